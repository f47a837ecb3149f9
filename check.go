// check audits a database for the promises the four layers make: nothing
// happened twice, nothing was lost, and once the system is quiet everything
// has finished. It reads only, so anyone can run it against a copy of a live
// file; every invariant is a query that lists its violations.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"time"
)

// invariant is one promise and the query that lists where it is broken.
type invariant struct {
	name string
	// settledOnly marks promises that hold once the system is quiet, not
	// while work is in flight.
	settledOnly bool
	// sinceRecent marks a query that takes one parameter: the oldest
	// created_at whose events cleanup has certainly not deleted.
	sinceRecent bool
	// publishedBefore marks a query that takes one parameter: now minus
	// deliveryLag. It is a promise about time, which the simulator's clock
	// (a day can pass between two worker passes) breaks with nothing
	// wrong; the simulator checks it once quiet.
	publishedBefore bool
	query           string
}

// violation is one place where an invariant is broken.
type violation struct {
	Invariant string `json:"invariant"`
	Detail    string `json:"detail"`
}

// failedEventsInvariant names the invariant that lists failed outbox
// events and the orders they hold back; inspect prints it too.
const failedEventsInvariant = "no outbox event has failed to publish"

// deliveryLag is how long after its publish an event may wait for its
// consumers before check reports it: the reconciler's bound twice, so a
// lost message has had its copy and the copy its consumers.
const deliveryLag = 2 * deliveryBound

// undeliveredInvariant names the invariant that lists events published
// more than deliveryLag ago that a consumer has not applied.
var undeliveredInvariant = fmt.Sprintf("no event published more than %s ago is undelivered", deliveryLag)

// invariants returns every invariant, its queries written for d.
func invariants(d *dialect) []invariant {
	respondedOrderID := d.jsonField("k.response_body", "order_id")
	// Which consumer must apply which event: their subscriptions
	// (deliveryTargets), as the reconciler reads them.
	missingInbox := `
		SELECT e.event_type || ' ' || e.event_id || ' of ' || e.aggregate_id || ' was published at ' || COALESCE(e.published_at, '?') ||
		       ' and ' || s.consumer || ' has not applied it (republished ' || e.republishes || ' times)'
		FROM outbox_events e JOIN ` + subscriptionsTable(deliveryTargets()) + ` s ON s.subject = e.event_type
		WHERE NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.consumer = s.consumer AND i.message_id = e.event_id)`
	// The events in flight only (outbox_events_delivery): the reconciler's
	// cursor passes an event once it has every inbox row, and the next
	// invariant says it did.
	inFlight := `
		  AND e.delivery_position >= ` + deliveryCursor
	return []invariant{
		{name: "an idempotency key maps to at most one order", query: `
			SELECT a.user_id || ' key ' || a.idempotency_key || ' made orders ' || a.order_id || ' and ' || b.order_id
			FROM orders a JOIN orders b
			  ON a.user_id = b.user_id AND a.idempotency_key = b.idempotency_key AND a.order_id < b.order_id
			WHERE ` + d.withinADay("a.created_at", "b.created_at")},
		{name: "every stored 201 names an order of that user", query: `
			SELECT k.user_id || ' key ' || k.idempotency_key || ' answered order ' ||
			       COALESCE(` + respondedOrderID + `, '?') || ', which does not exist'
			FROM idempotency_keys k
			WHERE k.request_path = '/api/orders' AND k.response_status = 201
			  AND NOT EXISTS (SELECT 1 FROM orders o
			                  WHERE o.order_id = ` + respondedOrderID + ` AND o.user_id = k.user_id)`},
		{name: "every order has exactly one OrderCreated event", sinceRecent: true, query: `
			SELECT o.order_id || ' has ' || COALESCE(c.events, 0) || ' OrderCreated events'
			FROM orders o
			-- Counted once per order, then joined: joined row by row, SQLite
			-- (3.54) indexed the events by event_type only and read every
			-- OrderCreated for every order, an audit of 20,000 orders took
			-- 90 seconds and of a million would never end. outbox_events
			-- has no index on aggregate_id of its own: the create path
			-- would pay for it.
			LEFT JOIN (SELECT aggregate_id, COUNT(*) AS events FROM outbox_events
			           WHERE event_type = 'OrderCreated' GROUP BY aggregate_id) c
			  ON c.aggregate_id = o.order_id
			WHERE c.events > 1 OR (c.events IS NULL AND o.created_at >= ?)`},
		{name: "every order announces its payment at most once", query: `
			SELECT aggregate_id || ' has ' || COUNT(*) || ' ' || event_type || ' events'
			FROM outbox_events WHERE event_type IN ('PaymentCaptured', 'OrderCancelled')
			GROUP BY aggregate_id, event_type HAVING COUNT(*) > 1`},
		{name: "an order's refunded amount is the sum of its refunds", query: `
			SELECT o.order_id || ' says ' || o.refunded_cents || ' refunded, its refunds add up to ' ||
			       COALESCE((SELECT SUM(r.amount_cents) FROM refunds r WHERE r.order_id = o.order_id AND r.status = 'succeeded'), 0)
			FROM orders o
			WHERE o.refunded_cents <> COALESCE((SELECT SUM(r.amount_cents) FROM refunds r WHERE r.order_id = o.order_id AND r.status = 'succeeded'), 0)`},
		{name: "an order's refunded amount is a whole number no larger than the order", query: `
			SELECT order_id || ' refunded ' || refunded_cents || ' of ' || amount_cents
			FROM orders
			WHERE refunded_cents > amount_cents OR NOT ` + d.isInteger("refunded_cents")},
		{name: "a saga's status agrees with its steps", query: `
			SELECT s.saga_id || ' of order ' || s.order_id || ' is ' || s.status || ' with steps ' ||
			       COALESCE((SELECT string_agg(st.step_name || '=' || st.status, ' ' ORDER BY st.step_index)
			                 FROM saga_steps st WHERE st.saga_id = s.saga_id), 'none run')
			FROM saga_instances s
			-- A step has a row once it has run (done or failed; compensated
			-- once undone), and the steps run in order: the rows are the
			-- first steps, without a gap.
			WHERE EXISTS (SELECT 1 FROM saga_steps st WHERE st.saga_id = s.saga_id
			              AND st.step_index >= (SELECT COUNT(*) FROM saga_steps c WHERE c.saga_id = s.saga_id))
			   OR CASE s.status
			      -- Every step ran.
			      WHEN 'completed' THEN (SELECT COUNT(*) FROM saga_steps st WHERE st.saga_id = s.saga_id AND st.status = 'done') <> ` + fmt.Sprint(len(fulfilmentSteps())) + `
			      -- Going forward: nothing failed or was undone, and a step is left.
			      WHEN 'in_progress' THEN EXISTS (SELECT 1 FROM saga_steps st WHERE st.saga_id = s.saga_id AND st.status <> 'done')
			                           OR (SELECT COUNT(*) FROM saga_steps st WHERE st.saga_id = s.saga_id) >= ` + fmt.Sprint(len(fulfilmentSteps())) + `
			      -- Going back: the last step that ran failed, and it alone.
			      ELSE (SELECT COUNT(*) FROM saga_steps st WHERE st.saga_id = s.saga_id AND st.status = 'failed') <> 1
			           OR EXISTS (SELECT 1 FROM saga_steps st JOIN saga_steps f ON f.saga_id = st.saga_id AND f.status = 'failed'
			                      WHERE st.saga_id = s.saga_id AND st.step_index > f.step_index)
			           -- Compensated: everything that ran is undone.
			           OR (s.status = 'compensated' AND EXISTS (SELECT 1 FROM saga_steps st WHERE st.saga_id = s.saga_id AND st.status = 'done'))
			      END`},
		{name: failedEventsInvariant, query: `
			SELECT f.event_type || ' ' || f.event_id || ' of ' || f.aggregate_id || ' failed after ' || f.attempts ||
			       ' attempts (' || COALESCE(f.last_error, 'no error recorded') || '); ' ||
			       (SELECT COUNT(*) FROM outbox_events later
			        WHERE later.aggregate_id = f.aggregate_id AND later.seq > f.seq AND later.status <> 'published') ||
			       ' later events of ' || f.aggregate_id || ' wait behind it'
			FROM outbox_events f WHERE f.status = 'failed'`},
		{name: "no order is charged twice", query: `
			SELECT order_id || ' was charged ' || COUNT(*) || ' times'
			FROM processor_charges WHERE status = 'succeeded' GROUP BY order_id HAVING COUNT(*) > 1`},
		{name: "no charge is refunded beyond what it captured", query: `
			SELECT c.charge_id || ' captured ' || c.amount_cents || ', refunded ' || c.refunded_cents ||
			       ', refunds add up to ' || COALESCE((SELECT SUM(r.amount_cents) FROM processor_refunds r WHERE r.charge_id = c.charge_id), 0)
			FROM processor_charges c
			WHERE c.refunded_cents > c.amount_cents
			   OR c.refunded_cents <> COALESCE((SELECT SUM(r.amount_cents) FROM processor_refunds r WHERE r.charge_id = c.charge_id), 0)`},
		// Sold stock is a reserved hold of a completed saga (stock.go):
		// what is reserved is held or sold.
		{name: "stock is conserved (available + reserved = stocked)", query: `
			SELECT s.sku || ': ' || s.available || ' available + ' || COALESCE(SUM(r.qty), 0) || ' reserved <> ' || s.stocked
			FROM stock_items s
			LEFT JOIN stock_holds r ON r.sku = s.sku AND r.status = 'reserved'
			GROUP BY s.sku, s.available, s.stocked
			HAVING s.available + COALESCE(SUM(r.qty), 0) <> s.stocked`},
		{name: "a cancelled order sold nothing and holds no money", query: `
			SELECT o.order_id || ' is cancelled but ' ||
			       CASE WHEN EXISTS (SELECT 1 FROM saga_instances s WHERE s.order_id = o.order_id AND s.status = 'completed')
			            THEN 'sold stock (its saga completed)' ELSE 'the processor holds its money' END
			FROM orders o
			WHERE o.status = 'cancelled'
			  AND (EXISTS (SELECT 1 FROM saga_instances s WHERE s.order_id = o.order_id AND s.status = 'completed')
			       OR COALESCE((SELECT SUM(c.amount_cents - c.refunded_cents) FROM processor_charges c
			                    WHERE c.order_id = o.order_id AND c.status = 'succeeded'), 0) <> 0)`},
		{name: "an order's status agrees with its money", query: `
			SELECT o.order_id || ' is ' || o.status || ' with charge ' || COALESCE(o.charge_id, 'none') ||
			       ', refunded ' || o.refunded_cents || ' of ' || o.amount_cents || ', ' ||
			       (SELECT COUNT(*) FROM refunds r WHERE r.order_id = o.order_id) || ' refunds'
			FROM orders o
			WHERE CASE o.status
			      -- Not paid yet: no money has moved that the order knows of, so
			      -- none can have come back (a refund of it is refused as early).
			      WHEN 'created' THEN o.charge_id IS NOT NULL OR o.refunded_cents <> 0
			                       OR EXISTS (SELECT 1 FROM refunds r WHERE r.order_id = o.order_id)
			      -- Paid: charged, and something of it is still kept.
			      WHEN 'paid' THEN o.charge_id IS NULL OR o.refunded_cents >= o.amount_cents
			      -- Refunded: charged, and all of it given back.
			      WHEN 'refunded' THEN o.charge_id IS NULL OR o.refunded_cents <> o.amount_cents
			      -- Cancelled: never paid, so never refunded either (a charge
			      -- the saga made and compensated is the processor's record,
			      -- not the order's).
			      ELSE o.charge_id IS NOT NULL OR o.refunded_cents <> 0
			           OR EXISTS (SELECT 1 FROM refunds r WHERE r.order_id = o.order_id)
			      END`},
		{name: "a paid or refunded order was charged its amount, once", query: `
			SELECT o.order_id || ' is ' || o.status || ' for ' || o.amount_cents || ' ' || o.currency || ' but its charge ' ||
			       COALESCE(o.charge_id, 'none') || ' is ' || COALESCE(c.status || ' ' || c.amount_cents || ' ' || c.currency || ' of ' || c.order_id, 'unknown to the processor')
			FROM orders o LEFT JOIN processor_charges c ON c.charge_id = o.charge_id
			WHERE o.status IN ('paid', 'refunded')
			  AND (c.charge_id IS NULL OR c.status <> 'succeeded' OR c.order_id <> o.order_id
			       OR c.amount_cents <> o.amount_cents OR c.currency <> o.currency)`},
		// Sold: every item's hold still reserved, and the saga completed.
		// The holds are the reserve_stock record read with the order's
		// items (stock_holds, schema version 14): all of them are reserved
		// while that record is done, and none once it is compensated.
		{name: "a paid or refunded order sold every item, and released none", query: `
			SELECT o.order_id || ' is ' || o.status || ' with saga ' || COALESCE(s.status, 'missing') ||
			       ' and its reserve_stock ' || COALESCE(st.status, 'not run')
			FROM orders o LEFT JOIN saga_instances s ON s.order_id = o.order_id
			LEFT JOIN saga_steps st ON st.saga_id = s.saga_id AND st.step_name = 'reserve_stock'
			WHERE o.status IN ('paid', 'refunded')
			  AND (s.status IS NULL OR s.status <> 'completed' OR st.status IS NULL OR st.status <> 'done')`},
		// A hold is the record of reserve_stock read with the order's
		// items (stock_holds): an order whose items cannot be read holds
		// nothing there, and would show only as stock not conserved.
		{name: "an order whose stock was reserved holds each of its items", query: `
			SELECT s.order_id || ' had its stock reserved, but its items cannot be read: ' || substr(o.items, 1, 40)
			FROM saga_steps st JOIN saga_instances s ON s.saga_id = st.saga_id
			JOIN orders o ON o.order_id = s.order_id
			WHERE st.step_name = 'reserve_stock' AND st.status IN ('done', 'compensated')
			  AND NOT EXISTS (SELECT 1 FROM stock_holds r WHERE r.order_id = s.order_id AND r.sku IS NOT NULL AND r.qty > 0)`},
		{name: "a cancelled order holds no stock", query: `
			SELECT o.order_id || ' is cancelled but still holds ' || r.qty || ' of ' || r.sku
			FROM orders o JOIN stock_holds r ON r.order_id = o.order_id
			WHERE o.status = 'cancelled' AND r.status = 'reserved'`},
		{name: "a refund is of a paid or refunded order, and with those in flight never exceeds it", query: `
			SELECT o.order_id || ' is ' || o.status || ' for ' || o.amount_cents || ' with refunds pending or made of ' ||
			       COALESCE((SELECT SUM(r.amount_cents) FROM refunds r WHERE r.order_id = o.order_id AND r.status IN ('pending', 'succeeded')), 0)
			FROM orders o
			WHERE EXISTS (SELECT 1 FROM refunds r WHERE r.order_id = o.order_id)
			  AND (o.status NOT IN ('paid', 'refunded')
			       OR (SELECT SUM(r.amount_cents) FROM refunds r WHERE r.order_id = o.order_id AND r.status IN ('pending', 'succeeded')) > o.amount_cents)`},
		{name: "a refund counted as made is one the processor made, of that charge and amount", query: `
			SELECT r.refund_id || ' of ' || r.order_id || ' is ' || r.status || ' for ' || r.amount_cents ||
			       ' but the processor has ' || COALESCE(p.refund_id || ' of ' || p.amount_cents || ' from ' || p.charge_id, 'no such refund')
			FROM refunds r JOIN orders o ON o.order_id = r.order_id
			LEFT JOIN processor_refunds p ON p.refund_id = r.processor_refund_id
			WHERE (r.status = 'succeeded' AND (p.refund_id IS NULL OR p.amount_cents <> r.amount_cents OR p.charge_id <> o.charge_id))
			   -- Pending or refused: no processor refund is tied to it.
			   OR (r.status <> 'succeeded' AND r.processor_refund_id IS NOT NULL)`},
		{name: "an order never counts more refunded than the processor gave back", query: `
			SELECT o.order_id || ' counts ' || o.refunded_cents || ' refunded, the processor gave back ' || c.refunded_cents || ' of ' || c.charge_id
			FROM orders o JOIN processor_charges c ON c.charge_id = o.charge_id
			WHERE o.refunded_cents > c.refunded_cents`},

		{name: "once quiet, every order is paid, cancelled or refunded", settledOnly: true, query: `
			SELECT order_id || ' is still ' || status FROM orders WHERE status = 'created'`},
		{name: "once quiet, the processor holds exactly what each order kept", settledOnly: true, query: `
			SELECT o.order_id || ' is ' || o.status || ' for ' || o.amount_cents || ' (refunded ' || o.refunded_cents ||
			       ') but the processor holds ' || COALESCE(SUM(c.amount_cents - c.refunded_cents), 0)
			FROM orders o LEFT JOIN processor_charges c ON c.order_id = o.order_id AND c.status = 'succeeded'
			GROUP BY o.order_id
			HAVING COALESCE(SUM(c.amount_cents - c.refunded_cents), 0) <>
			       CASE o.status WHEN 'paid' THEN o.amount_cents - o.refunded_cents
			                     WHEN 'refunded' THEN 0
			                     WHEN 'cancelled' THEN 0
			                     ELSE -1 END`},
		{name: "once quiet, no refund is left pending", settledOnly: true, query: `
			SELECT refund_id || ' of ' || order_id || ' is still pending' FROM refunds WHERE status = 'pending'`},
		{name: "once quiet, nothing is reserved but what was sold", settledOnly: true, query: `
			SELECT r.sku || ' still has ' || SUM(r.qty) || ' reserved for sagas not completed' FROM stock_holds r
			WHERE r.status = 'reserved' AND NOT ` + soldHold + `
			GROUP BY r.sku`},
		{name: "once quiet, every saga is terminal and agrees with its order", settledOnly: true, query: `
			SELECT o.order_id || ' is ' || o.status || ' with saga ' || COALESCE(s.status, 'missing')
			FROM orders o LEFT JOIN saga_instances s ON s.order_id = o.order_id
			WHERE NOT ((s.status = 'completed' AND o.status IN ('paid', 'refunded'))
			        OR (s.status = 'compensated' AND o.status = 'cancelled'))`},
		{name: undeliveredInvariant, publishedBefore: true, query: missingInbox + inFlight + `
		  AND e.published_at <= ?`},
		{name: "once quiet, every published event is applied by each consumer of its subject", settledOnly: true, query: missingInbox + inFlight},
		// Since the event was written, no inbox row of it can be older
		// than the retention cleanup deletes at: every row it lacks was
		// never there.
		{name: "the reconciler's cursor has passed only events every consumer applied", sinceRecent: true, query: missingInbox + `
		  AND e.delivery_position < ` + deliveryCursor + ` AND e.created_at > ?`},
		{name: "once quiet, no event is left unpublished", settledOnly: true, query: `
			SELECT event_type || ' ' || event_id || ' is ' || status FROM outbox_events WHERE status <> 'published'`},
		{name: "once quiet, no delivery is left unacked", settledOnly: true, query: `
			SELECT d.subscriber || ' has not acked ' || m.message_id
			FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq WHERE d.status <> 'acked'`},
		{name: "once quiet, no message is poison", settledOnly: true, query: `
			SELECT consumer || ' gave up on ' || message_id || ': ' || COALESCE(error, '') FROM inbox_messages WHERE status = 'poison'`},
		{name: "once quiet, every idempotency key is finished", settledOnly: true, query: `
			SELECT user_id || ' key ' || idempotency_key || ' is at ' || recovery_point FROM idempotency_keys WHERE recovery_point <> 'finished'`},
	}
}

// audit runs every invariant against db (the settled ones only if settled)
// and returns the violations. now dates what cleanup may have deleted.
func audit(ctx context.Context, db *sql.DB, now time.Time, settled bool) ([]violation, error) {
	auditor, err := prepareAuditor(ctx, db)
	if err != nil {
		return nil, err
	}
	defer auditor.close()
	return auditor.audit(ctx, now, settled)
}

// auditor holds every invariant's query prepared, for a caller that audits
// the same database again and again (the simulator does after every step):
// parsing the queries is most of what one audit of a small database costs.
type auditor struct {
	invariants []invariant
	statements []*sql.Stmt
}

// prepareAuditor prepares every invariant's query on db.
func prepareAuditor(ctx context.Context, db *sql.DB) (*auditor, error) {
	a := &auditor{invariants: invariants(dialectOf(db))}
	for _, inv := range a.invariants {
		statement, err := db.PrepareContext(ctx, inv.query)
		if err != nil {
			a.close()
			return nil, fmt.Errorf("prepare check %q: %w", inv.name, err)
		}
		a.statements = append(a.statements, statement)
	}
	return a, nil
}

// close releases the prepared statements.
func (a *auditor) close() {
	for _, statement := range a.statements {
		statement.Close()
	}
}

// audit runs every invariant (the settled ones only if settled) and returns
// the violations. now dates what cleanup may have deleted.
func (a *auditor) audit(ctx context.Context, now time.Time, settled bool) ([]violation, error) {
	recent := formatTime(now.Add(-messageRetention))
	lagging := formatTime(now.Add(-deliveryLag))
	var violations []violation
	for i, inv := range a.invariants {
		if inv.settledOnly && !settled {
			continue
		}
		var args []any
		if inv.sinceRecent {
			args = append(args, recent)
		}
		if inv.publishedBefore {
			args = append(args, lagging)
		}
		rows, err := a.statements[i].QueryContext(ctx, args...)
		details, err := violationDetails(inv, rows, err)
		if err != nil {
			return nil, err
		}
		for _, detail := range details {
			violations = append(violations, violation{Invariant: inv.name, Detail: detail})
		}
	}
	return violations, nil
}

// runInvariant runs one invariant's query on db and returns its
// violations' details. recent is the oldest created_at that cleanup has
// certainly not deleted (see sinceRecent).
func runInvariant(ctx context.Context, db *sql.DB, inv invariant, recent string) ([]string, error) {
	var args []any
	if inv.sinceRecent {
		args = append(args, recent)
	}
	rows, err := db.QueryContext(ctx, inv.query, args...)
	return violationDetails(inv, rows, err)
}

// violationDetails reads the details an invariant's query returned (rows
// and err are its result).
func violationDetails(inv invariant, rows *sql.Rows, err error) ([]string, error) {
	if err != nil {
		return nil, fmt.Errorf("check %q: %w", inv.name, err)
	}
	defer rows.Close()
	var details []string
	for rows.Next() {
		var detail string
		if err := rows.Scan(&detail); err != nil {
			return nil, fmt.Errorf("check %q: %w", inv.name, err)
		}
		details = append(details, detail)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("check %q: %w", inv.name, err)
	}
	return details, nil
}

// printAudit writes the violations, or a line saying all invariants hold.
// It returns an error if there is any violation.
func printAudit(w io.Writer, violations []violation, settled bool) error {
	checked := 0
	for _, inv := range invariants(sqliteDialect()) { // names and flags are the same in every dialect
		if settled || !inv.settledOnly {
			checked++
		}
	}
	if len(violations) == 0 {
		fmt.Fprintf(w, "ok: all %d invariants hold\n", checked)
		return nil
	}
	for _, v := range violations {
		fmt.Fprintf(w, "VIOLATION %s: %s\n", v.Invariant, terminalSafe(v.Detail))
	}
	return fmt.Errorf("%d violations of %d invariants", len(violations), checked)
}
