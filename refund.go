// Refunds: an idempotent request that calls another system. Creating an
// order touches only our database, so createOrder is one transaction. A
// refund calls the card processor, and no transaction can span that call; so,
// the way Stripe does it internally, the request is split into atomic phases
// with a recovery point persisted on the idempotency key after each:
//
//	started           the key is claimed; check the order, record a pending refund
//	refund_requested  call the processor with a key derived from ours
//	finished          the response is stored and replays from now on
//
// A request holds a lease on the key (locked_at, locked_by) while it works:
// a second request with the same key gets 409 until the lease passes. Each
// phase checks, in its own transaction, that it still holds the lease: a
// request that was slow enough to be taken over stops instead of recording
// its phase on top of the new holder's. If the process
// dies between phases, the client's retry after the lease, or the completer
// in the worker loop if the client never comes back, resumes at the recovery
// point. The processor's idempotency key makes the resumed call return the
// refund it already made: a refund never happens twice.
//
// Expiry. A refund key replays for idempotencyKeyTTL after its answer, like
// any key; after that, lookupKey forgets it. But money moved under a refund
// key is recorded on the refund row for ever (refunds is UNIQUE on order_id
// and idempotency_key: that is how a resumed request finds its refund). So
// an expired refund key sent again for the order it refunded is refused with
// a stored 422 idempotency-key-expired that names the refund, and nothing
// else happens; the client sends a new key for a new refund. Sent for
// another order, the expired key runs as a new request (Stripe's rule, and
// the rule for creating orders). Expiry only decides what a later request
// sees: the request that did the work answers with what it stored, however
// late it finishes.

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

// recoveryPoint is idempotency_keys.recovery_point.
type recoveryPoint string

const (
	recoveryStarted         recoveryPoint = "started"
	recoveryRefundRequested recoveryPoint = "refund_requested"
	recoveryFinished        recoveryPoint = "finished"
)

// refundRequest is a valid body of POST /api/orders/{id}/refund. A nil
// AmountCents refunds everything that remains.
type refundRequest struct {
	AmountCents *int64 `json:"amount_cents"`
}

// decodeRefundRequest parses and checks a refund body.
func decodeRefundRequest(body []byte) (refundRequest, error) {
	var refund refundRequest
	if err := decodeStrict(body, &refund); err != nil {
		return refundRequest{}, err
	}
	if refund.AmountCents != nil && (*refund.AmountCents <= 0 || *refund.AmountCents > maxAmountCents) {
		return refundRequest{}, invalidField("amount_cents", fmt.Sprintf("must be between 1 and %d", maxAmountCents))
	}
	return refund, nil
}

// refundView is the answer of a successful refund.
type refundView struct {
	RefundID          string    `json:"refund_id"`
	ProcessorRefundID string    `json:"processor_refund_id"`
	AmountCents       int64     `json:"amount_cents"`
	Status            string    `json:"status"`
	Order             orderView `json:"order"`
}

// refundPath returns the API path that refunds orderID.
func refundPath(orderID string) string {
	return "/api/orders/" + orderID + "/refund"
}

// orderIDFromRefundPath is refundPath's inverse.
func orderIDFromRefundPath(path string) (string, bool) {
	orderID, ok := strings.CutPrefix(path, "/api/orders/")
	if !ok {
		return "", false
	}
	return strings.CutSuffix(orderID, "/refund")
}

// errPaymentPending is returned for a refund of an order whose payment is
// still in flight. It is not definitive (in a moment the order is paid or
// cancelled), so nothing is stored and the same key may be retried.
var errPaymentPending = errors.New("the order's payment is still in progress")

// refundOrder refunds an order under an idempotency key, phase by phase.
// Returns errKeyReused, errKeyInProgress, or a transient error (the
// processor timed out: the lease is released and a retry resumes). Business
// refusals (order not paid, amount too large) are definitive: they come back
// as a stored problem response, not as an error.
func (a *App) refundOrder(ctx context.Context, req idempotentRequest, orderID string, refund refundRequest) (apiResponse, error) {
	key, lease, replay, err := a.acquireKey(ctx, req)
	if err != nil {
		return apiResponse{}, err
	}
	if replay != nil {
		return *replay, nil
	}
	if err := a.fault.at(ctx, faultRefundKeyClaimed); err != nil {
		return apiResponse{}, err
	}
	response, err := a.runRefundPhases(ctx, req, lease, key, orderID, refund)
	switch {
	case err == nil, errors.Is(err, errCrash), errors.Is(err, errKeyInProgress):
		return response, err
	case errors.Is(err, errPaymentPending):
		// Nothing happened under the key yet: free it for the retry.
		if err := a.forgetKey(ctx, req, lease); err != nil {
			return apiResponse{}, err
		}
		return apiResponse{}, err
	default:
		// A timeout or a failing database: release the lease, so that the
		// client's retry resumes at the recovery point at once instead of
		// waiting out the lease.
		if releaseErr := a.releaseKey(ctx, req, lease); releaseErr != nil {
			return apiResponse{}, errors.Join(err, releaseErr)
		}
		return apiResponse{}, err
	}
}

// runRefundPhases runs the phases from key's recovery point to the end, and
// returns the answer the last phase stored on the key. It never reads the
// key back: each phase says where it left it. Reading it back would apply
// the expiry rule to the request that did the work (a refund that finished
// after the TTL would find its key "expired", deleted, and answer 500 though
// the money moved), and a new request may take an expired key over the
// moment after the answer is stored.
func (a *App) runRefundPhases(ctx context.Context, req idempotentRequest, lease string, key idempotencyKeyRow, orderID string, refund refundRequest) (apiResponse, error) {
	point := key.RecoveryPoint
	for {
		switch point {
		case recoveryStarted:
			finished, err := a.refundPhaseStarted(ctx, req, lease, orderID, refund)
			if err != nil {
				return apiResponse{}, err
			}
			if finished != nil {
				return *finished, nil
			}
			if err := a.fault.at(ctx, faultRefundStarted); err != nil {
				return apiResponse{}, err
			}
			point = recoveryRefundRequested
		case recoveryRefundRequested:
			return a.refundPhaseRequested(ctx, req, lease, orderID)
		default:
			// acquireKey replays a finished key; it never gets here.
			return apiResponse{}, fmt.Errorf("bug: unhandled recovery point %q", point)
		}
	}
}

// acquireKey claims req's key, or takes over its lease if the lease has
// passed, and returns the key and the new lease token. It returns the stored
// response instead if the key is finished, errKeyInProgress while another
// request holds a fresh lease (or the key changed between reading and
// taking it), and errKeyReused if the key belongs to another request.
//
// It claims under keyTx, the one lock discipline of every key claim: on
// PostgreSQL a refund and an order creation sent at once with the same key
// wait for each other on the key's advisory lock, and the second finds the
// first's key (422 or a replay) instead of both inserting it (a unique
// violation, which was a 500).
func (a *App) acquireKey(ctx context.Context, req idempotentRequest) (idempotencyKeyRow, string, *apiResponse, error) {
	var key idempotencyKeyRow
	var replay *apiResponse
	lease := a.newID("lease")
	err := keyTx(ctx, a.db, req.UserID, req.IdempotencyKey, func(tx *sql.Tx) error {
		// keyTx may run this again: start from nothing.
		replay = nil
		now := a.now()
		var err error
		key, err = lookupKey(ctx, tx, req.UserID, req.IdempotencyKey, now)
		switch {
		case errors.Is(err, errKeyNotFound):
			if err := insertKey(ctx, tx, req, recoveryStarted, lease, now); err != nil {
				return err
			}
			key, err = lookupKey(ctx, tx, req.UserID, req.IdempotencyKey, now)
			return err
		case err != nil:
			return err
		}
		if err := checkSameRequest(key, req); err != nil {
			return err
		}
		if key.RecoveryPoint == recoveryFinished {
			response := key.response()
			replay = &response
			return nil
		}
		// A key the completer set aside (locked_at without locked_by) is
		// held by nobody: the client's own retry takes it at once.
		if key.LockedBy.Valid && key.LockedAt.Valid && key.LockedAt.String > formatTime(now.Add(-a.leases.refundLock)) {
			return errKeyInProgress
		}
		// Take it over only as it was read. On PostgreSQL this transaction
		// runs READ COMMITTED (keyTx) and a phase of the old holder may
		// have committed since: taking the key over anyway would resume
		// this request at a recovery point the key has already passed.
		result, err := tx.ExecContext(ctx, `
			UPDATE idempotency_keys SET locked_at = ?, locked_by = ?
			WHERE user_id = ? AND idempotency_key = ? AND recovery_point = ? AND COALESCE(locked_by, '') = ?`,
			formatTime(now), lease, req.UserID, req.IdempotencyKey, key.RecoveryPoint, key.LockedBy.String)
		if err != nil {
			return fmt.Errorf("take over idempotency key: %w", err)
		}
		n, err := result.RowsAffected()
		if err != nil {
			return fmt.Errorf("take over idempotency key: %w", err)
		}
		if n != 1 {
			return errKeyInProgress
		}
		return nil
	})
	return key, lease, replay, err
}

// holdsLease returns errKeyInProgress unless lease still holds req's key.
// Called first in every phase's transaction: the write lock keeps the
// answer true until the phase commits.
func holdsLease(ctx context.Context, tx *sql.Tx, req idempotentRequest, lease string) error {
	var lockedBy sql.NullString
	err := tx.QueryRowContext(ctx, `
		SELECT locked_by FROM idempotency_keys WHERE user_id = ? AND idempotency_key = ?`,
		req.UserID, req.IdempotencyKey).Scan(&lockedBy)
	if errors.Is(err, sql.ErrNoRows) {
		return errKeyInProgress
	}
	if err != nil {
		return fmt.Errorf("read lease: %w", err)
	}
	if lockedBy.String != lease {
		return errKeyInProgress
	}
	return nil
}

// setRecoveryPoint moves a key to its next phase, in the transaction of the
// phase's writes.
func setRecoveryPoint(ctx context.Context, tx *sql.Tx, req idempotentRequest, point recoveryPoint) error {
	_, err := tx.ExecContext(ctx, `
		UPDATE idempotency_keys SET recovery_point = ? WHERE user_id = ? AND idempotency_key = ?`,
		point, req.UserID, req.IdempotencyKey)
	if err != nil {
		return fmt.Errorf("set recovery point %s: %w", point, err)
	}
	return nil
}

// releaseKey drops lease after a failure, so the client's retry resumes at
// once instead of waiting out refundLockTimeout. A lease already taken over
// is left alone.
func (a *App) releaseKey(ctx context.Context, req idempotentRequest, lease string) error {
	_, err := a.db.ExecContext(ctx, `
		UPDATE idempotency_keys SET locked_at = NULL, locked_by = NULL
		WHERE user_id = ? AND idempotency_key = ? AND locked_by = ?`,
		req.UserID, req.IdempotencyKey, lease)
	if err != nil {
		return fmt.Errorf("release idempotency key: %w", err)
	}
	return nil
}

// forgetKey deletes a key that lease holds at its first recovery point,
// when the request turned out to be too early to do anything.
func (a *App) forgetKey(ctx context.Context, req idempotentRequest, lease string) error {
	_, err := a.db.ExecContext(ctx, `
		DELETE FROM idempotency_keys
		WHERE user_id = ? AND idempotency_key = ? AND recovery_point = ? AND locked_by = ?`,
		req.UserID, req.IdempotencyKey, recoveryStarted, lease)
	if err != nil {
		return fmt.Errorf("forget idempotency key: %w", err)
	}
	return nil
}

// refundPhaseStarted checks the order and records a pending refund, or
// stores a definitive refusal on the key and returns it (the request's
// answer). Counting pending refunds in what remains means two refunds in
// flight under different keys can never together exceed the charge.
// Returns errPaymentPending if the order is not paid yet, errKeyInProgress
// if lease no longer holds the key.
func (a *App) refundPhaseStarted(ctx context.Context, req idempotentRequest, lease, orderID string, refund refundRequest) (*apiResponse, error) {
	var finished *apiResponse
	err := withTx(ctx, a.db, func(tx *sql.Tx) error {
		finished = nil // withTx may run this again
		if err := holdsLease(ctx, tx, req, lease); err != nil {
			return err
		}
		now := a.now()
		refuse := func(p problem) error {
			response := problemResponse(p)
			finished = &response
			return completeKey(ctx, tx, req.UserID, req.IdempotencyKey, response, now)
		}
		order, err := readOrder(ctx, tx, orderID)
		if errors.Is(err, errOrderNotFound) || (err == nil && order.UserID != req.UserID) {
			return refuse(problem{
				Type: problemNotFound, Title: "Order not found", Status: 404,
				Detail: fmt.Sprintf("no order %s", orderID),
			})
		}
		if err != nil {
			return err
		}
		// A refund of this order under this key can exist only if the key
		// made it in an earlier life and then expired (the phase that
		// records a refund moves the key past started in the same
		// transaction). See "Expiry" at the top of this file.
		var earlier struct{ refundID, createdAt, settledAt string }
		err = tx.QueryRowContext(ctx, `
			SELECT refund_id, created_at, updated_at FROM refunds WHERE order_id = ? AND idempotency_key = ?`,
			orderID, req.IdempotencyKey).Scan(&earlier.refundID, &earlier.createdAt, &earlier.settledAt)
		switch {
		case err == nil:
			return refuse(expiredRefundKeyProblem(req.IdempotencyKey, earlier.refundID, earlier.createdAt, earlier.settledAt))
		case errors.Is(err, sql.ErrNoRows):
		default:
			return fmt.Errorf("look up an earlier refund under the key: %w", err)
		}
		if order.Status == orderCreated {
			return errPaymentPending
		}
		if order.Status != orderPaid {
			return refuse(problem{
				Type: problemOrderNotRefundable, Title: "Order is not refundable", Status: 409,
				Detail: fmt.Sprintf("order %s is %s; only a paid order can be refunded", orderID, order.Status),
			})
		}
		var committed int64
		err = tx.QueryRowContext(ctx, `
			SELECT COALESCE(SUM(amount_cents), 0) FROM refunds WHERE order_id = ? AND status IN ('pending', 'succeeded')`,
			orderID).Scan(&committed)
		if err != nil {
			return fmt.Errorf("sum refunds: %w", err)
		}
		remaining := order.AmountCents - committed
		amount := remaining
		if refund.AmountCents != nil {
			amount = *refund.AmountCents
		}
		if amount <= 0 || amount > remaining {
			return refuse(problem{
				Type: problemRefundTooLarge, Title: "Refund exceeds what remains", Status: 422,
				Detail: fmt.Sprintf("asked to refund %d; %d of %d remains refundable", amount, remaining, order.AmountCents),
			})
		}
		_, err = tx.ExecContext(ctx, `
			INSERT INTO refunds (refund_id, order_id, amount_cents, status, source, idempotency_key, created_at, updated_at)
			VALUES (?, ?, ?, 'pending', 'api', ?, ?, ?)`,
			a.newID("rf"), orderID, amount, req.IdempotencyKey, formatTime(now), formatTime(now))
		if isUniqueViolation(err) {
			// A refund of this order under this key committed since this
			// transaction's lease check: a retry that took the key over
			// (on PostgreSQL; SQLite's one writer rules it out). The key
			// is no longer this request's.
			return errKeyInProgress
		}
		if err != nil {
			return fmt.Errorf("insert refund: %w", err)
		}
		return setRecoveryPoint(ctx, tx, req, recoveryRefundRequested)
	})
	return finished, err
}

// expiredRefundKeyProblem is the answer to an expired key sent again for the
// order it refunded: refundID, made at createdAt and settled at settledAt
// (stored times). The key expired idempotencyKeyTTL after the refund
// settled, since the key's answer is stored in the same transaction.
func expiredRefundKeyProblem(idempotencyKey, refundID, createdAt, settledAt string) problem {
	made, expired := createdAt, settledAt
	if t, err := time.Parse(timeFormat, createdAt); err == nil {
		made = t.Format(time.RFC3339)
	}
	if t, err := time.Parse(timeFormat, settledAt); err == nil {
		expired = t.Add(idempotencyKeyTTL).Format(time.RFC3339)
	}
	return problem{
		Type: problemKeyExpired, Title: "Idempotency key expired", Status: 422,
		Detail: fmt.Sprintf("key %s made refund %s of this order on %s and expired at %s; send a new key for a new refund",
			idempotencyKey, refundID, made, expired),
	}
}

// refundPhaseRequested calls the processor for the pending refund, records
// the outcome, and returns the answer it stored on the key. Its processor
// key is derived from our refund id, so a resumed call returns the refund
// already made. Returns errKeyInProgress if lease no longer holds the key,
// errProcessorTimeout if the processor's answer was lost.
func (a *App) refundPhaseRequested(ctx context.Context, req idempotentRequest, lease, orderID string) (apiResponse, error) {
	var refundID string
	var amount int64
	err := a.db.QueryRowContext(ctx, `
		SELECT refund_id, amount_cents FROM refunds WHERE order_id = ? AND idempotency_key = ?`,
		orderID, req.IdempotencyKey).Scan(&refundID, &amount)
	if err != nil {
		return apiResponse{}, fmt.Errorf("read refund of %s: %w", orderID, err)
	}
	order, err := readOrder(ctx, a.db, orderID)
	if err != nil {
		return apiResponse{}, err
	}

	processorRefundID, err := a.processor.refund(ctx, "refund:"+refundID, order.ChargeID.String, amount)
	switch {
	case err == nil:
	case errors.Is(err, errCrash):
		return apiResponse{}, err
	case errors.Is(err, errRefundExceedsCharge), errors.Is(err, errProcessorKeyReused):
		refused := problemResponse(problem{
			Type: problemProcessorRefused, Title: "The processor refused the refund", Status: 422,
			Detail: err.Error(),
		})
		err := withTx(ctx, a.db, func(tx *sql.Tx) error {
			if err := holdsLease(ctx, tx, req, lease); err != nil {
				return err
			}
			now := a.now()
			if err := setRefundStatus(ctx, tx, refundID, "failed", sql.NullString{}, now); err != nil {
				return err
			}
			return completeKey(ctx, tx, req.UserID, req.IdempotencyKey, refused, now)
		})
		if err != nil {
			return apiResponse{}, err
		}
		return refused, nil
	default:
		// A timeout: the refund may have happened. The retry (or the
		// completer) asks again with the same key and learns which.
		return apiResponse{}, err
	}
	if err := a.fault.at(ctx, faultRefundAfterProcessor); err != nil {
		return apiResponse{}, err
	}

	var succeeded apiResponse
	err = withTx(ctx, a.db, func(tx *sql.Tx) error {
		if err := holdsLease(ctx, tx, req, lease); err != nil {
			return err
		}
		now := a.now()
		if err := setRefundStatus(ctx, tx, refundID, "succeeded", sql.NullString{String: processorRefundID, Valid: true}, now); err != nil {
			return err
		}
		if err := addRefundToOrder(ctx, tx, orderID, amount, now); err != nil {
			return err
		}
		orderRefunded, err := a.newOutboxEvent(eventOrderRefunded, orderID, orderRefundedPayload{
			OrderID: orderID, RefundID: refundID, AmountCents: amount,
		})
		if err != nil {
			return err
		}
		if err := insertOutboxEvent(ctx, tx, orderRefunded, now); err != nil {
			return err
		}
		updated, err := readOrder(ctx, tx, orderID)
		if err != nil {
			return err
		}
		body, err := json.Marshal(refundView{RefundID: refundID, ProcessorRefundID: processorRefundID, AmountCents: amount, Status: "succeeded", Order: updated.view()})
		if err != nil {
			return fmt.Errorf("encode refund: %w", err)
		}
		succeeded = apiResponse{Status: 200, Body: body}
		return completeKey(ctx, tx, req.UserID, req.IdempotencyKey, succeeded, now)
	})
	if err != nil {
		return apiResponse{}, err
	}
	// OrderRefunded is committed: wake the relay.
	a.wake.outboxWritten()
	return succeeded, nil
}

// setRefundStatus settles a pending refund. It returns an error if the
// refund is not pending: settling it twice would count its money twice.
func setRefundStatus(ctx context.Context, tx *sql.Tx, refundID, status string, processorRefundID sql.NullString, now time.Time) error {
	result, err := tx.ExecContext(ctx, `
		UPDATE refunds SET status = ?, processor_refund_id = ?, updated_at = ? WHERE refund_id = ? AND status = 'pending'`,
		status, processorRefundID, formatTime(now), refundID)
	if err != nil {
		return fmt.Errorf("settle refund %s: %w", refundID, err)
	}
	n, err := result.RowsAffected()
	if err != nil {
		return fmt.Errorf("settle refund %s: %w", refundID, err)
	}
	if n != 1 {
		return fmt.Errorf("bug: refund %s is no longer pending while its key is still leased", refundID)
	}
	return nil
}

// addRefundToOrder adds a refunded amount to an order; the order becomes
// refunded when nothing remains.
func addRefundToOrder(ctx context.Context, tx *sql.Tx, orderID string, amount int64, now time.Time) error {
	_, err := tx.ExecContext(ctx, `
		UPDATE orders
		SET refunded_cents = refunded_cents + ?,
		    status = CASE WHEN refunded_cents + ? >= amount_cents THEN 'refunded' ELSE status END,
		    updated_at = ?
		WHERE order_id = ?`,
		amount, amount, formatTime(now), orderID)
	if err != nil {
		return fmt.Errorf("add refund to order %s: %w", orderID, err)
	}
	return nil
}

// completeRefundsOnce finishes up to max refund keys whose request was
// abandoned: not finished, and either released after a transient failure or
// leased by a request that has not been heard from for refundLockTimeout.
// It returns how many it finished, and every key it failed on, joined: one
// key that cannot be finished (a bug, a damaged row) must not stop the
// others, whose pending refunds hold back what their orders can still
// refund and make charge.refunded webhooks for those orders wait. A key it
// fails on, or whose processor call times out, is set aside for
// refundLockTimeout (setRefundKeyAside), so it does not come back at the
// head of every pass and take the place of keys that can be finished.
func (a *App) completeRefundsOnce(ctx context.Context, max int) (int, error) {
	now := a.now()
	rows, err := a.db.QueryContext(ctx, `
		SELECT user_id, idempotency_key, request_method, request_path, request_params
		FROM idempotency_keys
		WHERE recovery_point <> 'finished' AND (locked_at IS NULL OR locked_at <= ?)
		-- Longest waiting first: a key set aside a moment ago goes after
		-- those abandoned before it.
		ORDER BY COALESCE(locked_at, created_at)
		LIMIT ?`, formatTime(now.Add(-a.leases.refundLock)), max)
	if err != nil {
		return 0, fmt.Errorf("find abandoned keys: %w", err)
	}
	var abandoned []idempotentRequest
	for rows.Next() {
		var req idempotentRequest
		if err := rows.Scan(&req.UserID, &req.IdempotencyKey, &req.Method, &req.Path, &req.CanonicalBody); err != nil {
			rows.Close()
			return 0, fmt.Errorf("scan abandoned key: %w", err)
		}
		abandoned = append(abandoned, req)
	}
	if err := rows.Close(); err != nil {
		return 0, fmt.Errorf("find abandoned keys: %w", err)
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("find abandoned keys: %w", err)
	}

	finished := 0
	var failures []error
	for _, req := range abandoned {
		err := a.completeRefund(ctx, req)
		orderID, _ := orderIDFromRefundPath(req.Path)
		if err == nil {
			a.log.Info("refund completer", "order_id", orderID, "user_id", req.UserID, "idempotency_key", req.IdempotencyKey, "outcome", "finished")
		} else {
			a.log.Warn("refund completer", "order_id", orderID, "user_id", req.UserID, "idempotency_key", req.IdempotencyKey, "outcome", "not finished", "error", err.Error())
		}
		switch {
		case err == nil:
			finished++
			continue
		case errors.Is(err, errCrash):
			return finished, err
		case errors.Is(err, errKeyInProgress), errors.Is(err, errRefundFinishedElsewhere), errors.Is(err, errPaymentPending):
			// A client's retry took it over, or someone finished it
			// meanwhile; or the order turned out not to be paid yet, and
			// the key was forgotten for the retry.
			continue
		case errors.Is(err, errProcessorTimeout):
			// Transient, and not a failure to report; but a processor that
			// keeps timing out must not be asked again on every pass.
		default:
			failures = append(failures, fmt.Errorf("complete refund %s of %s: %w", req.IdempotencyKey, req.UserID, err))
		}
		if err := a.setRefundKeyAside(ctx, req); err != nil {
			return finished, errors.Join(append(failures, err)...)
		}
	}
	return finished, errors.Join(failures...)
}

// errRefundFinishedElsewhere is returned by completeRefund for a key that
// was finished when it came to it: between the read that found it
// unfinished and now, someone else finished it (the client's retry, the
// completer or another refund finish). The answer stored on the key is
// theirs, and so is the finish: without it, two refund finish runs at once
// both logged the same refund as finished.
var errRefundFinishedElsewhere = errors.New("finished meanwhile by someone else (the client's retry, the completer or another refund finish), nothing done")

// completeRefund finishes the refund of one abandoned key, as the client's
// retry would. Returns refundOrder's errors, errRefundFinishedElsewhere if
// the key was finished meanwhile, or a bug error if the key's stored
// request is not a refund.
func (a *App) completeRefund(ctx context.Context, req idempotentRequest) error {
	orderID, ok := orderIDFromRefundPath(req.Path)
	if !ok {
		return fmt.Errorf("bug: unfinished idempotency key for %s %s", req.Method, req.Path)
	}
	refund, err := decodeRefundRequest(req.CanonicalBody)
	if err != nil {
		return fmt.Errorf("bug: stored refund request does not decode: %w", err)
	}
	response, err := a.refundOrder(ctx, req, orderID, refund)
	if err == nil && response.Replayed {
		return errRefundFinishedElsewhere
	}
	return err
}

// setRefundKeyAside keeps the completer away from req's key for
// refundLockTimeout after it failed on it: locked_at says when it last
// tried, and locked_by stays NULL, so nobody holds the key and the client's
// own retry may still take it at once (acquireKey). A key that a request
// has leased since is left alone.
func (a *App) setRefundKeyAside(ctx context.Context, req idempotentRequest) error {
	now := a.now()
	_, err := a.db.ExecContext(ctx, `
		UPDATE idempotency_keys SET locked_at = ?, locked_by = NULL
		WHERE user_id = ? AND idempotency_key = ? AND recovery_point <> 'finished'
		  AND (locked_by IS NULL OR locked_at <= ?)`,
		formatTime(now), req.UserID, req.IdempotencyKey, formatTime(now.Add(-a.leases.refundLock)))
	if err != nil {
		return fmt.Errorf("set refund key %s aside: %w", req.IdempotencyKey, err)
	}
	return nil
}
