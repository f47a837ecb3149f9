// Two operations at once on PostgreSQL, through their interleavings, in the
// spirit of PostgreSQL's own isolation tester (src/test/isolation: sessions,
// steps, and permutations of them). The deterministic simulator runs one
// goroutine on SQLite, where one writer at a time hides every race that
// PostgreSQL's row locks and snapshots let through; every fault an outside
// review found on the scale-out path lived in such a race.
//
// A session is one operation as one process runs it (a relay's pass, a
// repair, a client's request), over a pool of its own. Its steps are its
// statements: a pgx tracer sees each one before it is sent. For a pair of
// sessions A and B, and for each k, the harness lets A run until it is about
// to send its k-th statement (BEGIN and COMMIT count), runs B to its end or
// until PostgreSQL shows B waiting on a lock (pg_stat_activity), then lets A
// go on; and the same with B paused. A late session that takes the relay
// lease over from A, paused past it, is paused in turn as well, before
// each of its own statements, while A goes on: A wakes in the middle of
// the takeover. A claim that skips locked rows must never be seen waiting
// on a lock. After each interleaving it audits the database (check's
// invariants), lets the system settle (every worker, every client's
// retry), and audits again with the end-to-end oracle: every event applied
// once by every consumer of its subject, every order settled, every
// retried request answered as the first time.
//
// The world each interleaving starts from (isoFixture) holds some of
// everything the sessions work on: an event for the relay (one failure
// from failed), a lost message for the reconciler, deliveries for the
// consumers, a saga due, a paid order, an abandoned refund, a failed event,
// poison messages, a saga in compensation_failed, week-old rows for
// cleanup. It is built once and copied into the slot's schema before each
// interleaving.
//
// `go test ./...` with RETRYSAFE_TEST_POSTGRES runs a quick subset (the
// pairs where faults were found, but for the slowest); RETRYSAFE_ISOLATION=all
// runs every pair of sessions that touch a common table, as CI does.
// To run one pair (its sessions in the order isoSessions lists them):
//
//	RETRYSAFE_ISOLATION=all go test -run 'TestTwoSessions/pairs/relay/relay_past_the_lease$' .

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// isolationEnv names the variable that runs every pair ("all") instead of
// the quick subset.
const isolationEnv = "RETRYSAFE_ISOLATION"

// isoLedger is the consumer the harness adds beside the system's own: it
// reads every subject and counts, in iso_applied, how often each message was
// applied to it. A second consumer of a subject is what a team adds (an
// analytics or ledger service), and what two of the review's faults needed.
const isoLedger = "iso-ledger"

// isoSession is one operation, as one process runs it.
type isoSession struct {
	name string
	// run does the operation once. It returns an error only for an
	// outcome that is wrong whatever ran beside it: a refusal or a
	// transient failure that the operation reports to its caller (409,
	// 503, errRepairRefused) is an answer, and the settling that follows
	// finishes what it left.
	run func(ctx context.Context, p *isoProcess) error
	// client marks a request a client sends again until it has an answer
	// (the processor, for a webhook).
	client bool
	// alone marks an operation that two processes must never both do for
	// one thing: run beside itself, no publish or delivery may be
	// absorbed as a duplicate (each claims what the other does not).
	alone bool
	// lateFor, if set, makes the session a late one: it moves the clock
	// past a lease before it runs, as a process does that takes over the
	// work of one paused past its lease. It is paired only with the
	// sessions named, whose work it takes over.
	lateFor []string
	// onlyWith, if set, pairs the session only with the sessions named.
	onlyWith []string
	// pausedToo, on a late session, pauses it too: for each statement the
	// session it takes over from is paused before, the late one is
	// paused in turn before each of its own while the other goes on. The
	// process it took over from wakes in the middle of the takeover
	// (after the new holder's publish, before its mark). Its pairs run
	// every pair of pauses, so it is for short sessions.
	pausedToo bool
}

// isoProcess is one process of the pair: its own App over its own pool,
// whose statements its tracer sees.
type isoProcess struct {
	name   string
	app    *App
	api    http.Handler
	tracer *isoTracer
	// clock is the slot's, which a late session moves.
	clock *fakeClock
	// answers are the definitive answers its HTTP requests got, by
	// idempotency key, for the oracle's retry.
	answers map[string]response
}

// isoTracer pauses a session before its pauseAt-th statement. It sees
// every statement of the process's pool (pgx calls it on the session's
// goroutine before it sends the statement), only while armed.
type isoTracer struct {
	mu         sync.Mutex
	armed      bool
	pauseAt    int
	statements []string
	paused     chan struct{}
	release    chan struct{}
}

// arm starts counting statements from zero; the session stops before
// statement pauseAt (never, if 0) until resume.
func (t *isoTracer) arm(pauseAt int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.armed, t.pauseAt, t.statements = true, pauseAt, nil
	t.paused, t.release = make(chan struct{}), make(chan struct{})
}

// disarm stops counting and returns the statements seen.
func (t *isoTracer) disarm() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.armed = false
	return t.statements
}

// resume lets a paused session go on.
func (t *isoTracer) resume() {
	t.mu.Lock()
	defer t.mu.Unlock()
	select {
	case <-t.release:
	default:
		close(t.release)
	}
}

// TraceQueryStart counts the statement, and waits if it is the one to
// pause before.
func (t *isoTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	t.mu.Lock()
	if !t.armed {
		t.mu.Unlock()
		return ctx
	}
	t.statements = append(t.statements, data.SQL)
	n, paused, release := len(t.statements), t.paused, t.release
	t.mu.Unlock()
	if n == t.pauseAt {
		close(paused)
		<-release
	}
	return ctx
}

// TraceQueryEnd does nothing: the pause is before the statement.
func (t *isoTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// isoFixture is the world every interleaving starts from, and the names
// the sessions need in it.
type isoFixture struct {
	schema string
	now    time.Time
	// paidOrder is paid; a refund request and a webhook of a refund made
	// at the processor's dashboard both change it.
	paidOrder, dashboardRefund, dashboardCharge string
	// abandonedRefund is a refund request that stopped after the
	// processor made the refund (its key is held by nobody now); the
	// processor's webhook for it, too early, is asked for again.
	abandonedOrder, abandonedCharge, abandonedRefund string
	// compensationFailedSaga waits for an operator's resume.
	compensationFailedSaga string
}

// isoHarness runs interleavings in slots, each a schema of its own.
type isoHarness struct {
	base    string
	fixture isoFixture
	slots   chan *isoSlot
	// webhook is the processor's session, which settling sends again.
	webhook isoSession
}

// isoSlot is a schema that interleavings take in turn: the two processes
// of a pair, a third that settles the world after them, and an untraced
// pool for the harness's own statements.
type isoSlot struct {
	h *isoHarness
	// fixture is the world the slot's interleavings start from, in a
	// schema of its own beside the slot's; tables are its tables.
	fixture isoFixture
	tables  []string
	// known are the violations the fixture holds by design, before any
	// session runs: a failed event waits for an operator.
	known map[violation]bool
	// duplicates is how many publishes and deliveries the fixture's
	// broker and inboxes absorbed as duplicates (duplicatesOf).
	duplicates int
	schema     string
	admin      *sql.DB
	clock      *fakeClock
	procs      [2]*isoProcess
	settler    *isoProcess
	// lost holds the replays whose first delivery the broker loses.
	mu   sync.Mutex
	lost map[string]bool
}

// isoBroker is the embedded broker as the harness runs it. A republished
// copy reaches every subscriber of its subject, as a JetStream publish
// under a new Nats-Msg-Id does (the embedded broker keeps one copy per
// message id and drops the rest); and the first delivery of every replay is
// lost, as any message may be: only the reconciler brings it back.
type isoBroker struct {
	*embeddedBroker
	slot *isoSlot
}

// isoBrokerRefuses is the context key of a session whose publishes the
// broker refuses (withBrokerRefusing).
type isoBrokerRefuses struct{}

// withBrokerRefusing returns ctx for a session whose every publish the
// broker refuses, as an unreachable broker does, before any of it is
// stored.
func withBrokerRefusing(ctx context.Context) context.Context {
	return context.WithValue(ctx, isoBrokerRefuses{}, true)
}

// errIsoBrokerRefused is what a refused publish returns.
var errIsoBrokerRefused = errors.New("broker unreachable")

// publishBatch publishes msgs, then queues every republished one for every
// subscriber of its subject again. A session's context may say the broker
// refuses it (withBrokerRefusing).
func (b *isoBroker) publishBatch(ctx context.Context, msgs []message) error {
	if ctx.Value(isoBrokerRefuses{}) != nil {
		return errIsoBrokerRefused
	}
	if err := b.embeddedBroker.publishBatch(ctx, msgs); err != nil {
		return err
	}
	for _, msg := range msgs {
		if msg.PublishID == "" {
			continue
		}
		_, err := b.db.ExecContext(ctx, `
			INSERT INTO broker_deliveries (subscriber, message_seq, status, visible_at)
			SELECT s.subscriber, m.seq, 'pending', ? FROM broker_messages m
			JOIN broker_subscriptions s ON s.subject = m.subject
			WHERE m.message_id = ?
			ON CONFLICT (subscriber, message_seq) DO UPDATE
			SET status = 'pending', visible_at = excluded.visible_at, acked_at = NULL,
			    delivery_count = broker_deliveries.delivery_count + 1`,
			formatTime(b.now()), msg.ID)
		if err != nil {
			return fmt.Errorf("deliver the copy of %s to every subscriber: %w", msg.ID, err)
		}
	}
	return nil
}

// replay queues msg for subscriber again, and remembers to lose it once.
func (b *isoBroker) replay(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error {
	if err := b.embeddedBroker.replay(ctx, tx, subscriber, msg, replayID); err != nil {
		return err
	}
	b.slot.mu.Lock()
	defer b.slot.mu.Unlock()
	b.slot.lost[subscriber+"/"+msg.ID] = true
	return nil
}

// fetch hands out due deliveries, but loses the first of each replay: it
// acks it unseen.
func (b *isoBroker) fetch(ctx context.Context, subscriber string, max int) ([]delivery, error) {
	deliveries, err := b.embeddedBroker.fetch(ctx, subscriber, max)
	if err != nil {
		return nil, err
	}
	kept := deliveries[:0]
	for _, d := range deliveries {
		b.slot.mu.Lock()
		lose := b.slot.lost[subscriber+"/"+d.ID]
		delete(b.slot.lost, subscriber+"/"+d.ID)
		b.slot.mu.Unlock()
		if !lose {
			kept = append(kept, d)
			continue
		}
		if err := b.embeddedBroker.ack(ctx, d); err != nil {
			return nil, err
		}
	}
	return kept, nil
}

// isoLedgerConsumer returns the ledger consumer, whose effect is one more
// count in iso_applied, in the inbox's transaction.
func isoLedgerConsumer() consumer {
	return consumer{
		name:     isoLedger,
		subjects: []string{eventOrderCreated, eventPaymentCaptured, eventOrderCancelled, eventOrderRefunded},
		apply: func(ctx context.Context, tx *sql.Tx, msg message) error {
			_, err := tx.ExecContext(ctx, `
				INSERT INTO iso_applied (message_id, applications) VALUES (?, 1)
				ON CONFLICT (message_id) DO UPDATE SET applications = iso_applied.applications + 1`, msg.ID)
			return err
		},
	}
}

// newIsoHarness opens slots slots to run interleavings in. One slot works
// in the test database; several each work in a database of their own,
// since advisory locks (an idempotency key's, the migration's) are shared
// by every schema of a database, and two slots would wait on each other.
func newIsoHarness(t *testing.T, slots int) *isoHarness {
	t.Helper()
	h := &isoHarness{base: os.Getenv(testPostgresEnv), slots: make(chan *isoSlot, slots)}
	for i := range slots {
		base := h.base
		if slots > 1 {
			base = isoDatabase(t, h.base, i)
		}
		s := h.openSlot(t, base, i)
		if i == 0 {
			h.fixture = s.fixture
		} else if got, want := s.fixture, h.fixture; got.withoutSchema() != want.withoutSchema() {
			t.Fatalf("slot %d's fixture differs from slot 0's: %+v, %+v", i, got, want)
		}
		h.slots <- s
	}
	for _, session := range isoSessions(h.fixture) {
		if session.name == "webhook" {
			h.webhook = session
		}
	}
	return h
}

// withoutSchema returns f without the schema it is in: what two fixtures
// built alike share.
func (f isoFixture) withoutSchema() isoFixture {
	f.schema = ""
	return f
}

// isoDatabase creates a database for slot i beside the one base names,
// dropped when t ends, and returns its URL.
func isoDatabase(t *testing.T, base string, i int) string {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("%s_iso%d_%d", strings.TrimPrefix(u.Path, "/"), i, os.Getpid())
	admin := mustConnect(t, base)
	// name is our own [a-z0-9_] name, and the test database's.
	if _, err := admin.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(`CREATE DATABASE ` + name); err != nil {
		t.Fatalf("a database for each slot (or run one slot): %v", err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`); err != nil {
			t.Error(err)
		}
	})
	u.Path = "/" + name
	return u.String()
}

// mustConnect returns an untraced pool on the schema of url, closed when
// tb ends.
func mustConnect(tb testing.TB, url string) *sql.DB {
	tb.Helper()
	db, err := connectPostgres(context.Background(), url)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	return db
}

// openSlot builds the fixture in the database at base, makes a schema at
// this program's version beside it, with the ledger's table, and opens the
// processes that run in it.
func (h *isoHarness) openSlot(t *testing.T, base string, i int) *isoSlot {
	t.Helper()
	ctx := context.Background()
	s := &isoSlot{h: h, fixture: buildIsoFixture(t, base), lost: map[string]bool{}, known: map[violation]bool{}}
	fixture := mustConnect(t, s.fixture.schema)
	rows, err := fixture.Query(`SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' AND table_name <> 'schema_migrations' ORDER BY table_name`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var table string
		if err := rows.Scan(&table); err != nil {
			t.Fatal(err)
		}
		s.tables = append(s.tables, table)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	rows.Close()
	violations, err := audit(ctx, fixture, s.fixture.now, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range violations {
		s.known[v] = true
	}
	if s.duplicates, err = duplicatesOf(ctx, fixture); err != nil {
		t.Fatal(err)
	}
	s.schema = testPostgresSchema(t, base)
	s.admin = mustConnect(t, s.schema)
	s.clock = newFakeClock(s.fixture.now)
	if err := migrate(ctx, s.admin); err != nil {
		t.Fatal(err)
	}
	if _, err := s.admin.Exec(isoAppliedTable); err != nil {
		t.Fatal(err)
	}
	for j := range s.procs {
		s.procs[j] = s.openProcess(t, fmt.Sprintf("iso-%d-%c", i, 'a'+j))
	}
	s.settler = s.openProcess(t, fmt.Sprintf("iso-%d-settler", i))
	return s
}

// isoAppliedTable is the ledger consumer's own table.
const isoAppliedTable = `CREATE TABLE IF NOT EXISTS iso_applied (message_id TEXT PRIMARY KEY, applications INTEGER NOT NULL)`

// openProcess opens a process called name (its application_name, which
// pg_stat_activity shows) on the slot's schema.
func (s *isoSlot) openProcess(t *testing.T, name string) *isoProcess {
	t.Helper()
	ctx := context.Background()
	db, tracer := openTracedPool(t, s.schema, name)
	t.Cleanup(func() { db.Close() })
	app := newApp(db, s.clock.now, nil, nil)
	app.broker = &isoBroker{embeddedBroker: app.broker.(*embeddedBroker), slot: s}
	if err := app.addConsumer(ctx, isoLedgerConsumer()); err != nil {
		t.Fatal(err)
	}
	api := &server{
		app:           app,
		apiKeys:       map[string]string{keyUser42: "user-42", keyUser7: "user-7"},
		webhookSecret: []byte(testWebhookSecret),
		logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	return &isoProcess{name: name, app: app, api: api.routes(), tracer: tracer, clock: s.clock}
}

// openTracedPool opens a pool on the database at url whose statements
// the returned tracer sees, and which pg_stat_activity shows as name.
func openTracedPool(t *testing.T, url, name string) (*sql.DB, *isoTracer) {
	t.Helper()
	config, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	tracer := &isoTracer{}
	config.Tracer = tracer
	config.RuntimeParams["application_name"] = name
	// A deadlock between the pair is found in 50 ms, not a second; the
	// loser's transaction runs again (runTx).
	config.RuntimeParams["deadlock_timeout"] = "50ms"
	// The harness needs no durability, and thousands of commits.
	config.RuntimeParams["synchronous_commit"] = "off"
	db, err := connectPostgresWith(context.Background(), config)
	if err != nil {
		t.Fatal(err)
	}
	return db, tracer
}

// reset copies the fixture into the slot's schema, over whatever the last
// interleaving left, and sets the clock to the fixture's time.
func (s *isoSlot) reset(ctx context.Context) error {
	s.clock.mu.Lock()
	s.clock.t = s.fixture.now
	s.clock.mu.Unlock()
	s.mu.Lock()
	clear(s.lost)
	s.mu.Unlock()
	for _, p := range append(s.procs[:], s.settler) {
		p.answers = map[string]response{}
		// The same ids in every interleaving: two that end alike leave
		// the same rows (see stateOf).
		ids := newIDs(rand.NewChaCha8([32]byte([]byte(fmt.Sprintf("%-32s", p.name)))))
		p.app.newID, p.app.processor.newID = ids, ids
		// The relay lease is the fixture's again: what a process
		// remembers of it is as if it had just started.
		p.app.relayLeases.mu.Lock()
		p.app.relayLeases.held, p.app.relayLeases.sweeping = false, 0
		p.app.relayLeases.mu.Unlock()
		// And it has not yet looked up a SKU, so that a session sends
		// the same statements in every interleaving.
		p.app.stockedSKUs.Clear()
	}
	from, err := schemaOf(s.fixture.schema)
	if err != nil {
		return err
	}
	return withTx(ctx, s.admin, func(tx *sql.Tx) error {
		// No triggers (the copy needs no NOTIFY) and no foreign key
		// checks (tables are copied in any order).
		// DELETE, not TRUNCATE: a few hundred rows are deleted in a
		// fraction of the time TRUNCATE takes to make new files for
		// twenty tables.
		statements := []string{`SET LOCAL session_replication_role = replica`}
		for _, table := range s.tables {
			statements = append(statements, `DELETE FROM `+table,
				`INSERT INTO `+table+` OVERRIDING SYSTEM VALUE SELECT * FROM `+from+`.`+table)
		}
		for _, table := range []string{"outbox_events", "broker_messages"} {
			statements = append(statements, `SELECT setval(pg_get_serial_sequence('`+table+`', 'seq'), (SELECT COALESCE(MAX(seq), 0) + 1 FROM `+table+`), false)`)
		}
		// One round trip for them all: a statement without arguments
		// goes by the simple protocol, which takes several at once.
		if _, err := tx.ExecContext(ctx, strings.Join(statements, ";\n")); err != nil {
			return fmt.Errorf("copy the fixture: %w", err)
		}
		return nil
	})
}

// stateOf returns a digest of everything settling and the oracle read:
// every row of the slot's schema, the clock, the replays the broker will
// lose and the answers clients got. Two interleavings with the same digest
// settle alike, so the harness settles and audits each digest once.
func (s *isoSlot) stateOf(ctx context.Context) (string, error) {
	parts := make([]string, len(s.tables))
	for i, table := range s.tables {
		parts[i] = `(SELECT COALESCE(string_agg(t::text, '|' ORDER BY t::text), '') FROM ` + table + ` t)`
	}
	var rows string
	if err := s.admin.QueryRowContext(ctx, `SELECT md5(concat_ws('#', `+strings.Join(parts, ", ")+`))`).Scan(&rows); err != nil {
		return "", fmt.Errorf("digest the rows: %w", err)
	}
	s.mu.Lock()
	lost := fmt.Sprint(s.lost)
	s.mu.Unlock()
	answers := fmt.Sprint(s.procs[0].answers, s.procs[1].answers)
	return fmt.Sprintf("%s %s %s %s", rows, s.clock.now().Format(time.RFC3339Nano), lost, answers), nil
}

// schemaOf returns the schema that a test database URL names.
func schemaOf(url string) (string, error) {
	m := regexp.MustCompile(`search_path=(test_[0-9a-f]+)`).FindStringSubmatch(url)
	if m == nil {
		return "", fmt.Errorf("bug: %s names no test schema", redactURL(url))
	}
	return m[1], nil
}

// post sends a request to the process's API and keeps a definitive answer.
func (p *isoProcess) post(path, idempotencyKey, body string) response {
	req := httptest.NewRequest("POST", path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+keyUser42)
	if idempotencyKey != "" {
		req.Header.Set("Idempotency-Key", idempotencyKey)
	}
	req.Header.Set("Content-Type", "application/json")
	recorder := httptest.NewRecorder()
	p.api.ServeHTTP(recorder, req)
	r := response{Status: recorder.Code, Header: recorder.Header(), Body: recorder.Body.String()}
	if idempotencyKey != "" && r.Status < 300 {
		p.answers[idempotencyKey] = r
	}
	return r
}

// isoAnswer returns an error for an HTTP answer no client may get: a 500,
// or anything but the statuses the request may end with.
func isoAnswer(what string, r response, statuses ...int) error {
	if slices.Contains(statuses, r.Status) {
		return nil
	}
	return fmt.Errorf("%s answered %d %s", what, r.Status, r.Body)
}

// isoRefused reports whether err is an answer rather than a fault: a
// repair refused (what it repairs changed meanwhile) or the database
// busy.
func isoRefused(err error) bool {
	return errors.Is(err, errRepairRefused) || errors.Is(err, errRepairNotFound) || isBusy(err)
}

// isoSessions returns every operation that writes rows another operation
// reads or writes.
func isoSessions(f isoFixture) []isoSession {
	createBody := orderBody(1500, "sku-rare", 1, pmCardVisa)
	return []isoSession{
		{name: "create", client: true, run: func(ctx context.Context, p *isoProcess) error {
			// Never 409: a duplicate waits for the key's lock, then replays.
			return isoAnswer("create", p.post("/api/orders", "iso-create", createBody), 201, 503)
		}},
		{name: "relay", alone: true, run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.relayOnce(ctx, p.name, relayBatchSize)
			return err
		}},
		// The broker refuses the relay's batch: it counts a failure
		// against each event it claimed (recordPublishFailure).
		{name: "relay refused by the broker", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.relayOnce(withBrokerRefusing(ctx), p.name, relayBatchSize)
			return err
		}},
		{name: "reconciler", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.reconcileOnce(ctx, p.name, relayBatchSize)
			return err
		}},
		{name: "payment consumer", alone: true, run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.consumeOnce(ctx, p.consumer(paymentServiceConsumer), consumeBatchSize)
			return err
		}},
		{name: "order consumer", alone: true, run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.consumeOnce(ctx, p.consumer(orderServiceConsumer), consumeBatchSize)
			return err
		}},
		{name: "saga round", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.sagaOnce(ctx, p.name, sagaBatchSize)
			return err
		}},
		{name: "refund", client: true, run: func(ctx context.Context, p *isoProcess) error {
			return isoAnswer("refund", p.post(refundPath(f.paidOrder), "iso-refund", `{"amount_cents":1000}`), 200, 409, 503)
		}},
		// A client that sends one key to create an order and to refund
		// one, at once: the second to take the key's lock must find the
		// other's key (422), never fail on it (a unique violation was a
		// 500) or claim it too.
		{name: "refund under a create's key", client: true, onlyWith: []string{"create under a refund's key"}, run: func(ctx context.Context, p *isoProcess) error {
			return isoAnswer("refund", p.post(refundPath(f.paidOrder), "iso-shared", `{"amount_cents":1000}`), 200, 409, 422, 503)
		}},
		{name: "create under a refund's key", client: true, onlyWith: []string{"refund under a create's key"}, run: func(ctx context.Context, p *isoProcess) error {
			return isoAnswer("create", p.post("/api/orders", "iso-shared", createBody), 201, 422, 503)
		}},
		{name: "refund completer", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.completeRefundsOnce(ctx, refundBatchSize)
			return err
		}},
		{name: "webhook", client: true, run: func(ctx context.Context, p *isoProcess) error {
			for i, refund := range []struct{ charge, refund string }{{f.dashboardCharge, f.dashboardRefund}, {f.abandonedCharge, f.abandonedRefund}} {
				body := chargeRefundedEvent(fmt.Sprintf("evt_iso_%d", i), refund.charge, refund.refund, 1500)
				req := httptest.NewRequest("POST", "/webhooks/processor", strings.NewReader(string(body)))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(signatureHeader, signWebhook([]byte(testWebhookSecret), p.app.now(), body))
				recorder := httptest.NewRecorder()
				p.api.ServeHTTP(recorder, req)
				if err := isoAnswer("webhook", response{Status: recorder.Code, Body: recorder.Body.String()}, 200, 503); err != nil {
					return err
				}
			}
			return nil
		}},
		{name: "cleanup", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.cleanupOnce(ctx)
			return err
		}},
		{name: "outbox retry", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.retryOutboxEvents(ctx, "ops", outboxRetryTarget{AllFailed: true})
			if isoRefused(err) {
				return nil
			}
			return err
		}},
		{name: "inbox replay", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.replayInboxMessages(ctx, "ops", inboxReplayTarget{AllPoison: true})
			if isoRefused(err) {
				return nil
			}
			return err
		}},
		{name: "saga resume", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.resumeSaga(ctx, "ops", f.compensationFailedSaga)
			if isoRefused(err) {
				return nil
			}
			return err
		}},
		{name: "refund finish", run: func(ctx context.Context, p *isoProcess) error {
			_, err := p.app.finishRefunds(ctx, "ops")
			return err
		}},

		// The same work, taken over from a process paused past its lease.
		{name: "relay past the lease", lateFor: []string{"relay", "relay refused by the broker"}, pausedToo: true, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(relayLease + time.Second)
			_, err := p.app.relayOnce(ctx, p.name, relayBatchSize)
			return err
		}},
		{name: "relay lease taken over", lateFor: []string{"relay", "relay refused by the broker"}, pausedToo: true, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(relayLease + time.Second)
			return isoTakeRelayLease(ctx, p)
		}},
		{name: "reconciler past the lease", lateFor: []string{"reconciler"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(relayLease + time.Second)
			_, err := p.app.reconcileOnce(ctx, p.name, relayBatchSize)
			return err
		}},
		{name: "payment consumer past ackWait", lateFor: []string{"payment consumer"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(ackWait + time.Second)
			_, err := p.app.consumeOnce(ctx, p.consumer(paymentServiceConsumer), consumeBatchSize)
			return err
		}},
		{name: "order consumer past ackWait", lateFor: []string{"order consumer"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(ackWait + time.Second)
			_, err := p.app.consumeOnce(ctx, p.consumer(orderServiceConsumer), consumeBatchSize)
			return err
		}},
		{name: "saga round past the lease", lateFor: []string{"saga round", "saga resume"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(sagaLease + time.Second)
			_, err := p.app.sagaOnce(ctx, p.name, sagaBatchSize)
			return err
		}},
		{name: "refund completer past the lease", lateFor: []string{"refund", "refund completer", "refund finish"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(refundLockTimeout + time.Second)
			_, err := p.app.completeRefundsOnce(ctx, refundBatchSize)
			return err
		}},
		{name: "refund retried past the lease", client: true, lateFor: []string{"refund"}, run: func(ctx context.Context, p *isoProcess) error {
			p.clock.advance(refundLockTimeout + time.Second)
			return isoAnswer("refund", p.post(refundPath(f.paidOrder), "iso-refund", `{"amount_cents":1000}`), 200, 409, 503)
		}},
	}
}

// isoTakeRelayLease takes the relay lease over for p, if it has passed,
// with its write and its commit as two steps, and between them reads the
// events twice: no relay may write one under the lease it replaces once
// its row is written. It returns an error if one did.
//
// holdRelayLease takes a lease in one statement, but PostgreSQL writes the
// row before it commits (and holds it while the commit is flushed to
// disk): a relay's mark under the old token that begins meanwhile, and
// does not wait for the row, finds its token and writes after the new
// holder has claimed the same events. At statement boundaries the window
// cannot be seen, so the takeover here has one of its own.
func isoTakeRelayLease(ctx context.Context, p *isoProcess) error {
	// READ COMMITTED, as holdRelayLease's statement runs: each read sees
	// what committed before it.
	tx, err := p.app.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer tx.Rollback() // a no-op once committed
	now := p.app.now()
	var token int64
	err = tx.QueryRowContext(ctx, `
		UPDATE relay_leases SET lease_token = lease_token + 1, holder = ?, leased_until = ?
		WHERE name = ? AND leased_until <= ?
		RETURNING lease_token`,
		p.name, formatTime(now.Add(p.app.leases.relay)), relayLeaseName, formatTime(now)).Scan(&token)
	if errors.Is(err, sql.ErrNoRows) {
		return nil // a relay holds it: nothing to take over
	}
	if err != nil {
		return fmt.Errorf("take the relay lease over: %w", err)
	}
	before, err := isoEventRecords(ctx, tx)
	if err != nil {
		return err
	}
	after, err := isoEventRecords(ctx, tx)
	if err != nil {
		return err
	}
	var changed []string
	for i := range min(len(before), len(after)) {
		if before[i] != after[i] {
			changed = append(changed, before[i]+" became "+after[i])
		}
	}
	if len(changed) > 0 || len(before) != len(after) {
		return fmt.Errorf("a relay under token %d wrote events after the lease's takeover by token %d was written, before it committed: %s",
			token-1, token, strings.Join(changed, ", "))
	}
	return tx.Commit()
}

// isoEventRecords returns what a relay writes of each event, in the order
// they were written: its id, status and attempts.
func isoEventRecords(ctx context.Context, tx *sql.Tx) ([]string, error) {
	rows, err := tx.QueryContext(ctx, `SELECT event_id || ' ' || status || ' ' || attempts FROM outbox_events ORDER BY seq`)
	if err != nil {
		return nil, fmt.Errorf("read the events: %w", err)
	}
	defer rows.Close()
	var records []string
	for rows.Next() {
		var record string
		if err := rows.Scan(&record); err != nil {
			return nil, err
		}
		records = append(records, record)
	}
	return records, rows.Err()
}

// consumer returns the process's consumer called name.
func (p *isoProcess) consumer(name string) consumer {
	for _, c := range p.app.consumers() {
		if c.name == name {
			return c
		}
	}
	panic("bug: no consumer " + name)
}

// buildIsoFixture builds the world every interleaving starts from, in a
// schema of its own, through the system's own code.
func buildIsoFixture(t *testing.T, base string) isoFixture {
	t.Helper()
	ctx := context.Background()
	env := &testEnv{
		clock: newFakeClock(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)),
		path:  testPostgresSchema(t, base),
		fault: &faultSwitch{hits: map[faultPoint]int{}},
		ids:   newIDs(rand.NewChaCha8([32]byte{'i', 's', 'o'})),
	}
	env.open(t)
	if _, err := env.app.db.Exec(isoAppliedTable); err != nil {
		t.Fatal(err)
	}
	if err := env.app.addConsumer(ctx, isoLedgerConsumer()); err != nil {
		t.Fatal(err)
	}
	f := isoFixture{schema: env.path}
	payments := consumerNamed(t, env, paymentServiceConsumer)
	ledger := consumerNamed(t, env, isoLedger)
	consume := func(c consumer) {
		t.Helper()
		if _, err := env.app.consumeOnce(ctx, c, consumeBatchSize); err != nil {
			t.Fatal(err)
		}
	}
	relay := func() {
		t.Helper()
		if _, err := env.app.relayOnce(ctx, "fixture", relayBatchSize); err != nil {
			t.Fatal(err)
		}
	}
	create := func(key, body string) string {
		t.Helper()
		return orderField(mustCreateOrder(t, env, "user-42", key, body).Body, "order_id")
	}

	// A week and a day ago: an order that settled (cleanup deletes its
	// key, events, deliveries and inbox rows now), and an OrderCreated
	// that the payment service recorded as poison, which the ledger
	// applied and the reconciler's cursor passed: a replay of it races
	// cleanup's delete of the ledger's week-old row.
	createAndDrain(t, env, "iso-old", orderBody(900, "sku-1", 1, pmCardVisa))
	create("iso-poison-old", orderBody(1100, "sku-1", 1, pmCardVisa))
	relay()
	consume(ledger)
	poisonFor(t, env, payments, permanent(errors.New("payment service bug")))
	if _, err := env.app.reconcileOnce(ctx, "fixture", relayBatchSize); err != nil {
		t.Fatal(err)
	}
	env.clock.advance(messageRetention + 24*time.Hour)

	// An event that failed to publish, for the outbox retry.
	create("iso-failed", orderBody(1200, "sku-1", 1, pmCardVisa))
	failPublishing(t, env)
	// A saga in compensation_failed, for the saga resume (its faults
	// count the passes of their points from here).
	env.fault.mu.Lock()
	clear(env.fault.hits)
	env.fault.mu.Unlock()
	_, f.compensationFailedSaga = compensationFailedSaga(t, env)
	// A paid order, refunded at the processor's dashboard: its webhook and
	// a refund request both change it.
	f.paidOrder = createAndDrain(t, env, "iso-paid", orderBody(5000, "sku-1", 1, pmCardVisa))
	f.dashboardCharge = env.str(t, `SELECT charge_id FROM orders WHERE order_id = ?`, f.paidOrder)
	var err error
	f.dashboardRefund, err = env.app.processor.refund(ctx, "dashboard-1", f.dashboardCharge, 1500)
	if err != nil {
		t.Fatal(err)
	}
	// A refund request that stopped after the processor made the refund,
	// its lease passed: the completer and refund finish take it over, and
	// its webhook waits for them.
	f.abandonedOrder = createAndDrain(t, env, "iso-abandoned", orderBody(3000, "sku-1", 1, pmCardVisa))
	f.abandonedCharge = env.str(t, `SELECT charge_id FROM orders WHERE order_id = ?`, f.abandonedOrder)
	env.fault.crashAt(faultRefundAfterProcessor)
	req, refund := refundRequestFor(t, f.abandonedOrder, "iso-abandoned-refund", `{"amount_cents":1500}`)
	if _, err := env.app.refundOrder(ctx, req, f.abandonedOrder, refund); !errors.Is(err, errCrash) {
		t.Fatalf("the refund to abandon: %v", err)
	}
	env.fault.failAt("", nil, 0)
	f.abandonedRefund = env.str(t, `SELECT refund_id FROM processor_refunds WHERE charge_id = ?`, f.abandonedCharge)

	// A PaymentCaptured published, not yet applied: the order consumer's.
	create("iso-captured", orderBody(1300, "sku-1", 1, pmCardVisa))
	relay()
	consume(payments)
	consume(ledger)
	for range 5 {
		if _, err := env.app.sagaOnce(ctx, "fixture", sagaBatchSize); err != nil {
			t.Fatal(err)
		}
	}
	relay()
	// A fresh OrderCreated the payment service recorded as poison; the
	// reconciler has not marked it delivered yet: a replay of it races the
	// reconciler's mark.
	create("iso-poison-new", orderBody(1400, "sku-1", 1, pmCardVisa))
	relay()
	consume(ledger)
	poisonFor(t, env, payments, permanent(errors.New("payment service bug")))
	// An OrderCreated that the broker lost for the payment service: the
	// reconciler's.
	create("iso-lost", orderBody(1600, "sku-1", 1, pmCardVisa))
	relay()
	consume(ledger)
	lost, err := env.app.broker.fetch(ctx, paymentServiceConsumer, consumeBatchSize)
	if err != nil || len(lost) != 1 {
		t.Fatalf("the delivery to lose: %v %v", lost, err)
	}
	if err := env.app.broker.ack(ctx, lost...); err != nil {
		t.Fatal(err)
	}
	// Two sagas due for the last unit of sku-rare, which the create
	// session orders too: one reserves it, the other is cancelled.
	create("iso-saga", orderBody(1700, "sku-rare", 1, pmCardVisa))
	create("iso-saga-2", orderBody(1750, "sku-rare", 1, pmCardVisa))
	relay()
	consume(payments)
	// An OrderCreated delivered to nobody yet, and one not published yet.
	create("iso-delivery", orderBody(1800, "sku-1", 1, pmCardVisa))
	relay()
	pending := create("iso-pending", orderBody(1900, "sku-1", 1, pmCardVisa))
	// It has had every attempt but its last: a failure counted against it
	// now fails it. (Set here: the backoffs of nine refused publishes
	// would age every other event past the reconciler's bound.)
	if _, err := env.app.db.Exec(`UPDATE outbox_events SET attempts = ? WHERE aggregate_id = ?`, maxPublishAttempts-1, pending); err != nil {
		t.Fatal(err)
	}
	// Past the reconciler's bound and every lease.
	env.clock.advance(deliveryBound + time.Second)
	f.now = env.clock.now()
	return f
}

// isoRun is what one interleaving did.
type isoRun struct {
	// reached says that the first session stopped before statement
	// pauseAt: otherwise it ended first, and the second ran after it.
	reached bool
	// reachedB says that the second session stopped before its statement
	// pauseB, neither ending nor waiting on a lock before it.
	reachedB bool
	// statements are what each session sent.
	statements [2][]string
	errs       [2]error
}

// lockWaitLimit bounds how long the harness waits for a session that
// neither ends nor waits on a lock: what has not happened by then is a
// session stuck on something else (a bug of the harness or of the code).
const lockWaitLimit = 20 * time.Second

// interleave resets the slot and runs a and b in its two processes (see
// interleaveRuns).
func (s *isoSlot) interleave(ctx context.Context, a, b isoSession, pauseAt, pauseB int) (isoRun, error) {
	if err := s.reset(ctx); err != nil {
		return isoRun{}, err
	}
	pa, pb := s.procs[0], s.procs[1]
	return interleaveRuns(ctx, s.admin, pauseAt, pauseB,
		isoRunner{a.name, pa.tracer, pa.name, func(ctx context.Context) error { return a.run(ctx, pa) }},
		isoRunner{b.name, pb.tracer, pb.name, func(ctx context.Context) error { return b.run(ctx, pb) }})
}

// isoRunner is a session as interleaveRuns runs it: what it does, in a
// process whose statements tracer sees and which pg_stat_activity shows as
// process.
type isoRunner struct {
	session string
	tracer  *isoTracer
	process string
	run     func(ctx context.Context) error
}

// interleaveRuns runs a until it is about to send its pauseAt-th
// statement, then b until it ends, waits on a lock (which admin sees), or
// is about to send its pauseB-th statement (never, if pauseB is 0); then
// lets a go on, and lets a paused b go on once a ends or waits on a lock.
// It waits for both. With pauseAt beyond a's statements, a runs first and
// b after it.
func interleaveRuns(ctx context.Context, admin *sql.DB, pauseAt, pauseB int, a, b isoRunner) (run isoRun, err error) {
	a.tracer.arm(pauseAt)
	b.tracer.arm(pauseB)
	pausedA, pausedB := a.tracer.paused, b.tracer.paused
	defer func() {
		// Neither stays paused, whatever went wrong.
		a.tracer.resume()
		b.tracer.resume()
		run.statements = [2][]string{a.tracer.disarm(), b.tracer.disarm()}
	}()
	doneA, doneB := make(chan error, 1), make(chan error, 1)
	go func() { doneA <- a.run(ctx) }()
	select {
	case <-pausedA:
		run.reached = true
	case run.errs[0] = <-doneA:
		b.tracer.resume()
		run.errs[1] = b.run(ctx)
		return run, nil
	}
	go func() { doneB <- b.run(ctx) }()
	stopB, err := watchRun(ctx, admin, b, doneB, pausedB, &run.errs[1], fmt.Sprintf("while %s was paused before statement %d", a.session, pauseAt))
	if err != nil {
		return run, err
	}
	if stopB != isoPaused {
		// b waits on a lock: a pause it reaches once a lets it go is none.
		b.tracer.resume()
	}
	a.tracer.resume()
	aEnded := false
	if stopB == isoPaused {
		run.reachedB = true
		stopA, err := watchRun(ctx, admin, a, doneA, nil, &run.errs[0], fmt.Sprintf("while %s was paused before statement %d", b.session, pauseB))
		if err != nil {
			return run, err
		}
		aEnded = stopA == isoEnded
		b.tracer.resume()
	}
	if !aEnded {
		if run.errs[0], err = await(a.session, doneA); err != nil {
			return run, err
		}
	}
	if stopB != isoEnded {
		if run.errs[1], err = await(b.session, doneB); err != nil {
			return run, err
		}
	}
	return run, nil
}

// isoStop is what a session that watchRun watched came to.
type isoStop int

const (
	isoEnded   isoStop = iota
	isoWaiting         // on a lock
	isoPaused          // before the statement its tracer pauses it before
)

// watchRun waits until r ends (its error in *runErr), its tracer pauses it
// (paused closes; nil for never), or PostgreSQL shows it waiting on a
// lock. A claim (isoClaims) seen waiting is an error; so is none of these
// in lockWaitLimit (meanwhile says what the other session is doing).
func watchRun(ctx context.Context, admin *sql.DB, r isoRunner, done <-chan error, paused <-chan struct{}, runErr *error, meanwhile string) (isoStop, error) {
	deadline := time.Now().Add(lockWaitLimit)
	// Most sessions end within milliseconds; one that waits is seen
	// within a few more. Each look is a query of pg_stat_activity.
	poll := time.Millisecond
	for {
		select {
		case *runErr = <-done:
			return isoEnded, nil
		case <-paused:
			return isoPaused, nil
		case <-time.After(poll):
		}
		poll = min(2*poll, 8*time.Millisecond)
		statement, err := waitingStatement(ctx, admin, r.process)
		if err != nil {
			return 0, err
		}
		if claim := isoClaimIn(statement); claim != "" {
			return 0, fmt.Errorf("%s's claim (%s) waited on a lock %s: %s", r.session, claim, meanwhile, strings.Join(strings.Fields(statement), " "))
		}
		if statement != "" {
			return isoWaiting, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%s neither ended nor waited on a lock in %s %s", r.session, lockWaitLimit, meanwhile)
		}
	}
}

// waitingStatement returns the statement the process called name waits
// on a lock in (a row lock, an advisory lock, a table's), or "".
func waitingStatement(ctx context.Context, admin *sql.DB, name string) (string, error) {
	var statement string
	err := admin.QueryRowContext(ctx, `SELECT query FROM pg_stat_activity WHERE application_name = ? AND wait_event_type = 'Lock' LIMIT 1`, name).Scan(&statement)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("look for lock waits: %w", err)
	}
	return statement, nil
}

// isoClaims are the claims: statements that pick rows for one worker
// among several, and skip rows that another holds (SKIP LOCKED) instead
// of waiting for them. A claim that waited would take nothing more (the
// rows another holds are that one's to work on), and would line every
// worker up behind the slowest transaction; so a claim seen waiting on a
// lock is an error. Each is found by a piece of its statement that stays
// when the clause is lost: how it begins.
var isoClaims = map[string]*regexp.Regexp{
	"claimUndelivered": regexp.MustCompile(`^\s*UPDATE outbox_events\s+SET claimed_by`),
	"fetch":            regexp.MustCompile(`^\s*UPDATE broker_deliveries\s+SET delivery_count`),
	"claimSagas":       regexp.MustCompile(`^\s*SELECT saga_id, lease_token FROM saga_instances`),
}

// isoClaimIn returns the name of the claim statement is, or "".
func isoClaimIn(statement string) string {
	for name, pattern := range isoClaims {
		if pattern.MatchString(statement) {
			return name
		}
	}
	return ""
}

// settle lets the world come to rest after an interleaving, as it would
// in production: an operator repairs what was set aside, the workers run
// until quiet (the clock moving past every lease, backoff and the
// reconciler's bound), every client retries its request, and the workers
// run until quiet again. It returns an error for a retried request
// answered otherwise than the first time.
func (s *isoSlot) settle(ctx context.Context, sessions []isoSession) error {
	p := s.settler
	if _, err := p.app.replayInboxMessages(ctx, "ops", inboxReplayTarget{AllPoison: true}); err != nil && !isoRefused(err) {
		return fmt.Errorf("settle: inbox replay: %w", err)
	}
	if _, err := p.app.retryOutboxEvents(ctx, "ops", outboxRetryTarget{AllFailed: true}); err != nil && !isoRefused(err) {
		return fmt.Errorf("settle: outbox retry: %w", err)
	}
	sagas, err := listSagas(ctx, p.app.db, sagaCompensationFailed)
	if err != nil {
		return err
	}
	for _, saga := range sagas {
		if _, err := p.app.resumeSaga(ctx, "ops", saga.SagaID); err != nil && !isoRefused(err) {
			return fmt.Errorf("settle: saga resume: %w", err)
		}
	}
	if err := s.quiesce(ctx); err != nil {
		return err
	}
	// Every client asks again; a request answered before gets the same
	// answer. The processor sends its webhooks until they are answered
	// 2xx, whether or not they were sent before.
	for _, session := range append(sessions, s.h.webhook) {
		if !session.client {
			continue
		}
		if err := session.run(ctx, p); err != nil {
			return fmt.Errorf("settle: %s again: %w", session.name, err)
		}
	}
	for key, again := range p.answers {
		for _, q := range s.procs {
			if first, ok := q.answers[key]; ok && (first.Status != again.Status || first.Body != again.Body) {
				return fmt.Errorf("the retry of %s got %d %s, the first answer was %d %s", key, again.Status, again.Body, first.Status, first.Body)
			}
		}
	}
	return s.quiesce(ctx)
}

// quiesce runs the settler's workers until two passes in a row find
// nothing, the clock moving past every lease, backoff and the
// reconciler's bound between them.
func (s *isoSlot) quiesce(ctx context.Context) error {
	idle := 0
	for range 300 {
		n, err := s.settler.app.runWorkersOnce(ctx, s.settler.name)
		if err != nil {
			return fmt.Errorf("settle: workers: %w", err)
		}
		if n > 0 {
			idle = 0
			continue
		}
		if idle++; idle == 2 {
			return nil
		}
		s.clock.advance(2 * deliveryBound)
	}
	return errors.New("settle: the workers did not come to rest in 300 passes")
}

// oracle audits the slot's database: check's invariants, and what the
// ledger consumer and the repair log show.
func (s *isoSlot) oracle(ctx context.Context, settled bool) error {
	violations, err := audit(ctx, s.admin, s.clock.now(), settled)
	if err != nil {
		return err
	}
	var found []string
	for _, v := range violations {
		// What the fixture was built with (a failed event waiting for
		// an operator) is not the interleaving's doing; an event that
		// the broker refused to the end waits for an operator too, who
		// retries it when settling (but see "failed, though published"
		// below).
		if !settled && (s.known[v] || v.Invariant == failedEventsInvariant) {
			continue
		}
		found = append(found, v.Invariant+": "+v.Detail)
	}
	queries := []struct{ what, query string }{
		// An event fails once the broker refused its last attempt.
		// Nothing here dies between a publish and its mark, so one that
		// the broker has was published by a relay, then failed by a
		// relay whose lease had been taken over, counting a refusal
		// against it (recordPublishFailure's fence): it holds back every
		// later event of its order until an operator retries it.
		{"failed, though published", `SELECT event_id || ' failed after ' || attempts || ' attempts (' || COALESCE(last_error, '') || '), and the broker has it' FROM outbox_events e WHERE status = 'failed' AND EXISTS (SELECT 1 FROM broker_messages m WHERE m.message_id = e.event_id)`},
	}
	if settled {
		queries = append(queries, []struct{ what, query string }{
			{"applied more than once by " + isoLedger, `SELECT message_id || ' ' || applications || ' times' FROM iso_applied WHERE applications > 1`},
			{"never applied by " + isoLedger, `SELECT event_type || ' ' || event_id || ' of ' || aggregate_id || ' (' || status || ', delivery position ' || COALESCE(delivery_position::text, 'none') || ' against the cursor at ' || (SELECT position FROM delivery_cursor WHERE name = 'outbox') || ', inbox row ' || COALESCE((SELECT status FROM inbox_messages i WHERE i.consumer = 'iso-ledger' AND i.message_id = e.event_id), 'none') || ')' FROM outbox_events e WHERE NOT EXISTS (SELECT 1 FROM iso_applied a WHERE a.message_id = e.event_id)`},
			{"logged as finished by two refund finish runs", `SELECT target FROM repair_log WHERE action = 'refund finish' AND result LIKE '%; finished' GROUP BY target HAVING COUNT(*) > 1`},
			// What a repair repairs is set aside once here; two repairs of
			// it are two operators, or two workers, acting on one read.
			{"repaired twice", `SELECT action || ' ' || target FROM repair_log WHERE action IN ('saga resume', 'outbox retry', 'inbox replay') GROUP BY action, target HAVING COUNT(*) > 1`},
			// A saga held back by a constraint its own statements should
			// have kept (a conditional UPDATE split into a read and a write).
			{"a saga failed on an integrity constraint", `SELECT saga_id || ': ' || last_error FROM saga_instances WHERE last_error LIKE '%SQLSTATE 23%'`},
		}...)
	}
	for _, q := range queries {
		rows, err := s.admin.QueryContext(ctx, q.query)
		if err != nil {
			return fmt.Errorf("%s: %w", q.what, err)
		}
		for rows.Next() {
			var detail string
			if err := rows.Scan(&detail); err != nil {
				rows.Close()
				return err
			}
			found = append(found, q.what+": "+detail)
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return err
		}
	}
	if len(found) > 0 {
		return errors.New(strings.Join(found, "\n"))
	}
	return nil
}

// duplicatesOf returns how many publishes the broker and deliveries the
// inboxes of db absorbed as duplicates.
func duplicatesOf(ctx context.Context, db *sql.DB) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `
		SELECT (SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages) + (SELECT COALESCE(SUM(duplicates), 0) FROM inbox_messages)`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count duplicates: %w", err)
	}
	return n, nil
}

// runPair runs a and b through every interleaving: a paused before each
// of its statements while b runs, then b paused before each of its own
// while a runs (once for a session paired with itself: the two processes
// are alike). A pausedToo session that runs while the other is paused is
// paused as well, before each of its statements in turn, while the other
// goes on. It returns how many interleavings ran, and how many end states
// they reached.
func (h *isoHarness) runPair(t *testing.T, a, b isoSession) (ran, states int) {
	t.Helper()
	s := <-h.slots
	defer func() { h.slots <- s }()
	orders := [][2]isoSession{{a, b}}
	if a.name != b.name {
		orders = append(orders, [2]isoSession{b, a})
	}
	for _, order := range orders {
		// Only a late session is paused in turn: run first, it takes the
		// lease before the other wakes, which finds it taken or waits.
		both := order[1].pausedToo
		// What each end state settled to: most pauses leave the same
		// rows as the one before (the other session never met this
		// one's), and settle the same way.
		settled := map[string]bool{}
		for pauseAt := 1; ; pauseAt++ {
			var run isoRun
			// pauseB 0 lets the second run until it ends or waits.
			for pauseB := 0; ; pauseB++ {
				run = s.runOnce(t, order, pauseAt, pauseB, settled)
				ran++
				if !run.reached || !both || pauseB > 0 && !run.reachedB {
					break
				}
			}
			if !run.reached {
				break
			}
		}
		states += len(settled)
	}
	return ran, states
}

// runOnce runs one interleaving of order (see interleaveRuns) and checks
// it, settling and auditing an end state that settled holds not yet. It
// fails t if the interleaving went wrong.
func (s *isoSlot) runOnce(t *testing.T, order [2]isoSession, pauseAt, pauseB int, settled map[string]bool) isoRun {
	t.Helper()
	ctx := context.Background()
	run, err := s.interleave(ctx, order[0], order[1], pauseAt, pauseB)
	what := fmt.Sprintf("%s paused before its statement %d, %s run", order[0].name, pauseAt, order[1].name)
	if run.reachedB {
		what = fmt.Sprintf("%s paused before its statement %d, %s run and paused before its statement %d, %s run, %s run", order[0].name, pauseAt, order[1].name, pauseB, order[0].name, order[1].name)
	}
	if !run.reached {
		what = fmt.Sprintf("%s, then %s", order[0].name, order[1].name)
	}
	if err == nil {
		for i, sessionErr := range run.errs {
			if sessionErr != nil {
				err = fmt.Errorf("%s: %w", order[i].name, sessionErr)
			}
		}
	}
	if err == nil && order[0].alone && order[0].name == order[1].name {
		var n int
		if n, err = duplicatesOf(ctx, s.admin); err == nil && n != s.duplicates {
			err = fmt.Errorf("two at once did one thing twice: %d duplicates absorbed, the fixture had %d", n, s.duplicates)
		}
	}
	var state string
	if err == nil {
		state, err = s.stateOf(ctx)
	}
	if err == nil && !settled[state] {
		if err = s.oracle(ctx, false); err == nil {
			err = s.settle(ctx, []isoSession{order[0], order[1]})
		}
		if err == nil {
			err = s.oracle(ctx, true)
		}
		settled[state] = true
	}
	if err != nil {
		pausedB := 0
		if run.reachedB {
			pausedB = pauseB
		}
		t.Fatalf("%s:\n%v\n\n%s sent:\n%s\n\n%s sent:\n%s", what, err,
			order[0].name, isoStatements(run.statements[0], pauseAt), order[1].name, isoStatements(run.statements[1], pausedB))
	}
	return run
}

// isoStatements numbers statements, one line each, marking the one the
// session was paused before.
func isoStatements(statements []string, pauseAt int) string {
	var b strings.Builder
	for i, statement := range statements {
		mark := "  "
		if i+1 == pauseAt {
			mark = "->"
		}
		fmt.Fprintf(&b, "%s %2d %s\n", mark, i+1, strings.Join(strings.Fields(statement), " "))
	}
	return b.String()
}

// isoTablePattern finds the tables a statement names.
var isoTablePattern = regexp.MustCompile(`(?i)\b(?:FROM|JOIN|INTO|UPDATE)\s+([a-z_]+)`)

// isoTables returns the tables statements write and those they read.
func isoTables(statements []string) (writes, reads map[string]bool) {
	writes, reads = map[string]bool{}, map[string]bool{}
	for _, statement := range statements {
		for _, m := range isoTablePattern.FindAllStringSubmatch(statement, -1) {
			reads[m[1]] = true
		}
		for _, m := range regexp.MustCompile(`(?i)\b(?:INSERT INTO|UPDATE|DELETE FROM)\s+([a-z_]+)`).FindAllStringSubmatch(statement, -1) {
			writes[m[1]] = true
		}
	}
	return writes, reads
}

// Ensure no two operations at once on PostgreSQL, in any interleaving of
// their statements, break an invariant, lose or double an effect, or leave
// an order unsettled.
func TestTwoSessions(t *testing.T) {
	if !onPostgres() {
		t.Skipf("set %s to run pairs of operations at once on PostgreSQL", testPostgresEnv)
	}
	if testing.Short() {
		t.Skip("-short: pairs of operations at once take half a minute")
	}
	all := os.Getenv(isolationEnv) == "all"
	// The whole matrix runs in two slots at once: a session mostly waits
	// on the server, and two cores are busy enough with two pairs.
	slots := 1
	if all {
		slots = 2
	}
	h := newIsoHarness(t, slots)
	sessions := isoSessions(h.fixture)

	// Each session alone, to learn what it touches, and that every claim
	// that must never wait (isoClaims) is one a session sends.
	touches := map[string][2]map[string]bool{}
	claims := map[string]bool{}
	s := <-h.slots
	for _, session := range sessions {
		run, err := s.interleave(context.Background(), session, isoSession{name: "nothing", run: func(context.Context, *isoProcess) error { return nil }}, 1<<30, 0)
		if err == nil {
			err = run.errs[0]
		}
		if err != nil {
			t.Fatalf("%s alone: %v", session.name, err)
		}
		writes, reads := isoTables(run.statements[0])
		t.Logf("%s alone: %d statements", session.name, len(run.statements[0]))
		touches[session.name] = [2]map[string]bool{writes, reads}
		for _, statement := range run.statements[0] {
			if claim := isoClaimIn(statement); claim != "" {
				claims[claim] = true
			} else if strings.Contains(statement, "SKIP LOCKED") {
				t.Fatalf("%s sends a claim that isoClaims does not name: %s", session.name, statement)
			}
		}
	}
	h.slots <- s
	for claim := range isoClaims {
		if !claims[claim] {
			t.Fatalf("no session sends the claim isoClaims names %s", claim)
		}
	}

	// The quick subset: the pairs where faults were found, and a client's
	// duplicate request.
	quick := map[[2]string]bool{
		// The reconciler marked a replayed event delivered that no
		// consumer had applied (when delivery was a mark; now the
		// reconciler's cursor must not pass the replay's new position).
		{"inbox replay", "reconciler"}: true,
		// Cleanup deleted another consumer's week-old inbox row while a
		// replay put its event back in flight: applied twice.
		{"inbox replay", "cleanup"}: true,
		// Both logged one refund key as finished by them.
		{"refund finish", "refund finish"}: true,
		// A client's duplicate request waits for the first, and replays it.
		{"create", "create"}: true,
		// One key sent to create and to refund (a fault found on
		// PostgreSQL: a 500, when they took different locks).
		{"refund under a create's key", "create under a refund's key"}: true,
		// A refund request paused past its lease, and the client's retry
		// that takes its key over: the only test that sees the takeover's
		// conditions on the key's row, or a refund's transaction below
		// SERIALIZABLE.
		{"refund", "refund retried past the lease"}: true,
		// Two reconcilers: the second's claim skips what the first holds
		// instead of waiting for it (claimUndelivered without SKIP
		// LOCKED waited).
		{"reconciler", "reconciler"}: true,
		// Not here, though a fault was found in each, for their time (a
		// third more for the two): a relay whose lease was taken over
		// counted the broker's refusal against the event the new holder
		// had published ("relay refused by the broker" beside "relay
		// past the lease"), and a relay's mark did not wait for a
		// takeover of its lease that was committing ("relay" beside
		// "relay lease taken over"). TestOutbox and
		// TestOutboxConcurrentWriters find both in the quick run.
	}
	var pairs [][2]isoSession
	for i, a := range sessions {
		for _, b := range sessions[i:] {
			if !all && !quick[[2]string{a.name, b.name}] && !quick[[2]string{b.name, a.name}] {
				continue
			}
			if !isoShareATable(touches[a.name], touches[b.name]) {
				continue
			}
			if (a.lateFor != nil || b.lateFor != nil) && !slices.Contains(a.lateFor, b.name) && !slices.Contains(b.lateFor, a.name) {
				continue
			}
			if (a.onlyWith != nil && !slices.Contains(a.onlyWith, b.name)) || (b.onlyWith != nil && !slices.Contains(b.onlyWith, a.name)) {
				continue
			}
			pairs = append(pairs, [2]isoSession{a, b})
		}
	}
	sort.SliceStable(pairs, func(i, j int) bool { return pairs[i][0].name < pairs[j][0].name })
	var mu sync.Mutex
	total := 0
	count := func(t *testing.T, n, states int) {
		mu.Lock()
		defer mu.Unlock()
		total += n
		t.Logf("%d interleavings, %d end states", n, states)
	}
	t.Run("migrate/migrate", func(t *testing.T) {
		n := runMigrations(t, h.base, all)
		count(t, n, n)
	})
	// Each pair takes a slot; the group ends when every pair has.
	t.Run("pairs", func(t *testing.T) {
		for _, pair := range pairs {
			t.Run(pair[0].name+"/"+pair[1].name, func(t *testing.T) {
				t.Parallel()
				n, states := h.runPair(t, pair[0], pair[1])
				count(t, n, states)
			})
		}
	})
	t.Logf("%d pairs and migrate beside migrate, %d interleavings", len(pairs), total)
}

// isoMigrations is a schema of three versions, each of which fails if
// it is applied twice (as the real schema's do: "type utc_time already
// exists"). It tests migrate's discipline (the lock, the version read
// after it, a version per transaction) through every interleaving in a
// fraction of the time the real schema's DDL takes (half a second a
// migration on this machine); the real schema runs from its last version,
// and, in the whole matrix, from a new database.
var isoMigrations = []string{
	`CREATE DOMAIN iso_mig_time AS TEXT; CREATE TABLE iso_mig (id INTEGER PRIMARY KEY)`,
	`ALTER TABLE iso_mig ADD COLUMN note iso_mig_time`,
	`CREATE INDEX iso_mig_note ON iso_mig (note)`,
}

// runMigrations runs two processes starting at once on one database, at
// each older schema version, through every interleaving of their
// migrations: both must start, and leave the database at the newest
// version. isoMigrations run from each of their versions; with all, the
// real schema too, from its last version and from a new database. It
// returns how many interleavings ran.
func runMigrations(t *testing.T, base string, all bool) int {
	t.Helper()
	type start struct {
		migrations []string
		from       int
	}
	var starts []start
	for from := range isoMigrations {
		starts = append(starts, start{isoMigrations, from})
	}
	if all {
		real, err := schemaMigrations(schemaPostgresSQL)
		if err != nil {
			t.Fatal(err)
		}
		starts = append(starts, start{real, len(real) - 1}, start{real, 0})
	}
	ctx := context.Background()
	admin := mustConnect(t, base)
	ran := 0
	for _, start := range starts {
		// One schema for every interleaving from this start, emptied
		// before each; the real schema's takes a new one each time
		// (dropping its twenty tables is what creating it costs).
		url := testPostgresSchema(t, base)
		dbA, tracerA := openTracedPool(t, url, "iso-migrate-a")
		dbB, tracerB := openTracedPool(t, url, "iso-migrate-b")
		for pauseAt := 1; ; pauseAt++ {
			if pauseAt > 1 && len(start.migrations) != len(isoMigrations) {
				dbA.Close()
				dbB.Close()
				url = testPostgresSchema(t, base)
				dbA, tracerA = openTracedPool(t, url, "iso-migrate-a")
				dbB, tracerB = openTracedPool(t, url, "iso-migrate-b")
			}
			for _, statement := range []string{`DROP TABLE IF EXISTS iso_mig, schema_migrations`, `DROP DOMAIN IF EXISTS iso_mig_time`} {
				if _, err := dbA.ExecContext(ctx, statement); err != nil {
					t.Fatal(err)
				}
			}
			if start.from > 0 {
				if err := applyMigrations(ctx, dbA, start.migrations[:start.from]); err != nil {
					t.Fatal(err)
				}
			}
			migrate := func(db *sql.DB) func(ctx context.Context) error {
				return func(ctx context.Context) error { return applyMigrations(ctx, db, start.migrations) }
			}
			run, err := interleaveRuns(ctx, admin, pauseAt, 0,
				isoRunner{"migrate", tracerA, "iso-migrate-a", migrate(dbA)},
				isoRunner{"migrate", tracerB, "iso-migrate-b", migrate(dbB)})
			ran++
			for i, runErr := range run.errs {
				if err == nil && runErr != nil {
					err = fmt.Errorf("process %d: %w", i+1, runErr)
				}
			}
			var version int
			if err == nil {
				err = dbA.QueryRowContext(ctx, `SELECT MAX(version) FROM schema_migrations`).Scan(&version)
			}
			if err == nil && version != len(start.migrations) {
				err = fmt.Errorf("the database is at version %d, want %d", version, len(start.migrations))
			}
			if err != nil {
				t.Fatalf("%d versions, from version %d, one process paused before its statement %d:\n%v\n\nit sent:\n%s\n\nthe other sent:\n%s",
					len(start.migrations), start.from, pauseAt, err, isoStatements(run.statements[0], pauseAt), isoStatements(run.statements[1], 0))
			}
			if !run.reached {
				break
			}
		}
		dbA.Close()
		dbB.Close()
	}
	return ran
}

// isoShareATable reports whether one session writes a table the other
// reads or writes.
func isoShareATable(a, b [2]map[string]bool) bool {
	for table := range a[0] {
		if b[1][table] {
			return true
		}
	}
	for table := range b[0] {
		if a[1][table] {
			return true
		}
	}
	return false
}
