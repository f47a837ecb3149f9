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
	// when the first one has to be retried.
	t.Run("EventsOfOneOrderStayInOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			for i := range 3 {
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
		env.fault.failAt(faultPublish, errors.New("broker unreachable"), 1)
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

// claimedTypes claims what relayID may publish now and returns the event
// types, releasing the claim again.
func claimedTypes(tb testing.TB, env *testEnv, relayID string) []string {
	tb.Helper()
	// A claim that waits for the other relay's lock instead of skipping
	// the row fails here rather than hanging the test.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	events, err := env.app.claimOutboxEvents(ctx, relayID, relayBatchSize)
	if err != nil {
		tb.Fatal(err)
	}
	var types []string
	for _, event := range events {
		types = append(types, event.EventType)
	}
	if _, err := env.app.db.Exec(`UPDATE outbox_events SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = ?`, relayID); err != nil {
		tb.Fatal(err)
	}
	return types
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

	// Ensure a relay skips the rows another relay is claiming right now,
	// and does not take the next event of that order instead: it would go
	// out before the first.
	t.Run("ClaimInFlightHoldsItsOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			insertEvent(t, env, tx, "First", "ord_1")
			insertEvent(t, env, tx, "Second", "ord_1")
			insertEvent(t, env, tx, "Other", "ord_2")
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		// Another relay is between its claim's lock and its commit.
		other, err := env.app.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Rollback()
		if _, err := other.Exec(`SELECT seq FROM outbox_events WHERE event_type = 'First' FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(claimedTypes(t, env, "relay-1")); got != "[Other]" {
			t.Fatalf("claimed %s while First is locked, want [Other]", got)
		}
		if err := other.Rollback(); err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(claimedTypes(t, env, "relay-1")); got != "[First Other]" {
			t.Fatalf("claimed %s, want [First Other]", got)
		}
	})
}
