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
	"encoding/json"
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
	// inboxPoison: the message fails for a permanent reason, or the
	// consumer's own code failed on it maxDeliveries times (the inbox's
	// count, not the broker's); recorded with its error for an operator,
	// and acked so it stops looping.
	inboxPoison inboxOutcome = "poison"
	// inboxRetry: a transient failure, counted in inbox_failures; naked,
	// the broker delivers it again after consumeBackoff.
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

// maxMessageIDLength bounds, in bytes, an id from outside that an inbox
// row is to key on: a NATS message's id, a webhook's event id. PostgreSQL
// refuses a b-tree key longer than about 2700 bytes (SQLSTATE 54000), and
// such an id failed the message's inbox insert, then its failure count:
// on NATS the whole batch rolled back, at every delivery, for ever. 255,
// as for an Idempotency-Key (maxKeyLength); our own ids are under 50.
const maxMessageIDLength = 255

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
// relayed or read it.) Then any that addConsumer wired in.
func (a *App) consumers() []consumer {
	return append([]consumer{
		{name: paymentServiceConsumer, subjects: []string{eventOrderCreated}, apply: a.startFulfilment},
		{name: orderServiceConsumer, subjects: []string{eventPaymentCaptured, eventOrderCancelled}, apply: a.applyPaymentResult},
	}, a.addedConsumers...)
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

// noFailureLimit, passed as receiveIn's maxFailures, means that transient
// failures never make a message poison. It is for a sender that retries on
// its own schedule and decides itself when to give up: the card processor
// retries a webhook that got a 5xx for days, and a webhook made poison
// after a few 503s (a refund still being recorded, errRefundInFlight) would
// be acknowledged and its refund never counted.
const noFailureLimit = 0

// receiveResult is what receive did with one message.
type receiveResult struct {
	MessageID string
	Outcome   inboxOutcome
	// Err is why the message became poison or will be retried.
	Err error
	// Failures is how many transient failures of the consumer's own code
	// the inbox has counted for this message (inbox_failures), this one
	// included; 0 unless Outcome is retry or poison.
	Failures int
}

// receive applies one message in a transaction of its own, for a sender
// that retries on its own schedule and gives up on its own (the processor's
// webhooks): its transient failures are counted but never make the message
// poison (noFailureLimit), the caller answers them with a 5xx. A permanent
// failure is poison at once. See receiveIn. Broker consumers go through
// consumeOnce, which gives up after maxDeliveries failures instead: the
// broker itself never gives up.
func (a *App) receive(ctx context.Context, consumerName, messageID string, deliveryCount int, apply func(tx *sql.Tx) error) (receiveResult, error) {
	var result receiveResult
	err := withItems(ctx, a.db, withTx, func(tx *sql.Tx, undo *itemUndo) error {
		var err error
		result, err = a.entry.receiveIn(ctx, tx, undo, consumerName, messageID, deliveryCount, noFailureLimit, apply)
		return err
	})
	if err == nil {
		a.metrics.inboxOutcome(consumerName, result.Outcome)
	}
	return result, err
}

// receiveIn applies a message at most once for consumerName, in tx: the
// article's consume_order_created(). The inbox row is inserted first, in the
// same transaction as the effect: if it is already there, the message is a
// duplicate and apply does not run. Two concurrent deliveries of one message
// serialize on the write lock; the second sees the first's row.
//
// The message's writes are undone alone if it fails (undo: in its own
// SAVEPOINT, see itemUndo), so a consumer can put a whole batch in one
// transaction and a failing message undoes only its own writes; its
// failure is then recorded in tx (recordFailure).
//
// Returns an error only when tx must roll back: the process, the context or
// the database failed, not the message (isOurFailure), or the inbox could
// not be written. Nothing is counted then, so an outage of any length uses
// up no message's tries.
func (a *App) receiveIn(ctx context.Context, tx *sql.Tx, undo *itemUndo, consumerName, messageID string, deliveryCount, maxFailures int, apply func(tx *sql.Tx) error) (receiveResult, error) {
	result := receiveResult{MessageID: messageID}
	now := a.now()
	failed, err := undo.run(ctx, tx, "inbox_message", messageID, func() error {
		// Sample flaws 1 and 2: the row is keyed by (consumer, message_id),
		// and inserted in the effect's transaction, not checked before it.
		inserted, err := insertInboxRow(ctx, tx, consumerName, messageID, deliveryCount, now)
		if err != nil {
			return err
		}
		if !inserted {
			// Applied before: skip the effect, but still ack.
			result.Outcome = inboxDuplicate
			return countDuplicate(ctx, tx, consumerName, messageID)
		}
		if err := apply(tx); err != nil {
			return err
		}
		result.Outcome = inboxApplied
		return nil
	})
	if err != nil {
		return result, err
	}
	if failed == nil {
		return result, nil
	}
	if isOurFailure(ctx, a.db, failed) {
		return result, failed
	}
	return recordFailure(ctx, tx, result, consumerName, deliveryCount, maxFailures, failed, now)
}

// recordFailure records in tx why a message failed, after its own writes
// were rolled back to its savepoint: a permanent failure records it as
// poison (for this consumer only). A transient one is counted in
// inbox_failures; the maxFailures-th counted failure records poison
// (noFailureLimit: never), and before that the message is to be retried.
// deliveryCount, the broker's count, is only written down: it also counts
// deliveries whose transaction failed, so it cannot say how often the
// message itself failed.
func recordFailure(ctx context.Context, tx *sql.Tx, result receiveResult, consumerName string, deliveryCount, maxFailures int, cause error, now time.Time) (receiveResult, error) {
	if isPermanent(cause) {
		result.Outcome, result.Err = inboxPoison, cause
		return result, recordPoison(ctx, tx, consumerName, result.MessageID, deliveryCount, cause, now)
	}
	failures, err := countFailure(ctx, tx, consumerName, result.MessageID, cause, now)
	if err != nil {
		return result, err
	}
	result.Failures = failures
	if maxFailures != noFailureLimit && failures >= maxFailures {
		result.Outcome = inboxPoison
		result.Err = fmt.Errorf("failed %d times, the last time: %w", failures, cause)
		return result, recordPoison(ctx, tx, consumerName, result.MessageID, deliveryCount, result.Err, now)
	}
	result.Outcome, result.Err = inboxRetry, cause
	return result, nil
}

// countFailure adds one to the failures counted for messageID at
// consumerName and returns the new count. It runs in the caller's
// transaction, after the message's own writes were rolled back to its
// savepoint: if that transaction fails too, the failure is not counted,
// because it was ours (the database, the process), not the message's.
func countFailure(ctx context.Context, tx *sql.Tx, consumerName, messageID string, cause error, now time.Time) (int, error) {
	var failures int
	err := tx.QueryRowContext(ctx, `
		INSERT INTO inbox_failures (consumer, message_id, failures, last_error, last_failed_at)
		VALUES (?, ?, 1, ?, ?)
		ON CONFLICT (consumer, message_id) DO UPDATE
		SET failures = inbox_failures.failures + 1,
		    last_error = excluded.last_error,
		    last_failed_at = excluded.last_failed_at
		RETURNING failures`,
		consumerName, messageID, cause.Error(), formatTime(now)).Scan(&failures)
	if err != nil {
		return 0, fmt.Errorf("count failure of message %s for %s: %w", messageID, consumerName, err)
	}
	return failures, nil
}

// insertInboxRow records that consumerName applied messageID, and reports
// false if it had already: the primary key (consumer, message_id) decides,
// in the transaction of the effect.
func insertInboxRow(ctx context.Context, tx *sql.Tx, consumerName, messageID string, deliveryCount int, now time.Time) (bool, error) {
	inserted, err := tx.ExecContext(ctx, `
		INSERT INTO inbox_messages (consumer, message_id, status, delivery_count, processed_at)
		VALUES (?, ?, 'done', ?, ?)
		ON CONFLICT (consumer, message_id) DO NOTHING`,
		consumerName, messageID, deliveryCount, formatTime(now))
	if err != nil {
		return false, fmt.Errorf("insert inbox message: %w", err)
	}
	n, err := inserted.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("insert inbox message: %w", err)
	}
	return n == 1, nil
}

// countDuplicate counts one more delivery of a message consumerName had
// applied already, for inspect.
func countDuplicate(ctx context.Context, tx *sql.Tx, consumerName, messageID string) error {
	_, err := tx.ExecContext(ctx, `
		UPDATE inbox_messages SET duplicates = duplicates + 1 WHERE consumer = ? AND message_id = ?`,
		consumerName, messageID)
	if err != nil {
		return fmt.Errorf("count duplicate: %w", err)
	}
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

// consumeBackoff is how long a message whose consumer failed transiently
// for the failures-th time waits before its next delivery: 1s, 2s, 4s ...
func consumeBackoff(failures int) time.Duration {
	return time.Second << min(max(failures, 1)-1, 8)
}

// failedBatchRedelivery is how soon the messages of a batch whose
// transaction failed are delivered again. Short, because they did nothing
// wrong; the consume loop backs off after a failed pass anyway
// (startLoop), so a database that stays down is not hammered.
const failedBatchRedelivery = time.Second

// nakTimeout bounds the naks of a failed batch, which run even when ctx has
// ended (see consumeOnce): a process that shuts down must not hang on them.
const nakTimeout = 5 * time.Second

// consumeOnce fetches one batch for c and puts each message through the
// inbox, all in one transaction with a savepoint per message: one commit
// per batch. Applied, duplicate and poison messages are then acked;
// messages that failed transiently are naked with consumeBackoff. A crash
// before the acks only means the broker delivers the batch again, and the
// inbox skips it.
//
// If the batch transaction fails (the database down or busy, ctx ended),
// nothing of it is recorded, not even a failure count, and every delivery
// is naked so that it comes back after failedBatchRedelivery instead of
// ackWait: the broker redelivers without limit (natsBroker sets MaxDeliver
// -1), so the outage uses up nothing. Returns the batch's error, joined with
// any nak's. After a commit, an ack or nak that the broker refuses because
// the delivery was handed to another fetch meanwhile (this consumer was
// paused past ackWait) is not an error: what was committed stands, and the
// consumer that holds the delivery now acks it.
func (a *App) consumeOnce(ctx context.Context, c consumer, max int) ([]receiveResult, error) {
	// When the fetch began, for its "receive" span: a span's times are the
	// wall clock's, not the App's.
	fetched := time.Now()
	deliveries, err := a.broker.fetch(ctx, c.name, max)
	if err != nil || len(deliveries) == 0 {
		return nil, err
	}
	// The batch is traced, logged and counted at its ends: here, in
	// receiveTraced, and once it committed (observeConsumed).
	batch := a.observeFetch(ctx, c, deliveries, fetched)
	var results []receiveResult
	err = withItems(ctx, a.db, withTx, func(tx *sql.Tx, undo *itemUndo) error {
		results = make([]receiveResult, len(deliveries))
		for i, d := range deliveries {
			if d.Malformed != nil {
				// The broker could not make a message of it (no id to
				// deduplicate by): poison for this consumer, under the id
				// the broker made up, so an operator sees it.
				results[i] = receiveResult{MessageID: d.ID, Outcome: inboxPoison, Err: d.Malformed}
				if err := recordPoison(ctx, tx, c.name, d.ID, d.DeliveryCount, d.Malformed, a.now()); err != nil {
					return err
				}
				continue
			}
			result, err := a.receiveTraced(batch, i, tx, undo, c, d)
			if err != nil {
				return err
			}
			results[i] = result
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, errCrash) {
			// A dead process naks nothing: its deliveries come back after
			// ackWait.
			return nil, err
		}
		return nil, errors.Join(err, a.nakFailedBatch(ctx, deliveries))
	}
	a.observeConsumed(ctx, c, deliveries, results, batch)
	var handled []delivery
	var errs []error
	for i, d := range deliveries {
		switch results[i].Outcome {
		case inboxRetry:
			if err := a.broker.nak(ctx, d, consumeBackoff(results[i].Failures)); err != nil && !errors.Is(err, errDeliveryLeaseLost) {
				// One failed nak must not keep the others' acks back.
				errs = append(errs, err)
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
	if err := a.broker.ack(ctx, handled...); err != nil && !errors.Is(err, errDeliveryLeaseLost) {
		errs = append(errs, err)
	}
	return results, errors.Join(errs...)
}

// payloadOrderID returns the order_id an event's payload names, for the
// log; "" if it names none.
func payloadOrderID(payload []byte) string {
	var named struct {
		OrderID string `json:"order_id"`
	}
	json.Unmarshal(payload, &named)
	return named.OrderID
}

// nakFailedBatch naks every delivery of a batch whose transaction failed,
// best effort: a nak that fails only means that delivery comes back after
// ackWait. It runs even if ctx has ended (a shutdown cancelled the batch),
// because that is when another process should get the messages soon.
func (a *App) nakFailedBatch(ctx context.Context, deliveries []delivery) error {
	nakCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), nakTimeout)
	defer cancel()
	var errs []error
	for _, d := range deliveries {
		if err := a.broker.nak(nakCtx, d, failedBatchRedelivery); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// addConsumer wires one more consumer into a, as a second consumer of a
// subject would be (the simulator's ledger): it subscribes it, has the
// reconciler wait for it on each of its subjects, and gives it a wake-up.
// From then on it is one of consumers(): the workers run it and an
// operator replays its poison messages. Like subscribeConsumers, it must
// run before anything is published.
func (a *App) addConsumer(ctx context.Context, c consumer) error {
	if err := a.broker.subscribe(ctx, c.name, c.subjects...); err != nil {
		return err
	}
	for _, subject := range c.subjects {
		a.deliveryTargets = append(a.deliveryTargets, deliveryTarget{subject: subject, consumer: c.name})
	}
	a.wake.consumers[c.name] = newWakeup()
	a.addedConsumers = append(a.addedConsumers, c)
	return nil
}
