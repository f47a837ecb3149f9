// A structure of the simulator around the outbox's order: an order
// refunded twice in a row while the broker refuses the first refund's
// event.
//
// The outbox promises that the events of one order go out in the order
// they were written: the relay takes an event only while it is the oldest
// unpublished event of its order (claimOutboxEvents). Only refunds put a
// second event of an order behind one that may still be waiting: the saga
// starts from a consumed OrderCreated, and an order is refundable only
// once its PaymentCaptured is consumed, so each of those is out before
// the next event of its order is written. Left to chance, a second refund
// of an order was written behind a waiting event only while the broker
// was broken for a stretch (simulate_operator.go), and a relay that took
// the later event first was seen at seed 41 at the earliest. So now and
// then the client of a paid order refunds a dollar of it, and another
// once the first refund has answered, while the broker refuses the
// order's first refund event for up to heldEventSteps steps. It refuses
// that one message and stores the rest of its batch, as JetStream does
// when one of a batch's asynchronous publishes fails, and the publish
// fails: the relay records the whole batch failed and publishes it again
// later, and the broker's dedupe drops the copies. A relay that claims
// the second refund's event while the first is waiting then gets it out
// first, whether the batch holds the refused event too or not.
//
// The oracle is the broker's own (checkFirstPublishedInOrder): as it
// acknowledges an event for the first time, every event of its order
// written before it must have gone out already, and none written after
// it.

package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// simOutboxOrderCounts count the structure of this file.
type simOutboxOrderCounts struct {
	// RefundedTwice counts the orders refunded twice in a row while the
	// broker refused the first refund's event; RefusedPublishes the
	// batches it refused that event in.
	RefundedTwice, RefusedPublishes int
}

// add adds other's counts to c.
func (c *simOutboxOrderCounts) add(other simOutboxOrderCounts) {
	c.RefundedTwice += other.RefundedTwice
	c.RefusedPublishes += other.RefusedPublishes
}

// String is the summary line's part.
func (c simOutboxOrderCounts) String() string {
	return fmt.Sprintf("%d orders refunded twice in a row while the broker refused the first refund's event (in %d batches)",
		c.RefundedTwice, c.RefusedPublishes)
}

// simHeldEvent is an order refunded twice in a row, and the event of its
// first refund, which the broker refuses.
type simHeldEvent struct {
	orderID string
	client  *simClient
	// first and second are the client's refunds; second is nil until
	// first has answered.
	first, second *simRequest
	// eventID is the first OrderRefunded of the order the broker got, ""
	// until then; the broker refuses it until step until, or until it has
	// refused it heldEventRefusals times.
	eventID         string
	until, refusals int
}

// refundTwiceChance is the chance that a client's request is the first of
// two refunds of one order, whose first event the broker refuses, when
// no order is being refunded twice.
const refundTwiceChance = 0.1

// heldEventSteps is how many steps the structure lasts: long enough for
// the client's two refunds to be made, paused at fault points on the way,
// and for a relay to try to publish what they wrote.
const heldEventSteps = 60

// heldEventRefusals is the most times the broker refuses the event: each
// refusal is one of its maxPublishAttempts, and the event is not to be
// set aside for an operator.
const heldEventRefusals = 5

// errSimPublishRefused is what a publish of the refused event gets.
var errSimPublishRefused = errors.New("the broker refuses a message of the batch (a simulated fault)")

// refundTwice starts the structure: the client of a paid order whose
// events are all out refunds a part of it, and refunds it again once the
// first refund has answered (stepHeldEvent), while the broker refuses the
// first event of the order it gets (refuseHeldEvent). It reports whether
// it sent the first refund.
func (s *simulation) refundTwice(ctx context.Context) (bool, error) {
	if s.heldEvent != nil {
		return false, nil
	}
	rows, err := s.direct.QueryContext(ctx, `
		SELECT o.order_id FROM orders o
		WHERE o.status = ? AND o.refunded_cents + 200 <= o.amount_cents
		  AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.aggregate_id = o.order_id AND e.status <> 'published')
		ORDER BY o.order_id`, orderPaid)
	if err != nil {
		return false, fmt.Errorf("read the paid orders: %w", err)
	}
	var candidates []string
	for rows.Next() {
		var orderID string
		if err := rows.Scan(&orderID); err != nil {
			rows.Close()
			return false, fmt.Errorf("read the paid orders: %w", err)
		}
		if s.clientOf(orderID) != nil {
			candidates = append(candidates, orderID)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(candidates) == 0 {
		return false, err
	}
	orderID := pick(s, candidates)
	client := s.clientOf(orderID)
	s.heldEvent = &simHeldEvent{orderID: orderID, client: client, first: s.partRefund(client, orderID), until: s.step + heldEventSteps}
	s.report.Counts.RefundedTwice++
	s.tracef("%s refunds %s twice in a row, and the broker refuses its first event until step %d", client.name, orderID, s.heldEvent.until)
	return true, s.sendRequest(ctx, client, s.heldEvent.first)
}

// partRefund returns a refund of one dollar of orderID.
func (s *simulation) partRefund(client *simClient, orderID string) *simRequest {
	s.report.Counts.Refunds++
	return &simRequest{client: client, kind: "refund", method: "POST", path: refundPath(orderID),
		key: s.newKey(client, "refund"), body: `{"amount_cents":100}`, orderID: orderID}
}

// stepHeldEvent sends the second refund once the first has answered. It
// reports whether it sent it.
func (s *simulation) stepHeldEvent(ctx context.Context) (bool, error) {
	held := s.heldEvent
	if held == nil || held.second != nil || held.first.inFlight > 0 || s.quiescing {
		return false, nil
	}
	held.second = s.partRefund(held.client, held.orderID)
	return true, s.sendRequest(ctx, held.client, held.second)
}

// refuseHeldEvent is called as the broker gets msgs, and returns those it
// stores, and the error the publish gets (nil if it goes through): a
// batch that holds the refused event is stored without it, and fails.
// The structure ends here, at the first publish after its last step or
// its last refusal.
func (s *simulation) refuseHeldEvent(msgs []message) ([]message, error) {
	held := s.heldEvent
	if held == nil {
		return msgs, nil
	}
	if s.quiescing || s.step >= held.until || held.refusals >= heldEventRefusals {
		s.heldEvent = nil
		s.tracef("the broker takes the events of %s again", held.orderID)
		return msgs, nil
	}
	for i, msg := range msgs {
		if held.eventID == "" && msg.PublishID == "" && msg.Subject == eventOrderRefunded && payloadOrderID(msg.Payload) == held.orderID {
			held.eventID = msg.ID
			// The broker refused a publish: an event may be failed after
			// its attempts (withoutSetAside).
			s.operator.brokePublish = true
		}
		if msg.ID == held.eventID {
			held.refusals++
			s.report.Counts.RefusedPublishes++
			s.tracef("the broker stores %d messages of a batch, and refuses %s of %s", len(msgs)-1, msg.ID, held.orderID)
			return append(msgs[:i:i], msgs[i+1:]...), errSimPublishRefused
		}
	}
	return msgs, nil
}

// clientOf returns the client that was told of orderID, nil if none was.
func (s *simulation) clientOf(orderID string) *simClient {
	for _, client := range s.clients {
		if slices.Contains(client.orders, orderID) {
			return client
		}
	}
	return nil
}
