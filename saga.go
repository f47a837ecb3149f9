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

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
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

// stepStatus is saga_steps.status.
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
	// errSagaLeaseLost: another worker claimed the saga since this one did
	// (this one was paused or slow past sagaLease), or the saga is no longer
	// in the status this worker read. The write that found out rolled back;
	// the worker stops working on the saga without another write.
	errSagaLeaseLost = errors.New("saga lease lost to another worker")
)

// sagaClaim is one worker's claim on one saga. Token is the saga's
// lease_token after the claim: every claim adds one, so a worker whose
// token no longer matches knows that someone claimed the saga after it, even
// a process that reuses its worker name.
type sagaClaim struct {
	SagaID   string
	WorkerID string
	Token    int64
	// ClaimedAt is when the claim was made, on the App's clock.
	ClaimedAt time.Time
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

// startFulfilment is the payment service's inbox handler for OrderCreated:
// it creates the saga and its steps, all pending, in the inbox transaction.
// The steps themselves run later in sagaOnce, because charging a card is a
// call to another system and must not happen inside a database transaction.
func (a *App) startFulfilment(ctx context.Context, tx *sql.Tx, msg message) error {
	if msg.Subject != eventOrderCreated {
		return permanent(fmt.Errorf("payment service does not handle %s", msg.Subject))
	}
	var payload orderCreatedPayload
	if err := json.Unmarshal(msg.Payload, &payload); err != nil {
		return permanent(fmt.Errorf("decode %s: %w", msg.Subject, err))
	}
	if _, err := readOrder(ctx, tx, payload.OrderID); err != nil {
		if errors.Is(err, errOrderNotFound) {
			return permanent(fmt.Errorf("OrderCreated for unknown order %s", payload.OrderID))
		}
		return err
	}
	now := formatTime(a.now())
	sagaID := a.newID("saga")
	steps := fulfilmentSteps()
	_, err := tx.ExecContext(ctx, `
		INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at)
		VALUES (?, ?, ?, ?, ?, ?, ?)`,
		sagaID, payload.OrderID, sagaInProgress, steps[0], now, now, now)
	if isUniqueViolation(err) {
		// A second OrderCreated for the same order (another event id) must
		// not start a second saga.
		return permanent(fmt.Errorf("order %s already has a fulfilment saga", payload.OrderID))
	}
	if err != nil {
		return fmt.Errorf("insert saga: %w", err)
	}
	// Every step starts pending: it is marked done only with its effect.
	values := make([]string, len(steps))
	args := make([]any, 0, 4*len(steps))
	for index, name := range steps {
		values[index] = "(?, ?, ?, ?)"
		args = append(args, sagaID, index, name, stepPending)
	}
	_, err = tx.ExecContext(ctx, `
		INSERT INTO saga_steps (saga_id, step_index, step_name, status) VALUES `+strings.Join(values, ", "), args...)
	if err != nil {
		return fmt.Errorf("insert saga steps: %w", err)
	}
	return nil
}

// readSaga reads a saga and its steps in step order.
func readSaga(ctx context.Context, q queryer, sagaID string) (sagaRow, []sagaStepRow, error) {
	var saga sagaRow
	err := q.QueryRowContext(ctx, `
		SELECT saga_id, order_id, status, current_step, attempts, failure_reason, last_error
		FROM saga_instances WHERE saga_id = ?`, sagaID,
	).Scan(&saga.SagaID, &saga.OrderID, &saga.Status, &saga.CurrentStep, &saga.Attempts, &saga.FailureReason, &saga.LastError)
	if err != nil {
		return sagaRow{}, nil, fmt.Errorf("read saga %s: %w", sagaID, err)
	}
	rows, err := q.QueryContext(ctx, `
		SELECT step_index, step_name, status, attempts, result, error
		FROM saga_steps WHERE saga_id = ? ORDER BY step_index`, sagaID)
	if err != nil {
		return sagaRow{}, nil, fmt.Errorf("read steps of saga %s: %w", sagaID, err)
	}
	defer rows.Close()
	var steps []sagaStepRow
	for rows.Next() {
		var step sagaStepRow
		if err := rows.Scan(&step.Index, &step.Name, &step.Status, &step.Attempts, &step.Result, &step.Error); err != nil {
			return sagaRow{}, nil, fmt.Errorf("scan saga step: %w", err)
		}
		steps = append(steps, step)
	}
	if err := rows.Err(); err != nil {
		return sagaRow{}, nil, fmt.Errorf("read steps of saga %s: %w", sagaID, err)
	}
	return saga, steps, nil
}

// sagaBackoff is how long a saga waits after its attempts-th transient
// failure: 1s, 2s, 4s ... at most a minute.
func sagaBackoff(attempts int) time.Duration {
	return min(time.Second<<min(attempts-1, 6), time.Minute)
}

// sagaOnce claims up to max runnable sagas under a lease and runs each as
// far as it can go now. A saga is runnable when it is in progress or
// compensating, due, and not leased to a live worker; so this is also the
// recovery pass: a saga whose worker died is resumed, forward or backward,
// once its lease passes. It returns how many sagas it ran.
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
				LIMIT ? `+dialectOf(a.db).skipLocked+`)
			RETURNING saga_id, lease_token`,
			workerID, formatTime(now.Add(a.leases.saga)), formatTime(now), formatTime(now), max)
		if err != nil {
			return fmt.Errorf("claim sagas: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			lease := sagaClaim{WorkerID: workerID, ClaimedAt: now}
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
	var failures []error
	for _, lease := range leases {
		err := a.runSaga(ctx, lease)
		switch {
		case err == nil:
		case errors.Is(err, errCrash):
			return 0, err
		case errors.Is(err, errSagaLeaseLost):
			// Another worker has the saga now (this one was slow, or the
			// tail of this batch waited past its lease): leave it to them.
		default:
			// One saga failing (a bug, a broken row) must not hold up the
			// others claimed with it: put it back for later, go on, and
			// report it.
			failures = append(failures, fmt.Errorf("saga %s: %w", lease.SagaID, err))
			if err := a.setSagaAside(ctx, lease, err); err != nil && !errors.Is(err, errSagaLeaseLost) {
				return 0, err
			}
		}
	}
	return len(leases), errors.Join(failures...)
}

// runSaga drives one saga, under lease, until it is terminal or must wait
// (a transient failure schedules the next attempt). Returns errSagaLeaseLost
// as soon as a write finds that another worker claimed the saga since; any
// other error only when the worker must stop (errCrash, or the database
// failing).
//
// Every write below is fenced by lease.Token (fenceSaga, in the write's own
// transaction), and a status only moves forward (in_progress -> completed,
// or in_progress -> compensating -> compensated | compensation_failed): a
// worker acting on what it read before a pause can neither record a step
// over another worker's nor pull the saga back.
func (a *App) runSaga(ctx context.Context, lease sagaClaim) error {
	// A saga at the tail of a batch may have waited past the lease that
	// claimed it: renew it, or find out it is gone, before any work. One
	// claimed moments ago needs no renewal: its next write renews it.
	if a.now().Sub(lease.ClaimedAt) >= a.leases.saga/2 {
		if err := a.renewSagaLease(ctx, lease); err != nil {
			return err
		}
	}
	// What the steps use of the order (its items, amount, card) never
	// changes: read it once, not at every step.
	var order orderRow
	for {
		saga, steps, err := readSaga(ctx, a.db, lease.SagaID)
		if err != nil {
			return err
		}
		if order.OrderID != saga.OrderID {
			order, err = readOrder(ctx, a.db, saga.OrderID)
			if err != nil {
				return err
			}
		}
		if err := a.fault.at(ctx, faultBeforeStep); err != nil {
			return err
		}
		switch saga.Status {
		case sagaInProgress:
			step, ok := firstStepWith(steps, stepPending)
			if !ok {
				return fmt.Errorf("bug: saga %s in progress with no pending step", lease.SagaID)
			}
			err := a.runStep(ctx, lease, saga, step, steps, order)
			switch {
			case err == nil, errors.Is(err, errStepNotPending):
				continue
			case errors.Is(err, errCrash), errors.Is(err, errSagaLeaseLost):
				return err
			case isBusinessFailure(err):
				if err := a.failStep(ctx, lease, saga, step, err); err != nil {
					return err
				}
				continue
			default:
				// Transient (a timeout, a busy database): try again later. A
				// charge that timed out may have happened, so giving up and
				// compensating would need the charge's id we do not have;
				// retrying with the same key is what finds it.
				return a.scheduleRetry(ctx, lease, saga, err, false)
			}
		case sagaCompensating:
			step, ok := lastStepWith(steps, stepDone)
			if !ok {
				if err := a.finishCompensation(ctx, lease, saga); err != nil {
					return err
				}
				continue
			}
			err := a.compensateStep(ctx, lease, saga, step, steps, order)
			switch {
			case err == nil, errors.Is(err, errStepNotPending):
				if err := a.fault.at(ctx, faultMidCompensation); err != nil {
					return err
				}
				continue
			case errors.Is(err, errCrash), errors.Is(err, errSagaLeaseLost):
				return err
			default:
				// A compensation can fail too. Retry it, and after
				// maxCompensationAttempts stop and leave it to an operator.
				return a.scheduleRetry(ctx, lease, saga, err, true)
			}
		case sagaCompleted, sagaCompensated, sagaCompensationFailed:
			return a.releaseSaga(ctx, lease)
		default:
			return fmt.Errorf("bug: unhandled saga status %q", saga.Status)
		}
	}
}

// isBusinessFailure reports whether a step failed for a reason that retrying
// cannot change, so the saga must compensate.
func isBusinessFailure(err error) bool {
	return errors.Is(err, errCardDeclined) ||
		errors.Is(err, errOutOfStock) ||
		errors.Is(err, errProcessorKeyReused) ||
		isPermanent(err)
}

// firstStepWith returns the first step in the given status.
func firstStepWith(steps []sagaStepRow, status stepStatus) (sagaStepRow, bool) {
	for _, step := range steps {
		if step.Status == status {
			return step, true
		}
	}
	return sagaStepRow{}, false
}

// lastStepWith returns the last step in the given status: compensation runs
// in reverse.
func lastStepWith(steps []sagaStepRow, status stepStatus) (sagaStepRow, bool) {
	for i := len(steps) - 1; i >= 0; i-- {
		if steps[i].Status == status {
			return steps[i], true
		}
	}
	return sagaStepRow{}, false
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

// runStep runs one pending forward step. Each local effect commits in one
// transaction with the step's record, fenced by lease; the card is charged
// outside any transaction (it is a call to another system), only while the
// lease still holds, and with a key derived from the saga, so a second
// worker that took the saga over asks for the same charge.
func (a *App) runStep(ctx context.Context, lease sagaClaim, saga sagaRow, step sagaStepRow, steps []sagaStepRow, order orderRow) error {
	switch step.Name {
	case stepReserveStock:
		return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			now := a.now()
			if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
				return err
			}
			if err := reserveStock(ctx, tx, order, now); err != nil {
				return err
			}
			if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
				return err
			}
			return a.markStepDone(ctx, tx, lease, step, "", now)
		})
	case stepChargeCard:
		if err := a.renewSagaLease(ctx, lease); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultBeforeProcessorCall); err != nil {
			return err
		}
		chargeID, err := a.processor.charge(ctx, chargeRequest{
			IdempotencyKey: chargeKey(saga.SagaID),
			OrderID:        order.OrderID,
			AmountCents:    order.AmountCents,
			Currency:       order.Currency,
			PaymentMethod:  order.PaymentMethod,
		})
		if err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {
			return err
		}
		return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			now := a.now()
			if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
				return err
			}
			return a.markStepDone(ctx, tx, lease, step, chargeID, now)
		})
	case stepConfirm:
		charge, ok := firstStepNamed(steps, stepChargeCard)
		if !ok || !charge.Result.Valid {
			return fmt.Errorf("bug: saga %s confirms without a charge", saga.SagaID)
		}
		err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			now := a.now()
			if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
				return err
			}
			if err := settleReservations(ctx, tx, order.OrderID, stockSold, now); err != nil {
				return err
			}
			// The payment result leaves through the outbox, in the same
			// transaction that records it; the order service applies it.
			paymentCaptured, err := a.newOutboxEvent(eventPaymentCaptured, order.OrderID, paymentCapturedPayload{
				OrderID:     order.OrderID,
				ChargeID:    charge.Result.String,
				AmountCents: order.AmountCents,
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
			return a.markStepDone(ctx, tx, lease, step, "", now)
		})
		if err == nil {
			// PaymentCaptured is committed: the relay need not wait for
			// its next poll to tell the order service.
			a.wake.relay.signal()
		}
		return err
	default:
		return fmt.Errorf("bug: unhandled saga step %q", step.Name)
	}
}

// compensateStep undoes one done step. A local compensation commits with its
// record, fenced by lease; the refund is idempotent at the processor, so a
// crash between the refund and its record refunds once on resume.
func (a *App) compensateStep(ctx context.Context, lease sagaClaim, saga sagaRow, step sagaStepRow, steps []sagaStepRow, order orderRow) error {
	switch step.Name {
	case stepReserveStock:
		return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			now := a.now()
			if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
				return err
			}
			if err := settleReservations(ctx, tx, order.OrderID, stockReleased, now); err != nil {
				return err
			}
			if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
				return err
			}
			return a.markStepCompensated(ctx, tx, lease, step, now)
		})
	case stepChargeCard:
		if err := a.renewSagaLease(ctx, lease); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultBeforeProcessorCall); err != nil {
			return err
		}
		if _, err := a.processor.refund(ctx, refundKey(saga.SagaID), step.Result.String, order.AmountCents); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {
			return err
		}
		return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
			now := a.now()
			if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
				return err
			}
			return a.markStepCompensated(ctx, tx, lease, step, now)
		})
	case stepConfirm:
		// confirm is the last step: once it is done the saga is completed
		// and never compensates.
		return fmt.Errorf("bug: saga %s compensating a confirmed order", saga.SagaID)
	default:
		return fmt.Errorf("bug: unhandled saga step %q", step.Name)
	}
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

// renewSagaLease renews lease in a transaction of its own, before work that
// runs outside any transaction (a processor call) or after a wait. Returns
// errSagaLeaseLost if another worker claimed the saga meanwhile.
func (a *App) renewSagaLease(ctx context.Context, lease sagaClaim) error {
	return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		return a.fenceSaga(ctx, tx, lease, a.now())
	})
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

// markStepDone records step as done and moves the saga to the next step (or
// completes it), in the transaction of the step's effect, after fenceSaga.
// If another worker recorded the step first it returns errStepNotPending,
// and the effect rolls back with it; if the saga is no longer in progress
// (another worker turned it to compensation) it returns errSagaLeaseLost:
// a saga never moves back.
func (a *App) markStepDone(ctx context.Context, tx *sql.Tx, lease sagaClaim, step sagaStepRow, result string, now time.Time) error {
	updated, err := tx.ExecContext(ctx, `
		UPDATE saga_steps SET status = ?, attempts = attempts + 1, result = ?, done_at = ?
		WHERE saga_id = ? AND step_index = ? AND status = ?`,
		stepDone, sql.NullString{String: result, Valid: result != ""}, formatTime(now), lease.SagaID, step.Index, stepPending)
	if err != nil {
		return fmt.Errorf("mark step %s done: %w", step.Name, err)
	}
	if err := oneRowOr(updated, errStepNotPending); err != nil {
		return err
	}
	steps := fulfilmentSteps()
	status, next := sagaInProgress, step.Name
	if step.Index+1 < len(steps) {
		next = steps[step.Index+1]
	} else {
		status = sagaCompleted
	}
	advanced, err := tx.ExecContext(ctx, `
		UPDATE saga_instances SET status = ?, current_step = ?, attempts = 0, last_error = NULL, updated_at = ?
		WHERE saga_id = ? AND status = ? AND lease_token = ?`,
		status, next, formatTime(now), lease.SagaID, sagaInProgress, lease.Token)
	if err != nil {
		return fmt.Errorf("advance saga: %w", err)
	}
	return oneRowOr(advanced, errSagaLeaseLost)
}

// markStepCompensated records that step was undone, in the transaction of
// the compensation's effect, after fenceSaga. Returns errStepNotPending if
// it was already, and errSagaLeaseLost if the saga is no longer
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
	recorded, err := tx.ExecContext(ctx, `
		UPDATE saga_instances SET current_step = ?, attempts = 0, last_error = NULL, updated_at = ?
		WHERE saga_id = ? AND status = ? AND lease_token = ?`,
		step.Name, formatTime(now), lease.SagaID, sagaCompensating, lease.Token)
	if err != nil {
		return fmt.Errorf("record compensation: %w", err)
	}
	return oneRowOr(recorded, errSagaLeaseLost)
}

// failStep records that step failed for a business reason and turns the saga
// to compensation. Both writes must match, under the lease: a worker that
// read "pending" before a pause and fails the step now (the stock it wanted
// was taken, by the very worker that took its saga over) must not turn a
// saga that moved on meanwhile to compensation.
func (a *App) failStep(ctx context.Context, lease sagaClaim, saga sagaRow, step sagaStepRow, cause error) error {
	return withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		now := a.now()
		if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
			return err
		}
		failed, err := tx.ExecContext(ctx, `
			UPDATE saga_steps SET status = ?, attempts = attempts + 1, error = ?
			WHERE saga_id = ? AND step_index = ? AND status = ?`,
			stepFailed, cause.Error(), saga.SagaID, step.Index, stepPending)
		if err != nil {
			return fmt.Errorf("mark step %s failed: %w", step.Name, err)
		}
		if err := oneRowOr(failed, errSagaLeaseLost); err != nil {
			return err
		}
		turned, err := tx.ExecContext(ctx, `
			UPDATE saga_instances SET status = ?, failure_reason = ?, attempts = 0, updated_at = ?
			WHERE saga_id = ? AND status = ? AND lease_token = ?`,
			sagaCompensating, cause.Error(), formatTime(now), saga.SagaID, sagaInProgress, lease.Token)
		if err != nil {
			return fmt.Errorf("start compensation: %w", err)
		}
		return oneRowOr(turned, errSagaLeaseLost)
	})
}

// finishCompensation ends a saga whose done steps are all undone, and tells
// the order service through the outbox that the order is cancelled. Fenced:
// OrderCancelled is written only by the worker that holds the saga.
func (a *App) finishCompensation(ctx context.Context, lease sagaClaim, saga sagaRow) error {
	err := withFencedTx(ctx, a.db, func(tx *sql.Tx) error {
		now := a.now()
		if err := a.fenceSaga(ctx, tx, lease, now); err != nil {
			return err
		}
		updated, err := tx.ExecContext(ctx, `
			UPDATE saga_instances SET status = ?, updated_at = ?
			WHERE saga_id = ? AND status = ? AND lease_token = ?`,
			sagaCompensated, formatTime(now), saga.SagaID, sagaCompensating, lease.Token)
		if err != nil {
			return fmt.Errorf("finish compensation: %w", err)
		}
		if err := oneRowOr(updated, errSagaLeaseLost); err != nil {
			return err
		}
		orderCancelled, err := a.newOutboxEvent(eventOrderCancelled, saga.OrderID, orderCancelledPayload{
			OrderID: saga.OrderID,
			Reason:  saga.FailureReason.String,
		})
		if err != nil {
			return err
		}
		return insertOutboxEvent(ctx, tx, orderCancelled, now)
	})
	if err == nil {
		// OrderCancelled is committed: wake the relay.
		a.wake.relay.signal()
	}
	return err
}

// scheduleRetry records a transient failure and releases the saga until its
// next attempt. For a compensation, the maxCompensationAttempts-th failure
// makes the saga compensation_failed instead: an operator must look. Fenced,
// and only from the status the worker read: a stale worker's failure is not
// recorded (errSagaLeaseLost).
func (a *App) scheduleRetry(ctx context.Context, lease sagaClaim, saga sagaRow, cause error, compensating bool) error {
	attempts := saga.Attempts + 1
	status := saga.Status
	if compensating && attempts >= maxCompensationAttempts {
		status = sagaCompensationFailed
	}
	now := a.now()
	updated, err := a.db.ExecContext(ctx, `
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

// setSagaAside releases a saga that failed unexpectedly and makes it due
// again in a minute, its status unchanged. Returns errSagaLeaseLost if
// another worker holds it now.
func (a *App) setSagaAside(ctx context.Context, lease sagaClaim, cause error) error {
	now := a.now()
	updated, err := a.db.ExecContext(ctx, `
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

// releaseSaga gives up lease on a terminal saga. A lease already taken over
// is left alone.
func (a *App) releaseSaga(ctx context.Context, lease sagaClaim) error {
	_, err := a.db.ExecContext(ctx, `
		UPDATE saga_instances SET locked_by = NULL, locked_until = NULL
		WHERE saga_id = ? AND locked_by = ? AND lease_token = ?`,
		lease.SagaID, lease.WorkerID, lease.Token)
	if err != nil {
		return fmt.Errorf("release saga: %w", err)
	}
	return nil
}
