// Four structures of the simulator around work that is held or undone: a
// refund's lease while its request is still at work, a processor request
// that never arrives, a shipment refused after the card was charged, and a
// saga pass that never ends.
//
// A refund request holds its key's lease from its claim until it answers,
// or until the lease passes (refund.go). A retry of the same request meant
// to arrive meanwhile is told 409 "in progress" and does nothing. Left to
// itself, the simulator only allowed that 409; it never demanded it, so a
// retry that took a live lease over passed: the processor's key made the
// two calls one refund, and the two answers agreed. Here, while an earlier
// send holds the lease (it claimed the key and has not answered, or its
// process died after the claim), a retry answered before that lease can
// have passed must get 409 or 503, nothing else.
//
// The processor could lose a response, never a request: every timeout
// came after the work was done there, so code that counted a timed-out
// refund as made was right by luck. Now a request is sometimes lost on its
// way (faultProcessorLoseRequest): the processor did nothing, and once
// quiet the processor must still hold exactly what each order kept.
//
// No saga of the simulator ever undid a charge: its steps fail for a
// declined card or missing stock, both before the charge, so the
// compensating refund (undoStep) never ran. Now the warehouse sometimes
// refuses a shipment (a permanent failure where a step writes its effect):
// at reserve_stock the saga releases nothing it had, at confirm it refunds
// the card and releases the stock. The model lets every order whose saga
// might have been the one refused end cancelled; the money checks say
// whether the refund was made, once.
//
// A saga pass runs rounds until no saga it claimed goes on (sagaOnce). A
// saga that goes on for ever without a step to show for it (an undo that
// neither succeeds nor fails, a step recorded again and again) would keep
// its worker in that pass for ever, and the simulator with it, silent. So
// the steps the saga engine starts are counted between two steps of the
// simulation (and two passes of quiescing): far more than any pass can run
// is a livelock, and the run fails saying so.

package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// simHeldCounts count the structures of this file.
type simHeldCounts struct {
	// LostRequests counts processor requests lost on the way; HeldRetries
	// the retries answered while an earlier send of theirs held the lease;
	// RefusedShipments the saga steps failed by the warehouse.
	LostRequests, HeldRetries, RefusedShipments int
}

// add adds other's counts to c.
func (c *simHeldCounts) add(other simHeldCounts) {
	c.LostRequests += other.LostRequests
	c.HeldRetries += other.HeldRetries
	c.RefusedShipments += other.RefusedShipments
}

// String is the summary line's part.
func (c simHeldCounts) String() string {
	return fmt.Sprintf("%d processor requests lost on the way, %d refund retries while an earlier send held the lease, %d shipments refused",
		c.LostRequests, c.HeldRetries, c.RefusedShipments)
}

// lostRequestChance is the chance that a charge or refund request is lost
// before the processor sees it: a client's refund, or the request of a
// worker (the saga's charges and compensating refunds, the completer's
// refunds), which are fewer and whose retries are the point.
const (
	lostRequestChance       = 0.05
	lostWorkerRequestChance = 0.25
)

// refuseShipmentChance is the chance that the warehouse refuses a saga
// step where it writes its effect; refuseConfirmChance the chance in a
// saga pass that holds a saga at confirm, whose card is charged (the
// refusal undoes the charge: few confirms run where faults do, most in
// the calm catch-ups).
const (
	refuseShipmentChance = 0.1
	refuseConfirmChance  = 0.5
)

// sagaStepsCap is more saga steps than the engine can start between two
// steps of the simulation, or in one round of quiescing: every worker's
// pass over sagaBatchSize sagas, each run forward and back with room to
// spare, many times over.
const sagaStepsCap = 50_000

// loseRequest, called by the fault hook at faultProcessorLoseRequest,
// loses the request now and then. The processor does nothing; the caller
// sees a timeout.
func (s *simulation) loseRequest(action *simAction, point faultPoint) error {
	if point != faultProcessorLoseRequest {
		return nil
	}
	chance := lostRequestChance
	if action.request == nil {
		chance = lostWorkerRequestChance
	}
	if !s.chance(chance) {
		return nil
	}
	s.report.Counts.LostRequests++
	action.processorTimedOut = true
	s.tracef("a%d %s: a request to the processor is lost on the way", action.id, action.process.name)
	return errors.New("connection refused")
}

// heldLease records that action, a send of a refund, claimed its key: it
// holds the lease until it answers.
func (s *simulation) heldLease(action *simAction, point faultPoint) {
	if point == faultRefundKeyClaimed && action.request != nil && action.request.kind == "refund" {
		action.request.leaseHolder = action
	}
}

// judgeHeldLease checks action's answer, a refund's, against a lease an
// earlier send of the request holds. The holder claimed the key no
// earlier than it was sent, so its lease lasts at least until then plus
// the lease's length; action read the clock for its own claim no later
// than its answer. The lease was live at that claim if the answer came a
// millisecond (the stored times' precision, and then some) before.
func (s *simulation) judgeHeldLease(action *simAction, answer simAnswer) error {
	req := action.request
	holder := req.leaseHolder
	if holder == action {
		req.leaseHolder = nil
		return nil
	}
	if holder == nil {
		return nil
	}
	liveUntil := holder.sentAt.Add(s.app.leases.refundLock - time.Millisecond)
	if !answer.at.Before(liveUntil) {
		return nil
	}
	s.report.Counts.HeldRetries++
	kind := problemType(orderField([]byte(answer.body), "type"))
	if answer.status == http.StatusServiceUnavailable || (answer.status == http.StatusConflict && kind == problemKeyInProgress) {
		return nil
	}
	return s.fail("refund key %s got %d %s while a%d, sent %s before, held its lease (a lease lasts %s): want 409 %s",
		req.key, answer.status, shorten(answer.body, 100), holder.id, answer.at.Sub(holder.sentAt), s.app.leases.refundLock, problemKeyInProgress)
}

// countSagaStep counts a saga step started, and fails the run once more
// have started since the last reset than any pass can run.
func (s *simulation) countSagaStep(point faultPoint) error {
	if point != faultBeforeStep {
		return nil
	}
	s.sagaSteps++
	if s.sagaSteps < sagaStepsCap {
		return nil
	}
	s.violate(s.fail("the saga engine started %d steps without the simulation taking one: a pass that never ends", s.sagaSteps))
	return errCrash
}

// refuseShipment, called by the fault hook at faultAfterStepEffect of a
// saga pass, now and then fails the step for good, as a warehouse that
// refuses the shipment would. Every order whose saga is at reserve_stock
// or confirm may be the one: the model lets each end cancelled.
func (s *simulation) refuseShipment(ctx context.Context, action *simAction, point faultPoint) error {
	if point != faultAfterStepEffect || action.request != nil {
		return nil
	}
	chance := refuseShipmentChance
	confirming, err := s.sagasAtConfirm(ctx, action)
	if err != nil {
		return err
	}
	if len(confirming.sagas) > 0 {
		chance = refuseConfirmChance
		if action == s.refuseConfirmIn {
			// The last pass of the saga workers cut off from the
			// processor (simulate_cutoff.go).
			chance = 1
		}
	}
	if !s.chance(chance) {
		return nil
	}
	rows, err := s.direct.QueryContext(ctx, `
		SELECT order_id FROM saga_instances WHERE status = 'in_progress' AND current_step IN (?, ?)`,
		stepReserveStock, stepConfirm)
	if err != nil {
		return fmt.Errorf("sagas that may be refused: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var orderID string
		if err := rows.Scan(&orderID); err != nil {
			return fmt.Errorf("sagas that may be refused: %w", err)
		}
		s.model.refused[orderID] = true
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("sagas that may be refused: %w", err)
	}
	s.report.Counts.RefusedShipments++
	s.tracef("a%d %s: the warehouse refuses a shipment", action.id, action.process.name)
	if len(confirming.sagas) > 0 && s.cutOffState == nil {
		// Its charge is to be undone (simulate_cutoff.go).
		s.beganCutOff(confirming, fmt.Sprintf("a%d %s: ", action.id, action.process.name))
	}
	return permanent(errors.New("the warehouse refuses the shipment"))
}
