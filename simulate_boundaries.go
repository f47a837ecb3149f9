// Boundaries in the simulator: the unit of stock, the instant a key
// expires, the clock reading a key's lifetime counts from, and the second
// at which a webhook's signature is too old (or too new).
//
// Each is a value at which the right answer changes, and the simulator,
// left to chance, never lands on it. Its stock is a thousand units or
// one, so an order never asks for exactly what a plentiful item has left;
// its retries come a little or a day later, never at the microsecond a
// key's answer plus a day comes round; a create whose transaction spans a
// clock move is retried a day later, long after both its claim and its
// answer; and every webhook is signed at the receiver's own second. So a
// comparison off by one, in either direction, passed every seed. These
// structures land there on purpose:
//
//   - exactly the stock that remains: sku-last is stocked with a few
//     units, and the orders of it ask, together, for exactly that many
//     (lastStockCreate). Whichever reserves last asks for exactly what is
//     available; with a good card and nobody asking for more, the model
//     knows every one of them must be paid (simModel.fate);
//   - a retry at a key's expiry (probeKeyExpiry): a create or a refund
//     whose answer was stored at a known instant (its send ran without the
//     clock moving), sent again at that instant plus idempotencyKeyTTL, or
//     a microsecond before. A key replays while expires_at > now (idem.go:
//     lookupKey and replaySettledKey both treat expires_at <= now as
//     expired), so a microsecond before it must be replayed, and at the
//     instant it must not: a create runs as new, a refund key sent again
//     for the order it refunded is refused as expired. A create's retry
//     takes the read path (replaySettledKey), a refund's the write path
//     (lookupKey in acquireKey);
//   - a create whose transaction spans a clock move (probeClockMovedCreate):
//     the clock jumps at a fault point inside its transaction, and its
//     retry comes between its claim plus a day and its answer plus a day.
//     The key's life counts from the answer (insertCompletedKey reads the
//     clock again), so it must be replayed;
//   - a webhook signed off the receiver's clock (newStaleSignature, and
//     the skew of newRefundEvent): beyond webhookTolerance, in the past or
//     the future, it must be refused 400 bad-signature and change
//     nothing; within it, as a processor whose clock is a little off signs
//     it, it must be taken as usual.

package main

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// simBoundaryCounts count the structures of a run.
type simBoundaryCounts struct {
	// LastStockOrders counts the orders of sku-last, which together ask
	// for exactly its stock.
	LastStockOrders int
	// ExpiryProbes counts the retries sent at a key's expiry or a
	// microsecond before; ClockMovedProbes the retries of a create whose
	// transaction spanned a clock move, sent after its claim plus a day
	// and before its answer plus a day.
	ExpiryProbes, ClockMovedProbes int
	// StaleSignatures counts webhooks signed beyond the tolerance (past or
	// future); SkewedSignatures the events signed within it, off the
	// receiver's clock.
	StaleSignatures, SkewedSignatures int
}

// add adds other's counts to c.
func (c *simBoundaryCounts) add(other simBoundaryCounts) {
	c.LastStockOrders += other.LastStockOrders
	c.ExpiryProbes += other.ExpiryProbes
	c.ClockMovedProbes += other.ClockMovedProbes
	c.StaleSignatures += other.StaleSignatures
	c.SkewedSignatures += other.SkewedSignatures
}

// String is the summary line's part.
func (c simBoundaryCounts) String() string {
	return fmt.Sprintf("%d orders of the last units of %s, %d retries at a key's expiry or a microsecond before, "+
		"%d retries of a create whose transaction spanned a clock move, %d webhooks signed beyond the tolerance, %d events signed off our clock within it",
		c.LastStockOrders, lastSKU, c.ExpiryProbes, c.ClockMovedProbes, c.StaleSignatures, c.SkewedSignatures)
}

// lastSKU is stocked with a few units when a run starts; its orders ask,
// together, for exactly as many (simLastStock).
const lastSKU = "sku-last"

// simLastStock is how much of lastSKU is stocked, and how much the orders
// sent so far ask for.
type simLastStock struct {
	stocked, asked int64
}

// stockLastSKU stocks lastSKU with two to four units, in the warehouse and
// in the model, before anything runs.
func (s *simulation) stockLastSKU(ctx context.Context) error {
	stocked := int64(2 + s.rng.IntN(3))
	_, err := s.direct.ExecContext(ctx, `
		INSERT INTO stock_items (sku, available, stocked) VALUES (?, ?, ?)`,
		lastSKU, stocked, stocked)
	if err != nil {
		return fmt.Errorf("stock %s: %w", lastSKU, err)
	}
	s.lastStock = simLastStock{stocked: stocked}
	s.model.stocked[lastSKU] = stocked
	return nil
}

// lastStockCreate returns, now and then, a new create of client's for
// units of lastSKU with a good card: some of what no order has asked for
// yet, or all of it; nil when all is asked for, or not this time. A
// request is asked for once (the model counts a create's demand once
// within a day of its first send): together the orders ask for exactly
// the stock.
func (s *simulation) lastStockCreate(client *simClient) *simRequest {
	left := s.lastStock.stocked - s.lastStock.asked
	if left <= 0 || !s.chance(0.08) {
		return nil
	}
	qty := left
	if left > 1 && s.chance(0.5) {
		qty = 1 + s.rng.Int64N(left-1)
	}
	s.lastStock.asked += qty
	s.report.Counts.LastStockOrders++
	body := orderBodyJSON(int64(100*(1+s.rng.IntN(90))), []orderItem{{SKU: lastSKU, Qty: qty}}, pmCardVisa)
	req := &simRequest{client: client, kind: "create", method: "POST", path: "/api/orders", key: s.newKey(client, "order"), body: body}
	s.tracef("%s orders %d of %s, of which %d of %d are now asked for", client.name, qty, lastSKU, s.lastStock.asked, s.lastStock.stocked)
	return req
}

// expiryProbeChance is the chance, per client request, that the client
// sends a create or refund again at its key's expiry, or a microsecond
// before (probeKeyExpiry).
const expiryProbeChance = 0.03

// simExpiryProbe is a retry sent at a chosen instant of its key's life,
// with the answer it must get.
type simExpiryProbe struct {
	request *simRequest
	// answer is the answer the key stores, given at a known instant.
	answer simAnswer
	// at is when the retry is sent; dueStep the step it is sent at.
	at      time.Time
	dueStep int
	// wantReplay: the key still lives at at, and the retry must get answer
	// again; otherwise it has expired, and must not.
	wantReplay bool
	// why says where at lies, for the trace and a failure.
	why string
	// clockMoved is set for the retry of a create whose transaction
	// spanned a clock move (probeClockMovedCreate).
	clockMoved bool
}

// storedAnswer returns the answer req's key stores, if the simulator knows
// when it was stored: the last answer that was not a replay, a 201 of a
// create or a 200 of a refund, and nothing since that could have changed
// the key (a send in flight or dropped, a lost commit, another answer
// that was not a replay). A refund stores its answer in its last phase's
// transaction, after its last fault point: at the instant its client got
// it. A create stores it in its one transaction, which may wait in a
// group commit's queue or span a clock move: with sentInOneGo, only one
// whose send ran without the clock moving.
func storedAnswer(req *simRequest, sentInOneGo bool) (simAnswer, bool) {
	if req.inFlight > 0 || req.sends != len(req.answers) || !req.commitLostAt.IsZero() || req.gaveUp {
		return simAnswer{}, false
	}
	want := map[string]int{"create": http.StatusCreated, "refund": http.StatusOK}[req.kind]
	for i := len(req.answers) - 1; i >= 0; i-- {
		answer := req.answers[i]
		switch {
		case !definitive(answer):
			// A 503 stored nothing.
		case answer.replayed:
			// The key's answer again: it must be the one below.
		case answer.status != want || (sentInOneGo && req.kind == "create" && !answer.sentAt.Equal(answer.at)):
			return simAnswer{}, false
		default:
			for _, later := range req.answers[i+1:] {
				if definitive(later) && later.body != answer.body {
					return simAnswer{}, false
				}
			}
			return answer, true
		}
	}
	return simAnswer{}, false
}

// probeReady reports whether the world lets a probe's retry reach the key
// at the instant it is sent: the database up, its disk with room, no group
// commit held (a create would queue), nothing quiescing.
func (s *simulation) probeReady() bool {
	if s.quiescing || s.groupProcess != nil || s.network == nil || s.network.down || s.network.diskFull {
		return false
	}
	return true
}

// probeKeyExpiry picks a create or refund of any client's whose answer
// was stored at a known instant, and its client sends it again at that
// instant plus idempotencyKeyTTL, or a microsecond before. It reports
// whether it sent one.
func (s *simulation) probeKeyExpiry(ctx context.Context) (bool, error) {
	if !s.probeReady() || s.expiryProbe != nil {
		return false, nil
	}
	var creates, refunds []*simRequest
	for _, client := range s.clients {
		for _, req := range client.requests {
			if answer, ok := storedAnswer(req, true); ok && s.clock.now().Before(answer.at.Add(idempotencyKeyTTL-time.Microsecond)) {
				if req.kind == "refund" {
					refunds = append(refunds, req)
				} else {
					creates = append(creates, req)
				}
			}
		}
	}
	// Half the time a refund, if there is one: there are fewer, and only
	// their retries take the write path.
	candidates := creates
	if len(refunds) > 0 && (len(creates) == 0 || s.chance(0.5)) {
		candidates = refunds
	}
	if len(candidates) == 0 {
		return false, nil
	}
	req := pick(s, candidates)
	answer, _ := storedAnswer(req, true)
	return true, s.sendProbe(ctx, s.expiryInstant(req, answer, s.step))
}

// expiryInstant returns a probe of req's key at its expiry, answer's
// instant plus idempotencyKeyTTL, or, half the time, a microsecond
// before, due at step dueStep.
func (s *simulation) expiryInstant(req *simRequest, answer simAnswer, dueStep int) *simExpiryProbe {
	probe := &simExpiryProbe{request: req, answer: answer, at: answer.at.Add(idempotencyKeyTTL), dueStep: dueStep,
		why: "at its expiry, its answer plus " + idempotencyKeyTTL.String()}
	if s.chance(0.5) {
		probe.at = probe.at.Add(-time.Microsecond)
		probe.wantReplay = true
		probe.why = "a microsecond before its expiry, its answer plus " + idempotencyKeyTTL.String()
	}
	return probe
}

// probeRefundExpiry is called when a refund answers 200 from the phases
// it ran, the answer its key stores from that instant: seven times in
// ten it schedules a retry at the key's expiry, or a microsecond before,
// for a step or two on. (Refunds answered 200 while the faults go on are
// few; left to probeKeyExpiry, a refund key's expiry, which only the
// write path decides, was rarely probed.)
func (s *simulation) probeRefundExpiry(req *simRequest, answer simAnswer) {
	if s.expiryProbe != nil || s.quiescing || answer.replayed || answer.status != http.StatusOK || !s.chance(0.7) {
		return
	}
	s.expiryProbe = s.expiryInstant(req, answer, s.step+1+s.rng.IntN(3))
}

// probeClockMovedCreate is called when a create answers 201 from a send in
// whose transaction the clock jumped, from from to to: the key's claim
// read the clock at from or before, its answer at to or after. It
// schedules a retry between from plus a day and to plus a day, for a step
// or two on: the key must replay it.
func (s *simulation) probeClockMovedCreate(action *simAction, answer simAnswer) {
	from, to := action.clockMovedFrom, action.clockMovedTo
	if s.expiryProbe != nil || s.quiescing || answer.replayed || answer.status != http.StatusCreated || to.Sub(from) < 2*time.Microsecond {
		return
	}
	at := from.Add(idempotencyKeyTTL + to.Sub(from)/2).Truncate(time.Microsecond)
	s.expiryProbe = &simExpiryProbe{request: action.request, answer: answer, at: at, dueStep: s.step + 1 + s.rng.IntN(3),
		wantReplay: true, clockMoved: true, why: fmt.Sprintf("%s after its claim and %s before its answer plus %s (its transaction spanned a clock move of %s)",
			at.Sub(from), to.Add(idempotencyKeyTTL).Sub(at), idempotencyKeyTTL, to.Sub(from))}
	s.tracef("a%d %s: the create's transaction spanned a clock move of %s; its retry is due in a day", action.id, action.process.name, to.Sub(from))
}

// stepExpiryProbe sends the scheduled probe at its step, if its key is
// still as it was and the world lets the retry reach it. It reports
// whether it sent it.
func (s *simulation) stepExpiryProbe(ctx context.Context) (bool, error) {
	probe := s.expiryProbe
	if probe == nil || s.step < probe.dueStep {
		return false, nil
	}
	s.expiryProbe = nil
	answer, ok := storedAnswer(probe.request, false)
	if !ok || answer.body != probe.answer.body || !s.probeReady() || !s.clock.now().Before(probe.at) {
		s.tracef("the retry of key %s due %s is not sent: its key or the world moved on", probe.request.key, probe.why)
		return false, nil
	}
	return true, s.sendProbe(ctx, probe)
}

// sendProbe moves the clock to probe.at and sends its request again there.
func (s *simulation) sendProbe(ctx context.Context, probe *simExpiryProbe) error {
	if probe.clockMoved {
		s.report.Counts.ClockMovedProbes++
	} else {
		s.report.Counts.ExpiryProbes++
	}
	d := probe.at.Sub(s.clock.now())
	s.clock.advance(d)
	s.report.Counts.ClockJumps++
	req := probe.request
	s.tracef("clock +%s: %s sends key %s again %s", d, req.client.name, req.key, probe.why)
	s.report.Counts.Retries++
	return s.sendRequestProbing(ctx, req.client, req, probe)
}

// judgeProbe checks the answer to a probe's retry: the key's answer again
// while it lives, and not once it has expired (a create runs as new; a
// refund key sent again for the order it refunded is refused as expired).
// A 503 (the database failed it) says nothing either way. Whether the key
// has expired is decided at the instant the retry arrives, before its
// first fault point; only a refund can wait after it (see below).
func (s *simulation) judgeProbe(action *simAction, answer simAnswer) error {
	probe := action.probe
	if probe == nil || answer.status == http.StatusServiceUnavailable {
		return nil
	}
	req := probe.request
	stored := probe.answer
	kind := problemType(orderField([]byte(answer.body), "type"))
	switch {
	case probe.wantReplay && (answer.status != stored.status || answer.body != stored.body || !answer.replayed):
		return s.fail("%s %s key %s of %s, answered at %s, sent again %s got %d %s; want its answer replayed: %d %s",
			req.method, req.path, req.key, req.client.user, stored.at.Format(timeFormat), probe.why,
			answer.status, shorten(answer.body, 120), stored.status, shorten(stored.body, 120))
	case probe.wantReplay:
	case req.kind == "create" && (answer.replayed || answer.body == stored.body):
		return s.fail("create key %s of %s, answered at %s, sent again %s was replayed: "+
			"a key replays while expires_at > now, and runs as new at the instant it expires", req.key, req.client.user, stored.at.Format(timeFormat), probe.why)
	case req.kind == "refund" && answer.status == http.StatusConflict && kind == problemKeyInProgress && action.waited:
		// It claimed the expired key anew, then was held past its lease,
		// and the request that took the key over answers for it.
	case req.kind == "refund" && (answer.status != http.StatusUnprocessableEntity || kind != problemKeyExpired):
		return s.fail("refund key %s of %s, answered at %s, sent again for the order it refunded %s got %d %s; want 422 %s",
			req.key, req.client.user, stored.at.Format(timeFormat), probe.why, answer.status, shorten(answer.body, 120), problemKeyExpired)
	}
	return nil
}

// newStaleSignature returns an earlier event sent again with a signature
// made off the receiver's clock by more than webhookTolerance, in the past
// (a captured webhook replayed) or the future (a sender whose clock runs
// ahead, or a signature made to outlive the tolerance): it must be refused
// 400 bad-signature, however good its body. nil if no event was sent yet.
func (s *simulation) newStaleSignature(client *simClient) *simRequest {
	if len(s.webhooks) == 0 {
		return nil
	}
	event := s.events[pick(s, s.webhooks)]
	skew := webhookTolerance + time.Second + time.Duration(s.rng.IntN(600))*time.Second
	if s.chance(0.5) {
		skew = -skew
	}
	s.report.Counts.StaleSignatures++
	return &simRequest{client: client, kind: "stale-signed", method: "POST", path: "/webhooks/processor", body: event.body,
		eventID: event.eventID, signSkew: skew}
}

// signingSkew returns, for one event in five, how far off the receiver's
// clock the processor's clock is when it signs the event: within
// webhookTolerance, by two seconds at least (the signature carries whole
// seconds), in either direction. The event must be taken as usual.
func (s *simulation) signingSkew() time.Duration {
	if !s.chance(0.2) {
		return 0
	}
	s.report.Counts.SkewedSignatures++
	skew := time.Duration(s.rng.Int64N(int64(webhookTolerance - 2*time.Second)))
	if s.chance(0.5) {
		skew = -skew
	}
	return skew
}
