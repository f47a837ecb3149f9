package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
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
