// The console: the repairs of repair.go as a page an operator opens in a
// browser on `serve`, beside what needs them. Without it an operator pieces
// the backlog together from /admin's JSON and `check`, and presses nothing:
// each repair is a curl with the admin key pasted into a shell history.
// The page shows the outbox backlog and its lag, the failed events, the
// poison messages, the sagas in compensation_failed and the abandoned
// refunds, each with its repair button, and one order's timeline (trace.go).
//
// Log in and CSRF, as chosen here:
//   - A browser cannot send the admin API's Bearer header from a link, so
//     the login is a form that POSTs the admin key once. The answer is a
//     session cookie, HttpOnly (no script reads it) and SameSite=Strict (no
//     other site's page makes the browser send it), holding a random nonce,
//     the login time and the operator's name, signed with an HMAC keyed by
//     RETRYSAFE_ADMIN_KEY. Nothing is stored on the server: a session ends
//     after consoleSessionLifetime by the App's clock, or for every browser
//     at once when the admin key changes. The key itself never leaves the
//     login request. Wrong keys slow their address down (throttle.go).
//   - Every button is a POST form carrying a token derived from the
//     session's nonce with the same HMAC: a request without the session's
//     token is refused, whoever made the browser send it. SameSite=Strict
//     already keeps the cookie off a cross-site POST, and net/http's
//     CrossOriginProtection refuses a POST whose Sec-Fetch-Site or Origin
//     says it came from another site (the login form too, so no other site
//     can log a browser in); the token is what is left when an older
//     browser sends neither header.
//   - The page cannot be framed (X-Frame-Options, frame-ancestors), so no
//     other site can lay it under a decoy and have the operator press
//     "retry" unknowingly; it loads nothing from elsewhere (its CSP allows
//     no script and no outside source at all).
//
// After a button the answer is a redirect back to /console (Post/Redirect/
// Get), with what the repair did and the audit after it in a short-lived
// signed cookie, so that reloading the page shows the message without
// repeating the repair.

package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	_ "embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

//go:embed console.html
var consoleHTML string

// consoleTemplate renders the console and its login form. html/template
// escapes every value, so an error text or a message id from the database
// cannot become markup. consoleIDField is the value of a button's hidden
// id field (see consoleRoutes).
var consoleTemplate = template.Must(template.New("console").Funcs(template.FuncMap{
	"consoleIDField": url.PathEscape,
}).Parse(consoleHTML))

// errConsoleForm: a console POST lacks an id field of its button, or has
// one twice, or one its button did not escape. It did not come from the
// page; the answer is 400 and nothing is changed.
var errConsoleForm = errors.New("not a form of the console's buttons")

// consoleFormID returns the id that the form's field name carries,
// path-escaped by the page (consoleIDField). Returns errConsoleForm if the
// field is missing, repeated, empty or not path-escaped.
func consoleFormID(form url.Values, name string) (string, error) {
	values := form[name]
	if len(values) != 1 {
		return "", fmt.Errorf("%w: want one field %s, got %d", errConsoleForm, name, len(values))
	}
	id, err := url.PathUnescape(values[0])
	if err != nil || id == "" {
		return "", fmt.Errorf("%w: field %s is not a path-escaped id", errConsoleForm, name)
	}
	return id, nil
}

// Cookies of the console. Both are scoped to /console: the API never sees
// them.
const (
	consoleSessionCookie = "retrysafe_console"
	consoleFlashCookie   = "retrysafe_console_flash"
)

// consoleSessionLifetime is how long a login lasts. A session cookie cannot
// be revoked one by one (nothing is stored), so a stolen one works this
// long; changing RETRYSAFE_ADMIN_KEY ends every session at once.
const consoleSessionLifetime = 12 * time.Hour

// consoleFlashLimit bounds the message a repair leaves in its cookie: a
// browser keeps at most about 4 KiB per cookie. `refund finish` over many
// keys is cut, and says where to read the rest.
const consoleFlashLimit = 2500

// consoleOperatorPrefix starts the operator that repair_log records for a
// repair made from the console: "console", or "console (NAME)".
const consoleOperatorPrefix = "console"

// consoleRoutes adds /console to mux (see the file comment for the log in
// and CSRF protection).
//
// A button's form posts to a fixed path per kind of repair, and carries
// the row's ids in hidden fields, path-escaped (consoleIDField): ids come
// from outside (a webhook's event id, a NATS Nats-Msg-Id), and an id in
// the form's action could change where the form posts. A browser resolves
// an action before sending it: "../../sagas/S/resume?" under
// /console/inbox/C/ is /console/sagas/S/resume, with this session's CSRF
// token; an id with "/", "?" or "#" names no route. Escaping the id in the
// action is not enough: url.PathEscape keeps "." and "..", and browsers
// resolve "%2e%2e" as ".." too (WHATWG URL). In a field, no id can touch
// the path, and escaped, every id comes back byte for byte (the HTML
// parser and form encoding would otherwise turn a line break into CR LF).
func (s *server) consoleRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /console", s.consoleEnabled(s.handleConsole))
	mux.HandleFunc("GET /console/login", s.consoleEnabled(s.handleConsoleLoginForm))
	mux.HandleFunc("POST /console/login", s.consoleEnabled(s.handleConsoleLogin))
	mux.HandleFunc("POST /console/logout", s.consoleEnabled(s.handleConsoleLogout))
	mux.HandleFunc("POST /console/outbox/retry", s.consoleAction(func(ctx context.Context, form url.Values, operator string) ([]repairResult, error) {
		eventID, err := consoleFormID(form, "event_id")
		if err != nil {
			return nil, err
		}
		return s.app.retryOutboxEvents(ctx, operator, outboxRetryTarget{EventID: eventID})
	}))
	mux.HandleFunc("POST /console/inbox/replay", s.consoleAction(func(ctx context.Context, form url.Values, operator string) ([]repairResult, error) {
		consumer, err := consoleFormID(form, "consumer")
		if err != nil {
			return nil, err
		}
		messageID, err := consoleFormID(form, "message_id")
		if err != nil {
			return nil, err
		}
		return s.app.replayInboxMessages(ctx, operator, inboxReplayTarget{Consumer: consumer, MessageID: messageID})
	}))
	mux.HandleFunc("POST /console/sagas/resume", s.consoleAction(func(ctx context.Context, form url.Values, operator string) ([]repairResult, error) {
		sagaID, err := consoleFormID(form, "saga_id")
		if err != nil {
			return nil, err
		}
		result, err := s.app.resumeSaga(ctx, operator, sagaID)
		if err != nil {
			return nil, err
		}
		return []repairResult{result}, nil
	}))
	mux.HandleFunc("POST /console/refunds/finish", s.consoleAction(func(ctx context.Context, form url.Values, operator string) ([]repairResult, error) {
		return s.app.finishRefunds(ctx, operator)
	}))
	allowed := map[string]string{
		"/console":                "GET",
		"/console/login":          "GET, POST",
		"/console/logout":         "POST",
		"/console/outbox/retry":   "POST",
		"/console/inbox/replay":   "POST",
		"/console/sagas/resume":   "POST",
		"/console/refunds/finish": "POST",
	}
	for path, methods := range allowed {
		mux.HandleFunc(path, s.consoleEnabled(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", methods)
			writeProblem(w, problem{Type: problemMethodNotAllowed, Title: "Method not allowed", Status: http.StatusMethodNotAllowed,
				Detail: fmt.Sprintf("%s does not accept %s", r.URL.Path, r.Method)})
		}))
	}
	mux.HandleFunc("/console/", s.consoleEnabled(func(w http.ResponseWriter, r *http.Request) {
		writeProblem(w, problem{Type: problemNotFound, Title: "Not found", Status: http.StatusNotFound,
			Detail: fmt.Sprintf("no console route for %s %s", r.Method, r.URL.Path)})
	}))
}

// consoleEnabled answers as /admin does while RETRYSAFE_ADMIN_KEY is unset
// (404 admin-disabled, saying how to enable the console), and otherwise
// passes the request to next with the headers every console answer
// carries.
func (s *server) consoleEnabled(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.adminKey == "" {
			writeProblem(w, problem{Type: problemAdminDisabled, Title: "The console is off", Status: http.StatusNotFound,
				Detail: "start serve with RETRYSAFE_ADMIN_KEY set, open /console and log in with that key"})
			return
		}
		h := w.Header()
		// The page shows what the database holds now, and the admin's
		// token: no cache keeps either.
		h.Set("Cache-Control", "no-store")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("X-Content-Type-Options", "nosniff")
		next(w, r)
	}
}

// consoleSession is what the session cookie holds, signed.
type consoleSession struct {
	Nonce    string `json:"n"`
	IssuedAt string `json:"t"`
	Operator string `json:"o,omitempty"`
}

// consoleMAC signs msg for purpose ("session", "csrf", "flash") with a key
// derived from the admin key, so that a value signed for one purpose is
// never accepted for another.
func (s *server) consoleMAC(purpose, msg string) []byte {
	derive := hmac.New(sha256.New, []byte(s.adminKey))
	derive.Write([]byte("retrysafe console"))
	mac := hmac.New(sha256.New, derive.Sum(nil))
	mac.Write([]byte(purpose + "\x00" + msg))
	return mac.Sum(nil)
}

// signedValue encodes v as a cookie value: its JSON, then its MAC for
// purpose, both base64url.
func (s *server) signedValue(purpose string, v any) string {
	body, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("bug: encode %s cookie: %v", purpose, err))
	}
	payload := base64.RawURLEncoding.EncodeToString(body)
	return payload + "." + base64.RawURLEncoding.EncodeToString(s.consoleMAC(purpose, payload))
}

// openSignedValue decodes a value signedValue made for purpose into v.
// Returns false for anything else: no value, a forged or altered one, one
// signed for another purpose or under another admin key.
func (s *server) openSignedValue(purpose, value string, v any) bool {
	payload, sig, ok := strings.Cut(value, ".")
	if !ok {
		return false
	}
	got, err := base64.RawURLEncoding.DecodeString(sig)
	if err != nil || !hmac.Equal(got, s.consoleMAC(purpose, payload)) {
		return false
	}
	body, err := base64.RawURLEncoding.DecodeString(payload)
	if err != nil {
		return false
	}
	return json.Unmarshal(body, v) == nil
}

// consoleSessionOf returns the request's session, if it has a valid one
// that has not expired.
func (s *server) consoleSessionOf(r *http.Request) (consoleSession, bool) {
	cookie, err := r.Cookie(consoleSessionCookie)
	if err != nil {
		return consoleSession{}, false
	}
	var session consoleSession
	if !s.openSignedValue("session", cookie.Value, &session) || session.Nonce == "" {
		return consoleSession{}, false
	}
	issued, err := time.Parse(timeFormat, session.IssuedAt)
	if err != nil || s.app.now().Sub(issued) > consoleSessionLifetime {
		return consoleSession{}, false
	}
	return session, true
}

// csrfToken is the token every form of session carries.
func (s *server) csrfToken(session consoleSession) string {
	return hex.EncodeToString(s.consoleMAC("csrf", session.Nonce))
}

// operatorOf is what repair_log records for a repair from session.
func operatorOf(session consoleSession) string {
	if session.Operator == "" {
		return consoleOperatorPrefix
	}
	return consoleOperatorPrefix + " (" + session.Operator + ")"
}

// setConsoleCookie sets a cookie of the console: HttpOnly, SameSite=Strict,
// for /console only, Secure when the request came over TLS. maxAge 0 makes
// a cookie the browser drops when it closes; below 0 deletes it.
func setConsoleCookie(w http.ResponseWriter, r *http.Request, name, value string, maxAge int) {
	http.SetCookie(w, &http.Cookie{
		Name:     name,
		Value:    value,
		Path:     "/console",
		MaxAge:   maxAge,
		HttpOnly: true,
		Secure:   r.TLS != nil,
		SameSite: http.SameSiteStrictMode,
	})
}

// refuseCrossSite answers 403 and returns true if r is a POST that a page
// of another site made the browser send (its Sec-Fetch-Site or Origin
// header says so).
func refuseCrossSite(w http.ResponseWriter, r *http.Request) bool {
	if err := http.NewCrossOriginProtection().Check(r); err != nil {
		writeProblem(w, problem{Type: problemForbidden, Title: "Forbidden", Status: http.StatusForbidden,
			Detail: "a page of another site sent this request; the console answers only its own forms"})
		return true
	}
	return false
}

// loginPage is what the login form shows.
type loginPage struct {
	Login   bool
	Message string
}

// handleConsoleLoginForm is GET /console/login.
func (s *server) handleConsoleLoginForm(w http.ResponseWriter, r *http.Request) {
	s.renderConsole(w, r, http.StatusOK, loginPage{Login: true})
}

// handleConsoleLogin is POST /console/login: with the admin key, a new
// session and a redirect to the console; with anything else, 403 and the
// form again, saying so; from an address that sent too many wrong keys,
// 429 with Retry-After and the form, whatever the key (throttle.go).
func (s *server) handleConsoleLogin(w http.ResponseWriter, r *http.Request) {
	if refuseCrossSite(w, r) {
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBodyBytes)
	if err := r.ParseForm(); err != nil {
		writeProblem(w, problem{Type: problemValidation, Title: "Invalid form", Status: http.StatusBadRequest, Detail: "the login form could not be read: " + err.Error()})
		return
	}
	right, retryAfter := false, 0
	if key := r.PostForm.Get("key"); key != "" {
		right, retryAfter = s.checkAdminKey(r, key)
	}
	if retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
		s.renderConsole(w, r, http.StatusTooManyRequests, loginPage{Login: true, Message: fmt.Sprintf(
			"Too many wrong keys came from your address (%s): no key from it is checked for %d seconds, the right one neither. Wait, or log in from another address.",
			guessAddress(r), retryAfter)})
		return
	}
	if !right {
		s.renderConsole(w, r, http.StatusForbidden, loginPage{Login: true, Message: "That is not the admin key (RETRYSAFE_ADMIN_KEY). Customers' API keys do not open the console."})
		return
	}
	operator := strings.TrimSpace(r.PostForm.Get("operator"))
	if len(operator) > 64 || strings.IndexFunc(operator, func(c rune) bool { return c < 0x20 || c > 0x7e }) >= 0 {
		s.renderConsole(w, r, http.StatusBadRequest, loginPage{Login: true, Message: "Your name, for repair_log, must be at most 64 printable ASCII characters."})
		return
	}
	var nonce [16]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		panic(fmt.Sprintf("bug: no randomness for a session: %v", err))
	}
	session := consoleSession{Nonce: hex.EncodeToString(nonce[:]), IssuedAt: formatTime(s.app.now()), Operator: operator}
	setConsoleCookie(w, r, consoleSessionCookie, s.signedValue("session", session), 0)
	http.Redirect(w, r, "/console", http.StatusSeeOther)
}

// handleConsoleLogout is POST /console/logout: the cookie is deleted from
// this browser. (A copy of it elsewhere stays valid until it expires; see
// consoleSessionLifetime.) It takes the session's token like every other
// form: without it, any page that could make the browser POST here could
// log the operator out, in the middle of a repair.
func (s *server) handleConsoleLogout(w http.ResponseWriter, r *http.Request) {
	if _, ok := s.consoleForm(w, r); !ok {
		return
	}
	setConsoleCookie(w, r, consoleSessionCookie, "", -1)
	http.Redirect(w, r, "/console/login", http.StatusSeeOther)
}

// consoleFlash is the message a repair leaves for the page it redirects
// to.
type consoleFlash struct {
	OK    bool     `json:"ok"`
	Lines []string `json:"lines"`
}

// consoleRepair is a repair as a button runs it, on the button's form,
// with the operator the session names.
type consoleRepair func(ctx context.Context, form url.Values, operator string) ([]repairResult, error)

// consoleForm reads a POST of one of the console's own forms and returns
// its session. A request without a session is sent to the login form; one
// from another site, or without the session's CSRF token, is refused with
// 403; a form that cannot be read, with 400. It returns false when it has
// answered.
func (s *server) consoleForm(w http.ResponseWriter, r *http.Request) (consoleSession, bool) {
	if refuseCrossSite(w, r) {
		return consoleSession{}, false
	}
	session, ok := s.consoleSessionOf(r)
	if !ok {
		http.Redirect(w, r, "/console/login", http.StatusSeeOther)
		return consoleSession{}, false
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBodyBytes)
	if err := r.ParseForm(); err != nil {
		writeProblem(w, problem{Type: problemValidation, Title: "Invalid form", Status: http.StatusBadRequest, Detail: "the form could not be read: " + err.Error()})
		return consoleSession{}, false
	}
	token, err := hex.DecodeString(r.PostForm.Get("csrf"))
	if err != nil || !hmac.Equal(token, s.consoleMAC("csrf", session.Nonce)) {
		writeProblem(w, problem{Type: problemForbidden, Title: "Forbidden", Status: http.StatusForbidden,
			Detail: "the form lacks this session's token; reload /console and press the button there"})
		return consoleSession{}, false
	}
	return session, true
}

// consoleAction runs repair for a POST of the console's own forms
// (consoleForm), then redirects back to /console with what it did.
func (s *server) consoleAction(repair consoleRepair) http.HandlerFunc {
	return s.consoleEnabled(func(w http.ResponseWriter, r *http.Request) {
		session, ok := s.consoleForm(w, r)
		if !ok {
			return
		}
		results, err := repair(r.Context(), r.PostForm, operatorOf(session))
		if errors.Is(err, errConsoleForm) {
			writeProblem(w, problem{Type: problemValidation, Title: "Invalid form", Status: http.StatusBadRequest,
				Detail: err.Error() + "; reload /console and press the button there"})
			return
		}
		flash := s.consoleOutcome(r.Context(), results, err)
		setConsoleCookie(w, r, consoleFlashCookie, s.signedValue("flash", flash), 60)
		http.Redirect(w, r, "/console", http.StatusSeeOther)
	})
}

// consoleOutcome says what a repair did, as the command prints it: a line
// per row repaired, then the audit of `retrysafe check --in-flight`; or why
// nothing was changed.
func (s *server) consoleOutcome(ctx context.Context, results []repairResult, err error) consoleFlash {
	var flash consoleFlash
	for _, result := range results {
		flash.Lines = append(flash.Lines, result.Target+": "+result.Result)
	}
	switch {
	case err == nil:
	case errors.Is(err, errRepairNotFound), errors.Is(err, errRepairRefused):
		flash.Lines = append(flash.Lines, "Nothing was changed: "+err.Error())
		return flash
	case isBusy(err), isDatabaseUnavailable(err):
		flash.Lines = append(flash.Lines, "Nothing was changed: the database was busy or unavailable; press the button again")
		return flash
	default:
		s.logger.Error("console repair failed", "error", err)
		flash.Lines = append(flash.Lines, "Failed: "+err.Error())
		return flash
	}
	if len(results) == 0 {
		flash.Lines = append(flash.Lines, "Nothing to repair.")
	}
	failed := 0
	for _, result := range results {
		if result.Failed {
			failed++
		}
	}
	audit := s.app.answerAudit(ctx)
	switch {
	case audit.Unfinished != "":
		flash.Lines = append(flash.Lines, audit.Unfinished)
	case audit.OK:
		flash.OK = failed == 0
		flash.Lines = append(flash.Lines, "check --in-flight: ok")
	default:
		for _, v := range audit.Violations {
			flash.Lines = append(flash.Lines, "check --in-flight: VIOLATION "+v.Invariant+": "+v.Detail)
		}
	}
	size := 0
	for i, line := range flash.Lines {
		size += len(line)
		if size > consoleFlashLimit {
			flash.Lines = append(flash.Lines[:i], fmt.Sprintf("... and %d lines more: see repair_log below", len(flash.Lines)-i))
			break
		}
	}
	return flash
}

// consolePage is what the console shows.
type consolePage struct {
	Login    bool
	Flash    *consoleFlash
	Operator string
	CSRF     string
	Now      string
	// Backlog counts the pending outbox events; Lag is the age of the
	// oldest, "" when there is none.
	Backlog int
	Lag     string
	Failed  []outboxListing
	Poison  []consolePoison
	Sagas   []sagaListing
	Refunds []unfinishedRefund
	Repairs []repairLogRow
	// Order is the order looked up; OrderError says why it has no
	// timeline.
	Order      string
	OrderError string
	Timeline   string
	Mermaid    string
	// Drawing is the timeline as trace --svg draws it, shown inline.
	// printSVG escapes every text it takes from the tables, so the
	// template may insert it as it is.
	Drawing template.HTML
}

// consolePoison is a poison message as the console lists it: with a
// replay button, or with why no replay can work.
type consolePoison struct {
	inboxListing
	// NoReplay, if set, says why replayInboxMessages refuses this message
	// whatever the operator does, and what to do instead. The row has no
	// button then: a button that is always refused only teaches operators
	// to ignore refusals.
	NoReplay string
}

// noReplayReason returns why no replay can deliver a poison message of
// consumer again, or "" if one can. byBroker says whether consumer reads
// from the broker; stored, whether the outbox or the embedded broker
// still holds the message (replaySource). These are the refusals of
// replayInboxMessages that no later state of the row can lift.
func noReplayReason(consumer string, byBroker, stored bool) string {
	switch {
	case consumer == webhookConsumer:
		return "No replay can deliver it: the card processor sent this webhook, got 200, and sends an event again only after an error. " +
			"Check it against the processor's own record of the charge and refund; the error says what did not match."
	case !byBroker:
		return "No replay can deliver it: " + consumer + " does not read from the broker."
	case !stored:
		return "No replay can deliver it: neither the outbox nor the broker holds the message any more " +
			"(cleanup deletes delivered messages after a week; a message our relay did not publish was never there)."
	}
	return ""
}

// repairLogRow is one repair_log row, as the console lists the latest.
type repairLogRow struct {
	RepairID, Operator, Action, Target, Result, CreatedAt string
}

// consoleRecentRepairs is how many repair_log rows the console shows.
const consoleRecentRepairs = 10

// handleConsole is GET /console: the console for a session, the login
// form otherwise. ?order=ID adds that order's timeline; an order that does
// not exist is a 404 page saying so.
func (s *server) handleConsole(w http.ResponseWriter, r *http.Request) {
	session, ok := s.consoleSessionOf(r)
	if !ok {
		http.Redirect(w, r, "/console/login", http.StatusSeeOther)
		return
	}
	ctx := r.Context()
	now := s.app.now()
	page := consolePage{Operator: operatorOf(session), CSRF: s.csrfToken(session), Now: formatTime(now)}
	if cookie, err := r.Cookie(consoleFlashCookie); err == nil {
		var flash consoleFlash
		if s.openSignedValue("flash", cookie.Value, &flash) {
			page.Flash = &flash
		}
		setConsoleCookie(w, r, consoleFlashCookie, "", -1)
	}
	if err := s.readConsole(ctx, now, &page); err != nil {
		s.logger.Error("console failed", "error", err)
		writeProblem(w, problem{Type: problemInternal, Title: "Internal error", Status: http.StatusInternalServerError, Detail: err.Error()})
		return
	}
	status := http.StatusOK
	page.Order = strings.TrimSpace(r.URL.Query().Get("order"))
	if page.Order != "" {
		var err error
		page.Timeline, page.Mermaid, page.Drawing, err = consoleTimeline(ctx, s.app.readDB, page.Order)
		switch {
		case errors.Is(err, errNoSuchOrder):
			status = http.StatusNotFound
			page.OrderError = "There is no order " + page.Order + "."
		case err != nil:
			s.logger.Error("console timeline failed", "order_id", page.Order, "error", err)
			status = http.StatusInternalServerError
			page.OrderError = "The timeline could not be read: " + err.Error()
		}
	}
	s.renderConsole(w, r, status, page)
}

// consoleTimeline returns the order's timeline as `retrysafe trace` prints
// it: as text, as Mermaid source, and drawn as an SVG (which the page shows
// inline: no script renders it, so the console's Content-Security-Policy
// needs nothing more). Returns errNoSuchOrder for an order that does not
// exist.
func consoleTimeline(ctx context.Context, db *sql.DB, orderID string) (string, string, template.HTML, error) {
	t, err := traceOrder(ctx, db, orderID)
	if err != nil {
		return "", "", "", err
	}
	var text, mermaid, drawing bytes.Buffer
	if err := printTrace(&text, t); err != nil {
		return "", "", "", err
	}
	if err := printMermaid(&mermaid, t); err != nil {
		return "", "", "", err
	}
	if err := printSVG(&drawing, t); err != nil {
		return "", "", "", err
	}
	// printSVG escapes every text from the tables (TestTraceSVG).
	return text.String(), mermaid.String(), template.HTML(drawing.String()), nil
}

// readConsole fills page with what needs an operator, read from the
// read-only pool: the page never waits for the write lock.
func (s *server) readConsole(ctx context.Context, now time.Time, page *consolePage) error {
	db := s.app.readDB
	var oldest string
	// Pending includes the events held back behind a failed one of
	// their order: they are the backlog too. The oldest is the first
	// written, as /metrics reads it (scrapeOutboxOldestPending).
	err := db.QueryRowContext(ctx, `
		SELECT COUNT(*), COALESCE((SELECT created_at FROM outbox_events
			WHERE status = 'pending' ORDER BY seq LIMIT 1), '')
		FROM outbox_events WHERE status = 'pending'`).Scan(&page.Backlog, &oldest)
	if err != nil {
		return fmt.Errorf("read outbox backlog: %w", err)
	}
	if oldest != "" {
		created, err := time.Parse(timeFormat, oldest)
		if err != nil {
			return fmt.Errorf("read outbox backlog: %w", err)
		}
		page.Lag = now.Sub(created).Round(time.Second).String()
	}

	rows, err := db.QueryContext(ctx, `
		SELECT e.event_id, e.event_type, e.aggregate_id, e.status, e.attempts, COALESCE(e.last_error, ''), e.created_at,
		       (SELECT COUNT(*) FROM outbox_events later
		        WHERE later.aggregate_id = e.aggregate_id AND later.seq > e.seq AND later.status <> 'published')
		FROM outbox_events e WHERE e.status = 'failed' ORDER BY e.seq LIMIT ?`, listLimit)
	if err != nil {
		return fmt.Errorf("read failed outbox events: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var e outboxListing
		if err := rows.Scan(&e.EventID, &e.EventType, &e.OrderID, &e.Status, &e.Attempts, &e.LastError, &e.CreatedAt, &e.HeldBack); err != nil {
			return fmt.Errorf("scan outbox event: %w", err)
		}
		page.Failed = append(page.Failed, e)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read failed outbox events: %w", err)
	}
	rows.Close()

	brokerConsumers := map[string]bool{}
	for _, c := range s.app.consumers() {
		brokerConsumers[c.name] = true
	}
	// stored: whether the outbox or the embedded broker still holds the
	// message's payload, which a replay delivers again (replaySource).
	rows, err = db.QueryContext(ctx, `
		SELECT m.consumer, m.message_id, m.status, COALESCE(m.error, ''), m.delivery_count, m.processed_at,
		       CASE WHEN EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = m.message_id)
		              OR EXISTS (SELECT 1 FROM broker_messages b WHERE b.message_id = m.message_id)
		            THEN 1 ELSE 0 END
		FROM inbox_messages m WHERE m.status = 'poison' ORDER BY m.processed_at, m.consumer LIMIT ?`, listLimit)
	if err != nil {
		return fmt.Errorf("read poison messages: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var m inboxListing
		var stored int
		if err := rows.Scan(&m.Consumer, &m.MessageID, &m.Status, &m.Error, &m.DeliveryCount, &m.ProcessedAt, &stored); err != nil {
			return fmt.Errorf("scan poison message: %w", err)
		}
		page.Poison = append(page.Poison, consolePoison{inboxListing: m, NoReplay: noReplayReason(m.Consumer, brokerConsumers[m.Consumer], stored == 1)})
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read poison messages: %w", err)
	}
	rows.Close()

	if page.Sagas, err = listSagas(ctx, db, sagaCompensationFailed); err != nil {
		return err
	}
	if page.Refunds, err = listUnfinishedRefunds(ctx, db, now, s.app.leases.refundLock); err != nil {
		return err
	}

	rows, err = db.QueryContext(ctx, `
		SELECT repair_id, operator, action, target, result, created_at
		FROM repair_log ORDER BY created_at DESC, repair_id DESC LIMIT ?`, consoleRecentRepairs)
	if err != nil {
		return fmt.Errorf("read repair_log: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var l repairLogRow
		if err := rows.Scan(&l.RepairID, &l.Operator, &l.Action, &l.Target, &l.Result, &l.CreatedAt); err != nil {
			return fmt.Errorf("scan repair_log: %w", err)
		}
		page.Repairs = append(page.Repairs, l)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read repair_log: %w", err)
	}
	return nil
}

// renderConsole writes page (a consolePage or a loginPage) as HTML with
// status. It renders into a buffer first, so that a template error is a
// 500, not half a page.
func (s *server) renderConsole(w http.ResponseWriter, r *http.Request, status int, page any) {
	var buf bytes.Buffer
	if err := consoleTemplate.Execute(&buf, page); err != nil {
		s.logger.Error("console template failed", "path", r.URL.Path, "error", err)
		writeProblem(w, problem{Type: problemInternal, Title: "Internal error", Status: http.StatusInternalServerError})
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	w.Write(buf.Bytes())
}
