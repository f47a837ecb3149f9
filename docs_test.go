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
