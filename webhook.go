// Webhooks from the card processor: the other direction a retry comes from.
// Processors deliver each event at least once and retry until they get a
// 2xx, so the handler checks the signature, then applies the event through
// the inbox: the same event delivered twice changes the order once.

package main

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// devWebhookSecret signs webhooks when RETRYSAFE_WEBHOOK_SECRET is not set.
// It is public: set your own anywhere but a laptop.
const devWebhookSecret = "whsec_retrysafe_dev"

// webhookTolerance is how far a signed timestamp may be from now, on either
// side; exactly this far is still accepted. A captured webhook replayed
// later than this is rejected even with a valid signature. Stripe's
// libraries check only that side; a timestamp further ahead is refused
// too, because it is either a clock gone wrong (ours or the processor's),
// which an operator should hear of from the 400s now rather than find
// when every webhook is refused as old, or a signature made for the
// future, which stays replayable for its lead on top of the tolerance.
const webhookTolerance = 5 * time.Minute

// webhookConsumer is the inbox name of processor webhooks.
const webhookConsumer = "processor-webhooks"

// signatureHeader carries "t=<unix seconds>,v1=<hex HMAC-SHA256 of
// "<t>.<raw body>">", the scheme Stripe uses.
const signatureHeader = "Retrysafe-Signature"

// processorEvent is a webhook body. Its data is decoded by the code that
// applies the event's type: a signed event whose data is wrong is still
// the processor's, so it is recorded as poison under its id, with the
// reason, for an operator (refusing it with a 4xx would only make the
// processor deliver it again, for days).
type processorEvent struct {
	ID   string          `json:"id"`
	Type string          `json:"type"`
	Data json.RawMessage `json:"data"`
}

// chargeRefundedData is the data of a charge.refunded event. AmountCents
// is a pointer so that a missing or null amount is not taken for 0.
type chargeRefundedData struct {
	ChargeID    string `json:"charge_id"`
	RefundID    string `json:"refund_id"`
	AmountCents *int64 `json:"amount_cents"`
	// OrderID is the metadata our saga attached to the charge, which the
	// processor sends back with every event about it (as Stripe's events
	// carry the charge's metadata). It tells a refund of a charge whose
	// answer our saga has not recorded yet (the response is on its way, or
	// was lost and the charge will be asked for again) from a refund of a
	// charge that is not ours.
	OrderID string `json:"order_id,omitempty"`
}

// signWebhook returns the signature header value for body at t.
func signWebhook(secret []byte, t time.Time, body []byte) string {
	timestamp := strconv.FormatInt(t.Unix(), 10)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(timestamp + "."))
	mac.Write(body)
	return "t=" + timestamp + ",v1=" + hex.EncodeToString(mac.Sum(nil))
}

// Outcomes of a charge.refunded event that arrived too early: it is not
// applied nor recorded, and the processor delivers it again.
var (
	// errRefundInFlight: a refund of the same order is still being
	// recorded.
	errRefundInFlight = errors.New("a refund of this order is still being recorded; deliver the event again later")
	// errPaymentNotRecorded: the charge is one our saga made, and the
	// order has not heard of it yet (the event overtook PaymentCaptured).
	errPaymentNotRecorded = errors.New("the order of this charge has not recorded its payment yet; deliver the event again later")
	// errChargeOfCancelledOrder: the charge is one our saga made for an
	// order it then cancelled (a later step failed, and the charge was
	// refunded, or found refunded, by its compensation).
	errChargeOfCancelledOrder = errors.New("the charge is of an order that was cancelled")
)

// errBadSignature is returned for a webhook whose signature is missing,
// wrong, or further than webhookTolerance from now (older, or ahead).
var errBadSignature = errors.New("bad webhook signature")

// verifyWebhook checks header against body. Returns errBadSignature, wrapped
// with the reason.
func verifyWebhook(secret []byte, header string, body []byte, now time.Time) error {
	var timestamp string
	var signatures []string
	for _, part := range strings.Split(header, ",") {
		name, value, _ := strings.Cut(strings.TrimSpace(part), "=")
		switch name {
		case "t":
			timestamp = value
		case "v1":
			signatures = append(signatures, value)
		}
	}
	seconds, err := strconv.ParseInt(timestamp, 10, 64)
	if err != nil || len(signatures) == 0 {
		return fmt.Errorf("%w: want t=<unix seconds>,v1=<hex>", errBadSignature)
	}
	age := now.Sub(time.Unix(seconds, 0))
	if age > webhookTolerance || age < -webhookTolerance {
		return fmt.Errorf("%w: timestamp is %s away from now", errBadSignature, age.Round(time.Second))
	}
	want := signWebhook(secret, time.Unix(seconds, 0), body)
	_, wantHex, _ := strings.Cut(want, ",v1=")
	for _, signature := range signatures {
		// Constant time, so the comparison leaks nothing about the secret.
		if hmac.Equal([]byte(signature), []byte(wantHex)) {
			return nil
		}
	}
	return fmt.Errorf("%w: no v1 signature matches", errBadSignature)
}

// handleProcessorWebhook is POST /webhooks/processor.
func (s *server) handleProcessorWebhook(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		writeProblem(w, problem{Type: problemBodyTooLarge, Title: "Body too large", Status: http.StatusRequestEntityTooLarge})
		return
	}
	if err := verifyWebhook(s.webhookSecret, r.Header.Get(signatureHeader), body, s.app.now()); err != nil {
		writeProblem(w, problem{Type: problemBadSignature, Title: "Bad signature", Status: http.StatusBadRequest, Detail: err.Error()})
		return
	}
	var event processorEvent
	if err := decodeStrict(body, &event); err != nil {
		s.writeError(w, r, err)
		return
	}
	switch {
	case event.ID == "":
		s.writeError(w, r, invalidField("id", "is required"))
		return
	case !storableText(event.ID):
		// JSON can spell a NUL (\u0000), which PostgreSQL refuses in the
		// inbox row and in the failure count: a 500 at every delivery.
		s.writeError(w, r, invalidField("id", "must be text without NUL"))
		return
	case len(event.ID) > maxMessageIDLength:
		// PostgreSQL could not key the inbox row on it: a 500 again.
		s.writeError(w, r, invalidField("id", fmt.Sprintf("must be at most %d bytes", maxMessageIDLength)))
		return
	}
	result, err := s.app.receiveProcessorEvent(r.Context(), event)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if result.Outcome == inboxRetry {
		// Not applied and not recorded: a non-2xx makes the processor
		// deliver it again.
		s.writeError(w, r, result.Err)
		return
	}
	// Applied, duplicate and poison are all acknowledged: the processor
	// must stop retrying, and poison is kept for an operator.
	replyFields := struct {
		Received bool         `json:"received"`
		Outcome  inboxOutcome `json:"outcome"`
		Error    string       `json:"error,omitempty"`
	}{Received: true, Outcome: result.Outcome}
	if result.Outcome == inboxPoison {
		replyFields.Error = result.Err.Error()
		s.logger.Warn("poison webhook", "event_id", event.ID, "type", event.Type, "error", result.Err)
	}
	reply, err := json.Marshal(replyFields)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("encode webhook reply: %w", err))
		return
	}
	writeAPIResponse(w, apiResponse{Status: http.StatusOK, Body: reply})
}

// receiveProcessorEvent applies a processor event through the inbox.
//
// A charge.refunded event is checked against the processor first: its
// signature says who sent it, not that every field is what the processor
// did, so, as Stripe advises, the refund it names is retrieved from the
// processor and must match. That is a call to another system, so it runs
// before the inbox transaction; an event that does not match becomes
// poison there, with the reason, unless it fails an earlier check first.
func (a *App) receiveProcessorEvent(ctx context.Context, event processorEvent) (receiveResult, error) {
	var mismatch error
	if event.Type == "charge.refunded" {
		var err error
		if mismatch, err = a.verifyChargeRefunded(ctx, event); err != nil {
			return receiveResult{}, err
		}
	}
	return a.receive(ctx, webhookConsumer, event.ID, 1, func(tx *sql.Tx) error {
		switch event.Type {
		case "charge.refunded":
			return a.applyChargeRefunded(ctx, tx, event, mismatch)
		default:
			// Processors send many event types; one we do not use is
			// recorded and acknowledged, not an error.
			return nil
		}
	})
}

// verifyChargeRefunded asks the processor for the refund that event names.
// It returns a permanent error (the event's poison reason) if the processor
// made no such refund, or made it of another charge or amount; nil if they
// match or if the event's data is malformed (applyChargeRefunded says how).
// Its own error is for a processor that could not answer.
//
// Without it, a signed event with a made-up refund of a plausible amount
// was counted: arriving while the order still looked unrefunded, it was
// within what remained, and the refund the processor really made, arriving
// later, was then refused as too large.
func (a *App) verifyChargeRefunded(ctx context.Context, event processorEvent) (error, error) {
	var data chargeRefundedData
	if len(event.Data) == 0 || decodeStrict(event.Data, &data) != nil || data.RefundID == "" || data.AmountCents == nil {
		return nil, nil
	}
	chargeID, amount, err := a.processor.lookupRefund(ctx, data.RefundID)
	switch {
	case errors.Is(err, errNoSuchRefund):
		return permanent(fmt.Errorf("charge.refunded names refund %s, which the processor never made", data.RefundID)), nil
	case err != nil:
		return nil, err
	case chargeID != data.ChargeID || amount != *data.AmountCents:
		return permanent(fmt.Errorf("charge.refunded says refund %s is %d of charge %s; the processor says %d of charge %s",
			data.RefundID, *data.AmountCents, data.ChargeID, amount, chargeID)), nil
	}
	return nil, nil
}

// applyChargeRefunded records a refund the processor made. A refund our own
// API asked for is already recorded (by its processor refund id) and changes
// nothing; one made elsewhere, at the processor's dashboard say, is added to
// the order.
//
// A signed event is not trusted beyond its origin: its amount must be
// positive and at most what remains of the charge it names (the charge's
// order, whoever's it is: events are per processor, not per user), or it is
// poison and changes nothing. Without the check, an amount of 2^63-1 made
// the sum overflow (to a REAL on SQLite, and every GET of the order failed
// from then on), and any amount above what remains refunded more than was
// charged.
//
// Returns a permanent error for an event that can never apply, and
// errPaymentNotRecorded or errRefundInFlight for one that came too early.
// A refund of the charge of an order we cancelled changes nothing.
//
// unconfirmed is what verifyChargeRefunded found (nil if the processor
// confirmed the refund): checked last, right before the refund is counted.
func (a *App) applyChargeRefunded(ctx context.Context, tx *sql.Tx, event processorEvent, unconfirmed error) error {
	if len(event.Data) == 0 {
		return permanent(errors.New("charge.refunded has no data"))
	}
	var data chargeRefundedData
	if err := decodeStrict(event.Data, &data); err != nil {
		return permanent(fmt.Errorf("charge.refunded data: %w", err))
	}
	if data.ChargeID == "" || data.RefundID == "" || data.AmountCents == nil {
		return permanent(errors.New("charge.refunded needs data.charge_id, data.refund_id and data.amount_cents"))
	}
	amount := *data.AmountCents
	if amount <= 0 {
		return permanent(fmt.Errorf("charge.refunded data.amount_cents must be positive, got %d", amount))
	}
	order, err := orderOfCharge(ctx, tx, data)
	if errors.Is(err, errChargeOfCancelledOrder) {
		// The money of an order we cancelled went back: by our saga's
		// compensation, or from the processor's dashboard before it.
		// Nothing is owed either way: the event is applied as it is, if
		// the processor confirms the refund it names.
		return unconfirmed
	}
	if err != nil {
		return err
	}

	var known struct {
		orderID string
		amount  int64
	}
	err = tx.QueryRowContext(ctx, `SELECT order_id, amount_cents FROM refunds WHERE processor_refund_id = ?`,
		data.RefundID).Scan(&known.orderID, &known.amount)
	switch {
	case err == nil:
		// Already counted: by our API, or by an earlier event announcing
		// the same refund under another event id. It must be this very
		// refund, or the event contradicts what we recorded.
		switch {
		case known.orderID != order.OrderID:
			return permanent(fmt.Errorf("charge.refunded names refund %s of charge %s, but that refund is of another order", data.RefundID, data.ChargeID))
		case known.amount != amount:
			return permanent(fmt.Errorf("charge.refunded says refund %s is %d, but it was recorded as %d", data.RefundID, amount, known.amount))
		}
		return nil
	case errors.Is(err, sql.ErrNoRows):
	default:
		return fmt.Errorf("look up refund: %w", err)
	}

	// The event may overtake our own record of a refund we asked for: the
	// processor refunded, and our API has not written down its id yet. Ask
	// for the event again later rather than count that refund twice.
	var refundInFlight bool
	err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM refunds WHERE order_id = ? AND status = 'pending')`,
		order.OrderID).Scan(&refundInFlight)
	if err != nil {
		return fmt.Errorf("look up refunds in flight: %w", err)
	}
	if refundInFlight {
		return errRefundInFlight
	}
	// No refund is pending, so refunded_cents counts every refund of the
	// order, each once; and this transaction holds the write lock (or,
	// on PostgreSQL, is serializable), so it stays true until commit.
	remaining := order.AmountCents - order.RefundedCents
	if amount > remaining {
		return permanent(fmt.Errorf("charge.refunded of %d exceeds the %d that remains of charge %s", amount, remaining, data.ChargeID))
	}
	if unconfirmed != nil {
		return unconfirmed
	}
	now := a.now()
	_, err = tx.ExecContext(ctx, `
		INSERT INTO refunds (refund_id, order_id, amount_cents, status, processor_refund_id, source, created_at, updated_at)
		VALUES (?, ?, ?, 'succeeded', ?, 'webhook', ?, ?)`,
		a.newID("rf"), order.OrderID, amount, data.RefundID, formatTime(now), formatTime(now))
	if err != nil {
		return fmt.Errorf("record refund: %w", err)
	}
	return addRefundToOrder(ctx, tx, order.OrderID, amount, now)
}

// orderOfCharge returns the order that the event's charge paid. Returns
// errPaymentNotRecorded if our saga made the charge but its order has not
// recorded the payment yet, and a permanent error if no order of ours made
// it.
func orderOfCharge(ctx context.Context, tx *sql.Tx, data chargeRefundedData) (orderRow, error) {
	chargeID := data.ChargeID
	var orderID string
	err := tx.QueryRowContext(ctx, `SELECT order_id FROM orders WHERE charge_id = ?`, chargeID).Scan(&orderID)
	switch {
	case err == nil:
		return readOrder(ctx, tx, orderID)
	case !errors.Is(err, sql.ErrNoRows):
		return orderRow{}, fmt.Errorf("look up order of charge: %w", err)
	}
	// The saga writes the charge id on its step as soon as the processor
	// answers; the order hears of it later, through the outbox and its
	// inbox. A refund announced in between is early, not unknown. And a
	// saga that cancels its order after the charge (a later step failed)
	// refunds it: that refund, or one made from the dashboard before the
	// compensation's, is of a charge we know, of an order that is owed
	// nothing.
	var sagaOrderStatus orderStatus
	err = tx.QueryRowContext(ctx, `
		SELECT o.status FROM saga_steps st
		JOIN saga_instances s ON s.saga_id = st.saga_id
		JOIN orders o ON o.order_id = s.order_id
		WHERE st.step_name = ? AND st.result = ?`,
		stepChargeCard, chargeID).Scan(&sagaOrderStatus)
	switch {
	case err == nil && sagaOrderStatus == orderCreated:
		return orderRow{}, errPaymentNotRecorded
	case err == nil && sagaOrderStatus == orderCancelled:
		return orderRow{}, errChargeOfCancelledOrder
	case err != nil && !errors.Is(err, sql.ErrNoRows):
		return orderRow{}, fmt.Errorf("look up saga of charge: %w", err)
	}
	// Earlier still: the processor charged, and the saga has not recorded
	// the answer (or never got it: a lost response, asked for again under
	// the same key). The charge's metadata names the order; while that
	// order waits for its payment, the event is early. (Once the order is
	// paid with another charge, or cancelled, the same event is poison: a
	// wrong order id in the metadata cannot hold it back for ever.)
	if data.OrderID != "" {
		var status orderStatus
		err := tx.QueryRowContext(ctx, `SELECT status FROM orders WHERE order_id = ?`, data.OrderID).Scan(&status)
		switch {
		case err == nil && status == orderCreated:
			return orderRow{}, errPaymentNotRecorded
		case err != nil && !errors.Is(err, sql.ErrNoRows):
			return orderRow{}, fmt.Errorf("look up order of charge metadata: %w", err)
		}
	}
	return orderRow{}, permanent(fmt.Errorf("charge.refunded for unknown charge %s", chargeID))
}

// chargeRefundedEvent encodes a charge.refunded event, as the processor
// sends it.
func chargeRefundedEvent(eventID, chargeID, refundID string, amountCents int64) []byte {
	data, err := json.Marshal(chargeRefundedData{ChargeID: chargeID, RefundID: refundID, AmountCents: &amountCents})
	if err != nil {
		panic(fmt.Sprintf("bug: encode event data: %v", err))
	}
	body, err := json.Marshal(processorEvent{ID: eventID, Type: "charge.refunded", Data: data})
	if err != nil {
		panic(fmt.Sprintf("bug: encode event: %v", err))
	}
	return body
}
