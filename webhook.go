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

// webhookTolerance is how old a signed timestamp may be. A captured webhook
// replayed later than this is rejected even with a valid signature.
const webhookTolerance = 5 * time.Minute

// webhookConsumer is the inbox name of processor webhooks.
const webhookConsumer = "processor-webhooks"

// signatureHeader carries "t=<unix seconds>,v1=<hex HMAC-SHA256 of
// "<t>.<raw body>">", the scheme Stripe uses.
const signatureHeader = "Retrysafe-Signature"

// processorEvent is a webhook body.
type processorEvent struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Data struct {
		ChargeID    string `json:"charge_id"`
		RefundID    string `json:"refund_id"`
		AmountCents int64  `json:"amount_cents"`
	} `json:"data"`
}

// signWebhook returns the signature header value for body at t.
func signWebhook(secret []byte, t time.Time, body []byte) string {
	timestamp := strconv.FormatInt(t.Unix(), 10)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(timestamp + "."))
	mac.Write(body)
	return "t=" + timestamp + ",v1=" + hex.EncodeToString(mac.Sum(nil))
}

// errRefundInFlight: a charge.refunded event arrived while a refund of the
// same order is still being recorded; it is not applied, and the processor
// delivers it again.
var errRefundInFlight = errors.New("a refund of this order is still being recorded; deliver the event again later")

// errBadSignature is returned for a webhook whose signature is missing,
// wrong, or older than webhookTolerance.
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
	if event.ID == "" {
		s.writeError(w, r, invalidField("id", "is required"))
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
func (a *App) receiveProcessorEvent(ctx context.Context, event processorEvent) (receiveResult, error) {
	return a.receive(ctx, webhookConsumer, event.ID, 1, func(tx *sql.Tx) error {
		switch event.Type {
		case "charge.refunded":
			return a.applyChargeRefunded(ctx, tx, event)
		default:
			// Processors send many event types; one we do not use is
			// recorded and acknowledged, not an error.
			return nil
		}
	})
}

// applyChargeRefunded records a refund the processor made. A refund our own
// API asked for is already recorded (by its processor refund id) and changes
// nothing; one made elsewhere, at the processor's dashboard say, is added to
// the order.
func (a *App) applyChargeRefunded(ctx context.Context, tx *sql.Tx, event processorEvent) error {
	if event.Data.ChargeID == "" || event.Data.RefundID == "" || event.Data.AmountCents <= 0 {
		return permanent(errors.New("charge.refunded needs data.charge_id, data.refund_id and a positive data.amount_cents"))
	}
	var known bool
	err := tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM refunds WHERE processor_refund_id = ?)`,
		event.Data.RefundID).Scan(&known)
	if err != nil {
		return fmt.Errorf("look up refund: %w", err)
	}
	if known {
		return nil
	}
	var orderID string
	var refundInFlight bool
	err = tx.QueryRowContext(ctx, `SELECT order_id FROM orders WHERE charge_id = ?`, event.Data.ChargeID).Scan(&orderID)
	if errors.Is(err, sql.ErrNoRows) {
		return permanent(fmt.Errorf("charge.refunded for unknown charge %s", event.Data.ChargeID))
	}
	if err != nil {
		return fmt.Errorf("look up order of charge: %w", err)
	}
	// The event may overtake our own record of a refund we asked for: the
	// processor refunded, and our API has not written down its id yet. Ask
	// for the event again later rather than count that refund twice.
	err = tx.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM refunds WHERE order_id = ? AND status = 'pending')`,
		orderID).Scan(&refundInFlight)
	if err != nil {
		return fmt.Errorf("look up refunds in flight: %w", err)
	}
	if refundInFlight {
		return errRefundInFlight
	}
	now := a.now()
	_, err = tx.ExecContext(ctx, `
		INSERT INTO refunds (refund_id, order_id, amount_cents, status, processor_refund_id, source, created_at, updated_at)
		VALUES (?, ?, ?, 'succeeded', ?, 'webhook', ?, ?)`,
		a.newID("rf"), orderID, event.Data.AmountCents, event.Data.RefundID, formatTime(now), formatTime(now))
	if err != nil {
		return fmt.Errorf("record refund: %w", err)
	}
	return addRefundToOrder(ctx, tx, orderID, event.Data.AmountCents, now)
}

// chargeRefundedEvent encodes a charge.refunded event, as the processor
// sends it.
func chargeRefundedEvent(eventID, chargeID, refundID string, amountCents int64) []byte {
	event := processorEvent{ID: eventID, Type: "charge.refunded"}
	event.Data.ChargeID = chargeID
	event.Data.RefundID = refundID
	event.Data.AmountCents = amountCents
	body, err := json.Marshal(event)
	if err != nil {
		panic(fmt.Sprintf("bug: encode event: %v", err))
	}
	return body
}
