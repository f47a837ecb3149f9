package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// consoleClient is a browser as the console tests play it: it keeps the
// console's cookies, and shows each redirect instead of following it.
type consoleClient struct {
	ts      *httptest.Server
	cookies map[string]*http.Cookie
}

// newConsoleClient returns a client of ts with no cookie.
func newConsoleClient(ts *httptest.Server) *consoleClient {
	return &consoleClient{ts: ts, cookies: map[string]*http.Cookie{}}
}

// do sends method path with form (a POST body, if not nil) and the extra
// headers, and keeps the cookies the answer sets or deletes.
func (c *consoleClient) do(tb testing.TB, method, path string, form url.Values, header map[string]string) response {
	tb.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, c.ts.URL+path, body)
	if err != nil {
		tb.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for name, value := range header {
		req.Header.Set(name, value)
	}
	for _, cookie := range c.cookies {
		req.AddCookie(cookie)
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	if err != nil {
		tb.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	for _, cookie := range resp.Cookies() {
		if cookie.MaxAge < 0 {
			delete(c.cookies, cookie.Name)
		} else {
			c.cookies[cookie.Name] = cookie
		}
	}
	return response{Status: resp.StatusCode, Header: resp.Header, Body: string(got)}
}

// login logs the client in with key under the name operator, and fails
// the test unless it is sent on to the console.
func (c *consoleClient) login(tb testing.TB, key, operator string) {
	tb.Helper()
	r := c.do(tb, "POST", "/console/login", url.Values{"key": {key}, "operator": {operator}}, nil)
	mustRedirect(tb, "login", r, "/console")
	if c.cookies[consoleSessionCookie] == nil {
		tb.Fatalf("login set no session cookie: %v", r.Header["Set-Cookie"])
	}
}

// page returns the console (GET path), failing the test unless it answers
// status.
func (c *consoleClient) page(tb testing.TB, path string, status int) string {
	tb.Helper()
	r := c.do(tb, "GET", path, nil, nil)
	if r.Status != status {
		tb.Fatalf("GET %s: got %d %s, want %d", path, r.Status, r.Body, status)
	}
	return r.Body
}

// press POSTs a console form at path with the page's CSRF token, and
// returns the console it redirects to.
func (c *consoleClient) press(tb testing.TB, path string) string {
	tb.Helper()
	token := csrfTokenOn(tb, c.page(tb, "/console", http.StatusOK))
	r := c.do(tb, "POST", path, url.Values{"csrf": {token}}, nil)
	mustRedirect(tb, "POST "+path, r, "/console")
	return c.page(tb, "/console", http.StatusOK)
}

// mustRedirect fails the test unless r is a 303 to location.
func mustRedirect(tb testing.TB, what string, r response, location string) {
	tb.Helper()
	if r.Status != http.StatusSeeOther || r.Header.Get("Location") != location {
		tb.Fatalf("%s: got %d to %q %s, want 303 to %s", what, r.Status, r.Header.Get("Location"), r.Body, location)
	}
}

// csrfTokenOn returns the CSRF token of the page's forms.
func csrfTokenOn(tb testing.TB, page string) string {
	tb.Helper()
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(page)
	if m == nil {
		tb.Fatalf("no CSRF token on the page:\n%s", page)
	}
	return m[1]
}

// attrsOn returns the values of the data attribute name on page, in order.
func attrsOn(page, name string) string {
	var values []string
	for _, m := range regexp.MustCompile(`data-`+name+`="([^"]*)"`).FindAllStringSubmatch(page, -1) {
		values = append(values, m[1])
	}
	return strings.Join(values, " ")
}

// setAside is one row of each kind the console repairs, made for real.
type setAside struct {
	sagaID, sagaOrderID string
	poisonMessageID     string
	refundOrderID       string
	failedEventID       string
	failedOrderID       string
	pendingOrderID      string
	pendingSince        time.Duration
	poisonOrderID       string
}

// setAsideOneOfEach makes a saga compensation_failed, a poison message for
// the payment service, an abandoned refund, a failed outbox event, and one
// pending event 90 seconds old behind none of them.
func setAsideOneOfEach(tb testing.TB, env *testEnv) setAside {
	tb.Helper()
	ctx := context.Background()
	var s setAside
	s.sagaOrderID, s.sagaID = compensationFailedSaga(tb, env)
	s.refundOrderID = createAndDrain(tb, env, "k2", orderBody(5000, "sku-2", 1, pmCardVisa))

	s.poisonOrderID = orderField(mustCreateOrder(tb, env, "user-42", "k3", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
	if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
		tb.Fatal(err)
	}
	poisonFor(tb, env, consumerNamed(tb, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
	s.poisonMessageID = env.str(tb, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, s.poisonOrderID)

	env.fault.crashAt(faultRefundStarted)
	req, refund := refundRequestFor(tb, s.refundOrderID, "refund-1", "")
	if _, err := env.app.refundOrder(ctx, req, s.refundOrderID, refund); !errors.Is(err, errCrash) {
		tb.Fatalf("got %v, want the crash", err)
	}
	env.fault.failAt("", nil, 0)

	s.failedOrderID = orderField(mustCreateOrder(tb, env, "user-42", "k4", orderBody(5000, "sku-2", 1, pmCardVisa)).Body, "order_id")
	failPublishing(tb, env)
	s.failedEventID = env.str(tb, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, s.failedOrderID)

	s.pendingOrderID = orderField(mustCreateOrder(tb, env, "user-42", "k5", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
	s.pendingSince = 90 * time.Second
	env.clock.advance(s.pendingSince)
	return s
}

func TestConsole(t *testing.T) {
	// Ensure that without RETRYSAFE_ADMIN_KEY every console path answers
	// as /admin does, 404 admin-disabled saying how to enable it, and
	// changes nothing.
	t.Run("OffWithoutTheAdminKey", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, ""))
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events`)
		before := repairState(t, env)
		for _, r := range []response{
			c.do(t, "GET", "/console", nil, nil),
			c.do(t, "GET", "/console/login", nil, nil),
			c.do(t, "POST", "/console/login", url.Values{"key": {""}}, nil),
			c.do(t, "POST", "/console/outbox/"+eventID+"/retry", url.Values{}, nil),
		} {
			mustProblem(t, "console", r, http.StatusNotFound, problemAdminDisabled)
			if !strings.Contains(r.Body, "RETRYSAFE_ADMIN_KEY") || !strings.Contains(r.Body, "/console") {
				t.Fatalf("%s does not say how to enable the console", r.Body)
			}
		}
		if len(c.cookies) != 0 {
			t.Fatalf("a disabled console set cookies: %v", c.cookies)
		}
		if after := repairState(t, env); after != before {
			t.Fatalf("changed\n%s\ninto\n%s", before, after)
		}
	})

	// Ensure the console sends a browser without a session to the login
	// form; no key, a wrong key and a customer's API key are refused with
	// 403 and no cookie; the admin key sets an HttpOnly, SameSite=Strict
	// session cookie for /console that opens the page.
	t.Run("LogInWithTheAdminKeyOnly", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		mustRedirect(t, "console without a session", c.do(t, "GET", "/console", nil, nil), "/console/login")
		if form := c.page(t, "/console/login", http.StatusOK); !strings.Contains(form, `name="key"`) {
			t.Fatalf("no login form:\n%s", form)
		}
		for _, key := range []string{"", keyUser42, "admin_test_kez", testAdminKey + "x"} {
			r := c.do(t, "POST", "/console/login", url.Values{"key": {key}}, nil)
			if r.Status != http.StatusForbidden || !strings.Contains(r.Body, "not the admin key") || len(c.cookies) != 0 {
				t.Fatalf("key %q: got %d %v %s", key, r.Status, c.cookies, r.Body)
			}
		}
		r := c.do(t, "POST", "/console/login", url.Values{"key": {testAdminKey}, "operator": {"bad\tname"}}, nil)
		if r.Status != http.StatusBadRequest || len(c.cookies) != 0 {
			t.Fatalf("bad operator name: got %d %v", r.Status, c.cookies)
		}

		c.login(t, testAdminKey, "alice")
		cookie := c.cookies[consoleSessionCookie]
		if !cookie.HttpOnly || cookie.SameSite != http.SameSiteStrictMode || cookie.Path != "/console" || strings.Contains(cookie.Value, testAdminKey) {
			t.Fatalf("session cookie %+v: want HttpOnly, SameSite=Strict, Path=/console, without the key", cookie)
		}
		r = c.do(t, "GET", "/console", nil, nil)
		if r.Status != http.StatusOK || !strings.Contains(r.Body, "console (alice)") {
			t.Fatalf("got %d %s", r.Status, r.Body)
		}
		for name, want := range map[string]string{"X-Frame-Options": "DENY", "Cache-Control": "no-store"} {
			if got := r.Header.Get(name); got != want {
				t.Fatalf("%s: %q, want %q", name, got, want)
			}
		}
		if csp := r.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "frame-ancestors 'none'") {
			t.Fatalf("Content-Security-Policy: %q", csp)
		}

		mustRedirect(t, "logout", c.do(t, "POST", "/console/logout", url.Values{}, nil), "/console/login")
		mustRedirect(t, "console after logout", c.do(t, "GET", "/console", nil, nil), "/console/login")
	})

	// Ensure a session cookie that was altered, signed under another admin
	// key, or is older than consoleSessionLifetime opens nothing.
	t.Run("ForgedOrExpiredSessionsAreRefused", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		good := *c.cookies[consoleSessionCookie]

		payload, sig, _ := strings.Cut(good.Value, ".")
		other := &server{adminKey: "another_key"}
		forged := map[string]string{
			"altered payload":   payload + "x." + sig,
			"no signature":      payload,
			"another admin key": other.signedValue("session", consoleSession{Nonce: "n", IssuedAt: formatTime(env.clock.now())}),
			"a flash as session": (&server{adminKey: testAdminKey}).signedValue("flash",
				consoleSession{Nonce: "n", IssuedAt: formatTime(env.clock.now())}),
		}
		for what, value := range forged {
			c.cookies[consoleSessionCookie] = &http.Cookie{Name: consoleSessionCookie, Value: value}
			mustRedirect(t, what, c.do(t, "GET", "/console", nil, nil), "/console/login")
		}

		c.cookies[consoleSessionCookie] = &good
		c.page(t, "/console", http.StatusOK)
		env.clock.advance(consoleSessionLifetime + time.Second)
		mustRedirect(t, "expired session", c.do(t, "GET", "/console", nil, nil), "/console/login")
	})

	// Ensure the page shows, as the database holds them, the backlog and
	// the age of its oldest event, the failed events, the poison messages,
	// the sagas in compensation_failed and the unfinished refunds.
	t.Run("ShowsWhatTheDatabaseSetAside", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		s := setAsideOneOfEach(t, env)
		c.login(t, testAdminKey, "")
		page := c.page(t, "/console", http.StatusOK)

		backlog := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'`)
		if backlog != 1 || !strings.Contains(page, fmt.Sprintf(`<span id="backlog">%d</span>`, backlog)) {
			t.Fatalf("backlog %d in the database; page:\n%s", backlog, page)
		}
		if !strings.Contains(page, `<span id="lag">1m30s</span>`) {
			t.Fatalf("want the lag of the pending event, 1m30s; page:\n%s", page)
		}
		for _, tc := range []struct{ attr, query, want string }{
			{"event", `SELECT string_agg(event_id, ' ' ORDER BY seq) FROM outbox_events WHERE status = 'failed'`, s.failedEventID},
			{"message", `SELECT string_agg(consumer || '/' || message_id, ' ' ORDER BY consumer) FROM inbox_messages WHERE status = 'poison'`,
				paymentServiceConsumer + "/" + s.poisonMessageID},
			{"saga", `SELECT string_agg(saga_id, ' ' ORDER BY saga_id) FROM saga_instances WHERE status = 'compensation_failed'`, s.sagaID},
			{"refund", `SELECT string_agg(user_id || '/' || idempotency_key, ' ' ORDER BY idempotency_key) FROM idempotency_keys WHERE recovery_point <> 'finished'`,
				"user-42/refund-1"},
		} {
			inDB := env.str(t, tc.query)
			if got := attrsOn(page, tc.attr); got != inDB || inDB != tc.want {
				t.Errorf("%s: page shows %q, the database holds %q, want %q", tc.attr, got, inDB, tc.want)
			}
		}
		for _, want := range []string{"broker unreachable", "payment service bug", "abandoned: its request stopped", "confirm"} {
			if !strings.Contains(page, want) {
				t.Errorf("page does not show %q", want)
			}
		}
		for _, button := range []string{
			`action="/console/outbox/` + s.failedEventID + `/retry"`,
			`action="/console/inbox/` + paymentServiceConsumer + "/" + s.poisonMessageID + `/replay"`,
			`action="/console/sagas/` + s.sagaID + `/resume"`,
			`action="/console/refunds/finish"`,
		} {
			if !strings.Contains(page, button) {
				t.Errorf("page has no form %s", button)
			}
		}
	})

	// Ensure each button does its repair, logged under the session's
	// operator, and the page it redirects to says what happened and shows
	// the audit; then the workers finish what each repair handed back.
	t.Run("EachButtonRepairs", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		s := setAsideOneOfEach(t, env)
		c.login(t, testAdminKey, "alice")

		page := c.press(t, "/console/outbox/"+s.failedEventID+"/retry")
		if got := env.str(t, `SELECT status || ':' || attempts FROM outbox_events WHERE event_id = ?`, s.failedEventID); got != "pending:0" {
			t.Fatalf("event is %s after retry", got)
		}
		if !strings.Contains(page, "pending again") || !strings.Contains(page, "check --in-flight: ok") || attrsOn(page, "event") != "" {
			t.Fatalf("after retry:\n%s", page)
		}
		if again := c.page(t, "/console", http.StatusOK); strings.Contains(again, `id="flash"`) {
			t.Fatal("a reload shows the message again")
		}

		page = c.press(t, "/console/inbox/"+paymentServiceConsumer+"/"+s.poisonMessageID+"/replay")
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison'`); got != 0 || !strings.Contains(page, "delivered again") {
			t.Fatalf("%d poison after replay:\n%s", got, page)
		}

		page = c.press(t, "/console/sagas/"+s.sagaID+"/resume")
		if got := env.str(t, `SELECT status FROM saga_instances WHERE saga_id = ?`, s.sagaID); got != string(sagaCompensating) || !strings.Contains(page, "compensating again") {
			t.Fatalf("saga is %s after resume:\n%s", got, page)
		}

		page = c.press(t, "/console/refunds/finish")
		if got := env.str(t, `SELECT recovery_point FROM idempotency_keys WHERE idempotency_key = 'refund-1'`); got != string(recoveryFinished) || !strings.Contains(page, "; finished") {
			t.Fatalf("refund key at %s after finish:\n%s", got, page)
		}

		want := "console (alice)|inbox replay|" + paymentServiceConsumer + "/" + s.poisonMessageID + "; console (alice)|outbox retry|" + s.failedEventID +
			"; console (alice)|refund finish|user-42/refund-1; console (alice)|saga resume|" + s.sagaID
		if got := env.str(t, `SELECT string_agg(operator || '|' || action || '|' || target, '; ' ORDER BY action) FROM repair_log`); got != want {
			t.Fatalf("repair_log:\n%s\nwant\n%s", got, want)
		}
		if !strings.Contains(page, `id="repairs"`) || strings.Count(page, "console (alice)</td>") != 4 {
			t.Fatalf("the page does not list the four repairs:\n%s", page)
		}

		// A repair of what was repaired already is refused, and says so.
		page = c.press(t, "/console/outbox/"+s.failedEventID+"/retry")
		if !strings.Contains(page, "Nothing was changed: refused: outbox event "+s.failedEventID+" is pending, not failed") {
			t.Fatalf("second retry:\n%s", page)
		}
		env.drain(t)
		for _, orderID := range []string{s.failedOrderID, s.poisonOrderID, s.pendingOrderID} {
			if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
				t.Errorf("order %s is %s (%s), want paid", orderID, got, env.str(t, `SELECT cancel_reason FROM orders WHERE order_id = ?`, orderID))
			}
		}
		mustAuditClean(t, env, true)
	})

	// Ensure a button's POST changes nothing without a session (sent to
	// log in), without this session's token, with another session's
	// token, or sent by another site's page (403 forbidden).
	t.Run("RefusesForgedPosts", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		s := setAsideOneOfEach(t, env)
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		token := csrfTokenOn(t, c.page(t, "/console", http.StatusOK))
		other := newConsoleClient(ts)
		other.login(t, testAdminKey, "")
		otherToken := csrfTokenOn(t, other.page(t, "/console", http.StatusOK))
		if token == otherToken {
			t.Fatal("two sessions share a CSRF token")
		}
		before := repairState(t, env)

		paths := []string{
			"/console/outbox/" + s.failedEventID + "/retry",
			"/console/inbox/" + paymentServiceConsumer + "/" + s.poisonMessageID + "/replay",
			"/console/sagas/" + s.sagaID + "/resume",
			"/console/refunds/finish",
		}
		for _, path := range paths {
			stranger := newConsoleClient(ts)
			mustRedirect(t, "no session", stranger.do(t, "POST", path, url.Values{"csrf": {token}}, nil), "/console/login")
			for what, form := range map[string]url.Values{
				"no token":                {},
				"a wrong token":           {"csrf": {strings.Repeat("0", len(token))}},
				"not hex":                 {"csrf": {"zz"}},
				"another session's token": {"csrf": {otherToken}},
			} {
				r := c.do(t, "POST", path, form, nil)
				mustProblem(t, path+" with "+what, r, http.StatusForbidden, problemForbidden)
			}
			for what, header := range map[string]map[string]string{
				"Sec-Fetch-Site: cross-site": {"Sec-Fetch-Site": "cross-site"},
				"another Origin":             {"Origin": "http://evil.example"},
			} {
				r := c.do(t, "POST", path, url.Values{"csrf": {token}}, header)
				mustProblem(t, path+" with "+what, r, http.StatusForbidden, problemForbidden)
			}
		}
		r := newConsoleClient(ts).do(t, "POST", "/console/login", url.Values{"key": {testAdminKey}}, map[string]string{"Sec-Fetch-Site": "cross-site"})
		mustProblem(t, "cross-site login", r, http.StatusForbidden, problemForbidden)
		if after := repairState(t, env); after != before {
			t.Fatalf("a refused POST changed\n%s\ninto\n%s", before, after)
		}
		// The same browser, from its own page, is let through.
		if page := c.press(t, "/console/sagas/"+s.sagaID+"/resume"); !strings.Contains(page, "compensating again") {
			t.Fatalf("own form:\n%s", page)
		}
	})

	// Ensure the order form shows the order's timeline as trace prints it,
	// text and Mermaid source, escaped; an unknown order is a 404 page
	// saying so.
	t.Run("ShowsAnOrdersTimeline", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		c.login(t, testAdminKey, "")
		page := c.page(t, "/console?order="+orderID, http.StatusOK)

		tr, err := traceOrder(context.Background(), env.app.db, orderID)
		if err != nil {
			t.Fatal(err)
		}
		var text, mermaid bytes.Buffer
		if err := printTrace(&text, tr); err != nil {
			t.Fatal(err)
		}
		if err := printMermaid(&mermaid, tr); err != nil {
			t.Fatal(err)
		}
		escape := strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&#34;", "'", "&#39;").Replace
		if !strings.Contains(page, `<pre id="timeline">`+escape(text.String())+`</pre>`) {
			t.Fatalf("page does not hold the trace text\n%s\npage:\n%s", text.String(), page)
		}
		if !strings.Contains(page, `<pre class="mermaid" id="mermaid">`+escape(mermaid.String())+`</pre>`) || !strings.Contains(mermaid.String(), "sequenceDiagram") {
			t.Fatalf("page does not hold the Mermaid source\n%s", mermaid.String())
		}
		if strings.Contains(page, "<script") {
			t.Fatal("the page loads a script")
		}

		page = c.page(t, "/console?order=ord_nope%3Cb%3E", http.StatusNotFound)
		if !strings.Contains(page, "There is no order ord_nope&lt;b&gt;.") {
			t.Fatalf("unknown order:\n%s", page)
		}
	})

	// Ensure an error text from the database is shown as text, never as
	// markup: a consumer's error can quote anything a message carried.
	t.Run("EscapesWhatTheDatabaseHolds", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa))
		if _, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		poisonFor(t, env, consumerNamed(t, env, paymentServiceConsumer), permanent(errors.New(`<script>alert("x")</script>`)))
		c.login(t, testAdminKey, "<b>mallory</b>")
		page := c.page(t, "/console", http.StatusOK)
		if strings.Contains(page, "<script>") || strings.Contains(page, "<b>mallory") ||
			!strings.Contains(page, "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;") || !strings.Contains(page, "console (&lt;b&gt;mallory&lt;/b&gt;)") {
			t.Fatalf("the page does not escape what it shows:\n%s", page)
		}
	})

	// Ensure the outcome of a repair of many rows still fits the cookie
	// that carries it to the page (a browser keeps about 4 KiB), and says
	// where the rest is.
	t.Run("LongOutcomeFitsItsCookie", func(t *testing.T) {
		env := MustOpenApp(t)
		s := &server{app: env.app, adminKey: testAdminKey}
		var results []repairResult
		for i := range 100 {
			results = append(results, repairResult{Target: fmt.Sprintf("user-42/refund-%d", i), Result: strings.Repeat("finished ", 20)})
		}
		flash := s.consoleOutcome(context.Background(), results, nil)
		if value := s.signedValue("flash", flash); len(value) > 4000 {
			t.Fatalf("the outcome's cookie is %d bytes", len(value))
		}
		if last := flash.Lines[len(flash.Lines)-1]; !strings.Contains(last, "lines more: see repair_log below") {
			t.Fatalf("last line %q", last)
		}
	})

	// Ensure a wrong method or an unknown console path gets its problem.
	t.Run("Problems", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		mustProblem(t, "GET retry", c.do(t, "GET", "/console/outbox/evt_x/retry", nil, nil), http.StatusMethodNotAllowed, problemMethodNotAllowed)
		mustProblem(t, "DELETE console", c.do(t, "DELETE", "/console", nil, nil), http.StatusMethodNotAllowed, problemMethodNotAllowed)
		mustProblem(t, "unknown path", c.do(t, "GET", "/console/nope", nil, nil), http.StatusNotFound, problemNotFound)
	})
}

// browserText returns the text of the element sel selects on the page.
func browserText(tb testing.TB, ctx context.Context, sel chromedp.CSS) string {
	tb.Helper()
	text, err := chromedp.Run(ctx, chromedp.Text(sel))
	if err != nil {
		tb.Fatalf("read %s: %v", sel, err)
	}
	return text
}

// chromiumPath returns the Chromium the browser test drives:
// $RETRYSAFE_CHROMIUM, or Debian's /usr/bin/chromium. It skips the test
// when there is none, unless RETRYSAFE_TEST_BROWSER=1 (as in CI), where a
// missing browser fails it.
func chromiumPath(tb testing.TB) string {
	tb.Helper()
	candidates := []string{"/usr/bin/chromium"}
	if path := os.Getenv("RETRYSAFE_CHROMIUM"); path != "" {
		candidates = []string{path}
	}
	for _, path := range candidates {
		if _, err := exec.LookPath(path); err == nil {
			return path
		}
	}
	if os.Getenv("RETRYSAFE_TEST_BROWSER") == "1" {
		tb.Fatalf("RETRYSAFE_TEST_BROWSER=1 but no Chromium at %s: apt-get install chromium, or set RETRYSAFE_CHROMIUM", strings.Join(candidates, ", "))
	}
	tb.Skipf("no Chromium at %s: apt-get install chromium (or set RETRYSAFE_CHROMIUM) to run the browser test", strings.Join(candidates, ", "))
	return ""
}

// Ensure an operator in a real browser logs in, sees the failed event,
// presses "retry", and after a relay pass sees the event published in the
// order's timeline, as the database has it.
func TestConsoleInBrowser(t *testing.T) {
	chromium := chromiumPath(t)
	env := MustOpenApp(t)
	ts := newAdminTestServer(t, env, testAdminKey)
	orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
	failPublishing(t, env)
	eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)

	// The flags this machine's closed network needs: without them
	// Chromium keeps trying to reach Google's hosts.
	allocator, cancelAllocator := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
	)
	defer cancelAllocator()
	browser, cancelBrowser := chromedp.NewContext(allocator)
	defer cancelBrowser()
	ctx, cancel := context.WithTimeout(browser, 90*time.Second)
	defer cancel()

	retry := `form[action="/console/outbox/` + eventID + `/retry"] button`
	row := chromedp.CSS(`tr[data-event="` + eventID + `"]`)
	err := chromedp.Do(ctx,
		chromedp.Navigate(ts.URL+"/console"),
		chromedp.WaitVisible(chromedp.CSS(`#key`)),
		chromedp.SendKeys(chromedp.CSS(`#key`), testAdminKey),
		chromedp.SendKeys(chromedp.CSS(`#operator`), "browser"),
		chromedp.Click(chromedp.CSS(`#login`)),
		chromedp.WaitVisible(row),
	)
	if err != nil {
		t.Fatalf("log in: %v", err)
	}
	failedRow := browserText(t, ctx, row)
	if !strings.Contains(failedRow, "broker unreachable") {
		t.Fatalf("failed event's row: %q", failedRow)
	}
	if err := chromedp.Do(ctx, chromedp.Click(chromedp.CSS(retry)), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("press retry: %v", err)
	}
	flash := browserText(t, ctx, chromedp.CSS(`#flash`))
	if !strings.Contains(flash, eventID) || !strings.Contains(flash, "pending again") || !strings.Contains(flash, "check --in-flight: ok") {
		t.Fatalf("after retry the page says %q", flash)
	}
	if got := env.str(t, `SELECT status FROM outbox_events WHERE event_id = ?`, eventID); got != string(outboxPending) {
		t.Fatalf("event is %s after retry, want pending", got)
	}

	if n, err := env.app.relayOnce(context.Background(), "relay", relayBatchSize); err != nil || n != 1 {
		t.Fatalf("relay published %d, %v; want the retried event", n, err)
	}
	err = chromedp.Do(ctx,
		chromedp.Navigate(ts.URL+"/console"),
		chromedp.WaitVisible(chromedp.CSS(`#backlog`)),
	)
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	backlog := browserText(t, ctx, chromedp.CSS(`#backlog`))
	failed := browserText(t, ctx, chromedp.CSS(`#failed`))
	if backlog != "0" || !strings.Contains(failed, "No outbox event has failed") {
		t.Fatalf("after the relay pass the page shows backlog %q and %q", backlog, failed)
	}
	err = chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS(`#order`), orderID),
		chromedp.Click(chromedp.CSS(`#trace`)),
		chromedp.WaitVisible(chromedp.CSS(`#timeline`)),
	)
	if err != nil {
		t.Fatalf("look the order up: %v", err)
	}
	timeline := browserText(t, ctx, chromedp.CSS(`#timeline`))
	seq := env.count(t, `SELECT seq FROM outbox_events WHERE event_id = ?`, eventID)
	if !strings.Contains(timeline, fmt.Sprintf("outbox seq %d marked published", seq)) {
		t.Fatalf("the timeline does not show the event published:\n%s", timeline)
	}
	if got := env.str(t, `SELECT status FROM outbox_events WHERE event_id = ?`, eventID); got != string(outboxPublished) {
		t.Fatalf("event is %s, want published", got)
	}
	if got := repairLog(t, env); got != "console (browser)|outbox retry|"+eventID {
		t.Fatalf("repair_log: %s", got)
	}
}

// Ensure every console route the README's "The console" section names is
// routed, every button it names in bold is a button of the page, and
// every command it compares a button to exists.
func TestREADMEConsoleSection(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## The console\n")
	if !ok {
		t.Fatal("README has no section \"The console\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")

	env := MustOpenApp(t)
	ts := newAdminTestServer(t, env, testAdminKey)
	routes := regexp.MustCompile("`(GET|POST) (/console[^`]*)`").FindAllStringSubmatch(section, -1)
	if len(routes) != 9 {
		t.Fatalf("found %d console routes in the section, want 9", len(routes))
	}
	for _, route := range routes {
		path := regexp.MustCompile(`\{([a-z_]+)\}`).ReplaceAllString(route[2], "$1")
		path = strings.ReplaceAll(path, "ORDER_ID", "ord_x")
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		var form url.Values
		if route[1] == "POST" {
			form = url.Values{"csrf": {csrfTokenOn(t, c.page(t, "/console", http.StatusOK))}, "key": {testAdminKey}}
		}
		r := c.do(t, route[1], path, form, nil)
		if r.Status == http.StatusMethodNotAllowed || r.Status == http.StatusForbidden || strings.Contains(r.Body, "no console route") {
			t.Errorf("README lists %s %s, which is not routed: %d %s", route[1], route[2], r.Status, r.Body)
		}
	}

	html, err := os.ReadFile("console.html")
	if err != nil {
		t.Fatal(err)
	}
	buttons := 0
	for _, bold := range regexp.MustCompile(`\*\*([a-z ]+)\*\* button`).FindAllStringSubmatch(section, -1) {
		buttons++
		if !strings.Contains(string(html), `>`+bold[1]+`</button>`) {
			t.Errorf("README names the button %q, which the page does not have", bold[1])
		}
	}
	if buttons != 4 {
		t.Fatalf("found %d buttons in the section, want retry, replay, resume and finish refunds", buttons)
	}
	if !strings.Contains(string(html), ">log out</button>") || !strings.Contains(section, "**log out**") {
		t.Error("the section and the page disagree on log out")
	}

	flat := strings.Join(strings.Fields(section), " ")
	commands := 0
	for _, m := range regexp.MustCompile("`retrysafe ((?:[a-z]+ ?)+)((?:--[a-z-]+ ?)*)").FindAllStringSubmatch(flat, -1) {
		commands++
		path := strings.Fields(m[1])
		cmd, _, err := newRootCommand().Find(path)
		if err != nil || cmd.CommandPath() != "retrysafe "+strings.Join(path, " ") {
			t.Errorf("README names retrysafe %s, which is no command (%v)", m[1], err)
			continue
		}
		for _, flag := range strings.Fields(m[2]) {
			if cmd.Flags().Lookup(strings.TrimPrefix(flag, "--")) == nil {
				t.Errorf("README gives %s the flag %s, which it does not have", cmd.CommandPath(), flag)
			}
		}
	}
	if commands < 7 {
		t.Fatalf("found %d commands in the section, want serve, the four repairs, trace and check", commands)
	}
}
