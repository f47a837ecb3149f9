package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// Ensure no malformed, hostile or oversized request gets in: each gets a 4xx
// problem (never a 5xx), and nothing is stored.
func TestBadInputNeverGetsIn(t *testing.T) {
	env := MustOpenApp(t)
	ts := newTestServer(t, env)
	valid := orderBody(5000, "sku-1", 2, pmCardVisa)
	withField := func(field, value string) string {
		var fields map[string]json.RawMessage
		if err := json.Unmarshal([]byte(valid), &fields); err != nil {
			t.Fatal(err)
		}
		fields[field] = json.RawMessage(value)
		body, err := json.Marshal(fields)
		if err != nil {
			t.Fatal(err)
		}
		return string(body)
	}
	sqlText := `x'; DROP TABLE orders; --`

	tests := []struct {
		name string
		key  string
		body string
	}{
		{"EmptyBody", "k", ""},
		{"UnclosedObject", "k", `{"amount_cents":5000`},
		{"TrailingComma", "k", `{"amount_cents":5000,}`},
		{"TwoObjects", "k", valid + valid},
		{"TrailingGarbage", "k", valid + "x"},
		{"Array", "k", `[` + valid + `]`},
		{"String", "k", `"order"`},
		{"Null", "k", `null`},
		{"AmountAsString", "k", withField("amount_cents", `"5000"`)},
		{"AmountAsFloat", "k", withField("amount_cents", `50.5`)},
		{"AmountAsBool", "k", withField("amount_cents", `true`)},
		{"AmountOverflowsInt64", "k", withField("amount_cents", `9223372036854775808`)},
		{"AmountUnderflowsInt64", "k", withField("amount_cents", `-9223372036854775809`)},
		{"AmountHugeExponent", "k", withField("amount_cents", `1e400`)},
		{"AmountNegative", "k", withField("amount_cents", `-1`)},
		{"AmountZero", "k", withField("amount_cents", `0`)},
		{"AmountAbsurd", "k", withField("amount_cents", `100000000000`)},
		{"ItemsAsObject", "k", withField("items", `{"sku":"sku-1","qty":1}`)},
		{"ItemsNull", "k", withField("items", `null`)},
		{"QtyAsString", "k", withField("items", `[{"sku":"sku-1","qty":"2"}]`)},
		{"QtyOverflows", "k", withField("items", `[{"sku":"sku-1","qty":99999999999999999999}]`)},
		{"QtyHuge", "k", withField("items", `[{"sku":"sku-1","qty":1000000}]`)},
		{"TooManyItems", "k", withField("items", `[`+strings.TrimSuffix(strings.Repeat(`{"sku":"sku-1","qty":1},`, 51), ",")+`]`)},
		{"CurrencyAsNumber", "k", withField("currency", `840`)},
		{"CurrencyInvalidUTF8", "k", strings.Replace(valid, `"usd"`, "\"us\xffd\"", 1)},
		{"KeyNameInvalidUTF8", "k", strings.Replace(valid, `"currency"`, "\"curr\xc3ency\"", 1)},
		{"PaymentMethodAsArray", "k", withField("payment_method", `["pm_card_visa"]`)},
		{"UnknownField", "k", withField("coupon", `"FREE"`)},
		{"SQLInSKU", "k", withField("items", `[{"sku":"`+sqlText+`","qty":1}]`)},
		{"SQLInCurrency", "k", withField("currency", `"`+sqlText+`"`)},
		{"SQLInPaymentMethod", "k", withField("payment_method", `"`+sqlText+`"`)},
		{"HeaderInjectionInSKU", "k", withField("items", `[{"sku":"sku-1\r\nSet-Cookie: x=1","qty":1}]`)},
		{"DeepNesting", "k", strings.Repeat("[", 10000) + strings.Repeat("]", 10000)},
		{"HugeBody", "k", `{"amount_cents":5000,"pad":"` + strings.Repeat("x", 2*maxBodyBytes) + `"}`},
		{"KeyTooLong", strings.Repeat("k", maxKeyLength+1), valid},
		{"KeyHuge", strings.Repeat("k", 20000), valid},
		{"KeyNonASCII", "kéy", valid},
		{"KeyOnlyQuotes", `""`, valid},
		{"KeyFoldedByAProxy", "k1, k1", valid},
		{"KeyQuotedWithParameters", `"k1";p=1`, valid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := call(t, ts, "POST", "/api/orders", keyUser42, tt.key, tt.body)
			if got.Status < 400 || got.Status >= 500 {
				t.Fatalf("got %d %s, want a 4xx", got.Status, got.Body)
			}
			problemTypeOf(t, got)
		})
	}

	// Malformed framing that Go's client will not send: net/http rejects it
	// before any handler runs, with a 4xx of its own.
	rawRequests := map[string]string{
		"NULInKey":       "POST /api/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + keyUser42 + "\r\nIdempotency-Key: a\x00b\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
		"BareLFInHeader": "POST /api/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\nX-Injected: 1\r\nContent-Length: 2\r\n\r\n{}",
		"NegativeLength": "POST /api/orders HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
	}
	for name, raw := range rawRequests {
		t.Run("Raw"+name, func(t *testing.T) {
			conn, err := net.DialTimeout("tcp", strings.TrimPrefix(ts.URL, "http://"), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := conn.Write([]byte(raw)); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode < 400 || resp.StatusCode >= 500 {
				t.Fatalf("got %d, want a 4xx", resp.StatusCode)
			}
		})
	}

	// Bodies that mean two things: encoding/json matches field names
	// case-insensitively (with Unicode folding: "ſ" is an "s", the Kelvin
	// sign a "k") and keeps the last of a repeated key, while the
	// fingerprint keeps every spelling. Each is refused, naming the field,
	// before a key is claimed: the refunds go to an order that does not
	// exist, which would otherwise store a 404 under the key.
	itemsOf := func(items string) string { return withField("items", items) }
	orderWith := func(members string) string {
		return `{` + members + `,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`
	}
	refundOfNothing := refundPath("ord_none")
	ambiguous := []struct {
		name, path, body string
		field            string
	}{
		{"DuplicateAmount", "/api/orders", orderWith(`"amount_cents":100,"amount_cents":999`), "amount_cents"},
		{"DuplicateAmountEscaped", "/api/orders", orderWith(`"amount_cents":100,"amount\u005fcents":999`), "amount_cents"},
		{"CaseVariantAmount", "/api/orders", orderWith(`"AMOUNT_CENTS":999`), "AMOUNT_CENTS"},
		{"AmountThenItsCaseVariant", "/api/orders", orderWith(`"amount_cents":100,"AMOUNT_CENTS":999`), "AMOUNT_CENTS"},
		{"CaseVariantThenAmount", "/api/orders", orderWith(`"AMOUNT_CENTS":999,"amount_cents":100`), "AMOUNT_CENTS"},
		{"LongSInAmount", "/api/orders", orderWith(`"amount_cent\u017f":999`), "amount_cent\u017f"},
		{"DuplicateItems", "/api/orders", strings.Replace(valid, `"items":`, `"items":[{"sku":"sku-2","qty":9}],"items":`, 1), "items"},
		{"DuplicateQtyInItem", "/api/orders", itemsOf(`[{"sku":"sku-1","qty":1,"qty":2}]`), "items[0].qty"},
		{"CaseVariantSKU", "/api/orders", itemsOf(`[{"SKU":"sku-1","qty":1}]`), "items[0].SKU"},
		{"KelvinSignInSKU", "/api/orders", itemsOf(`[{"s\u212au":"sku-1","qty":1}]`), "items[0].s\u212au"},
		{"RefundDuplicateAmount", refundOfNothing, `{"amount_cents":4000,"amount_cents":100}`, "amount_cents"},
		{"RefundAmountThenItsCaseVariant", refundOfNothing, `{"amount_cents":4000,"AMOUNT_CENTS":100}`, "AMOUNT_CENTS"},
		{"RefundCaseVariantAmount", refundOfNothing, `{"Amount_Cents":100}`, "Amount_Cents"},
	}
	for _, tt := range ambiguous {
		t.Run(tt.name, func(t *testing.T) {
			got := call(t, ts, "POST", tt.path, keyUser42, "k-"+tt.name, tt.body)
			var p problem
			if err := json.Unmarshal([]byte(got.Body), &p); err != nil {
				t.Fatalf("got %d %s, want a problem: %v", got.Status, got.Body, err)
			}
			// The field is named as the client spelled it.
			var want string
			if err := json.Unmarshal([]byte(`"`+tt.field+`"`), &want); err != nil {
				t.Fatal(err)
			}
			if got.Status != 400 || p.Type != problemValidation || len(p.Errors) != 1 || p.Errors[0].Field != want {
				t.Fatalf("got %d %s, want 400 %s naming %q", got.Status, got.Body, problemValidation, want)
			}
		})
	}

	if n := env.count(t, `SELECT (SELECT COUNT(*) FROM idempotency_keys) + (SELECT COUNT(*) FROM orders) + (SELECT COUNT(*) FROM outbox_events)`); n != 0 {
		t.Fatalf("bad input stored %d rows", n)
	}

	// SQL text that is valid data (here, a key) is stored as data.
	t.Run("SQLTextInKeyIsJustData", func(t *testing.T) {
		first := call(t, ts, "POST", "/api/orders", keyUser42, sqlText, valid)
		again := call(t, ts, "POST", "/api/orders", keyUser42, sqlText, valid)
		if first.Status != 201 || again.Header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("got %d then %d %q", first.Status, again.Status, again.Header.Get("Idempotent-Replayed"))
		}
		if got := env.str(t, `SELECT idempotency_key FROM orders`); got != sqlText {
			t.Fatalf("stored key %q, want %q", got, sqlText)
		}
	})
}

// FuzzCanonicalJSON checks the fingerprint's core: equivalent bodies give
// one canonical form, and different ones differ.
func FuzzCanonicalJSON(f *testing.F) {
	f.Add(`{"b":1,"a":[1,2,{"y":null,"x":"s"}]}`, `{"a":[1,2,{"x":"s","y":null}],"b":1}`)
	f.Add(`{"amount_cents":5000}`, `{"amount_cents":5000.0}`)
	f.Add(`{"a":"\u00e9"}`, `{"a":"é"}`)
	f.Add(`{"a":1,"a":2}`, `{"a":2}`)
	f.Add(`[]`, `{}`)
	f.Add("{\"a\":\"\xff\"}", `{"a":"\ufffd"}`)
	f.Fuzz(func(t *testing.T, a, b string) {
		canonicalA, errA := canonicalJSON([]byte(a))
		canonicalB, errB := canonicalJSON([]byte(b))
		if errA != nil {
			var repeated *invalidRequestError
			if utf8.ValidString(a) && json.Valid([]byte(a)) && !strings.Contains(a, "\x00") && !errors.As(errA, &repeated) {
				// Valid JSON may only be refused for a name repeated in
				// one object, or for trailing data, which json.Valid
				// already rules out.
				t.Fatalf("canonicalJSON(%q) refused valid JSON: %v", a, errA)
			}
			return
		}
		// Canonical form is a fixed point, and survives re-indenting.
		again, err := canonicalJSON(canonicalA)
		if err != nil || !bytes.Equal(again, canonicalA) {
			t.Fatalf("canonical form of %q is not stable: %s then %s (%v)", a, canonicalA, again, err)
		}
		var indented bytes.Buffer
		if err := json.Indent(&indented, []byte(a), "", "  "); err == nil {
			if reindented, err := canonicalJSON(indented.Bytes()); err != nil || !bytes.Equal(reindented, canonicalA) {
				t.Fatalf("re-indenting %q changed its canonical form: %s vs %s", a, reindented, canonicalA)
			}
		}
		if errB != nil {
			return
		}
		// Same canonical form exactly when the decoded values are equal.
		same := bytes.Equal(canonicalA, canonicalB)
		equal := reflect.DeepEqual(decodeWithNumbers(t, canonicalA), decodeWithNumbers(t, canonicalB))
		if same != equal {
			t.Fatalf("%q and %q: same canonical form %v, equal values %v", a, b, same, equal)
		}
	})
}

// decodeWithNumbers decodes JSON keeping numbers as their literal text.
func decodeWithNumbers(t *testing.T, data []byte) any {
	decoder := json.NewDecoder(bytes.NewReader(data))
	decoder.UseNumber()
	var value any
	if err := decoder.Decode(&value); err != nil {
		t.Fatalf("decode %s: %v", data, err)
	}
	return value
}

// FuzzDecodeOrderRequest checks that the decoder never panics, and that what
// it accepts is within the limits and survives a round trip.
func FuzzDecodeOrderRequest(f *testing.F) {
	f.Add(orderBody(5000, "sku-1", 2, pmCardVisa))
	f.Add(`{"amount_cents":1,"currency":"eur","items":[{"sku":"a","qty":1000}],"payment_method":"pm_card_timeout"}`)
	f.Add(`{"amount_cents":-1}`)
	f.Add(`{"amount_cents":9223372036854775808,"currency":"usd","items":[],"payment_method":""}`)
	f.Add(`{"items":[{"sku":"sku-1","qty":1},{"sku":"sku-1","qty":1}]}`)
	f.Add(`nonsense`)
	f.Fuzz(func(t *testing.T, body string) {
		order, err := decodeOrderRequest([]byte(body))
		if err != nil {
			var invalid *invalidRequestError
			if !errors.As(err, &invalid) || len(invalid.Errors) == 0 {
				t.Fatalf("decodeOrderRequest(%q) returned %T %v, want an *invalidRequestError naming a field", body, err, err)
			}
			return
		}
		if order.AmountCents <= 0 || order.AmountCents > maxAmountCents || len(order.Items) == 0 || len(order.Items) > maxOrderItems ||
			!supportedCurrencies[order.Currency] || !paymentMethods[order.PaymentMethod] {
			t.Fatalf("accepted an out-of-limits order %+v from %q", order, body)
		}
		for _, item := range order.Items {
			if item.Qty <= 0 || item.Qty > maxItemQty || !skuPattern.MatchString(item.SKU) {
				t.Fatalf("accepted item %+v from %q", item, body)
			}
		}
		encoded, err := json.Marshal(order)
		if err != nil {
			t.Fatal(err)
		}
		again, err := decodeOrderRequest(encoded)
		if err != nil || !reflect.DeepEqual(again, order) {
			t.Fatalf("round trip of %+v gave %+v, %v", order, again, err)
		}
	})
}

// Ensure the Idempotency-Key value is read as exactly one key: bare, or
// the IETF draft's quoted string with RFC 8941's escapes; a list, a
// quoted string with anything after it, or a character outside printable
// ASCII is refused with a reason naming the header.
func TestParseIdempotencyKey(t *testing.T) {
	for value, want := range map[string]string{
		`pay-req-user-42-cart-7`:   `pay-req-user-42-cart-7`,
		`"pay-req-user-42-cart-7"`: `pay-req-user-42-cart-7`,
		` "k1" `:                   `k1`,
		`"a \"b\" \\ c, d; e"`:     `a "b" \ c, d; e`,
		`a "b" \ c; d`:             `a "b" \ c; d`,
		`k1, k1`:                   "holds a list",
		`k1,`:                      "holds a list",
		`"k1", "k1"`:               "holds a list",
		`"k1" ,k2`:                 "holds a list",
		`"k1";p=1`:                 "parameters",
		`"k1"k1`:                   "text after its quoted string",
		`"k1" "k2"`:                "text after its quoted string",
		`"k1`:                      "no closing quote",
		`"k1\"`:                    "no closing quote",
		`"k\1"`:                    "escapes a character",
		`""`:                       "empty",
		"\"k\t1\"":                 "printable ASCII",
		"k\x7f1":                   "printable ASCII",
		"\"k\u00e91\"":             "printable ASCII",
		strings.Repeat("k", 256):   "the limit is 255",
	} {
		key, err := parseIdempotencyKey(value)
		switch {
		case err != nil && !strings.Contains(err.Error(), "Idempotency-Key"):
			t.Errorf("%q: refused with %q, which does not name the header", value, err)
		case err != nil && !strings.Contains(err.Error(), want):
			t.Errorf("%q: refused with %q, want %q", value, err, want)
		case err == nil && key != want:
			t.Errorf("%q: got key %q, want %q", value, key, want)
		}
	}
}

// FuzzIdempotencyKeyHeader checks that the key header parser never panics,
// accepts only 1 to 255 printable ASCII characters, never a list, and
// reads a quoted key as the same key quoted again.
func FuzzIdempotencyKeyHeader(f *testing.F) {
	for _, seed := range []string{"k", `"quoted"`, `"`, `""`, strings.Repeat("k", 255), strings.Repeat("k", 256), "tab\there", "é", "a b",
		"k1, k1", `"k1", "k1"`, `"a\"b\\c"`, `"k1";p=1`, `"k1"x`} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, value string) {
		req, err := http.NewRequest("POST", "/api/orders", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header["Idempotency-Key"] = []string{value}
		key, problem := idempotencyKeyFrom(req)
		if problem != nil {
			if problem.Status != 400 {
				t.Fatalf("%q: status %d, want 400", value, problem.Status)
			}
			return
		}
		if len(key) == 0 || len(key) > maxKeyLength {
			t.Fatalf("%q: accepted a key of length %d", value, len(key))
		}
		for _, c := range []byte(key) {
			if c < 0x20 || c > 0x7e {
				t.Fatalf("%q: accepted byte %#x", value, c)
			}
		}
		// A bare key is the value as sent, never a list; a quoted one is
		// what the same key, quoted again, reads as.
		if bare := strings.Trim(value, " "); !strings.HasPrefix(bare, `"`) {
			if key != bare || strings.Contains(key, ",") {
				t.Fatalf("%q: accepted bare as key %q", value, key)
			}
			return
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		if again, err := parseIdempotencyKey(quoted); err != nil || again != key {
			t.Fatalf("%q: key %q quoted as %s reads as %q (%v)", value, key, quoted, again, err)
		}
	})
}

// Ensure two bodies with one fingerprint are one request: a retry with the
// same key replays only an answer to the question it asked, and what runs
// is what was fingerprinted.
func TestSameFingerprintSameRequest(t *testing.T) {
	// Ensure a body and its keys in the other order (one canonical form,
	// so one fingerprint) can never be two orders that share one 201:
	// a body that encoding/json reads differently from the fingerprint is
	// refused before a key is claimed.
	t.Run("CaseVariantOrdersAreRefusedNotReplayed", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		rest := `"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"`
		asks999 := `{"amount_cents":100,"AMOUNT_CENTS":999,` + rest + `}`
		asks100 := `{"AMOUNT_CENTS":999,"amount_cents":100,` + rest + `}`
		first := call(t, ts, "POST", "/api/orders", keyUser42, "k1", asks999)
		second := call(t, ts, "POST", "/api/orders", keyUser42, "k1", asks100)
		for _, got := range []response{first, second} {
			if got.Status != 400 || problemTypeOf(t, got) != problemValidation || !strings.Contains(got.Body, `"field":"AMOUNT_CENTS"`) {
				t.Fatalf("got %d %s then %d %s, want 400 %s naming AMOUNT_CENTS for both",
					first.Status, first.Body, second.Status, second.Body, problemValidation)
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM idempotency_keys) + (SELECT COUNT(*) FROM orders)`); n != 0 {
			t.Fatalf("stored %d rows", n)
		}
	})

	// Ensure a refund body that asks for 100 in one reading and 4000 in the
	// other refunds nothing; the client fixes it and the same key works.
	t.Run("AmbiguousRefundRefundsNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		orderID := paidOrderOverHTTP(t, env, ts, 5000)
		got := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":4000,"AMOUNT_CENTS":100}`)
		if got.Status != 400 || problemTypeOf(t, got) != problemValidation || !strings.Contains(got.Body, `"field":"AMOUNT_CENTS"`) {
			t.Fatalf("got %d %s, want 400 %s naming AMOUNT_CENTS", got.Status, got.Body, problemValidation)
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = 'r1') + (SELECT COUNT(*) FROM refunds) + (SELECT COUNT(*) FROM processor_refunds)`); n != 0 {
			t.Fatalf("stored %d rows", n)
		}
		fixed := call(t, ts, "POST", refundPath(orderID), keyUser42, "r1", `{"amount_cents":100}`)
		if fixed.Status != 200 || env.count(t, `SELECT refunded_cents FROM orders WHERE order_id = ?`, orderID) != 100 {
			t.Fatalf("the fixed refund got %d %s, want 200 refunding 100", fixed.Status, fixed.Body)
		}
	})
}

// requestKind is one idempotent POST: its path and its body's decoder.
type requestKind struct {
	name   string
	path   string
	decode func(body []byte) (any, error)
}

// idempotentKinds returns the idempotent POSTs of the API.
func idempotentKinds() []requestKind {
	return []requestKind{
		{"order", "/api/orders", func(body []byte) (any, error) { return decodeOrderRequest(body) }},
		{"refund", refundPath("ord_1"), func(body []byte) (any, error) { return decodeRefundRequest(body) }},
	}
}

// FuzzSameFingerprintSameRequest checks the promise an idempotency key
// rests on: two bodies that decode and share a fingerprint decode to the
// same request (so replaying one's answer to the other is right), and a
// body decodes to the same request as its canonical form (the bytes whose
// fingerprint is stored, and which the completer decodes later). Each body
// is also compared with itself with every object's members reversed: same
// canonical form, so it must be the same request.
func FuzzSameFingerprintSameRequest(f *testing.F) {
	rest := `"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"`
	f.Add(`{"amount_cents":100,"AMOUNT_CENTS":999,`+rest+`}`, `{"AMOUNT_CENTS":999,"amount_cents":100,`+rest+`}`)
	f.Add(`{"amount_cents":100,"amount_cents":999,`+rest+`}`, `{"amount_cents":999,`+rest+`}`)
	f.Add(`{"amount_cents":100,"amount\u005fcents":999,`+rest+`}`, `{"amount_cents":999,`+rest+`}`)
	f.Add(`{"amount_cents":999,"amount_cent\u017f":100,`+rest+`}`, `{"amount_cent\u017f":100,"amount_cents":999,`+rest+`}`)
	f.Add(`{"amount_cents":5,"currency":"usd","items":[{"sku":"sku-1","qty":1,"QTY":7}],"payment_method":"pm_card_visa"}`,
		`{"amount_cents":5,"currency":"usd","items":[{"QTY":7,"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`)
	f.Add(`{"amount_cents":4000,"AMOUNT_CENTS":100}`, `{"AMOUNT_CENTS":100,"amount_cents":4000}`)
	f.Add(`{"amount_cents":4000,"amount_cents":100}`, `{"amount_cents":100}`)
	f.Add(orderBody(5000, "sku-1", 2, pmCardVisa), ` {"payment_method":"pm_card_visa", "items":[{"qty":2,"sku":"sku-1"}], "currency":"usd", "amount_cents":5000}`)
	f.Add(`{}`, `null`)
	f.Fuzz(func(t *testing.T, a, b string) {
		for _, kind := range idempotentKinds() {
			fingerprintA, requestA, okA := fingerprintAndDecode(t, kind, a)
			fingerprintB, requestB, okB := fingerprintAndDecode(t, kind, b)
			if okA && okB && fingerprintA == fingerprintB && !reflect.DeepEqual(requestA, requestB) {
				t.Fatalf("%s bodies %q and %q share fingerprint %s but decode to %s and %s",
					kind.name, a, b, fingerprintA, jsonOf(requestA), jsonOf(requestB))
			}
			reversed, ok := reverseMembers(a)
			if !ok {
				continue
			}
			fingerprintR, requestR, okR := fingerprintAndDecode(t, kind, reversed)
			if okA && okR && (fingerprintA != fingerprintR || !reflect.DeepEqual(requestA, requestR)) {
				t.Fatalf("%s body %q and its reverse %q: fingerprints %s and %s, requests %s and %s",
					kind.name, a, reversed, fingerprintA, fingerprintR, jsonOf(requestA), jsonOf(requestR))
			}
			if okA != okR {
				t.Fatalf("%s body %q decodes (%v) but its reverse %q does not, or the other way round (%v)",
					kind.name, a, okA, reversed, okR)
			}
		}
	})
}

// fingerprintAndDecode returns body's fingerprint and the request it
// decodes to, and false if either step refuses it. It fails the test if the
// body and its canonical form decode differently.
func fingerprintAndDecode(t *testing.T, kind requestKind, body string) (string, any, bool) {
	t.Helper()
	canonical, err := canonicalJSON([]byte(body))
	if err != nil {
		return "", nil, false
	}
	fromBody, errBody := kind.decode([]byte(body))
	fromCanonical, errCanonical := kind.decode(canonical)
	if (errBody == nil) != (errCanonical == nil) || !reflect.DeepEqual(fromBody, fromCanonical) {
		t.Fatalf("%s body %q decodes to %s (%v), its canonical form %s to %s (%v)",
			kind.name, body, jsonOf(fromBody), errBody, canonical, jsonOf(fromCanonical), errCanonical)
	}
	if errCanonical != nil {
		return "", nil, false
	}
	req := idempotentRequest{Method: "POST", Path: kind.path, CanonicalBody: canonical}
	return req.fingerprint(), fromCanonical, true
}

// jsonOf shows a decoded request, pointers followed, for a failure message.
func jsonOf(request any) string {
	encoded, err := json.Marshal(request)
	if err != nil {
		return fmt.Sprintf("%+v (%v)", request, err)
	}
	return string(encoded)
}

// reverseMembers returns body with the members of every object in reverse
// order, repeated names kept; false if body is not one valid UTF-8 JSON
// value.
func reverseMembers(body string) (string, bool) {
	if !utf8.ValidString(body) {
		return "", false
	}
	decoder := json.NewDecoder(strings.NewReader(body))
	decoder.UseNumber()
	reversed, err := reverseValue(decoder)
	if err != nil {
		return "", false
	}
	if _, err := decoder.Token(); err != io.EOF {
		return "", false
	}
	return reversed, true
}

// reverseValue reads one value from decoder and writes it with its objects'
// members reversed.
func reverseValue(decoder *json.Decoder) (string, error) {
	token, err := decoder.Token()
	if err != nil {
		return "", err
	}
	delim, ok := token.(json.Delim)
	if !ok {
		encoded, err := json.Marshal(token)
		return string(encoded), err
	}
	var parts []string
	for decoder.More() {
		part := ""
		if delim == '{' {
			name, err := decoder.Token()
			if err != nil {
				return "", err
			}
			encodedName, err := json.Marshal(name)
			if err != nil {
				return "", err
			}
			part = string(encodedName) + ":"
		}
		value, err := reverseValue(decoder)
		if err != nil {
			return "", err
		}
		parts = append(parts, part+value)
	}
	if _, err := decoder.Token(); err != nil {
		return "", err
	}
	if delim == '{' {
		slices.Reverse(parts)
		return "{" + strings.Join(parts, ",") + "}", nil
	}
	return "[" + strings.Join(parts, ",") + "]", nil
}
