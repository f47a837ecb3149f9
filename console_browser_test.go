package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

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

// newBrowser starts a headless Chromium of its own for the test, closed
// when the test ends, and returns the context of its tab: every action on
// it fails after timeout instead of hanging.
func newBrowser(tb testing.TB, timeout time.Duration) context.Context {
	tb.Helper()
	chromium := chromiumPath(tb)
	// The flags this machine's closed network needs: without them
	// Chromium keeps trying to reach Google's hosts.
	allocator, cancelAllocator := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(tb.TempDir()),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
	)
	tb.Cleanup(cancelAllocator)
	browser, cancelBrowser := chromedp.NewContext(allocator)
	tb.Cleanup(cancelBrowser)
	ctx, cancel := context.WithTimeout(browser, timeout)
	tb.Cleanup(cancel)
	return ctx
}

// browserLogin opens ts's console in the browser and logs in as
// operator, waiting until sel shows on the console.
func browserLogin(tb testing.TB, ctx context.Context, ts *httptest.Server, operator string, sel chromedp.CSS) {
	tb.Helper()
	err := chromedp.Do(ctx,
		chromedp.Navigate(ts.URL+"/console"),
		chromedp.WaitVisible(chromedp.CSS(`#key`)),
		chromedp.SendKeys(chromedp.CSS(`#key`), testAdminKey),
		chromedp.SendKeys(chromedp.CSS(`#operator`), operator),
		chromedp.Click(chromedp.CSS(`#login`)),
		chromedp.WaitVisible(sel),
	)
	if err != nil {
		tb.Fatalf("log in: %v", err)
	}
}

func TestConsoleInBrowser(t *testing.T) {
	// Ensure an operator in a real browser logs in, sees the failed event,
	// presses "retry", and after a relay pass sees the event published in
	// the order's timeline, as the database has it, and the order's
	// journey drawn.
	t.Run("RetriesAFailedEvent", func(t *testing.T) {
		ctx := newBrowser(t, 90*time.Second)
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		failPublishing(t, env)
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ?`, orderID)

		row := chromedp.CSS(`tr[data-event="` + eventID + `"]`)
		browserLogin(t, ctx, ts, "browser", row)
		failedRow := browserText(t, ctx, row)
		if !strings.Contains(failedRow, "broker unreachable") {
			t.Fatalf("failed event's row: %q", failedRow)
		}
		if err := chromedp.Do(ctx, chromedp.Click(row+" button"), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
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
		err := chromedp.Do(ctx,
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
		// The journey is drawn: an SVG with one arrow a row of the
		// timeline, laid out (it has a size), with nothing to run.
		drawn, err := chromedp.Run(ctx, chromedp.Evaluate[[3]int](`(() => {
			const svg = document.querySelector('#journey svg');
			if (!svg) return [0, 0, 0];
			const box = svg.getBoundingClientRect();
			return [svg.querySelectorAll('[marker-end]').length, Math.round(box.width), Math.round(box.height)];
		})()`))
		if err != nil {
			t.Fatalf("read the drawing: %v", err)
		}
		tr, err := traceOrder(context.Background(), env.app.db, orderID)
		if err != nil {
			t.Fatal(err)
		}
		if drawn[0] != len(tr.rows) || drawn[1] == 0 || drawn[2] == 0 {
			t.Fatalf("the drawing shows %d arrows in %dx%d; want %d arrows, laid out", drawn[0], drawn[1], drawn[2], len(tr.rows))
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
	})

	// Ensure that in a real browser each button repairs its own row and
	// nothing else, whatever the row's id holds: `/`, `?`, `#`, `.`, `..`,
	// `%`, a line break, letters beyond ASCII, or a relative path that a
	// browser resolves to another row's repair (`../../sagas/SAGA_ID/resume?`).
	// The saga and the event that the hostile ids point at stay as they
	// were until their own buttons are pressed; each order link asks for
	// its own order; a poison webhook, which no replay can deliver again,
	// has no button and says what to do instead.
	t.Run("EachButtonRepairsOnlyItsOwnRow", func(t *testing.T) {
		ctx := newBrowser(t, 5*time.Minute)
		env := MustOpenApp(t)
		ts := newAdminTestServer(t, env, testAdminKey)
		h := setAsideHostileIDs(t, env, ts)
		browserLogin(t, ctx, ts, "", chromedp.CSS(`#failed`))

		links, err := chromedp.Run(ctx, chromedp.Evaluate[[][2]string](
			`[...document.querySelectorAll("#failed tr")].slice(1).map(tr => [tr.cells[0].textContent, tr.cells[2].querySelector("a").href])`))
		if err != nil || len(links) != len(h.failedEvents) {
			t.Fatalf("the failed events' order links: %q, %v; want %d", links, err, len(h.failedEvents))
		}
		for _, link := range links {
			eventID := idShownAs(h.failedEvents, link[0])
			want := env.str(t, `SELECT aggregate_id FROM outbox_events WHERE event_id = ?`, eventID)
			u, err := url.Parse(link[1])
			if err != nil || u.Path != "/console" || u.Query().Get("order") != want {
				t.Errorf("the order link of event %q is %s, want one for order %q", eventID, link[1], want)
			}
		}

		// The hostile ids first: a console that put ids into its form
		// actions had their buttons resume the saga, or retry the event,
		// that they name.
		var presses []buttonPress
		for _, id := range h.failedEvents {
			presses = append(presses, buttonPress{table: "failed", cells: []string{id}, row: "outbox " + id,
				action: repairOutboxRetry, target: id, says: "pending again"})
		}
		for _, id := range h.poisonMessages {
			presses = append(presses, buttonPress{table: "poison", cells: []string{paymentServiceConsumer, id}, row: "inbox " + paymentServiceConsumer + "/" + id,
				action: repairInboxReplay, target: paymentServiceConsumer + "/" + id, says: "delivered again"})
		}
		for _, id := range append(h.sagas, h.sagaID) {
			presses = append(presses, buttonPress{table: "sagas", cells: []string{id}, row: "saga " + id,
				action: repairSagaResume, target: id, says: "compensating again"})
		}
		hostile := func(p buttonPress) bool { return strings.Contains(p.target, "../") && strings.HasSuffix(p.target, "?") }
		victim := func(p buttonPress) bool { return p.target == h.sagaID || p.target == h.eventID }
		slices.SortStableFunc(presses, func(a, b buttonPress) int {
			rank := func(p buttonPress) int {
				switch {
				case hostile(p):
					return 0
				case victim(p):
					return 2
				}
				return 1
			}
			return rank(a) - rank(b)
		})
		for _, p := range presses {
			p.pressAndCheck(t, ctx, ts, env)
		}

		found, err := chromedp.Run(ctx, chromedp.Evaluate[int](markRowButton("poison", []string{webhookConsumer, h.webhookID})))
		if err != nil || found != -1 {
			t.Fatalf("the poison webhook's row: got %d, %v; want the row, without a button", found, err)
		}
		if row := browserText(t, ctx, chromedp.CSS(`#poison`)); !strings.Contains(row, "No replay can deliver it") {
			t.Fatalf("the poison webhook's row does not say why it has no button: %q", row)
		}
		if got := env.str(t, `SELECT status FROM inbox_messages WHERE consumer = ? AND message_id = ?`, webhookConsumer, h.webhookID); got != string(inboxPoison) {
			t.Fatalf("the poison webhook is %q, want poison", got)
		}
	})
}

// buttonPress is one button of the console, as an operator finds it (the
// row of table whose first cells show cells), and what pressing it must
// do: change that row of repairableRows and no other, log action on
// target, and say says.
type buttonPress struct {
	table  string
	cells  []string
	row    string
	action repairAction
	target string
	says   string
}

// markRowButton returns a script that marks, with the attribute
// data-press, the button of the one row of table whose first cells show
// cells, and returns 1; or -1 if that row has no button, or how many rows
// match if not one. (A page shows a CR LF or a lone CR as LF.)
func markRowButton(table string, cells []string) string {
	tableJSON, err := json.Marshal(table)
	if err != nil {
		panic(err)
	}
	cellsJSON, err := json.Marshal(cells)
	if err != nil {
		panic(err)
	}
	return `(() => {
		const table = document.getElementById(` + string(tableJSON) + `);
		const want = ` + string(cellsJSON) + `.map(text => text.replace(/\r\n?/g, "\n"));
		document.querySelectorAll("[data-press]").forEach(e => e.removeAttribute("data-press"));
		const rows = table ? [...table.rows].filter(tr => want.every((text, i) => tr.cells[i] && tr.cells[i].textContent === text)) : [];
		if (rows.length !== 1) return rows.length;
		const button = rows[0].querySelector("button");
		if (!button) return -1;
		button.setAttribute("data-press", "");
		return 1;
	})()`
}

// pressAndCheck loads the console, presses p's button with the mouse, and
// fails the test unless the page the browser lands on says p.says and
// exactly p.row changed, with one repair_log row of p.action on p.target.
func (p buttonPress) pressAndCheck(tb testing.TB, ctx context.Context, ts *httptest.Server, env *testEnv) {
	tb.Helper()
	what := fmt.Sprintf("the button of %s row %q", p.table, p.cells)
	if err := chromedp.Do(ctx, chromedp.Navigate(ts.URL+"/console"), chromedp.WaitVisible(chromedp.CSS(`#`+p.table))); err != nil {
		tb.Fatalf("load the console for %s: %v", what, err)
	}
	found, err := chromedp.Run(ctx, chromedp.Evaluate[int](markRowButton(p.table, p.cells)))
	if err != nil || found != 1 {
		tb.Fatalf("%s: found %d such rows (-1: without a button), %v", what, found, err)
	}
	before := repairableRows(tb, env)
	logged := env.count(tb, `SELECT COUNT(*) FROM repair_log WHERE action = ? AND target = ?`, p.action, p.target)
	allLogged := env.count(tb, `SELECT COUNT(*) FROM repair_log`)

	pressing, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(pressing, chromedp.Click(chromedp.CSS(`[data-press]`)), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		location, _ := chromedp.Run(ctx, chromedp.Location())
		body, _ := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`body`)))
		tb.Fatalf("pressed %s: the browser is at %s, showing %q, not the console's outcome (%v)", what, location, body, err)
	}
	flash := browserText(tb, ctx, chromedp.CSS(`#flash`))

	if changed := changedRows(before, repairableRows(tb, env)); len(changed) != 1 || !strings.HasPrefix(changed[0], strconv.Quote(p.row)+":") {
		tb.Fatalf("pressing %s changed\n%s\nwant %q only; the page said %q", what, strings.Join(changed, "\n"), p.row, flash)
	}
	if !strings.Contains(flash, p.says) {
		tb.Fatalf("pressing %s: the page says %q, want %q", what, flash, p.says)
	}
	if got := env.count(tb, `SELECT COUNT(*) FROM repair_log WHERE action = ? AND target = ?`, p.action, p.target); got != logged+1 || env.count(tb, `SELECT COUNT(*) FROM repair_log`) != allLogged+1 {
		tb.Fatalf("pressing %s logged %d repairs of %s %q, want one more than %d and nothing else", what, got, p.action, p.target, logged)
	}
}

// idShownAs returns the id among ids that a page shows as text.
func idShownAs(ids []string, text string) string {
	for _, id := range ids {
		if strings.NewReplacer("\r\n", "\n", "\r", "\n").Replace(id) == text {
			return id
		}
	}
	return text
}
