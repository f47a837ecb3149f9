package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Ensure the demo, run as a user runs it, passes every one of its checks.
func TestDemo(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"demo"}, strings.NewReader(""), &out, &out); err != nil {
		t.Fatalf("demo failed: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "All checks passed.") {
		t.Fatalf("demo did not finish:\n%s", out.String())
	}

	// Ensure the demo tells the same story on NATS JetStream (and, with
	// RETRYSAFE_TEST_POSTGRES, on PostgreSQL): the same checks pass.
	t.Run("OnNATS", func(t *testing.T) {
		url := os.Getenv("RETRYSAFE_TEST_NATS")
		if url == "" {
			t.Skip("set RETRYSAFE_TEST_NATS=nats://127.0.0.1:4222 to run the demo on NATS JetStream")
		}
		var out bytes.Buffer
		err := run(context.Background(), []string{"demo", "--db", testDatabase(t), "--broker", url}, strings.NewReader(""), &out, &out)
		if err != nil || !strings.Contains(out.String(), "All checks passed.") {
			t.Fatalf("demo failed: %v\n%s", err, out.String())
		}
	})
}

// Ensure the demo survives a debugger: a request held at a breakpoint in the
// create path, longer than any timeout a server or client commonly has (the
// demo's used to: 10 s on the client, 30 s to read and write on the server),
// still gets its answer, and every check passes.
func TestDemoHeldAtBreakpoint(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a request for half a minute")
	}
	// It mostly sleeps: let the other tests run meanwhile.
	t.Parallel()
	const hold = 31 * time.Second
	// held is set on the server's goroutine, read on this one.
	var held atomic.Bool
	stop := func(ctx context.Context, point faultPoint) {
		// The first order's key is claimed, inside its transaction: where a
		// breakpoint on the key lookup or the order insert stops.
		if point == faultAfterKeyClaim && held.CompareAndSwap(false, true) {
			time.Sleep(hold)
		}
	}
	var out bytes.Buffer
	if err := runDemoStopping(context.Background(), &out, "", "", nil, stop, nil); err != nil {
		t.Fatalf("demo held %s at %s failed: %v\n%s", hold, faultAfterKeyClaim, err, out.String())
	}
	if !held.Load() {
		t.Fatalf("the demo never reached %s", faultAfterKeyClaim)
	}
	if !strings.Contains(out.String(), "All checks passed.") {
		t.Fatalf("demo did not finish:\n%s", out.String())
	}
}

// Example_demo pins what the client sees in the demo, and the closing table.
func Example_demo() {
	var out bytes.Buffer
	if err := runDemo(context.Background(), &out, "", "", nil); err != nil {
		fmt.Println(err)
	}
	for _, line := range strings.Split(out.String(), "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "== ") || strings.HasPrefix(line, "ok: all") || strings.HasPrefix(line, "-> ") || strings.HasPrefix(line, "ok: ") && !strings.Contains(line, "ord_") {
			fmt.Println(line)
		}
	}
	// Output:
	// == 1. A first request creates the order ==
	// -> 201 Created  Idempotent-Replayed: -
	// == 2. The network hiccups; the client retries with the same key ==
	// -> 201 Created  Idempotent-Replayed: true
	// ok: replayed the first response byte for byte
	// ok: still 1 order and 1 outbox event: prevented a duplicate order
	// == 3. A buggy client reuses the key for a different order ==
	// -> 422 Unprocessable Entity  Idempotent-Replayed: -
	// ok: 422 /problems/idempotency-key-reused, and still 1 order
	// == 4. The relay publishes OrderCreated, then crashes before marking it published ==
	// ok: relay-1 died after publishing (simulated crash)
	// ok: the outbox still says pending: the event is not lost
	// ok: 1 message in the broker, 1 duplicate publish absorbed
	// == 5. The payment service consumes OrderCreated, and dies before its ack reaches the broker ==
	// ok: the saga was started and the message recorded in the inbox, in one transaction; no ack was sent (simulated crash)
	// ok: message id = outbox event_id; 1 saga started, not 2
	// == 6. The saga reserves stock, and the card charge times out ==
	// ok: the charge exists at the processor, the saga is waiting to retry charge_card
	// ok: saga completed, 1 charge at the processor: prevented a double charge
	// == 7. PaymentCaptured goes out through the outbox; the order service marks the order paid ==
	// -> 200 OK  Idempotent-Replayed: -
	// == 8. A second order with a declined card is compensated ==
	// -> 201 Created  Idempotent-Replayed: -
	// ok: reserve_stock compensated, charge_card failed, confirm never ran
	// ok: sku-2 stock is back: 1000 available, 0 reserved
	// -> 200 OK  Idempotent-Replayed: -
	// == 9. The customer gets a refund of the first order; the client retries that too ==
	// -> 200 OK  Idempotent-Replayed: -
	// -> 200 OK  Idempotent-Replayed: true
	// ok: 1 refund of 2000 at the processor
	// == Every effect happened once ==
	// ok: all 22 invariants hold
}

func TestCommands(t *testing.T) {
	// runCLI runs the command line and returns its output and error.
	runCLI := func(t *testing.T, args ...string) (string, error) {
		t.Helper()
		var out bytes.Buffer
		err := run(context.Background(), args, strings.NewReader(""), &out, &out)
		return out.String(), err
	}

	// Ensure demo --db keeps the database, and inspect and cleanup read it.
	// The demo's clock is in January 2026, so by the wall clock its keys
	// have long expired and cleanup removes them.
	t.Run("DemoKeepsItsDatabaseForInspect", func(t *testing.T) {
		path := testDatabase(t)
		if out, err := runCLI(t, "demo", "--db", path); err != nil {
			t.Fatalf("demo: %v\n%s", err, out)
		}
		// On PostgreSQL, inspect and check run read-only transactions
		// instead; a write would fail them.
		before, _ := os.ReadFile(path)
		if out, err := runCLI(t, "check", "--db", path); err != nil || !strings.Contains(out, "ok: all") {
			t.Fatalf("check: %v\n%s", err, out)
		}
		out, err := runCLI(t, "inspect", "--db", path)
		if err != nil || !strings.Contains(out, "orders (2 rows)") || !strings.Contains(out, "processor_refunds (1 row)") {
			t.Fatalf("inspect: %v\n%s", err, out)
		}
		out, err = runCLI(t, "inspect", "--db", path, "--json")
		if err != nil || !strings.Contains(out, `"saga_steps"`) {
			t.Fatalf("inspect --json: %v\n%s", err, out)
		}
		if after, _ := os.ReadFile(path); !bytes.Equal(before, after) {
			t.Fatal("check or inspect changed the database file")
		}
		out, err = runCLI(t, "cleanup", "--db", path)
		if err != nil || !strings.Contains(out, "deleted 3 expired idempotency keys") {
			t.Fatalf("cleanup: %v\n%s", err, out)
		}
	})

	// Ensure mistakes on the command line fail with a message naming them.
	t.Run("MistakesFailClearly", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), "missing.db")
		existing := filepath.Join(t.TempDir(), "existing.db")
		if err := os.WriteFile(existing, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			args []string
			want string
		}{
			{[]string{"inspect", "--db", missing}, "no database at " + missing},
			{[]string{"cleanup", "--db", missing}, "no database at " + missing},
			{[]string{"demo", "--db", existing}, "already exists"},
			{[]string{"demo", "extra"}, "takes no arguments"},
			{[]string{"inspect", missing}, "name the database with --db"},
			{[]string{"relay", "--db", missing}, "no database at " + missing},
			{[]string{"worker", "--db", missing}, "no database at " + missing},
			{[]string{"serve", "--db", missing, "--addr", "not an address"}, "listen on not an address"},
			{[]string{"bogus"}, "unknown command"},
		}
		if onPostgres() {
			used := testDatabase(t)
			if out, err := runCLI(t, "demo", "--db", used); err != nil {
				t.Fatalf("demo: %v\n%s", err, out)
			}
			tests = append(tests, []struct {
				args []string
				want string
			}{
				{[]string{"demo", "--db", used}, "already holds retrysafe's tables"},
				{[]string{"serve", "--db", testDatabase(t), "--durability", "full"}, "--durability full is for SQLite"},
				{[]string{"inspect", "--db", "postgres://127.0.0.1:1/nowhere"}, "connect to postgres://127.0.0.1:1/nowhere"},
			}...)
		}
		for _, tt := range tests {
			out, err := runCLI(t, tt.args...)
			if err == nil || !strings.Contains(out, tt.want) {
				t.Errorf("%v: got %v\n%s\nwant an error mentioning %q", tt.args, err, out, tt.want)
			}
		}
		if _, err := os.Stat(missing); !os.IsNotExist(err) {
			t.Fatalf("a failed command created %s", missing)
		}
	})

	// Ensure sign-webhook signs the way the server checks.
	t.Run("SignWebhookMatchesTheServer", func(t *testing.T) {
		t.Setenv("RETRYSAFE_WEBHOOK_SECRET", "whsec_cli")
		body := `{"id":"evt_1","type":"charge.refunded"}`
		out, err := runCLI(t, "sign-webhook", body)
		if err != nil {
			t.Fatal(err)
		}
		if err := verifyWebhook([]byte("whsec_cli"), strings.TrimSpace(out), []byte(body), time.Now()); err != nil {
			t.Fatalf("the server rejects %q: %v", out, err)
		}
	})

	// Ensure a malformed RETRYSAFE_API_KEYS stops serve with a clear error.
	t.Run("MalformedAPIKeysStopServe", func(t *testing.T) {
		t.Setenv("RETRYSAFE_API_KEYS", "user-42")
		out, err := runCLI(t, "serve", "--db", filepath.Join(t.TempDir(), "x.db"), "--addr", "127.0.0.1:0")
		if err == nil || !strings.Contains(out, `RETRYSAFE_API_KEYS entry "user-42" is not user:key`) {
			t.Fatalf("got %v\n%s", err, out)
		}
	})
}

// Ensure the README's breakpoint on the key lookup names the line that
// does it: a line number drifts whenever idem.go is edited above it.
func TestREADMEBreakpointLine(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	found := regexp.MustCompile("`break idem\\.go:(\\d+)`").FindSubmatch(readme)
	if found == nil {
		t.Fatal("README names no `break idem.go:N` breakpoint")
	}
	line, _ := strconv.Atoi(string(found[1]))
	source, err := os.ReadFile("idem.go")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(source), "\n")
	if line < 1 || line > len(lines) || !strings.Contains(lines[line-1], "key, err := lookupKey(") {
		for i, l := range lines {
			if strings.Contains(l, "key, err := lookupKey(") {
				t.Fatalf("README says `break idem.go:%d`; the key lookup is on line %d", line, i+1)
			}
		}
		t.Fatalf("README says `break idem.go:%d`, and idem.go has no key lookup line", line)
	}
}

// Ensure demo --step says how to watch the tables while it waits, and
// goes on at each Enter.
func TestDemoStepSaysHowToWatch(t *testing.T) {
	dbPath := filepath.Join(t.TempDir(), "demo.db")
	var out bytes.Buffer
	enters := strings.NewReader(strings.Repeat("\n", 100))
	if err := run(context.Background(), []string{"demo", "--step", "--db", dbPath}, enters, &out, &out); err != nil {
		t.Fatalf("demo --step failed: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "go run . inspect --db "+dbPath) || !strings.Contains(out.String(), "[press Enter to run:") {
		t.Fatalf("demo --step does not say how to watch the tables, or does not pause:\n%s", out.String())
	}
}
