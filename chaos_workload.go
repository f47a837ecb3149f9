// The chaos clients: what they send and what they may be answered. Beside
// plain creates retried with one key, the mix holds the requests that make
// the races reachable (refunds in parts, some at once; refunds made at the
// processor's dashboard and announced by webhook; the last unit of a rare
// SKU; one key sent to create and refund at once; keys reused after they
// expired) and valid-but-hostile input (bodies whose keys differ only in
// case, webhooks with absurd amounts or unknown charges, duplicated and out
// of order). Every answer is kept and checked against the database when the
// run is quiet (auditWorkload).

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// chaosRefundPlan is how a client refunds its order.
type chaosRefundPlan int

const (
	refundNone chaosRefundPlan = iota
	// refundWholeTwice refunds everything under one key, then sends the
	// same request again: the second answer must be the first's replay.
	refundWholeTwice
	// refundInParts refunds a quarter twice at once under two keys, sends
	// the first again, then refunds the rest under a third key.
	refundInParts
)

// chaosRefundKey is one refund request a client made, kept so it can be
// reused after the clock jumped past its expiry.
type chaosRefundKey struct {
	key, body string
	// refunded: the key was answered 200. Reused after expiry it must be
	// answered 422 idempotency-key-expired; a key that was refused may run
	// again as new, which refunds nothing twice.
	refunded bool
	// jumps is how many clock jumps had settled when the key was first
	// sent: a later answer for it is judged against this count.
	jumps int
}

// chaos201 is an order a client was answered 201 for.
type chaos201 struct {
	orderID, userID, key string
}

// chaosRefund is a refund a client was answered 200 for.
type chaosRefund struct {
	orderID, refundID string
	amount            int64
}

// chaosWebhook is one processor event the run sent and its final answer.
type chaosWebhook struct {
	eventID, chargeID, refundID string
	amount                      int64
	// legit: the processor really made this refund (at its dashboard), so
	// it must end up recorded; otherwise it must never be.
	legit   bool
	status  int
	outcome string
}

// chaosKeyCheck is a key under which nothing may be stored: its request was
// answered 400 (or should have been).
type chaosKeyCheck struct {
	userID, key, what string
}

// chaosRun is what the clients of one run share.
type chaosRun struct {
	// client gives up on a request after a few seconds, as most do: a
	// paused serve looks like a slow one, and the retry goes to the next.
	// patient waits longer than SQLite's busy_timeout, so that it, unlike
	// client, sees the 503 a serve answers when the database stays locked.
	client, patient *http.Client
	bases           []string
	c               *chaosCounters
	clock           *chaosClock
	processor       *Processor
	webhookSecret   []byte
	start           time.Time

	mu         sync.Mutex
	violations []string
	answered   []chaos201
	refunds    []chaosRefund
	webhooks   []chaosWebhook
	nothingAt  []chaosKeyCheck
}

// violation records a client-visible violation.
func (r *chaosRun) violation(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.violations = append(r.violations, fmt.Sprintf(format, args...))
}

// record appends under the run's lock.
func (r *chaosRun) record(fn func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fn()
}

// chaosCounters counts what the clients saw.
type chaosCounters struct {
	requests, retries, replays, serverErrors, unavailable atomic.Int64
	refundRequests, refundOK, refundRefused               atomic.Int64
	webhooksSent, webhookApplied, webhookDuplicate        atomic.Int64
	webhookPoison, webhookRejected                        atomic.Int64
	hostileBodies, keyRaces                               atomic.Int64
	reusedCreates, reusedRefunds                          atomic.Int64

	mu sync.Mutex
	// unavailableAt and serverErrorAt are when each 503 and each other 5xx
	// was answered, from the run's start.
	unavailableAt, serverErrorAt []time.Duration
}

// chaosAnswer is one HTTP exchange.
type chaosAnswer struct {
	status   int
	body     []byte
	replayed bool
}

// problemType returns the answer's problem type, or "".
func (a chaosAnswer) problemType() string {
	var p problem
	if err := json.Unmarshal(a.body, &p); err != nil {
		return ""
	}
	return string(p.Type)
}

// post sends one request and counts it.
func (r *chaosRun) post(ctx context.Context, client *http.Client, method, url, apiKey, key, body string, header map[string]string) (chaosAnswer, error) {
	r.c.requests.Add(1)
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return chaosAnswer{}, err
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if method == http.MethodPost {
		req.Header.Set("Content-Type", "application/json")
	}
	for name, value := range header {
		req.Header.Set(name, value)
	}
	resp, err := client.Do(req)
	if err != nil {
		return chaosAnswer{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return chaosAnswer{}, err
	}
	answer := chaosAnswer{status: resp.StatusCode, body: data, replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	if answer.replayed {
		r.c.replays.Add(1)
	}
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable:
		r.c.unavailable.Add(1)
		r.c.mu.Lock()
		r.c.unavailableAt = append(r.c.unavailableAt, time.Since(r.start))
		r.c.mu.Unlock()
	case resp.StatusCode >= 500:
		r.c.serverErrors.Add(1)
		r.c.mu.Lock()
		r.c.serverErrorAt = append(r.c.serverErrorAt, time.Since(r.start))
		r.c.mu.Unlock()
	}
	return answer, nil
}

// chaosGiveUpOn5xx is how long a client keeps retrying 500 answers before
// it reports what it got: longer than an outage, so a 500 during one is
// still retried, short enough that a request that always fails does not
// hold the run up.
const chaosGiveUpOn5xx = 20 * time.Second

// chaosGiveUp is how long a client waits for a definitive answer at all:
// far longer than any fault lasts. A request still "in progress" or "payment
// pending" after this is stuck, and the client says so instead of holding
// the run up.
const chaosGiveUp = 90 * time.Second

// errNoDefinitiveAnswer is returned when a request got only transient
// answers for chaosGiveUp.
var errNoDefinitiveAnswer = errors.New("no definitive answer")

// untilDefinitive sends a request with the same key until it gets an answer
// that is not a transient failure, as a careful client does: a timeout (a
// slow or paused serve) or a dropped connection makes it try the next
// serve, as a load balancer would; a 503 or a 409 that says "not yet" makes
// it wait and try again. A 500 is retried too, for chaosGiveUpOn5xx, then
// returned.
func (r *chaosRun) untilDefinitive(ctx context.Context, serve int, method, path, apiKey, key, body string) (chaosAnswer, error) {
	var firstServerError time.Time
	began := time.Now()
	var last chaosAnswer
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			r.c.retries.Add(1)
			if time.Since(began) > chaosGiveUp {
				return last, fmt.Errorf("%w in %s: the last was %d %s", errNoDefinitiveAnswer, chaosGiveUp, last.status, last.body)
			}
			select {
			case <-ctx.Done():
				return chaosAnswer{}, ctx.Err()
			case <-time.After(time.Duration(min(20*attempt, 250)) * time.Millisecond):
			}
		}
		answer, err := r.post(ctx, r.clientOf(serve), method, r.bases[serve%len(r.bases)]+path, apiKey, key, body, nil)
		last = answer
		switch {
		case err != nil:
			serve++
			continue
		case answer.status == http.StatusServiceUnavailable, isRetriableConflict(answer):
			continue
		case answer.status >= 500:
			if firstServerError.IsZero() {
				firstServerError = time.Now()
			}
			if time.Since(firstServerError) < chaosGiveUpOn5xx {
				continue
			}
		}
		return answer, nil
	}
}

// clientOf returns the HTTP client of the n'th request stream: every third
// is patient.
func (r *chaosRun) clientOf(n int) *http.Client {
	if n%3 == 2 {
		return r.patient
	}
	return r.client
}

// isRetriableConflict reports whether answer is a 409 that asks the client
// to come back (a request in progress, a payment in flight), as opposed to
// a stored, definitive refusal.
func isRetriableConflict(answer chaosAnswer) bool {
	if answer.status != http.StatusConflict {
		return false
	}
	t := answer.problemType()
	return t == string(problemKeyInProgress) || t == string(problemPaymentPending)
}

// runChaosOrder plays one client: create the order, maybe retry a success,
// then what the schedule says: refunds, webhooks, hostile bodies, a key
// race.
func (r *chaosRun) runChaosOrder(ctx context.Context, order *chaosOrder) {
	defer order.finish(r.clock)
	if order.hostile >= 0 {
		r.sendHostileCreate(ctx, order)
	}
	jumps := r.clock.settledJumps()
	created, err := r.untilDefinitive(ctx, order.index, "POST", "/api/orders", order.apiKey, order.key, order.body)
	if err != nil {
		r.violation("%s %s: never got an answer: %v", order.userID, order.key, err)
		return
	}
	if created.status != http.StatusCreated {
		r.violation("%s %s: got %d %s, want 201", order.userID, order.key, created.status, created.body)
		return
	}
	order.gotOrderID = orderField(created.body, "order_id")
	r.record(func() { r.answered = append(r.answered, chaos201{order.gotOrderID, order.userID, order.key}) })
	if order.retryAnyway {
		again, err := r.untilDefinitive(ctx, order.index+1, "POST", "/api/orders", order.apiKey, order.key, order.body)
		switch {
		case err != nil:
		case r.keyMayHaveExpired(jumps) && again.status == http.StatusCreated && !again.replayed && orderField(again.body, "order_id") != order.gotOrderID:
			// The key expired in a clock jump between the two: the
			// retry made a new order, as an expired key does.
			r.record(func() {
				r.answered = append(r.answered, chaos201{orderField(again.body, "order_id"), order.userID, order.key})
			})
		case again.status != http.StatusCreated || string(again.body) != string(created.body) || !again.replayed:
			r.violation("%s %s: retry got %d %s, want the replayed %s", order.userID, order.key, again.status, again.body, created.body)
		}
	}
	if order.keyRace {
		r.raceOneKey(ctx, order)
	}
	switch order.refundPlan {
	case refundWholeTwice:
		r.refundWholeTwice(ctx, order)
	case refundInParts:
		r.refundInParts(ctx, order)
	}
	if order.webhooks {
		r.sendWebhooks(ctx, order)
	}
}

// refundWholeTwice refunds everything under one key and sends the request
// again. A paid order is refunded; one cancelled for want of stock is
// refused for good. Either way the retry gets the very same answer.
func (r *chaosRun) refundWholeTwice(ctx context.Context, order *chaosOrder) {
	key := "refund-" + order.key
	first, ok := r.refund(ctx, order, key, `{}`)
	if !ok {
		return
	}
	second, ok := r.refund(ctx, order, key, `{}`)
	if !ok || r.keyMayHaveExpired(order.refundKeyJumps(key)) {
		return
	}
	if second.status != first.status || string(first.body) != string(second.body) || !second.replayed {
		r.violation("%s %s: refunds got %d %s and %d %s, want one answer, then its replay", order.userID, order.key, first.status, first.body, second.status, second.body)
	}
}

// refundInParts refunds a quarter of the order twice at once (two keys),
// repeats the first, then, for half the orders, refunds what remains under
// a third key. Which of
// them wins the race for what remains is up to the server; none may be
// answered with money that was not refunded.
func (r *chaosRun) refundInParts(ctx context.Context, order *chaosOrder) {
	part := fmt.Sprintf(`{"amount_cents":%d}`, max(order.amount/4, 1))
	var wg sync.WaitGroup
	var first chaosAnswer
	var firstOK bool
	wg.Add(1)
	go func() {
		defer wg.Done()
		first, firstOK = r.refund(ctx, order, "refund-"+order.key+"-a", part)
	}()
	r.refund(ctx, order, "refund-"+order.key+"-b", part)
	wg.Wait()
	if firstOK {
		again, ok := r.refund(ctx, order, "refund-"+order.key+"-a", part)
		if ok && !r.keyMayHaveExpired(order.refundKeyJumps("refund-"+order.key+"-a")) && (again.status != first.status || string(again.body) != string(first.body) || !again.replayed) {
			r.violation("%s %s: refund part got %d %s, then %d %s; want the replay", order.userID, order.key, first.status, first.body, again.status, again.body)
		}
	}
	if order.index%2 == 0 {
		// Half the orders keep the rest, so a key reused after expiry
		// meets an order that can still be refunded.
		r.refund(ctx, order, "refund-"+order.key+"-rest", `{}`)
	}
}

// expiredSince reports whether answer is 422 idempotency-key-expired and
// the key may have expired since its first use (keyMayHaveExpired): the
// retry of a request that crossed the key's expiry.
func (r *chaosRun) expiredSince(jumps int, answer chaosAnswer) bool {
	return answer.status == http.StatusUnprocessableEntity && answer.problemType() == string(problemKeyExpired) && r.keyMayHaveExpired(jumps)
}

// keyMayHaveExpired reports whether a key first used when jumps clock
// jumps had settled may have expired since: a jump has begun since then.
// A repeat of it then promises no replay. A key whose answer was a refusal
// (nothing refunded under it) runs as a new request once it expired, and
// gets a fresh answer; one under which money moved gets 422
// idempotency-key-expired.
func (r *chaosRun) keyMayHaveExpired(jumps int) bool {
	return r.clock.jumpCount() > jumps
}

// refund sends one refund until it is answered and checks the answer is one
// a refund may get. It returns false if it recorded a violation.
func (r *chaosRun) refund(ctx context.Context, order *chaosOrder, key, body string) (chaosAnswer, bool) {
	r.c.refundRequests.Add(1)
	jumps := order.addRefundKey(key, body, r.clock.settledJumps())
	answer, err := r.untilDefinitive(ctx, order.index, "POST", refundPath(order.gotOrderID), order.apiKey, key, body)
	if err != nil {
		r.violation("%s %s: refund %s never got an answer: %v", order.userID, order.key, key, err)
		return answer, false
	}
	if r.expiredSince(jumps, answer) {
		// The clock jumped past the key's expiry since the client first
		// sent it: a client that retries, or repeats, across a day gets
		// this.
		return answer, true
	}
	return answer, r.checkRefundAnswer(order, key, answer)
}

// checkRefundAnswer checks a definitive refund answer and keeps a 200 for
// the audit.
func (r *chaosRun) checkRefundAnswer(order *chaosOrder, key string, answer chaosAnswer) bool {
	switch answer.status {
	case http.StatusOK:
		var view refundView
		if err := json.Unmarshal(answer.body, &view); err != nil || view.RefundID == "" {
			r.violation("%s %s: refund %s answered 200 %s, which is not a refund", order.userID, order.key, key, answer.body)
			return false
		}
		r.c.refundOK.Add(1)
		order.markRefunded(key)
		r.record(func() { r.refunds = append(r.refunds, chaosRefund{order.gotOrderID, view.RefundID, view.AmountCents}) })
		return true
	case http.StatusConflict, http.StatusUnprocessableEntity:
		switch answer.problemType() {
		case string(problemOrderNotRefundable), string(problemRefundTooLarge), string(problemProcessorRefused):
			r.c.refundRefused.Add(1)
			return true
		}
	}
	r.violation("%s %s: refund %s answered %d %s", order.userID, order.key, key, answer.status, answer.body)
	return false
}

// raceOneKey sends one new key to a create and to a refund of the order at
// the same moment. The first to claim the key runs; the other must be
// answered 422 idempotency-key-reused, never 500, never both run.
func (r *chaosRun) raceOneKey(ctx context.Context, order *chaosOrder) {
	r.c.keyRaces.Add(1)
	key := "race-" + order.key
	var created chaosAnswer
	var createErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		created, createErr = r.untilDefinitive(ctx, order.index+1, "POST", "/api/orders", order.apiKey, key, order.body)
	}()
	refunded, refundErr := r.untilDefinitive(ctx, order.index, "POST", refundPath(order.gotOrderID), order.apiKey, key, `{"amount_cents":1}`)
	wg.Wait()
	if createErr != nil || refundErr != nil {
		r.violation("%s %s: the key race got no answer: %v %v", order.userID, key, createErr, refundErr)
		return
	}
	createLost := created.status == http.StatusUnprocessableEntity && created.problemType() == string(problemKeyReused)
	refundLost := refunded.status == http.StatusUnprocessableEntity && refunded.problemType() == string(problemKeyReused)
	switch {
	case created.status == http.StatusCreated && refundLost:
		r.record(func() {
			r.answered = append(r.answered, chaos201{orderField(created.body, "order_id"), order.userID, key})
		})
	case createLost && !refundLost:
		// The refund won the key: reusing it after expiry must not refund again.
		order.addRefundKey(key, `{"amount_cents":1}`, r.clock.settledJumps())
		r.checkRefundAnswer(order, key, refunded)
	default:
		r.violation("%s %s: one key sent to a create and a refund at once got %d %s and %d %s; want one to run and the other 422 %s",
			order.userID, key, created.status, created.body, refunded.status, refunded.body, problemKeyReused)
		if created.status == http.StatusCreated {
			r.record(func() {
				r.answered = append(r.answered, chaos201{orderField(created.body, "order_id"), order.userID, key})
			})
		}
	}
}

// chaosHostileCreates are create bodies that are valid JSON, signed by a
// valid API key, and mean two things: a field given twice, or twice in
// different case. encoding/json takes the last, case-insensitively; a
// fingerprint of the first would not match what runs. Each must be answered
// 400 and store nothing.
var chaosHostileCreates = []string{
	`{"amount_cents":%[1]d,"AMOUNT_CENTS":999,"currency":"usd","items":[{"sku":%[2]q,"qty":%[3]d}],"payment_method":%[4]q}`,
	`{"amount_cents":%[1]d,"amount_cents":999,"currency":"usd","items":[{"sku":%[2]q,"qty":%[3]d}],"payment_method":%[4]q}`,
	`{"amount_cents":%[1]d,"currency":"usd","Currency":"usd","items":[{"sku":%[2]q,"qty":%[3]d}],"payment_method":%[4]q}`,
	`{"amount_cents":%[1]d,"currency":"usd","items":[{"sku":%[2]q,"SKU":"sku-rare","qty":%[3]d}],"payment_method":%[4]q}`,
	`{"amount_cents":%[1]d,"currency":"usd","items":[{"sku":%[2]q,"qty":%[3]d}],"payment_method":%[4]q,"Payment_Method":"pm_card_chargeDeclined"}`,
}

// sendHostileCreate sends one of chaosHostileCreates under a fresh key.
func (r *chaosRun) sendHostileCreate(ctx context.Context, order *chaosOrder) {
	r.c.hostileBodies.Add(1)
	key := "hostile-" + order.key
	body := fmt.Sprintf(chaosHostileCreates[order.hostile%len(chaosHostileCreates)], order.amount, order.sku, order.qty, order.paymentMethod)
	r.record(func() { r.nothingAt = append(r.nothingAt, chaosKeyCheck{order.userID, key, body}) })
	answer, err := r.untilDefinitive(ctx, order.index, "POST", "/api/orders", order.apiKey, key, body)
	if err != nil {
		r.violation("%s %s: hostile body never got an answer: %v", order.userID, key, err)
		return
	}
	if answer.status != http.StatusBadRequest || answer.problemType() != string(problemValidation) {
		r.violation("%s %s: body %s was answered %d %s, want 400 %s", order.userID, key, body, answer.status, answer.body, problemValidation)
		if answer.status == http.StatusCreated {
			r.record(func() {
				r.answered = append(r.answered, chaos201{orderField(answer.body, "order_id"), order.userID, key})
			})
		}
	}
}

// waitSettled reads the order until its payment is settled, and returns it.
// An order still unpaid after chaosGiveUp is stuck: a message was lost.
func (r *chaosRun) waitSettled(ctx context.Context, order *chaosOrder) (orderView, error) {
	began := time.Now()
	for attempt := 0; ; attempt++ {
		if time.Since(began) > chaosGiveUp {
			r.violation("%s %s: order %s is still unpaid after %s", order.userID, order.key, order.gotOrderID, chaosGiveUp)
			return orderView{}, errNoDefinitiveAnswer
		}
		req, err := http.NewRequestWithContext(ctx, "GET", r.bases[(order.index+attempt)%len(r.bases)]+"/api/orders/"+order.gotOrderID, nil)
		if err != nil {
			return orderView{}, err
		}
		req.Header.Set("Authorization", "Bearer "+order.apiKey)
		resp, err := r.client.Do(req)
		if err == nil {
			data, readErr := io.ReadAll(resp.Body)
			resp.Body.Close()
			var view orderView
			if readErr == nil && resp.StatusCode == http.StatusOK && json.Unmarshal(data, &view) == nil && view.Status != orderCreated {
				return view, nil
			}
		}
		select {
		case <-ctx.Done():
			return orderView{}, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// chaosEdgeAmounts are amounts a signed charge.refunded event may carry
// that no refund could have: zero, negative, beyond the charge, beyond any
// amount the API accepts, near the int64 limit.
func chaosEdgeAmounts(orderAmount int64) []int64 {
	return []int64{0, -1, orderAmount + 1, maxAmountCents + 1, 1 << 62, math.MaxInt64}
}

// sendWebhooks plays the processor for a paid order: it makes two refunds
// at its dashboard and announces them out of order, the first twice; then
// a forged refund with an absurd amount, and one for a charge nobody knows.
func (r *chaosRun) sendWebhooks(ctx context.Context, order *chaosOrder) {
	view, err := r.waitSettled(ctx, order)
	if err != nil || view.Status != orderPaid || view.Payment == nil {
		return
	}
	chargeID := view.Payment.ChargeID
	var events []chaosWebhook
	for i, amount := range []int64{max(order.amount/10, 1), max(order.amount/20, 1)} {
		processorRefundID, err := r.dashboardRefund(ctx, fmt.Sprintf("dashboard-%s-%d", order.key, i), chargeID, amount)
		if err != nil {
			// Refunded through the API already: the processor refused.
			continue
		}
		events = append(events, chaosWebhook{eventID: fmt.Sprintf("evt_%s_%d", order.key, i), chargeID: chargeID, refundID: processorRefundID, amount: amount, legit: true})
	}
	// Out of order: the later refund is announced first.
	for i, j := 0, len(events)-1; i < j; i, j = i+1, j-1 {
		events[i], events[j] = events[j], events[i]
	}
	if len(events) > 0 {
		events = append(events, events[len(events)-1])
	}
	edges := chaosEdgeAmounts(order.amount)
	events = append(events,
		chaosWebhook{eventID: "evt_forged_" + order.key, chargeID: chargeID, refundID: "re_forged_" + order.key, amount: edges[order.index%len(edges)]},
		chaosWebhook{eventID: "evt_unknown_" + order.key, chargeID: "ch_unknown_" + order.key, refundID: "re_unknown_" + order.key, amount: 100})
	for _, event := range events {
		r.sendWebhook(ctx, order, event)
	}
}

// dashboardRefund refunds amount of chargeID at the processor, as someone
// at its dashboard would; it retries through outages.
func (r *chaosRun) dashboardRefund(ctx context.Context, key, chargeID string, amount int64) (string, error) {
	for {
		processorRefundID, err := r.processor.refund(ctx, key, chargeID, amount)
		if err == nil || errors.Is(err, errRefundExceedsCharge) || errors.Is(err, errProcessorKeyReused) || ctx.Err() != nil {
			return processorRefundID, err
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// sendWebhook signs and sends one event until it is acknowledged or
// refused, and keeps the answer for the audit.
func (r *chaosRun) sendWebhook(ctx context.Context, order *chaosOrder, event chaosWebhook) {
	r.c.webhooksSent.Add(1)
	body := chargeRefundedEvent(event.eventID, event.chargeID, event.refundID, event.amount)
	var firstServerError time.Time
	began := time.Now()
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			r.c.retries.Add(1)
			if time.Since(began) > chaosGiveUp {
				r.violation("webhook %s (%s of %d) got no definitive answer in %s", event.eventID, event.refundID, event.amount, chaosGiveUp)
				return
			}
			select {
			case <-ctx.Done():
				r.violation("webhook %s never got an answer", event.eventID)
				return
			case <-time.After(time.Duration(min(20*attempt, 250)) * time.Millisecond):
			}
		}
		// Signed and sent while no clock jump can fall in between.
		r.clock.stamping.RLock()
		header := map[string]string{signatureHeader: signWebhook(r.webhookSecret, r.clock.now(), body)}
		answer, err := r.post(ctx, r.client, "POST", r.bases[(order.index+attempt)%len(r.bases)]+"/webhooks/processor", "", "", string(body), header)
		r.clock.stamping.RUnlock()
		if err != nil || answer.status == http.StatusServiceUnavailable {
			continue
		}
		if answer.status >= 500 {
			if firstServerError.IsZero() {
				firstServerError = time.Now()
			}
			if time.Since(firstServerError) < chaosGiveUpOn5xx {
				continue
			}
		}
		event.status = answer.status
		if answer.status == http.StatusOK {
			var reply struct {
				Outcome string `json:"outcome"`
			}
			json.Unmarshal(answer.body, &reply)
			event.outcome = reply.Outcome
		}
		switch {
		case event.outcome == string(inboxApplied):
			r.c.webhookApplied.Add(1)
		case event.outcome == string(inboxDuplicate):
			r.c.webhookDuplicate.Add(1)
		case event.outcome == string(inboxPoison):
			r.c.webhookPoison.Add(1)
		case answer.status >= 400 && answer.status < 500:
			r.c.webhookRejected.Add(1)
		default:
			r.violation("webhook %s (%s of %d) answered %d %s", event.eventID, event.refundID, event.amount, answer.status, answer.body)
		}
		r.record(func() { r.webhooks = append(r.webhooks, event) })
		return
	}
}

// reuseExpiredKeys sends again, after a clock jump, requests whose keys
// expired with it: a create runs as new (the server documents that an
// expired key no longer replays), a refund is answered 422
// idempotency-key-expired (running it as new would refund twice).
func (r *chaosRun) reuseExpiredKeys(ctx context.Context, order *chaosOrder) {
	r.c.reusedCreates.Add(1)
	answer, err := r.untilDefinitive(ctx, order.index+1, "POST", "/api/orders", order.apiKey, order.key, order.body)
	switch {
	case err != nil:
		r.violation("%s %s: reused expired key never got an answer: %v", order.userID, order.key, err)
	case answer.status == http.StatusCreated && !answer.replayed && orderField(answer.body, "order_id") != order.gotOrderID:
		r.record(func() {
			r.answered = append(r.answered, chaos201{orderField(answer.body, "order_id"), order.userID, order.key})
		})
	default:
		r.violation("%s %s: reused after expiry, answered %d (replayed %v) %s; want a new order (first was %s)",
			order.userID, order.key, answer.status, answer.replayed, answer.body, order.gotOrderID)
		if answer.status == http.StatusCreated && orderField(answer.body, "order_id") != order.gotOrderID {
			r.record(func() {
				r.answered = append(r.answered, chaos201{orderField(answer.body, "order_id"), order.userID, order.key})
			})
		}
	}
	for _, refund := range order.refundKeysSnapshot() {
		r.c.reusedRefunds.Add(1)
		answer, err := r.untilDefinitive(ctx, order.index, "POST", refundPath(order.gotOrderID), order.apiKey, refund.key, refund.body)
		if err != nil {
			r.violation("%s %s: reused expired refund key never got an answer: %v", order.userID, refund.key, err)
			continue
		}
		expired := answer.status == http.StatusUnprocessableEntity && answer.problemType() == string(problemKeyExpired)
		if !refund.refunded && !expired {
			// Nothing was refunded under the key: running it as new is
			// what an expired key means, and its answer must be a valid one.
			r.checkRefundAnswer(order, refund.key, answer)
			continue
		}
		if !expired {
			r.violation("%s %s: refund key reused after expiry answered %d %s; want 422 %s",
				order.userID, refund.key, answer.status, answer.body, problemKeyExpired)
			if answer.status == http.StatusOK {
				r.checkRefundAnswer(order, refund.key, answer)
			}
		}
	}
}

// auditWorkload checks every answer the clients kept against the quiet
// database.
func (r *chaosRun) auditWorkload(ctx context.Context, db *sql.DB) ([]string, error) {
	var found []string
	seen := map[string]bool{}
	for _, a := range r.answered {
		if seen[a.orderID] {
			found = append(found, fmt.Sprintf("%s %s: order %s was answered to two requests", a.userID, a.key, a.orderID))
		}
		seen[a.orderID] = true
		var n int
		err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders WHERE order_id = ? AND user_id = ? AND idempotency_key = ?`,
			a.orderID, a.userID, a.key).Scan(&n)
		if err != nil {
			return nil, fmt.Errorf("audit a 201: %w", err)
		}
		if n != 1 {
			found = append(found, fmt.Sprintf("%s %s: order %s the client got exists %d times", a.userID, a.key, a.orderID, n))
		}
	}
	var orderCount int
	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&orderCount); err != nil {
		return nil, fmt.Errorf("count orders: %w", err)
	}
	if orderCount != len(r.answered) {
		found = append(found, fmt.Sprintf("%d orders exist but clients were answered 201 for %d", orderCount, len(r.answered)))
	}
	for _, refund := range r.refunds {
		var n int
		err := db.QueryRowContext(ctx, `
			SELECT COUNT(*) FROM refunds WHERE refund_id = ? AND order_id = ? AND amount_cents = ? AND status = 'succeeded'`,
			refund.refundID, refund.orderID, refund.amount).Scan(&n)
		if err != nil {
			return nil, fmt.Errorf("audit a refund: %w", err)
		}
		if n != 1 {
			found = append(found, fmt.Sprintf("refund %s of %d on %s was answered 200 but is not a succeeded refund", refund.refundID, refund.amount, refund.orderID))
		}
	}
	for _, event := range r.webhooks {
		var n int
		var amount int64
		err := db.QueryRowContext(ctx, `SELECT COUNT(*), COALESCE(SUM(amount_cents), 0) FROM refunds WHERE processor_refund_id = ?`,
			event.refundID).Scan(&n, &amount)
		if err != nil {
			return nil, fmt.Errorf("audit a webhook: %w", err)
		}
		switch {
		case event.legit && (n != 1 || amount != event.amount):
			found = append(found, fmt.Sprintf("webhook %s: the processor refunded %d (%s) but %d refunds of %d are recorded (answered %d %s)",
				event.eventID, event.amount, event.refundID, n, amount, event.status, event.outcome))
		case !event.legit && (n != 0 || event.outcome == string(inboxApplied)):
			found = append(found, fmt.Sprintf("webhook %s: a refund of %d the processor never made (%s on %s) was answered %d %s and recorded %d times",
				event.eventID, event.amount, event.refundID, event.chargeID, event.status, event.outcome, n))
		}
	}
	for _, k := range r.nothingAt {
		var keys, orders int
		err := db.QueryRowContext(ctx, `
			SELECT (SELECT COUNT(*) FROM idempotency_keys WHERE user_id = ? AND idempotency_key = ?),
			       (SELECT COUNT(*) FROM orders WHERE user_id = ? AND idempotency_key = ?)`,
			k.userID, k.key, k.userID, k.key).Scan(&keys, &orders)
		if err != nil {
			return nil, fmt.Errorf("audit a hostile request: %w", err)
		}
		if keys != 0 || orders != 0 {
			found = append(found, fmt.Sprintf("%s %s: body %s left %d keys and %d orders", k.userID, k.key, k.what, keys, orders))
		}
	}
	return found, nil
}

// timesSummary says when answers came: how many fell in an
// outage window (or within grace after one) and when the others came.
func timesSummary(at []time.Duration, faults *chaosFaultCounts, grace time.Duration) (during, outside int, when string) {
	sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
	var times []string
	for _, t := range at {
		if faults.duringOutage(t, grace) {
			during++
			continue
		}
		outside++
		if len(times) < 8 {
			times = append(times, t.Round(100*time.Millisecond).String())
		}
	}
	return during, outside, strings.Join(times, " ")
}

// orderIntent are the parameters of a scheduled order, kept to build the
// hostile variants of its body.
type orderIntent struct {
	amount        int64
	sku           string
	qty           int
	paymentMethod string
}

// finish marks the order's client done, at the clock's current jump.
func (o *chaosOrder) finish(clock *chaosClock) {
	clock.mu.Lock()
	jumps := clock.jumps
	clock.mu.Unlock()
	o.mu.Lock()
	defer o.mu.Unlock()
	o.done = true
	o.doneAtJump = jumps
}

// finishedBefore reports whether the order's client finished before the
// jump'th clock jump.
func (o *chaosOrder) finishedBefore(jump int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.done && o.doneAtJump < jump && o.gotOrderID != ""
}

// addRefundKey remembers a refund key the client used, and jumps, the
// clock's count of settled jumps, if this is its first use. It returns the
// count at the key's first use.
func (o *chaosOrder) addRefundKey(key, body string, jumps int) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, k := range o.refundKeys {
		if k.key == key {
			return k.jumps
		}
	}
	o.refundKeys = append(o.refundKeys, chaosRefundKey{key: key, body: body, jumps: jumps})
	return jumps
}

// refundKeyJumps returns the clock's count of settled jumps at the key's
// first use.
func (o *chaosOrder) refundKeyJumps(key string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, k := range o.refundKeys {
		if k.key == key {
			return k.jumps
		}
	}
	return 0
}

// markRefunded records that the refund key was answered 200.
func (o *chaosOrder) markRefunded(key string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for i := range o.refundKeys {
		if o.refundKeys[i].key == key {
			o.refundKeys[i].refunded = true
		}
	}
}

// refundKeysSnapshot returns the refund keys the client used.
func (o *chaosOrder) refundKeysSnapshot() []chaosRefundKey {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]chaosRefundKey(nil), o.refundKeys...)
}

// chaosRareSKUs each have one unit: orders race for the last one, and a
// decline or cancellation must give it back.
var chaosRareSKUs = []string{"sku-rare", "sku-rare-2", "sku-rare-3"}

// chaosSchedule returns the orders of a run, the same for the same seed.
func chaosSchedule(cfg chaosConfig) []*chaosOrder {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5eed))
	orders := make([]*chaosOrder, cfg.Orders)
	for i := range orders {
		paymentMethod := pmCardVisa
		switch roll := rng.IntN(100); {
		case roll < 15:
			paymentMethod = pmCardDeclined
		case roll < 30:
			paymentMethod = pmCardTimeout
		}
		sku := []string{"sku-1", "sku-2"}[rng.IntN(2)]
		qty := 1 + rng.IntN(3)
		if rng.IntN(100) < 5 {
			sku, qty = chaosRareSKUs[rng.IntN(len(chaosRareSKUs))], 1
		}
		amount := int64(100 + rng.IntN(9900))
		user := chaosUsers[rng.IntN(len(chaosUsers))]
		plan := refundNone
		if paymentMethod == pmCardVisa {
			switch roll := rng.IntN(100); {
			case roll < 10:
				plan = refundWholeTwice
			case roll < 20:
				plan = refundInParts
			}
		}
		hostile := -1
		if rng.IntN(100) < 4 {
			hostile = rng.IntN(len(chaosHostileCreates))
		}
		orders[i] = &chaosOrder{
			index: i,
			// Both users use the same key names: a key must never cross users.
			key:         fmt.Sprintf("chaos-%d-%d", cfg.Seed, i/2),
			body:        fmt.Sprintf(`{"amount_cents":%d,"currency":"usd","items":[{"sku":%q,"qty":%d}],"payment_method":%q}`, amount, sku, qty, paymentMethod),
			orderIntent: orderIntent{amount: amount, sku: sku, qty: qty, paymentMethod: paymentMethod},
			refundPlan:  plan,
			webhooks:    paymentMethod == pmCardVisa && rng.IntN(100) < 6,
			keyRace:     rng.IntN(100) < 3,
			hostile:     hostile,
			retryAnyway: rng.IntN(100) < 20,
			apiKey:      user.apiKey,
			userID:      user.userID,
		}
		if i%2 == 1 {
			// The pair shares a key name: give the second the other user.
			other := chaosUsers[0]
			if orders[i-1].userID == other.userID {
				other = chaosUsers[1]
			}
			orders[i].apiKey, orders[i].userID = other.apiKey, other.userID
		}
	}
	return orders
}
