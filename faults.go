// This file names every place where a crash or a lost message changes what
// happens next. Tests and the demo pass a faultHook that fails at one of
// them; production passes none, and an unset hook costs one nil check.

package main

import (
	"context"
	"errors"
)

// faultPoint names one place in the workflow where the process may die.
type faultPoint string

const (
	// faultAfterKeyClaim: the key is claimed (the transaction holds the write
	// lock and found the key free); nothing is written yet.
	faultAfterKeyClaim faultPoint = "idem.after_key_claim"
	// faultAfterBusinessWrite: the order and its outbox event are written, the
	// response is not yet stored on the key.
	faultAfterBusinessWrite faultPoint = "idem.after_business_write"
	// faultPublish: the broker refuses a publish (or the process dies just
	// before it).
	faultPublish faultPoint = "broker.publish"
	// faultAfterPublish: the broker has the event, the outbox still says
	// pending (or, after the reconciler's copy, has not recorded it).
	faultAfterPublish faultPoint = "outbox.after_publish"
	// faultConsumerApply: the consumer's own code is about to apply a
	// message, inside the inbox's transaction; an error here is its code
	// failing (a bug, a dependency down), counted until the message is
	// poison.
	faultConsumerApply faultPoint = "inbox.apply"
	// faultAfterEffect: the consumer's effect and inbox row are committed, the
	// broker has not seen the ack.
	faultAfterEffect faultPoint = "inbox.after_effect"
	// faultBeforeStep: a saga worker has read the saga and is about to run
	// its next step or compensation. A worker paused here acts on what it
	// read, however long ago that was.
	faultBeforeStep faultPoint = "saga.before_step"
	// faultAfterStepEffect: a saga step's local effect is written, its record
	// not yet (they share one transaction, so this rolls both back).
	faultAfterStepEffect faultPoint = "saga.after_step_effect"
	// faultBeforeProcessorCall: the saga is about to charge or refund.
	faultBeforeProcessorCall faultPoint = "saga.before_processor_call"
	// faultAfterProcessorCall: the processor charged or refunded, the saga has
	// not recorded it.
	faultAfterProcessorCall faultPoint = "saga.after_processor_call"
	// faultMidCompensation: one compensation is recorded, the next not run.
	faultMidCompensation faultPoint = "saga.mid_compensation"
	// faultRefundKeyClaimed: a refund's key claim committed (the request
	// holds its lease), its first phase not started. A request paused here
	// past the lease finds, when it wakes, that the client's retry took
	// the key over.
	faultRefundKeyClaimed faultPoint = "refund.after_key_claim"
	// faultRefundStarted: a refund's first phase committed (recovery point
	// refund_requested), the processor not yet called.
	faultRefundStarted faultPoint = "refund.after_started"
	// faultRefundAfterProcessor: the processor refunded, the key is not
	// finished.
	faultRefundAfterProcessor faultPoint = "refund.after_processor_call"
	// faultBeforeCursorMove: the reconciler has read how far the delivery
	// cursor may move, and has not moved it. A sweep paused here moves it,
	// when it wakes, to where it could go then, which another sweep may
	// have passed since.
	faultBeforeCursorMove faultPoint = "deliver.before_cursor_move"
	// faultProcessorLoseRequest: a charge or refund request is lost on the
	// way to the processor, which never sees it. The caller sees the same
	// timeout as for a lost response and cannot tell the two apart: only
	// asking again under the same key makes it done, once.
	faultProcessorLoseRequest faultPoint = "processor.lose_request"
	// faultProcessorLoseResponse: the processor did the work and the
	// response is lost on the way back.
	faultProcessorLoseResponse faultPoint = "processor.lose_response"
	// faultProcessorRetrieve: we ask the processor what it did (retrieve
	// a refund) and no answer comes: it is down, or the call times out.
	// Nothing changed there; the caller cannot tell what it would have
	// said.
	faultProcessorRetrieve faultPoint = "processor.retrieve"
)

// allFaultPoints lists every fault point. The crash tests range over it, so
// a point added here is tested without touching them.
func allFaultPoints() []faultPoint {
	return []faultPoint{
		faultAfterKeyClaim,
		faultAfterBusinessWrite,
		faultPublish,
		faultAfterPublish,
		faultConsumerApply,
		faultAfterEffect,
		faultBeforeStep,
		faultAfterStepEffect,
		faultBeforeProcessorCall,
		faultAfterProcessorCall,
		faultMidCompensation,
		faultRefundKeyClaimed,
		faultRefundStarted,
		faultRefundAfterProcessor,
		faultBeforeCursorMove,
		faultProcessorLoseRequest,
		faultProcessorLoseResponse,
		faultProcessorRetrieve,
	}
}

// insideTransaction reports whether point is reached while the process
// holds a transaction open. On SQLite that transaction holds the database's
// write lock, so a process paused there stops every other writer until it
// goes on: nobody can take its work over meanwhile (for the others it is an
// outage), and a harness that waited for another worker to act would wait
// for ever. A crash there rolls the transaction back.
func (point faultPoint) insideTransaction() bool {
	switch point {
	case faultAfterKeyClaim, faultAfterBusinessWrite, faultConsumerApply, faultAfterStepEffect:
		return true
	default:
		return false
	}
}

// errCrash is what a faultHook returns to simulate the process dying at a
// point: the caller abandons its work, uncommitted writes roll back, and the
// test reopens the database as a fresh process would.
var errCrash = errors.New("simulated crash")

// faultHook is called at each faultPoint. A non-nil error is returned by the
// code at that point as if the process had died (errCrash) or an operation
// had failed (any other error).
type faultHook func(ctx context.Context, point faultPoint) error

// at calls the hook, if any, for point.
func (hook faultHook) at(ctx context.Context, point faultPoint) error {
	if hook == nil {
		return nil
	}
	return hook(ctx, point)
}
