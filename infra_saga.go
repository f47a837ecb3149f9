// The saga engine: how the decisions and steps of saga.go are applied to
// many sagas at once, by several workers, safely. A first reading can skip
// it. It claims due sagas under a lease (sagaOnce) and fences every write
// with the lease's token (fenceSaga: a lease is not a lock, and a worker
// paused past it must not write). It advances the claimed sagas together,
// in rounds: a round makes its card charges outside any transaction, then
// runs every saga's step in one transaction with a savepoint per saga, so
// a round costs one commit, not one per saga. A compensating saga, the rare
// path, runs compensate on its own: one transaction per undone step.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// sagaBackoff is how long a saga waits after its attempts-th transient
// failure: 1s, 2s, 4s ... at most a minute.
func sagaBackoff(attempts int) time.Duration {
	return min(time.Second<<min(attempts-1, 6), time.Minute)
}

// sagaOnce claims up to max runnable sagas under a lease and advances them
// together, in rounds, each as far as it can go now. A saga is runnable
// when it is in progress or compensating, due, and not leased to a live
// worker; so this is also the recovery pass: a saga whose worker died is
// resumed, forward or backward, once its lease passes. It returns how many
// sagas it ran.
//
// A round takes every claimed saga one step: the card calls of the round
// first, outside any transaction (sagaCalls), then every saga's local step,
// or the record of its call, in one transaction with a savepoint per saga
// (sagaStepIn). One commit per round, not one per saga and step. A
// compensating saga runs compensate, to its end, in its round.
func (a *App) sagaOnce(ctx context.Context, workerID string, max int) (int, error) {
	var leases []sagaClaim
	err := withClaimTx(ctx, a.db, func(tx *sql.Tx) error {
		leases = nil
		now := a.now()
		// lease_token + 1: the claim's fencing token (see sagaClaim).
		rows, err := tx.QueryContext(ctx, `
			UPDATE saga_instances SET locked_by = ?, locked_until = ?, lease_token = lease_token + 1
			WHERE saga_id IN (
				SELECT saga_id FROM saga_instances
				WHERE status IN ('in_progress', 'compensating')
				  AND next_attempt_at <= ?
				  AND (locked_until IS NULL OR locked_until <= ?)
				ORDER BY next_attempt_at
				LIMIT ? `+skipLocked(a.db)+`)
			RETURNING saga_id, lease_token`,
			workerID, formatTime(now.Add(a.leases.saga)), formatTime(now), formatTime(now), max)
		if err != nil {
			return fmt.Errorf("claim sagas: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			lease := sagaClaim{WorkerID: workerID}
			if err := rows.Scan(&lease.SagaID, &lease.Token); err != nil {
				return fmt.Errorf("scan saga id: %w", err)
			}
			leases = append(leases, lease)
		}
		return rows.Err()
	})
	if err != nil {
		return 0, err
	}
	// RETURNING gives no order; run them in the order claimed, so that a
	// pass is the same every time (the simulator replays it from a seed).
	sort.Slice(leases, func(i, j int) bool { return leases[i].SagaID < leases[j].SagaID })
	runs := make([]*sagaRun, len(leases))
	for i, lease := range leases {
		runs[i] = &sagaRun{lease: lease}
	}
	var failures []error
	for len(runs) > 0 {
		runs, err = a.sagaRound(ctx, runs, &failures)
		if err != nil {
			return 0, errors.Join(append(failures, err)...)
		}
	}
	return len(leases), errors.Join(failures...)
}

// sagaRun is one claimed saga while sagaOnce advances it: what the worker
// read of it this round, and what the processor answered.
type sagaRun struct {
	lease sagaClaim
	saga  sagaRow
	steps []sagaStepRow
	// order is read once: what the saga uses of it (items, amount,
	// payment method) never changes.
	order orderRow
	// action is what the saga does this round (nextSagaAction).
	action sagaAction
	// step is the step this round runs (in progress) or undoes
	// (compensating); stepOK is false when there is none.
	step   sagaStepRow
	stepOK bool
	// unexpected is set when the saga cannot go on at all (a bug, a
	// broken row): it is set aside.
	unexpected error
	// called: the processor was called for step this round; chargeID and
	// callErr are its answer, recorded by chargeCardStep in the round's
	// transaction.
	called   bool
	chargeID string
	callErr  error
	// renewed: the last round's commit recorded a step of this saga, and
	// renewed its lease with it (fenceSaga).
	renewed bool
	// span is the span of what this round does to the saga (tracing.go).
	span trace.Span
}

// sagaNext says what becomes of a saga after its step in a round.
type sagaNext int

const (
	// sagaAgain: the saga goes on in the next round, read afresh.
	sagaAgain sagaNext = iota
	// sagaStepDone: a forward step is recorded, and the lease renewed with
	// it; the saga goes on.
	sagaStepDone
	// sagaCompensatedStep: one compensation is recorded; the saga goes on.
	sagaCompensatedStep
	// sagaLeft: the saga is terminal, waits for a retry, or is another
	// worker's now; this pass is done with it.
	sagaLeft
	// sagaWroteEvent: like sagaLeft, and the step's transaction wrote an
	// event to the outbox (PaymentCaptured, OrderCancelled).
	sagaWroteEvent
)

// String names what became of a saga after its step, for the log.
func (n sagaNext) String() string {
	switch n {
	case sagaAgain:
		return "again"
	case sagaStepDone:
		return "step done"
	case sagaCompensatedStep:
		return "step compensated"
	case sagaLeft:
		return "left for now"
	case sagaWroteEvent:
		return "ended, event written"
	}
	return fmt.Sprintf("sagaNext(%d)", int(n))
}

// sagaRound reads every saga in runs, and advances each one step: a
// compensating saga runs compensate on its own (runCompensation); for the
// others, the round makes its processor calls, then runs every saga's step
// in one transaction. It returns the sagas that go on. Every write is
// fenced by its saga's lease (fenceSaga, in the write's own savepoint), and
// a status only moves forward (in_progress -> completed, or in_progress ->
// compensating -> compensated | compensation_failed): a worker acting on
// what it read before a pause can neither record a step over another
// worker's nor pull a saga back.
//
// A saga that fails unexpectedly (a bug, a broken row) is set aside for a
// minute and reported in failures; it does not hold up the others. Returns
// an error only when the worker must stop: errCrash, or the database
// failing (nothing of the round's transaction is committed then; the sagas
// come back when their leases pass).
func (a *App) sagaRound(ctx context.Context, runs []*sagaRun, failures *[]error) ([]*sagaRun, error) {
	var again, stepping []*sagaRun
	for _, run := range runs {
		a.readSagaRun(ctx, run)
		if run.unexpected == nil && run.action.kind == actionCompensate {
			next, err := a.runCompensation(ctx, run)
			if err != nil {
				failSagaSpans(stepping, err)
				return nil, err
			}
			if next == sagaAgain {
				again = append(again, run)
			}
			continue
		}
		a.startSagaSpan(ctx, run)
		stepping = append(stepping, run)
		if err := a.fault.at(ctx, faultBeforeStep); err != nil {
			failSagaSpans(stepping, err)
			return nil, err
		}
	}
	runs = stepping
	if err := a.sagaCalls(ctx, runs); err != nil {
		failSagaSpans(runs, err)
		return nil, err
	}
	var nexts []sagaNext
	var asides []error
	err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		nexts, asides = make([]sagaNext, len(runs)), make([]error, len(runs))
		for i, run := range runs {
			switch {
			case run.called && errors.Is(run.callErr, errSagaLeaseLost):
				nexts[i] = sagaLeft
			case run.unexpected != nil:
				// A bug or a broken row must not hold up the other
				// sagas: put it back for later and report it.
				asides[i] = run.unexpected
				nexts[i] = sagaLeft
				err := a.setSagaAside(ctx, tx, run.lease, run.unexpected)
				if err != nil && !errors.Is(err, errSagaLeaseLost) {
					return err
				}
			default:
				// The events the step writes are created in its span.
				next, err := a.sagaStepIn(trace.ContextWithSpan(ctx, run.span), tx, run)
				if err != nil {
					return err
				}
				nexts[i] = next
			}
		}
		return nil
	})
	if err != nil {
		failSagaSpans(runs, err)
		return nil, err
	}
	wroteEvent := false
	for i, run := range runs {
		a.observeSagaStep(run, nexts[i])
		if asides[i] != nil {
			*failures = append(*failures, fmt.Errorf("saga %s: %w", run.lease.SagaID, asides[i]))
		}
		// The next round's processor call needs no renewal of its own
		// right after a commit that renewed the lease.
		run.renewed = nexts[i] == sagaStepDone
		switch nexts[i] {
		case sagaAgain, sagaStepDone:
			again = append(again, run)
		case sagaLeft:
		case sagaWroteEvent:
			wroteEvent = true
		default:
			return nil, fmt.Errorf("bug: unhandled saga next %d", nexts[i])
		}
	}
	if wroteEvent {
		// PaymentCaptured is committed: the relay need not wait for its
		// next poll to tell the order service.
		a.wake.relay.signal()
	}
	return again, nil
}

// observeSagaStep ends the span of run's step this round, and logs and
// counts what became of the saga.
func (a *App) observeSagaStep(run *sagaRun, next sagaNext) {
	endSagaSpan(run, next)
	if run.stepOK {
		withTraceID(a.log, run.span.SpanContext()).Info("saga step", "saga_id", run.lease.SagaID, "order_id", run.saga.OrderID,
			"saga_status", string(run.saga.Status), "step", run.step.Name, "then", next.String())
	}
	if next == sagaWroteEvent && run.saga.Status == sagaInProgress {
		// The last step ran: the saga completed.
		a.metrics.sagaEnded(sagaCompleted)
	}
}

// readSagaRun reads run's saga and steps afresh (and its order the first
// time), and asks nextSagaAction what it does this round. A saga that
// cannot be read (a broken row; or the database failing, which setting it
// aside then finds out) gets run.unexpected.
func (a *App) readSagaRun(ctx context.Context, run *sagaRun) {
	run.called, run.chargeID, run.callErr, run.unexpected = false, "", nil, nil
	run.step, run.stepOK = sagaStepRow{}, false
	saga, steps, err := readSaga(ctx, a.db, run.lease.SagaID)
	if err != nil {
		run.unexpected = err
		return
	}
	run.saga, run.steps = saga, steps
	if run.order.OrderID == "" {
		order, err := readOrder(ctx, a.db, saga.OrderID)
		if err != nil {
			run.unexpected = err
			return
		}
		run.order = order
	}
	run.action, run.unexpected = nextSagaAction(saga, steps)
	if run.action.kind == actionRunStep {
		run.step, run.stepOK = run.action.step, true
	}
}

// runCompensation runs compensate (or what demo --without saga put in its
// place) on run's saga, and applies afterFailure to a failure: it records
// a retry in a transaction of its own, unless another worker recorded the
// undo first (the saga is read again) or holds the saga now. Returns an
// error only when the worker must stop (isOurFailure).
func (a *App) runCompensation(ctx context.Context, run *sagaRun) (sagaNext, error) {
	err := a.entry.compensate(ctx, run)
	if err == nil {
		// OrderCancelled is committed: the relay need not wait for its
		// next poll to tell the order service.
		a.wake.relay.signal()
		return sagaWroteEvent, nil
	}
	if isOurFailure(ctx, a.db, err) {
		return sagaLeft, err
	}
	switch afterFailure(run.saga.Status, err) {
	case failureReread:
		return sagaAgain, nil
	case failureLeave:
		return sagaLeft, nil
	default:
		err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			return a.scheduleRetry(ctx, tx, run.lease, run.saga, err)
		})
		return sagaLeftUnlessFailed(err)
	}
}

// observeCompensation runs undo for step of run's saga (the zero step: the
// end of the compensation) in a span of its own, and logs and counts it.
func (a *App) observeCompensation(ctx context.Context, run *sagaRun, step sagaStepRow, undo func(context.Context, *sagaRun, sagaStepRow) error) error {
	run.step, run.stepOK = step, step.Name != ""
	a.startSagaSpan(ctx, run)
	err := undo(trace.ContextWithSpan(ctx, run.span), run, step)
	next := sagaCompensatedStep
	switch {
	case errors.Is(err, errStepNotPending):
		next = sagaAgain
	case err != nil:
		next = sagaLeft
	case !run.stepOK:
		next = sagaWroteEvent
	}
	if err != nil {
		failSpan(run.span, err)
	}
	endSagaSpan(run, next)
	log := withTraceID(a.log, run.span.SpanContext())
	switch {
	case run.stepOK:
		log.Info("saga step", "saga_id", run.lease.SagaID, "order_id", run.saga.OrderID, "saga_status", string(run.saga.Status),
			"step", step.Name, "then", next.String())
	case next == sagaWroteEvent:
		log.Info("saga compensated", "saga_id", run.lease.SagaID, "order_id", run.saga.OrderID, "then", next.String())
	}
	switch next {
	case sagaCompensatedStep:
		a.metrics.compensated(step.Name)
	case sagaWroteEvent:
		a.metrics.sagaEnded(sagaCompensated)
	}
	return err
}

// inSagaTx runs fn in a transaction of its own for run's saga, after
// fenceSaga: fn's writes commit only if the worker still holds the saga's
// latest claim, and errSagaLeaseLost rolls them back otherwise.
func (a *App) inSagaTx(ctx context.Context, run *sagaRun, fn func(tx *sql.Tx, now time.Time) error) error {
	return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		now := a.now()
		if err := a.fenceSaga(ctx, tx, run.lease, now); err != nil {
			return err
		}
		return fn(tx, now)
	})
}

// renewLease, run by inSagaTx, writes nothing but the renewal that
// fenceSaga made: before a call to another system, it makes sure the lease
// holds for the call.
func renewLease(tx *sql.Tx, now time.Time) error {
	return nil
}

// sagaCalls makes the round's processor calls: the charge of every saga
// at charge_card (chargeCard). They are calls to another system and run
// outside any transaction, only while the lease holds, and with keys
// derived from the saga, so a second worker that took a saga over asks for
// the same charge. The leases are renewed first, in one transaction for all
// the calls, except those the last round's commit renewed (a saga whose
// reserve_stock it recorded). A saga whose lease is gone gets callErr
// errSagaLeaseLost and no call.
func (a *App) sagaCalls(ctx context.Context, runs []*sagaRun) error {
	var calling []*sagaRun
	for _, run := range runs {
		if run.unexpected == nil && run.stepOK && run.step.Name == stepChargeCard {
			calling = append(calling, run)
		}
	}
	if len(calling) == 0 {
		return nil
	}
	lost := make([]bool, len(calling))
	var renewing []int
	for i, run := range calling {
		if !run.renewed {
			renewing = append(renewing, i)
		}
	}
	if len(renewing) > 0 {
		err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			clear(lost)
			now := a.now()
			for _, i := range renewing {
				err := a.fenceSaga(ctx, tx, calling[i].lease, now)
				if errors.Is(err, errSagaLeaseLost) {
					// A fence that changed no row wrote nothing: the
					// other leases renew all the same.
					lost[i] = true
					continue
				}
				if err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	for i, run := range calling {
		run.called = true
		if lost[i] {
			run.callErr = errSagaLeaseLost
			continue
		}
		if err := a.fault.at(ctx, faultBeforeProcessorCall); err != nil {
			return err
		}
		// The call is part of the step's span.
		run.chargeID, run.callErr = a.chargeCard(trace.ContextWithSpan(ctx, run.span), run)
		if errors.Is(run.callErr, errCrash) {
			return run.callErr
		}
		if run.callErr != nil {
			continue
		}
		if err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {
			return err
		}
	}
	return nil
}

// sagaStepIn runs run's step in its own SAVEPOINT of tx and says what
// becomes of the saga. A step that fails rolls back to the savepoint, so
// the other sagas' steps in tx stand; its failure is then recorded in tx,
// as afterFailure decides: a business failure turns the saga to
// compensation (failStep), a transient one schedules the next attempt
// (scheduleRetry).
//
// Returns an error only when tx must roll back (isOurFailure).
func (a *App) sagaStepIn(ctx context.Context, tx *sql.Tx, run *sagaRun) (sagaNext, error) {
	var next sagaNext
	failed, err := inSavepoint(ctx, tx, "saga_step", func() error {
		var err error
		next, err = a.sagaStep(ctx, tx, run)
		return err
	})
	switch {
	case err != nil:
		return sagaLeft, err
	case failed == nil:
		return next, nil
	case isOurFailure(ctx, a.db, failed):
		return sagaLeft, failed
	}
	switch afterFailure(run.saga.Status, failed) {
	case failureReread:
		return sagaAgain, nil
	case failureLeave:
		return sagaLeft, nil
	case failureCompensate:
		return sagaAgainUnlessLost(a.failStep(ctx, tx, run.lease, run.saga, run.step, failed))
	default:
		return sagaLeftUnlessFailed(a.scheduleRetry(ctx, tx, run.lease, run.saga, failed))
	}
}

// sagaAgainUnlessLost is what becomes of a saga after a write that turned
// it (failStep): it goes on, unless the write found its lease lost.
func sagaAgainUnlessLost(err error) (sagaNext, error) {
	if errors.Is(err, errSagaLeaseLost) {
		return sagaLeft, nil
	}
	if err != nil {
		return sagaLeft, err
	}
	return sagaAgain, nil
}

// sagaLeftUnlessFailed is what becomes of a saga after a write that
// released it (scheduleRetry): this pass is done with it either way.
func sagaLeftUnlessFailed(err error) (sagaNext, error) {
	if err != nil && !errors.Is(err, errSagaLeaseLost) {
		return sagaLeft, err
	}
	return sagaLeft, nil
}

// sagaStep runs run's step in tx after fenceSaga (runStep), or releases a
// saga that another worker ended since this one's claim.
func (a *App) sagaStep(ctx context.Context, tx *sql.Tx, run *sagaRun) (sagaNext, error) {
	switch run.action.kind {
	case actionRunStep:
		now := a.now()
		if err := a.fenceSaga(ctx, tx, run.lease, now); err != nil {
			return sagaLeft, err
		}
		completed, err := a.runStep(ctx, tx, run, now)
		if completed && err == nil {
			// confirm wrote PaymentCaptured and completed the saga.
			return sagaWroteEvent, nil
		}
		return sagaStepDone, err
	case actionNone:
		// Ended by another worker since this one's claim.
		return sagaLeft, releaseSaga(ctx, tx, run.lease)
	default:
		return sagaLeft, fmt.Errorf("bug: unhandled saga action %d", run.action.kind)
	}
}

// fenceSaga is the first statement of every transaction that writes for a
// saga: it renews lease and returns errSagaLeaseLost unless lease is still
// the saga's latest claim. The UPDATE takes the saga row's write lock (the
// database's write lock on SQLite), so no other worker can claim the saga
// between this check and the transaction's commit: the check stays true for
// every write that follows it in tx.
func (a *App) fenceSaga(ctx context.Context, tx *sql.Tx, lease sagaClaim, now time.Time) error {
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_instances SET locked_until = ?
		WHERE saga_id = ? AND locked_by = ? AND lease_token = ?`,
		formatTime(now.Add(a.leases.saga)), lease.SagaID, lease.WorkerID, lease.Token)
	if err != nil {
		return fmt.Errorf("renew lease of saga %s: %w", lease.SagaID, err)
	}
	return oneRowOr(updated, errSagaLeaseLost)
}

// oneRowOr returns notMatched unless result changed exactly one row: the
// way a fenced or conditional write finds out that its condition no longer
// held.
func oneRowOr(result sql.Result, notMatched error) error {
	n, err := result.RowsAffected()
	if err != nil {
		return fmt.Errorf("rows affected: %w", err)
	}
	if n != 1 {
		return notMatched
	}
	return nil
}

// scheduleRetry records in tx a transient failure and releases the saga
// until its next attempt; a compensation's last allowed failure makes it
// compensation_failed instead (retryAfter). Fenced, and only from the status the
// worker read: a stale worker's failure is not recorded (errSagaLeaseLost).
func (a *App) scheduleRetry(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, cause error) error {
	status, attempts := retryAfter(saga)
	now := a.now()
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_instances
		SET status = ?, attempts = ?, last_error = ?, next_attempt_at = ?, updated_at = ?,
		    locked_by = NULL, locked_until = NULL
		WHERE saga_id = ? AND status = ? AND locked_by = ? AND lease_token = ?`,
		status, attempts, cause.Error(), formatTime(now.Add(sagaBackoff(attempts))), formatTime(now),
		saga.SagaID, saga.Status, lease.WorkerID, lease.Token)
	if err != nil {
		return fmt.Errorf("schedule saga retry: %w", err)
	}
	return oneRowOr(updated, errSagaLeaseLost)
}

// setSagaAside releases, in tx, a saga that failed unexpectedly and makes
// it due again in a minute, its status unchanged. Returns errSagaLeaseLost
// if another worker holds it now.
func (a *App) setSagaAside(ctx context.Context, tx *sql.Tx, lease sagaClaim, cause error) error {
	now := a.now()
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_instances
		SET attempts = attempts + 1, last_error = ?, next_attempt_at = ?, updated_at = ?,
		    locked_by = NULL, locked_until = NULL
		WHERE saga_id = ? AND locked_by = ? AND lease_token = ?`,
		cause.Error(), formatTime(now.Add(time.Minute)), formatTime(now), lease.SagaID, lease.WorkerID, lease.Token)
	if err != nil {
		return fmt.Errorf("set saga %s aside: %w", lease.SagaID, err)
	}
	return oneRowOr(updated, errSagaLeaseLost)
}

// releaseSaga gives up lease on a terminal saga, in tx. A lease already
// taken over is left alone.
func releaseSaga(ctx context.Context, tx *sql.Tx, lease sagaClaim) error {
	_, err := tx.ExecContext(ctx, `
		UPDATE saga_instances SET locked_by = NULL, locked_until = NULL
		WHERE saga_id = ? AND locked_by = ? AND lease_token = ?`,
		lease.SagaID, lease.WorkerID, lease.Token)
	if err != nil {
		return fmt.Errorf("release saga: %w", err)
	}
	return nil
}
