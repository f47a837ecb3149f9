// End-to-end delivery (the article's "dual-write problem" section, taken one
// step further): the broker's acknowledgement ends an event's publication,
// not its life. A broker can lose a message it acknowledged: JetStream with
// its default sync policy acknowledges before the message is on disk, and a
// crash of its host loses what it had not flushed (Jepsen, NATS 2.12.1). The
// outbox row then says published, no consumer ever hears of the event, and
// the order it announced stays created for ever.
//
// An event is delivered when every consumer that subscribes to its subject
// has its inbox row. Nothing marks it: the inbox rows say it. The
// reconciler, part of the relay, publishes again, under the same message
// id, every event published longer than deliveryBound ago that is still
// not delivered: every inbox absorbs the copy where the original did
// arrive (and the embedded broker's dedupe before them). It claims what it
// republishes under a lease, fenced like the relay's.
//
// To read only the events in flight, however long the history, it keeps
// a cursor (delivery_cursor): every publish stamps its event with a
// position (delivery_position) that no cursor has passed yet, and the
// reconciler moves the cursor up to the first event, from the cursor on,
// that a consumer lacks. Events below the cursor are delivered for good.
// One row written per sweep, where a mark per event was two per order.

// Its limit: it reads the consumers' inboxes, so it works where they share
// the outbox's database. Where each consumer owns its database, the
// consumer has to notice the gap itself (docs/postgres-nats.md).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
)

// deliveryTarget is one consumer that must apply every event of one
// subject.
type deliveryTarget struct {
	subject, consumer string
}

// deliveryTargets returns, for every subject, the consumers that must apply
// its events: read off consumers(), whose subjects are the subscriptions,
// so a consumer added there is waited for here too. (consumers() of an
// empty App serves: its apply functions are not called. An App's own
// targets add those of the consumers wired in by addConsumer.)
func deliveryTargets() []deliveryTarget {
	var targets []deliveryTarget
	for _, c := range (&App{}).consumers() {
		for _, subject := range c.subjects {
			targets = append(targets, deliveryTarget{subject: subject, consumer: c.name})
		}
	}
	return targets
}

// subscriptionsTable returns targets as a table, "(...)", of two columns,
// subject and consumer, to follow FROM or JOIN. The names are the
// program's constants, written as SQL literals. (SQLite and PostgreSQL both
// name the columns of VALUES column1 and column2.)
func subscriptionsTable(targets []deliveryTarget) string {
	rows := make([]string, len(targets))
	for i, t := range targets {
		rows[i] = "(" + sqlLiteral(t.subject) + ", " + sqlLiteral(t.consumer) + ")"
	}
	return "(SELECT column1 AS subject, column2 AS consumer FROM (VALUES " + strings.Join(rows, ", ") + ") AS targets)"
}

// sqlLiteral quotes s as an SQL string literal.
func sqlLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// undeliveredSQL returns the condition, on the outbox_events row e, that
// one of targets subscribed to e's subject has no inbox row of it. A poison
// row counts as delivered: the consumer received the message and gave up
// on it, which inspect and check report, and an operator replays.
func undeliveredSQL(targets []deliveryTarget) string {
	return `EXISTS (
		SELECT 1 FROM ` + subscriptionsTable(targets) + ` s
		WHERE s.subject = e.event_type
		  AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.consumer = s.consumer AND i.message_id = e.event_id))`
}

// reconcileOnce is one sweep of the reconciler: it moves the delivery
// cursor past the events delivered, then claims up to limit events
// published (or last republished) more than leases.deliver ago that are
// still not delivered, publishes them again under their event id, and
// records that. It returns how many it republished.
//
// The claim is the relay's lease on the event (claimed_by, claimed_until,
// and lease_token, the fencing token): two relays sweeping together never
// republish one event in one sweep, and a relay paused past its lease
// finds its record refused (recordRepublished) once another relay has
// claimed the event since. Its copy went out anyway, which is harmless:
// the same message id, absorbed like every copy. However old the event,
// the copy is harmless: cleanup keeps the inbox rows of an event that the
// cursor has not passed.
func (a *App) reconcileOnce(ctx context.Context, relayID string, limit int) (int, error) {
	if err := a.advanceDeliveryCursor(ctx); err != nil {
		return 0, err
	}
	events, err := a.claimUndelivered(ctx, relayID, limit)
	if err != nil || len(events) == 0 {
		return 0, err
	}
	msgs := make([]message, len(events))
	for i, event := range events {
		// The event id, as on the first publish: every inbox keys on
		// it. JetStream deduplicates this publish by an id of the
		// claim's own (see message.PublishID).
		msgs[i] = message{ID: event.EventID, Subject: event.EventType, Payload: event.Payload, Trace: event.Trace,
			PublishID: fmt.Sprintf("%s/republish-%d", event.EventID, event.LeaseToken)}
	}
	if err := a.broker.publishBatch(ctx, msgs); err != nil {
		if errors.Is(err, errCrash) {
			return 0, err
		}
		// The broker is down or refuses: the claim stays until its lease
		// passes, and the first sweep after that tries again. Not an
		// error of the sweep, as a failed publish is none of relayOnce.
		a.log.Warn("reconciler republish failed", "relay", relayID, "events", len(events), "error", err.Error())
		return 0, nil
	}
	// The broker has the copies, the outbox has not recorded them.
	if err := a.fault.at(ctx, faultAfterPublish); err != nil {
		return 0, err
	}
	n, err := a.recordRepublished(ctx, relayID, events)
	a.metrics.republished(n)
	return n, err
}

// deliveryCursor is the reconciler's cursor, as a scalar subquery: every
// published event whose delivery_position is below it is delivered.
const deliveryCursor = `(SELECT position FROM delivery_cursor WHERE name = 'outbox')`

// cursorPassed says, of the outbox event e, 'yes' if the reconciler's
// cursor has passed it (delivered for good), else 'no' (inspect, trace).
const cursorPassed = `CASE WHEN e.delivery_position < ` + deliveryCursor + ` THEN 'yes' ELSE 'no' END`

// advanceDeliveryCursor moves the delivery cursor up to the first event,
// from the cursor on, that a consumer of its subject has not applied; if
// there is none, up to the horizon (dialect.deliveryHorizon): the events
// it passes are delivered for good, and no sweep reads them again. It
// reads only the events from the cursor on (the outbox_events_delivery
// index), however long the history, and writes one row, only when the
// cursor moves.
//
// It needs no lease and no fence: the position it computes is true of the
// snapshot its one SELECT reads, and stays true. Below the horizon every
// publish that will commit is in that snapshot; a publish after it stamps a
// position at or above the horizon (dialect.deliveryPosition); an inbox
// row is deleted only by cleanup, of an event the cursor has passed, and by
// an operator's inbox replay, which stamps the event again. Two
// reconcilers moving the cursor at once each write a true position; the
// UPDATE only moves it up.
func (a *App) advanceDeliveryCursor(ctx context.Context) error {
	d := dialectOf(a.db)
	var cursor, next int64
	err := a.db.QueryRowContext(ctx, `
		SELECT c.position, COALESCE(
			(SELECT e.delivery_position FROM outbox_events e
			 WHERE e.delivery_position >= c.position AND e.delivery_position < h.horizon
			   AND `+undeliveredSQL(a.deliveryTargets)+`
			 ORDER BY e.delivery_position LIMIT 1),
			h.horizon)
		FROM delivery_cursor c, (SELECT `+d.deliveryHorizon+` AS horizon) h
		WHERE c.name = 'outbox'`).Scan(&cursor, &next)
	if err != nil {
		return fmt.Errorf("read the delivery cursor: %w", err)
	}
	if next <= cursor {
		return nil
	}
	if err := a.fault.at(ctx, faultBeforeCursorMove); err != nil {
		return err
	}
	// Only up: a sweep that read before another moved the cursor past
	// next, and writes after it, must not set it back.
	_, err = a.db.ExecContext(ctx, `UPDATE delivery_cursor SET position = ? WHERE name = 'outbox' AND position < ?`, next, next)
	if err != nil {
		return fmt.Errorf("move the delivery cursor: %w", err)
	}
	return nil
}

// claimUndelivered leases to relayID up to limit published events, not
// delivered, whose last publish is more than leases.deliver ago, and not
// leased to a live relay. Returns them in the order they were written.
func (a *App) claimUndelivered(ctx context.Context, relayID string, limit int) ([]outboxEvent, error) {
	now := a.now()
	var events []outboxEvent
	err := withClaimTx(ctx, a.db, func(tx *sql.Tx) error {
		events = nil
		// lease_token + 1: the claim's fencing token, as the relay's.
		rows, err := tx.QueryContext(ctx, `
			UPDATE outbox_events
			SET claimed_by = ?, claimed_until = ?, lease_token = lease_token + 1
			WHERE seq IN (
				SELECT e.seq FROM outbox_events e
				-- Published: an operator's replay of a message whose event
				-- the relay has not marked yet stamps a position too, and a
				-- copy of it would be refused its record (recordRepublished)
				-- and sent again every lease until the relay marks it.
				WHERE e.status = 'published' AND e.delivery_position >= `+deliveryCursor+`
				  -- Past the bound since the last publish: a consumer that is
				  -- merely behind gets no copy. The last publish is the
				  -- later of the relay's or a replay's (published_at) and
				  -- this reconciler's copy (republished_at): a replay after
				  -- a copy is the last, and waits its bound too.
				  AND e.published_at <= ? AND (e.republished_at IS NULL OR e.republished_at <= ?)
				  AND (e.claimed_until IS NULL OR e.claimed_until <= ?)
				  AND `+undeliveredSQL(a.deliveryTargets)+`
				-- The index's order: ORDER BY seq made SQLite read the
				-- whole table, in seq order, instead of the index.
				ORDER BY e.delivery_position
				LIMIT ? `+skipLocked(a.db)+`)
			RETURNING seq, event_id, event_type, aggregate_id, payload, republishes, lease_token, traceparent, tracestate`,
			relayID, formatTime(now.Add(a.leases.relay)),
			formatTime(now.Add(-a.leases.deliver)), formatTime(now.Add(-a.leases.deliver)), formatTime(now), limit)
		if err != nil {
			return fmt.Errorf("claim undelivered events: %w", err)
		}
		// republishes in place of attempts (scanClaimedEvents).
		events, err = scanClaimedEvents(rows)
		return err
	})
	if err != nil {
		return nil, err
	}
	return events, nil
}

// recordRepublished records, under relayID's claim of each event (its seq
// and lease token), that the event was published again now, and releases
// the claim. It returns how many it recorded: an event another relay
// claimed since (this one was paused past its lease) is left to that
// relay, whose record is the one that counts.
func (a *App) recordRepublished(ctx context.Context, relayID string, events []outboxEvent) (int, error) {
	args := make([]any, 0, 2*len(events)+2)
	args = append(args, formatTime(a.now()), relayID)
	for _, event := range events {
		args = append(args, event.Seq, event.LeaseToken)
	}
	recorded, err := a.db.ExecContext(ctx, `
		UPDATE outbox_events
		SET republished_at = ?, republishes = republishes + 1, claimed_by = NULL, claimed_until = NULL
		WHERE status = 'published' AND claimed_by = ?
		  AND (seq, lease_token) IN `+integerPairs(len(events)),
		args...)
	if err != nil {
		return 0, fmt.Errorf("record %d republished events: %w", len(events), err)
	}
	n, err := recorded.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("record %d republished events: %w", len(events), err)
	}
	return int(n), nil
}
