package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// queryStrings returns the first column of every row of query.
func queryStrings(tb testing.TB, path, query string, args ...any) []string {
	tb.Helper()
	db, err := openReadOnlyDB(context.Background(), path)
	if err != nil {
		tb.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query(query, args...)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	var values []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			tb.Fatal(err)
		}
		values = append(values, v)
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	return values
}

// decodeInspectJSON runs inspect --json with args and decodes it.
func decodeInspectJSON(tb testing.TB, args ...string) map[string]tableDump {
	tb.Helper()
	out, err := runTraceCLI(tb, append([]string{"inspect", "--json"}, args...)...)
	if err != nil {
		tb.Fatalf("inspect --json: %v\n%s", err, out)
	}
	var dumps map[string]tableDump
	if err := json.Unmarshal([]byte(out), &dumps); err != nil {
		tb.Fatalf("inspect --json: %v\n%s", err, out)
	}
	return dumps
}

func TestInspect(t *testing.T) {
	path := testDatabase(t)
	orderIDs := MustRunDemo(t, path)
	// Every id of the demo that names one order's row, by the order.
	idsOf := map[string][]string{}
	for _, orderID := range orderIDs {
		idsOf[orderID] = queryStrings(t, path, `
			SELECT order_id FROM orders WHERE order_id = ?
			UNION ALL SELECT event_id FROM outbox_events WHERE aggregate_id = ?
			UNION ALL SELECT saga_id FROM saga_instances WHERE order_id = ?
			UNION ALL SELECT charge_id FROM processor_charges WHERE order_id = ?
			UNION ALL SELECT refund_id FROM refunds WHERE order_id = ?`,
			orderID, orderID, orderID, orderID, orderID)
	}

	// Ensure the default text fits a terminal beside the code: every line
	// is at most 120 columns, and the ids that only tell rows apart are
	// shortened as trace shortens them.
	t.Run("FitsATerminal", func(t *testing.T) {
		out, err := runTraceCLI(t, "inspect", "--db", path)
		if err != nil {
			t.Fatalf("inspect: %v\n%s", err, out)
		}
		for _, line := range strings.Split(out, "\n") {
			if n := len([]rune(line)); n > 120 {
				t.Errorf("a line of %d columns, want at most 120:\n%s", n, line)
			}
		}
		for _, orderID := range orderIDs {
			// The orders table keeps the id whole: trace and --order take it.
			if !strings.Contains(out, orderID) {
				t.Errorf("inspect does not show the order id %s:\n%s", orderID, out)
			}
			for _, id := range idsOf[orderID][1:] {
				if strings.Contains(out, id) {
					t.Errorf("inspect shows %s whole, want %s:\n%s", id, shortIDs(id), out)
				}
				if !strings.Contains(out, shortIDs(id)) {
					t.Errorf("inspect does not show %s:\n%s", shortIDs(id), out)
				}
			}
		}
	})

	// Ensure --wide shows every id whole, and the columns the default
	// text leaves out.
	t.Run("WideShowsEverything", func(t *testing.T) {
		out, err := runTraceCLI(t, "inspect", "--db", path, "--wide")
		if err != nil {
			t.Fatalf("inspect --wide: %v\n%s", err, out)
		}
		for _, orderID := range orderIDs {
			for _, id := range idsOf[orderID] {
				if !strings.Contains(out, id) {
					t.Errorf("inspect --wide does not show %s whole:\n%s", id, out)
				}
			}
		}
		for _, column := range []string{"user_id", "request_method", "currency", "duplicates", "broker_delivery_count"} {
			if !strings.Contains(out, column) {
				t.Errorf("inspect --wide has no column %s:\n%s", column, out)
			}
		}
	})

	// Ensure inspect shows, beside each inbox row, how many times the
	// broker delivered the message and how many of those deliveries the
	// inbox skipped: the demo's first OrderCreated is delivered twice to
	// payment-svc and applied once.
	t.Run("ShowsRedeliveriesTheInboxSkipped", func(t *testing.T) {
		out, err := runTraceCLI(t, "inspect", "--db", path)
		if err != nil {
			t.Fatalf("inspect: %v\n%s", err, out)
		}
		created := queryStrings(t, path, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, orderIDs[0])
		if len(created) != 1 {
			t.Fatalf("got %d OrderCreated events of the first order, want 1", len(created))
		}
		// consumer, message_id, status, delivered, applied_on, skipped
		want := regexp.MustCompile(`(?m)^  payment-svc +` + regexp.QuoteMeta(shortIDs(created[0])) + ` +done +2 +1 +1 `)
		if !strings.Contains(out, "delivered  applied_on  skipped") || !want.MatchString(out) {
			t.Fatalf("inspect says:\n%s\nwant an inbox row matching %s", out, want)
		}
		out, err = runTraceCLI(t, "inspect", "--db", path, "--wide")
		if err != nil {
			t.Fatalf("inspect --wide: %v\n%s", err, out)
		}
		want = regexp.MustCompile(`(?m)^  payment-svc +` + regexp.QuoteMeta(created[0]) + ` +done +1 +1 +2 `)
		if !want.MatchString(out) {
			t.Fatalf("inspect --wide says:\n%s\nwant an inbox row matching %s", out, want)
		}
	})

	// Ensure --json keeps the columns scripts read: the inbox's counts
	// are added to the text only.
	t.Run("JSONKeepsItsColumns", func(t *testing.T) {
		dumps := decodeInspectJSON(t, "--db", path)
		got := strings.Join(dumps["inbox_messages"].Columns, ",")
		if want := "consumer,message_id,status,delivery_count,error"; got != want {
			t.Fatalf("inbox_messages columns are %s, want %s", got, want)
		}
	})

	// Ensure --order shows that order's rows in every table and no other
	// order's: in the text, whole or shortened, and in the JSON, where
	// every order's rows add up to the whole database's.
	t.Run("OrderShowsOnlyItsRows", func(t *testing.T) {
		all := decodeInspectJSON(t, "--db", path)
		sums := map[string]int{}
		for _, orderID := range orderIDs {
			for _, view := range []string{"", "--wide"} {
				args := []string{"inspect", "--db", path, "--order", orderID}
				if view != "" {
					args = append(args, view)
				}
				out, err := runTraceCLI(t, args...)
				if err != nil {
					t.Fatalf("inspect --order %s %s: %v\n%s", orderID, view, err, out)
				}
				if !strings.Contains(out, "orders (1 row)") || !strings.Contains(out, orderID) {
					t.Errorf("inspect --order %s %s does not show the order:\n%s", orderID, view, out)
				}
				for other, ids := range idsOf {
					if other == orderID {
						continue
					}
					for _, id := range ids {
						if strings.Contains(out, shortIDs(id)) {
							t.Errorf("inspect --order %s %s shows %s of order %s:\n%s", orderID, view, id, other, out)
						}
					}
				}
			}
			dumps := decodeInspectJSON(t, "--db", path, "--order", orderID)
			for name, dump := range dumps {
				sums[name] += len(dump.Rows)
			}
			for _, name := range []string{"idempotency_keys", "orders", "outbox_events", "inbox_messages", "saga_instances", "saga_steps", "processor_charges"} {
				if len(dumps[name].Rows) == 0 {
					t.Errorf("inspect --order %s shows no %s", orderID, name)
				}
			}
		}
		// Keys are left out: a key may have no order (a refused request).
		// Stock items are shared by orders. A webhook's inbox row is the
		// processor's event, not one of an order's outbox events.
		for name, dump := range all {
			if name == "idempotency_keys" || name == "stock_items" {
				continue
			}
			if name == "inbox_messages" {
				webhooks := 0
				consumer := slices.Index(dump.Columns, "consumer")
				for _, row := range dump.Rows {
					if row[consumer] == webhookConsumer {
						webhooks++
					}
				}
				if sums[name] != len(dump.Rows)-webhooks {
					t.Errorf("the orders' inbox_messages add up to %d rows, want the database's %d less %d webhooks", sums[name], len(dump.Rows), webhooks)
				}
				continue
			}
			if sums[name] != len(dump.Rows) {
				t.Errorf("the orders' %s add up to %d rows, want the database's %d", name, sums[name], len(dump.Rows))
			}
		}
	})

	// Ensure an order id that is not in the database is an error that
	// names it, not an empty set of tables.
	t.Run("UnknownOrderIsAnError", func(t *testing.T) {
		out, err := runTraceCLI(t, "inspect", "--db", path, "--order", "ord_nope")
		if err == nil || !strings.Contains(err.Error(), "no order ord_nope in") {
			t.Fatalf("inspect --order ord_nope: got %v\n%s\nwant an error naming ord_nope", err, out)
		}
	})
}

// readmeInspectSample matches docs/inspect-and-trace.md's inbox sample: the command line,
// then inspect's output.
var readmeInspectSample = regexp.MustCompile("(?s)(<!-- inspect sample: generated by TestDocsInspectSample[^\n]*-->\n```\n\\$ [^\n]*\n)(.*?)(```\n)")

// readmeInspectOrder matches the order id in docs/inspect-and-trace.md's inspect --order
// commands.
var readmeInspectOrder = regexp.MustCompile(`(inspect --db demo\.db --order )ord_[0-9a-f-]+`)

// Ensure docs/inspect-and-trace.md's inbox sample is inspect's output on a real demo run:
// regenerate it with go test -run TestDocsInspectSample -update.
func TestDocsInspectSample(t *testing.T) {
	path := filepath.Join(t.TempDir(), "demo.db")
	orderIDs := MustRunDemo(t, path)
	out, err := runTraceCLI(t, "inspect", "--db", path, "--order", orderIDs[0])
	if err != nil {
		t.Fatalf("inspect --order: %v\n%s", err, out)
	}
	// sed -n '/^inbox_messages/,/^$/p', without the closing blank line.
	start := strings.Index(out, "inbox_messages (")
	if start < 0 {
		t.Fatalf("inspect --order shows no inbox_messages:\n%s", out)
	}
	sample := out[start:]
	sample = sample[:strings.Index(sample, "\n\n")+1]

	readme, err := os.ReadFile("docs/inspect-and-trace.md")
	if err != nil {
		t.Fatal(err)
	}
	m := readmeInspectSample.FindSubmatchIndex(readme)
	if m == nil {
		t.Fatal("docs/inspect-and-trace.md has no block opened by <!-- inspect sample: generated by TestDocsInspectSample ... --> and ```")
	}
	current := string(readme[m[4]:m[5]])
	updated := string(readme[:m[4]]) + sample + string(readme[m[5]:])
	// docs/inspect-and-trace.md's inspect --order commands name the same order, so they
	// work as written.
	updated = readmeInspectOrder.ReplaceAllString(updated, "${1}"+orderIDs[0])
	if updated == string(readme) {
		return
	}
	if !*updateDocs {
		t.Fatalf("docs/inspect-and-trace.md's inspect sample or its order id is stale; run go test -run TestDocsInspectSample -update\ngot:\n%s\nwant (order %s):\n%s", current, orderIDs[0], sample)
	}
	if err := os.WriteFile("docs/inspect-and-trace.md", []byte(updated), 0o644); err != nil {
		t.Fatal(err)
	}
}
