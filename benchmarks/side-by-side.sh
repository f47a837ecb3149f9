#!/usr/bin/env bash
# One side-by-side run for BENCHMARKS.md: the peers (the article's Python
# sample and River on SQLite), what the driver allows, then retrysafe's
# benchmarks for the same work, on one machine, one after the other, with
# nothing else running.
#
#   benchmarks/side-by-side.sh PEERS_DIR [BEFORE_DIR]
#
# PEERS_DIR holds the peers, their run.sh and sqlite-ceiling. BEFORE_DIR,
# if given, is another checkout of retrysafe (say, `git worktree add
# ../before COMMIT`): each group of benchmarks then runs there and here,
# one right after the other, so before and after come from one run. With
# RETRYSAFE_TEST_POSTGRES and RETRYSAFE_TEST_NATS set, the end-to-end
# benchmark runs on PostgreSQL + NATS too, and then three rounds of DBOS
# (the dbos-pg peer) and ours one after the other, at 8 and 64 clients. Output goes to
# benchmarks/side-by-side.txt.
set -euo pipefail
peers=${1:?usage: benchmarks/side-by-side.sh PEERS_DIR [BEFORE_DIR]}
peers=$(cd "$peers" && pwd)
before=${2:-}
if [ -n "$before" ]; then
	before=$(cd "$before" && pwd)
fi
cd "$(dirname "$0")/.."
here=$(pwd)
out=benchmarks/side-by-side.txt

# trees prints the checkouts to run, before first, each with its label.
trees() {
	if [ -n "$before" ]; then
		echo "$before before $(git -C "$before" rev-parse --short HEAD)"
	fi
	echo "$here after $(git rev-parse --short HEAD)"
}

# each runs its arguments as a go test command in every checkout.
each() {
	local group=$1
	shift
	trees | while read -r dir label commit; do
		echo "## retrysafe $label ($commit), $group"
		(cd "$dir" && "$@")
	done
}

{
	echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), $(go version), $(nproc) CPUs"
	echo "## peers"
	"$peers/run.sh" 3000 2>&1 | grep -v '^go: downloading'
	echo "## what the driver allows (sqlite-ceiling)"
	(cd "$peers/sqlite-ceiling" && go run .) 2>&1 | grep -v '^go: downloading'
	each SQLite env RETRYSAFE_TEST_POSTGRES= RETRYSAFE_TEST_NATS= go test -run '^$' \
		-bench 'CreateOrder/(normal|full)/(atomic|bare)$|^BenchmarkReplay$|ReplayHTTP|BenchmarkHTTP/' \
		-benchtime 3000x -count 3 -timeout 30m .
	each "SQLite, end to end" env RETRYSAFE_TEST_POSTGRES= RETRYSAFE_TEST_NATS= go test -run '^$' -bench 'EndToEnd' \
		-benchtime 2000x -count 3 -timeout 30m .
	if [ -n "${RETRYSAFE_TEST_POSTGRES:-}" ]; then
		each "PostgreSQL${RETRYSAFE_TEST_NATS:+ + NATS}" go test -run '^$' -bench 'EndToEnd' -benchtime 1000x -count 1 -timeout 30m .
		# DBOS on the same PostgreSQL, alternating with ours: the same
		# clients, 16 SKUs on both sides, three rounds, so that the drift
		# of the machine falls on both alike. Compare the median ratio.
		for round in 1 2 3; do
			for clients in 8 64; do
				echo "## DBOS, $clients clients, round $round"
				(cd "$peers/dbos-pg" && go run . -db 'postgres://postgres@127.0.0.1:5432/dbos_bench?sslmode=disable' \
					-orders 2000 -clients "$clients" -skus 16 2>/dev/null | grep -E '^(dbos|check)')
				echo "## retrysafe $(git rev-parse --short HEAD), $clients clients, round $round"
				go test -run '^$' -bench "EndToEnd/clients-$clients-skus-16\$" -benchtime 2000x -count 1 -timeout 30m . |
					grep -E '^Benchmark'
			done
		done
	fi
} 2>&1 | tee "$out"
