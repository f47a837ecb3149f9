// Metrics and logs (the "Operate it" section): what an operator watches to
// see the four layers work, and to see what they set aside. Without them a
// relay that stopped publishing, a consumer that makes every message poison
// or sagas piling up in compensation_failed are found by a customer, not by
// an alert.
//
// Two kinds of numbers, on purpose:
//   - what describes the work in flight or waiting for an operator (the
//     outbox backlog and its oldest event, failed events, sagas not ended)
//     is read from the database at scrape time (dbCollector), so every
//     process reports the same true number however many relays and
//     workers share the database; each is read through a partial index
//     that holds only those rows, so a scrape costs the same whatever the
//     history;
//   - what describes actions (publishes, deliveries, inbox outcomes,
//     compensations, sagas ended, processor calls, replays, request
//     latencies) is counted by the process that did them, where it did
//     them; Prometheus adds the processes up. A count of the sagas that
//     ended is such a counter, not a gauge: counted in the database it
//     would read a table that grows for ever, and kept in a row it would
//     cost every saga a write to one hot row.
//
// An App without metrics has a nil *metrics, and every method below is a
// no-op on nil: the benchmarks and tests that do not ask for metrics pay
// one nil check per action.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
)

// metricsQueryTimeout bounds each query a scrape makes. Prometheus gives up
// on a scrape after 10s by default; a database too busy to count its
// backlog in 2s should show as a failed gauge (and a log line), not as a
// scrape that times out and hides the counters with it.
const metricsQueryTimeout = 2 * time.Second

// metrics are one App's Prometheus metrics, in a registry of its own: no
// global default registry, so several Apps (tests, the simulator) each
// count their own.
type metrics struct {
	registry *prometheus.Registry

	outboxPublishes      prometheus.Counter
	outboxPublishRetries prometheus.Counter
	outboxRepublished    prometheus.Counter
	deliveries           *prometheus.CounterVec
	redeliveries         *prometheus.CounterVec
	inboxMessages        *prometheus.CounterVec
	compensations        *prometheus.CounterVec
	sagasEnded           *prometheus.CounterVec
	processorCalls       *prometheus.CounterVec
	processorKeyHits     *prometheus.CounterVec
	idempotentReplays    *prometheus.CounterVec
	requestDuration      *prometheus.HistogramVec
	orderCompletion      *prometheus.HistogramVec
}

// Processor operations, the operation label of the processor metrics.
const (
	processorCharge = "charge"
	processorRefund = "refund"
)

// enableMetrics gives a (and its processor) metrics, registered with the
// database gauges over a's database, and returns them.
func (a *App) enableMetrics() *metrics {
	m := newMetrics(newDBCollector(a.readDB, a.now))
	a.metrics = m
	a.processor.metrics = m
	for _, c := range a.consumers() {
		m.initConsumer(c.name)
	}
	m.initConsumer(webhookConsumer)
	return m
}

// newMetrics returns metrics in a new registry, with the Go runtime's and
// the process's standard collectors and database.
func newMetrics(database prometheus.Collector) *metrics {
	m := &metrics{
		registry: prometheus.NewRegistry(),
		outboxPublishes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "retrysafe_outbox_publishes_total",
			Help: "Outbox events this process's relay published to the broker.",
		}),
		outboxPublishRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "retrysafe_outbox_publish_retries_total",
			Help: "Failed publishes of an outbox event by this process's relay after which the event waits for another attempt.",
		}),
		outboxRepublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "retrysafe_outbox_republished_events_total",
			Help: "Published events this process's reconciler published again because no consumer had applied them within the delivery bound: messages the broker lost, or a consumer never got.",
		}),
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_broker_deliveries_total",
			Help: "Messages this process's consumers fetched from the broker, redeliveries included.",
		}, []string{"consumer"}),
		redeliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_broker_redeliveries_total",
			Help: "Deliveries this process fetched that were not a message's first delivery to the consumer.",
		}, []string{"consumer"}),
		inboxMessages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_inbox_messages_total",
			Help: "Messages this process put through a consumer's inbox, by outcome: applied, duplicate, poison or retry.",
		}, []string{"consumer", "outcome"}),
		compensations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_saga_compensations_total",
			Help: "Saga steps this process undid (compensated), by step.",
		}, []string{"step"}),
		sagasEnded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_sagas_ended_total",
			Help: "Fulfilment sagas this process ended, by final state: completed, or compensated (every step undone).",
		}, []string{"state"}),
		processorCalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_processor_calls_total",
			Help: "Calls this process made to the card processor, by operation (charge, refund).",
		}, []string{"operation"}),
		processorKeyHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_processor_key_hits_total",
			Help: "Processor calls answered from an idempotency key the processor had seen before, by operation.",
		}, []string{"operation"}),
		idempotentReplays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "retrysafe_idempotent_replays_total",
			Help: "API requests answered with the stored response of their Idempotency-Key, by route.",
		}, []string{"route"}),
		requestDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "retrysafe_http_request_duration_seconds",
			Help:    "Time to answer an API request, by route pattern and status class.",
			Buckets: prometheus.DefBuckets,
		}, []string{"route", "status_class"}),
		orderCompletion: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "retrysafe_order_completion_seconds",
			Help: "Time from an order's creation to its final state (paid or cancelled), observed when the order service applies the final event.",
			// 10ms to about 11 minutes: a saga that waits out its
			// backoffs takes minutes.
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 17),
		}, []string{"status"}),
	}
	m.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.registry.MustRegister(m.collectors(database)...)
	for _, state := range []sagaStatus{sagaCompleted, sagaCompensated} {
		m.sagasEnded.WithLabelValues(string(state))
	}
	for _, operation := range []string{processorCharge, processorRefund} {
		m.processorCalls.WithLabelValues(operation)
		m.processorKeyHits.WithLabelValues(operation)
	}
	return m
}

// collectors returns retrysafe's own collectors: database, and what m
// counts.
func (m *metrics) collectors(database prometheus.Collector) []prometheus.Collector {
	return []prometheus.Collector{
		database,
		m.outboxPublishes, m.outboxPublishRetries, m.outboxRepublished,
		m.deliveries, m.redeliveries, m.inboxMessages,
		m.compensations, m.sagasEnded, m.processorCalls, m.processorKeyHits,
		m.idempotentReplays, m.requestDuration, m.orderCompletion,
	}
}

// initConsumer makes consumer's series exist at zero, so that a rate over
// them is defined before the first message arrives.
func (m *metrics) initConsumer(consumer string) {
	m.deliveries.WithLabelValues(consumer)
	m.redeliveries.WithLabelValues(consumer)
	for _, outcome := range []inboxOutcome{inboxApplied, inboxDuplicate, inboxPoison, inboxRetry} {
		m.inboxMessages.WithLabelValues(consumer, string(outcome))
	}
}

// handler serves the registry in Prometheus's text format. A gauge whose
// query failed is left out and the failure logged to log; the rest is
// served, so that a slow database does not hide the counters.
func (m *metrics) handler(log *slog.Logger) http.Handler {
	return promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{
		ErrorLog:      slog.NewLogLogger(log.Handler(), slog.LevelError),
		ErrorHandling: promhttp.ContinueOnError,
	})
}

// published counts n events the relay published.
func (m *metrics) published(n int) {
	if m == nil {
		return
	}
	m.outboxPublishes.Add(float64(n))
}

// publishRetried counts a failed publish after which the event waits for
// another attempt.
func (m *metrics) publishRetried() {
	if m == nil {
		return
	}
	m.outboxPublishRetries.Inc()
}

// republished counts n events the reconciler published again.
func (m *metrics) republished(n int) {
	if m == nil {
		return
	}
	m.outboxRepublished.Add(float64(n))
}

// delivered counts the deliveries a consumer fetched, and those of them that
// were redeliveries.
func (m *metrics) delivered(consumer string, deliveries []delivery) {
	if m == nil {
		return
	}
	redelivered := 0
	for _, d := range deliveries {
		if d.DeliveryCount > 1 {
			redelivered++
		}
	}
	m.deliveries.WithLabelValues(consumer).Add(float64(len(deliveries)))
	m.redeliveries.WithLabelValues(consumer).Add(float64(redelivered))
}

// inboxOutcome counts one message's outcome in consumer's inbox.
func (m *metrics) inboxOutcome(consumer string, outcome inboxOutcome) {
	if m == nil {
		return
	}
	m.inboxMessages.WithLabelValues(consumer, string(outcome)).Inc()
}

// compensated counts one undone saga step.
func (m *metrics) compensated(step string) {
	if m == nil {
		return
	}
	m.compensations.WithLabelValues(step).Inc()
}

// sagaEnded counts one saga this process ended, in state.
func (m *metrics) sagaEnded(state sagaStatus) {
	if m == nil {
		return
	}
	m.sagasEnded.WithLabelValues(string(state)).Inc()
}

// processorCalled counts a call to the processor, and whether the
// processor answered it from a key it had seen.
func (m *metrics) processorCalled(operation string, keyHit bool) {
	if m == nil {
		return
	}
	m.processorCalls.WithLabelValues(operation).Inc()
	if keyHit {
		m.processorKeyHits.WithLabelValues(operation).Inc()
	}
}

// observeRequest records one API request: its latency by route pattern
// (never the raw path, which holds order ids: one series per order would
// swamp Prometheus) and status class, and whether it was a replay.
func (m *metrics) observeRequest(route string, status int, replayed bool, elapsed time.Duration) {
	if m == nil {
		return
	}
	if route == "" {
		// Answered before routing (net/http itself, on a malformed
		// request).
		route = "unrouted"
	}
	m.requestDuration.WithLabelValues(route, statusClass(status)).Observe(elapsed.Seconds())
	if replayed {
		m.idempotentReplays.WithLabelValues(route).Inc()
	}
}

// statusClass returns "2xx" for 200 to 299, and so on.
func statusClass(status int) string {
	switch status / 100 {
	case 1:
		return "1xx"
	case 2:
		return "2xx"
	case 3:
		return "3xx"
	case 4:
		return "4xx"
	case 5:
		return "5xx"
	}
	return "other"
}

// observeFinalStates records, for each order the order service just made
// paid or cancelled (an applied PaymentCaptured or OrderCancelled among
// deliveries), how long it took since the order was created. It runs after
// the inbox transaction committed: a batch that rolled back and ran again
// observes once. The orders' creation times take one query per batch, made
// only when metrics are on; if it fails, the failure is logged and nothing
// observed: a metric must not fail the consumer.
func (a *App) observeFinalStates(ctx context.Context, c consumer, deliveries []delivery, results []receiveResult) {
	if a.metrics == nil || c.name != orderServiceConsumer {
		return
	}
	// The order IDs made final, and the status each was given.
	final := map[string]orderStatus{}
	for i, d := range deliveries {
		if results[i].Outcome != inboxApplied {
			continue
		}
		switch d.Subject {
		case eventPaymentCaptured:
			final[payloadOrderID(d.Payload)] = orderPaid
		case eventOrderCancelled:
			final[payloadOrderID(d.Payload)] = orderCancelled
		}
	}
	if len(final) == 0 {
		return
	}
	now := a.now()
	ids := make([]any, 0, len(final))
	for orderID := range final {
		ids = append(ids, orderID)
	}
	rows, err := a.readDB.QueryContext(ctx, `
		SELECT order_id, created_at FROM orders WHERE order_id IN (`+placeholders(len(ids))+`)`, ids...)
	if err != nil {
		a.log.Warn("metrics: read creation times", "error", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var orderID, createdAt string
		if err := rows.Scan(&orderID, &createdAt); err != nil {
			a.log.Warn("metrics: read creation times", "error", err)
			return
		}
		created, err := time.Parse(timeFormat, createdAt)
		if err != nil {
			a.log.Warn("metrics: creation time", "order_id", orderID, "error", err)
			continue
		}
		a.metrics.orderCompletion.WithLabelValues(string(final[orderID])).Observe(now.Sub(created).Seconds())
	}
	if err := rows.Err(); err != nil {
		a.log.Warn("metrics: read creation times", "error", err)
	}
}

// The queries a scrape makes. Each reads a partial index (schema.sql,
// version 6) that holds only the rows waiting for work or for an
// operator, never the history: a scrape costs the same on the first day
// and after a million orders. TestMetricsScrapeReadsOnlyLiveRows checks
// their plans on both databases.
const (
	// outbox_events_pending, which the relay's claim reads too.
	scrapeOutboxPending = `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`
	// outbox_events_pending's first entry: the pending event written first.
	// By seq, not by created_at: an index of created_at would be one more
	// b-tree page that every create writes and flushes (schema.sql,
	// version 9). The two orders differ only between events written at
	// the same moment by different transactions or clocks.
	scrapeOutboxOldestPending = `SELECT created_at FROM outbox_events
		WHERE status = 'pending' ORDER BY seq LIMIT 1`
	// outbox_events_failed.
	scrapeOutboxFailed = `SELECT COUNT(*) FROM outbox_events WHERE status = 'failed'`
	// saga_instances_runnable, which the saga loop's claim reads too. The
	// condition is the index's own, word for word: SQLite uses a partial
	// index only for a query that says what the index says.
	scrapeSagasRunning = `SELECT status, COUNT(*) FROM saga_instances
		WHERE status IN ('in_progress', 'compensating') GROUP BY status`
	// saga_instances_compensation_failed.
	scrapeSagasCompensationFailed = `SELECT COUNT(*) FROM saga_instances WHERE status = 'compensation_failed'`
)

// scrapeOutboxUndelivered reads outbox_events_delivery, as the reconciler
// does: the events from its cursor on that a consumer of their subject has
// not applied yet, and the oldest publish among them.
var scrapeOutboxUndelivered = `SELECT COUNT(*), MIN(e.published_at) FROM outbox_events e
	WHERE e.delivery_position >= ` + deliveryCursor + ` AND ` + undeliveredSQL(deliveryTargets())

// dbCollector reads the gauges that describe the database at scrape time:
// each scrape, from any process, reports what the database holds now. It
// reads only what is bounded by the work in flight and the work waiting
// for an operator; the sagas that ended, a number that grows for ever, are
// counted by the processes that ended them (sagasEnded).
type dbCollector struct {
	db  queryer
	now func() time.Time

	outboxPending, outboxOldestPending, outboxFailed, sagas *prometheus.Desc
	outboxUndelivered, outboxOldestUndelivered              *prometheus.Desc
}

// newDBCollector returns a dbCollector that reads db, and measures ages by
// now.
func newDBCollector(db queryer, now func() time.Time) *dbCollector {
	return &dbCollector{
		db:  db,
		now: now,
		outboxPending: prometheus.NewDesc("retrysafe_outbox_pending_events",
			"Outbox events not yet published (the relay's backlog), read from the database.", nil, nil),
		outboxOldestPending: prometheus.NewDesc("retrysafe_outbox_oldest_pending_age_seconds",
			"Age of the oldest outbox event not yet published, 0 if none; read from the database.", nil, nil),
		outboxFailed: prometheus.NewDesc("retrysafe_outbox_failed_events",
			"Outbox events marked failed after their last publish attempt, each holding back its order's later events until an operator acts; read from the database.", nil, nil),
		outboxUndelivered: prometheus.NewDesc("retrysafe_outbox_undelivered_events",
			"Outbox events published and not yet in every consumer's inbox, as of the reconciler's last sweep (in flight, or lost by the broker); read from the database.", nil, nil),
		outboxOldestUndelivered: prometheus.NewDesc("retrysafe_outbox_oldest_undelivered_age_seconds",
			"Time since the oldest undelivered event was published, 0 if none; past the delivery bound the reconciler publishes it again, so an age well past it means delivery is stuck. Read from the database.", nil, nil),
		sagas: prometheus.NewDesc("retrysafe_sagas",
			"Fulfilment sagas not ended, by state (in_progress, compensating, compensation_failed), read from the database.", []string{"state"}, nil),
	}
}

// Describe sends the gauges' descriptions.
func (c *dbCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.outboxPending
	ch <- c.outboxOldestPending
	ch <- c.outboxFailed
	ch <- c.outboxUndelivered
	ch <- c.outboxOldestUndelivered
	ch <- c.sagas
}

// Collect reads the gauges: the outbox's three, then the sagas, each group
// within metricsQueryTimeout. A query that fails sends an invalid metric in
// place of its group's gauges, which the handler logs and leaves out.
func (c *dbCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), metricsQueryTimeout)
	defer cancel()
	if err := c.collectOutbox(ctx, ch); err != nil {
		for _, desc := range []*prometheus.Desc{c.outboxPending, c.outboxOldestPending, c.outboxFailed, c.outboxUndelivered, c.outboxOldestUndelivered} {
			ch <- prometheus.NewInvalidMetric(desc, err)
		}
	}
	ctx, cancel = context.WithTimeout(context.Background(), metricsQueryTimeout)
	defer cancel()
	if err := c.collectSagas(ctx, ch); err != nil {
		ch <- prometheus.NewInvalidMetric(c.sagas, err)
	}
}

// collectOutbox sends the backlog, its oldest event's age and the failed
// events.
func (c *dbCollector) collectOutbox(ctx context.Context, ch chan<- prometheus.Metric) error {
	var pending, failed int64
	if err := c.db.QueryRowContext(ctx, scrapeOutboxPending).Scan(&pending); err != nil {
		return fmt.Errorf("count pending outbox events: %w", err)
	}
	var oldest sql.NullString // none pending: no row, and an age of 0
	err := c.db.QueryRowContext(ctx, scrapeOutboxOldestPending).Scan(&oldest)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("read oldest pending outbox event: %w", err)
	}
	if err := c.db.QueryRowContext(ctx, scrapeOutboxFailed).Scan(&failed); err != nil {
		return fmt.Errorf("count failed outbox events: %w", err)
	}
	var undelivered int64
	var oldestPublished sql.NullString
	if err := c.db.QueryRowContext(ctx, scrapeOutboxUndelivered).Scan(&undelivered, &oldestPublished); err != nil {
		return fmt.Errorf("count undelivered outbox events: %w", err)
	}
	oldestAge, err := c.ageOf(oldest)
	if err != nil {
		return fmt.Errorf("oldest pending outbox event: %w", err)
	}
	oldestUndeliveredAge, err := c.ageOf(oldestPublished)
	if err != nil {
		return fmt.Errorf("oldest undelivered outbox event: %w", err)
	}
	ch <- prometheus.MustNewConstMetric(c.outboxPending, prometheus.GaugeValue, float64(pending))
	ch <- prometheus.MustNewConstMetric(c.outboxOldestPending, prometheus.GaugeValue, oldestAge)
	ch <- prometheus.MustNewConstMetric(c.outboxFailed, prometheus.GaugeValue, float64(failed))
	ch <- prometheus.MustNewConstMetric(c.outboxUndelivered, prometheus.GaugeValue, float64(undelivered))
	ch <- prometheus.MustNewConstMetric(c.outboxOldestUndelivered, prometheus.GaugeValue, oldestUndeliveredAge)
	return nil
}

// ageOf returns the seconds from a stored time to now, 0 for none.
func (c *dbCollector) ageOf(stored sql.NullString) (float64, error) {
	if !stored.Valid {
		return 0, nil
	}
	at, err := time.Parse(timeFormat, stored.String)
	if err != nil {
		return 0, err
	}
	return max(c.now().Sub(at).Seconds(), 0), nil
}

// collectSagas sends the number of sagas in each state that has not ended,
// zero included.
func (c *dbCollector) collectSagas(ctx context.Context, ch chan<- prometheus.Metric) error {
	counts := map[sagaStatus]int64{sagaInProgress: 0, sagaCompensating: 0}
	rows, err := c.db.QueryContext(ctx, scrapeSagasRunning)
	if err != nil {
		return fmt.Errorf("count sagas by state: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var status sagaStatus
		var count int64
		if err := rows.Scan(&status, &count); err != nil {
			return fmt.Errorf("scan saga counts: %w", err)
		}
		if _, known := counts[status]; !known {
			return fmt.Errorf("bug: unhandled saga status %q", status)
		}
		counts[status] = count
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("count sagas by state: %w", err)
	}
	var compensationFailed int64
	if err := c.db.QueryRowContext(ctx, scrapeSagasCompensationFailed).Scan(&compensationFailed); err != nil {
		return fmt.Errorf("count sagas by state: %w", err)
	}
	counts[sagaCompensationFailed] = compensationFailed
	for status, count := range counts {
		ch <- prometheus.MustNewConstMetric(c.sagas, prometheus.GaugeValue, float64(count), string(status))
	}
	return nil
}

// logFormat is --log-format: how serve, relay, worker and demo --trace
// write their log lines.
type logFormat string

const (
	// logText is slog's key=value lines, for people.
	logText logFormat = "text"
	// logJSON is one JSON object per line, for machines.
	logJSON logFormat = "json"
)

// parseLogFormat returns the format named by --log-format, or an error
// naming the flag and the formats there are.
func parseLogFormat(name string) (logFormat, error) {
	switch format := logFormat(name); format {
	case logText, logJSON:
		return format, nil
	}
	return "", fmt.Errorf("--log-format %q: want text or json", name)
}

// addLogFormatFlag adds --log-format.
func addLogFormatFlag(cmd *cobra.Command, format *string) {
	cmd.Flags().StringVar(format, "log-format", string(logText), "log lines as text (key=value) or json (one object per line)")
}

// newLogger returns a logger that writes to out in format; opts may be nil.
func newLogger(out io.Writer, format logFormat, opts *slog.HandlerOptions) *slog.Logger {
	if format == logJSON {
		return slog.New(slog.NewJSONHandler(out, opts))
	}
	return slog.New(slog.NewTextHandler(out, opts))
}

// notice tells the operator something at start-up: as a plain line in text
// format, as a log record in json format, so that every line a machine
// reads is JSON.
func notice(out io.Writer, logger *slog.Logger, format logFormat, message string) {
	if format == logJSON {
		logger.Info(message)
		return
	}
	fmt.Fprintln(out, message)
}

// serveMetrics serves GET /metrics of app on listener, for --metrics-addr:
// an address of its own, never the API's. Its goroutine exits when ctx is done, after
// closing the server, or when the server fails (logged).
func serveMetrics(ctx context.Context, wg *sync.WaitGroup, listener net.Listener, app *App, logger *slog.Logger) {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", app.metrics.handler(logger))
	server := newHTTPServer(listener.Addr().String(), mux)
	wg.Add(1)
	go func() {
		defer wg.Done()
		served := make(chan error, 1)
		go func() { served <- server.Serve(listener) }()
		select {
		case <-ctx.Done():
			server.Close()
			<-served
		case err := <-served:
			logger.Error("metrics server stopped", "error", err)
		}
	}()
}
