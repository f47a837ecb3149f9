package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
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
//
// It runs with RETRYSAFE_SOAK set (CI sets it): it sleeps half a minute,
// and a parallel test starts only after every other test has finished, so
// it would add that half minute to go test ./... .
func TestDemoHeldAtBreakpoint(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a request for half a minute")
	}
	if soakDuration(t) == 0 {
		t.Skip("holds a request for half a minute: set RETRYSAFE_SOAK (for example 1s) to run it; CI does")
	}
	// It mostly sleeps: let the other parallel tests run meanwhile.
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
	if err := runDemoWith(context.Background(), &out, demoOptions{stop: stop}); err != nil {
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
		if strings.HasPrefix(line, "== ") || strings.Contains(line, "-> ") || strings.HasPrefix(line, "ok: ") && !strings.Contains(line, "ord_") {
			fmt.Println(line)
		}
	}
	// Output:
	// == 1. A first request creates the order ==
	// -> 201 Created
	// == 2. The network hiccups; the client retries with the same key ==
	// -> 201 Created  Idempotent-Replayed: true
	// ok: replayed the first response byte for byte
	// ok: still 1 order and 1 outbox event: prevented a duplicate order
	// == 3. A buggy client reuses the key for a different order ==
	// -> 422 Unprocessable Entity
	// ok: 422 /problems/idempotency-key-reused, and still 1 order
	// == 4. The relay publishes OrderCreated, then crashes before marking it published ==
	// ok: relay-1 died after publishing
	// ok: the outbox still says pending: the event is not lost
	// ok: 1 message in the broker, 1 duplicate publish absorbed
	// == 5. The payment service consumes OrderCreated, and dies before its ack reaches the broker ==
	// payment-svc: evt_d465e39a -> applied
	// ok: the saga was started; the consumer died before its ack
	// ok: the message was recorded in payment-svc's inbox
	// payment-svc: evt_d465e39a -> duplicate
	// ok: the redelivery was skipped as a duplicate: message id = outbox event_id
	// ok: 1 saga started, not 2
	// == 6. The saga reserves stock, and the card charge times out ==
	// ok: the charge exists at the processor, the saga is waiting to retry charge_card
	// ok: saga completed, 1 charge at the processor: prevented a double charge
	// == 7. PaymentCaptured goes out through the outbox; the order service marks the order paid ==
	// order-svc: evt_2637dab7 -> applied
	// -> 200 OK
	// == 8. A second order with a declined card is compensated ==
	// -> 201 Created
	// payment-svc: evt_66df44eb -> applied
	// ok: reserve_stock compensated, charge_card failed, confirm never ran
	// ok: sku-2 stock is back: 1000 available, 0 reserved
	// order-svc: evt_aad76d3d -> applied
	// -> 200 OK
	// == 9. The customer asks for a refund of the first order; the processor's answer is lost, and the client retries ==
	// -> 503 Service Unavailable
	// ok: 503; the processor made the refund, and the key waits at refund_requested, released
	// recovery points: the first phase committed started -> refund_requested before the call;
	// -> 200 OK
	// ok: the retry resumed at refund_requested: 200, still 1 refund of 2000 at the processor
	// then recorded the refund and its answer: refund_requested -> finished
	// -> 200 OK  Idempotent-Replayed: true
	// ok: a third try replays the answer byte for byte; 1 refund of 2000 at the processor
	// == 10. Two clients send one new key at the same moment ==
	// A -> 201 Created
	// B -> 201 Created  Idempotent-Replayed: true
	// ok: B waited for A's transaction, then got A's answer replayed; 1 order
	// == 11. The database connection drops in the middle of a request; the retry goes through ==
	// -> 503 Service Unavailable
	// ok: 503 Service Unavailable; no order and no key stored
	// -> 201 Created
	// ok: the retry created the order: 201, not a replay; 1 order
	// ok: every OrderCreated the payment service got was about an order that exists
	// == 12. The processor sends a webhook twice ==
	// -> 200 OK  {"received":true,"outcome":"applied"}
	// -> 200 OK  {"received":true,"outcome":"duplicate"}
	// ok: the first applied, the second was skipped as a duplicate
	// ok: the order counts 2500 refunded (2000 + 500), once
	// == 13. A day later, the refund client sends its key again ==
	// -> 422 Unprocessable Entity
	// ok: 422 /problems/idempotency-key-expired; still 1 refund of 2000
	// == Each effect below happened as often as it should ==
	// == Each message delivered more than once was applied once ==
	// ok: all 32 invariants hold
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
		if err != nil || !strings.Contains(out, "orders (4 rows)") || !strings.Contains(out, "processor_refunds (2 rows)") {
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
		if err != nil || !strings.Contains(out, "deleted 5 expired idempotency keys") {
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

// Ensure docs/debugging.md's breakpoint on the key lookup names the line that
// does it: a line number drifts whenever idem.go is edited above it.
func TestDocsBreakpointLine(t *testing.T) {
	readme, err := os.ReadFile("docs/debugging.md")
	if err != nil {
		t.Fatal(err)
	}
	found := regexp.MustCompile("`break idem\\.go:(\\d+)`").FindSubmatch(readme)
	if found == nil {
		t.Fatal("docs/debugging.md names no `break idem.go:N` breakpoint")
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
				t.Fatalf("docs/debugging.md says `break idem.go:%d`; the key lookup is on line %d", line, i+1)
			}
		}
		t.Fatalf("docs/debugging.md says `break idem.go:%d`, and idem.go has no key lookup line", line)
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

// Ensure each layer, replaced by the naive code the article warns against,
// shows its hole: the demo exits non-zero, and its closing tables and the
// invariants check show the duplicate or lost effect. A failed check is
// named after what failed, a closing table's title is what its rows show,
// and an invariant broken many times is one line with a count. (Without
// the flag the same story passes: TestDemo.)
func TestDemoWithout(t *testing.T) {
	cases := []struct {
		layer layer
		shows []string
		// hides are claims the run must not make: true ones printed as
		// failed, or false ones printed as titles.
		hides []string
	}{
		{layerIdempotency, []string{
			`== 5 effect\(s\) did not happen as often as they should ==`,
			`order created for cart-7\s+3 POSTs\s+3\s+<- should be 1`,
			`card charged for cart-7\s+2 charge calls\s+3\s+<- should be 1`,
			`\n4 x VIOLATION an idempotency key maps to at most one order; the first: user-42 key pay-req-user-42-cart-7`,
		}, []string{
			`Each effect below happened as often as it should`,
		}},
		{layerOutbox, []string{
			`FAILED: every OrderCreated the payment service got was about an order that exists`,
			`OrderCreated for an order never made\s+1 dropped POST\s+2\s+<- should be 0`,
			`VIOLATION once quiet, no message is poison(:|; the first:) payment-svc gave up on \S+: OrderCreated for unknown order`,
		}, nil},
		{layerInbox, []string{
			`ok: the saga was started; the consumer died before its ack\n\s+FAILED: the message was recorded in payment-svc's inbox\s+observed: 0 inbox row`,
			`FAILED: the redelivery was skipped as a duplicate: message id = outbox event_id\s+observed: the redelivery was applied\n\s+ok: 1 saga started, not 2\n`,
			`FAILED: the first applied, the second was skipped as a duplicate\s+observed: [^\n]+\n\s+ok: the order counts 2500 refunded`,
			`== 2 message\(s\) applied more than once ==\n\s+consumer\s+message id\s+delivered\s+applied\n` +
				`\s+payment-svc\s+evt_d465e39a\s+2\s+2\s+<- should be 1\n` +
				`\s+processor-webhooks\s+evt_processor_1\s+2\s+2\s+<- should be 1\n`,
			`\n8 x VIOLATION once quiet, every published event is applied by each consumer of its subject; the first: OrderCreated \S+ of \S+ was published at \S+ and payment-svc has not applied it`,
		}, []string{
			`FAILED: [^\n]*1 saga started`,
			`FAILED: [^\n]*2500 refunded`,
			`was applied once`,
		}},
		{layerSaga, []string{
			`stock released for cart-8 \(declined\)\s+1 compensation\s+0\s+<- should be 1`,
			`\nVIOLATION once quiet, nothing is reserved but what was sold: sku-2 still has 3 reserved for sagas not completed`,
		}, nil},
	}
	// violationLine is one line of the invariants check, as the demo
	// prints it.
	violationLine := regexp.MustCompile(`(?m)^(?:\d+ x )?VIOLATION (.+?)(?:: |; the first: )`)
	for _, tc := range cases {
		t.Run(string(tc.layer), func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), []string{"demo", "--without", string(tc.layer)}, strings.NewReader(""), &out, &out)
			if err == nil {
				t.Fatalf("demo --without %s passed; want it to fail:\n%s", tc.layer, out.String())
			}
			for _, pattern := range tc.shows {
				if !regexp.MustCompile(pattern).MatchString(out.String()) {
					t.Errorf("demo --without %s does not show %q:\n%s", tc.layer, pattern, out.String())
				}
			}
			for _, pattern := range tc.hides {
				if found := regexp.MustCompile(pattern).FindString(out.String()); found != "" {
					t.Errorf("demo --without %s shows %q:\n%s", tc.layer, found, out.String())
				}
			}
			lines := map[string]int{}
			for _, m := range violationLine.FindAllStringSubmatch(out.String(), -1) {
				lines[m[1]]++
			}
			for invariant, n := range lines {
				if n > 1 {
					t.Errorf("demo --without %s prints %d VIOLATION lines for %q, want one with a count", tc.layer, n, invariant)
				}
			}
			if strings.Contains(out.String(), "All checks passed.") {
				t.Errorf("demo --without %s claims all checks passed:\n%s", tc.layer, out.String())
			}
			hole := layerHoles()[tc.layer]
			if !strings.Contains(out.String(), "The test that catches it: "+hole.test) {
				t.Errorf("demo --without %s does not name its test %q", tc.layer, hole.test)
			}
			checkTestsExist(t, hole.test)
		})
	}

	// Ensure a layer that does not exist is refused before anything runs.
	t.Run("RefusesAnUnknownLayer", func(t *testing.T) {
		var out bytes.Buffer
		err := run(context.Background(), []string{"demo", "--without", "cache"}, strings.NewReader(""), &out, &out)
		if err == nil || !strings.Contains(err.Error(), "idempotency, inbox, outbox, saga") {
			t.Fatalf("got %v, want an error naming the layers", err)
		}
		if strings.Contains(out.String(), "==") {
			t.Fatalf("the story ran:\n%s", out.String())
		}
	})
}

// checkTestsExist fails unless every test a "go test -run 'A/B|C'" command
// names is in a _test.go file of the package: a hole must name a test that
// is there.
func checkTestsExist(t *testing.T, command string) {
	t.Helper()
	_, pattern, _ := strings.Cut(command, "-run '")
	pattern, _, _ = strings.Cut(pattern, "'")
	files, err := filepath.Glob("*_test.go")
	if err != nil {
		t.Fatal(err)
	}
	var source strings.Builder
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		source.Write(text)
	}
	for _, name := range strings.Split(pattern, "|") {
		top, sub, _ := strings.Cut(name, "/")
		if !strings.Contains(source.String(), "func "+top+"(t *testing.T)") {
			t.Errorf("%q names test %s, which does not exist", command, top)
		}
		if sub != "" && !strings.Contains(source.String(), `t.Run("`+sub+`"`) {
			t.Errorf("%q names subtest %s, which does not exist", command, name)
		}
	}
}

// Ensure docs/reading-order.md's reading order gives each file's true length: a
// reader plans an evening by it.
func TestDocsReadingOrder(t *testing.T) {
	readme, err := os.ReadFile("docs/reading-order.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(readme), "## Read it in this order")
	section, _, _ = strings.Cut(section, "\n## ")
	counts := regexp.MustCompile("`([a-z_]+\\.(?:go|sql))`\\s+\\((\\d+)").FindAllStringSubmatch(section, -1)
	if len(counts) < 10 {
		t.Fatalf("docs/reading-order.md's reading order gives %d line counts; want one for each file it lists", len(counts))
	}
	for _, count := range counts {
		text, err := os.ReadFile(count[1])
		if err != nil {
			t.Errorf("docs/reading-order.md's reading order lists %s: %v", count[1], err)
			continue
		}
		if got := strconv.Itoa(bytes.Count(text, []byte("\n"))); got != count[2] {
			t.Errorf("docs/reading-order.md says %s has %s lines; it has %s", count[1], count[2], got)
		}
	}
}

// Ensure that in the demo, on SQLite, the way from the HTTP handler to the
// body of the create transaction passes through no group-commit or
// PostgreSQL code: a debugger's step from the handler goes straight there.
func TestDemoCreatePathIsDirect(t *testing.T) {
	var stack []string
	stop := func(ctx context.Context, point faultPoint) {
		if point != faultAfterKeyClaim || stack != nil {
			return
		}
		pcs := make([]uintptr, 64)
		frames := runtime.CallersFrames(pcs[:runtime.Callers(1, pcs)])
		for {
			frame, more := frames.Next()
			stack = append(stack, frame.Function+" "+filepath.Base(frame.File))
			if !more {
				break
			}
		}
	}
	var out bytes.Buffer
	if err := runDemoWith(context.Background(), &out, demoOptions{stop: stop}); err != nil {
		t.Fatalf("demo failed: %v\n%s", err, out.String())
	}
	joined := strings.Join(stack, "\n")
	if !strings.Contains(joined, "handleCreateOrder") {
		t.Fatalf("the create path's stack does not reach the handler:\n%s", joined)
	}
	for _, plumbing := range []string{"infra_groupcommit.go", "infra_postgres.go", "infra_dialect.go", "keyTx"} {
		for _, frame := range stack {
			if strings.Contains(frame, plumbing) {
				t.Errorf("the create path passes through %s:\n%s", plumbing, joined)
				break
			}
		}
	}
}
