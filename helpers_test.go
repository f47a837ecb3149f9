package main

import (
	"context"
	cryptorand "crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// testEnv is an App over a fresh database file, with a fake clock and a
// fault switch the test flips.
type testEnv struct {
	app   *App
	clock *fakeClock
	path  string
	fault *faultSwitch
	ids   func(string) string
}

// faultSwitch fails at one point, a given number of times.
type faultSwitch struct {
	mu        sync.Mutex
	point     faultPoint
	err       error
	remaining int
	// hits counts how often each point was passed, failing or not.
	hits map[faultPoint]int
	// decide, if set, is asked at every point instead: the Nth pass of a
	// point is hits[point] after counting this one.
	decide func(point faultPoint, pass int) error
	// decideCtx is decide with the context of the code at the point, for
	// tests that run two workers at once and tell them apart by a value
	// in their contexts (see withWorker).
	decideCtx func(ctx context.Context, point faultPoint, pass int) error
}

// workerKey is the context key withWorker sets.
type workerKey struct{}

// withWorker returns ctx marked as the context of the worker called name,
// so a fault hook can pause one worker and not the other.
func withWorker(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, workerKey{}, name)
}

// workerOf returns the name withWorker gave ctx, or "".
func workerOf(ctx context.Context) string {
	name, _ := ctx.Value(workerKey{}).(string)
	return name
}

// hook is the faultHook that the App calls.
func (f *faultSwitch) hook(ctx context.Context, point faultPoint) error {
	f.mu.Lock()
	f.hits[point]++
	pass, decide, decideCtx := f.hits[point], f.decide, f.decideCtx
	if decideCtx != nil {
		f.mu.Unlock()
		return decideCtx(ctx, point, pass)
	}
	if decide == nil && point == f.point && f.remaining > 0 {
		f.remaining--
		f.mu.Unlock()
		return f.err
	}
	f.mu.Unlock()
	// decide may itself run code that passes fault points: call it
	// without the lock.
	if decide != nil {
		return decide(point, pass)
	}
	return nil
}

// failAt makes the next times passes of point return err.
func (f *faultSwitch) failAt(point faultPoint, err error, times int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.point, f.err, f.remaining, f.decide, f.decideCtx = point, err, times, nil, nil
}

// set makes decide choose what every point does.
func (f *faultSwitch) set(decide func(point faultPoint, pass int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.decide = decide
}

// setCtx is set for a decideCtx.
func (f *faultSwitch) setCtx(decide func(ctx context.Context, point faultPoint, pass int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.decideCtx = decide
}

// crashAt makes the next pass of point crash.
func (f *faultSwitch) crashAt(point faultPoint) {
	f.failAt(point, errCrash, 1)
}

// hitCount returns how often point was passed.
func (f *faultSwitch) hitCount(point faultPoint) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hits[point]
}

// testPostgresEnv names the variable that runs the tests on PostgreSQL: the
// URL of a database in which they may create and drop schemas.
const testPostgresEnv = "RETRYSAFE_TEST_POSTGRES"

// testDatabase returns a new, empty database for tb: a file in tb's temp
// dir, or, when RETRYSAFE_TEST_POSTGRES is set, a schema of its own in that
// PostgreSQL database (the URL sets search_path), dropped when tb ends.
func testDatabase(tb testing.TB) string {
	tb.Helper()
	base := os.Getenv(testPostgresEnv)
	if base == "" {
		return filepath.Join(tb.TempDir(), "test.db")
	}
	return testPostgresSchema(tb, base)
}

// testPostgresSchema creates a schema in the PostgreSQL database at base and
// returns base with its search_path set to it. The schema is dropped when
// tb ends.
func testPostgresSchema(tb testing.TB, base string) string {
	tb.Helper()
	schemaURL, drop, err := createTestSchema(base)
	if err != nil {
		tb.Fatalf("%s: %v", testPostgresEnv, err)
	}
	// Registered before the App opens, so it runs after the App is closed.
	tb.Cleanup(func() {
		if err := drop(); err != nil {
			tb.Error(err)
		}
	})
	return schemaURL
}

// createTestSchema creates a schema with a random name in the PostgreSQL
// database at base. It returns base with its search_path set to the schema,
// and a function that drops the schema.
func createTestSchema(base string) (string, func() error, error) {
	ctx := context.Background()
	var random [6]byte
	if _, err := cryptorand.Read(random[:]); err != nil {
		return "", nil, fmt.Errorf("schema name: %w", err)
	}
	schema := "test_" + hex.EncodeToString(random[:])
	// schema is our own [a-z0-9_] name: safe to put in the statements.
	exec := func(statement string) error {
		admin, err := connectPostgres(ctx, base)
		if err != nil {
			return err
		}
		defer admin.Close()
		if _, err := admin.ExecContext(ctx, statement); err != nil {
			return fmt.Errorf("%s: %w", statement, err)
		}
		return nil
	}
	if err := exec(`CREATE SCHEMA ` + schema); err != nil {
		return "", nil, err
	}
	u, err := url.Parse(base)
	if err != nil {
		return "", nil, err
	}
	query := u.Query()
	query.Set("search_path", schema)
	u.RawQuery = query.Encode()
	return u.String(), func() error { return exec(`DROP SCHEMA ` + schema + ` CASCADE`) }, nil
}

// onPostgres reports whether the tests run on PostgreSQL.
func onPostgres() bool {
	return os.Getenv(testPostgresEnv) != ""
}

// MustOpenApp returns a testEnv over a new database (see testDatabase); it
// is closed when the test ends.
func MustOpenApp(tb testing.TB) *testEnv {
	tb.Helper()
	env := &testEnv{
		clock: newFakeClock(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)),
		path:  testDatabase(tb),
		fault: &faultSwitch{hits: map[faultPoint]int{}},
		ids:   newIDs(rand.NewChaCha8([32]byte{byte(len(tb.Name())), 't', 'e', 's', 't'})),
	}
	env.open(tb)
	return env
}

// open opens the App over env.path.
func (env *testEnv) open(tb testing.TB) {
	tb.Helper()
	app, err := openApp(context.Background(), env.path, env.clock.now, env.ids, env.fault.hook)
	if err != nil {
		tb.Fatalf("open app: %v", err)
	}
	env.app = app
	tb.Cleanup(func() { app.db.Close() })
}

// restart simulates a process dying and a new one starting on the same
// file: the database is closed (what was not committed is gone) and opened
// again; nothing in memory survives.
func (env *testEnv) restart(tb testing.TB) {
	tb.Helper()
	if err := env.app.db.Close(); err != nil {
		tb.Fatalf("close db: %v", err)
	}
	env.fault.failAt("", nil, 0)
	env.open(tb)
}

// count runs a query that returns one integer.
func (env *testEnv) count(tb testing.TB, query string, args ...any) int {
	tb.Helper()
	return queryInt(tb, env.app.db, query, args...)
}

// queryInt runs on db a query that returns one integer (a count, an
// integer pragma).
func queryInt(tb testing.TB, db *sql.DB, query string, args ...any) int {
	tb.Helper()
	var n int
	if err := db.QueryRow(query, args...).Scan(&n); err != nil {
		tb.Fatalf("%s: %v", query, err)
	}
	return n
}

// str runs a query that returns one string.
func (env *testEnv) str(tb testing.TB, query string, args ...any) string {
	tb.Helper()
	var s sql.NullString
	if err := env.app.db.QueryRow(query, args...).Scan(&s); err != nil {
		tb.Fatalf("%s: %v", query, err)
	}
	return s.String
}

// drain runs every worker until nothing is left to do, moving the clock past
// leases and backoffs when a pass finds nothing. It fails the test if the
// system does not settle.
func (env *testEnv) drain(tb testing.TB) {
	tb.Helper()
	ctx := context.Background()
	idle := 0
	for range 500 {
		n, err := env.app.runWorkersOnce(ctx, "test-worker")
		if err != nil {
			tb.Fatalf("workers: %v", err)
		}
		if n > 0 {
			idle = 0
			continue
		}
		idle++
		if idle == 3 {
			return
		}
		env.clock.advance(2 * time.Minute)
	}
	tb.Fatalf("the workers did not settle in 500 passes; left: %s", env.unsettled(tb))
}

// unsettled says what work is left in env's database, for a test that
// waited for the workers to finish it.
func (env *testEnv) unsettled(tb testing.TB) string {
	tb.Helper()
	return fmt.Sprintf("%d outbox events pending, %d deliveries pending, %d sagas running, %d keys unfinished",
		env.count(tb, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`),
		env.count(tb, `SELECT COUNT(*) FROM broker_deliveries WHERE status = 'pending'`),
		env.count(tb, `SELECT COUNT(*) FROM saga_instances WHERE status IN ('in_progress', 'compensating')`),
		env.count(tb, `SELECT COUNT(*) FROM idempotency_keys WHERE recovery_point <> 'finished'`))
}

// unkeyableID returns an id longer than PostgreSQL keys a b-tree on
// (2704 bytes): 3000 random letters, which no compression brings under.
func unkeyableID() string {
	random := rand.New(rand.NewPCG(1, 2))
	id := make([]byte, 3000)
	for i := range id {
		id[i] = 'a' + byte(random.IntN(26))
	}
	return string(id)
}

// orderBody is a valid create-order body.
func orderBody(amount int64, sku string, qty int, paymentMethod string) string {
	return fmt.Sprintf(`{"amount_cents":%d,"currency":"usd","items":[{"sku":%q,"qty":%d}],"payment_method":%q}`,
		amount, sku, qty, paymentMethod)
}

// Test API keys.
const (
	keyUser42         = "sk_test_a"
	keyUser7          = "sk_test_b"
	testWebhookSecret = "whsec_test"
)

// newTestAPI returns the API of env, with the test users' keys.
func newTestAPI(env *testEnv) *server {
	return &server{
		app:           env.app,
		apiKeys:       map[string]string{keyUser42: "user-42", keyUser7: "user-7"},
		webhookSecret: []byte(testWebhookSecret),
		logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// newTestServer serves env's API on a loopback port until the test ends.
func newTestServer(tb testing.TB, env *testEnv) *httptest.Server {
	tb.Helper()
	ts := httptest.NewServer(newTestAPI(env).routes())
	tb.Cleanup(ts.Close)
	return ts
}

// newUnwaitedTestServer serves env's API on a loopback port until the test
// ends, and returns its base URL. Unlike newTestServer it ends without
// waiting for its handlers (httptest.Server.Close waits for every request
// in flight): a test that finds requests hung must fail saying so, not
// hang in its cleanup.
func newUnwaitedTestServer(tb testing.TB, env *testEnv) string {
	tb.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	httpServer := &http.Server{Handler: newTestAPI(env).routes()}
	go httpServer.Serve(listener) // returns once Close closes the listener
	tb.Cleanup(func() { httpServer.Close() })
	return "http://" + listener.Addr().String()
}

// response is what a test client saw.
type response struct {
	Status int
	Header http.Header
	Body   string
}

// sendWith sends a JSON request to url with client, as the user of apiKey,
// under idempotencyKey. Unlike call it may run on any goroutine: it
// returns its failure.
func sendWith(client *http.Client, method, url, apiKey, idempotencyKey, body string) (response, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	req.Header.Set("Idempotency-Key", idempotencyKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: string(data)}, nil
}

// call sends a request with optional body, API key and idempotency key.
func call(tb testing.TB, ts *httptest.Server, method, path, apiKey, idempotencyKey, body string) response {
	tb.Helper()
	req, err := http.NewRequest(method, ts.URL+path, strings.NewReader(body))
	if err != nil {
		tb.Fatalf("new request: %v", err)
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if idempotencyKey != "" {
		req.Header.Set("Idempotency-Key", idempotencyKey)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	return roundTrip(tb, ts, req)
}

// roundTrip sends req to ts and returns what came back.
func roundTrip(tb testing.TB, ts *httptest.Server, req *http.Request) response {
	tb.Helper()
	resp, err := ts.Client().Do(req)
	if err != nil {
		tb.Fatalf("%s %s: %v", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatalf("read body: %v", err)
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: string(data)}
}

// waitLimit bounds every wait of a test on something happening elsewhere (a
// goroutine reaching a fault point, a process printing its address, the
// workers settling). What has not happened by then never will: a test whose
// system is stuck fails within seconds, saying what it waited for, instead
// of hanging until go test's ten-minute timeout. (A relay that never marked
// its events published once held TestOutbox for 608 s.)
const waitLimit = 10 * time.Second

// eventually calls check until it reports done, every few milliseconds,
// and fails tb if it has not within timeout, with what it waited for and
// what check saw the last time it looked.
func eventually(tb testing.TB, what string, timeout time.Duration, check func() (done bool, saw string)) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		done, saw := check()
		if done {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("waited %s for %s; last saw %s", timeout, what, saw)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// await waits at most waitLimit for ch to send or close. Its error names
// what was waited for: a fault hook, which may run on a goroutine other than
// the test's, returns it and so fails the worker it stopped, instead of
// blocking it for ever.
func await[T any](what string, ch <-chan T) (T, error) {
	select {
	case v := <-ch:
		return v, nil
	case <-time.After(waitLimit):
		var zero T
		return zero, fmt.Errorf("waited %s for %s; it never came", waitLimit, what)
	}
}

// mustReceive is await on the test's own goroutine: it fails tb.
func mustReceive[T any](tb testing.TB, what string, ch <-chan T) T {
	tb.Helper()
	v, err := await(what, ch)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

// mustWait is wg.Wait bounded by waitLimit. The goroutine it starts exits
// when wg's goroutines are done, even after tb has failed.
func mustWait(tb testing.TB, what string, wg *sync.WaitGroup) {
	tb.Helper()
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	mustReceive(tb, what, done)
}

// waitOnLock waits until PostgreSQL shows a statement containing statement
// waiting on a lock, and fails tb with notWaiting if done delivers first:
// the operation that should have waited ended instead.
func waitOnLock(tb testing.TB, env *testEnv, statement string, done <-chan error, notWaiting string) {
	tb.Helper()
	for waiting := 0; waiting == 0; {
		select {
		case err := <-done:
			tb.Fatalf("%s: %v", notWaiting, err)
		case <-time.After(10 * time.Millisecond):
		}
		waiting = env.count(tb, `SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE ?`, "%"+statement+"%")
	}
}

// atOnce runs fn(0) to fn(n-1), each in a goroutine of its own, released
// together as processes started at the same moment would be, and returns
// their errors by index.
func atOnce(n int, fn func(i int) error) []error {
	var start, done sync.WaitGroup
	start.Add(1)
	errs := make([]error, n)
	for i := range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			errs[i] = fn(i)
		}()
	}
	start.Done()
	done.Wait()
	return errs
}
