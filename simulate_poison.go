// Poison messages in the simulator: the failure that makes a message
// poison, and a poison message's place in end-to-end delivery.
//
// The threshold. A consumer gives up on a message when its own code has
// failed on it maxDeliveries times (the inbox's count), and not before:
// one failure less and a message that would have gone through on its
// next delivery is set aside for an operator; one more and a message
// that can never go through is delivered once more than promised. The
// simulator's consumers fail a message now and then, never as often as
// that (consumerFailuresPerMessage), so the threshold was never reached
// but by a dependency broken for a long stretch, whose deliveries the
// simulator does not count. Here a consumer sometimes fails one message
// at every delivery (failingInARow), the structure delivers it again as
// soon as it is due (stepPoisonRun), and the simulator counts, itself, the
// committed passes in which the message failed: the pass that records it
// poison must be exactly the maxDeliveries-th, and none before it
// (judgePoisonRun).
//
// Its place in delivery. An event is delivered when each consumer of its
// subject has received it: applied it, or given up on it as poison, which
// inspect and check report and an operator replays (deliver.go). So the
// reconciler must not publish a poison message again (its consumer would
// only skip the copy), the cursor must pass an event whose every consumer
// has received it, and an operator's replay must put the event back
// in flight, its delivery lag counted from the replay, so that a replay
// the broker loses is published again. Three checks, each at the moment
// it must hold: as the reconciler publishes its copies
// (checkRepublishedUndelivered), after a sweep that ran straight through
// (checkReceivedPassed), and right after a replay commits
// (checkReplayedInFlight).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// simPoisonCounts count the poison structures of a run.
type simPoisonCounts struct {
	// PoisonRuns counts the messages a consumer failed on at every
	// delivery; PoisonAtThreshold those it then recorded poison, at the
	// maxDeliveries-th failure.
	PoisonRuns, PoisonAtThreshold int
	// ReplaysInFlight counts the replays checked to have put their event
	// back in flight; SweepsChecked the reconciler's sweeps whose marks
	// were checked.
	ReplaysInFlight, SweepsChecked int
}

// add adds other's counts to c.
func (c *simPoisonCounts) add(other simPoisonCounts) {
	c.PoisonRuns += other.PoisonRuns
	c.PoisonAtThreshold += other.PoisonAtThreshold
	c.ReplaysInFlight += other.ReplaysInFlight
	c.SweepsChecked += other.SweepsChecked
}

// String is the summary line's part.
func (c simPoisonCounts) String() string {
	return fmt.Sprintf("%d messages failed at every delivery (%d of them poison at the %d-th failure), "+
		"%d replays checked back in flight, %d sweeps of the reconciler checked",
		c.PoisonRuns, c.PoisonAtThreshold, maxDeliveries, c.ReplaysInFlight, c.SweepsChecked)
}

// poisonRunChance is the chance, per message a consumer applies while no
// run is on, that its code starts failing on that message at every
// delivery.
const poisonRunChance = 0.03

// simPoisonRun is one message its consumer fails on at every delivery.
type simPoisonRun struct {
	consumer, messageID string
	// failures counts the committed passes of the consumer in which the
	// message failed, as the simulator saw them.
	failures int
	// pass is the consumer's pass that stepPoisonRun started, while it
	// runs.
	pass *simAction
	// unseen is set once a pass the simulator does not see the results of
	// may have failed the message (a worker pass inside an action, with
	// the App's own consumers): from then on the count is not the
	// simulator's to judge.
	unseen bool
}

// failingInARow returns c with an apply that, now and then, starts to
// fail one message at every delivery, with an ordinary error, before its
// writes: a dependency that fails for that order only. One such message
// at a time, never one the consumer has failed on or received before.
func (s *simulation) failingInARow(c consumer) consumer {
	apply := c.apply
	c.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		run := s.poisonRun
		if run == nil && !s.quiescing && s.chance(poisonRunChance) && s.neverFailed(ctx, c.name, msg.ID) {
			run = &simPoisonRun{consumer: c.name, messageID: msg.ID}
			s.poisonRun = run
			s.report.Counts.PoisonRuns++
			s.tracef("%s starts failing on %s at every delivery", c.name, msg.ID)
		}
		if run == nil || run.consumer != c.name || run.messageID != msg.ID || s.quiescing {
			return apply(ctx, tx, msg)
		}
		s.countOwnFailure()
		return errors.New("the address service fails on this order at every call (simulated)")
	}
	return c
}

// neverFailed reports whether consumerName has neither received messageID
// nor failed on it, as far as the simulator and the inbox know: a run
// counts its failures from the first.
func (s *simulation) neverFailed(ctx context.Context, consumerName, messageID string) bool {
	if s.consumerFailures[consumerName+"/"+messageID] > 0 || (s.replayRace != nil && s.replayRace.messageID == messageID) {
		return false
	}
	var seen bool
	err := s.direct.QueryRowContext(ctx, `
		SELECT EXISTS (SELECT 1 FROM inbox_failures WHERE consumer = ? AND message_id = ?)
		    OR EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = ? AND message_id = ?)`,
		consumerName, messageID, consumerName, messageID).Scan(&seen)
	return err == nil && !seen
}

// judgePoisonRun judges what a committed pass of a consumer, action, did
// with the run's message: the failure that makes it poison is the
// maxDeliveries-th, and no earlier one does. The pass's results are nil
// if its transaction did not commit (nothing of it counts), or if its
// commit landed and the answer was lost: then the simulator cannot tell
// what it counted, and the run is no longer its to judge.
func (s *simulation) judgePoisonRun(action *simAction) error {
	run := s.poisonRun
	if run == nil || run.consumer != action.consumer {
		return nil
	}
	consumerName, results := action.consumer, action.consumed
	if results == nil && action.commitLost {
		run.unseen = true
	}
	for _, result := range results {
		if result.MessageID != run.messageID {
			continue
		}
		if result.Outcome != inboxRetry && result.Outcome != inboxPoison {
			// Applied or skipped by a pass that does not fail it: over.
			s.poisonRun = nil
			return nil
		}
		run.failures++
		switch {
		case run.unseen:
		case result.Outcome == inboxPoison && run.failures != maxDeliveries:
			return s.fail("%s recorded %s poison at the %d-th failure of its own code in a row: it gives up at the %d-th (maxDeliveries), not before",
				consumerName, run.messageID, run.failures, maxDeliveries)
		case result.Outcome == inboxRetry && run.failures >= maxDeliveries:
			return s.fail("%s failed on %s %d times in a row and will deliver it again: it gives up at the %d-th failure (maxDeliveries)",
				consumerName, run.messageID, run.failures, maxDeliveries)
		}
		if result.Outcome == inboxPoison {
			if !run.unseen {
				s.report.Counts.PoisonAtThreshold++
			}
			s.tracef("%s gives up on %s after %d failures in a row", consumerName, run.messageID, run.failures)
			s.poisonRun = nil
		}
	}
	return nil
}

// stepPoisonRun delivers the run's message again as soon as it is due:
// the clock moves to when the broker hands it over, and a pass of its
// consumer runs. Without it a message would wait for a pass of that very
// consumer, about one step in forty, and five failures in a row would
// take longer than a run. It reports whether it started a pass.
func (s *simulation) stepPoisonRun(ctx context.Context) (bool, error) {
	run := s.poisonRun
	if run == nil || s.quiescing {
		return false, nil
	}
	if run.pass != nil && containsAction(s.actions, run.pass) {
		return false, nil
	}
	run.pass = nil
	var due sql.NullString
	err := s.direct.QueryRowContext(ctx, `
		SELECT MIN(d.visible_at) FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq
		WHERE m.message_id = ? AND d.subscriber = ? AND d.status = 'pending'`,
		run.messageID, run.consumer).Scan(&due)
	if err != nil {
		return false, fmt.Errorf("read the delivery of %s: %w", run.messageID, err)
	}
	if !due.Valid {
		// Handed over, or lost; or received at last, by a pass that does
		// not fail it (the workers catching up): then the run is over.
		var received bool
		err := s.direct.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = ? AND message_id = ?)`,
			run.consumer, run.messageID).Scan(&received)
		if err != nil {
			return false, fmt.Errorf("read the inbox of %s: %w", run.consumer, err)
		}
		if received {
			s.poisonRun = nil
		}
		return false, nil
	}
	if !s.chance(0.5) {
		return false, nil
	}
	if at, err := time.Parse(timeFormat, due.String); err == nil && at.After(s.clock.now()) {
		d := at.Sub(s.clock.now()) + time.Millisecond
		s.clock.advance(d)
		s.report.Counts.ClockJumps++
		s.tracef("clock +%s: %s is due to %s again", d, run.messageID, run.consumer)
	}
	for _, c := range s.app.consumers() {
		if c.name == run.consumer {
			process := pick(s, s.processes[4:])
			action := &simAction{process: process}
			s.report.Counts.WorkerPasses++
			run.pass = action
			return true, s.consumePass(ctx, action, c)
		}
	}
	return false, fmt.Errorf("bug: no consumer %s", run.consumer)
}

// subscribersOf returns the names of the App's consumers of subject.
func (s *simulation) subscribersOf(subject string) []string {
	var names []string
	for _, c := range s.app.consumers() {
		if subscribes(c, subject) {
			names = append(names, c.name)
		}
	}
	return names
}

// receivedByEvery reports whether every consumer of subject has an inbox
// row of messageID, applied or poison: it has received the message.
func (s *simulation) receivedByEvery(ctx context.Context, messageID, subject string) (bool, error) {
	for _, name := range s.subscribersOf(subject) {
		var received bool
		err := s.direct.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = ? AND message_id = ?)`,
			name, messageID).Scan(&received)
		if err != nil {
			return false, fmt.Errorf("read the inbox of %s: %w", name, err)
		}
		if !received {
			return false, nil
		}
	}
	return true, nil
}

// checkRepublishedUndelivered fails the run if the reconciler publishes
// again a message every consumer of its subject has received. It is
// called as the copies reach the broker, right after the sweep claimed
// them: nothing else ran in between.
func (s *simulation) checkRepublishedUndelivered(ctx context.Context, msgs []message) error {
	for _, msg := range msgs {
		received, err := s.receivedByEvery(ctx, msg.ID, msg.Subject)
		if err != nil {
			return err
		}
		if received {
			return s.fail("the reconciler published %s (%s) again, which every consumer of its subject has received, "+
				"applied or set aside as poison for an operator: the copy can only be skipped", msg.ID, msg.Subject)
		}
	}
	return nil
}

// checkReceivedPassed fails the run if every event at the first position
// the reconciler's cursor has not passed (a batch's events share one) is
// one that every consumer of its subject has received, though it is below
// horizon, the delivery horizon (dialect.deliveryHorizon) read before the
// sweep began: the sweep's own can only be higher. (Read after the sweep,
// on PostgreSQL, it may be higher than the sweep's: a transaction the
// sweep had to wait for, of another run on the same server, has ended
// since.) It is called after a sweep of the reconciler that ran straight
// through, so its cursor is the last word on the inboxes as they are.
func (s *simulation) checkReceivedPassed(ctx context.Context, horizon int64) error {
	rows, err := s.direct.QueryContext(ctx, `
		SELECT e.event_id, e.event_type FROM outbox_events e
		WHERE e.delivery_position = (SELECT MIN(delivery_position) FROM outbox_events WHERE delivery_position >= `+deliveryCursor+`)
		  AND e.delivery_position < ?`, horizon)
	if err != nil {
		return fmt.Errorf("read the first events in flight: %w", err)
	}
	type event struct{ id, subject string }
	var first []event
	for rows.Next() {
		var e event
		if err := rows.Scan(&e.id, &e.subject); err != nil {
			rows.Close()
			return fmt.Errorf("read the first events in flight: %w", err)
		}
		first = append(first, e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the first events in flight: %w", err)
	}
	s.report.Counts.SweepsChecked++
	for _, e := range first {
		received, err := s.receivedByEvery(ctx, e.id, e.subject)
		if err != nil || !received {
			return err
		}
	}
	if len(first) > 0 {
		return s.fail("after the reconciler's sweep, its cursor stops at %s (%s) and the events published with it, though every consumer "+
			"of their subjects has received them, applied or set aside as poison", first[0].id, first[0].subject)
	}
	return nil
}

// checkReplayedInFlight fails the run unless each message an operator's
// replay just committed (results, made at replayedAt or later) has its
// event back in flight, its delivery lag counted from the replay: a
// replay the broker loses must be published again by the reconciler. An
// event the outbox no longer holds (cleanup deleted it, and the replay
// came from the broker's copy) is left out.
func (s *simulation) checkReplayedInFlight(ctx context.Context, results []repairResult, replayedAt time.Time) error {
	for _, result := range results {
		consumerName, messageID, _ := strings.Cut(result.Target, "/")
		var inFlight sql.NullBool
		var publishedAt string
		err := s.direct.QueryRowContext(ctx, `SELECT delivery_position >= `+deliveryCursor+`, published_at FROM outbox_events WHERE event_id = ?`,
			messageID).Scan(&inFlight, &publishedAt)
		if errors.Is(err, sql.ErrNoRows) {
			continue
		}
		if err != nil {
			return fmt.Errorf("read the replayed event %s: %w", messageID, err)
		}
		if !inFlight.Bool || publishedAt < formatTime(replayedAt) {
			return s.fail("the operator replayed %s for %s, and its event is not back in flight from the replay "+
				"(the reconciler's cursor has passed it: %v, published at %s): a replay the broker loses would never be published again",
				messageID, consumerName, !inFlight.Bool, publishedAt)
		}
		s.report.Counts.ReplaysInFlight++
	}
	return nil
}
