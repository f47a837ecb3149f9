// The operator in the simulator: what the four layers set aside (a failed
// outbox event, a poison message, a compensation_failed saga, a refund the
// completer gave up on) is brought back by a repair, and a repair runs
// among everything else: while the worker that set the row aside waits at
// a fault point with a stale claim, just after it crashed, while the
// database is out. Without it the simulator never called a repair, and a
// repair that did its work twice, or undid a live worker's, went unseen.
//
// Things get set aside because a dependency breaks for a stretch of steps
// (the broker refuses publishes, a consumer's own code fails, the stock
// service is down, the processor's answers are lost), as they would in
// production; the operator then repairs whatever it finds. An operator
// whose repair was killed after its commit runs it again: the second run
// must find nothing the first one repaired. Once the run is made quiet
// the operator repairs until nothing is set aside, and the full check
// then says that no repair's effect happened twice.

package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// simRepairCounts are what the operator did in a run.
type simRepairCounts struct {
	// Breaks counts the stretches in which a dependency was broken.
	Breaks int
	// Runs counts repairs run; Repaired the rows they repaired; Again the
	// repairs run a second time, as after a kill that hid the first's
	// answer; Cut those cut off by an outage.
	Runs, Repaired, Again, Cut int
}

// add adds other's counts to c.
func (c *simRepairCounts) add(other simRepairCounts) {
	c.Breaks += other.Breaks
	c.Runs += other.Runs
	c.Repaired += other.Repaired
	c.Again += other.Again
	c.Cut += other.Cut
}

// String is the summary line's part.
func (c simRepairCounts) String() string {
	return fmt.Sprintf("%d repairs (%d rows repaired, %d run again after a lost answer, %d cut off by an outage; %d dependencies broken for a while)",
		c.Runs, c.Repaired, c.Again, c.Cut, c.Breaks)
}

// simOperator is the operator's side of a run: the dependency that is
// broken now, if any (the fault point where it fails), and until which
// step.
type simOperator struct {
	broken faultPoint
	until  int
	// brokePublish is set once the broker has refused publishes.
	brokePublish bool
	// setAside is what was set aside for an operator at the last step
	// (see checkSetAside), by repair target.
	setAside map[string]repairAction
}

// simOperatorProcess runs the repairs. The simulator's crashes pick among
// the services; a repair is cut short by a crash inside its transaction or
// an outage, like any action.
var simOperatorProcess = &simProcess{name: "operator", kind: "operator"}

// brokenDependencies are the fault points where a broken dependency
// fails, each with what is broken.
var brokenDependencies = []struct {
	point faultPoint
	what  string
}{
	{faultPublish, "the broker refuses every publish"},
	{faultConsumerApply, "the consumers' own code fails"},
	{faultAfterStepEffect, "the stock service is down"},
	{faultProcessorLoseResponse, "the processor's answers are lost"},
}

// brokenDependency is called by the fault hook: while a dependency is
// broken, its point fails with an ordinary error, so that what reaches it
// is retried until it is set aside.
func (s *simulation) brokenDependency(point faultPoint) error {
	if s.operator.broken == "" || s.operator.broken != point {
		return nil
	}
	if s.step >= s.operator.until {
		s.operator.broken = ""
		s.tracef("the dependency behind %s works again", point)
		return nil
	}
	return fmt.Errorf("a broken dependency at %s", point)
}

// operatorPass breaks a dependency for a while (when none is), or has the
// operator run one repair on whatever is set aside.
func (s *simulation) operatorPass(ctx context.Context) error {
	if s.operator.broken == "" && s.chance(0.5) {
		broken := pick(s, brokenDependencies)
		s.operator.broken = broken.point
		s.operator.brokePublish = s.operator.brokePublish || broken.point == faultPublish
		s.operator.until = s.step + 60 + s.rng.IntN(200)
		s.report.Counts.Repairs.Breaks++
		s.tracef("%s until step %d", broken.what, s.operator.until)
		return nil
	}
	if s.operator.broken != "" {
		// Minutes pass before an operator looks: the retries of what the
		// broken dependency fails run out of attempts meanwhile (ten
		// publishes take minutes of backoff).
		d := time.Duration(2+s.rng.IntN(9)) * time.Minute
		s.clock.advance(d)
		s.report.Counts.ClockJumps++
		s.tracef("clock +%s while it stays broken", d)
	}
	repair := pick(s, []repairAction{repairOutboxRetry, repairInboxReplay, repairSagaResume, repairRefundFinish})
	again := s.chance(0.3)
	action := &simAction{process: simOperatorProcess, what: string(repair)}
	s.report.Counts.Repairs.Runs++
	return s.start(ctx, action, func(ctx context.Context) {
		targets, err := s.runRepair(ctx, repair)
		if err == nil && again {
			// The operator's terminal died after the commit, before the
			// answer: the operator runs it again. What the first run
			// repaired must not be repaired twice.
			s.report.Counts.Repairs.Again++
			var twice []string
			twice, err = s.runRepair(ctx, repair)
			for _, target := range twice {
				if slices.Contains(targets, target) {
					err = fmt.Errorf("%s repaired %s twice", repair, target)
				}
			}
			targets = append(targets, twice...)
		}
		if action.sawOutage {
			s.report.Counts.Repairs.Cut++
		}
		s.report.Counts.Repairs.Repaired += len(targets)
		action.result = fmt.Sprintf("%d repaired %v", len(targets), targets)
		action.err = err
	})
}

// runRepair runs one repair on everything of its kind that is set aside,
// as an operator would, and returns what it repaired. Finding nothing to
// repair is not an error.
func (s *simulation) runRepair(ctx context.Context, repair repairAction) ([]string, error) {
	const operator = "sim-operator"
	var results []repairResult
	var errs []error
	switch repair {
	case repairOutboxRetry:
		found, err := s.app.retryOutboxEvents(ctx, operator, outboxRetryTarget{AllFailed: true})
		results, errs = append(results, found...), append(errs, err)
	case repairInboxReplay:
		for _, c := range s.app.consumers() {
			replayedAt := s.clock.now()
			found, err := s.app.replayInboxMessages(ctx, operator, inboxReplayTarget{Consumer: c.name, AllPoison: true})
			if err == nil {
				// Right after its commit: the replayed events are back in
				// flight (simulate_poison.go).
				if err := s.checkReplayedInFlight(ctx, found, replayedAt); err != nil {
					s.violate(err)
				}
			}
			results, errs = append(results, found...), append(errs, err)
		}
	case repairSagaResume:
		parked, err := listSagas(ctx, s.app.db, sagaCompensationFailed)
		errs = append(errs, err)
		for _, saga := range parked {
			result, err := s.app.resumeSaga(ctx, operator, saga.SagaID)
			if err == nil {
				results = append(results, result)
			}
			errs = append(errs, err)
		}
	case repairRefundFinish:
		found, err := s.app.finishRefunds(ctx, operator)
		for _, result := range found {
			// A key it left to a request that took it over meanwhile is
			// not repaired: a second run may finish it.
			if !result.Failed && s.keyFinished(ctx, result.Target) {
				results = append(results, result)
			}
		}
		errs = append(errs, err)
	default:
		return nil, fmt.Errorf("bug: unhandled repair %q", repair)
	}
	var targets []string
	for _, result := range results {
		targets = append(targets, result.Target)
	}
	for _, err := range errs {
		if err != nil && !errors.Is(err, errRepairRefused) && !errors.Is(err, errRepairNotFound) {
			return targets, err
		}
	}
	return targets, nil
}

// keyFinished reports whether the refund key target ("user/key") is
// finished, read from the handle no fault reaches.
func (s *simulation) keyFinished(ctx context.Context, target string) bool {
	user, key, _ := strings.Cut(target, "/")
	var finished bool
	err := s.direct.QueryRowContext(ctx, `
		SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE user_id = ? AND idempotency_key = ? AND recovery_point = 'finished')`,
		user, key).Scan(&finished)
	return err == nil && finished
}

// withoutSetAside returns violations without those that name an outbox
// event failed after all its attempts, once the broker has refused
// publishes for a stretch: check --in-flight lists it for the operator,
// whose repair is still to come. (Its last attempt may have failed for an
// outage instead.) One failed after fewer attempts stays a violation.
func (s *simulation) withoutSetAside(violations []violation) []violation {
	var kept []violation
	for _, v := range violations {
		if v.Invariant == failedEventsInvariant && s.operator.brokePublish &&
			strings.Contains(v.Detail, fmt.Sprintf(" failed after %d attempts ", maxPublishAttempts)) {
			continue
		}
		kept = append(kept, v)
	}
	return kept
}

// repairWhileQuiet runs every repair once, with no faults, while the run
// is made quiet, and reports whether any repaired something.
func (s *simulation) repairWhileQuiet(ctx context.Context) (bool, error) {
	repaired := false
	for _, repair := range []repairAction{repairOutboxRetry, repairInboxReplay, repairSagaResume, repairRefundFinish} {
		targets, err := s.runRepair(ctx, repair)
		if err != nil {
			return false, s.fail("%s while quiet: %v", repair, err)
		}
		if len(targets) > 0 {
			s.report.Counts.Repairs.Runs++
			s.report.Counts.Repairs.Repaired += len(targets)
			s.tracef("quiesce: %s repaired %v", repair, targets)
			repaired = true
		}
	}
	return repaired, nil
}

// setAsideRows reads what is set aside for an operator: poison messages
// (target consumer/message id), events failed after their attempts (event
// id) and sagas whose compensation failed (saga id), each with the repair
// that takes it back.
func (s *simulation) setAsideRows(ctx context.Context) (map[string]repairAction, error) {
	rows, err := s.direct.QueryContext(ctx, `
		SELECT consumer || '/' || message_id, 'inbox' FROM inbox_messages WHERE status = 'poison'
		UNION ALL SELECT event_id, 'outbox' FROM outbox_events WHERE status = 'failed'
		UNION ALL SELECT saga_id, 'saga' FROM saga_instances WHERE status = 'compensation_failed'`)
	if err != nil {
		return nil, fmt.Errorf("read what is set aside: %w", err)
	}
	defer rows.Close()
	repairs := map[string]repairAction{"inbox": repairInboxReplay, "outbox": repairOutboxRetry, "saga": repairSagaResume}
	found := map[string]repairAction{}
	for rows.Next() {
		var target, kind string
		if err := rows.Scan(&target, &kind); err != nil {
			return nil, fmt.Errorf("read what is set aside: %w", err)
		}
		found[target] = repairs[kind]
	}
	return found, rows.Err()
}

// checkSetAside fails the run if something set aside for an operator at
// the last step is gone without the operator's repair: it may leave that
// state only through the repair (which logs it), never by cleanup or any
// other code path, or its message, event or refund is lost for good with
// nothing left to show it.
func (s *simulation) checkSetAside(ctx context.Context) error {
	now, err := s.setAsideRows(ctx)
	if err != nil {
		return err
	}
	for target, repair := range s.operator.setAside {
		if _, ok := now[target]; ok {
			continue
		}
		var repaired bool
		err := s.direct.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM repair_log WHERE action = ? AND target = ?)`,
			string(repair), target).Scan(&repaired)
		if err != nil {
			return fmt.Errorf("read the repair log: %w", err)
		}
		if !repaired {
			return s.fail("%s was set aside for an operator's %s, and is gone without one", target, repair)
		}
	}
	s.operator.setAside = now
	return nil
}
