package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// The client's trace in the tests: the traceparent and tracestate a
// caller of POST /api/orders sends.
const (
	clientTraceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpanID      = "00f067aa0ba902b7"
	clientTraceparent = "00-" + clientTraceID + "-" + clientSpanID + "-01"
	clientTracestate  = "vendor=opaque"
)

// recordSpans gives env's App a tracer provider that keeps every span in
// memory, exported as each ends.
func recordSpans(tb testing.TB, env *testEnv) *tracetest.InMemoryExporter {
	tb.Helper()
	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	tb.Cleanup(func() { provider.Shutdown(context.Background()) })
	env.app.tracerProvider = provider
	return exporter
}

// postTraced sends POST path with the client's traceparent (if given) and
// returns the status and body.
func postTraced(tb testing.TB, ts *httptest.Server, path, key, body, traceparent, tracestate string) (int, string) {
	tb.Helper()
	req, err := http.NewRequest("POST", ts.URL+path, strings.NewReader(body))
	if err != nil {
		tb.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+keyUser42)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	if traceparent != "" {
		req.Header.Set("traceparent", traceparent)
	}
	if tracestate != "" {
		req.Header.Set("tracestate", tracestate)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return resp.StatusCode, string(answer)
}

// spanAttr returns the attribute key of span as text, "" if it has none.
func spanAttr(span tracetest.SpanStub, key attribute.Key) string {
	for _, kv := range span.Attributes {
		if kv.Key == key {
			return kv.Value.String()
		}
	}
	return ""
}

// spansNamed returns the spans called name, in the order they ended.
func spansNamed(spans tracetest.SpanStubs, name string) []tracetest.SpanStub {
	var named []tracetest.SpanStub
	for _, span := range spans {
		if span.Name == name {
			named = append(named, span)
		}
	}
	return named
}

// oneSpanNamed returns the one span called name, and fails the test unless
// there is exactly one.
func oneSpanNamed(tb testing.TB, spans tracetest.SpanStubs, name string) tracetest.SpanStub {
	tb.Helper()
	named := spansNamed(spans, name)
	if len(named) != 1 {
		tb.Fatalf("%d spans called %q, want 1; spans: %s", len(named), name, spanNames(spans))
	}
	return named[0]
}

// spanNames lists the names of spans, for a failure message.
func spanNames(spans tracetest.SpanStubs) string {
	var names []string
	for _, span := range spans {
		names = append(names, span.Name)
	}
	return strings.Join(names, ", ")
}

// linkTo returns span's link to the span context target, and whether it has
// one.
func linkTo(span tracetest.SpanStub, target trace.SpanContext) (sdktrace.Link, bool) {
	for _, link := range span.Links {
		if link.SpanContext.TraceID() == target.TraceID() && link.SpanContext.SpanID() == target.SpanID() {
			return link, true
		}
	}
	return sdktrace.Link{}, false
}

// mustLinkTo fails the test unless span links to the span target.
func mustLinkTo(tb testing.TB, span, target tracetest.SpanStub) sdktrace.Link {
	tb.Helper()
	link, ok := linkTo(span, target.SpanContext)
	if !ok {
		tb.Fatalf("span %q (trace %s) does not link to %q (span %s); its links: %v",
			span.Name, span.SpanContext.TraceID(), target.Name, target.SpanContext.SpanID(), span.Links)
	}
	return link
}

// traceparentOf is the traceparent header of span, as the outbox stores it.
func traceparentOf(span tracetest.SpanStub) string {
	return "00-" + span.SpanContext.TraceID().String() + "-" + span.SpanContext.SpanID().String() + "-01"
}

// mustHaveMessagingAttrs fails the test unless span is a messaging span of
// the operation type op on messaging system, and, when it handles one
// message, names its destination and id.
func mustHaveMessagingAttrs(tb testing.TB, span tracetest.SpanStub, system, op, destination, messageID string) {
	tb.Helper()
	for key, want := range map[attribute.Key]string{
		"messaging.system":           system,
		"messaging.operation.type":   op,
		"messaging.destination.name": destination,
		"messaging.message.id":       messageID,
	} {
		if got := spanAttr(span, key); got != want {
			tb.Errorf("span %q has %s=%q, want %q", span.Name, key, got, want)
		}
	}
}

// redeliver waits until c gets its message again, which it applied and
// did not ack, and returns what the inbox made of it: on the embedded
// broker once the App's clock passes ackWait; on NATS once the broker's
// real AckWait passed.
func redeliver(tb testing.TB, env *testEnv, onNATS bool, c consumer) []receiveResult {
	tb.Helper()
	ctx := context.Background()
	if !onNATS {
		env.clock.advance(env.app.leases.ackWait)
	}
	var results []receiveResult
	eventually(tb, c.name+" to get its message again", waitLimit, func() (bool, string) {
		var err error
		results, err = env.app.consumeOnce(ctx, c, 10)
		if err != nil {
			tb.Fatal(err)
		}
		return len(results) > 0, "no delivery"
	})
	return results
}

// traceOneOrder drives one order through every layer under an in-memory
// exporter, with a relay crash after publishing and a redelivery to the
// payment service, and checks the spans. broker is the NATS broker, or nil
// for the embedded one.
func traceOneOrder(t *testing.T, env *testEnv, broker *natsBroker) {
	ctx := context.Background()
	exporter := recordSpans(t, env)
	var logs bytes.Buffer
	env.app.log = slog.New(slog.NewJSONHandler(&logs, nil))
	ts := newTestServer(t, env)
	system := env.app.broker.system()

	status, body := postTraced(t, ts, "/api/orders", "traced-1", orderBody(5000, "sku-1", 1, pmCardVisa), clientTraceparent, clientTracestate)
	if status != 201 {
		t.Fatalf("create: %d %s", status, body)
	}
	orderID := orderField([]byte(body), "order_id")
	// The relay publishes, and dies before it marks the event published;
	// once its lease passed, another relay publishes it again.
	env.fault.crashAt(faultAfterPublish)
	if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); !errors.Is(err, errCrash) {
		t.Fatalf("relay: %v, want the crash", err)
	}
	env.clock.advance(env.app.leases.relay)
	if n, err := env.app.relayOnce(ctx, "relay-2", relayBatchSize); err != nil || n != 1 {
		t.Fatalf("republished %d, %v; want 1", n, err)
	}
	// The payment service applies OrderCreated and dies before its ack; the
	// broker delivers it again, and the inbox skips it.
	payments := env.app.consumers()[0]
	env.fault.crashAt(faultAfterEffect)
	if _, err := env.app.consumeOnce(ctx, payments, 10); !errors.Is(err, errCrash) {
		t.Fatalf("consume: %v, want the crash", err)
	}
	if results := redeliver(t, env, broker != nil, payments); len(results) != 1 || results[0].Outcome != inboxDuplicate {
		t.Fatalf("the redelivery: %+v, want one duplicate", results)
	}
	// The saga's steps, PaymentCaptured through the relay, the order paid.
	env.drain(t)
	if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != "paid" {
		t.Fatalf("order %s is %s, want paid", orderID, got)
	}
	orderCreatedID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, orderID)
	paymentCapturedID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'PaymentCaptured'`, orderID)
	spans := exporter.GetSpans()

	// The request continues the client's trace.
	post := oneSpanNamed(t, spans, "POST /api/orders")
	if post.SpanKind != trace.SpanKindServer || post.SpanContext.TraceID().String() != clientTraceID ||
		post.Parent.SpanID().String() != clientSpanID || !post.Parent.IsRemote() {
		t.Fatalf("the POST's span is %v in trace %s under %s, want a server span continuing %s", post.SpanKind,
			post.SpanContext.TraceID(), post.Parent.SpanID(), clientTraceparent)
	}
	if got := spanAttr(post, "http.response.status_code"); got != "201" {
		t.Errorf("the POST's span has status %s, want 201", got)
	}

	// OrderCreated is created in the request, and its creation context is
	// stored with it: in the outbox, in the broker, in the saga.
	createdOC := oneSpanNamed(t, spans, "create "+eventOrderCreated)
	if createdOC.SpanKind != trace.SpanKindProducer || createdOC.Parent.SpanID() != post.SpanContext.SpanID() {
		t.Fatalf("create OrderCreated is %v under %s, want a producer span under the POST's %s", createdOC.SpanKind, createdOC.Parent.SpanID(), post.SpanContext.SpanID())
	}
	mustHaveMessagingAttrs(t, createdOC, outboxMessagingSystem, "create", eventOrderCreated, orderCreatedID)
	stored := map[string]string{
		"outbox_events":  env.str(t, `SELECT traceparent || ' ' || tracestate FROM outbox_events WHERE event_id = ?`, orderCreatedID),
		"saga_instances": env.str(t, `SELECT traceparent || ' ' || tracestate FROM saga_instances WHERE order_id = ?`, orderID),
	}
	if broker == nil {
		stored["broker_messages"] = env.str(t, `SELECT traceparent || ' ' || tracestate FROM broker_messages WHERE message_id = ?`, orderCreatedID)
	} else {
		stored["NATS headers"] = natsTraceHeaders(t, broker, orderCreatedID)
	}
	for where, got := range stored {
		if want := traceparentOf(createdOC) + " " + clientTracestate; got != want {
			t.Errorf("%s holds the creation context %q, want %q", where, got, want)
		}
	}

	// The relay's two sends, the failed one and the republish, link to it.
	sends := spansNamed(spans, "send "+eventOrderCreated)
	if len(sends) != 2 || sends[0].Status.Code != codes.Error || sends[1].Status.Code == codes.Error {
		t.Fatalf("%d sends of OrderCreated, want 2: the one that crashed (an error), the republish (none)", len(sends))
	}
	for _, send := range sends {
		if send.SpanKind != trace.SpanKindClient {
			t.Errorf("send is a %v span, want client: the create span is the creation context", send.SpanKind)
		}
		link := mustLinkTo(t, send, createdOC)
		if !hasAttr(link.Attributes, "messaging.message.id", orderCreatedID) {
			t.Errorf("the send's link has %v, want messaging.message.id %s", link.Attributes, orderCreatedID)
		}
		mustHaveMessagingAttrs(t, send, system, "send", eventOrderCreated, orderCreatedID)
	}

	// The payment service's two deliveries: applied, then a duplicate, each
	// processed in a span linked to the creation context.
	processes := spansNamed(spans, "process "+eventOrderCreated)
	if len(processes) != 2 {
		t.Fatalf("%d process spans of OrderCreated, want 2", len(processes))
	}
	receives := spansNamed(spans, "receive "+paymentServiceConsumer)
	for i, want := range []inboxOutcome{inboxApplied, inboxDuplicate} {
		process := processes[i]
		if got := spanAttr(process, attrInboxOutcome); got != string(want) {
			t.Errorf("delivery %d was %s, want %s", i+1, got, want)
		}
		if process.SpanKind != trace.SpanKindConsumer {
			t.Errorf("process is a %v span, want consumer", process.SpanKind)
		}
		mustLinkTo(t, process, createdOC)
		mustHaveMessagingAttrs(t, process, system, "process", eventOrderCreated, orderCreatedID)
		underReceive := false
		for _, receive := range receives {
			underReceive = underReceive || process.Parent.SpanID() == receive.SpanContext.SpanID()
		}
		if !underReceive {
			t.Errorf("delivery %d is not processed under a receive span", i+1)
		}
	}
	if got := spanAttr(processes[1], attrDeliveryCount); got != "2" {
		t.Errorf("the redelivery's delivery count is %s, want 2", got)
	}
	for _, receive := range receives {
		mustLinkTo(t, receive, createdOC)
		if got := spanAttr(receive, "messaging.operation.type"); got != "receive" {
			t.Errorf("receive span has operation type %q", got)
		}
	}

	// Each saga step links to the same creation context, read from the saga.
	for _, step := range fulfilmentSteps() {
		span := oneSpanNamed(t, spans, "saga "+step)
		mustLinkTo(t, span, createdOC)
		if span.Parent.IsValid() {
			t.Errorf("saga %s is a child of %s, want a trace of its own", step, span.Parent.SpanID())
		}
	}

	// PaymentCaptured is created in the confirm step's span, and the order
	// service's processing links to that.
	confirm := oneSpanNamed(t, spans, "saga "+stepConfirm)
	createdPC := oneSpanNamed(t, spans, "create "+eventPaymentCaptured)
	if createdPC.Parent.SpanID() != confirm.SpanContext.SpanID() {
		t.Fatalf("create PaymentCaptured is under %s, want the confirm step's %s", createdPC.Parent.SpanID(), confirm.SpanContext.SpanID())
	}
	if got := env.str(t, `SELECT traceparent FROM outbox_events WHERE event_id = ?`, paymentCapturedID); got != traceparentOf(createdPC) {
		t.Errorf("the PaymentCaptured row holds %q, want %q", got, traceparentOf(createdPC))
	}
	mustLinkTo(t, oneSpanNamed(t, spans, "send "+eventPaymentCaptured), createdPC)
	processPC := oneSpanNamed(t, spans, "process "+eventPaymentCaptured)
	mustLinkTo(t, processPC, createdPC)
	mustHaveMessagingAttrs(t, processPC, system, "process", eventPaymentCaptured, paymentCapturedID)
	if got := spanAttr(processPC, attrInboxOutcome); got != string(inboxApplied) {
		t.Errorf("the order service's PaymentCaptured was %s, want applied", got)
	}

	// Every span of the order is in the POST's trace or links to a trace
	// that is: no background span is the request's child.
	mustAllReachTrace(t, spans, post.SpanContext.TraceID())
	for _, span := range spans {
		background := !strings.HasPrefix(span.Name, "POST ") && !strings.HasPrefix(span.Name, "create "+eventOrderCreated)
		if background && span.SpanContext.TraceID() == post.SpanContext.TraceID() {
			t.Errorf("%q is in the request's trace, want a trace of its own linked to it", span.Name)
		}
	}

	// Each background log line names the trace of the span that did it.
	mustLogTraceIDs(t, logs.Bytes(), spans)
}

// hasAttr reports whether attrs hold key with the text value want.
func hasAttr(attrs []attribute.KeyValue, key attribute.Key, want string) bool {
	for _, kv := range attrs {
		if kv.Key == key && kv.Value.String() == want {
			return true
		}
	}
	return false
}

// mustAllReachTrace fails the test unless every span is in the trace
// root, or links to a span of a trace that is in it or links to it, and
// so on.
func mustAllReachTrace(tb testing.TB, spans tracetest.SpanStubs, root trace.TraceID) {
	tb.Helper()
	reached := map[trace.TraceID]bool{root: true}
	for grew := true; grew; {
		grew = false
		for _, span := range spans {
			if reached[span.SpanContext.TraceID()] {
				continue
			}
			for _, link := range span.Links {
				if reached[link.SpanContext.TraceID()] {
					reached[span.SpanContext.TraceID()] = true
					grew = true
					break
				}
			}
		}
	}
	for _, span := range spans {
		if !reached[span.SpanContext.TraceID()] {
			tb.Errorf("span %q (trace %s) neither shares the POST's trace %s nor links to it", span.Name, span.SpanContext.TraceID(), root)
		}
	}
}

// mustLogTraceIDs fails the test unless every background log line (relay,
// inbox, saga) names, as trace_id, the trace of a span of its kind.
func mustLogTraceIDs(tb testing.TB, logs []byte, spans tracetest.SpanStubs) {
	tb.Helper()
	spanPrefix := map[string][]string{
		"relay published":      {"send "},
		"inbox":                {"process ", "receive "},
		"saga step":            {"saga "},
		"saga compensated":     {"saga "},
		"relay publish failed": {"send "},
	}
	lines := 0
	for _, line := range bytes.Split(bytes.TrimSpace(logs), []byte("\n")) {
		var record map[string]any
		if err := json.Unmarshal(line, &record); err != nil {
			tb.Fatalf("a log line that is not JSON: %s", line)
		}
		msg, _ := record["msg"].(string)
		prefixes, background := spanPrefix[msg]
		if !background {
			continue
		}
		lines++
		traceID, _ := record["trace_id"].(string)
		found := false
		for _, span := range spans {
			for _, prefix := range prefixes {
				found = found || (strings.HasPrefix(span.Name, prefix) && span.SpanContext.TraceID().String() == traceID)
			}
		}
		if !found {
			tb.Errorf("log line %s has trace_id %q, which is no trace of a %v span", line, traceID, prefixes)
		}
	}
	if lines == 0 {
		tb.Error("no background log lines")
	}
}

// natsTraceHeaders returns "traceparent tracestate" of the message
// messageID in broker's stream.
func natsTraceHeaders(tb testing.TB, broker *natsBroker, messageID string) string {
	tb.Helper()
	ctx := context.Background()
	stream, err := broker.js.Stream(ctx, broker.stream)
	if err != nil {
		tb.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		msg, err := stream.GetMsg(ctx, seq)
		if err != nil {
			tb.Fatal(err)
		}
		if msg.Header.Get("Nats-Msg-Id") == messageID {
			return msg.Header.Get("traceparent") + " " + msg.Header.Get("tracestate")
		}
	}
	tb.Fatalf("no message %s in stream %s", messageID, broker.stream)
	return ""
}

func TestTracing(t *testing.T) {
	// Ensure one order's spans, from the POST to PaymentCaptured at the
	// order service, share the POST's trace or link to it, across a relay
	// crash and a redelivery, with the messaging attributes set (on
	// PostgreSQL too, with RETRYSAFE_TEST_POSTGRES).
	t.Run("OneOrderIsOneTraceOrLinkedToIt", func(t *testing.T) {
		traceOneOrder(t, MustOpenApp(t), nil)
	})

	// Ensure the creation context travels in NATS headers as it does in
	// the embedded broker's column.
	t.Run("OneOrderOverNATS", func(t *testing.T) {
		env := MustOpenApp(t)
		broker := useTestNATS(t, env, time.Second)
		traceOneOrder(t, env, broker)
	})

	// Ensure a refund continues its caller's trace, and OrderRefunded is
	// created in it.
	t.Run("RefundContinuesItsTrace", func(t *testing.T) {
		env := MustOpenApp(t)
		exporter := recordSpans(t, env)
		ts := newTestServer(t, env)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		status, body := postTraced(t, ts, "/api/orders/"+orderID+"/refund", "refund-1", "{}", clientTraceparent, "")
		if status != 200 && status != 201 {
			t.Fatalf("refund: %d %s", status, body)
		}
		spans := exporter.GetSpans()
		refund := oneSpanNamed(t, spans, "POST /api/orders/{id}/refund")
		if refund.SpanContext.TraceID().String() != clientTraceID || spanAttr(refund, "http.route") != "/api/orders/{id}/refund" {
			t.Fatalf("the refund's span is in trace %s with route %s, want %s and the route", refund.SpanContext.TraceID(), spanAttr(refund, "http.route"), clientTraceID)
		}
		created := oneSpanNamed(t, spans, "create "+eventOrderRefunded)
		if created.SpanContext.TraceID() != refund.SpanContext.TraceID() {
			t.Fatalf("create OrderRefunded is in trace %s, want the refund's", created.SpanContext.TraceID())
		}
		if got := env.str(t, `SELECT traceparent FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderRefunded'`, orderID); got != traceparentOf(created) {
			t.Fatalf("the OrderRefunded row holds %q, want %q", got, traceparentOf(created))
		}
	})

	// Ensure a malformed traceparent is ignored, as W3C Trace Context says:
	// the request succeeds and starts a trace of its own.
	t.Run("MalformedTraceparentStartsATrace", func(t *testing.T) {
		env := MustOpenApp(t)
		exporter := recordSpans(t, env)
		ts := newTestServer(t, env)
		malformed := "00-" + strings.Repeat("0", 32) + "-" + clientSpanID + "-01" // an all-zero trace id is invalid
		status, body := postTraced(t, ts, "/api/orders", "k1", orderBody(5000, "sku-1", 1, pmCardVisa), malformed, "")
		if status != 201 {
			t.Fatalf("create with a malformed traceparent: %d %s, want 201", status, body)
		}
		post := oneSpanNamed(t, exporter.GetSpans(), "POST /api/orders")
		if post.Parent.IsValid() || !post.SpanContext.IsValid() {
			t.Fatalf("the POST's span has parent %v, want a new trace", post.Parent)
		}
	})

	// Ensure that with tracing off nothing is recorded, an event created
	// outside any trace stores no context, and a client's traceparent is
	// passed on unchanged (as OpenTelemetry's no-op tracer does).
	t.Run("OffRecordsNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		if _, ok := env.app.tracerProvider.(noop.TracerProvider); !ok {
			t.Fatalf("a new App's tracer provider is %T, want the no-op one", env.app.tracerProvider)
		}
		ts := newTestServer(t, env)
		if status, body := postTraced(t, ts, "/api/orders", "plain", orderBody(5000, "sku-1", 1, pmCardVisa), "", ""); status != 201 {
			t.Fatalf("create: %d %s", status, body)
		}
		if status, body := postTraced(t, ts, "/api/orders", "traced", orderBody(5000, "sku-1", 1, pmCardVisa), clientTraceparent, ""); status != 201 {
			t.Fatalf("create: %d %s", status, body)
		}
		got := env.str(t, `SELECT string_agg(COALESCE(traceparent, 'NULL'), ' ' ORDER BY seq) FROM outbox_events`)
		if want := "NULL " + clientTraceparent; got != want {
			t.Fatalf("the outbox holds %q, want %q", got, want)
		}
	})

	// Ensure serve, relay and worker refuse an OTLP endpoint that is not
	// an http(s) URL, naming the variable, before they touch the
	// database: the exporter would send the spans elsewhere.
	t.Run("MalformedEndpointIsRefused", func(t *testing.T) {
		for _, command := range []string{"serve", "relay", "worker"} {
			for _, name := range otlpEndpointVariables {
				t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
				t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
				t.Setenv(name, "localhost:4318")
				path := filepath.Join(t.TempDir(), "never.db")
				args := []string{command, "--db", path}
				if command == "serve" {
					args = append(args, "--addr", "127.0.0.1:0")
				}
				var out bytes.Buffer
				err := run(context.Background(), args, strings.NewReader(""), &out, &out)
				if err == nil || !strings.Contains(out.String(), name+`="localhost:4318": want an http:// or https:// URL`) {
					t.Fatalf("%s with %s=localhost:4318: %v\n%s\nwant a refusal naming the variable", command, name, err, out.String())
				}
				if _, statErr := os.Stat(path); statErr == nil {
					t.Fatalf("%s created %s before refusing", command, path)
				}
			}
		}
	})

	// Ensure serve, relay and worker export over OTLP/HTTP when
	// OTEL_EXPORTER_OTLP_ENDPOINT is set, flush at stop, and keep the
	// no-op provider when it is not.
	t.Run("ExportsOnlyWithAnEndpoint", func(t *testing.T) {
		env := MustOpenApp(t)
		t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
		t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
		var out bytes.Buffer
		stop, err := startTracing(context.Background(), env.app, &out, "worker", "worker@test")
		if err != nil {
			t.Fatal(err)
		}
		stop()
		if _, ok := env.app.tracerProvider.(noop.TracerProvider); !ok || out.Len() != 0 {
			t.Fatalf("without an endpoint: provider %T, printed %q; want the no-op one, silently", env.app.tracerProvider, out.String())
		}

		var mu sync.Mutex
		var paths []string
		collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			paths = append(paths, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type"))
			mu.Unlock()
			w.Header().Set("Content-Type", "application/x-protobuf")
		}))
		defer collector.Close()
		t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
		stop, err = startTracing(context.Background(), env.app, &out, "worker", "worker@test")
		if err != nil {
			t.Fatal(err)
		}
		_, span := env.app.tracer().Start(context.Background(), "test")
		span.End()
		stop()
		mu.Lock()
		defer mu.Unlock()
		if len(paths) == 0 || paths[0] != "POST /v1/traces application/x-protobuf" {
			t.Fatalf("the collector got %v, want the span POSTed to /v1/traces at stop", paths)
		}
		if !strings.Contains(out.String(), "traces: exporting spans over OTLP/HTTP to "+collector.URL) {
			t.Fatalf("startTracing printed %q, want it to say where spans go", out.String())
		}
	})
}

// discardExporter drops every span it is given: the cost measured is the
// spans' making and batching, not a collector's.
type discardExporter struct{}

// ExportSpans drops spans.
func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }

// Shutdown does nothing.
func (discardExporter) Shutdown(context.Context) error { return nil }

// BenchmarkCreateOrderTracing is fresh creates through the HTTP handler (in
// process, no network), each with a client's traceparent, with tracing off
// (the no-op provider, as without OTEL_EXPORTER_OTLP_ENDPOINT) and on (the
// SDK with a batch processor, as serve sets up, exporting to nowhere): the
// server span, the create span and the two columns.
func BenchmarkCreateOrderTracing(b *testing.B) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)
	for _, mode := range []string{"off", "on"} {
		b.Run(mode, func(b *testing.B) {
			app := benchApp(b, durabilityNormal)
			if mode == "on" {
				provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}))
				b.Cleanup(func() { provider.Shutdown(context.Background()) })
				app.tracerProvider = provider
			}
			s := &server{app: app, apiKeys: map[string]string{keyUser42: "user-42"}, logger: discardLogger()}
			handler := s.routes()
			i := 0
			for b.Loop() {
				i++
				req := httptest.NewRequest("POST", "/api/orders", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+keyUser42)
				req.Header.Set("Idempotency-Key", "trace-"+mode+"-"+strconv.Itoa(i))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("traceparent", clientTraceparent)
				recorder := httptest.NewRecorder()
				handler.ServeHTTP(recorder, req)
				if recorder.Code != http.StatusCreated {
					b.Fatalf("got %d %s; want 201", recorder.Code, recorder.Body)
				}
			}
			reportOpsPerSecond(b, "orders/s")
		})
	}
}

// Ensure docs/observability.md's "Traces" section names exactly the spans retrysafe
// makes: every span name of its table is made by a paid, a declined and a
// refunded order, and every span they make is in the table; and the
// command it shows turns tracing on.
func TestDocsTracesSection(t *testing.T) {
	readme, err := os.ReadFile("docs/observability.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## Traces\n")
	if !ok {
		t.Fatal("docs/observability.md has no section \"Traces\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var patterns []*regexp.Regexp
	var names []string
	for _, line := range strings.Split(section, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		first := strings.Split(line, "|")[1]
		for _, name := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			names = append(names, name[1])
			// {event}, {consumer} and {step} stand for an event type, a
			// consumer and a saga step; {id} is the route's own.
			pattern := regexp.QuoteMeta(name[1])
			pattern = strings.ReplaceAll(pattern, `\{event\}`, "("+strings.Join([]string{eventOrderCreated, eventPaymentCaptured, eventOrderCancelled, eventOrderRefunded}, "|")+")")
			pattern = strings.ReplaceAll(pattern, `\{consumer\}`, "("+paymentServiceConsumer+"|"+orderServiceConsumer+")")
			pattern = strings.ReplaceAll(pattern, `\{step\}`, "("+strings.Join(fulfilmentSteps(), "|")+")")
			patterns = append(patterns, regexp.MustCompile("^"+pattern+"$"))
		}
	}
	if len(names) < 8 {
		t.Fatalf("found %d span names in the section's table: %v", len(names), names)
	}
	if !strings.Contains(section, "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 retrysafe serve --db retrysafe.db") {
		t.Error("the section does not show how to turn tracing on")
	}

	env := MustOpenApp(t)
	exporter := recordSpans(t, env)
	ts := newTestServer(t, env)
	status, body := postTraced(t, ts, "/api/orders", "paid", orderBody(5000, "sku-1", 1, pmCardVisa), clientTraceparent, "")
	if status != 201 {
		t.Fatalf("create: %d %s", status, body)
	}
	paid := orderField([]byte(body), "order_id")
	if status, body := postTraced(t, ts, "/api/orders", "declined", orderBody(700, "sku-2", 1, pmCardDeclined), "", ""); status != 201 {
		t.Fatalf("create: %d %s", status, body)
	}
	env.drain(t)
	if status, body := postTraced(t, ts, "/api/orders/"+paid+"/refund", "refund", "{}", "", ""); status != 200 && status != 201 {
		t.Fatalf("refund: %d %s", status, body)
	}
	env.drain(t)
	spans := exporter.GetSpans()
	for i, pattern := range patterns {
		found := false
		for _, span := range spans {
			found = found || pattern.MatchString(span.Name)
		}
		if !found {
			t.Errorf("docs/observability.md names the span %q, which no order made; spans: %s", names[i], spanNames(spans))
		}
	}
	for _, span := range spans {
		found := false
		for _, pattern := range patterns {
			found = found || pattern.MatchString(span.Name)
		}
		if !found {
			t.Errorf("a span %q that docs/observability.md's table does not name", span.Name)
		}
	}
}
