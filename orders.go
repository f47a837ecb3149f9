// The order service: what an order is, how a create request is checked, and
// how the order follows the payment result it hears about through its inbox
// (the article's step 7: "the order status is updated safely, in its own
// transaction").

package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"regexp"
	"strings"
	"time"
)

// orderStatus is orders.status.
type orderStatus string

const (
	orderCreated   orderStatus = "created"
	orderPaid      orderStatus = "paid"
	orderCancelled orderStatus = "cancelled"
	orderRefunded  orderStatus = "refunded"
)

// Limits on a create request. maxAmountCents is Stripe's limit for a USD
// charge; anything larger is a client bug, not a purchase.
const (
	maxAmountCents = 99_999_999
	maxOrderItems  = 50
	maxItemQty     = 1000
)

// Currencies and payment methods the fake processor knows.
var (
	supportedCurrencies = map[string]bool{"usd": true, "eur": true, "gbp": true}
	paymentMethods      = map[string]bool{
		pmCardVisa:     true,
		pmCardDeclined: true,
		pmCardTimeout:  true,
	}
)

// skuPattern is what a SKU looks like; anything else is rejected before it
// reaches a query or a log line.
var skuPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)

// orderItem is one line of an order.
type orderItem struct {
	SKU string `json:"sku"`
	Qty int64  `json:"qty"`
}

// orderRequest is a valid body of POST /api/orders.
type orderRequest struct {
	AmountCents   int64       `json:"amount_cents"`
	Currency      string      `json:"currency"`
	Items         []orderItem `json:"items"`
	PaymentMethod string      `json:"payment_method"`
}

// fieldError says what is wrong with one field of a request.
type fieldError struct {
	Field  string `json:"field"`
	Detail string `json:"detail"`
}

// invalidRequestError is returned for a request body the API will not take.
// Nothing is stored for it, so the client may fix the body and retry with
// the same idempotency key.
type invalidRequestError struct {
	Errors []fieldError
}

// Error lists every field at fault.
func (e *invalidRequestError) Error() string {
	var parts []string
	for _, fe := range e.Errors {
		parts = append(parts, fe.Field+": "+fe.Detail)
	}
	return "invalid request: " + strings.Join(parts, "; ")
}

// invalidField returns an invalidRequestError for one field.
func invalidField(field, detail string) error {
	return &invalidRequestError{Errors: []fieldError{{Field: field, Detail: detail}}}
}

// decodeStrict decodes body, a JSON object, into dst, rejecting unknown
// fields and trailing data, and turns the decoder's errors into ones that
// name the field. Field names must match exactly, and each may appear once
// (see checkNames): encoding/json would take "AMOUNT_CENTS" for
// "amount_cents" and keep the last of two, so a body could mean one thing
// to the decoder and another to the fingerprint or to a reader.
func decodeStrict(body []byte, dst any) error {
	if err := checkNames(body, reflect.TypeOf(dst)); err != nil {
		return err
	}
	decoder := json.NewDecoder(bytes.NewReader(body))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(dst); err != nil {
		var typeErr *json.UnmarshalTypeError
		var syntaxErr *json.SyntaxError
		switch {
		case errors.As(err, &typeErr) && typeErr.Field != "" && strings.HasPrefix(typeErr.Value, "number") && typeErr.Type.Kind() == reflect.Int64:
			return invalidField(typeErr.Field, "must be a whole number within range")
		case errors.As(err, &typeErr) && typeErr.Field != "":
			return invalidField(typeErr.Field, fmt.Sprintf("must be %s, not a JSON %s", jsonTypeName(typeErr.Type.Kind().String()), typeErr.Value))
		case errors.As(err, &typeErr):
			return invalidField("body", "must be a JSON object")
		case errors.As(err, &syntaxErr):
			return invalidField("body", fmt.Sprintf("invalid JSON at byte %d: %v", syntaxErr.Offset, syntaxErr))
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			field := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
			return invalidField(field, "unknown field")
		case errors.Is(err, io.EOF):
			return invalidField("body", "is empty")
		default:
			return invalidField("body", err.Error())
		}
	}
	if _, err := decoder.Token(); err != io.EOF {
		return invalidField("body", "has data after the JSON object")
	}
	return nil
}

// checkNames walks the JSON value in body and returns an
// *invalidRequestError naming the first member that the decoder would read
// differently from the fingerprint (canonicalJSON) or from a person:
//   - a name that appears twice in one object, at any depth: the decoder
//     silently keeps the last one;
//   - where shape says an object is decoded into a struct, a name that is
//     not exactly one of its fields' JSON names. The decoder would match
//     one that differs only in case, folding with Unicode's rules ("ſ" is
//     an "s", the Kelvin sign a "k"), while the fingerprint keeps every
//     spelling apart and sorts them: which of two spellings wins would
//     depend on the order of the members;
//   - a body that is not an object, when shape is a struct: the decoder
//     would take null as an empty request.
//
// shape is the type the body is decoded into, or nil to check only for
// repeated names. Fields of embedded structs are not looked at: no request
// type has any. A body that is not valid JSON returns nil, so that the
// decoder reports it with its position.
func checkNames(body []byte, shape reflect.Type) error {
	decoder := json.NewDecoder(bytes.NewReader(body))
	err := checkValueNames(decoder, "", shape)
	var invalid *invalidRequestError
	if errors.As(err, &invalid) {
		return err
	}
	return nil
}

// checkValueNames checks the next value of decoder, found at path, which is
// decoded into shape (nil if unknown). See checkNames.
func checkValueNames(decoder *json.Decoder, path string, shape reflect.Type) error {
	for shape != nil && shape.Kind() == reflect.Pointer {
		shape = shape.Elem()
	}
	token, err := decoder.Token()
	if err != nil {
		return err
	}
	delim, isDelim := token.(json.Delim)
	isStruct := shape != nil && shape.Kind() == reflect.Struct
	if path == "" && isStruct && delim != '{' {
		return invalidField("body", "must be a JSON object")
	}
	if !isDelim {
		return nil
	}
	if delim == '[' {
		var elemShape reflect.Type
		if shape != nil && (shape.Kind() == reflect.Slice || shape.Kind() == reflect.Array) {
			elemShape = shape.Elem()
		}
		for i := 0; decoder.More(); i++ {
			if err := checkValueNames(decoder, fmt.Sprintf("%s[%d]", path, i), elemShape); err != nil {
				return err
			}
		}
		_, err := decoder.Token() // ]
		return err
	}
	seen := map[string]bool{}
	for decoder.More() {
		token, err := decoder.Token()
		if err != nil {
			return err
		}
		name, _ := token.(string) // the decoder has checked that it is one
		field := name
		if path != "" {
			field = path + "." + name
		}
		if seen[name] {
			return invalidField(field, "appears twice; send each field once")
		}
		seen[name] = true
		var memberShape reflect.Type
		if isStruct {
			var exact bool
			var spelled string
			memberShape, exact, spelled = structField(shape, name)
			switch {
			case !exact && spelled != "":
				return invalidField(field, fmt.Sprintf("unknown field; names are case-sensitive: did you mean %q?", spelled))
			case !exact:
				// The decoder would refuse it too, unless its idea of
				// matching is looser than bytes.EqualFold: decide here.
				return invalidField(field, "unknown field")
			}
		}
		if err := checkValueNames(decoder, field, memberShape); err != nil {
			return err
		}
	}
	_, err = decoder.Token() // }
	return err
}

// structField looks up the member name among the fields of the struct
// type shape as encoding/json names them. It returns the field's type and
// true if a field has exactly that name; otherwise, the name of a field
// that encoding/json would match anyway, by folding case, if there is one.
func structField(shape reflect.Type, name string) (reflect.Type, bool, string) {
	spelled := ""
	for i := range shape.NumField() {
		field := shape.Field(i)
		tag := field.Tag.Get("json")
		if !field.IsExported() || tag == "-" {
			continue
		}
		fieldName, _, _ := strings.Cut(tag, ",")
		if fieldName == "" {
			fieldName = field.Name
		}
		if fieldName == name {
			return field.Type, true, ""
		}
		// bytes.EqualFold is the fold encoding/json matches names with.
		if spelled == "" && bytes.EqualFold([]byte(fieldName), []byte(name)) {
			spelled = fieldName
		}
	}
	return nil, false, spelled
}

// jsonTypeName names a Go kind the way a JSON client thinks of it.
func jsonTypeName(kind string) string {
	switch kind {
	case "int64", "int", "int32":
		return "an integer"
	case "string":
		return "a string"
	case "slice":
		return "an array"
	case "struct", "map":
		return "an object"
	default:
		return kind
	}
}

// decodeOrderRequest parses and checks a POST /api/orders body. Returns an
// *invalidRequestError naming every field that is wrong.
func decodeOrderRequest(body []byte) (orderRequest, error) {
	// Pointers tell a missing field from a zero one.
	var raw struct {
		AmountCents *int64  `json:"amount_cents"`
		Currency    *string `json:"currency"`
		Items       *[]struct {
			SKU *string `json:"sku"`
			Qty *int64  `json:"qty"`
		} `json:"items"`
		PaymentMethod *string `json:"payment_method"`
	}
	if err := decodeStrict(body, &raw); err != nil {
		return orderRequest{}, err
	}

	var problems []fieldError
	var order orderRequest
	switch {
	case raw.AmountCents == nil:
		problems = append(problems, fieldError{"amount_cents", "is required"})
	case *raw.AmountCents <= 0:
		problems = append(problems, fieldError{"amount_cents", "must be greater than 0"})
	case *raw.AmountCents > maxAmountCents:
		problems = append(problems, fieldError{"amount_cents", fmt.Sprintf("must be at most %d", maxAmountCents)})
	default:
		order.AmountCents = *raw.AmountCents
	}
	switch {
	case raw.Currency == nil:
		problems = append(problems, fieldError{"currency", "is required"})
	case !supportedCurrencies[*raw.Currency]:
		problems = append(problems, fieldError{"currency", "must be one of usd, eur, gbp (lower case)"})
	default:
		order.Currency = *raw.Currency
	}
	switch {
	case raw.Items == nil:
		problems = append(problems, fieldError{"items", "is required"})
	case len(*raw.Items) == 0:
		problems = append(problems, fieldError{"items", "must not be empty"})
	case len(*raw.Items) > maxOrderItems:
		problems = append(problems, fieldError{"items", fmt.Sprintf("must have at most %d items", maxOrderItems)})
	default:
		seen := map[string]bool{}
		for i, item := range *raw.Items {
			field := fmt.Sprintf("items[%d]", i)
			switch {
			case item.SKU == nil:
				problems = append(problems, fieldError{field + ".sku", "is required"})
			case !skuPattern.MatchString(*item.SKU):
				problems = append(problems, fieldError{field + ".sku", "must be lower-case letters, digits and dashes"})
			case seen[*item.SKU]:
				problems = append(problems, fieldError{field + ".sku", "appears twice; add the quantities"})
			}
			switch {
			case item.Qty == nil:
				problems = append(problems, fieldError{field + ".qty", "is required"})
			case *item.Qty <= 0 || *item.Qty > maxItemQty:
				problems = append(problems, fieldError{field + ".qty", fmt.Sprintf("must be between 1 and %d", maxItemQty)})
			}
			if item.SKU != nil && item.Qty != nil {
				seen[*item.SKU] = true
				order.Items = append(order.Items, orderItem{SKU: *item.SKU, Qty: *item.Qty})
			}
		}
	}
	switch {
	case raw.PaymentMethod == nil:
		problems = append(problems, fieldError{"payment_method", "is required"})
	case !paymentMethods[*raw.PaymentMethod]:
		problems = append(problems, fieldError{"payment_method", "must be one of pm_card_visa, pm_card_chargeDeclined, pm_card_timeout"})
	default:
		order.PaymentMethod = *raw.PaymentMethod
	}
	if len(problems) > 0 {
		return orderRequest{}, &invalidRequestError{Errors: problems}
	}
	return order, nil
}

// checkSKUs returns an *invalidRequestError if an item names a SKU the
// warehouse does not stock. Too little stock is not an input error: the saga
// finds out and cancels the order.
//
// A SKU found once is not looked up again (a.stockedSKUs): nothing deletes
// a row of stock_items, so a SKU stocked once stays known, and an order's
// look costs no statement once its SKUs were seen. A SKU not found is
// looked up every time: it may be stocked later.
func (a *App) checkSKUs(ctx context.Context, q queryer, items []orderItem) error {
	for i, item := range items {
		if _, known := a.stockedSKUs.Load(item.SKU); known {
			continue
		}
		var exists bool
		err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM stock_items WHERE sku = ?)`, item.SKU).Scan(&exists)
		if err != nil {
			return fmt.Errorf("look up sku: %w", err)
		}
		if !exists {
			return invalidField(fmt.Sprintf("items[%d].sku", i), fmt.Sprintf("unknown sku %q", item.SKU))
		}
		a.stockedSKUs.Store(item.SKU, true)
	}
	return nil
}

// orderRow is a row of orders.
type orderRow struct {
	OrderID        string
	UserID         string
	AmountCents    int64
	Currency       string
	Items          []orderItem
	PaymentMethod  string
	Status         orderStatus
	IdempotencyKey string
	ChargeID       sql.NullString
	RefundedCents  int64
	CancelReason   sql.NullString
	CreatedAt      string
}

// orderView is the order as the API shows it.
type orderView struct {
	OrderID       string       `json:"order_id"`
	Status        orderStatus  `json:"status"`
	AmountCents   int64        `json:"amount_cents"`
	Currency      string       `json:"currency"`
	Items         []orderItem  `json:"items"`
	PaymentMethod string       `json:"payment_method"`
	RefundedCents int64        `json:"refunded_cents"`
	CancelReason  string       `json:"cancel_reason,omitempty"`
	CreatedAt     string       `json:"created_at"`
	Payment       *paymentView `json:"payment,omitempty"`
	Saga          *sagaView    `json:"saga,omitempty"`
}

// paymentView is the order's charge as GET /api/orders/{id} shows it.
type paymentView struct {
	ChargeID      string `json:"charge_id"`
	CapturedCents int64  `json:"captured_cents"`
	RefundedCents int64  `json:"refunded_cents"`
}

// view returns the order as the API shows it, without payment and saga.
func (o orderRow) view() orderView {
	return orderView{
		OrderID:       o.OrderID,
		Status:        o.Status,
		AmountCents:   o.AmountCents,
		Currency:      o.Currency,
		Items:         o.Items,
		PaymentMethod: o.PaymentMethod,
		RefundedCents: o.RefundedCents,
		CancelReason:  o.CancelReason.String,
		CreatedAt:     o.CreatedAt,
	}
}

// insertOrder writes a new order in tx.
func insertOrder(ctx context.Context, tx *sql.Tx, order orderRow) error {
	items, err := json.Marshal(order.Items)
	if err != nil {
		return fmt.Errorf("encode items: %w", err)
	}
	_, err = tx.ExecContext(ctx, `
		INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status,
		                    idempotency_key, created_at, updated_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		order.OrderID, order.UserID, order.AmountCents, order.Currency, items, order.PaymentMethod, order.Status,
		order.IdempotencyKey, order.CreatedAt, order.CreatedAt,
	)
	if err != nil {
		return fmt.Errorf("insert order: %w", err)
	}
	return nil
}

// errOrderNotFound is returned when an order does not exist or belongs to
// another user; the API answers both with 404 so ids cannot be probed.
var errOrderNotFound = errors.New("order not found")

// queryer is what both *sql.DB and *sql.Tx offer for reads, so a read can
// run inside a transaction or outside one.
type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// readOrder reads one order. Returns errOrderNotFound if there is none.
func readOrder(ctx context.Context, q queryer, orderID string) (orderRow, error) {
	var order orderRow
	var items []byte
	err := q.QueryRowContext(ctx, `
		SELECT order_id, user_id, amount_cents, currency, items, payment_method, status,
		       COALESCE(idempotency_key, ''), charge_id, refunded_cents, cancel_reason, created_at
		FROM orders WHERE order_id = ?`, orderID,
	).Scan(&order.OrderID, &order.UserID, &order.AmountCents, &order.Currency, &items, &order.PaymentMethod,
		&order.Status, &order.IdempotencyKey, &order.ChargeID, &order.RefundedCents, &order.CancelReason, &order.CreatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return orderRow{}, errOrderNotFound
	}
	if err != nil {
		return orderRow{}, fmt.Errorf("read order: %w", err)
	}
	if err := json.Unmarshal(items, &order.Items); err != nil {
		return orderRow{}, fmt.Errorf("decode items of order %s: %w", orderID, err)
	}
	return order, nil
}

// readOrders reads the orders orderIDs in one statement, for the saga
// engine, which reads a round's sagas together. An order that does not
// exist is missing from the map; one whose items cannot be decoded has
// its error in broken, and is missing from the map too.
func readOrders(ctx context.Context, q queryer, orderIDs []string) (orders map[string]orderRow, broken map[string]error, err error) {
	args := make([]any, len(orderIDs))
	for i, id := range orderIDs {
		args[i] = id
	}
	rows, err := q.QueryContext(ctx, `
		SELECT order_id, user_id, amount_cents, currency, items, payment_method, status,
		       COALESCE(idempotency_key, ''), charge_id, refunded_cents, cancel_reason, created_at
		FROM orders WHERE order_id IN (`+placeholders(len(orderIDs))+`)`, args...)
	if err != nil {
		return nil, nil, fmt.Errorf("read orders: %w", err)
	}
	defer rows.Close()
	orders, broken = map[string]orderRow{}, map[string]error{}
	for rows.Next() {
		var order orderRow
		var items []byte
		err := rows.Scan(&order.OrderID, &order.UserID, &order.AmountCents, &order.Currency, &items, &order.PaymentMethod,
			&order.Status, &order.IdempotencyKey, &order.ChargeID, &order.RefundedCents, &order.CancelReason, &order.CreatedAt)
		if err != nil {
			return nil, nil, fmt.Errorf("read orders: %w", err)
		}
		if err := json.Unmarshal(items, &order.Items); err != nil {
			broken[order.OrderID] = fmt.Errorf("decode items of order %s: %w", order.OrderID, err)
			continue
		}
		orders[order.OrderID] = order
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("read orders: %w", err)
	}
	return orders, broken, nil
}

// orderServiceConsumer is the order service's subscription: it moves an
// order to paid or cancelled when the saga's result arrives.
const orderServiceConsumer = "order-svc"

// applyPaymentResult is the order service's inbox handler. It runs in the
// inbox transaction, so the status change and the record that this message
// was applied commit together. An event that contradicts the order's state
// is a permanent error: the message becomes poison for an operator.
//
// A copy of a result the order already shows (paid with that very charge,
// or cancelled for that very reason) changes nothing: a copy normally
// meets its inbox row and is skipped, but cleanup deletes inbox rows after
// messageRetention, and a copy can come later still (a relay paused a week
// in the middle of its publish sends it then; on NATS an operator's replay
// for another consumer reaches every consumer). Poison, it would come back
// with every replay, as a copy of OrderCreated did (sagaAlreadyStarted).
func (a *App) applyPaymentResult(ctx context.Context, tx *sql.Tx, msg message) error {
	switch msg.Subject {
	case eventPaymentCaptured:
		var payload paymentCapturedPayload
		if err := json.Unmarshal(msg.Payload, &payload); err != nil {
			return permanent(fmt.Errorf("decode %s: %w", msg.Subject, err))
		}
		// Refunded since, an order still shows the charge that paid it.
		paidByIt := func(order orderRow) bool {
			return (order.Status == orderPaid || order.Status == orderRefunded) && order.ChargeID.String == payload.ChargeID
		}
		return setOrderStatus(ctx, tx, payload.OrderID, orderCreated, orderPaid, a.now(),
			`charge_id = ?`, payload.ChargeID, paidByIt)
	case eventOrderCancelled:
		var payload orderCancelledPayload
		if err := json.Unmarshal(msg.Payload, &payload); err != nil {
			return permanent(fmt.Errorf("decode %s: %w", msg.Subject, err))
		}
		cancelledByIt := func(order orderRow) bool {
			return order.Status == orderCancelled && order.CancelReason.String == payload.Reason
		}
		return setOrderStatus(ctx, tx, payload.OrderID, orderCreated, orderCancelled, a.now(),
			`cancel_reason = ?`, payload.Reason, cancelledByIt)
	default:
		return permanent(fmt.Errorf("order service does not handle %s", msg.Subject))
	}
}

// setOrderStatus moves an order from one status to another and sets one more
// column. Returns nil, and changes nothing, if the order is not in from but
// already shows the change (done is true of it: a copy of a message that
// its inbox forgot, see applyPaymentResult), and a permanent error if the
// order is missing or in any other state.
func setOrderStatus(ctx context.Context, tx *sql.Tx, orderID string, from, to orderStatus, now time.Time, set string, value any,
	done func(orderRow) bool) error {
	result, err := tx.ExecContext(ctx,
		`UPDATE orders SET status = ?, updated_at = ?, `+set+` WHERE order_id = ? AND status = ?`,
		to, formatTime(now), value, orderID, from)
	if err != nil {
		return fmt.Errorf("update order %s: %w", orderID, err)
	}
	n, err := result.RowsAffected()
	if err != nil {
		return fmt.Errorf("update order %s: %w", orderID, err)
	}
	if n == 1 {
		return nil
	}
	order, err := readOrder(ctx, tx, orderID)
	if err != nil {
		return permanent(err)
	}
	if done(order) {
		return nil
	}
	return permanent(fmt.Errorf("order %s is %s, cannot become %s", orderID, order.Status, to))
}
