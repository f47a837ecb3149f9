package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape gets url (a /metrics endpoint) and parses it with Prometheus's
// own text parser.
func scrape(tb testing.TB, url string) map[string]*dto.MetricFamily {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		tb.Fatalf("scrape %s: %d %s", url, resp.StatusCode, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		tb.Fatalf("parse %s: %v", url, err)
	}
	return families
}

// sample returns the value of the series of family name whose labels
// include labels: a counter's or gauge's value, a histogram's count. ok is
// false if there is no such series.
func sample(families map[string]*dto.MetricFamily, name string, labels ...string) (value float64, ok bool) {
	family := families[name]
	if family == nil {
		return 0, false
	}
	for _, metric := range family.GetMetric() {
		if !hasLabels(metric, labels) {
			continue
		}
		switch family.GetType() {
		case dto.MetricType_COUNTER:
			return metric.GetCounter().GetValue(), true
		case dto.MetricType_GAUGE:
			return metric.GetGauge().GetValue(), true
		case dto.MetricType_HISTOGRAM:
			return float64(metric.GetHistogram().GetSampleCount()), true
		}
	}
	return 0, false
}

// hasLabels reports whether metric has every name, value pair of labels.
func hasLabels(metric *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, pair := range metric.GetLabel() {
			if pair.GetName() == labels[i] && pair.GetValue() == labels[i+1] {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// histogramSum returns the sum of the observations of family name's series
// with labels.
func histogramSum(families map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	for _, metric := range families[name].GetMetric() {
		if hasLabels(metric, labels) {
			return metric.GetHistogram().GetSampleSum()
		}
	}
	return 0
}

// metricCheck is one number from a scrape next to what the database says
// it must be.
type metricCheck struct {
	name   string
	labels []string
	want   float64
}

// checkMetrics fails tb for every check whose scraped value is not want.
func checkMetrics(tb testing.TB, families map[string]*dto.MetricFamily, checks []metricCheck) {
	tb.Helper()
	for _, check := range checks {
		got, ok := sample(families, check.name, check.labels...)
		if !ok {
			tb.Errorf("%s%v: no such series", check.name, check.labels)
			continue
		}
		if got != check.want {
			tb.Errorf("%s%v = %v, want %v (from the database)", check.name, check.labels, got, check.want)
		}
	}
}

// failPublishes makes the relay's next publishes fail times times in a
// row, moving the clock past each backoff, so that the events it claims
// are retried and, at maxPublishAttempts, marked failed.
func failPublishes(tb testing.TB, env *testEnv, times int) {
	tb.Helper()
	env.fault.failAt(faultPublish, errors.New("broker unreachable"), times)
	for range times {
		if _, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil {
			tb.Fatalf("relay: %v", err)
		}
		env.clock.advance(10 * time.Minute)
	}
}

func TestMetrics(t *testing.T) {
	// Ensure every number /metrics serves after a real flow (a failed
	// event, publish retries, a redelivery, a poison message, a declined
	// card's compensation, a processor timeout answered from its key, a
	// refund, a replayed POST) is what the database holds.
	t.Run("MatchTheDatabase", func(t *testing.T) {
		env := MustOpenApp(t)
		env.app.enableMetrics()
		ts := newTestServer(t, env)
		ctx := context.Background()
		// Nothing pending yet: no oldest event, an age of 0.
		checkMetrics(t, gather(t, env.app.metrics), []metricCheck{
			{"retrysafe_outbox_pending_events", nil, 0},
			{"retrysafe_outbox_oldest_pending_age_seconds", nil, 0},
		})
		post := func(key, paymentMethod string) response {
			t.Helper()
			// A second apart, so that the oldest pending event is not
			// also the newest.
			env.clock.advance(time.Second)
			created := call(t, ts, "POST", "/api/orders", keyUser42, key, orderBody(5000, "sku-1", 1, paymentMethod))
			if created.Status != 201 {
				t.Fatalf("create %s: %d %s", key, created.Status, created.Body)
			}
			return created
		}

		// An order whose OrderCreated fails every publish attempt: marked
		// failed after maxPublishAttempts.
		post("m-failed", pmCardVisa)
		failPublishes(t, env, maxPublishAttempts)
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'failed'`); got != 1 {
			t.Fatalf("%d failed events, want 1", got)
		}

		created := post("m-paid", pmCardVisa)
		paidID := orderField([]byte(created.Body), "order_id")
		post("m-declined", pmCardDeclined)
		post("m-timeout", pmCardTimeout)
		replay := call(t, ts, "POST", "/api/orders", keyUser42, "m-paid", orderBody(5000, "sku-1", 1, pmCardVisa))
		if replay.Header.Get("Idempotent-Replayed") != "true" || replay.Body != created.Body {
			t.Fatalf("the retry was not replayed: %d %q", replay.Status, replay.Header.Get("Idempotent-Replayed"))
		}
		// An OrderCreated for an order that does not exist: poison for the
		// payment service.
		err := withTx(ctx, env.app.db, func(tx *sql.Tx) error {
			event, err := env.app.newOutboxEvent(eventOrderCreated, "ord_missing", orderCreatedPayload{OrderID: "ord_missing"})
			if err != nil {
				return err
			}
			return insertOutboxEvent(ctx, tx, event, env.clock.now())
		})
		if err != nil {
			t.Fatal(err)
		}

		// The backlog, and its oldest event's age, before the relay runs.
		env.clock.advance(90 * time.Second)
		families := gather(t, env.app.metrics)
		oldest, err := time.Parse(timeFormat, env.str(t, `SELECT MIN(created_at) FROM outbox_events WHERE status = 'pending'`))
		if err != nil {
			t.Fatal(err)
		}
		checkMetrics(t, families, []metricCheck{
			{"retrysafe_outbox_pending_events", nil, float64(env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`))},
			{"retrysafe_outbox_oldest_pending_age_seconds", nil, env.clock.now().Sub(oldest).Seconds()},
			{"retrysafe_outbox_failed_events", nil, 1},
		})
		if got, _ := sample(families, "retrysafe_outbox_pending_events"); got != 4 {
			t.Errorf("pending events %v, want the 3 orders' and the stray event", got)
		}

		// One failed publish of the batch, then one pass of the payment
		// service whose acks are lost: the broker delivers again.
		failPublishes(t, env, 1)
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payment := env.app.consumers()[0]
		env.fault.failAt(faultAfterEffect, errors.New("connection to the broker lost"), 1)
		if _, err := env.app.consumeOnce(ctx, payment, consumeBatchSize); err == nil {
			t.Fatal("the lost ack was not reported")
		}
		env.clock.advance(env.app.leases.ackWait)
		env.drain(t)

		refund := call(t, ts, "POST", refundPath(paidID), keyUser42, "m-refund", `{"amount_cents":1000}`)
		if refund.Status != 200 {
			t.Fatalf("refund: %d %s", refund.Status, refund.Body)
		}
		if missing := call(t, ts, "GET", "/api/orders/ord_nope", keyUser42, "", ""); missing.Status != 404 {
			t.Fatalf("GET of a missing order: %d", missing.Status)
		}

		families = gather(t, env.app.metrics)
		checks := []metricCheck{
			{"retrysafe_outbox_pending_events", nil, float64(env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`))},
			{"retrysafe_outbox_oldest_pending_age_seconds", nil, 0},
			{"retrysafe_outbox_failed_events", nil, float64(env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'failed'`))},
			{"retrysafe_outbox_publishes_total", nil, float64(env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'published'`))},
			// Every attempt but the one that marked an event failed.
			{"retrysafe_outbox_publish_retries_total", nil, float64(env.count(t, `
				SELECT SUM(CASE WHEN status = 'failed' THEN attempts - 1 ELSE attempts END) FROM outbox_events`))},
			{"retrysafe_saga_compensations_total", []string{"step", stepReserveStock}, float64(env.count(t, `
				SELECT COUNT(*) FROM saga_steps WHERE status = 'compensated' AND step_name = ?`, stepReserveStock))},
			{"retrysafe_processor_calls_total", []string{"operation", processorCharge}, float64(env.count(t, `
				SELECT COUNT(*) + SUM(key_hits) FROM processor_charges`))},
			{"retrysafe_processor_key_hits_total", []string{"operation", processorCharge}, float64(env.count(t, `
				SELECT SUM(key_hits) FROM processor_charges`))},
			{"retrysafe_processor_calls_total", []string{"operation", processorRefund}, float64(env.count(t, `
				SELECT COUNT(*) + SUM(key_hits) FROM processor_refunds`))},
			{"retrysafe_idempotent_replays_total", []string{"route", "POST /api/orders"}, 1},
			// 4 creates and the replay; the route, never the raw path.
			{"retrysafe_http_request_duration_seconds", []string{"route", "POST /api/orders", "status_class", "2xx"}, 5},
			{"retrysafe_http_request_duration_seconds", []string{"route", "POST /api/orders/{id}/refund", "status_class", "2xx"}, 1},
			{"retrysafe_http_request_duration_seconds", []string{"route", "GET /api/orders/{id}", "status_class", "4xx"}, 1},
			{"retrysafe_order_completion_seconds", []string{"status", "paid"}, float64(env.count(t, `
				SELECT COUNT(*) FROM orders WHERE status = 'paid'`))},
			{"retrysafe_order_completion_seconds", []string{"status", "cancelled"}, float64(env.count(t, `
				SELECT COUNT(*) FROM orders WHERE status = 'cancelled'`))},
		}
		for _, state := range []sagaStatus{sagaInProgress, sagaCompensating, sagaCompensationFailed} {
			checks = append(checks, metricCheck{"retrysafe_sagas", []string{"state", string(state)},
				float64(env.count(t, `SELECT COUNT(*) FROM saga_instances WHERE status = ?`, state))})
		}
		// This App ended every saga there is.
		for _, state := range []sagaStatus{sagaCompleted, sagaCompensated} {
			checks = append(checks, metricCheck{"retrysafe_sagas_ended_total", []string{"state", string(state)},
				float64(env.count(t, `SELECT COUNT(*) FROM saga_instances WHERE status = ?`, state))})
		}
		for _, c := range env.app.consumers() {
			checks = append(checks,
				metricCheck{"retrysafe_broker_deliveries_total", []string{"consumer", c.name}, float64(env.count(t, `
					SELECT SUM(delivery_count) FROM broker_deliveries WHERE subscriber = ?`, c.name))},
				metricCheck{"retrysafe_broker_redeliveries_total", []string{"consumer", c.name}, float64(env.count(t, `
					SELECT SUM(delivery_count - 1) FROM broker_deliveries WHERE subscriber = ?`, c.name))},
				metricCheck{"retrysafe_inbox_messages_total", []string{"consumer", c.name, "outcome", "applied"}, float64(env.count(t, `
					SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND status = 'done'`, c.name))},
				metricCheck{"retrysafe_inbox_messages_total", []string{"consumer", c.name, "outcome", "duplicate"}, float64(env.count(t, `
					SELECT SUM(duplicates) FROM inbox_messages WHERE consumer = ?`, c.name))},
				metricCheck{"retrysafe_inbox_messages_total", []string{"consumer", c.name, "outcome", "poison"}, float64(env.count(t, `
					SELECT COUNT(*) FROM inbox_messages WHERE consumer = ? AND status = 'poison'`, c.name))},
			)
		}
		checkMetrics(t, families, checks)

		// Each of the flow's cases happened, so the checks above compare
		// something.
		for _, happened := range []metricCheck{
			{"retrysafe_outbox_failed_events", nil, 1},
			{"retrysafe_saga_compensations_total", []string{"step", stepReserveStock}, 1},
			{"retrysafe_processor_key_hits_total", []string{"operation", processorCharge}, 1},
			{"retrysafe_broker_redeliveries_total", []string{"consumer", paymentServiceConsumer}, 1},
			{"retrysafe_inbox_messages_total", []string{"consumer", paymentServiceConsumer, "outcome", "duplicate"}, 1},
			{"retrysafe_inbox_messages_total", []string{"consumer", paymentServiceConsumer, "outcome", "poison"}, 1},
			{"retrysafe_sagas_ended_total", []string{"state", string(sagaCompensated)}, 1},
			{"retrysafe_sagas_ended_total", []string{"state", string(sagaCompleted)}, 2},
			{"retrysafe_order_completion_seconds", []string{"status", "paid"}, 2},
			{"retrysafe_order_completion_seconds", []string{"status", "cancelled"}, 1},
		} {
			if got, _ := sample(families, happened.name, happened.labels...); got < happened.want {
				t.Errorf("%s%v = %v: the flow did not produce what it tests", happened.name, happened.labels, got)
			}
		}
		if got, _ := sample(families, "retrysafe_outbox_publish_retries_total"); got < float64(maxPublishAttempts) {
			t.Errorf("publish retries %v: the flow did not retry", got)
		}

		// POST -> final state: the order service applied each final event
		// at its inbox row's processed_at.
		rows, err := env.app.db.Query(`
			SELECT o.status, o.created_at, i.processed_at
			FROM orders o
			JOIN outbox_events e ON e.aggregate_id = o.order_id AND e.event_type IN (?, ?)
			JOIN inbox_messages i ON i.message_id = e.event_id AND i.consumer = ?`,
			eventPaymentCaptured, eventOrderCancelled, orderServiceConsumer)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		wantSum := map[string]float64{}
		for rows.Next() {
			var status, createdAt, processedAt string
			if err := rows.Scan(&status, &createdAt, &processedAt); err != nil {
				t.Fatal(err)
			}
			created, _ := time.Parse(timeFormat, createdAt)
			processed, _ := time.Parse(timeFormat, processedAt)
			wantSum[status] += processed.Sub(created).Seconds()
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		for _, status := range []string{"paid", "cancelled"} {
			got := histogramSum(families, "retrysafe_order_completion_seconds", "status", status)
			if diff := got - wantSum[status]; diff > 1e-6 || diff < -1e-6 || got == 0 {
				t.Errorf("order completion seconds of %s orders sum to %v, want %v", status, got, wantSum[status])
			}
		}
		for _, metric := range families["retrysafe_http_request_duration_seconds"].GetMetric() {
			for _, pair := range metric.GetLabel() {
				if strings.Contains(pair.GetValue(), "ord_") {
					t.Errorf("a request series labelled with a raw path: %v", metric.GetLabel())
				}
			}
		}
	})

	// Ensure a gauge whose query fails is left out and logged, and the
	// counters are still served.
	t.Run("FailedGaugeIsLoggedNotFatal", func(t *testing.T) {
		db, err := openDB(context.Background(), testDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		db.Close()
		m := newMetrics(newDBCollector(db, time.Now))
		m.published(3)
		var log bytes.Buffer
		ts := httptest.NewServer(m.handler(slog.New(slog.NewTextHandler(&log, nil))))
		defer ts.Close()
		families := scrape(t, ts.URL)
		if got, ok := sample(families, "retrysafe_outbox_publishes_total"); !ok || got != 3 {
			t.Errorf("publishes %v, %v; want 3 served beside the failed gauges", got, ok)
		}
		if _, ok := sample(families, "retrysafe_outbox_pending_events"); ok {
			t.Error("a gauge whose query failed was served")
		}
		for _, want := range []string{"count pending outbox events", "count sagas by state", "database is closed"} {
			if !strings.Contains(log.String(), want) {
				t.Errorf("the log does not say %q:\n%s", want, log.String())
			}
		}
	})

	// Ensure the API never serves /metrics, with metrics on or off: they
	// are served on --metrics-addr, an address of their own, out of
	// customers' reach.
	t.Run("NeverOnTheAPIAddress", func(t *testing.T) {
		for _, on := range []bool{false, true} {
			env := MustOpenApp(t)
			if on {
				env.app.enableMetrics()
			}
			ts := newTestServer(t, env)
			got := call(t, ts, "GET", "/metrics", "", "", "")
			if got.Status != 404 || got.Header.Get("Content-Type") != "application/problem+json" {
				t.Fatalf("metrics on: %v; got %d %s, want a 404 problem", on, got.Status, got.Header.Get("Content-Type"))
			}
		}
	})

	// Ensure two Apps count apart: each has a registry of its own.
	t.Run("EachAppCountsItsOwn", func(t *testing.T) {
		first, second := MustOpenApp(t), MustOpenApp(t)
		first.app.enableMetrics().published(2)
		second.app.enableMetrics()
		got, _ := sample(gather(t, second.app.metrics), "retrysafe_outbox_publishes_total")
		if got != 0 {
			t.Fatalf("the second App counts %v publishes of the first", got)
		}
	})
}

// Ensure every query a scrape makes reads one of the partial indexes that
// hold only the rows waiting for work or for an operator, never a table
// nor a whole index: on a database with a history beside its live work
// (fillHistory), by SQLite's query plan, or by PostgreSQL's EXPLAIN with
// sequential scans priced out (on tables this small it would rather scan,
// and should; the question is whether it could do otherwise).
func TestMetricsScrapeReadsOnlyLiveRows(t *testing.T) {
	env := MustOpenApp(t)
	fillHistory(t, env.app.db, 1000)
	live := []string{"outbox_events_unpublished", "outbox_events_pending", "outbox_events_failed",
		"outbox_events_delivery", "saga_instances_runnable", "saga_instances_compensation_failed"}
	// Besides the live rows, a scrape may look rows up by their whole
	// primary key (the reconciler's cursor; each consumer's inbox row of an
	// event in flight) and read the consumers' subscriptions (VALUES).
	lookup := regexp.MustCompile(`USING PRIMARY KEY \(|VALUES CLAUSE|Values Scan|Index (Only )?Scan using (delivery_cursor|inbox_messages)_pkey`)
	readsLiveIndex := func(line string) bool {
		if lookup.MatchString(line) {
			return true
		}
		for _, index := range live {
			if regexp.MustCompile(`INDEX ` + index + `\b|using ` + index + `\b|Index Scan on ` + index + `\b`).MatchString(line) {
				return true
			}
		}
		return false
	}
	for _, query := range []string{scrapeOutboxPending, scrapeOutboxOldestPending, scrapeOutboxFailed, scrapeOutboxUndelivered,
		scrapeSagasRunning, scrapeSagasCompensationFailed} {
		plan := explain(t, env.app.db, query)
		for _, line := range plan {
			reads := regexp.MustCompile(`^(SCAN|SEARCH) |Scan `).MatchString(line)
			heap := strings.Contains(line, "Bitmap Heap Scan")
			if reads && !heap && !readsLiveIndex(line) {
				t.Errorf("%s\nreads more than the live rows:\n%s", query, strings.Join(plan, "\n"))
				break
			}
		}
	}
}

// explain returns the lines of db's plan for query: SQLite's EXPLAIN QUERY
// PLAN, or PostgreSQL's EXPLAIN with enable_seqscan off.
func explain(tb testing.TB, db *sql.DB, query string) []string {
	tb.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		tb.Fatal(err)
	}
	// It only reads, and SET LOCAL ends with it.
	defer tx.Rollback()
	sqlite := dialectOf(db).name == "sqlite"
	statement := "EXPLAIN " + query
	if sqlite {
		statement = "EXPLAIN QUERY PLAN " + query
	} else if _, err := tx.ExecContext(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		tb.Fatal(err)
	}
	rows, err := tx.QueryContext(ctx, statement)
	if err != nil {
		tb.Fatalf("%s: %v", statement, err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var line string
		if sqlite {
			var id, parent, unused int
			err = rows.Scan(&id, &parent, &unused, &line)
		} else {
			err = rows.Scan(&line)
		}
		if err != nil {
			tb.Fatal(err)
		}
		plan = append(plan, strings.TrimSpace(line))
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	return plan
}

// gather returns m's metric families as a scrape would.
func gather(tb testing.TB, m *metrics) map[string]*dto.MetricFamily {
	tb.Helper()
	ts := httptest.NewServer(m.handler(discardLogger()))
	defer ts.Close()
	return scrape(tb, ts.URL)
}

// Ensure each background action logs one line naming its order: a relay
// publish and a failed one, each inbox outcome, each saga step, a
// compensation and the end of one, the refund completer. In JSON, each
// line is an object with the keys a log pipeline indexes.
func TestBackgroundActionLinesNameTheirOrder(t *testing.T) {
	env := MustOpenApp(t)
	var buf bytes.Buffer
	env.app.log = newLogger(&buf, logJSON, nil)
	ts := newTestServer(t, env)
	paidID := paidOrderOverHTTP(t, env, ts, 5000)
	declined := call(t, ts, "POST", "/api/orders", keyUser42, "declined", orderBody(5000, "sku-1", 1, pmCardDeclined))
	declinedID := orderField([]byte(declined.Body), "order_id")
	failPublishes(t, env, 1)
	env.drain(t)
	// A refund whose request died after the processor refunded: the
	// completer finishes it.
	env.fault.crashAt(faultRefundAfterProcessor)
	req, refund := refundRequestFor(t, paidID, "refund-1", "")
	if _, err := env.app.refundOrder(context.Background(), req, paidID, refund); !errors.Is(err, errCrash) {
		t.Fatalf("got %v, want the crash", err)
	}
	env.clock.advance(refundLockTimeout)
	if n, err := env.app.completeRefundsOnce(context.Background(), 10); err != nil || n != 1 {
		t.Fatalf("completer finished %d, %v; want 1", n, err)
	}

	seen := map[string]bool{}
	for _, line := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
		var record map[string]any
		if err := json.Unmarshal(line, &record); err != nil {
			t.Fatalf("a log line that is not JSON: %s", line)
		}
		for _, key := range []string{"time", "level", "msg", "order_id"} {
			if _, ok := record[key].(string); !ok {
				t.Errorf("a line without the string key %q: %s", key, line)
			}
		}
		orderID, _ := record["order_id"].(string)
		if orderID != paidID && orderID != declinedID {
			t.Errorf("a line naming neither order (%s, %s): %s", paidID, declinedID, line)
		}
		msg, _ := record["msg"].(string)
		then, _ := record["then"].(string)
		outcome, _ := record["outcome"].(string)
		seen[strings.TrimSpace(msg+" "+then+outcome)] = true
	}
	for _, want := range []string{
		"relay published",
		"relay publish failed",
		"inbox applied",
		"saga step step done",
		"saga step step compensated",
		"saga compensated ended, event written",
		"refund completer finished",
	} {
		if !seen[want] {
			t.Errorf("no %q line; got %v\n%s", want, seen, buf.String())
		}
	}
}

// lineRecorder is the output of a command run in the test's process: it
// keeps the lines and tells waitFor of each new one.
type lineRecorder struct {
	mu      sync.Mutex
	partial []byte
	lines   []string
	// changed is closed, and replaced, whenever a line arrives.
	changed chan struct{}
}

// newLineRecorder returns an empty lineRecorder.
func newLineRecorder() *lineRecorder {
	return &lineRecorder{changed: make(chan struct{})}
}

// Write keeps p's complete lines.
func (r *lineRecorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.partial = append(r.partial, p...)
	for {
		end := bytes.IndexByte(r.partial, '\n')
		if end < 0 {
			break
		}
		r.lines = append(r.lines, string(r.partial[:end]))
		r.partial = r.partial[end+1:]
	}
	close(r.changed)
	r.changed = make(chan struct{})
	return len(p), nil
}

// snapshot returns the lines so far.
func (r *lineRecorder) snapshot() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.lines)
}

// waitFor waits until found is true of the lines, and fails tb after a
// minute.
func (r *lineRecorder) waitFor(tb testing.TB, what string, found func(lines []string) bool) {
	tb.Helper()
	deadline := time.After(time.Minute)
	for {
		r.mu.Lock()
		lines, changed := slices.Clone(r.lines), r.changed
		r.mu.Unlock()
		if found(lines) {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			tb.Fatalf("no %s after a minute; the lines:\n%s", what, strings.Join(lines, "\n"))
		}
	}
}

// jsonRecords parses every line as a JSON object, and fails tb for one that
// is not.
func jsonRecords(tb testing.TB, process string, lines []string) []map[string]any {
	tb.Helper()
	var records []map[string]any
	for _, line := range lines {
		var record map[string]any
		if err := json.Unmarshal([]byte(line), &record); err != nil {
			tb.Fatalf("%s wrote a line that is not JSON: %s", process, line)
		}
		records = append(records, record)
	}
	return records
}

// Ensure serve, relay and worker, run as separate processes on one
// database with --log-format json, write only JSON lines, each background
// one naming its order, and serve metrics (relay and worker on
// --metrics-addr) that agree with the database: the gauges the same in
// every process, the counters each process's own.
func TestProcessesLogJSONAndServeMetrics(t *testing.T) {
	t.Setenv("RETRYSAFE_API_KEYS", "user-42:"+keyUser42)
	t.Setenv("RETRYSAFE_WEBHOOK_SECRET", testWebhookSecret)
	target := testDatabase(t)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	type process struct {
		name   string
		out    *lineRecorder
		exited chan error
	}
	start := func(name string, args ...string) *process {
		p := &process{name: name, out: newLineRecorder(), exited: make(chan error, 1)}
		go func() { p.exited <- run(ctx, args, strings.NewReader(""), p.out, p.out) }()
		return p
	}
	urlIn := func(p *process, pattern string) string {
		t.Helper()
		re := regexp.MustCompile(pattern)
		var url string
		p.out.waitFor(t, p.name+" address", func(lines []string) bool {
			for _, line := range lines {
				if found := re.FindStringSubmatch(line); found != nil {
					url = found[1]
					return true
				}
			}
			return false
		})
		return url
	}
	serveProcess := start("serve", "serve", "--db", target, "--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--workers=false", "--log-format", "json")
	base := urlIn(serveProcess, `retrysafe serving (http://[0-9.:]+)`)
	serveMetrics := urlIn(serveProcess, `"url":"(http://[0-9.:]+/metrics)"`)
	relay := start("relay", "relay", "--db", target, "--metrics-addr", "127.0.0.1:0", "--log-format", "json")
	worker := start("worker", "worker", "--db", target, "--metrics-addr", "127.0.0.1:0", "--log-format", "json")
	relayMetrics := urlIn(relay, `"url":"(http://[0-9.:]+/metrics)"`)
	workerMetrics := urlIn(worker, `"url":"(http://[0-9.:]+/metrics)"`)

	client := &http.Client{Timeout: 30 * time.Second}
	var orderIDs []string
	for i, paymentMethod := range []string{pmCardVisa, pmCardDeclined} {
		req, err := http.NewRequest("POST", base+"/api/orders", strings.NewReader(orderBody(5000, "sku-1", 1, paymentMethod)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+keyUser42)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "process-"+strconv.Itoa(i))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 201 {
			t.Fatalf("create: %d %s %v", resp.StatusCode, body, err)
		}
		orderIDs = append(orderIDs, orderField(body, "order_id"))
	}
	worker.out.waitFor(t, "final event applied for both orders", func(lines []string) bool {
		final := 0
		for _, orderID := range orderIDs {
			for _, line := range lines {
				if strings.Contains(line, `"consumer":"order-svc"`) && strings.Contains(line, `"outcome":"applied"`) &&
					strings.Contains(line, `"order_id":"`+orderID+`"`) {
					final++
					break
				}
			}
		}
		return final == len(orderIDs)
	})

	db, err := openReadOnlyDB(context.Background(), target)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	count := func(query string, args ...any) float64 {
		t.Helper()
		var n int
		if err := db.QueryRow(query, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", query, err)
		}
		return float64(n)
	}
	gauges := []metricCheck{
		{"retrysafe_outbox_pending_events", nil, 0},
		{"retrysafe_sagas", []string{"state", string(sagaInProgress)}, count(`SELECT COUNT(*) FROM saga_instances WHERE status = 'in_progress'`)},
		{"retrysafe_sagas", []string{"state", string(sagaCompensationFailed)}, count(`SELECT COUNT(*) FROM saga_instances WHERE status = 'compensation_failed'`)},
	}
	for _, url := range []string{serveMetrics, relayMetrics, workerMetrics} {
		checkMetrics(t, scrape(t, url), gauges)
	}
	if resp, err := client.Get(base + "/metrics"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("serve's API address answers GET /metrics with %v %v, want 404: metrics are on --metrics-addr only", resp.Status, err)
	} else {
		resp.Body.Close()
	}
	checkMetrics(t, scrape(t, serveMetrics), []metricCheck{
		{"retrysafe_http_request_duration_seconds", []string{"route", "POST /api/orders", "status_class", "2xx"}, 2},
		{"retrysafe_outbox_publishes_total", nil, 0},
		{"retrysafe_sagas_ended_total", []string{"state", string(sagaCompleted)}, 0},
	})
	checkMetrics(t, scrape(t, relayMetrics), []metricCheck{
		{"retrysafe_outbox_publishes_total", nil, count(`SELECT COUNT(*) FROM outbox_events WHERE status = 'published'`)},
		{"retrysafe_inbox_messages_total", []string{"consumer", orderServiceConsumer, "outcome", "applied"}, 0},
	})
	checkMetrics(t, scrape(t, workerMetrics), []metricCheck{
		{"retrysafe_outbox_publishes_total", nil, 0},
		// The worker ended both sagas: the counters are its own.
		{"retrysafe_sagas_ended_total", []string{"state", string(sagaCompleted)}, count(`SELECT COUNT(*) FROM saga_instances WHERE status = 'completed'`)},
		{"retrysafe_sagas_ended_total", []string{"state", string(sagaCompensated)}, count(`SELECT COUNT(*) FROM saga_instances WHERE status = 'compensated'`)},
		{"retrysafe_inbox_messages_total", []string{"consumer", paymentServiceConsumer, "outcome", "applied"}, 2},
		{"retrysafe_inbox_messages_total", []string{"consumer", orderServiceConsumer, "outcome", "applied"}, 2},
		{"retrysafe_saga_compensations_total", []string{"step", stepReserveStock}, 1},
		{"retrysafe_order_completion_seconds", []string{"status", "paid"}, 1},
		{"retrysafe_order_completion_seconds", []string{"status", "cancelled"}, 1},
	})

	stop()
	background := map[string]bool{"relay published": true, "inbox": true, "saga step": true, "saga compensated": true}
	seen := map[string]bool{}
	for _, p := range []*process{serveProcess, relay, worker} {
		if err := mustReceive(t, p.name+" to exit", p.exited); err != nil {
			t.Errorf("%s exited with %v", p.name, err)
		}
		for _, record := range jsonRecords(t, p.name, p.out.snapshot()) {
			for _, key := range []string{"time", "level", "msg"} {
				if _, ok := record[key].(string); !ok {
					t.Errorf("%s: a line without %q: %v", p.name, key, record)
				}
			}
			if record["level"] != "INFO" {
				t.Errorf("%s: %v", p.name, record)
			}
			msg, _ := record["msg"].(string)
			if !background[msg] {
				continue
			}
			seen[p.name+" "+msg] = true
			if orderID, _ := record["order_id"].(string); !slices.Contains(orderIDs, orderID) {
				t.Errorf("%s: a background line naming no order of %v: %v", p.name, orderIDs, record)
			}
		}
	}
	for _, want := range []string{"relay relay published", "worker inbox", "worker saga step", "worker saga compensated"} {
		if !seen[want] {
			t.Errorf("no %q line; got %v", want, seen)
		}
	}
}

// Ensure a bad --log-format or --metrics-addr stops the command with a
// message naming it, before anything is created.
func TestLogAndMetricsFlagsFailClearly(t *testing.T) {
	dir := t.TempDir()
	existing := filepath.Join(dir, "existing.db")
	if out, err := runArgs("demo", "--db", existing); err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	fresh := filepath.Join(dir, "fresh.db")
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--db", fresh, "--addr", "127.0.0.1:0", "--log-format", "xml"}, `--log-format "xml": want text or json`},
		{[]string{"relay", "--db", existing, "--log-format", "JSON"}, `--log-format "JSON": want text or json`},
		{[]string{"worker", "--db", existing, "--log-format", ""}, `--log-format "": want text or json`},
		{[]string{"demo", "--trace", "--log-format", "yaml"}, `--log-format "yaml": want text or json`},
		{[]string{"relay", "--db", existing, "--metrics-addr", "not an address"}, "listen on --metrics-addr not an address"},
		{[]string{"serve", "--db", fresh, "--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:99999"}, "listen on --metrics-addr 127.0.0.1:99999"},
		{[]string{"worker", "--db", fresh, "--metrics-addr", "127.0.0.1:99999"}, "listen on --metrics-addr 127.0.0.1:99999"},
	} {
		out, err := runArgs(tt.args...)
		if err == nil || !strings.Contains(out, tt.want) {
			t.Errorf("%v: got %v\n%s\nwant an error mentioning %q", tt.args, err, out, tt.want)
		}
	}
	if _, err := os.Stat(fresh); !os.IsNotExist(err) {
		t.Fatalf("a refused command created %s", fresh)
	}
}

// runArgs runs the command line and returns its output and error.
func runArgs(args ...string) (string, error) {
	var out bytes.Buffer
	err := run(context.Background(), args, strings.NewReader(""), &out, &out)
	return out.String(), err
}

// BenchmarkMetricsCreate is BenchmarkHTTP's fresh creates over loopback
// HTTP from 8 clients (durability normal) with metrics off and on: what
// counting costs on the create path.
func BenchmarkMetricsCreate(b *testing.B) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	for _, on := range []bool{false, true} {
		name := "off"
		if on {
			name = "on"
		}
		b.Run(name, func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			if on {
				app.enableMetrics()
			}
			benchCreatesOverHTTP(b, app, 8, "metrics-", body)
		})
	}
}

// BenchmarkMetricsObserveRequest is what the request middleware adds per
// request, alone: a nil check when off, a histogram observation when on.
func BenchmarkMetricsObserveRequest(b *testing.B) {
	for _, on := range []bool{false, true} {
		name := "off"
		var m *metrics
		if on {
			name = "on"
			m = newMetrics(newDBCollector(nil, time.Now))
		}
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				m.observeRequest("POST /api/orders", http.StatusCreated, false, time.Millisecond)
			}
		})
	}
}

// Ensure docs/observability.md's "Metrics and logs" section lists exactly the metrics
// there are, and its example line is one the demo prints.
func TestDocsMetricsAndLogs(t *testing.T) {
	readme, err := os.ReadFile("docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, found := strings.Cut(string(readme), "\n## Metrics and logs\n")
	if !found {
		t.Fatal(`docs/observability.md has no "## Metrics and logs" section`)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var listed []string
	for _, match := range regexp.MustCompile("(?m)^\\| `(retrysafe_[a-z_]+)` \\|").FindAllStringSubmatch(section, -1) {
		listed = append(listed, match[1])
	}
	database := newDBCollector(nil, time.Now)
	m := newMetrics(database)
	var exported []string
	for _, collector := range m.collectors(database) {
		descs := make(chan *prometheus.Desc, 16)
		collector.Describe(descs)
		close(descs)
		for desc := range descs {
			name := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(desc.String())
			exported = append(exported, name[1])
		}
	}
	slices.Sort(listed)
	slices.Sort(exported)
	if !slices.Equal(listed, exported) {
		t.Errorf("docs/observability.md lists\n%v\nthe metrics are\n%v", listed, exported)
	}

	example := regexp.MustCompile("(?m)^\\{\"level\".*\\}$").FindString(section)
	if example == "" {
		t.Fatal("the section shows no JSON log line")
	}
	out, err := runArgs("demo", "--trace", "--log-format", "json")
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	if !slices.Contains(strings.Split(out, "\n"), example) {
		t.Errorf("the demo prints no line\n%s\nit prints:\n%s", example, out)
	}
}

// BenchmarkMetricsScrape is one read of the database gauges, what every
// scrape of /metrics asks of the database, on databases whose history
// grows from a thousand sagas (and as many orders and events) to a million
// (RETRYSAFE_BENCH_ROWS caps it), each with the same live work beside it
// (fillHistory). The time must stay flat: Prometheus scrapes every few
// seconds from every process, for ever.
func BenchmarkMetricsScrape(b *testing.B) {
	for _, rows := range historySizes(benchRows(b)) {
		b.Run("sagas-"+strconv.Itoa(rows), func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			fillHistory(b, app.db, rows)
			registry := prometheus.NewRegistry()
			registry.MustRegister(newDBCollector(app.readDB, app.now))
			for b.Loop() {
				families, err := registry.Gather()
				if err != nil {
					b.Fatal(err)
				}
				for _, family := range families {
					if family.GetName() == "retrysafe_outbox_failed_events" && family.GetMetric()[0].GetGauge().GetValue() != historyFailedEvents {
						b.Fatalf("%v failed events, want %d", family.GetMetric()[0].GetGauge().GetValue(), historyFailedEvents)
					}
				}
			}
		})
	}
}
