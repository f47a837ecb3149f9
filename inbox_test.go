package main

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

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
		wg.Wait()
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

	// Ensure a transient failure is not acked and comes back, and becomes
	// poison after maxDeliveries.
	t.Run("TransientFailureComesBackThenPoison", func(t *testing.T) {
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
			return errors.New("database is locked")
		}}
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
		if len(outcomes) != len(want) || outcomes[4] != inboxPoison || outcomes[0] != inboxRetry {
			t.Fatalf("got %v, want %v", outcomes, want)
		}
		if calls.Load() != maxDeliveries {
			t.Fatalf("applied %d times, want %d", calls.Load(), maxDeliveries)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_deliveries WHERE status = 'acked'`); got != 1 {
			t.Fatalf("poison was not acked")
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
