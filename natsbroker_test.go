package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"
)

// natsStreamCounter keeps the streams of one test process apart.
var natsStreamCounter atomic.Int64

// useTestNATS switches env's App to a fresh JetStream stream on the server
// named by RETRYSAFE_TEST_NATS, and deletes the stream when the test ends.
// It skips the test when the variable is not set.
func useTestNATS(tb testing.TB, env *testEnv, ackWait time.Duration) *natsBroker {
	tb.Helper()
	url := os.Getenv("RETRYSAFE_TEST_NATS")
	if url == "" {
		tb.Skip("set RETRYSAFE_TEST_NATS=nats://127.0.0.1:4222 to run the NATS JetStream tests")
	}
	ctx := context.Background()
	stream := fmt.Sprintf("RTTEST%d_%d", os.Getpid(), natsStreamCounter.Add(1))
	broker, err := openNATSBroker(ctx, url, stream, ackWait)
	if err != nil {
		tb.Fatalf("NATS at %s: %v", url, err)
	}
	tb.Cleanup(func() {
		if err := broker.deleteStream(context.Background()); err != nil {
			tb.Error(err)
		}
		broker.close()
	})
	env.app.broker = broker
	if err := env.app.subscribeConsumers(ctx); err != nil {
		tb.Fatal(err)
	}
	return broker
}

// streamMessages returns how many messages the stream holds.
func streamMessages(tb testing.TB, broker *natsBroker) uint64 {
	tb.Helper()
	stream, err := broker.js.Stream(context.Background(), broker.stream)
	if err != nil {
		tb.Fatal(err)
	}
	info, err := stream.Info(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	return info.State.Msgs
}

func TestNATSBroker(t *testing.T) {
	ctx := context.Background()

	// Ensure every kind of order goes through relay, JetStream, the inboxes
	// and the saga, and the audit passes.
	t.Run("OrdersFlowThroughJetStream", func(t *testing.T) {
		env := MustOpenApp(t)
		useTestNATS(t, env, 5*time.Second)
		mustCreateOrder(t, env, "user-42", "visa", orderBody(5000, "sku-1", 2, pmCardVisa))
		mustCreateOrder(t, env, "user-42", "declined", orderBody(1200, "sku-2", 1, pmCardDeclined))
		mustCreateOrder(t, env, "user-42", "timeout", orderBody(3000, "sku-2", 1, pmCardTimeout))
		env.drain(t)
		if got := env.str(t, `SELECT string_agg(status, ',' ORDER BY amount_cents) FROM orders`); got != "cancelled,paid,paid" {
			t.Fatalf("order statuses by amount: %s", got)
		}
		mustAudit(t, env, true)
	})

	// Ensure a relay that publishes an event twice stores it once: the event
	// id is the Nats-Msg-Id.
	t.Run("RepublishIsDeduplicated", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, 5*time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		env.fault.crashAt(faultAfterPublish)
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err == nil {
			t.Fatal("want the crash")
		}
		env.clock.advance(env.app.leases.relay)
		if n, err := env.app.relayOnce(ctx, "relay-2", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("republished %d, %v; want 1", n, err)
		}
		if got := streamMessages(t, broker); got != 1 {
			t.Fatalf("the stream holds %d messages, want 1", got)
		}
		var eventID string
		if err := env.app.db.QueryRow(`SELECT event_id FROM outbox_events`).Scan(&eventID); err != nil {
			t.Fatal(err)
		}
		if stored, dropped, err := broker.held(ctx, eventID); err != nil || stored != 1 || dropped != 1 {
			t.Fatalf("held(%s) = %d stored, %d dropped, %v; want 1 and 1", eventID, stored, dropped, err)
		}
	})

	// Ensure a message that is not acked comes back after AckWait with a
	// higher delivery count, and the inbox skips it.
	t.Run("UnackedMessageIsRedeliveredAndSkipped", func(t *testing.T) {
		env := MustOpenApp(t)
		useTestNATS(t, env, time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		env.fault.crashAt(faultAfterEffect)
		if _, err := env.app.consumeOnce(ctx, payments, 10); err == nil {
			t.Fatal("want the crash")
		}
		var results []receiveResult
		deadline := time.Now().Add(10 * time.Second)
		for len(results) == 0 && time.Now().Before(deadline) {
			var err error
			results, err = env.app.consumeOnce(ctx, payments, 10)
			if err != nil {
				t.Fatal(err)
			}
		}
		if len(results) != 1 || results[0].Outcome != inboxDuplicate {
			t.Fatalf("got %v, want one duplicate", results)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != 1 {
			t.Fatalf("got %d sagas, want 1", got)
		}
	})

	// Ensure a message that keeps failing stops at MaxDeliver as poison in
	// the inbox, acknowledged, instead of looping.
	t.Run("MaxDeliverEndsAsPoison", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		flaky := consumer{name: "flaky", subjects: []string{"Ping"}, apply: func(ctx context.Context, tx *sql.Tx, msg message) error {
			return fmt.Errorf("database is locked")
		}}
		if err := broker.subscribe(ctx, flaky.name, flaky.subjects...); err != nil {
			t.Fatal(err)
		}
		if err := broker.publishBatch(ctx, []message{{ID: "msg-1", Subject: "Ping", Payload: []byte(`{}`)}}); err != nil {
			t.Fatal(err)
		}
		var outcomes []inboxOutcome
		deadline := time.Now().Add(40 * time.Second)
		for time.Now().Before(deadline) && (len(outcomes) == 0 || outcomes[len(outcomes)-1] != inboxPoison) {
			results, err := env.app.consumeOnce(ctx, flaky, 10)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range results {
				outcomes = append(outcomes, r.Outcome)
			}
		}
		if len(outcomes) != maxDeliveries || outcomes[len(outcomes)-1] != inboxPoison {
			t.Fatalf("got %v, want %d deliveries ending in poison", outcomes, maxDeliveries)
		}
		consumer, err := broker.js.Consumer(ctx, broker.stream, flaky.name+"_Ping")
		if err != nil {
			t.Fatal(err)
		}
		info, err := consumer.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.NumAckPending != 0 || info.NumPending != 0 {
			t.Fatalf("consumer still has %d pending acks and %d pending messages", info.NumAckPending, info.NumPending)
		}
	})
}
