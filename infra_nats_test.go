package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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

// deliveryRecorder is a messageBroker that remembers the highest delivery
// count fetched of each message, so that a test can wait until the broker
// has delivered a message again.
type deliveryRecorder struct {
	messageBroker
	mu      sync.Mutex
	highest map[string]int
}

// fetch fetches from the wrapped broker and records what came.
func (r *deliveryRecorder) fetch(ctx context.Context, subscriber string, limit int) ([]delivery, error) {
	deliveries, err := r.messageBroker.fetch(ctx, subscriber, limit)
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, d := range deliveries {
		r.highest[d.ID] = max(r.highest[d.ID], d.DeliveryCount)
	}
	return deliveries, err
}

// allDeliveredMoreThan reports whether want messages were fetched, each
// more than n times, and returns the highest delivery counts.
func (r *deliveryRecorder) allDeliveredMoreThan(want, n int) (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	done := len(r.highest) == want
	for _, count := range r.highest {
		done = done && count > n
	}
	return done, fmt.Sprint(r.highest)
}

// consumerInfo returns the state of a durable consumer of broker's stream.
func consumerInfo(tb testing.TB, broker *natsBroker, durable string) *jetstream.ConsumerInfo {
	tb.Helper()
	ctx := context.Background()
	consumer, err := broker.js.Consumer(ctx, broker.stream, durable)
	if err != nil {
		tb.Fatal(err)
	}
	info, err := consumer.Info(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	return info
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

	// Ensure a message JetStream lost after acknowledging it (deleted from
	// the stream, as a crash before its flush loses it) is published again
	// by the reconciler and applied once. The copy has a Nats-Msg-Id of its
	// own: under the event id, JetStream dropped it as a duplicate of the
	// message it no longer held, for its whole duplicate window.
	t.Run("MessageJetStreamLostIsRepublishedAndAppliedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, 5*time.Second)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("relay published %d, %v, want 1", n, err)
		}
		lost, err := loseNATSMessages(ctx, broker.js, broker.stream, 1, func(int) int { return 0 })
		if err != nil || lost != 1 {
			t.Fatalf("JetStream lost %d messages, %v, want 1", lost, err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, order); got != "created" {
			t.Fatalf("before the bound the order is %s, want created", got)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want 1", n, err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, order); got != "paid" {
			t.Fatalf("order is %s, want paid", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, order); got != 1 {
			t.Fatalf("got %d charges, want 1", got)
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

	// Ensure a message on which our code keeps failing ends as poison in the
	// inbox after maxDeliveries counted failures, acknowledged, instead of
	// looping.
	t.Run("TransientFailuresOfOurCodeEndAsPoison", func(t *testing.T) {
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

	// Ensure a database outage longer than MaxDeliver x AckWait (every
	// batch transaction fails) loses nothing: JetStream keeps delivering,
	// and once the database is back every message is applied exactly once,
	// none poison, and every order is paid. (With MaxDeliver 5, JetStream
	// stopped delivering after the fifth failed batch: no saga, the order
	// created for ever.)
	t.Run("OutageLongerThanMaxDeliverLosesNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		const orders = 3
		for i := range orders {
			mustCreateOrder(t, env, "user-42", fmt.Sprintf("k%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
		}
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		recorder := &deliveryRecorder{messageBroker: broker, highest: map[string]int{}}
		env.app.broker = recorder
		payments := env.app.consumers()[0]
		started := time.Now()
		deadline := started.Add(30 * time.Second)
		for {
			done, highest := recorder.allDeliveredMoreThan(orders, maxDeliveries)
			if done {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %s of outage the highest delivery counts are %s; want each of %d messages delivered more than %d times",
					time.Since(started).Round(time.Second), highest, orders, maxDeliveries)
			}
			if results, err := outagePass(ctx, env, payments); len(results) != 0 {
				t.Fatalf("an outage pass got %v, %v; want the batch to fail", results, err)
			}
		}
		t.Logf("outage of %s", time.Since(started).Round(100*time.Millisecond))
		deadline = time.Now().Add(30 * time.Second)
		for env.count(t, `SELECT COUNT(*) FROM inbox_messages`) < orders {
			if time.Now().After(deadline) {
				t.Fatalf("after the outage only %d of %d messages were applied", env.count(t, `SELECT COUNT(*) FROM inbox_messages`), orders)
			}
			results, err := env.app.consumeOnce(ctx, payments, 10)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range results {
				if r.Outcome != inboxApplied {
					t.Fatalf("after the outage %s got %s (%v), want applied", r.MessageID, r.Outcome, r.Err)
				}
			}
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_failures`); got != 0 {
			t.Fatalf("the outage counted %d failures against messages, want none", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != orders {
			t.Fatalf("got %d sagas, want %d", got, orders)
		}
		env.app.broker = broker
		env.drain(t)
		if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'paid'`); got != orders {
			t.Fatalf("%d of %d orders paid", got, orders)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison'`); got != 0 {
			t.Fatalf("%d poison messages, want none", got)
		}
		mustAudit(t, env, true)
	})

	// Ensure a message without Nats-Msg-Id (not published by our relay) is
	// recorded as poison under an id naming its stream sequence and
	// terminated, while the rest of its batch is applied (it used to fail
	// the whole fetch, for ever).
	t.Run("MessageWithoutMsgIDDoesNotFailItsBatch", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := broker.js.Publish(ctx, broker.subject(eventOrderCreated), []byte(`{"order_id":"ord_elsewhere"}`)); err != nil {
			t.Fatal(err)
		}
		mustCreateOrder(t, env, "user-42", "k2", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		results, err := env.app.consumeOnce(ctx, payments, 10)
		if err != nil {
			t.Fatal(err)
		}
		outcomes := map[inboxOutcome]int{}
		for _, r := range results {
			outcomes[r.Outcome]++
		}
		if outcomes[inboxApplied] != 2 || outcomes[inboxPoison] != 1 {
			t.Fatalf("got %v, want two applied and one poison", results)
		}
		rawID := fmt.Sprintf("nats-seq-%s-1", broker.stream)
		poison := env.str(t, `SELECT error FROM inbox_messages WHERE consumer = ? AND message_id = ? AND status = 'poison'`, paymentServiceConsumer, rawID)
		if !strings.Contains(poison, "no Nats-Msg-Id header") {
			t.Fatalf("the poison row of %s says %q, want the missing header named", rawID, poison)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			info := consumerInfo(t, broker, paymentServiceConsumer+"_"+eventOrderCreated)
			if info.NumAckPending == 0 && info.NumPending == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the consumer still has %d pending acks and %d pending messages", info.NumAckPending, info.NumPending)
			}
			if results, err := env.app.consumeOnce(ctx, payments, 10); err != nil || len(results) != 0 {
				t.Fatalf("a later pass got %v, %v; want nothing", results, err)
			}
		}
	})

	// Ensure a message whose Nats-Msg-Id, or Retrysafe-Replay-Of, is not
	// text a database can key on (bytes that are not UTF-8, a NUL, or
	// more than maxMessageIDLength bytes) is recorded as poison under
	// nats-seq-<stream>-<sequence>, with the id it carried escaped in its
	// error (a long one by its length), and terminated, while the rest of
	// its batch is applied. On PostgreSQL, which refuses such an id, its
	// inbox insert and then its failure count failed, so the whole batch
	// rolled back and was naked, and came back to fail again, for ever.
	t.Run("MessageWithAnIDThatIsNotTextDoesNotStallItsBatch", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		foreign := []struct{ header, id string }{
			{jetstream.MsgIDHeader, "evt_\xff"},
			{replayedMessageIDHeader, "evt_\xc3\x28"},
			{jetstream.MsgIDHeader, "evt_\x00"},
			{jetstream.MsgIDHeader, unkeyableID()},
		}
		for i, f := range foreign {
			msg := nats.NewMsg(broker.subject(eventOrderCreated))
			msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("foreign-%d", i))
			msg.Header.Set(f.header, f.id)
			msg.Data = []byte(`{"order_id":"ord_elsewhere"}`)
			if _, err := broker.js.PublishMsg(ctx, msg); err != nil {
				t.Fatal(err)
			}
		}
		mustCreateOrder(t, env, "user-42", "k2", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		results, err := env.app.consumeOnce(ctx, payments, 10)
		if err != nil {
			t.Fatal(err)
		}
		outcomes := map[inboxOutcome]int{}
		for _, r := range results {
			outcomes[r.Outcome]++
		}
		if outcomes[inboxApplied] != 2 || outcomes[inboxPoison] != len(foreign) {
			t.Fatalf("got %v, want two applied and %d poison", results, len(foreign))
		}
		for i, f := range foreign {
			rawID := fmt.Sprintf("nats-seq-%s-%d", broker.stream, i+1)
			poison := env.str(t, `SELECT error FROM inbox_messages WHERE consumer = ? AND message_id = ? AND status = 'poison'`, paymentServiceConsumer, rawID)
			// Escaped, as Go quotes it: the error is text too.
			want := f.header + " " + strconv.Quote(f.id)
			if len(f.id) > maxMessageIDLength {
				want = fmt.Sprintf("%s of %d bytes", f.header, len(f.id))
			}
			if !strings.Contains(poison, want) {
				t.Fatalf("the poison row of %s says %q, want it to name %s", rawID, poison, want)
			}
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			info := consumerInfo(t, broker, paymentServiceConsumer+"_"+eventOrderCreated)
			if info.NumAckPending == 0 && info.NumPending == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the consumer still has %d pending acks and %d pending messages", info.NumAckPending, info.NumPending)
			}
			if results, err := env.app.consumeOnce(ctx, payments, 10); err != nil || len(results) != 0 {
				t.Fatalf("a later pass got %v, %v; want nothing", results, err)
			}
		}
	})

	// Ensure a message is fetched although the server's count of the
	// consumer's pending messages fell behind (nats-server 2.9 then answers
	// every fetch that does not wait with "no messages"): fetch asks for
	// the consumer's info, which makes the server count again, and
	// fetches again.
	t.Run("PendingCountThatFellBehindIsRecounted", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		behind := &countBehind{Consumer: broker.durables[paymentServiceConsumer][0], behind: true}
		broker.durables[paymentServiceConsumer][0] = behind
		payments := env.app.consumers()[0]
		deadline := time.Now().Add(3 * pendingRecount)
		for {
			results, err := env.app.consumeOnce(ctx, payments, consumeBatchSize)
			if err != nil {
				t.Fatal(err)
			}
			if len(results) == 1 && results[0].Outcome == inboxApplied {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the OrderCreated was not fetched in %s of passes (%d fetches found nothing); got %v",
					3*pendingRecount, behind.emptyFetches(), results)
			}
			time.Sleep(workerIdle)
		}
		if behind.emptyFetches() == 0 {
			t.Fatal("no fetch found the count behind: the test did not test the recount")
		}
	})

	// Ensure a durable consumer created with MaxDeliver 5 (by an older
	// version) is updated to unlimited deliveries when the consumer
	// subscribes, keeping its position and pending acks.
	t.Run("ConsumerCreatedWithMaxDeliverFiveIsUpdated", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		durable := "legacy_Ping"
		_, err := broker.js.CreateConsumer(ctx, broker.stream, jetstream.ConsumerConfig{
			Durable:       durable,
			FilterSubject: broker.subject("Ping"),
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       time.Second,
			MaxDeliver:    5,
			DeliverPolicy: jetstream.DeliverAllPolicy,
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := broker.publishBatch(ctx, []message{{ID: "msg-1", Subject: "Ping", Payload: []byte(`{}`)}}); err != nil {
			t.Fatal(err)
		}
		legacy, err := broker.js.Consumer(ctx, broker.stream, durable)
		if err != nil {
			t.Fatal(err)
		}
		batch, err := legacy.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for range batch.Messages() {
		}
		if err := broker.subscribe(ctx, "legacy", "Ping"); err != nil {
			t.Fatalf("subscribe over the old consumer: %v", err)
		}
		info := consumerInfo(t, broker, durable)
		if info.Config.MaxDeliver != -1 {
			t.Fatalf("MaxDeliver is %d after subscribe, want -1", info.Config.MaxDeliver)
		}
		if info.Delivered.Stream != 1 || info.NumAckPending != 1 {
			t.Fatalf("the updated consumer delivered up to %d with %d acks pending, want 1 and 1", info.Delivered.Stream, info.NumAckPending)
		}
	})

	// Ensure a consumer paused after its commit, past AckWait, while another
	// consumer takes the message over, applies it once: JetStream does not
	// fence the late ack (see natsBroker.ack), and it does no harm, because
	// the inbox row was committed first and the second run is a duplicate.
	t.Run("ConsumerPausedPastAckWaitAppliesOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payments := env.app.consumers()[0]
		var takenOver []receiveResult
		env.fault.set(func(point faultPoint, pass int) error {
			if point != faultAfterEffect || pass != 1 {
				return nil
			}
			// A is paused between its commit and its ack; B fetches the
			// message once AckWait has passed.
			deadline := time.Now().Add(10 * time.Second)
			for len(takenOver) == 0 && time.Now().Before(deadline) {
				results, err := env.app.consumeOnce(ctx, payments, 10)
				if err != nil {
					return err
				}
				takenOver = results
			}
			return nil
		})
		results, err := env.app.consumeOnce(ctx, payments, 10)
		if err != nil || len(results) != 1 || results[0].Outcome != inboxApplied {
			t.Fatalf("A got %v, %v; want applied and its late ack accepted", results, err)
		}
		if len(takenOver) != 1 || takenOver[0].Outcome != inboxDuplicate {
			t.Fatalf("B got %v, want one duplicate", takenOver)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances`); got != 1 {
			t.Fatalf("got %d sagas, want 1", got)
		}
		if info := consumerInfo(t, broker, paymentServiceConsumer+"_"+eventOrderCreated); info.NumAckPending != 0 || info.NumPending != 0 {
			t.Fatalf("the consumer still has %d pending acks and %d pending messages", info.NumAckPending, info.NumPending)
		}
	})
}

// countBehind is a durable consumer whose server's count of pending
// messages fell behind, as nats-server 2.9's can: every fetch that does not
// wait finds nothing, until the consumer's info is asked for, which makes
// the server count again.
type countBehind struct {
	jetstream.Consumer
	mu     sync.Mutex
	behind bool
	empty  int
}

// FetchNoWait finds nothing while the count is behind.
func (c *countBehind) FetchNoWait(batch int) (jetstream.MessageBatch, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.behind {
		c.empty++
		return emptyBatch{}, nil
	}
	return c.Consumer.FetchNoWait(batch)
}

// Info counts again, as the server does.
func (c *countBehind) Info(ctx context.Context) (*jetstream.ConsumerInfo, error) {
	c.mu.Lock()
	c.behind = false
	c.mu.Unlock()
	return c.Consumer.Info(ctx)
}

// emptyFetches returns how many fetches found nothing.
func (c *countBehind) emptyFetches() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.empty
}

// emptyBatch is a fetch's answer of "no messages".
type emptyBatch struct{}

func (emptyBatch) Messages() <-chan jetstream.Msg {
	messages := make(chan jetstream.Msg)
	close(messages)
	return messages
}

func (emptyBatch) Error() error { return nil }

// startTestNATS starts size nats-servers of the test's own from the binary
// named by RETRYSAFE_TEST_NATS_SERVER (a cluster if size is 3), and stops
// them when the test ends. It skips the test when the variable is not set.
func startTestNATS(tb testing.TB, size int, syncAlways bool) *natsCluster {
	tb.Helper()
	binary := os.Getenv("RETRYSAFE_TEST_NATS_SERVER")
	if binary == "" {
		tb.Skip("set RETRYSAFE_TEST_NATS_SERVER to a nats-server binary (2.10 or later) to run the tests that start their own servers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cluster, err := startNATSCluster(ctx, binary, tb.TempDir(), size, syncAlways, io.Discard)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(cluster.stop)
	if syncAlways && !cluster.syncAlways {
		tb.Skipf("%s does not know sync_interval: always (nats-server before 2.10)", binary)
	}
	return cluster
}

// Ensure a cluster whose server finds its port taken (by another process,
// after startNATSCluster picked it free) is started again on new ports,
// instead of waiting, a member short, for a stream it can never place: a
// test that started its own cluster beside a soak restarting its servers
// failed that way ("no suitable peers for placement").
func TestNATSClusterStartsAgainWhenAPortIsTaken(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	// It answers, as another process's server would: the server given
	// it as its client port exits, while its port still accepts.
	go func() {
		for {
			conn, err := taken.Accept()
			if err != nil {
				return
			}
			conn.Close()
		}
	}()
	picks := 0
	natsPortPicker = func() (string, error) {
		picks++
		if picks == 4 {
			// The second server's client port.
			return taken.Addr().String(), nil
		}
		return freeLoopbackAddr()
	}
	defer func() { natsPortPicker = freeLoopbackAddr }()
	cluster := startTestNATS(t, 3, false)
	if picks != 18 {
		t.Fatalf("picked %d ports, want 18: two starts of three servers with three ports each", picks)
	}
	if strings.Contains(cluster.url(), taken.Addr().String()) {
		t.Fatalf("the cluster %s still has the port that was taken", cluster.url())
	}
}

func TestNATSDurability(t *testing.T) {
	ctx := context.Background()

	// Ensure a process on a single server with the default sync policy is
	// warned of both settings that let JetStream lose what it
	// acknowledged, each by name.
	t.Run("OneReplicaAndLazySyncAreNamed", func(t *testing.T) {
		cluster := startTestNATS(t, 1, false)
		if policy, err := natsSyncPolicy(ctx, cluster.monitorURL()); err != nil || !policy.known {
			t.Skipf("the server does not report its sync policy (%v): nats-server before 2.10", err)
		}
		broker, err := openNATSBroker(ctx, cluster.url(), "DURABILITY", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer broker.close()
		warnings, err := natsDurabilityWarnings(ctx, broker, []string{cluster.monitorURL()})
		if err != nil {
			t.Fatal(err)
		}
		var settings []string
		for _, warning := range warnings {
			settings = append(settings, warning.Setting)
		}
		if got := strings.Join(settings, ","); got != "replicas,sync_interval" {
			t.Fatalf("warned of %q (%v), want replicas,sync_interval", got, warnings)
		}
		if !strings.Contains(warnings[1].Message, "every 2m0s") || !strings.Contains(warnings[1].Message, "sync_interval: always") {
			t.Fatalf("the sync warning says %q, want the interval and the setting that fixes it", warnings[1].Message)
		}
	})

	// Ensure a stream created through the three URLs of a cluster has
	// three replicas, and a cluster that syncs before it acknowledges
	// draws no warning.
	t.Run("ClusterOfThreeWithSyncAlwaysDrawsNone", func(t *testing.T) {
		cluster := startTestNATS(t, 3, true)
		broker, err := openNATSBroker(ctx, cluster.url(), "DURABILITY", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer broker.close()
		info, err := cluster.streamInfo(ctx, "DURABILITY")
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.Replicas != 3 {
			t.Fatalf("the stream has %d replicas, want 3", info.Config.Replicas)
		}
		warnings, err := natsDurabilityWarnings(ctx, broker, strings.Split(cluster.monitorURL(), ","))
		if err != nil || len(warnings) != 0 {
			t.Fatalf("got %v, %v; want no warning", warnings, err)
		}

		// Ensure a process that counts one server (given one URL, or
		// connected before the cluster told it of the others) keeps
		// the stream's three copies: its update must not scale it down
		// to one, which would leave every message on one server.
		if err := broker.ensureStream(ctx, 1); err != nil {
			t.Fatal(err)
		}
		info, err = cluster.streamInfo(ctx, "DURABILITY")
		if err != nil {
			t.Fatal(err)
		}
		if info.Config.Replicas != 3 {
			t.Fatalf("after an update from a process that counted one server, the stream has %d replicas, want 3", info.Config.Replicas)
		}
	})
}

// BenchmarkNATSPublish is the relay's publish on the NATS server(s) named
// by RETRYSAFE_TEST_NATS (several URLs: a cluster, and the stream gets 3
// replicas): one event at a time, each waiting for its acknowledgement
// (the latency a relay with one pending event sees), and batches of 100
// (relayBatchSize's order of size). Run it against servers with and
// without sync_interval: always to see what acknowledged-means-on-disk
// costs (README "PostgreSQL and NATS: what a lost write costs").
func BenchmarkNATSPublish(b *testing.B) {
	url := os.Getenv("RETRYSAFE_TEST_NATS")
	if url == "" {
		b.Skip("set RETRYSAFE_TEST_NATS to benchmark publishing to NATS JetStream")
	}
	for _, batch := range []int{1, 100} {
		b.Run(fmt.Sprintf("batch-%d", batch), func(b *testing.B) {
			ctx := context.Background()
			stream := fmt.Sprintf("RTBENCH%d_%d", os.Getpid(), natsStreamCounter.Add(1))
			broker, err := openNATSBroker(ctx, url, stream, time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			defer broker.close()
			defer func() {
				if err := broker.deleteStream(ctx); err != nil {
					b.Error(err)
				}
			}()
			payload := []byte(`{"order_id":"ord_bench","amount_cents":5000,"currency":"usd"}`)
			msgs := make([]message, batch)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for j := range msgs {
					msgs[j] = message{ID: fmt.Sprintf("evt_%d_%d", i, j), Subject: eventOrderCreated, Payload: payload}
				}
				if err := broker.publishBatch(ctx, msgs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "msgs/s")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/batch")
		})
	}
}

// mustPublishFailWithin publishes one message and fails tb unless the
// publish fails within limit.
func mustPublishFailWithin(tb testing.TB, broker *natsBroker, limit time.Duration) {
	tb.Helper()
	published := make(chan error, 1)
	started := time.Now()
	go func() {
		published <- broker.publishBatch(context.Background(), []message{{ID: "msg-1", Subject: "Ping", Payload: []byte(`{}`)}})
	}()
	select {
	case err := <-published:
		if err == nil {
			tb.Fatalf("the publish succeeded after %s; want it to fail", time.Since(started).Round(100*time.Millisecond))
		}
		tb.Logf("the publish failed after %s: %v", time.Since(started).Round(100*time.Millisecond), err)
	case <-time.After(limit):
		tb.Fatalf("the publish still waits after %s", limit)
	}
}

// stopNode stops node with SIGSTOP until the test ends.
func stopNode(tb testing.TB, node *natsNode) {
	tb.Helper()
	node.mu.Lock()
	process := node.cmd.Process
	node.mu.Unlock()
	if err := process.Signal(syscall.SIGSTOP); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { process.Signal(syscall.SIGCONT) })
	waitStopped(tb, process.Pid)
}

// waitStopped waits until every thread of process pid is stopped: kill
// returns before a thread running on another core has taken the signal,
// and meanwhile the server still answers (a publish right after SIGSTOP
// was acknowledged). Where there is no /proc, it waits a little instead.
func waitStopped(tb testing.TB, pid int) {
	tb.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		if len(stats) == 0 {
			time.Sleep(100 * time.Millisecond)
			return
		}
		stopped := true
		for _, path := range stats {
			stat, err := os.ReadFile(path)
			// The state follows the command name, which is in parentheses.
			if i := bytes.LastIndexByte(stat, ')'); err == nil && i+2 < len(stat) && stat[i+2] != 'T' && stat[i+2] != 't' {
				stopped = false
			}
		}
		if stopped {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("process %d has not stopped 5s after SIGSTOP", pid)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestNATSStalledServer(t *testing.T) {
	ctx := context.Background()

	// Ensure a publish to a server that stopped answering (SIGSTOP, or a
	// host gone without closing its connections) fails within seconds:
	// the client's pings go unanswered and it drops the connection, so
	// the relay records the failure and retries.
	t.Run("PublishToStoppedServerFails", func(t *testing.T) {
		cluster := startTestNATS(t, 1, false)
		broker, err := openNATSBroker(ctx, cluster.url(), "STALLED", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer broker.close()
		stopNode(t, cluster.nodes[0])
		mustPublishFailWithin(t, broker, 2*natsPublishTimeout)
	})

	// Ensure a publish through a healthy server of a cluster, to a stream
	// that lost its quorum (two of its three servers stopped answering, so
	// no leader can be elected and nothing can be acknowledged), fails
	// after natsPublishTimeout: the connection to the healthy server stays
	// up, so only the publish's own timeout ends the wait. (With one
	// server stopped, the others may elect a leader that takes the
	// publish, and it succeeds.)
	t.Run("PublishToStreamWithoutQuorumFails", func(t *testing.T) {
		cluster := startTestNATS(t, 3, false)
		creator, err := openNATSBroker(ctx, cluster.url(), "STALLED", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		creator.close()
		_, leader, followers, err := cluster.streamCluster(ctx, "STALLED")
		if err != nil {
			t.Fatal(err)
		}
		broker, err := openNATSBroker(ctx, "nats://"+followers[0].clientAddr, "STALLED", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer broker.close()
		stopNode(t, leader)
		stopNode(t, followers[1])
		mustPublishFailWithin(t, broker, 2*natsPublishTimeout)
	})
}
