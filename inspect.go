// inspect prints the tables a reader wants to look at beside the article:
// every layer's state, as aligned text or as JSON.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// inspectedTables are shown by inspect, in the order of the workflow, each
// with the columns worth reading (long ones left out of the text view).
var inspectedTables = []struct {
	name, query string
}{
	{"idempotency_keys", `SELECT user_id, idempotency_key, request_method, request_path, status, recovery_point, response_status, expires_at FROM idempotency_keys ORDER BY created_at`},
	{"orders", `SELECT order_id, user_id, amount_cents, currency, payment_method, status, refunded_cents, cancel_reason FROM orders ORDER BY created_at`},
	{"refunds", `SELECT refund_id, order_id, amount_cents, status, source, processor_refund_id FROM refunds ORDER BY created_at`},
	{"outbox_events", `SELECT seq, event_id, event_type, aggregate_id, status, attempts, last_error FROM outbox_events ORDER BY seq`},
	{"broker_messages", `SELECT seq, message_id, subject, duplicates FROM broker_messages ORDER BY seq`},
	{"broker_deliveries", `SELECT d.subscriber, m.message_id, d.status, d.delivery_count FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq ORDER BY d.message_seq, d.subscriber`},
	{"inbox_messages", `SELECT consumer, message_id, status, delivery_count, error FROM inbox_messages ORDER BY processed_at, consumer`},
	{"inbox_failures", `SELECT consumer, message_id, failures, last_error, last_failed_at FROM inbox_failures ORDER BY last_failed_at, consumer`},
	{"saga_instances", `SELECT saga_id, order_id, status, current_step, attempts, failure_reason FROM saga_instances ORDER BY created_at`},
	{"saga_steps", `SELECT saga_id, step_index, step_name, status, attempts, result FROM saga_steps ORDER BY saga_id, step_index`},
	{"stock_items", `SELECT sku, available, reserved, sold, stocked FROM stock_items ORDER BY sku`},
	{"stock_reservations", `SELECT order_id, sku, qty, status FROM stock_reservations ORDER BY created_at, sku`},
	{"processor_charges", `SELECT charge_id, idempotency_key, order_id, amount_cents, status, refunded_cents, key_hits FROM processor_charges ORDER BY created_at`},
	{"processor_refunds", `SELECT refund_id, idempotency_key, charge_id, amount_cents, key_hits FROM processor_refunds ORDER BY created_at`},
}

// tableDump is one table's rows, for inspect --json.
type tableDump struct {
	Columns []string `json:"columns"`
	Rows    [][]any  `json:"rows"`
}

// dumpTable reads a whole inspected table. inspect is for demo-sized files;
// on a large one, pipe it through head.
func dumpTable(ctx context.Context, db *sql.DB, query string) (tableDump, error) {
	rows, err := db.QueryContext(ctx, query)
	if err != nil {
		return tableDump{}, err
	}
	defer rows.Close()
	columns, err := rows.Columns()
	if err != nil {
		return tableDump{}, err
	}
	dump := tableDump{Columns: columns, Rows: [][]any{}}
	for rows.Next() {
		values := make([]any, len(columns))
		pointers := make([]any, len(columns))
		for i := range values {
			pointers[i] = &values[i]
		}
		if err := rows.Scan(pointers...); err != nil {
			return tableDump{}, err
		}
		for i, v := range values {
			if b, ok := v.([]byte); ok {
				values[i] = string(b)
			}
		}
		dump.Rows = append(dump.Rows, values)
	}
	return dump, rows.Err()
}

// inspect writes every inspected table to w, as aligned text or JSON.
func inspect(ctx context.Context, db *sql.DB, w io.Writer, asJSON bool) error {
	dumps := map[string]tableDump{}
	for _, table := range inspectedTables {
		dump, err := dumpTable(ctx, db, table.query)
		if err != nil {
			return fmt.Errorf("read %s: %w", table.name, err)
		}
		dumps[table.name] = dump
	}
	if asJSON {
		encoder := json.NewEncoder(w)
		encoder.SetIndent("", "  ")
		return encoder.Encode(dumps)
	}
	for _, table := range inspectedTables {
		dump := dumps[table.name]
		rowsWord := "rows"
		if len(dump.Rows) == 1 {
			rowsWord = "row"
		}
		fmt.Fprintf(w, "%s (%d %s)\n", table.name, len(dump.Rows), rowsWord)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  "+strings.Join(dump.Columns, "\t"))
		for _, row := range dump.Rows {
			cells := make([]string, len(row))
			for i, v := range row {
				if v == nil {
					cells[i] = "-"
				} else {
					cells[i] = fmt.Sprint(v)
				}
			}
			fmt.Fprintln(tw, "  "+strings.Join(cells, "\t"))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintln(w)
	}
	// A failed event holds back every later event of its order (the relay
	// keeps an order's events in order), so say which orders wait.
	for _, inv := range invariants(dialectOf(db)) {
		if inv.name != failedEventsInvariant {
			continue
		}
		details, err := runInvariant(ctx, db, inv, "")
		if err != nil {
			return err
		}
		for _, detail := range details {
			fmt.Fprintf(w, "ATTENTION: %s\n", detail)
		}
	}
	return nil
}
