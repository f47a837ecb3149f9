// The transactional outbox (the article's "dual-write problem" section): an
// event is written in the same transaction as the business row it announces,
// and a relay publishes it later. The outbox makes publishing reliable, not
// exactly-once: a relay that dies after publishing and before marking
// publishes again, and the broker's dedupe and the consumers' inboxes absorb
// the copy.
//
// Where the article's sample went wrong: its relay read pending rows and
// published them without claiming them, so two relays running together
// published every event twice in the same sweep. relayOnce claims a batch
// under a lease first.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
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

// Batch sizes of the background jobs.
const (
	relayBatchSize   = 128
	consumeBatchSize = 64
	sagaBatchSize    = 16
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
	// LeaseToken is the event's lease_token after the relay's claim: the
	// relay's marks take effect only while it still matches.
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

// claimOutboxEvents leases up to limit publishable events to relayID. An
// event is publishable when it is pending, due, not leased to a live relay,
// and the oldest unpublished event of its aggregate: events of one order go
// out in the order they were written, even with several relays.
//
// It claims rows by their status, never "every seq above the last one
// published": on PostgreSQL a seq is assigned at insert, so an event may
// become visible after one with a higher seq. A relay that sees event 2 of
// an order while event 1 is being claimed by another relay (or is not yet
// committed, if they were written by concurrent transactions) does not take
// event 2: it is not the oldest unpublished event of its order.
func (a *App) claimOutboxEvents(ctx context.Context, relayID string, limit int) ([]outboxEvent, error) {
	var events []outboxEvent
	err := withClaimTx(ctx, a.db, func(tx *sql.Tx) error {
		events = nil
		now := formatTime(a.now())
		// lease_token + 1: each claim's fencing token (see markPublished).
		rows, err := tx.QueryContext(ctx, `
			UPDATE outbox_events
			SET claimed_by = ?, claimed_until = ?, lease_token = lease_token + 1
			WHERE seq IN (
				SELECT e.seq FROM outbox_events e
				WHERE e.status = 'pending'
				  AND e.next_attempt_at <= ?
				  AND (e.claimed_until IS NULL OR e.claimed_until <= ?)
				  AND NOT EXISTS (
					SELECT 1 FROM outbox_events earlier
					WHERE earlier.aggregate_id = e.aggregate_id
					  AND earlier.seq < e.seq
					  AND earlier.status <> 'published')
				ORDER BY e.seq
				LIMIT ? `+skipLocked(a.db)+`)
			RETURNING seq, event_id, event_type, aggregate_id, payload, attempts, lease_token, traceparent, tracestate`,
			relayID, formatTime(a.now().Add(a.leases.relay)), now, now, limit)
		if err != nil {
			return fmt.Errorf("claim outbox events: %w", err)
		}
		events, err = scanClaimedEvents(rows)
		return err
	})
	if err != nil {
		return nil, err
	}
	return events, nil
}

// scanClaimedEvents reads the events a claim's RETURNING gives (seq,
// event_id, event_type, aggregate_id, payload, attempts, lease_token,
// traceparent, tracestate), closes rows, and returns the events in the
// order they were written: RETURNING gives no order.
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
// A crash after publishing and before marking leaves the events claimed; once
// the lease passes, a relay publishes them again (the broker drops the copy by
// message id). A failed publish is retried with relayBackoff, and after
// maxPublishAttempts the event is marked failed: kept, shown by inspect,
// never dropped.
func (a *App) relayOnce(ctx context.Context, relayID string, batchSize int) (published int, err error) {
	// Sample flaw 9: it published pending rows without claiming them, so
	// two relays published every event twice. Here a batch is claimed
	// under a lease first.
	events, err := a.claimOutboxEvents(ctx, relayID, batchSize)
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
	if err := a.markPublished(ctx, relayID, events); err != nil {
		return 0, err
	}
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

// markPublished marks events published, in one statement for the batch.
// Each event is marked only under the claim this relay made (its seq and
// lease token): a relay that was paused past its lease, while another relay
// claimed the event, leaves it alone, and the relay that took it over
// publishes and marks it. (A relay name is not enough to tell: a restarted
// process may reuse it.)
func (a *App) markPublished(ctx context.Context, relayID string, events []outboxEvent) error {
	if len(events) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(events)+2)
	args = append(args, formatTime(a.now()), relayID)
	for _, event := range events {
		args = append(args, event.Seq, event.LeaseToken)
	}
	_, err := a.db.ExecContext(ctx, `
		UPDATE outbox_events
		SET status = 'published', published_at = ?, claimed_by = NULL, claimed_until = NULL
		WHERE status = 'pending' AND claimed_by = ?
		  AND (seq, lease_token) IN `+integerPairs(len(events)),
		args...)
	if err != nil {
		return fmt.Errorf("mark %d outbox events published: %w", len(events), err)
	}
	return nil
}

// recordPublishFailure releases a failed event for a later attempt, or marks
// it failed after maxPublishAttempts. Only under this relay's claim: a stale
// relay's failure must not count against (or fail) an event that another
// relay has published or is publishing.
func (a *App) recordPublishFailure(ctx context.Context, relayID string, event outboxEvent, publishErr error) error {
	attempts := event.Attempts + 1
	status := outboxPending
	if attempts >= maxPublishAttempts {
		status = outboxFailed
	}
	recorded, err := a.db.ExecContext(ctx, `
		UPDATE outbox_events
		SET status = ?, attempts = ?, next_attempt_at = ?, last_error = ?, claimed_by = NULL, claimed_until = NULL
		WHERE event_id = ? AND status = 'pending' AND claimed_by = ? AND lease_token = ?`,
		status, attempts, formatTime(a.now().Add(relayBackoff(a.leases.publishBackoff, attempts))), publishErr.Error(),
		event.EventID, relayID, event.LeaseToken)
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
