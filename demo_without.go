// demo --without LAYER: the article's "skip any one of them and you get a
// hole", made visible. Each layer can be replaced, in the demo only, by the
// naive code the article warns against; the demo then runs the same story
// and shows the duplicate or lost effect, the invariants check breaks, and
// the test that catches it.
//
// The naive code is here, apart from the layers, so that the layers read as
// they run in production: withoutLayer swaps it in when the demo wires its
// App, and the layers themselves have no branch for it.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strings"
)

// layer names one of the four layers.
type layer string

// The four layers, as demo --without names them.
const (
	layerIdempotency layer = "idempotency"
	layerOutbox      layer = "outbox"
	layerInbox       layer = "inbox"
	layerSaga        layer = "saga"
)

// hole is what goes wrong without a layer.
type hole struct {
	// naive is the code that replaces the layer.
	naive string
	// effect is what the story shows going wrong.
	effect string
	// test is the test that fails if the layer has this hole.
	test string
}

// layerHoles returns, for each layer, the naive code that replaces it and
// the hole that leaves.
func layerHoles() map[layer]hole {
	return map[layer]hole{
		layerIdempotency: {
			naive:  "POST /api/orders ignores the Idempotency-Key: every request creates an order",
			effect: "every retry of one request made another order, and each was charged",
			test:   "go test -run 'TestIdempotency/RetryReturnsSameOrder|TestIdempotency/ConcurrentDuplicatesWaitAndReplay' .",
		},
		layerOutbox: {
			naive:  "POST /api/orders publishes OrderCreated to the broker first, then commits the order (a dual write)",
			effect: "a request whose commit failed, and every retry that only replayed, still published an OrderCreated, for orders that do not exist",
			test:   "go test -run 'TestOutbox/EventCommitsWithTheOrder|TestIdempotency/TransientFailureLeavesKeyFree' .",
		},
		layerInbox: {
			naive:  "consumers apply every delivery, with no inbox row to say it was applied before",
			effect: "a redelivered OrderCreated ran its effect again; only the saga's record of the event that started it kept a second saga from starting (the article's consumer, with no such record, charges twice), a webhook sent twice was applied twice, and with no inbox row nothing in the database shows that any message was applied",
			test:   "go test -run 'TestInbox/RedeliveryIsSkipped|TestInbox/CrashBeforeAckRedeliversAndSkips' .",
		},
		layerSaga: {
			naive:  "a saga whose step fails just stops: the order is cancelled, nothing done before is undone",
			effect: "the declined order is cancelled but still holds the stock reserved for it",
			test:   "go test -run 'TestSaga/DeclinedCardCompensatesOnlyStepsThatRan' .",
		},
	}
}

// parseLayer reads a --without value. Returns an error naming the layers
// if s is none of them.
func parseLayer(s string) (layer, error) {
	holes := layerHoles()
	if _, ok := holes[layer(s)]; ok {
		return layer(s), nil
	}
	var names []string
	for name := range holes {
		names = append(names, string(name))
	}
	sort.Strings(names)
	return "", fmt.Errorf("--without %q: no such layer; choose one of %s", s, strings.Join(names, ", "))
}

// withoutLayer replaces l's entry point in a.entry by the naive code the
// article warns against; an empty l changes nothing.
func (a *App) withoutLayer(l layer) {
	switch l {
	case layerIdempotency:
		a.entry.createOrder = a.createOrderWithoutKey
	case layerOutbox:
		a.entry.createOrder = a.createOrderDualWrite
	case layerInbox:
		a.entry.receiveIn = receiveWithoutInbox
	case layerSaga:
		a.entry.compensate = a.compensateNothing
	}
}

// compensateNothing is demo --without saga: a saga whose step failed just
// ends, and the order is cancelled; nothing done before is undone.
func (a *App) compensateNothing(ctx context.Context, run *sagaRun) error {
	if err := a.fault.at(ctx, faultBeforeStep); err != nil {
		return err
	}
	return a.observeCompensation(ctx, run, sagaStepRow{}, a.cancelOrder)
}

// createOrderWithoutKey is demo --without idempotency: the order and its
// event commit together, but nothing remembers the request, so a retry is
// a new order.
func (a *App) createOrderWithoutKey(ctx context.Context, req idempotentRequest, order orderRequest) (apiResponse, error) {
	var response apiResponse
	err := withTx(ctx, a.db, func(tx *sql.Tx) error {
		now := a.now()
		newOrder, orderCreatedEvent, err := a.newOrderCreated(a.newID("ord"), req, order, now)
		if err != nil {
			return err
		}
		if err := insertOrder(ctx, tx, newOrder); err != nil {
			return err
		}
		if err := insertOutboxEvent(ctx, tx, orderCreatedEvent, now); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterBusinessWrite); err != nil {
			return err
		}
		response, err = createdResponse(newOrder)
		return err
	})
	return response, err
}

// publishBeforeCommit is demo --without outbox: OrderCreated for the order
// about to be created goes to the broker now, from the request path,
// before the transaction that creates the order has even begun. If that
// transaction fails, or finds the request already answered, the event is
// out all the same, about an order that does not exist.
func (a *App) publishBeforeCommit(ctx context.Context, orderID string, req idempotentRequest, order orderRequest) error {
	_, orderCreatedEvent, err := a.newOrderCreated(orderID, req, order, a.now())
	if err != nil {
		return err
	}
	return a.broker.publishBatch(ctx, []message{{
		ID:      orderCreatedEvent.EventID,
		Subject: orderCreatedEvent.EventType,
		Payload: orderCreatedEvent.Payload,
	}})
}

// createOrderDualWrite is demo --without outbox: createOrder with the dual
// write. OrderCreated goes to the broker first (publishBeforeCommit), and the
// transaction writes the order and the key but no outbox event.
func (a *App) createOrderDualWrite(ctx context.Context, req idempotentRequest, order orderRequest) (apiResponse, error) {
	response, err := replaySettledKey(ctx, a.readDB, req, a.now())
	if !errors.Is(err, errKeyNotSettled) {
		return response, err
	}
	orderID := a.newID("ord")
	if err := a.publishBeforeCommit(ctx, orderID, req, order); err != nil {
		return apiResponse{}, err
	}
	err = a.writeTx(ctx, req.UserID, req.IdempotencyKey, func(ctx context.Context, tx *sql.Tx) error {
		now := a.now()
		key, err := lookupKey(ctx, tx, req.UserID, req.IdempotencyKey, now)
		switch {
		case err == nil:
			if err := checkSameRequest(key, req); err != nil {
				return err
			}
			if key.Status != keyCompleted {
				return errKeyInProgress
			}
			response = key.response()
			return nil
		case errors.Is(err, errKeyNotFound):
		default:
			return err
		}
		if err := a.fault.at(ctx, faultAfterKeyClaim); err != nil {
			return err
		}
		newOrder, _, err := a.newOrderCreated(orderID, req, order, now)
		if err != nil {
			return err
		}
		if err := insertOrder(ctx, tx, newOrder); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterBusinessWrite); err != nil {
			return err
		}
		response, err = createdResponse(newOrder)
		if err != nil {
			return err
		}
		return insertCompletedKey(ctx, tx, req, response, a.now())
	})
	if err != nil {
		return apiResponse{}, err
	}
	return response, nil
}

// receiveWithoutInbox is demo --without inbox: the message's effect runs on
// every delivery. Nothing records that it ran, so nothing can skip it the
// second time; a failure is retried for ever. Every message runs in a
// savepoint (the demo's batches are small), whatever undo says.
func receiveWithoutInbox(ctx context.Context, tx *sql.Tx, _ *itemUndo, consumerName, messageID string, deliveryCount, maxFailures int, apply func(tx *sql.Tx) error) (receiveResult, error) {
	result := receiveResult{MessageID: messageID, Outcome: inboxApplied}
	failed, err := inSavepoint(ctx, tx, "inbox_message", func() error { return apply(tx) })
	if failed != nil {
		result.Outcome = inboxRetry
		result.Err = failed
	}
	return result, err
}
