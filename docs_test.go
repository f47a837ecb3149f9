package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// markdownLink matches a link's target: [text](target).
var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// markdownHeading matches a heading line outside code blocks.
var markdownHeading = regexp.MustCompile(`^#{1,6} (.+)$`)

// headingAnchors returns the anchors GitHub gives the headings of a
// Markdown file: lower case, punctuation dropped, spaces as hyphens.
func headingAnchors(text string) map[string]bool {
	anchors := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		m := markdownHeading.FindStringSubmatch(line)
		if inCode || m == nil {
			continue
		}
		var anchor strings.Builder
		for _, r := range strings.ToLower(m[1]) {
			switch {
			case r == ' ':
				anchor.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				anchor.WriteRune(r)
			}
		}
		anchors[anchor.String()] = true
	}
	return anchors
}

// Ensure every link of the first page and of docs/ leads somewhere: the
// file exists and, for a link to a section, the page has that heading; and
// every page of docs/ is linked from the first page, so the text moved out
// of the README can still be found from it.
func TestDocsLinks(t *testing.T) {
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, "README.md", "BENCHMARKS.md")
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, page := range pages {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(page, "docs/") && !strings.Contains(string(readme), "]("+page+")") {
			t.Errorf("README.md does not link to %s", page)
		}
		for _, m := range markdownLink.FindAllStringSubmatch(string(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
			}
			linked, err := os.ReadFile(path)
			if err != nil {
				t.Errorf("%s links to %s: %v", page, target, err)
				continue
			}
			if anchor != "" && !headingAnchors(string(linked))[anchor] {
				t.Errorf("%s links to %s: %s has no heading with the anchor #%s", page, target, path, anchor)
			}
		}
	}
}

// glossaryCode matches one file of a glossary entry's code column and the
// names after it: [`saga.go`](../saga.go): `fenceSaga`, `oneRowOr`.
var glossaryCode = regexp.MustCompile("\\[`([a-z_]+\\.go)`\\]\\(\\.\\./[a-z_]+\\.go\\)((?:[:,] `[^`]+`)+)")

// namedIn matches "`NAME` in `FILE.go`" on the first page.
var namedIn = regexp.MustCompile("`([A-Za-z_.()*]+)` in `([a-z_]+\\.go)`")

// declarationName turns a name as the docs write it, "(*App).relayOnce",
// into the one declarationSource takes, "App.relayOnce".
func declarationName(name string) string {
	name = strings.TrimPrefix(name, "(*")
	name = strings.TrimPrefix(name, "(")
	return strings.Replace(name, ")", "", 1)
}

// Ensure each function, type or constant the glossary, the tour's engine
// box and the first page's table of names point to is declared in the file they name: a rename
// would otherwise leave a reader looking for a function that is gone.
func TestDocsNameRealDeclarations(t *testing.T) {
	checked := 0
	// The tour's box of engine functions links its files as the glossary
	// does.
	for _, page := range []string{"docs/glossary.md", tourPath} {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range glossaryCode.FindAllStringSubmatch(string(text), -1) {
			for _, name := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(m[2], -1) {
				checked++
				if _, err := declarationSource(m[1], declarationName(name[1])); err != nil {
					t.Errorf("%s: %v", page, err)
				}
			}
		}
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range namedIn.FindAllStringSubmatch(string(readme), -1) {
		checked++
		if _, err := declarationSource(m[2], declarationName(m[1])); err != nil {
			t.Errorf("README.md: %v", err)
		}
	}
	t.Logf("checked %d names", checked)
	if checked < 30 {
		t.Fatalf("checked %d names; the patterns no longer match the pages", checked)
	}
}

// Ensure the debugging page opens with the line that installs Delve, right
// under its title: a new machine has no dlv, and every command the page
// shows needs it.
func TestDocsDebuggingInstallsDelveFirst(t *testing.T) {
	page, err := os.ReadFile("docs/debugging.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.SplitN(string(page), "\n", 5)
	if len(lines) < 5 || !strings.HasPrefix(lines[0], "# ") || lines[1] != "" || lines[2] != "```sh" ||
		!strings.HasPrefix(lines[3], "go install github.com/go-delve/delve/cmd/dlv@latest") {
		t.Fatalf("docs/debugging.md does not open with its title and the Delve install line:\n%s", strings.Join(lines[:min(len(lines), 4)], "\n"))
	}
}
