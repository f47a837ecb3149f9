package main

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
)

// simulationSeedsEnv names the variable that sets how many seeds
// TestSimulation runs; CI runs more than the default.
const simulationSeedsEnv = "RETRYSAFE_SIM_SEEDS"

// Ensure that, for every seed, a run of clients, workers, crashes, pauses,
// clock jumps and lost responses keeps every invariant after every step, and
// every promise to the clients once quiet. A failure prints the seed, the
// step and the trace; `retrysafe simulate --seed N` replays it.
func TestSimulation(t *testing.T) {
	seeds := 200
	if testing.Short() {
		seeds = 20
	}
	if v := os.Getenv(simulationSeedsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a number of seeds", simulationSeedsEnv, v)
		}
		seeds = n
	}
	if onPostgres() {
		// A schema per seed costs more than the run itself.
		seeds = min(seeds, 20)
	}
	ctx := context.Background()
	for seed := uint64(1); seed <= uint64(seeds); seed++ {
		report, err := simulateOnce(ctx, simOptions{seed: seed, steps: simulationSteps, path: simulationDatabase(t)})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if report.Failure != "" {
			t.Fatalf("seed %d failed at step %d: %s\nreplay: go run . simulate --seed %d --steps %d\n%s",
				seed, report.FailureStep, report.Failure, seed, simulationSteps, strings.Join(report.Trace, "\n"))
		}
	}
}

// Ensure a seed gives the same run twice, byte for byte.
func TestSimulationIsDeterministic(t *testing.T) {
	ctx := context.Background()
	var traces [2]string
	for i := range traces {
		report, err := simulateOnce(ctx, simOptions{seed: 42, steps: simulationSteps, path: simulationDatabase(t)})
		if err != nil {
			t.Fatal(err)
		}
		traces[i] = strings.Join(report.Trace, "\n")
	}
	if traces[0] != traces[1] {
		t.Fatalf("seed 42 ran differently twice:\n%s\n\n%s", traces[0], traces[1])
	}
}

// simulationDatabase returns a new database for one simulated run: a
// SQLite file, or with RETRYSAFE_TEST_POSTGRES a PostgreSQL schema (the
// simulator runs one coroutine at a time and never waits inside a
// transaction, so it is as deterministic there).
func simulationDatabase(tb testing.TB) string {
	tb.Helper()
	return testDatabase(tb)
}
