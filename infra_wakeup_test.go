package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"
)

// wakeDeadline is how long a test waits for an order to be paid. Far
// longer than a wake-up takes, far shorter than the idle hour the loops
// sleep in these tests: an order paid within it was moved on by wake-ups.
const wakeDeadline = 60 * time.Second

// openIdleApp opens an App on the wall clock over target whose loops,
// once started, sleep for an hour whenever a pass finds nothing: only a
// wake-up can move an order on.
func openIdleApp(tb testing.TB, target string) *App {
	tb.Helper()
	app, err := openApp(context.Background(), target, nil, nil, nil)
	if err != nil {
		tb.Fatalf("open app: %v", err)
	}
	tb.Cleanup(func() { app.db.Close() })
	app.idle = idleTimes{relay: time.Hour, worker: time.Hour}
	return app
}

// createPaidOrder POSTs a new order with key to ts and waits until watcher
// sees it final; it fails the test unless the order is paid within
// wakeDeadline.
func createPaidOrder(tb testing.TB, client *http.Client, ts string, watcher *finalWatcher, key string) {
	tb.Helper()
	status, answer, err := postOrder(client, ts, key, orderBody(5000, "sku-1", 1, pmCardVisa))
	if err != nil || status != http.StatusCreated {
		tb.Fatalf("POST %s: got %d %s, %v; want 201", key, status, answer, err)
	}
	var order struct {
		OrderID string `json:"order_id"`
	}
	if err := json.Unmarshal(answer, &order); err != nil {
		tb.Fatalf("decode %s: %v", answer, err)
	}
	final := make(chan struct{})
	go func() {
		watcher.wait(order.OrderID)
		close(final)
	}()
	select {
	case <-final:
	case <-time.After(wakeDeadline):
		tb.Fatalf("order %s (key %s) not final after %s, with every loop idle for an hour: no wake-up moved it on", order.OrderID, key, wakeDeadline)
	}
	orderStatus, httpStatus, err := getOrderStatus(client, ts, order.OrderID)
	if err != nil || orderStatus != string(orderPaid) {
		tb.Fatalf("order %s: got %q (%s), %v; want paid", order.OrderID, orderStatus, httpStatus, err)
	}
}

// getOrderStatus returns an order's status through the API.
func getOrderStatus(client *http.Client, ts, orderID string) (string, string, error) {
	req, err := http.NewRequest("GET", ts+"/api/orders/"+orderID, nil)
	if err != nil {
		return "", "", err
	}
	req.Header.Set("Authorization", "Bearer "+keyUser42)
	resp, err := client.Do(req)
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	var view struct {
		Status string `json:"status"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&view); err != nil {
		return "", "", fmt.Errorf("decode order: %w", err)
	}
	return view.Status, resp.Status, nil
}

func TestWakeup(t *testing.T) {
	// Ensure a signal sent while nobody waits is kept, once, and never
	// blocks the committing caller.
	t.Run("SignalsCollapseAndNeverBlock", func(t *testing.T) {
		w := newWakeup()
		for range 3 {
			w.signal()
		}
		select {
		case <-w.signaled():
		default:
			t.Fatal("got no pending signal; want one")
		}
		select {
		case <-w.signaled():
			t.Fatal("got a second pending signal; want the three to collapse into one")
		default:
		}
		var none *wakeup
		if none.signaled() != nil {
			t.Fatal("a loop without a wakeup got a channel; want nil, never ready")
		}
	})

	// Ensure an order created through the API is paid while every loop of
	// its serve sleeps an hour when idle: each commit wakes the next loop.
	t.Run("OrderIsPaidWithoutPolling", func(t *testing.T) {
		target := testDatabase(t)
		app := openIdleApp(t, target)
		ts := serveInProcess(t, app, target, true)
		watcher := watchFinal(t, target)
		client := benchClient(1)
		for i := range 3 {
			createPaidOrder(t, client, ts.URL, watcher, "wake-"+strconv.Itoa(i))
		}
	})

	// Ensure a burst of concurrent orders, whose signals collapse while the
	// loops are busy, is paid in full: a loop woken once runs until a pass
	// finds nothing, so no order waits for the idle hour.
	t.Run("BurstIsPaidInFull", func(t *testing.T) {
		target := testDatabase(t)
		app := openIdleApp(t, target)
		ts := serveInProcess(t, app, target, true)
		watcher := watchFinal(t, target)
		const clients, perClient = 8, 5
		client := benchClient(clients)
		var wg sync.WaitGroup
		for c := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perClient {
					createPaidOrder(t, client, ts.URL, watcher, fmt.Sprintf("burst-%d-%d", c, i))
				}
			}()
		}
		wg.Wait()
	})

	// Ensure on PostgreSQL that an order created by one process is paid by
	// another process's loops, idle for an hour: the create's commit
	// notifies (schema_postgres.sql, version 3) and the other process's
	// listener wakes its relay.
	t.Run("PostgresNotifyWakesAnotherProcess", func(t *testing.T) {
		_, apiServer, watcher, client := twoIdleProcesses(t)
		// The first order may be found by the worker process's first passes;
		// the second can only be found through a notification.
		createPaidOrder(t, client, apiServer.URL, watcher, "notify-1")
		createPaidOrder(t, client, apiServer.URL, watcher, "notify-2")
	})

	// Ensure on PostgreSQL that a commit that writes to the outbox wakes
	// the relay once: by its notification, which reaches this process's
	// listener too, not by a signal of its own as well (a second pass of
	// the relay, whose claim found nothing).
	t.Run("PostgresCommitWakesTheRelayOnce", func(t *testing.T) {
		if !onPostgres() {
			t.Skip("set " + testPostgresEnv + " to run the PostgreSQL tests")
		}
		target := testDatabase(t)
		app := openIdleApp(t, target)
		ts := serveInProcess(t, app, target, true)
		for deadline := time.Now().Add(wakeDeadline); !app.wake.outboxNotified.Load(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the listener never listened")
			}
		}
		before := app.wake.relay.count()
		createPaidOrder(t, benchClient(1), ts.URL, watchFinal(t, target), "once-1")
		// A notification comes a moment after its commit.
		time.Sleep(100 * time.Millisecond)
		// OrderCreated and PaymentCaptured.
		if got := app.wake.relay.count() - before; got != 2 {
			t.Fatalf("the relay was signalled %d times for an order's 2 events; want 2", got)
		}
	})

	// Ensure on PostgreSQL that a listener whose connection was cut
	// connects again: the next order is still paid by the other process,
	// idle for an hour.
	t.Run("PostgresListenerReconnects", func(t *testing.T) {
		api, apiServer, watcher, client := twoIdleProcesses(t)
		createPaidOrder(t, client, apiServer.URL, watcher, "reconnect-1")
		// (Every listener of this database: only these tests run one.)
		var cut int
		err := api.db.QueryRow(`
			SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = ? AND datname = current_database()`, listenerName).Scan(&cut)
		if err != nil || cut == 0 {
			t.Fatalf("cut the listener: got %d connections, %v; want at least 1", cut, err)
		}
		createPaidOrder(t, client, apiServer.URL, watcher, "reconnect-2")
	})

	// Ensure with NATS JetStream (and PostgreSQL, so that the relay is woken
	// across processes too) that an order is paid when the relay runs in one
	// process and the consumers in another, all loops idle for an hour: the
	// relay announces each stored batch, and the other process's consumers
	// wake.
	t.Run("NATSAnnouncementWakesAnotherProcess", func(t *testing.T) {
		natsURL := os.Getenv("RETRYSAFE_TEST_NATS")
		if !onPostgres() || natsURL == "" {
			t.Skip("set " + testPostgresEnv + " and RETRYSAFE_TEST_NATS to run this test")
		}
		target := testDatabase(t)
		stream := fmt.Sprintf("RTTEST%d_%d", os.Getpid(), natsStreamCounter.Add(1))
		relayProcess := openIdleApp(t, target)
		workerProcess := openIdleApp(t, target)
		for _, app := range []*App{relayProcess, workerProcess} {
			broker, err := openNATSBroker(context.Background(), natsURL, stream, app.leases.ackWait)
			if err != nil {
				t.Fatalf("NATS at %s: %v", natsURL, err)
			}
			t.Cleanup(broker.close)
			if err := broker.onAnnounce(app.wake.published); err != nil {
				t.Fatal(err)
			}
			app.broker = broker
			if err := app.subscribeConsumers(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		t.Cleanup(func() {
			if err := relayProcess.broker.(*natsBroker).deleteStream(context.Background()); err != nil {
				t.Error(err)
			}
		})
		apiServer := serveInProcess(t, relayProcess, target, false)
		ctx, stop := context.WithCancel(context.Background())
		var loops sync.WaitGroup
		startRelayLoop(ctx, &loops, relayProcess, "relay", discardLogger())
		startListener(ctx, &loops, relayProcess, target, discardLogger())
		startWorkerLoops(ctx, &loops, workerProcess, "worker", discardLogger())
		startListener(ctx, &loops, workerProcess, target, discardLogger())
		t.Cleanup(func() {
			stop()
			loops.Wait()
		})
		watcher := watchFinal(t, target)
		client := benchClient(1)
		createPaidOrder(t, client, apiServer.URL, watcher, "nats-1")
		createPaidOrder(t, client, apiServer.URL, watcher, "nats-2")
	})
}

// twoIdleProcesses starts, on a new PostgreSQL database, one App that
// serves the API without loops and another that runs the loops, both idle
// for an hour unless woken; it returns the API's App and server, a watcher
// for final orders and a client. It skips without PostgreSQL.
func twoIdleProcesses(t *testing.T) (*App, *httptest.Server, *finalWatcher, *http.Client) {
	t.Helper()
	if !onPostgres() {
		t.Skip("set " + testPostgresEnv + " to run the PostgreSQL tests")
	}
	target := testDatabase(t)
	api := openIdleApp(t, target)
	workers := openIdleApp(t, target)
	apiServer := serveInProcess(t, api, target, false)
	serveInProcess(t, workers, target, true)
	return api, apiServer, watchFinal(t, target), benchClient(1)
}

// Ensure a loop that found less than a full batch waits for the next
// signal instead of looking again at once (a look that would find
// nothing), and that one that found a full batch looks again at once.
func TestLoopAfterAShortBatch(t *testing.T) {
	for _, tc := range []struct {
		name  string
		found int
		// again: the second pass runs without a signal.
		again bool
	}{
		{"ShortBatchWaitsForASignal", 1, false},
		{"FullBatchLooksAgainAtOnce", 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, stop := context.WithCancel(context.Background())
			var loops sync.WaitGroup
			t.Cleanup(func() {
				stop()
				loops.Wait()
			})
			wake := newWakeup()
			var mu sync.Mutex
			signalled := false
			passes := make(chan bool, 2) // whether the signal had been sent
			startLoop(ctx, &loops, discardLogger(), "test", time.Hour, wake, 2, func(context.Context) (int, error) {
				mu.Lock()
				sent := signalled
				mu.Unlock()
				select {
				case passes <- sent:
				default:
				}
				return tc.found, nil
			})
			<-passes
			if tc.again {
				if sent := <-passes; sent {
					t.Fatal("the second pass ran after the signal; want it at once, with no signal")
				}
				return
			}
			mu.Lock()
			signalled = true
			mu.Unlock()
			wake.signal()
			if sent := <-passes; !sent {
				t.Fatal("the second pass ran before the signal; want the loop to wait for it")
			}
		})
	}
}

// Ensure a loop drops a signal sent before a pass began (the pass's look
// found the work it announced) and keeps one sent during the pass (its
// look may have come before that work was committed).
func TestLoopDropsASignalItsPassSaw(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	t.Cleanup(func() {
		stop()
		loops.Wait()
	})
	wake := newWakeup()
	// The first pass is held until the test lets it end: a signal sent
	// before it began, and one sent during the second.
	wake.signal()
	release := make(chan struct{})
	passes := make(chan int, 4)
	pass := 0
	startLoop(ctx, &loops, discardLogger(), "test", time.Hour, wake, 0, func(ctx context.Context) (int, error) {
		pass++
		passes <- pass
		if pass == 2 {
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return 0, nil
	})
	if got := <-passes; got != 1 {
		t.Fatalf("pass %d first", got)
	}
	// Pass 1 began after the first signal: it saw that work, and the loop
	// waits. A second pass now would be the dropped signal's.
	select {
	case got := <-passes:
		t.Fatalf("pass %d ran for a signal the first pass saw", got)
	case <-time.After(100 * time.Millisecond):
	}
	wake.signal()
	if got := <-passes; got != 2 {
		t.Fatalf("pass %d after a new signal; want 2", got)
	}
	wake.signal() // during pass 2
	close(release)
	select {
	case got := <-passes:
		if got != 3 {
			t.Fatalf("pass %d; want 3", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the signal sent during pass 2 was dropped")
	}
}

// TestLoopKeepsASignalItsLookMayHaveMissed: a consumer loop on NATS, whose
// fetch (FetchNoWait) may come a moment before the message it was told
// of, looks again after a pass that found nothing, instead of dropping
// the signal and idling (an order stuck in CI, "not final after 1m0s,
// with every loop idle for an hour").
func TestLoopKeepsASignalItsLookMayHaveMissed(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	t.Cleanup(func() {
		stop()
		loops.Wait()
	})
	wake := newWakeup()
	wake.keepSeen.Store(true)
	wake.signal()
	passes := make(chan int, 4)
	pass := 0
	startLoop(ctx, &loops, discardLogger(), "test", time.Hour, wake, 0, func(ctx context.Context) (int, error) {
		// Each look finds nothing: the first comes before the message,
		// the second finds it gone to another consumer.
		pass++
		select {
		case passes <- pass:
		case <-ctx.Done():
		}
		return 0, nil
	})
	for want := 1; want <= 2; want++ {
		select {
		case got := <-passes:
			if got != want {
				t.Fatalf("pass %d; want %d", got, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no pass %d: the signal was dropped after an empty look", want)
		}
	}
}
