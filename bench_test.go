package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// benchApp returns an App on the wall clock over a new database: a SQLite
// file, or with RETRYSAFE_TEST_POSTGRES a PostgreSQL schema (see
// testDatabase). durabilityFull is SQLite's, so it skips on PostgreSQL.
func benchApp(b *testing.B, d durability) *App {
	b.Helper()
	if d != durabilityNormal && onPostgres() {
		b.Skip("--durability is SQLite's; PostgreSQL's is the server's synchronous_commit")
	}
	db, err := openDBWith(context.Background(), testDatabase(b), d)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { db.Close() })
	app := newApp(db, nil, nil, nil)
	if err := app.subscribeConsumers(context.Background()); err != nil {
		b.Fatal(err)
	}
	return app
}

// reportOpsPerSecond reports b.N per second, which reads better than ns/op
// next to the targets.
func reportOpsPerSecond(b *testing.B, unit string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), unit)
}

// benchOrder is the order every create benchmark sends.
var benchOrder = orderRequest{AmountCents: 5000, Currency: "usd", Items: []orderItem{{SKU: "sku-1", Qty: 2}}, PaymentMethod: pmCardVisa}

// benchRequest returns the idempotent request of the i-th benchmark order.
func benchRequest(prefix string, i int) idempotentRequest {
	return idempotentRequest{
		UserID:         "user-42",
		IdempotencyKey: prefix + strconv.Itoa(i),
		Method:         "POST",
		Path:           "/api/orders",
		CanonicalBody:  []byte(orderBody(5000, "sku-1", 2, pmCardVisa)),
	}
}

// createBare writes an order and its outbox event, with no idempotency: the
// ceiling for createOrder.
func createBare(ctx context.Context, app *App) error {
	return withTx(ctx, app.db, func(tx *sql.Tx) error {
		now := app.now()
		order := orderRow{OrderID: app.newID("ord"), UserID: "user-42", AmountCents: 5000, Currency: "usd",
			Items: benchOrder.Items, PaymentMethod: pmCardVisa, Status: orderCreated, CreatedAt: formatTime(now)}
		if err := insertOrder(ctx, tx, order); err != nil {
			return err
		}
		event, err := app.newOutboxEvent(eventOrderCreated, order.OrderID, orderCreatedPayload{OrderID: order.OrderID})
		if err != nil {
			return err
		}
		return insertOutboxEvent(ctx, tx, event, now)
	})
}

// createThreeTransactions is the article sample's shape: claim the key, do
// the work, store the result, each in its own transaction. (A crash between
// them leaves the key stuck; here it only serves as the baseline.)
func createThreeTransactions(ctx context.Context, app *App, req idempotentRequest) error {
	now := app.now()
	err := withTx(ctx, app.db, func(tx *sql.Tx) error {
		if _, err := lookupKey(ctx, tx, req.UserID, req.IdempotencyKey, now); err != errKeyNotFound {
			return fmt.Errorf("key exists: %v", err)
		}
		return insertKey(ctx, tx, req, recoveryStarted, "", now)
	})
	if err != nil {
		return err
	}
	if err := createBare(ctx, app); err != nil {
		return err
	}
	return withTx(ctx, app.db, func(tx *sql.Tx) error {
		return completeKey(ctx, tx, req.UserID, req.IdempotencyKey, apiResponse{Status: 201, Body: []byte(`{}`)}, app.now())
	})
}

func BenchmarkCreateOrder(b *testing.B) {
	ctx := context.Background()
	for _, d := range []durability{durabilityNormal, durabilityFull} {
		b.Run(string(d)+"/bare", func(b *testing.B) {
			app := benchApp(b, d)
			for b.Loop() {
				if err := createBare(ctx, app); err != nil {
					b.Fatal(err)
				}
			}
			reportOpsPerSecond(b, "orders/s")
		})
		b.Run(string(d)+"/atomic", func(b *testing.B) {
			app := benchApp(b, d)
			i := 0
			for b.Loop() {
				i++
				if _, err := app.createOrder(ctx, benchRequest("k", i), benchOrder); err != nil {
					b.Fatal(err)
				}
			}
			reportOpsPerSecond(b, "orders/s")
		})
		b.Run(string(d)+"/three-transactions", func(b *testing.B) {
			app := benchApp(b, d)
			i := 0
			for b.Loop() {
				i++
				if err := createThreeTransactions(ctx, app, benchRequest("k", i)); err != nil {
					b.Fatal(err)
				}
			}
			reportOpsPerSecond(b, "orders/s")
		})
	}
}

func BenchmarkReplay(b *testing.B) {
	ctx := context.Background()
	app := benchApp(b, durabilityNormal)
	req := benchRequest("k", 1)
	if _, err := app.createOrder(ctx, req, benchOrder); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		response, err := app.createOrder(ctx, req, benchOrder)
		if err != nil || !response.Replayed {
			b.Fatalf("got %v, %v; want a replay", response.Replayed, err)
		}
	}
	reportOpsPerSecond(b, "replays/s")
}

// fillOutbox writes n pending OrderCreated events, each for its own order,
// in one statement.
func fillOutbox(b *testing.B, app *App, n int) {
	b.Helper()
	now := formatTime(app.now())
	_, err := app.db.Exec(`
		WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?)
		INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at)
		SELECT 'evt_bench_' || n, 'BenchEvent', 'ord_bench_' || n, '{"n":' || n || '}', 'pending', ?, ? FROM i`,
		n, now, now)
	if err != nil {
		b.Fatal(err)
	}
}

func BenchmarkRelay(b *testing.B) {
	ctx := context.Background()
	for _, batch := range []int{1, 16, 128} {
		b.Run("batch-"+strconv.Itoa(batch), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			fillOutbox(b, app, b.N)
			b.ResetTimer()
			published := 0
			for published < b.N {
				n, err := app.relayOnce(ctx, "bench-relay", batch)
				if err != nil {
					b.Fatal(err)
				}
				if n == 0 {
					b.Fatalf("relay stopped at %d of %d", published, b.N)
				}
				published += n
			}
			reportOpsPerSecond(b, "events/s")
		})
	}
}

// fillDeliveries creates n orders whose OrderCreated messages wait for the
// payment service in the broker.
func fillDeliveries(b *testing.B, app *App, n int) {
	b.Helper()
	now := formatTime(app.now())
	statements := []string{
		`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, created_at, updated_at)
		 SELECT 'ord_bench_' || n, 'user-42', 5000, 'usd', '[{"sku":"sku-1","qty":2}]', 'pm_card_visa', 'created', ?2, ?2 FROM i`,
		`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO broker_messages (message_id, subject, payload, published_at)
		 SELECT 'evt_bench_' || n, 'OrderCreated', '{"order_id":"ord_bench_' || n || '"}', ?2 FROM i`,
		`INSERT INTO broker_deliveries (subscriber, message_seq, status, visible_at)
		 SELECT 'payment-svc', seq, 'pending', ?2 FROM broker_messages WHERE ?1 > 0`,
	}
	for _, statement := range statements {
		if _, err := app.db.Exec(statement, n, now); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkConsume(b *testing.B) {
	ctx := context.Background()
	app := benchApp(b, durabilityNormal)
	fillDeliveries(b, app, b.N)
	payments := app.consumers()[0]
	b.ResetTimer()
	consumed := 0
	for consumed < b.N {
		results, err := app.consumeOnce(ctx, payments, consumeBatchSize)
		if err != nil {
			b.Fatal(err)
		}
		if len(results) == 0 {
			b.Fatalf("consumer stopped at %d of %d", consumed, b.N)
		}
		consumed += len(results)
	}
	reportOpsPerSecond(b, "deliveries/s")
}

// servedApps numbers the Apps serveInProcess runs loops for.
var servedApps atomic.Int64

// serveInProcess serves app's API on a loopback port the way serve does
// (on SQLite, app commits concurrent creates together whatever its
// durability; see infra_groupcommit.go), with the relay and worker loops when
// workers is set, and a listener when target is a PostgreSQL database.
// Everything stops when tb ends, before app's database closes.
func serveInProcess(tb testing.TB, app *App, target string, workers bool) *httptest.Server {
	tb.Helper()
	ctx, stop := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	s := &server{app: app, apiKeys: map[string]string{keyUser42: "user-42"}, webhookSecret: []byte(testWebhookSecret),
		logger: discardLogger()}
	ts := httptest.NewServer(s.routes())
	if workers {
		// A name per App, as each process has its own (workerName).
		workerID := "serve-" + strconv.FormatInt(servedApps.Add(1), 10)
		startRelayLoop(ctx, &loops, app, workerID, discardLogger())
		startWorkerLoops(ctx, &loops, app, workerID, discardLogger())
		startListener(ctx, &loops, app, target, discardLogger())
	}
	tb.Cleanup(func() {
		ts.Close()
		stop()
		loops.Wait()
	})
	return ts
}

// benchClient is an HTTP client that keeps a connection per client open.
func benchClient(clients int) *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients, MaxConnsPerHost: clients}}
}

// postOrder sends POST /api/orders with key and returns the response's
// status and body.
func postOrder(client *http.Client, baseURL, key, body string) (int, []byte, error) {
	r, err := sendWith(client, "POST", baseURL+"/api/orders", keyUser42, key, body)
	return r.Status, []byte(r.Body), err
}

// runClients runs do b.N times in all, spread over exactly clients
// goroutines (RunParallel would round to a multiple of GOMAXPROCS). i is
// the call's number, from 1.
func runClients(b *testing.B, clients int, do func(i int) error) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1))
				if i > b.N {
					return
				}
				if err := do(i); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// runAtRate calls do(1), ..., do(b.N), each on a goroutine of its own,
// started rate times a second on schedule, however long the earlier ones
// take; it returns when all have returned.
func runAtRate(b *testing.B, rate int, do func(i int) error) {
	b.Helper()
	start := time.Now()
	var wg sync.WaitGroup
	for i := 1; i <= b.N; i++ {
		time.Sleep(time.Until(start.Add(time.Duration(i-1) * time.Second / time.Duration(rate))))
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := do(i); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
}

// BenchmarkHTTP is fresh creates over loopback HTTP from 8 and 64 clients
// at once, at each durability; full commits in groups, as serve does with
// --durability=full.
func BenchmarkHTTP(b *testing.B) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	for _, d := range []durability{durabilityNormal, durabilityFull} {
		for _, clients := range []int{8, 64} {
			b.Run(string(d)+"/clients-"+strconv.Itoa(clients), func(b *testing.B) {
				benchCreatesOverHTTP(b, benchApp(b, d), clients, "http-", body)
			})
		}
	}
}

// benchCreatesOverHTTP measures fresh creates of body, each under a new
// key starting with prefix, sent to app over loopback HTTP by clients
// clients at once, in orders per second.
func benchCreatesOverHTTP(b *testing.B, app *App, clients int, prefix, body string) {
	ts := serveInProcess(b, app, "", false)
	client := benchClient(clients)
	prefix += strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	b.ResetTimer()
	runClients(b, clients, func(i int) error {
		status, answer, err := postOrder(client, ts.URL, prefix+strconv.Itoa(i), body)
		if err != nil {
			return err
		}
		if status != http.StatusCreated {
			return fmt.Errorf("got %d %s; want 201", status, answer)
		}
		return nil
	})
	reportOpsPerSecond(b, "orders/s")
}

// BenchmarkReplayHTTP is retries of one settled key over loopback HTTP:
// every answer is the stored one.
func BenchmarkReplayHTTP(b *testing.B) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	for _, clients := range []int{1, 8} {
		b.Run("clients-"+strconv.Itoa(clients), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			ts := serveInProcess(b, app, "", false)
			client := benchClient(clients)
			status, first, err := postOrder(client, ts.URL, "replay-1", body)
			if err != nil || status != http.StatusCreated {
				b.Fatalf("first request: got %d %s, %v; want 201", status, first, err)
			}
			b.ResetTimer()
			runClients(b, clients, func(int) error {
				status, answer, err := postOrder(client, ts.URL, "replay-1", body)
				if err != nil {
					return err
				}
				if status != http.StatusCreated || string(answer) != string(first) {
					return fmt.Errorf("got %d %s; want the first answer again", status, answer)
				}
				return nil
			})
			reportOpsPerSecond(b, "replays/s")
		})
	}
}

// finalWatcher tells waiting clients when their order reached a final
// state (paid or cancelled). One goroutine polls, on a connection of its
// own, for every order waited on, so that the clients' waiting does not
// take the API's connection.
type finalWatcher struct {
	db *sql.DB
	// polls counts its queries: on PostgreSQL each is a transaction.
	polls atomic.Int64
	mu    sync.Mutex
	// waiting maps an order id to where its final time goes.
	waiting map[string]chan time.Time
}

// watchFinal starts a finalWatcher over a read-only connection to target.
// It stops when tb ends.
func watchFinal(tb testing.TB, target string) *finalWatcher {
	tb.Helper()
	db, err := openReadOnlyDB(context.Background(), target)
	if err != nil {
		tb.Fatal(err)
	}
	w := &finalWatcher{db: db, waiting: map[string]chan time.Time{}}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.run(ctx, tb)
	}()
	tb.Cleanup(func() {
		stop()
		<-done
		db.Close()
	})
	return w
}

// wait returns when orderID is final, with the time it became final (its
// updated_at, on the wall clock the App writes with).
func (w *finalWatcher) wait(orderID string) time.Time {
	final := make(chan time.Time, 1)
	w.mu.Lock()
	w.waiting[orderID] = final
	w.mu.Unlock()
	return <-final
}

// waitAll returns when every order of orderIDs is final, with the time
// each became final, in order. It counts the final orders every
// millisecond, then reads their times once: the orders must be the only
// ones of the database that become final meanwhile. (Asking after each of
// thousands of orders by id, as run does, was a query that kept
// PostgreSQL busy and slowed what it measured.)
func (w *finalWatcher) waitAll(tb testing.TB, orderIDs []string) []time.Time {
	tb.Helper()
	for {
		w.polls.Add(1)
		var final int
		if err := w.db.QueryRow(`SELECT COUNT(*) FROM orders WHERE status IN ('paid', 'cancelled')`).Scan(&final); err != nil {
			tb.Fatal(err)
		}
		if final >= len(orderIDs) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	rows, err := w.db.Query(`SELECT order_id, updated_at FROM orders WHERE status IN ('paid', 'cancelled')`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	at := map[string]time.Time{}
	for rows.Next() {
		var id, updatedAt string
		if err := rows.Scan(&id, &updatedAt); err != nil {
			tb.Fatal(err)
		}
		if at[id], err = time.Parse(timeFormat, updatedAt); err != nil {
			tb.Fatal(err)
		}
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	times := make([]time.Time, len(orderIDs))
	for i, orderID := range orderIDs {
		final, ok := at[orderID]
		if !ok {
			tb.Fatalf("order %s is not final", orderID)
		}
		times[i] = final
	}
	return times
}

// run polls every millisecond until ctx is done.
func (w *finalWatcher) run(ctx context.Context, tb testing.TB) {
	ticker := time.NewTicker(time.Millisecond)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		w.mu.Lock()
		ids := make([]any, 0, len(w.waiting))
		for id := range w.waiting {
			ids = append(ids, id)
		}
		w.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		w.polls.Add(1)
		rows, err := w.db.QueryContext(ctx, `
			SELECT order_id, updated_at FROM orders
			WHERE status IN ('paid', 'cancelled') AND order_id IN (`+placeholders(len(ids))+`)`, ids...)
		if err != nil {
			if ctx.Err() == nil {
				tb.Error(err)
			}
			return
		}
		for rows.Next() {
			var id, updatedAt string
			if err := rows.Scan(&id, &updatedAt); err != nil {
				tb.Error(err)
				break
			}
			at, err := time.Parse(timeFormat, updatedAt)
			if err != nil {
				tb.Error(err)
				break
			}
			w.mu.Lock()
			w.waiting[id] <- at
			delete(w.waiting, id)
			w.mu.Unlock()
		}
		if err := rows.Err(); err != nil && ctx.Err() == nil {
			tb.Error(err)
		}
		rows.Close()
	}
}

// percentile returns the p-th percentile (0 < p <= 100) of sorted.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// BenchmarkEndToEnd is the whole way of an order through serve: each
// client POSTs an order and waits until it is paid, then sends the next.
// It reports orders/s until every order is final, the p50 and p99 of
// POST -> paid, and what the orders cost the database: commits, rows
// written and statements per order, with where the commits go in the log
// (commitMeter). With RETRYSAFE_TEST_NATS set, the broker is NATS
// JetStream. On PostgreSQL it also runs 2 and 3 serve processes (Apps
// with pools, listeners and broker connections of their own, in this test
// process) side by side, the clients spread over their APIs: scaling out.
// rate-100 sends an order every 10 ms whatever the answers: the latency
// of POST -> paid at a steady 100 orders/s.
//
// Every order buys the same SKU, so every saga's reservation updates one
// stock row: a hot SKU, the worst case for row locks. The -skus-16 runs
// (clients-64 on both databases, and the 8-client ones on PostgreSQL)
// spread the orders over 16 SKUs, as a shop's orders are: the rest of the
// path without that one row. Beside the commits, the run reports what an
// order costs in CPU and WAL (costMeter), the capacity model's inputs.
func BenchmarkEndToEnd(b *testing.B) {
	// rate, if set, sends orders at that many a second whatever the
	// answers (an open loop, as independent shoppers arrive), instead of
	// clients that each wait for their answer before the next order.
	// accepted: each client waits only for its 201 before the next order,
	// and the run ends when every order has settled: DBOS's peer measures
	// that way (../shared/peers/dbos-pg: its clients wait for a workflow to
	// start, not to end), so its rate and ours compare like for like.
	type setup struct {
		clients, processes, skus, rate int
		accepted                       bool
	}
	setups := []setup{{clients: 1}, {clients: 8}, {clients: 64}, {rate: 100}, {clients: 64, skus: 16},
		{clients: 8, skus: 16, accepted: true}, {clients: 64, skus: 16, accepted: true}}
	if onPostgres() {
		setups = append(setups, setup{clients: 8, processes: 2}, setup{clients: 8, processes: 3},
			setup{clients: 8, skus: 16}, setup{clients: 8, processes: 2, skus: 16}, setup{clients: 8, processes: 3, skus: 16})
	}
	for _, run := range setups {
		run.processes, run.skus = max(run.processes, 1), max(run.skus, 1)
		name := "clients-" + strconv.Itoa(run.clients)
		if run.rate > 0 {
			name = "rate-" + strconv.Itoa(run.rate)
		}
		if run.accepted {
			name += "-accepted"
		}
		if run.processes > 1 {
			name += "-processes-" + strconv.Itoa(run.processes)
		}
		if run.skus > 1 {
			name += "-skus-" + strconv.Itoa(run.skus)
		}
		// bodies[i%len(bodies)] is the i-th order: sku-1 alone, or a
		// SKU of its own for each of run.skus.
		bodies := []string{orderBody(5000, "sku-1", 1, pmCardVisa)}
		if run.skus > 1 {
			bodies = nil
			for k := range run.skus {
				bodies = append(bodies, orderBody(5000, "bench-sku-"+strconv.Itoa(k), 1, pmCardVisa))
			}
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			target := testDatabase(b)
			var apps []*App
			// Every App's connections count what they commit, and where.
			ledger := newCommitLedger()
			for range run.processes {
				db, err := openCountedDB(ctx, target, ledger)
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { db.Close() })
				apps = append(apps, newApp(db, nil, nil, nil))
			}
			// One unit per order, and enough of them: an order cancelled
			// for want of stock would not be paid.
			if _, err := apps[0].db.Exec(`UPDATE stock_items SET available = available + ?, stocked = stocked + ? WHERE sku = 'sku-1'`, b.N, b.N); err != nil {
				b.Fatal(err)
			}
			if run.skus > 1 {
				for k := range run.skus {
					_, err := apps[0].db.Exec(`INSERT INTO stock_items (sku, available, stocked) VALUES (?, ?, ?)`,
						"bench-sku-"+strconv.Itoa(k), b.N, b.N)
					if err != nil {
						b.Fatal(err)
					}
				}
			}
			useBenchNATS(b, apps...)
			var servers []*httptest.Server
			for _, app := range apps {
				if err := app.subscribeConsumers(ctx); err != nil {
					b.Fatal(err)
				}
				servers = append(servers, serveInProcess(b, app, target, true))
			}
			watcher := watchFinal(b, target)
			client := benchClient(max(run.clients, 64))
			latencies := make([]time.Duration, b.N)
			meter := startCommitMeter(b, target, ledger)
			costs := startCostMeter(b, target, watcher)
			b.ResetTimer()
			send := func(do func(i int) error) { runClients(b, run.clients, do) }
			if run.rate > 0 {
				send = func(do func(i int) error) { runAtRate(b, run.rate, do) }
			}
			// Accepted orders, to wait for once all are sent (run.accepted).
			accepted := make([]struct {
				orderID string
				sent    time.Time
			}, b.N)
			send(func(i int) error {
				sent := time.Now()
				status, answer, err := postOrder(client, servers[i%len(servers)].URL, "e2e-"+strconv.Itoa(i), bodies[i%len(bodies)])
				if err != nil {
					return err
				}
				if status != http.StatusCreated {
					return fmt.Errorf("got %d %s; want 201", status, answer)
				}
				var order struct {
					OrderID string `json:"order_id"`
				}
				if err := json.Unmarshal(answer, &order); err != nil {
					return fmt.Errorf("decode %s: %w", answer, err)
				}
				if run.accepted {
					accepted[i-1].orderID, accepted[i-1].sent = order.OrderID, sent
					return nil
				}
				latencies[i-1] = watcher.wait(order.OrderID).Sub(sent)
				return nil
			})
			if run.accepted {
				orderIDs := make([]string, len(accepted))
				for i, order := range accepted {
					orderIDs[i] = order.orderID
				}
				for i, final := range watcher.waitAll(b, orderIDs) {
					latencies[i] = final.Sub(accepted[i].sent)
				}
			}
			b.StopTimer()
			// An order's events are still in flight when it settles: count
			// their delivery too, or the reconciler's marks of the last
			// seconds' events would fall outside the counts.
			waitDelivered(b, apps[0])
			costs.report(b, b.N)
			reportOpsPerSecond(b, "orders/s")
			var paid int
			if err := apps[0].db.QueryRow(`SELECT COUNT(*) FROM orders WHERE status = 'paid'`).Scan(&paid); err != nil {
				b.Fatal(err)
			}
			if paid != b.N {
				b.Fatalf("%d of %d orders paid", paid, b.N)
			}
			slices.Sort(latencies)
			b.ReportMetric(float64(percentile(latencies, 50).Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(percentile(latencies, 99).Microseconds())/1000, "p99-ms")
			meter.report(b, b.N, watcher.polls.Load())
			reportStages(b, apps[0].db)
		})
	}
}

// waitDelivered runs the reconciler's sweep on app until every event in the
// outbox is published and delivered, so that a benchmark's counts include
// the whole life of its orders' events: an order settles before the
// event that settled it reaches its consumers, and the reconciler's loop
// sweeps only every leases.deliver/10.
func waitDelivered(b *testing.B, app *App) {
	b.Helper()
	ctx := context.Background()
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := app.reconcileOnce(ctx, "bench-settle", relayBatchSize); err != nil {
			b.Fatal(err)
		}
		var inFlight int
		err := app.db.QueryRow(`SELECT COUNT(*) FROM outbox_events
			WHERE status <> 'published' OR delivery_position >= ` + deliveryCursor).Scan(&inFlight)
		if err != nil {
			b.Fatal(err)
		}
		if inFlight == 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d events still not delivered 30 s after the orders settled", inFlight)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// useBenchNATS switches apps to one fresh JetStream stream, each with a
// connection of its own, when RETRYSAFE_TEST_NATS is set. The stream is
// deleted when b ends.
func useBenchNATS(b *testing.B, apps ...*App) {
	b.Helper()
	url := os.Getenv("RETRYSAFE_TEST_NATS")
	if url == "" {
		return
	}
	stream := fmt.Sprintf("RTBENCH%d_%d", os.Getpid(), natsStreamCounter.Add(1))
	for i, app := range apps {
		broker, err := openNATSBroker(context.Background(), url, stream, app.leases.ackWait)
		if err != nil {
			b.Fatalf("NATS at %s: %v", url, err)
		}
		b.Cleanup(func() {
			if i == 0 {
				if err := broker.deleteStream(context.Background()); err != nil {
					b.Error(err)
				}
			}
			broker.close()
		})
		if err := broker.onAnnounce(app.wake.published); err != nil {
			b.Fatal(err)
		}
		app.broker = broker
	}
}

// grownApp is built once per process: an App over a database that already
// holds a million orders, keys, events and inbox rows (BenchmarkGrowth).
var grownApp struct {
	once sync.Once
	app  *App
	// remove deletes the grown database.
	remove func() error
	err    error
}

// TestMain removes the grown database, which outlives single benchmarks.
func TestMain(m *testing.M) {
	code := m.Run()
	if grownApp.app != nil {
		grownApp.app.db.Close()
	}
	if grownApp.remove != nil {
		if err := grownApp.remove(); err != nil {
			fmt.Fprintln(os.Stderr, "remove the grown database:", err)
		}
	}
	os.Exit(code)
}

// BenchmarkGrowth is CreateOrder/normal/atomic on a file that already holds
// a million orders, keys, events and inbox rows: the cost must not grow
// with the tables. RETRYSAFE_BENCH_ROWS sets a smaller size, for a quick
// run.
func BenchmarkGrowth(b *testing.B) {
	rows := benchRows(b)
	grownApp.once.Do(func() {
		var target string
		if base := os.Getenv(testPostgresEnv); base != "" {
			target, grownApp.remove, grownApp.err = createTestSchema(base)
		} else {
			var dir string
			dir, grownApp.err = os.MkdirTemp("", "retrysafe-growth-")
			target = filepath.Join(dir, "grown.db")
			grownApp.remove = func() error { return os.RemoveAll(dir) }
		}
		if grownApp.err != nil {
			return
		}
		db, err := openDB(context.Background(), target)
		if err != nil {
			grownApp.err = err
			return
		}
		now := formatTime(time.Now())
		expires := formatTime(time.Now().Add(idempotencyKeyTTL))
		// PostgreSQL wants exactly the parameters a statement uses.
		for _, fill := range []struct {
			statement string
			args      []any
		}{
			{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
			 INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, idempotency_key, created_at, updated_at)
			 SELECT 'ord_old_' || n, 'user-' || (n % 1000), 5000, 'usd', '[{"sku":"sku-1","qty":2}]', 'pm_card_visa', 'paid', 'old-' || n, ?2, ?2 FROM i`, []any{rows, now}},
			{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
			 INSERT INTO idempotency_keys (user_id, idempotency_key, request_method, request_path, request_hash, request_params, status, recovery_point, response_status, response_body, created_at, expires_at)
			 SELECT 'user-' || (n % 1000), 'old-' || n, 'POST', '/api/orders', 'hash-' || n, '{}', 'completed', 'finished', 201, ?4, ?2, ?3 FROM i`, []any{rows, now, expires, []byte(`{}`)}},
			{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
			 INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at, published_at, delivery_position)
			 SELECT 'evt_old_' || n, 'OrderCreated', 'ord_old_' || n, '{}', 'published', ?2, ?2, ?2, 0 FROM i`, []any{rows, now}},
			{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
			 INSERT INTO inbox_messages (consumer, message_id, status, delivery_count, processed_at)
			 SELECT 'payment-svc', 'evt_old_' || n, 'done', 1, ?2 FROM i`, []any{rows, now}},
		} {
			if _, err := db.Exec(fill.statement, fill.args...); err != nil {
				grownApp.err = err
				return
			}
		}
		grownApp.app = newApp(db, nil, nil, nil)
	})
	if grownApp.err != nil {
		b.Fatal(grownApp.err)
	}
	ctx := context.Background()
	prefix := "grow-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	i := 0
	for b.Loop() {
		i++
		if _, err := grownApp.app.createOrder(ctx, benchRequest(prefix, i), benchOrder); err != nil {
			b.Fatal(err)
		}
	}
	reportOpsPerSecond(b, "orders/s")
}

// BenchmarkRelays drains a backlog with one relay and with two running side
// by side, each with its own relay id, as two relay processes would. On
// SQLite the two take turns at the one write lock; on PostgreSQL their
// claims skip each other's rows and run at once.
func BenchmarkRelays(b *testing.B) {
	ctx := context.Background()
	for _, relays := range []int{1, 2} {
		b.Run(strconv.Itoa(relays), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			fillOutbox(b, app, b.N)
			b.ResetTimer()
			var published atomic.Int64
			var wg sync.WaitGroup
			for r := range relays {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						n, err := app.relayOnce(ctx, fmt.Sprintf("bench-relay-%d", r), relayBatchSize)
						if err != nil {
							b.Error(err)
							return
						}
						if n == 0 {
							return
						}
						published.Add(int64(n))
					}
				}()
			}
			wg.Wait()
			if got := published.Load(); got != int64(b.N) {
				b.Fatalf("published %d of %d", got, b.N)
			}
			reportOpsPerSecond(b, "events/s")
		})
	}
}

func BenchmarkDurable(b *testing.B) {
	ctx := context.Background()
	const clients = 64
	for _, grouped := range []bool{false, true} {
		name := "one-commit-per-request"
		if grouped {
			name = "group-commit"
		}
		b.Run(name, func(b *testing.B) {
			app := benchApp(b, durabilityFull)
			if !grouped {
				app.withoutGroupCommit()
			}
			var next atomic.Int64
			b.SetParallelism(clients / max(1, runtimeProcs()))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := app.createOrder(ctx, benchRequest("d", int(next.Add(1))), benchOrder); err != nil {
						b.Error(err)
						return
					}
				}
			})
			reportOpsPerSecond(b, "orders/s")
		})
	}
}

// BenchmarkRelayBacklog drains a million pending events and reports the
// process's peak resident memory: the relay claims a batch at a time, so a
// backlog must not be loaded whole.
//
// RETRYSAFE_BENCH_BACKLOG sets a smaller backlog, for a quick run.
func BenchmarkRelayBacklog(b *testing.B) {
	ctx := context.Background()
	backlog := 1_000_000
	if value := os.Getenv("RETRYSAFE_BENCH_BACKLOG"); value != "" {
		n, err := strconv.Atoi(value)
		if err != nil || n <= 0 {
			b.Fatalf("RETRYSAFE_BENCH_BACKLOG=%q: want a positive number", value)
		}
		backlog = n
	}
	for b.Loop() {
		b.StopTimer()
		app := benchApp(b, durabilityNormal)
		fillOutbox(b, app, backlog)
		b.StartTimer()
		drained := 0
		for {
			n, err := app.relayOnce(ctx, "bench-relay", relayBatchSize)
			if err != nil {
				b.Fatal(err)
			}
			if n == 0 {
				break
			}
			drained += n
		}
		if drained != backlog {
			b.Fatalf("drained %d of %d", drained, backlog)
		}
	}
	b.ReportMetric(float64(backlog*b.N)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(peakRSSMiB(b), "peak-RSS-MiB")
}

// peakRSSMiB reads the process's peak resident set size from /proc.
func peakRSSMiB(b *testing.B) float64 {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		b.Skipf("no /proc/self/status: %v", err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if value, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(value), "kB")))
			if err != nil {
				b.Fatal(err)
			}
			return float64(kb) / 1024
		}
	}
	b.Fatal("no VmHWM in /proc/self/status")
	return 0
}

// runtimeProcs is GOMAXPROCS, which RunParallel multiplies by its
// parallelism to get the number of goroutines.
func runtimeProcs() int {
	return runtime.GOMAXPROCS(0)
}

// discardLogger is a logger that drops everything, so request logs do not
// skew the HTTP benchmark.
func discardLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// benchRows is how many rows the benchmarks on a long history put in each
// table: a million, or RETRYSAFE_BENCH_ROWS for a quick run.
func benchRows(b *testing.B) int {
	b.Helper()
	value := os.Getenv("RETRYSAFE_BENCH_ROWS")
	if value == "" {
		return 1_000_000
	}
	n, err := strconv.Atoi(value)
	if err != nil || n <= 0 {
		b.Fatalf("RETRYSAFE_BENCH_ROWS=%q: want a positive number", value)
	}
	return n
}

// Live work that fillHistory adds beside the history, the same at every
// size: what a busy service has in flight, and what waits for an operator.
const (
	historyInFlight           = 100
	historyFailedEvents       = 20
	historyCompensationFailed = 10
)

// fillHistory gives db, a new database, what months of traffic leave
// behind: rows paid orders, each with its published OrderCreated and its
// completed saga; and
// beside them the live work, the same at every size: historyInFlight orders
// just created (OrderCreated pending, saga in progress),
// historyFailedEvents orders whose OrderCreated failed to publish, and
// historyCompensationFailed sagas waiting for an operator. The saga steps
// are left out: no gauge or benchmark here reads them, and three million
// rows would triple the time to build the file.
func fillHistory(tb testing.TB, db *sql.DB, rows int) {
	tb.Helper()
	long := formatTime(time.Now().Add(-30 * 24 * time.Hour))
	now := formatTime(time.Now())
	// PostgreSQL wants exactly the parameters a statement uses.
	for _, fill := range []struct {
		statement string
		args      []any
	}{
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, idempotency_key, created_at, updated_at)
		 SELECT 'ord_hist_' || n, 'user-' || (n % 1000), 5000, 'usd', '[{"sku":"sku-1","qty":2}]', 'pm_card_visa',
		        'paid', 'hist-' || n, ?2, ?2 FROM i`, []any{rows, long}},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at, published_at, delivery_position)
		 SELECT 'evt_hist_' || n, 'OrderCreated', 'ord_hist_' || n, '{}', 'published', ?2, ?2, ?2, 0 FROM i`, []any{rows, long}},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at)
		 SELECT 'saga_hist_' || n, 'ord_hist_' || n, 'completed', 'confirm', ?2, ?2, ?2 FROM i`, []any{rows, long}},
		// The live work: orders 'ord_live_1' ... in flight, then failed, then
		// compensation_failed.
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, idempotency_key, created_at, updated_at)
		 SELECT 'ord_live_' || n, 'user-' || (n % 1000), 5000, 'usd', '[{"sku":"sku-1","qty":2}]', 'pm_card_visa', 'created', 'live-' || n, ?2, ?2 FROM i`,
			[]any{historyInFlight + historyFailedEvents + historyCompensationFailed, now}},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, attempts, next_attempt_at, created_at, last_error, delivery_position)
		 SELECT 'evt_live_' || n, 'OrderCreated', 'ord_live_' || n, '{}',
		        CASE WHEN n <= ?2 THEN 'pending' WHEN n <= ?3 THEN 'failed' ELSE 'published' END,
		        CASE WHEN n > ?2 AND n <= ?3 THEN ?4 ELSE 1 END, ?5, ?5,
		        CASE WHEN n > ?2 AND n <= ?3 THEN 'broker unreachable' END,
		        CASE WHEN n > ?3 THEN 0 END FROM i`,
			[]any{historyInFlight + historyFailedEvents + historyCompensationFailed, historyInFlight, historyInFlight + historyFailedEvents, maxPublishAttempts, now}},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at)
		 SELECT 'saga_live_' || n, 'ord_live_' || n, CASE WHEN n > ?2 THEN 'compensation_failed' ELSE 'in_progress' END,
		        'reserve_stock', ?3, ?3, ?3 FROM i WHERE n <= ?2 OR n > ?4`,
			[]any{historyInFlight + historyFailedEvents + historyCompensationFailed, historyInFlight, now, historyInFlight + historyFailedEvents}},
		// The live sagas' steps: none run yet, or (compensation_failed)
		// the stock reserved and the charge failed.
		{`INSERT INTO saga_steps (saga_id, step_index, step_name, status)
		 SELECT s.saga_id, k.step_index, k.step_name,
		        CASE WHEN s.status = 'in_progress' THEN 'pending'
		             WHEN k.step_index = 0 THEN 'done' WHEN k.step_index = 1 THEN 'failed' ELSE 'pending' END
		 FROM saga_instances s
		 CROSS JOIN (SELECT 0 AS step_index, 'reserve_stock' AS step_name
		             UNION ALL SELECT 1, 'charge_card' UNION ALL SELECT 2, 'confirm') k
		 WHERE s.saga_id LIKE 'saga_live_%'`, nil},
	} {
		if _, err := db.Exec(fill.statement, fill.args...); err != nil {
			tb.Fatalf("fill the history: %v", err)
		}
	}
	// What the planner knows of the tables after a bulk load; autovacuum
	// would do it on PostgreSQL, a while later.
	if _, err := db.Exec(`ANALYZE`); err != nil {
		tb.Fatalf("analyze: %v", err)
	}
}

// historySizes returns the sizes of history the scaling benchmarks run at:
// a thousand, ten thousand ... up to largest (benchRows), and largest.
func historySizes(largest int) []int {
	var sizes []int
	for size := 1000; size < largest; size *= 10 {
		sizes = append(sizes, size)
	}
	return append(sizes, largest)
}

// fillPublished writes history published OrderCreated events that the
// payment service applied (its inbox rows) and the reconciler marked
// delivered, then inFlight published just now that nobody applied yet.
func fillPublished(b *testing.B, app *App, history, inFlight int) {
	b.Helper()
	now := formatTime(app.now())
	// Each statement takes only the parameters it uses: PostgreSQL refuses
	// a parameter it cannot type.
	statements := []struct {
		sql   string
		count int
	}{
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at, published_at, delivery_position)
		 SELECT 'evt_bench_' || n, 'OrderCreated', 'ord_bench_' || n, '{"n":' || n || '}', 'published', ?2, ?2, ?2, 0 FROM i`, history},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO inbox_messages (consumer, message_id, status, delivery_count, processed_at)
		 SELECT 'payment-svc', 'evt_bench_' || n, 'done', 1, ?2 FROM i`, history},
		{`WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < ?1)
		 INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at, published_at, delivery_position)
		 SELECT 'evt_flight_' || n, 'OrderCreated', 'ord_flight_' || n, '{"n":' || n || '}', 'published', ?2, ?2, ?2,
		        (SELECT position FROM delivery_cursor WHERE name = 'outbox') FROM i`, inFlight},
	}
	for _, statement := range statements {
		if _, err := app.db.Exec(statement.sql, statement.count, now); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReconcile measures one sweep of the reconciler (deliver.go) over
// a history of published and delivered events, with 100 in flight (not
// applied yet, not due): what checking delivery end to end costs per
// sweep. FirstSweep is a sweep whose cursor is back at the start of the
// history: it reads every event, and moves the cursor past them.
func BenchmarkReconcile(b *testing.B) {
	ctx := context.Background()
	for _, history := range []int{10_000, 100_000} {
		b.Run("published-"+strconv.Itoa(history), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			fillPublished(b, app, history, 100)
			b.ResetTimer()
			for range b.N {
				if n, err := app.reconcileOnce(ctx, "bench-relay", relayBatchSize); err != nil || n != 0 {
					b.Fatalf("republished %d, %v, want 0", n, err)
				}
			}
		})
		b.Run("FirstSweep-"+strconv.Itoa(history), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			fillPublished(b, app, history, 100)
			for range b.N {
				b.StopTimer()
				if _, err := app.db.Exec(`UPDATE delivery_cursor SET position = 0`); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if n, err := app.reconcileOnce(ctx, "bench-relay", relayBatchSize); err != nil || n != 0 {
					b.Fatalf("republished %d, %v, want 0", n, err)
				}
			}
		})
	}
}

// orderStages are the moments of a paid order's way, each read from the
// row that records it, in the order they happen. Every stored time comes
// from the App's clock, the wall clock in a benchmark.
var orderStages = []struct{ name, query string }{
	{"created", `o.created_at`},
	{"OrderCreated published", `(SELECT e.published_at FROM outbox_events e WHERE e.aggregate_id = o.order_id AND e.event_type = 'OrderCreated')`},
	{"saga started (payment inbox)", `(SELECT s.created_at FROM saga_instances s WHERE s.order_id = o.order_id)`},
	{"reserve_stock done", `(SELECT t.done_at FROM saga_steps t JOIN saga_instances s ON s.saga_id = t.saga_id WHERE s.order_id = o.order_id AND t.step_name = 'reserve_stock')`},
	{"charged (processor)", `(SELECT c.created_at FROM processor_charges c WHERE c.order_id = o.order_id)`},
	{"charge_card done", `(SELECT t.done_at FROM saga_steps t JOIN saga_instances s ON s.saga_id = t.saga_id WHERE s.order_id = o.order_id AND t.step_name = 'charge_card')`},
	{"confirm done", `(SELECT t.done_at FROM saga_steps t JOIN saga_instances s ON s.saga_id = t.saga_id WHERE s.order_id = o.order_id AND t.step_name = 'confirm')`},
	{"PaymentCaptured published", `(SELECT e.published_at FROM outbox_events e WHERE e.aggregate_id = o.order_id AND e.event_type = 'PaymentCaptured')`},
	{"paid (order inbox)", `o.updated_at`},
}

// reportStages logs, for the paid orders in db, the median time between
// each stage of an order's way and the one before it (orderStages): where
// the latency of an order goes.
func reportStages(b *testing.B, db *sql.DB) {
	b.Helper()
	columns := make([]string, len(orderStages))
	for i, stage := range orderStages {
		columns[i] = "COALESCE(" + stage.query + ", '')"
	}
	rows, err := db.Query(`SELECT ` + strings.Join(columns, ", ") + ` FROM orders o WHERE o.status = 'paid'`)
	if err != nil {
		b.Fatal(err)
	}
	defer rows.Close()
	gaps := make([][]time.Duration, len(orderStages))
	for rows.Next() {
		texts := make([]string, len(orderStages))
		dest := make([]any, len(texts))
		for i := range texts {
			dest[i] = &texts[i]
		}
		if err := rows.Scan(dest...); err != nil {
			b.Fatal(err)
		}
		for i := 1; i < len(texts); i++ {
			from, errFrom := time.Parse(timeFormat, texts[i-1])
			to, errTo := time.Parse(timeFormat, texts[i])
			if errFrom == nil && errTo == nil {
				gaps[i] = append(gaps[i], to.Sub(from))
			}
		}
	}
	if err := rows.Err(); err != nil {
		b.Fatal(err)
	}
	var text strings.Builder
	fmt.Fprintf(&text, "where a paid order's time goes (median ms from the stage before):\n")
	for i := 1; i < len(orderStages); i++ {
		slices.Sort(gaps[i])
		fmt.Fprintf(&text, "  %-30s %8.2f  (%d orders)\n", orderStages[i].name, float64(percentile(gaps[i], 50).Microseconds())/1000, len(gaps[i]))
	}
	b.Log(text.String())
}
