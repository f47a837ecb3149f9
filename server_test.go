package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// problemTypeOf returns the "type" of a problem body.
func problemTypeOf(tb testing.TB, r response) problemType {
	tb.Helper()
	if ct := r.Header.Get("Content-Type"); ct != "application/problem+json" {
		tb.Fatalf("got Content-Type %q for %d %s, want application/problem+json", ct, r.Status, r.Body)
	}
	var p problem
	if err := json.Unmarshal([]byte(r.Body), &p); err != nil {
		tb.Fatalf("problem body %q: %v", r.Body, err)
	}
	if p.Status != r.Status {
		tb.Fatalf("problem status %d in a %d response", p.Status, r.Status)
	}
	return p.Type
}

func TestHTTPCreateOrder(t *testing.T) {
	body := orderBody(5000, "sku-1", 2, pmCardVisa)

	// Ensure a create answers 201 with the order and a Location, and the
	// retry replays it byte for byte with Idempotent-Replayed.
	t.Run("RetryIsReplayed", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		first := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		if first.Status != 201 || first.Header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("got %d replayed=%q, want 201 not replayed", first.Status, first.Header.Get("Idempotent-Replayed"))
		}
		orderID := orderField([]byte(first.Body), "order_id")
		if first.Header.Get("Location") != "/api/orders/"+orderID || orderField([]byte(first.Body), "status") != string(orderCreated) {
			t.Fatalf("got Location %q and body %s", first.Header.Get("Location"), first.Body)
		}
		second := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		if second.Status != 201 || second.Body != first.Body || second.Header.Get("Idempotent-Replayed") != "true" ||
			second.Header.Get("Location") != first.Header.Get("Location") {
			t.Fatalf("got %d %q %s, want the replayed first response", second.Status, second.Header.Get("Idempotent-Replayed"), second.Body)
		}
	})

	// Ensure every bad request gets the right status and problem type, and
	// stores nothing.
	t.Run("BadRequestsAreRejectedAndNotStored", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		tests := []struct {
			name      string
			apiKey    string
			key       string
			body      string
			status    int
			problem   problemType
			mutateReq func(*http.Request)
		}{
			{name: "NoAPIKey", key: "k", body: body, status: 401, problem: problemUnauthorized},
			{name: "NotBearer", apiKey: "Basic " + keyUser42, key: "k", body: body, status: 401, problem: problemUnauthorized},
			{name: "UnknownAPIKey", apiKey: "sk_nope", key: "k", body: body, status: 401, problem: problemUnauthorized},
			{name: "NoIdempotencyKey", apiKey: keyUser42, body: body, status: 400, problem: problemKeyMissing},
			{name: "KeyTooLong", apiKey: keyUser42, key: strings.Repeat("k", 256), body: body, status: 400, problem: problemKeyInvalid},
			{name: "KeyNotASCII", apiKey: keyUser42, key: "kéy", body: body, status: 400, problem: problemKeyInvalid},
			{name: "KeyWithTab", apiKey: keyUser42, key: "k\ty", body: body, status: 400, problem: problemKeyInvalid},
			{name: "InvalidJSON", apiKey: keyUser42, key: "k", body: `{"amount_cents":`, status: 400, problem: problemValidation},
			{name: "UnknownField", apiKey: keyUser42, key: "k", body: strings.Replace(body, `{`, `{"coupon":"x",`, 1), status: 400, problem: problemValidation},
			{name: "WrongType", apiKey: keyUser42, key: "k", body: strings.Replace(body, `5000`, `"5000"`, 1), status: 400, problem: problemValidation},
			{name: "ZeroAmount", apiKey: keyUser42, key: "k", body: orderBody(0, "sku-1", 1, pmCardVisa), status: 400, problem: problemValidation},
			{name: "NegativeAmount", apiKey: keyUser42, key: "k", body: orderBody(-5, "sku-1", 1, pmCardVisa), status: 400, problem: problemValidation},
			{name: "AbsurdAmount", apiKey: keyUser42, key: "k", body: orderBody(maxAmountCents+1, "sku-1", 1, pmCardVisa), status: 400, problem: problemValidation},
			{name: "OverflowingAmount", apiKey: keyUser42, key: "k", body: strings.Replace(body, `5000`, `99999999999999999999999`, 1), status: 400, problem: problemValidation},
			{name: "NoItems", apiKey: keyUser42, key: "k", body: `{"amount_cents":5,"currency":"usd","items":[],"payment_method":"pm_card_visa"}`, status: 400, problem: problemValidation},
			{name: "UnknownSKU", apiKey: keyUser42, key: "k", body: orderBody(5, "sku-404", 1, pmCardVisa), status: 400, problem: problemValidation},
			{name: "ZeroQty", apiKey: keyUser42, key: "k", body: orderBody(5, "sku-1", 0, pmCardVisa), status: 400, problem: problemValidation},
			{name: "UnknownPaymentMethod", apiKey: keyUser42, key: "k", body: orderBody(5, "sku-1", 1, "pm_card_amex"), status: 400, problem: problemValidation},
			{name: "NotJSON", apiKey: keyUser42, key: "k", body: body, status: 415, problem: problemUnsupportedMedia,
				mutateReq: func(r *http.Request) { r.Header.Set("Content-Type", "text/plain") }},
			{name: "TooLarge", apiKey: keyUser42, key: "k", body: `{"amount_cents":5,"pad":"` + strings.Repeat("x", maxBodyBytes) + `"}`, status: 413, problem: problemBodyTooLarge},
		}
		for _, tt := range tests {
			req, err := http.NewRequest("POST", ts.URL+"/api/orders", strings.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasPrefix(tt.apiKey, "Basic ") {
				req.Header.Set("Authorization", tt.apiKey)
			} else if tt.apiKey != "" {
				req.Header.Set("Authorization", "Bearer "+tt.apiKey)
			}
			if tt.key != "" {
				req.Header.Set("Idempotency-Key", tt.key)
			}
			req.Header.Set("Content-Type", "application/json")
			if tt.mutateReq != nil {
				tt.mutateReq(req)
			}
			got := roundTrip(t, ts, req)
			if got.Status != tt.status || problemTypeOf(t, got) != tt.problem {
				t.Errorf("%s: got %d %s, want %d %s", tt.name, got.Status, got.Body, tt.status, tt.problem)
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM idempotency_keys) + (SELECT COUNT(*) FROM orders)`); n != 0 {
			t.Fatalf("bad requests stored %d rows", n)
		}
		// The key "k" was never stored: fixing the body and retrying works.
		if fixed := call(t, ts, "POST", "/api/orders", keyUser42, "k", body); fixed.Status != 201 {
			t.Fatalf("the fixed request got %d %s, want 201", fixed.Status, fixed.Body)
		}
	})

	// Ensure a SKU is looked up until it is found stocked, and only then
	// taken as known (checkSKUs keeps the SKUs it found): an unknown SKU
	// beside a known one is still refused, and a SKU refused while
	// unknown is taken once it is stocked.
	t.Run("UnknownSKUIsRefusedUntilStocked", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		if first := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body); first.Status != 201 {
			t.Fatalf("got %d %s, want 201", first.Status, first.Body)
		}
		twoItems := `{"amount_cents":5,"currency":"usd","items":[{"sku":"sku-1","qty":1},{"sku":"sku-new","qty":1}],"payment_method":"pm_card_visa"}`
		for range 2 {
			refused := call(t, ts, "POST", "/api/orders", keyUser42, "k2", twoItems)
			if refused.Status != 400 || !strings.Contains(refused.Body, `items[1].sku`) {
				t.Fatalf("got %d %s, want 400 naming items[1].sku", refused.Status, refused.Body)
			}
		}
		if _, err := env.app.db.Exec(`INSERT INTO stock_items (sku, available, stocked) VALUES ('sku-new', 5, 5)`); err != nil {
			t.Fatal(err)
		}
		if taken := call(t, ts, "POST", "/api/orders", keyUser42, "k2", twoItems); taken.Status != 201 {
			t.Fatalf("once sku-new is stocked: got %d %s, want 201", taken.Status, taken.Body)
		}
	})

	// Ensure an Idempotency-Key that is not exactly one key is refused, as
	// two header lines are, with a 400 naming the header, by every endpoint
	// that takes one, and nothing is stored. A proxy may fold two lines
	// into one, "k1, k1" (RFC 9110, section 5.3): taken as a new key, it
	// made a second order.
	t.Run("FoldedKeyHeaderIsRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		first := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		if first.Status != 201 {
			t.Fatalf("got %d %s, want 201", first.Status, first.Body)
		}
		endpoints := [][2]string{ // a path, and a body it takes
			{"/api/orders", body},
			{refundPath(orderField([]byte(first.Body), "order_id")), `{}`},
		}
		for _, endpoint := range endpoints {
			path, body := endpoint[0], endpoint[1]
			for _, lines := range [][]string{
				{"k1", "k1"},       // two lines
				{"k1, k1"},         // the same two, folded by a proxy
				{`"k1", "k1"`},     // the draft's form, folded
				{`"k1","k2"`},      // two keys
				{"k1,"},            // folded with an empty line
				{`"k1";expires=1`}, // parameters
				{`"k1"k1`},         // text after the quoted string
				{`"k1`},            // no closing quote
				{`"k\1"`},          // an escape RFC 8941 does not have
			} {
				req, err := http.NewRequest("POST", ts.URL+path, strings.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Authorization", "Bearer "+keyUser42)
				req.Header.Set("Content-Type", "application/json")
				req.Header["Idempotency-Key"] = lines
				got := roundTrip(t, ts, req)
				if got.Status != 400 || problemTypeOf(t, got) != problemKeyInvalid || !strings.Contains(got.Body, "Idempotency-Key") {
					t.Errorf("POST %s with Idempotency-Key %q: got %d %s, want 400 %s naming the header", path, lines, got.Status, got.Body, problemKeyInvalid)
				}
			}
		}
		if n := env.count(t, `SELECT (SELECT COUNT(*) FROM idempotency_keys) + (SELECT COUNT(*) FROM orders) + (SELECT COUNT(*) FROM refunds)`); n != 2 {
			t.Fatalf("got %d rows in idempotency_keys, orders and refunds, want k1's key and order", n)
		}
	})

	// Ensure the IETF draft's quoted key (an RFC 8941 string) and the same
	// key bare are one key: the retry replays, whichever form each sends.
	t.Run("QuotedAndBareKeyAreOneKey", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		for _, forms := range [][2]string{
			{`pay-req-user-42-cart-7`, `"pay-req-user-42-cart-7"`},
			{`"say \"hi\" \\ bye"`, `say "hi" \ bye`},
		} {
			first := call(t, ts, "POST", "/api/orders", keyUser42, forms[0], body)
			again := call(t, ts, "POST", "/api/orders", keyUser42, forms[1], body)
			if first.Status != 201 || again.Body != first.Body || again.Header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("%s then %s: got %d %s then %d %q %s, want the replay", forms[0], forms[1],
					first.Status, first.Body, again.Status, again.Header.Get("Idempotent-Replayed"), again.Body)
			}
		}
		stored := env.count(t, `SELECT COUNT(*) FROM orders WHERE idempotency_key IN (?, ?)`, `pay-req-user-42-cart-7`, `say "hi" \ bye`)
		if all := env.count(t, `SELECT COUNT(*) FROM orders`); stored != 2 || all != 2 {
			t.Fatalf("got %d orders, %d of them under the keys as read, want one under each", all, stored)
		}
	})

	// Ensure a key reused with another body is 422 of its own problem type.
	t.Run("KeyReuseIsItsOwn422", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		reused := call(t, ts, "POST", "/api/orders", keyUser42, "k1", orderBody(9900, "sku-1", 2, pmCardVisa))
		if reused.Status != 422 || problemTypeOf(t, reused) != problemKeyReused {
			t.Fatalf("got %d %s, want 422 %s", reused.Status, reused.Body, problemKeyReused)
		}
	})

	// Ensure 50 concurrent requests with one key make one order, and each
	// gets the same 201 (or a 409 to retry).
	t.Run("FiftyConcurrentRequestsOneOrder", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		const n = 50
		responses := make([]response, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				responses[i] = call(t, ts, "POST", "/api/orders", keyUser42, "same-key", body)
			}()
		}
		mustWait(t, "all 50 requests to be answered", &wg)
		var created string
		for i, r := range responses {
			switch r.Status {
			case 201:
				if created == "" {
					created = r.Body
				}
				if r.Body != created {
					t.Fatalf("response %d: got %s, want %s", i, r.Body, created)
				}
			case 409:
			default:
				t.Fatalf("response %d: got %d %s, want 201 or 409", i, r.Status, r.Body)
			}
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 1 {
			t.Fatalf("got %d orders, want 1", got)
		}
	})

	// Ensure one user's key never replays another user's response, and users
	// see only their own orders.
	t.Run("UsersAreIsolated", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		mine := call(t, ts, "POST", "/api/orders", keyUser42, "shared", body)
		theirs := call(t, ts, "POST", "/api/orders", keyUser7, "shared", body)
		if theirs.Status != 201 || theirs.Header.Get("Idempotent-Replayed") != "" || theirs.Body == mine.Body {
			t.Fatalf("user-7 got %d %q %s", theirs.Status, theirs.Header.Get("Idempotent-Replayed"), theirs.Body)
		}
		myOrder := "/api/orders/" + orderField([]byte(mine.Body), "order_id")
		if got := call(t, ts, "GET", myOrder, keyUser42, "", ""); got.Status != 200 {
			t.Fatalf("owner got %d", got.Status)
		}
		if got := call(t, ts, "GET", myOrder, keyUser7, "", ""); got.Status != 404 || problemTypeOf(t, got) != problemNotFound {
			t.Fatalf("another user got %d %s, want 404", got.Status, got.Body)
		}
	})

	// Ensure GET shows the order's payment and saga once the workers ran.
	t.Run("GetShowsPaymentAndSaga", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		created := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		env.drain(t)
		got := call(t, ts, "GET", "/api/orders/"+orderField([]byte(created.Body), "order_id"), keyUser42, "", "")
		var view orderView
		if err := json.Unmarshal([]byte(got.Body), &view); err != nil {
			t.Fatal(err)
		}
		if view.Status != orderPaid || view.Payment == nil || view.Payment.CapturedCents != 5000 || view.Saga == nil || view.Saga.Status != sagaCompleted {
			t.Fatalf("got %s", got.Body)
		}
	})

	// Ensure a panic answers 500 and stores nothing.
	t.Run("PanicIs500AndStoresNothing", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		env.fault.set(func(point faultPoint, pass int) error {
			if point == faultAfterBusinessWrite {
				panic("boom")
			}
			return nil
		})
		got := call(t, ts, "POST", "/api/orders", keyUser42, "k1", body)
		if got.Status != 500 || problemTypeOf(t, got) != problemInternal {
			t.Fatalf("got %d %s, want 500", got.Status, got.Body)
		}
		if n := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`); n != 0 {
			t.Fatalf("stored %d keys", n)
		}
	})

	// Ensure health, unknown routes and wrong methods answer sensibly.
	t.Run("HealthAndRouting", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newTestServer(t, env)
		if got := call(t, ts, "GET", "/healthz", "", "", ""); got.Status != 200 {
			t.Fatalf("healthz %d", got.Status)
		}
		if got := call(t, ts, "DELETE", "/api/orders", keyUser42, "", ""); got.Status != 405 || problemTypeOf(t, got) != problemMethodNotAllowed || got.Header.Get("Allow") != "POST" {
			t.Fatalf("DELETE got %d %s", got.Status, got.Body)
		}
		if got := call(t, ts, "GET", "/nope", "", "", ""); got.Status != 404 || problemTypeOf(t, got) != problemNotFound {
			t.Fatalf("GET /nope got %d %s", got.Status, got.Body)
		}
		if got := call(t, ts, "GET", string(problemKeyReused), "", "", ""); got.Status != 200 || !strings.Contains(got.Body, "different request") {
			t.Fatalf("problem doc got %d %s", got.Status, got.Body)
		}
	})
}

// Ensure an order id whose bytes are not UTF-8, or that holds a NUL, is a
// 404 that stores nothing, on every database: PostgreSQL refuses such text
// in a query, and answered 500.
func TestHTTPOrderIDNotUTF8(t *testing.T) {
	env := MustOpenApp(t)
	ts := newTestServer(t, env)
	for _, tc := range []struct{ method, path, key, body string }{
		{"GET", "/api/orders/ord_%FF", "", ""},
		{"POST", "/api/orders/ord_%FF/refund", "r-not-utf8", "{}"},
		{"POST", "/api/orders/%C3%28/refund", "r-not-utf8-2", ""},
		{"GET", "/api/orders/ord_%00", "", ""},
		{"POST", "/api/orders/ord_%00/refund", "r-nul", "{}"},
	} {
		got := call(t, ts, tc.method, tc.path, keyUser42, tc.key, tc.body)
		if got.Status != http.StatusNotFound || problemTypeOf(t, got) != problemNotFound {
			t.Fatalf("%s %s: got %d %s, want 404 %s", tc.method, tc.path, got.Status, got.Body, problemNotFound)
		}
	}
	if n := env.count(t, `SELECT COUNT(*) FROM idempotency_keys`); n != 0 {
		t.Fatalf("%d idempotency keys stored, want 0", n)
	}
}

// Ensure RETRYSAFE_API_KEYS refuses a user or key that is not printable
// ASCII: a user id is stored on every order and printed by every command.
func TestParseAPIKeysRefusesUnprintable(t *testing.T) {
	for _, spec := range []string{"user\x1b[2K:sk_a", "user 42:sk_a", "user-42:sk\ta", "usér:sk_a"} {
		if _, err := parseAPIKeys(spec); err == nil || !strings.Contains(err.Error(), "printable ASCII") {
			t.Fatalf("parseAPIKeys(%q) = %v, want an error naming printable ASCII", spec, err)
		}
	}
	keys, err := parseAPIKeys("user-42:sk_test_a, user-7:sk_test_b")
	if err != nil || keys["sk_test_a"] != "user-42" || keys["sk_test_b"] != "user-7" {
		t.Fatalf("parseAPIKeys of a good spec = %v, %v", keys, err)
	}
}
