// trace follows one order through every layer: the key it was asked under,
// the order and outbox rows written together, the relay, each delivery and
// what the inbox did with it, each saga step and compensation, each call to
// the processor with its idempotency key, refunds, and where the order ended.
// The tables hold the story in pieces; trace puts the pieces in time order,
// as text, as a Mermaid sequence diagram, or drawn as an SVG (trace_svg.go).

package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// Participants of a trace, in the order a sequence diagram shows them. Each
// consumer's inbox is a participant of its own: "Inbox (payment-svc)".
const (
	traceClient    = "Client"
	traceAPI       = "API"
	traceRelay     = "Outbox/Relay"
	traceBroker    = "Broker"
	traceSaga      = "Saga"
	traceProcessor = "Processor"
)

// Phases of an order's story. Many rows share one instant (the demo's clock
// stands still while a pass runs, and a transaction writes every row at one
// time), so rows of the same instant are put in the order of the story.
const (
	phaseCreate = iota // the key, the order, OrderCreated and its delivery
	phaseSaga          // the saga, its steps, the processor, compensations
	phaseResult        // the saga's result event and its delivery
	phaseRefund        // refunds and OrderRefunded
)

// traceRow is one event of an order's timeline: one arrow of the diagram.
type traceRow struct {
	// at is the stored time of the event, in timeFormat.
	at string
	// orderedBy is set when the table stores no time for this event: it
	// says how the row was placed, and at is borrowed from a row it follows.
	orderedBy string
	phase     int
	from, to  string
	text      string
}

// orderTrace is one order's timeline.
type orderTrace struct {
	orderID string
	header  string
	rows    []traceRow
	// final is the order's final state at finalAt: a note rather than an
	// arrow.
	final, finalAt string
}

// add appends a row that has a time of its own; its text is
// traceText(format, args...).
func (t *orderTrace) add(at string, phase int, from, to, format string, args ...any) {
	t.rows = append(t.rows, traceRow{at: at, phase: phase, from: from, to: to, text: traceText(format, args...)})
}

// addUntimed appends a row whose table stores no time for it, at the time
// given (taken from a row it must follow), saying how it was ordered.
func (t *orderTrace) addUntimed(at, orderedBy string, phase int, from, to, format string, args ...any) {
	t.rows = append(t.rows, traceRow{at: at, orderedBy: orderedBy, phase: phase, from: from, to: to, text: traceText(format, args...)})
}

// traceText formats a row's text. Its string args come from the tables
// (ids, keys, paths, error texts, some from outside): each is shown
// through terminalSafe, so that none can rewrite the timeline's lines.
func traceText(format string, args ...any) string {
	shown := make([]any, len(args))
	for i, arg := range args {
		if s, ok := arg.(string); ok {
			arg = terminalSafe(s)
		}
		shown[i] = arg
	}
	return fmt.Sprintf(format, shown...)
}

// errNoSuchOrder is returned by traceOrder for an order id that is not in
// the database.
var errNoSuchOrder = errors.New("no such order")

// errAmbiguousOrder is returned by resolveOrderID for the start of an id
// that more than one order's id begins with.
var errAmbiguousOrder = errors.New("more than one order's id begins with it; give more of the id")

// resolveOrderID returns the order id that id is, or begins: the demo and
// trace print ids shortened ("ord_da217ec1"), and a reader copies those.
// Returns errNoSuchOrder if no order's id is or begins with id, and
// errAmbiguousOrder if several begin with it.
func resolveOrderID(ctx context.Context, db *sql.DB, id string) (string, error) {
	if id == "" || !storableText(id) {
		// No order has it, and PostgreSQL would refuse it in the query.
		return "", errNoSuchOrder
	}
	// substr, not LIKE: an id's "_" would be a LIKE wildcard. An exact id
	// comes first.
	rows, err := db.QueryContext(ctx, `
		SELECT order_id FROM orders WHERE substr(order_id, 1, ?) = ?
		ORDER BY CASE WHEN order_id = ? THEN 0 ELSE 1 END, order_id LIMIT 2`, len(id), id, id)
	if err != nil {
		return "", fmt.Errorf("read order: %w", err)
	}
	defer rows.Close()
	var found []string
	for rows.Next() {
		var orderID string
		if err := rows.Scan(&orderID); err != nil {
			return "", fmt.Errorf("read order: %w", err)
		}
		found = append(found, orderID)
	}
	if err := rows.Err(); err != nil {
		return "", fmt.Errorf("read order: %w", err)
	}
	switch {
	case len(found) == 0:
		return "", errNoSuchOrder
	case found[0] == id || len(found) == 1:
		return found[0], nil
	default:
		return "", errAmbiguousOrder
	}
}

// traceOrder reads every row about the order whose id is, or begins with,
// orderID (resolveOrderID) and returns them in time order. Returns
// errNoSuchOrder if there is no such order, errAmbiguousOrder if several.
func traceOrder(ctx context.Context, db *sql.DB, orderID string) (*orderTrace, error) {
	orderID, err := resolveOrderID(ctx, db, orderID)
	if err != nil {
		return nil, err
	}
	t := &orderTrace{orderID: orderID}
	var userID, currency, paymentMethod, status, createdAt, updatedAt string
	var amount, refunded int64
	var key, chargeID, cancelReason sql.NullString
	err = db.QueryRowContext(ctx, `
		SELECT user_id, amount_cents, currency, payment_method, status, idempotency_key,
		       charge_id, refunded_cents, cancel_reason, created_at, updated_at
		FROM orders WHERE order_id = ?`, orderID).Scan(
		&userID, &amount, &currency, &paymentMethod, &status, &key,
		&chargeID, &refunded, &cancelReason, &createdAt, &updatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNoSuchOrder
	}
	if err != nil {
		return nil, fmt.Errorf("read order: %w", err)
	}
	t.header = traceText("order %s of %s: %d %s, %s", orderID, userID, amount, currency, paymentMethod)

	if err := t.addKeys(ctx, db, userID, key); err != nil {
		return nil, err
	}
	if key.Valid {
		t.add(createdAt, phaseCreate, traceAPI, traceAPI, "order written (status created), in the key's transaction")
	} else {
		t.add(createdAt, phaseCreate, traceAPI, traceAPI, "order written (status created)")
	}
	// Refunds before events: within one instant, a refund is written and
	// the processor called before its OrderRefunded event.
	if err := t.addRefunds(ctx, db); err != nil {
		return nil, err
	}
	if err := t.addEvents(ctx, db); err != nil {
		return nil, err
	}
	sagaStatus, err := t.addSaga(ctx, db)
	if err != nil {
		return nil, err
	}

	t.final = traceText("order %s", status)
	if cancelReason.Valid {
		t.final += traceText(" (%s)", cancelReason.String)
	}
	if chargeID.Valid {
		t.final += traceText(", charged %s", chargeID.String)
	}
	if refunded > 0 {
		t.final += fmt.Sprintf(", %d refunded", refunded)
	}
	if sagaStatus != "" {
		t.final += traceText(", saga %s", sagaStatus)
	}
	t.finalAt = updatedAt

	// Time first; within one instant, the story's phase; within a phase,
	// the order the rows were read in, which follows the story.
	sort.SliceStable(t.rows, func(i, j int) bool {
		if t.rows[i].at != t.rows[j].at {
			return t.rows[i].at < t.rows[j].at
		}
		return t.rows[i].phase < t.rows[j].phase
	})
	return t, nil
}

// addKeys adds the idempotency keys the order was created and refunded
// under. A key that cleanup deleted after it expired is not shown.
func (t *orderTrace) addKeys(ctx context.Context, db *sql.DB, userID string, createKey sql.NullString) error {
	rows, err := db.QueryContext(ctx, `
		SELECT idempotency_key, request_method, request_path, status, recovery_point, response_status, created_at
		FROM idempotency_keys
		WHERE user_id = ? AND (idempotency_key = ? OR request_path LIKE ?)
		ORDER BY created_at, idempotency_key`,
		userID, createKey.String, "/api/orders/"+t.orderID+"/%")
	if err != nil {
		return fmt.Errorf("read idempotency keys: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var key, method, path, status, recoveryPoint, createdAt string
		var responseStatus sql.NullInt64
		if err := rows.Scan(&key, &method, &path, &status, &recoveryPoint, &responseStatus, &createdAt); err != nil {
			return fmt.Errorf("read idempotency keys: %w", err)
		}
		phase := phaseCreate
		if path != "/api/orders" {
			phase = phaseRefund
		}
		answer := status
		if responseStatus.Valid {
			answer = fmt.Sprintf("%s, answered %d", status, responseStatus.Int64)
		}
		if recoveryPoint != "finished" {
			answer += ", at " + recoveryPoint
		}
		// The order's own id in its path adds nothing here.
		if rest, ok := strings.CutPrefix(path, "/api/orders/"+t.orderID); ok {
			path = "..." + rest
		}
		t.add(createdAt, phase, traceClient, traceAPI, "%s %s, key %s: %s", method, path, key, answer)
	}
	return rows.Err()
}

// addEvents adds each outbox event of the order: written, published to the
// broker, marked published, and delivered to each subscriber.
func (t *orderTrace) addEvents(ctx context.Context, db *sql.DB) error {
	type event struct {
		seq                              int64
		id, eventType, status, createdAt string
		attempts                         int64
		publishedAt, lastError           sql.NullString
		brokerSeq, duplicates            sql.NullInt64
		brokerPublishedAt                sql.NullString
		republishes                      int64
		republishedAt                    sql.NullString
		passed                           bool
	}
	rows, err := db.QueryContext(ctx, `
		SELECT e.seq, e.event_id, e.event_type, e.status, e.created_at, e.attempts, e.published_at, e.last_error,
		       m.seq, m.duplicates, m.published_at, e.republishes, e.republished_at,
		       `+cursorPassed+` = 'yes'
		FROM outbox_events e LEFT JOIN broker_messages m ON m.message_id = e.event_id
		WHERE e.aggregate_id = ? ORDER BY e.seq`, t.orderID)
	if err != nil {
		return fmt.Errorf("read outbox events: %w", err)
	}
	var events []event
	for rows.Next() {
		var e event
		if err := rows.Scan(&e.seq, &e.id, &e.eventType, &e.status, &e.createdAt, &e.attempts, &e.publishedAt, &e.lastError,
			&e.brokerSeq, &e.duplicates, &e.brokerPublishedAt, &e.republishes, &e.republishedAt, &e.passed); err != nil {
			rows.Close()
			return fmt.Errorf("read outbox events: %w", err)
		}
		events = append(events, e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read outbox events: %w", err)
	}
	for _, e := range events {
		phase, writer := phaseResult, traceSaga
		switch e.eventType {
		case "OrderCreated":
			phase, writer = phaseCreate, traceAPI
		case "OrderRefunded":
			phase, writer = phaseRefund, traceAPI
		}
		t.add(e.createdAt, phase, writer, traceRelay, "%s %s written (outbox seq %d), same transaction", e.eventType, e.id, e.seq)
		if e.brokerPublishedAt.Valid {
			t.add(e.brokerPublishedAt.String, phase, traceRelay, traceBroker, "published %s (broker seq %d)", e.id, e.brokerSeq.Int64)
		}
		if e.publishedAt.Valid {
			// broker_messages counts the publishes its dedupe absorbed,
			// with no time for each.
			for n := int64(1); n <= e.duplicates.Int64; n++ {
				t.addUntimed(e.publishedAt.String, "a publish the broker absorbed: placed before the outbox's published_at",
					phase, traceRelay, traceBroker, "published %s again: a duplicate, dropped by message id", e.id)
			}
			t.add(e.publishedAt.String, phase, traceRelay, traceRelay, "outbox seq %d marked published", e.seq)
		} else {
			t.add(e.createdAt, phase, traceRelay, traceRelay, "outbox seq %d not published: %s after %d attempts %s", e.seq, e.status, e.attempts, e.lastError.String)
		}
		if e.republishes > 0 {
			// Only the last republish has a time.
			t.add(e.republishedAt.String, phase, traceRelay, traceBroker,
				"republished %s, undelivered after %s (%d in all)", e.id, deliveryBound, e.republishes)
		}
		if err := t.addDeliveries(ctx, db, phase, e.id, e.brokerSeq); err != nil {
			return err
		}
		if e.publishedAt.Valid {
			if err := t.addDelivery(ctx, db, phase, e.id, e.eventType, e.publishedAt.String, e.passed); err != nil {
				return err
			}
		}
	}
	return nil
}

// addDelivery adds whether a published event is delivered: in the inbox
// of every consumer of its subject (deliver.go), or which ones it is
// missing from. It is delivered when the last of them applied it; passed
// says the reconciler's cursor has passed the event, which makes it
// delivered for good, even once cleanup has deleted the inbox rows.
func (t *orderTrace) addDelivery(ctx context.Context, db *sql.DB, phase int, eventID, eventType, publishedAt string, passed bool) error {
	var consumers, missing []string
	deliveredAt := publishedAt
	for _, target := range deliveryTargets() {
		if target.subject != eventType {
			continue
		}
		consumers = append(consumers, target.consumer)
		var processedAt sql.NullString
		err := db.QueryRowContext(ctx, `SELECT MAX(processed_at) FROM inbox_messages WHERE consumer = ? AND message_id = ?`,
			target.consumer, eventID).Scan(&processedAt)
		if err != nil {
			return fmt.Errorf("read inbox: %w", err)
		}
		switch {
		case !processedAt.Valid:
			missing = append(missing, target.consumer)
		case processedAt.String > deliveredAt:
			deliveredAt = processedAt.String
		}
	}
	switch {
	case len(missing) == 0:
		t.add(deliveredAt, phase, traceRelay, traceRelay, "%s delivered: in the inbox of %s", eventID, consumerList(consumers))
	case passed:
		t.addUntimed(publishedAt, "delivered, inbox rows deleted: placed at the publish", phase, traceRelay, traceRelay,
			"%s delivered: cleanup has since deleted the inbox rows of %s", eventID, consumerList(missing))
	default:
		t.addUntimed(publishedAt, "not delivered: placed at the publish", phase, traceRelay, traceRelay,
			"%s not delivered yet: not in the inbox of %s", eventID, consumerList(missing))
	}
	return nil
}

// consumerList names consumers for a trace line; "no consumer" if none.
func consumerList(consumers []string) string {
	if len(consumers) == 0 {
		return "no consumer (none subscribes to it)"
	}
	return strings.Join(consumers, ", ")
}

// inboxName is the participant for a consumer's inbox.
func inboxName(consumer string) string {
	return "Inbox (" + terminalSafe(consumer) + ")"
}

// addDeliveries adds each delivery of one message to each consumer, and
// what the consumer's inbox did with it. The broker counts deliveries
// (broker_deliveries.delivery_count) but stores no time for each; the inbox
// stores the delivery it applied the message on, so a delivery after it was
// skipped and one before it failed and was rolled back. On NATS the broker's
// tables stay empty, and the inbox's own counts stand in for them.
func (t *orderTrace) addDeliveries(ctx context.Context, db *sql.DB, phase int, messageID string, brokerSeq sql.NullInt64) error {
	type delivery struct {
		consumer                          string
		deliveries                        int64
		ackedAt                           sql.NullString
		inboxStatus, processedAt, errText sql.NullString
		appliedOn, duplicates             sql.NullInt64
	}
	var list []delivery
	seen := map[string]bool{}
	if brokerSeq.Valid {
		rows, err := db.QueryContext(ctx, `
			SELECT subscriber, delivery_count, acked_at FROM broker_deliveries
			WHERE message_seq = ? ORDER BY subscriber`, brokerSeq.Int64)
		if err != nil {
			return fmt.Errorf("read broker deliveries: %w", err)
		}
		for rows.Next() {
			var d delivery
			if err := rows.Scan(&d.consumer, &d.deliveries, &d.ackedAt); err != nil {
				rows.Close()
				return fmt.Errorf("read broker deliveries: %w", err)
			}
			seen[d.consumer] = true
			list = append(list, d)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return fmt.Errorf("read broker deliveries: %w", err)
		}
	}
	rows, err := db.QueryContext(ctx, `
		SELECT consumer, status, delivery_count, duplicates, processed_at, error FROM inbox_messages
		WHERE message_id = ? ORDER BY consumer`, messageID)
	if err != nil {
		return fmt.Errorf("read inbox: %w", err)
	}
	inbox := map[string]delivery{}
	for rows.Next() {
		var d delivery
		if err := rows.Scan(&d.consumer, &d.inboxStatus, &d.appliedOn, &d.duplicates, &d.processedAt, &d.errText); err != nil {
			rows.Close()
			return fmt.Errorf("read inbox: %w", err)
		}
		inbox[d.consumer] = d
		if !seen[d.consumer] {
			d.deliveries = d.appliedOn.Int64 + d.duplicates.Int64
			list = append(list, delivery{consumer: d.consumer, deliveries: d.deliveries})
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read inbox: %w", err)
	}

	for _, d := range list {
		in, applied := inbox[d.consumer]
		to := inboxName(d.consumer)
		for n := int64(1); n <= d.deliveries; n++ {
			switch {
			case applied && n == in.appliedOn.Int64:
				outcome := "applied, recorded in the inbox"
				if in.inboxStatus.String == "poison" {
					outcome = "poison, set aside: " + terminalSafe(in.errText.String)
				}
				t.add(in.processedAt.String, phase, traceBroker, to, "delivery %d of %s: %s", n, messageID, outcome)
			case applied && n > in.appliedOn.Int64:
				at, orderedBy := in.processedAt.String, "a skipped redelivery: ordered by delivery count, after the application"
				if d.ackedAt.Valid {
					at, orderedBy = d.ackedAt.String, "a skipped redelivery: ordered by delivery count, at the ack"
				}
				t.addUntimed(at, orderedBy, phase, traceBroker, to, "delivery %d of %s: skipped, already in the inbox", n, messageID)
			case applied:
				t.addUntimed(in.processedAt.String, "a failed delivery: ordered by delivery count, before the application",
					phase, traceBroker, to, "delivery %d of %s: failed, rolled back", n, messageID)
			default:
				at := d.ackedAt.String
				if at == "" && len(t.rows) > 0 {
					at = t.rows[len(t.rows)-1].at
				}
				t.addUntimed(at, "a delivery with no inbox row: ordered by delivery count, after the publish",
					phase, traceBroker, to, "delivery %d of %s: not applied (yet)", n, messageID)
			}
		}
		if d.ackedAt.Valid {
			t.add(d.ackedAt.String, phase, to, traceBroker, "ack %s", messageID)
		}
	}
	return nil
}

// addSaga adds the order's saga: started, each step that ran with the
// processor calls it made, and each compensation. It returns the saga's
// status, or "" if the order has no saga yet.
func (t *orderTrace) addSaga(ctx context.Context, db *sql.DB) (string, error) {
	var sagaID, status, createdAt string
	err := db.QueryRowContext(ctx, `SELECT saga_id, status, created_at FROM saga_instances WHERE order_id = ?`, t.orderID).
		Scan(&sagaID, &status, &createdAt)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read saga: %w", err)
	}
	t.addSagaStart(createdAt, sagaID)

	type step struct {
		index                                  int64
		name, status                           string
		result, errText, doneAt, compensatedAt sql.NullString
	}
	rows, err := db.QueryContext(ctx, `
		SELECT step_index, step_name, status, result, error, done_at, compensated_at
		FROM saga_steps WHERE saga_id = ? ORDER BY step_index`, sagaID)
	if err != nil {
		return "", fmt.Errorf("read saga steps: %w", err)
	}
	var steps []step
	for rows.Next() {
		var s step
		if err := rows.Scan(&s.index, &s.name, &s.status, &s.result, &s.errText, &s.doneAt, &s.compensatedAt); err != nil {
			rows.Close()
			return "", fmt.Errorf("read saga steps: %w", err)
		}
		steps = append(steps, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return "", fmt.Errorf("read saga steps: %w", err)
	}

	for _, s := range steps {
		// The processor ledger keys each charge by saga and step, so a
		// retried step finds its first charge instead of charging again.
		calls, err := t.addProcessorCalls(ctx, db, `
			SELECT charge_id, idempotency_key, amount_cents, currency, status, key_hits, created_at
			FROM processor_charges WHERE idempotency_key = ?`, phaseSaga, traceSaga, "charge", sagaID+":"+s.name)
		if err != nil {
			return "", err
		}
		// saga_steps.attempts is always 1: a step's row is written once,
		// when it has run. How often the saga asked for it is in the
		// processor's ledger: a step retried after a lost answer (a
		// timeout, a crash) asked again under the same key.
		asked := askedProcessor(calls)
		switch s.status {
		case "pending":
			continue // never ran
		case "failed":
			at := createdAt
			if len(t.rows) > 0 {
				at = t.rows[len(t.rows)-1].at
			}
			text := traceText("step %d %s failed: %s", s.index, s.name, s.errText.String)
			if asked != "" {
				text += " (" + asked + ")"
			}
			t.addUntimed(at, "a failed step: saga_steps stores no time for it, ordered after the row before it",
				phaseSaga, traceSaga, traceSaga, "%s", text)
		default: // done or compensated: it ran
			text := traceText("step %d %s done", s.index, s.name)
			if s.result.Valid && s.result.String != "" {
				text += " (" + terminalSafe(s.result.String) + ")"
			}
			if asked != "" {
				text += ": " + asked
			}
			t.add(s.doneAt.String, phaseSaga, traceSaga, traceSaga, "%s", text)
		}
	}
	for i := len(steps) - 1; i >= 0; i-- {
		s := steps[i]
		if s.compensatedAt.Valid {
			t.add(s.compensatedAt.String, phaseSaga, traceSaga, traceSaga, "compensate step %d %s", s.index, s.name)
		}
	}
	return status, nil
}

// addSagaStart adds the saga's start right after the delivery that started
// it: the first application of OrderCreated, in whose inbox transaction the
// saga row was written (so before that delivery's ack).
func (t *orderTrace) addSagaStart(createdAt, sagaID string) {
	for i, row := range t.rows {
		if row.phase == phaseCreate && row.from == traceBroker && strings.Contains(row.text, ": applied") {
			start := traceRow{at: createdAt, phase: phaseCreate, from: row.to, to: traceSaga, text: traceText("started %s, in the inbox's transaction", sagaID)}
			t.rows = append(t.rows[:i+1], append([]traceRow{start}, t.rows[i+1:]...)...)
			return
		}
	}
	t.add(createdAt, phaseSaga, inboxName("payment-svc"), traceSaga, "started %s, in the inbox's transaction", sagaID)
}

// addProcessorCalls adds the processor calls that query finds in the
// processor's ledger (charges or refunds), and returns how many there were.
// Each row is the first call; key_hits counts the calls the processor
// answered from the key, whose times it does not keep.
func (t *orderTrace) addProcessorCalls(ctx context.Context, db *sql.DB, query string, phase int, caller, what string, args ...any) (int64, error) {
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return 0, fmt.Errorf("read processor %ss: %w", what, err)
	}
	defer rows.Close()
	calls := int64(0)
	for rows.Next() {
		var id, idempotencyKey, currency, status, createdAt string
		var amount, keyHits int64
		if err := rows.Scan(&id, &idempotencyKey, &amount, &currency, &status, &keyHits, &createdAt); err != nil {
			return 0, fmt.Errorf("read processor %ss: %w", what, err)
		}
		t.add(createdAt, phase, caller, traceProcessor, "%s %d %s, key %s: %s %s", what, amount, currency, idempotencyKey, status, id)
		for hit := int64(1); hit <= keyHits; hit++ {
			t.addUntimed(createdAt, "a call answered from the key: the processor counts them (key_hits), placed at the first call",
				phase, caller, traceProcessor, "%s, key %s: answered from the key (%s)", what, idempotencyKey, id)
		}
		calls += 1 + keyHits
	}
	return calls, rows.Err()
}

// askedProcessor says how often a saga step asked the processor, given
// the calls its key received; "" for none or one, which the processor's
// row above it already shows.
func askedProcessor(calls int64) string {
	switch {
	case calls <= 1:
		return ""
	case calls == 2:
		return "asked the processor twice, the second answered from its key"
	default:
		return fmt.Sprintf("asked the processor %d times, the last %d answered from its key", calls, calls-1)
	}
}

// addRefunds adds the order's refunds and the processor calls that made
// them.
func (t *orderTrace) addRefunds(ctx context.Context, db *sql.DB) error {
	type refund struct {
		id, status, source, createdAt string
		amount                        int64
		processorRefundID             sql.NullString
	}
	rows, err := db.QueryContext(ctx, `
		SELECT refund_id, amount_cents, status, source, created_at, processor_refund_id
		FROM refunds WHERE order_id = ? ORDER BY created_at, refund_id`, t.orderID)
	if err != nil {
		return fmt.Errorf("read refunds: %w", err)
	}
	var refunds []refund
	for rows.Next() {
		var r refund
		if err := rows.Scan(&r.id, &r.amount, &r.status, &r.source, &r.createdAt, &r.processorRefundID); err != nil {
			rows.Close()
			return fmt.Errorf("read refunds: %w", err)
		}
		refunds = append(refunds, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read refunds: %w", err)
	}
	for _, r := range refunds {
		if r.source == "webhook" {
			// Made at the processor (its dashboard, another system): we
			// never called; its charge.refunded webhook told us.
			t.add(r.createdAt, phaseRefund, traceProcessor, traceAPI, "charge.refunded: refund %s of %d made at the processor, recorded as %s (now %s)",
				r.processorRefundID.String, r.amount, r.id, r.status)
			continue
		}
		t.add(r.createdAt, phaseRefund, traceAPI, traceAPI, "refund %s of %d written before the call (%s, now %s)", r.id, r.amount, r.source, r.status)
		// processor_refunds has no currency; the charge's is the same. An
		// API refund calls with key refund:<refund_id>.
		if _, err := t.addProcessorCalls(ctx, db, `
			SELECT p.refund_id, p.idempotency_key, p.amount_cents, c.currency, 'refunded', p.key_hits, p.created_at
			FROM processor_refunds p JOIN processor_charges c ON c.charge_id = p.charge_id
			WHERE p.idempotency_key = ?`, phaseRefund, traceAPI, "refund",
			"refund:"+r.id); err != nil {
			return err
		}
	}
	return nil
}

// uuidPattern matches the random part of retrysafe's ids ("ord_" and a
// UUID), with the id's prefix.
var uuidPattern = regexp.MustCompile(`\b([a-z]+_)?([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`)

// shortIDs shortens every id in s to its prefix and first eight hex digits:
// within one order's timeline they are still unique, and lines fit a
// terminal.
func shortIDs(s string) string {
	return uuidPattern.ReplaceAllString(s, "$1$2")
}

// idsByRole replaces every id in s by its prefix and an ellipsis ("evt_…"):
// the prefix says what the id is, and a diagram of a run stays the same
// when the run's ids change.
func idsByRole(s string) string {
	return uuidPattern.ReplaceAllString(s, "${1}…")
}

// printTrace writes the timeline as text, one row a line, or more than one
// when a row's text is wider than the room a terminal leaves it: the rest
// continues under the text column (wrapRow). No text is cut. A row shows
// its time of day; a line of its own names the day, before the first row
// and before each row on a later day than the one above it, so the date
// takes no room from the text.
func printTrace(w io.Writer, t *orderTrace) error {
	var buf bytes.Buffer
	buf.WriteString(wrapRow("", 2, t.header))
	fmt.Fprintln(&buf, "times are UTC; ~ marks a row whose table stores no time for it (see below)")
	arrowWidth := 0
	for _, row := range t.rows {
		arrowWidth = max(arrowWidth, len([]rune(row.from+" -> "+row.to)))
	}
	var orderedBy []string
	seen := map[string]bool{}
	day := ""
	for _, row := range t.rows {
		if d := traceDay(row.at); d != "" && d != day {
			day = d
			fmt.Fprintf(&buf, "on %s:\n", day)
		}
		mark := " "
		if row.orderedBy != "" {
			mark = "~"
			if !seen[row.orderedBy] {
				seen[row.orderedBy] = true
				orderedBy = append(orderedBy, row.orderedBy)
			}
		}
		prefix := fmt.Sprintf("%s%s  %-*s  ", mark, traceTimeOfDay(row.at), arrowWidth, row.from+" -> "+row.to)
		buf.WriteString(wrapRow(prefix, len([]rune(prefix)), shortIDs(row.text)))
	}
	// The final state is a summary, not a row: it is printed last, with
	// the time the order last changed, which an earlier row may follow.
	since := t.finalAt
	if d := traceDay(t.finalAt); d != "" {
		since = d + " " + traceTimeOfDay(t.finalAt)
	}
	buf.WriteString(wrapRow(" final: ", len(" final: "), fmt.Sprintf("%s (since %s)", shortIDs(t.final), since)))
	for _, o := range orderedBy {
		buf.WriteString(wrapRow("~ ", 2, o))
	}
	_, err := w.Write(buf.Bytes())
	return err
}

// traceDay returns the date of a stored time (timeFormat:
// 2006-01-02T15:04:05.000000Z), or "" if at is not one.
func traceDay(at string) string {
	if len(at) < len(timeFormat) {
		return ""
	}
	return at[:10]
}

// traceTimeOfDay returns a stored time's time of day to the millisecond,
// or at as it is if it is not a stored time.
func traceTimeOfDay(at string) string {
	if len(at) < len(timeFormat) {
		return at
	}
	return at[11:23]
}

// traceWidth is the widest line trace and inspect print: a terminal
// beside the code.
const traceWidth = 120

// minTextRoom is the narrowest column wrapRow breaks a text into: with
// wider participant names than the demo's, a line grows past traceWidth
// rather than into a column of single words.
const minTextRoom = 40

// wrapRow returns prefix and text as lines of at most traceWidth columns,
// each ending in a newline: text is broken at spaces (inside a word only
// when the word alone is wider than the room), and every line after the
// first starts with indent spaces. Nothing is cut: the lines hold every
// character of text but the spaces they were broken at.
func wrapRow(prefix string, indent int, text string) string {
	var b strings.Builder
	b.WriteString(prefix)
	room := max(traceWidth-len([]rune(prefix)), minTextRoom)
	rest := []rune(text)
	for len(rest) > room {
		cut := room
		for i := room; i > 0; i-- {
			if rest[i] == ' ' {
				cut = i
				break
			}
		}
		b.WriteString(string(rest[:cut]))
		b.WriteString("\n")
		b.WriteString(strings.Repeat(" ", indent))
		rest = rest[cut:]
		if rest[0] == ' ' {
			rest = rest[1:]
		}
		room = max(traceWidth-indent, minTextRoom)
	}
	b.WriteString(string(rest))
	b.WriteString("\n")
	return b.String()
}

// fitWidth cuts line to traceWidth, ending it with "...": inspect's brief
// view does, and --wide shows what it cut. trace wraps its rows instead
// (wrapRow), so that it never loses text.
func fitWidth(line string) string {
	if len([]rune(line)) <= traceWidth {
		return line
	}
	return string([]rune(line)[:traceWidth-3]) + "..."
}

// mermaidID is the participant's name in Mermaid source: letters only.
func mermaidID(participant string) string {
	var b strings.Builder
	for _, r := range participant {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		}
	}
	return b.String()
}

// mermaidLabel keeps a label from ending the line early: Mermaid reads ";"
// and "#" in a message.
func mermaidLabel(s string) string {
	return strings.NewReplacer(";", ",", "#", "no. ").Replace(idsByRole(s))
}

// printMermaid writes the timeline as a Mermaid sequenceDiagram: one arrow a
// row, then the final state as a note. Ids are shown by their prefix only,
// so the diagram of a run with fixed steps stays the same.
func printMermaid(w io.Writer, t *orderTrace) error {
	var buf bytes.Buffer
	fmt.Fprintln(&buf, "sequenceDiagram")
	for _, p := range traceParticipants(t) {
		fmt.Fprintf(&buf, "    participant %s as %s\n", mermaidID(p), p)
	}
	for _, row := range t.rows {
		fmt.Fprintf(&buf, "    %s->>%s: %s\n", mermaidID(row.from), mermaidID(row.to), mermaidLabel(row.text))
	}
	fmt.Fprintf(&buf, "    Note over %s: %s\n", mermaidID(traceAPI), mermaidLabel(t.final))
	_, err := w.Write(buf.Bytes())
	return err
}

// sqliteHeader starts every SQLite database file.
const sqliteHeader = "SQLite format 3\x00"

// requireRetrysafeFile returns an error unless path is an SQLite file with
// retrysafe's tables. openReadOnlyDB alone would report a text file, an
// empty file or another program's database as being at schema version 0,
// as if it only needed migrating.
func requireRetrysafeFile(ctx context.Context, path string) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return noDatabaseError(path)
	}
	if err != nil {
		return err
	}
	header := make([]byte, len(sqliteHeader))
	_, err = io.ReadFull(f, header)
	f.Close()
	if err != nil || string(header) != sqliteHeader {
		return fmt.Errorf("%s is not a retrysafe database: not an SQLite file", path)
	}
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer db.Close()
	var tables int
	err = db.QueryRowContext(ctx, `SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'orders'`).Scan(&tables)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	if tables == 0 {
		return fmt.Errorf("%s is not a retrysafe database: it has no orders table", path)
	}
	return nil
}
