// trace --svg draws one order's journey as an SVG sequence diagram: the
// same rows as --mermaid, laid out here in Go, so that a browser, an image
// viewer or a Markdown page shows it without running any JavaScript.

package main

import (
	"bytes"
	"fmt"
	"html"
	"io"
	"sort"
	"strings"
)

// Layout of the drawing, in SVG user units (pixels at 100%).
const (
	svgColumn    = 150 // between two lifelines
	svgMargin    = 20  // around the drawing
	svgHeadTop   = 20  // top of the participants' boxes
	svgHeadH     = 36  // height of a participant's box
	svgRow       = 30  // between two arrows
	svgCharWidth = 6.6 // an estimate of one character at svgFontSize, to size the canvas
	svgFontSize  = 11
)

// traceParticipants returns the participants of t in the order a diagram
// shows them: the client and the API, the outbox and the broker, each
// consumer's inbox, then the saga and the processor. Only those that take
// part in a row are returned.
func traceParticipants(t *orderTrace) []string {
	present := map[string]bool{}
	var inboxes []string
	for _, row := range t.rows {
		for _, p := range []string{row.from, row.to} {
			if !present[p] && strings.HasPrefix(p, "Inbox (") {
				inboxes = append(inboxes, p)
			}
			present[p] = true
		}
	}
	sort.Strings(inboxes)
	order := []string{traceClient, traceAPI, traceRelay, traceBroker}
	order = append(order, inboxes...)
	order = append(order, traceSaga, traceProcessor)
	var shown []string
	for _, p := range order {
		if present[p] {
			shown = append(shown, p)
		}
	}
	return shown
}

// printSVG writes the timeline as an SVG sequence diagram: a lifeline per
// participant, one arrow a row in time order (a row from a participant to
// itself is a short loop), its text above it, and the final state as a
// note at the bottom. Ids are shown by their prefix only (idsByRole), as in
// --mermaid, so the drawing of a run with fixed steps stays the same. Every
// text comes from the tables and is escaped.
func printSVG(w io.Writer, t *orderTrace) error {
	participants := traceParticipants(t)
	column := map[string]int{}
	for i, p := range participants {
		column[p] = i
	}
	x := func(p string) float64 {
		return float64(svgMargin + svgColumn/2 + column[p]*svgColumn)
	}
	firstRow := svgHeadTop + svgHeadH + svgRow
	noteY := firstRow + len(t.rows)*svgRow
	height := noteY + svgRow + svgMargin

	// Labels start at their arrow's left end and may run past the last
	// lifeline: the canvas is as wide as the longest one needs.
	width := float64(2*svgMargin + len(participants)*svgColumn)
	for _, row := range t.rows {
		left := min(x(row.from), x(row.to))
		width = max(width, left+6+float64(len([]rune(idsByRole(row.text))))*svgCharWidth+svgMargin)
	}
	final := "final: " + idsByRole(t.final)
	width = max(width, float64(svgMargin)+float64(len([]rune(final)))*svgCharWidth+2*svgMargin)

	var buf bytes.Buffer
	fmt.Fprintf(&buf, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%d" viewBox="0 0 %.0f %d" font-family="sans-serif" font-size="%d">`+"\n",
		width, height, width, height, svgFontSize)
	fmt.Fprintf(&buf, "<title>%s</title>\n", html.EscapeString(idsByRole(t.header)))
	buf.WriteString(`<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>` + "\n")
	fmt.Fprintf(&buf, `<rect width="100%%" height="100%%" fill="#fff"/>`+"\n")
	for _, p := range participants {
		fmt.Fprintf(&buf, `<line x1="%.0f" y1="%d" x2="%.0f" y2="%d" stroke="#999" stroke-dasharray="4 3"/>`+"\n",
			x(p), svgHeadTop+svgHeadH, x(p), noteY-svgRow/2)
		fmt.Fprintf(&buf, `<rect x="%.0f" y="%d" width="%d" height="%d" rx="4" fill="#eef3fb" stroke="#4a6fa5"/>`+"\n",
			x(p)-svgColumn/2+8, svgHeadTop, svgColumn-16, svgHeadH)
		fmt.Fprintf(&buf, `<text x="%.0f" y="%d" text-anchor="middle" font-weight="bold">%s</text>`+"\n",
			x(p), svgHeadTop+svgHeadH/2+4, html.EscapeString(p))
	}
	for i, row := range t.rows {
		y := firstRow + i*svgRow
		from, to := x(row.from), x(row.to)
		label := html.EscapeString(idsByRole(row.text))
		if row.from == row.to {
			// A row within one participant: a loop to the right.
			fmt.Fprintf(&buf, `<path d="M%.0f,%d h24 v10 h-24" fill="none" stroke="#333" marker-end="url(#arrow)"/>`+"\n", from, y-6)
			fmt.Fprintf(&buf, `<text x="%.0f" y="%d">%s</text>`+"\n", from+30, y+2, label)
			continue
		}
		fmt.Fprintf(&buf, `<line x1="%.0f" y1="%d" x2="%.0f" y2="%d" stroke="#333" marker-end="url(#arrow)"/>`+"\n", from, y, to, y)
		fmt.Fprintf(&buf, `<text x="%.0f" y="%d">%s</text>`+"\n", min(from, to)+6, y-5, label)
	}
	fmt.Fprintf(&buf, `<rect x="%d" y="%d" width="%.0f" height="%d" fill="#fff8dc" stroke="#c9a227"/>`+"\n",
		svgMargin, noteY-svgRow/2+4, width-2*svgMargin, svgRow-8)
	fmt.Fprintf(&buf, `<text x="%d" y="%d">%s</text>`+"\n", svgMargin+8, noteY+4, html.EscapeString(final))
	buf.WriteString("</svg>\n")
	_, err := w.Write(buf.Bytes())
	return err
}
