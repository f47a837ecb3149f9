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
	"sort"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"
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
// (the effect half of the article's consume_order_created()):
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
	// The steps run later, each in a span of its own that links to the
	// message's creation context: the saga keeps it.
	traceparent, tracestate := msg.Trace.columns()
	_, err := tx.ExecContext(ctx, `
		INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at,
		                            traceparent, tracestate)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		sagaID, payload.OrderID, sagaInProgress, steps[0], now, now, now, traceparent, tracestate)
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
	var traceparent, tracestate sql.NullString
	err := q.QueryRowContext(ctx, `
		SELECT saga_id, order_id, status, current_step, attempts, failure_reason, last_error, traceparent, tracestate
		FROM saga_instances WHERE saga_id = ?`, sagaID,
	).Scan(&saga.SagaID, &saga.OrderID, &saga.Status, &saga.CurrentStep, &saga.Attempts, &saga.FailureReason, &saga.LastError,
		&traceparent, &tracestate)
	if err != nil {
		return sagaRow{}, nil, fmt.Errorf("read saga %s: %w", sagaID, err)
	}
	saga.Trace = traceContextFrom(traceparent, tracestate)
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
// (sagaStepIn). One commit per round, not one per saga and step.
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
		round := runs
		runs, err = a.sagaRound(ctx, round, &failures)
		failSagaSpans(round, err)
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
	// step is the step this round runs (in progress) or undoes
	// (compensating); ok is false when there is none.
	step   sagaStepRow
	stepOK bool
	// unexpected is set when the saga cannot go on at all (a bug, a
	// broken row): it is set aside.
	unexpected error
	// called: the processor was called for step this round; chargeID and
	// callErr are its answer.
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

// sagaRound reads every saga in runs, makes the round's processor calls,
// then runs every saga's step in one transaction, and returns the sagas
// that go on. Every write is fenced by its saga's lease (fenceSaga, in the
// write's own savepoint), and a status only moves forward (in_progress ->
// completed, or in_progress -> compensating -> compensated |
// compensation_failed): a worker acting on what it read before a pause can
// neither record a step over another worker's nor pull a saga back.
//
// A saga that fails unexpectedly (a bug, a broken row) is set aside for a
// minute and reported in failures; it does not hold up the others. Returns
// an error only when the worker must stop: errCrash, or the database
// failing (nothing of the round's transaction is committed then; the sagas
// come back when their leases pass).
func (a *App) sagaRound(ctx context.Context, runs []*sagaRun, failures *[]error) ([]*sagaRun, error) {
	for _, run := range runs {
		a.readSagaRun(ctx, run)
		a.startSagaSpan(ctx, run)
		if err := a.fault.at(ctx, faultBeforeStep); err != nil {
			return nil, err
		}
	}
	if err := a.sagaCalls(ctx, runs); err != nil {
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
		return nil, err
	}
	var again []*sagaRun
	wroteEvent := false
	for i, run := range runs {
		endSagaSpan(run, nexts[i])
		log := withTraceID(a.log, run.span.SpanContext())
		switch {
		case run.stepOK:
			log.Info("saga step", "saga_id", run.lease.SagaID, "order_id", run.saga.OrderID, "saga_status", string(run.saga.Status),
				"step", run.step.Name, "then", nexts[i].String())
		case run.saga.Status == sagaCompensating && nexts[i] == sagaWroteEvent:
			// Every step undone: finishCompensation wrote OrderCancelled.
			log.Info("saga compensated", "saga_id", run.lease.SagaID, "order_id", run.saga.OrderID, "then", nexts[i].String())
		}
		switch {
		case nexts[i] == sagaCompensatedStep:
			a.metrics.compensated(run.step.Name)
		case nexts[i] == sagaWroteEvent && run.saga.Status == sagaInProgress:
			// The last step ran: the saga completed.
			a.metrics.sagaEnded(sagaCompleted)
		case nexts[i] == sagaWroteEvent:
			// Every step undone: the saga is compensated.
			a.metrics.sagaEnded(sagaCompensated)
		}
		if asides[i] != nil {
			*failures = append(*failures, fmt.Errorf("saga %s: %w", run.lease.SagaID, asides[i]))
		}
		// The next round's processor call needs no renewal of its own
		// right after a commit that renewed the lease.
		run.renewed = nexts[i] == sagaStepDone
		switch nexts[i] {
		case sagaAgain, sagaStepDone:
			again = append(again, run)
		case sagaCompensatedStep:
			if err := a.fault.at(ctx, faultMidCompensation); err != nil {
				return nil, err
			}
			again = append(again, run)
		case sagaLeft:
		case sagaWroteEvent:
			wroteEvent = true
		default:
			return nil, fmt.Errorf("bug: unhandled saga next %d", nexts[i])
		}
	}
	if wroteEvent {
		// PaymentCaptured or OrderCancelled is committed: the relay need
		// not wait for its next poll to tell the order service.
		a.wake.relay.signal()
	}
	return again, nil
}

// readSagaRun reads run's saga and steps afresh (and its order the first
// time), and picks the step this round runs or undoes. A saga that cannot
// be read (a broken row; or the database failing, which setting it aside
// then finds out) gets run.unexpected.
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
	switch saga.Status {
	case sagaInProgress:
		run.step, run.stepOK = firstStepWith(steps, stepPending)
		if !run.stepOK {
			run.unexpected = fmt.Errorf("bug: saga %s in progress with no pending step", saga.SagaID)
		}
	case sagaCompensating:
		if a.without == layerSaga {
			// demo --without saga: nothing is undone, the saga just ends
			// (demo_without.go).
			break
		}
		// Compensation runs in reverse.
		run.step, run.stepOK = lastStepWith(steps, stepDone)
	case sagaCompleted, sagaCompensated, sagaCompensationFailed:
	default:
		run.unexpected = fmt.Errorf("bug: unhandled saga status %q", saga.Status)
	}
}

// sagaCalls makes the round's processor calls: the charge of every saga
// at charge_card, the refund of every saga compensating it. They are calls
// to another system and run outside any transaction, only while the lease
// holds, and with keys derived from the saga, so a second worker that took
// a saga over asks for the same charge or refund. The leases are renewed
// first, in one transaction for all the calls, except those the last
// round's commit renewed (a saga whose reserve_stock it recorded). A saga
// whose lease is gone gets callErr errSagaLeaseLost and no call.
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
		ctx := trace.ContextWithSpan(ctx, run.span)
		if run.saga.Status == sagaInProgress {
			run.chargeID, run.callErr = a.processor.charge(ctx, chargeRequest{
				IdempotencyKey: chargeKey(run.saga.SagaID),
				OrderID:        run.order.OrderID,
				AmountCents:    run.order.AmountCents,
				Currency:       run.order.Currency,
				PaymentMethod:  run.order.PaymentMethod,
			})
		} else {
			_, run.callErr = a.processor.refund(ctx, refundKey(run.saga.SagaID), run.step.Result.String, run.order.AmountCents)
		}
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
// the other sagas' steps in tx stand; its failure is then recorded in tx:
// a business failure turns the saga to compensation (failStep), a
// transient one schedules the next attempt (scheduleRetry).
//
// Returns an error only when tx must roll back (errCrash, the context
// ended, the database failed or must retry the transaction).
func (a *App) sagaStepIn(ctx context.Context, tx *sql.Tx, run *sagaRun) (sagaNext, error) {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT saga_step`); err != nil {
		return sagaLeft, fmt.Errorf("savepoint: %w", err)
	}
	next, err := a.sagaStep(ctx, tx, run)
	if err != nil {
		if _, rollbackErr := tx.ExecContext(ctx, `ROLLBACK TO saga_step`); rollbackErr != nil {
			// SQLite already rolled the whole transaction back (a full
			// disk, SQLITE_FULL): the cause, not the missing savepoint,
			// says the failure is transient.
			return sagaLeft, fmt.Errorf("rollback to savepoint after %w: %v", err, rollbackErr)
		}
	}
	if _, releaseErr := tx.ExecContext(ctx, `RELEASE saga_step`); releaseErr != nil {
		return sagaLeft, fmt.Errorf("release savepoint: %w", releaseErr)
	}
	switch {
	case err == nil:
		return next, nil
	case errors.Is(err, errCrash), ctx.Err() != nil, dialectOf(a.db).retryTx(err), isBusy(err), isDatabaseUnavailable(err):
		return sagaLeft, err
	case errors.Is(err, errStepNotPending):
		// Recorded by another worker first: read the saga again.
		return sagaAgain, nil
	case errors.Is(err, errSagaLeaseLost):
		// Another worker has the saga now: leave it to them.
		return sagaLeft, nil
	case run.saga.Status == sagaInProgress && isBusinessFailure(err):
		err := a.failStep(ctx, tx, run.lease, run.saga, run.step, err)
		return sagaAgainUnlessLost(err)
	case run.saga.Status == sagaInProgress:
		// Transient (a timeout, a busy processor): try again later. A
		// charge that timed out may have happened, so giving up and
		// compensating would need the charge's id we do not have;
		// retrying with the same key is what finds it.
		return sagaLeftUnlessFailed(a.scheduleRetry(ctx, tx, run.lease, run.saga, err, false))
	default:
		// A compensation can fail too. Retry it, and after
		// maxCompensationAttempts stop and leave it to an operator.
		return sagaLeftUnlessFailed(a.scheduleRetry(ctx, tx, run.lease, run.saga, err, true))
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

// sagaStep runs run's step in tx, or records the processor's answer to it.
// Each local effect commits with the step's record, fenced by the lease.
func (a *App) sagaStep(ctx context.Context, tx *sql.Tx, run *sagaRun) (sagaNext, error) {
	if run.called && run.callErr != nil {
		return sagaLeft, run.callErr
	}
	now := a.now()
	switch run.saga.Status {
	case sagaInProgress:
		if err := a.fenceSaga(ctx, tx, run.lease, now); err != nil {
			return sagaLeft, err
		}
		return a.runStep(ctx, tx, run, now)
	case sagaCompensating:
		if err := a.fenceSaga(ctx, tx, run.lease, now); err != nil {
			return sagaLeft, err
		}
		if !run.stepOK {
			// Every done step is undone.
			if err := a.finishCompensation(ctx, tx, run.lease, run.saga, now); err != nil {
				return sagaLeft, err
			}
			return sagaWroteEvent, nil
		}
		if err := a.compensateStep(ctx, tx, run, now); err != nil {
			return sagaLeft, err
		}
		return sagaCompensatedStep, nil
	case sagaCompleted, sagaCompensated, sagaCompensationFailed:
		// Ended by another worker since this one's claim.
		return sagaLeft, releaseSaga(ctx, tx, run.lease)
	default:
		return sagaLeft, fmt.Errorf("bug: unhandled saga status %q", run.saga.Status)
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

// runStep runs run's pending forward step in tx, after fenceSaga: a local
// effect commits with the step's record. The charge itself happened at the
// processor (sagaCalls), outside any transaction: here it is recorded.
func (a *App) runStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) (sagaNext, error) {
	switch run.step.Name {
	case stepReserveStock:
		if err := reserveStock(ctx, tx, run.order, now); err != nil {
			return sagaLeft, err
		}
		if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
			return sagaLeft, err
		}
		return sagaStepDone, a.markStepDone(ctx, tx, run.lease, run.step, "", now)
	case stepChargeCard:
		if !run.called {
			return sagaLeft, fmt.Errorf("bug: saga %s records a charge it did not ask for", run.saga.SagaID)
		}
		return sagaStepDone, a.markStepDone(ctx, tx, run.lease, run.step, run.chargeID, now)
	case stepConfirm:
		charge, ok := firstStepNamed(run.steps, stepChargeCard)
		if !ok || !charge.Result.Valid {
			return sagaLeft, fmt.Errorf("bug: saga %s confirms without a charge", run.saga.SagaID)
		}
		if err := settleReservations(ctx, tx, run.order.OrderID, stockSold, now); err != nil {
			return sagaLeft, err
		}
		// The payment result leaves through the outbox, in the same
		// transaction that records it; the order service applies it.
		paymentCaptured, err := a.newOutboxEvent(eventPaymentCaptured, run.order.OrderID, paymentCapturedPayload{
			OrderID:     run.order.OrderID,
			ChargeID:    charge.Result.String,
			AmountCents: run.order.AmountCents,
		})
		if err != nil {
			return sagaLeft, err
		}
		if err := insertOutboxEvent(ctx, tx, paymentCaptured, now); err != nil {
			return sagaLeft, err
		}
		if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
			return sagaLeft, err
		}
		// The last step: this completes the saga.
		return sagaWroteEvent, a.markStepDone(ctx, tx, run.lease, run.step, "", now)
	default:
		return sagaLeft, fmt.Errorf("bug: unhandled saga step %q", run.step.Name)
	}
}

// compensateStep undoes run's last done step in tx, after fenceSaga: one
// step of the article's compensate(), which finishCompensation ends. A
// local compensation commits with its record; the refund happened at the
// processor (sagaCalls) under an idempotency key, so a crash between the
// refund and its record refunds once on resume.
func (a *App) compensateStep(ctx context.Context, tx *sql.Tx, run *sagaRun, now time.Time) error {
	switch run.step.Name {
	case stepReserveStock:
		if err := settleReservations(ctx, tx, run.order.OrderID, stockReleased, now); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterStepEffect); err != nil {
			return err
		}
		return a.markStepCompensated(ctx, tx, run.lease, run.step, now)
	case stepChargeCard:
		if !run.called {
			return fmt.Errorf("bug: saga %s records a refund it did not ask for", run.saga.SagaID)
		}
		return a.markStepCompensated(ctx, tx, run.lease, run.step, now)
	case stepConfirm:
		// confirm is the last step: once it is done the saga is completed
		// and never compensates.
		return fmt.Errorf("bug: saga %s compensating a confirmed order", run.saga.SagaID)
	default:
		return fmt.Errorf("bug: unhandled saga step %q", run.step.Name)
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
// completes it, and releases it: a completed saga needs no lease), in the
// transaction of the step's effect, after fenceSaga. If another worker
// recorded the step first it returns errStepNotPending, and the effect
// rolls back with it; if the saga is no longer in progress (another worker
// turned it to compensation) it returns errSagaLeaseLost: a saga never
// moves back.
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
	if err := oneRowOr(advanced, errSagaLeaseLost); err != nil {
		return err
	}
	if status == sagaCompleted {
		return releaseSaga(ctx, tx, lease)
	}
	return nil
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

// failStep records in tx that step failed for a business reason and turns
// the saga to compensation. Both writes must match, under the lease: a
// worker that read "pending" before a pause and fails the step now (the
// stock it wanted was taken, by the very worker that took its saga over)
// must not turn a saga that moved on meanwhile to compensation.
func (a *App) failStep(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, step sagaStepRow, cause error) error {
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
}

// finishCompensation ends, in tx after fenceSaga, a saga whose done steps
// are all undone, releases it, and tells the order service through the
// outbox that the order is cancelled. Fenced: OrderCancelled is written
// only by the worker that holds the saga.
func (a *App) finishCompensation(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, now time.Time) error {
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
	// A compensated saga needs no lease.
	if err := releaseSaga(ctx, tx, lease); err != nil {
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
}

// scheduleRetry records in tx a transient failure and releases the saga
// until its next attempt. For a compensation, the
// maxCompensationAttempts-th failure makes the saga compensation_failed
// instead: an operator must look. Fenced, and only from the status the
// worker read: a stale worker's failure is not recorded (errSagaLeaseLost).
func (a *App) scheduleRetry(ctx context.Context, tx *sql.Tx, lease sagaClaim, saga sagaRow, cause error, compensating bool) error {
	attempts := saga.Attempts + 1
	status := saga.Status
	if compensating && attempts >= maxCompensationAttempts {
		status = sagaCompensationFailed
	}
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
