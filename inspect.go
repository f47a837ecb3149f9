// inspect prints the tables a reader wants to look at beside the article:
// every layer's state, as aligned text or as JSON, for every order or for
// one.

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

// inspectedTable is one table inspect shows, with the columns of each view.
// Every view reads the same rows: from, ofOrder and orderBy are shared.
type inspectedTable struct {
	name string
	// columns are the columns of --json and, unless wide is set, of the
	// text with --wide. The JSON's stay as they are: scripts read them.
	columns string
	// wide adds to the --wide text what a reader wants beside the columns.
	wide string
	// brief are the default text's columns: the ones a reader needs, so a
	// line fits a terminal (ids are shortened too, see inspectBrief).
	brief string
	// whole is a column whose ids the default text keeps whole: the id a
	// reader copies into trace or --order.
	whole string
	from  string
	// ofOrder keeps only one order's rows (inspect --order); each ? in it
	// is the order id.
	ofOrder string
	orderBy string
}

// eventsOfOrder selects the outbox events of one order: the broker's
// messages and the inbox's rows carry the event id as their message id.
const eventsOfOrder = `(SELECT event_id FROM outbox_events WHERE aggregate_id = ?)`

// deliveredByBroker is how many times the embedded broker delivered an
// inbox row's message to its consumer. The inbox applies a message once and
// skips every later delivery, so the two counts side by side are the
// redeliveries the inbox absorbed. On NATS the broker's tables stay empty
// and this is NULL.
const deliveredByBroker = `(SELECT d.delivery_count FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq
	WHERE m.message_id = i.message_id AND d.subscriber = i.consumer)`

// inspectedTables are shown by inspect, in the order of the workflow.
var inspectedTables = []inspectedTable{
	{
		name:    "idempotency_keys",
		columns: `user_id, idempotency_key, request_method, request_path, status, recovery_point, response_status, expires_at`,
		// status is completed exactly when recovery_point is finished.
		brief: `idempotency_key, request_path, recovery_point, response_status AS response, expires_at`,
		from:  `idempotency_keys`,
		// The key the order was created under, and the keys of the
		// requests on the order (its refunds), both scoped to its user.
		ofOrder: `user_id = (SELECT user_id FROM orders WHERE order_id = ?)
			AND (idempotency_key = (SELECT idempotency_key FROM orders WHERE order_id = ?)
			     OR request_path LIKE '/api/orders/' || ? || '/%')`,
		orderBy: `created_at`,
	},
	{
		name:    "orders",
		columns: `order_id, user_id, amount_cents, currency, payment_method, status, refunded_cents, cancel_reason`,
		brief:   `order_id, amount_cents, payment_method, status, refunded_cents AS refunded, cancel_reason`,
		whole:   "order_id",
		from:    `orders`,
		ofOrder: `order_id = ?`,
		orderBy: `created_at`,
	},
	{
		name:    "refunds",
		columns: `refund_id, order_id, amount_cents, status, source, processor_refund_id`,
		from:    `refunds`,
		ofOrder: `order_id = ?`,
		orderBy: `created_at`,
	},
	{
		name:    "outbox_events",
		columns: `seq, event_id, event_type, aggregate_id, status, attempts, last_error`,
		from:    `outbox_events`,
		ofOrder: `aggregate_id = ?`,
		orderBy: `seq`,
	},
	{
		// Not a table: each event beside each consumer that must apply
		// it (deliveryTargets), and whether that consumer's inbox has it.
		// An event is delivered when every one has (deliver.go).
		name: "event_deliveries",
		// passed: the reconciler's cursor has passed the event, which is
		// delivered for good, inbox rows or not.
		columns: `e.event_id, e.event_type, s.consumer, e.status, COALESCE(i.status, 'missing') AS inbox, e.republishes, e.delivery_position, ` + cursorPassed + ` AS passed`,
		brief:   `e.event_id, e.event_type, s.consumer, COALESCE(i.status, 'missing') AS inbox, e.republishes AS republished, ` + cursorPassed + ` AS passed`,
		from: `outbox_events e JOIN ` + subscriptionsTable(deliveryTargets()) + ` s ON s.subject = e.event_type
			LEFT JOIN inbox_messages i ON i.consumer = s.consumer AND i.message_id = e.event_id`,
		ofOrder: `e.aggregate_id = ?`,
		orderBy: `e.seq, s.consumer`,
	},
	{
		name:    "broker_messages",
		columns: `seq, message_id, subject, duplicates`,
		from:    `broker_messages`,
		ofOrder: `message_id IN ` + eventsOfOrder,
		orderBy: `seq`,
	},
	{
		name:    "broker_deliveries",
		columns: `d.subscriber, m.message_id, d.status, d.delivery_count`,
		from:    `broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq`,
		ofOrder: `m.message_id IN ` + eventsOfOrder,
		orderBy: `d.message_seq, d.subscriber`,
	},
	{
		name:    "inbox_messages",
		columns: `consumer, message_id, status, delivery_count, error`,
		wide:    `consumer, message_id, status, delivery_count, duplicates, ` + deliveredByBroker + ` AS broker_delivery_count, error`,
		brief:   `consumer, message_id, status, ` + deliveredByBroker + ` AS delivered, delivery_count AS applied_on, duplicates AS skipped, error`,
		from:    `inbox_messages i`,
		ofOrder: `message_id IN ` + eventsOfOrder,
		orderBy: `processed_at, consumer`,
	},
	{
		name:    "inbox_failures",
		columns: `consumer, message_id, failures, last_error, last_failed_at`,
		// The error last: a long one is cut, not the time.
		brief:   `consumer, message_id, failures, last_failed_at, last_error`,
		from:    `inbox_failures`,
		ofOrder: `message_id IN ` + eventsOfOrder,
		orderBy: `last_failed_at, consumer`,
	},
	{
		name:    "saga_instances",
		columns: `saga_id, order_id, status, current_step, attempts, failure_reason`,
		from:    `saga_instances`,
		ofOrder: `order_id = ?`,
		orderBy: `created_at`,
	},
	{
		name:    "saga_steps",
		columns: `saga_id, step_index, step_name, status, attempts, result`,
		from:    `saga_steps`,
		ofOrder: `saga_id IN (SELECT saga_id FROM saga_instances WHERE order_id = ?)`,
		orderBy: `saga_id, step_index`,
	},
	{
		name: "stock_items",
		// reserved and sold are the SKU's reservations (schema version
		// 11), sold those of completed sagas (version 13).
		columns: `sku, available,
			(SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku = stock_items.sku AND r.status = 'reserved' AND NOT ` + soldHold + `) AS reserved,
			(SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku = stock_items.sku AND ` + soldHold + `) AS sold, stocked`,
		from:    `stock_items`,
		ofOrder: `sku IN (SELECT sku FROM stock_holds WHERE order_id = ?)`,
		orderBy: `sku`,
	},
	{
		name:    "stock_holds",
		columns: `order_id, sku, qty, status`,
		from:    `stock_holds`,
		ofOrder: `order_id = ?`,
		orderBy: `created_at, sku`,
	},
	{
		name:    "processor_charges",
		columns: `charge_id, idempotency_key, order_id, amount_cents, status, refunded_cents, key_hits`,
		from:    `processor_charges`,
		ofOrder: `order_id = ?`,
		orderBy: `created_at`,
	},
	{
		name:    "processor_refunds",
		columns: `refund_id, idempotency_key, charge_id, amount_cents, key_hits`,
		from:    `processor_refunds`,
		ofOrder: `charge_id IN (SELECT charge_id FROM processor_charges WHERE order_id = ?)`,
		orderBy: `created_at`,
	},
	{
		// Who repaired what (repair.go): the operator's side of the story.
		name:    "repair_log",
		columns: `operator, action, target, result, created_at`,
		brief:   `operator, action, target, created_at`,
		from:    `repair_log`,
		// Every repair's result names the order it was for.
		ofOrder: `result LIKE '%' || CAST(? AS TEXT) || '%'`,
		orderBy: `created_at, repair_id`,
	},
}

// inspectView is which columns inspect shows.
type inspectView int

const (
	inspectBrief inspectView = iota // the default text: fits 120 columns
	inspectWide                     // --wide: every column, whole ids
	inspectJSON                     // --json: the columns scripts read
)

// inspectOptions are inspect's flags.
type inspectOptions struct {
	view inspectView
	// orderID, when set, keeps only that order's rows in every table.
	orderID string
}

// query returns the table's query for view, with one order's rows only if
// orderID is set, and its arguments.
func (t inspectedTable) query(view inspectView, orderID string) (string, []any) {
	columns := t.columns
	switch view {
	case inspectBrief:
		if t.brief != "" {
			columns = t.brief
		} else if t.wide != "" {
			columns = t.wide
		}
	case inspectWide:
		if t.wide != "" {
			columns = t.wide
		}
	case inspectJSON:
	}
	query := `SELECT ` + columns + ` FROM ` + t.from
	var args []any
	if orderID != "" {
		query += ` WHERE ` + t.ofOrder
		for range strings.Count(t.ofOrder, "?") {
			args = append(args, orderID)
		}
	}
	return query + ` ORDER BY ` + t.orderBy, args
}

// tableDump is one table's rows, for inspect --json.
type tableDump struct {
	Columns []string `json:"columns"`
	Rows    [][]any  `json:"rows"`
}

// dumpTable reads a whole inspected table. inspect is for demo-sized files;
// on a large one, pipe it through head.
func dumpTable(ctx context.Context, db *sql.DB, query string, args ...any) (tableDump, error) {
	rows, err := db.QueryContext(ctx, query, args...)
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
// opts.orderID may be the start of the id, as the demo prints it
// (resolveOrderID). Returns an error wrapping errNoSuchOrder if
// opts.orderID names no order, errAmbiguousOrder if several.
func inspect(ctx context.Context, db *sql.DB, w io.Writer, opts inspectOptions) error {
	if opts.orderID != "" {
		orderID, err := resolveOrderID(ctx, db, opts.orderID)
		if err != nil {
			return fmt.Errorf("order %s: %w", terminalSafe(opts.orderID), err)
		}
		opts.orderID = orderID
	}
	dumps := map[string]tableDump{}
	for _, table := range inspectedTables {
		query, args := table.query(opts.view, opts.orderID)
		dump, err := dumpTable(ctx, db, query, args...)
		if err != nil {
			return fmt.Errorf("read %s: %w", table.name, err)
		}
		dumps[table.name] = dump
	}
	if opts.view == inspectJSON {
		encoder := json.NewEncoder(w)
		encoder.SetIndent("", "  ")
		return encoder.Encode(dumps)
	}
	// The brief view shortens ids to their prefix and first eight hex
	// digits, as trace does, and cuts what still does not fit (only a long
	// error text, as the widest columns come last).
	fit := func(line string) string {
		if opts.view == inspectWide {
			return line
		}
		return fitWidth(line)
	}
	cell := func(v any, whole bool) string {
		if v == nil {
			return "-"
		}
		if opts.view == inspectWide || whole {
			return terminalSafe(fmt.Sprint(v))
		}
		return shortIDs(terminalSafe(fmt.Sprint(v)))
	}
	for _, table := range inspectedTables {
		dump := dumps[table.name]
		rowsWord := "rows"
		if len(dump.Rows) == 1 {
			rowsWord = "row"
		}
		fmt.Fprintf(w, "%s (%d %s)\n", table.name, len(dump.Rows), rowsWord)
		var aligned strings.Builder
		tw := tabwriter.NewWriter(&aligned, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  "+strings.Join(dump.Columns, "\t"))
		for _, row := range dump.Rows {
			cells := make([]string, len(row))
			for i, v := range row {
				cells[i] = cell(v, dump.Columns[i] == table.whole)
			}
			fmt.Fprintln(tw, "  "+strings.Join(cells, "\t"))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		for _, line := range strings.SplitAfter(aligned.String(), "\n") {
			if line == "" {
				continue
			}
			fmt.Fprintln(w, fit(strings.TrimSuffix(line, "\n")))
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
			if opts.orderID != "" && !strings.Contains(detail, opts.orderID) {
				continue
			}
			detail = terminalSafe(detail)
			if opts.view != inspectWide {
				detail = shortIDs(detail)
			}
			fmt.Fprintln(w, fit("ATTENTION: "+detail))
		}
	}
	return nil
}
