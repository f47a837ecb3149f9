// End-to-end delivery (the article's "dual-write problem" section, taken one
// step further): the broker's acknowledgement ends an event's publication,
// not its life. A broker can lose a message it acknowledged: JetStream with
// its default sync policy acknowledges before the message is on disk, and a
// crash of its host loses what it had not flushed (Jepsen, NATS 2.12.1). The
// outbox row then says published, no consumer ever hears of the event, and
// the order it announced stays created for ever.
//
// An event is delivered when every consumer that subscribes to its subject
// has its inbox row. The reconciler, part of the relay, marks delivered
// events, and publishes again, under the same message id, every event
// published longer than deliveryBound ago that is still not delivered:
// every inbox absorbs the copy where the original did arrive (and the
// embedded broker's dedupe before them). It claims what it republishes under a lease, fenced like the
// relay's.
//
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

// reconcileOnce is one sweep of the reconciler: it marks delivered the
// published events that every consumer of their subject has applied, then
// claims up to limit events published (or last republished) more than
// leases.deliver ago that are still not delivered, publishes them again
// under their event id, and records that. It returns how many it
// republished.
//
// The claim is the relay's lease on the event (claimed_by, claimed_until,
// and lease_token, the fencing token): two relays sweeping together never
// republish one event in one sweep, and a relay paused past its lease
// finds its record refused (recordRepublished) once another relay has
// claimed the event since. Its copy went out anyway, which is harmless:
// the same message id, absorbed like every copy. However old the event,
// the copy is harmless: cleanup keeps the inbox rows of an event that is
// not delivered.
func (a *App) reconcileOnce(ctx context.Context, relayID string, limit int) (int, error) {
	if err := a.markDelivered(ctx); err != nil {
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

// markDelivered sets delivered_at on every published event that each
// consumer of its subject has applied. It reads only the events in flight
// (the outbox_events_undelivered index), however long the history.
//
// It is not fenced, and needs no lease: it writes a fact that the inbox
// rows make true, and writes it only once (delivered_at IS NULL). Two
// relays marking together mark the same.
//
// It takes two statements where one would do on SQLite: the first locks
// the events that look delivered, the second marks those that still are,
// reading the inbox afresh. On PostgreSQL, under READ COMMITTED, a
// statement reads every table as of its start but updates the latest
// version of each row it locks: a single UPDATE that read a poison row
// while an inbox replay was deleting it, then waited for the replay's lock
// on the event, marked the replayed event delivered once the replay
// committed, though no consumer had applied the replay (a lost replay was
// then never published again). The second statement starts after the
// locks are granted, so it sees what a replay that held one committed; a
// replay that comes after the lock waits for it, then fails to serialize
// and runs again.
func (a *App) markDelivered(ctx context.Context) error {
	now := formatTime(a.now())
	err := withClaimTx(ctx, a.db, func(tx *sql.Tx) error {
		rows, err := tx.QueryContext(ctx, `
			SELECT e.seq FROM outbox_events e
			WHERE e.status = 'published' AND e.delivered_at IS NULL
			  AND NOT `+undeliveredSQL(a.deliveryTargets)+`
			LIMIT ? `+skipLocked(a.db),
			markDeliveredBatch)
		if err != nil {
			return err
		}
		var seqs []any
		for rows.Next() {
			var seq int64
			if err := rows.Scan(&seq); err != nil {
				rows.Close()
				return err
			}
			seqs = append(seqs, seq)
		}
		rows.Close()
		if err := rows.Err(); err != nil || len(seqs) == 0 {
			return err
		}
		_, err = tx.ExecContext(ctx, `
			UPDATE outbox_events AS e SET delivered_at = ?
			WHERE e.seq IN (`+placeholders(len(seqs))+`) AND e.delivered_at IS NULL
			  AND NOT `+undeliveredSQL(a.deliveryTargets),
			append([]any{now}, seqs...)...)
		return err
	})
	if err != nil {
		return fmt.Errorf("mark delivered events: %w", err)
	}
	return nil
}

// markDeliveredBatch bounds how many events one sweep marks delivered: the
// rest wait for the next sweep, a relay's pass later.
const markDeliveredBatch = 1000

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
				WHERE e.status = 'published' AND e.delivered_at IS NULL
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
				ORDER BY e.published_at, e.seq
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
