package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

func TestOutbox(t *testing.T) {
	ctx := context.Background()

	// Ensure the order and its event are written together, and a rolled back
	// order leaves no event behind.
	t.Run("EventCommitsWithTheOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		env.fault.failAt(faultAfterBusinessWrite, errors.New("rolled back"), 1)
		req, order := newOrderRequest(t, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.createOrder(ctx, req, order); err == nil {
			t.Fatal("want an error")
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events`); got != 0 {
			t.Fatalf("got %d events for an order that never was", got)
		}
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events e JOIN orders o ON o.order_id = e.aggregate_id`); got != 1 {
			t.Fatalf("got %d events for the order, want 1", got)
		}
	})

	// Ensure the relay publishes with the event id as message id and marks
	// the events published.
	t.Run("RelayPublishesAndMarks", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		published, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize)
		if err != nil || published != 1 {
			t.Fatalf("got %d, %v, want 1 published", published, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events e JOIN broker_messages m ON m.message_id = e.event_id WHERE e.status = 'published'`); got != 1 {
			t.Fatalf("got %d published events in the broker under their event id, want 1", got)
		}
		if again, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || again != 0 {
			t.Fatalf("second sweep published %d, %v, want 0", again, err)
		}
	})

	// Ensure a relay that crashes after publishing and before marking
	// publishes again after its lease, and the broker stores one message.
	t.Run("CrashAfterPublishRepublishes", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		env.fault.crashAt(faultAfterPublish)
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); !errors.Is(err, errCrash) {
			t.Fatalf("got %v, want the crash", err)
		}
		env.restart(t)
		if n, _ := env.app.relayOnce(ctx, "relay-2", relayBatchSize); n != 0 {
			t.Fatalf("relay-2 published %d events still leased to relay-1", n)
		}
		env.clock.advance(relayLease)
		if n, err := env.app.relayOnce(ctx, "relay-2", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("got %d, %v, want 1 republished", n, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_messages WHERE duplicates = 1`); got != 1 {
			t.Fatalf("got %d messages with one absorbed duplicate, want 1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_deliveries`); got != 1 {
			t.Fatalf("got %d deliveries queued, want 1", got)
		}
	})

	// Ensure two relays sweeping together never publish one event twice (the
	// sample published without claiming).
	t.Run("TwoRelaysNeverPublishTheSameEvent", func(t *testing.T) {
		env := MustOpenApp(t)
		const orders = 60
		for i := range orders {
			mustCreateOrder(t, env, "user-42", fmt.Sprintf("k%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
		}
		var wg sync.WaitGroup
		counts := make([]int, 2)
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					n, err := env.app.relayOnce(ctx, fmt.Sprintf("relay-%d", r), 8)
					if err != nil {
						t.Errorf("relay-%d: %v", r, err)
						return
					}
					if n == 0 {
						return
					}
					counts[r] += n
				}
			}()
		}
		wg.Wait()
		if counts[0]+counts[1] != orders {
			t.Fatalf("relays published %d + %d, want %d in all", counts[0], counts[1], orders)
		}
		if got := env.count(t, `SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages`); got != 0 {
			t.Fatalf("got %d duplicate publishes, want 0", got)
		}
	})

	// Ensure a failing publish is retried with backoff, then marked failed and
	// kept, never dropped.
	t.Run("FailingPublishIsRetriedThenMarkedFailed", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		env.fault.failAt(faultPublish, errors.New("broker unreachable"), maxPublishAttempts)
		for attempt := 1; attempt <= maxPublishAttempts; attempt++ {
			if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 0 {
				t.Fatalf("attempt %d: got %d, %v", attempt, n, err)
			}
			if n, _ := env.app.relayOnce(ctx, "relay-1", relayBatchSize); n != 0 {
				t.Fatalf("attempt %d: retried before its backoff", attempt)
			}
			env.clock.advance(relayBackoff(time.Second, attempt))
		}
		if got := env.str(t, `SELECT status || ':' || attempts || ':' || last_error FROM outbox_events`); got != "failed:10:broker unreachable" {
			t.Fatalf("got %s, want failed:10:broker unreachable", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM broker_messages`); got != 0 {
			t.Fatalf("got %d messages, want 0", got)
		}
	})

	// Ensure events of one order go out in the order they were written, even
	// when the first one has to be retried: the events written while it
	// waits out its backoff, due at once, wait behind it.
	t.Run("EventsOfOneOrderStayInOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		writeSteps := func(steps ...int) {
			t.Helper()
			err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
				for _, i := range steps {
					event, err := env.app.newOutboxEvent(fmt.Sprintf("Step%d", i), "ord_1", map[string]int{"i": i})
					if err != nil {
						return err
					}
					if err := insertOutboxEvent(ctx, tx, event, env.clock.now()); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		writeSteps(0)
		env.fault.failAt(faultPublish, errors.New("broker unreachable"), 1)
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		writeSteps(1, 2)
		for range 10 {
			if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
				t.Fatal(err)
			}
			env.clock.advance(relayBackoff(time.Second, 1))
		}
		rows, err := env.app.db.Query(`SELECT subject FROM broker_messages ORDER BY seq`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var got []string
		for rows.Next() {
			var subject string
			if err := rows.Scan(&subject); err != nil {
				t.Fatal(err)
			}
			got = append(got, subject)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(got) != "[Step0 Step1 Step2]" {
			t.Fatalf("published %v, want [Step0 Step1 Step2]", got)
		}
	})

	// Ensure two relays of one process take turns under its relay lease:
	// while one is between its claim and its mark, the other publishes
	// nothing. A claim writes nothing, so without the turn both read the
	// same events and publish them twice.
	t.Run("RelaysOfOneProcessTakeTurns", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		type sweep struct {
			published int
			err       error
		}
		second := make(chan sweep, 1)
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			if workerOf(ctx) == "A" && point == faultPublish {
				n, err := env.app.relayOnce(withWorker(ctx, "B"), "relay-2", relayBatchSize)
				second <- sweep{n, err}
			}
			return nil
		})
		if n, err := env.app.relayOnce(withWorker(ctx, "A"), "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("relay-1 published %d, %v; want the order's event", n, err)
		}
		if got := mustReceive(t, "relay-2's sweep", second); got.err != nil || got.published != 0 {
			t.Fatalf("relay-2 published %d, %v during relay-1's sweep; want nothing", got.published, got.err)
		}
		if got := env.count(t, `SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages`); got != 0 {
			t.Fatalf("got %d duplicate publishes, want 0", got)
		}
	})

	// Ensure a relay paused past its lease marks nothing once another
	// relay has taken the lease: its events are the new holder's to
	// publish and mark. Without the token in the mark, the stale relay's
	// write landed beside the new holder's.
	t.Run("StaleRelayMarksNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		token, events := mustClaimOneOrder(t, env, "relay-1")
		env.clock.advance(env.app.leases.relay + time.Second)
		taken, ok, err := env.app.holdRelayLease(ctx, "relay-2")
		if err != nil || !ok || taken == token {
			t.Fatalf("relay-2 got token %d (%v, %v); want a new token past relay-1's %d", taken, ok, err, token)
		}
		if n, err := env.app.markPublished(ctx, events); err != nil || n != 0 {
			t.Fatalf("relay-1 marked %d, %v; want nothing under a lease taken over", n, err)
		}
		if got := env.str(t, `SELECT status FROM outbox_events`); got != "pending" {
			t.Fatalf("event is %s, want pending for relay-2", got)
		}
	})

	// Ensure a relay paused past its lease cannot fail an event that a
	// relay under the same name (a restarted process) claimed since and is
	// publishing. Relay A's publish fails after the pause, on the event's
	// last allowed attempt; meanwhile B has published it and not yet marked
	// it. Without the claim's token in A's update, A marked the published
	// event failed, B's mark then matched nothing, and the event stayed
	// failed, holding back every later event of its order.
	t.Run("StaleRelayCannotFailAnEventAnotherPublished", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if _, err := env.app.db.Exec(`UPDATE outbox_events SET attempts = ?`, maxPublishAttempts-1); err != nil {
			t.Fatal(err)
		}
		bPublished, resumeB, bDone := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		// A test that fails while B is held still lets B go.
		releaseB := sync.OnceFunc(func() { close(resumeB) })
		t.Cleanup(releaseB)
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			switch {
			case workerOf(ctx) == "A" && point == faultPublish:
				env.clock.advance(env.app.leases.relay + time.Second)
				go func() {
					_, err := env.app.relayOnce(withWorker(ctx, "B"), "relay", relayBatchSize)
					bDone <- err
				}()
				mustReceive(t, "relay B to take the event over and publish it", bPublished)
				return errors.New("broker connection reset")
			case workerOf(ctx) == "B" && point == faultAfterPublish:
				close(bPublished)
				_, err := await("the test to let relay B mark the event", resumeB)
				return err
			}
			return nil
		})
		if _, err := env.app.relayOnce(withWorker(ctx, "A"), "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		releaseB()
		if err := mustReceive(t, "relay B to finish", bDone); err != nil {
			t.Fatal(err)
		}
		if got := env.str(t, `SELECT status || ':' || attempts FROM outbox_events`); got != "published:9" {
			t.Fatalf("event is %s, want published:9", got)
		}
	})
}

// mustClaimOneOrder creates an order, takes the relay lease for relayID and
// claims the order's event under it; it returns the lease's token and the
// claimed events.
func mustClaimOneOrder(tb testing.TB, env *testEnv, relayID string) (int64, []outboxEvent) {
	tb.Helper()
	ctx := context.Background()
	mustCreateOrder(tb, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
	token, ok, err := env.app.holdRelayLease(ctx, relayID)
	if err != nil || !ok {
		tb.Fatalf("got %v, %v; want the lease", ok, err)
	}
	events, err := env.app.claimOutboxEvents(ctx, token, relayBatchSize)
	if err != nil || len(events) != 1 {
		tb.Fatalf("claimed %d, %v; want the order's event", len(events), err)
	}
	return token, events
}

// insertEvent writes one outbox event for aggregateID in tx.
func insertEvent(tb testing.TB, env *testEnv, tx *sql.Tx, eventType, aggregateID string) {
	tb.Helper()
	event, err := env.app.newOutboxEvent(eventType, aggregateID, map[string]string{"order_id": aggregateID})
	if err != nil {
		tb.Fatal(err)
	}
	if err := insertOutboxEvent(context.Background(), tx, event, env.clock.now()); err != nil {
		tb.Fatal(err)
	}
}

// On PostgreSQL transactions commit side by side, which SQLite's one writer
// never does; these are the relay's traps there.
func TestOutboxConcurrentWriters(t *testing.T) {
	if !onPostgres() {
		t.Skipf("PostgreSQL only: set %s to a database URL (SQLite has one writer, so nothing commits out of order)", testPostgresEnv)
	}
	ctx := context.Background()

	// Ensure an event that commits after one with a higher seq is still
	// published: the relay claims by status, it does not read on from the
	// last seq it saw.
	t.Run("LateCommitIsNotSkipped", func(t *testing.T) {
		env := MustOpenApp(t)
		slow, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer slow.Rollback()
		insertEvent(t, env, slow, "Slow", "ord_slow") // takes the lower seq
		err = withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			insertEvent(t, env, tx, "Fast", "ord_fast")
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("published %d, %v, want the committed event", n, err)
		}
		if err := slow.Commit(); err != nil {
			t.Fatal(err)
		}
		if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
			t.Fatalf("published %d, %v after the late commit, want the event with the lower seq", n, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'published'`); got != 2 {
			t.Fatalf("%d events published, want 2", got)
		}
	})

	// Ensure a relay's mark that runs while another relay's takeover of
	// the relay lease is committing waits for the takeover and marks
	// nothing. Without FOR SHARE on the lease in the mark, its statement
	// read the lease as it was when the statement began, found its token,
	// and marked events the new holder was publishing.
	t.Run("MarkBesideACommittingTakeoverMarksNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		_, events := mustClaimOneOrder(t, env, "relay-1")
		takeover, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer takeover.Rollback()
		if _, err := takeover.Exec(`UPDATE relay_leases SET lease_token = lease_token + 1, holder = 'relay-2'`); err != nil {
			t.Fatal(err)
		}
		marked := make(chan error, 1)
		go func() {
			n, err := env.app.markPublished(ctx, events)
			if err == nil && n != 0 {
				err = fmt.Errorf("marked %d events under a lease taken over", n)
			}
			marked <- err
		}()
		waitOnLock(t, env, "UPDATE outbox_events", marked, "the mark did not wait for the takeover")
		if err := takeover.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := mustReceive(t, "the mark to end", marked); err != nil {
			t.Fatal(err)
		}
		if got := env.str(t, `SELECT status FROM outbox_events`); got != "pending" {
			t.Fatalf("event is %s, want pending for the lease's new holder", got)
		}
	})
}
