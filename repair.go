// Repair: the way back for what the four layers set aside for an operator.
// An outbox event marked failed after maxPublishAttempts (and every later
// event of its order, which waits behind it); an inbox message recorded as
// poison; a saga in compensation_failed; a refund whose request was
// abandoned. Each was set aside rather than retried for ever, and without
// these commands the only way back was hand-written SQL that had to get
// every invariant right: reset the attempts but not the fencing token, or
// delete the poison row but forget that the broker had acked the message.
//
// Each repair is one transaction that re-checks, on the row, the state it
// repairs (a refusal changes nothing), makes the change, and writes its
// repair_log row; the commands then run the audit of
// `retrysafe check --in-flight`. Finishing refunds is the exception: it
// calls the card processor, which no transaction can span, so it runs the
// completer's phases (refund.go) and logs each key's outcome after.

package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
)

// repairAction is repair_log.action.
type repairAction string

const (
	repairOutboxRetry  repairAction = "outbox retry"
	repairInboxReplay  repairAction = "inbox replay"
	repairSagaResume   repairAction = "saga resume"
	repairRefundFinish repairAction = "refund finish"
)

// Outcomes of a repair that changed nothing.
var (
	// errRepairNotFound: there is no row by that name (a typo, or cleanup
	// deleted it). The API answers 404.
	errRepairNotFound = errors.New("not found")
	// errRepairRefused: the row is not in the state the repair repairs (an
	// event that did not fail, a message that is not poison), or the
	// command was asked for two things at once. The API answers 409.
	errRepairRefused = errors.New("refused")
)

// repairResult is what one repair did to one row, as the commands print it
// and the admin API returns it.
type repairResult struct {
	Target string `json:"target"`
	Result string `json:"result"`
	// Failed is set when the work could not be done (a refund the
	// processor did not answer for); Result says why.
	Failed bool `json:"failed,omitempty"`
}

// logRepair writes a repair_log row in tx, the repair's own transaction.
func logRepair(ctx context.Context, tx *sql.Tx, repairID, operator string, action repairAction, target, result string, now time.Time) error {
	_, err := tx.ExecContext(ctx, `
		INSERT INTO repair_log (repair_id, operator, action, target, result, created_at)
		VALUES (?, ?, ?, ?, ?, ?)`,
		repairID, operator, action, target, result, formatTime(now))
	if err != nil {
		return fmt.Errorf("log repair of %s: %w", terminalSafe(target), err)
	}
	return nil
}

// checkRepairID returns errRepairNotFound, naming id as what it was given
// for, if id is text that no row can hold (storableText). Without it such
// an id reached the repair's query, which PostgreSQL refused: /admin
// answered 500 and the commands failed with the database's error, where
// SQLite found nothing.
func checkRepairID(what, id string) error {
	if storableText(id) {
		return nil
	}
	return fmt.Errorf("%w: no %s %s: an id is UTF-8 text without NUL", errRepairNotFound, what, terminalSafe(id))
}

// outboxRetryTarget names what retryOutboxEvents retries: one event, the
// failed events of one order, or every failed event.
type outboxRetryTarget struct {
	EventID   string
	OrderID   string
	AllFailed bool
}

// failedEvent is a failed outbox event about to be retried.
type failedEvent struct {
	EventID   string
	EventType string
	OrderID   string
	Status    outboxStatus
	Attempts  int
	LastError string
}

// retryOutboxEvents puts the failed events target names back to pending
// with their attempts reset, due now, in one transaction: the relay
// publishes them on its next pass, and the later events of their orders,
// which waited behind them (claimOutboxEvents takes only the oldest
// unpublished event of an order), follow in order. Returns errRepairNotFound
// if there is no such event or order, errRepairRefused if the event, or
// every event of the order, is not failed (nothing is changed then).
func (a *App) retryOutboxEvents(ctx context.Context, operator string, target outboxRetryTarget) ([]repairResult, error) {
	if err := checkRepairID("outbox event", target.EventID); err != nil {
		return nil, err
	}
	if err := checkRepairID("order", target.OrderID); err != nil {
		return nil, err
	}
	var results []repairResult
	repairID := a.newID("rep")
	err := withTx(ctx, a.db, func(tx *sql.Tx) error {
		results = nil
		now := a.now()
		events, err := failedEventsOf(ctx, tx, target)
		if err != nil {
			return err
		}
		for i, event := range events {
			retried, err := tx.ExecContext(ctx, `
				UPDATE outbox_events
				SET status = 'pending', attempts = 0, next_attempt_at = ?, claimed_by = NULL, claimed_until = NULL,
				    -- A claim of its own: a relay still holding a claim from
				    -- before the failure can mark nothing with it.
				    lease_token = lease_token + 1
				WHERE event_id = ? AND status = 'failed'`,
				formatTime(now), event.EventID)
			if err != nil {
				return fmt.Errorf("retry outbox event %s: %w", event.EventID, err)
			}
			if err := oneRowOr(retried, fmt.Errorf("%w: outbox event %s is no longer failed", errRepairRefused, event.EventID)); err != nil {
				return err
			}
			result := fmt.Sprintf("%s of %s failed after %d attempts (%s); pending again", event.EventType, event.OrderID, event.Attempts, event.LastError)
			if err := logRepair(ctx, tx, fmt.Sprintf("%s-%d", repairID, i+1), operator, repairOutboxRetry, event.EventID, result, now); err != nil {
				return err
			}
			results = append(results, repairResult{Target: event.EventID, Result: result})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	a.wake.outboxWritten()
	return results, nil
}

// failedEventsOf reads, in tx, the failed events target names, oldest
// first. Returns errRepairNotFound or errRepairRefused as
// retryOutboxEvents does.
func failedEventsOf(ctx context.Context, tx *sql.Tx, target outboxRetryTarget) ([]failedEvent, error) {
	const columns = `event_id, event_type, aggregate_id, status, attempts, COALESCE(last_error, '')`
	var rows *sql.Rows
	var err error
	switch {
	case target.EventID != "":
		rows, err = tx.QueryContext(ctx, `SELECT `+columns+` FROM outbox_events WHERE event_id = ?`, target.EventID)
	case target.OrderID != "":
		rows, err = tx.QueryContext(ctx, `SELECT `+columns+` FROM outbox_events WHERE aggregate_id = ? ORDER BY seq`, target.OrderID)
	case target.AllFailed:
		rows, err = tx.QueryContext(ctx, `SELECT `+columns+` FROM outbox_events WHERE status = 'failed' ORDER BY seq`)
	default:
		return nil, fmt.Errorf("bug: outbox retry without a target")
	}
	if err != nil {
		return nil, fmt.Errorf("read failed outbox events: %w", err)
	}
	defer rows.Close()
	var events, failed []failedEvent
	for rows.Next() {
		var event failedEvent
		if err := rows.Scan(&event.EventID, &event.EventType, &event.OrderID, &event.Status, &event.Attempts, &event.LastError); err != nil {
			return nil, fmt.Errorf("scan outbox event: %w", err)
		}
		events = append(events, event)
		if event.Status == outboxFailed {
			failed = append(failed, event)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read failed outbox events: %w", err)
	}
	switch {
	case len(failed) > 0:
		return failed, nil
	case target.EventID != "" && len(events) == 0:
		return nil, fmt.Errorf("%w: no outbox event %s", errRepairNotFound, terminalSafe(target.EventID))
	case target.EventID != "":
		return nil, fmt.Errorf("%w: outbox event %s is %s, not failed; only a failed event goes back to pending", errRepairRefused, terminalSafe(target.EventID), events[0].Status)
	case target.OrderID != "" && len(events) == 0:
		return nil, fmt.Errorf("%w: no outbox event of order %s", errRepairNotFound, terminalSafe(target.OrderID))
	case target.OrderID != "":
		return nil, fmt.Errorf("%w: order %s has no failed outbox event", errRepairRefused, terminalSafe(target.OrderID))
	default:
		return nil, fmt.Errorf("%w: no outbox event is failed", errRepairRefused)
	}
}

// inboxReplayTarget names what replayInboxMessages replays: one message (for
// one consumer, or for every consumer that gave up on it), or every poison
// message (of one consumer, or of all).
type inboxReplayTarget struct {
	Consumer  string
	MessageID string
	AllPoison bool
}

// poisonMessage is an inbox row recorded as poison.
type poisonMessage struct {
	Consumer  string
	MessageID string
	Status    string
	Error     string
}

// replayInboxMessages delivers the poison messages target names to their
// consumers again, once the cause is fixed, in one transaction per call:
// the poison row and the consumer's failure count (inbox_failures) are
// deleted, so the consumer applies the message as if it were new, and the
// broker is asked to deliver it again (messageBroker.replay). Returns
// errRepairNotFound for an unknown consumer or message, errRepairRefused
// for a message that is not poison or can no longer be replayed (nothing
// is changed then).
//
// The message keeps its id: the consumer's inbox keys on it, so a replayed
// message that a consumer did apply (another consumer of the same subject,
// on NATS) is a duplicate there, never applied twice.
func (a *App) replayInboxMessages(ctx context.Context, operator string, target inboxReplayTarget) ([]repairResult, error) {
	consumers := map[string]consumer{}
	var names []string
	for _, c := range a.consumers() {
		consumers[c.name] = c
		names = append(names, c.name)
	}
	if _, ok := consumers[target.Consumer]; target.Consumer != "" && !ok {
		return nil, fmt.Errorf("%w: no consumer %q reads from the broker; the consumers are %s", errRepairNotFound, target.Consumer, strings.Join(names, ", "))
	}
	if err := checkRepairID("message", target.MessageID); err != nil {
		return nil, err
	}
	var results []repairResult
	repairID := a.newID("rep")
	err := withTx(ctx, a.db, func(tx *sql.Tx) error {
		results = nil
		now := a.now()
		messages, err := poisonMessagesOf(ctx, tx, target)
		if err != nil {
			return err
		}
		for i, poison := range messages {
			c, ok := consumers[poison.Consumer]
			if !ok {
				// The webhook inbox: the card processor sends those again
				// itself, as long as it gets a 5xx.
				return fmt.Errorf("%w: %s is not a broker consumer, nothing can deliver %s to it again; the consumers are %s",
					errRepairRefused, terminalSafe(poison.Consumer), terminalSafe(poison.MessageID), strings.Join(names, ", "))
			}
			msg, err := replaySource(ctx, tx, poison.MessageID)
			if err != nil {
				return err
			}
			if !subscribes(c, msg.Subject) {
				return fmt.Errorf("%w: %s does not subscribe to %s, the subject of %s", errRepairRefused, c.name, terminalSafe(msg.Subject), terminalSafe(msg.ID))
			}
			deleted, err := tx.ExecContext(ctx, `
				DELETE FROM inbox_messages WHERE consumer = ? AND message_id = ? AND status = 'poison'`,
				poison.Consumer, poison.MessageID)
			if err != nil {
				return fmt.Errorf("delete poison record of %s: %w", terminalSafe(poison.MessageID), err)
			}
			if err := oneRowOr(deleted, fmt.Errorf("%w: %s is no longer poison for %s", errRepairRefused, terminalSafe(poison.MessageID), terminalSafe(poison.Consumer))); err != nil {
				return err
			}
			// Its failures were counted against the cause now fixed: the
			// replay gets maxDeliveries tries of its own.
			_, err = tx.ExecContext(ctx, `DELETE FROM inbox_failures WHERE consumer = ? AND message_id = ?`,
				poison.Consumer, poison.MessageID)
			if err != nil {
				return fmt.Errorf("reset failures of %s: %w", terminalSafe(poison.MessageID), err)
			}
			// The poison record counted as delivered: the event is in
			// flight again until the consumer applies the replay, so a
			// replay the broker loses is published again, and its
			// delivery lag (check, the oldest-undelivered metric) counts
			// from now. The reconciler's copies then reach every consumer
			// of the subject, so each other consumer's inbox row must
			// outlive them: where the reconciler's cursor had passed the
			// event, every consumer had its row then, and cleanup may have
			// deleted one since (a week on), so it is written again; a row
			// that is there has its retention counted from the replay. A
			// consumer with no row, of an event the cursor has not passed,
			// has not applied it: it gets no row. The refreshed
			// processed_at is also what stops a cleanup running beside the
			// replay: it deletes only a row whose processed_at is old on
			// the row's latest version, and this update holds the row
			// until the replay commits.
			_, err = tx.ExecContext(ctx, `
				INSERT INTO inbox_messages (consumer, message_id, status, delivery_count, processed_at)
				SELECT s.consumer, e.event_id, 'done', 1, ?
				FROM outbox_events e JOIN `+subscriptionsTable(a.deliveryTargets)+` s ON s.subject = e.event_type
				WHERE e.event_id = ? AND s.consumer <> ?
				  AND (e.delivery_position < `+deliveryCursor+`
				       OR EXISTS (SELECT 1 FROM inbox_messages j WHERE j.consumer = s.consumer AND j.message_id = e.event_id))
				ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = excluded.processed_at`,
				formatTime(now), poison.MessageID, poison.Consumer)
			if err != nil {
				return fmt.Errorf("remember %s for the other consumers: %w", terminalSafe(poison.MessageID), err)
			}
			// A new position, which no cursor has passed: the reconciler
			// reads the event again.
			_, err = tx.ExecContext(ctx, `UPDATE outbox_events SET published_at = ?, delivery_position = `+dialectOf(a.db).deliveryPosition+` WHERE event_id = ?`,
				formatTime(now), poison.MessageID)
			if err != nil {
				return fmt.Errorf("put %s back in flight: %w", terminalSafe(poison.MessageID), err)
			}
			id := fmt.Sprintf("%s-%d", repairID, i+1)
			// Last, after every write: on NATS this publishes, and a
			// failed publish rolls the writes back.
			if err := a.broker.replay(ctx, tx, c.name, msg, id); err != nil {
				return err
			}
			result := fmt.Sprintf("%s of %s was poison for %s (%s); delivered again", msg.Subject, payloadOrderID(msg.Payload), c.name, poison.Error)
			target := c.name + "/" + poison.MessageID
			if err := logRepair(ctx, tx, id, operator, repairInboxReplay, target, result, now); err != nil {
				return err
			}
			results = append(results, repairResult{Target: target, Result: result})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, result := range results {
		name, _, _ := strings.Cut(result.Target, "/")
		a.wake.consumers[name].signal()
	}
	return results, nil
}

// subscribes reports whether c reads subject.
func subscribes(c consumer, subject string) bool {
	for _, s := range c.subjects {
		if s == subject {
			return true
		}
	}
	return false
}

// poisonMessagesOf reads, in tx, the poison rows target names. Returns
// errRepairNotFound or errRepairRefused as replayInboxMessages does.
func poisonMessagesOf(ctx context.Context, tx *sql.Tx, target inboxReplayTarget) ([]poisonMessage, error) {
	var rows *sql.Rows
	var err error
	// consumer = '' matches every consumer.
	switch {
	case target.MessageID != "":
		rows, err = tx.QueryContext(ctx, `
			SELECT consumer, message_id, status, COALESCE(error, '') FROM inbox_messages
			WHERE message_id = ? AND (consumer = ? OR ? = '') ORDER BY consumer`,
			target.MessageID, target.Consumer, target.Consumer)
	case target.AllPoison:
		rows, err = tx.QueryContext(ctx, `
			SELECT consumer, message_id, status, COALESCE(error, '') FROM inbox_messages
			WHERE status = 'poison' AND (consumer = ? OR ? = '') ORDER BY processed_at, consumer`,
			target.Consumer, target.Consumer)
	default:
		return nil, fmt.Errorf("bug: inbox replay without a target")
	}
	if err != nil {
		return nil, fmt.Errorf("read poison messages: %w", err)
	}
	defer rows.Close()
	var found, poison []poisonMessage
	for rows.Next() {
		var m poisonMessage
		if err := rows.Scan(&m.Consumer, &m.MessageID, &m.Status, &m.Error); err != nil {
			return nil, fmt.Errorf("scan inbox message: %w", err)
		}
		found = append(found, m)
		if m.Status == string(inboxPoison) {
			poison = append(poison, m)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read poison messages: %w", err)
	}
	scope := "no consumer has an"
	if target.Consumer != "" {
		scope = target.Consumer + " has no"
	}
	switch {
	case len(poison) > 0:
		return poison, nil
	case target.MessageID != "" && len(found) == 0:
		return nil, fmt.Errorf("%w: %s inbox record of message %s", errRepairNotFound, scope, terminalSafe(target.MessageID))
	case target.MessageID != "":
		return nil, fmt.Errorf("%w: message %s was applied by %s, not poison; only a poison message is delivered again", errRepairRefused, terminalSafe(target.MessageID), terminalSafe(found[0].Consumer))
	default:
		return nil, fmt.Errorf("%w: no message is poison for %s", errRepairRefused, scope)
	}
}

// replaySource returns, read in tx, the message messageID as the relay
// published it: from the outbox, whose event id is the message id, or,
// once cleanup has deleted the published event, from the embedded
// broker's copy (which it deletes only once every delivery of it is
// acked and old). Returns errRepairRefused if neither holds it any more
// (cleanup deletes delivered messages after messageRetention; a message
// that NATS could not give an id, nats-seq-..., never had an event).
func replaySource(ctx context.Context, tx *sql.Tx, messageID string) (message, error) {
	msg := message{ID: messageID}
	err := tx.QueryRowContext(ctx, `SELECT event_type, payload FROM outbox_events WHERE event_id = ?`,
		messageID).Scan(&msg.Subject, &msg.Payload)
	if errors.Is(err, sql.ErrNoRows) {
		err = tx.QueryRowContext(ctx, `SELECT subject, payload FROM broker_messages WHERE message_id = ?`,
			messageID).Scan(&msg.Subject, &msg.Payload)
	}
	if errors.Is(err, sql.ErrNoRows) {
		return message{}, fmt.Errorf("%w: message %s is in neither the outbox nor the broker any more, so there is nothing to deliver again", errRepairRefused, terminalSafe(messageID))
	}
	if err != nil {
		return message{}, fmt.Errorf("read message %s: %w", terminalSafe(messageID), err)
	}
	return msg, nil
}

// replay queues msg for subscriber again, in tx: the embedded broker lives
// in the App's database (newApp), so the replay commits, or rolls back,
// with the repair. The subscriber's delivery goes back to pending, due now,
// and its delivery_count, the fencing token of ack and nak, goes up by one:
// a consumer that still holds the delivery from before the replay (it
// recorded the message poison and has not acked yet) cannot ack the replay
// away. replayID is not needed: a delivery is keyed by subscriber and
// message.
//
// Returns errRepairRefused if the broker holds no copy of msg: cleanup
// deleted it, or the workers use NATS JetStream and this process was not
// told so. Queuing a delivery that no worker reads would delete the poison
// record and deliver nothing.
func (b *embeddedBroker) replay(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error {
	queued, err := tx.ExecContext(ctx, `
		INSERT INTO broker_deliveries (subscriber, message_seq, status, visible_at)
		SELECT ?, seq, 'pending', ? FROM broker_messages WHERE message_id = ?
		ON CONFLICT (subscriber, message_seq) DO UPDATE
		SET status = 'pending', visible_at = excluded.visible_at, acked_at = NULL,
		    delivery_count = broker_deliveries.delivery_count + 1`,
		subscriber, formatTime(b.now()), msg.ID)
	if err != nil {
		return fmt.Errorf("deliver %s to %s again: %w", terminalSafe(msg.ID), subscriber, err)
	}
	return oneRowOr(queued, fmt.Errorf("%w: the embedded broker holds no copy of %s (if the workers use NATS JetStream, name it with --broker as they do)", errRepairRefused, terminalSafe(msg.ID)))
}

// replayedMessageIDHeader carries, on a message that replays another, the
// id of the message it replays: the id the consumer's inbox keys on.
// (Nats-Msg-Id must differ, or JetStream would drop the replay as a
// duplicate of the original within natsDuplicateWindow.)
const replayedMessageIDHeader = "Retrysafe-Replay-Of"

// replay publishes msg again to its subject, under the Nats-Msg-Id
// replayID and with the original id in replayedMessageIDHeader, which
// fetch hands to the consumer as the message id.
//
// JetStream cannot deliver the original again: the consumer acked it when
// it recorded it as poison, and an acked message stays acked. So this is a
// new message, and every durable on its subject receives it; a consumer
// other than subscriber that applied the original finds it in its inbox
// and skips it.
//
// It publishes inside the repair's transaction, after the poison row is
// deleted, and waits for JetStream's ack; only then does the transaction
// commit. A network call inside a transaction is what the saga avoids;
// here it is what makes the replay neither lost nor swallowed:
//   - published after the commit, a failed publish (or a crash) would
//     leave the poison row deleted and nothing on its way: lost, with no
//     record left to show it;
//   - committed after the publish, but the consumer could receive the
//     replay before the poison row is gone: its inbox insert would find
//     the row and skip the message as a duplicate. Inside the
//     transaction, the consumer's insert waits for the row's deletion to
//     commit (SQLite: the write lock; PostgreSQL: the row's lock).
//
// If the publish fails, the repair rolls back and says so. If the commit
// fails after the publish, the replay arrives while the poison row is
// still there: the consumer skips it, the message stays poison and
// visible, and the operator runs the repair again.
func (b *natsBroker) replay(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error {
	// The embedded broker's copy means the workers use it, not NATS: a
	// replay to a stream nobody reads would deliver nothing.
	var embedded int
	if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM broker_messages WHERE message_id = ?`, msg.ID).Scan(&embedded); err != nil {
		return fmt.Errorf("look for %s in the embedded broker: %w", terminalSafe(msg.ID), err)
	}
	if embedded > 0 {
		return fmt.Errorf("%w: the embedded broker holds %s, so the workers use it, not NATS JetStream; run without --broker", errRepairRefused, terminalSafe(msg.ID))
	}
	natsMsg := nats.NewMsg(b.subject(msg.Subject))
	natsMsg.Header.Set(jetstream.MsgIDHeader, replayID)
	natsMsg.Header.Set(replayedMessageIDHeader, msg.ID)
	natsMsg.Data = msg.Payload
	if _, err := b.js.PublishMsg(ctx, natsMsg); err != nil {
		return fmt.Errorf("publish %s again for %s: %w", terminalSafe(msg.ID), subscriber, err)
	}
	if err := b.conn.Publish(b.announceSubject(), nil); err != nil {
		return fmt.Errorf("announce the replay of %s: %w", terminalSafe(msg.ID), err)
	}
	return nil
}

// resumeSaga hands a saga in compensation_failed back to the workers:
// compensating, its attempts reset, due now. The saga loop claims it and
// tries its remaining compensations again, in reverse, each under the
// processor's idempotency key (a refund that happened before the failure
// is found, not made again). Returns errRepairNotFound if there is no such
// saga, errRepairRefused if it is not compensation_failed.
//
// The UPDATE is fenced like every saga write: it checks the status on the
// row, and takes a lease token of its own, so a worker still holding an
// older claim on the saga finds its token gone (advanceSaga) and writes
// nothing.
func (a *App) resumeSaga(ctx context.Context, operator, sagaID string) (repairResult, error) {
	if err := checkRepairID("saga", sagaID); err != nil {
		return repairResult{}, err
	}
	var result repairResult
	repairID := a.newID("rep")
	err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		now := a.now()
		saga, _, err := readSaga(ctx, tx, sagaID)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("%w: no saga %s", errRepairNotFound, terminalSafe(sagaID))
		}
		if err != nil {
			return err
		}
		resumed, err := tx.ExecContext(ctx, `
			UPDATE saga_instances
			SET status = ?, attempts = 0, next_attempt_at = ?, updated_at = ?,
			    locked_by = NULL, locked_until = NULL, lease_token = lease_token + 1
			WHERE saga_id = ? AND status = ?`,
			sagaCompensating, formatTime(now), formatTime(now), sagaID, sagaCompensationFailed)
		if err != nil {
			return fmt.Errorf("resume saga %s: %w", terminalSafe(sagaID), err)
		}
		refused := fmt.Errorf("%w: saga %s of order %s is %s, not %s; only a saga whose compensation failed is resumed",
			errRepairRefused, terminalSafe(sagaID), terminalSafe(saga.OrderID), saga.Status, sagaCompensationFailed)
		if err := oneRowOr(resumed, refused); err != nil {
			return err
		}
		result = repairResult{Target: sagaID, Result: fmt.Sprintf("order %s: %s after %d attempts at undoing %s (%s); compensating again",
			saga.OrderID, saga.Status, saga.Attempts, saga.CurrentStep, saga.LastError.String)}
		return logRepair(ctx, tx, repairID, operator, repairSagaResume, sagaID, result.Result, now)
	})
	if err != nil {
		return repairResult{}, err
	}
	a.wake.saga.signal()
	return result, nil
}

// parseSagaStatus reads a --state value. Returns an error naming the
// states if s is not one.
func parseSagaStatus(s string) (sagaStatus, error) {
	switch sagaStatus(s) {
	case sagaInProgress, sagaCompensating, sagaCompleted, sagaCompensated, sagaCompensationFailed:
		return sagaStatus(s), nil
	default:
		return "", fmt.Errorf("%q is not a saga state; the states are %s, %s, %s, %s, %s", s,
			sagaInProgress, sagaCompensating, sagaCompleted, sagaCompensated, sagaCompensationFailed)
	}
}

// sagaListing is one saga as saga list shows it.
type sagaListing struct {
	SagaID      string     `json:"saga_id"`
	OrderID     string     `json:"order_id"`
	Status      sagaStatus `json:"status"`
	CurrentStep string     `json:"current_step"`
	Attempts    int        `json:"attempts"`
	LastError   string     `json:"last_error,omitempty"`
	UpdatedAt   string     `json:"updated_at"`
}

// listLimit bounds the admin lists: an operator pages through what needs
// a look, not through a day's orders.
const listLimit = 500

// listSagas returns the sagas in state, longest unchanged first.
func listSagas(ctx context.Context, q queryer, state sagaStatus) ([]sagaListing, error) {
	rows, err := q.QueryContext(ctx, `
		SELECT saga_id, order_id, status, current_step, attempts, COALESCE(last_error, ''), updated_at
		FROM saga_instances WHERE status = ? ORDER BY updated_at, saga_id LIMIT ?`, state, listLimit)
	if err != nil {
		return nil, fmt.Errorf("list sagas: %w", err)
	}
	defer rows.Close()
	sagas := []sagaListing{}
	for rows.Next() {
		var s sagaListing
		if err := rows.Scan(&s.SagaID, &s.OrderID, &s.Status, &s.CurrentStep, &s.Attempts, &s.LastError, &s.UpdatedAt); err != nil {
			return nil, fmt.Errorf("scan saga: %w", err)
		}
		sagas = append(sagas, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list sagas: %w", err)
	}
	return sagas, nil
}

// unfinishedRefund is an idempotency key of a refund that has not reached
// finished.
type unfinishedRefund struct {
	UserID         string        `json:"user_id"`
	IdempotencyKey string        `json:"idempotency_key"`
	OrderID        string        `json:"order_id"`
	RecoveryPoint  recoveryPoint `json:"recovery_point"`
	CreatedAt      string        `json:"created_at"`
	AgeSeconds     int64         `json:"age_seconds"`
	// Held is set while a request holds a fresh lease on the key: it is
	// working on it, and refund finish leaves it alone.
	Held bool `json:"held"`
	// State says who, if anyone, has the key.
	State string `json:"state"`

	request idempotentRequest
}

// listUnfinishedRefunds returns the refund keys stuck before finished,
// oldest first, each with its age at now and who holds it: a request's
// lease lasts refundLock (see completeRefundsOnce and acquireKey for the
// rules).
func listUnfinishedRefunds(ctx context.Context, q queryer, now time.Time, refundLock time.Duration) ([]unfinishedRefund, error) {
	rows, err := q.QueryContext(ctx, `
		SELECT user_id, idempotency_key, request_method, request_path, request_params, recovery_point,
		       COALESCE(locked_at, ''), COALESCE(locked_by, ''), created_at
		FROM idempotency_keys
		WHERE recovery_point <> 'finished'
		ORDER BY created_at, user_id, idempotency_key
		LIMIT ?`, listLimit)
	if err != nil {
		return nil, fmt.Errorf("list unfinished refunds: %w", err)
	}
	defer rows.Close()
	cutoff := formatTime(now.Add(-refundLock))
	refunds := []unfinishedRefund{}
	for rows.Next() {
		var r unfinishedRefund
		var lockedAt, lockedBy string
		err := rows.Scan(&r.UserID, &r.IdempotencyKey, &r.request.Method, &r.request.Path, &r.request.CanonicalBody,
			&r.RecoveryPoint, &lockedAt, &lockedBy, &r.CreatedAt)
		if err != nil {
			return nil, fmt.Errorf("scan unfinished refund: %w", err)
		}
		r.request.UserID, r.request.IdempotencyKey = r.UserID, r.IdempotencyKey
		r.OrderID, _ = orderIDFromRefundPath(r.request.Path)
		if created, err := time.Parse(timeFormat, r.CreatedAt); err == nil {
			r.AgeSeconds = int64(now.Sub(created) / time.Second)
		}
		switch {
		case lockedBy != "" && lockedAt > cutoff:
			r.Held = true
			r.State = "held by a request since " + lockedAt
		case lockedBy != "":
			r.State = "abandoned: its request stopped"
		case lockedAt != "":
			r.State = "set aside by the completer after a failure"
		default:
			r.State = "released after a transient failure"
		}
		refunds = append(refunds, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list unfinished refunds: %w", err)
	}
	return refunds, nil
}

// finishRefunds runs the refund completer once, now, over every unfinished
// refund key that no request holds: the abandoned ones, and also those the
// completer set aside after a failure, which it would take again only
// after refundLockTimeout (the operator has fixed the cause). Each key is
// finished as the client's retry would finish it (completeRefund), phase by
// phase, with the processor's idempotency key: a refund that happened is
// found, not made again. A key a request holds is left to it; one that
// someone else finished after the list was read is reported as theirs
// (errRefundFinishedElsewhere), never as finished by this run.
//
// Not one transaction: the processor is called between phases. Each key's
// outcome is logged in its own transaction after it. A key that could not
// be finished (the processor timed out again) is a result with Failed
// set, not an error: the others' outcomes stand and are reported. Returns
// an error only if the keys cannot be read or an outcome not logged.
func (a *App) finishRefunds(ctx context.Context, operator string) ([]repairResult, error) {
	refunds, err := listUnfinishedRefunds(ctx, a.db, a.now(), a.leases.refundLock)
	if err != nil {
		return nil, err
	}
	repairID := a.newID("rep")
	results := []repairResult{}
	for i, refund := range refunds {
		if refund.Held {
			continue
		}
		target := refund.UserID + "/" + refund.IdempotencyKey
		before := fmt.Sprintf("refund of order %s at %s, %s", refund.OrderID, refund.RecoveryPoint, refund.State)
		err := a.completeRefund(ctx, refund.request)
		var result string
		failed := false
		switch {
		case err == nil:
			result = before + "; finished"
		case errors.Is(err, errCrash):
			return results, err
		case errors.Is(err, errRefundFinishedElsewhere):
			result = before + "; " + err.Error()
		case errors.Is(err, errKeyInProgress):
			result = before + "; taken over meanwhile by someone else (the client's retry, the completer or another refund finish), left to it"
		case errors.Is(err, errPaymentPending):
			result = before + "; the order is not paid yet, the key is forgotten for the client's retry"
		default:
			result = before + "; not finished: " + err.Error()
			failed = true
		}
		err = withTx(ctx, a.db, func(tx *sql.Tx) error {
			return logRepair(ctx, tx, fmt.Sprintf("%s-%d", repairID, i+1), operator, repairRefundFinish, target, result, a.now())
		})
		if err != nil {
			return results, err
		}
		results = append(results, repairResult{Target: target, Result: result, Failed: failed})
	}
	return results, nil
}

// checkOperator returns an error unless operator names someone: a repair
// is logged with who made it.
func checkOperator(operator string) error {
	if strings.TrimSpace(operator) == "" {
		return fmt.Errorf("name who makes this repair with --operator NAME ($USER is not set)")
	}
	return nil
}

// addRepairFlags adds --db and --operator, and the hidden clock flags: the
// chaos run repairs on the clock of the processes it repairs behind.
func addRepairFlags(cmd *cobra.Command, dbPath, operator *string, clock *chaosClockFlags) {
	cmd.Flags().StringVar(dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	cmd.Flags().StringVar(operator, "operator", os.Getenv("USER"), "who makes the repair, for repair_log (default $USER)")
	addClockFlags(cmd, clock)
}

// runRepair opens the database at dbPath, runs repair, prints its results
// and then the audit of `retrysafe check --in-flight`. It fails if the
// repair was refused or failed (nothing was changed then), if a result
// says it could not be done, or if the audit finds a violation (the repair
// is committed; the audit names what is still wrong).
func runRepair(cmd *cobra.Command, dbPath string, clock chaosClockFlags, brokerURL, stream string, repair func(ctx context.Context, app *App) ([]repairResult, error)) error {
	ctx := cmd.Context()
	if err := checkBrokerURL(brokerURL); err != nil {
		return err
	}
	app, err := openExistingApp(ctx, dbPath, processClock(clock.file, clock.skew), nil)
	if err != nil {
		return err
	}
	defer app.db.Close()
	closeBroker, err := useBroker(ctx, app, brokerURL, stream)
	if err != nil {
		return err
	}
	defer closeBroker()
	results, err := repair(ctx, app)
	out := cmd.OutOrStdout()
	failed := 0
	for _, result := range results {
		fmt.Fprintf(out, "%s: %s\n", terminalSafe(result.Target), terminalSafe(result.Result))
		if result.Failed {
			failed++
		}
	}
	if err != nil {
		return err
	}
	if err := printRepairAudit(ctx, out, app); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d could not be repaired; see above", failed, len(results))
	}
	return nil
}

// auditAfterRepair runs the audit of `retrysafe check --in-flight` that
// follows every repair (the commands, /admin, the console) and returns its
// violations: the system is not quiet right after a repair (the event it
// put back is pending), so the settled invariants cannot hold yet.
//
// It reads on the read connections (readDB), never on the write
// connection: the audit reads every table, seconds of work on a million
// orders, and on SQLite a process has one write connection, so an audit
// there would stop every create and every background write of serve for
// as long as it read. It stays the whole audit, not one scoped to the rows
// repaired: the question after a repair is what else still needs a look
// (another failed event, the poison message behind it), and the repaired
// row's own state is what the repair's transaction just checked. One at a
// time per process: repairs pressed in a row, or a script over /admin,
// take one read connection at most, and the others stay with GETs and
// replays.
func (a *App) auditAfterRepair(ctx context.Context) ([]violation, error) {
	select {
	case a.repairAudits <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-a.repairAudits }()
	return audit(ctx, a.readDB, a.now(), false)
}

// repairAuditBudget is how long the audit answered with an /admin or
// console repair may take. A full audit reads every table: 28 s on a
// million orders, and serve's WriteTimeout (30 s) would cut the answer off
// after the repair had committed, leaving the operator to guess. Past the
// budget the answer says the repair is committed and the audit unfinished,
// and points to `retrysafe check`, which has no such limit.
const repairAuditBudget = 10 * time.Second

// answerAudit runs the audit after an /admin or console repair within
// repairAuditBudget, and returns what to answer of it. An audit that fails
// or runs out of time is reported in Unfinished, never as the repair's
// error: the repair is committed whatever the audit says.
func (a *App) answerAudit(ctx context.Context) auditAnswer {
	ctx, cancel := context.WithTimeout(ctx, a.repairAuditBudget)
	defer cancel()
	violations, err := a.auditAfterRepair(ctx)
	if err != nil {
		unfinished := fmt.Sprintf("the repair is committed, but its audit did not finish (%v); run 'retrysafe check --in-flight'", err)
		if errors.Is(err, context.DeadlineExceeded) {
			unfinished = fmt.Sprintf("the repair is committed; its audit did not finish within %s on this database; run 'retrysafe check --in-flight'", a.repairAuditBudget)
		}
		return auditAnswer{Violations: []violation{}, Unfinished: unfinished}
	}
	return auditAnswer{OK: len(violations) == 0, Violations: append([]violation{}, violations...)}
}

// printRepairAudit runs and prints the audit after a repair
// (auditAfterRepair).
func printRepairAudit(ctx context.Context, w io.Writer, app *App) error {
	violations, err := app.auditAfterRepair(ctx)
	if err != nil {
		return err
	}
	fmt.Fprint(w, "check --in-flight: ")
	if err := printAudit(w, violations, false); err != nil {
		return fmt.Errorf("the repair is committed, but check fails: %w", err)
	}
	return nil
}

// newOutboxCommand builds "retrysafe outbox".
func newOutboxCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Repair the outbox: retry events that failed to publish",
	}
	var dbPath, operator, orderID string
	var clock chaosClockFlags
	var allFailed bool
	retry := &cobra.Command{
		Use:   "retry [EVENT_ID | --order ORDER_ID | --all-failed]",
		Short: "Put failed outbox events back to pending, attempts reset, so the relay publishes them",
		Args: func(cmd *cobra.Command, args []string) error {
			return oneTarget(cmd, args, "EVENT_ID", map[string]bool{"--order": orderID != "", "--all-failed": allFailed})
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOperator(operator); err != nil {
				return err
			}
			target := outboxRetryTarget{OrderID: orderID, AllFailed: allFailed}
			if len(args) == 1 {
				target.EventID = args[0]
			}
			return runRepair(cmd, dbPath, clock, "", "", func(ctx context.Context, app *App) ([]repairResult, error) {
				return app.retryOutboxEvents(ctx, operator, target)
			})
		},
	}
	addRepairFlags(retry, &dbPath, &operator, &clock)
	retry.Flags().StringVar(&orderID, "order", "", "retry the failed events of this order")
	retry.Flags().BoolVar(&allFailed, "all-failed", false, "retry every failed event")
	cmd.AddCommand(retry)
	return cmd
}

// oneTarget returns an error unless exactly one of the positional argument
// (called name) and the flags that are set names what to repair.
func oneTarget(cmd *cobra.Command, args []string, name string, flags map[string]bool) error {
	if len(args) > 1 {
		return fmt.Errorf("%s takes one %s (got %d arguments)", cmd.CommandPath(), name, len(args))
	}
	var given []string
	if len(args) == 1 {
		given = append(given, name)
	}
	var choices []string
	for _, flag := range []string{"--order", "--all-failed", "--all-poison"} {
		set, ok := flags[flag]
		if !ok {
			continue
		}
		choices = append(choices, flag)
		if set {
			given = append(given, flag)
		}
	}
	switch len(given) {
	case 1:
		return nil
	case 0:
		return fmt.Errorf("%s needs one of %s or %s; 'retrysafe check --db FILE' lists what needs repair", cmd.CommandPath(), name, strings.Join(choices, " or "))
	default:
		return fmt.Errorf("%s takes one of %s or %s, not %s together", cmd.CommandPath(), name, strings.Join(choices, " or "), strings.Join(given, " and "))
	}
}

// newInboxCommand builds "retrysafe inbox".
func newInboxCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "inbox",
		Short: "Repair the inbox: deliver poison messages again",
	}
	var dbPath, operator, consumerName, brokerURL, stream string
	var clock chaosClockFlags
	var allPoison bool
	replay := &cobra.Command{
		Use:   "replay [--consumer C] [MESSAGE_ID | --all-poison]",
		Short: "Deliver poison messages to their consumer again, once the cause is fixed",
		Args: func(cmd *cobra.Command, args []string) error {
			return oneTarget(cmd, args, "MESSAGE_ID", map[string]bool{"--all-poison": allPoison})
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOperator(operator); err != nil {
				return err
			}
			target := inboxReplayTarget{Consumer: consumerName, AllPoison: allPoison}
			if len(args) == 1 {
				target.MessageID = args[0]
			}
			return runRepair(cmd, dbPath, clock, brokerURL, stream, func(ctx context.Context, app *App) ([]repairResult, error) {
				return app.replayInboxMessages(ctx, operator, target)
			})
		},
	}
	addRepairFlags(replay, &dbPath, &operator, &clock)
	replay.Flags().StringVar(&consumerName, "consumer", "", "only this consumer's poison messages ("+paymentServiceConsumer+", "+orderServiceConsumer+")")
	replay.Flags().BoolVar(&allPoison, "all-poison", false, "every poison message (of --consumer, if given)")
	addBrokerFlags(replay, &brokerURL, &stream)
	cmd.AddCommand(replay)
	return cmd
}

// newSagaCommand builds "retrysafe saga".
func newSagaCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "saga",
		Short: "List sagas by state; resume a saga whose compensation failed",
	}
	var dbPath, operator string
	var clock chaosClockFlags
	resume := &cobra.Command{
		Use:   "resume SAGA_ID",
		Short: "Try the compensations of a compensation_failed saga again",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return fmt.Errorf("%s takes one SAGA_ID (got %d arguments); 'retrysafe saga list --state %s' lists them", cmd.CommandPath(), len(args), sagaCompensationFailed)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOperator(operator); err != nil {
				return err
			}
			return runRepair(cmd, dbPath, clock, "", "", func(ctx context.Context, app *App) ([]repairResult, error) {
				result, err := app.resumeSaga(ctx, operator, args[0])
				if err != nil {
					return nil, err
				}
				return []repairResult{result}, nil
			})
		},
	}
	addRepairFlags(resume, &dbPath, &operator, &clock)

	var listDB, state string
	list := &cobra.Command{
		Use:   "list [--state S]",
		Short: "List the sagas in one state, longest unchanged first",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			status, err := parseSagaStatus(state)
			if err != nil {
				return err
			}
			db, err := openReadOnlyDB(cmd.Context(), listDB)
			if err != nil {
				return err
			}
			defer db.Close()
			sagas, err := listSagas(cmd.Context(), db, status)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "SAGA_ID\tORDER_ID\tSTATUS\tSTEP\tATTEMPTS\tUPDATED_AT\tLAST_ERROR")
			for _, s := range sagas {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", terminalSafe(s.SagaID), terminalSafe(s.OrderID), s.Status, terminalSafe(s.CurrentStep),
					s.Attempts, terminalSafe(s.UpdatedAt), terminalSafe(s.LastError))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d sagas %s\n", len(sagas), status)
			return nil
		},
	}
	list.Flags().StringVar(&listDB, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	list.Flags().StringVar(&state, "state", string(sagaCompensationFailed), "in_progress, compensating, completed, compensated or compensation_failed")
	cmd.AddCommand(resume, list)
	return cmd
}

// newRefundCommand builds "retrysafe refund".
func newRefundCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "refund",
		Short: "List abandoned refunds; finish them now",
	}
	var dbPath, operator string
	var clock chaosClockFlags
	finish := &cobra.Command{
		Use:   "finish",
		Short: "Run the refund completer once, now, over every refund key no request holds",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOperator(operator); err != nil {
				return err
			}
			return runRepair(cmd, dbPath, clock, "", "", func(ctx context.Context, app *App) ([]repairResult, error) {
				results, err := app.finishRefunds(ctx, operator)
				if err == nil && len(results) == 0 {
					fmt.Fprintln(cmd.OutOrStdout(), "no refund to finish")
				}
				return results, err
			})
		},
	}
	addRepairFlags(finish, &dbPath, &operator, &clock)

	var listDB string
	list := &cobra.Command{
		Use:   "list",
		Short: "List the refund keys stuck before finished, with their age",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			db, err := openReadOnlyDB(cmd.Context(), listDB)
			if err != nil {
				return err
			}
			defer db.Close()
			refunds, err := listUnfinishedRefunds(cmd.Context(), db, time.Now(), refundLockTimeout)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "USER_ID\tIDEMPOTENCY_KEY\tORDER_ID\tRECOVERY_POINT\tAGE\tSTATE")
			for _, r := range refunds {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", terminalSafe(r.UserID), terminalSafe(r.IdempotencyKey), terminalSafe(r.OrderID), r.RecoveryPoint,
					time.Duration(r.AgeSeconds)*time.Second, terminalSafe(r.State))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d unfinished refunds\n", len(refunds))
			return nil
		},
	}
	list.Flags().StringVar(&listDB, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	cmd.AddCommand(finish, list)
	return cmd
}

// minAdminKeyLength is the shortest RETRYSAFE_ADMIN_KEY serve accepts. The
// key opens every repair and the console, and whoever can reach serve can
// guess at it: the throttle (throttle.go) slows down one address, not
// many. 32 random characters are beyond any number of guesses; `openssl
// rand -hex 32` makes 64.
const minAdminKeyLength = 32

// adminKeyConfig reads RETRYSAFE_ADMIN_KEY for serve. Unset, the admin
// endpoints are off. Returns an error, saying how to make a good key, if
// the key is shorter than minAdminKeyLength; or if it is also a
// customer's API key: a customer's key must never open /admin.
func adminKeyConfig(say func(message string), apiKeys map[string]string) (string, error) {
	adminKey := os.Getenv("RETRYSAFE_ADMIN_KEY")
	if adminKey == "" {
		say("RETRYSAFE_ADMIN_KEY is not set: the /admin endpoints are off")
		return "", nil
	}
	if n := utf8.RuneCountInString(adminKey); n < minAdminKeyLength {
		return "", fmt.Errorf("RETRYSAFE_ADMIN_KEY is %d characters, too short to keep guessers out: use at least %d random ones, made with `openssl rand -hex 32`", n, minAdminKeyLength)
	}
	if user, ok := apiKeys[adminKey]; ok {
		return "", fmt.Errorf("RETRYSAFE_ADMIN_KEY is also the API key of %s; choose an admin key no customer has", user)
	}
	return adminKey, nil
}

// adminOperatorHeader names, on an admin request, the person behind it;
// repair_log records "admin-api (NAME)", or "admin-api" without it.
const adminOperatorHeader = "Retrysafe-Operator"

// adminRoutes adds the admin endpoints to mux: the repairs, and the lists
// that show what needs one. Every one answers only to the admin key.
func (s *server) adminRoutes(mux *http.ServeMux) {
	mux.Handle("POST /admin/outbox/{event_id}/retry", s.admin(s.handleAdminOutboxRetry))
	mux.Handle("POST /admin/inbox/{consumer}/{message_id}/replay", s.admin(s.handleAdminInboxReplay))
	mux.Handle("POST /admin/sagas/{saga_id}/resume", s.admin(s.handleAdminSagaResume))
	mux.Handle("POST /admin/refunds/finish", s.admin(s.handleAdminRefundFinish))
	mux.Handle("GET /admin/outbox", s.admin(s.handleAdminOutbox))
	mux.Handle("GET /admin/inbox", s.admin(s.handleAdminInbox))
	mux.Handle("GET /admin/sagas", s.admin(s.handleAdminSagas))
	mux.Handle("GET /admin/refunds", s.admin(s.handleAdminRefunds))
	allowed := map[string]string{
		"/admin/outbox/{event_id}/retry":              "POST",
		"/admin/inbox/{consumer}/{message_id}/replay": "POST",
		"/admin/sagas/{saga_id}/resume":               "POST",
		"/admin/refunds/finish":                       "POST",
		"/admin/outbox":                               "GET",
		"/admin/inbox":                                "GET",
		"/admin/sagas":                                "GET",
		"/admin/refunds":                              "GET",
	}
	for path, methods := range allowed {
		mux.Handle(path, s.admin(func(w http.ResponseWriter, r *http.Request, operator string) {
			w.Header().Set("Allow", methods)
			writeProblem(w, problem{Type: problemMethodNotAllowed, Title: "Method not allowed", Status: http.StatusMethodNotAllowed,
				Detail: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method)})
		}))
	}
	// Any other /admin path: off, unauthorized, or not found, in that order,
	// so that nothing under /admin tells a stranger what exists.
	mux.Handle("/admin/", s.admin(func(w http.ResponseWriter, r *http.Request, operator string) {
		writeProblem(w, problem{Type: problemNotFound, Title: "Not found", Status: http.StatusNotFound,
			Detail: fmt.Sprintf("no admin route for %s %s", r.Method, r.URL.Path)})
	}))
}

// adminHandler is a handler for an authenticated admin; operator is what
// repair_log records.
type adminHandler func(w http.ResponseWriter, r *http.Request, operator string)

// admin lets only the admin key through to next: with
// RETRYSAFE_ADMIN_KEY unset it answers 404 admin-disabled, saying how to
// enable the endpoints; without the admin key as the bearer token (a
// customer's API key is not it) 401; from an address that sent too many
// wrong keys, 429 too-many-wrong-keys with Retry-After, whatever the key
// (throttle.go).
func (s *server) admin(next adminHandler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.adminKey == "" {
			writeProblem(w, problem{Type: problemAdminDisabled, Title: "Admin endpoints are off", Status: http.StatusNotFound,
				Detail: "start serve with RETRYSAFE_ADMIN_KEY set, and send Authorization: Bearer <that key>"})
			return
		}
		scheme, key, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		key = strings.TrimSpace(key)
		right, retryAfter := false, 0
		if strings.EqualFold(scheme, "Bearer") && ok && key != "" {
			right, retryAfter = s.checkAdminKey(r, key)
		}
		if retryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
			writeProblem(w, problem{Type: problemTooManyWrongKeys, Title: "Too many wrong keys", Status: http.StatusTooManyRequests,
				Detail: fmt.Sprintf("too many wrong admin keys came from %s; no key from it is checked for %d seconds", guessAddress(r), retryAfter)})
			return
		}
		if !right {
			w.Header().Set("WWW-Authenticate", `Bearer realm="retrysafe-admin"`)
			writeProblem(w, problem{Type: problemUnauthorized, Title: "Unauthorized", Status: http.StatusUnauthorized,
				Detail: "the admin endpoints take Authorization: Bearer $RETRYSAFE_ADMIN_KEY; customers' API keys do not open them"})
			return
		}
		operator := "admin-api"
		if name := r.Header.Get(adminOperatorHeader); name != "" {
			if len(name) > 64 || strings.IndexFunc(name, func(c rune) bool { return c < 0x20 || c > 0x7e }) >= 0 {
				writeProblem(w, problem{Type: problemValidation, Title: "Invalid operator", Status: http.StatusBadRequest,
					Detail: adminOperatorHeader + " must be 1 to 64 printable ASCII characters"})
				return
			}
			operator = "admin-api (" + name + ")"
		}
		next(w, r, operator)
	})
}

// checkAdminKey reports whether key, presented by r as the admin key, is
// it, counting a wrong one against r's address (throttle.go); the right
// one clears that address's count. If the address must wait before a key
// of it is checked, key is not checked, and retryAfter is the wait in
// seconds (0 otherwise).
func (s *server) checkAdminKey(r *http.Request, key string) (right bool, retryAfter int) {
	address := guessAddress(r)
	if ok, wait := s.guesses.attempt(address); !ok {
		return false, retryAfterSeconds(wait)
	}
	if !sameSecret(key, s.adminKey) {
		return false, 0
	}
	s.guesses.succeeded(address)
	return true, 0
}

// sameSecret compares a presented key with the secret in constant time.
// Both are hashed first, so that not even the secret's length shows in how
// long the comparison takes.
func sameSecret(presented, secret string) bool {
	a := sha256.Sum256([]byte(presented))
	b := sha256.Sum256([]byte(secret))
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

// repairAnswer is the body of a successful admin repair: what it did, and
// the audit that followed it.
type repairAnswer struct {
	Repairs []repairResult `json:"repairs"`
	Check   auditAnswer    `json:"check"`
}

// auditAnswer is the audit of `retrysafe check --in-flight`.
type auditAnswer struct {
	OK         bool        `json:"ok"`
	Violations []violation `json:"violations"`
	// Unfinished, if set, says why the audit did not finish: OK is then
	// false although no violation was found.
	Unfinished string `json:"unfinished,omitempty"`
}

// writeRepair answers an admin repair: its problem if it changed nothing,
// or 200 with what it did and the audit after it. A failing audit does not
// make the answer an error: the repair is committed (retrying it would be
// refused), and the violations say what is still wrong.
func (s *server) writeRepair(w http.ResponseWriter, r *http.Request, results []repairResult, err error) {
	switch {
	case err == nil:
	case errors.Is(err, errRepairNotFound):
		writeProblem(w, problem{Type: problemNotFound, Title: "Not found", Status: http.StatusNotFound, Detail: err.Error()})
		return
	case errors.Is(err, errRepairRefused):
		writeProblem(w, problem{Type: problemRepairRefused, Title: "Repair refused", Status: http.StatusConflict, Detail: err.Error()})
		return
	case isBusy(err), isDatabaseUnavailable(err):
		w.Header().Set("Retry-After", "1")
		writeProblem(w, problem{Type: problemUnavailable, Title: "Temporarily unavailable", Status: http.StatusServiceUnavailable,
			Detail: "a transient failure; nothing was repaired, retry"})
		return
	default:
		s.logger.Error("admin request failed", "method", r.Method, "path", r.URL.Path, "error", err)
		writeProblem(w, problem{Type: problemInternal, Title: "Internal error", Status: http.StatusInternalServerError, Detail: err.Error()})
		return
	}
	writeJSON(w, repairAnswer{Repairs: results, Check: s.app.answerAudit(r.Context())})
}

// writeJSON writes v as a 200 application/json answer.
func writeJSON(w http.ResponseWriter, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("bug: encode answer: %v", err))
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(body)
}

// handleAdminOutboxRetry is POST /admin/outbox/{event_id}/retry.
func (s *server) handleAdminOutboxRetry(w http.ResponseWriter, r *http.Request, operator string) {
	results, err := s.app.retryOutboxEvents(r.Context(), operator, outboxRetryTarget{EventID: r.PathValue("event_id")})
	s.writeRepair(w, r, results, err)
}

// handleAdminInboxReplay is POST /admin/inbox/{consumer}/{message_id}/replay.
func (s *server) handleAdminInboxReplay(w http.ResponseWriter, r *http.Request, operator string) {
	target := inboxReplayTarget{Consumer: r.PathValue("consumer"), MessageID: r.PathValue("message_id")}
	results, err := s.app.replayInboxMessages(r.Context(), operator, target)
	s.writeRepair(w, r, results, err)
}

// handleAdminSagaResume is POST /admin/sagas/{saga_id}/resume.
func (s *server) handleAdminSagaResume(w http.ResponseWriter, r *http.Request, operator string) {
	result, err := s.app.resumeSaga(r.Context(), operator, r.PathValue("saga_id"))
	s.writeRepair(w, r, []repairResult{result}, err)
}

// handleAdminRefundFinish is POST /admin/refunds/finish.
func (s *server) handleAdminRefundFinish(w http.ResponseWriter, r *http.Request, operator string) {
	results, err := s.app.finishRefunds(r.Context(), operator)
	s.writeRepair(w, r, results, err)
}

// outboxListing is one outbox event as GET /admin/outbox shows it.
type outboxListing struct {
	EventID   string       `json:"event_id"`
	EventType string       `json:"event_type"`
	OrderID   string       `json:"order_id"`
	Status    outboxStatus `json:"status"`
	Attempts  int          `json:"attempts"`
	LastError string       `json:"last_error,omitempty"`
	CreatedAt string       `json:"created_at"`
	// HeldBack counts the later events of the order that wait behind
	// this one.
	HeldBack int `json:"held_back"`
}

// handleAdminOutbox is GET /admin/outbox?status=failed (the default; also
// pending or published): the events in that status, oldest first.
func (s *server) handleAdminOutbox(w http.ResponseWriter, r *http.Request, operator string) {
	status := outboxStatus(r.URL.Query().Get("status"))
	switch status {
	case "":
		status = outboxFailed
	case outboxPending, outboxPublished, outboxFailed:
	default:
		writeProblem(w, invalidQuery("status", "must be pending, published or failed"))
		return
	}
	rows, err := s.app.readDB.QueryContext(r.Context(), `
		SELECT e.event_id, e.event_type, e.aggregate_id, e.status, e.attempts, COALESCE(e.last_error, ''), e.created_at,
		       (SELECT COUNT(*) FROM outbox_events later
		        WHERE later.aggregate_id = e.aggregate_id AND later.seq > e.seq AND later.status <> 'published')
		FROM outbox_events e WHERE e.status = ? ORDER BY e.seq LIMIT ?`, status, listLimit)
	if err != nil {
		s.writeRepair(w, r, nil, fmt.Errorf("list outbox events: %w", err))
		return
	}
	defer rows.Close()
	events := []outboxListing{}
	for rows.Next() {
		var e outboxListing
		if err := rows.Scan(&e.EventID, &e.EventType, &e.OrderID, &e.Status, &e.Attempts, &e.LastError, &e.CreatedAt, &e.HeldBack); err != nil {
			s.writeRepair(w, r, nil, fmt.Errorf("scan outbox event: %w", err))
			return
		}
		events = append(events, e)
	}
	if err := rows.Err(); err != nil {
		s.writeRepair(w, r, nil, fmt.Errorf("list outbox events: %w", err))
		return
	}
	writeJSON(w, events)
}

// inboxListing is one inbox row as GET /admin/inbox shows it.
type inboxListing struct {
	Consumer      string `json:"consumer"`
	MessageID     string `json:"message_id"`
	Status        string `json:"status"`
	Error         string `json:"error,omitempty"`
	DeliveryCount int    `json:"delivery_count"`
	ProcessedAt   string `json:"processed_at"`
}

// handleAdminInbox is GET /admin/inbox?status=poison (the default; also
// done): the inbox rows in that status, oldest first.
func (s *server) handleAdminInbox(w http.ResponseWriter, r *http.Request, operator string) {
	status := r.URL.Query().Get("status")
	switch status {
	case "":
		status = string(inboxPoison)
	case string(inboxPoison), "done":
	default:
		writeProblem(w, invalidQuery("status", "must be poison or done"))
		return
	}
	rows, err := s.app.readDB.QueryContext(r.Context(), `
		SELECT consumer, message_id, status, COALESCE(error, ''), delivery_count, processed_at
		FROM inbox_messages WHERE status = ? ORDER BY processed_at, consumer LIMIT ?`, status, listLimit)
	if err != nil {
		s.writeRepair(w, r, nil, fmt.Errorf("list inbox messages: %w", err))
		return
	}
	defer rows.Close()
	messages := []inboxListing{}
	for rows.Next() {
		var m inboxListing
		if err := rows.Scan(&m.Consumer, &m.MessageID, &m.Status, &m.Error, &m.DeliveryCount, &m.ProcessedAt); err != nil {
			s.writeRepair(w, r, nil, fmt.Errorf("scan inbox message: %w", err))
			return
		}
		messages = append(messages, m)
	}
	if err := rows.Err(); err != nil {
		s.writeRepair(w, r, nil, fmt.Errorf("list inbox messages: %w", err))
		return
	}
	writeJSON(w, messages)
}

// handleAdminSagas is GET /admin/sagas?state=S (compensation_failed by
// default).
func (s *server) handleAdminSagas(w http.ResponseWriter, r *http.Request, operator string) {
	state := r.URL.Query().Get("state")
	if state == "" {
		state = string(sagaCompensationFailed)
	}
	status, err := parseSagaStatus(state)
	if err != nil {
		writeProblem(w, invalidQuery("state", err.Error()))
		return
	}
	sagas, err := listSagas(r.Context(), s.app.readDB, status)
	if err != nil {
		s.writeRepair(w, r, nil, err)
		return
	}
	writeJSON(w, sagas)
}

// handleAdminRefunds is GET /admin/refunds: the refund keys stuck before
// finished.
func (s *server) handleAdminRefunds(w http.ResponseWriter, r *http.Request, operator string) {
	refunds, err := listUnfinishedRefunds(r.Context(), s.app.readDB, s.app.now(), s.app.leases.refundLock)
	if err != nil {
		s.writeRepair(w, r, nil, err)
		return
	}
	writeJSON(w, refunds)
}

// invalidQuery is the problem of a query parameter that is not valid.
func invalidQuery(name, detail string) problem {
	return problem{Type: problemValidation, Title: "Invalid query", Status: http.StatusBadRequest,
		Detail: name + " " + detail, Errors: []fieldError{{Field: name, Detail: detail}}}
}
