package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
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
	// A user name from RETRYSAFE_API_KEYS, which serve accepts as it is.
	hostileUser = "user\x1b[31m-42\u202e"
	// An operator name, as --operator takes it.
	hostileOperator = "ops\x1b[2K\rroot"
	// An order id in a request's path (percent-encoded on the wire),
	// which the key of the request stores.
	hostilePathID = "ord_\x1b[2K\r\nVIOLATION forged: path"
)

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
