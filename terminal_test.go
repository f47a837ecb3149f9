package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
)

// Hostile strings, as outside systems may send them. Each fools a terminal
// another way when printed raw; the text after a newline is a line a
// reader would believe.
const (
	// Erases the line it is printed on (the VIOLATION about it) and
	// writes another in its place.
	hostileErase = "evt_erase\x1b[2K\rok: all 22 invariants hold"
	// Retitles the terminal window.
	hostileTitle = "evt_title\x1b]0;retitled\x07"
	// Starts a line of its own.
	hostileNewline = "evt_newline\nok: all 99 invariants hold"
	// Displays as another string: a right-to-left override and isolates.
	hostileBidi = "evt_bidi\u202etxt.exe\u202c\u2066\u2069"
	// A C1 CSI (one rune does what ESC [ does), DEL and a tab.
	hostileC1 = "evt_c1\u009b2K\x7f\tend"
	// A signed webhook's charge id, which its poison reason quotes.
	hostileCharge = "ch_\x1b[31mred\nVIOLATION forged: none"
	// A message id from another publisher on the broker (on NATS, any
	// Nats-Msg-Id): an OSC 8 hyperlink.
	hostileMessageID = "evt_link\x1b]8;;https://example.invalid\x1b\\click\x1b]8;;\x1b\\"
	// The order id in that message's payload, which its poison reason
	// and the replay's result quote.
	hostileOrderID = "ord_\x1b[8mhidden\x1b[0m"
	// A broker's error text, kept as the failed event's last_error.
	hostileBrokerError = "broker says \x1b[2K\r\nok: all 99 invariants hold"
	// A processor's error text, kept as the saga's last_error.
	hostileProcessorError = "peer reset \x1b]0;owned\x07\u202e"
	// A user name from RETRYSAFE_API_KEYS, as serve accepted it before it
	// required printable ASCII (a database may still hold one).
	hostileUser = "user\x1b[31m-42\u202e"
	// An operator name, as --operator takes it.
	hostileOperator = "ops\x1b[2K\rroot"
	// An order id in a request's path (percent-encoded on the wire),
	// which the key of the request stores.
	hostilePathID = "ord_\x1b[2K\r\nVIOLATION forged: path"
	// One whose bytes are not UTF-8, stored on SQLite (the API refuses
	// such an id now; PostgreSQL never stored one).
	hostileBytesPathID = "ord_\xff\x9b2K"
)

// forgedLines start the lines that the hostile strings would forge.
var forgedLines = []string{"ok: all 99", "VIOLATION forged"}

// rawControl returns the first rune of out that a terminal acts on rather
// than shows (newlines apart), quoted with what surrounds it, or "".
func rawControl(out string) string {
	for i, r := range out {
		bad := false
		switch {
		case r == utf8.RuneError:
			_, size := utf8.DecodeRuneInString(out[i:])
			bad = size <= 1
		case r == '\n':
		case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f:
			bad = true // C0 (ESC, CR, TAB, BEL...), DEL, C1
		case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069, r == 0x200e, r == 0x200f, r == 0x061c:
			bad = true // bidi overrides, embeddings, isolates and marks
		case r == 0x2028, r == 0x2029:
			bad = true // line and paragraph separators
		}
		if bad {
			return fmt.Sprintf("%U at byte %d: %q", r, i, out[max(0, i-40):min(len(out), i+40)])
		}
	}
	return ""
}

// escaped is how the output must show s: Go-quoted, without the quotes
// (what a terminalSafe field holds around it may be quoted with it).
func escaped(s string) string {
	quoted := strconv.Quote(s)
	return quoted[1 : len(quoted)-1]
}

// mustBeTerminalSafe fails t if what printed out raw control characters,
// a forged line, or does not show each of shows escaped.
func mustBeTerminalSafe(t *testing.T, what, out string, shows ...string) {
	t.Helper()
	if bad := rawControl(out); bad != "" {
		t.Errorf("%s printed a raw control character, %s", what, bad)
	}
	for _, line := range strings.Split(out, "\n") {
		for _, forged := range forgedLines {
			if strings.HasPrefix(strings.TrimSpace(line), forged) {
				t.Errorf("%s printed a forged line %q", what, line)
			}
		}
	}
	for _, s := range shows {
		if !strings.Contains(out, escaped(s)) {
			t.Errorf("%s does not show %s escaped as %s", what, strconv.Quote(s), escaped(s))
		}
	}
}

// Ensure terminalSafe leaves an ordinary string as it is (ids, keys,
// paths and printable text in any script print as they always did) and
// Go-quotes one that holds anything a terminal would act on.
func TestTerminalSafe(t *testing.T) {
	for _, ordinary := range []string{
		"", "evt_d465e39a-9f4c-4b8e-8a3a-3c2f1d0e9b8a", "pay-req-user-42-cart-7", "/api/orders/ord_1/refund",
		"charge.refunded for unknown charge ch_1", `a "quoted" \ word`, "café ☕ 東京 שלום …", "👍",
	} {
		if got := terminalSafe(ordinary); got != ordinary {
			t.Errorf("terminalSafe(%q) = %q, want it unchanged", ordinary, got)
		}
	}
	for _, s := range []string{
		"\x1b[2K", "a\rb", "a\nb", "a\tb", "bell\a", "del\x7f", "nel\u0085", "csi\u009b2K",
		"\u202aLRE", "\u202bRLE", "\u202cPDF", "\u202dLRO", "\u202eRLO", "\u2066LRI", "\u2067RLI", "\u2068FSI", "\u2069PDI",
		"\u200eLRM", "\u200fRLM", "\u061cALM", "zero\u200bwidth", "line\u2028separator", "paragraph\u2029separator",
		"tag\U000e0041", "not utf-8 \xff", "cut \xe2\x80",
	} {
		if got, want := terminalSafe(s), strconv.Quote(s); got != want {
			t.Errorf("terminalSafe(%s) = %s, want %s", strconv.Quote(s), strconv.Quote(got), strconv.Quote(want))
		}
	}
}

// Ensure whatever terminalSafe returns is safe to print and gives the
// string back: either it is the string itself, or a Go-quoted form that
// strconv.Unquote (or bash's $'...') reads back exactly.
func FuzzTerminalSafe(f *testing.F) {
	for _, seed := range []string{"evt_1", hostileErase, hostileTitle, hostileNewline, hostileBidi, hostileC1, "\xff\xfe", "\U000e0041"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, s string) {
		shown := terminalSafe(s)
		if bad := rawControl(shown); bad != "" || strings.ContainsRune(shown, '\n') {
			t.Fatalf("terminalSafe(%q) = %q holds %s", s, shown, bad)
		}
		if shown == s {
			return
		}
		back, err := strconv.Unquote(shown)
		if err != nil || back != s {
			t.Fatalf("terminalSafe(%q) = %q, which unquotes to %q (%v)", s, shown, back, err)
		}
	})
}

// Ensure the terminalWriter under the commands' output escapes every rune
// a terminal would act on but newlines and tabs, writes a rune cut
// between two writes whole, keeps JSON decoding to the same strings, and
// lets chaos's progress bar reach the terminal itself.
func TestTerminalWriter(t *testing.T) {
	var buf bytes.Buffer
	w := newTerminalWriter(&buf)
	write := func(s string) {
		t.Helper()
		if n, err := w.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s, n, err)
		}
	}
	mustRead := func(want string) {
		t.Helper()
		if err := w.flush(); err != nil {
			t.Fatal(err)
		}
		if got := buf.String(); got != want {
			t.Errorf("got %q, want %q", got, want)
		}
		buf.Reset()
	}

	write("ok\tcafé ☕\n" + hostileErase + hostileTitle + hostileBidi + hostileC1 + "\u2028\xff\U000e0041\n")
	mustRead("ok\tcafé ☕\n" + `evt_erase\u001b[2K\u000dok: all 22 invariants hold` + `evt_title\u001b]0;retitled\u0007` +
		`evt_bidi\u202etxt.exe\u202c\u2066\u2069` + "evt_c1\\u009b2K\\u007f\tend" + `\u2028\xff\udb40\udc41` + "\n")

	// A rune cut in two by the writes, harmless or not.
	write("caf\xc3")
	write("\xa9 \xe2\x80")
	write("\xae.")
	mustRead(`café \u202e.`)
	// One that no write completes.
	write("cut \xe2\x80")
	mustRead(`cut \xe2\x80`)

	hostile := []string{hostileErase, hostileTitle, hostileNewline, hostileBidi, hostileC1, hostileMessageID, "\U000e0041 tag", "\u2028"}
	if err := json.NewEncoder(w).Encode(hostile); err != nil {
		t.Fatal(err)
	}
	if bad := rawControl(buf.String()); bad != "" {
		t.Errorf("JSON through the writer holds %s", bad)
	}
	var decoded []string
	if err := json.Unmarshal(buf.Bytes(), &decoded); err != nil || !slices.Equal(decoded, hostile) {
		t.Errorf("JSON through the writer decodes to %q (%v), want %q", decoded, err, hostile)
	}

	if under := underTerminalWriter(w); under != &buf {
		t.Errorf("underTerminalWriter returned %T, want the writer under it", under)
	}
}

// hostileDatabase is a database seeded with the hostile strings, through
// the code that stores them in production.
type hostileDatabase struct {
	env *testEnv
	// logs is what serve's logger (text format) wrote meanwhile: its
	// request lines, and the background layers' lines.
	logs bytes.Buffer
	// adminJSON is GET /admin/inbox?status=poison and
	// GET /admin/refunds, as the admin API answered.
	adminJSON                          []string
	sagaID, sagaOrderID                string
	failedOrderID, hostileUsersOrderID string
	hostileUsersKey, adminKey          string
	// hostilePath is the path of the refund request of hostilePathID.
	hostilePath string
}

// seedHostileDatabase stores every hostile string where outside data
// lands: signed webhooks with hostile ids and charge ids (poison, with
// reasons that quote them; one of an unknown type, applied), a message
// with a hostile id and payload on the broker (poison for the payment
// service), a refund request whose path holds a hostile order id, an
// order and an abandoned refund of a user with a hostile name, a failed
// outbox event whose broker error is hostile, and a compensation_failed
// saga whose processor error is hostile.
func seedHostileDatabase(t *testing.T) *hostileDatabase {
	t.Helper()
	ctx := context.Background()
	h := &hostileDatabase{env: MustOpenApp(t), hostileUsersKey: "sk_test_hostile", adminKey: "admin-key-for-the-hostile-test"}
	env := h.env
	logger := newLogger(&h.logs, logText, nil)
	env.app.log = logger
	s := &server{
		app:           env.app,
		apiKeys:       map[string]string{keyUser42: "user-42", h.hostileUsersKey: hostileUser},
		webhookSecret: []byte(testWebhookSecret),
		adminKey:      h.adminKey,
		logger:        logger,
	}
	ts := httptest.NewServer(s.routes())
	t.Cleanup(ts.Close)

	// A saga whose refund keeps failing with the processor's hostile
	// error text, until it is compensation_failed.
	failConfirm(env, func(p faultPoint, pass int) error {
		if p == faultProcessorLoseResponse && pass >= 2 {
			return errors.New(hostileProcessorError)
		}
		return nil
	})
	h.sagaOrderID = createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
	if got := sagaSteps(t, env, h.sagaOrderID); !strings.HasPrefix(got, "compensation_failed:") {
		t.Fatalf("saga: %s", got)
	}
	env.fault.failAt("", nil, 0)
	h.sagaID = env.str(t, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, h.sagaOrderID)

	// The hostile user's order, paid (a refund of it is abandoned last,
	// where no worker finishes it).
	created := call(t, ts, "POST", "/api/orders", h.hostileUsersKey, "k2", orderBody(3000, "sku-2", 1, pmCardVisa))
	if created.Status != http.StatusCreated {
		t.Fatalf("create as the hostile user: %d %s", created.Status, created.Body)
	}
	h.hostileUsersOrderID = orderField([]byte(created.Body), "order_id")
	env.drain(t)

	// Signed webhooks with hostile ids: charge.refunded events for a
	// hostile charge id are poison, with reasons that quote it; an event
	// of a type we do not use is recorded as applied.
	for _, id := range []string{hostileErase, hostileNewline, hostileBidi, hostileC1, hostileTitle} {
		eventType, data := "charge.refunded", map[string]any{"charge_id": hostileCharge, "refund_id": "re_1", "amount_cents": 100}
		if id == hostileTitle {
			eventType = "invoice.paid"
		}
		body, err := json.Marshal(map[string]any{"id": id, "type": eventType, "data": data})
		if err != nil {
			t.Fatal(err)
		}
		answer := postWebhook(t, ts, body, signWebhook([]byte(testWebhookSecret), env.clock.now(), body))
		if answer.Status != http.StatusOK {
			t.Fatalf("webhook %q: %d %s", id, answer.Status, answer.Body)
		}
	}

	// A refund of an order whose id, in the path, is hostile: its key
	// stores the path.
	h.hostilePath = "/api/orders/" + hostilePathID + "/refund"
	call(t, ts, "POST", "/api/orders/"+url.PathEscape(hostilePathID)+"/refund", keyUser42, "k-path", "{}")
	if n := env.count(t, `SELECT COUNT(*) FROM idempotency_keys WHERE request_path = ?`, h.hostilePath); n != 1 {
		t.Fatalf("the key of the hostile path was not stored (%d rows)", n)
	}
	if !onPostgres() {
		// The API refuses such a path now (TestHTTPOrderIDNotUTF8); a
		// database written before that may still hold one.
		_, err := env.app.db.Exec(`
			INSERT INTO idempotency_keys (user_id, idempotency_key, request_method, request_path, request_hash, request_params,
			                              status, recovery_point, created_at, expires_at)
			SELECT user_id, 'k-bytes', request_method, ?, request_hash, request_params, status, recovery_point, created_at, expires_at
			FROM idempotency_keys WHERE idempotency_key = 'k-path'`, "/api/orders/"+hostileBytesPathID+"/refund")
		if err != nil {
			t.Fatalf("store a key whose path is not UTF-8: %v", err)
		}
	}

	// A message another publisher put on the broker, with a hostile id
	// and a hostile order id: the payment service makes it poison.
	payload, err := json.Marshal(map[string]string{"order_id": hostileOrderID})
	if err != nil {
		t.Fatal(err)
	}
	if err := env.app.broker.publishBatch(ctx, []message{{ID: hostileMessageID, Subject: eventOrderCreated, Payload: payload}}); err != nil {
		t.Fatal(err)
	}
	env.drain(t)
	if n := env.count(t, `SELECT COUNT(*) FROM inbox_messages WHERE message_id = ? AND status = 'poison'`, hostileMessageID); n != 1 {
		t.Fatalf("the hostile message is not poison (%d rows)", n)
	}

	// An order whose OrderCreated the broker refuses with a hostile
	// error text until the relay marks it failed.
	h.failedOrderID = orderField(mustCreateOrder(t, env, "user-42", "k3", orderBody(5000, "sku-2", 1, pmCardVisa)).Body, "order_id")
	env.fault.failAt(faultPublish, errors.New(hostileBrokerError), maxPublishAttempts)
	for range maxPublishAttempts {
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatalf("relay: %v", err)
		}
		env.clock.advance(6 * time.Minute)
	}
	env.fault.failAt("", nil, 0)
	if n := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE aggregate_id = ? AND status = 'failed'`, h.failedOrderID); n != 1 {
		t.Fatalf("the event of %s did not fail (%d failed)", h.failedOrderID, n)
	}

	// A refund of the hostile user's order, abandoned after its first
	// phase.
	env.fault.crashAt(faultRefundStarted)
	req, refund := refundRequestFor(t, h.hostileUsersOrderID, "refund-1", "")
	req.UserID = hostileUser
	if _, err := env.app.refundOrder(ctx, req, h.hostileUsersOrderID, refund); !errors.Is(err, errCrash) {
		t.Fatalf("got %v, want the crash", err)
	}
	env.fault.failAt("", nil, 0)

	for _, path := range []string{"/admin/inbox?status=poison", "/admin/refunds"} {
		answer := adminCall(t, ts, "GET", path, h.adminKey, "")
		if answer.Status != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, answer.Status, answer.Body)
		}
		h.adminJSON = append(h.adminJSON, answer.Body)
	}
	return h
}

// onSQLiteOnly returns shows, or nothing on PostgreSQL, which refuses
// strings that are not UTF-8.
func onSQLiteOnly(shows ...string) []string {
	if onPostgres() {
		return nil
	}
	return shows
}

// commandPaths returns the path of every command of the tree under cmd
// that runs (not the groups, such as "saga"), without the root's name.
func commandPaths(cmd *cobra.Command) []string {
	var paths []string
	for _, sub := range cmd.Commands() {
		if sub.Runnable() {
			paths = append(paths, strings.TrimPrefix(sub.CommandPath(), "retrysafe "))
		}
		paths = append(paths, commandPaths(sub)...)
	}
	return paths
}

// Ensure no command prints data from outside raw: on a database seeded
// with hostile ids, keys, error texts, user and operator names, every
// command's text output holds no control character (but its own
// newlines), no line that a string forged, and shows each hostile string
// it prints Go-quoted (ordinary ids print as they are, see
// TestTerminalSafe). The JSON outputs still hold the stored strings
// exactly. Every command in the tree is run here or named, with the
// reason, in notRun: a new command fails this test until it is one or the
// other.
func TestEveryCommandEscapesHostileText(t *testing.T) {
	h := seedHostileDatabase(t)
	db := h.env.path
	webhookPoison := []string{hostileErase, hostileNewline, hostileBidi, hostileC1}

	notRun := map[string]string{
		"serve":  "runs until stopped; its output is slog's lines, checked below as the seeding's server and workers wrote them",
		"relay":  "likewise",
		"worker": "likewise",
		"chaos":  "starts processes for minutes; it prints its own database's counts and audit, with no data from outside",
	}
	runs := []struct {
		args  []string
		shows []string
	}{
		{args: []string{"check", "--db", db},
			shows: append([]string{hostileCharge, hostileMessageID, hostileOrderID, hostileBrokerError, hostileUser}, webhookPoison...)},
		{args: []string{"check", "--db", db, "--in-flight"}, shows: []string{hostileBrokerError}},
		{args: []string{"inspect", "--db", db}, shows: append([]string{hostileTitle, hostileMessageID, hostilePathID}, webhookPoison...)},
		{args: []string{"inspect", "--db", db, "--wide"},
			shows: slices.Concat([]string{hostileTitle, hostileMessageID, hostilePathID, hostileUser, hostileCharge, hostileOrderID, hostileBrokerError},
				webhookPoison, onSQLiteOnly(hostileBytesPathID))},
		{args: []string{"inspect", "--db", db, "--json"}},
		{args: []string{"inspect", "--db", db, "--wide", "--order", h.hostileUsersOrderID}, shows: []string{hostileUser}},
		{args: []string{"inspect", "--db", db, "--order", hostilePathID}, shows: []string{hostilePathID}},
		// The text cuts the error at 120 columns; the diagram does not.
		{args: []string{"trace", "--db", db, h.failedOrderID}},
		{args: []string{"trace", "--db", db, "--mermaid", h.failedOrderID}, shows: []string{hostileBrokerError}},
		{args: []string{"trace", "--db", db, h.hostileUsersOrderID}, shows: []string{hostileUser}},
		{args: []string{"trace", "--db", db, h.sagaOrderID}},
		{args: []string{"trace", "--db", db, hostilePathID}, shows: []string{hostilePathID}},
		{args: []string{"saga", "list", "--db", db}, shows: []string{hostileProcessorError}},
		{args: []string{"refund", "list", "--db", db}, shows: []string{hostileUser}},
		// Refused: the webhook inbox is not the broker's.
		{args: []string{"inbox", "replay", "--db", db, "--operator", hostileOperator, hostileNewline}, shows: []string{hostileNewline}},
		{args: []string{"inbox", "replay", "--db", db, "--operator", hostileOperator, "--consumer", paymentServiceConsumer, "--all-poison"},
			shows: []string{hostileMessageID, hostileOrderID, hostileBrokerError}},
		{args: []string{"outbox", "retry", "--db", db, "--operator", hostileOperator, "--all-failed"}, shows: []string{hostileBrokerError}},
		{args: []string{"saga", "resume", "--db", db, "--operator", hostileOperator, h.sagaID}, shows: []string{hostileProcessorError}},
		{args: []string{"refund", "finish", "--db", db, "--operator", hostileOperator}, shows: []string{hostileUser}},
		// The repairs' log: the operator, the targets and the results.
		{args: []string{"inspect", "--db", db, "--wide"}, shows: []string{hostileOperator, hostileMessageID, hostileOrderID, hostileUser}},
		{args: []string{"cleanup", "--db", db}},
		{args: []string{"sign-webhook", `{"id":"` + hostileErase + `"}`}},
		// Their databases are their own, with no data from outside.
		{args: []string{"demo"}},
		{args: []string{"simulate", "--steps", "30", "--trace"}},
	}

	root := newRootCommand()
	covered := map[string]bool{}
	for _, r := range runs {
		cmd, _, err := root.Find(r.args)
		if err != nil {
			t.Fatalf("%v: %v", r.args, err)
		}
		covered[strings.TrimPrefix(cmd.CommandPath(), "retrysafe ")] = true
	}
	paths := commandPaths(root)
	sort.Strings(paths)
	for _, path := range paths {
		if !covered[path] && notRun[path] == "" {
			t.Errorf("retrysafe %s is neither run on the hostile database here nor named in notRun with the reason", path)
		}
	}

	for _, r := range runs {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), r.args, strings.NewReader(""), &stdout, &stderr)
		what := fmt.Sprintf("%q (exit error %q)", r.args, fmt.Sprint(err))
		failed := t.Failed()
		mustBeTerminalSafe(t, what, stdout.String()+"\n"+stderr.String(), r.shows...)
		if t.Failed() && !failed {
			t.Logf("%s printed:\n%q\n%q", what, stdout.String(), stderr.String())
		}
		if slices.Contains(r.args, "--json") {
			mustHoldExactly(t, "inspect --json", stdout.String(),
				hostileErase, hostileNewline, hostileBidi, hostileC1, hostileTitle, hostileMessageID, hostileUser, h.hostilePath)
		}
	}

	// serve's log lines, as the server and the workers wrote them in text
	// format while the database was seeded: the request lines, the poison
	// webhooks, the poison message.
	mustBeTerminalSafe(t, "serve's log", h.logs.String(), hostileErase, hostileNewline, hostileBidi, hostileC1, hostileMessageID, hostilePathID)
	for i, answer := range h.adminJSON {
		mustHoldExactly(t, fmt.Sprintf("admin JSON %d", i), answer, []string{hostileMessageID, hostileUser}[i])
	}
}

// mustHoldExactly fails t unless the JSON document out decodes and holds
// each of want exactly, as a whole string value.
func mustHoldExactly(t *testing.T, what, out string, want ...string) {
	t.Helper()
	var document any
	if err := json.Unmarshal([]byte(out), &document); err != nil {
		t.Errorf("%s is not JSON: %v\n%s", what, err, out)
		return
	}
	values := map[string]bool{}
	var collect func(v any)
	collect = func(v any) {
		switch v := v.(type) {
		case string:
			values[v] = true
		case []any:
			for _, item := range v {
				collect(item)
			}
		case map[string]any:
			for _, item := range v {
				collect(item)
			}
		}
	}
	collect(document)
	for _, s := range want {
		if !values[s] {
			t.Errorf("%s does not hold %s exactly", what, strconv.Quote(s))
		}
	}
}
