// The demo (the article's "full reference design, end to end"): one order
// arrives several times, and the business result happens once. Each step
// says which layer acted and what it prevented, and checks the outcome; the
// demo fails if any check fails.
//
// The API steps go over real HTTP to a server on a loopback port, so the
// reader sees exactly what a client sees. The background work (relay,
// consumers, saga) is driven one pass at a time, on a clock that moves only
// when the story says so, so every run prints the same thing and every pass
// is a place for a breakpoint.

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// demoStart is the demo clock's first instant.
var demoStart = time.Date(2026, 1, 15, 9, 0, 0, 0, time.UTC)

// demoAPIKey authenticates the demo's client as user-42.
const demoAPIKey = "sk_test_demo"

// newDemoCommand builds "retrysafe demo".
func newDemoCommand() *cobra.Command {
	var dbPath, brokerURL, logFormatFlag string
	var step, trace bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the scripted scenario: the same order arrives several times, the result happens once",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseLogFormat(logFormatFlag)
			if err != nil {
				return err
			}
			var pause func(title string)
			if step {
				if dbPath == "" {
					fmt.Fprintln(cmd.OutOrStdout(), "The demo pauses before each step. To watch the tables while it waits, run it with --db demo.db\n"+
						"and, in another terminal: go run . inspect --db demo.db (or: go run . trace --db demo.db ORDER_ID).")
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "The demo pauses before each step. To watch the tables while it waits, run in another terminal:\n"+
						"  go run . inspect --db %s        (or: go run . trace --db %s ORDER_ID)\n", dbPath, dbPath)
				}
				input := bufio.NewReader(cmd.InOrStdin())
				pause = func(title string) {
					fmt.Fprintf(cmd.OutOrStdout(), "\n[press Enter to run: %s] ", title)
					input.ReadString('\n')
				}
			}
			var traceLog *slog.Logger
			if trace {
				// Without the wall clock's time: the story runs on its own
				// clock.
				traceLog = newLogger(cmd.OutOrStdout(), format, &slog.HandlerOptions{
					ReplaceAttr: func(groups []string, attr slog.Attr) slog.Attr {
						if attr.Key == slog.TimeKey && len(groups) == 0 {
							return slog.Attr{}
						}
						return attr
					},
				})
			}
			return runDemoStopping(cmd.Context(), cmd.OutOrStdout(), dbPath, brokerURL, pause, nil, traceLog)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "", "keep the demo's database: a new SQLite file, or an empty PostgreSQL database's postgres:// URL (for 'retrysafe inspect')")
	cmd.Flags().BoolVar(&trace, "trace", false, "also log each background action (relay publish, inbox outcome, saga step) as it happens")
	cmd.Flags().StringVar(&logFormatFlag, "log-format", string(logText), "with --trace: log lines as text (key=value) or json (one object per line)")
	cmd.Flags().BoolVar(&step, "step", false, "pause before each step, to look at the tables in another terminal")
	cmd.Flags().StringVar(&brokerURL, "broker", "", "NATS JetStream URL (nats://127.0.0.1:4222) instead of the embedded broker; the demo uses a stream of its own and deletes it")
	return cmd
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
}

// demoNATSAckWait is the demo's AckWait on NATS JetStream: the clock the
// demo moves is not the server's, so its lost ack is redelivered after this
// much real time.
const demoNATSAckWait = time.Second

// runDemo runs the scenario against a new database at dbPath (a temporary
// file if empty), on NATS JetStream if brokerURL is set. pause, if set, is
// called before each step.
func runDemo(ctx context.Context, out io.Writer, dbPath, brokerURL string, pause func(title string)) error {
	return runDemoStopping(ctx, out, dbPath, brokerURL, pause, nil, nil)
}

// runDemoStopping is runDemo with stop, if set, called at every fault point
// the story passes, on the goroutine that reached it: a test holds it there
// as a breakpoint would. trace, if set, logs each background action (demo
// --trace), as serve logs them.
func runDemoStopping(ctx context.Context, out io.Writer, dbPath, brokerURL string, pause func(title string), stop func(ctx context.Context, point faultPoint), trace *slog.Logger) error {
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
	if brokerURL != "" {
		if err := checkBrokerURL(brokerURL); err != nil {
			return err
		}
		// A stream of this run's own, so that nothing from another run is
		// delivered to it.
		stream := fmt.Sprintf("RETRYSAFE_DEMO_%d", time.Now().UnixNano())
		var err error
		broker, err = openNATSBroker(ctx, brokerURL, stream, demoNATSAckWait)
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

	d := &demo{clock: newFakeClock(demoStart), out: out, pause: pause}
	// A seeded source makes the ids, and so the whole output, the same on
	// every run.
	ids := newIDs(rand.NewChaCha8([32]byte{'r', 'e', 't', 'r', 'y', 's', 'a', 'f', 'e'}))
	fault := func(ctx context.Context, point faultPoint) error {
		if stop != nil {
			stop(ctx, point)
		}
		if point == d.crashAt {
			d.crashAt = ""
			return errCrash
		}
		return nil
	}
	app, err := openApp(ctx, dbPath, d.clock.now, ids, fault)
	if err != nil {
		return err
	}
	defer app.db.Close()
	if trace != nil {
		app.log = trace
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

	if err := d.run(ctx); err != nil {
		fmt.Fprintf(out, "\nDEMO FAILED: %v\n", err)
		return err
	}
	if kept {
		fmt.Fprintf(out, "\nThe database is in %s: try \"go run . inspect --db '%s'\".\n", redactURL(dbPath), redactURL(dbPath))
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

// say narrates.
func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "   "+format+"\n", args...)
}

// check fails the demo unless ok, and prints what was checked.
func (d *demo) check(ok bool, format string, args ...any) error {
	what := fmt.Sprintf(format, args...)
	if !ok {
		return fmt.Errorf("check failed: %s", what)
	}
	fmt.Fprintf(d.out, "   ok: %s\n", what)
	return nil
}

// count runs a COUNT(*) query.
func (d *demo) count(ctx context.Context, query string, args ...any) int {
	var n int
	if err := d.app.db.QueryRowContext(ctx, query, args...).Scan(&n); err != nil {
		panic(fmt.Sprintf("bug: demo query %q: %v", query, err))
	}
	return n
}

// httpResult is what the demo's client saw.
type httpResult struct {
	status   int
	replayed bool
	body     []byte
}

// post sends a POST as the demo's client and prints the exchange.
func (d *demo) post(ctx context.Context, path, idempotencyKey, body string) (httpResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.base+path, strings.NewReader(body))
	if err != nil {
		return httpResult{}, err
	}
	req.Header.Set("Authorization", "Bearer "+demoAPIKey)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", idempotencyKey)
	fmt.Fprintf(d.out, "   POST %s  Idempotency-Key: %s\n   %s\n", path, idempotencyKey, body)
	return d.do(req)
}

// get sends a GET as the demo's client and prints the exchange.
func (d *demo) get(ctx context.Context, path string) (httpResult, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.base+path, nil)
	if err != nil {
		return httpResult{}, err
	}
	req.Header.Set("Authorization", "Bearer "+demoAPIKey)
	fmt.Fprintf(d.out, "   GET %s\n", path)
	return d.do(req)
}

// do sends req and prints the status line and the Idempotent-Replayed header.
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
	replayed := resp.Header.Get("Idempotent-Replayed")
	if replayed == "" {
		replayed = "-"
	}
	fmt.Fprintf(d.out, "   -> %s  Idempotent-Replayed: %s\n", resp.Status, replayed)
	return httpResult{status: resp.StatusCode, replayed: replayed == "true", body: body}, nil
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
	d.say("relay %s published %d event(s)", relayID, published)
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
		for _, result := range results {
			d.say("%s: message %s -> %s", name, result.MessageID, result.Outcome)
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

// runSagas runs one saga pass and prints each saga's steps.
func (d *demo) runSagas(ctx context.Context, orderID string) (sagaRow, []sagaStepRow, error) {
	if _, err := d.app.sagaOnce(ctx, "worker-1", sagaBatchSize); err != nil {
		return sagaRow{}, nil, err
	}
	var sagaID string
	if err := d.app.db.QueryRowContext(ctx, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID).Scan(&sagaID); err != nil {
		return sagaRow{}, nil, fmt.Errorf("find saga of %s: %w", orderID, err)
	}
	saga, steps, err := readSaga(ctx, d.app.db, sagaID)
	if err != nil {
		return sagaRow{}, nil, err
	}
	var parts []string
	for _, step := range steps {
		parts = append(parts, step.Name+"="+string(step.Status))
	}
	d.say("saga %s: %s", saga.Status, strings.Join(parts, " "))
	return saga, steps, nil
}

// The first order's request, as the client sends it and as it retries it:
// the same JSON with its fields in another order and other spacing.
const (
	demoOrderBody      = `{"amount_cents":5000,"currency":"usd","items":[{"sku":"sku-1","qty":2}],"payment_method":"pm_card_timeout"}`
	demoOrderRetry     = `{ "payment_method": "pm_card_timeout", "items": [ {"qty": 2, "sku": "sku-1"} ], "currency": "usd", "amount_cents": 5000 }`
	demoOrderOtherBody = `{"amount_cents":9900,"currency":"usd","items":[{"sku":"sku-1","qty":2}],"payment_method":"pm_card_timeout"}`
	demoDeclinedBody   = `{"amount_cents":1200,"currency":"usd","items":[{"sku":"sku-2","qty":3}],"payment_method":"pm_card_chargeDeclined"}`
	demoKey            = "pay-req-user-42-cart-7"
	demoDeclinedKey    = "pay-req-user-42-cart-8"
	demoRefundKey      = "refund-req-user-42-cart-7"
)

// run is the scenario.
func (d *demo) run(ctx context.Context) error {
	fmt.Fprintln(d.out, "retrysafe demo: the same order arrives several times; the business result happens once.")

	// 1. The first request.
	d.title("A first request creates the order")
	first, err := d.post(ctx, "/api/orders", demoKey, demoOrderBody)
	if err != nil {
		return err
	}
	orderID := orderField(first.body, "order_id")
	d.say("idempotency key: claimed, and the order, its OrderCreated event and this response committed in ONE transaction")
	if err := d.check(first.status == 201 && orderID != "", "201 Created with order %s", orderID); err != nil {
		return err
	}

	// 2. The retry.
	d.title("The network hiccups; the client retries with the same key")
	retry, err := d.post(ctx, "/api/orders", demoKey, demoOrderRetry)
	if err != nil {
		return err
	}
	d.say("idempotency key: same request (fields reordered, spacing changed: same canonical body), so the stored response is replayed")
	if err := d.check(retry.status == 201 && retry.replayed && bytes.Equal(retry.body, first.body), "replayed the first response byte for byte"); err != nil {
		return err
	}
	if err := d.check(d.count(ctx, `SELECT COUNT(*) FROM orders`) == 1 && d.count(ctx, `SELECT COUNT(*) FROM outbox_events`) == 1,
		"still 1 order and 1 outbox event: prevented a duplicate order"); err != nil {
		return err
	}

	// 3. Reuse with another body.
	d.title("A buggy client reuses the key for a different order")
	reused, err := d.post(ctx, "/api/orders", demoKey, demoOrderOtherBody)
	if err != nil {
		return err
	}
	d.say("idempotency key: the fingerprint differs, so the key is refused instead of replaying an answer to another question")
	if err := d.check(reused.status == 422 && strings.Contains(string(reused.body), string(problemKeyReused)),
		"422 %s, and still 1 order", problemKeyReused); err != nil {
		return err
	}

	// 4. The relay publishes, crashes before marking, and republishes.
	d.title("The relay publishes OrderCreated, then crashes before marking it published")
	d.crashAt = faultAfterPublish
	_, err = d.app.relayOnce(ctx, "relay-1", relayBatchSize)
	if err := d.check(errors.Is(err, errCrash), "relay-1 died after publishing (%v)", err); err != nil {
		return err
	}
	if err := d.check(d.count(ctx, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`) == 1,
		"the outbox still says pending: the event is not lost"); err != nil {
		return err
	}
	d.clock.advance(relayLease + time.Second)
	d.say("%s later relay-1's lease has passed; a new relay sweeps", relayLease+time.Second)
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}
	var eventID string
	if err := d.app.db.QueryRowContext(ctx, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID).Scan(&eventID); err != nil {
		return fmt.Errorf("read the OrderCreated event id: %w", err)
	}
	stored, dropped, err := d.app.broker.held(ctx, eventID)
	if err != nil {
		return err
	}
	d.say("outbox: published again with the same event_id as message id; the broker dropped the copy")
	if err := d.check(stored == 1 && dropped == 1,
		"1 message in the broker, 1 duplicate publish absorbed"); err != nil {
		return err
	}

	// 5. The ack is lost; the broker redelivers; the inbox skips.
	d.title("The payment service consumes OrderCreated, and dies before its ack reaches the broker")
	d.crashAt = faultAfterEffect
	applied, err := d.consume(ctx, paymentServiceConsumer)
	if err := d.check(errors.Is(err, errCrash) && len(applied) == 1 && applied[0].Outcome == inboxApplied,
		"the saga was started and the message recorded in the inbox, in one transaction; no ack was sent (%v)", err); err != nil {
		return err
	}
	d.clock.advance(d.ackWait + time.Second)
	d.say("%s later the broker has had no ack, so it delivers %s again", d.ackWait+time.Second, eventID)
	again, err := d.consumeRedelivery(ctx, paymentServiceConsumer)
	if err != nil {
		return err
	}
	d.say("inbox: (payment-svc, %s) is already recorded, so the effect is skipped and the message acked", eventID)
	if err := d.check(len(again) == 1 && again[0].Outcome == inboxDuplicate && again[0].MessageID == eventID &&
		d.count(ctx, `SELECT COUNT(*) FROM saga_instances`) == 1,
		"message id = outbox event_id; 1 saga started, not 2"); err != nil {
		return err
	}

	// 6. The saga: reserve, charge times out, retry with the same key.
	d.title("The saga reserves stock, and the card charge times out")
	saga, _, err := d.runSagas(ctx, orderID)
	if err != nil {
		return err
	}
	d.say("processor: charged the card, then the response was lost; the saga cannot know, so it will retry")
	if err := d.check(saga.Status == sagaInProgress && d.count(ctx, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, orderID) == 1,
		"the charge exists at the processor, the saga is waiting to retry charge_card"); err != nil {
		return err
	}
	d.clock.advance(2 * time.Second)
	d.say("2s later the saga retries charge_card with the same idempotency key %s", chargeKey(saga.SagaID))
	saga, _, err = d.runSagas(ctx, orderID)
	if err != nil {
		return err
	}
	var keyHits int
	if err := d.app.db.QueryRowContext(ctx, `SELECT key_hits FROM processor_charges WHERE order_id = ?`, orderID).Scan(&keyHits); err != nil {
		return fmt.Errorf("read processor key hits: %w", err)
	}
	d.say("processor: the key matched the first charge, so it answered with it instead of charging again")
	if err := d.check(saga.Status == sagaCompleted && keyHits == 1 &&
		d.count(ctx, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, orderID) == 1,
		"saga completed, 1 charge at the processor: prevented a double charge"); err != nil {
		return err
	}

	// 7. PaymentCaptured reaches the order service.
	d.title("PaymentCaptured goes out through the outbox; the order service marks the order paid")
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}
	if _, err := d.consume(ctx, orderServiceConsumer); err != nil {
		return err
	}
	paid, err := d.get(ctx, "/api/orders/"+orderID)
	if err != nil {
		return err
	}
	if err := d.check(orderField(paid.body, "status") == string(orderPaid), "order %s is paid", orderID); err != nil {
		return err
	}

	// 8. The declined card: compensation.
	d.title("A second order with a declined card is compensated")
	declined, err := d.post(ctx, "/api/orders", demoDeclinedKey, demoDeclinedBody)
	if err != nil {
		return err
	}
	declinedID := orderField(declined.body, "order_id")
	availableBefore := d.count(ctx, `SELECT available + reserved FROM stock_items WHERE sku = 'sku-2'`)
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}
	if _, err := d.consume(ctx, paymentServiceConsumer); err != nil {
		return err
	}
	saga, steps, err := d.runSagas(ctx, declinedID)
	if err != nil {
		return err
	}
	d.say("saga: charge_card failed (%s); only reserve_stock had run, so only it was undone", saga.FailureReason.String)
	if err := d.check(saga.Status == sagaCompensated && steps[0].Status == stepCompensated && steps[1].Status == stepFailed && steps[2].Status == stepPending,
		"reserve_stock compensated, charge_card failed, confirm never ran"); err != nil {
		return err
	}
	if err := d.check(d.count(ctx, `SELECT available FROM stock_items WHERE sku = 'sku-2'`) == availableBefore &&
		d.count(ctx, `SELECT reserved FROM stock_items WHERE sku = 'sku-2'`) == 0,
		"sku-2 stock is back: %d available, 0 reserved", availableBefore); err != nil {
		return err
	}
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}
	if _, err := d.consume(ctx, orderServiceConsumer); err != nil {
		return err
	}
	cancelled, err := d.get(ctx, "/api/orders/"+declinedID)
	if err != nil {
		return err
	}
	if err := d.check(orderField(cancelled.body, "status") == string(orderCancelled), "order %s is cancelled, not left paid", declinedID); err != nil {
		return err
	}

	// 9. A refund, retried.
	d.title("The customer gets a refund of the first order; the client retries that too")
	refundPathOfFirst := refundPath(orderID)
	refunded, err := d.post(ctx, refundPathOfFirst, demoRefundKey, `{"amount_cents":2000}`)
	if err != nil {
		return err
	}
	refundedAgain, err := d.post(ctx, refundPathOfFirst, demoRefundKey, `{"amount_cents":2000}`)
	if err != nil {
		return err
	}
	d.say("idempotency key: the refund went started -> refund_requested -> finished; the retry replays it")
	if err := d.check(refunded.status == 200 && !refunded.replayed && refundedAgain.replayed && bytes.Equal(refunded.body, refundedAgain.body) &&
		d.count(ctx, `SELECT COUNT(*) FROM processor_refunds`) == 1,
		"1 refund of 2000 at the processor"); err != nil {
		return err
	}
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}

	return d.summary(ctx, orderID, declinedID)
}

// summary prints the closing table: how often each thing was attempted, and
// how often it happened.
func (d *demo) summary(ctx context.Context, orderID, declinedID string) error {
	fmt.Fprintf(d.out, "\n== Every effect happened once ==\n")
	var eventID string
	err := d.app.db.QueryRowContext(ctx, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, orderID).Scan(&eventID)
	if err != nil {
		return fmt.Errorf("read the OrderCreated event id: %w", err)
	}
	orderCreatedStored, _, err := d.app.broker.held(ctx, eventID)
	if err != nil {
		return err
	}
	rows := []struct {
		effect    string
		attempts  string
		happened  int
		wantTimes int
	}{
		{"order created for " + demoKey, "3 POSTs", d.count(ctx, `SELECT COUNT(*) FROM orders WHERE idempotency_key = ?`, demoKey), 1},
		{"OrderCreated in the broker", "2 publishes", orderCreatedStored, 1},
		{"saga started by payment-svc", "2 deliveries", d.count(ctx, `SELECT COUNT(*) FROM saga_instances WHERE order_id = ?`, orderID), 1},
		{"card charged", "2 charge calls", d.count(ctx, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ? AND status = 'succeeded'`, orderID), 1},
		{"stock sold for the first order", "1 reservation", d.count(ctx, `SELECT COUNT(*) FROM stock_reservations WHERE order_id = ? AND status = 'sold'`, orderID), 1},
		{"order marked paid", "1 delivery", d.count(ctx, `SELECT COUNT(*) FROM inbox_messages i JOIN outbox_events e ON e.event_id = i.message_id WHERE e.aggregate_id = ? AND e.event_type = 'PaymentCaptured' AND i.status = 'done'`, orderID), 1},
		{"stock released for the declined order", "1 compensation", d.count(ctx, `SELECT COUNT(*) FROM stock_reservations WHERE order_id = ? AND status = 'released'`, declinedID), 1},
		{"declined order cancelled", "1 delivery", d.count(ctx, `SELECT COUNT(*) FROM orders WHERE order_id = ? AND status = 'cancelled'`, declinedID), 1},
		{"refund made", "2 POSTs", d.count(ctx, `SELECT COUNT(*) FROM processor_refunds`), 1},
	}
	fmt.Fprintf(d.out, "   %-40s %-16s %s\n", "effect", "attempts", "happened")
	for _, row := range rows {
		fmt.Fprintf(d.out, "   %-40s %-16s %d\n", row.effect, row.attempts, row.happened)
		if row.happened != row.wantTimes {
			return fmt.Errorf("check failed: %s happened %d times, want %d", row.effect, row.happened, row.wantTimes)
		}
	}
	violations, err := audit(ctx, d.app.db, d.clock.now(), true)
	if err != nil {
		return err
	}
	fmt.Fprintln(d.out)
	if err := printAudit(d.out, violations, true); err != nil {
		return fmt.Errorf("check failed: %w", err)
	}
	fmt.Fprintln(d.out, "\nAll checks passed.")
	return nil
}
