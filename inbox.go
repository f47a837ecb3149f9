// The inbox (the article's "safe consumption" section): a consumer remembers
// which messages it already applied, so a redelivered message changes
// nothing. The outbox answers "did we tell anyone?"; the inbox answers "did
// we already act?".
//
// Where the article's sample went wrong, and what this file does instead:
//   - Its inbox was keyed by message_id alone, so a second consumer of the
//     same message collided with the first one's record. Here the key is
//     (consumer, message_id).
//   - It checked the inbox outside the transaction that applied the effect,
//     so two concurrent deliveries could both pass the check. Here the inbox
//     row is inserted first, in the same transaction as the effect: a
//     conflict means "already applied", and the effect is skipped.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// inboxOutcome says what happened to one delivery.
type inboxOutcome string

const (
	// inboxApplied: the effect ran and was recorded; the message is acked.
	inboxApplied inboxOutcome = "applied"
	// inboxDuplicate: the consumer had applied this message before; nothing
	// ran, and the message is acked so the broker stops redelivering it.
	inboxDuplicate inboxOutcome = "duplicate"
	// inboxPoison: the message fails for a permanent reason, or failed
	// maxDeliveries times; recorded with its error for an operator, and
	// acked so it stops looping.
	inboxPoison inboxOutcome = "poison"
	// inboxRetry: a transient failure; not acked, the broker delivers it
	// again later.
	inboxRetry inboxOutcome = "retry"
)

// permanentError marks a failure that will fail the same way every time (a
// payload that does not decode, an event that contradicts the state).
type permanentError struct{ err error }

// Error returns the wrapped error's message.
func (e *permanentError) Error() string { return e.err.Error() }

// Unwrap returns the wrapped error, for errors.Is and errors.As.
func (e *permanentError) Unwrap() error { return e.err }

// permanent marks err as permanent: retrying cannot help.
func permanent(err error) error {
	return &permanentError{err: err}
}

// isPermanent reports whether err, or an error it wraps, is permanent.
func isPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// consumer is one subscriber with the effect it applies per message.
type consumer struct {
	name     string
	subjects []string
	// apply runs inside the inbox transaction: its writes commit together
	// with the record that the message was applied.
	apply func(ctx context.Context, tx *sql.Tx, msg message) error
}

// consumers lists the system's consumers: the payment service starts the
// fulfilment saga when an order is created; the order service follows the
// payment result. (The article's sample wrote PaymentCaptured and nobody ever
// relayed or read it.)
func (a *App) consumers() []consumer {
	return []consumer{
		{name: paymentServiceConsumer, subjects: []string{eventOrderCreated}, apply: a.startFulfilment},
		{name: orderServiceConsumer, subjects: []string{eventPaymentCaptured, eventOrderCancelled}, apply: a.applyPaymentResult},
	}
}

// subscribeConsumers subscribes every consumer to its subjects. It must run
// before anything is published, as with a durable subscription on a real
// broker.
func (a *App) subscribeConsumers(ctx context.Context) error {
	for _, c := range a.consumers() {
		if err := a.broker.subscribe(ctx, c.name, c.subjects...); err != nil {
			return err
		}
	}
	return nil
}

// receiveResult is what receive did with one message.
type receiveResult struct {
	MessageID string
	Outcome   inboxOutcome
	// Err is why the message became poison or will be retried.
	Err error
}

// receive applies one message in a transaction of its own; see receiveIn.
func (a *App) receive(ctx context.Context, consumerName, messageID string, deliveryCount int, apply func(tx *sql.Tx) error) (receiveResult, error) {
	var result receiveResult
	err := withTx(ctx, a.db, func(tx *sql.Tx) error {
		var err error
		result, err = a.receiveIn(ctx, tx, consumerName, messageID, deliveryCount, apply)
		return err
	})
	return result, err
}

// receiveIn applies a message at most once for consumerName, in tx. The
// inbox row is inserted first, in the same transaction as the effect: if it
// is already there, the message is a duplicate and apply does not run. Two
// concurrent deliveries of one message serialize on the write lock; the
// second sees the first's row.
//
// The message runs in its own SAVEPOINT, so a consumer can put a whole batch
// in one transaction and a failing message undoes only its own writes. A
// permanent failure, or a transient one on the maxDeliveries-th delivery,
// records the message as poison (for this consumer only). Returns an error
// only when the process must stop (errCrash) or the inbox could not be
// written; the caller's transaction must then roll back.
func (a *App) receiveIn(ctx context.Context, tx *sql.Tx, consumerName, messageID string, deliveryCount int, apply func(tx *sql.Tx) error) (receiveResult, error) {
	result := receiveResult{MessageID: messageID}
	if _, err := tx.ExecContext(ctx, `SAVEPOINT inbox_message`); err != nil {
		return result, fmt.Errorf("savepoint: %w", err)
	}
	err := recordAndApply(ctx, tx, consumerName, messageID, deliveryCount, a.now(), apply, &result)
	if err != nil {
		if _, rollbackErr := tx.ExecContext(ctx, `ROLLBACK TO inbox_message`); rollbackErr != nil {
			return result, fmt.Errorf("rollback to savepoint: %w", rollbackErr)
		}
	}
	if _, releaseErr := tx.ExecContext(ctx, `RELEASE inbox_message`); releaseErr != nil {
		return result, fmt.Errorf("release savepoint: %w", releaseErr)
	}
	switch {
	case err == nil:
		return result, nil
	case errors.Is(err, errCrash):
		return result, err
	case dialectOf(a.db).retryTx(err):
		// PostgreSQL failed the transaction to keep it serializable: it
		// must roll back and run again (withTx does), not count as this
		// message's failure.
		return result, err
	case isPermanent(err) || deliveryCount >= maxDeliveries:
		result.Outcome = inboxPoison
		result.Err = err
		return result, recordPoison(ctx, tx, consumerName, messageID, deliveryCount, err, a.now())
	default:
		result.Outcome = inboxRetry
		result.Err = err
		return result, nil
	}
}

// recordAndApply inserts the inbox row and, if it is new, applies the
// message; a conflict means the message was applied before.
func recordAndApply(ctx context.Context, tx *sql.Tx, consumerName, messageID string, deliveryCount int, now time.Time, apply func(tx *sql.Tx) error, result *receiveResult) error {
	inserted, err := tx.ExecContext(ctx, `
		INSERT INTO inbox_messages (consumer, message_id, status, delivery_count, processed_at)
		VALUES (?, ?, 'done', ?, ?)
		ON CONFLICT (consumer, message_id) DO NOTHING`,
		consumerName, messageID, deliveryCount, formatTime(now))
	if err != nil {
		return fmt.Errorf("insert inbox message: %w", err)
	}
	n, err := inserted.RowsAffected()
	if err != nil {
		return fmt.Errorf("insert inbox message: %w", err)
	}
	if n == 0 {
		result.Outcome = inboxDuplicate
		_, err := tx.ExecContext(ctx, `
			UPDATE inbox_messages SET duplicates = duplicates + 1 WHERE consumer = ? AND message_id = ?`,
			consumerName, messageID)
		if err != nil {
			return fmt.Errorf("count duplicate: %w", err)
		}
		return nil
	}
	if err := apply(tx); err != nil {
		return err
	}
	result.Outcome = inboxApplied
	return nil
}

// recordPoison records a message this consumer gives up on. If a concurrent
// delivery applied it after all, that record stands.
func recordPoison(ctx context.Context, tx *sql.Tx, consumerName, messageID string, deliveryCount int, cause error, now time.Time) error {
	_, err := tx.ExecContext(ctx, `
		INSERT INTO inbox_messages (consumer, message_id, status, error, delivery_count, processed_at)
		VALUES (?, ?, 'poison', ?, ?, ?)
		ON CONFLICT (consumer, message_id) DO NOTHING`,
		consumerName, messageID, cause.Error(), deliveryCount, formatTime(now))
	if err != nil {
		return fmt.Errorf("record poison message %s for %s: %w", messageID, consumerName, err)
	}
	return nil
}

// consumeBackoff is how long a message that failed transiently waits before
// its next delivery: 1s, 2s, 4s ...
func consumeBackoff(deliveryCount int) time.Duration {
	return time.Second << min(deliveryCount-1, 8)
}

// consumeOnce fetches one batch for c and puts each message through the
// inbox, all in one transaction with a savepoint per message: one commit
// per batch. Applied, duplicate and poison messages are then acked;
// messages that failed transiently are not, and come back after
// consumeBackoff. A crash before the acks only means the broker delivers
// the batch again, and the inbox skips it.
func (a *App) consumeOnce(ctx context.Context, c consumer, max int) ([]receiveResult, error) {
	deliveries, err := a.broker.fetch(ctx, c.name, max)
	if err != nil || len(deliveries) == 0 {
		return nil, err
	}
	var results []receiveResult
	err = withTx(ctx, a.db, func(tx *sql.Tx) error {
		results = nil
		for _, d := range deliveries {
			result, err := a.receiveIn(ctx, tx, c.name, d.ID, d.DeliveryCount, func(tx *sql.Tx) error {
				return c.apply(ctx, tx, d.message)
			})
			if err != nil {
				return err
			}
			results = append(results, result)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var handled []delivery
	for i, d := range deliveries {
		switch results[i].Outcome {
		case inboxRetry:
			if err := a.broker.nak(ctx, d, consumeBackoff(d.DeliveryCount)); err != nil {
				return results, err
			}
		case inboxApplied, inboxDuplicate, inboxPoison:
			if err := a.fault.at(ctx, faultAfterEffect); err != nil {
				return results, err
			}
			handled = append(handled, d)
		default:
			return results, fmt.Errorf("bug: unhandled inbox outcome %q", results[i].Outcome)
		}
	}
	if err := a.broker.ack(ctx, handled...); err != nil {
		return results, err
	}
	return results, nil
}
