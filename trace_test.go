package main

import (
	"bytes"
	"context"
	"database/sql"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// updateDocs rewrites docs/inspect-and-trace.md's trace diagram from a demo run:
// go test -run TestDocsDiagram -update
var updateDocs = flag.Bool("update", false, "rewrite the samples in docs/ that a demo run generates")

// runTraceCLI runs the command line and returns its output and error.
func runTraceCLI(tb testing.TB, args ...string) (string, error) {
	tb.Helper()
	var out bytes.Buffer
	err := run(context.Background(), args, strings.NewReader(""), &out, &out)
	return out.String(), err
}

// MustRunDemo runs the demo into a new database at path and returns the ids
// of its orders, oldest first.
func MustRunDemo(tb testing.TB, path string) []string {
	tb.Helper()
	if out, err := runTraceCLI(tb, "demo", "--db", path); err != nil {
		tb.Fatalf("demo: %v\n%s", err, out)
	}
	db, err := openReadOnlyDB(context.Background(), path)
	if err != nil {
		tb.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query(`SELECT order_id FROM orders ORDER BY created_at, order_id`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	var orderIDs []string
	for rows.Next() {
		var orderID string
		if err := rows.Scan(&orderID); err != nil {
			tb.Fatal(err)
		}
		orderIDs = append(orderIDs, orderID)
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	if len(orderIDs) < 2 {
		tb.Fatalf("the demo made %d orders, want at least 2", len(orderIDs))
	}
	return orderIDs
}

// timelineLine matches one row of trace's text: an optional ~, the time,
// the arrow and the text. The time has its date when the timeline spans
// several days.
var timelineLine = regexp.MustCompile(`^[ ~]((?:\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d\.\d\d\d)  (.+?) -> (.+?)  +(.*)$`)

func TestTrace(t *testing.T) {
	path := testDatabase(t)
	orderIDs := MustRunDemo(t, path)
	db, err := openReadOnlyDB(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()

	// Ensure the first order's journey is told in time order, every line
	// fits a terminal, and the story's events come in the story's order.
	t.Run("LinesInTimeOrder", func(t *testing.T) {
		out, err := runTraceCLI(t, "trace", "--db", path, orderIDs[0])
		if err != nil {
			t.Fatalf("trace: %v\n%s", err, out)
		}
		previous := ""
		var texts []string
		for _, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
			if len([]rune(line)) > traceWidth {
				t.Errorf("line of %d columns, want at most %d:\n%s", len([]rune(line)), traceWidth, line)
			}
			m := timelineLine.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			if m[1] < previous {
				t.Errorf("%s comes after %s:\n%s", m[1], previous, out)
			}
			previous = m[1]
			texts = append(texts, m[4])
		}
		story := []string{
			"POST /api/orders, key ", "order written", "OrderCreated", "published evt_", "published evt_", "again: a duplicate",
			"marked published", "delivery 1 of", "started saga_", "delivery 2 of", "skipped, already in the inbox", "step 0 reserve_stock done",
			"charge 5000 usd, key saga_", "answered from the key", "step 1 charge_card done", "step 2 confirm done",
			"PaymentCaptured", "refund rf_", "refund 2000 usd, key refund:rf_", "OrderRefunded",
			// The refund's key, sent again a day later, when it had
			// expired: its row now holds that answer.
			"POST .../refund",
		}
		rest := strings.Join(texts, "\n")
		for _, want := range story {
			i := strings.Index(rest, want)
			if i < 0 {
				t.Fatalf("%q missing, or out of the story's order, in:\n%s", want, out)
			}
			rest = rest[i+len(want):]
		}
		if !strings.Contains(out, "final: order paid") {
			t.Errorf("no final state in:\n%s", out)
		}
	})

	// Ensure no row of the demo's first order is cut: a row wider than a
	// terminal continues on the next lines, under the text column, and
	// the rows the docs quote each fit on one line.
	t.Run("RowsWhole", func(t *testing.T) {
		out, err := runTraceCLI(t, "trace", "--db", path, orderIDs[0])
		if err != nil {
			t.Fatalf("trace: %v\n%s", err, out)
		}
		trace, err := traceOrder(context.Background(), db, orderIDs[0])
		if err != nil {
			t.Fatal(err)
		}
		// A continuation line starts with the spaces that reach the text
		// column; a row starts with one space or ~ and its time.
		rejoined := regexp.MustCompile(`\n {2,}`).ReplaceAllString(out, " ")
		for _, row := range append(trace.rows, traceRow{text: trace.final}) {
			if text := shortIDs(row.text); !strings.Contains(rejoined, text) {
				t.Errorf("the row %q is not whole in:\n%s", text, out)
			}
		}
		for _, quoted := range []*regexp.Regexp{
			regexp.MustCompile(`(?m)  published evt_[0-9a-f]{8} again: a duplicate, dropped by message id$`),
			regexp.MustCompile(`(?m)  charge, key saga_[0-9a-f]{8}:charge_card: answered from the key \(ch_[0-9a-f]{8}\)$`),
		} {
			if !quoted.MatchString(out) {
				t.Errorf("no line matching %s in:\n%s", quoted, out)
			}
		}
	})

	// Ensure the charge the saga asked for twice says so: the processor's
	// ledger counts the second request, answered from the key, and
	// saga_steps, written once when the step has run, cannot.
	t.Run("ChargeAskedTwiceSaysSo", func(t *testing.T) {
		trace, err := traceOrder(context.Background(), db, orderIDs[0])
		if err != nil {
			t.Fatal(err)
		}
		var step string
		for _, row := range trace.rows {
			if strings.HasPrefix(row.text, "step 1 charge_card ") {
				step = shortIDs(row.text)
			}
		}
		want := regexp.MustCompile(`^step 1 charge_card done \(ch_[0-9a-f]{8}\): asked the processor twice, the second answered from its key$`)
		if !want.MatchString(step) {
			t.Errorf("got %q, want a match for %s", step, want)
		}
	})

	// Ensure the diagram has one arrow per row of the database, for each
	// order: one per key, outbox event, broker publish and absorbed
	// duplicate, delivery, ack, saga step that ran, compensation and
	// processor call; and one arrow per line of the text timeline.
	t.Run("MermaidArrowsMatchRows", func(t *testing.T) {
		for _, orderID := range orderIDs {
			out, err := runTraceCLI(t, "trace", "--db", path, "--mermaid", orderID)
			if err != nil {
				t.Fatalf("trace --mermaid: %v\n%s", err, out)
			}
			text, err := runTraceCLI(t, "trace", "--db", path, orderID)
			if err != nil {
				t.Fatalf("trace: %v\n%s", err, text)
			}
			count := func(query string) int {
				t.Helper()
				var n int
				if err := db.QueryRow(query, orderID).Scan(&n); err != nil {
					t.Fatalf("%s: %v", query, err)
				}
				return n
			}
			arrows := regexp.MustCompile(`(?m)^    (\w+)->>(\w+): (.*)$`).FindAllStringSubmatch(out, -1)
			// arrowsLike counts the arrows from and to (any if "") whose
			// label matches pattern.
			arrowsLike := func(from, to, pattern string) int {
				n := 0
				for _, a := range arrows {
					if (from == "" || a[1] == from) && (to == "" || a[2] == to) && regexp.MustCompile(pattern).MatchString(a[3]) {
						n++
					}
				}
				return n
			}
			sagaOf := `(SELECT saga_id FROM saga_instances WHERE order_id = ?)`
			tests := []struct {
				kind      string
				got, want int
			}{
				{"idempotency keys", arrowsLike("Client", "API", `^(POST|PUT|PATCH|DELETE) `),
					count(`SELECT COUNT(*) FROM idempotency_keys k JOIN orders o ON o.user_id = k.user_id
					       WHERE o.order_id = ? AND (k.idempotency_key = o.idempotency_key OR k.request_path LIKE '/api/orders/' || o.order_id || '/%')`)},
				{"outbox events", arrowsLike("", "OutboxRelay", ` written \(outbox seq \d+\)`),
					count(`SELECT COUNT(*) FROM outbox_events WHERE aggregate_id = ?`)},
				{"broker publishes", arrowsLike("OutboxRelay", "Broker", `^published evt_… \(`),
					count(`SELECT COUNT(*) FROM broker_messages m JOIN outbox_events e ON e.event_id = m.message_id WHERE e.aggregate_id = ?`)},
				{"absorbed duplicate publishes", arrowsLike("OutboxRelay", "Broker", `^published evt_… again`),
					count(`SELECT COALESCE(SUM(m.duplicates), 0) FROM broker_messages m JOIN outbox_events e ON e.event_id = m.message_id WHERE e.aggregate_id = ?`)},
				{"deliveries", arrowsLike("Broker", "", `^delivery \d+ of`),
					count(`SELECT COALESCE(SUM(d.delivery_count), 0) FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq
					       JOIN outbox_events e ON e.event_id = m.message_id WHERE e.aggregate_id = ?`)},
				{"inbox applications", arrowsLike("Broker", "", `^delivery \d+ of`) - strings.Count(out, ": skipped, already in the inbox"),
					count(`SELECT COUNT(*) FROM inbox_messages i JOIN outbox_events e ON e.event_id = i.message_id WHERE e.aggregate_id = ?`)},
				{"inbox skips", strings.Count(out, ": skipped, already in the inbox"),
					count(`SELECT COALESCE(SUM(i.duplicates), 0) FROM inbox_messages i JOIN outbox_events e ON e.event_id = i.message_id WHERE e.aggregate_id = ?`)},
				{"acks", arrowsLike("", "Broker", `^ack `),
					count(`SELECT COUNT(*) FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq
					       JOIN outbox_events e ON e.event_id = m.message_id WHERE e.aggregate_id = ? AND d.status = 'acked'`)},
				{"saga steps that ran", arrowsLike("Saga", "Saga", `^step \d+ `),
					count(`SELECT COUNT(*) FROM saga_steps WHERE saga_id = ` + sagaOf + ` AND status <> 'pending'`)},
				{"compensations", arrowsLike("Saga", "Saga", `^compensate step `),
					count(`SELECT COUNT(*) FROM saga_steps WHERE saga_id = ` + sagaOf + ` AND compensated_at IS NOT NULL`)},
				{"processor charges", arrowsLike("", "Processor", `^charge\b`),
					count(`SELECT COALESCE(SUM(1 + key_hits), 0) FROM processor_charges WHERE order_id = ?`)},
				{"processor refunds", arrowsLike("", "Processor", `^refund\b`),
					count(`SELECT COALESCE(SUM(1 + p.key_hits), 0) FROM processor_refunds p
					       JOIN processor_charges c ON c.charge_id = p.charge_id WHERE c.order_id = ?
					       AND NOT EXISTS (SELECT 1 FROM refunds r WHERE r.processor_refund_id = p.refund_id AND r.source = 'webhook')`)},
				{"refunds made at the processor", arrowsLike("Processor", "API", `^charge\.refunded: `),
					count(`SELECT COUNT(*) FROM refunds WHERE order_id = ? AND source = 'webhook'`)},
				{"lines of the text timeline", len(arrows),
					len(regexp.MustCompile(`(?m)^[ ~](?:\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d\.\d\d\d  \S.* -> `).FindAllString(text, -1))},
			}
			for _, tt := range tests {
				if tt.got != tt.want {
					t.Errorf("order %s: %d arrows for %s, want %d (rows)\n%s", orderID, tt.got, tt.kind, tt.want, out)
				}
			}
			if !strings.HasPrefix(out, "sequenceDiagram\n") || !strings.Contains(out, "    Note over API: order ") {
				t.Errorf("not a sequence diagram ending in the order's state:\n%s", out)
			}
		}
	})

	// Ensure an id as the demo prints it, its first 12 characters, traces
	// the order it begins (and inspect --order shows it); a start that
	// several orders' ids share is refused, naming the problem.
	t.Run("ShortIDAsTheDemoPrintsIt", func(t *testing.T) {
		full, err := runTraceCLI(t, "trace", "--db", path, orderIDs[0])
		if err != nil {
			t.Fatalf("trace: %v\n%s", err, full)
		}
		short, err := runTraceCLI(t, "trace", "--db", path, shortID(orderIDs[0]))
		if err != nil || short != full {
			t.Fatalf("trace %s: %v\n%s\nwant the trace of %s:\n%s", shortID(orderIDs[0]), err, short, orderIDs[0], full)
		}
		inspected, err := runTraceCLI(t, "inspect", "--db", path, "--order", shortID(orderIDs[1]), "--json")
		if err != nil || !strings.Contains(inspected, orderIDs[1]) || strings.Contains(inspected, orderIDs[0]) {
			t.Fatalf("inspect --order %s: %v\n%s", shortID(orderIDs[1]), err, inspected)
		}
		for _, args := range [][]string{{"trace", "--db", path, "ord_"}, {"inspect", "--db", path, "--order", "ord_"}} {
			out, err := runTraceCLI(t, args...)
			if err == nil || !strings.Contains(out, "more than one order's id begins with it") {
				t.Errorf("%v: got %v\n%s\nwant an error saying the id is ambiguous", args, err, out)
			}
		}
	})

	// Ensure trace reads only: the file is the same after it.
	t.Run("ReadsOnly", func(t *testing.T) {
		if onPostgres() {
			t.Skip("on PostgreSQL, trace runs read-only transactions: a write would fail it")
		}
		before, _ := os.ReadFile(path)
		if out, err := runTraceCLI(t, "trace", "--db", path, orderIDs[1]); err != nil {
			t.Fatalf("trace: %v\n%s", err, out)
		}
		if after, _ := os.ReadFile(path); !bytes.Equal(before, after) {
			t.Fatal("trace changed the database file")
		}
	})

	// Ensure mistakes fail with a message naming them, and exit non-zero.
	t.Run("MistakesFailClearly", func(t *testing.T) {
		dir := t.TempDir()
		text := filepath.Join(dir, "notes.txt")
		if err := os.WriteFile(text, []byte("not a database\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		empty := filepath.Join(dir, "empty.db")
		if err := os.WriteFile(empty, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		other := filepath.Join(dir, "other.db")
		otherDB, err := sql.Open("sqlite", "file:"+other)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := otherDB.Exec(`CREATE TABLE notes (body TEXT)`); err != nil {
			t.Fatal(err)
		}
		otherDB.Close()
		tests := []struct {
			args []string
			want string
		}{
			{[]string{"trace", "--db", path, "ord_nope"}, "no order ord_nope in"},
			{[]string{"trace", "--db", path}, "takes one ORDER_ID (got 0 arguments)"},
			{[]string{"trace", "--db", text, orderIDs[0]}, text + " is not a retrysafe database: not an SQLite file"},
			{[]string{"trace", "--db", empty, orderIDs[0]}, empty + " is not a retrysafe database: not an SQLite file"},
			{[]string{"trace", "--db", other, orderIDs[0]}, other + " is not a retrysafe database: it has no orders table"},
			{[]string{"trace", "--db", filepath.Join(dir, "missing.db"), orderIDs[0]}, "no database at " + filepath.Join(dir, "missing.db")},
		}
		for _, tt := range tests {
			out, err := runTraceCLI(t, tt.args...)
			if err == nil || !strings.Contains(out, tt.want) {
				t.Errorf("%v: got %v\n%s\nwant an error mentioning %q", tt.args, err, out, tt.want)
			}
		}
		if _, err := os.Stat(filepath.Join(dir, "missing.db")); !os.IsNotExist(err) {
			t.Fatal("trace created the missing database")
		}
	})

	// Ensure trace without --db looks for retrysafe.db, as inspect does,
	// and says there is none.
	t.Run("NoDBFlagNamesTheDefaultFile", func(t *testing.T) {
		t.Chdir(t.TempDir())
		out, err := runTraceCLI(t, "trace", orderIDs[0])
		if err == nil || !strings.Contains(out, "no database at retrysafe.db") {
			t.Fatalf("got %v\n%s\nwant an error mentioning no database at retrysafe.db", err, out)
		}
	})
}

// Ensure wrapRow breaks a long text at spaces under its column, breaks a
// word only when it alone is wider than the room, and loses nothing.
func TestWrapRow(t *testing.T) {
	prefix := strings.Repeat("p", 60)
	words := strings.Repeat("word ", 30)
	long := strings.Repeat("x", 150)
	for _, text := range []string{"short", words, long, words + long + " end"} {
		got := wrapRow(prefix, 60, text)
		lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
		kept := strings.TrimPrefix(lines[0], prefix)
		for _, line := range lines {
			if n := len([]rune(line)); n > traceWidth {
				t.Errorf("line of %d columns, want at most %d: %q", n, traceWidth, line)
			}
		}
		for _, line := range lines[1:] {
			continued, ok := strings.CutPrefix(line, strings.Repeat(" ", 60))
			if !ok {
				t.Fatalf("continuation line not under the text column: %q", line)
			}
			kept += continued
		}
		if strip := strings.NewReplacer(" ", ""); strip.Replace(kept) != strip.Replace(text) {
			t.Errorf("got %q, want every character of %q", got, text)
		}
	}
}

// readmeDiagram matches docs/inspect-and-trace.md's generated trace diagram.
var readmeDiagram = regexp.MustCompile("(?s)(<!-- trace diagram: generated by TestDocsDiagram[^\n]*-->\n```mermaid\n)(.*?)(```\n)")

// readmeTraceCommand matches the order id in docs/inspect-and-trace.md's trace commands.
var readmeTraceCommand = regexp.MustCompile(`(trace --db demo\.db )ord_[0-9a-f-]+`)

// Ensure docs/inspect-and-trace.md's diagram is the trace of a real demo run: regenerate
// it with go test -run TestDocsDiagram -update.
func TestDocsDiagram(t *testing.T) {
	path := filepath.Join(t.TempDir(), "demo.db")
	orderIDs := MustRunDemo(t, path)
	diagram, err := runTraceCLI(t, "trace", "--db", path, "--mermaid", orderIDs[0])
	if err != nil {
		t.Fatalf("trace --mermaid: %v\n%s", err, diagram)
	}
	readme, err := os.ReadFile("docs/inspect-and-trace.md")
	if err != nil {
		t.Fatal(err)
	}
	m := readmeDiagram.FindSubmatchIndex(readme)
	if m == nil {
		t.Fatal("docs/inspect-and-trace.md has no block opened by <!-- trace diagram: generated by TestDocsDiagram ... --> and ```mermaid")
	}
	current := string(readme[m[4]:m[5]])
	updated := string(readme[:m[4]]) + diagram + string(readme[m[5]:])
	// docs/inspect-and-trace.md's trace commands name the same order, so they work as
	// written.
	updated = readmeTraceCommand.ReplaceAllString(updated, "${1}"+shortID(orderIDs[0]))
	if updated == string(readme) {
		return
	}
	if !*updateDocs {
		t.Fatalf("docs/inspect-and-trace.md's trace diagram or order id is stale; run go test -run TestDocsDiagram -update\ngot:\n%s\nwant (order %s):\n%s", current, orderIDs[0], diagram)
	}
	if err := os.WriteFile("docs/inspect-and-trace.md", []byte(updated), 0o644); err != nil {
		t.Fatal(err)
	}
}

// journeyPicture is the drawing of the demo's first order that the first
// page shows.
const journeyPicture = "docs/journey.svg"

// Ensure the first page's picture of an order's journey is what trace --svg
// draws for the demo's first order today: regenerate it with
// go test -run TestDocsJourneyPicture -update.
func TestDocsJourneyPicture(t *testing.T) {
	path := filepath.Join(t.TempDir(), "demo.db")
	orderIDs := MustRunDemo(t, path)
	drawn, err := runTraceCLI(t, "trace", "--db", path, "--svg", orderIDs[0])
	if err != nil {
		t.Fatalf("trace --svg: %v\n%s", err, drawn)
	}
	if !strings.HasPrefix(drawn, "<svg ") || !strings.HasSuffix(drawn, "</svg>\n") || strings.Contains(drawn, "<script") {
		t.Fatalf("trace --svg wrote no SVG, or one with a script:\n%s", drawn)
	}
	current, err := os.ReadFile(journeyPicture)
	if err == nil && string(current) == drawn {
		return
	}
	if !*updateDocs {
		t.Fatalf("%s is not what trace --svg draws for the demo's first order (%v); run go test -run TestDocsJourneyPicture -update", journeyPicture, err)
	}
	if err := os.WriteFile(journeyPicture, []byte(drawn), 0o644); err != nil {
		t.Fatal(err)
	}
}

// Ensure trace --svg shows every row of the timeline as an arrow with its
// text, escapes what came from the tables, and refuses --mermaid with it.
func TestTraceSVG(t *testing.T) {
	trace := &orderTrace{
		header: "order ord_x",
		rows: []traceRow{
			{from: traceClient, to: traceAPI, text: `POST /api/orders, key <script>&"x"`},
			{from: traceAPI, to: traceAPI, text: "order written"},
			{from: traceBroker, to: "Inbox (payment-svc)", text: "delivery 1"},
		},
		final: "order paid",
	}
	var out bytes.Buffer
	if err := printSVG(&out, trace); err != nil {
		t.Fatal(err)
	}
	svg := out.String()
	for _, want := range []string{"&lt;script&gt;&amp;&#34;x&#34;", ">order written</text>", ">delivery 1</text>", ">Inbox (payment-svc)</text>", "final: order paid"} {
		if !strings.Contains(svg, want) {
			t.Errorf("the SVG has no %q:\n%s", want, svg)
		}
	}
	if strings.Contains(svg, "<script") {
		t.Errorf("text from the tables reached the SVG unescaped:\n%s", svg)
	}
	if n := strings.Count(svg, "marker-end="); n != len(trace.rows) {
		t.Errorf("got %d arrows, want one for each of the %d rows", n, len(trace.rows))
	}
	path := filepath.Join(t.TempDir(), "demo.db")
	orderIDs := MustRunDemo(t, path)
	if out, err := runTraceCLI(t, "trace", "--db", path, "--svg", "--mermaid", orderIDs[0]); err == nil || !strings.Contains(out, "not both") {
		t.Fatalf("trace --svg --mermaid: got %v\n%s", err, out)
	}
}
