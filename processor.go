// The fake card processor: an outside system, run in process with its own
// ledger (processor_charges, processor_refunds) so audits can compare what
// we think we charged with what the processor did. It honours idempotency
// keys the way Stripe does: the same key returns the original result without
// charging again; the same key with other parameters is an error.
//
// Test payment methods:
//   - pm_card_visa succeeds;
//   - pm_card_chargeDeclined is declined;
//   - pm_card_timeout charges, then loses the first response: the caller
//     sees a timeout and cannot tell whether money moved. The only safe
//     retry is one with the same key (the second article's scenario).

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Test payment methods.
const (
	pmCardVisa     = "pm_card_visa"
	pmCardDeclined = "pm_card_chargeDeclined"
	pmCardTimeout  = "pm_card_timeout"
)

// Processor answers.
var (
	// errCardDeclined: the charge was refused; a definitive business outcome.
	errCardDeclined = errors.New("card declined")
	// errProcessorTimeout: no answer came back. The work may or may not have
	// happened; retry with the same idempotency key.
	errProcessorTimeout = errors.New("processor timed out")
	// errProcessorKeyReused: the key was first used with other parameters.
	errProcessorKeyReused = errors.New("processor: idempotency key reused with different parameters")
	// errRefundExceedsCharge: the refund is for more than is left to refund.
	errRefundExceedsCharge = errors.New("processor: refund exceeds the charge's remaining amount")
)

// Processor is the fake card processor.
type Processor struct {
	db    *sql.DB
	now   func() time.Time
	newID func(prefix string) string
	fault faultHook
	// metrics counts the calls, as the caller sees them; nil for none.
	metrics *metrics
}

// chargeRequest is one call to charge.
type chargeRequest struct {
	IdempotencyKey string
	OrderID        string
	AmountCents    int64
	Currency       string
	PaymentMethod  string
}

// charge charges a card under an idempotency key. Returns the charge id, or
// errCardDeclined (also on every retry of a declined key),
// errProcessorKeyReused, or errProcessorTimeout when the response was lost
// (the charge may exist: retry with the same key to learn its id).
func (p *Processor) charge(ctx context.Context, req chargeRequest) (string, error) {
	if err := p.loseRequest(ctx); err != nil {
		return "", err
	}
	var chargeID, status string
	var firstCall, keyHit bool
	// The key's UNIQUE index decides, in one statement: the charge is
	// inserted under its key unless the key has one already. (A look-up
	// first, then the insert, was three statements, and under SERIALIZABLE
	// two charges of different keys failed each other: each had looked up
	// a missing key and inserted one beside it.)
	err := withTx(ctx, p.db, func(tx *sql.Tx) error {
		keyHit, firstCall = false, false
		chargeID = p.newID("ch")
		status = "succeeded"
		if req.PaymentMethod == pmCardDeclined {
			// Like Stripe, a decline is recorded under the key, so a retry
			// is declined again instead of trying the card a second time.
			status = "declined"
		}
		inserted, err := tx.ExecContext(ctx, `
			INSERT INTO processor_charges (charge_id, idempotency_key, order_id, amount_cents, currency, payment_method, status, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)
			ON CONFLICT (idempotency_key) DO NOTHING`,
			chargeID, req.IdempotencyKey, req.OrderID, req.AmountCents, req.Currency, req.PaymentMethod, status, formatTime(p.now()))
		if err != nil {
			return fmt.Errorf("processor: insert charge: %w", err)
		}
		if n, err := inserted.RowsAffected(); err != nil || n == 1 {
			// First time this key is seen: the work is done.
			firstCall = err == nil
			return err
		}
		var orderID, currency, paymentMethod string
		var amount int64
		err = tx.QueryRowContext(ctx, `
			SELECT charge_id, order_id, amount_cents, currency, payment_method, status
			FROM processor_charges WHERE idempotency_key = ?`, req.IdempotencyKey,
		).Scan(&chargeID, &orderID, &amount, &currency, &paymentMethod, &status)
		if err != nil {
			return fmt.Errorf("processor: read charge: %w", err)
		}
		if orderID != req.OrderID || amount != req.AmountCents || currency != req.Currency || paymentMethod != req.PaymentMethod {
			return errProcessorKeyReused
		}
		if _, err := tx.ExecContext(ctx, `UPDATE processor_charges SET key_hits = key_hits + 1 WHERE charge_id = ?`, chargeID); err != nil {
			return fmt.Errorf("processor: count key hit: %w", err)
		}
		keyHit = true
		return nil
	})
	p.metrics.processorCalled(processorCharge, err == nil && keyHit)
	if err != nil {
		return "", err
	}
	if err := p.loseResponse(ctx, firstCall && req.PaymentMethod == pmCardTimeout); err != nil {
		return "", err
	}
	if status == "declined" {
		return "", errCardDeclined
	}
	return chargeID, nil
}

// refund refunds amountCents of a charge under an idempotency key. Returns
// the refund id, or errRefundExceedsCharge, errProcessorKeyReused, or
// errProcessorTimeout when the response was lost.
func (p *Processor) refund(ctx context.Context, idempotencyKey, chargeID string, amountCents int64) (string, error) {
	if err := p.loseRequest(ctx); err != nil {
		return "", err
	}
	var refundID string
	var keyHit bool
	err := withTx(ctx, p.db, func(tx *sql.Tx) error {
		keyHit = false
		var existingCharge string
		var existingAmount int64
		err := tx.QueryRowContext(ctx, `
			SELECT refund_id, charge_id, amount_cents FROM processor_refunds WHERE idempotency_key = ?`, idempotencyKey,
		).Scan(&refundID, &existingCharge, &existingAmount)
		switch {
		case err == nil:
			if existingCharge != chargeID || existingAmount != amountCents {
				return errProcessorKeyReused
			}
			_, err := tx.ExecContext(ctx, `UPDATE processor_refunds SET key_hits = key_hits + 1 WHERE refund_id = ?`, refundID)
			if err != nil {
				return fmt.Errorf("processor: count key hit: %w", err)
			}
			keyHit = true
			return nil
		case errors.Is(err, sql.ErrNoRows):
		default:
			return fmt.Errorf("processor: read refund: %w", err)
		}

		result, err := tx.ExecContext(ctx, `
			UPDATE processor_charges SET refunded_cents = refunded_cents + ?
			WHERE charge_id = ? AND status = 'succeeded' AND refunded_cents + ? <= amount_cents`,
			amountCents, chargeID, amountCents)
		if err != nil {
			return fmt.Errorf("processor: update charge: %w", err)
		}
		if n, err := result.RowsAffected(); err != nil || n != 1 {
			return errRefundExceedsCharge
		}
		refundID = p.newID("re")
		_, err = tx.ExecContext(ctx, `
			INSERT INTO processor_refunds (refund_id, idempotency_key, charge_id, amount_cents, created_at)
			VALUES (?, ?, ?, ?, ?)`,
			refundID, idempotencyKey, chargeID, amountCents, formatTime(p.now()))
		if err != nil {
			return fmt.Errorf("processor: insert refund: %w", err)
		}
		return nil
	})
	p.metrics.processorCalled(processorRefund, err == nil && keyHit)
	if err != nil {
		return "", err
	}
	if err := p.loseResponse(ctx, false); err != nil {
		return "", err
	}
	return refundID, nil
}

// errNoSuchRefund is returned by lookupRefund for a refund id the processor
// never made.
var errNoSuchRefund = errors.New("the processor has no such refund")

// lookupRefund returns the charge and the amount of the processor's refund
// refundID, as a processor's "retrieve a refund" call does. Returns
// errNoSuchRefund if it made none of that id, and errProcessorTimeout when
// no answer comes (faultProcessorRetrieve).
func (p *Processor) lookupRefund(ctx context.Context, refundID string) (string, int64, error) {
	if err := p.fault.at(ctx, faultProcessorRetrieve); err != nil {
		return "", 0, fmt.Errorf("%w (%v)", errProcessorTimeout, err)
	}
	var chargeID string
	var amount int64
	err := p.db.QueryRowContext(ctx, `SELECT charge_id, amount_cents FROM processor_refunds WHERE refund_id = ?`,
		refundID).Scan(&chargeID, &amount)
	if errors.Is(err, sql.ErrNoRows) {
		return "", 0, errNoSuchRefund
	}
	if err != nil {
		return "", 0, fmt.Errorf("processor: read refund %s: %w", refundID, err)
	}
	return chargeID, amount, nil
}

// remaining returns how much of charge chargeID is left to refund (its
// amount less what was refunded), as a processor's "retrieve a charge"
// call tells. Returns errProcessorTimeout when no answer comes
// (faultProcessorRetrieve).
func (p *Processor) remaining(ctx context.Context, chargeID string) (int64, error) {
	if err := p.fault.at(ctx, faultProcessorRetrieve); err != nil {
		return 0, fmt.Errorf("%w (%v)", errProcessorTimeout, err)
	}
	var remaining int64
	err := p.db.QueryRowContext(ctx, `SELECT amount_cents - refunded_cents FROM processor_charges WHERE charge_id = ?`,
		chargeID).Scan(&remaining)
	if err != nil {
		return 0, fmt.Errorf("processor: read charge %s: %w", chargeID, err)
	}
	return remaining, nil
}

// loseRequest returns errProcessorTimeout when the request is lost before
// the processor sees it (faultProcessorLoseRequest): nothing is done there.
func (p *Processor) loseRequest(ctx context.Context) error {
	return asTimeout(p.fault.at(ctx, faultProcessorLoseRequest))
}

// loseResponse returns errProcessorTimeout when the answer to a call that
// did its work is lost on the way back: always when lose is set, and
// whenever the fault hook fires at faultProcessorLoseResponse.
func (p *Processor) loseResponse(ctx context.Context, lose bool) error {
	if lose {
		return errProcessorTimeout
	}
	return asTimeout(p.fault.at(ctx, faultProcessorLoseResponse))
}

// asTimeout turns the error of a fault point on the way to or from the
// processor into the timeout its caller sees. A crash stays a crash: a
// process that died there releases nothing, and nobody is told anything.
func asTimeout(err error) error {
	if err == nil || errors.Is(err, errCrash) {
		return err
	}
	return fmt.Errorf("%w (%v)", errProcessorTimeout, err)
}
