// Cleanup: idempotency keys are not an audit log. Expired keys are deleted,
// and so are old published events, acked broker messages and old inbox rows,
// in small batches so the writer lock is never held for long.

package main

import (
	"context"
	"fmt"
	"time"
)

// Retention of delivered messages. An inbox row must outlive every possible
// redelivery of its message, or a late duplicate would be applied again. A
// broker redelivers an unacked message for as long as it is unacked, so
// age alone cannot bound it: a row whose delivery the embedded broker
// still holds unacked is kept however old (the delete below checks it),
// and a copy that comes after the row is gone (a republish, a redelivery
// from NATS) is absorbed by the effect itself (a saga's started_by, an
// order's status). A week is far beyond any redelivery of a healthy
// consumer. A message that is poison for a consumer is kept however
// old (its event and the broker's copy): an operator's replay needs it.
const (
	messageRetention = 7 * 24 * time.Hour
	cleanupBatchSize = 500
)

// cleanupResult counts what cleanupOnce deleted.
type cleanupResult struct {
	Keys, OutboxEvents, BrokerMessages, InboxMessages int
}

// cleanupOnce deletes expired idempotency keys (only finished ones: an
// unfinished refund still needs its key to complete) and delivered messages
// older than messageRetention, cleanupBatchSize rows per transaction.
func (a *App) cleanupOnce(ctx context.Context) (cleanupResult, error) {
	var result cleanupResult
	now := a.now()
	retainedSince := formatTime(now.Add(-messageRetention))
	// An event's inbox rows are the proof that it was delivered until the
	// reconciler's cursor passes it (deliver.go); below, cleanup deletes
	// only the rows of events the cursor has passed. Move it first, so
	// that what was delivered since the last sweep counts.
	if err := a.advanceDeliveryCursor(ctx); err != nil {
		return result, err
	}
	var err error
	result.Keys, err = a.deleteInBatches(ctx, `
		DELETE FROM idempotency_keys WHERE (user_id, idempotency_key) IN (
			SELECT user_id, idempotency_key FROM idempotency_keys
			WHERE expires_at <= ? AND recovery_point = 'finished' LIMIT ?)`, formatTime(now))
	if err != nil {
		return result, fmt.Errorf("delete expired keys: %w", err)
	}
	result.OutboxEvents, err = a.deleteInBatches(ctx, `
		DELETE FROM outbox_events WHERE seq IN (
			SELECT seq FROM outbox_events e
			-- Never one that a consumer has not applied (check keeps
			-- reporting it until an operator sees why), nor one that a
			-- consumer holds as poison (the operator's replay needs it).
			WHERE status = 'published' AND delivery_position < `+deliveryCursor+` AND published_at <= ?
			  AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.message_id = e.event_id AND i.status = 'poison')
			LIMIT ?)`, retainedSince)
	if err != nil {
		return result, fmt.Errorf("delete published events: %w", err)
	}
	_, err = a.deleteInBatches(ctx, `
		DELETE FROM broker_deliveries WHERE (subscriber, message_seq) IN (
			SELECT subscriber, message_seq FROM broker_deliveries WHERE status = 'acked' AND acked_at <= ? LIMIT ?)`, retainedSince)
	if err != nil {
		return result, fmt.Errorf("delete acked deliveries: %w", err)
	}
	result.BrokerMessages, err = a.deleteInBatches(ctx, `
		DELETE FROM broker_messages WHERE seq IN (
			SELECT m.seq FROM broker_messages m
			WHERE m.published_at <= ?
			  AND NOT EXISTS (SELECT 1 FROM broker_deliveries d WHERE d.message_seq = m.seq)
			  AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.message_id = m.message_id AND i.status = 'poison')
			LIMIT ?)`, retainedSince)
	if err != nil {
		return result, fmt.Errorf("delete delivered messages: %w", err)
	}
	// Each DELETE repeats, on the row it deletes, the conditions on that
	// row: on PostgreSQL a DELETE that waited for another transaction's
	// lock re-checks only those on the row's latest version (the subquery
	// keeps what it read when the statement started). An inbox replay
	// that makes a week-old row's event deliverable again moves the row's
	// processed_at to now (replayInboxMessages), and the re-check keeps it.
	result.InboxMessages, err = a.deleteInBatches(ctx, `
		DELETE FROM inbox_messages
		WHERE status = 'done' AND processed_at <= ?1 AND (consumer, message_id) IN (
			SELECT consumer, message_id FROM inbox_messages i WHERE status = 'done' AND processed_at <= ?1
			  -- Never while the embedded broker still delivers the message
			  -- to that consumer (its ack was lost): the row is what makes
			  -- the redelivery a duplicate.
			  AND NOT EXISTS (
			    SELECT 1 FROM broker_messages m JOIN broker_deliveries d ON d.message_seq = m.seq
			    WHERE m.message_id = i.message_id AND d.subscriber = i.consumer AND d.status = 'pending')
			  -- Nor while the reconciler's cursor has not passed its event:
			  -- the row is what says the event is delivered, and what
			  -- makes the reconciler's copy a duplicate.
			  AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = i.message_id
			                    AND (e.delivery_position IS NULL OR e.delivery_position >= `+deliveryCursor+`))
			LIMIT ?2)`, retainedSince)
	if err != nil {
		return result, fmt.Errorf("delete old inbox rows: %w", err)
	}
	return result, nil
}

// deleteInBatches runs a DELETE whose last parameter is the batch size until
// it deletes nothing, and returns how many rows it deleted.
func (a *App) deleteInBatches(ctx context.Context, query string, cutoff string) (int, error) {
	total := 0
	for {
		result, err := a.db.ExecContext(ctx, query, cutoff, cleanupBatchSize)
		if err != nil {
			return total, err
		}
		n, err := result.RowsAffected()
		if err != nil {
			return total, err
		}
		total += int(n)
		if n < cleanupBatchSize {
			return total, nil
		}
	}
}
