package main

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strings"
	"testing"
)

// tourPath is the guided tour, whose code excerpts are copied from the
// source by name.
const tourPath = "docs/tour.md"

// updateTourEnv names the variable that makes TestTourExcerptsMatchSource
// rewrite the tour's excerpts from the source instead of failing.
const updateTourEnv = "RETRYSAFE_UPDATE_TOUR"

// tourExcerpt matches one excerpt of the tour: the marker naming a file and
// a declaration, then the fenced Go block that holds its text.
var tourExcerpt = regexp.MustCompile("(?s)(<!-- excerpt ([a-z_]+\\.go) ([A-Za-z_.]+) -->\n```go\n)(.*?)(```\n)")

// declarationSource returns the text of the declaration called name in
// file, with its doc comment: a function ("relayOnce"), a method with its
// receiver's type ("App.createOrder", "idempotentRequest.fingerprint"), or
// the type, const or var declaration that holds a name ("recoveryPoint").
// Names, not line numbers, so that an excerpt follows its function when the
// file around it changes.
func declarationSource(file, name string) (string, error) {
	source, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	fset := token.NewFileSet()
	parsed, err := parser.ParseFile(fset, file, source, parser.ParseComments)
	if err != nil {
		return "", err
	}
	receiver, function, isMethod := strings.Cut(name, ".")
	if !isMethod {
		function = receiver
	}
	text := func(doc *ast.CommentGroup, from, to token.Pos) string {
		if doc != nil {
			from = doc.Pos()
		}
		return string(source[fset.Position(from).Offset:fset.Position(to).Offset]) + "\n"
	}
	for _, decl := range parsed.Decls {
		switch decl := decl.(type) {
		case *ast.FuncDecl:
			if decl.Name.Name != function || (decl.Recv != nil) != isMethod {
				continue
			}
			if isMethod && receiverTypeName(decl.Recv.List[0].Type) != receiver {
				continue
			}
			return text(decl.Doc, decl.Pos(), decl.End()), nil
		case *ast.GenDecl:
			if isMethod {
				continue
			}
			for _, spec := range decl.Specs {
				var names []*ast.Ident
				switch spec := spec.(type) {
				case *ast.TypeSpec:
					names = []*ast.Ident{spec.Name}
				case *ast.ValueSpec:
					names = spec.Names
				}
				for _, ident := range names {
					if ident.Name == function {
						return text(decl.Doc, decl.Pos(), decl.End()), nil
					}
				}
			}
		}
	}
	return "", fmt.Errorf("%s declares no %s", file, name)
}

// receiverTypeName returns the type name of a method's receiver: "App" for
// (a *App).
func receiverTypeName(expr ast.Expr) string {
	if star, ok := expr.(*ast.StarExpr); ok {
		expr = star.X
	}
	if ident, ok := expr.(*ast.Ident); ok {
		return ident.Name
	}
	return ""
}

// Ensure every excerpt of the tour is the current text of the declaration
// it names: a tour that shows last month's createOrder teaches the wrong
// thing. RETRYSAFE_UPDATE_TOUR=1 go test -run TestTourExcerptsMatchSource .
// rewrites them from the source.
func TestTourExcerptsMatchSource(t *testing.T) {
	tour, err := os.ReadFile(tourPath)
	if err != nil {
		t.Fatal(err)
	}
	matches := tourExcerpt.FindAllSubmatchIndex(tour, -1)
	if len(matches) == 0 {
		t.Fatalf("%s has no <!-- excerpt FILE NAME --> followed by a ```go block", tourPath)
	}
	var updated bytes.Buffer
	last, stale := 0, 0
	for _, m := range matches {
		file, name := string(tour[m[4]:m[5]]), string(tour[m[6]:m[7]])
		current := string(tour[m[8]:m[9]])
		want, err := declarationSource(file, name)
		if err != nil {
			t.Errorf("%s: excerpt %s %s: %v", tourPath, file, name, err)
			want = current
		}
		if current != want {
			stale++
			if os.Getenv(updateTourEnv) != "1" {
				t.Errorf("%s: the excerpt of %s in %s differs from the source; run %s=1 go test -run TestTourExcerptsMatchSource .\ngot:\n%s\nwant:\n%s",
					tourPath, name, file, updateTourEnv, current, want)
			}
		}
		updated.Write(tour[last:m[8]])
		updated.WriteString(want)
		last = m[9]
	}
	updated.Write(tour[last:])
	if stale > 0 && os.Getenv(updateTourEnv) == "1" {
		if err := os.WriteFile(tourPath, updated.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote %d excerpts of %s from the source", stale, tourPath)
	}
}

// Ensure a declaration is found by name whatever surrounds it, and a name
// the file does not declare is an error rather than an empty excerpt.
func TestDeclarationSource(t *testing.T) {
	got, err := declarationSource("idem.go", "idempotentRequest.fingerprint")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(got, "func (r idempotentRequest) fingerprint() string {") || !strings.HasPrefix(got, "// fingerprint") || !strings.HasSuffix(got, "}\n") {
		t.Fatalf("got %q, want fingerprint with its doc comment", got)
	}
	got, err = declarationSource("refund.go", "recoveryFinished")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(got, "recoveryStarted") {
		t.Fatalf("got %q, want the const block of the recovery points", got)
	}
	if _, err := declarationSource("idem.go", "App.noSuchFunction"); err == nil {
		t.Fatal("got no error for a function idem.go does not declare")
	}
	if _, err := declarationSource("idem.go", "fingerprint"); err == nil {
		t.Fatal("got no error for fingerprint without its receiver: the method is not a function")
	}
}

// tourMaxLines is the length of a tour read in an hour.
const tourMaxLines = 600

// Ensure the tour stays a tour: at most tourMaxLines lines, so that it is
// read in an hour and not skimmed; and each page that speaks of atomic
// phases says where they come from (Stripe's design, as Brandur Leach
// describes it), since neither article has them.
func TestDocsTourIsShort(t *testing.T) {
	tour, err := os.ReadFile(tourPath)
	if err != nil {
		t.Fatal(err)
	}
	if lines := bytes.Count(tour, []byte("\n")); lines > tourMaxLines {
		t.Errorf("%s has %d lines; a tour read in an hour has at most %d", tourPath, lines, tourMaxLines)
	}
	for _, page := range []string{tourPath, "README.md", "docs/reading-order.md"} {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(text), "atomic phases") && !strings.Contains(string(text), "Brandur Leach") {
			t.Errorf("%s speaks of atomic phases without saying they come from Stripe's design as Brandur Leach describes it", page)
		}
	}
}
