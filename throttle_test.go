package main

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

// guessClient sends admin keys to a server's handler as if from one
// address, so that a test can play several addresses.
type guessClient struct {
	handler http.Handler
	address string
}

// newGuessServer returns env's routes with testAdminKey as the admin key.
func newGuessServer(env *testEnv) http.Handler {
	s := &server{app: env.app, apiKeys: map[string]string{keyUser42: "user-42"}, adminKey: testAdminKey,
		logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	return s.routes()
}

// login POSTs the console's login form with key.
func (c guessClient) login(key string) *httptest.ResponseRecorder {
	req := httptest.NewRequest("POST", "/console/login", strings.NewReader(url.Values{"key": {key}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return c.send(req)
}

// admin GETs /admin/sagas with key as the bearer token.
func (c guessClient) admin(key string) *httptest.ResponseRecorder {
	req := httptest.NewRequest("GET", "/admin/sagas", nil)
	req.Header.Set("Authorization", "Bearer "+key)
	return c.send(req)
}

// send serves req as if it came from c's address.
func (c guessClient) send(req *http.Request) *httptest.ResponseRecorder {
	req.RemoteAddr = c.address
	recorder := httptest.NewRecorder()
	c.handler.ServeHTTP(recorder, req)
	return recorder
}

// mustAnswer fails the test unless got has status, and, for 429, a
// Retry-After of retryAfter seconds.
func mustAnswer(tb testing.TB, what string, got *httptest.ResponseRecorder, status, retryAfter int) {
	tb.Helper()
	if got.Code != status {
		tb.Fatalf("%s: got %d %s, want %d", what, got.Code, got.Body, status)
	}
	if status == http.StatusTooManyRequests {
		if got := got.Header().Get("Retry-After"); got != fmt.Sprint(retryAfter) {
			tb.Fatalf("%s: Retry-After %q, want %d", what, got, retryAfter)
		}
	}
}

func TestAdminKeyGuessesAreThrottled(t *testing.T) {
	// Ensure wrong keys at the login form from one address are answered
	// at once five times, then each makes the address wait twice as long
	// as the last (429 with Retry-After and the form, the right key
	// refused too), up to a lockout of 15 minutes that waiting out only
	// renews; the operator's right key still logs in from another
	// address, and clears only that address's count.
	t.Run("WrongKeysSlowDownThenLockOut", func(t *testing.T) {
		env := MustOpenApp(t)
		h := newGuessServer(env)
		guesser := guessClient{h, "203.0.113.7:40000"}
		operator := guessClient{h, "198.51.100.1:50000"}
		for i := range freeAdminKeyGuesses {
			mustAnswer(t, fmt.Sprintf("wrong key %d", i+1), guesser.login("guess"), http.StatusForbidden, 0)
		}
		wait := time.Second
		for i := freeAdminKeyGuesses + 1; wait < guessLockout; i++ {
			mustAnswer(t, fmt.Sprintf("wrong key %d", i), guesser.login("guess"), http.StatusForbidden, 0)
			got := guesser.login(testAdminKey)
			mustAnswer(t, fmt.Sprintf("the right key after wrong key %d", i), got, http.StatusTooManyRequests, int(wait/time.Second))
			if body := got.Body.String(); !strings.Contains(body, "Too many wrong keys came from your address (203.0.113.7)") || !strings.Contains(body, `name="key"`) {
				t.Fatalf("the 429 page:\n%s", body)
			}
			env.clock.advance(wait - time.Millisecond)
			mustAnswer(t, "a key just before the wait ends", guesser.login(testAdminKey), http.StatusTooManyRequests, 1)
			env.clock.advance(time.Millisecond)
			wait *= 2
		}
		for range 2 {
			mustAnswer(t, "a wrong key at the cap", guesser.login("guess"), http.StatusForbidden, 0)
			mustAnswer(t, "the right key, locked out", guesser.login(testAdminKey), http.StatusTooManyRequests, int(guessLockout/time.Second))
			env.clock.advance(guessLockout)
		}

		mustAnswer(t, "a wrong key from the operator", operator.login("typo"), http.StatusForbidden, 0)
		mustAnswer(t, "the right key from another address", operator.login(testAdminKey), http.StatusSeeOther, 0)
		mustAnswer(t, "a wrong key, the operator logged in elsewhere", guesser.login("guess"), http.StatusForbidden, 0)
		mustAnswer(t, "the right key, the operator logged in elsewhere", guesser.login(testAdminKey), http.StatusTooManyRequests, int(guessLockout/time.Second))
	})

	// Ensure the /admin endpoints count wrong bearer keys with the
	// console's login, per address, and answer a waiting address 429
	// too-many-wrong-keys with Retry-After as problem+json; a request
	// without a key is no guess.
	t.Run("AdminAPICountsWithTheConsole", func(t *testing.T) {
		env := MustOpenApp(t)
		h := newGuessServer(env)
		guesser := guessClient{h, "[2001:db8:1:2:3:4:5:6]:40000"}
		for i := range freeAdminKeyGuesses - 1 {
			mustAnswer(t, fmt.Sprintf("wrong bearer key %d", i+1), guesser.admin("guess"), http.StatusUnauthorized, 0)
		}
		for range 10 {
			mustAnswer(t, "no key", guesser.send(httptest.NewRequest("GET", "/admin/sagas", nil)), http.StatusUnauthorized, 0)
		}
		mustAnswer(t, "a wrong key at the login form", guesser.login("guess"), http.StatusForbidden, 0)
		mustAnswer(t, "the sixth wrong key", guesser.admin("guess"), http.StatusUnauthorized, 0)
		got := guesser.admin(testAdminKey)
		mustAnswer(t, "the right bearer key", got, http.StatusTooManyRequests, 1)
		if problemTypeOf(t, response{Status: got.Code, Header: got.Header(), Body: got.Body.String()}) != problemTooManyWrongKeys ||
			got.Header().Get("Content-Type") != "application/problem+json" {
			t.Fatalf("got %s %s", got.Header(), got.Body)
		}
		// Another address of the same IPv6 /64 is the same guesser.
		neighbour := guessClient{h, "[2001:db8:1:2:ffff::1]:40000"}
		mustAnswer(t, "the same /64", neighbour.admin(testAdminKey), http.StatusTooManyRequests, 1)
		other := guessClient{h, "[2001:db8:1:3::1]:40000"}
		mustAnswer(t, "another /64", other.admin(testAdminKey), http.StatusOK, 0)
		env.clock.advance(time.Second)
		mustAnswer(t, "the right bearer key after the wait", guesser.admin(testAdminKey), http.StatusOK, 0)
		for i := range freeAdminKeyGuesses {
			mustAnswer(t, fmt.Sprintf("wrong key %d after the right one", i+1), guesser.admin("guess"), http.StatusUnauthorized, 0)
		}
	})

	// Ensure keys sent all at once from one address are throttled like
	// keys sent one by one: the throttle counts a key before it is
	// checked, so only the free ones and one more are checked.
	t.Run("BurstsAreThrottledToo", func(t *testing.T) {
		clock := newFakeClock(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC))
		g := newGuessThrottle(clock.now)
		checked := 0
		for range 100 {
			if ok, _ := g.attempt("203.0.113.7"); ok {
				checked++
			}
		}
		if checked != freeAdminKeyGuesses+1 {
			t.Fatalf("%d of 100 keys sent at once were checked, want %d", checked, freeAdminKeyGuesses+1)
		}
	})

	// Ensure an address is forgotten guessMemory after its last wrong
	// key, and the table never holds more than guessTableSize addresses:
	// a new one pushes out the address whose last wrong key is oldest.
	t.Run("TableIsBounded", func(t *testing.T) {
		clock := newFakeClock(time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC))
		g := newGuessThrottle(clock.now)
		for range freeAdminKeyGuesses + 1 {
			g.attempt("first")
		}
		if ok, _ := g.attempt("first"); ok {
			t.Fatal("first was not made to wait")
		}
		for i := range 3 * guessTableSize {
			g.attempt(fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&0xff, i&0xff))
			if len(g.byAddress) > guessTableSize || g.byAge.Len() != len(g.byAddress) {
				t.Fatalf("after %d addresses the table holds %d (list %d), want at most %d", i+2, len(g.byAddress), g.byAge.Len(), guessTableSize)
			}
		}
		if _, ok := g.byAddress["first"]; ok {
			t.Fatal("the oldest address was kept")
		}
		if _, ok := g.byAddress[fmt.Sprintf("10.%d.%d.%d", (3*guessTableSize-1)>>16, (3*guessTableSize-1)>>8&0xff, (3*guessTableSize-1)&0xff)]; !ok {
			t.Fatal("the newest address was pushed out")
		}

		clock.advance(guessMemory + time.Second)
		g.attempt("last")
		if len(g.byAddress) != 1 {
			t.Fatalf("after guessMemory the table holds %d addresses, want the new one only", len(g.byAddress))
		}
	})
}
