// The saga engine: how the decisions and steps of saga.go are applied to
// many sagas at once, by several workers, safely. A first reading needs
// only the functions the tour's box "Engine functions you cannot skip"
// names (claimSagas, leaseSagas, sagaStepIn, scheduleRetry, sagaCalls,
// runCompensation). It claims due sagas (sagaRound: a read, and on PostgreSQL a row
// lock until the claiming transaction ends; the claim is written by the
// saga's first step, or by leaseSagas when that step cannot run there and
// then), and every write it makes for a saga ends with advanceSaga's
// compare-and-set on the saga's lease token (saga.go), so a worker paused
// past its lease writes nothing. It advances the claimed sagas together,
// in rounds: a round makes its card charges outside any transaction, then
// runs every saga's step in one transaction with a savepoint per saga, so
// a round costs one commit, not one per saga; the same commit claims the
// sagas started meanwhile, runs the first step of each, and reads the
// next round's. A compensating saga, the rare path, runs compensate on
// its own: one transaction per undone step.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// sagaBackoff is how long a saga waits after its attempts-th transient
// failure: 1s, 2s, 4s ... at most a minute.
func sagaBackoff(attempts int) time.Duration {
	return min(time.Second<<min(attempts-1, 6), time.Minute)
}

// sagaOnce claims up to max runnable sagas and advances them together, in
// rounds, each as far as it can go now. A saga is runnable when it is in
// progress or compensating, due, and not leased to a live worker; so this
// is also the recovery pass: a saga whose worker died is resumed, forward
// or backward, once its lease passes. It returns how many sagas it ran.
//
// A round takes every claimed saga one step: the card calls of the round
// first, outside any transaction (sagaCalls), then every saga's local step,
// or the record of its call, in one transaction with a savepoint per saga
// (sagaStepIn). One commit per round, not one per saga and step. A
// compensating saga runs compensate, to its end, in its round.
//
// The same transaction claims the sagas that became due, up to max in
// all, and runs the first step of each right away (admitSagas), so a saga
// started while others are under way joins them at once instead of
// waiting for them to finish; and reads every saga of the next round. The
// pass ends when no claimed saga goes on.
//
// The first round of a pass always claims; a later one only if a saga was
// started since the last claim (a.wake.saga was signalled), or if the last
// claim may have left due sagas behind (it took all it had room for, or
// had no room): a claim after every round found nothing in most, a
// statement each. Sagas that become due without a signal (a retry's
// backoff over, another process's, a dead worker's) wait for the next
// pass, as they would when no pass runs.
func (a *App) sagaOnce(ctx context.Context, workerID string, max int) (int, error) {
	var runs []*sagaRun
	var failures []error
	claimed := 0
	var seen uint64
	leftBehind := false
	for first := true; first || len(runs) > 0; first = false {
		var admitted int
		var err error
		claim := first || leftBehind || a.wake.saga.count() != seen
		if claim {
			seen = a.wake.saga.count()
		}
		runs, admitted, leftBehind, err = a.sagaRound(ctx, workerID, max, runs, claim, &failures)
		if err != nil {
			return 0, errors.Join(append(failures, err)...)
		}
		claimed += admitted
	}
	return claimed, errors.Join(failures...)
}

// claimSagas reads, in tx, up to max runnable sagas for workerID (see
// sagaOnce) and returns them in saga id order, each with the lease token
// it had: the claim that the saga's first write will make (advanceSaga,
// or leaseSagas). On PostgreSQL the rows stay locked until tx ends, so two
// workers claiming at once take different sagas (SKIP LOCKED); a claim
// that two workers make anyway (one read the saga before the other's
// first write committed: on SQLite, never) is settled by that write, and
// the loser's step rolls back.
func (a *App) claimSagas(ctx context.Context, tx *sql.Tx, workerID string, max int) ([]*sagaRun, error) {
	now := formatTime(a.now())
	rows, err := tx.QueryContext(ctx, `
		SELECT saga_id, lease_token FROM saga_instances
		WHERE status IN ('in_progress', 'compensating')
		  AND next_attempt_at <= ?
		  AND (locked_until IS NULL OR locked_until <= ?)
		ORDER BY next_attempt_at
		LIMIT ? `+skipLocked(a.db),
		now, now, max)
	if err != nil {
		return nil, fmt.Errorf("claim sagas: %w", err)
	}
	defer rows.Close()
	var runs []*sagaRun
	for rows.Next() {
		run := &sagaRun{lease: sagaClaim{WorkerID: workerID}}
		if err := rows.Scan(&run.lease.SagaID, &run.lease.Token); err != nil {
			return nil, fmt.Errorf("scan saga id: %w", err)
		}
		runs = append(runs, run)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	// Run them in saga id order, so that a pass is the same every time
	// (the simulator replays it from a seed).
	sort.Slice(runs, func(i, j int) bool { return runs[i].lease.SagaID < runs[j].lease.SagaID })
	return runs, nil
}

// leaseSagas writes, in tx, the claim of each of runs that claimSagas read
// and whose first step cannot run in the claiming transaction (a charge to
// ask for, a compensation to run): the lease, and the token moved on, as
// advanceSaga would. Those whose token moved since (another worker wrote
// for them) are returned as lost.
func (a *App) leaseSagas(ctx context.Context, tx *sql.Tx, runs []*sagaRun) (lost map[*sagaRun]bool, err error) {
	lost = map[*sagaRun]bool{}
	for _, run := range runs {
		err := a.advanceSaga(ctx, tx, run.lease, run.saga.Status, false, `updated_at = ?`, formatTime(a.now()))
		if errors.Is(err, errSagaLeaseLost) {
			lost[run] = true
			continue
		}
		if err != nil {
			return nil, err
		}
	}
	return lost, nil
}

// sagaWithSteps is a saga and its steps, in step order, as readSagas read
// them.
type sagaWithSteps struct {
	saga  sagaRow
	steps []sagaStepRow
}

// readSagas reads the sagas sagaIDs and their steps in one statement, so
// the saga engine reads every saga of a round in one round trip (and, in
// the round's transaction, from one snapshot). A saga that does not exist
// is missing from the map.
func readSagas(ctx context.Context, q queryer, sagaIDs []string) (map[string]sagaWithSteps, error) {
	placeholders := make([]string, len(sagaIDs))
	args := make([]any, len(sagaIDs))
	for i, sagaID := range sagaIDs {
		placeholders[i], args[i] = "?", sagaID
	}
	// A LEFT JOIN: a saga is written with its steps, but one without any
	// must still read as a saga, not as missing.
	rows, err := q.QueryContext(ctx, `
		SELECT s.saga_id, s.order_id, s.status, s.current_step, s.attempts, s.failure_reason, s.last_error,
		       s.traceparent, s.tracestate,
		       t.step_index, t.step_name, t.status, t.attempts, t.result, t.error
		FROM saga_instances s LEFT JOIN saga_steps t ON t.saga_id = s.saga_id
		WHERE s.saga_id IN (`+strings.Join(placeholders, ", ")+`) ORDER BY s.saga_id, t.step_index`, args...)
	if err != nil {
		return nil, fmt.Errorf("read sagas %v: %w", sagaIDs, err)
	}
	defer rows.Close()
	sagas := make(map[string]sagaWithSteps, len(sagaIDs))
	for rows.Next() {
		var saga sagaRow
		var traceparent, tracestate sql.NullString
		var index, attempts sql.NullInt64
		var name, status sql.NullString
		var step sagaStepRow
		err := rows.Scan(&saga.SagaID, &saga.OrderID, &saga.Status, &saga.CurrentStep, &saga.Attempts, &saga.FailureReason, &saga.LastError,
			&traceparent, &tracestate,
			&index, &name, &status, &attempts, &step.Result, &step.Error)
		if err != nil {
			return nil, fmt.Errorf("scan saga %s: %w", saga.SagaID, err)
		}
		saga.Trace = traceContextFrom(traceparent, tracestate)
		read := sagas[saga.SagaID]
		read.saga = saga
		if index.Valid {
			step.Index, step.Name, step.Status, step.Attempts = int(index.Int64), name.String, stepStatus(status.String), int(attempts.Int64)
			read.steps = append(read.steps, step)
		}
		sagas[saga.SagaID] = read
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read sagas %v: %w", sagaIDs, err)
	}
	return sagas, nil
}

// sagaRead is what the engine read of a saga for its next round.
type sagaRead struct {
	saga  sagaRow
	steps []sagaStepRow
	// order is the saga's order, read the first time only: what the saga
	// uses of it (items, amount, payment method) never changes.
	order orderRow
	// err: the saga could not be read (a broken row, or it is gone).
	err error
}

// readSagaRuns reads every saga of runs and its steps in one statement of
// q, and the order of a saga read for the first time, and keeps each read
// for the saga's next round (run.read). A saga that cannot be read gets
// the read's err; an error returned is q failing.
func (a *App) readSagaRuns(ctx context.Context, q queryer, runs []*sagaRun) error {
	if len(runs) == 0 {
		return nil
	}
	sagaIDs := make([]string, len(runs))
	for i, run := range runs {
		sagaIDs[i] = run.lease.SagaID
	}
	sagas, err := readSagas(ctx, q, sagaIDs)
	if err != nil {
		return err
	}
	// The orders of the sagas read for the first time, in one statement:
	// what a saga uses of its order (items, amount, payment method) never
	// changes.
	var orderIDs []string
	for _, run := range runs {
		if read, ok := sagas[run.lease.SagaID]; ok && run.order.OrderID == "" {
			orderIDs = append(orderIDs, read.saga.OrderID)
		}
	}
	var orders map[string]orderRow
	var broken map[string]error
	if len(orderIDs) > 0 {
		if orders, broken, err = readOrders(ctx, q, orderIDs); err != nil {
			return err
		}
	}
	for _, run := range runs {
		read, ok := sagas[run.lease.SagaID]
		if !ok {
			run.read = &sagaRead{err: fmt.Errorf("read saga %s: %w", run.lease.SagaID, sql.ErrNoRows)}
			continue
		}
		run.read = &sagaRead{saga: read.saga, steps: read.steps}
		if run.order.OrderID != "" {
			continue
		}
		// A broken or missing order is the saga's problem (it is set
		// aside), not the round's.
		order, found := orders[read.saga.OrderID]
		switch {
		case broken[read.saga.OrderID] != nil:
			run.read.err = broken[read.saga.OrderID]
		case !found:
			run.read.err = fmt.Errorf("order %s of saga %s: %w", read.saga.OrderID, run.lease.SagaID, errOrderNotFound)
		}
		run.read.order = order
	}
	return nil
}

// sagaRun is one claimed saga while sagaOnce advances it: what the worker
// read of it this round, and what the processor answered.
type sagaRun struct {
	lease sagaClaim
	// read is what the last transaction read of the saga for this round
	// (readSagaRuns); nil if the saga must be read afresh.
	read  *sagaRead
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
	// renewed its lease with it (advanceSaga).
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

// sagaRound advances every saga in runs one step, acting on what the
// transaction before it read of each (run.read; a saga not read there is
// read first): a compensating saga runs compensate on its own
// (runCompensation); for the others, the round makes its processor calls,
// then runs every saga's step in one transaction. It returns the sagas
// that go on. Every write ends with advanceSaga (in the write's own
// savepoint), and a status only moves forward (in_progress -> completed,
// or in_progress -> compensating -> compensated | compensation_failed): a
// worker acting on what it read before a pause can neither record a step
// over another worker's nor pull a saga back.
//
// If claim is set, the round's transaction also claims, for workerID, the
// sagas that became due, up to max with those that go on, and runs the
// first step of each (admitSagas); then it reads every saga of the next
// round (readSagaRuns). It returns how many it claimed, and whether it may
// have left due sagas unclaimed: it took as many as it had room for, or it
// had no room.
//
// A saga that fails unexpectedly (a bug, a broken row) is set aside for a
// minute and reported in failures; it does not hold up the others. Returns
// an error only when the worker must stop: errCrash, or the database
// failing (nothing of the round's transaction is committed then; the sagas
// come back when their leases pass).
func (a *App) sagaRound(ctx context.Context, workerID string, max int, runs []*sagaRun, claim bool, failures *[]error) (_ []*sagaRun, claimed int, leftBehind bool, _ error) {
	var unread []*sagaRun
	for _, run := range runs {
		if run.read == nil {
			unread = append(unread, run)
		}
	}
	// Only the sagas of a round that ran no step (all compensated), or
	// whose read failed, are read here, outside a transaction.
	if err := a.readSagaRuns(ctx, a.db, unread); err != nil {
		for _, run := range unread {
			run.read = &sagaRead{err: err}
		}
	}
	var again, stepping []*sagaRun
	for _, run := range runs {
		startSagaRound(run)
		if run.unexpected == nil && run.action.kind == actionCompensate {
			next, err := a.runCompensation(ctx, run)
			if err != nil {
				failSagaSpans(stepping, err)
				return nil, 0, false, err
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
			return nil, 0, false, err
		}
	}
	runs = stepping
	if err := a.sagaCalls(ctx, runs); err != nil {
		failSagaSpans(runs, err)
		return nil, 0, false, err
	}
	var steps, admittedSteps []sagaStepOutcome
	var admitted []*sagaRun
	err := withItems(ctx, a.db, withFencedTx, func(tx *sql.Tx, undo *itemUndo) error {
		var err error
		steps, err = a.stepAll(ctx, tx, undo, runs)
		if err != nil {
			return err
		}
		// The next round's sagas: those that go on, and those that became
		// due meanwhile. Those whose step this transaction recorded done
		// are not read again: the worker knows what it wrote
		// (readAfterStepDone).
		next := slices.Clone(again)
		for i, run := range runs {
			if steps[i].next == sagaAgain {
				next = append(next, run)
			}
		}
		admitted, admittedSteps, leftBehind = nil, nil, claim
		if claim && len(next) < max {
			admitted, admittedSteps, err = a.admitSagas(ctx, tx, undo, workerID, max-len(next))
			if err != nil {
				return err
			}
			leftBehind = len(admitted) == max-len(next)
		}
		for i, run := range admitted {
			if admittedSteps[i].next == sagaAgain {
				next = append(next, run)
			}
		}
		return a.readSagaRuns(ctx, tx, next)
	})
	if err != nil {
		failSagaSpans(append(runs, admitted...), err)
		return nil, 0, false, err
	}
	wroteEvent := false
	all, outcomes := append(slices.Clone(runs), admitted...), append(slices.Clone(steps), admittedSteps...)
	for i, run := range all {
		step := outcomes[i]
		// Committed: what this worker wrote for the saga moved its token
		// on (advanceSaga), and renewed its lease, so the next round's
		// processor call needs no renewal of its own.
		if step.wrote {
			run.lease.Token++
		}
		run.renewed = step.wrote
		if !step.leased {
			a.observeSagaStep(run, step.next)
		}
		if step.aside != nil {
			*failures = append(*failures, fmt.Errorf("saga %s: %w", run.lease.SagaID, step.aside))
		}
		switch step.next {
		case sagaStepDone:
			run.read = run.readAfterStepDone()
			again = append(again, run)
		case sagaAgain:
			again = append(again, run)
		case sagaLeft:
		case sagaWroteEvent:
			wroteEvent = true
		default:
			return nil, 0, false, fmt.Errorf("bug: unhandled saga next %d", step.next)
		}
	}
	if wroteEvent {
		// PaymentCaptured is committed: the relay need not wait for its
		// next poll to tell the order service.
		a.wake.outboxWritten()
	}
	return again, len(admitted), leftBehind, nil
}

// readAfterStepDone is what the next round would read of run's saga once
// the round's commit recorded its forward step done (markStepDone): the
// step's row, with the charge's id for charge_card, and the saga in
// progress at the next step. No other worker wrote for the saga since: the
// write was its compare-and-set on the lease token. So reading the saga
// again, a statement per saga and round, would read only what this worker
// wrote. (TestSagaRoundKnowsWhatItWrote compares the two.)
func (run *sagaRun) readAfterStepDone() *sagaRead {
	done := run.step
	done.Status, done.Attempts, done.Result, done.Error = stepDone, 1, sql.NullString{}, sql.NullString{}
	if done.Name == stepChargeCard {
		done.Result = sql.NullString{String: run.chargeID, Valid: true}
	}
	saga := run.saga
	saga.Status, saga.CurrentStep = afterStepDone(run.step)
	saga.Attempts, saga.LastError = 0, sql.NullString{}
	return &sagaRead{saga: saga, steps: append(slices.Clone(run.steps), done)}
}

// sagaStepOutcome is what a round's transaction did for one saga: what
// becomes of it, why it was set aside (if it was), and whether the worker
// wrote for it (its token moved on, once the transaction commits).
type sagaStepOutcome struct {
	next  sagaNext
	aside error
	wrote bool
	// leased: the saga was claimed to run in the next round, and nothing
	// else was done for it.
	leased bool
}

// stepAll runs, in tx, what each of runs does this round (stepIn), and
// returns what became of each. An error returned means tx must roll back.
func (a *App) stepAll(ctx context.Context, tx *sql.Tx, undo *itemUndo, runs []*sagaRun) ([]sagaStepOutcome, error) {
	outcomes := make([]sagaStepOutcome, len(runs))
	for i, run := range runs {
		outcome, err := a.stepIn(ctx, tx, undo, run)
		if err != nil {
			return nil, err
		}
		outcomes[i] = outcome
	}
	return outcomes, nil
}

// stepIn runs, in tx, what run's saga does this round: nothing if its
// lease was found lost before its call; setting it aside if it cannot go
// on (a bug, a broken row: it does not hold up the others); its step
// otherwise (sagaStepIn). Returns an error only when tx must roll back.
func (a *App) stepIn(ctx context.Context, tx *sql.Tx, undo *itemUndo, run *sagaRun) (sagaStepOutcome, error) {
	switch {
	case run.called && errors.Is(run.callErr, errSagaLeaseLost):
		return sagaStepOutcome{next: sagaLeft}, nil
	case run.unexpected != nil:
		err := a.setSagaAside(ctx, tx, run.lease, run.unexpected)
		if err != nil && !errors.Is(err, errSagaLeaseLost) {
			return sagaStepOutcome{}, err
		}
		return sagaStepOutcome{next: sagaLeft, aside: run.unexpected}, nil
	default:
		// The events the step writes are created in its span.
		return a.sagaStepIn(trace.ContextWithSpan(ctx, run.span), tx, undo, run)
	}
}

// admitSagas claims, in tx, up to max sagas that became due (claimSagas),
// reads them, and runs the first step of each right away, in tx: its
// write is the claim. A saga whose first step is a call to another system
// (a charge, asked for again after a worker died) or a compensation
// cannot run in a transaction: its claim is written alone (leaseSagas),
// and it runs in the next round. Returns the sagas claimed and what
// became of each.
func (a *App) admitSagas(ctx context.Context, tx *sql.Tx, undo *itemUndo, workerID string, max int) ([]*sagaRun, []sagaStepOutcome, error) {
	runs, err := a.claimSagas(ctx, tx, workerID, max)
	if err != nil || len(runs) == 0 {
		return nil, nil, err
	}
	if err := a.readSagaRuns(ctx, tx, runs); err != nil {
		return nil, nil, err
	}
	outcomes := make([]sagaStepOutcome, len(runs))
	var leasing []*sagaRun
	for i, run := range runs {
		startSagaRound(run)
		if run.unexpected == nil && (run.action.kind == actionCompensate || (run.stepOK && run.step.Name == stepChargeCard)) {
			leasing = append(leasing, run)
			continue
		}
		a.startSagaSpan(ctx, run)
		if outcomes[i], err = a.stepIn(ctx, tx, undo, run); err != nil {
			return nil, nil, err
		}
	}
	lost, err := a.leaseSagas(ctx, tx, leasing)
	if err != nil {
		return nil, nil, err
	}
	for i, run := range runs {
		if slices.Contains(leasing, run) {
			// Claimed, to run in the next round; or lost to a worker
			// that wrote for it first.
			outcomes[i] = sagaStepOutcome{next: sagaAgain, wrote: true, leased: true}
			if lost[run] {
				outcomes[i] = sagaStepOutcome{next: sagaLeft, leased: true}
			}
		}
	}
	return runs, outcomes, nil
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

// startSagaRound takes what was read of run's saga for this round
// (run.read) and asks nextSagaAction what it does. A saga that could not
// be read (a broken row; or the database failing, which setting it aside
// then finds out) gets run.unexpected.
func startSagaRound(run *sagaRun) {
	read := run.read
	run.read = nil
	run.called, run.chargeID, run.callErr, run.unexpected = false, "", nil, nil
	run.step, run.stepOK = sagaStepRow{}, false
	if read.err != nil {
		run.unexpected = read.err
		return
	}
	run.saga, run.steps = read.saga, read.steps
	if run.order.OrderID == "" {
		run.order = read.order
	}
	run.action, run.unexpected = nextSagaAction(run.saga, run.steps)
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
		a.wake.outboxWritten()
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

// inSagaTx runs fn in a transaction of its own for run's saga. fn ends
// with advanceSaga: its writes commit only if the worker still holds the
// saga, and errSagaLeaseLost rolls them back otherwise. Once they commit,
// the worker's token is the one advanceSaga wrote.
func (a *App) inSagaTx(ctx context.Context, run *sagaRun, fn func(tx *sql.Tx, now time.Time) error) error {
	err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		return fn(tx, a.now())
	})
	if err == nil {
		run.lease.Token++
	}
	return err
}

// sagaCalls makes the round's processor calls: the charge of every saga
// at charge_card (chargeCard). They are calls to another system and run
// outside any transaction, only while the lease holds, and with keys
// derived from the saga, so a second worker that took a saga over asks for
// the same charge. The leases are renewed first, in one transaction for all
// the calls, except those the last round's commit renewed (a saga whose
// reserve_stock it recorded, the usual case). A saga whose lease is gone gets callErr
// errSagaLeaseLost and no call. The calls run one after another, or side
// by side if a.sagaCallsSideBySide.
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
				err := a.renewSagaLease(ctx, tx, calling[i].lease, sagaInProgress, now)
				if errors.Is(err, errSagaLeaseLost) {
					// A renewal that changed no row wrote nothing: the
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
		for _, i := range renewing {
			if !lost[i] {
				calling[i].lease.Token++
			}
		}
	}
	for i, run := range calling {
		run.called = true
		if lost[i] {
			run.callErr = errSagaLeaseLost
		}
	}
	if !a.sagaCallsSideBySide {
		for _, run := range calling {
			if err := a.sagaCall(ctx, run); err != nil {
				return err
			}
		}
		return nil
	}
	// Side by side, each on a goroutine that ends before this returns: a
	// round waits for its slowest call, not for the sum of them.
	errs := make([]error, len(calling))
	var wg sync.WaitGroup
	for i, run := range calling {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = a.sagaCall(ctx, run)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sagaCall charges the card for run (chargeCard), unless its lease is
// lost, and keeps the answer for the round's transaction. Returns an
// error only when the worker must stop (errCrash, a fault point's).
func (a *App) sagaCall(ctx context.Context, run *sagaRun) error {
	if run.callErr != nil {
		return nil
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
		return nil
	}
	return a.fault.at(ctx, faultAfterProcessorCall)
}

// sagaStepIn runs run's step in tx, undone alone if it fails (undo: in its
// own SAVEPOINT, see itemUndo), and says what becomes of the saga. A step
// that fails rolls back to the savepoint, so the other sagas' steps in tx
// stand; its failure is then recorded in tx,
// as afterFailure decides: a business failure turns the saga to
// compensation (failStep, in a savepoint of its own: it writes twice), a
// transient one schedules the next attempt (scheduleRetry).
//
// Returns an error only when tx must roll back (isOurFailure).
func (a *App) sagaStepIn(ctx context.Context, tx *sql.Tx, undo *itemUndo, run *sagaRun) (sagaStepOutcome, error) {
	var next sagaNext
	failed, err := undo.run(ctx, tx, "saga_step", run.lease.SagaID, func() error {
		var err error
		next, err = a.sagaStep(ctx, tx, run)
		return err
	})
	switch {
	case err != nil:
		return sagaStepOutcome{}, err
	case failed == nil:
		return sagaStepOutcome{next: next, wrote: next == sagaStepDone || next == sagaWroteEvent}, nil
	case isOurFailure(ctx, a.db, failed):
		return sagaStepOutcome{}, failed
	}
	switch afterFailure(run.saga.Status, failed) {
	case failureReread:
		return sagaStepOutcome{next: sagaAgain}, nil
	case failureLeave:
		return sagaStepOutcome{next: sagaLeft}, nil
	case failureCompensate:
		lost, err := inSavepoint(ctx, tx, "saga_fail", func() error {
			return a.failStep(ctx, tx, run.lease, run.saga, run.step, failed)
		})
		switch {
		case err != nil:
			return sagaStepOutcome{}, err
		case errors.Is(lost, errSagaLeaseLost):
			return sagaStepOutcome{next: sagaLeft}, nil
		case lost != nil:
			return sagaStepOutcome{}, lost
		}
		return sagaStepOutcome{next: sagaAgain, wrote: true}, nil
	default:
		err := a.scheduleRetry(ctx, tx, run.lease, run.saga, failed)
		if err != nil && !errors.Is(err, errSagaLeaseLost) {
			return sagaStepOutcome{}, err
		}
		return sagaStepOutcome{next: sagaLeft}, nil
	}
}

// sagaLeftUnlessFailed is what becomes of a saga after a write that
// released it (scheduleRetry): this pass is done with it either way.
func sagaLeftUnlessFailed(err error) (sagaNext, error) {
	if err != nil && !errors.Is(err, errSagaLeaseLost) {
		return sagaLeft, err
	}
	return sagaLeft, nil
}

// sagaStep runs run's step in tx (runStep), whose record ends with
// advanceSaga; a saga that another worker ended since this one read it is
// left alone.
func (a *App) sagaStep(ctx context.Context, tx *sql.Tx, run *sagaRun) (sagaNext, error) {
	switch run.action.kind {
	case actionRunStep:
		completed, err := a.runStep(ctx, tx, run, a.now())
		if completed && err == nil {
			// confirm wrote PaymentCaptured and completed the saga.
			return sagaWroteEvent, nil
		}
		return sagaStepDone, err
	case actionNone:
		// Ended by another worker since this one read it.
		return sagaLeft, nil
	default:
		return sagaLeft, fmt.Errorf("bug: unhandled saga action %d", run.action.kind)
	}
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
// compensation_failed instead (retryAfter). Only from the status the
// worker read, and only while it holds the saga (advanceSaga): a stale
// worker's failure is not recorded (errSagaLeaseLost).
func (a *App) scheduleRetry(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, cause error) error {
	status, attempts := retryAfter(saga)
	now := a.now()
	return a.advanceSaga(ctx, tx, lease, saga.Status, true,
		`status = ?, attempts = ?, last_error = ?, next_attempt_at = ?, updated_at = ?`,
		status, attempts, cause.Error(), formatTime(now.Add(sagaBackoff(attempts))), formatTime(now))
}

// setSagaAside releases, in tx, a saga that failed unexpectedly and makes
// it due again in a minute, its status unchanged. Returns errSagaLeaseLost
// if another worker holds it now.
func (a *App) setSagaAside(ctx context.Context, tx *sql.Tx, lease sagaClaim, cause error) error {
	now := a.now()
	// Whatever its status: a broken row may not even say it right.
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_instances
		SET attempts = attempts + 1, last_error = ?, next_attempt_at = ?, updated_at = ?,
		    locked_by = NULL, locked_until = NULL, lease_token = lease_token + 1
		WHERE saga_id = ? AND lease_token = ?`,
		cause.Error(), formatTime(now.Add(time.Minute)), formatTime(now), lease.SagaID, lease.Token)
	if err != nil {
		return fmt.Errorf("set saga %s aside: %w", lease.SagaID, err)
	}
	return oneRowOr(updated, errSagaLeaseLost)
}

// sagaAlreadyStarted decides, in tx, about an OrderCreated (eventID) for an
// order that has a fulfilment saga. The one that started it, come again,
// changes nothing: a copy normally meets its inbox row and is skipped, but
// cleanup deletes inbox rows after messageRetention, and a copy can come
// later still (on NATS an operator's replay of the event for another
// consumer of its subject reaches every consumer). Poison, it would come
// back with every replay. Any other OrderCreated of the order must not
// start a second saga: it is poison. (A saga started before schema
// version 8 did not record its event: a copy of its OrderCreated is poison
// too, as every one was then.)
func sagaAlreadyStarted(ctx context.Context, tx *sql.Tx, orderID, eventID string) error {
	var startedBy sql.NullString
	if err := tx.QueryRowContext(ctx, `SELECT started_by FROM saga_instances WHERE order_id = ?`, orderID).Scan(&startedBy); err != nil {
		return fmt.Errorf("read the saga of order %s: %w", orderID, err)
	}
	if startedBy.Valid && startedBy.String == eventID {
		return nil
	}
	return permanent(fmt.Errorf("order %s already has a fulfilment saga", orderID))
}
