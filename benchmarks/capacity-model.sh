#!/bin/sh
# capacity-model.sh derives the capacity model of docs/capacity.md from the
# output of BenchmarkEndToEnd on PostgreSQL and NATS (the per-order costs it
# reports), and checks it: the 2- and 3-process runs predicted from the
# 1-process run's cost per order and the fixed cost of a process, fitted on
# clients-8-processes-2.
#
#   benchmarks/capacity-model.sh benchmarks/postgres-capacity.txt [cores] [process-cost]
#
# cores is the machine's (nproc by default); process-cost, in cores, is the
# fixed cost of a process beyond the first, to check a run against the one
# it was fitted on (fitted on this run's clients-8-processes-2 by default).
set -eu
file=${1:?usage: capacity-model.sh BENCH_OUTPUT [cores]}
cores=${2:-$(nproc)}
awk -v cores="$cores" -v given="${3:-}" '
/^BenchmarkEndToEnd\/.*ns\/op/ {
	name = $1; sub(/^BenchmarkEndToEnd\//, "", name); sub(/-[0-9]+$/, "", name)
	for (i = 5; i < NF; i += 2) m[name, $(i + 1)] = $i
	names[++n] = name
}
function cost(r) { return m[r, "pg-cpu-ms/order"] + m[r, "nats-cpu-ms/order"] + m[r, "app-cpu-ms/order"] }
function avail(r) { return cores - m[r, "other-cpu-cores"] }
END {
	printf "%-32s %8s %8s %8s %8s %9s %9s %8s %7s\n", "run", "pg ms", "nats ms", "app ms", "all ms", "wal B", "orders/s", "cores", "idle"
	for (k = 1; k <= n; k++) {
		r = names[k]
		printf "%-32s %8.2f %8.2f %8.2f %8.2f %9.0f %9.1f %8.2f %7.2f\n", r, m[r, "pg-cpu-ms/order"], m[r, "nats-cpu-ms/order"],
			m[r, "app-cpu-ms/order"], cost(r), m[r, "wal-bytes/order"], m[r, "orders/s"], avail(r), avail(r) - m[r, "orders/s"] * cost(r) / 1000
	}
	base = "clients-8"
	if (!((base, "orders/s") in m)) exit
	printf "\none core carries (from %s): PostgreSQL %.0f, NATS %.0f, our process at least %.0f orders/s\n", base,
		1000 / m[base, "pg-cpu-ms/order"], 1000 / m[base, "nats-cpu-ms/order"], 1000 / m[base, "app-cpu-ms/order"]
	two = base "-processes-2"
	if (!((two, "orders/s") in m)) exit
	# The CPU the 2-process run used beyond its orders at the 1-process cost.
	f = m[two, "orders/s"] * (cost(two) - cost(base)) / 1000
	printf "a process beyond the first costs %.3f cores (fitted on %s)\n", f, two
	if (given != "") {
		f = given
		printf "the predictions take the given %.3f cores\n", f
	}
	printf "\n"
	printf "%-32s %8s %14s %14s %9s %7s\n", "run", "cores", "cost alone", "with process", "measured", "off by"
	for (k = 1; k <= n; k++) {
		r = names[k]
		if (r !~ /processes-/) continue
		p = r; sub(/.*processes-/, "", p); sub(/-.*/, "", p)
		b = base; if (r ~ /skus-16/) b = base "-skus-16"
		alone = avail(r) / cost(b) * 1000
		with = (avail(r) - (p - 1) * f) / cost(b) * 1000
		printf "%-32s %8.2f %14.1f %14.1f %9.1f %+6.0f%%\n", r, avail(r), alone, with, m[r, "orders/s"], (with / m[r, "orders/s"] - 1) * 100
	}
}' "$file"
