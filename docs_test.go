package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
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

// readingListRow matches a row of reading-order.md's "Questions, and the
// lines that answer them": the question, what to read, the lines, the
// test.
var readingListRow = regexp.MustCompile("^\\| ([^|]+) \\| ([^|]+) \\| ([0-9]+) \\| `(Test[A-Za-z0-9_]+)[^`]*` \\|$")

// readingListSpan matches one file's functions in a row's "Read" cell:
// `file.go` `name` A-B, `name` A-B.
var readingListSpan = regexp.MustCompile("`([a-z_]+\\.go)` ((?:`[A-Za-z]+` [0-9]+-[0-9]+(?:, )?)+)")

// Ensure each row of reading-order.md's reading lists names functions at
// the lines it gives (from the doc comment to the closing brace), adds
// them up right, and names a test that exists: a reader who reads those
// lines reads the whole function, and nothing else.
func TestDocsReadingListsSpanTheirFunctions(t *testing.T) {
	page, err := os.ReadFile("docs/reading-order.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, found := strings.Cut(string(page), "\n## Questions, and the lines that answer them\n")
	if !found {
		t.Fatal("docs/reading-order.md has no section \"Questions, and the lines that answer them\"")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	tests := map[string]bool{}
	testFiles, err := filepath.Glob("*_test.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range testFiles {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(`(?m)^func (Test\w+)\(`).FindAllStringSubmatch(string(text), -1) {
			tests[m[1]] = true
		}
	}
	rows, total := 0, 0
	for _, line := range strings.Split(section, "\n") {
		row := readingListRow.FindStringSubmatch(line)
		if row == nil {
			continue
		}
		rows++
		sum := 0
		for _, span := range readingListSpan.FindAllStringSubmatch(row[2], -1) {
			for _, fn := range regexp.MustCompile("`([A-Za-z]+)` ([0-9]+)-([0-9]+)").FindAllStringSubmatch(span[2], -1) {
				first, last, err := declarationLines(span[1], fn[1])
				if err != nil {
					t.Errorf("%q: %v", row[1], err)
					continue
				}
				if want := fmt.Sprintf("%d-%d", first, last); fn[2]+"-"+fn[3] != want {
					t.Errorf("%q: %s %s is at %s-%s in the page, %s in the code", row[1], span[1], fn[1], fn[2], fn[3], want)
				}
				sum += last - first + 1
			}
		}
		if fmt.Sprint(sum) != row[3] {
			t.Errorf("%q: the page says %s lines, its functions have %d", row[1], row[3], sum)
		}
		if !tests[row[4]] {
			t.Errorf("%q: no test %s", row[1], row[4])
		}
		total += sum
	}
	if rows < 10 {
		t.Fatalf("found %d rows; the pattern no longer matches the page", rows)
	}
	t.Logf("%d questions, %d lines of Go", rows, total)
}

// declarationLines returns the first and last line of the function or
// method name in file, from its doc comment to its closing brace.
func declarationLines(file, name string) (first, last int, err error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
	if err != nil {
		return 0, 0, err
	}
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Name.Name != name {
			continue
		}
		start := fn.Pos()
		if fn.Doc != nil {
			start = fn.Doc.Pos()
		}
		return fset.Position(start).Line, fset.Position(fn.End()).Line, nil
	}
	return 0, 0, fmt.Errorf("%s declares no function %s", file, name)
}
