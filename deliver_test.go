package main

import (
	"context"
	"database/sql"
	"errors"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestDelivery(t *testing.T) {
	ctx := context.Background()
	first := func(int) int { return 0 }

	// Ensure a message the broker lost after acknowledging it is published
	// again once the delivery bound passes, and applied once: the order
	// settles instead of staying created for ever.
	t.Run("MessageTheBrokerLostIsRepublishedAndAppliedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("relay published %d, %v, want 1", n, err)
		}
		lost, err := loseEmbeddedMessages(ctx, env.app.db, 1, first)
		if err != nil || len(lost) != 1 {
			t.Fatalf("the broker lost %v, %v, want the OrderCreated", lost, err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, order); got != "created" {
			t.Fatalf("before the bound the order is %s, want created (nothing delivered it)", got)
		}
		mustRepublishOneAndPay(t, env, order, "the OrderCreated the broker lost")
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, order); got != 1 {
			t.Fatalf("got %d charges, want 1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE delivery_position >= `+deliveryCursor); got != 0 {
			t.Fatalf("the reconciler's cursor has not passed %d events, want 0", got)
		}
		mustAudit(t, env, true)
	})

	// Ensure the metrics show a lost message: undelivered events and the
	// age of the oldest, which grows past the bound until the reconciler
	// publishes it again and the consumers apply it, and the republish
	// counted by the process that made it.
	t.Run("MetricsShowTheUndeliveredAndTheRepublished", func(t *testing.T) {
		env := MustOpenApp(t)
		m := env.app.enableMetrics()
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		env.drain(t)
		env.clock.advance(deliveryBound)
		published, err := time.Parse(timeFormat, env.str(t, `SELECT published_at FROM outbox_events`))
		if err != nil {
			t.Fatal(err)
		}
		checkMetrics(t, gather(t, m), []metricCheck{
			{"retrysafe_outbox_undelivered_events", nil, 1},
			{"retrysafe_outbox_oldest_undelivered_age_seconds", nil, env.app.now().Sub(published).Seconds()},
			{"retrysafe_outbox_republished_events_total", nil, 0},
		})
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want 1", n, err)
		}
		env.drain(t)
		if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		checkMetrics(t, gather(t, m), []metricCheck{
			{"retrysafe_outbox_undelivered_events", nil, 0},
			{"retrysafe_outbox_oldest_undelivered_age_seconds", nil, 0},
			{"retrysafe_outbox_republished_events_total", nil, 1},
		})
	})

	// Ensure trace and inspect show an event's delivery per consumer: which
	// inbox it is missing from, its republish, and when it was delivered.
	t.Run("TraceAndInspectShowDeliveryPerConsumer", func(t *testing.T) {
		env := MustOpenApp(t)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		shown := func() (string, string) {
			trace, err := traceOrder(ctx, env.app.db, order)
			if err != nil {
				t.Fatal(err)
			}
			var traced, inspected strings.Builder
			if err := printTrace(&traced, trace); err != nil {
				t.Fatal(err)
			}
			if err := inspect(ctx, env.app.db, &inspected, inspectOptions{view: inspectWide, orderID: order}); err != nil {
				t.Fatal(err)
			}
			return traced.String(), inspected.String()
		}
		traced, inspected := shown()
		if !strings.Contains(traced, "not delivered yet: not in the inbox of "+paymentServiceConsumer) {
			t.Errorf("trace of a lost OrderCreated does not name the inbox it is missing from:\n%s", traced)
		}
		if !regexp.MustCompile(`OrderCreated\s+` + paymentServiceConsumer + `\s+published\s+missing\s+0`).MatchString(inspected) {
			t.Errorf("inspect does not show the OrderCreated missing from %s's inbox:\n%s", paymentServiceConsumer, inspected)
		}
		env.clock.advance(deliveryBound)
		if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		env.drain(t)
		if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		traced, inspected = shown()
		for _, want := range []string{"undelivered after 5m0s (1 in all)", "delivered: in the inbox of " + paymentServiceConsumer} {
			if !strings.Contains(traced, want) {
				t.Errorf("trace does not say %q:\n%s", want, traced)
			}
		}
		if !regexp.MustCompile(`OrderCreated\s+` + paymentServiceConsumer + `\s+published\s+done\s+1\s+\d+\s+yes`).MatchString(inspected) {
			t.Errorf("inspect does not show the OrderCreated applied by %s after one republish:\n%s", paymentServiceConsumer, inspected)
		}
	})

	// Ensure a consumer that is merely slow gets no copy before the bound,
	// and a delivered event none after it.
	t.Run("DeliveredOrSlowEventsAreNotRepublished", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(deliveryBound - time.Second)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("before the bound the reconciler republished %d, %v, want 0", n, err)
		}
		env.drain(t)
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("the reconciler republished %d delivered events, %v, want 0", n, err)
		}
		if got := env.count(t, `SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages`); got != 0 {
			t.Fatalf("the broker absorbed %d copies, want none sent", got)
		}
	})

	// Ensure an event one consumer applied and another never got is
	// published again: the second applies it once, the first's inbox
	// absorbs the copy.
	t.Run("EventOneConsumerMissedIsRepublishedAndTheOtherAbsorbsIt", func(t *testing.T) {
		env := MustOpenApp(t)
		analytics, applied := subscribeAnalytics(t, env)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		env.drain(t) // the payment service applies it, analytics never runs
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want the OrderCreated analytics missed", n, err)
		}
		for range 2 {
			if _, err := env.app.consumeOnce(ctx, analytics, consumeBatchSize); err != nil {
				t.Fatal(err)
			}
		}
		env.drain(t)
		if *applied != 1 {
			t.Fatalf("analytics applied the event %d times, want 1", *applied)
		}
		if got := env.count(t, `SELECT duplicates FROM inbox_messages i JOIN outbox_events e ON e.event_id = i.message_id
			WHERE i.consumer = ? AND e.aggregate_id = ? AND e.event_type = 'OrderCreated'`, paymentServiceConsumer, order); got != 1 {
			t.Fatalf("the payment service's inbox absorbed %d copies, want 1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, order); got != 1 {
			t.Fatalf("got %d charges, want 1", got)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("once both applied it the reconciler republished %d, %v, want 0", n, err)
		}
	})

	// Ensure a message the broker lost while every relay was down for over
	// a week is still published again when they come back, and is still a
	// duplicate to the consumer that applied it: cleanup kept that
	// consumer's inbox row, because the event was not delivered to all.
	t.Run("LostMessageIsRepublishedAWeekLater", func(t *testing.T) {
		env := MustOpenApp(t)
		analytics, applied := subscribeAnalytics(t, env)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		env.drain(t) // the payment service applies it, analytics never runs
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(messageRetention + time.Hour)
		if _, err := env.app.cleanupOnce(ctx); err != nil {
			t.Fatal(err)
		}
		// The event sits at the cursor: the payment service's week-old
		// row of it is what makes the copy below a duplicate there.
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND message_id IN (SELECT event_id FROM outbox_events WHERE aggregate_id = ?)`,
			paymentServiceConsumer, order); got != 1 {
			t.Fatalf("cleanup left %d of the payment service's inbox rows of an event the cursor has not passed, want 1", got)
		}
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("a week later the reconciler republished %d, %v, want the OrderCreated analytics missed", n, err)
		}
		for range 2 {
			if _, err := env.app.consumeOnce(ctx, analytics, consumeBatchSize); err != nil {
				t.Fatal(err)
			}
		}
		env.drain(t)
		if *applied != 1 {
			t.Fatalf("analytics applied the event %d times, want 1", *applied)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, order); got != 1 {
			t.Fatalf("got %d charges, want 1: the payment service applied the copy again", got)
		}
	})

	// Ensure the cursor never passes a publish whose transaction is still
	// committing, on PostgreSQL: there a transaction with a lower id (A's
	// publish) can commit after one with a higher id (B's) is visible and
	// delivered. A cursor moved past B would never read A, and a message
	// of A the broker lost would never be published again. (SQLite runs
	// one writer at a time: A's transaction would hold B back.)
	t.Run("CursorWaitsForAPublishStillCommitting", func(t *testing.T) {
		env := MustOpenApp(t)
		if dialectOf(env.app.db).name != "postgres" {
			t.Skip("SQLite's one writer commits publishes in the order of their positions")
		}
		orderA := orderField(mustCreateOrder(t, env, "user-42", "kA", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		eventA := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderA)
		// A's publish: the relay's mark, in a transaction that takes its
		// id now and commits last. The broker never got A's message.
		if _, err := env.app.db.Exec(`UPDATE outbox_events SET next_attempt_at = '9999-01-01T00:00:00.000000Z' WHERE event_id = ?`, eventA); err != nil {
			t.Fatal(err)
		}
		publishA, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer publishA.Rollback()
		_, err = publishA.ExecContext(ctx, `UPDATE outbox_events SET status = 'published', published_at = ?, delivery_position = `+dialectOf(env.app.db).deliveryPosition+` WHERE event_id = ?`,
			formatTime(env.clock.now()), eventA)
		if err != nil {
			t.Fatal(err)
		}
		// B: created, published, applied and settled while A's publish
		// is still open; every sweep of the reconciler runs meanwhile.
		orderB := createAndDrain(t, env, "kB", orderBody(100, "sku-1", 1, pmCardVisa))
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderB); got != "paid" {
			t.Fatalf("order B is %s, want paid", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE aggregate_id = ? AND delivery_position < `+deliveryCursor, orderB); got != 0 {
			t.Fatalf("the cursor passed %d of B's events while A's publish, with a lower id, was still open; want 0", got)
		}
		if err := publishA.Commit(); err != nil {
			t.Fatal(err)
		}
		mustRepublishOneAndPay(t, env, orderA, "A's OrderCreated, which the broker never had")
		mustAudit(t, env, true)
	})

	// Ensure an event cannot be marked published without its delivery
	// position, as a relay built before schema version 12 would mark it
	// while running beside a process that migrated: no sweep would ever
	// read it, and a message of it the broker lost would never be
	// published again. The mark fails, and the event waits for a relay
	// that stamps it.
	t.Run("PublishWithoutAPositionIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		_, err := env.app.db.Exec(`UPDATE outbox_events SET status = 'published', published_at = ?`, formatTime(env.clock.now()))
		if err == nil {
			t.Fatal("an event was marked published without a delivery position")
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`); got != 1 {
			t.Fatalf("got %d pending events after the refused mark, want 1", got)
		}
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure an event published after cleanup deleted every event the
	// cursor had passed still gets a position the cursor has not passed:
	// stamped below it, the reconciler would never read it again, and a
	// message the broker lost would never be published again.
	t.Run("EventAfterCleanupEmptiedTheOutboxIsWatched", func(t *testing.T) {
		env := MustOpenApp(t)
		createAndDrain(t, env, "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		env.clock.advance(messageRetention + time.Hour)
		if _, err := env.app.cleanupOnce(ctx); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != 0 {
			t.Fatalf("cleanup kept %d events, want 0", got)
		}
		order := orderField(mustCreateOrder(t, env, "user-42", "k2", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if lost, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil || len(lost) != 1 {
			t.Fatalf("lost %v, %v, want the OrderCreated", lost, err)
		}
		mustRepublishOneAndPay(t, env, order, "the OrderCreated the broker lost")
		mustAudit(t, env, true)
	})

	// Ensure an event delivered because its consumer recorded it poison
	// (the cursor passed it) is watched again once an operator replays it: a replay the
	// broker loses is published again (simulator seed 176 of the second
	// consumer: the ledger never booked the order).
	t.Run("ReplayTheBrokerLostIsRepublished", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		eventID := poisonForPaymentService(t, env)
		if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE event_id = ? AND delivery_position < `+deliveryCursor, eventID); got != 1 {
			t.Fatalf("the reconciler's cursor passed %d poison events, want 1", got)
		}
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		if lost, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil || len(lost) != 1 {
			t.Fatalf("lost %v, %v, want the replay", lost, err)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want the replayed OrderCreated the broker lost", n, err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
	})

	// Ensure a replay the broker loses is published again even when
	// cleanup deleted another consumer's inbox row of the event meanwhile
	// (the consumer that gave up waited a week for its fix), and that the
	// copy is a duplicate there. Replays used to leave such an event
	// counted as delivered (a copy would have been new to the other
	// consumer), so nothing published the lost replay again; now the
	// replay writes the other consumer's row again first.
	t.Run("ReplayLostAfterCleanupIsRepublished", func(t *testing.T) {
		env := MustOpenApp(t)
		analytics, broken, applied := addBrokenAnalytics(t, env)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		env.drain(t)
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'analytics' AND status = 'poison'`); got != 1 {
			t.Fatalf("analytics holds %d poison messages, want its OrderCreated", got)
		}
		env.clock.advance(messageRetention + time.Hour)
		if _, err := env.app.cleanupOnce(ctx); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?`, paymentServiceConsumer); got != 0 {
			t.Fatalf("cleanup kept %d inbox rows of the payment service, want its week-old row deleted", got)
		}
		*broken = false
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{Consumer: "analytics", AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.db.ExecContext(ctx, `DELETE FROM broker_deliveries WHERE subscriber = 'analytics'`); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want the replay the broker lost", n, err)
		}
		if _, err := env.app.consumeOnce(ctx, analytics, consumeBatchSize); err != nil {
			t.Fatal(err)
		}
		env.drain(t)
		if *applied != 1 {
			t.Fatalf("analytics applied the event %d times, want 1", *applied)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison'`); got != 0 {
			t.Fatalf("%d poison messages after the copy, want none", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ?`, order); got != 1 {
			t.Fatalf("got %d charges, want 1", got)
		}
	})

	// Ensure a replay writes no inbox row for a consumer that has not
	// applied the event when the reconciler's cursor sits exactly at it
	// (stopped there because that consumer lacks it): only an event the
	// cursor has passed was applied by every consumer. With the cursor's
	// own position counted as passed, the payment service got a row it
	// never applied, its copy was skipped as a duplicate, and the order
	// was never paid.
	t.Run("ReplayOfAnEventAtTheCursorLeavesTheOthersToApplyIt", func(t *testing.T) {
		env := MustOpenApp(t)
		analytics, broken, applied := addBrokenAnalytics(t, env)
		order := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.consumeOnce(ctx, analytics, consumeBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE delivery_position = `+deliveryCursor); got != 1 {
			t.Fatalf("%d events at the cursor, want the OrderCreated the payment service has not applied", got)
		}
		*broken = false
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{Consumer: "analytics", AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?`, paymentServiceConsumer); got != 0 {
			t.Fatalf("the replay wrote %d inbox rows for the payment service, which has not applied the event", got)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, order); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		if *applied != 1 {
			t.Fatalf("analytics applied the event %d times, want 1", *applied)
		}
	})

	// Ensure a replay counts as the event's last publish for the
	// reconciler: an event it republished once, then recorded poison and
	// replayed deliveryBound or more after that copy, gets no copy at the
	// next sweep, and gets one only deliveryBound after the replay. The
	// bound was measured from the reconciler's own last copy alone, which
	// the replay left as it was, so every replay of an event republished
	// before was republished again at once.
	t.Run("ReplayOfARepublishedEventWaitsItsBound", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if lost, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil || len(lost) != 1 {
			t.Fatalf("lost %v, %v, want the OrderCreated", lost, err)
		}
		env.clock.advance(deliveryBound)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("reconciler republished %d, %v, want the OrderCreated the broker lost", n, err)
		}
		poisonForPaymentService(t, env)
		env.clock.advance(deliveryBound)
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("right after the replay the reconciler republished %d, %v, want none", n, err)
		}
		env.clock.advance(deliveryBound - time.Second)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("within the bound from the replay the reconciler republished %d, %v, want none", n, err)
		}
		env.clock.advance(time.Second)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("the bound after the replay the reconciler republished %d, %v, want the replay nobody applied", n, err)
		}
		if got := env.count(t, `SELECT republishes FROM outbox_events`); got != 2 {
			t.Fatalf("the event records %d republishes, want 2", got)
		}
	})

	// Ensure a replay counts the delivery lag from the replay: an event
	// first published longer than deliveryLag ago, poison since and
	// replayed, is in flight, not late. Counted from its first publish,
	// the audit after every repair failed on the replay itself.
	t.Run("ReplayOfAnOldEventIsInFlightNotLate", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		poisonForPaymentService(t, env)
		env.clock.advance(deliveryLag + time.Minute)
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		violations, err := audit(ctx, env.app.db, env.clock.now(), false)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range violations {
			t.Errorf("right after the replay: %s: %s", v.Invariant, v.Detail)
		}
		env.clock.advance(deliveryLag + time.Minute)
		violations, err = audit(ctx, env.app.db, env.clock.now(), false)
		if err != nil {
			t.Fatal(err)
		}
		if len(violations) != 1 || violations[0].Invariant != undeliveredInvariant {
			t.Fatalf("a replay nobody applied for %s: violations %v, want %q", deliveryLag, violations, undeliveredInvariant)
		}
	})

	// Ensure two relays never republish one event in one sweep, and that a
	// relay paused past its lease cannot record a republish of an event
	// that a relay under the same name (a restarted process) claimed since
	// and is republishing: its write carries the claim's token, which the
	// other claim replaced. Without the token in the WHERE, A's record took
	// B's claim away and B's record, the one that counts, matched nothing.
	t.Run("PausedRelayCannotRecordARepublishAnotherClaimed", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(deliveryBound)
		concurrent := -1
		bPublished, resumeB, bDone := make(chan struct{}), make(chan struct{}), make(chan int, 1)
		// A test that fails while B is held still lets B go.
		releaseB := sync.OnceFunc(func() { close(resumeB) })
		t.Cleanup(releaseB)
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			switch {
			case workerOf(ctx) == "A" && point == faultPublish:
				// A holds the claim: B finds nothing to take.
				n, err := env.app.reconcileOnce(withWorker(ctx, "B"), "relay", relayBatchSize)
				if err != nil {
					return err
				}
				concurrent = n
				// A is paused past its lease; B takes the event over.
				env.clock.advance(env.app.leases.relay + time.Second)
				go func() {
					n, err := env.app.reconcileOnce(withWorker(ctx, "B"), "relay", relayBatchSize)
					if err != nil {
						t.Error(err)
					}
					bDone <- n
				}()
				mustReceive(t, "relay B to take the event over and republish it", bPublished)
			case workerOf(ctx) == "B" && point == faultAfterPublish:
				close(bPublished)
				_, err := await("the test to let relay B record its republish", resumeB)
				return err
			}
			return nil
		})
		recordedByA, err := env.app.reconcileOnce(withWorker(ctx, "A"), "relay", relayBatchSize)
		if err != nil {
			t.Fatal(err)
		}
		releaseB()
		recordedByB := mustReceive(t, "relay B to finish", bDone)
		if concurrent != 0 || recordedByA != 0 || recordedByB != 1 {
			t.Fatalf("B republished %d while A held the claim; A recorded %d, B %d after taking it over; want 0, 0, 1",
				concurrent, recordedByA, recordedByB)
		}
		if got := env.count(t, `SELECT republishes FROM outbox_events WHERE claimed_by IS NULL`); got != 1 {
			t.Fatalf("the event records %d republishes, want 1 (B's), and no claim left", got)
		}
		env.fault.set(nil)
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure the cursor only moves up: a sweep paused between reading
	// where the cursor may go and moving it, while other sweeps move it
	// further, leaves it where they put it when it wakes. Set back, the
	// events in between would be read by every sweep again, and cleanup's
	// deletions would no longer all lie below the cursor.
	t.Run("SweepPausedBeforeItsMoveNeverSetsTheCursorBack", func(t *testing.T) {
		env := MustOpenApp(t)
		createAndDrain(t, env, "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		mustCreateOrder(t, env, "user-42", "k2", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		for _, c := range env.app.consumers() {
			if _, err := env.app.consumeOnce(ctx, c, consumeBatchSize); err != nil {
				t.Fatal(err)
			}
		}
		var furthest int64
		paused := false
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			if point != faultBeforeCursorMove || paused {
				return nil
			}
			// Paused: meanwhile the order is paid, and other sweeps
			// move the cursor past its PaymentCaptured.
			paused = true
			env.drain(t)
			furthest = int64(env.count(t, `SELECT position FROM delivery_cursor WHERE name = 'outbox'`))
			return nil
		})
		if err := env.app.advanceDeliveryCursor(ctx); err != nil {
			t.Fatal(err)
		}
		if !paused {
			t.Fatal("the sweep had nowhere to move the cursor")
		}
		if got := int64(env.count(t, `SELECT position FROM delivery_cursor WHERE name = 'outbox'`)); got != furthest {
			t.Fatalf("the cursor is at %d after the paused sweep woke, want %d, where the other sweeps put it", got, furthest)
		}
		env.fault.set(nil)
		mustAudit(t, env, true)
	})

	// Ensure cleanup moves the reconciler's cursor before it deletes: an
	// event applied a week ago, which no sweep had passed since, is
	// deleted with its inbox rows, not kept for ever.
	t.Run("CleanupMovesTheCursorFirst", func(t *testing.T) {
		env := MustOpenApp(t)
		createAndDrain(t, env, "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.db.Exec(`UPDATE delivery_cursor SET position = 0`); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(messageRetention + time.Hour)
		if _, err := env.app.cleanupOnce(ctx); err != nil {
			t.Fatal(err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != 0 {
			t.Errorf("cleanup kept %d delivered events, want 0", got)
		}
		mustAudit(t, env, true)
	})

	// Ensure a republish the broker refuses leaves the event claimed and
	// undelivered, and the next sweep after the lease tries again.
	t.Run("RefusedRepublishIsTriedAgain", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := loseEmbeddedMessages(ctx, env.app.db, 1, first); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(deliveryBound)
		env.fault.failAt(faultPublish, errors.New("broker unreachable"), 1)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("got %d, %v, want 0 republished, and no error: the broker refused, the sweep did not fail", n, err)
		}
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("within the claim's lease: got %d, %v, want 0", n, err)
		}
		env.clock.advance(env.app.leases.relay)
		if n, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("got %d, %v, want 1 republished", n, err)
		}
		env.drain(t)
		mustAudit(t, env, true)
	})
}

// poisonForPaymentService does what fetchedAsPoison does, then acks the
// delivery and lets the reconciler sweep, which counts the poison record as
// delivered. It returns the event's id.
func poisonForPaymentService(t *testing.T, env *testEnv) string {
	t.Helper()
	ctx := context.Background()
	fetched := fetchedAsPoison(t, env)
	if err := env.app.broker.ack(ctx, fetched); err != nil {
		t.Fatal(err)
	}
	if _, err := env.app.reconcileOnce(ctx, "relay-1", relayBatchSize); err != nil {
		t.Fatal(err)
	}
	return fetched.ID
}

// fetchedAsPoison relays the pending OrderCreated, fetches it for the
// payment service and records it poison there (as its release with a bug
// would), and returns the delivery, not acked.
func fetchedAsPoison(t *testing.T, env *testEnv) delivery {
	t.Helper()
	ctx := context.Background()
	if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
		t.Fatal(err)
	}
	fetched, err := env.app.broker.fetch(ctx, paymentServiceConsumer, 1)
	if err != nil || len(fetched) != 1 {
		t.Fatalf("fetched %v, %v", fetched, err)
	}
	if _, err := env.app.db.Exec(`INSERT INTO inbox_messages (consumer, message_id, status, error, delivery_count, processed_at) VALUES (?, ?, 'poison', 'payment service bug', 1, ?)`,
		paymentServiceConsumer, fetched[0].ID, formatTime(env.clock.now())); err != nil {
		t.Fatal(err)
	}
	return fetched[0]
}

// subscribeAnalytics adds a second consumer of OrderCreated, as an
// analytics service would be, that the reconciler waits for; it counts
// what it applies.
func subscribeAnalytics(t *testing.T, env *testEnv) (consumer, *int) {
	t.Helper()
	analytics := consumer{name: "analytics", subjects: []string{eventOrderCreated}}
	applied := new(int)
	analytics.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		*applied++
		return nil
	}
	env.app.deliveryTargets = append(env.app.deliveryTargets, deliveryTarget{subject: eventOrderCreated, consumer: analytics.name})
	if err := env.app.broker.subscribe(context.Background(), analytics.name, analytics.subjects...); err != nil {
		t.Fatal(err)
	}
	return analytics, applied
}

// mustRepublishOneAndPay moves env's clock past the delivery bound,
// expects one sweep of the reconciler to publish one event again (lost,
// which the broker lost), and orderID to end paid once the workers are
// quiet.
func mustRepublishOneAndPay(t *testing.T, env *testEnv, orderID, lost string) {
	t.Helper()
	env.clock.advance(deliveryBound)
	if n, err := env.app.reconcileOnce(context.Background(), "relay-1", relayBatchSize); err != nil || n != 1 {
		t.Fatalf("the reconciler republished %d, %v, want %s", n, err, lost)
	}
	env.drain(t)
	if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != "paid" {
		t.Fatalf("order %s is %s, want paid", orderID, got)
	}
}

// addBrokenAnalytics adds a second consumer of OrderCreated to env, which
// records every message poison while *broken (a bug of its release) and
// counts in *applied what it applies once fixed.
func addBrokenAnalytics(t *testing.T, env *testEnv) (analytics consumer, broken *bool, applied *int) {
	t.Helper()
	broken, applied = new(bool), new(int)
	*broken = true
	analytics = consumer{name: "analytics", subjects: []string{eventOrderCreated}, apply: func(ctx context.Context, tx *sql.Tx, msg message) error {
		if *broken {
			return permanent(errors.New("a bug of the analytics release"))
		}
		*applied++
		return nil
	}}
	if err := env.app.addConsumer(context.Background(), analytics); err != nil {
		t.Fatal(err)
	}
	return analytics, broken, applied
}
