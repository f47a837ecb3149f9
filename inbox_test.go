package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// outagePass runs one consume pass of c whose batch transaction cannot
// commit: c's effect cancels the pass's context, as a shutdown does, or a
// database that stops answering. The message is not at fault. Returns what
// consumeOnce returned.
func outagePass(ctx context.Context, env *testEnv, c consumer) ([]receiveResult, error) {
	passCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	c.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		cancel()
		return ctx.Err()
	}
	return env.app.consumeOnce(passCtx, c, 10)
}

// countingEffect returns an inbox effect that adds one to a counter row, and
// a function that reads the counter: an effect that is visibly not
// idempotent, so applying it twice shows.
func countingEffect(tb testing.TB, env *testEnv, name string) (func(tx *sql.Tx) error, func() int) {
	tb.Helper()
	if _, err := env.app.db.Exec(`CREATE TABLE IF NOT EXISTS test_counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL)`); err != nil {
		tb.Fatal(err)
	}
	if _, err := env.app.db.Exec(`INSERT INTO test_counters (name, n) VALUES (?, 0)`, name); err != nil {
		tb.Fatal(err)
	}
	apply := func(tx *sql.Tx) error {
		_, err := tx.Exec(`UPDATE test_counters SET n = n + 1 WHERE name = ?`, name)
		return err
	}
	read := func() int {
		return env.count(tb, `SELECT n FROM test_counters WHERE name = ?`, name)
	}
	return apply, read
}

func TestInbox(t *testing.T) {
	ctx := context.Background()

	// Ensure a message whose effect fills the disk fails as the database
	// being unavailable: SQLite rolls the whole transaction back on
	// SQLITE_FULL, so the message's savepoint is gone, and the missing
	// savepoint must not hide the cause (a webhook was answered 500, a
	// worker reported a bug, where a full disk is transient).
	t.Run("FullDiskIsTransient", func(t *testing.T) {
		if onPostgres() {
			t.Skip("max_page_count is SQLite's")
		}
		env := MustOpenApp(t)
		if _, err := env.app.db.ExecContext(ctx, `CREATE TABLE scratch (b BLOB)`); err != nil {
			t.Fatal(err)
		}
		lift := capFileAtItsSize(t, env)
		defer lift()
		_, err := env.app.receive(ctx, "billing", "msg-full", 1, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO scratch (b) VALUES (randomblob(1000000))`)
			return err
		})
		if !isDatabaseUnavailable(err) {
			t.Fatalf("a message that filled the disk failed with %v, want the database unavailable", err)
		}
	})

	// Ensure a message whose effect meets the database failing for a
	// moment (a dropped connection, a serialization failure, a lock held
	// past the busy timeout), in a transaction that could still write,
	// rolls back and counts nothing against the message: a long outage
	// must not use up its tries and make it poison.
	t.Run("TransientDatabaseErrorCountsNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		for _, transient := range []error{
			fmt.Errorf("write the effect: %w", driver.ErrBadConn),
			fmt.Errorf("write the effect: %w", &pgconn.PgError{Code: pgSerializationFailure}),
		} {
			result, err := env.app.receive(ctx, "billing", "msg-transient", 1, func(tx *sql.Tx) error { return transient })
			if err == nil {
				t.Fatalf("%v: got %s and no error, want the transaction rolled back", transient, result.Outcome)
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages) + (SELECT COUNT(*) FROM inbox_failures)`); n != 0 {
			t.Fatalf("a transient failure of the database left %d rows counted against the message", n)
		}
	})

	// Ensure a redelivered message is skipped and acked, not applied again.
	t.Run("RedeliveryIsSkipped", func(t *testing.T) {
		env := MustOpenApp(t)
		apply, applied := countingEffect(t, env, "c")
		first, err := env.app.receive(ctx, "billing", "msg-1", 1, apply)
		if err != nil {
			t.Fatal(err)
		}
		again, err := env.app.receive(ctx, "billing", "msg-1", 2, apply)
		if err != nil {
			t.Fatal(err)
		}
		if first.Outcome != inboxApplied || again.Outcome != inboxDuplicate || applied() != 1 {
			t.Fatalf("got %s then %s, applied %d times; want applied, duplicate, 1", first.Outcome, again.Outcome, applied())
		}
	})

	// Ensure two consumers of one message each apply it and keep their own
	// record (the sample keyed the inbox by message id alone).
	t.Run("TwoConsumersOfOneMessage", func(t *testing.T) {
		env := MustOpenApp(t)
		applyA, appliedA := countingEffect(t, env, "a")
		applyB, appliedB := countingEffect(t, env, "b")
		a, err := env.app.receive(ctx, "consumer-a", "msg-1", 1, applyA)
		if err != nil {
			t.Fatal(err)
		}
		b, err := env.app.receive(ctx, "consumer-b", "msg-1", 1, applyB)
		if err != nil {
			t.Fatal(err)
		}
		if a.Outcome != inboxApplied || b.Outcome != inboxApplied || appliedA() != 1 || appliedB() != 1 {
			t.Fatalf("got %s and %s, want both applied", a.Outcome, b.Outcome)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE message_id = 'msg-1' AND status = 'done'`); got != 2 {
			t.Fatalf("got %d inbox rows, want one per consumer", got)
		}
	})

	// Ensure two concurrent deliveries of one message apply it once, both
	// ack, and neither is marked poison (the sample checked the inbox outside
	// the transaction).
	t.Run("ConcurrentDeliveriesApplyOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		apply, applied := countingEffect(t, env, "c")
		// Both deliveries pass the start line before either applies.
		var started sync.WaitGroup
		started.Add(2)
		results := make([]receiveResult, 2)
		var wg sync.WaitGroup
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				started.Done()
				started.Wait()
				var err error
				results[i], err = env.app.receive(ctx, "billing", "msg-1", 1, apply)
				if err != nil {
					t.Error(err)
				}
			}()
		}
		mustWait(t, "both deliveries to be received", &wg)
		outcomes := map[inboxOutcome]int{}
		for _, r := range results {
			outcomes[r.Outcome]++
		}
		if outcomes[inboxApplied] != 1 || outcomes[inboxDuplicate] != 1 || applied() != 1 {
			t.Fatalf("got outcomes %v and %d applications, want one applied, one duplicate", outcomes, applied())
		}
	})

	// Ensure a permanent failure is recorded as poison for that consumer only,
	// without touching another consumer's record of the same message.
	t.Run("PermanentFailureIsPoisonForThatConsumerOnly", func(t *testing.T) {
		env := MustOpenApp(t)
		apply, _ := countingEffect(t, env, "c")
		if _, err := env.app.receive(ctx, "consumer-a", "msg-1", 1, apply); err != nil {
			t.Fatal(err)
		}
		result, err := env.app.receive(ctx, "consumer-b", "msg-1", 1, func(tx *sql.Tx) error {
			return permanent(errors.New("payload does not decode"))
		})
		if err != nil {
			t.Fatal(err)
		}
		if result.Outcome != inboxPoison {
			t.Fatalf("got %s, want poison", result.Outcome)
		}
		if got := env.str(t, `SELECT status || ':' || COALESCE(error, '') FROM inbox_messages WHERE consumer = 'consumer-b'`); got != "poison:payload does not decode" {
			t.Fatalf("consumer-b's row is %q", got)
		}
		if got := env.str(t, `SELECT status FROM inbox_messages WHERE consumer = 'consumer-a'`); got != "done" {
			t.Fatalf("consumer-a's row became %q", got)
		}
	})

	// Ensure a message on which our own code fails transiently comes back
	// and becomes poison on the maxDeliveries-th failure the inbox counted,
	// however often the broker delivered it before (here twice into a batch
	// transaction that failed): the broker's count includes our outages.
	t.Run("TransientFailuresOfOurCodeBecomePoisonAfterMaxDeliveries", func(t *testing.T) {
		env := MustOpenApp(t)
		if err := env.app.broker.subscribe(ctx, "flaky", "Ping"); err != nil {
			t.Fatal(err)
		}
		if err := env.app.broker.publishBatch(ctx, []message{{ID: "msg-1", Subject: "Ping", Payload: []byte(`{}`)}}); err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		flaky := consumer{name: "flaky", subjects: []string{"Ping"}, apply: func(ctx context.Context, tx *sql.Tx, msg message) error {
			calls.Add(1)
			return errors.New("stock service unavailable")
		}}
		for range 2 {
			if _, err := outagePass(ctx, env, flaky); err == nil {
				t.Fatal("the outage pass succeeded")
			}
			env.clock.advance(env.app.leases.ackWait)
		}
		var outcomes []inboxOutcome
		for range 20 {
			results, err := env.app.consumeOnce(ctx, flaky, 10)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range results {
				outcomes = append(outcomes, r.Outcome)
			}
			env.clock.advance(time.Minute)
		}
		want := []inboxOutcome{inboxRetry, inboxRetry, inboxRetry, inboxRetry, inboxPoison}
		if fmt.Sprint(outcomes) != fmt.Sprint(want) || calls.Load() != maxDeliveries {
			t.Fatalf("got %v after %d failures of our code, want %v after %d", outcomes, calls.Load(), want, maxDeliveries)
		}
		if got := env.str(t, `SELECT status || ':' || error FROM inbox_messages WHERE consumer = 'flaky'`); got != "poison:failed 5 times, the last time: stock service unavailable" {
			t.Fatalf("the inbox row is %q", got)
		}
		if got := env.count(t, `SELECT failures FROM inbox_failures WHERE consumer = 'flaky' AND message_id = 'msg-1'`); got != maxDeliveries {
			t.Fatalf("counted %d failures, want %d", got, maxDeliveries)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_deliveries WHERE status = 'acked'`); got != 1 {
			t.Fatalf("poison was not acked")
		}
	})

	// Ensure a database outage longer than maxDeliveries deliveries (every
	// batch transaction fails) uses up none of a message's tries: afterwards
	// one transient failure of our own code is a retry, not poison, and
	// every order's saga starts exactly once.
	t.Run("OutageDoesNotUseUpDeliveries", func(t *testing.T) {
		env := MustOpenApp(t)
		for i := range 3 {
			mustCreateOrder(t, env, "user-42", fmt.Sprintf("k%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
		}
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		for pass := range maxDeliveries + 1 {
			results, err := outagePass(ctx, env, payments)
			if err == nil || len(results) != 0 {
				t.Fatalf("outage pass %d: got %v, %v; want the batch to fail", pass+1, results, err)
			}
			env.clock.advance(env.app.leases.ackWait)
		}
		if got := env.count(t, `SELECT MIN(delivery_count) FROM broker_deliveries WHERE subscriber = ?`, paymentServiceConsumer); got <= maxDeliveries {
			t.Fatalf("the outage delivered each message at least %d times, want more than %d", got, maxDeliveries)
		}
		var failed atomic.Bool
		failOnce := payments
		failOnce.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
			if failed.CompareAndSwap(false, true) {
				return errors.New("stock service unavailable")
			}
			return payments.apply(ctx, tx, msg)
		}
		results, err := env.app.consumeOnce(ctx, failOnce, 10)
		if err != nil {
			t.Fatal(err)
		}
		outcomes := map[inboxOutcome]int{}
		for _, r := range results {
			outcomes[r.Outcome]++
		}
		if outcomes[inboxRetry] != 1 || outcomes[inboxApplied] != 2 {
			t.Fatalf("after the outage got %v, want one retry and two applied", outcomes)
		}
		env.clock.advance(consumeBackoff(1))
		if results, err := env.app.consumeOnce(ctx, payments, 10); err != nil || len(results) != 1 || results[0].Outcome != inboxApplied {
			t.Fatalf("the retry got %v, %v; want applied", results, err)
		}
		if got := env.str(t, `SELECT string_agg(status, ',') FROM inbox_messages`); got != "done,done,done" {
			t.Fatalf("inbox rows: %s, want three done", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != 3 {
			t.Fatalf("got %d sagas, want 3", got)
		}
		env.drain(t)
		if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'paid'`); got != 3 {
			t.Fatalf("%d of 3 orders paid", got)
		}
		mustAudit(t, env, true)
	})

	// Ensure the deliveries of a batch whose transaction failed are naked:
	// they come back after failedBatchRedelivery, not after ackWait.
	t.Run("FailedBatchComesBackWithoutWaitingOutAckWait", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		if _, err := outagePass(ctx, env, payments); err == nil {
			t.Fatal("the outage pass succeeded")
		}
		env.clock.advance(failedBatchRedelivery)
		if results, err := env.app.consumeOnce(ctx, payments, 10); err != nil || len(results) != 1 || results[0].Outcome != inboxApplied {
			t.Fatalf("got %v, %v; want the message back and applied", results, err)
		}
	})

	// Ensure a webhook on which our code fails transiently is answered 503
	// however often the processor sends it, and is never made poison: the
	// processor retries for days, and a poison webhook would lose its refund.
	t.Run("WebhookTransientFailureIsNeverPoison", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		env.fault.crashAt(faultRefundAfterProcessor)
		req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		ts = newTestServer(t, env)
		chargeID := env.str(t, `SELECT charge_id FROM orders`)
		refundID := env.str(t, `SELECT refund_id FROM processor_refunds`)
		body := chargeRefundedEvent("evt_early", chargeID, refundID, 2000)
		for i := range 3 * maxDeliveries {
			early := postWebhook(t, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
			if early.Status != 503 {
				t.Fatalf("delivery %d of the early webhook got %d %s, want 503", i+1, early.Status, early.Body)
			}
			env.clock.advance(time.Second)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?`, webhookConsumer); got != 0 {
			t.Fatalf("the webhook has %d inbox rows, want none until it applies", got)
		}
		env.clock.advance(env.app.leases.refundLock)
		if n, err := env.app.completeRefundsOnce(ctx, 10); err != nil || n != 1 {
			t.Fatalf("completer finished %d, %v; want 1", n, err)
		}
		again := postWebhook(t, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
		if again.Status != 200 || !strings.Contains(again.Body, `"applied"`) {
			t.Fatalf("the webhook after the refund got %d %s, want 200 applied", again.Status, again.Body)
		}
		if got := env.count(t, `SELECT refunded_cents FROM orders`); got != 2000 {
			t.Fatalf("refunded_cents %d, want 2000", got)
		}
	})

	// Ensure a consumer that dies after its effect but before the ack gets
	// the message again after ackWait, and the inbox skips it.
	t.Run("CrashBeforeAckRedeliversAndSkips", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		env.fault.crashAt(faultAfterEffect)
		if _, err := env.app.consumeOnce(ctx, payments, 10); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		payments = env.app.consumers()[0]
		if results, _ := env.app.consumeOnce(ctx, payments, 10); len(results) != 0 {
			t.Fatalf("redelivered before ackWait: %v", results)
		}
		env.clock.advance(ackWait)
		results, err := env.app.consumeOnce(ctx, payments, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(results) != 1 || results[0].Outcome != inboxDuplicate {
			t.Fatalf("got %v, want one duplicate", results)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != 1 {
			t.Fatalf("got %d sagas, want 1", got)
		}
		if got := env.count(t, `SELECT delivery_count FROM broker_deliveries WHERE subscriber = ?`, paymentServiceConsumer); got != 2 {
			t.Fatalf("delivery count %d, want 2", got)
		}
	})

	// Ensure a consumer paused after its commit, past ackWait, while another
	// takes the message over, applies it once: the other's run is a
	// duplicate and acks, and the paused consumer's late ack is refused
	// (errDeliveryLeaseLost) without undoing anything.
	t.Run("ConsumerPausedPastAckWaitAppliesOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		var takenOver []receiveResult
		var takeOverErr error
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultAfterEffect && pass == 1 {
				// A is paused between its commit and its ack.
				env.clock.advance(env.app.leases.ackWait)
				takenOver, takeOverErr = env.app.consumeOnce(ctx, payments, 10)
			}
			return nil
		})
		results, err := env.app.consumeOnce(ctx, payments, 10)
		// A's late ack is refused (the delivery is B's now), and that is
		// no error for A: its commit stands, and B acks.
		if err != nil || len(results) != 1 || results[0].Outcome != inboxApplied {
			t.Fatalf("A got %v, %v; want applied, and its late ack refused without an error", results, err)
		}
		if takeOverErr != nil || len(takenOver) != 1 || takenOver[0].Outcome != inboxDuplicate {
			t.Fatalf("B got %v, %v; want one duplicate", takenOver, takeOverErr)
		}
		if got := env.str(t, `SELECT status || ':' || delivery_count FROM broker_deliveries WHERE subscriber = ?`, paymentServiceConsumer); got != "acked:2" {
			t.Fatalf("the delivery is %s, want acked by B's delivery 2", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != 1 {
			t.Fatalf("got %d sagas, want 1", got)
		}
	})

	// Ensure the message id is the outbox event id from end to end: broker
	// message id and inbox message id (the sample's demo hand-built one).
	t.Run("MessageIDIsTheEventID", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		env.drain(t)
		got := env.count(t, `
			SELECT COUNT(*) FROM outbox_events e
			JOIN broker_messages m ON m.message_id = e.event_id
			JOIN inbox_messages i ON i.message_id = e.event_id`)
		if want := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != want || want != 2 {
			t.Fatalf("got %d events traceable by id through broker and inbox, want %d (OrderCreated, PaymentCaptured)", got, want)
		}
	})
}

func TestEmbeddedBroker(t *testing.T) {
	ctx := context.Background()

	// Ensure a consumer paused past ackWait, whose message another consumer
	// has fetched since, can neither ack nor nak the other's delivery (the
	// delivery count fences both), and the other's ack stands.
	// Ensure a consumer that recorded a message poison and had not acked it
	// yet when an operator replayed it cannot ack the replay away: the
	// replayed message is delivered again (simulator seed 24 of the merged
	// reconciler: an order left created).
	t.Run("StaleHolderCannotAckAReplayAway", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		stale := fetchedAsPoison(t, env)
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		if err := env.app.broker.ack(ctx, stale); !errors.Is(err, errDeliveryLeaseLost) {
			t.Fatalf("the stale ack after the replay got %v, want errDeliveryLeaseLost", err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s after the replay, want paid", got)
		}
	})

	t.Run("StaleHolderCannotAckOrNakTheNextDelivery", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := env.app.broker
		if err := broker.subscribe(ctx, "billing", "Ping"); err != nil {
			t.Fatal(err)
		}
		if err := broker.publishBatch(ctx, []message{{ID: "msg-1", Subject: "Ping", Payload: []byte(`{}`)}}); err != nil {
			t.Fatal(err)
		}
		a, err := broker.fetch(ctx, "billing", 1)
		if err != nil || len(a) != 1 {
			t.Fatalf("A fetched %v, %v", a, err)
		}
		env.clock.advance(env.app.leases.ackWait)
		b, err := broker.fetch(ctx, "billing", 1)
		if err != nil || len(b) != 1 || b[0].DeliveryCount != 2 {
			t.Fatalf("B fetched %v, %v; want the second delivery", b, err)
		}
		if err := broker.ack(ctx, a[0]); !errors.Is(err, errDeliveryLeaseLost) {
			t.Fatalf("A's stale ack got %v, want errDeliveryLeaseLost", err)
		}
		if err := broker.nak(ctx, a[0], 0); !errors.Is(err, errDeliveryLeaseLost) {
			t.Fatalf("A's stale nak got %v, want errDeliveryLeaseLost", err)
		}
		if c, err := broker.fetch(ctx, "billing", 1); err != nil || len(c) != 0 {
			t.Fatalf("a third fetch during B's lease got %v, %v; want nothing", c, err)
		}
		if err := broker.ack(ctx, b[0]); err != nil {
			t.Fatalf("B's ack: %v", err)
		}
		env.clock.advance(env.app.leases.ackWait)
		if c, err := broker.fetch(ctx, "billing", 1); err != nil || len(c) != 0 {
			t.Fatalf("after B's ack a fetch got %v, %v; want nothing", c, err)
		}
	})
}
