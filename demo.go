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
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
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
	var dbPath, brokerURL, without, logFormatFlag string
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
			opts := demoOptions{dbPath: dbPath, brokerURL: brokerURL}
			if without != "" {
				if opts.without, err = parseLayer(without); err != nil {
					return err
				}
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
			opts.pause = pause
			if trace {
				// Without the wall clock's time: the story runs on its own
				// clock.
				opts.trace = newLogger(cmd.OutOrStdout(), format, &slog.HandlerOptions{
					ReplaceAttr: func(groups []string, attr slog.Attr) slog.Attr {
						if attr.Key == slog.TimeKey && len(groups) == 0 {
							return slog.Attr{}
						}
						return attr
					},
				})
			}
			return runDemoWith(cmd.Context(), cmd.OutOrStdout(), opts)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "", "keep the demo's database: a new SQLite file, or an empty PostgreSQL database's postgres:// URL (for 'retrysafe inspect')")
	cmd.Flags().BoolVar(&trace, "trace", false, "also log each background action (relay publish, inbox outcome, saga step) as it happens")
	cmd.Flags().StringVar(&logFormatFlag, "log-format", string(logText), "with --trace: log lines as text (key=value) or json (one object per line)")
	cmd.Flags().BoolVar(&step, "step", false, "pause before each step, to look at the tables in another terminal")
	cmd.Flags().StringVar(&without, "without", "", "replace one layer (idempotency, outbox, inbox or saga) by the naive code the article warns against, and watch the story break")
	cmd.Flags().StringVar(&brokerURL, "broker", "", "NATS JetStream URL (nats://127.0.0.1:4222) instead of the embedded broker; the demo uses a stream of its own and deletes it")
	return cmd
}

// The first order's request, as the client sends it and as it retries it:
// the same JSON with its fields in another order and other spacing.
const (
	demoOrderBody      = `{"amount_cents":5000,"currency":"usd","items":[{"sku":"sku-1","qty":2}],"payment_method":"pm_card_timeout"}`
	demoOrderRetry     = `{ "payment_method": "pm_card_timeout", "items": [ {"qty": 2, "sku": "sku-1"} ], "currency": "usd", "amount_cents": 5000 }`
	demoOrderOtherBody = `{"amount_cents":9900,"currency":"usd","items":[{"sku":"sku-1","qty":2}],"payment_method":"pm_card_timeout"}`
	demoDeclinedBody   = `{"amount_cents":1200,"currency":"usd","items":[{"sku":"sku-2","qty":3}],"payment_method":"pm_card_chargeDeclined"}`
	demoRaceBody       = `{"amount_cents":2500,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`
	demoDroppedBody    = `{"amount_cents":1800,"currency":"usd","items":[{"sku":"sku-2","qty":1}],"payment_method":"pm_card_visa"}`
	demoRefundBody     = `{"amount_cents":2000}`
	demoKey            = "pay-req-user-42-cart-7"
	demoDeclinedKey    = "pay-req-user-42-cart-8"
	demoRaceKey        = "pay-req-user-42-cart-9"
	demoDroppedKey     = "pay-req-user-42-cart-10"
	demoRefundKey      = "refund-req-user-42-cart-7"
	// demoDashboardRefund is the processor's key for a refund made in its
	// dashboard, not through our API: only its webhook tells us.
	demoDashboardRefund = "dashboard-refund-cart-7"
	demoWebhookEventID  = "evt_processor_1"
)

// demoWait is how long the racing client's request is watched for an
// answer while the first one holds the key: it must not get one.
const demoWait = 200 * time.Millisecond

// ordersOfKey counts the orders made under an idempotency key.
func (d *demo) ordersOfKey(ctx context.Context, key string) int {
	return d.count(ctx, `SELECT COUNT(*) FROM orders WHERE idempotency_key = ?`, key)
}

// orderOfKey returns the id of the first order made under key, if any.
func (d *demo) orderOfKey(ctx context.Context, key string) string {
	var orderID string
	err := d.app.db.QueryRowContext(ctx, `SELECT order_id FROM orders WHERE idempotency_key = ? ORDER BY created_at, order_id LIMIT 1`, key).Scan(&orderID)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		panic(fmt.Sprintf("bug: demo query: %v", err))
	}
	return orderID
}

// run is the scenario.
func (d *demo) run(ctx context.Context) error {
	fmt.Fprintln(d.out, "retrysafe demo: the same order arrives several times; the business result happens once.")
	fmt.Fprintln(d.out, "(ids are shortened to their first 8 hex digits)")
	if err := d.retries(ctx); err != nil {
		return err
	}
	orderID := d.orderOfKey(ctx, demoKey)
	if err := d.relayCrash(ctx, orderID); err != nil {
		return err
	}
	if err := d.lostAck(ctx, orderID); err != nil {
		return err
	}
	if err := d.chargeTimeout(ctx, orderID); err != nil {
		return err
	}
	if err := d.compensation(ctx); err != nil {
		return err
	}
	if err := d.refund(ctx, orderID); err != nil {
		return err
	}
	if err := d.race(ctx); err != nil {
		return err
	}
	if err := d.droppedConnection(ctx); err != nil {
		return err
	}
	if err := d.webhookTwice(ctx, orderID); err != nil {
		return err
	}
	return d.expiredKey(ctx, orderID)
}

// retries is the idempotency key at work: a request, its retry, and a key
// reused for another request.
func (d *demo) retries(ctx context.Context) error {
	d.title("A first request creates the order")
	first, err := d.post(ctx, "/api/orders", demoKey, demoOrderBody)
	if err != nil {
		return err
	}
	orderID := orderField(first.body, "order_id")
	events := d.count(ctx, `SELECT COUNT(*) FROM outbox_events WHERE aggregate_id = ? AND event_type = ?`, orderID, eventOrderCreated)
	keys := d.count(ctx, `SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = ? AND response_status = 201`, demoKey)
	err = d.check(first.status == 201 && orderID != "" && events == 1 && keys == 1, "201 Created, order "+shortID(orderID)+"; its OrderCreated event and the key's answer are stored",
		fmt.Sprintf("%s; %d OrderCreated event(s) in the outbox, %d stored answer(s)", first.seen(), events, keys),
		"idempotency key: claimed, and the order, its OrderCreated event and this response committed in ONE transaction")
	if err != nil {
		return err
	}

	d.title("The network hiccups; the client retries with the same key")
	retry, err := d.post(ctx, "/api/orders", demoKey, demoOrderRetry)
	if err != nil {
		return err
	}
	err = d.check(retry.status == 201 && retry.replayed && bytes.Equal(retry.body, first.body), "replayed the first response byte for byte", retry.seen(),
		"idempotency key: the same request (fields reordered, spacing changed: the same canonical body), so the stored response was replayed")
	if err != nil {
		return err
	}
	orders := d.ordersOfKey(ctx, demoKey)
	events = d.count(ctx, `SELECT COUNT(*) FROM outbox_events`)
	err = d.check(orders == 1 && events == 1, "still 1 order and 1 outbox event: prevented a duplicate order",
		fmt.Sprintf("%d orders under %s, %d outbox events", orders, demoKey, events))
	if err != nil {
		return err
	}

	d.title("A buggy client reuses the key for a different order")
	reused, err := d.post(ctx, "/api/orders", demoKey, demoOrderOtherBody)
	if err != nil {
		return err
	}
	orders = d.ordersOfKey(ctx, demoKey)
	return d.check(reused.status == 422 && strings.Contains(string(reused.body), string(problemKeyReused)) && orders == 1,
		fmt.Sprintf("422 %s, and still 1 order", problemKeyReused), fmt.Sprintf("%s; %d orders under the key", reused.seen(), orders),
		"idempotency key: the fingerprint differs, so the key was refused instead of replaying an answer to another question")
}

// relayCrash is the outbox at work: the relay dies between publishing and
// marking, and the next relay publishes the same event again.
func (d *demo) relayCrash(ctx context.Context, orderID string) error {
	d.title("The relay publishes OrderCreated, then crashes before marking it published")
	d.crashAt = faultAfterPublish
	_, err := d.app.relayOnce(ctx, "relay-1", relayBatchSize)
	d.crashAt = ""
	if err := d.check(errors.Is(err, errCrash), "relay-1 died after publishing", fmt.Sprintf("relay-1 returned %v", err)); err != nil {
		return err
	}
	pending := d.count(ctx, `SELECT COUNT(*) FROM outbox_events WHERE aggregate_id = ? AND status = 'pending'`, orderID)
	if err := d.check(pending == 1, "the outbox still says pending: the event is not lost", fmt.Sprintf("%d pending events of the order", pending)); err != nil {
		return err
	}
	d.clock.advance(relayLease + time.Second)
	d.say("%s later relay-1's lease has passed; a new relay sweeps", relayLease+time.Second)
	if _, err := d.relay(ctx, "relay-2"); err != nil {
		return err
	}
	var eventID string
	err = d.app.db.QueryRowContext(ctx, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID).Scan(&eventID)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("read the OrderCreated event id: %w", err)
	}
	stored, dropped, err := d.app.broker.held(ctx, eventID)
	if err != nil {
		return err
	}
	return d.check(stored == 1 && dropped == 1, "1 message in the broker, 1 duplicate publish absorbed",
		fmt.Sprintf("the broker holds %d message(s) with the event's id and dropped %d", stored, dropped),
		"outbox: published again with the same event_id as message id; the broker dropped the copy")
}

// lostAck is the inbox at work: the consumer applies, dies before its ack,
// and the redelivery is skipped.
func (d *demo) lostAck(ctx context.Context, orderID string) error {
	d.title("The payment service consumes OrderCreated, and dies before its ack reaches the broker")
	var eventID string
	err := d.app.db.QueryRowContext(ctx, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = ?`, orderID, eventOrderCreated).Scan(&eventID)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("read the OrderCreated event id: %w", err)
	}
	d.crashAt = faultAfterEffect
	applied, err := d.consume(ctx, paymentServiceConsumer)
	d.crashAt = ""
	sagas := d.count(ctx, `SELECT COUNT(*) FROM saga_instances WHERE order_id = ?`, orderID)
	err = d.check(errors.Is(err, errCrash) && len(applied) == 1 && applied[0].Outcome == inboxApplied && sagas == 1,
		"the saga was started; the consumer died before its ack",
		fmt.Sprintf("%d message(s) handled, error %v; %d saga(s) for the order", len(applied), err, sagas))
	if err != nil {
		return err
	}
	recorded := d.count(ctx, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND message_id = ?`, paymentServiceConsumer, eventID)
	err = d.check(recorded == 1, "the message was recorded in payment-svc's inbox",
		fmt.Sprintf("%d inbox row(s) for (%s, %s)", recorded, paymentServiceConsumer, shortID(eventID)),
		"inbox: its row and the saga were written in one transaction, so neither is there without the other")
	if err != nil {
		return err
	}
	d.clock.advance(d.ackWait + time.Second)
	d.say("%s later the broker has had no ack, so it delivers the message again", d.ackWait+time.Second)
	again, err := d.consumeRedelivery(ctx, paymentServiceConsumer)
	if err != nil {
		return err
	}
	sagas = d.count(ctx, `SELECT COUNT(*) FROM saga_instances WHERE order_id = ?`, orderID)
	outcomes := make([]string, len(again))
	for i, result := range again {
		outcomes[i] = string(result.Outcome)
	}
	err = d.check(len(again) == 1 && again[0].Outcome == inboxDuplicate && again[0].MessageID == eventID,
		"the redelivery was skipped as a duplicate: message id = outbox event_id",
		fmt.Sprintf("the redelivery was %s", strings.Join(outcomes, ", ")),
		fmt.Sprintf("inbox: (payment-svc, %s) was already recorded, so the effect was skipped and the message acked", shortID(eventID)))
	if err != nil {
		return err
	}
	return d.check(sagas == 1, "1 saga started, not 2", fmt.Sprintf("%d saga(s) for the order", sagas))
}

// chargeTimeout is the saga at work: the charge's answer is lost, and the
// retry with the same key finds the first charge.
func (d *demo) chargeTimeout(ctx context.Context, orderID string) error {
	d.title("The saga reserves stock, and the card charge times out")
	saga, _, err := d.runSagas(ctx, orderID)
	if err != nil {
		return err
	}
	charges := d.count(ctx, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, orderID)
	err = d.check(saga.Status == sagaInProgress && charges == 1, "the charge exists at the processor, the saga is waiting to retry charge_card",
		fmt.Sprintf("saga %s, %d charge(s) at the processor", saga.Status, charges),
		"processor: charged the card, then the response was lost; the saga cannot know, so it will retry")
	if err != nil {
		return err
	}
	d.clock.advance(2 * time.Second)
	d.say("2s later the saga retries charge_card with the same idempotency key %s", shortIDs(chargeKey(saga.SagaID)))
	saga, _, err = d.runSagas(ctx, orderID)
	if err != nil {
		return err
	}
	var keyHits int
	err = d.app.db.QueryRowContext(ctx, `SELECT COALESCE(SUM(key_hits), 0) FROM processor_charges WHERE order_id = ?`, orderID).Scan(&keyHits)
	if err != nil {
		return fmt.Errorf("read processor key hits: %w", err)
	}
	charges = d.count(ctx, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, orderID)
	err = d.check(saga.Status == sagaCompleted && keyHits == 1 && charges == 1, "saga completed, 1 charge at the processor: prevented a double charge",
		fmt.Sprintf("saga %s, %d charge(s), the key matched %d time(s)", saga.Status, charges, keyHits),
		"processor: the key matched the first charge, so it answered with it instead of charging again")
	if err != nil {
		return err
	}

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
	status := orderField(paid.body, "status")
	return d.check(status == string(orderPaid), "order "+shortID(orderID)+" is paid", "the order is "+status)
}

// compensation is the saga's other half: a declined card undoes the steps
// that ran.
func (d *demo) compensation(ctx context.Context) error {
	d.title("A second order with a declined card is compensated")
	declined, err := d.post(ctx, "/api/orders", demoDeclinedKey, demoDeclinedBody)
	if err != nil {
		return err
	}
	declinedID := orderField(declined.body, "order_id")
	const sku2Reserved = `SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku = 'sku-2' AND r.status = 'reserved' AND NOT ` + soldHold
	stocked := d.count(ctx, `SELECT available FROM stock_items WHERE sku = 'sku-2'`) + d.count(ctx, sku2Reserved)
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
	err = d.check(saga.Status == sagaCompensated && len(steps) == 3 &&
		steps[0].Status == stepCompensated && steps[1].Status == stepFailed && steps[2].Status == stepPending,
		"reserve_stock compensated, charge_card failed, confirm never ran", fmt.Sprintf("saga %s: %s", saga.Status, stepsLine(steps)),
		fmt.Sprintf("saga: charge_card failed (%s); only reserve_stock had run, so only it was undone", saga.FailureReason.String))
	if err != nil {
		return err
	}
	available := d.count(ctx, `SELECT available FROM stock_items WHERE sku = 'sku-2'`)
	reserved := d.count(ctx, sku2Reserved)
	err = d.check(available == stocked && reserved == 0, fmt.Sprintf("sku-2 stock is back: %d available, 0 reserved", stocked),
		fmt.Sprintf("sku-2: %d available, %d reserved", available, reserved))
	if err != nil {
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
	status := orderField(cancelled.body, "status")
	return d.check(status == string(orderCancelled), "order "+shortID(declinedID)+" is cancelled, not left paid", "the order is "+status)
}

// refund is a refund's atomic phases: the processor's answer to the
// refund is lost, and the client's retry resumes from the recovery point
// the first request reached.
func (d *demo) refund(ctx context.Context, orderID string) error {
	d.title("The customer asks for a refund of the first order; the processor's answer is lost, and the client retries")
	lost, err := d.postDroppingAt(ctx, faultProcessorLoseResponse, refundPath(orderID), demoRefundKey, demoRefundBody)
	if err != nil {
		return err
	}
	keyAt := func(point recoveryPoint) int {
		return d.count(ctx, `SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = ? AND recovery_point = ? AND locked_by IS NULL`, demoRefundKey, string(point))
	}
	refunds, waiting := d.count(ctx, `SELECT COUNT(*) FROM processor_refunds`), keyAt(recoveryRefundRequested)
	err = d.check(lost.status == 503 && refunds == 1 && waiting == 1,
		"503; the processor made the refund, and the key waits at refund_requested, released",
		fmt.Sprintf("%s; %d refund(s) at the processor, %d key(s) released at refund_requested", lost.seen(), refunds, waiting),
		"recovery points: the first phase committed started -> refund_requested before the call;",
		"the answer was lost on the way back, so nothing after the call was stored")
	if err != nil {
		return err
	}
	refunded, err := d.post(ctx, refundPath(orderID), demoRefundKey, demoRefundBody)
	if err != nil {
		return err
	}
	refunds, finished := d.count(ctx, `SELECT COUNT(*) FROM processor_refunds`), keyAt(recoveryFinished)
	hits := d.count(ctx, `SELECT COALESCE(SUM(key_hits), 0) FROM processor_refunds`)
	err = d.check(refunded.status == 200 && !refunded.replayed && refunds == 1 && hits == 1 && finished == 1,
		"the retry resumed at refund_requested: 200, still 1 refund of 2000 at the processor",
		fmt.Sprintf("%s; %d refund(s) at the processor, %d key hit(s), %d key(s) finished", refunded.seen(), refunds, hits, finished),
		"it asked the processor again under the refund's own key, answered from that key,",
		"then recorded the refund and its answer: refund_requested -> finished")
	if err != nil {
		return err
	}
	refundedAgain, err := d.post(ctx, refundPath(orderID), demoRefundKey, demoRefundBody)
	if err != nil {
		return err
	}
	refunds = d.count(ctx, `SELECT COUNT(*) FROM processor_refunds`)
	err = d.check(refundedAgain.replayed && bytes.Equal(refunded.body, refundedAgain.body) && refunds == 1,
		"a third try replays the answer byte for byte; 1 refund of 2000 at the processor",
		fmt.Sprintf("%s; %d refund(s) at the processor", refundedAgain.seen(), refunds),
		"idempotency key: a finished key replays")
	if err != nil {
		return err
	}
	_, err = d.relay(ctx, "relay-2")
	return err
}

// race is two requests with one new key at once: the second waits for the
// first's transaction, then replays its answer.
func (d *demo) race(ctx context.Context) error {
	d.title("Two clients send one new key at the same moment")
	// A second later, so that a timeline keeps the steps apart.
	d.clock.advance(time.Second)
	fmt.Fprintf(d.out, "   POST /api/orders  Idempotency-Key: %s  (from clients A and B)\n   %s\n", demoRaceKey, demoRaceBody)
	type answer struct {
		result httpResult
		err    error
	}
	send := func(done chan<- answer) {
		result, err := d.send(ctx, "/api/orders", demoRaceKey, demoRaceBody)
		done <- answer{result, err}
	}
	d.mu.Lock()
	d.holdAt, d.held, d.release = faultAfterKeyClaim, make(chan struct{}), make(chan struct{})
	held, release := d.held, d.release
	d.mu.Unlock()
	aDone, bDone := make(chan answer, 1), make(chan answer, 1)
	go send(aDone)
	// A holds the key inside its transaction (or, without the key, has
	// already answered).
	var a answer
	aAnswered := false
	select {
	case <-held:
	case a = <-aDone:
		aAnswered = true
	}
	go send(bDone)
	var b answer
	bEarly := false
	select {
	case b = <-bDone:
		bEarly = true
	case <-time.After(demoWait):
	}
	d.mu.Lock()
	d.holdAt = ""
	d.mu.Unlock()
	close(release)
	if !aAnswered {
		a = <-aDone
	}
	if !bEarly {
		b = <-bDone
	}
	if a.err != nil {
		return a.err
	}
	if b.err != nil {
		return b.err
	}
	d.printResult("A ", a.result)
	d.printResult("B ", b.result)
	orders := d.ordersOfKey(ctx, demoRaceKey)
	return d.check(!bEarly && a.result.status == 201 && b.result.status == 201 && b.result.replayed && bytes.Equal(a.result.body, b.result.body) && orders == 1,
		"B waited for A's transaction, then got A's answer replayed; 1 order",
		fmt.Sprintf("A: %s; B (answered while A held the key: %t): %s; %d order(s) under the key", a.result.seen(), bEarly, b.result.seen(), orders),
		"idempotency key: A claimed it; B's transaction could not begin until A's committed, then found A's answer")
}

// droppedConnection is a transient failure: nothing is stored, so the key
// is free and the retry does the work.
func (d *demo) droppedConnection(ctx context.Context) error {
	d.title("The database connection drops in the middle of a request; the retry goes through")
	// A second later, so that a timeline keeps the steps apart.
	d.clock.advance(time.Second)
	dropped, err := d.postDroppingAt(ctx, faultAfterBusinessWrite, "/api/orders", demoDroppedKey, demoDroppedBody)
	if err != nil {
		return err
	}
	orders, keys := d.ordersOfKey(ctx, demoDroppedKey), d.count(ctx, `SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = ?`, demoDroppedKey)
	err = d.check(dropped.status == 503 && orders == 0 && keys == 0, "503 Service Unavailable; no order and no key stored",
		fmt.Sprintf("%s; %d order(s), %d key row(s)", dropped.seen(), orders, keys),
		"the order and its event were written, then the connection dropped before COMMIT: all of it rolled back, the key's claim too")
	if err != nil {
		return err
	}
	retried, err := d.post(ctx, "/api/orders", demoDroppedKey, demoDroppedBody)
	if err != nil {
		return err
	}
	orders = d.ordersOfKey(ctx, demoDroppedKey)
	err = d.check(retried.status == 201 && !retried.replayed && orders == 1, "the retry created the order: 201, not a replay; 1 order",
		fmt.Sprintf("%s; %d order(s)", retried.seen(), orders),
		"idempotency key: a transient failure stores no outcome, so the key was free for the retry")
	if err != nil {
		return err
	}
	if err := d.settle(ctx); err != nil {
		return err
	}
	unknown := d.count(ctx, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND status = 'poison'`, paymentServiceConsumer)
	return d.check(unknown == 0, "every OrderCreated the payment service got was about an order that exists",
		fmt.Sprintf("payment-svc set aside %d message(s) as poison: OrderCreated for orders that do not exist", unknown),
		"outbox: the failed attempt's event rolled back with its order; only committed events were published")
}

// webhookTwice is the processor's side: a webhook delivered twice changes
// the order once.
func (d *demo) webhookTwice(ctx context.Context, orderID string) error {
	d.title("The processor sends a webhook twice")
	// A second later, so that a timeline keeps the steps apart.
	d.clock.advance(time.Second)
	var chargeID string
	if err := d.app.db.QueryRowContext(ctx, `SELECT COALESCE(charge_id, '') FROM orders WHERE order_id = ?`, orderID).Scan(&chargeID); err != nil {
		return fmt.Errorf("read the charge of %s: %w", orderID, err)
	}
	refundID, err := d.app.processor.refund(ctx, demoDashboardRefund, chargeID, 500)
	if err != nil {
		return err
	}
	d.say("someone refunds 500 in the processor's dashboard; the processor tells us with charge.refunded, and sends it again")
	event := chargeRefundedEvent(demoWebhookEventID, chargeID, refundID, 500)
	var answers []string
	for range 2 {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.base+"/webhooks/processor", bytes.NewReader(event))
		if err != nil {
			return err
		}
		req.Header.Set(signatureHeader, signWebhook([]byte(devWebhookSecret), d.clock.now(), event))
		result, err := d.do(req)
		if err != nil {
			return err
		}
		fmt.Fprintf(d.out, "   POST /webhooks/processor  %s\n", shortIDs(string(event)))
		fmt.Fprintf(d.out, "   -> %d %s  %s\n", result.status, http.StatusText(result.status), strings.TrimSpace(string(result.body)))
		answers = append(answers, fmt.Sprintf("%d %s", result.status, strings.TrimSpace(string(result.body))))
		if outcome := orderField(result.body, "outcome"); result.status == http.StatusOK && outcome != "" {
			d.tally(webhookConsumer, receiveResult{MessageID: demoWebhookEventID, Outcome: inboxOutcome(outcome)})
		}
	}
	err = d.check(len(answers) == 2 && strings.Contains(answers[0], `"applied"`) && strings.Contains(answers[1], `"duplicate"`),
		"the first applied, the second was skipped as a duplicate",
		fmt.Sprintf("answers %q", answers),
		fmt.Sprintf("inbox: (%s, %s) was recorded with the first delivery's effect, so the second changed nothing", webhookConsumer, demoWebhookEventID))
	if err != nil {
		return err
	}
	var refundedCents int
	if err := d.app.db.QueryRowContext(ctx, `SELECT refunded_cents FROM orders WHERE order_id = ?`, orderID).Scan(&refundedCents); err != nil {
		return fmt.Errorf("read refunded_cents of %s: %w", orderID, err)
	}
	return d.check(refundedCents == 2500, "the order counts 2500 refunded (2000 + 500), once", fmt.Sprintf("refunded_cents %d", refundedCents))
}

// expiredKey is a key used again after it expired.
func (d *demo) expiredKey(ctx context.Context, orderID string) error {
	d.title("A day later, the refund client sends its key again")
	later := idempotencyKeyTTL + time.Hour
	d.clock.advance(later)
	d.say("%s later: the refund's key expired %s after its answer", later, idempotencyKeyTTL)
	again, err := d.post(ctx, refundPath(orderID), demoRefundKey, demoRefundBody)
	if err != nil {
		return err
	}
	refunds := d.count(ctx, `SELECT COUNT(*) FROM processor_refunds WHERE idempotency_key <> ?`, demoDashboardRefund)
	return d.check(again.status == 422 && strings.Contains(string(again.body), string(problemKeyExpired)) && refunds == 1,
		fmt.Sprintf("422 %s; still 1 refund of 2000", problemKeyExpired), fmt.Sprintf("%s; %d refund(s) through the API", again.seen(), refunds),
		"idempotency key: an expired key no longer replays, but the order remembers the refund made under it,",
		"so the answer names that refund instead of refunding again (a create's expired key would make a new order)")
}

// summaryRows are the closing table: how often each thing was attempted,
// how often it happened, and how often it should have.
func (d *demo) summaryRows(ctx context.Context) []summaryRow {
	return []summaryRow{
		{"order created for cart-7", "3 POSTs", d.ordersOfKey(ctx, demoKey), 1},
		{"order created for cart-9", "2 POSTs at once", d.ordersOfKey(ctx, demoRaceKey), 1},
		{"order created for cart-10", "2 POSTs, 1 dropped", d.ordersOfKey(ctx, demoDroppedKey), 1},
		{"OrderCreated for an order never made", "1 dropped POST", d.count(ctx, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND status = 'poison'`, paymentServiceConsumer), 0},
		{"saga started for cart-7", "2 deliveries", d.count(ctx, `SELECT COUNT(*) FROM saga_instances s JOIN orders o ON o.order_id = s.order_id WHERE o.idempotency_key = ?`, demoKey), 1},
		{"card charged for cart-7", "2 charge calls", d.count(ctx, `SELECT COUNT(*) FROM processor_charges c JOIN orders o ON o.order_id = c.order_id WHERE o.idempotency_key = ? AND c.status = 'succeeded'`, demoKey), 1},
		{"stock sold for cart-7", "1 reservation", d.count(ctx, `SELECT COUNT(*) FROM stock_holds r JOIN orders o ON o.order_id = r.order_id WHERE o.idempotency_key = ? AND `+soldHold, demoKey), 1},
		{"stock released for cart-8 (declined)", "1 compensation", d.count(ctx, `SELECT COUNT(*) FROM stock_holds r JOIN orders o ON o.order_id = r.order_id WHERE o.idempotency_key = ? AND r.status = 'released'`, demoDeclinedKey), 1},
		{"order cancelled for cart-8", "1 delivery", d.count(ctx, `SELECT COUNT(*) FROM orders WHERE idempotency_key = ? AND status = 'cancelled'`, demoDeclinedKey), 1},
		{"refund of 2000 made", "4 POSTs, 1 lost", d.count(ctx, `SELECT COUNT(*) FROM processor_refunds WHERE idempotency_key <> ?`, demoDashboardRefund), 1},
		{"dashboard refund counted", "2 webhooks", d.count(ctx, `SELECT COUNT(*) FROM refunds WHERE source = 'webhook'`), 1},
	}
}

// summaryRow is one line of the closing table.
type summaryRow struct {
	effect   string
	attempts string
	happened int
	want     int
}

// printSummary prints the closing table and returns its rows that did not
// happen as often as they should have. Its title says whether every
// effect did, so it is printed after the rows are read.
func (d *demo) printSummary(ctx context.Context) []string {
	rows := d.summaryRows(ctx)
	var wrong []string
	for _, row := range rows {
		if row.happened != row.want {
			wrong = append(wrong, fmt.Sprintf("%s happened %d times, want %d", row.effect, row.happened, row.want))
		}
	}
	if len(wrong) == 0 {
		fmt.Fprintf(d.out, "\n== Each effect below happened as often as it should ==\n")
	} else {
		fmt.Fprintf(d.out, "\n== %d effect(s) did not happen as often as they should ==\n", len(wrong))
	}
	fmt.Fprintf(d.out, "   %-36s %-19s %s\n", "effect", "attempts", "happened")
	for _, row := range rows {
		mark := ""
		if row.happened != row.want {
			mark = fmt.Sprintf("   <- should be %d", row.want)
		}
		fmt.Fprintf(d.out, "   %-36s %-19s %d%s\n", row.effect, row.attempts, row.happened, mark)
	}
	return wrong
}

// printDeliveries prints, for each message a consumer got more than once
// in the story, how often it came and how often the consumer applied it,
// and returns those applied more than once: the hole the inbox closes.
// The effects table above can miss it, when something else (the saga's
// started_by, a refund's processor id) kept the second application from
// changing a count.
func (d *demo) printDeliveries() []string {
	var redelivered []*messageDeliveries
	var wrong []string
	for _, m := range d.deliveries {
		if m.delivered < 2 {
			continue
		}
		redelivered = append(redelivered, m)
		if m.applied > 1 {
			wrong = append(wrong, fmt.Sprintf("%s applied %s %d times, want once", m.consumer, shortID(m.messageID), m.applied))
		}
	}
	if len(wrong) == 0 {
		fmt.Fprintf(d.out, "\n== Each message delivered more than once was applied once ==\n")
	} else {
		fmt.Fprintf(d.out, "\n== %d message(s) applied more than once ==\n", len(wrong))
	}
	fmt.Fprintf(d.out, "   %-20s %-16s %-10s %s\n", "consumer", "message id", "delivered", "applied")
	for _, m := range redelivered {
		mark := ""
		if m.applied > 1 {
			mark = "   <- should be 1"
		}
		fmt.Fprintf(d.out, "   %-20s %-16s %-10d %d%s\n", m.consumer, shortID(m.messageID), m.delivered, m.applied, mark)
	}
	return wrong
}

// printViolations prints check's violations, one line per invariant: a
// violation alone as check prints it, several (the demo breaks an
// invariant once for each event of its story) as their count and the
// first. Returns an error if there are any.
func (d *demo) printViolations(violations []violation) error {
	if len(violations) == 0 {
		return printAudit(d.out, nil, true)
	}
	var invariants []string
	byInvariant := map[string][]violation{}
	for _, v := range violations {
		if byInvariant[v.Invariant] == nil {
			invariants = append(invariants, v.Invariant)
		}
		byInvariant[v.Invariant] = append(byInvariant[v.Invariant], v)
	}
	for _, invariant := range invariants {
		found := byInvariant[invariant]
		first := shortIDs(terminalSafe(found[0].Detail))
		if len(found) == 1 {
			fmt.Fprintf(d.out, "VIOLATION %s: %s\n", invariant, first)
			continue
		}
		fmt.Fprintf(d.out, "%d x VIOLATION %s; the first: %s\n", len(found), invariant, first)
	}
	return fmt.Errorf("%d violations of %d invariants", len(violations), len(invariants))
}

// summary prints the closing tables and the invariants check. Returns an
// error if any found something wrong.
func (d *demo) summary(ctx context.Context) error {
	wrong := d.printSummary(ctx)
	wrong = append(wrong, d.printDeliveries()...)
	if len(wrong) > 0 {
		return fmt.Errorf("check failed: %s", strings.Join(wrong, "; "))
	}
	violations, err := audit(ctx, d.app.db, d.clock.now(), true)
	if err != nil {
		return err
	}
	fmt.Fprintln(d.out)
	if err := d.printViolations(violations); err != nil {
		return fmt.Errorf("check failed: %w", err)
	}
	return nil
}

// summaryWithout prints the closing tables and the invariants check of a
// run without a layer, and returns how many violations check found, of how
// many invariants. The tables' marked rows join d.failed.
func (d *demo) summaryWithout(ctx context.Context) (violations, invariants int, err error) {
	d.failed = append(d.failed, d.printSummary(ctx)...)
	d.failed = append(d.failed, d.printDeliveries()...)
	found, err := audit(ctx, d.app.db, d.clock.now(), true)
	if err != nil {
		return 0, 0, err
	}
	fmt.Fprintln(d.out)
	// printViolations's error only repeats that there are violations.
	_ = d.printViolations(found)
	broken := map[string]bool{}
	for _, v := range found {
		broken[v.Invariant] = true
	}
	return len(found), len(broken), nil
}
