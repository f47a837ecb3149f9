// A second consumer of one subject, and a poison message replayed before
// its ack, in the simulator.
//
// The ledger. In the shipped wiring every subject has one consumer: the
// payment service reads OrderCreated, the order service PaymentCaptured
// and OrderCancelled. A fault that takes "some consumer applied this
// event" for "each consumer of its subject applied it" cannot show there.
// So the simulator wires in a second consumer of OrderCreated
// (App.addConsumer): a ledger service that books each order in a table of
// its own, in its inbox's transaction. It is a consumer like the others:
// the workers run it and it fails as they do, the reconciler waits for it,
// an operator replays its poison messages. The broker's loss of a message
// it acknowledged now sometimes reaches a message that one of the two has
// acked and the other has not (loseAMessage): the reconciler must not mark
// the event delivered, must publish it again, and the payment service's
// inbox must absorb the copy. Once quiet, every order must be booked
// exactly once (checkLedger).
//
// The poison replayed before its ack. A release of a consumer with a bug
// rejects a message as invalid: poison at once, a permanent failure. The
// consumer commits that record and, before its ack lands, stalls (a pause,
// a slow network). Meanwhile the relay's reconciler sweeps and counts the
// poison record as delivered; the operator, who was watching, deploys the
// fix and replays every poison message. Then the stalled consumer acks the
// delivery it fetched before the replay. That ack must not take the
// replayed delivery away: nothing would ever deliver it again, and the
// reconciler, which saw it delivered, publishes no copy. Left to chance
// this never happens: the operator repairs at random steps, and a
// consumer's ack follows its commit at once unless it is held there, so
// this builds the sequence on purpose (stepReplayRace).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// simLedgerConsumer is the simulator's second consumer of OrderCreated.
const simLedgerConsumer = "ledger-svc"

// simConsumersCounts count the two structures in a run.
type simConsumersCounts struct {
	// LostAfterOneApplied counts messages the broker lost that one
	// subscriber had acked and another had not.
	LostAfterOneApplied int
	// PoisonReplayedBeforeAck counts poison messages replayed while the
	// consumer that recorded them had not acked yet.
	PoisonReplayedBeforeAck int
	// ReplaysToEvery counts the copies a replay delivered to the other
	// consumers of its subject (replayToEvery); ReplaysForgotten those of
	// them that reached a consumer whose inbox no longer had the message.
	ReplaysToEvery, ReplaysForgotten int
	// ReplaysLost counts the replays the broker lost (loseTheReplay).
	ReplaysLost int
}

// add adds other's counts to c.
func (c *simConsumersCounts) add(other simConsumersCounts) {
	c.LostAfterOneApplied += other.LostAfterOneApplied
	c.PoisonReplayedBeforeAck += other.PoisonReplayedBeforeAck
	c.ReplaysToEvery += other.ReplaysToEvery
	c.ReplaysForgotten += other.ReplaysForgotten
	c.ReplaysLost += other.ReplaysLost
}

// String says how often a run reached the structures, for the summary.
func (c simConsumersCounts) String() string {
	return fmt.Sprintf("%d messages lost for one consumer of OrderCreated after the other had applied them, "+
		"%d poison messages replayed before their ack, %d copies of replays delivered to every consumer of the subject "+
		"(%d to a consumer whose inbox had forgotten the message), %d replays the broker lost",
		c.LostAfterOneApplied, c.PoisonReplayedBeforeAck, c.ReplaysToEvery, c.ReplaysForgotten, c.ReplaysLost)
}

// wireLedger creates the ledger's table and wires the ledger into the App,
// before anything is published. The table has no key: an order booked
// twice shows as two rows.
func (s *simulation) wireLedger(ctx context.Context) error {
	_, err := s.direct.ExecContext(ctx, `
		CREATE TABLE sim_ledger_entries (message_id TEXT NOT NULL, order_id TEXT NOT NULL, booked_at TEXT NOT NULL)`)
	if err != nil {
		return fmt.Errorf("create the ledger's table: %w", err)
	}
	return s.app.addConsumer(ctx, consumer{name: simLedgerConsumer, subjects: []string{eventOrderCreated}, apply: s.bookOrder})
}

// bookOrder is the ledger's apply: one row per OrderCreated, in the inbox's
// transaction. A message it booked already changes nothing, but only one
// the inbox may have forgotten, booked more than messageRetention ago (a
// replay's copy: replayToEvery); an earlier one the inbox let through is
// a fault (s.ledgerFault).
func (s *simulation) bookOrder(ctx context.Context, tx *sql.Tx, msg message) error {
	orderID := payloadOrderID(msg.Payload)
	if orderID == "" {
		return permanent(fmt.Errorf("OrderCreated %s names no order", msg.ID))
	}
	var booked, recently int
	if err := tx.QueryRowContext(ctx, `SELECT COUNT(*), COUNT(*) FILTER (WHERE booked_at > ?) FROM sim_ledger_entries WHERE message_id = ?`,
		formatTime(s.clock.now().Add(-messageRetention)), msg.ID).Scan(&booked, &recently); err != nil {
		return fmt.Errorf("read the ledger: %w", err)
	}
	if recently > 0 && s.ledgerFault == "" {
		s.ledgerFault = fmt.Sprintf("%s got %s of order %s again, booked less than %s ago: its inbox let a copy through", simLedgerConsumer, msg.ID, orderID, messageRetention)
	}
	if booked > 0 {
		return nil
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO sim_ledger_entries (message_id, order_id, booked_at) VALUES (?, ?, ?)`,
		msg.ID, orderID, formatTime(s.clock.now()))
	if err != nil {
		return fmt.Errorf("book order %s: %w", orderID, err)
	}
	return nil
}

// checkLedger fails the run unless, once quiet, the ledger booked every
// order exactly once: no OrderCreated lost for it, none applied twice.
func (s *simulation) checkLedger(ctx context.Context) error {
	if s.ledgerFault != "" {
		return s.fail("%s", s.ledgerFault)
	}
	rows, err := s.direct.QueryContext(ctx, `
		SELECT o.order_id, COUNT(l.order_id) FROM orders o LEFT JOIN sim_ledger_entries l ON l.order_id = o.order_id
		GROUP BY o.order_id HAVING COUNT(l.order_id) <> 1 ORDER BY o.order_id`)
	if err != nil {
		return fmt.Errorf("read the ledger: %w", err)
	}
	defer rows.Close()
	if rows.Next() {
		var orderID string
		var booked int
		if err := rows.Scan(&orderID, &booked); err != nil {
			return fmt.Errorf("read the ledger: %w", err)
		}
		return s.fail("once quiet, %s booked order %s %d times, want once: every consumer of OrderCreated applies it exactly once", simLedgerConsumer, orderID, booked)
	}
	return rows.Err()
}

// loseAMessage makes the broker lose one message it acknowledged that a
// subscriber has not acked yet: half the time, if there is one, a message
// that another subscriber of its subject has acked already, so that the
// loss reaches one consumer's copy while the other has applied it. It
// returns the ids lost.
func (s *simulation) loseAMessage(ctx context.Context) ([]string, error) {
	if s.chance(0.5) {
		lost, err := loseEmbeddedMessagesAckedByOne(ctx, s.direct, 1, s.rng.IntN)
		if err != nil || len(lost) > 0 {
			for _, id := range lost {
				s.report.Counts.LostAfterOneApplied++
				s.tracef("the broker loses %s after one of its subscribers acked it", id)
			}
			return lost, err
		}
	}
	return loseEmbeddedMessages(ctx, s.direct, 1, s.rng.IntN)
}

// loseAfterAnAck sometimes makes the broker lose, just after a subscriber
// acked, a message that one subscriber of its subject has acked and
// another has not: the broker's host crashes at any time, not only as
// something is published.
func (s *simulation) loseAfterAnAck(ctx context.Context) error {
	if s.quiescing || !s.chance(0.05) {
		return nil
	}
	lost, err := loseEmbeddedMessagesAckedByOne(ctx, s.direct, 1, s.rng.IntN)
	if err != nil {
		return fmt.Errorf("lose a message: %w", err)
	}
	for _, id := range lost {
		if b, ok := s.app.broker.(*simBroker); ok {
			b.markLost(id)
		}
		s.report.Counts.LostMessages++
		s.report.Counts.LostAfterOneApplied++
		s.tracef("the broker loses %s, which one of its subscribers acked and another has not", id)
	}
	return nil
}

// simReplayRace is a consumer pass that recorded a message poison, held
// before its ack while the reconciler sweeps and the operator replays.
type simReplayRace struct {
	action              *simAction
	consumer, messageID string
	stage               replayRaceStage
	// away is the pass that runs while the operator is away a week before
	// the fix (once it is started; stepReplayRace).
	away *simAction
}

// replayRaceStage is how far a simReplayRace has come.
type replayRaceStage int

const (
	// raceRejected: the consumer's apply rejected the message; its batch
	// has not committed yet.
	raceRejected replayRaceStage = iota
	// raceHeld: the poison record is committed, the ack not sent.
	raceHeld
	// raceSwept: the reconciler has swept.
	raceSwept
	// raceReplayed: the operator has replayed it; the held pass wakes up
	// next.
	raceReplayed
)

// releasedWithABug returns c with an apply that, now and then, rejects a
// message as invalid, as a release of the consumer with a bug would: the
// inbox records it poison at once. At most one such message is in play at
// a time.
func (s *simulation) releasedWithABug(c consumer) consumer {
	apply := c.apply
	c.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		if s.replayRace != nil || s.quiescing || s.current == nil || !s.chance(0.05) {
			return apply(ctx, tx, msg)
		}
		s.replayRace = &simReplayRace{action: s.current, consumer: c.name, messageID: msg.ID}
		s.countOwnFailure()
		s.tracef("%s, a release with a bug, rejects %s as invalid", c.name, msg.ID)
		return permanent(errors.New("the message fails validation (a bug of the consumer's release, simulated)"))
	}
	return c
}

// holdBeforeAck is the fault hook's part of the structure: the pass that
// recorded the rejected message poison is held after its commit, before
// its ack. It reports whether it held action (which must then wait).
func (s *simulation) holdBeforeAck(ctx context.Context, action *simAction, point faultPoint) bool {
	r := s.replayRace
	if r == nil || r.action != action || r.stage != raceRejected || point != faultAfterEffect {
		return false
	}
	var status string
	err := s.direct.QueryRowContext(ctx, `SELECT status FROM inbox_messages WHERE consumer = ? AND message_id = ?`,
		r.consumer, r.messageID).Scan(&status)
	if err != nil || status != string(inboxPoison) {
		// Applied by another delivery first: nothing to replay.
		s.replayRace = nil
		return false
	}
	r.stage = raceHeld
	s.tracef("a%d %s recorded %s poison for %s and stalls before its ack", action.id, action.process.name, r.messageID, r.consumer)
	return true
}

// stepReplayRace moves the structure on, one stage a step: the relay's
// reconciler sweeps; the operator replays every poison message; the held
// pass wakes up and acks. It reports whether it did something this step.
func (s *simulation) stepReplayRace(ctx context.Context) (bool, error) {
	r := s.replayRace
	if r == nil {
		return false, nil
	}
	if !containsAction(s.actions, r.action) || r.action.crashed {
		// Its batch rolled back, or its process crashed: its delivery
		// comes again, an ordinary run from here on.
		s.replayRace = nil
		return false, nil
	}
	switch r.stage {
	case raceRejected:
		return false, nil
	case raceHeld:
		r.stage = raceSwept
		d := time.Duration(1+s.rng.IntN(5)) * time.Second
		s.clock.advance(d)
		process := pick(s, s.processes[2:4])
		action := &simAction{process: process}
		s.report.Counts.WorkerPasses++
		s.tracef("clock +%s: the reconciler sweeps while a%d still holds %s", d, r.action.id, r.messageID)
		return true, s.reconcilePass(ctx, action)
	case raceSwept:
		if r.away == nil && s.chance(1.0/3) {
			return true, s.operatorAway(ctx, r)
		}
		if r.away != nil && containsAction(s.actions, r.away) {
			return false, nil
		}
		r.stage = raceReplayed
		s.report.Counts.PoisonReplayedBeforeAck++
		s.report.Counts.Repairs.Runs++
		action := &simAction{process: simOperatorProcess, what: string(repairInboxReplay)}
		s.tracef("the fix of %s is deployed; the operator replays its poison messages while a%d holds %s", r.consumer, r.action.id, r.messageID)
		return true, s.start(ctx, action, func(ctx context.Context) {
			targets, err := s.runRepair(ctx, repairInboxReplay)
			s.report.Counts.Repairs.Repaired += len(targets)
			action.result = fmt.Sprintf("%d repaired %v", len(targets), targets)
			action.err = err
		})
	case raceReplayed:
		s.replayRace = nil
		s.tracef("a%d %s wakes up and acks what it fetched before the replay", r.action.id, r.action.process.name)
		return true, s.resume(ctx, r.action)
	default:
		return false, fmt.Errorf("bug: unhandled replay race stage %d", r.stage)
	}
}

// operatorAway starts r's week without an operator: the other consumers
// apply what is due (the message too, if they had not), a week and an
// hour pass, and cleanup runs, which deletes their inbox rows of it. The
// replay that follows, when it reaches every consumer (replayToEvery),
// then reaches one that no longer remembers the message.
func (s *simulation) operatorAway(ctx context.Context, r *simReplayRace) error {
	process := pick(s, s.processes[2:4])
	r.away = &simAction{process: process, what: "runWorkersOnce, then cleanupOnce a week later"}
	s.report.Counts.WorkerPasses++
	if s.poisonRun != nil {
		// Its pass of the consumers may fail the message that one fails
		// at every delivery, and the simulator does not see it.
		s.poisonRun.unseen = true
	}
	s.tracef("the operator is away a week before the fix of %s while a%d holds %s", r.consumer, r.action.id, r.messageID)
	return s.start(ctx, r.away, func(ctx context.Context) {
		if _, err := s.app.runWorkersOnce(ctx, process.name); err != nil {
			r.away.err = err
			return
		}
		s.clock.advance(messageRetention + time.Hour)
		s.report.Counts.ClockJumps++
		result, err := s.app.cleanupOnce(ctx)
		r.away.result = workerResult(result.InboxMessages, "inbox rows deleted", err)
		r.away.err = err
	})
}

// replayToEvery delivers a replayed msg, in the replay's tx, to every
// consumer of its subject besides subscriber, as JetStream delivers the
// new message its replay publishes. Most of them applied it long ago and
// their inbox skips it; one whose inbox row cleanup deleted (a week after
// it applied the message: the operator replays what waited that long)
// meets it as new, and must still apply it only once: the payment service
// finds the saga that message started (sagaAlreadyStarted), the ledger the
// booking it made (bookOrder).
func (b *simBroker) replayToEvery(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error {
	for _, c := range b.s.app.consumers() {
		if c.name == subscriber || !subscribes(c, msg.Subject) {
			continue
		}
		// Forgotten: no inbox row, and the event is older than what
		// cleanup keeps (one that is not has not reached c yet).
		var forgotten bool
		if err := tx.QueryRowContext(ctx, `
			SELECT NOT EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = ? AND message_id = ?)
			   AND EXISTS (SELECT 1 FROM outbox_events WHERE event_id = ? AND created_at <= ?)`,
			c.name, msg.ID, msg.ID, formatTime(b.s.clock.now().Add(-messageRetention))).Scan(&forgotten); err != nil {
			return fmt.Errorf("read the inbox of %s: %w", c.name, err)
		}
		if err := b.messageBroker.replay(ctx, tx, c.name, msg, replayID); err != nil {
			return err
		}
		b.s.report.Counts.ReplaysToEvery++
		if forgotten {
			b.s.report.Counts.ReplaysForgotten++
			b.s.tracef("the replay of %s reaches %s too, whose inbox no longer remembers it", msg.ID, c.name)
		}
	}
	return nil
}

// loseTheReplay sometimes makes the broker lose, in the replay's tx, the
// delivery to subscriber that an operator's replay just queued: a broker
// loses what it acknowledged, a replay as well as a first publish. The
// replay puts the event back in flight, so the reconciler publishes it
// again once the delivery bound has passed; a replay that left it counted
// as delivered would never reach subscriber.
func (s *simulation) loseTheReplay(ctx context.Context, tx *sql.Tx, subscriber string, msg message) error {
	if s.quiescing || !s.chance(0.25) {
		return nil
	}
	_, err := tx.ExecContext(ctx, `
		DELETE FROM broker_deliveries
		WHERE subscriber = ? AND message_seq = (SELECT seq FROM broker_messages WHERE message_id = ?)`,
		subscriber, msg.ID)
	if err != nil {
		return fmt.Errorf("lose the replay of %s: %w", msg.ID, err)
	}
	if b, ok := s.app.broker.(*simBroker); ok {
		// Lost, cleanup may delete the broker's copy once no delivery of
		// it is left: the reconciler publishes it again from the outbox.
		b.markLost(msg.ID)
	}
	s.report.Counts.ReplaysLost++
	s.tracef("the broker loses the replay of %s to %s", msg.ID, subscriber)
	return nil
}
