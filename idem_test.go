package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// newOrderRequest returns the idempotentRequest and decoded order for body.
func newOrderRequest(tb testing.TB, userID, key, body string) (idempotentRequest, orderRequest) {
	tb.Helper()
	canonical, err := canonicalJSON([]byte(body))
	if err != nil {
		tb.Fatalf("canonicalJSON: %v", err)
	}
	order, err := decodeOrderRequest([]byte(body))
	if err != nil {
		tb.Fatalf("decodeOrderRequest: %v", err)
	}
	return idempotentRequest{UserID: userID, IdempotencyKey: key, Method: "POST", Path: "/api/orders", CanonicalBody: canonical}, order
}

// mustCreateOrder creates an order and fails the test on error.
func mustCreateOrder(tb testing.TB, env *testEnv, userID, key, body string) apiResponse {
	tb.Helper()
	req, order := newOrderRequest(tb, userID, key, body)
	response, err := env.app.createOrder(context.Background(), req, order)
	if err != nil {
		tb.Fatalf("createOrder: %v", err)
	}
	return response
}

func TestCanonicalJSON(t *testing.T) {
	// Ensure field order and whitespace do not change the fingerprint.
	t.Run("EquivalentBodiesShareAFingerprint", func(t *testing.T) {
		a, err := canonicalJSON([]byte(`{"b":1,"a":[{"y":2,"x":"s"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		b, err := canonicalJSON([]byte(" {\n\"a\" : [ {\"x\":\"s\", \"y\":2} ] ,\t\"b\":1 } "))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Fatalf("got %s and %s, want equal", a, b)
		}
	})
	// Ensure any change of value changes the fingerprint.
	t.Run("DifferentBodiesDiffer", func(t *testing.T) {
		bodies := []string{`{"a":1}`, `{"a":2}`, `{"a":"1"}`, `{"a":1.0}`, `{"a":[1]}`, `{"b":1}`, `{"a":1,"b":null}`}
		seen := map[string]string{}
		for _, body := range bodies {
			canonical, err := canonicalJSON([]byte(body))
			if err != nil {
				t.Fatal(err)
			}
			if other, dup := seen[string(canonical)]; dup {
				t.Fatalf("%s and %s canonicalize alike: %s", body, other, canonical)
			}
			seen[string(canonical)] = body
		}
	})
	// Ensure bodies that are not exactly one valid UTF-8 JSON value are refused.
	t.Run("RejectsInvalidBodies", func(t *testing.T) {
		for _, body := range []string{"", "{", `{"a":1} {"a":2}`, "{\"a\":\"\xff\"}", "nul"} {
			if got, err := canonicalJSON([]byte(body)); err == nil {
				t.Errorf("canonicalJSON(%q) = %s, want an error", body, got)
			}
		}
	})
	// Ensure method and path are part of the fingerprint.
	t.Run("FingerprintCoversMethodAndPath", func(t *testing.T) {
		base := idempotentRequest{Method: "POST", Path: "/api/orders", CanonicalBody: []byte(`{}`)}
		otherPath := base
		otherPath.Path = "/api/orders/x/refund"
		otherMethod := base
		otherMethod.Method = "PUT"
		if base.fingerprint() == otherPath.fingerprint() || base.fingerprint() == otherMethod.fingerprint() {
			t.Fatal("fingerprint ignores method or path")
		}
	})
}

func TestIdempotency(t *testing.T) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)

	// Ensure a retry with the same key returns the first order and writes nothing.
	t.Run("RetryReturnsSameOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		first := mustCreateOrder(t, env, "user-42", "k1", body)
		second := mustCreateOrder(t, env, "user-42", "k1", body)
		if first.Replayed || !second.Replayed {
			t.Fatalf("got replayed %v then %v, want false then true", first.Replayed, second.Replayed)
		}
		if !bytes.Equal(first.Body, second.Body) || second.Status != 201 || second.Location != first.Location {
			t.Fatalf("got %d %s, want the first response %d %s", second.Status, second.Body, first.Status, first.Body)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != 1 {
			t.Fatalf("got %d outbox events, want 1", got)
		}
	})

	// Ensure a key reused for another request is rejected and does nothing.
	t.Run("KeyReusedWithAnotherBodyIsRejected", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", body)
		req, order := newOrderRequest(t, "user-42", "k1", orderBody(9900, "sku-1", 2, pmCardVisa))
		_, err := env.app.createOrder(context.Background(), req, order)
		if !errors.Is(err, errKeyReused) {
			t.Fatalf("got %v, want errKeyReused", err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
	})

	// Ensure one user's key never replays another user's response.
	t.Run("KeysAreScopedToTheCaller", func(t *testing.T) {
		env := MustOpenApp(t)
		mine := mustCreateOrder(t, env, "user-42", "shared-key", body)
		theirs := mustCreateOrder(t, env, "user-7", "shared-key", body)
		if theirs.Replayed || bytes.Equal(mine.Body, theirs.Body) {
			t.Fatalf("user-7 got user-42's response: %s", theirs.Body)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE user_id = 'user-7'`); got != 1 {
			t.Fatalf("got %d orders for user-7, want 1", got)
		}
	})

	// Ensure expires_at is read: within 24h a key replays, after it runs anew.
	t.Run("ExpiredKeyNoLongerReplays", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", body)
		env.clock.advance(idempotencyKeyTTL - time.Second)
		if !mustCreateOrder(t, env, "user-42", "k1", body).Replayed {
			t.Fatal("a key younger than its TTL did not replay")
		}
		env.clock.advance(2 * time.Second)
		if mustCreateOrder(t, env, "user-42", "k1", body).Replayed {
			t.Fatal("an expired key replayed")
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 2 {
			t.Fatalf("got %d orders, want 2 (the key expired between them)", got)
		}
	})

	// Ensure a crash between claiming the key and storing the response
	// leaves neither a stuck key nor a half-made order: the retry does the
	// work once.
	for _, point := range []faultPoint{faultAfterKeyClaim, faultAfterBusinessWrite} {
		t.Run("CrashAt_"+string(point)+"_RetryRunsOnce", func(t *testing.T) {
			env := MustOpenApp(t)
			env.fault.crashAt(point)
			req, order := newOrderRequest(t, "user-42", "k1", body)
			if _, err := env.app.createOrder(context.Background(), req, order); !errors.Is(err, errCrash) {
				t.Fatalf("got %v, want the crash", err)
			}
			env.restart(t)
			if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`); got != 0 {
				t.Fatalf("got %d keys after the crash, want 0", got)
			}
			retry := mustCreateOrder(t, env, "user-42", "k1", body)
			if retry.Status != 201 || retry.Replayed {
				t.Fatalf("got %d replayed=%v, want a fresh 201", retry.Status, retry.Replayed)
			}
			if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
				t.Fatalf("got %d orders, want 1", got)
			}
			if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys WHERE status = 'processing'`); got != 0 {
				t.Fatalf("got %d keys stuck in processing", got)
			}
		})
	}

	// Ensure a transient failure stores nothing: the key stays free and the
	// retry does the work once (the sample stored every exception as a
	// permanent 500).
	t.Run("TransientFailureLeavesKeyFree", func(t *testing.T) {
		env := MustOpenApp(t)
		env.fault.failAt(faultAfterBusinessWrite, errors.New("disk I/O error"), 1)
		req, order := newOrderRequest(t, "user-42", "k1", body)
		if _, err := env.app.createOrder(context.Background(), req, order); err == nil {
			t.Fatal("got no error, want the transient failure")
		}
		if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`); got != 0 {
			t.Fatalf("got %d keys stored for a transient failure, want 0", got)
		}
		if retry := mustCreateOrder(t, env, "user-42", "k1", body); retry.Status != 201 || retry.Replayed {
			t.Fatalf("got %d replayed=%v, want a fresh 201", retry.Status, retry.Replayed)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
	})

	// Ensure a panic in the middle of the work stores nothing.
	t.Run("PanicStoresNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		env.app.fault = func(ctx context.Context, point faultPoint) error {
			if point == faultAfterBusinessWrite {
				panic("boom")
			}
			return nil
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("no panic")
				}
			}()
			req, order := newOrderRequest(t, "user-42", "k1", body)
			env.app.createOrder(context.Background(), req, order)
		}()
		if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`) + env.count(t, `SELECT COUNT(*) FROM orders`); got != 0 {
			t.Fatalf("got %d rows after a panic, want 0", got)
		}
	})

	// Ensure concurrent requests with one key make one order and all get
	// its response.
	t.Run("ConcurrentDuplicatesWaitAndReplay", func(t *testing.T) {
		env := MustOpenApp(t)
		const n = 20
		responses := make([]apiResponse, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, order := newOrderRequest(t, "user-42", "k1", body)
				responses[i], errs[i] = env.app.createOrder(context.Background(), req, order)
			}()
		}
		mustWait(t, "every request to be answered", &wg)
		fresh := 0
		for i := range n {
			if errs[i] != nil {
				t.Fatalf("request %d: %v", i, errs[i])
			}
			if !bytes.Equal(responses[i].Body, responses[0].Body) {
				t.Fatalf("request %d got %s, want %s", i, responses[i].Body, responses[0].Body)
			}
			if !responses[i].Replayed {
				fresh++
			}
		}
		if fresh != 1 {
			t.Fatalf("got %d fresh responses, want 1", fresh)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
	})
}

func TestCleanup(t *testing.T) {
	// Ensure cleanup deletes expired finished keys in batches, keeps live
	// ones, and keeps an unfinished refund key its completer still needs.
	t.Run("DeletesExpiredKeys", func(t *testing.T) {
		env := MustOpenApp(t)
		const expired = cleanupBatchSize + 20
		for i := range expired {
			mustCreateOrder(t, env, "user-42", fmt.Sprintf("old-%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
		}
		_, err := env.app.db.Exec(`UPDATE idempotency_keys SET recovery_point = 'started', status = 'processing' WHERE idempotency_key = 'old-0'`)
		if err != nil {
			t.Fatal(err)
		}
		env.clock.advance(idempotencyKeyTTL + time.Minute)
		mustCreateOrder(t, env, "user-42", "new", orderBody(100, "sku-1", 1, pmCardVisa))

		result, err := env.app.cleanupOnce(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if result.Keys != expired-1 {
			t.Fatalf("deleted %d keys, want %d", result.Keys, expired-1)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`); got != 2 {
			t.Fatalf("got %d keys left, want 2 (the live one and the unfinished one)", got)
		}
	})

	// Ensure delivered messages are deleted once older than messageRetention,
	// and nothing that is still in flight is.
	t.Run("DeletesOldDeliveredMessages", func(t *testing.T) {
		env := MustOpenApp(t)
		createAndDrain(t, env, "old", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		env.clock.advance(messageRetention + time.Minute)
		// A new order whose events are still on their way.
		mustCreateOrder(t, env, "user-42", "new", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}

		result, err := env.app.cleanupOnce(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		want := cleanupResult{Keys: 1, OutboxEvents: 2, BrokerMessages: 2, InboxMessages: 2}
		if result != want {
			t.Fatalf("deleted %+v, want %+v", result, want)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_deliveries WHERE status = 'pending'`); got != 1 {
			t.Fatalf("got %d pending deliveries, want the new order's 1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != 1 {
			t.Fatalf("got %d outbox events, want the new order's 1", got)
		}
	})
}

// Ensure cleanup keeps an inbox row, however old, while the broker still
// delivers its message to that consumer (the ack was lost, and the
// consumer has not run since): the redelivery is then skipped as the
// duplicate it is, not applied again or made poison (simulator seed 1375:
// a PaymentCaptured of a paid order, poison for good).
func TestCleanupKeepsTheInboxRowOfAPendingDelivery(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	orderID := createAndDrain(t, env, "k1", orderBody(100, "sku-1", 1, pmCardVisa))
	eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = ?`, orderID, eventPaymentCaptured)
	// The ack was lost: the delivery is pending again.
	if _, err := env.app.db.Exec(`
		UPDATE broker_deliveries SET status = 'pending', acked_at = NULL
		WHERE subscriber = ? AND message_seq = (SELECT seq FROM broker_messages WHERE message_id = ?)`,
		orderServiceConsumer, eventID); err != nil {
		t.Fatal(err)
	}
	env.clock.advance(messageRetention + time.Hour)
	if _, err := env.app.cleanupOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND message_id = ?`, orderServiceConsumer, eventID); got != 1 {
		t.Fatalf("cleanup deleted the inbox row of a message still being delivered")
	}
	env.drain(t)
	if got := env.str(t, `SELECT status FROM inbox_messages WHERE consumer = ? AND message_id = ?`, orderServiceConsumer, eventID); got != "done" {
		t.Fatalf("the redelivery made the row %s, want it skipped as a duplicate", got)
	}
	mustAuditClean(t, env, true)
}

func TestIdempotencyKeyExpiry(t *testing.T) {
	// Ensure a clock that jumps past the TTL while an order is being
	// created changes no answer: the request gets its 201 and a retry right
	// after replays it instead of making a second order.
	t.Run("ClockJumpsPastExpiryMidCreate", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultAfterKeyClaim && pass == 1 {
				env.clock.advance(idempotencyKeyTTL + time.Minute)
			}
			return nil
		})
		body := orderBody(5000, "sku-1", 1, pmCardVisa)
		first := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		retry := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		if first.Status != 201 || retry.Status != 201 || retry.Header.Get("Idempotent-Replayed") != "true" || retry.Body != first.Body {
			t.Fatalf("got %d then %d replayed=%q, want 201 then its replay", first.Status, retry.Status, retry.Header.Get("Idempotent-Replayed"))
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
		env.drain(t)
		mustAudit(t, env, true)
	})
}

func TestIdempotencyKeyLocking(t *testing.T) {
	// Ensure the same key sent at once to create an order and to refund
	// one is claimed by one of them; the other gets 422 (another request's
	// key) or 409, never a 5xx. Meaningful on PostgreSQL, where the two
	// claims run side by side.
	t.Run("SameKeyToCreateAndRefundAtOnceNever5xx", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		const orders, waves = 8, 10
		orderIDs := make([]string, orders)
		for i := range orders {
			created := mustCreateOrder(t, env, "user-42", fmt.Sprintf("order-%d", i), orderBody(5000, "sku-1", 1, pmCardVisa))
			orderIDs[i] = orderField(created.Body, "order_id")
		}
		env.drain(t)

		type pair struct{ create, refund response }
		statuses := map[int]int{}
		for wave := range waves {
			pairs := make([]pair, orders)
			errs := make([]error, 2*orders)
			start := make(chan struct{})
			var wg sync.WaitGroup
			for i := range orders {
				key := fmt.Sprintf("shared-%d-%d", wave, i)
				wg.Add(2)
				go func() {
					defer wg.Done()
					<-start
					pairs[i].create, errs[2*i] = send(ts, "POST", "/api/orders", keyUser42, key, orderBody(100, "sku-1", 1, pmCardVisa))
				}()
				go func() {
					defer wg.Done()
					<-start
					pairs[i].refund, errs[2*i+1] = send(ts, "POST", refundPath(orderIDs[i]), keyUser42, key, `{"amount_cents":1}`)
				}()
			}
			close(start)
			mustWait(t, "every create and refund of the wave to be answered", &wg)
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			for i, p := range pairs {
				won := 0
				for _, r := range []response{p.create, p.refund} {
					statuses[r.Status]++
					switch {
					case r.Status == 200 || r.Status == 201:
						won++
					case r.Status == 409 || (r.Status == 422 && problemTypeOf(t, r) == problemKeyReused):
					default:
						t.Errorf("wave %d pair %d: got %d %s, want 2xx, 409 or 422 key reused", wave, i, r.Status, r.Body)
					}
				}
				if won != 1 {
					t.Errorf("wave %d pair %d: %d of create (%d) and refund (%d) succeeded, want 1", wave, i, won, p.create.Status, p.refund.Status)
				}
			}
		}
		t.Logf("statuses of %d requests: %v", 2*orders*waves, statuses)
		env.drain(t)
		mustAudit(t, env, true)
	})

	// Ensure a key inserted twice, by a claim that bypassed keyTx, is
	// errKeyInProgress (409, retry for the answer), not a database error
	// (500).
	t.Run("DuplicateKeyInsertIsInProgressNot500", func(t *testing.T) {
		env := MustOpenApp(t)
		ctx := context.Background()
		req, _ := newOrderRequest(t, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		insert := func(tx *sql.Tx) error { return insertKey(ctx, tx, req, recoveryStarted, "", env.clock.now()) }
		if err := withTx(ctx, env.app.db, insert); err != nil {
			t.Fatal(err)
		}
		if err := withTx(ctx, env.app.db, insert); !errors.Is(err, errKeyInProgress) {
			t.Fatalf("insertKey again got %v, want errKeyInProgress", err)
		}
		err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			return insertCompletedKey(ctx, tx, req, apiResponse{Status: 201, Body: []byte(`{}`)}, env.clock.now())
		})
		if !errors.Is(err, errKeyInProgress) {
			t.Fatalf("insertCompletedKey again got %v, want errKeyInProgress", err)
		}
	})
}

// holdWriteLock takes SQLite's write lock on env's file from a connection of
// its own, as another process would, until the test ends.
func holdWriteLock(tb testing.TB, env *testEnv) {
	tb.Helper()
	other, err := openDB(context.Background(), env.path)
	if err != nil {
		tb.Fatal(err)
	}
	tx, err := other.BeginTx(context.Background(), nil) // BEGIN IMMEDIATE
	if err != nil {
		other.Close()
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		tx.Rollback()
		other.Close()
	})
}

func TestReplayFromReadConnection(t *testing.T) {
	ctx := context.Background()
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	uncommitted := apiResponse{Status: 201, Body: []byte(`{"order_id":"ord_uncommitted"}`), Location: "/api/orders/ord_uncommitted"}

	// Ensure a retry of a settled key is answered while another process
	// holds the write lock. (A replay under the write lock would wait out
	// busy_timeout, then fail.)
	t.Run("DoesNotWaitForTheWriteLock", func(t *testing.T) {
		if onPostgres() {
			t.Skip("SQLite's single writer; PostgreSQL reads never wait for writers")
		}
		env := MustOpenApp(t)
		first := mustCreateOrder(t, env, "user-42", "k1", body)
		holdWriteLock(t, env)
		retry := mustCreateOrder(t, env, "user-42", "k1", body)
		if !retry.Replayed || !bytes.Equal(retry.Body, first.Body) {
			t.Fatalf("got replayed=%v %s, want the replay of %s", retry.Replayed, retry.Body, first.Body)
		}
	})

	// Ensure a retry and a GET are answered while this process's own write
	// connection is in a transaction, as it is during every create. (On
	// the write connection they would wait for it, here for ever.)
	t.Run("DoesNotWaitForTheWriteConnection", func(t *testing.T) {
		env := MustOpenApp(t)
		first := mustCreateOrder(t, env, "user-42", "k1", body)
		tx, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		retry := mustCreateOrder(t, env, "user-42", "k1", body)
		if !retry.Replayed || !bytes.Equal(retry.Body, first.Body) {
			t.Fatalf("got replayed=%v %s, want the replay of %s", retry.Replayed, retry.Body, first.Body)
		}
		orderID := strings.TrimPrefix(first.Location, "/api/orders/")
		if _, err := env.app.orderDetails(ctx, orderID, "user-42"); err != nil {
			t.Fatalf("GET while the write connection is in a transaction: %v", err)
		}
	})

	// Ensure a response written by a transaction that has not committed
	// is never served from a read connection; once committed, it is.
	t.Run("UncommittedResponseIsNotServed", func(t *testing.T) {
		env := MustOpenApp(t)
		req, _ := newOrderRequest(t, "user-42", "k1", body)
		tx, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if err := insertCompletedKey(ctx, tx, req, uncommitted, env.clock.now()); err != nil {
			t.Fatal(err)
		}
		got, err := replaySettledKey(ctx, env.app.readDB, req, env.clock.now())
		if !errors.Is(err, errKeyNotSettled) {
			t.Fatalf("got %d %s, %v while its transaction is open; want errKeyNotSettled", got.Status, got.Body, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		got, err = replaySettledKey(ctx, env.app.readDB, req, env.clock.now())
		if err != nil || !got.Replayed || !bytes.Equal(got.Body, uncommitted.Body) {
			t.Fatalf("got %s, %v after the commit; want the committed response %s", got.Body, err, uncommitted.Body)
		}
	})

	// Ensure a response whose transaction rolled back is never served: the
	// retry finds no key and does the work.
	t.Run("RolledBackResponseIsNeverServed", func(t *testing.T) {
		env := MustOpenApp(t)
		req, order := newOrderRequest(t, "user-42", "k1", body)
		tx, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertCompletedKey(ctx, tx, req, uncommitted, env.clock.now()); err != nil {
			t.Fatal(err)
		}
		if _, err := replaySettledKey(ctx, env.app.readDB, req, env.clock.now()); !errors.Is(err, errKeyNotSettled) {
			t.Fatalf("got %v while its transaction is open, want errKeyNotSettled", err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if _, err := replaySettledKey(ctx, env.app.readDB, req, env.clock.now()); !errors.Is(err, errKeyNotSettled) {
			t.Fatalf("got %v after the rollback, want errKeyNotSettled", err)
		}
		response, err := env.app.createOrder(ctx, req, order)
		if err != nil {
			t.Fatal(err)
		}
		if response.Replayed || bytes.Equal(response.Body, uncommitted.Body) {
			t.Fatalf("got replayed=%v %s, want a new order", response.Replayed, response.Body)
		}
	})

	// Ensure a settled key is served only for the very same request.
	t.Run("AnotherRequestIsRejected", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", body)
		req, _ := newOrderRequest(t, "user-42", "k1", orderBody(9900, "sku-1", 2, pmCardVisa))
		if got, err := replaySettledKey(ctx, env.app.readDB, req, env.clock.now()); !errors.Is(err, errKeyReused) {
			t.Fatalf("got %d %s, %v; want errKeyReused", got.Status, got.Body, err)
		}
	})

	// Ensure an expired or unfinished key is left to the write path, which
	// deletes the first and reports the second in progress.
	t.Run("ExpiredOrUnfinishedKeyIsNotServed", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", body)
		req, _ := newOrderRequest(t, "user-42", "k1", body)
		env.clock.advance(idempotencyKeyTTL)
		if got, err := replaySettledKey(ctx, env.app.readDB, req, env.clock.now()); !errors.Is(err, errKeyNotSettled) {
			t.Fatalf("got %d %s, %v for an expired key; want errKeyNotSettled", got.Status, got.Body, err)
		}
		unfinished, order := newOrderRequest(t, "user-42", "k2", body)
		err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			return insertKey(ctx, tx, unfinished, recoveryStarted, "lease-1", env.clock.now())
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := replaySettledKey(ctx, env.app.readDB, unfinished, env.clock.now()); !errors.Is(err, errKeyNotSettled) {
			t.Fatalf("got %v for an unfinished key, want errKeyNotSettled", err)
		}
		if _, err := env.app.createOrder(ctx, unfinished, order); !errors.Is(err, errKeyInProgress) {
			t.Fatalf("got %v for an unfinished key, want errKeyInProgress", err)
		}
	})
}
