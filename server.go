// The HTTP API: where a client's retries arrive. Requests are authenticated
// and checked here; the idempotency protocol itself lives in idem.go and
// refund.go.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strings"
	"time"
)

// maxBodyBytes bounds every request body: an order is a few hundred bytes.
const maxBodyBytes = 64 << 10

// maxKeyLength is the longest Idempotency-Key accepted, as Stripe does.
const maxKeyLength = 255

// devAPIKey is accepted for user-42 when RETRYSAFE_API_KEYS is not set, so
// the curl walkthrough works out of the box. serve says so when it starts.
const (
	devAPIKey = "sk_test_retrysafe"
	devUserID = "user-42"
)

// server serves the API.
type server struct {
	app *App
	// apiKeys maps an API key to the user it authenticates.
	apiKeys map[string]string
	// webhookSecret signs the processor's webhooks.
	webhookSecret []byte
	// adminKey opens the /admin endpoints (repair.go); empty, they are off.
	adminKey string
	// guesses throttles wrong admin keys (throttle.go); routes makes one
	// on the App's clock if it is nil.
	guesses *guessThrottle
	logger  *slog.Logger
}

// parseAPIKeys parses RETRYSAFE_API_KEYS ("user-42:sk_test_a,user-7:sk_test_b").
// Returns an error naming the entry that is malformed.
func parseAPIKeys(spec string) (map[string]string, error) {
	keys := map[string]string{}
	for _, entry := range strings.Split(spec, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		user, key, ok := strings.Cut(entry, ":")
		if !ok || user == "" || key == "" {
			return nil, fmt.Errorf("RETRYSAFE_API_KEYS entry %q is not user:key", entry)
		}
		// The user id is stored on every order and key, and printed by
		// every command: printable ASCII without spaces, like our own ids.
		if !isPrintableToken(user) || !isPrintableToken(key) {
			return nil, fmt.Errorf("RETRYSAFE_API_KEYS entry %q: user and key must be printable ASCII without spaces", terminalSafe(entry))
		}
		if _, dup := keys[key]; dup {
			return nil, fmt.Errorf("RETRYSAFE_API_KEYS lists key of %q twice", user)
		}
		keys[key] = user
	}
	if len(keys) == 0 {
		return nil, errors.New("RETRYSAFE_API_KEYS has no user:key entries")
	}
	return keys, nil
}

// isPrintableToken reports whether s is printable ASCII with no spaces.
func isPrintableToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] > '~' {
			return false
		}
	}
	return true
}

// routes returns the server's handler, with panic recovery and request
// logging around every route.
func (s *server) routes() http.Handler {
	if s.guesses == nil {
		s.guesses = newGuessThrottle(s.app.now)
	}
	mux := http.NewServeMux()
	// The two requests that write events start (or continue) their trace
	// (tracing.go).
	mux.Handle("POST /api/orders", s.traced("/api/orders", s.authenticated(s.handleCreateOrder)))
	mux.Handle("GET /api/orders/{id}", s.authenticated(s.handleGetOrder))
	mux.Handle("POST /api/orders/{id}/refund", s.traced("/api/orders/{id}/refund", s.authenticated(s.handleRefund)))
	mux.HandleFunc("POST /webhooks/processor", s.handleProcessorWebhook)
	mux.HandleFunc("GET /healthz", s.handleHealth)
	mux.HandleFunc("GET /problems/{name}", s.handleProblemDoc)
	s.adminRoutes(mux)
	s.consoleRoutes(mux)
	// The method-less patterns catch what the ones above do not, so that a
	// wrong method or path still gets a problem document.
	allowed := map[string]string{
		"/api/orders":             "POST",
		"/api/orders/{id}":        "GET",
		"/api/orders/{id}/refund": "POST",
		"/webhooks/processor":     "POST",
		"/healthz":                "GET",
	}
	for path, methods := range allowed {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", methods)
			writeProblem(w, problem{Type: problemMethodNotAllowed, Title: "Method not allowed", Status: http.StatusMethodNotAllowed,
				Detail: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method)})
		})
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeProblem(w, problem{Type: problemNotFound, Title: "Not found", Status: http.StatusNotFound,
			Detail: fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path)})
	})
	return s.logRequests(s.recoverPanics(mux))
}

// newHTTPServer returns an http.Server with the limits a public server needs:
// slow clients cannot hold connections open for ever.
func newHTTPServer(addr string, handler http.Handler) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           handler,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    32 << 10,
	}
}

// statusRecorder remembers the status a handler wrote, for the request log.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

// WriteHeader remembers status and passes it on.
func (r *statusRecorder) WriteHeader(status int) {
	r.status = status
	r.ResponseWriter.WriteHeader(status)
}

// logRequests logs one line per request, and counts it in the metrics.
func (s *server) logRequests(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		recorder := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(recorder, r)
		elapsed := time.Since(start)
		replayed := recorder.Header().Get("Idempotent-Replayed") == "true"
		// The mux set r.Pattern when it routed the request: the route, not
		// the path with its order id.
		s.app.metrics.observeRequest(r.Pattern, recorder.status, replayed, elapsed)
		s.logger.Info("request",
			"method", r.Method,
			"path", r.URL.Path,
			"status", recorder.status,
			"replayed", replayed,
			"duration", elapsed.Round(time.Microsecond))
	})
}

// recoverPanics turns a panic into a 500 problem. The transaction the panic
// unwound through has rolled back, so nothing was stored and the client may
// retry with the same key.
func (s *server) recoverPanics(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			recovered := recover()
			if recovered == nil {
				return
			}
			if recovered == http.ErrAbortHandler {
				panic(recovered) // net/http's own way to abort a response
			}
			s.logger.Error("panic", "method", r.Method, "path", r.URL.Path, "panic", fmt.Sprint(recovered))
			writeProblem(w, problem{Type: problemInternal, Title: "Internal error", Status: http.StatusInternalServerError})
		}()
		next.ServeHTTP(w, r)
	})
}

// userHandler is a handler for an authenticated user.
type userHandler func(w http.ResponseWriter, r *http.Request, userID string)

// authenticated resolves the Authorization header to a user before the
// handler, and so before the idempotency layer: an unknown caller gets 401
// and nothing is stored.
func (s *server) authenticated(next userHandler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The scheme name is case-insensitive (RFC 9110, section 11.1).
		scheme, apiKey, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		ok = ok && strings.EqualFold(scheme, "Bearer")
		userID, known := s.apiKeys[strings.TrimSpace(apiKey)]
		if !ok || !known {
			w.Header().Set("WWW-Authenticate", `Bearer realm="retrysafe"`)
			writeProblem(w, problem{Type: problemUnauthorized, Title: "Unauthorized", Status: http.StatusUnauthorized,
				Detail: "missing or unknown API key"})
			return
		}
		next(w, r, userID)
	})
}

// writeProblem writes p as application/problem+json.
func writeProblem(w http.ResponseWriter, p problem) {
	writeAPIResponse(w, problemResponse(p))
}

// writeAPIResponse writes a response, stored or new. A replay carries
// Idempotent-Replayed: true so the client can tell.
func writeAPIResponse(w http.ResponseWriter, response apiResponse) {
	contentType := "application/json"
	if response.Status >= 400 {
		contentType = "application/problem+json"
	}
	w.Header().Set("Content-Type", contentType)
	if response.Location != "" {
		w.Header().Set("Location", response.Location)
	}
	if response.Replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(response.Status)
	w.Write(response.Body)
}

// idempotencyKeyFrom reads the Idempotency-Key header. Returns a problem if
// it is missing, sent more than once, or not one key (see
// parseIdempotencyKey).
func idempotencyKeyFrom(r *http.Request) (string, *problem) {
	values := r.Header.Values("Idempotency-Key")
	if len(values) > 1 {
		return "", &problem{Type: problemKeyInvalid, Title: "Invalid Idempotency-Key", Status: 400,
			Detail: "send exactly one Idempotency-Key header"}
	}
	if len(values) == 0 || strings.Trim(values[0], " ") == "" {
		return "", &problem{Type: problemKeyMissing, Title: "Missing Idempotency-Key", Status: 400,
			Detail: "this request needs an Idempotency-Key header"}
	}
	key, err := parseIdempotencyKey(values[0])
	if err != nil {
		return "", &problem{Type: problemKeyInvalid, Title: "Invalid Idempotency-Key", Status: 400, Detail: err.Error()}
	}
	return key, nil
}

// parseIdempotencyKey returns the key an Idempotency-Key field value holds,
// in either of two forms that name the same key:
//   - the IETF draft's (draft-ietf-httpapi-idempotency-key-header): a
//     Structured Field Item of type String, "8e03978e-40d5-43e8", with "
//     and \ escaped by a backslash (RFC 8941, section 4.2.5);
//   - Stripe's bare key, pay-req-user-42-cart-7, taken as it is.
//
// Either way the key is 1 to maxKeyLength printable ASCII characters.
// Returns an error naming the header if the value is a list, has
// parameters or anything else after its quoted string, or holds a
// character outside printable ASCII.
//
// A bare key may not hold a comma. A proxy may fold two Idempotency-Key
// lines into one, joined by a comma (RFC 9110, section 5.3): "k1, k1" is
// two keys, and taken as one new key it made a second order where the
// same two lines unfolded are refused.
func parseIdempotencyKey(value string) (string, error) {
	// Spaces around a value are not part of it (RFC 8941, section 4.2).
	value = strings.Trim(value, " ")
	key := value
	if strings.HasPrefix(value, `"`) {
		quoted, rest, err := parseQuotedString(value)
		if err != nil {
			return "", err
		}
		switch rest = strings.TrimLeft(rest, " "); {
		case rest == "":
			key = quoted
		case rest[0] == ',':
			return "", errKeyList
		case rest[0] == ';':
			return "", errors.New("Idempotency-Key has parameters after its quoted string; send the key alone")
		default:
			return "", errors.New("Idempotency-Key has text after its quoted string; send one quoted string, or the key bare")
		}
	} else if strings.Contains(value, ",") {
		return "", errKeyList
	}
	switch {
	case key == "":
		return "", errors.New("Idempotency-Key is an empty string")
	case len(key) > maxKeyLength:
		return "", fmt.Errorf("Idempotency-Key is %d characters; the limit is %d", len(key), maxKeyLength)
	}
	for _, c := range []byte(key) {
		if c < 0x20 || c > 0x7e {
			return "", errors.New("Idempotency-Key must be printable ASCII")
		}
	}
	return key, nil
}

// errKeyList refuses an Idempotency-Key that is a list: two header lines
// that a proxy folded into one, or a bare key with a comma, which cannot be
// told from them.
var errKeyList = errors.New("Idempotency-Key holds a list (a comma outside a quoted string): send exactly one key, in one header line (a proxy joins two lines with a comma)")

// parseQuotedString parses the sf-string that value starts with (RFC 8941,
// section 4.2.5) and returns what it holds and what follows it. Returns an
// error if it has no closing quote, escapes a character other than " and
// \, or holds one outside printable ASCII.
func parseQuotedString(value string) (quoted, rest string, err error) {
	var b strings.Builder
	for i := 1; i < len(value); i++ {
		c := value[i]
		switch {
		case c == '\\':
			i++
			if i == len(value) || (value[i] != '"' && value[i] != '\\') {
				return "", "", errors.New(`Idempotency-Key's quoted string escapes a character other than " and \`)
			}
			b.WriteByte(value[i])
		case c == '"':
			return b.String(), value[i+1:], nil
		case c < 0x20 || c > 0x7e:
			return "", "", errors.New("Idempotency-Key must be printable ASCII")
		default:
			b.WriteByte(c)
		}
	}
	return "", "", errors.New("Idempotency-Key's quoted string has no closing quote")
}

// readJSONBody reads a JSON request body, at most maxBodyBytes. An empty
// body reads as emptyAs. Returns a problem for the wrong content type (415),
// a body too large (413), or one that is not valid UTF-8 JSON (400).
func readJSONBody(w http.ResponseWriter, r *http.Request, emptyAs string) ([]byte, *problem) {
	if r.ContentLength != 0 || r.Header.Get("Content-Type") != "" {
		mediaType, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if err != nil || mediaType != "application/json" {
			return nil, &problem{Type: problemUnsupportedMedia, Title: "Unsupported media type", Status: http.StatusUnsupportedMediaType,
				Detail: "send Content-Type: application/json"}
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return nil, &problem{Type: problemBodyTooLarge, Title: "Body too large", Status: http.StatusRequestEntityTooLarge,
			Detail: fmt.Sprintf("the body must be at most %d bytes", maxBodyBytes)}
	}
	if err != nil {
		return nil, &problem{Type: problemValidation, Title: "Unreadable body", Status: 400, Detail: err.Error()}
	}
	if len(body) == 0 {
		body = []byte(emptyAs)
	}
	return body, nil
}

// idempotentRequestFrom reads what every idempotent POST needs: the key and
// the canonical body. It writes the problem and returns false if either is
// unusable.
//
// The body as sent is not returned: handlers decode req.CanonicalBody, the
// bytes whose fingerprint is stored and which the completer decodes if the
// request dies, so that the request that runs, now or later, is the one the
// key was claimed for.
func idempotentRequestFrom(w http.ResponseWriter, r *http.Request, userID, emptyBody string) (idempotentRequest, bool) {
	key, keyProblem := idempotencyKeyFrom(r)
	if keyProblem != nil {
		writeProblem(w, *keyProblem)
		return idempotentRequest{}, false
	}
	body, bodyProblem := readJSONBody(w, r, emptyBody)
	if bodyProblem != nil {
		writeProblem(w, *bodyProblem)
		return idempotentRequest{}, false
	}
	canonical, err := canonicalJSON(body)
	if err != nil {
		fields := []fieldError{{Field: "body", Detail: err.Error()}}
		var invalid *invalidRequestError
		if errors.As(err, &invalid) {
			fields = invalid.Errors
		}
		writeProblem(w, problem{Type: problemValidation, Title: "Invalid request", Status: 400,
			Detail: err.Error(), Errors: fields})
		return idempotentRequest{}, false
	}
	return idempotentRequest{
		UserID:         userID,
		IdempotencyKey: key,
		Method:         r.Method,
		Path:           r.URL.Path,
		CanonicalBody:  canonical,
	}, true
}

// handleCreateOrder is POST /api/orders.
func (s *server) handleCreateOrder(w http.ResponseWriter, r *http.Request, userID string) {
	req, ok := idempotentRequestFrom(w, r, userID, "")
	if !ok {
		return
	}
	order, err := decodeOrderRequest(req.CanonicalBody)
	if err == nil && !s.app.createReadsInTx {
		// On PostgreSQL, createOrder checks them in its transaction.
		err = s.app.checkSKUs(r.Context(), s.app.readDB, order.Items)
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	response, err := s.app.entry.createOrder(r.Context(), req, order)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if !response.Replayed {
		// A new order's OrderCreated is committed: the relay need not
		// wait for its next poll. (A replay wrote nothing.)
		s.app.wake.outboxWritten()
	}
	writeAPIResponse(w, response)
}

// handleRefund is POST /api/orders/{id}/refund.
func (s *server) handleRefund(w http.ResponseWriter, r *http.Request, userID string) {
	req, ok := idempotentRequestFrom(w, r, userID, "{}")
	if !ok {
		return
	}
	orderID, ok := orderIDFrom(w, r)
	if !ok {
		return
	}
	refund, err := decodeRefundRequest(req.CanonicalBody)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	response, err := s.app.refundOrder(r.Context(), req, orderID, refund)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeAPIResponse(w, response)
}

// handleGetOrder is GET /api/orders/{id}: the order with its payment and its
// saga. Another user's order is 404, as if it did not exist.
func (s *server) handleGetOrder(w http.ResponseWriter, r *http.Request, userID string) {
	orderID, ok := orderIDFrom(w, r)
	if !ok {
		return
	}
	view, err := s.app.orderDetails(r.Context(), orderID, userID)
	if errors.Is(err, errOrderNotFound) {
		writeProblem(w, problem{Type: problemNotFound, Title: "Order not found", Status: http.StatusNotFound,
			Detail: fmt.Sprintf("no order %s", orderID)})
		return
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	body, err := json.Marshal(view)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("encode order: %w", err))
		return
	}
	writeAPIResponse(w, apiResponse{Status: http.StatusOK, Body: body})
}

// orderIDFrom returns the {id} of the request's path, or answers 404 and
// returns false if it cannot be the id of any order: bytes that are not
// UTF-8, or a NUL (the path may hold any, escaped as %FF or %00). Our ids
// are ASCII; such an id must not reach a query, where PostgreSQL refuses
// it (a 500), nor be stored as a key's request path (storableText).
func orderIDFrom(w http.ResponseWriter, r *http.Request) (string, bool) {
	orderID := r.PathValue("id")
	if !storableText(orderID) {
		writeProblem(w, problem{Type: problemNotFound, Title: "Order not found", Status: http.StatusNotFound,
			Detail: fmt.Sprintf("no order %q: an order id is UTF-8 text without NUL", orderID)})
		return "", false
	}
	return orderID, true
}

// handleHealth is GET /healthz: 200 when the database answers.
func (s *server) handleHealth(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.app.db.PingContext(ctx); err != nil {
		writeProblem(w, problem{Type: problemUnavailable, Title: "Database unavailable", Status: http.StatusServiceUnavailable})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write([]byte(`{"status":"ok"}`))
}

// handleProblemDoc explains a problem type to whoever follows its URI.
func (s *server) handleProblemDoc(w http.ResponseWriter, r *http.Request) {
	doc, ok := problemDocs[problemType("/problems/"+r.PathValue("name"))]
	if !ok {
		writeProblem(w, problem{Type: problemNotFound, Title: "Not found", Status: http.StatusNotFound})
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, doc)
}

// writeError maps an error from the layers below to its problem. Anything
// not definitive is answered without storing anything: the same key may be
// retried.
func (s *server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var invalid *invalidRequestError
	switch {
	case errors.As(err, &invalid):
		detail := invalid.Error()
		writeProblem(w, problem{Type: problemValidation, Title: "Invalid request", Status: http.StatusBadRequest,
			Detail: detail, Errors: invalid.Errors})
	case errors.Is(err, errKeyReused):
		writeProblem(w, problem{Type: problemKeyReused, Title: "Idempotency key reused", Status: http.StatusUnprocessableEntity,
			Detail: "this Idempotency-Key was used with a different request; nothing was done"})
	case errors.Is(err, errPaymentPending):
		w.Header().Set("Retry-After", "1")
		writeProblem(w, problem{Type: problemPaymentPending, Title: "Payment in progress", Status: http.StatusConflict,
			Detail: "the order is not paid yet; nothing was stored, retry with the same Idempotency-Key"})
	case errors.Is(err, errKeyInProgress):
		w.Header().Set("Retry-After", "1")
		writeProblem(w, problem{Type: problemKeyInProgress, Title: "Request in progress", Status: http.StatusConflict,
			Detail: "a request with this Idempotency-Key is in progress; retry later for its result"})
	case isBusy(err), isDatabaseUnavailable(err), errors.Is(err, errBatchLost), errors.Is(err, errProcessorTimeout), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, errRefundInFlight), errors.Is(err, errPaymentNotRecorded):
		w.Header().Set("Retry-After", "1")
		writeProblem(w, problem{Type: problemUnavailable, Title: "Temporarily unavailable", Status: http.StatusServiceUnavailable,
			Detail: "a transient failure; the request may or may not have taken effect: retry with the same Idempotency-Key to get its outcome"})
	default:
		s.logger.Error("request failed", "method", r.Method, "path", r.URL.Path, "error", err)
		writeProblem(w, problem{Type: problemInternal, Title: "Internal error", Status: http.StatusInternalServerError,
			Detail: "retry with the same Idempotency-Key"})
	}
}

// orderDetails returns userID's order with its payment and saga. Returns
// errOrderNotFound if the order does not exist or is another user's. It
// reads on a read connection: a GET never waits for the write lock.
func (a *App) orderDetails(ctx context.Context, orderID, userID string) (orderView, error) {
	order, err := readOrder(ctx, a.readDB, orderID)
	if err != nil {
		return orderView{}, err
	}
	if order.UserID != userID {
		return orderView{}, errOrderNotFound
	}
	view := order.view()
	if order.ChargeID.Valid {
		view.Payment = &paymentView{ChargeID: order.ChargeID.String, CapturedCents: order.AmountCents, RefundedCents: order.RefundedCents}
	}
	var sagaID string
	err = a.readDB.QueryRowContext(ctx, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID).Scan(&sagaID)
	switch {
	case err == nil:
		saga, steps, err := readSaga(ctx, a.readDB, sagaID)
		if err != nil {
			return orderView{}, err
		}
		view.Saga = &sagaView{SagaID: saga.SagaID, Status: saga.Status, CurrentStep: saga.CurrentStep, FailureReason: saga.FailureReason.String}
		for _, step := range withPendingSteps(steps) {
			view.Saga.Steps = append(view.Saga.Steps, sagaStepView{Name: step.Name, Status: step.Status})
		}
	case errors.Is(err, sql.ErrNoRows):
		// The saga starts when the payment service consumes OrderCreated.
	default:
		return orderView{}, fmt.Errorf("read saga of %s: %w", orderID, err)
	}
	return view, nil
}
