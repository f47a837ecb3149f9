// The simulator's reference model: what each client request must get,
// worked out from what the clients sent and were told, never from the
// system's own tables.
//
// An invariant that holds on the database says nothing about a client
// refused for no reason, nor about a status that a mistaken answer
// reported. So every answer is judged at the step it is given, against
// what the model allows:
//
//   - a key: while a request certainly holds it (its answer was given and
//     a day has not passed since the request was sent), a request with
//     another body gets 422 idempotency-key-reused and the same request
//     gets the same answer; while no request may hold it, neither is
//     refused as reused. Between the two (an answer lost, a key that may
//     have expired) both are allowed;
//   - a create: 201 for the order asked for (amount, currency, items,
//     payment method, status created), an order told to no one else; never
//     409, never 400 for a valid body;
//   - a refund: 404 for another user's order; otherwise the model knows the
//     order's fate (a declined card, or more of an item than is stocked,
//     is cancelled; plentiful items and a good card are paid; scarce items
//     may go either way) and bounds what was refunded, by our side and by
//     the processor, from the refunds answered, those still in doubt and
//     the refunds made at the processor's dashboard: a refund that fits is
//     granted, one too large refused with the right problem, one of a
//     cancelled order refused as not refundable;
//   - a webhook: a refund made at the dashboard is applied once (then
//     duplicate), never poison; a made-up one never applied; the
//     processor's announcement of our own refund counts nothing twice.
//
// Once quiet, each order told of must have ended as its fate allows, with
// the refunded amount the model counts.

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// simModel is the reference model of one run.
type simModel struct {
	// keys are the requests sent under each key, by user and key, in the
	// order of their first send.
	keys map[string][]*simRequest
	// orders are the orders clients were told of, by id; orderList the
	// same, in the order they were told.
	orders    map[string]*modelOrder
	orderList []*modelOrder
	// stocked is what the warehouse holds of each sku; demand what every
	// create sent so far may take of it (see sent).
	stocked, demand map[string]int64
	// dashboard are the refunds made at the processor's dashboard, by
	// order id (an order may be told of only after its refund was made).
	dashboard map[string][]*simRequest
	// refused are the orders whose shipment the warehouse may have
	// refused, by id (simulate_held.go).
	refused map[string]bool
}

// modelOrder is what the model knows of one order.
type modelOrder struct {
	id, user    string
	amount      int64
	currency    string
	items       []orderItem
	card        string
	createdBy   *simRequest
	leftCreated bool // some answer showed its payment settled
}

// newSimModel returns an empty model of the warehouse in schema.sql.
func newSimModel() *simModel {
	return &simModel{
		keys:      map[string][]*simRequest{},
		orders:    map[string]*modelOrder{},
		refused:   map[string]bool{},
		stocked:   map[string]int64{"sku-1": 1000, "sku-2": 1000, "sku-rare": 1},
		demand:    map[string]int64{},
		dashboard: map[string][]*simRequest{},
	}
}

// keyID names a key in the model.
func keyID(user, key string) string { return user + "\x00" + key }

// sent records that req is sent at, before the system sees it.
func (m *simModel) sent(req *simRequest, at time.Time) {
	if req.kind == "create" || req.kind == "refund" || req.kind == "hostile" {
		id := keyID(req.client.user, req.key)
		if !containsRequest(m.keys[id], req) {
			m.keys[id] = append(m.keys[id], req)
		}
	}
	// A create asks for its items once while its key certainly lives: a
	// day from its first send (a claim is no earlier, and a key lives a
	// day from its answer, which is later still). After that any send may
	// find the key expired and make another order: each counts again.
	if req.kind == "create" && (req.sends == 0 || !at.Before(req.firstSentAt.Add(idempotencyKeyTTL))) {
		if body, err := decodeOrderRequest([]byte(req.body)); err == nil {
			for _, item := range body.Items {
				m.demand[item.SKU] += item.Qty
			}
		}
	}
	// A new life of the key begins with the first send, and with the first
	// send after the last life's answer certainly expired.
	last, ok := lastDefinitive(req.answers)
	switch {
	case req.sends == 0:
		req.firstSentAt, req.lifeStart = at, at
	case ok && !at.Before(last.at.Add(idempotencyKeyTTL)) && !req.lifeStart.After(last.sentAt):
		req.lifeStart = at
	}
	req.sends++
}

// lastDefinitive returns the latest definitive answer of answers.
func lastDefinitive(answers []simAnswer) (simAnswer, bool) {
	for i := len(answers) - 1; i >= 0; i-- {
		if definitive(answers[i]) {
			return answers[i], true
		}
	}
	return simAnswer{}, false
}

// claimsKey reports whether answer says the request holds its key, its
// answer stored there.
func claimsKey(req *simRequest, answer simAnswer) bool {
	if !definitive(answer) {
		return false
	}
	kind := problemType(orderField([]byte(answer.body), "type"))
	switch {
	case answer.status == http.StatusBadRequest, kind == problemKeyReused:
		return false
	case req.kind == "create":
		return answer.status == http.StatusCreated
	default:
		return req.kind == "refund"
	}
}

// mayHaveClaimed reports whether some send of req may have claimed its key:
// one not refused before the key was taken.
func mayHaveClaimed(req *simRequest) bool {
	if req.kind == "hostile" {
		return false
	}
	if req.sends > len(req.answers) {
		return true // a send whose connection dropped
	}
	for _, answer := range req.answers {
		kind := problemType(orderField([]byte(answer.body), "type"))
		if answer.status == http.StatusBadRequest || kind == problemKeyReused || kind == problemPaymentPending {
			continue
		}
		return true
	}
	return false
}

// mayHoldUntil is when req's hold on its key has certainly ended: a day
// after the last answer it may have stored. A refund whose outcome is
// still in doubt holds it for as long as it stays unfinished.
func mayHoldUntil(req *simRequest) time.Time {
	if req.kind == "refund" && (undecided(req) || req.sends > len(req.answers)) {
		return time.Unix(1<<40, 0)
	}
	return req.lastEnd.Add(idempotencyKeyTTL)
}

// certainlyHolds reports whether req certainly held its key from before
// from and still does at until: it was answered with its stored outcome
// in its current life, and a day has not passed since that life began.
func certainlyHolds(req *simRequest, from, until time.Time) bool {
	for _, answer := range req.answers {
		if answer.sentAt.Before(req.lifeStart) || !claimsKey(req, answer) {
			continue
		}
		return !answer.at.After(from) && until.Before(req.lifeStart.Add(idempotencyKeyTTL))
	}
	return false
}

// keyHolders returns whether a request under req's key other than req may
// hold the key while req's send ran (from sentAt to at), and whether one
// certainly does.
func (m *simModel) keyHolders(req *simRequest, sentAt, at time.Time) (may, certain bool) {
	for _, other := range m.keys[keyID(req.client.user, req.key)] {
		if other == req || other.firstSentAt.After(at) {
			continue
		}
		if mayHaveClaimed(other) && sentAt.Before(mayHoldUntil(other)) {
			may = true
		}
		if certainlyHolds(other, sentAt, at) {
			certain = true
		}
	}
	return may, certain
}

// judge checks answer, which action's request just got, against the
// model, and learns from it.
func (m *simModel) judge(s *simulation, action *simAction, answer simAnswer) error {
	req := action.request
	if answer.status == http.StatusServiceUnavailable {
		return nil // judged in answered: a 503 is allowed when something was down
	}
	kind := problemType(orderField([]byte(answer.body), "type"))
	switch req.kind {
	case "hostile":
		if kind != problemValidation {
			return s.fail("hostile body %s got %d %s, want 400 %s", req.body, answer.status, kind, problemValidation)
		}
		return nil
	case "webhook":
		return m.judgeWebhook(s, req, answer)
	case "stale-signed":
		if answer.status != http.StatusBadRequest || kind != problemBadSignature {
			side := "ahead of"
			if req.signSkew < 0 {
				side = "behind"
			}
			return s.fail("event %s signed %s %s our clock, beyond the %s tolerance, got %d %s, want 400 %s",
				req.eventID, req.signSkew.Abs(), side, webhookTolerance, answer.status, shorten(answer.body, 160), problemBadSignature)
		}
		return nil
	}
	may, certain := m.keyHolders(req, action.sentAt, answer.at)
	if kind == problemKeyReused {
		if !may {
			return s.fail("%s %s key %s of %s was refused as reused, but no other request may hold it", req.method, req.path, req.key, req.client.user)
		}
		return nil
	}
	if certain {
		return s.fail("%s %s key %s of %s got %d %s, but another request holds the key: want 422 %s",
			req.method, req.path, req.key, req.client.user, answer.status, shorten(answer.body, 100), problemKeyReused)
	}
	if kind == problemKeyInProgress {
		// Another send of the request holds the lease: one sent before it
		// and not answered, or one sent since; or the completer took the
		// key over while this send was held past the lease.
		busy := action.keyMayBeBusy || req.sends > action.sendsBefore || answer.at.Sub(action.sentAt) >= s.app.leases.refundLock
		if req.kind != "refund" || !busy {
			return s.fail("%s %s key %s got 409 %s, but no request under the key was in progress",
				req.method, req.path, req.key, kind)
		}
		return nil
	}
	// A replay of this request's own earlier answer: judged in answered
	// against that answer, not against what holds now.
	for _, earlier := range req.answers[:len(req.answers)-1] {
		if definitive(earlier) && earlier.body == answer.body && earlier.status == answer.status {
			return nil
		}
	}
	if req.kind == "create" {
		return m.judgeCreate(s, req, answer)
	}
	return m.judgeRefund(s, action, answer)
}

// judgeCreate checks a create's new answer: the order asked for, new.
func (m *simModel) judgeCreate(s *simulation, req *simRequest, answer simAnswer) error {
	if answer.status != http.StatusCreated {
		return s.fail("a valid create key %s got %d, want 201: %s", req.key, answer.status, shorten(answer.body, 160))
	}
	asked, err := decodeOrderRequest([]byte(req.body))
	if err != nil {
		return fmt.Errorf("bug: the simulator sent an invalid create %s: %w", req.body, err)
	}
	var got orderView
	if err := json.Unmarshal([]byte(answer.body), &got); err != nil {
		return s.fail("a 201 that is not an order: %s", answer.body)
	}
	if got.Status != orderCreated || got.AmountCents != asked.AmountCents || got.Currency != asked.Currency ||
		got.PaymentMethod != asked.PaymentMethod || got.RefundedCents != 0 || fmt.Sprint(got.Items) != fmt.Sprint(asked.Items) {
		return s.fail("create key %s asked for %s and got %s", req.key, req.body, answer.body)
	}
	if known, ok := m.orders[got.OrderID]; ok {
		if known.createdBy != req {
			return s.fail("create key %s of %s was told of order %s, made for key %s of %s",
				req.key, req.client.user, got.OrderID, known.createdBy.key, known.createdBy.client.user)
		}
		return nil
	}
	order := &modelOrder{id: got.OrderID, user: req.client.user, amount: asked.AmountCents, currency: asked.Currency,
		items: asked.Items, card: asked.PaymentMethod, createdBy: req}
	m.orders[order.id] = order
	m.orderList = append(m.orderList, order)
	return nil
}

// fate says how an order may end: paid (then perhaps refunded), cancelled,
// or either.
func (m *simModel) fate(order *modelOrder) (mayBePaid, mayBeCancelled bool) {
	if order.card == pmCardDeclined {
		return false, true
	}
	plentiful := true
	for _, item := range order.items {
		if item.Qty > m.stocked[item.SKU] {
			return false, true
		}
		if m.demand[item.SKU] > m.stocked[item.SKU] {
			plentiful = false
		}
	}
	// The warehouse may have refused its shipment (simulate_held.go).
	return true, !plentiful || m.refused[order.id]
}

// refundBounds are what the model knows of an order's refunds: what our
// side counts at least and at most (pending refunds included, as a new
// refund's check counts them), and what the processor gave back at least
// and at most.
type refundBounds struct {
	ourMin, ourMax, processorMin, processorMax int64
}

// bounds works out order's refundBounds from every refund request and
// dashboard refund the model has seen, except the request except.
func (m *simModel) bounds(s *simulation, order *modelOrder, except *simRequest) refundBounds {
	var b refundBounds
	for _, client := range s.clients {
		for _, req := range client.requests {
			if req == except || req.kind != "refund" || req.orderID != order.id || req.client.user != order.user {
				continue
			}
			made, low, high := refundOutcome(req, order)
			if made {
				b.ourMin += low
				b.processorMin += low
			}
			b.ourMax += high
			b.processorMax += high
		}
	}
	for _, event := range m.dashboard[order.id] {
		b.processorMin += event.refundAmount
		b.processorMax += event.refundAmount
		switch webhookApplied(event) {
		case "yes":
			b.ourMin += event.refundAmount
			b.ourMax += event.refundAmount
		case "maybe":
			b.ourMax += event.refundAmount
		}
	}
	return b
}

// refundsAnswered is what our API's answers say it refunded of order.
func (m *simModel) refundsAnswered(s *simulation, order *modelOrder) int64 {
	var made int64
	for _, client := range s.clients {
		for _, req := range client.requests {
			if req.kind != "refund" || req.orderID != order.id || req.client.user != order.user {
				continue
			}
			if ok, amount, _ := refundOutcome(req, order); ok {
				made += amount
			}
		}
	}
	return made
}

// refundOutcome returns what a refund request is known to have given back:
// certainly (made, and low == high, the amount), or between low (0) and
// high while in doubt.
func refundOutcome(req *simRequest, order *modelOrder) (made bool, low, high int64) {
	for _, answer := range req.answers {
		if answer.status == http.StatusOK {
			var view refundView
			if json.Unmarshal([]byte(answer.body), &view) == nil {
				return true, view.AmountCents, view.AmountCents
			}
		}
	}
	if !refundInDoubt(req) {
		return false, 0, 0
	}
	var asked refundRequest
	if err := json.Unmarshal([]byte(req.body), &asked); err == nil && asked.AmountCents != nil {
		return false, 0, *asked.AmountCents
	}
	return false, 0, order.amount
}

// refundInDoubt reports whether a refund request without a 200 may have
// made a refund all the same: a send of it went unanswered (a 503, a
// dropped connection), and no answer since settled that it made none. A
// refusal of the order or of the amount does (a request that had recorded
// a refund resumes it instead of checking again), and so does the
// processor's refusal; a refusal of the key (reused, expired) does not: it
// says only that the key's life, and its outcome, ended unheard.
func refundInDoubt(req *simRequest) bool {
	inDoubt := req.sends > len(req.answers)
	for _, answer := range req.answers {
		kind := problemType(orderField([]byte(answer.body), "type"))
		switch {
		case answer.status == http.StatusOK:
			return false
		case !definitive(answer):
			inDoubt = true
		case kind == problemKeyReused, kind == problemKeyExpired:
		default:
			inDoubt = false
		}
	}
	return inDoubt
}

// webhookApplied says whether the dashboard refund event was applied:
// "yes", "no", or "maybe" (a delivery whose answer never came).
func webhookApplied(event *simRequest) string {
	maybe := event.sends > len(event.answers)
	for _, answer := range event.answers {
		switch outcome := webhookOutcome(answer); {
		case outcome == string(inboxApplied), outcome == string(inboxDuplicate):
			return "yes"
		case answer.status == http.StatusServiceUnavailable:
			// Early (not recorded), or an outage that may have lost the
			// commit's answer.
			maybe = true
		}
	}
	if maybe {
		return "maybe"
	}
	return "no"
}

// webhookOutcome is the inbox outcome a webhook answer reports.
func webhookOutcome(answer simAnswer) string {
	if answer.status != http.StatusOK {
		return ""
	}
	return orderField([]byte(answer.body), "outcome")
}

// judgeRefund checks a refund's new answer against the order's fate and
// refund bounds.
func (m *simModel) judgeRefund(s *simulation, action *simAction, answer simAnswer) error {
	req := action.request
	kind := problemType(orderField([]byte(answer.body), "type"))
	order, ok := m.orders[req.orderID]
	if !ok || order.user != req.client.user {
		if answer.status != http.StatusNotFound || kind != problemNotFound {
			return s.fail("refund key %s of %s for order %s, not theirs, got %d, want 404: %s",
				req.key, req.client.user, req.orderID, answer.status, shorten(answer.body, 160))
		}
		return nil
	}
	if kind == problemKeyExpired {
		if unsettled, ok := m.unsettledUnderKey(req); ok && answer.at.Before(unsettled.Add(idempotencyKeyTTL)) {
			return s.fail("refund key %s of %s was refused as expired %s after it was last known unsettled: it replays for a day from its answer",
				req.key, req.client.user, answer.at.Sub(unsettled))
		}
		if !m.mayHaveRefundedUnderKey(req, answer.at) {
			return s.fail("refund key %s of %s was refused as expired, but no refund of order %s can have been made under it a day ago",
				req.key, req.client.user, order.id)
		}
		return nil
	}
	if m.mustBeExpired(req, answer.at) {
		return s.fail("refund key %s of %s made a refund of order %s over a day ago: want 422 %s, got %d %s",
			req.key, req.client.user, order.id, problemKeyExpired, answer.status, shorten(answer.body, 160))
	}
	mayBePaid, mayBeCancelled := m.fate(order)
	b := m.bounds(s, order, req)
	var asked refundRequest
	if err := json.Unmarshal([]byte(req.body), &asked); err != nil {
		return fmt.Errorf("bug: the simulator sent an invalid refund %s: %w", req.body, err)
	}
	need := int64(1)
	if asked.AmountCents != nil {
		need = *asked.AmountCents
	}
	mayBeRefunded := b.ourMax >= order.amount
	refuse := func(why string) error {
		return s.fail("refund key %s of %s: %d of order %s (%d; our refunds %d..%d, the processor's %d..%d; may be paid %t, cancelled %t): %s; got %d %s",
			req.key, req.client.user, need, order.id, order.amount, b.ourMin, b.ourMax, b.processorMin, b.processorMax,
			mayBePaid, mayBeCancelled, why, answer.status, shorten(answer.body, 200))
	}
	switch {
	case answer.status == http.StatusOK:
		if !mayBePaid {
			return refuse("a refund of an order that cannot have been paid was granted")
		}
		var view refundView
		if err := json.Unmarshal([]byte(answer.body), &view); err != nil {
			return refuse("a 200 that is not a refund")
		}
		x := view.AmountCents
		switch {
		case asked.AmountCents != nil && x != *asked.AmountCents:
			return refuse("the refund made is not the amount asked for")
		case asked.AmountCents == nil && (x < order.amount-b.ourMax || x > order.amount-b.ourMin):
			return refuse("a refund of all that remains refunded another amount")
		case x <= 0 || x > order.amount-b.ourMin || x > order.amount-b.processorMin:
			return refuse("the refund exceeds what remains")
		case view.Order.OrderID != order.id || view.Order.RefundedCents > b.ourMax+x || view.Order.RefundedCents > order.amount:
			return refuse("the order in the answer counts more refunded than can have been")
		case (view.Order.Status == orderRefunded) != (view.Order.RefundedCents == order.amount) ||
			(view.Order.Status != orderRefunded && view.Order.Status != orderPaid):
			return refuse("the order in the answer has a status that disagrees with its refunds")
		}
		order.leftCreated = true
	case kind == problemRefundTooLarge:
		// An order certainly refunded in full is no longer paid: it is
		// refused as not refundable before any amount is looked at. (A
		// replayed answer was stored earlier, by the request's first
		// send or the completer, maybe while the last refund was still
		// pending and the order paid.)
		if !mayBePaid || need <= order.amount-b.ourMax || (b.ourMin >= order.amount && !answer.replayed) {
			return refuse("a refund that fits was refused as too large")
		}
		order.leftCreated = true
	case kind == problemProcessorRefused:
		// The processor refuses what exceeds what it still holds; all that
		// remains by our count exceeds it when it gave back more than we
		// counted (a dashboard refund whose event has not been applied).
		fits := need <= order.amount-b.processorMax
		if asked.AmountCents == nil {
			fits = b.processorMax <= b.ourMin
		}
		if !mayBePaid || fits {
			return refuse("a refund that fits at the processor was refused by it")
		}
		order.leftCreated = true
	case kind == problemOrderNotRefundable:
		if !mayBeCancelled && !mayBeRefunded {
			return refuse("an order that is paid and not all refunded was refused as not refundable")
		}
		order.leftCreated = true
	case kind == problemPaymentPending:
		if order.leftCreated {
			return refuse("an order whose payment had settled was said to be still paying")
		}
	default:
		return refuse("not an answer a refund may get")
	}
	return nil
}

// mayHaveRefundedUnderKey reports whether some request under req's key,
// for req's order, may have recorded a refund at least a day before at:
// then the key, sent again after its expiry, is refused as expired.
func (m *simModel) mayHaveRefundedUnderKey(req *simRequest, at time.Time) bool {
	for _, other := range m.keys[keyID(req.client.user, req.key)] {
		if other.kind != "refund" || other.path != req.path {
			continue
		}
		made, _, _ := refundOutcome(other, &modelOrder{})
		refused := false
		for _, answer := range other.answers {
			refused = refused || problemType(orderField([]byte(answer.body), "type")) == problemProcessorRefused
		}
		if !made && !refused && !refundInDoubt(other) && other != req {
			continue // refused before any refund was recorded
		}
		if !at.Before(other.firstSentAt.Add(idempotencyKeyTTL)) {
			return true
		}
	}
	return false
}

// unsettledUnderKey returns the latest time the simulator knows a refund
// under req's key, for req's order, was claimed and not settled (see
// simRequest.unsettledAt): its answer, whenever stored, came later, and
// the key replays it for a day from then.
func (m *simModel) unsettledUnderKey(req *simRequest) (time.Time, bool) {
	var latest time.Time
	for _, other := range m.keys[keyID(req.client.user, req.key)] {
		if other.kind == "refund" && other.path == req.path && other.unsettledAt.After(latest) {
			latest = other.unsettledAt
		}
	}
	return latest, !latest.IsZero()
}

// mustBeExpired reports whether req certainly made a refund of its order
// under its key, which has certainly expired since: the only answer then is
// 422 idempotency-key-expired.
func (m *simModel) mustBeExpired(req *simRequest, at time.Time) bool {
	earlier := req.answers[:len(req.answers)-1]
	last, ok := lastDefinitive(earlier)
	if !ok || at.Before(last.at.Add(idempotencyKeyTTL)) {
		return false
	}
	for _, answer := range earlier {
		if answer.status == http.StatusOK {
			return true
		}
	}
	return false
}

// judgeWebhook checks a processor event's answer: a refund made at the
// dashboard is applied once and never poison; a made-up one is never
// applied; an announcement of our own refund is never poison.
func (m *simModel) judgeWebhook(s *simulation, req *simRequest, answer simAnswer) error {
	outcome := webhookOutcome(answer)
	if answer.status != http.StatusOK {
		return s.fail("event %s got %d: %s", req.eventID, answer.status, shorten(answer.body, 160))
	}
	applied := 0
	for _, earlier := range req.answers {
		if webhookOutcome(earlier) == string(inboxApplied) {
			applied++
		}
	}
	switch {
	case applied > 1:
		return s.fail("event %s was applied twice", req.eventID)
	case req.eventKind == "made-up" && outcome == string(inboxApplied):
		return s.fail("event %s, a refund the processor never made or of an amount no refund could have, was applied", req.eventID)
	case req.eventKind != "made-up" && outcome == string(inboxPoison):
		return s.fail("event %s, a %s refund the processor made, is poison: %s", req.eventID, req.eventKind, shorten(answer.body, 200))
	case outcome == string(inboxDuplicate) && req.sends == 1:
		return s.fail("event %s, delivered once, is a duplicate", req.eventID)
	}
	if order, ok := m.orders[req.orderID]; ok && outcome == string(inboxApplied) {
		order.leftCreated = true
	}
	return nil
}

// checkFinal checks, once quiet, each order told of against its fate and
// the refunds the model counts.
func (m *simModel) checkFinal(ctx context.Context, s *simulation) error {
	for _, order := range m.orderList {
		var status orderStatus
		var refunded int64
		err := s.direct.QueryRowContext(ctx, `SELECT status, refunded_cents FROM orders WHERE order_id = ?`, order.id).Scan(&status, &refunded)
		if err != nil {
			return s.fail("order %s, told of, cannot be read: %v", order.id, err)
		}
		mayBePaid, mayBeCancelled := m.fate(order)
		b := m.bounds(s, order, nil)
		switch {
		case status == orderCancelled && !mayBeCancelled:
			return s.fail("once quiet, order %s (%s, items %v) is cancelled, but nothing could stop it being paid", order.id, order.card, order.items)
		case (status == orderPaid || status == orderRefunded) && !mayBePaid:
			return s.fail("once quiet, order %s (%s, items %v) is %s, but it cannot have been paid", order.id, order.card, order.items, status)
		case status == orderCancelled && (refunded != 0 || m.refundsAnswered(s, order) > 0):
			// A refund made at the dashboard may come before the saga
			// cancels (its compensation then refunds what remains, if
			// anything): the money checks judge that the processor holds
			// none. Our own API refunds only paid orders.
			return s.fail("once quiet, order %s is cancelled, but it counts %d refunded, and our API refunded %d of it", order.id, refunded, m.refundsAnswered(s, order))
		case status != orderCancelled && (refunded < b.ourMin || refunded > b.ourMax):
			return s.fail("once quiet, order %s counts %d refunded; the refunds answered and made at the processor add up to %d..%d",
				order.id, refunded, b.ourMin, b.ourMax)
		}
	}
	return nil
}
