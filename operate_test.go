package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Ensure the drill of "Operate it" (docs/operate-and-repair.md) works as written: with the
// broker down, an order's OrderCreated waits in the outbox (the backlog and
// its age show on /metrics), then fails after its attempts and check names
// it; once the broker is back, outbox retry releases it, the backlog
// drains, the order is paid and check passes.
func TestOperateDrill(t *testing.T) {
	t.Setenv("RETRYSAFE_API_KEYS", "user-42:"+keyUser42)
	t.Setenv("RETRYSAFE_WEBHOOK_SECRET", testWebhookSecret)
	target := testDatabase(t)
	client := &http.Client{Timeout: 30 * time.Second}

	// start runs serve until the returned function stops it, and returns
	// its address and its metrics' URL.
	metricsURL := regexp.MustCompile(`url=(http://\S+/metrics)`)
	start := func(args ...string) (string, string, func()) {
		ctx, stop := context.WithCancel(context.Background())
		out := newLineRecorder()
		exited := make(chan error, 1)
		go func() {
			exited <- run(ctx, append([]string{"serve", "--db", target, "--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--lease-scale", "0.01"}, args...), strings.NewReader(""), out, out)
		}()
		var base, metrics string
		out.waitFor(t, "serve's address and its metrics'", func(lines []string) bool {
			for _, line := range lines {
				if _, rest, ok := strings.Cut(line, "retrysafe serving "); ok {
					base, _, _ = strings.Cut(rest, " ")
				}
				if found := metricsURL.FindStringSubmatch(line); found != nil {
					metrics = found[1]
				}
			}
			return base != "" && metrics != ""
		})
		return base, metrics, func() {
			stop()
			if err := mustReceive(t, "serve to exit", exited); err != nil {
				t.Errorf("serve: %v\n%s", err, strings.Join(out.snapshot(), "\n"))
			}
		}
	}
	gauge := func(metrics, name string) float64 {
		t.Helper()
		value, ok := sample(scrape(t, metrics), name)
		if !ok {
			t.Fatalf("/metrics has no %s", name)
		}
		return value
	}

	base, metrics, stop := start("--broker-down")
	req, err := http.NewRequest("POST", base+"/api/orders", strings.NewReader(orderBody(5000, "sku-1", 1, pmCardVisa)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+keyUser42)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "drill-1")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 201 {
		t.Fatalf("create: %d %s %v", resp.StatusCode, body, err)
	}
	orderID := orderField(body, "order_id")
	if pending := gauge(metrics, "retrysafe_outbox_pending_events"); pending != 1 {
		t.Fatalf("with the broker down, %v events pending; want the order's 1", pending)
	}
	// Real processes with real backoffs: slower to settle than waitLimit.
	eventually(t, "the event to fail", time.Minute, func() (bool, string) {
		failed := gauge(metrics, "retrysafe_outbox_failed_events")
		return failed == 1, fmt.Sprintf("%v failed events", failed)
	})
	if out, err := runArgs("check", "--db", target, "--in-flight"); err == nil || !strings.Contains(out, failedEventsInvariant) || !strings.Contains(out, orderID) {
		t.Fatalf("check with a failed event: %v\n%s", err, out)
	}
	stop()

	_, metrics, stop = start()
	defer stop()
	db, err := openReadOnlyDB(context.Background(), target)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if out, err := runArgs("outbox", "retry", "--db", target, "--operator", "drill", "--all-failed"); err != nil {
		t.Fatalf("outbox retry: %v\n%s", err, out)
	}
	eventually(t, "the backlog to drain and the order to be paid", time.Minute, func() (bool, string) {
		var status string
		err := db.QueryRowContext(context.Background(), `SELECT status FROM orders WHERE order_id = ?`, orderID).Scan(&status)
		pending := gauge(metrics, "retrysafe_outbox_pending_events")
		return err == nil && status == string(orderPaid) && pending == 0, fmt.Sprintf("order %s (%v), %v events pending", status, err, pending)
	})
	if failed := gauge(metrics, "retrysafe_outbox_failed_events"); failed != 0 {
		t.Fatalf("%v failed events after the retry; want 0", failed)
	}
	if out, err := runArgs("check", "--db", target); err != nil {
		t.Fatalf("check after the drill: %v\n%s", err, out)
	}
	// The repair is on the order's record: inspect --order shows who did it.
	if out, err := runArgs("inspect", "--db", target, "--order", orderID); err != nil || !strings.Contains(out, "repair_log (1 row)") || !strings.Contains(out, "drill") {
		t.Fatalf("inspect --order after the repair: %v\n%s", err, out)
	}
}
