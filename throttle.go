// Throttling of admin-key guesses. The console's login form and every
// /admin request check the admin key of whoever can reach serve. Without a
// limit a guesser tries keys as fast as the network carries requests; with
// one, an address that sends wrong keys is made to wait, longer and longer,
// and then is locked out for a while, while the operator's right key still
// works from any other address.
//
// What counts as an address: the IP of the connection's peer
// (http.Request.RemoteAddr), and for IPv6 its /64, since one host commonly
// holds a whole /64. X-Forwarded-For is not read: any client can write it,
// and serve has no setting that says which proxy to believe. Behind a
// reverse proxy every client has the proxy's address, so guesses from
// anyone slow down everyone behind it: throttle there too, or reach the
// console without the proxy (on loopback, over SSH).
//
// The counts live in memory, per serve process, in a table of at most
// guessTableSize addresses. An attacker with many addresses cannot grow it;
// each new address when it is full pushes out the address whose last wrong
// key is oldest, so such an attacker can make the table forget a locked-out
// address early. That is the price of a bound: minAdminKeyLength keeps the
// key out of reach of guessing from many addresses anyway.

package main

import (
	"container/list"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"
)

// Limits on wrong admin keys from one address.
const (
	// freeAdminKeyGuesses is how many wrong keys in a row an address may
	// send without waiting: an operator's typos.
	freeAdminKeyGuesses = 5
	// firstGuessWait is how long an address waits after its first wrong
	// key beyond the free ones before its next key is checked; each wrong
	// key after it doubles the wait.
	firstGuessWait = time.Second
	// guessLockout caps the wait: from the 16th wrong key in a row on
	// (1 s doubled ten times passes it), each locks the address out this
	// long, about 100 guesses a day.
	guessLockout = 15 * time.Minute
	// guessMemory is how long an address's wrong keys are remembered after
	// its last one. Longer than guessLockout, so that waiting out a
	// lockout does not buy a new set of free guesses.
	guessMemory = time.Hour
	// guessTableSize bounds how many addresses are remembered, about a
	// hundred bytes each: a megabyte at most.
	guessTableSize = 10000
)

// guessThrottle counts the wrong admin keys of each address and says how
// long an address must wait before its next key is checked. Safe for
// concurrent use.
type guessThrottle struct {
	now func() time.Time

	mu sync.Mutex
	// byAddress finds an address's element of byAge.
	byAddress map[string]*list.Element
	// byAge holds *guessRecord, the oldest last guess at the front: the
	// first to forget when the table is full.
	byAge *list.List
}

// guessRecord is what the throttle remembers of one address.
type guessRecord struct {
	address string
	// wrong counts the keys in a row that were not the admin key.
	wrong int
	// last is when the last of them came.
	last time.Time
	// until is when the address may send a key again.
	until time.Time
}

// newGuessThrottle returns an empty throttle on the clock now.
func newGuessThrottle(now func() time.Time) *guessThrottle {
	return &guessThrottle{now: now, byAddress: map[string]*list.Element{}, byAge: list.New()}
}

// attempt is called before a key from address is checked. It returns
// false and how long to wait if address must not try yet. Otherwise it
// counts the key as wrong, making address wait if it has had its free
// guesses, and returns true; the caller calls succeeded if the key was
// right. Counting before the check means a burst of keys sent at once is
// throttled like keys sent one by one: only the first few are checked.
func (g *guessThrottle) attempt(address string) (bool, time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	record := g.recordOf(address, now)
	if wait := record.until.Sub(now); wait > 0 {
		return false, wait
	}
	record.wrong++
	record.last = now
	if beyond := record.wrong - freeAdminKeyGuesses; beyond > 0 {
		record.until = now.Add(guessWait(beyond))
	}
	g.byAge.MoveToBack(g.byAddress[address])
	return true, 0
}

// guessWait is the wait after the beyond-th wrong key past the free ones.
func guessWait(beyond int) time.Duration {
	if beyond > 20 {
		return guessLockout
	}
	return min(firstGuessWait<<(beyond-1), guessLockout)
}

// succeeded forgets the wrong keys of address, and of no other: the
// operator's login from one address does not clear a guesser's count at
// another.
func (g *guessThrottle) succeeded(address string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if element, ok := g.byAddress[address]; ok {
		g.byAge.Remove(element)
		delete(g.byAddress, address)
	}
}

// recordOf returns address's record, a new one if it has none or its last
// wrong key is older than guessMemory. A new record is added at the back
// of byAge; to make room, records older than guessMemory are dropped from
// the front, then, while the table is still full, the oldest.
func (g *guessThrottle) recordOf(address string, now time.Time) *guessRecord {
	if element, ok := g.byAddress[address]; ok {
		record := element.Value.(*guessRecord)
		if now.Sub(record.last) <= guessMemory {
			return record
		}
		g.byAge.Remove(element)
		delete(g.byAddress, address)
	}
	for front := g.byAge.Front(); front != nil; front = g.byAge.Front() {
		oldest := front.Value.(*guessRecord)
		if now.Sub(oldest.last) <= guessMemory && g.byAge.Len() < guessTableSize {
			break
		}
		g.byAge.Remove(front)
		delete(g.byAddress, oldest.address)
	}
	record := &guessRecord{address: address, last: now}
	g.byAddress[address] = g.byAge.PushBack(record)
	return record
}

// guessAddress returns the address r's guesses are counted under (see the
// file comment).
func guessAddress(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	ip = ip.Unmap().WithZone("")
	if ip.Is6() {
		prefix, err := ip.Prefix(64)
		if err != nil {
			panic("bug: an IPv6 address has no /64: " + err.Error())
		}
		return prefix.String()
	}
	return ip.String()
}

// retryAfterSeconds is wait as a Retry-After value: whole seconds, rounded
// up, so that a client that waits that long is heard.
func retryAfterSeconds(wait time.Duration) int {
	return int((wait + time.Second - 1) / time.Second)
}
