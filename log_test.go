package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
)

// Ensure the background layers leave a trace as serve runs them: one
// structured line per relay publish, per inbox outcome and per saga step,
// each naming the order.
func TestBackgroundActionsAreLogged(t *testing.T) {
	env := MustOpenApp(t)
	var buf bytes.Buffer
	env.app.log = slog.New(slog.NewJSONHandler(&buf, nil))
	ts := newTestServer(t, env)
	created := call(t, ts, "POST", "/api/orders", keyUser42, "log-1", orderBody(5000, "sku-1", 1, pmCardVisa))
	if created.Status != 201 {
		t.Fatalf("create: %d %s", created.Status, created.Body)
	}
	orderID := orderField([]byte(created.Body), "order_id")
	env.drain(t)

	seen := map[string]int{}
	for _, line := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
		var record map[string]any
		if err := json.Unmarshal(line, &record); err != nil {
			t.Fatalf("a log line that is not JSON: %s", line)
		}
		field := func(name string) string { value, _ := record[name].(string); return value }
		if field("order_id") != orderID {
			t.Errorf("a background line without the order's id %s: %s", orderID, line)
			continue
		}
		seen[field("msg")+" "+field("event_type")+field("step")+" "+field("outcome")]++
	}
	for _, want := range []string{
		"relay published OrderCreated ",
		"inbox OrderCreated applied",
		"saga step reserve_stock ",
		"saga step charge_card ",
		"saga step confirm ",
		"relay published PaymentCaptured ",
		"inbox PaymentCaptured applied",
	} {
		if seen[want] == 0 {
			t.Errorf("no %q line; got %v\n%s", want, seen, buf.String())
		}
	}
}

// Ensure demo --trace interleaves the background layers' lines with the
// story, each naming its order.
func TestDemoTrace(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"demo", "--trace"}, strings.NewReader(""), &out, &out); err != nil {
		t.Fatalf("demo --trace failed: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		`msg="relay published"`, `event_type=OrderCreated`,
		`msg=inbox consumer=payment-svc`, `outcome=duplicate`,
		`msg="saga step"`, `step=charge_card`, `then="step compensated"`,
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo --trace printed no %s", want)
		}
	}
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(line, "level=INFO") && (strings.Contains(line, "time=") || !strings.Contains(line, "order_id=ord_")) {
			t.Errorf("a trace line with a wall-clock time or without an order id: %s", line)
		}
	}
}
