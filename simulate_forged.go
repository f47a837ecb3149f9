// A forged refund event while the processor cannot be asked, in the
// simulator.
//
// Someone holds the webhook signing secret (it leaked), or the processor
// has a bug and announces a refund it never made: a charge.refunded event
// arrives, correctly signed, naming a refund of an order that is paid, of
// an amount that fits what remains. Only the processor can tell that the
// refund does not exist, and right then its API is down for a while: every
// retrieve times out, for several calls in a row, not one call now and
// then. The event must wait, answered 503 and delivered again, and count
// nothing; once the processor answers, it says it made no such refund and
// the event is poison. A refund counted because the processor could not
// deny it is a finding, at the answer (simModel.judgeWebhook: a made-up
// refund applied) and after the step (check: a refund counted as made is
// one the processor made).
//
// Left to chance, this never met: the simulator's forged events are few,
// most arrive before their order's payment is recorded (they wait for it,
// and by their next delivery the processor answers), and a retrieve goes
// unanswered about one time in three (simulate_transient.go). So the structure
// aims the event at an order already paid, with no refund pending, and
// sends it at once, inside the outage.
//
// A real refund with the wrong amount. The processor made a refund at its
// dashboard, and a signed event names that very refund with an amount it
// did not make it of, one cent off, within what remains of the charge,
// before the processor's own event for it arrives (mismatchedAmount). The
// refund exists, so only its amount tells; the event must be poison, and
// the processor's own then applied.

package main

import (
	"context"
	"errors"
	"fmt"
)

// simForgedCounts count the forged events sent during a processor outage.
type simForgedCounts struct {
	// ProcessorOutages counts the outages of the processor's API;
	// ForgedRefunds the signed events for refunds it never made sent
	// during one; RetrievesRefused the retrieves that timed out in them.
	ProcessorOutages, ForgedRefunds, RetrievesRefused int
	// MismatchedAmounts counts the signed events naming a refund the
	// processor made, with an amount it did not make it of
	// (mismatchedAmount).
	MismatchedAmounts int
}

// add adds other's counts to c.
func (c *simForgedCounts) add(other simForgedCounts) {
	c.ProcessorOutages += other.ProcessorOutages
	c.ForgedRefunds += other.ForgedRefunds
	c.RetrievesRefused += other.RetrievesRefused
	c.MismatchedAmounts += other.MismatchedAmounts
}

// String is the summary line's part.
func (c simForgedCounts) String() string {
	return fmt.Sprintf("%d outages of the processor's API (%d retrieves timed out) with %d forged refund events of paid orders, "+
		"%d signed events of a real refund with an amount the processor did not make it of",
		c.ProcessorOutages, c.RetrievesRefused, c.ForgedRefunds, c.MismatchedAmounts)
}

// forgedRefundChance is the chance, per client request, that a forged
// refund event arrives while the processor's API is down.
const forgedRefundChance = 0.03

// sendForgedDuringOutage runs the structure: the processor's API goes down
// for a few steps, and a signed charge.refunded event naming a refund it
// never made arrives for a paid order with no refund pending. It reports
// whether it sent one.
func (s *simulation) sendForgedDuringOutage(ctx context.Context, client *simClient) (bool, error) {
	var chargeID, orderID string
	var remaining int64
	err := s.direct.QueryRowContext(ctx, `
		SELECT o.charge_id, o.order_id, o.amount_cents - o.refunded_cents FROM orders o
		WHERE o.status = 'paid' AND o.charge_id IS NOT NULL AND o.refunded_cents < o.amount_cents
		  AND NOT EXISTS (SELECT 1 FROM refunds r WHERE r.order_id = o.order_id AND r.status = 'pending')
		ORDER BY o.order_id LIMIT 1 OFFSET ?`, s.rng.IntN(4)).Scan(&chargeID, &orderID, &remaining)
	if err != nil {
		// No such order yet (or not at that offset): another time.
		return false, nil
	}
	n := len(s.webhooks) + 1
	refundID := fmt.Sprintf("re_forged_%d", n)
	amount := 1 + s.rng.Int64N(remaining)
	event := s.newRefundEvent(client, n, "made-up", chargeID, refundID, orderID, amount)
	if event == nil {
		return false, nil
	}
	// Once the processor answers, the event is poison: rightly so.
	s.refusedEvents = append(s.refusedEvents, event.eventID)
	s.processorDownUntil = s.step + 3 + s.rng.IntN(8)
	s.report.Counts.ProcessorOutages++
	s.report.Counts.ForgedRefunds++
	s.tracef("the processor's API is down until step %d; a signed event %s announces refund %s of %d of %s, which it never made",
		s.processorDownUntil, event.eventID, refundID, amount, orderID)
	return true, s.sendRequest(ctx, client, event)
}

// mismatchedAmount returns, half the time, a signed charge.refunded
// event that names real, a refund the processor just made at its
// dashboard, with an amount it did not make it of (one cent less, or
// more, within what remains of the charge, remaining): someone who saw
// the refund and holds the secret, or a processor's bug. It goes first,
// before the processor's own event for the refund, which is queued to be
// delivered later (s.announced). It must not be applied: poison once the
// processor says the refund is of another amount, and the processor's own
// event is then applied as usual. nil if not this time, or no amount
// fits.
//
// Left to chance, the simulator's signed events named a refund the
// processor made with its very amount, or a refund it never made: the
// amount the processor confirms was never the only thing wrong, and a
// check of the refund's existence alone passed every seed.
func (s *simulation) mismatchedAmount(client *simClient, real *simRequest, chargeID, refundID string, remaining int64) *simRequest {
	if !s.chance(0.5) {
		return nil
	}
	amount := real.refundAmount - 1
	if amount < 1 {
		amount = real.refundAmount + 1
	}
	if amount > remaining {
		return nil
	}
	event := s.newRefundEvent(client, len(s.webhooks)+1, "made-up", chargeID, refundID, real.orderID, amount)
	if event == nil {
		return nil
	}
	s.refusedEvents = append(s.refusedEvents, event.eventID)
	s.announced = append(s.announced, real)
	real.client.requests = append(real.client.requests, real)
	s.report.Counts.MismatchedAmounts++
	s.tracef("a signed event %s says refund %s of %s is %d; the processor made it of %d, and announces it as %s",
		event.eventID, refundID, real.orderID, amount, real.refundAmount, real.eventID)
	return event
}

// processorUnreachable fails every retrieve at the processor while its
// API is down: the caller gets a timeout.
func (s *simulation) processorUnreachable(point faultPoint) error {
	if point != faultProcessorRetrieve || s.step >= s.processorDownUntil {
		return nil
	}
	s.report.Counts.RetrievesRefused++
	s.tracef("a%d %s: the processor's API is down, a retrieve times out", s.current.id, s.current.process.name)
	return errors.New("i/o timeout")
}
