package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// webhookReply is the body of a webhook's 200.
type webhookReply struct {
	Received bool         `json:"received"`
	Outcome  inboxOutcome `json:"outcome"`
	Error    string       `json:"error"`
}

// refundedEvent returns a charge.refunded body with amount as written (a
// JSON literal), or without amount_cents if amount is empty.
func refundedEvent(eventID, chargeID, refundID, amount string) []byte {
	data := fmt.Sprintf(`"charge_id":%q,"refund_id":%q`, chargeID, refundID)
	if amount != "" {
		data += `,"amount_cents":` + amount
	}
	return []byte(fmt.Sprintf(`{"id":%q,"type":"charge.refunded","data":{%s}}`, eventID, data))
}

// postSigned sends body as a correctly signed webhook. It returns the
// response and, for a 200, its decoded reply.
func postSigned(tb testing.TB, env *testEnv, ts *httptest.Server, body []byte) (response, webhookReply) {
	tb.Helper()
	got := postWebhook(tb, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
	var reply webhookReply
	if got.Status == 200 {
		if err := json.Unmarshal([]byte(got.Body), &reply); err != nil {
			tb.Fatalf("webhook reply %s: %v", got.Body, err)
		}
	}
	return got, reply
}

// requireEarly fails the test unless the signed event is answered 503 (an
// event that came too early, for the processor to deliver again).
func requireEarly(tb testing.TB, env *testEnv, ts *httptest.Server, event []byte) {
	tb.Helper()
	early, _ := postSigned(tb, env, ts, event)
	if early.Status != 503 || problemTypeOf(tb, early) != problemUnavailable {
		tb.Fatalf("got %d %s, want 503 to be delivered again", early.Status, early.Body)
	}
}

// requireAppliedPaidWith fails the test unless the signed event, delivered
// again, is applied and the only order is then want ("status:refunded").
func requireAppliedPaidWith(tb testing.TB, env *testEnv, ts *httptest.Server, event []byte, want string) {
	tb.Helper()
	if _, reply := postSigned(tb, env, ts, event); reply.Outcome != inboxApplied {
		tb.Fatalf("the redelivered event got %+v, want applied", reply)
	}
	if got := env.str(tb, `SELECT status || ':' || refunded_cents FROM orders`); got != want {
		tb.Fatalf("order %s, want %s", got, want)
	}
}

// paidOrderOf creates an order of the user with apiKey under key and runs
// the workers until it is paid. It returns the order id and its charge id.
func paidOrderOf(tb testing.TB, env *testEnv, ts *httptest.Server, apiKey, key string, amount int64) (string, string) {
	tb.Helper()
	created := call(tb, ts, "POST", "/api/orders", apiKey, key, orderBody(amount, "sku-1", 1, pmCardVisa))
	if created.Status != 201 {
		tb.Fatalf("create: %d %s", created.Status, created.Body)
	}
	env.drain(tb)
	orderID := orderField([]byte(created.Body), "order_id")
	chargeID := env.str(tb, `SELECT charge_id FROM orders WHERE order_id = ? AND status = 'paid'`, orderID)
	if chargeID == "" {
		tb.Fatalf("order %s is not paid", orderID)
	}
	return orderID, chargeID
}

// dashboardRefund refunds amount of chargeID at the processor, as someone
// at its dashboard would, and returns the processor's refund id.
func dashboardRefund(tb testing.TB, env *testEnv, key, chargeID string, amount int64) string {
	tb.Helper()
	refundID, err := env.app.processor.refund(context.Background(), key, chargeID, amount)
	if err != nil {
		tb.Fatalf("dashboard refund: %v", err)
	}
	return refundID
}

// requireOrderSound fails the test unless the order's refunded amount is a
// whole number no larger than its amount, GET still answers 200 with it,
// and the audit finds nothing wrong.
func requireOrderSound(tb testing.TB, env *testEnv, ts *httptest.Server, apiKey, orderID string) {
	tb.Helper()
	if !onPostgres() {
		// SQLite turns an INTEGER sum that overflows into a REAL.
		if got := env.str(tb, `SELECT typeof(refunded_cents) FROM orders WHERE order_id = ?`, orderID); got != "integer" {
			tb.Fatalf("refunded_cents of %s is stored as %s, want integer", orderID, got)
		}
	}
	if n := env.count(tb, `SELECT COUNT(*) FROM orders WHERE order_id = ? AND refunded_cents > amount_cents`, orderID); n != 0 {
		tb.Fatalf("order %s refunded more than it charged: %s", orderID,
			env.str(tb, `SELECT refunded_cents || ' of ' || amount_cents FROM orders WHERE order_id = ?`, orderID))
	}
	if got := call(tb, ts, "GET", "/api/orders/"+orderID, apiKey, "", ""); got.Status != 200 {
		tb.Fatalf("GET order %s: got %d %s, want 200", orderID, got.Status, got.Body)
	}
	violations, err := audit(context.Background(), env.app.db, env.clock.now(), false)
	if err != nil {
		tb.Fatal(err)
	}
	if len(violations) != 0 {
		tb.Fatalf("audit: %+v", violations)
	}
}

// Ensure a signed timestamp is accepted up to webhookTolerance away from
// now on either side, the edges included, and refused a second further,
// in the past (a captured webhook replayed) and in the future (a clock
// gone wrong, or a signature made to be replayed later).
func TestVerifyWebhookTolerance(t *testing.T) {
	secret := []byte(testWebhookSecret)
	body := chargeRefundedEvent("evt_1", "ch_1", "re_1", 100)
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		offset time.Duration
		ok     bool
	}{
		{-webhookTolerance - time.Second, false},
		{-webhookTolerance, true},
		{0, true},
		{webhookTolerance, true},
		{webhookTolerance + time.Second, false},
	} {
		err := verifyWebhook(secret, signWebhook(secret, now.Add(tc.offset), body), body, now)
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, errBadSignature)) {
			t.Errorf("signed %s from now: got %v, want accepted %v", tc.offset, err, tc.ok)
		}
	}
}

// Ensure a correctly signed webhook is still only input: its amount is
// checked against the charge it names, and a refund is counted once
// however often, and in whatever order, it is announced.
func TestHTTPWebhookHostile(t *testing.T) {
	// Ensure every amount a charge.refunded may carry either fits in what
	// remains of the charge and is added, or makes the event poison, with
	// its reason, and changes nothing.
	t.Run("RefundAmountBeyondTheChargeIsPoison", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		one := dashboardRefund(t, env, "dashboard-1", chargeID, 1)
		rest := dashboardRefund(t, env, "dashboard-2", chargeID, 4999)
		tests := []struct {
			name     string
			refundID string
			amount   string
			outcome  inboxOutcome
			reason   string // in the poison's error
			refunded int64  // the order's refunded_cents afterwards
		}{
			{"Zero", "re_zero", `0`, inboxPoison, "positive", 0},
			{"Negative", "re_negative", `-1`, inboxPoison, "positive", 0},
			{"OneMoreThanRemains", "re_5001", `5001`, inboxPoison, "exceeds the 5000 that remains", 0},
			{"AboveTheLargestCharge", "re_max", fmt.Sprint(maxAmountCents + 1), inboxPoison, "exceeds", 0},
			{"TwoToThe53", "re_2_53", `9007199254740992`, inboxPoison, "exceeds", 0},
			{"LargestInt64", "re_int64", `9223372036854775807`, inboxPoison, "exceeds", 0},
			{"BeyondInt64", "re_beyond", `9223372036854775808`, inboxPoison, "amount_cents", 0},
			{"Fraction", "re_fraction", `1.5`, inboxPoison, "amount_cents", 0},
			{"String", "re_string", `"100"`, inboxPoison, "amount_cents", 0},
			{"Null", "re_null", `null`, inboxPoison, "amount_cents", 0},
			{"Missing", "re_missing", ``, inboxPoison, "amount_cents", 0},
			{"One", one, `1`, inboxApplied, "", 1},
			{"ExactlyWhatRemains", rest, `4999`, inboxApplied, "", 5000},
			{"AnyMoreOnceAllIsRefunded", "re_after", `1`, inboxPoison, "exceeds the 0 that remains", 5000},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				eventID := "evt_" + tt.name
				got, reply := postSigned(t, env, ts, refundedEvent(eventID, chargeID, tt.refundID, tt.amount))
				if got.Status != 200 || reply.Outcome != tt.outcome || !strings.Contains(reply.Error, tt.reason) {
					t.Fatalf("got %d %s, want 200 %s (%q)", got.Status, got.Body, tt.outcome, tt.reason)
				}
				if tt.outcome == inboxPoison {
					recorded := env.str(t, `SELECT status || ': ' || COALESCE(error, '') FROM inbox_messages WHERE consumer = ? AND message_id = ?`,
						webhookConsumer, eventID)
					if !strings.HasPrefix(recorded, "poison: ") || !strings.Contains(recorded, tt.reason) {
						t.Fatalf("inbox has %q, want poison with %q", recorded, tt.reason)
					}
				}
				if got := env.count(t, `SELECT refunded_cents FROM orders WHERE order_id = ?`, orderID); got != int(tt.refunded) {
					t.Fatalf("refunded_cents %d, want %d", got, tt.refunded)
				}
				requireOrderSound(t, env, ts, keyUser42, orderID)
			})
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderRefunded) {
			t.Fatalf("order is %s, want refunded", got)
		}
	})

	// Ensure a signed event counts only a refund the processor confirms it
	// made, of that charge and amount. The simulator found the hole: an
	// event for a made-up refund, within what the order still had, was
	// counted; the refund the processor really made came later and was
	// refused as too large, so the order said 5000 refunded while the
	// processor had refunded 1.
	t.Run("OnlyRefundsTheProcessorConfirmsAreCounted", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		real := dashboardRefund(t, env, "dashboard-1", chargeID, 1)
		for _, tt := range []struct{ name, refundID, amount, reason string }{
			{"MadeUp", "re_made_up", "5000", "never made"},
			{"WrongAmount", real, "4000", "the processor says 1 of charge " + chargeID},
		} {
			got, reply := postSigned(t, env, ts, refundedEvent("evt_"+tt.name, chargeID, tt.refundID, tt.amount))
			if got.Status != 200 || reply.Outcome != inboxPoison || !strings.Contains(reply.Error, tt.reason) {
				t.Fatalf("%s: got %d %s, want poison (%q)", tt.name, got.Status, got.Body, tt.reason)
			}
		}
		if _, reply := postSigned(t, env, ts, refundedEvent("evt_real", chargeID, real, "1")); reply.Outcome != inboxApplied {
			t.Fatalf("the real refund's event got %+v, want applied", reply)
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "paid:1" {
			t.Fatalf("order %s, want paid:1", got)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure a signed event waits while the processor cannot be asked
	// about the refund it names: not counted, not recorded, and the
	// processor is told to deliver it again. Counting it unconfirmed
	// would count a made-up refund whenever the processor is slow.
	t.Run("EventWaitsWhileTheProcessorCannotConfirmIt", func(t *testing.T) {
		ctx := context.Background()
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		var event processorEvent
		if err := json.Unmarshal(refundedEvent("evt_made_up", chargeID, "re_made_up", "5000"), &event); err != nil {
			t.Fatal(err)
		}
		reachable := env.app.processor.db
		unreachable, err := sql.Open("sqlite", ":memory:")
		if err != nil {
			t.Fatal(err)
		}
		unreachable.Close()
		env.app.processor.db = unreachable
		if result, err := env.app.receiveProcessorEvent(ctx, event); err == nil {
			t.Fatalf("with the processor unreachable the event got %s, want an error (delivered again)", result.Outcome)
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages WHERE message_id = 'evt_made_up') + (SELECT COUNT(*) FROM refunds) + (SELECT refunded_cents FROM orders)`); n != 0 {
			t.Fatalf("an event the processor could not confirm changed %d", n)
		}
		env.app.processor.db = reachable
		if result, err := env.app.receiveProcessorEvent(ctx, event); err != nil || result.Outcome != inboxPoison {
			t.Fatalf("delivered again, the event got %+v, %v; want poison (the processor never made that refund)", result, err)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure an event for a charge nobody knows is poison and changes
	// nothing.
	t.Run("UnknownChargeIsPoison", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, _ := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		got, reply := postSigned(t, env, ts, refundedEvent("evt_1", "ch_unknown", "re_1", "100"))
		if got.Status != 200 || reply.Outcome != inboxPoison || !strings.Contains(reply.Error, "unknown charge ch_unknown") {
			t.Fatalf("got %d %s, want 200 poison naming the charge", got.Status, got.Body)
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM refunds) + (SELECT SUM(refunded_cents) FROM orders)`); n != 0 {
			t.Fatalf("an unknown charge changed %d", n)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure the order a charge belongs to is the one an event is checked
	// against and changes, whoever's it is: another user's small order
	// does not borrow what remains of a large one, and a refund already
	// recorded for one order is not claimed by another's charge.
	t.Run("AnotherOrdersChargeCountsOnlyForThatOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		large, _ := paidOrderOf(t, env, ts, keyUser42, "order-42", 5000)
		small, smallCharge := paidOrderOf(t, env, ts, keyUser7, "order-7", 1000)

		got, reply := postSigned(t, env, ts, refundedEvent("evt_1", smallCharge, "re_1", "3000"))
		if got.Status != 200 || reply.Outcome != inboxPoison || !strings.Contains(reply.Error, "exceeds the 1000 that remains") {
			t.Fatalf("got %d %s, want poison: 3000 exceeds the 1000 of the small order", got.Status, got.Body)
		}

		ours := call(t, ts, "POST", refundPath(large), keyUser42, "r1", `{"amount_cents":2000}`)
		if ours.Status != 200 {
			t.Fatalf("refund: %d %s", ours.Status, ours.Body)
		}
		oursAtProcessor := env.str(t, `SELECT processor_refund_id FROM refunds WHERE order_id = ?`, large)
		got, reply = postSigned(t, env, ts, refundedEvent("evt_2", smallCharge, oursAtProcessor, "2000"))
		if got.Status != 200 || reply.Outcome != inboxPoison || !strings.Contains(reply.Error, "another order") {
			t.Fatalf("got %d %s, want poison: the refund is of another order", got.Status, got.Body)
		}

		theirs := dashboardRefund(t, env, "dashboard-7", smallCharge, 1000)
		if _, reply := postSigned(t, env, ts, refundedEvent("evt_3", smallCharge, theirs, "1000")); reply.Outcome != inboxApplied {
			t.Fatalf("got %+v, want applied", reply)
		}
		for orderID, want := range map[string]int{small: 1000, large: 2000} {
			if got := env.count(t, `SELECT refunded_cents FROM orders WHERE order_id = ?`, orderID); got != want {
				t.Fatalf("order %s refunded %d, want %d", orderID, got, want)
			}
		}
		requireOrderSound(t, env, ts, keyUser42, large)
		requireOrderSound(t, env, ts, keyUser7, small)
		if got := call(t, ts, "GET", "/api/orders/"+small, keyUser42, "", ""); got.Status != 404 {
			t.Fatalf("user-42 sees user-7's order: %d %s", got.Status, got.Body)
		}
	})

	// Ensure a refund announced before our side has recorded the payment
	// is not lost as an unknown charge: it is not recorded, the processor
	// is asked to deliver it again, and then it is applied.
	t.Run("RefundBeforeThePaymentIsRecordedIsRetried", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		ctx := context.Background()
		created := call(t, ts, "POST", "/api/orders", keyUser42, "order-key", orderBody(5000, "sku-1", 1, pmCardVisa))
		orderID := orderField([]byte(created.Body), "order_id")
		// Run the saga up to the charge, but never relay its PaymentCaptured.
		if _, err := env.app.relayOnce(ctx, "test-worker", 10); err != nil {
			t.Fatal(err)
		}
		for _, c := range env.app.consumers() {
			if c.name != paymentServiceConsumer {
				continue
			}
			if _, err := env.app.consumeOnce(ctx, c, 10); err != nil {
				t.Fatal(err)
			}
		}
		chargeID := ""
		for range 20 {
			if _, err := env.app.sagaOnce(ctx, "test-worker", 10); err != nil {
				t.Fatal(err)
			}
			chargeID = env.str(t, `SELECT result FROM saga_steps WHERE step_name = ?`, stepChargeCard)
			if chargeID != "" {
				break
			}
			env.clock.advance(time.Minute)
		}
		if chargeID == "" || env.str(t, `SELECT status FROM orders`) != string(orderCreated) {
			t.Fatalf("want a charged order still created, got charge %q", chargeID)
		}
		refundID := dashboardRefund(t, env, "dashboard-1", chargeID, 1500)
		event := refundedEvent("evt_early", chargeID, refundID, "1500")

		requireEarly(t, env, ts, event)
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?) + (SELECT COUNT(*) FROM refunds)`, webhookConsumer); n != 0 {
			t.Fatalf("the early event stored %d rows", n)
		}
		env.drain(t)
		requireAppliedPaidWith(t, env, ts, event, "paid:1500")
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure a dashboard refund of a charge whose order the saga then
	// cancelled (a later step failed; its compensation refunded what
	// remained) is applied and changes nothing: the charge is one we know,
	// and the order is owed nothing.
	// It was poison ("unknown charge": a cancelled order records no
	// charge), as was the processor's announcement of the compensation's
	// own refund.
	t.Run("RefundOfACancelledOrdersChargeChangesNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		var event []byte
		failConfirm(env, func(point faultPoint, pass int) error {
			// After the charge, before the saga records it.
			if point == faultAfterProcessorCall && pass == 1 {
				chargeID := env.str(t, `SELECT charge_id FROM processor_charges`)
				event = refundedEvent("evt_dashboard", chargeID, dashboardRefund(t, env, "dashboard-1", chargeID, 1500), "1500")
			}
			return nil
		})
		created := call(t, ts, "POST", "/api/orders", keyUser42, "order-key", orderBody(5000, "sku-1", 1, pmCardVisa))
		orderID := orderField([]byte(created.Body), "order_id")
		env.drain(t)
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "cancelled:0" {
			t.Fatalf("order %s, want cancelled:0", got)
		}
		if _, reply := postSigned(t, env, ts, event); reply.Outcome != inboxApplied {
			t.Fatalf("the dashboard's event got %+v, want applied", reply)
		}
		own := refundedEvent("evt_compensation", env.str(t, `SELECT charge_id FROM processor_charges`),
			env.str(t, `SELECT refund_id FROM processor_refunds WHERE idempotency_key <> 'dashboard-1'`), "3500")
		if _, reply := postSigned(t, env, ts, own); reply.Outcome != inboxApplied {
			t.Fatalf("the compensation's own refund, announced, got %+v, want applied", reply)
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "cancelled:0" {
			t.Fatalf("order %s after the events, want cancelled:0", got)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure a refund of a charge whose answer the saga has not recorded
	// yet (the processor charged and the response was lost) is early, not
	// unknown: the charge's metadata names the order, which still waits for
	// its payment, so the event is answered 503 and applied when delivered
	// again. Without the metadata the event was poison, and the refund made
	// at the processor was never counted.
	t.Run("RefundOfAChargeWhoseAnswerIsNotRecordedIsRetried", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		created := call(t, ts, "POST", "/api/orders", keyUser42, "order-key", orderBody(5000, "sku-1", 1, pmCardVisa))
		orderID := orderField([]byte(created.Body), "order_id")
		startSagas(t, env)
		env.fault.failAt(faultProcessorLoseResponse, errors.New("connection reset"), 1)
		if _, err := env.app.sagaOnce(context.Background(), "test-worker", 10); err != nil {
			t.Fatal(err)
		}
		chargeID := env.str(t, `SELECT charge_id FROM processor_charges`)
		if chargeID == "" || env.count(t, `SELECT COUNT(*) FROM saga_steps WHERE step_name = ?`, stepChargeCard) != 0 {
			t.Fatalf("want a charge %q that the saga has not recorded", chargeID)
		}
		refundID := dashboardRefund(t, env, "dashboard-1", chargeID, 1500)
		event := []byte(fmt.Sprintf(`{"id":"evt_early","type":"charge.refunded","data":{"charge_id":%q,"refund_id":%q,"amount_cents":1500,"order_id":%q}}`,
			chargeID, refundID, orderID))

		requireEarly(t, env, ts, event)
		env.drain(t)
		requireAppliedPaidWith(t, env, ts, event, "paid:1500")
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure the processor's announcement of a refund our API asked for,
	// arriving before we recorded its id, is retried and then counted
	// once, not a second time.
	t.Run("OurOwnRefundAnnouncedWhilePendingIsCountedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		env.fault.crashAt(faultRefundAfterProcessor)
		if got := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":2000}`); got.Status != 500 {
			t.Fatalf("the crashing refund got %d %s", got.Status, got.Body)
		}
		refundID := env.str(t, `SELECT refund_id FROM processor_refunds`)
		event := refundedEvent("evt_1", chargeID, refundID, "2000")

		early, _ := postSigned(t, env, ts, event)
		if early.Status != 503 {
			t.Fatalf("got %d %s, want 503 while our refund is pending", early.Status, early.Body)
		}
		env.drain(t)
		if _, reply := postSigned(t, env, ts, event); reply.Outcome != inboxApplied {
			t.Fatalf("the redelivered event got %+v, want applied", reply)
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "paid:2000" {
			t.Fatalf("order %s, want paid:2000", got)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure one refund is counted once whether the processor delivers one
	// event twice or announces the refund under two event ids.
	t.Run("OneRefundIsCountedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		refundID := dashboardRefund(t, env, "dashboard-1", chargeID, 1500)
		deliveries := []struct {
			eventID string
			outcome inboxOutcome
		}{
			{"evt_1", inboxApplied},
			{"evt_1", inboxDuplicate},
			{"evt_2", inboxApplied}, // acknowledged; the refund is known
			{"evt_2", inboxDuplicate},
		}
		for _, d := range deliveries {
			if got, reply := postSigned(t, env, ts, refundedEvent(d.eventID, chargeID, refundID, "1500")); reply.Outcome != d.outcome {
				t.Fatalf("%s: got %d %s, want %s", d.eventID, got.Status, got.Body, d.outcome)
			}
			if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "paid:1500" {
				t.Fatalf("after %s: order %s, want paid:1500", d.eventID, got)
			}
			requireOrderSound(t, env, ts, keyUser42, orderID)
		}
		if n := env.count(t, `SELECT COUNT(*) FROM refunds`); n != 1 {
			t.Fatalf("%d refunds recorded, want 1", n)
		}
	})

	// Ensure an event whose id holds a NUL, which JSON can spell and
	// PostgreSQL cannot store, or is longer than maxMessageIDLength, which
	// PostgreSQL cannot key on, is refused with 400 naming the id, and
	// nothing is stored, on every database. On PostgreSQL its inbox insert
	// failed: a 500, at every delivery of it; SQLite applied it.
	t.Run("EventIDNoInboxCanKeyOnIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		refundID := dashboardRefund(t, env, "dashboard-1", chargeID, 100)
		for _, id := range []string{`evt_\u0000`, unkeyableID()} {
			body := fmt.Sprintf(`{"id":"%s","type":"charge.refunded","data":{"charge_id":%q,"refund_id":%q,"amount_cents":100}}`, id, chargeID, refundID)
			got, _ := postSigned(t, env, ts, []byte(body))
			if got.Status != 400 || problemTypeOf(t, got) != problemValidation || !strings.Contains(got.Body, `"field":"id"`) {
				t.Fatalf("id %.20s...: got %d %s, want 400 %s naming id", id, got.Status, got.Body, problemValidation)
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?) + (SELECT COUNT(*) FROM inbox_failures) + (SELECT COUNT(*) FROM refunds)`, webhookConsumer); n != 0 {
			t.Fatalf("stored %d rows", n)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})

	// Ensure a signed body that reads two ways (a member twice, a name in
	// another case) is refused whole, naming the field, and stores nothing.
	t.Run("AmbiguousBodyIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID, chargeID := paidOrderOf(t, env, ts, keyUser42, "order-key", 5000)
		refundID := dashboardRefund(t, env, "dashboard-1", chargeID, 100)
		bodies := map[string]string{
			"data.amount_cents": fmt.Sprintf(`{"id":"evt_1","type":"charge.refunded","data":{"charge_id":%q,"refund_id":%q,"amount_cents":100,"amount_cents":999999}}`, chargeID, refundID),
			"id":                fmt.Sprintf(`{"id":"evt_2","id":"evt_3","type":"charge.refunded","data":{"charge_id":%q,"refund_id":%q,"amount_cents":100}}`, chargeID, refundID),
			"Type":              fmt.Sprintf(`{"id":"evt_4","Type":"charge.refunded","data":{"charge_id":%q,"refund_id":%q,"amount_cents":100}}`, chargeID, refundID),
		}
		for field, body := range bodies {
			got, _ := postSigned(t, env, ts, []byte(body))
			if got.Status != 400 || problemTypeOf(t, got) != problemValidation || !strings.Contains(got.Body, `"field":"`+field+`"`) {
				t.Fatalf("got %d %s, want 400 %s naming %s", got.Status, got.Body, problemValidation, field)
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?) + (SELECT COUNT(*) FROM refunds)`, webhookConsumer); n != 0 {
			t.Fatalf("stored %d rows", n)
		}
		requireOrderSound(t, env, ts, keyUser42, orderID)
	})
}
