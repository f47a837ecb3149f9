// Error responses as RFC 9457 problem details. The type tells a client what
// went wrong without parsing the title: above all, a 422 for a reused
// idempotency key must not look like any other 422.

package main

import (
	"encoding/json"
	"fmt"
)

// problemType is a problem's "type": a relative URI that GET resolves to a
// page explaining it (see server.go).
type problemType string

const (
	problemValidation         problemType = "/problems/validation"
	problemKeyMissing         problemType = "/problems/idempotency-key-missing"
	problemKeyInvalid         problemType = "/problems/idempotency-key-invalid"
	problemKeyReused          problemType = "/problems/idempotency-key-reused"
	problemKeyInProgress      problemType = "/problems/idempotency-key-in-progress"
	problemKeyExpired         problemType = "/problems/idempotency-key-expired"
	problemUnauthorized       problemType = "/problems/unauthorized"
	problemNotFound           problemType = "/problems/not-found"
	problemMethodNotAllowed   problemType = "/problems/method-not-allowed"
	problemUnsupportedMedia   problemType = "/problems/unsupported-media-type"
	problemBodyTooLarge       problemType = "/problems/body-too-large"
	problemOrderNotRefundable problemType = "/problems/order-not-refundable"
	problemPaymentPending     problemType = "/problems/payment-pending"
	problemRefundTooLarge     problemType = "/problems/refund-exceeds-remaining"
	problemProcessorRefused   problemType = "/problems/processor-refused"
	problemUnavailable        problemType = "/problems/temporarily-unavailable"
	problemBadSignature       problemType = "/problems/bad-signature"
	problemInternal           problemType = "/problems/internal"
	problemAdminDisabled      problemType = "/problems/admin-disabled"
	problemRepairRefused      problemType = "/problems/repair-refused"
	problemForbidden          problemType = "/problems/forbidden"
	problemTooManyWrongKeys   problemType = "/problems/too-many-wrong-keys"
)

// problemDocs explains each problem type to a person who follows its URI.
var problemDocs = map[problemType]string{
	problemValidation:         "The request body is not a valid request. Fix the fields named in errors and send it again; the same Idempotency-Key may be reused, since nothing was stored.",
	problemKeyMissing:         "POST requests must carry an Idempotency-Key header: 1 to 255 printable ASCII characters, unique per operation (a UUID v4 is a good choice).",
	problemKeyInvalid:         "The Idempotency-Key header must be sent once, holding one key of 1 to 255 printable ASCII characters (a UUID v4 is a good choice): bare, without a comma (a proxy joins two header lines with one), or as a quoted string, the IETF draft's form (RFC 8941: \\\" and \\\\ escaped, nothing after the closing quote). Nothing was stored.",
	problemKeyReused:          "This Idempotency-Key was first used with a different request (method, path or body). Nothing was done. Use a new key for a new operation; reuse a key only to retry the very same request.",
	problemKeyInProgress:      "A request with this Idempotency-Key is still being processed. Retry after the Retry-After delay; you will get its result.",
	problemKeyExpired:         "This Idempotency-Key already made a refund of this order, and it has expired, so it no longer replays that refund's answer. The refund stays recorded under the key for ever, so the key cannot make another refund of the same order: nothing was done. Send a new Idempotency-Key for a new refund. This outcome is stored under the Idempotency-Key.",
	problemUnauthorized:       "Send Authorization: Bearer <api key>.",
	problemNotFound:           "There is no such resource, or it belongs to another user.",
	problemMethodNotAllowed:   "This resource does not accept that method.",
	problemUnsupportedMedia:   "Send the body as Content-Type: application/json.",
	problemBodyTooLarge:       "The request body is larger than the server accepts.",
	problemOrderNotRefundable: "Only a paid order can be refunded; this one is cancelled or already refunded. This outcome is stored under the Idempotency-Key.",
	problemPaymentPending:     "The order's payment is still in progress. Nothing was stored; retry with the same Idempotency-Key after Retry-After.",
	problemRefundTooLarge:     "The refund is larger than what remains to refund. This outcome is stored under the Idempotency-Key.",
	problemProcessorRefused:   "The card processor refused the refund. This outcome is stored under the Idempotency-Key.",
	problemUnavailable:        "A transient failure. The request may have taken effect (a connection can drop after a commit, before its answer): retry with the same Idempotency-Key after Retry-After, within the key's 24 hours, to get its outcome.",
	problemBadSignature:       "The webhook's Retrysafe-Signature header is missing, wrong or too old.",
	problemInternal:           "An unexpected error. Retry with the same Idempotency-Key to get the request's outcome.",
	problemAdminDisabled:      "The /admin endpoints are off. Start serve with RETRYSAFE_ADMIN_KEY set and send Authorization: Bearer <that key>; customers' API keys never open them.",
	problemForbidden:          "The console refused a request that did not come from its own page: sent by another site, or without the session's token. Nothing was changed; reload /console and press the button there.",
	problemTooManyWrongKeys:   "Too many wrong admin keys came from your address: no key from it is checked until Retry-After has passed, the right one neither. After five wrong keys in a row each wrong key doubles the wait, from 1 second up to 15 minutes; the right key, from any address, clears that address's count.",
	problemRepairRefused:      "The repair would change a row that is not in the state it repairs (an event that did not fail, a message that is not poison, a saga whose compensation did not fail). Nothing was changed; the detail says what the row is.",
}

// problem is an RFC 9457 problem details object.
type problem struct {
	Type   problemType `json:"type"`
	Title  string      `json:"title"`
	Status int         `json:"status"`
	Detail string      `json:"detail,omitempty"`
	// Errors names the fields at fault, for validation problems.
	Errors []fieldError `json:"errors,omitempty"`
}

// problemResponse returns a problem as an apiResponse, so that a definitive
// failure can be stored under an idempotency key and replayed like a
// success.
func problemResponse(p problem) apiResponse {
	body, err := json.Marshal(p)
	if err != nil {
		panic(fmt.Sprintf("bug: encode problem: %v", err))
	}
	return apiResponse{Status: p.Status, Body: body}
}
