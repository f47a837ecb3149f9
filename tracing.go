// Traces (OpenTelemetry): one order's work can be followed from POST
// /api/orders to the event that ends it, although the outbox, the broker,
// the inbox and the saga each run it in a transaction of their own, often in
// another process, and maybe minutes later. Without this, an operator who
// sees an order stuck holds a trace that ends at the 201.
//
// The creation context of every event (the W3C traceparent and tracestate
// of its "create" span) is written to the outbox row in the transaction that
// writes the event; the relay copies it into the message (a column of the
// embedded broker, headers on NATS); the consumer's spans and each saga
// step's span link to it, as the OpenTelemetry messaging conventions say
// (create, send, receive, process). They link rather than become children:
// a request that ended long ago is no parent of work done later, and a
// relay's batch has as many origins as events.
//
// Tracing is off unless OTEL_EXPORTER_OTLP_ENDPOINT is set: the App's
// tracer provider is then OpenTelemetry's no-op one, whose spans cost a few
// nanoseconds and record nothing. No global provider is set.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// tracerName is the instrumentation scope of every span retrysafe starts.
const tracerName = "retrysafe"

// Span attributes of retrysafe's own, beside the semantic conventions'.
const (
	// attrOrderID is the order a span worked on: the one id an operator
	// searches by.
	attrOrderID = attribute.Key("retrysafe.order.id")
	// attrInboxOutcome is what the inbox did with a delivery (inboxOutcome).
	attrInboxOutcome = attribute.Key("retrysafe.inbox.outcome")
	// attrDeliveryCount is the broker's delivery count: 2 or more is a
	// redelivery.
	attrDeliveryCount = attribute.Key("retrysafe.delivery.count")
	// attrSagaID, attrSagaStep and attrSagaThen describe a saga step's span.
	attrSagaID   = attribute.Key("retrysafe.saga.id")
	attrSagaStep = attribute.Key("retrysafe.saga.step")
	attrSagaThen = attribute.Key("retrysafe.saga.then")
)

// outboxMessagingSystem is messaging.system on a "create" span: the event is
// handed to retrysafe's outbox, whichever broker a relay later sends it to.
const outboxMessagingSystem = "retrysafe"

// system names the embedded broker as messaging.system.
func (b *embeddedBroker) system() string { return "retrysafe" }

// system names NATS as messaging.system.
func (b *natsBroker) system() string { return "nats" }

// traceContext is the W3C Trace Context of a message's creation, as the
// outbox row, the embedded broker's message, the NATS headers and the saga
// row carry it. Both fields are empty for an event created outside any
// trace.
type traceContext struct {
	TraceParent string
	TraceState  string
}

// Get returns the value of the header key in c: *traceContext is a
// propagation.TextMapCarrier, which the W3C propagator reads and writes.
func (c *traceContext) Get(key string) string {
	switch key {
	case "traceparent":
		return c.TraceParent
	case "tracestate":
		return c.TraceState
	}
	return ""
}

// Set sets the header key in c to value; the propagator sets no others.
func (c *traceContext) Set(key, value string) {
	switch key {
	case "traceparent":
		c.TraceParent = value
	case "tracestate":
		c.TraceState = value
	}
}

// Keys lists the headers c carries.
func (c *traceContext) Keys() []string {
	return []string{"traceparent", "tracestate"}
}

// traceContextOf returns the creation context that ctx's span gives a
// message: empty if ctx has no valid span context (tracing off and no
// traceparent came in).
func traceContextOf(ctx context.Context) traceContext {
	var carrier traceContext
	propagation.TraceContext{}.Inject(ctx, &carrier)
	return carrier
}

// traceContextFrom returns the context stored in two nullable columns.
func traceContextFrom(traceparent, tracestate sql.NullString) traceContext {
	return traceContext{TraceParent: traceparent.String, TraceState: tracestate.String}
}

// columns returns c as the values of its two nullable columns: NULL, not
// "", when there is none.
func (c traceContext) columns() (sql.NullString, sql.NullString) {
	return sql.NullString{String: c.TraceParent, Valid: c.TraceParent != ""},
		sql.NullString{String: c.TraceState, Valid: c.TraceState != ""}
}

// spanContext returns the span context c carries; an invalid one if c is
// empty or malformed (a traceparent that the W3C rules reject).
func (c traceContext) spanContext() trace.SpanContext {
	ctx := propagation.TraceContext{}.Extract(context.Background(), &c)
	return trace.SpanContextFromContext(ctx)
}

// link returns a link to the creation context c, with attrs, and false if
// c holds none.
func (c traceContext) link(attrs ...attribute.KeyValue) (trace.Link, bool) {
	spanContext := c.spanContext()
	if !spanContext.IsValid() {
		return trace.Link{}, false
	}
	return trace.Link{SpanContext: spanContext, Attributes: attrs}, true
}

// tracer returns the App's tracer.
func (a *App) tracer() trace.Tracer {
	return a.tracerProvider.Tracer(tracerName)
}

// tracingOn reports whether the App records spans. With the no-op provider
// (tracing off) the helpers below make no span at all, nor the attributes
// and links a span would be given: tracing off costs next to nothing.
func (a *App) tracingOn() bool {
	_, off := a.tracerProvider.(noop.TracerProvider)
	return !off
}

// observeRelay ends relayOnce's send span, and logs and counts what it
// published. A batch it published wakes the consumers in this process: they
// need not wait for their next poll.
func (a *App) observeRelay(span trace.Span, relayID string, events []outboxEvent, published int, err error) {
	defer span.End()
	if err != nil {
		failSpan(span, err)
		return
	}
	if published == 0 {
		return
	}
	a.wake.published()
	log := withTraceID(a.log, span.SpanContext())
	for _, event := range events {
		log.Info("relay published", "relay", relayID, "event_id", event.EventID, "event_type", event.EventType, "order_id", event.AggregateID)
	}
	a.metrics.published(published)
}

// failSpan marks span as failed by err.
func failSpan(span trace.Span, err error) {
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
	span.SetAttributes(semconv.ErrorTypeOther)
}

// withTraceID returns log with the trace_id of spanContext, so an
// operator can go from a background log line to its trace; log itself when
// the span context is not valid (tracing off), so that what is logged then
// does not change.
func withTraceID(log *slog.Logger, spanContext trace.SpanContext) *slog.Logger {
	if !spanContext.IsValid() {
		return log
	}
	return log.With("trace_id", spanContext.TraceID().String())
}

// traced starts a server span for each request to route, in the trace of
// the request's traceparent and tracestate when it has valid ones (W3C
// Trace Context; malformed ones are ignored, as the standard says, and the
// request starts a trace of its own). The handler's context carries the
// span, so the "create" span of the event it writes is the span's child.
func (s *server) traced(route string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := propagation.TraceContext{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		if !s.app.tracingOn() {
			// Nothing to record; the caller's context is passed on all
			// the same (startCreateSpan), as the no-op tracer would.
			next.ServeHTTP(w, r.WithContext(ctx))
			return
		}
		ctx, span := s.app.tracer().Start(ctx, r.Method+" "+route,
			trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(
				semconv.HTTPRequestMethodKey.String(r.Method),
				semconv.HTTPRoute(route),
				semconv.URLPath(r.URL.Path)))
		defer span.End()
		recorder := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(recorder, r.WithContext(ctx))
		span.SetAttributes(semconv.HTTPResponseStatusCode(recorder.status))
		if recorder.status >= 500 {
			span.SetStatus(codes.Error, http.StatusText(recorder.status))
		}
	})
}

// startCreateSpan starts the "create" span of event, a child of ctx's span
// (the request's, or the saga step's that writes the event), and returns
// the creation context to store with the event. The tracer is that of
// ctx's span: an event written outside any trace (tracing off and no
// traceparent came in; a test; a repair) gets no span and no context, and
// one written in a trace that is not recorded (tracing off, a traceparent
// came in) passes that trace's context on unchanged.
func startCreateSpan(ctx context.Context, event outboxEvent) (traceContext, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	switch {
	case !parent.SpanContext().IsValid():
		return traceContext{}, noop.Span{}
	case !parent.IsRecording():
		return traceContextOf(ctx), noop.Span{}
	}
	tracer := parent.TracerProvider().Tracer(tracerName)
	ctx, span := tracer.Start(ctx, "create "+event.EventType,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			semconv.MessagingSystemKey.String(outboxMessagingSystem),
			semconv.MessagingOperationTypeCreate,
			semconv.MessagingOperationName("create"),
			semconv.MessagingDestinationName(event.EventType),
			semconv.MessagingMessageID(event.EventID),
			attrOrderID.String(event.AggregateID)))
	return traceContextOf(ctx), span
}

// startSendSpan starts the relay's "send" span for events, published as one
// batch: a new trace (the relay's pass belongs to no request), kind client
// because the events' creation contexts are their "create" spans, with a
// link to each. A batch of one event, or of one event type, names it.
func (a *App) startSendSpan(ctx context.Context, relayID string, events []outboxEvent) (context.Context, trace.Span) {
	if !a.tracingOn() {
		return ctx, noop.Span{}
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(a.broker.system()),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingClientID(relayID),
	}
	links := make([]trace.Link, 0, len(events))
	oneSubject := true
	for _, event := range events {
		oneSubject = oneSubject && event.EventType == events[0].EventType
		link, ok := event.Trace.link(semconv.MessagingMessageID(event.EventID),
			semconv.MessagingDestinationName(event.EventType), attrOrderID.String(event.AggregateID))
		if ok {
			links = append(links, link)
		}
	}
	name := "send"
	if oneSubject {
		name += " " + events[0].EventType
		attrs = append(attrs, semconv.MessagingDestinationName(events[0].EventType))
	}
	if len(events) == 1 {
		attrs = append(attrs, semconv.MessagingMessageID(events[0].EventID), attrOrderID.String(events[0].AggregateID))
	} else {
		attrs = append(attrs, semconv.MessagingBatchMessageCount(len(events)))
	}
	return a.tracer().Start(ctx, name, trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attrs...), trace.WithLinks(links...))
}

// consumedBatch is what consumeOnce's observation keeps of one batch: the
// context of its "receive" span, and the span context of each delivery's
// "process" span, for the log's trace_id.
type consumedBatch struct {
	receiveCtx context.Context
	processed  []trace.SpanContext
}

// observeFetch records the "receive" span of a fetch by c that began at
// fetched, and counts its deliveries.
func (a *App) observeFetch(ctx context.Context, c consumer, deliveries []delivery, fetched time.Time) *consumedBatch {
	a.metrics.delivered(c.name, deliveries)
	return &consumedBatch{
		receiveCtx: a.traceReceive(ctx, c, deliveries, fetched),
		processed:  make([]trace.SpanContext, len(deliveries)),
	}
}

// receiveTraced puts d, the i-th delivery of batch, through the inbox in tx
// (a.entry.receiveIn: receiveIn unless demo --without replaced it), in a
// "process" span of its own.
func (a *App) receiveTraced(batch *consumedBatch, i int, tx *sql.Tx, undo *itemUndo, c consumer, d delivery) (receiveResult, error) {
	processCtx, span := a.startProcessSpan(batch.receiveCtx, c, d)
	batch.processed[i] = span.SpanContext()
	result, err := a.entry.receiveIn(processCtx, tx, undo, c.name, d.ID, d.DeliveryCount, maxDeliveries, func(tx *sql.Tx) error {
		if err := a.fault.at(processCtx, faultConsumerApply); err != nil {
			return err
		}
		return c.apply(processCtx, tx, d.message)
	})
	endProcessSpan(span, result, err)
	return result, err
}

// observeConsumed logs and counts what a committed batch did, and wakes
// the saga loop if the payment service applied a message: it may have
// started a saga (startFulfilment), which it can run now that it is
// committed. (The order service starts none: waking the loop for it was a
// claim that found nothing, a transaction on PostgreSQL, per order.)
func (a *App) observeConsumed(ctx context.Context, c consumer, deliveries []delivery, results []receiveResult, batch *consumedBatch) {
	if a.log.Enabled(ctx, slog.LevelInfo) {
		for i, d := range deliveries {
			withTraceID(a.log, batch.processed[i]).Info("inbox", "consumer", c.name, "message_id", d.ID, "event_type", d.Subject, "order_id", payloadOrderID(d.Payload),
				"delivery", d.DeliveryCount, "outcome", string(results[i].Outcome))
		}
	}
	for _, result := range results {
		a.metrics.inboxOutcome(c.name, result.Outcome)
	}
	a.observeFinalStates(ctx, c, deliveries, results)
	for _, result := range results {
		if result.Outcome == inboxApplied && c.name == paymentServiceConsumer {
			a.wake.saga.signal()
			break
		}
	}
}

// traceReceive records the "receive" span of a fetch by c that began at
// fetched and returned deliveries: a new trace, with a link to each
// message's creation context. It returns the context whose span parents
// the batch's "process" spans. A fetch that found nothing records nothing:
// the consume loops poll several times a second.
//
// fetched is the wall clock's, as every span's time is, not the App's.
func (a *App) traceReceive(ctx context.Context, c consumer, deliveries []delivery, fetched time.Time) context.Context {
	if !a.tracingOn() {
		return ctx
	}
	links := make([]trace.Link, 0, len(deliveries))
	for _, d := range deliveries {
		link, ok := d.Trace.link(semconv.MessagingMessageID(d.ID), semconv.MessagingDestinationName(d.Subject))
		if ok {
			links = append(links, link)
		}
	}
	ctx, span := a.tracer().Start(ctx, "receive "+c.name, trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindClient),
		trace.WithTimestamp(fetched), trace.WithLinks(links...),
		trace.WithAttributes(
			semconv.MessagingSystemKey.String(a.broker.system()),
			semconv.MessagingOperationTypeReceive,
			semconv.MessagingOperationName("receive"),
			semconv.MessagingConsumerGroupName(c.name),
			semconv.MessagingDestinationSubscriptionName(c.name),
			semconv.MessagingBatchMessageCount(len(deliveries))))
	span.End()
	return ctx
}

// startProcessSpan starts the "process" span of d at c, a child of the
// batch's "receive" span in ctx, with a link to the message's creation
// context: the trace of the request (or saga step) that wrote the event.
func (a *App) startProcessSpan(ctx context.Context, c consumer, d delivery) (context.Context, trace.Span) {
	if !a.tracingOn() {
		return ctx, noop.Span{}
	}
	var links []trace.Link
	if link, ok := d.Trace.link(semconv.MessagingMessageID(d.ID)); ok {
		links = append(links, link)
	}
	return a.tracer().Start(ctx, "process "+d.Subject, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithLinks(links...),
		trace.WithAttributes(
			semconv.MessagingSystemKey.String(a.broker.system()),
			semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"),
			semconv.MessagingDestinationName(d.Subject),
			semconv.MessagingMessageID(d.ID),
			semconv.MessagingConsumerGroupName(c.name),
			attrDeliveryCount.Int(d.DeliveryCount),
			attrOrderID.String(payloadOrderID(d.Payload))))
}

// endProcessSpan ends a "process" span with the inbox's outcome: a poison
// message or one to retry is an error; an applied or duplicate one is not.
// err is receiveIn's: the batch's transaction fails with it.
func endProcessSpan(span trace.Span, result receiveResult, err error) {
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(attrInboxOutcome.String(string(result.Outcome)))
	switch {
	case err != nil:
		failSpan(span, err)
	case result.Err != nil:
		failSpan(span, result.Err)
	}
	span.End()
}

// startSagaSpan starts the span of what this round does to run's saga: its
// pending step ("saga reserve_stock"), the undoing of a done one ("saga
// compensate charge_card"), or its end once all are undone ("saga
// cancel", which writes OrderCancelled). It is a new trace, linked to the
// creation context of the OrderCreated that started the saga
// (startFulfilment stored it): the request that created the order ended
// long before. A saga with nothing to do this round gets a no-op span.
func (a *App) startSagaSpan(ctx context.Context, run *sagaRun) {
	run.span = noop.Span{}
	name := ""
	switch {
	case !a.tracingOn(), run.unexpected != nil:
		return
	case run.saga.Status == sagaInProgress && run.stepOK:
		name = "saga " + run.step.Name
	case run.saga.Status == sagaCompensating && run.stepOK:
		name = "saga compensate " + run.step.Name
	case run.saga.Status == sagaCompensating:
		name = "saga cancel"
	default:
		return
	}
	var links []trace.Link
	if link, ok := run.saga.Trace.link(semconv.MessagingDestinationName(eventOrderCreated)); ok {
		links = append(links, link)
	}
	_, run.span = a.tracer().Start(ctx, name, trace.WithNewRoot(), trace.WithLinks(links...),
		trace.WithAttributes(
			attrSagaID.String(run.saga.SagaID),
			attrOrderID.String(run.saga.OrderID),
			attrSagaStep.String(run.step.Name)))
}

// endSagaSpan ends run's span with what became of the saga.
func endSagaSpan(run *sagaRun, next sagaNext) {
	if !run.span.IsRecording() {
		return
	}
	run.span.SetAttributes(attrSagaThen.String(next.String()))
	if run.called && run.callErr != nil {
		failSpan(run.span, run.callErr)
	}
	run.span.End()
}

// failSagaSpans ends the spans of a round that failed with err (the
// worker stops: a crash, the database). A span that ended already stays as
// it was: ending twice does nothing.
func failSagaSpans(runs []*sagaRun, err error) {
	if err == nil {
		return
	}
	for _, run := range runs {
		if run.span == nil {
			continue
		}
		failSpan(run.span, err)
		run.span.End()
	}
}

// otlpEndpointVariables are the standard variables that name where OTLP
// traces go: the base URL of a collector, or the URL of its traces path.
var otlpEndpointVariables = []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}

// otlpEndpointSet reports whether the standard variables ask for an OTLP
// exporter of traces.
func otlpEndpointSet() bool {
	for _, name := range otlpEndpointVariables {
		if os.Getenv(name) != "" {
			return true
		}
	}
	return false
}

// checkOTLPEndpoint returns an error naming the variable unless each OTLP
// endpoint that is set is an http:// or https:// URL with a host. The
// exporter would skip a malformed one with a line on stderr and send the
// spans to its default, https://localhost:4318, instead. serve, relay and
// worker check it before they touch the database.
func checkOTLPEndpoint() error {
	for _, name := range otlpEndpointVariables {
		value := os.Getenv(name)
		if value == "" {
			continue
		}
		u, err := url.Parse(value)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s=%q: want an http:// or https:// URL, such as http://127.0.0.1:4318", name, value)
		}
	}
	return nil
}

// traceShutdownTimeout bounds the flush of the last spans when a process
// stops: a collector that is down must not hold the shutdown.
const traceShutdownTimeout = 5 * time.Second

// startTracing gives app a tracer provider that exports its spans over
// OTLP/HTTP, in batches, when OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; the exporter reads the other
// standard variables (OTEL_EXPORTER_OTLP_HEADERS, ..._TIMEOUT,
// OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER...). Unset,
// app keeps its no-op provider. It returns what flushes the spans and stops
// the provider, for the process's exit. role and workerID name the process
// in the spans' resource.
func startTracing(ctx context.Context, app *App, out io.Writer, role, workerID string) (func(), error) {
	if !otlpEndpointSet() {
		return func() {}, nil
	}
	if err := checkOTLPEndpoint(); err != nil {
		return nil, err
	}
	exporter, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	// Later options win: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
	// override the defaults.
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName("retrysafe"), semconv.ServiceInstanceID(workerID),
			attribute.String("retrysafe.role", role)),
		resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	app.tracerProvider = provider
	endpoint := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" {
		endpoint = os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	fmt.Fprintf(out, "traces: exporting spans over OTLP/HTTP to %s\n", endpoint)
	return func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), traceShutdownTimeout)
		defer cancel()
		if err := provider.Shutdown(shutdownCtx); err != nil {
			fmt.Fprintf(out, "traces: flush the last spans: %v\n", err)
		}
	}, nil
}
