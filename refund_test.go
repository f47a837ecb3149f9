package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

// paidOrderOverHTTP creates an order for user-42 over HTTP, runs the workers
// until it is paid, and returns its id.
func paidOrderOverHTTP(tb testing.TB, env *testEnv, ts *httptest.Server, amount int64) string {
	tb.Helper()
	created := call(tb, ts, "POST", "/api/orders", keyUser42, "order-key", orderBody(amount, "sku-1", 1, pmCardVisa))
	if created.Status != 201 {
		tb.Fatalf("create: %d %s", created.Status, created.Body)
	}
	env.drain(tb)
	return orderField([]byte(created.Body), "order_id")
}

func TestHTTPRefund(t *testing.T) {
	// Ensure a refund is made once, replayed on retry, and the order follows.
	t.Run("RefundIsMadeOnceAndReplayed", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		first := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":2000}`)
		again := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":2000}`)
		if first.Status != 200 || again.Status != 200 || again.Body != first.Body || again.Header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("got %d then %d %q", first.Status, again.Status, again.Header.Get("Idempotent-Replayed"))
		}
		if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM processor_refunds`); got != "1:2000" {
			t.Fatalf("processor refunds count:sum %s, want 1:2000", got)
		}
		// An empty body refunds what remains, and the order becomes refunded.
		rest := call(t, ts, "POST", refundPath(orderID), keyUser42, "r2", "")
		if rest.Status != 200 || env.str(t, `SELECT status || ':' || refunded_cents FROM orders`) != "refunded:5000" {
			t.Fatalf("full refund got %d %s", rest.Status, rest.Body)
		}
	})

	// Ensure refusals are definitive: stored on the key and replayed.
	t.Run("RefusalsAreStored", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		declined := call(t, ts, "POST", "/api/orders", keyUser42, "declined", orderBody(100, "sku-1", 1, pmCardDeclined))
		env.drain(t)
		cancelled := call(t, ts, "POST", refundPath(orderField([]byte(declined.Body), "order_id")), keyUser42, "r0", "")
		if cancelled.Status != 409 || problemTypeOf(t, cancelled) != problemOrderNotRefundable {
			t.Fatalf("refund of a cancelled order got %d %s, want 409", cancelled.Status, cancelled.Body)
		}

		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		tooMuch := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":5001}`)
		if tooMuch.Status != 422 || problemTypeOf(t, tooMuch) != problemRefundTooLarge {
			t.Fatalf("refund of too much got %d %s, want 422", tooMuch.Status, tooMuch.Body)
		}
		replayed := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":5001}`)
		if replayed.Status != 422 || replayed.Header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("the refusal was not replayed: %d %q", replayed.Status, replayed.Header.Get("Idempotent-Replayed"))
		}
		otherUser := call(t, ts, "POST", refundPath(orderID), keyUser7, "r1", "")
		if otherUser.Status != 404 {
			t.Fatalf("another user's refund got %d, want 404", otherUser.Status)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 0 {
			t.Fatalf("got %d refunds, want 0", got)
		}
	})

	// Ensure a key reused for a refund of another order is refused as
	// reused, though the bodies are alike: it is another request, and
	// must not be answered with the first order's refund.
	t.Run("KeyReusedForAnotherOrderIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		first, _ := paidOrderOf(t, env, ts, keyUser42, "order-key-1", 5000)
		second, _ := paidOrderOf(t, env, ts, keyUser42, "order-key-2", 3000)
		mustRefund200(t, "the first order's refund", refundCall(t, ts, first, "r1", `{}`), false)
		reused := refundCall(t, ts, second, "r1", `{}`)
		if reused.Status != 422 || problemTypeOf(t, reused) != problemKeyReused {
			t.Fatalf("the key reused for another order got %d %s, want 422 %s", reused.Status, reused.Body, problemKeyReused)
		}
	})

	// Ensure a refund asked for while the payment is still in flight is a
	// 409 that stores nothing: the same key works once the order is paid.
	t.Run("TooEarlyIsNotStored", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		created := call(t, ts, "POST", "/api/orders", keyUser42, "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		orderID := orderField([]byte(created.Body), "order_id")
		early := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", "")
		if early.Status != 409 || early.Header.Get("Retry-After") == "" || problemTypeOf(t, early) != problemPaymentPending {
			t.Fatalf("early refund got %d %s, want 409 payment-pending with Retry-After", early.Status, early.Body)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = 'r1'`); got != 0 {
			t.Fatalf("the early refund stored its key")
		}
		env.drain(t)
		if later := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", ""); later.Status != 200 {
			t.Fatalf("the retry once paid got %d %s, want 200", later.Status, later.Body)
		}
	})

	// Ensure a crash at each recovery point, then a retry, resumes there and
	// refunds once; while the dead request's lease is fresh, a retry gets
	// 409 with Retry-After.
	for _, point := range []faultPoint{faultRefundKeyClaimed, faultRefundStarted, faultRefundAfterProcessor} {
		t.Run("CrashAt_"+string(point)+"_ResumesAfterLease", func(t *testing.T) {
			env := MustOpenApp(t)
			ts := newTestServer(t, env)
			orderID := paidOrderOverHTTP(t, env, ts, 5000)
			env.fault.crashAt(point)
			req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
			if _, err := env.app.refundOrder(context.Background(), req, orderID, refund); !errors.Is(err, errCrash) {
				t.Fatalf("got %v, want the crash", err)
			}
			env.restart(t)
			ts = newTestServer(t, env)

			busy := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":2000}`)
			if busy.Status != 409 || busy.Header.Get("Retry-After") == "" || problemTypeOf(t, busy) != problemKeyInProgress {
				t.Fatalf("retry within the lease got %d %q %s, want 409 with Retry-After", busy.Status, busy.Header.Get("Retry-After"), busy.Body)
			}
			env.clock.advance(refundLockTimeout)
			retry := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":2000}`)
			if retry.Status != 200 {
				t.Fatalf("retry after the lease got %d %s", retry.Status, retry.Body)
			}
			if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM processor_refunds`); got != "1:2000" {
				t.Fatalf("processor refunds count:sum %s, want 1:2000", got)
			}
			if got := env.count(t, `SELECT refunded_cents FROM orders`); got != 2000 {
				t.Fatalf("order refunded_cents %d, want 2000", got)
			}
		})
	}

	// Ensure a lost processor response releases the key: the retry resumes
	// at once and refunds once.
	t.Run("LostProcessorResponseIsRetriable", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		env.fault.failAt(faultProcessorLoseResponse, errors.New("connection reset"), 1)
		lost := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", "")
		if lost.Status != 503 || lost.Header.Get("Retry-After") == "" || problemTypeOf(t, lost) != problemUnavailable {
			t.Fatalf("got %d %s, want 503 with Retry-After", lost.Status, lost.Body)
		}
		retry := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", "")
		if retry.Status != 200 || env.count(t, `SELECT COUNT(*) FROM processor_refunds`) != 1 {
			t.Fatalf("retry got %d %s", retry.Status, retry.Body)
		}
	})

	// Ensure a request that stalls past its lease, while the completer takes
	// over and finishes, records nothing when it wakes: the money is counted
	// once and the completer's answer stands.
	t.Run("StalledRequestTakenOverRecordsNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		ctx := context.Background()
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultRefundAfterProcessor && pass == 1 {
				// The first request stalls here; meanwhile its lease passes
				// and the completer finishes the refund.
				env.clock.advance(env.app.leases.refundLock)
				if n, err := env.app.completeRefundsOnce(ctx, 10); err != nil || n != 1 {
					t.Errorf("completer finished %d, %v; want 1", n, err)
				}
			}
			return nil
		})
		req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); !errors.Is(err, errKeyInProgress) {
			t.Fatalf("the stalled request got %v, want errKeyInProgress", err)
		}
		if got := env.str(t, `SELECT refunded_cents || ':' || (SELECT COUNT(*) FROM outbox_events WHERE event_type = 'OrderRefunded') FROM orders`); got != "2000:1" {
			t.Fatalf("refunded_cents:OrderRefunded events = %s, want 2000:1", got)
		}
		mustAudit(t, env, false)
	})

	// Ensure a refund still in flight counts against what remains: while
	// one refund of 3000 waits for the processor, a second of 3000 under
	// another key of a 5000 order is refused 422, and only the first is
	// made. Counting the succeeded refunds alone, both went to the
	// processor and 6000 of 5000 was refunded.
	t.Run("RefundInFlightCountsAgainstWhatRemains", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		var second response
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultRefundStarted && pass == 1 {
				second = refundCall(t, ts, orderID, "r2", `{"amount_cents":3000}`)
			}
			return nil
		})
		mustRefund200(t, "the first refund", refundCall(t, ts, orderID, "r1", `{"amount_cents":3000}`), false)
		if second.Status != 422 || !strings.Contains(second.Body, string(problemRefundTooLarge)) {
			t.Fatalf("the second refund, while the first was in flight, got %d %s; want 422 %s", second.Status, second.Body, problemRefundTooLarge)
		}
		if got := env.str(t, `SELECT refunded_cents || ':' || (SELECT COALESCE(SUM(amount_cents), 0) FROM processor_refunds) FROM orders`); got != "3000:3000" {
			t.Fatalf("refunded_cents:processor's refunds = %s, want 3000:3000", got)
		}
	})

	// Ensure a request whose key the client's retry took over while it
	// stalled between claiming the key and its first phase writes nothing
	// when it wakes: unfenced, its first phase found the retry's refund
	// under the key and stored 422 "key expired" over the retry's 200,
	// and every later retry replayed the 422.
	t.Run("StalledBeforeFirstPhaseTakenOverWritesNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		ctx := context.Background()
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
		key, lease, replay, err := env.app.acquireKey(ctx, req)
		if err != nil || replay != nil {
			t.Fatalf("acquire: %v %v", replay, err)
		}
		env.clock.advance(env.app.leases.refundLock + time.Second)
		refundID := mustRefund200(t, "the retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), false)
		if stale, err := env.app.runRefundPhases(ctx, req, lease, key, orderID, refund); !errors.Is(err, errKeyInProgress) {
			t.Errorf("the stalled request got %d %s, %v; want errKeyInProgress", stale.Status, stale.Body, err)
		}
		if got := mustRefund200(t, "a later retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), true); got != refundID {
			t.Fatalf("a later retry replayed refund %s, want %s", got, refundID)
		}
	})

	// Ensure a webhook that overtakes our own record of a refund is asked for
	// again instead of counting the refund twice, and nothing gets stuck.
	t.Run("WebhookOvertakingOurRecordIsRetried", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		env.fault.crashAt(faultRefundAfterProcessor)
		req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
		if _, err := env.app.refundOrder(context.Background(), req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		ts = newTestServer(t, env)
		chargeID := env.str(t, `SELECT charge_id FROM orders`)
		refundID := env.str(t, `SELECT refund_id FROM processor_refunds`)
		body := chargeRefundedEvent("evt_early", chargeID, refundID, 2000)
		early := postWebhook(t, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
		if early.Status != 503 {
			t.Fatalf("the early webhook got %d %s, want 503 so the processor sends it again", early.Status, early.Body)
		}
		env.clock.advance(env.app.leases.refundLock)
		if n, err := env.app.completeRefundsOnce(context.Background(), 10); err != nil || n != 1 {
			t.Fatalf("completer finished %d, %v; want 1", n, err)
		}
		again := postWebhook(t, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
		if again.Status != 200 || !strings.Contains(again.Body, `"applied"`) {
			t.Fatalf("the redelivered webhook got %d %s, want 200 applied", again.Status, again.Body)
		}
		if got := env.count(t, `SELECT refunded_cents FROM orders`); got != 2000 {
			t.Fatalf("refunded_cents %d, want 2000", got)
		}
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure the completer finishes a refund whose client never came back,
	// and the client's late retry replays its result.
	t.Run("CompleterFinishesAbandonedRefund", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		env.fault.crashAt(faultRefundAfterProcessor)
		req, refund := refundRequestFor(t, orderID, "r1", "")
		if _, err := env.app.refundOrder(context.Background(), req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		if n, err := env.app.completeRefundsOnce(context.Background(), 10); err != nil || n != 0 {
			t.Fatalf("completer took a leased key: %d, %v", n, err)
		}
		env.clock.advance(refundLockTimeout)
		if n, err := env.app.completeRefundsOnce(context.Background(), 10); err != nil || n != 1 {
			t.Fatalf("completer finished %d, %v; want 1", n, err)
		}
		ts = newTestServer(t, env)
		late := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", "")
		if late.Status != 200 || late.Header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("late retry got %d %q", late.Status, late.Header.Get("Idempotent-Replayed"))
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "refunded:5000" {
			t.Fatalf("order %s, want refunded:5000", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 1 {
			t.Fatalf("got %d refunds, want 1", got)
		}
	})
}

// refundRequestFor builds a refund request of user-42 for direct calls.
func refundRequestFor(tb testing.TB, orderID, key, body string) (idempotentRequest, refundRequest) {
	tb.Helper()
	if body == "" {
		body = "{}"
	}
	canonical, err := canonicalJSON([]byte(body))
	if err != nil {
		tb.Fatal(err)
	}
	refund, err := decodeRefundRequest([]byte(body))
	if err != nil {
		tb.Fatal(err)
	}
	return idempotentRequest{UserID: "user-42", IdempotencyKey: key, Method: "POST", Path: refundPath(orderID), CanonicalBody: canonical}, refund
}

// postWebhook sends a processor webhook with the given signature header.
func postWebhook(tb testing.TB, ts *httptest.Server, body []byte, signature string) response {
	tb.Helper()
	req, err := http.NewRequest("POST", ts.URL+"/webhooks/processor", strings.NewReader(string(body)))
	if err != nil {
		tb.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if signature != "" {
		req.Header.Set(signatureHeader, signature)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: string(data)}
}

func TestHTTPWebhook(t *testing.T) {
	// Ensure a refund made at the processor's dashboard, announced twice,
	// changes the order once; a bad or stale signature changes nothing.
	t.Run("DeliveredTwiceAppliedOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		chargeID := env.str(t, `SELECT charge_id FROM orders WHERE order_id = ?`, orderID)
		refundID, err := env.app.processor.refund(context.Background(), "dashboard-1", chargeID, 1500)
		if err != nil {
			t.Fatal(err)
		}
		body := chargeRefundedEvent("evt_processor_1", chargeID, refundID, 1500)
		secret := []byte(testWebhookSecret)

		forged := postWebhook(t, ts, body, signWebhook([]byte("wrong secret"), env.clock.now(), body))
		stale := postWebhook(t, ts, body, signWebhook(secret, env.clock.now().Add(-webhookTolerance-time.Second), body))
		unsigned := postWebhook(t, ts, body, "")
		for name, r := range map[string]response{"forged": forged, "stale": stale, "unsigned": unsigned} {
			if r.Status != 400 || problemTypeOf(t, r) != problemBadSignature {
				t.Fatalf("%s webhook got %d %s, want 400 bad signature", name, r.Status, r.Body)
			}
		}
		if got := env.count(t, `SELECT refunded_cents FROM orders`); got != 0 {
			t.Fatalf("a rejected webhook changed the order: refunded_cents %d", got)
		}

		first := postWebhook(t, ts, body, signWebhook(secret, env.clock.now(), body))
		second := postWebhook(t, ts, body, signWebhook(secret, env.clock.now(), body))
		if first.Status != 200 || !strings.Contains(first.Body, `"applied"`) || second.Status != 200 || !strings.Contains(second.Body, `"duplicate"`) {
			t.Fatalf("got %d %s then %d %s, want applied then duplicate", first.Status, first.Body, second.Status, second.Body)
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "paid:1500" {
			t.Fatalf("order %s, want paid:1500", got)
		}

		// An event for a charge nobody knows is acknowledged as poison, with
		// its reason, so the processor stops retrying and an operator can
		// look.
		unknown := chargeRefundedEvent("evt_processor_2", "ch_unknown", "re_unknown", 100)
		poison := postWebhook(t, ts, unknown, signWebhook(secret, env.clock.now(), unknown))
		if poison.Status != 200 || !strings.Contains(poison.Body, `"outcome":"poison"`) || !strings.Contains(poison.Body, "unknown charge ch_unknown") {
			t.Fatalf("got %d %s, want 200 poison naming the charge", poison.Status, poison.Body)
		}
	})

	// Ensure a webhook signed further ahead than webhookTolerance is
	// refused with 400 and changes nothing, and one signed just within it
	// is applied: a clock gone wrong is heard of, not taken for a fresh
	// signature.
	t.Run("TimestampAheadBeyondTheToleranceIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		chargeID := env.str(t, `SELECT charge_id FROM orders WHERE order_id = ?`, orderID)
		refundID, err := env.app.processor.refund(context.Background(), "dashboard-1", chargeID, 1500)
		if err != nil {
			t.Fatal(err)
		}
		body := chargeRefundedEvent("evt_processor_1", chargeID, refundID, 1500)
		secret := []byte(testWebhookSecret)

		ahead := postWebhook(t, ts, body, signWebhook(secret, env.clock.now().Add(webhookTolerance+time.Second), body))
		if ahead.Status != 400 || problemTypeOf(t, ahead) != problemBadSignature {
			t.Fatalf("a webhook signed %s ahead got %d %s, want 400 bad signature", webhookTolerance+time.Second, ahead.Status, ahead.Body)
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?) + (SELECT COUNT(*) FROM inbox_failures WHERE consumer = ?) + (SELECT refunded_cents FROM orders)`,
			webhookConsumer, webhookConsumer); n != 0 {
			t.Fatalf("the refused webhook stored something (%d)", n)
		}
		within := postWebhook(t, ts, body, signWebhook(secret, env.clock.now().Add(webhookTolerance-time.Second), body))
		if within.Status != 200 || !strings.Contains(within.Body, `"applied"`) {
			t.Fatalf("a webhook signed %s ahead got %d %s, want it applied", webhookTolerance-time.Second, within.Status, within.Body)
		}
		if got := env.str(t, `SELECT status || ':' || refunded_cents FROM orders`); got != "paid:1500" {
			t.Fatalf("order %s, want paid:1500", got)
		}
	})
}

// refundCall sends a refund of orderID by user-42 under key.
func refundCall(tb testing.TB, ts *httptest.Server, orderID, key, body string) response {
	tb.Helper()
	return call(tb, ts, "POST", refundPath(orderID), keyUser42, key, body)
}

// mustRefund200 fails the test unless r is a refund's 200 with the wanted
// Idempotent-Replayed header, and returns the refund id.
func mustRefund200(tb testing.TB, what string, r response, replayed bool) string {
	tb.Helper()
	if r.Status != 200 || (r.Header.Get("Idempotent-Replayed") == "true") != replayed {
		tb.Fatalf("%s got %d replayed=%q %s, want 200 replayed=%v", what, r.Status, r.Header.Get("Idempotent-Replayed"), r.Body, replayed)
	}
	return orderField([]byte(r.Body), "refund_id")
}

// mustRefuseExpiredKey fails the test unless r is the stored 422 that
// refuses an expired key reused for the refund refundID of the same order.
func mustRefuseExpiredKey(tb testing.TB, what string, r response, refundID string) {
	tb.Helper()
	if r.Status != 422 || problemTypeOf(tb, r) != problemKeyExpired || !strings.Contains(r.Body, refundID) {
		tb.Fatalf("%s got %d %s, want 422 %s naming %s", what, r.Status, r.Body, problemKeyExpired, refundID)
	}
}

func TestHTTPRefundKeyExpiry(t *testing.T) {
	// Ensure a refund key reused after it expired, for the order it already
	// refunded, is refused with a stored 422 that names the refund, and
	// nothing else happens; the same key for another order runs as new.
	t.Run("ExpiredKeyReusedIsRefusedNot500", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		refundID := mustRefund200(t, "the refund", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), false)
		env.clock.advance(idempotencyKeyTTL + time.Minute)

		// For another order the expired key runs as a new request.
		created := call(t, ts, "POST", "/api/orders", keyUser42, "order-key-2", orderBody(3000, "sku-1", 1, pmCardVisa))
		env.drain(t)
		otherOrderID := orderField([]byte(created.Body), "order_id")
		mustRefund200(t, "the expired key for another order", refundCall(t, ts, otherOrderID, "r1", `{"amount_cents":1000}`), false)
		env.clock.advance(idempotencyKeyTTL + time.Minute)

		reused := refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`)
		mustRefuseExpiredKey(t, "the expired key reused", reused, refundID)
		again := refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`)
		mustRefuseExpiredKey(t, "its retry", again, refundID)
		if again.Header.Get("Idempotent-Replayed") != "true" || again.Body != reused.Body {
			t.Fatalf("the refusal was not replayed: %q %s", again.Header.Get("Idempotent-Replayed"), again.Body)
		}
		if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM refunds WHERE order_id = ?`, orderID); got != "1:2000" {
			t.Fatalf("refunds of the first order count:sum %s, want 1:2000", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 2 {
			t.Fatalf("got %d processor refunds, want 2", got)
		}
		if n, err := env.app.completeRefundsOnce(context.Background(), 10); err != nil || n != 0 {
			t.Fatalf("completer finished %d, %v; want 0, nil", n, err)
		}

		// Once cleanup has deleted the key, the refund row still remembers it.
		env.clock.advance(idempotencyKeyTTL + time.Minute)
		if _, err := env.app.cleanupOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
		mustRefuseExpiredKey(t, "the key reused after cleanup", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), refundID)
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure a refund that finishes after its key's TTL answers 200 (the
	// money moved), and a retry right after replays it.
	t.Run("RefundFinishingAfterExpiryAnswers200", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultRefundAfterProcessor {
				env.clock.advance(idempotencyKeyTTL + time.Minute)
			}
			return nil
		})
		refundID := mustRefund200(t, "the late refund", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), false)
		env.fault.set(nil)
		if got := mustRefund200(t, "its retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), true); got != refundID {
			t.Fatalf("the retry replayed refund %s, want %s", got, refundID)
		}
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure one key the completer cannot finish neither stops it from
	// finishing the others nor takes a place in every pass: it is reported,
	// set aside for a lease, and tried again after.
	t.Run("CompleterGoesOnPastABadKey", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		ctx := context.Background()
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		// A key whose refund row is gone: an operator's mistake, a bug.
		broken, _ := refundRequestFor(t, orderID, "broken", "")
		_, err := env.app.db.Exec(`
			INSERT INTO idempotency_keys
				(user_id, idempotency_key, request_method, request_path, request_hash, request_params,
				 status, recovery_point, created_at, expires_at)
			VALUES (?, ?, ?, ?, ?, ?, 'processing', 'refund_requested', ?, ?)`,
			broken.UserID, broken.IdempotencyKey, broken.Method, broken.Path, broken.fingerprint(), broken.CanonicalBody,
			formatTime(env.clock.now()), formatTime(env.clock.now().Add(idempotencyKeyTTL)))
		if err != nil {
			t.Fatal(err)
		}
		env.clock.advance(time.Second)
		env.fault.crashAt(faultRefundAfterProcessor)
		req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
		if _, err := env.app.refundOrder(ctx, req, orderID, refund); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		ts = newTestServer(t, env)
		env.clock.advance(env.app.leases.refundLock)

		// One key per pass: the broken key, oldest, comes first.
		n, err := env.app.completeRefundsOnce(ctx, 1)
		if n != 0 || err == nil || !strings.Contains(err.Error(), "broken") {
			t.Fatalf("first pass finished %d, %v; want 0 and an error naming the broken key", n, err)
		}
		if n, err := env.app.completeRefundsOnce(ctx, 1); n != 1 || err != nil {
			t.Fatalf("second pass finished %d, %v; want the abandoned refund", n, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM refunds WHERE status = 'pending'`); got != 0 {
			t.Fatalf("got %d pending refunds, want 0", got)
		}
		env.clock.advance(env.app.leases.refundLock)
		if n, err := env.app.completeRefundsOnce(ctx, 10); n != 0 || err == nil {
			t.Fatalf("after its lease the broken key got %d, %v; want it tried and reported again", n, err)
		}
		mustRefund200(t, "the abandoned refund's late retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), true)
	})

	// Ensure a clock that jumps past the key's TTL and the lease at each
	// point of a refund changes no answer: the request that did the work
	// gets 200 (after a 503 if the processor's answer was lost), a retry
	// replays it, a reuse once it expired gets the stored 422, and the
	// books balance.
	for _, point := range []faultPoint{faultRefundStarted, faultRefundAfterProcessor, faultProcessorLoseResponse} {
		t.Run("ClockJumpsPastExpiryAt_"+string(point), func(t *testing.T) {
			env := MustOpenApp(t)
			ts := newTestServer(t, env)
			orderID := paidOrderOverHTTP(t, env, ts, 5000)
			jumped := false
			env.fault.set(func(p faultPoint, pass int) error {
				if p != point || jumped {
					return nil
				}
				jumped = true
				env.clock.advance(idempotencyKeyTTL + env.app.leases.refundLock + time.Minute)
				if p == faultProcessorLoseResponse {
					return errors.New("connection reset")
				}
				return nil
			})
			first := refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`)
			if point == faultProcessorLoseResponse {
				if first.Status != 503 {
					t.Fatalf("the lost answer got %d %s, want 503", first.Status, first.Body)
				}
				first = refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`)
			}
			refundID := mustRefund200(t, "the refund", first, false)
			if got := mustRefund200(t, "its retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), true); got != refundID {
				t.Fatalf("the retry replayed refund %s, want %s", got, refundID)
			}
			env.drain(t)
			mustAudit(t, env, true)

			env.clock.advance(idempotencyKeyTTL + time.Minute)
			mustRefuseExpiredKey(t, "the expired key reused", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), refundID)
			if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM processor_refunds`); got != "1:2000" {
				t.Fatalf("processor refunds count:sum %s, want 1:2000", got)
			}
			env.drain(t)
			mustAudit(t, env, true)
		})
	}

	// Ensure the completer finishes a refund abandoned longer than its
	// key's TTL at each recovery point, and the client's late retry replays
	// the completer's answer.
	for _, point := range []faultPoint{faultRefundStarted, faultRefundAfterProcessor} {
		t.Run("CompleterFinishesRefundAbandonedPastExpiryAt_"+string(point), func(t *testing.T) {
			env := MustOpenApp(t)
			ts := newTestServer(t, env)
			orderID := paidOrderOverHTTP(t, env, ts, 5000)
			env.fault.crashAt(point)
			req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
			if _, err := env.app.refundOrder(context.Background(), req, orderID, refund); !errors.Is(err, errCrash) {
				t.Fatalf("got %v, want the crash", err)
			}
			env.restart(t)
			ts = newTestServer(t, env)
			env.clock.advance(idempotencyKeyTTL + env.app.leases.refundLock + time.Minute)
			if n, err := env.app.completeRefundsOnce(context.Background(), 10); n != 1 || err != nil {
				t.Fatalf("completer finished %d, %v; want 1", n, err)
			}
			mustRefund200(t, "the late retry", refundCall(t, ts, orderID, "r1", `{"amount_cents":2000}`), true)
			env.drain(t)
			mustAudit(t, env, true)
		})
	}
}

// send is call for a goroutine other than the test's: it returns the
// failure instead of ending the test.
func send(ts *httptest.Server, method, path, apiKey, idempotencyKey, body string) (response, error) {
	return sendWith(ts.Client(), method, ts.URL+path, apiKey, idempotencyKey, body)
}

// Ensure a refund request whose key a retry took over between its lease
// check and its refund's insert answers "in progress", not 500, on
// PostgreSQL: its insert waits for the retry's uncommitted refund under
// the same key, and meets it once the retry commits (SQLSTATE 23505, which
// PostgreSQL does not turn into a serialization failure when the other
// insert was still in flight). The isolation harness's pair refund /
// refund retried past the lease found it, in one run out of two or three.
func TestRefundConcurrentWriters(t *testing.T) {
	if os.Getenv(testPostgresEnv) == "" {
		t.Skipf("PostgreSQL only: set %s to a database URL (SQLite has one writer, so no insert waits on another's)", testPostgresEnv)
	}
	ctx := context.Background()
	env := MustOpenApp(t)
	ts := newTestServer(t, env)
	orderID := paidOrderOverHTTP(t, env, ts, 5000)
	req, refund := refundRequestFor(t, orderID, "r1", `{"amount_cents":2000}`)
	_, lease, replay, err := env.app.acquireKey(ctx, req)
	if err != nil || replay != nil {
		t.Fatalf("acquire: %v %v", replay, err)
	}
	// The retry: it takes the key over and records its refund, and has
	// not committed yet.
	retry, err := env.app.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer retry.Rollback()
	now := formatTime(env.clock.now())
	if _, err := retry.Exec(`UPDATE idempotency_keys SET locked_by = 'lease-of-the-retry', recovery_point = ? WHERE idempotency_key = 'r1'`, recoveryRefundRequested); err != nil {
		t.Fatal(err)
	}
	if _, err := retry.Exec(`
		INSERT INTO refunds (refund_id, order_id, amount_cents, status, source, idempotency_key, created_at, updated_at)
		VALUES ('rf_retry', ?, 2000, 'pending', 'api', 'r1', ?, ?)`, orderID, now, now); err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() {
		_, err := env.app.refundPhaseStarted(ctx, req, lease, orderID, refund)
		started <- err
	}()
	waitOnLock(t, env, "INSERT INTO refunds", started, "the first request's phase did not wait for the retry's insert")
	if err := retry.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := mustReceive(t, "the first request's phase to end", started); !errors.Is(err, errKeyInProgress) {
		t.Fatalf("the first request's phase got %v, want errKeyInProgress (answered 409)", err)
	}
	if got := env.str(t, `SELECT string_agg(refund_id, ',') FROM refunds`); got != "rf_retry" {
		t.Fatalf("refunds %s, want the retry's only", got)
	}
}
