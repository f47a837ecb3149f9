// A saga worker frozen past its lease, in the simulator.
//
// A process can stop for longer than any lease without crashing: a long
// garbage-collection pause, a virtual machine migrated, a laptop lid shut
// (Kleppmann, "How to do distributed locking"). A saga worker frozen in
// the middle of its sagas, between two steps, still believes it holds
// them; the clock passes its lease, another worker claims the same sagas
// and moves them on; then the frozen one wakes up and carries on from
// where it stopped, with what it read before. Each of its writes must
// carry its claim and change nothing once the claim is gone (STYLE.md,
// rule 13).
//
// Left to chance, a held pass is rarely resumed after another has taken
// its sagas over: the lease must pass while it waits, another sagaOnce
// must claim the very sagas it holds, and then it must be resumed before
// it crashes. This builds that sequence on purpose.

package main

import (
	"context"
	"time"
)

// simFrozen is a saga worker pass frozen at a fault point, until another
// worker has taken its sagas over (tookOver) and then it wakes up.
type simFrozen struct {
	action   *simAction
	tookOver bool
}

// freezeSagaWorker is the fault hook's part of the structure: sometimes a
// saga pass that reaches a point between two steps is frozen there. It
// reports whether it froze action (which must then wait).
func (s *simulation) freezeSagaWorker(action *simAction, point faultPoint) bool {
	if s.frozen != nil || action.what != "sagaOnce" || s.quiescing || action == s.refuseConfirmIn {
		return false
	}
	switch point {
	case faultBeforeStep, faultBeforeProcessorCall, faultAfterProcessorCall, faultMidCompensation:
	default:
		return false
	}
	if !s.chance(0.3) {
		return false
	}
	s.frozen = &simFrozen{action: action}
	s.report.Counts.FrozenSagaWorkers++
	s.tracef("a%d %s freezes at %s, its sagas still claimed", action.id, action.process.name, point)
	return true
}

// frozenWorkerStep moves the structure on, one stage a step: first the
// clock passes the frozen worker's lease and another worker runs a saga
// pass, which may take its sagas over; at a later step the frozen one
// wakes up. It reports whether it did something this step.
func (s *simulation) frozenWorkerStep(ctx context.Context) (bool, error) {
	f := s.frozen
	if f == nil {
		return false, nil
	}
	if !containsAction(s.actions, f.action) || f.action.crashed {
		// Its process crashed meanwhile: nothing is left to wake up.
		s.frozen = nil
		return false, nil
	}
	if !f.tookOver {
		f.tookOver = true
		d := s.app.leases.saga + time.Duration(1+s.rng.IntN(30))*time.Second
		s.clock.advance(d)
		s.report.Counts.ClockJumps++
		s.tracef("clock +%s: a%d %s is still frozen, past its lease", d, f.action.id, f.action.process.name)
		process := s.processes[4]
		if process == f.action.process {
			process = s.processes[5]
		}
		action := &simAction{process: process, what: "sagaOnce"}
		s.report.Counts.WorkerPasses++
		return true, s.start(ctx, action, func(ctx context.Context) {
			n, err := s.app.sagaOnce(ctx, process.name, 2)
			action.result = workerResult(n, "sagas run", err)
			action.err = err
		})
	}
	s.frozen = nil
	s.tracef("a%d %s wakes up", f.action.id, f.action.process.name)
	return true, s.resume(ctx, f.action)
}

// containsAction reports whether actions holds action.
func containsAction(actions []*simAction, action *simAction) bool {
	for _, a := range actions {
		if a == action {
			return true
		}
	}
	return false
}
