package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
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

// consoleButton is the form of a console button: where it posts, and its
// hidden fields but the CSRF token.
type consoleButton struct {
	action string
	fields url.Values
}

// retryButton is the form of the retry button of eventID's row.
func retryButton(eventID string) consoleButton {
	return consoleButton{"/console/outbox/retry", url.Values{"event_id": {url.PathEscape(eventID)}}}
}

// replayButton is the form of the replay button of consumer's poison
// message messageID.
func replayButton(consumer, messageID string) consoleButton {
	return consoleButton{"/console/inbox/replay", url.Values{"consumer": {url.PathEscape(consumer)}, "message_id": {url.PathEscape(messageID)}}}
}

// resumeButton is the form of the resume button of sagaID's row.
func resumeButton(sagaID string) consoleButton {
	return consoleButton{"/console/sagas/resume", url.Values{"saga_id": {url.PathEscape(sagaID)}}}
}

// finishButton is the form of the finish refunds button.
func finishButton() consoleButton {
	return consoleButton{"/console/refunds/finish", url.Values{}}
}

// form returns b's fields with csrf as its token.
func (b consoleButton) form(csrf string) url.Values {
	form := url.Values{"csrf": {csrf}}
	for name, values := range b.fields {
		form[name] = values
	}
	return form
}

// press POSTs the form of button b with the page's CSRF token, and
// returns the console it redirects to.
func (c *consoleClient) press(tb testing.TB, b consoleButton) string {
	tb.Helper()
	token := csrfTokenOn(tb, c.page(tb, "/console", http.StatusOK))
	r := c.do(tb, "POST", b.action, b.form(token), nil)
	mustRedirect(tb, "POST "+b.action+" "+b.fields.Encode(), r, "/console")
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

// formsOn counts the forms on page by where they post and what their
// hidden fields but the CSRF token hold ("ACTION FIELDS", the fields
// query-encoded, as consoleButton's are).
func formsOn(page string) map[string]int {
	forms := map[string]int{}
	for _, form := range regexp.MustCompile(`(?s)<form [^>]*action="([^"]*)"[^>]*>(.*?)</form>`).FindAllStringSubmatch(page, -1) {
		fields := url.Values{}
		for _, input := range regexp.MustCompile(`<input type="hidden" name="([^"]*)" value="([^"]*)">`).FindAllStringSubmatch(form[2], -1) {
			if input[1] != "csrf" {
				fields.Add(html.UnescapeString(input[1]), html.UnescapeString(input[2]))
			}
		}
		forms[html.UnescapeString(form[1])+" "+fields.Encode()]++
	}
	return forms
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

// repairableRows returns every row a console button can change, keyed by
// what it is ("outbox EVENT_ID", "inbox CONSUMER/MESSAGE_ID", "saga
// SAGA_ID"), with its state. A message's delivery is part of its inbox
// row: a replay changes both.
func repairableRows(tb testing.TB, env *testEnv) map[string]string {
	tb.Helper()
	rows, err := env.app.db.Query(`
		SELECT 'outbox ' || event_id, status || ':' || attempts || ':' || lease_token FROM outbox_events
		UNION ALL
		SELECT 'inbox ' || consumer || '/' || message_id, 'inbox ' || status FROM inbox_messages
		UNION ALL
		SELECT 'inbox ' || d.subscriber || '/' || m.message_id, 'delivery ' || d.status
		FROM broker_deliveries d JOIN broker_messages m ON m.seq = d.message_seq
		UNION ALL
		SELECT 'saga ' || saga_id, status || ':' || attempts || ':' || lease_token FROM saga_instances
		ORDER BY 1, 2`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	state := map[string]string{}
	for rows.Next() {
		var row, value string
		if err := rows.Scan(&row, &value); err != nil {
			tb.Fatal(err)
		}
		state[row] += value + ";"
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	return state
}

// changedRows returns the rows of repairableRows that differ between
// before and after, as "ROW: BEFORE -> AFTER" lines, sorted.
func changedRows(before, after map[string]string) []string {
	var changed []string
	for row, state := range before {
		if after[row] != state {
			changed = append(changed, fmt.Sprintf("%q: %s -> %s", row, state, after[row]))
		}
	}
	for row, state := range after {
		if _, ok := before[row]; !ok {
			changed = append(changed, fmt.Sprintf("%q: none -> %s", row, state))
		}
	}
	slices.Sort(changed)
	return changed
}

// hostileRows are rows set aside with ids an outsider could choose, and
// the two rows the hostile ones point at.
type hostileRows struct {
	// sagaID is a compensation_failed saga, eventID a failed event, both
	// with ordinary ids.
	sagaID, eventID string
	failedEvents    []string
	poisonMessages  []string
	sagas           []string
	// webhookID is a poison webhook's event id.
	webhookID string
}

// setAsideHostileIDs sets aside, through the code that does so in
// production, rows whose ids need escaping in a URL: compensation_failed
// sagas, poison messages of the payment service, failed outbox events
// (each of an order with the same id), and a poison webhook. The ids are
// given through the App's id seam (a webhook's through its body): on NATS
// a message id is whatever the publisher's Nats-Msg-Id says. Among them
// are relative paths to the repair of sagaID and eventID, which are set
// aside with ordinary ids.
func setAsideHostileIDs(tb testing.TB, env *testEnv, ts *httptest.Server) hostileRows {
	tb.Helper()
	ctx := context.Background()
	ids := newIDQueue(env)
	var h hostileRows
	_, h.sagaID = compensationFailedSaga(tb, env)
	h.eventID = "evt_victim"

	h.sagas = []string{"s/1", "s?2#3", "..", "%25", "日本/語 ✓", "../outbox/" + h.eventID + "/retry?"}
	for i, sagaID := range h.sagas {
		ids.add("saga", sagaID)
		orderID := compensationFailedSagaOf(tb, env, fmt.Sprintf("saga-%d", i))
		if got := env.str(tb, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID); got != sagaID {
			tb.Fatalf("saga %q, want %q", got, sagaID)
		}
	}

	h.poisonMessages = []string{"c/d", "?", "#", ".", "../x", "100%", "%2e%2e", "naïve ✓/☃", "../../sagas/" + h.sagaID + "/resume?"}
	for i, eventID := range h.poisonMessages {
		ids.add("evt", eventID)
		mustCreateOrder(tb, env, "user-42", fmt.Sprintf("poison-%d", i), orderBody(5000, "sku-1", 1, pmCardVisa))
	}
	if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
		tb.Fatal(err)
	}
	poisonFor(tb, env, consumerNamed(tb, env, paymentServiceConsumer), permanent(errors.New("payment service bug")))
	if got := env.count(tb, `SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison'`); got != len(h.poisonMessages) {
		tb.Fatalf("%d poison messages, want %d", got, len(h.poisonMessages))
	}

	h.failedEvents = []string{h.eventID, "a/b", "q?x=1&y=2", "h#frag", "..", "%2F", "%%", "ünï/cødé ✓", "two\nlines", "../sagas/" + h.sagaID + "/resume?"}
	for i, eventID := range h.failedEvents {
		if eventID != h.eventID {
			ids.add("ord", eventID)
		}
		ids.add("evt", eventID)
		mustCreateOrder(tb, env, "user-42", fmt.Sprintf("failed-%d", i), orderBody(5000, "sku-1", 1, pmCardVisa))
	}
	failPublishing(tb, env)
	if got := env.count(tb, `SELECT COUNT(*) FROM outbox_events WHERE status = 'failed'`); got != len(h.failedEvents) {
		tb.Fatalf("%d failed events, want %d", got, len(h.failedEvents))
	}

	h.webhookID = "../../sagas/" + h.sagaID + "/resume?"
	if got, reply := postSigned(tb, env, ts, refundedEvent(h.webhookID, "ch_unknown", "re_1", "100")); reply.Outcome != inboxPoison {
		tb.Fatalf("webhook: got %d %s, want it poison", got.Status, got.Body)
	}
	return h
}

// compensationFailedSagaOf does what compensationFailedSaga does, under
// another key, on an App that has run sagas before: the faults count the
// passes of their points from now. It returns the order's id.
func compensationFailedSagaOf(tb testing.TB, env *testEnv, key string) string {
	tb.Helper()
	steps := env.fault.hitCount(faultAfterStepEffect)
	responses := env.fault.hitCount(faultProcessorLoseResponse)
	env.fault.set(func(point faultPoint, pass int) error {
		switch {
		case point == faultAfterStepEffect && pass-steps == 2:
			return permanent(errors.New("warehouse rejected the shipment"))
		case point == faultProcessorLoseResponse && pass-responses >= 2:
			// The charge's response arrives; every refund's is lost.
			return errors.New("connection reset")
		}
		return nil
	})
	orderID := createAndDrain(tb, env, key, orderBody(5000, "sku-1", 2, pmCardVisa))
	env.fault.failAt("", nil, 0)
	if got := sagaSteps(tb, env, orderID); got != "compensation_failed: reserve_stock=done charge_card=done confirm=failed" {
		tb.Fatalf("saga: %s", got)
	}
	return orderID
}

// idQueue gives the ids a test chose, then the App's own: the seam through
// which a test gives rows the ids an outsider could.
type idQueue struct {
	mu     sync.Mutex
	next   func(prefix string) string
	queued map[string][]string
}

// newIDQueue puts an idQueue in front of env's ids.
func newIDQueue(env *testEnv) *idQueue {
	q := &idQueue{next: env.app.newID, queued: map[string][]string{}}
	env.app.newID = q.newID
	return q
}

// add makes the next ids of prefix ids, in order.
func (q *idQueue) add(prefix string, ids ...string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.queued[prefix] = append(q.queued[prefix], ids...)
}

// newID is the App's newID.
func (q *idQueue) newID(prefix string) string {
	q.mu.Lock()
	defer q.mu.Unlock()
	if queued := q.queued[prefix]; len(queued) > 0 {
		q.queued[prefix] = queued[1:]
		return queued[0]
	}
	return q.next(prefix)
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
			c.do(t, "POST", "/console/outbox/retry", retryButton(eventID).fields, nil),
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

		token := csrfTokenOn(t, r.Body)
		mustRedirect(t, "logout", c.do(t, "POST", "/console/logout", url.Values{"csrf": {token}}, nil), "/console/login")
		mustRedirect(t, "console after logout", c.do(t, "GET", "/console", nil, nil), "/console/login")
	})

	// Ensure log out takes the session's token like every other form: a
	// POST without it, with another session's, or sent by another site's
	// page is refused with 403 and the session stays; with it, the
	// session ends.
	t.Run("LogoutNeedsTheSessionsToken", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		token := csrfTokenOn(t, c.page(t, "/console", http.StatusOK))
		other := newConsoleClient(ts)
		other.login(t, testAdminKey, "")
		otherToken := csrfTokenOn(t, other.page(t, "/console", http.StatusOK))
		for what, tc := range map[string]struct {
			form   url.Values
			header map[string]string
		}{
			"no token":                   {url.Values{}, nil},
			"another session's token":    {url.Values{"csrf": {otherToken}}, nil},
			"Sec-Fetch-Site: cross-site": {url.Values{"csrf": {token}}, map[string]string{"Sec-Fetch-Site": "cross-site"}},
			"another Origin":             {url.Values{"csrf": {token}}, map[string]string{"Origin": "http://evil.example"}},
		} {
			r := c.do(t, "POST", "/console/logout", tc.form, tc.header)
			mustProblem(t, "logout with "+what, r, http.StatusForbidden, problemForbidden)
			if len(r.Header["Set-Cookie"]) != 0 {
				t.Fatalf("logout with %s set %v", what, r.Header["Set-Cookie"])
			}
			c.page(t, "/console", http.StatusOK)
		}
		mustRedirect(t, "logout", c.do(t, "POST", "/console/logout", url.Values{"csrf": {token}}, nil), "/console/login")
		mustRedirect(t, "console after logout", c.do(t, "GET", "/console", nil, nil), "/console/login")
		other.page(t, "/console", http.StatusOK)
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
		other := &server{adminKey: "another_admin_key_0b8e2f6d41c97a35e1"}
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
		for _, b := range []consoleButton{
			retryButton(s.failedEventID),
			replayButton(paymentServiceConsumer, s.poisonMessageID),
			resumeButton(s.sagaID),
			finishButton(),
		} {
			if got := formsOn(page)[b.action+" "+b.fields.Encode()]; got != 1 {
				t.Errorf("page has %d forms %s %s, want 1", got, b.action, b.fields.Encode())
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

		page := c.press(t, retryButton(s.failedEventID))
		if got := env.str(t, `SELECT status || ':' || attempts FROM outbox_events WHERE event_id = ?`, s.failedEventID); got != "pending:0" {
			t.Fatalf("event is %s after retry", got)
		}
		if !strings.Contains(page, "pending again") || !strings.Contains(page, "check --in-flight: ok") || attrsOn(page, "event") != "" {
			t.Fatalf("after retry:\n%s", page)
		}
		if again := c.page(t, "/console", http.StatusOK); strings.Contains(again, `id="flash"`) {
			t.Fatal("a reload shows the message again")
		}

		page = c.press(t, replayButton(paymentServiceConsumer, s.poisonMessageID))
		if got := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison'`); got != 0 || !strings.Contains(page, "delivered again") {
			t.Fatalf("%d poison after replay:\n%s", got, page)
		}

		page = c.press(t, resumeButton(s.sagaID))
		if got := env.str(t, `SELECT status FROM saga_instances WHERE saga_id = ?`, s.sagaID); got != string(sagaCompensating) || !strings.Contains(page, "compensating again") {
			t.Fatalf("saga is %s after resume:\n%s", got, page)
		}

		page = c.press(t, finishButton())
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
		page = c.press(t, retryButton(s.failedEventID))
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

		buttons := []consoleButton{
			retryButton(s.failedEventID),
			replayButton(paymentServiceConsumer, s.poisonMessageID),
			resumeButton(s.sagaID),
			finishButton(),
		}
		for _, b := range buttons {
			stranger := newConsoleClient(ts)
			mustRedirect(t, "no session", stranger.do(t, "POST", b.action, b.form(token), nil), "/console/login")
			for what, form := range map[string]url.Values{
				"no token":                b.form(""),
				"a wrong token":           b.form(strings.Repeat("0", len(token))),
				"not hex":                 b.form("zz"),
				"another session's token": b.form(otherToken),
			} {
				r := c.do(t, "POST", b.action, form, nil)
				mustProblem(t, b.action+" with "+what, r, http.StatusForbidden, problemForbidden)
			}
			for what, header := range map[string]map[string]string{
				"Sec-Fetch-Site: cross-site": {"Sec-Fetch-Site": "cross-site"},
				"another Origin":             {"Origin": "http://evil.example"},
			} {
				r := c.do(t, "POST", b.action, b.form(token), header)
				mustProblem(t, b.action+" with "+what, r, http.StatusForbidden, problemForbidden)
			}
		}
		r := newConsoleClient(ts).do(t, "POST", "/console/login", url.Values{"key": {testAdminKey}}, map[string]string{"Sec-Fetch-Site": "cross-site"})
		mustProblem(t, "cross-site login", r, http.StatusForbidden, problemForbidden)
		if after := repairState(t, env); after != before {
			t.Fatalf("a refused POST changed\n%s\ninto\n%s", before, after)
		}
		// The same browser, from its own page, is let through.
		if page := c.press(t, resumeButton(s.sagaID)); !strings.Contains(page, "compensating again") {
			t.Fatalf("own form:\n%s", page)
		}
	})

	// Ensure no id a row holds decides where a form posts: with ids full
	// of "/", "?", "#", "..", "%" and relative paths to another row's
	// repair, every form posts to its fixed route and carries its row's
	// ids, escaped, in hidden fields that decode to exactly those ids; the
	// poison webhook, which no replay can deliver again, has no button
	// and says so, and a replay forged for it anyway is refused. (The
	// browser test presses these buttons.)
	t.Run("NoIDDecidesWhereAFormPosts", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		h := setAsideHostileIDs(t, env, ts)
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		page := c.page(t, "/console", http.StatusOK)

		routes := map[string]bool{"/console/login": true, "/console/logout": true, "/console": true,
			"/console/outbox/retry": true, "/console/inbox/replay": true, "/console/sagas/resume": true, "/console/refunds/finish": true}
		forms := formsOn(page)
		for form := range forms {
			if action, _, _ := strings.Cut(form, " "); !routes[action] {
				t.Errorf("a form posts to %q", action)
			}
		}
		var want []consoleButton
		for _, id := range h.failedEvents {
			want = append(want, retryButton(id))
		}
		for _, id := range h.poisonMessages {
			want = append(want, replayButton(paymentServiceConsumer, id))
		}
		for _, id := range append(h.sagas, h.sagaID) {
			want = append(want, resumeButton(id))
		}
		for _, b := range want {
			if got := forms[b.action+" "+b.fields.Encode()]; got != 1 {
				t.Errorf("%d forms %s %s on the page, want 1", got, b.action, b.fields.Encode())
			}
		}
		if len(forms) != len(want)+2 {
			t.Errorf("%d forms on the page, want the %d buttons, log out and the order form:\n%v", len(forms), len(want), forms)
		}

		webhook := replayButton(webhookConsumer, h.webhookID)
		if !strings.Contains(page, "No replay can deliver it: the card processor sent this webhook") {
			t.Fatalf("the poison webhook's row does not say why it has no button:\n%s", page)
		}
		before := repairState(t, env)
		if page := c.press(t, webhook); !strings.Contains(page, "Nothing was changed: not found: no consumer &#34;processor-webhooks&#34; reads from the broker") {
			t.Fatalf("a forged replay of the webhook:\n%s", page)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure a form whose id field is missing, repeated or not
	// path-escaped is refused with 400 and changes nothing.
	t.Run("RefusesFormsWithoutTheirIDs", func(t *testing.T) {
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		s := setAsideOneOfEach(t, env)
		c := newConsoleClient(ts)
		c.login(t, testAdminKey, "")
		token := csrfTokenOn(t, c.page(t, "/console", http.StatusOK))
		before := repairState(t, env)
		for what, b := range map[string]consoleButton{
			"no event_id":      {"/console/outbox/retry", url.Values{}},
			"two event_ids":    {"/console/outbox/retry", url.Values{"event_id": {s.failedEventID, s.failedEventID}}},
			"a bad escape":     {"/console/outbox/retry", url.Values{"event_id": {"evt%zz"}}},
			"an empty saga_id": {"/console/sagas/resume", url.Values{"saga_id": {""}}},
			"no consumer":      {"/console/inbox/replay", url.Values{"message_id": {s.poisonMessageID}}},
		} {
			mustProblem(t, what, c.do(t, "POST", b.action, b.form(token), nil), http.StatusBadRequest, problemValidation)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure a poison message that neither the outbox nor the broker
	// holds any more (cleanup deleted it a week after its delivery) has
	// no replay button, says why, and a replay forged for it is refused.
	t.Run("GoneMessageHasNoReplayButton", func(t *testing.T) {
		env := MustOpenApp(t)
		c := newConsoleClient(newAdminTestServer(t, env, testAdminKey))
		s := setAsideOneOfEach(t, env)
		env.drain(t)
		forgetMessage(t, env, s.poisonMessageID)
		c.login(t, testAdminKey, "")
		page := c.page(t, "/console", http.StatusOK)
		replay := replayButton(paymentServiceConsumer, s.poisonMessageID)
		if formsOn(page)[replay.action+" "+replay.fields.Encode()] != 0 || !strings.Contains(page, "neither the outbox nor the broker holds the message any more") {
			t.Fatalf("the gone message's row:\n%s", page)
		}
		before := repairState(t, env)
		if page := c.press(t, replay); !strings.Contains(page, "Nothing was changed: refused: message "+s.poisonMessageID+" is in neither the outbox nor the broker") {
			t.Fatalf("a forged replay of the gone message:\n%s", page)
		}
		mustBeUnchanged(t, env, before)
	})

	// Ensure the order form shows the order's timeline as trace prints it,
	// drawn (the SVG inline, as trace --svg draws it), as text and as
	// Mermaid source, escaped; an unknown order is a 404 page saying so.
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
		var drawing bytes.Buffer
		if err := printSVG(&drawing, tr); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(page, `<figure id="journey">`+drawing.String()+`</figure>`) {
			t.Fatalf("page does not show the drawing inline\n%s\npage:\n%s", drawing.String(), page)
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
		mustProblem(t, "GET retry", c.do(t, "GET", "/console/outbox/retry", nil, nil), http.StatusMethodNotAllowed, problemMethodNotAllowed)
		mustProblem(t, "DELETE console", c.do(t, "DELETE", "/console", nil, nil), http.StatusMethodNotAllowed, problemMethodNotAllowed)
		mustProblem(t, "unknown path", c.do(t, "GET", "/console/nope", nil, nil), http.StatusNotFound, problemNotFound)
	})
}

// Ensure every console route docs/console.md's "The console" section names is
// routed, every button it names in bold is a button of the page, and
// every command it compares a button to exists.
func TestDocsConsoleSection(t *testing.T) {
	readme, err := os.ReadFile("docs/console.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## The console\n")
	if !ok {
		t.Fatal("docs/console.md has no section \"The console\"")
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
			t.Errorf("docs/console.md lists %s %s, which is not routed: %d %s", route[1], route[2], r.Status, r.Body)
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
			t.Errorf("docs/console.md names the button %q, which the page does not have", bold[1])
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
			t.Errorf("docs/console.md names retrysafe %s, which is no command (%v)", m[1], err)
			continue
		}
		for _, flag := range strings.Fields(m[2]) {
			if cmd.Flags().Lookup(strings.TrimPrefix(flag, "--")) == nil {
				t.Errorf("docs/console.md gives %s the flag %s, which it does not have", cmd.CommandPath(), flag)
			}
		}
	}
	if commands < 7 {
		t.Fatalf("found %d commands in the section, want serve, the four repairs, trace and check", commands)
	}
}
