package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// simulationSeedsEnv names the variable that sets how many seeds
// TestSimulation runs; CI runs 2000 (.ci/run).
const simulationSeedsEnv = "RETRYSAFE_SIM_SEEDS"

// simulationSeedsPostgresEnv sets how many seeds TestSimulation runs when
// RETRYSAFE_TEST_POSTGRES is set. A schema per seed, and a server that
// answers over a socket, make a seed cost about ten times what it does on
// SQLite, so the default is small; CI runs a few hundred.
const simulationSeedsPostgresEnv = "RETRYSAFE_SIM_SEEDS_POSTGRES"

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
	seedsEnv := simulationSeedsEnv
	if onPostgres() {
		seeds, seedsEnv = 5, simulationSeedsPostgresEnv
	}
	if v := os.Getenv(seedsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a number of seeds", seedsEnv, v)
		}
		seeds = n
	}
	// On SQLite a seed runs one coroutine at a time and never waits: alone
	// it keeps one core busy. Seeds side by side, each in a file of its
	// own, run as they would alone (the same trace, byte for byte), so one
	// runs per core, and CI's 2000 take half the time on two cores.
	workers := runtime.GOMAXPROCS(0)
	if onPostgres() {
		workers = simulationPostgresWorkers
	}
	reports, err := simulateSeeds(context.Background(), seeds, workers)
	if err != nil {
		t.Fatal(err)
	}
	var total simCounts
	for _, report := range reports {
		if report.Failure != "" {
			t.Fatalf("seed %d failed at step %d: %s\nreplay: %s\n%s",
				report.Seed, report.FailureStep, report.Failure, simulationReplay(report.Seed), strings.Join(report.Trace, "\n"))
		}
		total.add(report.Counts)
	}
	t.Logf("%d seeds: %d requests, %d crashes, %d database outages, %d lost commit answers%s",
		seeds, total.Requests, total.Crashes, total.Outages, total.LostCommits, total.summary(onPostgres()))
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.AbandonedRefunds == 0 {
		// Left to chance, no run has a refund cut off between its key's
		// claim and its settling that is finished a day later.
		t.Errorf("in %d seeds no refund was abandoned mid-call and asked for again a day later", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.FrozenSagaWorkers == 0 {
		t.Errorf("in %d seeds no saga worker was frozen past its lease while another took its sagas over", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && (total.ProcessorSilent == 0 || total.BusyStatements == 0) {
		t.Errorf("in %d seeds the processor left %d retrieves unanswered and the database failed %d statements of a consumer's effect busy, want some of each",
			seeds, total.ProcessorSilent, total.BusyStatements)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.BusyCreates == 0 {
		t.Errorf("in %d seeds the database never failed a create's statement busy inside a group commit", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.LostAfterOneApplied == 0 {
		t.Errorf("in %d seeds the broker never lost a message for one consumer of OrderCreated after the other applied it", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.PoisonReplayedBeforeAck == 0 {
		t.Errorf("in %d seeds no poison message was replayed before its consumer's ack", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.SharedKeys == 0 {
		t.Errorf("in %d seeds no user sent a key string another user had sent", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds && total.ReplaysToEvery == 0 {
		t.Errorf("in %d seeds no replay reached every consumer of its subject", seeds)
	}
	if !onPostgres() && seeds >= defaultSimulationSeeds {
		// The boundaries, the poison and the outbox's order structures:
		// each reached in the first seeds, so that an oracle that can no
		// longer fail shows.
		for _, reached := range []struct {
			what string
			n    int
		}{
			{"orders of the last units of " + lastSKU, total.LastStockOrders},
			{"retries at a key's expiry or a microsecond before", total.ExpiryProbes},
			{"retries of a create whose transaction spanned a clock move", total.ClockMovedProbes},
			{"webhooks signed beyond the tolerance", total.StaleSignatures},
			{"events signed off our clock within the tolerance", total.SkewedSignatures},
			{"refunds given up on after a processor timeout", total.GaveUpRefunds},
			{"events of a real refund with another amount", total.MismatchedAmounts},
			{"messages failed at every delivery until poison", total.PoisonAtThreshold},
			{"replays checked back in flight", total.ReplaysInFlight},
			{"sweeps of the reconciler checked", total.SweepsChecked},
			{"refusals of an order's refund event while the order was refunded again", total.RefusedPublishes},
			{"sagas failed as often as a compensation may while cut off from the processor", total.SagasWornOut},
		} {
			if reached.n == 0 {
				t.Errorf("in %d seeds the simulator made no %s", seeds, reached.what)
			}
		}
	}
	// About one seed in a hundred builds the week an operator is away
	// and then replays to every consumer: CI's thousands must reach it.
	if !onPostgres() && seeds >= 50*defaultSimulationSeeds && total.ReplaysForgotten == 0 {
		t.Errorf("in %d seeds no replay reached a consumer whose inbox had forgotten the message", seeds)
	}
	if !onPostgres() && seeds >= 50*defaultSimulationSeeds && total.ReplaysLost == 0 {
		t.Errorf("in %d seeds the broker lost no replay", seeds)
	}
	// About two seeds in a hundred undo a charge while the saga workers
	// cannot reach the processor, until the compensation gives up.
	if !onPostgres() && seeds >= 50*defaultSimulationSeeds && total.CompensationsCutOff == 0 {
		t.Errorf("in %d seeds no compensation failed %d times in a row cut off from the processor", seeds, maxCompensationAttempts)
	}
}

// Ensure the seeds that once failed on a fault of the simulator itself
// pass: 1779, whose catch-up of the workers (a calm hour, nothing failing)
// met a commit fault armed in an earlier transaction that had ended
// without committing; 686, where a client sent a create again under a key
// that had expired since its last answer, the connection dropped while
// its process's group commit still committed the new order, and the
// client, holding an answer from the key's earlier life, never asked
// again (a dropped send is now asked again once quiet, answered before or
// not); 695, where a create was refused 422 for a key its user's refund
// held, paused at refund.after_key_claim, the refund was then refused as
// too early (which leaves nothing under the key), and the same create
// got its 201 (a reuse refusal binds the key's answer only while the
// request that held it stands); 404, a relay paused a week between its
// publish and its record (the published-in-broker check asks what the
// broker acknowledged, not what it still holds); 375, where cleanup deleted the broker's copy of a
// replay the broker had lost (a lost replay counts as lost there); 88,
// where a refund refused as reused, because a create held its key, was
// retried once quiet after the create's key had expired and got its
// order's answer (a refusal as reused binds only while the holder
// certainly holds the key).
func TestSimulationSeedsThatFailedTheSimulator(t *testing.T) {
	if onPostgres() {
		t.Skip("these seeds are SQLite's runs")
	}
	for _, seed := range []uint64{1779, 686, 695, 404, 375, 88} {
		path, remove, err := simulationDatabase()
		if err != nil {
			t.Fatal(err)
		}
		report, err := simulateOnce(context.Background(), simOptions{seed: seed, steps: simulationSteps, path: path})
		if rerr := remove(); rerr != nil && err == nil {
			err = rerr
		}
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if report.Failure != "" {
			t.Fatalf("seed %d failed at step %d: %s\nreplay: %s", seed, report.FailureStep, report.Failure, simulationReplay(seed))
		}
	}
}

// longSimulationRuns are the long runs CI adds to TestSimulation's
// thousands of short ones (with RETRYSAFE_SIM_SEEDS set): what happens
// only after hundreds of steps, a week-long clock jump between two steps
// of one pass, rows that cleanup deletes a week on, a repair of what a
// long broken stretch set aside. Each once failed; a few seconds each.
var longSimulationRuns = []struct {
	seed  uint64
	steps int
	why   string
}{
	{2, 2000, "a relay paused 168 h at outbox.after_publish recorded events whose broker copies cleanup had deleted meanwhile, " +
		"and the published-in-broker check took them for events the broker never had"},
	{9, 2000, "an operator's refund finish, run again after its terminal died, finished a key the first run had left " +
		"to a request that took it over, and the check counted that key repaired twice"},
}

// Ensure the long runs that once failed pass (longSimulationRuns). Only
// with RETRYSAFE_SIM_SEEDS set, as in CI: go test ./... stays quick.
func TestSimulationLongRuns(t *testing.T) {
	if os.Getenv(simulationSeedsEnv) == "" {
		t.Skipf("set %s to run the simulator's long runs too (seconds each)", simulationSeedsEnv)
	}
	if onPostgres() {
		t.Skip("these are SQLite's runs")
	}
	for _, run := range longSimulationRuns {
		path, remove, err := simulationDatabase()
		if err != nil {
			t.Fatal(err)
		}
		report, err := simulateOnce(context.Background(), simOptions{seed: run.seed, steps: run.steps, path: path})
		if rerr := remove(); rerr != nil && err == nil {
			err = rerr
		}
		if err != nil {
			t.Fatalf("seed %d: %v", run.seed, err)
		}
		if report.Failure != "" {
			t.Fatalf("seed %d of %d steps (once: %s) failed at step %d: %s\nreplay: go run . simulate --seed %d --steps %d --trace",
				run.seed, run.steps, run.why, report.FailureStep, report.Failure, run.seed, run.steps)
		}
	}
}

// Ensure the simulated processor stops redelivering an event once it was
// received and its retry window has passed, and never gives up on one it
// could not deliver: a redelivery a week later would find the inbox's
// record of it cleaned up, which no processor does.
func TestSimulatedProcessorGivesUpAfterItsRetryWindow(t *testing.T) {
	s := &simulation{clock: newFakeClock(time.Date(2026, 1, 5, 9, 0, 0, 0, time.UTC))}
	applied := simAnswer{status: http.StatusOK, body: `{"received":true,"outcome":"applied"}`}
	unavailable := simAnswer{status: http.StatusServiceUnavailable, body: `{"status":503}`}
	received := &simRequest{kind: "webhook", sends: 2, firstSentAt: s.clock.now(), answers: []simAnswer{applied, unavailable}}
	neverReceived := &simRequest{kind: "webhook", sends: 1, firstSentAt: s.clock.now(), answers: []simAnswer{unavailable}}
	if s.processorGaveUp(received) || s.processorGaveUp(neverReceived) {
		t.Fatal("the processor gave up on an event within its retry window")
	}
	s.clock.advance(processorRetryWindow)
	if !s.processorGaveUp(received) {
		t.Error("the processor still redelivers an event it delivered, past its retry window")
	}
	if s.processorGaveUp(neverReceived) {
		t.Error("the processor gave up on an event it never delivered")
	}
}

// Ensure a key stays taken while a request under it is in doubt: a create
// under it refused as reused is right however long ago the key's other
// answers were while a refund under it is unfinished (an unfinished key
// never expires), and for a day after a send whose connection dropped.
func TestSimulatedRequestInDoubtHoldsItsKey(t *testing.T) {
	now := time.Date(2026, 1, 5, 9, 0, 0, 0, time.UTC)
	client := &simClient{name: "c1", user: "user-42"}
	create := &simRequest{client: client, kind: "create", key: "k1", sends: 1, answers: []simAnswer{{status: http.StatusCreated}}}
	refund := &simRequest{client: client, kind: "refund", key: "k1", sends: 1, lastEnd: now,
		answers: []simAnswer{{status: http.StatusServiceUnavailable, body: `{"type":"/problems/temporarily-unavailable"}`}}}
	client.requests = []*simRequest{create, refund}
	if !heldInDoubt(client, "k1", create, now.Add(30*idempotencyKeyTTL)) {
		t.Error("a refund answered only 503 does not hold its key")
	}
	refund.answers = append(refund.answers, simAnswer{status: http.StatusOK, body: `{"refund_id":"rf_1"}`})
	refund.sends++
	if heldInDoubt(client, "k1", create, now) {
		t.Error("a refund answered 200 still holds its key")
	}
	dropped := &simRequest{client: client, kind: "create", key: "k1", sends: 1, lastEnd: now}
	client.requests = append(client.requests, dropped)
	if !heldInDoubt(client, "k1", create, now.Add(idempotencyKeyTTL-time.Second)) {
		t.Error("a create whose connection dropped does not hold its key for a day")
	}
	if heldInDoubt(client, "k1", create, now.Add(idempotencyKeyTTL)) {
		t.Error("a create whose connection dropped holds its key past a day")
	}
}

// simulationPostgresWorkers is how many seeds TestSimulation runs at once on
// PostgreSQL. A run there spends most of its time waiting for the server (a
// round trip per statement, and the in-flight audit's queries after every
// step), so runs of different seeds, each alone in its schema and each as
// deterministic as it is alone, overlap well even on two cores.
const simulationPostgresWorkers = 4

// simulateSeeds runs seeds 1 to seeds, workers at a time, each on a new
// database, and returns the reports of those that ran, in seed order. Once
// a seed fails no new one starts; the seeds already running end their
// runs, so the first failure among the reports is the lowest failing seed
// of those that ran. It returns an error if a run could not start or its
// database could not be removed.
func simulateSeeds(ctx context.Context, seeds, workers int) ([]simReport, error) {
	reports := make([]simReport, seeds)
	errs := make([]error, seeds)
	var failed atomic.Bool
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		// Each worker returns once next is closed.
		wg.Go(func() {
			for i := range next {
				path, remove, err := simulationDatabase()
				if err != nil {
					errs[i] = err
					failed.Store(true)
					continue
				}
				reports[i], errs[i] = simulateOnce(ctx, simOptions{seed: uint64(i + 1), steps: simulationSteps, path: path})
				if err := remove(); err != nil && errs[i] == nil {
					errs[i] = err
				}
				if errs[i] != nil || reports[i].Failure != "" {
					failed.Store(true)
				}
			}
		})
	}
	// Seeds are handed out in order and every seed handed out runs to its
	// end, so those that ran are 1 to ran.
	ran := 0
	for ; ran < seeds && !failed.Load(); ran++ {
		next <- ran
	}
	close(next)
	wg.Wait()
	for i := range ran {
		if errs[i] != nil {
			return nil, fmt.Errorf("seed %d: %w", i+1, errs[i])
		}
	}
	return reports[:ran], nil
}

// simulationReplay is the command that replays seed: on PostgreSQL, into
// an empty database the command names.
func simulationReplay(seed uint64) string {
	if onPostgres() {
		return fmt.Sprintf("createdb sim%d && go run . simulate --seed %d --steps %d --trace --db postgres://.../sim%d",
			seed, seed, simulationSteps, seed)
	}
	return fmt.Sprintf("go run . simulate --seed %d --steps %d --trace", seed, simulationSteps)
}

// Ensure a seed gives the same run twice, byte for byte, and the same again
// when it runs beside another seed, as TestSimulation runs them on SQLite.
func TestSimulationIsDeterministic(t *testing.T) {
	ctx := context.Background()
	run := func(seed uint64) (string, error) {
		path, remove, err := simulationDatabase()
		if err != nil {
			return "", err
		}
		report, err := simulateOnce(ctx, simOptions{seed: seed, steps: simulationSteps, path: path})
		if rerr := remove(); rerr != nil && err == nil {
			err = rerr
		}
		return strings.Join(report.Trace, "\n"), err
	}
	alone, err := run(42)
	if err != nil {
		t.Fatal(err)
	}
	again, err := run(42)
	if err != nil {
		t.Fatal(err)
	}
	if again != alone {
		t.Fatalf("seed 42 ran differently twice:\n%s\n\n%s", alone, again)
	}
	// Seed 42 twice at once: the same ids, each run in a database of its
	// own; anything the two shared would show in the traces.
	var besides [2]string
	var errs [2]error
	var wg sync.WaitGroup
	for i := range besides {
		wg.Go(func() { besides[i], errs[i] = run(42) })
	}
	wg.Wait()
	for i, beside := range besides {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if beside != alone {
			t.Fatalf("seed 42 ran differently beside another run:\n%s\n\n%s", alone, beside)
		}
	}
}

// simulationDatabase returns a new database for one simulated run, and a
// function that removes it once the run is over: "" for a temporary SQLite
// file (simulateOnce removes it), or with RETRYSAFE_TEST_POSTGRES a
// PostgreSQL schema (the simulator runs one coroutine at a time and never
// waits inside a transaction, so it is as deterministic there). Its
// connections do not wait for the WAL to reach the disk
// (synchronous_commit=off): the simulator never crashes the server, and an
// fsync per commit on a shared CI machine made a seed cost seconds.
func simulationDatabase() (string, func() error, error) {
	base := os.Getenv(testPostgresEnv)
	if base == "" {
		return "", func() error { return nil }, nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return "", nil, fmt.Errorf("%s: %w", testPostgresEnv, err)
	}
	query := u.Query()
	query.Set("synchronous_commit", "off")
	u.RawQuery = query.Encode()
	schemaURL, drop, err := createTestSchema(u.String())
	if err != nil {
		return "", nil, fmt.Errorf("%s: %w", testPostgresEnv, err)
	}
	return schemaURL, drop, nil
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

// Ensure the simulator's PostgreSQL faults do what it claims, on a real
// server: a backend terminated mid-transaction leaves nothing and is
// reported as an unavailable database; a serialization failure or a
// deadlock, at a statement or at COMMIT, is retried by withTx and leaves
// the transaction's rows once; a commit whose answer is lost is committed
// although its caller got an unavailable database; and the pool works on
// afterwards.
func TestSimulatedPostgresFaults(t *testing.T) {
	if !onPostgres() {
		t.Skipf("set %s to run the simulator's PostgreSQL faults against a server", testPostgresEnv)
	}
	ctx := context.Background()
	rawURL := testDatabase(t)
	direct, err := openPostgres(ctx, rawURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { direct.Close() })
	config, err := pgx.ParseConfig(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	// Each call of draw takes the next fault of script: one per statement
	// of a transaction, and one per COMMIT.
	var script []postgresFault
	draw := func(commit bool) postgresFault {
		if len(script) == 0 {
			return postgresNoFault
		}
		fault := script[0]
		script = script[1:]
		return fault
	}
	s := &simulation{direct: direct}
	db := s.openPostgresPool(rebindConnector{stdlib.GetConnector(*config)}, &simDatabase{}, draw)
	t.Cleanup(func() { db.Close() })
	if _, err := direct.ExecContext(ctx, `CREATE TABLE scratch (k TEXT)`); err != nil {
		t.Fatal(err)
	}
	count := func(key string) int {
		t.Helper()
		var n int
		if err := direct.QueryRowContext(ctx, `SELECT COUNT(*) FROM scratch WHERE k = ?`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// insertTwo writes two rows under key in one transaction (begun by
	// begin), and returns how many times it ran.
	insertTwo := func(begin func(context.Context, *sql.DB, func(*sql.Tx) error) error, key string) (int, error) {
		runs := 0
		err := begin(ctx, db, func(tx *sql.Tx) error {
			runs++
			for range 2 {
				if _, err := tx.ExecContext(ctx, `INSERT INTO scratch (k) VALUES (?)`, key); err != nil {
					return err
				}
			}
			return nil
		})
		return runs, err
	}

	script = []postgresFault{postgresNoFault, postgresTerminate}
	if _, err := insertTwo(withTx, "terminated"); !errors.Is(err, errSimTerminated) || !isDatabaseUnavailable(err) {
		t.Fatalf("a transaction whose backend was terminated returned %v, want %v", err, errSimTerminated)
	}
	script = []postgresFault{postgresNoFault, postgresNoFault, postgresTerminate}
	if _, err := insertTwo(withTx, "terminated-at-commit"); !errors.Is(err, errSimTerminated) {
		t.Fatalf("a transaction whose backend was terminated before COMMIT returned %v, want %v", err, errSimTerminated)
	}
	if n := count("terminated") + count("terminated-at-commit"); n != 0 || s.report.Counts.Terminations != 2 {
		t.Fatalf("terminated transactions left %d rows (%d terminations counted), want 0 rows and 2", n, s.report.Counts.Terminations)
	}

	for _, tc := range []struct {
		name   string
		begin  func(context.Context, *sql.DB, func(*sql.Tx) error) error
		script []postgresFault
	}{
		{"serialization-failure", withTx, []postgresFault{postgresConflict}},
		{"serialization-failure-at-commit", withTx, []postgresFault{postgresNoFault, postgresNoFault, postgresConflict}},
		{"deadlock", withClaimTx, []postgresFault{postgresNoFault, postgresConflict}},
	} {
		script = tc.script
		runs, err := insertTwo(tc.begin, tc.name)
		if err != nil || runs != 2 || count(tc.name) != 2 {
			t.Fatalf("%s: got %v after %d runs, %d rows; want the transaction run again, once, and its 2 rows", tc.name, err, runs, count(tc.name))
		}
	}
	if c := s.report.Counts; c.SerializationFailures != 2 || c.Deadlocks != 1 {
		t.Fatalf("counted %d serialization failures and %d deadlocks, want 2 and 1", c.SerializationFailures, c.Deadlocks)
	}

	script = []postgresFault{postgresNoFault, postgresNoFault, postgresLoseCommit}
	runs, err := insertTwo(withTx, "lost-answer")
	if !isDatabaseUnavailable(err) || runs != 1 || count("lost-answer") != 2 || s.report.Counts.LostCommits != 1 {
		t.Fatalf("a commit whose answer was lost returned %v after %d runs, with %d rows (%d counted); want an unavailable database, 1 run, the 2 rows it committed, 1 counted",
			err, runs, count("lost-answer"), s.report.Counts.LostCommits)
	}

	// A statement on its own is a transaction of its own, and database/sql
	// must not run it again on another connection.
	insertOne := func(key string) error {
		_, err := db.ExecContext(ctx, `INSERT INTO scratch (k) VALUES (?)`, key)
		return err
	}
	script = []postgresFault{postgresTerminate}
	if err := insertOne("alone-terminated"); !errors.Is(err, errSimTerminated) || count("alone-terminated") != 0 {
		t.Fatalf("a statement whose backend was terminated returned %v with %d rows, want %v and 0 rows",
			err, count("alone-terminated"), errSimTerminated)
	}
	script = []postgresFault{postgresLoseCommit}
	if err := insertOne("alone-lost"); !isDatabaseUnavailable(err) || count("alone-lost") != 1 || s.report.Counts.LostCommits != 2 {
		t.Fatalf("a statement whose answer was lost returned %v with %d rows (%d lost commits counted); want an unavailable database, the 1 row it committed, 2 counted",
			err, count("alone-lost"), s.report.Counts.LostCommits)
	}

	if _, err := insertTwo(withTx, "after"); err != nil || count("after") != 2 {
		t.Fatalf("after the faults the pool returned %v with %d rows, want the 2 rows", err, count("after"))
	}
}
