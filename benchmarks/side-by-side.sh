#!/usr/bin/env bash
# One side-by-side run for BENCHMARKS.md: the peers (the article's Python
# sample and River on SQLite), then retrysafe's benchmarks for the same
# work, on one machine, one after the other, with nothing else running.
#
#   benchmarks/side-by-side.sh PEERS_DIR
#
# PEERS_DIR holds the peers, their run.sh and sqlite-ceiling. With RETRYSAFE_TEST_POSTGRES
# and RETRYSAFE_TEST_NATS set, the end-to-end benchmark runs on PostgreSQL
# + NATS too. Output goes to benchmarks/side-by-side.txt.
set -euo pipefail
peers=${1:?usage: benchmarks/side-by-side.sh PEERS_DIR}
peers=$(cd "$peers" && pwd)
cd "$(dirname "$0")/.."
out=benchmarks/side-by-side.txt
{
	echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), $(go version), $(nproc) CPUs"
	echo "## peers"
	"$peers/run.sh" 3000 2>&1 | grep -v '^go: downloading'
	echo "## what the driver allows (sqlite-ceiling)"
	(cd "$peers/sqlite-ceiling" && go run .) 2>&1 | grep -v '^go: downloading'
	echo "## retrysafe, SQLite"
	RETRYSAFE_TEST_POSTGRES= RETRYSAFE_TEST_NATS= go test -run '^$' \
		-bench 'CreateOrder/(normal|full)/(atomic|bare)$|^BenchmarkReplay$|ReplayHTTP|BenchmarkHTTP/' \
		-benchtime 3000x -count 3 -timeout 30m .
	RETRYSAFE_TEST_POSTGRES= RETRYSAFE_TEST_NATS= go test -run '^$' -bench 'EndToEnd' \
		-benchtime 2000x -count 3 -timeout 30m .
	if [ -n "${RETRYSAFE_TEST_POSTGRES:-}" ]; then
		echo "## retrysafe, PostgreSQL${RETRYSAFE_TEST_NATS:+ + NATS}"
		go test -run '^$' -bench 'EndToEnd' -benchtime 1000x -count 1 -timeout 30m .
	fi
} 2>&1 | tee "$out"
