// The fulfilment saga (the article's "Sagas and compensation" section):
// reserve_stock -> charge_card -> confirm, each step its own local
// transaction, and compensations in reverse when a later step fails a
// business rule.
//
// Where the article's sample went wrong, and what this file does instead:
//   - It inserted every step as done up front, so compensation "undid"
//     steps that never ran. Here a step is recorded as done in the same
//     transaction as its local effect, and only after it ran.
//   - It ran a compensation, then recorded it, outside any transaction: a
//     crash in between released the stock twice on resume. Here a local
//     compensation and its record commit together, and a remote one (the
//     refund) goes through the processor's idempotency key.
//   - It left the order paid after compensating. Here the saga ends by
//     writing OrderCancelled to the outbox, and the order service cancels
//     the order through its inbox.
//
// The payment service runs the saga; it learns of new orders by consuming
// OrderCreated (startFulfilment), so a redelivered OrderCreated starts no
// second saga.
//
// This file is the saga as the article has it: what happens next
// (nextSagaAction and the decisions below it, pure functions), each step
// (runStep), compensate, and the one rule that keeps a slow worker from
// doing harm (advanceSaga: a lease is not a lock, so every write for a
// saga ends with a compare-and-set on its lease token). The engine that
// applies them, infra_saga.go, claims sagas and advances many together in
// rounds, with the processor calls outside any transaction; on a first
// reading, read only its functions that the tour's box "Engine functions
// you cannot skip" names.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// paymentServiceConsumer is the payment service's subscription.
const paymentServiceConsumer = "payment-svc"

// sagaStatus is saga_instances.status.
type sagaStatus string

const (
	sagaInProgress         sagaStatus = "in_progress"
	sagaCompensating       sagaStatus = "compensating"
	sagaCompleted          sagaStatus = "completed"
	sagaCompensated        sagaStatus = "compensated"
	sagaCompensationFailed sagaStatus = "compensation_failed"
)

// stepStatus is saga_steps.status. A step has a row once it has run:
// done or failed, and compensated once undone. pending is what the API
// and the decisions call a step with no row yet; it is never stored.
type stepStatus string

const (
	stepPending     stepStatus = "pending"
	stepDone        stepStatus = "done"
	stepFailed      stepStatus = "failed"
	stepCompensated stepStatus = "compensated"
)

// The fulfilment saga's steps, in order.
const (
	stepReserveStock = "reserve_stock"
	stepChargeCard   = "charge_card"
	stepConfirm      = "confirm"
)

// fulfilmentSteps returns the saga's steps in the order they run.
func fulfilmentSteps() []string {
	return []string{stepReserveStock, stepChargeCard, stepConfirm}
}

// Saga outcomes.
var (
	// errOutOfStock: the warehouse cannot reserve an item; the saga
	// compensates and the order is cancelled.
	errOutOfStock = errors.New("not enough stock")
	// errStepNotPending: the step was recorded by another worker first (its
	// lease had passed); the transaction rolled back and the saga is
	// re-read.
	errStepNotPending = errors.New("saga step is no longer pending")
	// errSagaLeaseLost: another worker wrote for the saga since this one
	// read it (this one was paused or slow past sagaLease), or the saga is
	// no longer in the status this worker read. The write that found out
	// rolled back, the step's effect with it; the worker stops working on
	// the saga without another write.
	errSagaLeaseLost = errors.New("saga lease lost to another worker")
)

// sagaClaim is one worker's claim on one saga. Token is the saga's
// lease_token as the worker last read or wrote it: every write for the
// saga adds one (advanceSaga), so a worker whose token no longer matches
// knows that someone wrote for the saga since, even a process that reuses
// its worker name.
type sagaClaim struct {
	SagaID   string
	WorkerID string
	Token    int64
}

// sagaRow is a row of saga_instances.
type sagaRow struct {
	SagaID        string
	OrderID       string
	Status        sagaStatus
	CurrentStep   string
	Attempts      int
	FailureReason sql.NullString
	LastError     sql.NullString
	// Trace is the creation context of the OrderCreated that started the
	// saga: each step's span links to it (tracing.go).
	Trace traceContext
}

// sagaStepRow is a row of saga_steps.
type sagaStepRow struct {
	Index    int
	Name     string
	Status   stepStatus
	Attempts int
	Result   sql.NullString
	Error    sql.NullString
}

// sagaView is the saga as GET /api/orders/{id} shows it.
type sagaView struct {
	SagaID        string         `json:"saga_id"`
	Status        sagaStatus     `json:"status"`
	CurrentStep   string         `json:"current_step"`
	FailureReason string         `json:"failure_reason,omitempty"`
	Steps         []sagaStepView `json:"steps"`
}

// sagaStepView is one step as the API shows it.
type sagaStepView struct {
	Name   string     `json:"name"`
	Status stepStatus `json:"status"`
}

// startFulfilment is the payment service's inbox handler for OrderCreated
// (the effect half of the article's consume_order_created()): it creates
// the saga, at its first step, in the inbox transaction. The steps run
// later in sagaOnce, because charging a card is a call to another system
// and must not happen inside a database transaction; each step's row is
// written when it has run (markStepDone).
func (a *App) startFulfilment(ctx context.Context, tx *sql.Tx, msg message) error {
	if msg.Subject != eventOrderCreated {
		return permanent(fmt.Errorf("payment service does not handle %s", msg.Subject))
	}
	var payload orderCreatedPayload
	if err := json.Unmarshal(msg.Payload, &payload); err != nil {
		return permanent(fmt.Errorf("decode %s: %w", msg.Subject, err))
	}
	now := formatTime(a.now())
	sagaID := a.newID("saga")
	steps := fulfilmentSteps()
	// The steps run later, each in a span of its own that links to the
	// message's creation context: the saga keeps it.
	traceparent, tracestate := msg.Trace.columns()
	// Only for an order that exists, and only once per order.
	started, err := tx.ExecContext(ctx, `
		INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at,
		                            started_by, traceparent, tracestate)
		SELECT ?, order_id, ?, ?, ?, ?, ?, ?, ?, ? FROM orders WHERE order_id = ?
		ON CONFLICT (order_id) DO NOTHING`,
		sagaID, sagaInProgress, steps[0], now, now, now, msg.ID, traceparent, tracestate, payload.OrderID)
	if err != nil {
		return fmt.Errorf("insert saga: %w", err)
	}
	n, err := started.RowsAffected()
	if err != nil {
		return fmt.Errorf("insert saga: %w", err)
	}
	if n == 1 {
		return nil
	}
	if _, err := readOrder(ctx, tx, payload.OrderID); errors.Is(err, errOrderNotFound) {
		return permanent(fmt.Errorf("OrderCreated for unknown order %s", payload.OrderID))
	} else if err != nil {
		return err
	}
	// The order has its saga: this is the OrderCreated that started it,
	// come again, or a second one (sagaAlreadyStarted).
	return sagaAlreadyStarted(ctx, tx, payload.OrderID, msg.ID)
}

// readSaga reads a saga and its steps in step order, in one statement
// (readSagas): one round trip, and on PostgreSQL one transaction, where two
// statements outside a transaction were two of each, and could each see a
// different commit. Returns an error wrapping sql.ErrNoRows if there is no
// such saga.
func readSaga(ctx context.Context, q queryer, sagaID string) (sagaRow, []sagaStepRow, error) {
	sagas, err := readSagas(ctx, q, []string{sagaID})
	if err != nil {
		return sagaRow{}, nil, err
	}
	read, ok := sagas[sagaID]
	if !ok {
		return sagaRow{}, nil, fmt.Errorf("read saga %s: %w", sagaID, sql.ErrNoRows)
	}
	return read.saga, read.steps, nil
}

// What a saga does next: the article's state machine, as functions of what
// was read, with no I/O, so that each decision is tested on its own
// (TestSagaDecisions). The engine (infra_saga.go) reads the saga, asks them,
// and applies the answer under the saga's lease.

// sagaActionKind is what a saga does next.
type sagaActionKind int

const (
	// actionNone: the saga has ended (completed, compensated or
	// compensation_failed); there is nothing to do.
	actionNone sagaActionKind = iota
	// actionRunStep: run the saga's pending step (sagaAction.step).
	actionRunStep
	// actionCompensate: undo the done steps, last first, then cancel the
	// order (compensate).
	actionCompensate
)

// sagaAction is what a saga does next, and the step it runs.
type sagaAction struct {
	kind sagaActionKind
	step sagaStepRow
}

// nextSagaAction decides what saga does next, from the steps that have
// run, in step order: in progress, it runs the first step that has not
// (they run in order, so that is the next one); compensating, it
// compensates; ended, nothing. Returns a bug: error for a state no
// transition leads to.
func nextSagaAction(saga sagaRow, steps []sagaStepRow) (sagaAction, error) {
	switch saga.Status {
	case sagaInProgress:
		for _, step := range withPendingSteps(steps) {
			if step.Status == stepPending {
				return sagaAction{kind: actionRunStep, step: step}, nil
			}
		}
		return sagaAction{}, fmt.Errorf("bug: saga %s in progress with every step run", saga.SagaID)
	case sagaCompensating:
		return sagaAction{kind: actionCompensate}, nil
	case sagaCompleted, sagaCompensated, sagaCompensationFailed:
		return sagaAction{kind: actionNone}, nil
	default:
		return sagaAction{}, fmt.Errorf("bug: unhandled saga status %q", saga.Status)
	}
}

// withPendingSteps returns every step of the saga in step order: those
// that have run, as recorded, and pending for those that have not (the
// API shows them so, and nextSagaAction picks the first).
func withPendingSteps(recorded []sagaStepRow) []sagaStepRow {
	steps := make([]sagaStepRow, len(fulfilmentSteps()))
	for index, name := range fulfilmentSteps() {
		steps[index] = sagaStepRow{Index: index, Name: name, Status: stepPending}
	}
	for _, step := range recorded {
		if step.Index >= 0 && step.Index < len(steps) {
			steps[step.Index] = step
		}
	}
	return steps
}

// stepsToUndo returns the steps compensate undoes, in the order it undoes
// them: the done ones, last first (the sample's "WHERE status='done' ORDER
// BY step_index DESC"). A step that failed or never ran is not done, so it
// is not undone.
func stepsToUndo(steps []sagaStepRow) []sagaStepRow {
	var undo []sagaStepRow
	for i := len(steps) - 1; i >= 0; i-- {
		if steps[i].Status == stepDone {
			undo = append(undo, steps[i])
		}
	}
	return undo
}

// afterStepDone returns the saga's status and current step once step is
// done: in progress at the next step, or completed after the last one.
func afterStepDone(step sagaStepRow) (sagaStatus, string) {
	steps := fulfilmentSteps()
	if step.Index+1 < len(steps) {
		return sagaInProgress, steps[step.Index+1]
	}
	return sagaCompleted, step.Name
}

// failureAction is what becomes of a saga whose step or compensation
// failed, for a reason of its own (not the process's or the database's:
// those roll everything back, see isOurFailure).
type failureAction int

const (
	// failureReread: another worker recorded the step first; read the
	// saga again.
	failureReread failureAction = iota
	// failureLeave: another worker holds the saga now; leave it to them.
	failureLeave
	// failureCompensate: a business rule failed (declined, out of stock);
	// turn the saga to compensation.
	failureCompensate
	// failureRetryLater: a transient failure, or a compensation failing;
	// try again after sagaBackoff (retryAfter).
	failureRetryLater
)

// afterFailure decides what becomes of a saga in status whose step failed
// with err. A forward step that failed a business rule compensates; one
// that failed transiently (a timeout, a busy processor) is retried: a charge
// that timed out may have happened, and retrying with the same key is what
// finds out. A compensation that fails is retried too (retryAfter gives up
// after maxCompensationAttempts).
func afterFailure(status sagaStatus, err error) failureAction {
	switch {
	case errors.Is(err, errStepNotPending):
		return failureReread
	case errors.Is(err, errSagaLeaseLost):
		return failureLeave
	case status == sagaInProgress && isBusinessFailure(err):
		return failureCompensate
	default:
		return failureRetryLater
	}
}

// retryAfter returns the saga's status and attempts after one more
// transient failure: unchanged, except that a compensation's
// maxCompensationAttempts-th failure makes it compensation_failed, for an
// operator to look at.
func retryAfter(saga sagaRow) (sagaStatus, int) {
	attempts := saga.Attempts + 1
	if saga.Status == sagaCompensating && attempts >= maxCompensationAttempts {
		return sagaCompensationFailed, attempts
	}
	return saga.Status, attempts
}

// isBusinessFailure reports whether a step failed for a reason that retrying
// cannot change, so the saga must compensate.
func isBusinessFailure(err error) bool {
	return errors.Is(err, errCardDeclined) ||
		errors.Is(err, errOutOfStock) ||
		errors.Is(err, errProcessorKeyReused) ||
		isPermanent(err)
}

// The saga's steps. Each runs in a transaction (or savepoint) of its own,
// and records itself done in it, with its local effect; the record ends
// with advanceSaga, so the step counts only if the worker still held the
// saga when it committed.

// runStep runs the saga's pending step, run.step, in tx, and reports
// whether it was the last one (the saga is completed).
func (a *App) runStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) (completed bool, err error) {
	switch run.step.Name {
	case stepReserveStock:
		return false, a.reserveStockStep(ctx, tx, run, now)
	case stepChargeCard:
		return false, a.chargeCardStep(ctx, tx, run, now)
	case stepConfirm:
		return true, a.confirmStep(ctx, tx, run, now)
	default:
		return false, fmt.Errorf("bug: unhandled saga step %q", run.step.Name)
	}
}

// reserveStockStep is the saga's reserve_stock: it reserves the order's
// items, or returns errOutOfStock, and the saga compensates.
func (a *App) reserveStockStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) error {
	if err := reserveStock(ctx, tx, run.order); err != nil {
		return err
	}
	if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
		return err
	}
	// Sample flaw 6: it inserted every step as done up front. A step is
	// recorded done here, with its effect, only once it ran. This record
	// is the order's hold on its items (stock.go).
	return a.markStepDone(ctx, tx, run.lease, run.step, "", now)
}

// chargeCard asks the processor to charge the order's card, outside any
// transaction (a call to another system must not hold the database), and
// returns the charge's id. The engine makes the charges of a round
// together, then records each in chargeCardStep.
//
// The key is derived from the saga and the step, never from the attempt:
// a charge whose answer was lost is asked for again, by this worker or the
// one that takes the saga over, and the processor answers with the first
// charge instead of making a second.
func (a *App) chargeCard(ctx context.Context, run *sagaRun) (string, error) {
	return a.processor.charge(ctx, chargeRequest{
		IdempotencyKey: chargeKey(run.saga.SagaID),
		OrderID:        run.order.OrderID,
		AmountCents:    run.order.AmountCents,
		Currency:       run.order.Currency,
		PaymentMethod:  run.order.PaymentMethod,
	})
}

// chargeCardStep is the saga's charge_card: it records the charge that
// chargeCard made (run.chargeID), or returns chargeCard's error
// (errCardDeclined compensates, a timeout is retried with the same key).
func (a *App) chargeCardStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) error {
	if !run.called {
		return fmt.Errorf("bug: saga %s records a charge it did not ask for", run.saga.SagaID)
	}
	if run.callErr != nil {
		return run.callErr
	}
	return a.markStepDone(ctx, tx, run.lease, run.step, run.chargeID, now)
}

// confirmStep is the saga's last step, confirm: PaymentCaptured goes to the
// outbox, for the order service to mark the order paid, and the step's
// record completes the saga in the same transaction (markStepDone). That
// is the sale too: the reserved stock is sold once its saga completed, and
// nothing else is written for it (stock.go).
func (a *App) confirmStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) error {
	charge, ok := firstStepNamed(run.steps, stepChargeCard)
	if !ok || !charge.Result.Valid {
		return fmt.Errorf("bug: saga %s confirms without a charge", run.saga.SagaID)
	}
	// Sample flaw 11: it wrote PaymentCaptured and nobody relayed or
	// consumed it. Here it leaves through the outbox, and the order
	// service applies it.
	paymentCaptured, err := a.newOutboxEvent(eventPaymentCaptured, run.order.OrderID, paymentCapturedPayload{
		OrderID:     run.order.OrderID,
		ChargeID:    charge.Result.String,
		AmountCents: run.order.AmountCents,
	})
	if err != nil {
		return err
	}
	if err := insertOutboxEvent(ctx, tx, paymentCaptured, now); err != nil {
		return err
	}
	if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
		return err
	}
	return a.markStepDone(ctx, tx, run.lease, run.step, "", now)
}

// compensate undoes the saga's done steps, last first, and then ends the
// saga and cancels the order: the article's compensate(). Each undo, and
// the end, is a transaction of its own that ends with advanceSaga
// (inSagaTx), so a crash between two leaves the saga compensating with the
// rest to do, the worker that resumes it undoes each step once, and a
// worker that lost the saga undoes nothing. run.steps are the steps as
// read when the engine picked the saga.
//
// Returns errSagaLeaseLost if another worker holds the saga now, and an
// undo's error if it failed: the engine retries the saga later.
func (a *App) compensate(ctx context.Context, run *sagaRun) error {
	for _, step := range stepsToUndo(run.steps) {
		if err := a.fault.at(ctx, faultBeforeStep); err != nil {
			return err
		}
		// Traced, logged and counted as one saga step (observeCompensation).
		if err := a.observeCompensation(ctx, run, step, a.undoStep); err != nil {
			return err
		}
		// markStepCompensated started the count of attempts again.
		run.saga.Attempts = 0
		if err := a.fault.at(ctx, faultMidCompensation); err != nil {
			return err
		}
	}
	if err := a.fault.at(ctx, faultBeforeStep); err != nil {
		return err
	}
	return a.observeCompensation(ctx, run, sagaStepRow{}, a.cancelOrder)
}

// undoStep undoes one done step of run's saga and records it undone.
//
// Sample flaw 7: it ran a compensation, then recorded it, outside any
// transaction: a crash in between released the stock twice on resume. Here
// a local compensation (the stock) commits with its record, which changes
// from done to compensated only once, and a remote one
// (the refund) is asked for under a key derived from the saga, so the
// processor refunds once however often it is asked.
func (a *App) undoStep(ctx context.Context, run *sagaRun, step sagaStepRow) error {
	switch step.Name {
	case stepReserveStock:
		return a.inSagaTx(ctx, run, func(tx *sql.Tx, now time.Time) error {
			if err := releaseStock(ctx, tx, run.order); err != nil {
				return err
			}
			if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
				return err
			}
			return a.markStepCompensated(ctx, tx, run.lease, step, now)
		})
	case stepChargeCard:
		// A call to another system: outside any transaction, and only
		// while the lease holds (renewed first, as any write).
		if err := a.inSagaTx(ctx, run, func(tx *sql.Tx, now time.Time) error {
			return a.renewSagaLease(ctx, tx, run.lease, sagaCompensating, now)
		}); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultBeforeProcessorCall); err != nil {
			return err
		}
		_, err := a.processor.refund(ctx, refundKey(run.saga.SagaID), step.Result.String, run.order.AmountCents)
		if errors.Is(err, errRefundExceedsCharge) {
			err = a.refundTheRest(ctx, run, step)
		}
		if err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {
			return err
		}
		return a.inSagaTx(ctx, run, func(tx *sql.Tx, now time.Time) error {
			return a.markStepCompensated(ctx, tx, run.lease, step, now)
		})
	default:
		// confirm is the last step: once it is done the saga is completed
		// and never compensates.
		return fmt.Errorf("bug: saga %s cannot undo step %q", run.saga.SagaID, step.Name)
	}
}

// refundTheRest gives back what remains of step's charge, when the
// processor refused the compensation's refund of the order's amount
// (errRefundExceedsCharge): part or all of the charge was refunded
// meanwhile by other means (from the processor's dashboard), and that
// money is back already. Without it, the compensation failed the same way
// at every attempt, and the order stayed unpaid and never cancelled.
//
// The refund of the rest has a key of its own with its amount in it: a
// retry that finds less remaining (another refund came between) asks for
// less under another key, and the processor never refunds more than the
// charge. One whose answer was lost is found on the retry: nothing remains.
func (a *App) refundTheRest(ctx context.Context, run *sagaRun, step sagaStepRow) error {
	remaining, err := a.processor.remaining(ctx, step.Result.String)
	if err != nil || remaining == 0 {
		return err
	}
	_, err = a.processor.refund(ctx, fmt.Sprintf("%s:rest:%d", refundKey(run.saga.SagaID), remaining), step.Result.String, remaining)
	return err
}

// cancelOrder ends run's saga once its done steps are undone
// (finishCompensation). step is unused: it has the shape of undoStep.
func (a *App) cancelOrder(ctx context.Context, run *sagaRun, step sagaStepRow) error {
	return a.inSagaTx(ctx, run, func(tx *sql.Tx, now time.Time) error {
		return a.finishCompensation(ctx, tx, run.lease, run.saga, now)
	})
}

// chargeKey is the idempotency key the saga charges the card with: derived
// from the saga and the step, so every retry of this step, by any worker,
// asks the processor for the same charge.
func chargeKey(sagaID string) string {
	return sagaID + ":" + stepChargeCard
}

// refundKey is the idempotency key of the charge's compensating refund.
func refundKey(sagaID string) string {
	return sagaID + ":" + stepChargeCard + ":refund"
}

// firstStepNamed returns the step called name.
func firstStepNamed(steps []sagaStepRow, name string) (sagaStepRow, bool) {
	for _, step := range steps {
		if step.Name == name {
			return step, true
		}
	}
	return sagaStepRow{}, false
}

// advanceSaga is how every transaction that writes for a saga ends: a
// compare-and-set on the saga's row. It applies set (the columns' new
// values, args their parameters) only if the saga is still in status from
// and its lease_token is still lease.Token, the token the worker last read
// or wrote; it renews the worker's lease (or releases it, with release:
// a saga that has ended needs none), and moves the token on. It returns
// errSagaLeaseLost unless it changed the row, and then the caller's
// savepoint or transaction rolls back the step's effect with it. Once the
// transaction commits, the caller adds one to lease.Token, as the update
// did (inSagaTx; sagaRound for a round's steps), so its next write matches.
//
// A lease is not a lock. A worker paused past sagaLease (a GC pause, a
// SIGSTOP, a slow disk) wakes up believing it holds the saga while another
// has taken it over; whatever it writes after waking must not count. It
// need not check first: its step's effect and this update commit together
// or not at all, and the update is the last word. On SQLite one writer at
// a time makes the check and the write one moment. On PostgreSQL the
// update takes the row's lock, so a takeover, which updates the same row,
// waits for this transaction or this one waits for it, and under READ
// COMMITTED a waiting update checks lease_token again on the row as the
// other left it: one of the two finds its token gone.
func (a *App) advanceSaga(ctx context.Context, tx *sql.Tx, lease sagaClaim, from sagaStatus, release bool, set string, args ...any) error {
	lockedBy, lockedUntil := sql.NullString{String: lease.WorkerID, Valid: !release}, sql.NullString{}
	if !release {
		lockedUntil = sql.NullString{String: formatTime(a.now().Add(a.leases.saga)), Valid: true}
	}
	args = append(args, lockedBy, lockedUntil, lease.SagaID, from, lease.Token)
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_instances SET `+set+`, locked_by = ?, locked_until = ?, lease_token = lease_token + 1
		WHERE saga_id = ? AND status = ? AND lease_token = ?`, args...)
	if err != nil {
		return fmt.Errorf("advance saga %s: %w", lease.SagaID, err)
	}
	return oneRowOr(updated, errSagaLeaseLost)
}

// renewSagaLease renews lease before a call to another system, which no
// transaction can hold: advanceSaga with nothing else to change.
func (a *App) renewSagaLease(ctx context.Context, tx *sql.Tx, lease sagaClaim, status sagaStatus, now time.Time) error {
	return a.advanceSaga(ctx, tx, lease, status, false, `updated_at = ?`, formatTime(now))
}

// markStepDone records step as done, in the transaction of the step's
// effect, and moves the saga to the next step (or completes it, and
// releases it). Sample flaw 6: it inserted every step as done up front;
// here a step's row is written now that it has run. If another worker
// recorded the step first it returns errStepNotPending; if the worker lost
// the saga, or the saga is no longer in progress (another worker turned it
// to compensation: a saga never moves back), errSagaLeaseLost. Either way
// the effect rolls back with it.
func (a *App) markStepDone(ctx context.Context, tx *sql.Tx, lease sagaClaim, step sagaStepRow, result string, now time.Time) error {
	recorded, err := tx.ExecContext(ctx, `
		INSERT INTO saga_steps (saga_id, step_index, step_name, status, attempts, result, done_at)
		VALUES (?, ?, ?, ?, 1, ?, ?)
		ON CONFLICT (saga_id, step_index) DO NOTHING`,
		lease.SagaID, step.Index, step.Name, stepDone, sql.NullString{String: result, Valid: result != ""}, formatTime(now))
	if err != nil {
		return fmt.Errorf("record step %s done: %w", step.Name, err)
	}
	if err := oneRowOr(recorded, errStepNotPending); err != nil {
		return err
	}
	status, next := afterStepDone(step)
	return a.advanceSaga(ctx, tx, lease, sagaInProgress, status == sagaCompleted,
		`status = ?, current_step = ?, attempts = 0, last_error = NULL, updated_at = ?`, status, next, formatTime(now))
}

// markStepCompensated records that step was undone, in the transaction of
// the compensation's effect. Returns errStepNotPending if it was already,
// and errSagaLeaseLost if the worker lost the saga or it is no longer
// compensating.
func (a *App) markStepCompensated(ctx context.Context, tx *sql.Tx, lease sagaClaim, step sagaStepRow, now time.Time) error {
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_steps SET status = ?, compensated_at = ?
		WHERE saga_id = ? AND step_index = ? AND status = ?`,
		stepCompensated, formatTime(now), lease.SagaID, step.Index, stepDone)
	if err != nil {
		return fmt.Errorf("mark step %s compensated: %w", step.Name, err)
	}
	if err := oneRowOr(updated, errStepNotPending); err != nil {
		return err
	}
	return a.advanceSaga(ctx, tx, lease, sagaCompensating, false,
		`current_step = ?, attempts = 0, last_error = NULL, updated_at = ?`, step.Name, formatTime(now))
}

// failStep records in tx that step failed for a business reason and turns
// the saga to compensation. Both writes must hold: a worker that read the
// step as not run before a pause and fails it now (the stock it wanted
// was taken, by the very worker that took its saga over) must not turn a
// saga that moved on meanwhile to compensation.
func (a *App) failStep(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, step sagaStepRow, cause error) error {
	now := a.now()
	failed, err := tx.ExecContext(ctx, `
		INSERT INTO saga_steps (saga_id, step_index, step_name, status, attempts, error)
		VALUES (?, ?, ?, ?, 1, ?)
		ON CONFLICT (saga_id, step_index) DO NOTHING`,
		saga.SagaID, step.Index, step.Name, stepFailed, cause.Error())
	if err != nil {
		return fmt.Errorf("record step %s failed: %w", step.Name, err)
	}
	if err := oneRowOr(failed, errSagaLeaseLost); err != nil {
		return err
	}
	return a.advanceSaga(ctx, tx, lease, sagaInProgress, false,
		`status = ?, failure_reason = ?, attempts = 0, updated_at = ?`, sagaCompensating, cause.Error(), formatTime(now))
}

// finishCompensation ends a saga whose done steps are all undone, releases
// it, and tells the order service through the outbox that the order is
// cancelled, in tx: OrderCancelled is written only by the worker that
// holds the saga.
//
// Sample flaw 8: it left the order paid after compensating.
func (a *App) finishCompensation(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, now time.Time) error {
	orderCancelled, err := a.newOutboxEvent(eventOrderCancelled, saga.OrderID, orderCancelledPayload{
		OrderID: saga.OrderID,
		Reason:  saga.FailureReason.String,
	})
	if err != nil {
		return err
	}
	if err := insertOutboxEvent(ctx, tx, orderCancelled, now); err != nil {
		return err
	}
	return a.advanceSaga(ctx, tx, lease, sagaCompensating, true, `status = ?, updated_at = ?`, sagaCompensated, formatTime(now))
}
