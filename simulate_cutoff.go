// A structure of the simulator around a saga's retries: the saga workers
// cut off from the processor until their sagas have failed as often as a
// compensation may.
//
// A saga step that fails for a moment (a timeout) is tried again after a
// backoff, as often as it takes while the saga goes forward; only a
// compensation gives up, after maxCompensationAttempts failures, and waits
// for an operator (retryAfter). A compensating refund that timed out was
// not made: the charge counts as undone only once the processor has
// answered. Left to chance, neither was ever put to the test: most sagas
// move on in the calm catch-ups, where nothing fails, so a saga pass that
// could fail met a compensating refund about once in a hundred runs, and
// one saga failed five times in a row more rarely still. So now and then,
// as a saga pass is about to call the processor (always when one of its
// sagas is undoing a charge), the saga workers lose their way to it: every
// charge and refund they ask for is lost before the processor sees it. At
// each step the structure runs a saga pass, the clock past the backoff of
// the sagas it began with, until each of them has failed
// maxCompensationAttempts times in a row or has ended, or cutOffSteps steps
// have passed; then the way is back.
//
// The oracles are those that stand already: a saga going forward is still
// in progress after those failures, its status agreeing with its steps
// (check's invariants after every step); a compensation that gave up is
// parked with its charge not undone, and the operator's resume, once the
// run is quiet, refunds it; a cancelled order holds no money at the
// processor (the final check).

package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// simCutOffCounts count the structure of this file.
type simCutOffCounts struct {
	// CutOffs counts the stretches the saga workers could not reach the
	// processor; CutOffCalls the charges and refunds lost in them;
	// SagasWornOut the sagas that failed maxCompensationAttempts times in
	// a row during one, CompensationsCutOff those among them undoing a
	// charge.
	CutOffs, CutOffCalls, SagasWornOut, CompensationsCutOff int
}

// add adds other's counts to c.
func (c *simCutOffCounts) add(other simCutOffCounts) {
	c.CutOffs += other.CutOffs
	c.CutOffCalls += other.CutOffCalls
	c.SagasWornOut += other.SagasWornOut
	c.CompensationsCutOff += other.CompensationsCutOff
}

// String is the summary line's part.
func (c simCutOffCounts) String() string {
	return fmt.Sprintf("%d times the saga workers lost their way to the processor (%d calls lost; %d sagas failed %d times in a row, %d of them undoing a charge)",
		c.CutOffs, c.CutOffCalls, c.SagasWornOut, maxCompensationAttempts, c.CompensationsCutOff)
}

// simCutOff is a stretch in which the saga workers cannot reach the
// processor: the sagas its first pass held, and the pass it runs.
type simCutOff struct {
	sagas []string
	// compensating holds the sagas that were undoing a charge.
	compensating map[string]bool
	// wornOut holds the sagas counted as failed
	// maxCompensationAttempts times.
	wornOut map[string]bool
	pass    *simAction
	until   int
}

// cutOffChance is the chance that the saga workers lose their way to the
// processor as a pass of sagas going forward is about to call it.
const cutOffChance = 0.3

// cutOffSteps is the most steps a stretch lasts: room for a saga pass at
// each, maxCompensationAttempts of them, and the others that run between.
const cutOffSteps = 40

// cutOff is the fault hook's part: at a saga pass's call to the processor,
// it begins a stretch now and then, always when one of the pass's sagas is
// undoing a charge; and while a stretch lasts, it loses every charge and
// refund a saga pass asks for.
func (s *simulation) cutOff(ctx context.Context, action *simAction, point faultPoint) error {
	if action.what != "sagaOnce" || s.quiescing {
		return nil
	}
	if point == faultBeforeProcessorCall && s.cutOffState == nil {
		return s.beginCutOff(ctx, action)
	}
	if point != faultProcessorLoseRequest || s.cutOffState == nil {
		return nil
	}
	s.report.Counts.CutOffCalls++
	action.processorTimedOut = true
	s.tracef("a%d %s: the processor cannot be reached from the saga workers", action.id, action.process.name)
	return errors.New("no route to host")
}

// beginCutOff begins a stretch with the sagas action's process holds,
// if the dice say so or one of them is undoing a charge (only then in the
// last pass of a stretch, whose charges are to go through).
func (s *simulation) beginCutOff(ctx context.Context, action *simAction) error {
	cut, err := s.sagasWhere(ctx, `locked_by = ? AND status IN ('in_progress', 'compensating')`, action.process.name)
	if err != nil || len(cut.sagas) == 0 {
		return err
	}
	if len(cut.compensating) == 0 && (action == s.refuseConfirmIn || !s.chance(cutOffChance)) {
		return err
	}
	s.beganCutOff(cut, fmt.Sprintf("a%d %s: ", action.id, action.process.name))
	return nil
}

// sagasWhere returns a stretch with the sagas that where picks (with
// args), those compensating marked so.
func (s *simulation) sagasWhere(ctx context.Context, where string, args ...any) (*simCutOff, error) {
	rows, err := s.direct.QueryContext(ctx, `
		SELECT saga_id, status FROM saga_instances WHERE `+where+` ORDER BY saga_id`, args...)
	if err != nil {
		return nil, fmt.Errorf("the sagas to cut off: %w", err)
	}
	defer rows.Close()
	cut := &simCutOff{compensating: map[string]bool{}, wornOut: map[string]bool{}, until: s.step + cutOffSteps}
	for rows.Next() {
		var sagaID string
		var status sagaStatus
		if err := rows.Scan(&sagaID, &status); err != nil {
			return nil, fmt.Errorf("the sagas to cut off: %w", err)
		}
		cut.sagas = append(cut.sagas, sagaID)
		if status == sagaCompensating {
			cut.compensating[sagaID] = true
		}
	}
	return cut, rows.Err()
}

// cutOffCompensation begins a stretch with the sagas that are undoing a
// charge, if there are any.
func (s *simulation) cutOffCompensation(ctx context.Context) error {
	if s.quiescing {
		return nil
	}
	rows, err := s.direct.QueryContext(ctx, `
		SELECT i.saga_id FROM saga_instances i
		JOIN saga_steps st ON st.saga_id = i.saga_id AND st.step_name = ? AND st.status = 'done'
		WHERE i.status = ?
		ORDER BY i.saga_id`, stepChargeCard, sagaCompensating)
	if err != nil {
		return s.fail("the sagas undoing a charge: %v", err)
	}
	defer rows.Close()
	cut := &simCutOff{compensating: map[string]bool{}, wornOut: map[string]bool{}, until: s.step + cutOffSteps}
	for rows.Next() {
		var sagaID string
		if err := rows.Scan(&sagaID); err != nil {
			return s.fail("the sagas undoing a charge: %v", err)
		}
		cut.sagas = append(cut.sagas, sagaID)
		cut.compensating[sagaID] = true
	}
	if err := rows.Err(); err != nil {
		return s.fail("the sagas undoing a charge: %v", err)
	}
	if len(cut.sagas) > 0 {
		s.beganCutOff(cut, "")
	}
	return nil
}

// sagasAtConfirm returns a stretch with the sagas at confirm that action,
// a saga pass, holds: their cards are charged, and a refusal undoes that.
func (s *simulation) sagasAtConfirm(ctx context.Context, action *simAction) (*simCutOff, error) {
	if action.what != "sagaOnce" {
		return &simCutOff{}, nil
	}
	cut, err := s.sagasWhere(ctx, `locked_by = ? AND status = 'in_progress' AND current_step = ?`, action.process.name, stepConfirm)
	if err != nil {
		return nil, err
	}
	for _, sagaID := range cut.sagas {
		cut.compensating[sagaID] = true
	}
	return cut, nil
}

// beganCutOff makes cut the running stretch.
func (s *simulation) beganCutOff(cut *simCutOff, by string) {
	s.cutOffState = cut
	s.report.Counts.CutOffs++
	s.tracef("%sthe saga workers lose their way to the processor until step %d (sagas %s)",
		by, cut.until, strings.Join(cut.sagas, ", "))
}

// stepCutOff moves the stretch on: it counts the sagas that have failed
// maxCompensationAttempts times, ends the stretch once each of its sagas
// has or has ended (or its steps are up), and otherwise, when its last
// pass is over, moves the clock past their backoff and runs another. The
// stretch over, it runs one last pass for the sagas that still go on,
// which the processor answers: a saga worn out going forward charges the
// card and confirms, and the warehouse refuses that confirm
// (refuseShipment), so that the charge is to be undone, cut off again.
// It reports whether it did something this step.
func (s *simulation) stepCutOff(ctx context.Context) (bool, error) {
	cut := s.cutOffState
	if cut == nil {
		return false, s.cutOffCompensation(ctx)
	}
	if cut.pass != nil && containsAction(s.actions, cut.pass) {
		return false, nil
	}
	cut.pass = nil
	waiting, going := false, false
	var due time.Time
	for _, sagaID := range cut.sagas {
		var status sagaStatus
		var attempts int
		var next string
		var lockedUntil *string
		err := s.direct.QueryRowContext(ctx, `
			SELECT status, attempts, next_attempt_at, locked_until FROM saga_instances WHERE saga_id = ?`,
			sagaID).Scan(&status, &attempts, &next, &lockedUntil)
		if err != nil {
			return true, s.fail("read saga %s cut off from the processor: %v", sagaID, err)
		}
		if attempts >= maxCompensationAttempts && !cut.wornOut[sagaID] {
			cut.wornOut[sagaID] = true
			s.report.Counts.SagasWornOut++
			if cut.compensating[sagaID] {
				s.report.Counts.CompensationsCutOff++
			}
			s.tracef("saga %s has failed %d times in a row, %s", sagaID, attempts, status)
		}
		if status != sagaInProgress && status != sagaCompensating {
			continue
		}
		going = true
		waiting = waiting || !cut.wornOut[sagaID]
		for _, at := range []*string{&next, lockedUntil} {
			if at == nil {
				continue
			}
			t, err := time.Parse(timeFormat, *at)
			if err != nil {
				return true, s.fail("saga %s: %v", sagaID, err)
			}
			if t.After(due) {
				due = t
			}
		}
	}
	if s.quiescing {
		s.cutOffState = nil
		return false, nil
	}
	if !waiting || s.step >= cut.until {
		s.cutOffState = nil
		s.tracef("the saga workers reach the processor again")
		if !going {
			return false, nil
		}
	}
	if now := s.clock.now(); due.After(now) {
		d := due.Sub(now) + time.Millisecond
		s.clock.advance(d)
		s.tracef("clock +%s: past the backoff of the sagas cut off from the processor", d)
	}
	process := pick(s, s.processes[4:])
	action := &simAction{process: process, what: "sagaOnce"}
	cut.pass = action
	if s.cutOffState == nil {
		s.refuseConfirmIn = action
	}
	s.report.Counts.WorkerPasses++
	return true, s.start(ctx, action, func(ctx context.Context) {
		n, err := s.app.sagaOnce(ctx, process.name, 2)
		action.result = workerResult(n, "sagas run", err)
		action.err = err
	})
}
