// Terminal output of data from outside. A webhook's event id, a message id
// from the broker, a request's path, a processor's or broker's error text,
// a user or operator name: each is stored exactly as it came, and the
// commands print it. A terminal obeys the control characters in what it
// is given: an id holding ESC [2K CR erases the line it is printed on (the
// VIOLATION that check prints about it) and writes its own, ESC ]0; retitles
// the window, a newline starts a line of its own ("ok: all 22 invariants
// hold"), and the bidi overrides show a string as another. So every text
// formatter passes such strings through terminalSafe, and run wraps the
// commands' output in a terminalWriter, a safety net for a field that a
// formatter forgot.

package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// unsafeRune reports whether a terminal may act on r rather than show it:
// the C0 controls (ESC, CR, LF, TAB, BEL ...), DEL and the C1 controls
// (U+009B alone does what ESC [ does), the format characters (among them
// the bidi overrides and isolates U+202A-U+202E and U+2066-U+2069, and
// the zero-width characters), and the line and paragraph separators.
func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp)
}

// terminalSafe returns s as a terminal may print it: unchanged if it is
// valid UTF-8 without an unsafeRune, Go-quoted ("evt\x1b[2K\r") if not.
// Ordinary ids print as they always did; a hostile one prints whole, on
// the line it belongs to, with its quotes saying it was escaped. (In bash,
// $'...' around the quoted form gives the string back, to pass it to a
// command.)
func terminalSafe(s string) string {
	if utf8.ValidString(s) && strings.IndexFunc(s, unsafeRune) < 0 {
		return s
	}
	return strconv.Quote(s)
}

// terminalWriter is the safety net under every command's output: it
// writes each unsafeRune that reaches it, but newlines and tabs, as a
// \uXXXX escape (a byte that is not UTF-8 as \xNN), so that a field a
// formatter did not pass through terminalSafe can neither erase a line nor
// retitle the terminal. It cannot replace terminalSafe: a newline or a tab
// inside an id reaches it looking exactly like the formatter's own, and
// only the formatter knows which is which. The escapes are JSON's, and in
// JSON such a rune can only stand inside a string, so --json output and
// JSON log lines decode to the very same strings.
type terminalWriter struct {
	mu  sync.Mutex
	out io.Writer
	// partial is the start of a rune that a Write cut off, held until the
	// next Write completes it (or flush escapes it).
	partial []byte
}

// newTerminalWriter returns a terminalWriter that writes to out.
func newTerminalWriter(out io.Writer) *terminalWriter {
	return &terminalWriter{out: out}
}

// Write writes p to the underlying writer with its unsafe runes escaped.
func (w *terminalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	data := p
	if len(w.partial) > 0 {
		data = append(w.partial, p...)
		w.partial = nil
	}
	escaped := make([]byte, 0, len(data))
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		switch {
		case r == utf8.RuneError && size <= 1 && !utf8.FullRune(data[i:]):
			w.partial = append([]byte(nil), data[i:]...)
			size = len(data) - i
		case r == utf8.RuneError && size <= 1:
			escaped = fmt.Appendf(escaped, `\x%02x`, data[i])
		case r == '\n' || r == '\t' || !unsafeRune(r):
			escaped = append(escaped, data[i:i+size]...)
		case r > 0xffff:
			r1, r2 := utf16.EncodeRune(r)
			escaped = fmt.Appendf(escaped, `\u%04x\u%04x`, r1, r2)
		default:
			escaped = fmt.Appendf(escaped, `\u%04x`, r)
		}
		i += size
	}
	if _, err := w.out.Write(escaped); err != nil {
		return 0, err
	}
	return len(p), nil
}

// flush writes the start of a rune that no Write completed, escaped.
func (w *terminalWriter) flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.partial) == 0 {
		return nil
	}
	var escaped []byte
	for _, b := range w.partial {
		escaped = fmt.Appendf(escaped, `\x%02x`, b)
	}
	w.partial = nil
	_, err := w.out.Write(escaped)
	return err
}

// underTerminalWriter returns the writer that w writes to, if w is a
// terminalWriter: for the one output that writes a control character on
// purpose (chaos's progress bar, redrawn in place with CR).
func underTerminalWriter(w io.Writer) io.Writer {
	if t, ok := w.(*terminalWriter); ok {
		return t.out
	}
	return w
}
