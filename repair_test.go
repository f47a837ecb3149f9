package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// failPublishing makes the broker refuse every publish until the relay has
// tried maxPublishAttempts times and marked what it held failed.
func failPublishing(tb testing.TB, env *testEnv) {
	tb.Helper()
	ctx := context.Background()
	env.fault.failAt(faultPublish, errors.New("broker unreachable"), maxPublishAttempts)
	for range maxPublishAttempts {
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			tb.Fatalf("relay: %v", err)
		}
		// Past the longest relayBackoff.
		env.clock.advance(6 * time.Minute)
	}
	env.fault.failAt("", nil, 0)
}

// poisonFor delivers every pending message of c to a handler that fails
// with cause until the inbox records the messages as poison (at once for a
// permanent cause, after maxDeliveries for a transient one).
func poisonFor(tb testing.TB, env *testEnv, c consumer, cause error) {
	tb.Helper()
	ctx := context.Background()
	broken := c
	broken.apply = func(ctx context.Context, tx *sql.Tx, msg message) error { return cause }
	for range 50 {
		results, err := env.app.consumeOnce(ctx, broken, consumeBatchSize)
		if err != nil {
			tb.Fatalf("consume %s: %v", c.name, err)
		}
		for _, result := range results {
			if result.Outcome == inboxPoison {
				return
			}
		}
		// Past the longest consumeBackoff of maxDeliveries failures.
		env.clock.advance(time.Minute)
	}
	tb.Fatalf("no message of %s became poison", c.name)
}

// consumerNamed returns the App's consumer called name.
func consumerNamed(tb testing.TB, env *testEnv, name string) consumer {
	tb.Helper()
	for _, c := range env.app.consumers() {
		if c.name == name {
			return c
		}
	}
	tb.Fatalf("no consumer %s", name)
	return consumer{}
}

// repairState returns every row a repair may change, so that a test can
// tell that a refusal changed nothing.
func repairState(tb testing.TB, env *testEnv) string {
	tb.Helper()
	return env.str(tb, `
		SELECT COALESCE((SELECT string_agg(event_id || ':' || status || ':' || attempts || ':' || lease_token, ' ' ORDER BY seq) FROM outbox_events), '') || ' | ' ||
		       COALESCE((SELECT string_agg(consumer || ':' || message_id || ':' || status, ' ' ORDER BY consumer, message_id) FROM inbox_messages), '') || ' | ' ||
		       COALESCE((SELECT string_agg(consumer || ':' || message_id || ':' || failures, ' ' ORDER BY consumer, message_id) FROM inbox_failures), '') || ' | ' ||
		       COALESCE((SELECT string_agg(saga_id || ':' || status || ':' || attempts || ':' || lease_token, ' ' ORDER BY saga_id) FROM saga_instances), '') || ' | ' ||
		       COALESCE((SELECT string_agg(subscriber || ':' || message_seq || ':' || status, ' ' ORDER BY subscriber, message_seq) FROM broker_deliveries), '') || ' | ' ||
		       (SELECT COUNT(*) FROM repair_log)`)
}

// mustAuditClean fails the test unless the audit (settled or in flight)
// finds nothing.
func mustAuditClean(tb testing.TB, env *testEnv, settled bool) {
	tb.Helper()
	violations, err := audit(context.Background(), env.app.db, env.clock.now(), settled)
	if err != nil {
		tb.Fatal(err)
	}
	if len(violations) > 0 {
		tb.Fatalf("audit (settled=%v) found %v", settled, violations)
	}
}

// repairLog returns the repair_log rows as "operator|action|target" lines.
func repairLog(tb testing.TB, env *testEnv) string {
	tb.Helper()
	return env.str(tb, `SELECT COALESCE(string_agg(operator || '|' || action || '|' || target, '; ' ORDER BY repair_id), '') FROM repair_log`)
}

// mustRefuse fails the test unless err is a refusal of kind whose message
// contains want.
func mustRefuse(tb testing.TB, err, kind error, want string) {
	tb.Helper()
	if !errors.Is(err, kind) || !strings.Contains(err.Error(), want) {
		tb.Fatalf("got %v, want %v naming %q", err, kind, want)
	}
}

func TestOutboxRetry(t *testing.T) {
	ctx := context.Background()

	// Ensure a failed event goes back to pending with its attempts reset,
	// the repair is logged with its operator, and the relay then publishes
	// it and the order finishes with a clean audit.
	t.Run("FailedEventIsPublishedAfterRetry", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)
		if got := env.str(t, `SELECT status || ':' || attempts FROM outbox_events WHERE event_id = ?`, eventID); got != fmt.Sprintf("failed:%d", maxPublishAttempts) {
			t.Fatalf("event is %s, want failed after %d attempts", got, maxPublishAttempts)
		}
		token := env.count(t, `SELECT lease_token FROM outbox_events WHERE event_id = ?`, eventID)

		results, err := env.app.retryOutboxEvents(ctx, "alice", outboxRetryTarget{EventID: eventID})
		if err != nil {
			t.Fatal(err)
		}
		if len(results) != 1 || results[0].Target != eventID || !strings.Contains(results[0].Result, "pending again") {
			t.Fatalf("got %+v", results)
		}
		if got := env.str(t, `SELECT status || ':' || attempts FROM outbox_events WHERE event_id = ?`, eventID); got != "pending:0" {
			t.Fatalf("event is %s after the retry, want pending:0", got)
		}
		if got := env.count(t, `SELECT lease_token FROM outbox_events WHERE event_id = ?`, eventID); got != token+1 {
			t.Fatalf("lease token %d after the retry, want %d: a relay's old claim must be fenced out", got, token+1)
		}
		if got := repairLog(t, env); got != "alice|outbox retry|"+eventID {
			t.Fatalf("repair_log: %s", got)
		}
		mustAuditClean(t, env, false)
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		mustAuditClean(t, env, true)
	})

	// Ensure retrying an order's failed event releases the later events of
	// that order, which the relay held back behind it, in their order.
	t.Run("LaterEventsOfTheOrderAreNoLongerHeldBack", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		req, refund := refundRequestFor(t, orderID, "refund-1", `{"amount_cents":1000}`)
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); err != nil {
			t.Fatal(err)
		}
		failPublishing(t, env)
		req, refund = refundRequestFor(t, orderID, "refund-2", `{"amount_cents":2000}`)
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); err != nil {
			t.Fatal(err)
		}
		if n, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil || n != 0 {
			t.Fatalf("relay published %d, %v; want nothing while the first refund's event is failed", n, err)
		}
		results, err := env.app.retryOutboxEvents(ctx, "alice", outboxRetryTarget{OrderID: orderID})
		if err != nil || len(results) != 1 {
			t.Fatalf("got %+v, %v; want one event retried", results, err)
		}
		if n, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("relay published %d, %v; want the retried event", n, err)
		}
		if n, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("relay published %d, %v; want the event that waited behind it", n, err)
		}
		if got := env.str(t, `SELECT string_agg(status, ' ' ORDER BY seq) FROM outbox_events WHERE event_type = 'OrderRefunded'`); got != "published published" {
			t.Fatalf("refund events: %s", got)
		}
		env.drain(t)
		mustAuditClean(t, env, true)
	})

	// Ensure --all-failed retries the failed events of every order at once.
	t.Run("AllFailedRetriesEveryOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		mustCreateOrder(t, env, "user-42", "k2", orderBody(5000, "sku-2", 1, pmCardVisa))
		failPublishing(t, env)
		results, err := env.app.retryOutboxEvents(ctx, "alice", outboxRetryTarget{AllFailed: true})
		if err != nil || len(results) != 2 {
			t.Fatalf("got %+v, %v; want both events retried", results, err)
		}
		env.drain(t)
		mustAuditClean(t, env, true)
	})

	// Ensure an unknown event or order, an event that did not fail, and an
	// order or system without failed events are refused with a message
	// that names the problem, and nothing changes.
	t.Run("RefusesWhatIsNotFailed", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		published := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, orderID)
		before := repairState(t, env)
		for _, tc := range []struct {
			target outboxRetryTarget
			kind   error
			want   string
		}{
			{outboxRetryTarget{EventID: "evt_nope"}, errRepairNotFound, "no outbox event evt_nope"},
			{outboxRetryTarget{EventID: published}, errRepairRefused, published + " is published, not failed"},
			{outboxRetryTarget{OrderID: "ord_nope"}, errRepairNotFound, "no outbox event of order ord_nope"},
			{outboxRetryTarget{OrderID: orderID}, errRepairRefused, "order " + orderID + " has no failed outbox event"},
			{outboxRetryTarget{AllFailed: true}, errRepairRefused, "no outbox event is failed"},
		} {
			_, err := env.app.retryOutboxEvents(ctx, "alice", tc.target)
			mustRefuse(t, err, tc.kind, tc.want)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure the command refuses no target, two targets and a missing
	// operator before it touches the database, and on success prints what
	// it did and the audit; with another event still failed the audit
	// fails, and so does the command, though its repair is committed.
	t.Run("Command", func(t *testing.T) {
		env := MustOpenApp(t)
		first := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		second := orderField(mustCreateOrder(t, env, "user-42", "k2", orderBody(5000, "sku-2", 1, pmCardVisa)).Body, "order_id")
		failPublishing(t, env)
		firstEvent := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, first)
		before := repairState(t, env)
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"outbox", "retry"}, "needs one of EVENT_ID or --order or --all-failed"},
			{[]string{"outbox", "retry", firstEvent, "--all-failed"}, "not EVENT_ID and --all-failed together"},
			{[]string{"outbox", "retry", "--order", first, "--all-failed"}, "not --order and --all-failed together"},
			{[]string{"outbox", "retry", "a", "b"}, "takes one EVENT_ID (got 2 arguments)"},
			{[]string{"outbox", "retry", "--operator", " ", firstEvent}, "--operator NAME"},
			{[]string{"outbox", "retry", "evt_nope"}, "not found: no outbox event evt_nope"},
		} {
			args := append(tc.args, "--db", env.path)
			if !strings.Contains(strings.Join(tc.args, " "), "--operator") {
				args = append(args, "--operator", "alice")
			}
			mustRefuseCommand(t, args, tc.want)
		}
		mustBeUnchanged(t, env, before)

		out, err := runTraceCLI(t, "outbox", "retry", "--db", env.path, "--operator", "alice", firstEvent)
		if err == nil || !strings.Contains(out, firstEvent+": OrderCreated of "+first) ||
			!strings.Contains(out, "VIOLATION "+failedEventsInvariant) || !strings.Contains(out, "the repair is committed, but check fails") {
			t.Fatalf("got %v\n%s\nwant the repair, then the other order's failed event failing the check", err, out)
		}
		if got := env.str(t, `SELECT status FROM outbox_events WHERE event_id = ?`, firstEvent); got != string(outboxPending) {
			t.Fatalf("event is %s, want the repair committed", got)
		}
		out, err = runTraceCLI(t, "outbox", "retry", "--db", env.path, "--operator", "bob", "--order", second)
		if err != nil || !strings.Contains(out, "check --in-flight: ok: all") {
			t.Fatalf("got %v\n%s\nwant a clean check", err, out)
		}
		if got := repairLog(t, env); !strings.Contains(got, "alice|outbox retry|"+firstEvent) || !strings.Contains(got, "bob|outbox retry|") {
			t.Fatalf("repair_log: %s", got)
		}
		// The command ran on the wall clock: the events are due at its time.
		env.clock.advance(time.Since(env.clock.now()) + time.Minute)
		env.drain(t)
		mustAuditClean(t, env, true)
	})
}

func TestInboxReplay(t *testing.T) {
	ctx := context.Background()

	// Ensure a message whose handler failed maxDeliveries times is poison,
	// and once the handler is fixed, a replay resets its failure count and
	// delivers it again: the consumer applies it and the order finishes.
	t.Run("PoisonMessageIsAppliedAfterReplay", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), errors.New("payment service bug"))
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)
		if got := env.count(t, `SELECT failures FROM inbox_failures WHERE consumer = ? AND message_id = ?`, paymentServiceConsumer, eventID); got != maxDeliveries {
			t.Fatalf("%d failures counted, want %d", got, maxDeliveries)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM inbox_messages WHERE message_id = ?`, eventID); got != string(inboxPoison) {
			t.Fatalf("inbox row is %s, want poison", got)
		}

		results, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{MessageID: eventID})
		if err != nil || len(results) != 1 || results[0].Target != paymentServiceConsumer+"/"+eventID {
			t.Fatalf("got %+v, %v", results, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_failures`); got != 0 {
			t.Fatalf("%d failure counts left, want them reset", got)
		}
		if got := repairLog(t, env); got != "alice|inbox replay|"+paymentServiceConsumer+"/"+eventID {
			t.Fatalf("repair_log: %s", got)
		}
		mustAuditClean(t, env, false)
		env.drain(t)
		if got := env.str(t, `SELECT status FROM inbox_messages WHERE consumer = ? AND message_id = ?`, paymentServiceConsumer, eventID); got != "done" {
			t.Fatalf("inbox row is %s after the replay, want done", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		mustAuditClean(t, env, true)
	})

	// Ensure a replay on the embedded broker is refused when the broker
	// holds no copy of the message (the workers use NATS and the command
	// was not told so): queuing a delivery nobody reads would delete the
	// poison record and deliver nothing.
	t.Run("RefusesWhenTheEmbeddedBrokerLacksTheMessage", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		if _, err := env.app.db.Exec(`DELETE FROM broker_deliveries`); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.db.Exec(`DELETE FROM broker_messages`); err != nil {
			t.Fatal(err)
		}
		before := repairState(t, env)
		_, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{Consumer: paymentServiceConsumer, AllPoison: true})
		mustRefuse(t, err, errRepairRefused, "name it with --broker")
		mustBeUnchanged(t, env, before)
	})

	// Ensure a replay finds the message in the broker when the outbox no
	// longer holds its event (cleanup deletes published events after
	// messageRetention, and keeps a broker message while a delivery of it
	// is pending).
	t.Run("ReplayAfterTheOutboxForgotTheEvent", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)
		if _, err := env.app.db.Exec(`DELETE FROM outbox_events WHERE event_id = ?`, eventID); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{MessageID: eventID}); err != nil {
			t.Fatal(err)
		}
		// (No audit: the event was deleted by hand, before its time.)
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
	})

	// Ensure cleanup keeps a poison message, its event and the broker's
	// copy, past the message retention: a week later the operator's replay
	// still delivers it, and its order is paid.
	t.Run("PoisonMessageOutlivesTheRetention", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		env.drain(t)
		env.clock.advance(messageRetention + time.Hour)
		if _, err := env.app.cleanupOnce(ctx); err != nil {
			t.Fatal(err)
		}
		eventID := env.str(t, `SELECT message_id FROM inbox_messages WHERE status = 'poison'`)
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM outbox_events WHERE event_id = ?) + (SELECT COUNT(*) FROM broker_messages WHERE message_id = ?)`,
			eventID, eventID); n != 2 {
			t.Fatalf("cleanup left %d of the poison message's event and broker copy, want both", n)
		}
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
			t.Fatal(err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		mustAuditClean(t, env, true)
	})

	// Ensure a message that neither the outbox nor the broker holds any
	// more (deleted by hand: cleanup keeps it) is refused, saying so, and
	// nothing changes.
	t.Run("RefusesAMessageNoLongerHeld", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		forgetMessage(t, env, env.str(t, `SELECT message_id FROM inbox_messages WHERE status = 'poison'`))
		before := repairState(t, env)
		_, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true})
		mustRefuse(t, err, errRepairRefused, "in neither the outbox nor the broker any more")
		mustBeUnchanged(t, env, before)
	})

	// Ensure an unknown consumer or message, a message that was applied,
	// and a system without poison messages are refused with a message that
	// names the problem, and nothing changes.
	t.Run("RefusesWhatIsNotPoison", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		applied := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, orderID)
		before := repairState(t, env)
		for _, tc := range []struct {
			target inboxReplayTarget
			kind   error
			want   string
		}{
			{inboxReplayTarget{Consumer: "billing", AllPoison: true}, errRepairNotFound, `no consumer "billing"`},
			{inboxReplayTarget{MessageID: "evt_nope"}, errRepairNotFound, "no consumer has an inbox record of message evt_nope"},
			{inboxReplayTarget{Consumer: orderServiceConsumer, MessageID: applied}, errRepairNotFound, orderServiceConsumer + " has no inbox record"},
			{inboxReplayTarget{MessageID: applied}, errRepairRefused, "was applied by " + paymentServiceConsumer + ", not poison"},
			{inboxReplayTarget{AllPoison: true}, errRepairRefused, "no message is poison"},
		} {
			_, err := env.app.replayInboxMessages(ctx, "alice", tc.target)
			mustRefuse(t, err, tc.kind, tc.want)
		}
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"inbox", "replay"}, "needs one of MESSAGE_ID or --all-poison"},
			{[]string{"inbox", "replay", applied, "--all-poison"}, "not MESSAGE_ID and --all-poison together"},
			{[]string{"inbox", "replay", "--broker", "http://x", applied}, "want a nats:// URL"},
			{[]string{"inbox", "replay", applied}, "not poison"},
		} {
			mustRefuseCommand(t, append(tc.args, "--db", env.path, "--operator", "alice"), tc.want)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure a poison message of the webhook inbox, which no broker
	// delivers, is refused: the processor sends webhooks again itself.
	t.Run("RefusesTheWebhookInbox", func(t *testing.T) {
		env := MustOpenApp(t)
		result, err := env.app.receive(ctx, webhookConsumer, "evt_webhook", 1, func(tx *sql.Tx) error {
			return permanent(errors.New("unknown charge"))
		})
		if err != nil || result.Outcome != inboxPoison {
			t.Fatalf("got %+v, %v; want poison", result, err)
		}
		before := repairState(t, env)
		_, err = env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{MessageID: "evt_webhook"})
		mustRefuse(t, err, errRepairRefused, webhookConsumer+" is not a broker consumer")
		mustBeUnchanged(t, env, before)
	})

	// Ensure that on NATS JetStream, where the poison message was acked
	// and cannot be delivered again, the replay publishes a new message
	// that carries the original id: the consumer applies it under that id,
	// and the order finishes.
	t.Run("NATS", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, 30*time.Second)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)
		before := repairState(t, env)
		// A command that was not told the workers use NATS is refused.
		env.app.broker = &embeddedBroker{db: env.app.db, now: env.clock.now, ackWait: time.Minute}
		_, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{MessageID: eventID})
		mustRefuse(t, err, errRepairRefused, "name it with --broker")
		env.app.broker = broker
		// Nor one told NATS where the workers use the embedded broker.
		if _, err := env.app.db.Exec(`INSERT INTO broker_messages (message_id, subject, payload, published_at) VALUES (?, 'OrderCreated', '{}', '2026-03-01T12:00:00.000000Z')`, eventID); err != nil {
			t.Fatal(err)
		}
		_, err = env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{MessageID: eventID})
		mustRefuse(t, err, errRepairRefused, "run without --broker")
		if _, err := env.app.db.Exec(`DELETE FROM broker_messages`); err != nil {
			t.Fatal(err)
		}
		mustBeUnchanged(t, env, before)
		stored := streamMessages(t, broker)
		if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{Consumer: paymentServiceConsumer, MessageID: eventID}); err != nil {
			t.Fatal(err)
		}
		if got := streamMessages(t, broker); got != stored+1 {
			t.Fatalf("stream holds %d messages, want %d: one replay", got, stored+1)
		}
		waitForOrderStatus(t, env, orderID, orderPaid)
		if got := env.str(t, `SELECT status FROM inbox_messages WHERE consumer = ? AND message_id = ?`, paymentServiceConsumer, eventID); got != "done" {
			t.Fatalf("inbox row is %s after the replay, want done under the original id", got)
		}
		mustAuditClean(t, env, true)
	})
}

// waitForOrderStatus runs the workers until the order has status; on NATS
// a published message reaches a pull consumer a moment later.
func waitForOrderStatus(tb testing.TB, env *testEnv, orderID string, status orderStatus) {
	tb.Helper()
	eventually(tb, fmt.Sprintf("order %s to become %s", orderID, status), 20*time.Second, func() (bool, string) {
		if _, err := env.app.runWorkersOnce(context.Background(), "test-worker"); err != nil {
			tb.Fatalf("workers: %v", err)
		}
		got := env.str(tb, `SELECT status FROM orders WHERE order_id = ?`, orderID)
		if got == string(status) {
			return true, ""
		}
		env.clock.advance(time.Second)
		return false, fmt.Sprintf("it %s; %s", got, env.unsettled(tb))
	})
	env.drain(tb)
}

// compensationFailedSaga creates an order whose confirm step fails and
// whose refund keeps failing, until its saga is compensation_failed; the
// processor then works again. It returns the order and saga ids.
func compensationFailedSaga(tb testing.TB, env *testEnv) (string, string) {
	tb.Helper()
	failConfirm(env, func(p faultPoint, pass int) error {
		// The charge's response arrives; every refund's is lost.
		if p == faultProcessorLoseResponse && pass >= 2 {
			return errors.New("connection reset")
		}
		return nil
	})
	orderID := createAndDrain(tb, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
	if got := sagaSteps(tb, env, orderID); got != "compensation_failed: reserve_stock=done charge_card=done confirm=failed" {
		tb.Fatalf("saga: %s", got)
	}
	env.fault.failAt("", nil, 0)
	return orderID, env.str(tb, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID)
}

func TestSagaResume(t *testing.T) {
	ctx := context.Background()

	// Ensure a saga whose compensation failed is compensating again after
	// resume, under a new lease token, and the workers then undo its steps
	// (one refund, stock released) and cancel the order.
	t.Run("CompensationsAreTriedAgain", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID, sagaID := compensationFailedSaga(t, env)
		token := env.count(t, `SELECT lease_token FROM saga_instances WHERE saga_id = ?`, sagaID)
		result, err := env.app.resumeSaga(ctx, "alice", sagaID)
		if err != nil || result.Target != sagaID || !strings.Contains(result.Result, "compensating again") {
			t.Fatalf("got %+v, %v", result, err)
		}
		if got := env.str(t, `SELECT status || ':' || attempts FROM saga_instances WHERE saga_id = ?`, sagaID); got != "compensating:0" {
			t.Fatalf("saga is %s, want compensating:0", got)
		}
		if got := env.count(t, `SELECT lease_token FROM saga_instances WHERE saga_id = ?`, sagaID); got != token+1 {
			t.Fatalf("lease token %d, want %d: a worker's older claim must be fenced out", got, token+1)
		}
		// A worker that claimed the saga before the resume writes nothing.
		stale := sagaClaim{SagaID: sagaID, WorkerID: "test-worker", Token: int64(token)}
		err = withFencedTx(ctx, env.app.db, func(tx *sql.Tx) error {
			return env.app.renewSagaLease(ctx, tx, stale, sagaCompensating, env.clock.now())
		})
		if !errors.Is(err, errSagaLeaseLost) {
			t.Fatalf("stale claim: got %v, want errSagaLeaseLost", err)
		}
		if got := repairLog(t, env); got != "alice|saga resume|"+sagaID {
			t.Fatalf("repair_log: %s", got)
		}
		mustAuditClean(t, env, false)
		env.drain(t)
		if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=compensated confirm=failed" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 1 {
			t.Fatalf("%d refunds, want 1", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderCancelled) {
			t.Fatalf("order is %s, want cancelled", got)
		}
		mustAuditClean(t, env, true)
	})

	// Ensure an unknown saga and a saga in any other state are refused, and
	// nothing changes; the command too, and without a SAGA_ID.
	t.Run("RefusesWhatIsNotCompensationFailed", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		sagaID := env.str(t, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID)
		before := repairState(t, env)
		_, err := env.app.resumeSaga(ctx, "alice", "saga_nope")
		mustRefuse(t, err, errRepairNotFound, "no saga saga_nope")
		_, err = env.app.resumeSaga(ctx, "alice", sagaID)
		mustRefuse(t, err, errRepairRefused, "is completed, not compensation_failed")
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"saga", "resume"}, "takes one SAGA_ID (got 0 arguments)"},
			{[]string{"saga", "resume", sagaID}, "is completed, not compensation_failed"},
		} {
			mustRefuseCommand(t, append(tc.args, "--db", env.path, "--operator", "alice"), tc.want)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure saga list shows the sagas of a state and refuses a state that
	// is not one, naming the states.
	t.Run("ListByState", func(t *testing.T) {
		env := MustOpenApp(t)
		_, sagaID := compensationFailedSaga(t, env)
		out, err := runTraceCLI(t, "saga", "list", "--db", env.path, "--state", "compensation_failed")
		if err != nil || !strings.Contains(out, sagaID) || !strings.Contains(out, "1 sagas compensation_failed") {
			t.Fatalf("got %v\n%s", err, out)
		}
		out, err = runTraceCLI(t, "saga", "list", "--db", env.path, "--state", "completed")
		if err != nil || strings.Contains(out, sagaID) {
			t.Fatalf("got %v\n%s\nwant no compensation_failed saga among the completed", err, out)
		}
		out, err = runTraceCLI(t, "saga", "list", "--db", env.path, "--state", "failed")
		if err == nil || !strings.Contains(out, `"failed" is not a saga state; the states are in_progress, compensating, completed, compensated, compensation_failed`) {
			t.Fatalf("got %v\n%s", err, out)
		}
	})
}

func TestRefundFinish(t *testing.T) {
	ctx := context.Background()

	// Ensure a refund whose request died after its first phase is listed,
	// left alone while its request's lease is fresh, and finished once the
	// lease has passed: one processor refund, the order refunded, logged.
	t.Run("AbandonedRefundIsFinished", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		env.fault.crashAt(faultRefundStarted)
		req, refund := refundRequestFor(t, orderID, "refund-1", "")
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		env.clock.advance(time.Minute)

		refunds, err := listUnfinishedRefunds(ctx, env.app.db, env.clock.now(), env.app.leases.refundLock)
		if err != nil || len(refunds) != 1 || !refunds[0].Held || refunds[0].RecoveryPoint != recoveryRefundRequested || refunds[0].AgeSeconds != 60 {
			t.Fatalf("got %+v, %v; want one held key at refund_requested, 60s old", refunds, err)
		}
		results, err := env.app.finishRefunds(ctx, "alice")
		if err != nil || len(results) != 0 {
			t.Fatalf("got %+v, %v; want a held key left to its request", results, err)
		}

		env.clock.advance(refundLockTimeout)
		// The processor does not answer yet: reported, not finished.
		env.fault.failAt(faultProcessorLoseResponse, errors.New("connection reset"), 1)
		results, err = env.app.finishRefunds(ctx, "alice")
		if err != nil || len(results) != 1 || !results[0].Failed || !strings.Contains(results[0].Result, "not finished: processor timed out") {
			t.Fatalf("got %+v, %v; want the key reported unfinished", results, err)
		}
		results, err = env.app.finishRefunds(ctx, "alice")
		if err != nil || len(results) != 1 || results[0].Failed || !strings.Contains(results[0].Result, "released after a transient failure; finished") {
			t.Fatalf("got %+v, %v", results, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 1 {
			t.Fatalf("%d processor refunds, want 1: the lost answer's refund was found, not made again", got)
		}
		if got := env.str(t, `SELECT recovery_point FROM idempotency_keys WHERE idempotency_key = 'refund-1'`); got != string(recoveryFinished) {
			t.Fatalf("key is at %s", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderRefunded) {
			t.Fatalf("order is %s, want refunded", got)
		}
		if got := repairLog(t, env); got != "alice|refund finish|user-42/refund-1; alice|refund finish|user-42/refund-1" {
			t.Fatalf("repair_log: %s", got)
		}
		env.drain(t)
		mustAuditClean(t, env, true)
	})

	// Ensure that of two refund finish runs at once, only the one that
	// finished a key logs it finished; the other says someone else
	// finished it. Run A holds the first key (paused after its claim)
	// while run B, whole, leaves that key to A and finishes the second;
	// A then came to the second key, got its stored answer, and logged
	// it finished too.
	t.Run("TwoRunsAtOnceLogEachKeyFinishedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		orders := map[string]string{}
		for _, key := range []string{"refund-1", "refund-2"} {
			orders[key] = createAndDrain(t, env, "order-"+key, orderBody(5000, "sku-1", 1, pmCardVisa))
		}
		for _, key := range []string{"refund-1", "refund-2"} {
			env.fault.crashAt(faultRefundStarted)
			req, refund := refundRequestFor(t, orders[key], key, "")
			if _, err := env.app.refundOrder(ctx, req, orders[key], refund); !errors.Is(err, errCrash) {
				t.Fatalf("got %v, want the crash", err)
			}
			env.restart(t)
			env.clock.advance(time.Second)
		}
		env.clock.advance(refundLockTimeout)

		var resultsB []repairResult
		var errB error
		ranB := false
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			if point == faultRefundKeyClaimed && workerOf(ctx) == "A" && !ranB {
				ranB = true
				resultsB, errB = env.app.finishRefunds(withWorker(ctx, "B"), "bob")
			}
			return nil
		})
		resultsA, errA := env.app.finishRefunds(withWorker(ctx, "A"), "alice")
		if errA != nil || errB != nil || !ranB {
			t.Fatalf("A: %v, B: %v (ran %v)", errA, errB, ranB)
		}
		if len(resultsB) != 1 || resultsB[0].Target != "user-42/refund-2" || !strings.HasSuffix(resultsB[0].Result, "; finished") {
			t.Fatalf("B got %+v, want refund-2 finished (refund-1 left to A)", resultsB)
		}
		if len(resultsA) != 2 || !strings.HasSuffix(resultsA[0].Result, "; finished") || resultsA[1].Failed ||
			!strings.HasSuffix(resultsA[1].Result, "; finished meanwhile by someone else (the client's retry, the completer or another refund finish), nothing done") {
			t.Fatalf("A got %+v, want refund-1 finished and refund-2 finished by someone else", resultsA)
		}
		got := env.str(t, `SELECT string_agg(operator || ' ' || target, ', ' ORDER BY operator, target) FROM repair_log WHERE result LIKE '%; finished'`)
		if got != "alice user-42/refund-1, bob user-42/refund-2" {
			t.Fatalf("repair_log has each key finished by %s, want alice refund-1, bob refund-2", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 2 {
			t.Fatalf("%d processor refunds, want 2", got)
		}
	})

	// Ensure refund list shows the key with its recovery point, and refund
	// finish with nothing to finish says so and succeeds.
	t.Run("Command", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		out, err := runTraceCLI(t, "refund", "finish", "--db", env.path, "--operator", "alice")
		if err != nil || !strings.Contains(out, "no refund to finish") {
			t.Fatalf("got %v\n%s", err, out)
		}
		env.fault.crashAt(faultRefundStarted)
		req, refund := refundRequestFor(t, orderID, "refund-1", "")
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		out, err = runTraceCLI(t, "refund", "list", "--db", env.path)
		if err != nil || !strings.Contains(out, "refund-1") || !strings.Contains(out, orderID) ||
			!strings.Contains(out, "refund_requested") || !strings.Contains(out, "1 unfinished refunds") {
			t.Fatalf("got %v\n%s", err, out)
		}
	})
}

// testAdminKey is the admin key of the admin API tests: as long as serve
// requires (minAdminKeyLength).
const testAdminKey = "admin_test_key_6f0c9a41d2e87b35c4a1"

// newAdminTestServer serves env's API, with adminKey as the admin key, on
// a loopback port until the test ends.
func newAdminTestServer(tb testing.TB, env *testEnv, adminKey string) *httptest.Server {
	tb.Helper()
	s := &server{
		app:           env.app,
		apiKeys:       map[string]string{keyUser42: "user-42"},
		webhookSecret: []byte(testWebhookSecret),
		adminKey:      adminKey,
		logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	ts := httptest.NewServer(s.routes())
	tb.Cleanup(ts.Close)
	return ts
}

// adminPathSegment escapes id as one segment of an /admin path, as a
// client must: url.PathEscape, and the dots of an id made of dots only
// ("." and ".."), which a client or the server's path cleaning would
// otherwise resolve as a step up the path. (Go's ServeMux matches the
// escaped path and unescapes each segment, so PathValue returns the id.)
func adminPathSegment(id string) string {
	if strings.Trim(id, ".") == "" {
		return strings.Repeat("%2E", len(id))
	}
	return url.PathEscape(id)
}

// adminCall sends an admin request with a bearer key and an operator name.
func adminCall(tb testing.TB, ts *httptest.Server, method, path, key, operator string) response {
	tb.Helper()
	req, err := http.NewRequest(method, ts.URL+path, nil)
	if err != nil {
		tb.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if operator != "" {
		req.Header.Set(adminOperatorHeader, operator)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: string(body)}
}

// mustProblem fails the test unless r is a problem of type want with
// status.
func mustProblem(tb testing.TB, what string, r response, status int, want problemType) {
	tb.Helper()
	if r.Status != status {
		tb.Fatalf("%s: got %d %s, want %d", what, r.Status, r.Body, status)
	}
	if got := problemTypeOf(tb, r); got != want {
		tb.Fatalf("%s: got problem %s, want %s", what, got, want)
	}
}

func TestAdminAPI(t *testing.T) {
	// Ensure that without RETRYSAFE_ADMIN_KEY every admin endpoint answers
	// 404 admin-disabled, saying how to enable them, and changes nothing.
	t.Run("OffWithoutTheAdminKey", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, "")
		for _, path := range []string{"/admin/sagas", "/admin/outbox", "/admin/nope"} {
			r := adminCall(t, ts, "GET", path, keyUser42, "")
			mustProblem(t, path, r, http.StatusNotFound, problemAdminDisabled)
			if !strings.Contains(r.Body, "RETRYSAFE_ADMIN_KEY") {
				t.Fatalf("%s: %s does not say how to enable the endpoints", path, r.Body)
			}
		}
		r := adminCall(t, ts, "POST", "/admin/refunds/finish", "", "")
		mustProblem(t, "finish", r, http.StatusNotFound, problemAdminDisabled)
	})

	// Ensure no key, a customer's API key and a wrong key are refused with
	// 401, and the failed event stays failed.
	t.Run("RefusesAnyKeyButTheAdminKey", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events`)
		before := repairState(t, env)
		for _, key := range []string{"", keyUser42, "admin_test_kez", testAdminKey + "x", "admin"} {
			r := adminCall(t, ts, "POST", "/admin/outbox/"+eventID+"/retry", key, "")
			mustProblem(t, "key "+key, r, http.StatusUnauthorized, problemUnauthorized)
			if r.Header.Get("WWW-Authenticate") == "" {
				t.Fatalf("key %q: no WWW-Authenticate", key)
			}
		}
		r := adminCall(t, ts, "GET", "/admin/outbox", keyUser42, "")
		mustProblem(t, "list with a customer key", r, http.StatusUnauthorized, problemUnauthorized)
		if after := repairState(t, env); after != before {
			t.Fatalf("a refused request changed\n%s\ninto\n%s", before, after)
		}
	})

	// Ensure serve will not start with an admin key that is also a
	// customer's API key.
	t.Run("AdminKeyMustNotBeACustomerKey", func(t *testing.T) {
		customerKey := "sk_live_" + strings.Repeat("c", minAdminKeyLength)
		t.Setenv("RETRYSAFE_ADMIN_KEY", customerKey)
		_, err := adminKeyConfig(func(string) {}, map[string]string{customerKey: "user-42"})
		if err == nil || !strings.Contains(err.Error(), "also the API key of user-42") {
			t.Fatalf("got %v", err)
		}
		t.Setenv("RETRYSAFE_ADMIN_KEY", testAdminKey)
		if key, err := adminKeyConfig(func(string) {}, map[string]string{keyUser42: "user-42"}); err != nil || key != testAdminKey {
			t.Fatalf("got %q, %v", key, err)
		}
	})

	// Ensure serve refuses an admin key shorter than 32 characters, saying
	// how to make one, and exits before it creates the database; 32
	// characters are enough. (serve runs with its context already done:
	// one that accepted the key would open the database and stop at
	// once, not serve for ever.)
	t.Run("ServeRefusesAShortAdminKey", func(t *testing.T) {
		stopped, stop := context.WithCancel(context.Background())
		stop()
		for _, key := range []string{"a", "choose-a-long-random-secret", strings.Repeat("k", minAdminKeyLength-1), "ключ-" + strings.Repeat("к", 26)} {
			t.Setenv("RETRYSAFE_ADMIN_KEY", key)
			path := filepath.Join(t.TempDir(), "x.db")
			var output bytes.Buffer
			err := run(stopped, []string{"serve", "--db", path, "--addr", "127.0.0.1:0"}, strings.NewReader(""), &output, &output)
			out := output.String()
			if err == nil || !strings.Contains(out, "RETRYSAFE_ADMIN_KEY is") || !strings.Contains(out, "at least 32") || !strings.Contains(out, "openssl rand -hex 32") {
				t.Fatalf("key %q: got %v\n%s", key, err, out)
			}
			if _, err := os.Stat(path); !os.IsNotExist(err) {
				t.Fatalf("key %q: serve created %s before refusing the key (%v)", key, path, err)
			}
		}
		t.Setenv("RETRYSAFE_ADMIN_KEY", strings.Repeat("k", minAdminKeyLength))
		if key, err := adminKeyConfig(func(string) {}, nil); err != nil || len(key) != minAdminKeyLength {
			t.Fatalf("a key of %d characters: got %q, %v", minAdminKeyLength, key, err)
		}
	})

	// Ensure the admin key lists the failed event, retries it (logged under
	// the operator header), and answers with the audit after it; then the
	// order finishes.
	t.Run("RetriesAFailedEvent", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events`)

		r := adminCall(t, ts, "GET", "/admin/outbox?status=failed", testAdminKey, "")
		var events []outboxListing
		if err := json.Unmarshal([]byte(r.Body), &events); r.Status != 200 || err != nil || len(events) != 1 || events[0].EventID != eventID || events[0].OrderID != orderID {
			t.Fatalf("got %d %s (%v)", r.Status, r.Body, err)
		}
		r = adminCall(t, ts, "POST", "/admin/outbox/"+eventID+"/retry", testAdminKey, "alice")
		var answer repairAnswer
		if err := json.Unmarshal([]byte(r.Body), &answer); r.Status != 200 || err != nil {
			t.Fatalf("got %d %s (%v)", r.Status, r.Body, err)
		}
		if len(answer.Repairs) != 1 || answer.Repairs[0].Target != eventID || !answer.Check.OK || answer.Check.Violations == nil {
			t.Fatalf("got %+v", answer)
		}
		if got := repairLog(t, env); got != "admin-api (alice)|outbox retry|"+eventID {
			t.Fatalf("repair_log: %s", got)
		}
		r = adminCall(t, ts, "POST", "/admin/outbox/"+eventID+"/retry", testAdminKey, "")
		mustProblem(t, "second retry", r, http.StatusConflict, problemRepairRefused)
		if !strings.Contains(r.Body, "is pending, not failed") {
			t.Fatalf("second retry: %s", r.Body)
		}
		env.drain(t)
		mustAuditClean(t, env, true)
	})

	// Ensure a repair whose audit runs out of time is still answered as
	// done, saying the audit did not finish: on a large database the full
	// audit outlasts serve's write timeout, and the answer, not a 500 after
	// the commit, must tell the operator what happened.
	t.Run("AnsweredWhenItsAuditRunsOutOfTime", func(t *testing.T) {
		env := MustOpenApp(t)
		env.app.repairAuditBudget = time.Nanosecond
		ts := newAdminTestServer(t, env, testAdminKey)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events`)
		r := adminCall(t, ts, "POST", "/admin/outbox/"+eventID+"/retry", testAdminKey, "alice")
		var answer repairAnswer
		if err := json.Unmarshal([]byte(r.Body), &answer); r.Status != 200 || err != nil {
			t.Fatalf("got %d %s (%v), want 200", r.Status, r.Body, err)
		}
		if len(answer.Repairs) != 1 || answer.Check.OK || !strings.Contains(answer.Check.Unfinished, "committed") {
			t.Fatalf("got %+v, want the repair and an unfinished audit", answer)
		}
		if got := env.str(t, `SELECT status FROM outbox_events WHERE event_id = ?`, eventID); got != string(outboxPending) {
			t.Fatalf("event is %s, want pending", got)
		}
	})

	// Ensure the admin key replays a poison message, resumes a saga and
	// finishes refunds, each listed first, with operator admin-api.
	t.Run("ReplaysResumesAndFinishes", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		_, sagaID := compensationFailedSaga(t, env)
		r := adminCall(t, ts, "GET", "/admin/sagas?state=compensation_failed", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, sagaID) {
			t.Fatalf("sagas: %d %s", r.Status, r.Body)
		}
		r = adminCall(t, ts, "POST", "/admin/sagas/"+sagaID+"/resume", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, "compensating again") {
			t.Fatalf("resume: %d %s", r.Status, r.Body)
		}
		env.drain(t)

		orderID := orderField(mustCreateOrder(t, env, "user-42", "k2", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		if _, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)
		r = adminCall(t, ts, "GET", "/admin/inbox", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, eventID) || !strings.Contains(r.Body, "payment service bug") {
			t.Fatalf("inbox: %d %s", r.Status, r.Body)
		}
		r = adminCall(t, ts, "POST", "/admin/inbox/"+paymentServiceConsumer+"/"+eventID+"/replay", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, "delivered again") {
			t.Fatalf("replay: %d %s", r.Status, r.Body)
		}
		env.drain(t)

		env.fault.crashAt(faultRefundStarted)
		req, refund := refundRequestFor(t, orderID, "refund-1", "")
		if _, err := env.app.refundOrder(context.Background(), req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.clock.advance(refundLockTimeout + time.Second)
		r = adminCall(t, ts, "GET", "/admin/refunds", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, `"idempotency_key":"refund-1"`) {
			t.Fatalf("refunds: %d %s", r.Status, r.Body)
		}
		r = adminCall(t, ts, "POST", "/admin/refunds/finish", testAdminKey, "")
		if r.Status != 200 || !strings.Contains(r.Body, "finished") {
			t.Fatalf("finish: %d %s", r.Status, r.Body)
		}
		env.drain(t)
		if got := repairLog(t, env); strings.Count(got, "admin-api|") != 3 {
			t.Fatalf("repair_log: %s", got)
		}
		mustAuditClean(t, env, true)
	})

	// Ensure an id that needs escaping in a URL reaches its row exactly:
	// each repair of a row whose id holds "/", "?", "#", "..", "%", a line
	// break or letters beyond ASCII, sent with the id path-escaped, repairs
	// that row and no other, and the lists show the ids as stored.
	t.Run("RepairsRowsWhoseIDsNeedEscaping", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		h := setAsideHostileIDs(t, env, ts)
		r := adminCall(t, ts, "GET", "/admin/outbox", testAdminKey, "")
		var listed []outboxListing
		if err := json.Unmarshal([]byte(r.Body), &listed); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, e := range listed {
			ids = append(ids, e.EventID)
		}
		if strings.Join(ids, "|") != strings.Join(h.failedEvents, "|") {
			t.Fatalf("GET /admin/outbox lists %q, want %q", ids, h.failedEvents)
		}
		type call struct{ path, row string }
		var calls []call
		for _, id := range h.failedEvents {
			calls = append(calls, call{"/admin/outbox/" + adminPathSegment(id) + "/retry", "outbox " + id})
		}
		for _, id := range h.poisonMessages {
			calls = append(calls, call{"/admin/inbox/" + paymentServiceConsumer + "/" + adminPathSegment(id) + "/replay", "inbox " + paymentServiceConsumer + "/" + id})
		}
		for _, id := range append(h.sagas, h.sagaID) {
			calls = append(calls, call{"/admin/sagas/" + adminPathSegment(id) + "/resume", "saga " + id})
		}
		for _, c := range calls {
			before := repairableRows(t, env)
			r := adminCall(t, ts, "POST", c.path, testAdminKey, "")
			if r.Status != http.StatusOK {
				t.Fatalf("POST %s: got %d %s", c.path, r.Status, r.Body)
			}
			if changed := changedRows(before, repairableRows(t, env)); len(changed) != 1 || !strings.HasPrefix(changed[0], strconv.Quote(c.row)+":") {
				t.Fatalf("POST %s changed\n%s\nwant %q only", c.path, strings.Join(changed, "\n"), c.row)
			}
		}
	})

	// Ensure an unknown target, a bad query, a wrong method, a bad operator
	// header and an unknown admin path each get their problem.
	t.Run("Problems", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		for _, tc := range []struct {
			method, path, operator string
			status                 int
			want                   problemType
		}{
			{"POST", "/admin/outbox/evt_nope/retry", "", 404, problemNotFound},
			{"POST", "/admin/sagas/saga_nope/resume", "", 404, problemNotFound},
			{"POST", "/admin/inbox/billing/evt_nope/replay", "", 404, problemNotFound},
			{"POST", "/admin/inbox/" + paymentServiceConsumer + "/evt_nope/replay", "", 404, problemNotFound},
			{"GET", "/admin/sagas?state=failed", "", 400, problemValidation},
			{"GET", "/admin/outbox?status=lost", "", 400, problemValidation},
			{"GET", "/admin/inbox?status=lost", "", 400, problemValidation},
			{"GET", "/admin/outbox/evt_nope/retry", "", 405, problemMethodNotAllowed},
			{"DELETE", "/admin/sagas", "", 405, problemMethodNotAllowed},
			{"GET", "/admin/nope", "", 404, problemNotFound},
			{"POST", "/admin/refunds/finish", "bad\tname", 400, problemValidation},
		} {
			r := adminCall(t, ts, tc.method, tc.path, testAdminKey, tc.operator)
			mustProblem(t, tc.method+" "+tc.path, r, tc.status, tc.want)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM repair_log`); got != 0 {
			t.Fatalf("%d repairs logged, want none", got)
		}
	})
}

// Ensure an id that no row can hold (bytes that are not UTF-8, or a NUL)
// is not found by any repair, the same on every database: through /admin
// a 404 problem, through the console a page saying nothing was changed
// (its order form: the 404 page of an unknown order), through the
// commands an error naming it. PostgreSQL refuses such text in a query:
// /admin answered 500 and the commands failed with the database's error,
// where SQLite answered not found.
func TestRepairIDNotText(t *testing.T) {
	env := MustOpenApp(t)
	ts := newAdminTestServer(t, env, testAdminKey)
	createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
	c := newConsoleClient(ts)
	c.login(t, testAdminKey, "")
	before := repairState(t, env)
	for _, id := range []string{"evt_\xff", "\xc3\x28", "evt_\x00"} {
		escaped := url.PathEscape(id)
		for _, path := range []string{
			"/admin/outbox/" + escaped + "/retry",
			"/admin/inbox/" + paymentServiceConsumer + "/" + escaped + "/replay",
			"/admin/inbox/" + escaped + "/evt_1/replay",
			"/admin/sagas/" + escaped + "/resume",
		} {
			mustProblem(t, "POST "+path, adminCall(t, ts, "POST", path, testAdminKey, ""), http.StatusNotFound, problemNotFound)
		}
		for _, button := range []consoleButton{retryButton(id), replayButton(paymentServiceConsumer, id), resumeButton(id)} {
			if page := c.press(t, button); !strings.Contains(page, "Nothing was changed: not found: no ") {
				t.Fatalf("%s of %q: the page does not say it was not found:\n%s", button.action, id, page)
			}
		}
		if page := c.page(t, "/console?order="+url.QueryEscape(id), http.StatusNotFound); !strings.Contains(page, "There is no order") {
			t.Fatalf("order %q: the page does not say there is no such order:\n%s", id, page)
		}
		for _, args := range [][]string{
			{"outbox", "retry", id},
			{"outbox", "retry", "--order", id},
			{"inbox", "replay", id},
			{"saga", "resume", id},
		} {
			mustRefuseCommand(t, append(args, "--db", env.path, "--operator", "alice"), "not found: no ")
		}
		mustRefuseCommand(t, []string{"trace", id, "--db", env.path}, "no order "+terminalSafe(id))
		mustRefuseCommand(t, []string{"inspect", "--order", id, "--db", env.path}, "no order "+terminalSafe(id))
	}
	mustBeUnchanged(t, env, before)
}

// Ensure every command and flag in docs/operate-and-repair.md's "Repair what was set
// aside" section exists, and every admin endpoint it lists is routed.
func TestDocsRepairSection(t *testing.T) {
	readme, err := os.ReadFile("docs/operate-and-repair.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## Repair what was set aside\n")
	if !ok {
		t.Fatal("docs/operate-and-repair.md has no section \"Repair what was set aside\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")

	commands := 0
	inCode := false
	for _, line := range strings.Split(section, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		line, _, _ = strings.Cut(line, "#")
		fields := strings.Fields(line)
		if !inCode || len(fields) < 3 || fields[0] != "retrysafe" {
			continue
		}
		commands++
		cmd, rest, err := newRootCommand().Find(fields[1:])
		if err != nil || cmd.Name() != fields[2] {
			t.Fatalf("docs/operate-and-repair.md names %q, which is no command (%v)", line, err)
		}
		for _, word := range rest {
			if name, ok := strings.CutPrefix(word, "--"); ok && cmd.Flags().Lookup(name) == nil {
				t.Errorf("docs/operate-and-repair.md gives %s the flag --%s, which it does not have", cmd.CommandPath(), name)
			}
		}
	}
	for _, flagged := range regexp.MustCompile("`--[a-z-]+").FindAllString(section, -1) {
		name := strings.TrimPrefix(flagged, "`--")
		found := false
		for _, path := range [][]string{{"outbox", "retry"}, {"inbox", "replay"}, {"saga", "list"}, {"saga", "resume"}, {"refund", "finish"}} {
			cmd, _, err := newRootCommand().Find(path)
			if err == nil && cmd.Flags().Lookup(name) != nil {
				found = true
			}
		}
		if !found {
			t.Errorf("docs/operate-and-repair.md names --%s, which no repair command has", name)
		}
	}
	if commands < 6 {
		t.Fatalf("found %d commands in the section, want the six repair commands", commands)
	}

	env := MustOpenApp(t)
	ts := newAdminTestServer(t, env, testAdminKey)
	endpoints := regexp.MustCompile("`(GET|POST) (/admin/[^`?]*)(\\?[^`]*)?`").FindAllStringSubmatch(section, -1)
	if len(endpoints) != 8 {
		t.Fatalf("found %d admin endpoints in the section, want 8", len(endpoints))
	}
	for _, endpoint := range endpoints {
		path := regexp.MustCompile(`\{([a-z_]+)\}`).ReplaceAllString(endpoint[2], "$1") + endpoint[3]
		r := adminCall(t, ts, endpoint[1], path, testAdminKey, "")
		if r.Status == http.StatusMethodNotAllowed || strings.Contains(r.Body, "no admin route") {
			t.Errorf("docs/operate-and-repair.md lists %s %s, which is not routed: %d %s", endpoint[1], endpoint[2], r.Status, r.Body)
		}
	}
}

// mustBeUnchanged fails the test unless the repairable state is what it
// was before: a refusal changes nothing.
func mustBeUnchanged(t *testing.T, env *testEnv, before string) {
	t.Helper()
	if after := repairState(t, env); after != before {
		t.Fatalf("a refusal changed\n%s\ninto\n%s", before, after)
	}
}

// mustRefuseCommand fails the test unless the command args fails with a
// message naming want.
func mustRefuseCommand(t *testing.T, args []string, want string) {
	t.Helper()
	out, err := runTraceCLI(t, args...)
	if err == nil || !strings.Contains(out, want) {
		t.Fatalf("%v: got %v\n%s\nwant an error naming %q", args, err, out, want)
	}
}

// besideRepairsWindow is how long BenchmarkCreatesBesideRepairs sends
// creates in each of its runs: long enough to span an audit of a large
// database, which the repairs beside them run one after another.
const besideRepairsWindow = 20 * time.Second

// BenchmarkCreatesBesideRepairs is fresh creates over loopback HTTP from 8
// clients, for besideRepairsWindow, on a database with a long history
// (fillHistory: a million orders, events and sagas, or
// RETRYSAFE_BENCH_ROWS): alone, and while an operator retries a failed
// outbox event through /admin again and again, each repair answered with
// the audit after it. Beside orders/s it reports the slowest create and
// the 99th percentile, which show whether a repair stalls the creates,
// and the repairs made and how long each took, audit included (the last
// one is waited for after the window).
func BenchmarkCreatesBesideRepairs(b *testing.B) {
	app := benchApp(b, durabilityNormal)
	fillHistory(b, app.db, benchRows(b))
	s := &server{app: app, apiKeys: map[string]string{keyUser42: "user-42"}, webhookSecret: []byte(testWebhookSecret),
		adminKey: testAdminKey, logger: discardLogger()}
	ts := httptest.NewServer(s.routes())
	b.Cleanup(ts.Close)
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	for _, repairing := range []bool{false, true} {
		name := "alone"
		if repairing {
			name = "repairing"
		}
		b.Run(name, func(b *testing.B) {
			client := benchClient(8)
			prefix := "beside-" + name + "-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
			var latencies []time.Duration
			var repairs, repairTime atomic.Int64
			for b.Loop() {
				stop, repaired := make(chan struct{}), make(chan error, 1)
				if repairing {
					go func() { repaired <- repairUntil(stop, app, ts, &repairs, &repairTime) }()
				} else {
					repaired <- nil
				}
				var mu sync.Mutex
				var next atomic.Int64
				var wg sync.WaitGroup
				deadline := time.Now().Add(besideRepairsWindow)
				for range 8 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for time.Now().Before(deadline) {
							start := time.Now()
							status, answer, err := postOrder(client, ts.URL, prefix+strconv.FormatInt(next.Add(1), 10), body)
							if err != nil || status != http.StatusCreated {
								b.Errorf("create: %d %s %v; want 201", status, answer, err)
								return
							}
							mu.Lock()
							latencies = append(latencies, time.Since(start))
							mu.Unlock()
						}
					}()
				}
				wg.Wait()
				close(stop)
				b.StopTimer()
				if err := <-repaired; err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(len(latencies))/b.Elapsed().Seconds(), "orders/s")
			slices.Sort(latencies)
			b.ReportMetric(float64(latencies[len(latencies)*99/100].Microseconds())/1000, "p99-ms")
			b.ReportMetric(float64(latencies[len(latencies)-1].Microseconds())/1000, "max-ms")
			if n := repairs.Load(); n > 0 {
				b.ReportMetric(float64(n), "repairs")
				b.ReportMetric(float64(time.Duration(repairTime.Load()).Milliseconds())/float64(n), "ms/repair")
			}
		})
	}
}

// repairUntil makes one of fillHistory's failed events fail again (as the
// relay would) and retries it through POST /admin/outbox/{id}/retry, over
// and over until stop is closed, counting the repairs and the time they
// took (the audit after each included).
func repairUntil(stop <-chan struct{}, app *App, ts *httptest.Server, repairs, took *atomic.Int64) error {
	for i := 0; ; i++ {
		select {
		case <-stop:
			return nil
		default:
		}
		eventID := fmt.Sprintf("evt_live_%d", historyInFlight+1+i%historyFailedEvents)
		if _, err := app.db.Exec(`UPDATE outbox_events SET status = 'failed' WHERE event_id = ?`, eventID); err != nil {
			return err
		}
		req, err := http.NewRequest("POST", ts.URL+"/admin/outbox/"+eventID+"/retry", nil)
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+testAdminKey)
		start := time.Now()
		resp, err := ts.Client().Do(req)
		if err != nil {
			return err
		}
		answer, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("retry %s: %d %s", eventID, resp.StatusCode, answer)
		}
		took.Add(int64(time.Since(start)))
		repairs.Add(1)
	}
}

// Ensure the audit after a repair, from /admin and from the console, reads
// on the read connections and leaves the one write connection to the
// creates: with every read connection held, the repair commits and its
// answer waits, while a write goes through beside it. (On PostgreSQL,
// reads and writes share one pool: there is nothing to tell apart.)
func TestRepairAuditLeavesTheWriteConnection(t *testing.T) {
	if onPostgres() {
		t.Skip("on PostgreSQL the read connections are the pool the writes use too")
	}
	for _, via := range []string{"admin", "console"} {
		t.Run(via, func(t *testing.T) {
			env := MustOpenApp(t)
			ts := newAdminTestServer(t, env, testAdminKey)
			failed := setAsideOneOfEach(t, env).failedEventID
			ctx := context.Background()
			req, err := http.NewRequest("POST", ts.URL+"/admin/outbox/"+failed+"/retry", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Authorization", "Bearer "+testAdminKey)
			if via == "console" {
				c := newConsoleClient(ts)
				c.login(t, testAdminKey, "alice")
				token := csrfTokenOn(t, c.page(t, "/console", http.StatusOK))
				form := retryButton(failed).fields
				form.Set("csrf", token)
				req, err = http.NewRequest("POST", ts.URL+"/console/outbox/retry", strings.NewReader(form.Encode()))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				for _, cookie := range c.cookies {
					req.AddCookie(cookie)
				}
			}

			readers := env.app.readDB
			var held []*sql.Conn
			release := func() {
				for _, conn := range held {
					conn.Close()
				}
				held = nil
			}
			defer release()
			for range readers.Stats().MaxOpenConnections {
				conn, err := readers.Conn(ctx)
				if err != nil {
					t.Fatal(err)
				}
				held = append(held, conn)
			}
			waited := readers.Stats().WaitCount
			type answer struct {
				status int
				body   string
				err    error
			}
			answered := make(chan answer, 1)
			go func() {
				client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
				resp, err := client.Do(req)
				if err != nil {
					answered <- answer{err: err}
					return
				}
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				answered <- answer{resp.StatusCode, string(body), err}
			}()
			eventually(t, "the repair's audit to ask for a read connection", waitLimit, func() (bool, string) {
				select {
				case got := <-answered:
					t.Fatalf("with every read connection held, the repair was answered (%d %v): its audit did not read on them", got.status, got.err)
				default:
				}
				return readers.Stats().WaitCount != waited, "no wait for a read connection"
			})
			if got := env.str(t, `SELECT status FROM outbox_events WHERE event_id = ?`, failed); got != string(outboxPending) {
				t.Fatalf("the event is %s while the audit waits; want the repair committed", got)
			}
			// The audit waits for a reader, holding no write connection:
			// a write goes through.
			err = withTx(ctx, env.app.db, func(tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, `UPDATE stock_items SET stocked = stocked WHERE sku = 'sku-1'`)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			select {
			case got := <-answered:
				t.Fatalf("the repair was answered (%d %v) before a read connection was free", got.status, got.err)
			default:
			}
			release()
			got := mustReceive(t, "the repair's answer once a read connection was free", answered)
			want := http.StatusOK
			if via == "console" {
				want = http.StatusSeeOther
			}
			if got.err != nil || got.status != want {
				t.Fatalf("the repair answered %d %v %s, want %d", got.status, got.err, got.body, want)
			}
			if via == "admin" && !strings.Contains(got.body, `"check":{"ok":true`) {
				t.Fatalf("the audit after the repair: %s", got.body)
			}
		})
	}
}

// forgetMessage deletes message id from the outbox and the broker, as an
// operator's DELETE would (cleanup keeps a poison message).
func forgetMessage(t *testing.T, env *testEnv, id string) {
	t.Helper()
	for _, query := range []string{
		`DELETE FROM outbox_events WHERE event_id = ?`,
		`DELETE FROM broker_deliveries WHERE message_seq IN (SELECT seq FROM broker_messages WHERE message_id = ?)`,
		`DELETE FROM broker_messages WHERE message_id = ?`,
	} {
		if _, err := env.app.db.Exec(query, id); err != nil {
			t.Fatal(err)
		}
	}
}
