// Idempotency keys at the API layer (the article's first section): a retried
// request returns the first result instead of doing the work again, and a key
// reused with another request is rejected.
//
// Where the article's sample went wrong, and what this file does instead:
//   - It claimed the key, did the work and stored the result in three
//     transactions; a crash between them left the key "processing" for ever
//     (every retry got 409) or ran the work twice. createOrder does all three
//     in one transaction: a crash leaves nothing or everything.
//   - It keyed keys by the key alone; here a key belongs to one caller.
//   - It stored any exception as a permanent 500; here only definitive
//     outcomes are stored, and a transient failure leaves the key free.
//   - It wrote expires_at and never read it; here an expired key no longer
//     replays.

package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
	"unicode/utf8"
)

// Outcomes of the idempotency protocol.
var (
	// errKeyReused: the key was first used for another request (method, path
	// or body). Replaying would hand the client an answer to a question it
	// did not ask, so the request is rejected and nothing is done.
	errKeyReused = errors.New("idempotency key was used with a different request")
	// errKeyInProgress: another request holds the key's lease right now.
	errKeyInProgress = errors.New("a request with this idempotency key is in progress")
)

// keyStatus is idempotency_keys.status.
type keyStatus string

const (
	keyProcessing keyStatus = "processing"
	keyCompleted  keyStatus = "completed"
)

// idempotentRequest is one API call as the idempotency layer sees it.
type idempotentRequest struct {
	UserID         string
	IdempotencyKey string
	Method         string
	Path           string
	// CanonicalBody is the body after canonicalJSON.
	CanonicalBody []byte
}

// fingerprint returns the hash stored as request_hash (the article's
// request_hash()): method, path and
// canonical body, so the same request with its fields in another order or
// with other whitespace is still the same request.
func (r idempotentRequest) fingerprint() string {
	h := sha256.New()
	// Lengths first, so no two different (method, path, body) triples can
	// run together into the same bytes.
	fmt.Fprintf(h, "%d:%s\n%d:%s\n", len(r.Method), r.Method, len(r.Path), r.Path)
	h.Write(r.CanonicalBody)
	return hex.EncodeToString(h.Sum(nil))
}

// canonicalJSON returns body re-encoded with object keys sorted and no
// insignificant whitespace. Numbers keep their literal text (5000 and 5e3 are
// different requests; the decoder rejects the second anyway). It returns an
// error if body is not exactly one JSON value or not valid UTF-8: the decoder
// would silently replace bad bytes, and two different bodies would then look
// alike. For the same reason it returns an *invalidRequestError naming a key
// that appears twice in one object: decoding keeps only the last, so
// {"a":1,"a":2} and {"a":2} would share a fingerprint.
//
// The canonical form is what is fingerprinted, stored and decoded, now and
// by the completer: a name the request decoder would fold onto a field
// ("AMOUNT_CENTS") is kept apart here, and decodeStrict refuses it.
func canonicalJSON(body []byte) ([]byte, error) {
	if !utf8.Valid(body) {
		return nil, errors.New("body is not valid UTF-8")
	}
	if !json.Valid(body) {
		return nil, errors.New("body is not valid JSON")
	}
	if err := checkNames(body, nil); err != nil {
		return nil, err
	}
	decoder := json.NewDecoder(bytes.NewReader(body))
	decoder.UseNumber()
	var value any
	if err := decoder.Decode(&value); err != nil {
		return nil, fmt.Errorf("body is not valid JSON: %w", err)
	}
	if _, err := decoder.Token(); err != io.EOF {
		return nil, errors.New("body has data after the JSON value")
	}
	// encoding/json sorts map keys and writes no whitespace.
	canonical, err := json.Marshal(value)
	if err != nil {
		return nil, fmt.Errorf("re-encode body: %w", err)
	}
	return canonical, nil
}

// apiResponse is what the API answered, and what a replay answers again,
// byte for byte.
type apiResponse struct {
	Status   int
	Body     []byte
	Location string
	// Replayed is true when the answer came from the key, not from new work.
	Replayed bool
}

// idempotencyKeyRow is a row of idempotency_keys.
type idempotencyKeyRow struct {
	UserID         string
	IdempotencyKey string
	RequestMethod  string
	RequestPath    string
	RequestHash    string
	RequestParams  []byte
	Status         keyStatus
	RecoveryPoint  recoveryPoint
	LockedAt       sql.NullString
	// LockedBy is the lease token of the request working on the key; NULL
	// when nobody is (see acquireKey).
	LockedBy       sql.NullString
	ResponseStatus sql.NullInt64
	ResponseBody   []byte
	Location       sql.NullString
	CreatedAt      string
	ExpiresAt      string
}

// response returns the stored answer of a completed key.
func (k idempotencyKeyRow) response() apiResponse {
	return apiResponse{
		Status:   int(k.ResponseStatus.Int64),
		Body:     k.ResponseBody,
		Location: k.Location.String,
		Replayed: true,
	}
}

// errKeyNotFound is returned by lookupKey when the caller has no live key of
// that name.
var errKeyNotFound = errors.New("idempotency key not found")

// lookupKey reads the caller's key. Returns errKeyNotFound if there is none.
// An expired, finished key is deleted and reported as not found: it no
// longer replays, and the request runs as new. (An unfinished one is kept:
// the completer still owes it an outcome.) Only a request that claims the
// key may call it: expiry decides what a new request sees, never what the
// request that did the work answers (see runRefundPhases). A refund key
// that already moved money for the order is refused in refundPhaseStarted.
func lookupKey(ctx context.Context, tx *sql.Tx, userID, idempotencyKey string, now time.Time) (idempotencyKeyRow, error) {
	key, err := readKey(ctx, tx, userID, idempotencyKey)
	if err != nil {
		return idempotencyKeyRow{}, err
	}
	if key.ExpiresAt <= formatTime(now) && key.RecoveryPoint == recoveryFinished {
		_, err := tx.ExecContext(ctx, `DELETE FROM idempotency_keys WHERE user_id = ? AND idempotency_key = ?`,
			userID, idempotencyKey)
		if err != nil {
			return idempotencyKeyRow{}, fmt.Errorf("delete expired idempotency key: %w", err)
		}
		return idempotencyKeyRow{}, errKeyNotFound
	}
	return key, nil
}

// readKey reads the caller's key as it is, expired or not. Returns
// errKeyNotFound if there is none.
func readKey(ctx context.Context, q queryer, userID, idempotencyKey string) (idempotencyKeyRow, error) {
	var key idempotencyKeyRow
	err := q.QueryRowContext(ctx, `
		SELECT user_id, idempotency_key, request_method, request_path, request_hash, request_params,
		       status, recovery_point, locked_at, locked_by, response_status, response_body, response_location,
		       created_at, expires_at
		FROM idempotency_keys
		WHERE user_id = ? AND idempotency_key = ?`,
		userID, idempotencyKey,
	).Scan(
		&key.UserID, &key.IdempotencyKey, &key.RequestMethod, &key.RequestPath, &key.RequestHash, &key.RequestParams,
		&key.Status, &key.RecoveryPoint, &key.LockedAt, &key.LockedBy, &key.ResponseStatus, &key.ResponseBody, &key.Location,
		&key.CreatedAt, &key.ExpiresAt,
	)
	if errors.Is(err, sql.ErrNoRows) {
		return idempotencyKeyRow{}, errKeyNotFound
	}
	if err != nil {
		return idempotencyKeyRow{}, fmt.Errorf("read idempotency key: %w", err)
	}
	return key, nil
}

// errKeyNotSettled is returned by replaySettledKey when the key's answer
// cannot be given without the write lock: the key is missing, unfinished or
// expired, and the request must claim it (or wait for whoever holds it).
var errKeyNotSettled = errors.New("idempotency key is not settled")

// replaySettledKey answers a retry whose key is settled: completed, with
// its stored answer, and not expired by the App's clock. It reads from a
// read connection, so a retry neither takes nor waits for the write lock.
// Returns errKeyReused if the key was settled for another request, and
// errKeyNotSettled if it is not settled: then only the write path
// (createOrder's transaction) can decide.
//
// A read connection sees committed transactions only: a key whose
// transaction is still open, or rolled back, is simply not there. A settled
// key never changes until it expires (only lookupKey and cleanup delete it,
// and only once expired), so the answer read here is the one the write
// path would give.
func replaySettledKey(ctx context.Context, readDB *sql.DB, req idempotentRequest, now time.Time) (apiResponse, error) {
	key, err := readKey(ctx, readDB, req.UserID, req.IdempotencyKey)
	if errors.Is(err, errKeyNotFound) {
		return apiResponse{}, errKeyNotSettled
	}
	if err != nil {
		return apiResponse{}, err
	}
	if key.Status != keyCompleted || key.RecoveryPoint != recoveryFinished || key.ExpiresAt <= formatTime(now) {
		return apiResponse{}, errKeyNotSettled
	}
	if err := checkSameRequest(key, req); err != nil {
		return apiResponse{}, err
	}
	return key.response(), nil
}

// insertKey claims a new key for req, leased to lease (or to nobody if
// lease is empty). The primary key (user_id, idempotency_key) is the race
// guard; within keyTx no other writer can claim it between lookupKey and
// here. Returns errKeyInProgress if one did anyway (a claim made outside
// keyTx): the key is someone else's, and the client's retry learns whose.
func insertKey(ctx context.Context, tx *sql.Tx, req idempotentRequest, point recoveryPoint, lease string, now time.Time) error {
	lockedAt := sql.NullString{String: formatTime(now), Valid: lease != ""}
	lockedBy := sql.NullString{String: lease, Valid: lease != ""}
	_, err := tx.ExecContext(ctx, `
		INSERT INTO idempotency_keys
			(user_id, idempotency_key, request_method, request_path, request_hash, request_params,
			 status, recovery_point, locked_at, locked_by, created_at, expires_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		req.UserID, req.IdempotencyKey, req.Method, req.Path, req.fingerprint(), req.CanonicalBody,
		keyProcessing, point, lockedAt, lockedBy, formatTime(now), formatTime(now.Add(idempotencyKeyTTL)),
	)
	if isUniqueViolation(err) {
		// A 500 here would tell the client its request failed, when
		// another request holds the key; 409 says retry for the answer.
		return fmt.Errorf("insert idempotency key: %w", errKeyInProgress)
	}
	if err != nil {
		return fmt.Errorf("insert idempotency key: %w", err)
	}
	return nil
}

// insertCompletedKey writes a key with its definitive answer in one
// statement, for work that runs inside the claiming transaction. now is when
// the answer was made: the key replays for idempotencyKeyTTL from then.
// Returns errKeyInProgress if another request inserted the key first (see
// insertKey).
func insertCompletedKey(ctx context.Context, tx *sql.Tx, req idempotentRequest, response apiResponse, now time.Time) error {
	_, err := tx.ExecContext(ctx, `
		INSERT INTO idempotency_keys
			(user_id, idempotency_key, request_method, request_path, request_hash, request_params,
			 status, recovery_point, response_status, response_body, response_location, created_at, expires_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		req.UserID, req.IdempotencyKey, req.Method, req.Path, req.fingerprint(), req.CanonicalBody,
		keyCompleted, recoveryFinished, response.Status, response.Body, response.Location,
		formatTime(now), formatTime(now.Add(idempotencyKeyTTL)),
	)
	if isUniqueViolation(err) {
		return fmt.Errorf("insert idempotency key: %w", errKeyInProgress)
	}
	if err != nil {
		return fmt.Errorf("insert idempotency key: %w", err)
	}
	return nil
}

// completeKey stores the definitive answer on the key, made at now, and
// releases it. From now on every retry replays response, for
// idempotencyKeyTTL from now: a multi-phase request may finish long after it
// claimed the key (a stall, a completer that ran late), and a TTL counted
// from the claim would let the client's retry right after the answer run as
// a new request.
func completeKey(ctx context.Context, tx *sql.Tx, userID, idempotencyKey string, response apiResponse, now time.Time) error {
	result, err := tx.ExecContext(ctx, `
		UPDATE idempotency_keys
		SET status = ?, recovery_point = ?, locked_at = NULL, locked_by = NULL,
		    response_status = ?, response_body = ?, response_location = ?, expires_at = ?
		WHERE user_id = ? AND idempotency_key = ?`,
		keyCompleted, recoveryFinished, response.Status, response.Body, sql.NullString{String: response.Location, Valid: response.Location != ""},
		formatTime(now.Add(idempotencyKeyTTL)), userID, idempotencyKey,
	)
	if err != nil {
		return fmt.Errorf("complete idempotency key: %w", err)
	}
	if n, err := result.RowsAffected(); err != nil || n != 1 {
		return fmt.Errorf("bug: complete idempotency key matched %d rows (%v)", n, err)
	}
	return nil
}

// checkSameRequest returns errKeyReused if key was claimed by a request other
// than req.
func checkSameRequest(key idempotencyKeyRow, req idempotentRequest) error {
	if key.RequestHash != req.fingerprint() {
		return errKeyReused
	}
	return nil
}

// createOrder creates an order under an idempotency key: the article's
// handle() and create_order() with its work() in one. The key claim, the
// order row, its OrderCreated outbox event and the stored response commit in
// ONE transaction, because creating an order touches nothing but our own
// database: a crash at any point leaves either nothing (the retry does the
// work) or everything (the retry replays), and a concurrent duplicate waits
// for the write lock, then replays the completed key.
//
// (On SQLite, writeTx gathers concurrent requests into one commit, each in a
// savepoint. See infra_groupcommit.go.)
//
// Returns errKeyReused if the key belongs to another request, and
// errKeyInProgress if another request holds it. order must be valid (see
// decodeOrderRequest); nothing here rejects input, except an unknown SKU on
// PostgreSQL (an *invalidRequestError from checkSKUs, which the handler
// runs first on SQLite).
func (a *App) createOrder(ctx context.Context, req idempotentRequest, order orderRequest) (apiResponse, error) {
	// A retry of a settled request is answered without the write lock,
	// where there is a read connection to ask (replayBeforeWriting).
	response, err := a.replayBeforeWriting(ctx, req)
	if !errors.Is(err, errKeyNotSettled) {
		return response, err
	}
	orderID := a.newID("ord")
	// Sample flaw 3: it claimed the key, did the work and stored the answer
	// in three transactions. Here they are one.
	err = a.writeTx(ctx, req.UserID, req.IdempotencyKey, func(ctx context.Context, tx *sql.Tx) error {
		now := a.now()
		// Sample flaw 4: lookupKey reads expires_at; an expired key is
		// gone and the request runs as new.
		key, err := lookupKey(ctx, tx, req.UserID, req.IdempotencyKey, now)
		switch {
		case err == nil:
			// Seen before: replay, but only for the very same request.
			if err := checkSameRequest(key, req); err != nil {
				return err
			}
			if key.Status != keyCompleted {
				return errKeyInProgress
			}
			response = key.response()
			return nil
		case !errors.Is(err, errKeyNotFound):
			return err
		}
		// New key, ours until this transaction ends (BEGIN IMMEDIATE holds
		// the write lock; on PostgreSQL, keyTx locks the key).
		if err := a.checkSKUsInTx(ctx, tx, order.Items); err != nil {
			return err
		}
		if err := a.fault.at(ctx, faultAfterKeyClaim); err != nil {
			return err
		}
		// The order and its OrderCreated event in one transaction: the
		// event is published if and only if the order exists.
		newOrder, orderCreatedEvent, err := a.newOrderCreated(orderID, req, order, now)
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
		if err != nil {
			return err
		}
		// The key replays for idempotencyKeyTTL from the answer, not the
		// claim (a stalled transaction must still replay): read the clock.
		return insertCompletedKey(ctx, tx, req, response, a.now())
	})
	if err != nil {
		// Sample flaw 5: nothing is stored; the key stays free to retry.
		return apiResponse{}, err
	}
	return response, nil
}

// replayBeforeWriting answers a retry of a settled request from a read
// connection, before createOrder waits for the write lock; errKeyNotSettled
// if the key is not settled or the App reads in the transaction
// (createReadsInTx: PostgreSQL, where a read outside the transaction is a
// transaction of its own, and the write path's look answers a replay just
// as well).
func (a *App) replayBeforeWriting(ctx context.Context, req idempotentRequest) (apiResponse, error) {
	if a.createReadsInTx {
		return apiResponse{}, errKeyNotSettled
	}
	return replaySettledKey(ctx, a.readDB, req, a.now())
}

// checkSKUsInTx checks an order's SKUs in its create's transaction where
// the App reads in the transaction (createReadsInTx); elsewhere the handler
// checked them on a read connection, outside the write lock.
func (a *App) checkSKUsInTx(ctx context.Context, tx *sql.Tx, items []orderItem) error {
	if !a.createReadsInTx {
		return nil
	}
	return a.checkSKUs(ctx, tx, items)
}

// newOrderCreated returns the order that req creates, with id orderID, and
// its OrderCreated event.
func (a *App) newOrderCreated(orderID string, req idempotentRequest, order orderRequest, now time.Time) (orderRow, outboxEvent, error) {
	newOrder := orderRow{
		OrderID:        orderID,
		UserID:         req.UserID,
		AmountCents:    order.AmountCents,
		Currency:       order.Currency,
		Items:          order.Items,
		PaymentMethod:  order.PaymentMethod,
		Status:         orderCreated,
		IdempotencyKey: req.IdempotencyKey,
		CreatedAt:      formatTime(now),
	}
	orderCreatedEvent, err := a.newOutboxEvent(eventOrderCreated, newOrder.OrderID, orderCreatedPayload{
		OrderID:       newOrder.OrderID,
		UserID:        newOrder.UserID,
		AmountCents:   newOrder.AmountCents,
		Currency:      newOrder.Currency,
		Items:         newOrder.Items,
		PaymentMethod: newOrder.PaymentMethod,
	})
	return newOrder, orderCreatedEvent, err
}

// createdResponse is the 201 that creating newOrder answers.
func createdResponse(newOrder orderRow) (apiResponse, error) {
	body, err := json.Marshal(newOrder.view())
	if err != nil {
		return apiResponse{}, fmt.Errorf("encode order: %w", err)
	}
	return apiResponse{Status: 201, Body: body, Location: "/api/orders/" + newOrder.OrderID}, nil
}
