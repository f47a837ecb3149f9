// The embedded broker: a stand-in for NATS JetStream, Kafka or RabbitMQ,
// kept in the same SQLite file so the demo needs nothing else to run. It is
// honest about what those brokers promise and no more:
//   - dedupe on publish by message id (like JetStream's Nats-Msg-Id), so a
//     relay that publishes an event twice stores it once;
//   - at-least-once delivery to each subscriber, never exactly-once;
//   - redelivery when a delivery is not acked within ackWait, with a count,
//     and without limit: the inbox, not the broker, decides when a message
//     is poison (see receiveIn);
//   - a fetch is a lease on the delivery until ackWait passes, and its
//     delivery_count is the lease's fencing token: only the latest holder's
//     ack or nak takes effect.
//
// Being in the same file does not make it transactional with the outbox:
// publish runs in its own transaction, exactly as a network call would.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// message is what travels through the broker.
type message struct {
	// ID is the outbox event_id, and the inbox message_id downstream.
	ID      string
	Subject string
	Payload []byte
	// Trace is the event's creation context, copied from the outbox row
	// (tracing.go): the consumer's spans link to it.
	Trace traceContext
	// PublishID, if set, is what the broker deduplicates this publish by
	// instead of ID: the reconciler's copy of a message the broker may
	// have lost (deliver.go). JetStream remembers a Nats-Msg-Id for
	// natsDuplicateWindow even after the message is gone, and would drop
	// a copy under ID as a duplicate of what it lost; the copy still
	// reaches the consumers as ID, which their inboxes key on. The
	// embedded broker ignores it: a copy of a message it lost is stored
	// anew, one of a message it holds queues only the deliveries missing.
	PublishID string
}

// delivery is one handing of a message to one subscriber.
type delivery struct {
	message
	Subscriber string
	// Seq is the embedded broker's message sequence.
	Seq int64
	// DeliveryCount is 1 on the first delivery, more on redeliveries.
	DeliveryCount int
	// Malformed, if set, says why the broker could not make a message of
	// what it delivered (natsBroker: no Nats-Msg-Id header, so nothing
	// could deduplicate it). ID is then made up by the broker; the
	// consumer records it as poison under that id, and ack terminates it.
	Malformed error
	// natsMsg is the JetStream message to ack, with natsBroker.
	natsMsg jetstream.Msg
}

// errDeliveryLeaseLost is returned by the embedded broker's ack and nak when
// the delivery was fetched again since the caller fetched it (its lease,
// ackWait, passed and another fetch took it): the ack or nak is refused,
// so that it cannot end or move the new holder's lease.
var errDeliveryLeaseLost = errors.New("the delivery was handed to another fetch since; ack or nak refused")

// messageBroker is what the relay and the consumers need from a broker. It
// has two implementations: embeddedBroker (this file, the default) and
// natsBroker (infra_nats.go, NATS JetStream).
type messageBroker interface {
	// subscribe makes sure subscriber gets every message on subjects.
	subscribe(ctx context.Context, subscriber string, subjects ...string) error
	// publishBatch publishes msgs, deduplicated by message id, and returns
	// once the broker has them all.
	publishBatch(ctx context.Context, msgs []message) error
	// fetch hands up to max due messages to subscriber, each until its
	// ackWait passes; a message not acked by then is delivered again, as
	// often as it takes (the inbox, not the broker, gives up on a message).
	fetch(ctx context.Context, subscriber string, max int) ([]delivery, error)
	// ack tells the broker the deliveries were handled; a Malformed one is
	// terminated.
	ack(ctx context.Context, deliveries ...delivery) error
	// nak asks for d again after delay.
	nak(ctx context.Context, d delivery, delay time.Duration) error
	// held returns how many copies of the message messageID the broker
	// stores, and how many publishes of it it dropped as duplicates. The
	// demo shows both.
	held(ctx context.Context, messageID string) (stored, dropped int, err error)
	// replay delivers msg, which subscriber recorded as poison, to it
	// again, as part of the repair transaction tx (repair.go).
	replay(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error
	// system names the broker as the spans' messaging.system (tracing.go).
	system() string
}

// embeddedBroker is the embedded broker over the broker_* tables.
type embeddedBroker struct {
	db    *sql.DB
	now   func() time.Time
	fault faultHook
	// ackWait is how long a delivery waits for its ack before it is
	// delivered again.
	ackWait time.Duration
	// down, set by serve --broker-down and relay --broker-down, makes
	// every publish fail as if the broker could not be reached: a drill
	// for the operator's tools (docs/operate-and-repair.md, "Operate it").
	down bool
}

// errBrokerDown is every publish's error while the embedded broker is down.
var errBrokerDown = errors.New("the broker is down (--broker-down): publish refused")

// subscribe makes sure subscriber gets every message on subjects published
// from now on. Calling it again is harmless.
func (b *embeddedBroker) subscribe(ctx context.Context, subscriber string, subjects ...string) error {
	for _, subject := range subjects {
		_, err := b.db.ExecContext(ctx, `
			INSERT INTO broker_subscriptions (subscriber, subject) VALUES (?, ?)
			ON CONFLICT (subscriber, subject) DO NOTHING`, subscriber, subject)
		if err != nil {
			return fmt.Errorf("subscribe %s to %s: %w", subscriber, subject, err)
		}
	}
	return nil
}

// publishBatch stores msgs, all or none, and queues one delivery per
// subscriber of each subject. A message id seen before is dropped (and
// counted in broker_messages.duplicates): that is the broker's half of
// absorbing a relay that publishes twice.
func (b *embeddedBroker) publishBatch(ctx context.Context, msgs []message) error {
	if err := b.fault.at(ctx, faultPublish); err != nil {
		return err
	}
	if b.down {
		return errBrokerDown
	}
	if len(msgs) == 0 {
		return nil
	}
	now := formatTime(b.now())
	values := make([]string, len(msgs))
	args := make([]any, 0, 6*len(msgs))
	ids := make([]any, 0, len(msgs)+1)
	ids = append(ids, now)
	for i, msg := range msgs {
		values[i] = "(?, ?, ?, ?, ?, ?)"
		traceparent, tracestate := msg.Trace.columns()
		args = append(args, msg.ID, msg.Subject, msg.Payload, now, traceparent, tracestate)
		ids = append(ids, msg.ID)
	}
	// Two statements per batch, however large: a round trip per message
	// is what a database across the network (PostgreSQL) makes expensive.
	return withTx(ctx, b.db, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `
			INSERT INTO broker_messages (message_id, subject, payload, published_at, traceparent, tracestate)
			VALUES `+strings.Join(values, ", ")+`
			ON CONFLICT (message_id) DO UPDATE SET duplicates = broker_messages.duplicates + 1`,
			args...)
		if err != nil {
			return fmt.Errorf("publish %d messages: %w", len(msgs), err)
		}
		// For a duplicate, DO NOTHING keeps the deliveries already queued
		// (and acked) as they are.
		_, err = tx.ExecContext(ctx, `
			INSERT INTO broker_deliveries (subscriber, message_seq, status, visible_at)
			SELECT s.subscriber, m.seq, 'pending', ?
			FROM broker_messages m JOIN broker_subscriptions s ON s.subject = m.subject
			WHERE m.message_id IN (`+placeholders(len(msgs))+`)
			ON CONFLICT (subscriber, message_seq) DO NOTHING`,
			ids...)
		if err != nil {
			return fmt.Errorf("queue deliveries of %d messages: %w", len(msgs), err)
		}
		return nil
	})
}

// fetch hands up to max due messages to subscriber, oldest first. Each is
// hidden for ackWait: not acked by then, it is delivered again with a higher
// DeliveryCount.
func (b *embeddedBroker) fetch(ctx context.Context, subscriber string, max int) ([]delivery, error) {
	var deliveries []delivery
	err := withClaimTx(ctx, b.db, func(tx *sql.Tx) error {
		deliveries = nil
		now := b.now()
		rows, err := tx.QueryContext(ctx, `
			UPDATE broker_deliveries
			SET delivery_count = delivery_count + 1, visible_at = ?
			WHERE subscriber = ? AND message_seq IN (
				SELECT message_seq FROM broker_deliveries
				WHERE subscriber = ? AND status = 'pending' AND visible_at <= ?
				ORDER BY message_seq
				LIMIT ? `+dialectOf(b.db).skipLocked+`)
			RETURNING message_seq, delivery_count`,
			formatTime(now.Add(b.ackWait)), subscriber, subscriber, formatTime(now), max)
		if err != nil {
			return fmt.Errorf("fetch for %s: %w", subscriber, err)
		}
		defer rows.Close()
		for rows.Next() {
			d := delivery{Subscriber: subscriber}
			if err := rows.Scan(&d.Seq, &d.DeliveryCount); err != nil {
				return fmt.Errorf("scan delivery: %w", err)
			}
			deliveries = append(deliveries, d)
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("fetch for %s: %w", subscriber, err)
		}
		for i := range deliveries {
			var traceparent, tracestate sql.NullString
			err := tx.QueryRowContext(ctx, `SELECT message_id, subject, payload, traceparent, tracestate FROM broker_messages WHERE seq = ?`,
				deliveries[i].Seq).Scan(&deliveries[i].ID, &deliveries[i].Subject, &deliveries[i].Payload, &traceparent, &tracestate)
			if err != nil {
				return fmt.Errorf("read message %d: %w", deliveries[i].Seq, err)
			}
			deliveries[i].Trace = traceContextFrom(traceparent, tracestate)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	// RETURNING gives no order; deliver in the order published.
	sort.Slice(deliveries, func(i, j int) bool { return deliveries[i].Seq < deliveries[j].Seq })
	return deliveries, nil
}

// ack tells the broker these deliveries were handled: they are not
// delivered again. One statement acks a whole batch.
//
// Each ack is fenced by the delivery count that the caller's fetch
// returned: a caller paused past ackWait, whose message another fetch has
// taken since, acks nothing. Acking would be harmless to the message (the
// paused caller acks only after its transaction committed, so the inbox
// row is there and the new holder's run is a duplicate), but it would end
// the new holder's lease under it, and its own ack would then fail; one
// rule for ack and nak is easier to trust, and a stale nak is not harmless
// (see nak). Nothing is lost by refusing: the new holder acks. Returns
// errDeliveryLeaseLost, wrapped, if any delivery was refused; the others
// are acked.
func (b *embeddedBroker) ack(ctx context.Context, deliveries ...delivery) error {
	if len(deliveries) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(deliveries)+2)
	args = append(args, formatTime(b.now()), deliveries[0].Subscriber)
	fenced := make([]string, len(deliveries))
	for i, d := range deliveries {
		if d.Subscriber != deliveries[0].Subscriber {
			return fmt.Errorf("bug: one ack for two subscribers (%s, %s)", deliveries[0].Subscriber, d.Subscriber)
		}
		fenced[i] = `(message_seq = ? AND delivery_count = ?)`
		args = append(args, d.Seq, d.DeliveryCount)
	}
	acked, err := b.db.ExecContext(ctx, `
		UPDATE broker_deliveries SET status = 'acked', acked_at = ?
		WHERE subscriber = ? AND status = 'pending'
		  -- delivery_count is the fencing token: a fetch since ours raised it.
		  AND (`+strings.Join(fenced, " OR ")+`)`,
		args...)
	if err != nil {
		return fmt.Errorf("ack %d deliveries for %s: %w", len(deliveries), deliveries[0].Subscriber, err)
	}
	n, err := acked.RowsAffected()
	if err != nil {
		return fmt.Errorf("ack %d deliveries for %s: %w", len(deliveries), deliveries[0].Subscriber, err)
	}
	if int(n) != len(deliveries) {
		return fmt.Errorf("ack for %s: %d of %d deliveries: %w", deliveries[0].Subscriber, len(deliveries)-int(n), len(deliveries), errDeliveryLeaseLost)
	}
	return nil
}

// nak tells the broker d failed for now: deliver it again after delay.
//
// Fenced like ack, by d's delivery count: a caller paused past ackWait
// whose message another fetch has taken since must not move visible_at,
// which is now the new holder's lease; a nak with a short delay would hand
// the message to a third consumer while the second still works on it.
// Returns errDeliveryLeaseLost, wrapped, if refused.
func (b *embeddedBroker) nak(ctx context.Context, d delivery, delay time.Duration) error {
	naked, err := b.db.ExecContext(ctx, `
		UPDATE broker_deliveries SET visible_at = ?
		WHERE subscriber = ? AND message_seq = ? AND status = 'pending'
		  AND delivery_count = ? -- the fencing token, as in ack`,
		formatTime(b.now().Add(delay)), d.Subscriber, d.Seq, d.DeliveryCount)
	if err != nil {
		return fmt.Errorf("nak %s for %s: %w", d.ID, d.Subscriber, err)
	}
	n, err := naked.RowsAffected()
	if err != nil {
		return fmt.Errorf("nak %s for %s: %w", d.ID, d.Subscriber, err)
	}
	if n != 1 {
		return fmt.Errorf("nak %s for %s (delivery %d): %w", d.ID, d.Subscriber, d.DeliveryCount, errDeliveryLeaseLost)
	}
	return nil
}

// held returns how many copies of messageID the broker stores and how many
// duplicate publishes of it it absorbed.
func (b *embeddedBroker) held(ctx context.Context, messageID string) (int, int, error) {
	var stored, dropped int
	err := b.db.QueryRowContext(ctx, `
		SELECT COUNT(*), COALESCE(SUM(duplicates), 0) FROM broker_messages WHERE message_id = ?`,
		messageID).Scan(&stored, &dropped)
	if err != nil {
		return 0, 0, fmt.Errorf("count copies of %s: %w", messageID, err)
	}
	return stored, dropped, nil
}
