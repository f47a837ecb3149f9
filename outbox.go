// The transactional outbox (the article's "dual-write problem" section): an
// event is written in the same transaction as the business row it announces,
// and a relay publishes it later. The outbox makes publishing reliable, not
// exactly-once: a relay that dies after publishing and before marking
// publishes again, and the broker's dedupe and the consumers' inboxes absorb
// the copy.
//
// Where the article's sample went wrong: its relay read pending rows and
// published them without claiming them, so two relays running together
// published every event twice in the same sweep. Here one relay at a time
// holds the relay lease and publishes; the others wait for it to pass.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// Event types, and the payload each carries.
const (
	eventOrderCreated    = "OrderCreated"
	eventPaymentCaptured = "PaymentCaptured"
	eventOrderCancelled  = "OrderCancelled"
	eventOrderRefunded   = "OrderRefunded"
)

// orderCreatedPayload is the payload of OrderCreated.
type orderCreatedPayload struct {
	OrderID       string      `json:"order_id"`
	UserID        string      `json:"user_id"`
	AmountCents   int64       `json:"amount_cents"`
	Currency      string      `json:"currency"`
	Items         []orderItem `json:"items"`
	PaymentMethod string      `json:"payment_method"`
}

// paymentCapturedPayload is the payload of PaymentCaptured.
type paymentCapturedPayload struct {
	OrderID     string `json:"order_id"`
	ChargeID    string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
}

// orderCancelledPayload is the payload of OrderCancelled.
type orderCancelledPayload struct {
	OrderID string `json:"order_id"`
	Reason  string `json:"reason"`
}

// orderRefundedPayload is the payload of OrderRefunded.
type orderRefundedPayload struct {
	OrderID     string `json:"order_id"`
	RefundID    string `json:"refund_id"`
	AmountCents int64  `json:"amount_cents"`
}

// outboxStatus is outbox_events.status.
type outboxStatus string

const (
	outboxPending   outboxStatus = "pending"
	outboxPublished outboxStatus = "published"
	outboxFailed    outboxStatus = "failed"
)

// Batch sizes of the background jobs. A saga pass takes as many sagas as
// one consumer batch can start: at 16, a backlog of orders waited for the
// saga loop, 16 sagas a pass, and a round's commit served a quarter of
// what it could (72 settled orders/s on PostgreSQL, 8 clients sending
// 1,000 orders at once; 185 at 64).
const (
	relayBatchSize   = 128
	consumeBatchSize = 64
	sagaBatchSize    = consumeBatchSize
	refundBatchSize  = 16
)

// outboxEvent is an event on its way out.
type outboxEvent struct {
	Seq         int64
	EventID     string
	EventType   string
	AggregateID string
	Payload     []byte
	Attempts    int
	// LeaseToken is the token of the relay lease the event was claimed
	// under (holdRelayLease): the relay's marks take effect only while the
	// lease still has it. (The reconciler's copies carry the event's own
	// lease_token instead: see deliver.go.)
	LeaseToken int64
	// Trace is the event's creation context (tracing.go), which the relay
	// copies into the message.
	Trace traceContext
}

// newOutboxEvent returns an event with a fresh event_id. The event_id is the
// message id all the way: broker dedupe and every consumer's inbox key on it.
func (a *App) newOutboxEvent(eventType, aggregateID string, payload any) (outboxEvent, error) {
	encoded, err := json.Marshal(payload)
	if err != nil {
		return outboxEvent{}, fmt.Errorf("encode %s payload: %w", eventType, err)
	}
	return outboxEvent{
		EventID:     a.newID("evt"),
		EventType:   eventType,
		AggregateID: aggregateID,
		Payload:     encoded,
	}, nil
}

// insertOutboxEvent writes event in tx: it is published if and only if the
// rest of tx commits. Its "create" span, a child of ctx's span, is its
// creation context, stored with it (tracing.go).
func insertOutboxEvent(ctx context.Context, tx *sql.Tx, event outboxEvent, now time.Time) error {
	creation, span := startCreateSpan(ctx, event)
	defer span.End()
	traceparent, tracestate := creation.columns()
	_, err := tx.ExecContext(ctx, `
		INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at,
		                           traceparent, tracestate)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		event.EventID, event.EventType, event.AggregateID, event.Payload, outboxPending,
		formatTime(now), formatTime(now), traceparent, tracestate,
	)
	if err != nil {
		failSpan(span, err)
		return fmt.Errorf("insert outbox event: %w", err)
	}
	return nil
}

// relayBackoff is how long the relay waits before it tries an event again
// after its attempts-th failure: base (1 s, or less under --lease-scale),
// then twice as long each time, at most 300 times base (5 minutes).
func relayBackoff(base time.Duration, attempts int) time.Duration {
	backoff := base << min(attempts-1, 9)
	return min(backoff, 300*base)
}

// relayLeaseName names the relay lease of a database: one relay at a time
// publishes its outbox (relay_leases).
const relayLeaseName = "outbox"

// relayLeaseMemory is what a process knows of the relay lease: whether one
// of its relays holds it, under which token, until when, and whether a
// relay of the process is sweeping under it now (one at a time: two would
// claim the same events, since a claim writes nothing).
type relayLeaseMemory struct {
	mu    sync.Mutex
	held  bool
	token int64
	until time.Time
	// sweeping is the token of the sweep in flight, 0 when none (a token
	// is never 0: the first taking makes it 1).
	sweeping int64
}

// holdRelayLease starts a sweep of relayID under the relay lease and
// returns the lease's fencing token, taking the lease if it has passed; ok
// is false while another relay holds it, in this process or another, and
// relayID then publishes nothing. A sweep that got ok ends with
// endRelaySweep.
//
// The lease is one row for the whole outbox, not a claim written into each
// event: while one relay holds it no other publishes, so a claim is a read
// and an event's row is written once, when it is marked published. Each
// taking of the lease adds one to its token, and so does a renewal after
// the lease passed: a relay's claims count only under the token they were
// made with (markPublished), so a relay paused past its lease marks
// nothing, whether or not another relay took over meanwhile. A renewal of
// a live lease keeps the token. The holder renews when half the lease has
// gone; until then a sweep costs no statement for the lease.
//
// A relay name is for one process at a time (serve's includes its pid). A
// relay under the name of the holder takes the lease over at once, with a
// new token: a process restarted under the same name does not wait out the
// lease of the one that died.
func (a *App) holdRelayLease(ctx context.Context, relayID string) (token int64, ok bool, err error) {
	m := &a.relayLeases
	m.mu.Lock()
	defer m.mu.Unlock()
	now := a.now()
	live := m.held && m.until.After(now)
	if live && m.sweeping != 0 {
		return 0, false, nil // another relay of this process is sweeping
	}
	if live && m.until.Sub(now) > a.leases.relay/2 {
		m.sweeping = m.token
		return m.token, true, nil
	}
	ours := int64(-1) // matches no lease: a new token
	if m.held {
		ours = m.token
	}
	until := now.Add(a.leases.relay)
	err = a.db.QueryRowContext(ctx, `
		UPDATE relay_leases
		SET lease_token = CASE WHEN lease_token = ?2 AND leased_until > ?3 THEN lease_token ELSE lease_token + 1 END,
		    holder = ?1, leased_until = ?4
		WHERE name = ?5 AND (lease_token = ?2 OR holder = ?1 OR leased_until <= ?3)
		RETURNING lease_token`,
		relayID, ours, formatTime(now), formatTime(until), relayLeaseName).Scan(&token)
	if errors.Is(err, sql.ErrNoRows) {
		m.held = false
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("hold the relay lease: %w", err)
	}
	m.held, m.token, m.until, m.sweeping = true, token, until, token
	return token, true, nil
}

// endRelaySweep ends the sweep holdRelayLease started under token. lost
// says the sweep found the lease gone (its mark changed nothing): the next
// sweep asks the database again.
func (a *App) endRelaySweep(token int64, lost bool) {
	m := &a.relayLeases
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sweeping == token {
		m.sweeping = 0
	}
	if lost && m.token == token {
		m.held = false
	}
}

// claimOutboxEvents returns up to limit publishable events to publish
// under the relay lease's token (holdRelayLease); each carries it. An
// event is publishable when it is pending, due, and the
// oldest unpublished event of its aggregate: events of one order go out in
// the order they were written.
//
// The claim writes nothing: the lease keeps other relays away. It picks
// rows by their status, never "every seq above the last one published": on
// PostgreSQL a seq is assigned at insert, so an event may become visible
// after one with a higher seq. A relay that sees event 2 of an order while
// event 1 is not yet committed (they were written by concurrent
// transactions) does not take event 2: it is not the oldest unpublished
// event of its order.
func (a *App) claimOutboxEvents(ctx context.Context, token int64, limit int) ([]outboxEvent, error) {
	// The join reads the lease's token with the events: a lease taken
	// over since holdRelayLease gives nothing.
	rows, err := a.db.QueryContext(ctx, `
		SELECT e.seq, e.event_id, e.event_type, e.aggregate_id, e.payload, e.attempts, lease.lease_token, e.traceparent, e.tracestate
		FROM outbox_events e
		JOIN relay_leases lease ON lease.name = ? AND lease.lease_token = ?
		WHERE e.status = 'pending'
		  AND e.next_attempt_at <= ?
		  AND NOT EXISTS (
			SELECT 1 FROM outbox_events earlier
			WHERE earlier.aggregate_id = e.aggregate_id
			  AND earlier.seq < e.seq
			  AND earlier.status <> 'published')
		ORDER BY e.seq
		LIMIT ?`,
		relayLeaseName, token, formatTime(a.now()), limit)
	if err != nil {
		return nil, fmt.Errorf("claim outbox events: %w", err)
	}
	return scanClaimedEvents(rows)
}

// scanClaimedEvents reads the events a claim gives (seq, event_id,
// event_type, aggregate_id, payload, attempts, lease_token, traceparent,
// tracestate), closes rows, and returns them in the order they were
// written (a RETURNING gives no order).
func scanClaimedEvents(rows *sql.Rows) ([]outboxEvent, error) {
	defer rows.Close()
	var events []outboxEvent
	for rows.Next() {
		var event outboxEvent
		var traceparent, tracestate sql.NullString
		if err := rows.Scan(&event.Seq, &event.EventID, &event.EventType, &event.AggregateID, &event.Payload, &event.Attempts, &event.LeaseToken,
			&traceparent, &tracestate); err != nil {
			return nil, fmt.Errorf("scan claimed outbox event: %w", err)
		}
		event.Trace = traceContextFrom(traceparent, tracestate)
		events = append(events, event)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	sort.Slice(events, func(i, j int) bool { return events[i].Seq < events[j].Seq })
	return events, nil
}

// relayOnce publishes one batch of pending outbox events to the broker and
// marks them published: the article's sweep_once(). It returns how many it
// published.
//
// A crash after publishing and before marking leaves the events pending; once
// the relay lease passes, a relay publishes them again (the broker drops the
// copy by message id). A failed publish is retried with relayBackoff, and after
// maxPublishAttempts the event is marked failed: kept, shown by inspect,
// never dropped.
func (a *App) relayOnce(ctx context.Context, relayID string, batchSize int) (published int, err error) {
	// Sample flaw 9: it published pending rows without claiming them, so
	// two relays published every event twice. Here only the relay that
	// holds the relay lease publishes.
	token, ok, err := a.holdRelayLease(ctx, relayID)
	if err != nil || !ok {
		return 0, err
	}
	lost := false
	defer func() { a.endRelaySweep(token, lost) }()
	events, err := a.claimOutboxEvents(ctx, token, batchSize)
	if err != nil || len(events) == 0 {
		return 0, err
	}
	// The batch is one "send" span, and is logged and counted when it ends
	// (observeRelay).
	ctx, span := a.startSendSpan(ctx, relayID, events)
	defer func() { a.observeRelay(span, relayID, events, published, err) }()
	msgs := make([]message, len(events))
	for i, event := range events {
		// Sample flaw 10: the message id is the event id, which the
		// broker and every inbox deduplicate by.
		msgs[i] = message{ID: event.EventID, Subject: event.EventType, Payload: event.Payload, Trace: event.Trace}
	}
	// One batch: a broker round trip per batch, not per event.
	if err := a.broker.publishBatch(ctx, msgs); err != nil {
		return 0, a.recordPublishFailures(ctx, relayID, events, err)
	}
	// The broker has the batch, the outbox still says pending.
	if err := a.fault.at(ctx, faultAfterPublish); err != nil {
		return 0, err
	}
	marked, err := a.markPublished(ctx, events)
	if err != nil {
		return 0, err
	}
	// A mark that changed nothing found the lease taken over: the events
	// are the new holder's to publish, and this relay's sweeps wait.
	lost = marked == 0
	return len(events), nil
}

// recordPublishFailures records that the broker refused events
// (recordPublishFailure), unless the process is dying (errCrash): then it
// records nothing and returns publishErr.
func (a *App) recordPublishFailures(ctx context.Context, relayID string, events []outboxEvent, publishErr error) error {
	if errors.Is(publishErr, errCrash) {
		return publishErr
	}
	// The send failed, though relayOnce returns no error: it recorded why.
	failSpan(trace.SpanFromContext(ctx), publishErr)
	for _, event := range events {
		if err := a.recordPublishFailure(ctx, relayID, event, publishErr); err != nil {
			return err
		}
	}
	return nil
}

// markPublished marks events published, in one statement for the batch, and
// returns how many it marked,
// if the relay lease still has the token they were claimed under: a relay
// that was paused past its lease, whether or not another relay took the
// lease meanwhile, leaves them pending for the relay that holds it now,
// which publishes them again (the broker drops the copy by message id). It
// checks the token in the statement that writes, so that a takeover
// cannot come between the check and the write; on PostgreSQL the check
// waits for a takeover that is committing (dialect.forShare).
func (a *App) markPublished(ctx context.Context, events []outboxEvent) (marked int64, err error) {
	if len(events) == 0 {
		return 0, nil
	}
	args := make([]any, 0, len(events)+3)
	args = append(args, formatTime(a.now()))
	for _, event := range events {
		args = append(args, event.Seq)
	}
	args = append(args, relayLeaseName, events[0].LeaseToken)
	result, err := a.db.ExecContext(ctx, `
		UPDATE outbox_events
		SET status = 'published', published_at = ?, delivery_position = `+dialectOf(a.db).deliveryPosition+`
		WHERE status = 'pending' AND seq IN (`+placeholders(len(events))+`)
		  AND `+underRelayLease(a.db),
		args...)
	if err != nil {
		return 0, fmt.Errorf("mark %d outbox events published: %w", len(events), err)
	}
	marked, err = result.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("mark %d outbox events published: %w", len(events), err)
	}
	return marked, nil
}

// underRelayLease is the condition that makes a relay's write count only
// while the relay lease still has the token its batch was claimed under;
// its two parameters are the lease's name and that token (markPublished).
func underRelayLease(db *sql.DB) string {
	return `EXISTS (SELECT 1 FROM relay_leases WHERE name = ? AND lease_token = ? ` + dialectOf(db).forShare + `)`
}

// recordPublishFailure releases a failed event for a later attempt, or marks
// it failed after maxPublishAttempts. Only under the relay lease's token it
// was claimed with (see markPublished): a stale relay's failure must not
// count against (or fail) an event that another relay has published or is
// publishing.
func (a *App) recordPublishFailure(ctx context.Context, relayID string, event outboxEvent, publishErr error) error {
	attempts := event.Attempts + 1
	status := outboxPending
	if attempts >= maxPublishAttempts {
		status = outboxFailed
	}
	recorded, err := a.db.ExecContext(ctx, `
		UPDATE outbox_events
		SET status = ?, attempts = ?, next_attempt_at = ?, last_error = ?
		WHERE event_id = ? AND status = 'pending'
		  AND `+underRelayLease(a.db),
		status, attempts, formatTime(a.now().Add(relayBackoff(a.leases.publishBackoff, attempts))), publishErr.Error(),
		event.EventID, relayLeaseName, event.LeaseToken)
	if err != nil {
		return fmt.Errorf("record publish failure of %s: %w", event.EventID, err)
	}
	n, err := recorded.RowsAffected()
	if err != nil {
		return fmt.Errorf("record publish failure of %s: %w", event.EventID, err)
	}
	if n == 0 {
		// Not ours any more: the relay that holds the claim records it.
		return nil
	}
	// ctx carries the relay's send span (startSendSpan).
	withTraceID(a.log, trace.SpanContextFromContext(ctx)).Warn("relay publish failed", "relay", relayID, "event_id", event.EventID, "event_type", event.EventType, "order_id", event.AggregateID,
		"attempts", attempts, "status", string(status), "error", publishErr.Error())
	if status == outboxPending {
		a.metrics.publishRetried()
	}
	return nil
}
