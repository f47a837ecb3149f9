// A refund abandoned mid-call and finished a day later, in the simulator;
// and a refund its client gave up on after the processor timed out.
//
// A client asks for a refund of an order that was paid a while ago. The
// serve process is killed in the middle of it: after the refund's key is
// claimed and before the key is settled (the refund recorded as pending,
// or the processor already called). The client's connection drops; its
// owner gives up for the night. Nobody looks until the next day: the clock
// passes the key's first day, counted from its claim. Then the refund
// completer catches up and finishes the refund, and the next morning the
// client sends the same request again, with the same key. It must get the
// refund's answer: a key replays for a day from its answer, not from its
// claim (fault 3 of docs/faults-found.md). The model knows the key was
// still unsettled a day after its claim, so a 422 idempotency-key-expired
// within a day of that is a broken promise; answered checks the same
// against the refund's settling, and the model judges the rest.
//
// Left to chance, this never happens within a run: orders are rarely paid
// while the faults go on (an outage, a lost message or a crash holds the
// saga back), so a refund is mostly refused as "payment pending" before it
// claims anything; and a refund that is cut off is taken over by its
// client's retry or the completer within minutes, before any clock jump
// of a day. So the structure first lets the workers catch up (a calm
// hour, with every dependency up), as they do between bursts of trouble.
//
// A client that gives up. A refund's processor call loses its answer: the
// request answers 503 and releases its key, and its client never asks
// again. Nobody but the refund completer is left to finish it, and, until
// it does, the pending refund holds back what remains of the order for a
// refund under another key (timeOutRefund, giveUpRefund).

package main

import (
	"context"
	"fmt"
	"time"
)

// simAbandoned is a refund request whose process was killed mid-call, and
// whose client comes back at step returnAt.
type simAbandoned struct {
	request  *simRequest
	at       faultPoint
	killed   bool
	returnAt int
}

// abandonRefund runs the structure: the workers catch up, client refunds
// one of its paid orders, and its serve process is killed after the key is
// claimed. If the kill happened, the clock passes the key's first day, the
// refund completer starts a pass, and the client is due back within a few
// steps (see clientReturns). It reports whether it started.
func (s *simulation) abandonRefund(ctx context.Context, client *simClient) (bool, error) {
	if s.abandoned != nil || len(client.orders) == 0 || s.operator.broken != "" || s.groupProcess != nil {
		return false, nil
	}
	for _, network := range []*simDatabase{s.network, s.brokerNetwork} {
		if network != nil && (network.down || network.diskFull) {
			return false, nil
		}
	}
	if err := s.catchUp(ctx); err != nil {
		return false, err
	}
	orderID, ok := s.paidOrder(ctx, client)
	if !ok {
		return false, nil
	}
	req := s.newRefund(client, orderID)
	s.abandoned = &simAbandoned{request: req, at: pick(s, []faultPoint{faultRefundStarted, faultRefundAfterProcessor})}
	if err := s.sendRequest(ctx, client, req); err != nil {
		return true, err
	}
	if !s.abandoned.killed {
		// Cut off otherwise (the processor's answer lost, a crash or an
		// outage inside a transaction): an ordinary run from here on.
		s.abandoned = nil
		return true, nil
	}
	s.report.Counts.AbandonedRefunds++
	// Nobody looks until the next day.
	d := idempotencyKeyTTL + time.Duration(1+s.rng.IntN(120))*time.Minute
	s.clock.advance(d)
	s.report.Counts.ClockJumps++
	s.tracef("clock +%s: nobody looks at the refund under %s until the next day", d, req.key)
	// Nothing ran since the kill: the key is still unsettled now, and
	// whatever answer it gets is stored later.
	req.unsettledAt = s.clock.now()
	s.abandoned.returnAt = s.step + 1 + s.rng.IntN(4)
	// The completer catches up, as one pass among the others: it may be
	// held, crash or meet an outage like any.
	process := pick(s, s.processes[4:])
	action := &simAction{process: process, what: "completeRefundsOnce"}
	s.report.Counts.WorkerPasses++
	return true, s.start(ctx, action, func(ctx context.Context) {
		n, err := s.app.completeRefundsOnce(ctx, 4)
		action.result = workerResult(n, "refunds finished", err)
		action.err = err
	})
}

// killAbandoned is the fault hook's part of the structure: at the chosen
// point, the process running the abandoned refund dies, with every action
// of it (after the processor's call, the processor may announce the
// refund it made). It reports whether action is the abandoned refund's (which then
// runs straight to that point, held nowhere).
func (s *simulation) killAbandoned(ctx context.Context, action *simAction, point faultPoint) (bool, error) {
	a := s.abandoned
	if a == nil || a.killed || action.request != a.request {
		return false, nil
	}
	if point != a.at {
		return true, nil
	}
	if point == faultRefundAfterProcessor && s.chance(0.6) {
		// The processor announces the refund it made, whatever became of
		// the process that asked for it: the event comes while the
		// refund is pending, and must wait for it.
		s.announceOwnRefund(ctx, a.request)
	}
	for _, other := range s.actions {
		if other.process == action.process {
			other.crashed = true
		}
	}
	action.crashed = true
	a.killed = true
	s.report.Counts.Crashes++
	s.tracef("a%d %s is killed at %s, mid-refund: its key %s is claimed and not settled", action.id, action.process.name, point, a.request.key)
	return true, errCrash
}

// clientReturns sends the abandoned refund again, the same request under
// the same key, once its client is back.
func (s *simulation) clientReturns(ctx context.Context) (bool, error) {
	a := s.abandoned
	if a == nil || s.step < a.returnAt {
		return false, nil
	}
	s.abandoned = nil
	s.report.Counts.Retries++
	s.tracef("%s comes back and asks again for the refund under %s", a.request.client.name, a.request.key)
	return true, s.sendRequest(ctx, a.request.client, a.request)
}

// catchUp lets the workers catch up, as they do in a calm hour: every pass
// runs, with nothing failing and no pass held, until none finds work, the
// clock past every lease and backoff between rounds. Actions held at a
// fault point stay held: their leases pass, as a paused process's do.
func (s *simulation) catchUp(ctx context.Context) error {
	s.report.Counts.CatchUps++
	// Nothing fails in a calm hour: a commit fault armed in a transaction
	// that ended without committing (a crash, a statement's error) does
	// not carry over to the first commit of the catch-up.
	for _, network := range []*simDatabase{s.network, s.brokerNetwork} {
		if network != nil {
			network.loseCommit, network.failCommit, network.processDied = false, false, false
		}
	}
	for round := 0; round < 10; round++ {
		busy := false
		for _, process := range s.processes[2:] {
			n, err := s.app.runWorkersOnce(ctx, process.name)
			if err != nil {
				return s.fail("workers catching up: %v", err)
			}
			busy = busy || n > 0
		}
		if !busy {
			break
		}
		s.clock.advance(s.pastEveryWait())
	}
	s.tracef("the workers have caught up")
	return nil
}

// paidOrder returns one of client's orders that is paid and not all
// refunded, read from the handle no fault reaches.
func (s *simulation) paidOrder(ctx context.Context, client *simClient) (string, bool) {
	var paid []string
	for _, orderID := range client.orders {
		var n int
		err := s.direct.QueryRowContext(ctx, `
			SELECT COUNT(*) FROM orders WHERE order_id = ? AND user_id = ? AND status = ? AND refunded_cents < amount_cents`,
			orderID, client.user, orderPaid).Scan(&n)
		if err == nil && n == 1 {
			paid = append(paid, orderID)
		}
	}
	if len(paid) == 0 {
		return "", false
	}
	return pick(s, paid), true
}

// timeOutRefund runs the second structure: the workers catch up, client
// refunds one of its paid orders, and the processor's answer to the
// refund is lost (timeoutLoses); the client, answered 503, gives up on it
// (giveUpRefund). It reports whether it sent one.
//
// Left to chance, a refund's processor call almost never lost its
// answer in a run (one processor answer in ten is lost, and refunds are
// mostly refused as too early, before they reach the processor), and
// when it did, the client's retry finished it.
func (s *simulation) timeOutRefund(ctx context.Context, client *simClient) (bool, error) {
	if s.timingOut != nil || s.abandoned != nil || len(client.orders) == 0 || s.operator.broken != "" || s.groupProcess != nil {
		return false, nil
	}
	for _, network := range []*simDatabase{s.network, s.brokerNetwork} {
		if network != nil && (network.down || network.diskFull) {
			return false, nil
		}
	}
	if err := s.catchUp(ctx); err != nil {
		return false, err
	}
	orderID, ok := s.paidOrder(ctx, client)
	if !ok {
		return false, nil
	}
	req := s.newRefund(client, orderID)
	s.timingOut = req
	return true, s.sendRequest(ctx, client, req)
}

// timeoutLoses is the fault hook's part of the structure: the processor's
// answer to the timing-out refund is lost. It reports whether it lost it.
func (s *simulation) timeoutLoses(action *simAction, point faultPoint) bool {
	if point != faultProcessorLoseResponse || s.timingOut == nil || action.request != s.timingOut || action.processorTimedOut {
		return false
	}
	s.report.Counts.LostResponses++
	action.processorTimedOut = true
	s.tracef("a%d %s: the processor's answer to the refund under %s is lost", action.id, action.process.name, action.request.key)
	return true
}

// giveUpRefund has req's client give up on req, a refund just answered
// 503 because the processor's answer was lost (always, for the refund
// timeOutRefund sent; half the time for any other): the refund may have
// been made or not, its key is released (refundOrder), and the client
// never asks again, not even once the run is quiet. Only the refund
// completer can then finish it (or set it aside for an operator), and
// until it does, the refund counts against what remains for a refund
// under another key. Once quiet, check says no refund is pending and the
// processor holds what our side says it kept: nothing refunded twice, or
// lost. Without it every refund cut off by a timeout was finished by its
// client's retry, at the latest once quiet, and a completer that never
// took a released key passed.
func (s *simulation) giveUpRefund(req *simRequest, always bool) {
	if req.gaveUp || s.quiescing || (!always && !s.chance(0.5)) {
		return
	}
	req.gaveUp = true
	s.report.Counts.GaveUpRefunds++
	s.tracef("%s gives up on the refund under %s after the processor timed out: it never asks again", req.client.name, req.key)
}

// releasedGaveUp returns the refunds their clients gave up on whose keys
// are unfinished and released (held by nobody, not set aside), read as
// the run is made quiet: the refund completer's next pass must take
// them.
func (s *simulation) releasedGaveUp(ctx context.Context) ([]*simRequest, error) {
	var released []*simRequest
	for _, client := range s.clients {
		for _, req := range client.requests {
			if !req.gaveUp {
				continue
			}
			var free bool
			err := s.direct.QueryRowContext(ctx, `
				SELECT EXISTS (SELECT 1 FROM idempotency_keys
				               WHERE user_id = ? AND idempotency_key = ? AND recovery_point <> 'finished' AND locked_at IS NULL)`,
				client.user, req.key).Scan(&free)
			if err != nil {
				return nil, fmt.Errorf("read the key %s: %w", req.key, err)
			}
			if free {
				released = append(released, req)
			}
		}
	}
	return released, nil
}

// checkCompleterFinished fails the run unless the workers' first round
// once quiet, with nothing failing, finished each refund of released: the
// refund completer takes a released key at once, and a refund whose
// client gave up must not wait for an operator's refund finish.
func (s *simulation) checkCompleterFinished(ctx context.Context, released []*simRequest) error {
	for _, req := range released {
		if !s.keyFinished(ctx, req.client.user+"/"+req.key) {
			return s.fail("the refund under %s of %s, released after the processor timed out and given up on by its client, "+
				"was not finished by the refund completer's passes once quiet: only an operator's refund finish would", req.key, req.client.user)
		}
	}
	return nil
}

// String says how often a run reached the structures, for the summary.
func (a simAbandonedCounts) String() string {
	return fmt.Sprintf("%d refunds abandoned mid-call and asked for again a day later (%d catch-ups of the workers), "+
		"%d refunds given up on after a processor timeout", a.AbandonedRefunds, a.CatchUps, a.GaveUpRefunds)
}

// simAbandonedCounts count the structures in a run.
type simAbandonedCounts struct {
	AbandonedRefunds, CatchUps int
	// GaveUpRefunds counts the refunds whose client gave up on them after
	// a processor timeout (giveUpRefund).
	GaveUpRefunds int
}
