// The demo's harness: how the story is run (a server on a loopback port,
// a client without timeouts, a fault hook the story arms), how it talks
// and checks, and how it drives the background passes. The story itself
// is in demo.go; the naive code of demo --without in demo_without.go.

package main

import (
	"context"
	"database/sql/driver"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// demoOptions are the ways to run the demo.
type demoOptions struct {
	// dbPath keeps the demo's database there (a new SQLite file or an
	// empty PostgreSQL database); a temporary file if empty.
	dbPath string
	// brokerURL runs it on NATS JetStream instead of the embedded broker.
	brokerURL string
	// pause, if set, is called before each step (demo --step).
	pause func(title string)
	// stop, if set, is called at every fault point the story passes, on
	// the goroutine that reached it: a test holds it there as a
	// breakpoint would.
	stop func(ctx context.Context, point faultPoint)
	// trace, if set, logs each background action (demo --trace), as
	// serve logs them.
	trace *slog.Logger
	// without, if set, replaces that layer by the naive code the article
	// warns against (demo --without).
	without layer
}

// demo is the state of one demo run.
type demo struct {
	app    *App
	clock  *fakeClock
	out    io.Writer
	client *http.Client
	base   string
	// crashAt is the fault point at which the next pass dies, if set.
	crashAt faultPoint
	// ackWait is how long the broker waits for an ack before it delivers
	// again.
	ackWait time.Duration
	pause   func(title string)
	step    int
	// without is the layer replaced by naive code, if any; failed lists
	// the checks that failed then (the story goes on, to show the hole).
	without layer
	failed  []string
	// deliveries counts, per consumer and message id, the deliveries the
	// story saw handled and how many of them were applied, as the
	// consumer passes and the webhook's answers reported them once
	// committed: without the inbox no table records it.
	deliveries []*messageDeliveries

	// mu guards the faults below, which the server's goroutines reach.
	mu sync.Mutex
	// dropAt is the fault point at which the next request loses its
	// database connection, if set.
	dropAt faultPoint
	// holdAt is the fault point at which the next request waits until
	// release is closed, after closing held.
	holdAt        faultPoint
	held, release chan struct{}
}

// errConnectionDropped is the demo's transient failure: the database
// connection went away in the middle of a request.
var errConnectionDropped = fmt.Errorf("the connection to the database dropped: %w", driver.ErrBadConn)

// demoNATSAckWait is the demo's AckWait on NATS JetStream: the clock the
// demo moves is not the server's, so its lost ack is redelivered after this
// much real time.
const demoNATSAckWait = time.Second

// runDemo runs the scenario against a new database at dbPath (a temporary
// file if empty), on NATS JetStream if brokerURL is set. pause, if set, is
// called before each step.
func runDemo(ctx context.Context, out io.Writer, dbPath, brokerURL string, pause func(title string)) error {
	return runDemoWith(ctx, out, demoOptions{dbPath: dbPath, brokerURL: brokerURL, pause: pause})
}

// runDemoWith runs the scenario as opts say. Returns an error if a check
// failed; with opts.without, if the story showed the hole (it always
// should).
func runDemoWith(ctx context.Context, out io.Writer, opts demoOptions) error {
	dbPath := opts.dbPath
	kept := dbPath != ""
	if !kept {
		dir, err := os.MkdirTemp("", "retrysafe-demo-")
		if err != nil {
			return fmt.Errorf("create temporary directory: %w", err)
		}
		defer os.RemoveAll(dir)
		dbPath = filepath.Join(dir, "demo.db")
	} else if err := requireNewDatabase(ctx, dbPath); err != nil {
		return err
	}
	// Connect to the broker before the database is created: a mistyped
	// --broker must not leave a half-set-up database behind.
	var broker *natsBroker
	if opts.brokerURL != "" {
		if err := checkBrokerURL(opts.brokerURL); err != nil {
			return err
		}
		// A stream of this run's own, so that nothing from another run is
		// delivered to it.
		stream := fmt.Sprintf("RETRYSAFE_DEMO_%d", time.Now().UnixNano())
		var err error
		broker, err = openNATSBroker(ctx, opts.brokerURL, stream, demoNATSAckWait)
		if err != nil {
			return err
		}
		// Deferred after close, so it runs before it, on the same
		// connection.
		defer broker.close()
		defer func() {
			if err := broker.deleteStream(context.WithoutCancel(ctx)); err != nil {
				fmt.Fprintf(out, "could not delete the demo's NATS stream: %v\n", err)
			}
		}()
	}

	d := &demo{clock: newFakeClock(demoStart), out: out, pause: opts.pause, without: opts.without}
	// A seeded source makes the ids, and so the whole output, the same on
	// every run.
	ids := newIDs(rand.NewChaCha8([32]byte{'r', 'e', 't', 'r', 'y', 's', 'a', 'f', 'e'}))
	fault := func(ctx context.Context, point faultPoint) error {
		if opts.stop != nil {
			opts.stop(ctx, point)
		}
		if point == d.crashAt {
			d.crashAt = ""
			return errCrash
		}
		return d.requestFault(point)
	}
	app, err := openApp(ctx, dbPath, d.clock.now, ids, fault)
	if err != nil {
		return err
	}
	defer app.db.Close()
	// One request at a time, each in a transaction of its own: a step in
	// the debugger from the handler goes straight to it.
	app.withoutGroupCommit()
	app.withoutLayer(opts.without)
	if opts.trace != nil {
		app.log = opts.trace
	}
	d.app = app
	d.ackWait = app.leases.ackWait
	if broker != nil {
		app.broker = broker
		d.ackWait = demoNATSAckWait
		if err := app.subscribeConsumers(ctx); err != nil {
			return err
		}
	}

	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("listen on loopback: %w", err)
	}
	s := &server{
		app:           app,
		apiKeys:       map[string]string{demoAPIKey: devUserID},
		webhookSecret: []byte(devWebhookSecret),
		logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	// No timeouts, on the server or the client: the demo is stepped
	// through in a debugger, and a request held at a breakpoint for a
	// minute must still get its answer. (A timeout here would fail the
	// demo, or worse, make a paused request look like a lost one.) Nothing
	// in the story waits on the wall clock: it moves its own clock. serve
	// keeps newHTTPServer's limits.
	httpServer := newHTTPServer("", s.routes())
	httpServer.ReadHeaderTimeout = 0
	httpServer.ReadTimeout = 0
	httpServer.WriteTimeout = 0
	httpServer.IdleTimeout = 0
	go httpServer.Serve(listener)
	defer httpServer.Close()
	d.base = "http://" + listener.Addr().String()
	d.client = &http.Client{}

	if opts.without != "" {
		return d.runWithout(ctx)
	}
	if err := d.run(ctx); err != nil {
		fmt.Fprintf(out, "\nDEMO FAILED: %v\n", err)
		return err
	}
	if err := d.summary(ctx); err != nil {
		fmt.Fprintf(out, "\nDEMO FAILED: %v\n", err)
		return err
	}
	fmt.Fprintln(out, "\nAll checks passed.")
	if kept {
		fmt.Fprintf(out, "\nThe database is in %s: try \"go run . inspect --db '%s'\".\n", redactURL(dbPath), redactURL(dbPath))
	}
	return nil
}

// runWithout runs the story with d.without's layer replaced, to the end
// whatever fails, then says what went wrong. Returns an error unless the
// story ran clean, which would mean the demo no longer shows the hole.
func (d *demo) runWithout(ctx context.Context) error {
	h := layerHoles()[d.without]
	fmt.Fprintf(d.out, "Without the %s layer: %s.\n", d.without, h.naive)
	if err := d.run(ctx); err != nil {
		d.failed = append(d.failed, err.Error())
		fmt.Fprintf(d.out, "   FAILED: the story could not go on: %v\n", err)
	}
	story := len(d.failed)
	violations, broken, err := d.summaryWithout(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "\n== The hole: without the %s layer ==\n", d.without)
	fmt.Fprintf(d.out, "   %d check(s) of the story failed, %d row(s) of the closing tables are marked, and check found %d violation(s) of %d invariant(s).\n",
		story, len(d.failed)-story, violations, broken)
	if len(d.failed) == 0 && violations == 0 {
		return fmt.Errorf("without the %s layer the story still passed: the demo no longer shows its hole", d.without)
	}
	fmt.Fprintf(d.out, "   What went wrong: %s.\n", h.effect)
	fmt.Fprintf(d.out, "   The test that catches it: %s\n", h.test)
	return fmt.Errorf("without the %s layer: %d check(s) and table row(s) failed, %d invariant(s) broken", d.without, len(d.failed), broken)
}

// postDroppingAt is post, with the request's first pass through point
// failing as a dropped connection (d.dropAt): at a database fault point the
// database connection drops, at faultProcessorLoseResponse the processor's
// answer is lost on the way back.
func (d *demo) postDroppingAt(ctx context.Context, point faultPoint, path, idempotencyKey, body string) (httpResult, error) {
	d.mu.Lock()
	d.dropAt = point
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.dropAt = ""
		d.mu.Unlock()
	}()
	return d.post(ctx, path, idempotencyKey, body)
}

// requestFault is the part of the demo's fault hook that the server's
// goroutines reach: a dropped connection or a hold at d.dropAt, d.holdAt.
func (d *demo) requestFault(point faultPoint) error {
	d.mu.Lock()
	drop := point == d.dropAt
	if drop {
		d.dropAt = ""
	}
	hold := point == d.holdAt
	var held, release chan struct{}
	if hold {
		d.holdAt = ""
		held, release = d.held, d.release
	}
	d.mu.Unlock()
	if hold {
		close(held)
		<-release
	}
	if drop {
		return errConnectionDropped
	}
	return nil
}

// title starts a step.
func (d *demo) title(text string) {
	d.step++
	if d.pause != nil {
		d.pause(text)
	}
	fmt.Fprintf(d.out, "\n== %d. %s ==\n", d.step, text)
}

// say narrates what happened. It is called only after the check that
// shows it happened.
func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "   "+format+"\n", args...)
}

// check prints "ok: claim" if ok, then each line of why: what made it so.
// Otherwise the demo fails, saying what it observed instead; with a layer
// replaced (--without), the failure is printed and the story goes on.
func (d *demo) check(ok bool, claim, observed string, why ...string) error {
	if ok {
		fmt.Fprintf(d.out, "   ok: %s\n", claim)
		for _, line := range why {
			d.say("%s", line)
		}
		return nil
	}
	if d.without != "" {
		fmt.Fprintf(d.out, "   FAILED: %s\n           observed: %s\n", claim, observed)
		d.failed = append(d.failed, claim)
		return nil
	}
	return fmt.Errorf("check failed: %s; observed: %s", claim, observed)
}

// count runs a COUNT(*) query.
func (d *demo) count(ctx context.Context, query string, args ...any) int {
	var n int
	if err := d.app.db.QueryRowContext(ctx, query, args...).Scan(&n); err != nil {
		panic(fmt.Sprintf("bug: demo query %q: %v", query, err))
	}
	return n
}

// shortID shortens one id as shortIDs does ("ord_da217ec1").
func shortID(id string) string {
	return shortIDs(id)
}

// httpResult is what the demo's client saw.
type httpResult struct {
	status   int
	replayed bool
	body     []byte
}

// seen says what the client saw, for a failed check: the status, and the
// order it names or the problem's type.
func (r httpResult) seen() string {
	var fields struct {
		OrderID string `json:"order_id"`
		Type    string `json:"type"`
	}
	what := ""
	if err := json.Unmarshal(r.body, &fields); err == nil && fields.OrderID != "" {
		what = " order " + shortID(fields.OrderID)
	} else if err == nil && fields.Type != "" {
		what = " " + fields.Type
	}
	if r.replayed {
		what += " (replayed)"
	}
	return fmt.Sprintf("%d%s", r.status, what)
}

// post sends a POST as the demo's client and prints the exchange.
func (d *demo) post(ctx context.Context, path, idempotencyKey, body string) (httpResult, error) {
	fmt.Fprintf(d.out, "   POST %s  Idempotency-Key: %s\n   %s\n", shortIDs(path), idempotencyKey, body)
	result, err := d.send(ctx, path, idempotencyKey, body)
	if err != nil {
		return httpResult{}, err
	}
	d.printResult("", result)
	return result, nil
}

// send sends a POST as the demo's client, without printing it.
func (d *demo) send(ctx context.Context, path, idempotencyKey, body string) (httpResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.base+path, strings.NewReader(body))
	if err != nil {
		return httpResult{}, err
	}
	req.Header.Set("Authorization", "Bearer "+demoAPIKey)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", idempotencyKey)
	return d.do(req)
}

// get sends a GET as the demo's client and prints the exchange.
func (d *demo) get(ctx context.Context, path string) (httpResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.base+path, nil)
	if err != nil {
		return httpResult{}, err
	}
	req.Header.Set("Authorization", "Bearer "+demoAPIKey)
	fmt.Fprintf(d.out, "   GET %s\n", shortIDs(path))
	result, err := d.do(req)
	if err != nil {
		return httpResult{}, err
	}
	d.printResult("", result)
	return result, nil
}

// do sends req and reads the answer.
func (d *demo) do(req *http.Request) (httpResult, error) {
	resp, err := d.client.Do(req)
	if err != nil {
		return httpResult{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return httpResult{}, err
	}
	return httpResult{status: resp.StatusCode, replayed: resp.Header.Get("Idempotent-Replayed") == "true", body: body}, nil
}

// printResult prints the status line the client got, and the
// Idempotent-Replayed header when it is there.
func (d *demo) printResult(who string, result httpResult) {
	replayed := ""
	if result.replayed {
		replayed = "  Idempotent-Replayed: true"
	}
	fmt.Fprintf(d.out, "   %s-> %d %s%s\n", who, result.status, http.StatusText(result.status), replayed)
}

// orderField reads one string field of a JSON order.
func orderField(body []byte, field string) string {
	var fields map[string]any
	if err := json.Unmarshal(body, &fields); err != nil {
		return ""
	}
	value, _ := fields[field].(string)
	return value
}

// relay runs one relay pass as relayID and says what it did.
func (d *demo) relay(ctx context.Context, relayID string) (int, error) {
	published, err := d.app.relayOnce(ctx, relayID, relayBatchSize)
	if err != nil {
		return 0, err
	}
	d.say("%s published %d event(s)", relayID, published)
	return published, nil
}

// consume runs one pass of the named consumer and says what the inbox did.
// On an error it returns what the pass did before it.
func (d *demo) consume(ctx context.Context, name string) ([]receiveResult, error) {
	for _, c := range d.app.consumers() {
		if c.name != name {
			continue
		}
		results, err := d.app.consumeOnce(ctx, c, consumeBatchSize)
		d.tally(name, results...)
		for _, result := range results {
			outcome := string(result.Outcome)
			if result.Err != nil {
				outcome += " (" + shortIDs(result.Err.Error()) + ")"
			}
			d.say("%s: %s -> %s", name, shortID(result.MessageID), outcome)
		}
		return results, err
	}
	return nil, fmt.Errorf("bug: no consumer %s", name)
}

// consumeRedelivery runs passes of the named consumer until a message comes.
// The embedded broker has it at once (the demo moved its clock); NATS
// JetStream redelivers after demoNATSAckWait of real time. It gives up
// after demoRedeliveryPolls empty passes, counted rather than timed, so
// that a pass held at a breakpoint does not use up the wait.
func (d *demo) consumeRedelivery(ctx context.Context, name string) ([]receiveResult, error) {
	for poll := 1; ; poll++ {
		results, err := d.consume(ctx, name)
		if err != nil || len(results) > 0 {
			return results, err
		}
		if poll == demoRedeliveryPolls {
			return nil, fmt.Errorf("%s got no redelivery in %d passes, %s apart", name, demoRedeliveryPolls, demoRedeliveryPoll)
		}
		time.Sleep(demoRedeliveryPoll)
	}
}

// demoRedeliveryPoll and demoRedeliveryPolls: consumeRedelivery waits up to
// 100 × 100 ms, ten times demoNATSAckWait, for a redelivery.
const (
	demoRedeliveryPoll  = 100 * time.Millisecond
	demoRedeliveryPolls = 100
)

// runSagas runs one saga pass and prints the saga of orderID.
func (d *demo) runSagas(ctx context.Context, orderID string) (sagaRow, []sagaStepRow, error) {
	if _, err := d.app.sagaOnce(ctx, "worker-1", sagaBatchSize); err != nil {
		return sagaRow{}, nil, err
	}
	var sagaID string
	if err := d.app.db.QueryRowContext(ctx, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID).Scan(&sagaID); err != nil {
		return sagaRow{}, nil, fmt.Errorf("find saga of %s: %w", orderID, err)
	}
	saga, recorded, err := readSaga(ctx, d.app.db, sagaID)
	if err != nil {
		return sagaRow{}, nil, err
	}
	// A step that has not run has no row: it is shown pending.
	steps := withPendingSteps(recorded)
	d.say("saga %s: %s", saga.Status, stepsLine(steps))
	return saga, steps, nil
}

// stepsLine is a saga's steps as "reserve_stock=done charge_card=pending ...".
func stepsLine(steps []sagaStepRow) string {
	var parts []string
	for _, step := range steps {
		parts = append(parts, step.Name+"="+string(step.Status))
	}
	return strings.Join(parts, " ")
}

// settle runs the background work (relay, consumers, sagas) until a pass
// finds nothing to do, and says how much it did.
func (d *demo) settle(ctx context.Context) error {
	published, applied, steps := 0, 0, 0
	for pass := 0; pass < 10; pass++ {
		n, err := d.app.relayOnce(ctx, "relay-2", relayBatchSize)
		if err != nil {
			return err
		}
		did := n
		published += n
		for _, c := range d.app.consumers() {
			results, err := d.app.consumeOnce(ctx, c, consumeBatchSize)
			if err != nil {
				return err
			}
			d.tally(c.name, results...)
			did += len(results)
			for _, result := range results {
				if result.Outcome == inboxApplied {
					applied++
				}
			}
		}
		n, err = d.app.sagaOnce(ctx, "worker-1", sagaBatchSize)
		if err != nil {
			return err
		}
		did += n
		steps += n
		if did == 0 {
			break
		}
	}
	d.say("the relay, the consumers and the saga run: %d event(s) published, %d message(s) applied, %d saga pass(es)", published, applied, steps)
	return nil
}

// messageDeliveries is how often one message came to one consumer in the
// story, and how often the consumer applied it.
type messageDeliveries struct {
	consumer, messageID string
	delivered, applied  int
}

// tally counts results, committed by consumer, in d.deliveries. consumeOnce
// returns results only once their transaction committed (a pass that dies
// after the commit, before its acks, returns them with its error).
func (d *demo) tally(consumer string, results ...receiveResult) {
	for _, result := range results {
		var counted *messageDeliveries
		for _, m := range d.deliveries {
			if m.consumer == consumer && m.messageID == result.MessageID {
				counted = m
			}
		}
		if counted == nil {
			counted = &messageDeliveries{consumer: consumer, messageID: result.MessageID}
			d.deliveries = append(d.deliveries, counted)
		}
		counted.delivered++
		if result.Outcome == inboxApplied {
			counted.applied++
		}
	}
}
