package main

import (
	"context"
	"database/sql"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// simulationSeedsEnv names the variable that sets how many seeds
// TestSimulation runs; CI runs 2000 (.ci/run).
const simulationSeedsEnv = "RETRYSAFE_SIM_SEEDS"

// defaultSimulationSeeds is how many seeds go test ./... runs: a short run
// (a few seconds) that keeps the simulator working in the learner's loop of
// changing one line and running the tests. Finding a new fault takes
// thousands of seeds, which CI runs.
const defaultSimulationSeeds = 20

// Ensure that, for every seed, a run of clients, workers, crashes, pauses,
// clock jumps and lost responses keeps every invariant after every step, and
// every promise to the clients once quiet. A failure prints the seed, the
// step and the trace; `retrysafe simulate --seed N` replays it.
func TestSimulation(t *testing.T) {
	seeds := defaultSimulationSeeds
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

// Ensure the simulated network does what the simulator claims: while the
// database is down every call fails as unavailable and a transaction it
// cuts short leaves nothing; a lost commit is committed although its
// caller got an error; once the outage ends the App works again.
func TestSimulatedOutage(t *testing.T) {
	ctx := context.Background()
	network, db, _ := openSimTestDatabase(t)
	count := func() int {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM scratch`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	insert := func(tx *sql.Tx, key string) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO scratch (k) VALUES (?)`, key)
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE scratch (k TEXT)`); err != nil {
		t.Fatal(err)
	}

	err := withTx(ctx, db, func(tx *sql.Tx) error {
		if err := insert(tx, "cut-short"); err != nil {
			return err
		}
		network.down = true
		return insert(tx, "cut-short-2")
	})
	if !isDatabaseUnavailable(err) {
		t.Fatalf("a transaction cut short by an outage returned %v, want an unavailable database", err)
	}
	if _, err := db.ExecContext(ctx, `SELECT 1`); !isDatabaseUnavailable(err) {
		t.Fatalf("a statement during the outage returned %v, want an unavailable database", err)
	}
	network.down = false
	if n := count(); n != 0 {
		t.Fatalf("the transaction cut short left %d rows, want 0", n)
	}

	network.loseCommit = true
	err = withTx(ctx, db, func(tx *sql.Tx) error { return insert(tx, "lost-answer") })
	if !isDatabaseUnavailable(err) || !network.down {
		t.Fatalf("a lost commit returned %v (database down: %v), want an unavailable database, and down", err, network.down)
	}
	network.down = false
	if n := count(); n != 1 {
		t.Fatalf("the commit whose answer was lost left %d rows, want 1: it landed", n)
	}
}

// Ensure a create whose commit landed while its answer was lost is answered
// 503 without claiming that nothing was stored, and that the retry the 503
// asks for, under the same key, answers with the order that was made.
func TestLostCommitAnswerIsLearnedByRetry(t *testing.T) {
	ctx := context.Background()
	network, db, readers := openSimTestDatabase(t)
	app := newApp(db, newFakeClock(time.Date(2026, 1, 5, 9, 0, 0, 0, time.UTC)).now, nil, nil)
	app.readDB = readers
	handler := (&server{app: app, apiKeys: map[string]string{keyUser42: "user-42"},
		logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).routes()
	post := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", "/api/orders", strings.NewReader(orderBody(5000, "sku-1", 1, pmCardVisa)))
		req.Header.Set("Authorization", "Bearer "+keyUser42)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "lost-answer")
		recorder := httptest.NewRecorder()
		handler.ServeHTTP(recorder, req)
		return recorder
	}

	network.loseCommit = true
	lost := post()
	if lost.Code != http.StatusServiceUnavailable {
		t.Fatalf("a create whose commit's answer was lost got %d %s, want 503", lost.Code, lost.Body)
	}
	if strings.Contains(lost.Body.String(), "no outcome was stored") || !strings.Contains(lost.Body.String(), "may") {
		t.Fatalf("the 503 says %s; after a lost commit answer the request may have taken effect, and it must say so", lost.Body)
	}
	network.down = false
	retry := post()
	var orders int
	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&orders); err != nil {
		t.Fatal(err)
	}
	if retry.Code != http.StatusCreated || retry.Header().Get("Idempotent-Replayed") != "true" || orders != 1 {
		t.Fatalf("the retry got %d %s (replayed %q) with %d orders; want the replayed 201 of the one order the lost commit made",
			retry.Code, retry.Body, retry.Header().Get("Idempotent-Replayed"), orders)
	}
}

// openSimTestDatabase opens a new database through a simulated network,
// closed when the test ends.
func openSimTestDatabase(t *testing.T) (*simDatabase, *sql.DB, *sql.DB) {
	t.Helper()
	network := &simDatabase{}
	db, readers, err := openSimDatabase(context.Background(), filepath.Join(t.TempDir(), "sim.db"), network)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		readers.Close()
		db.Close()
	})
	return network, db, readers
}
