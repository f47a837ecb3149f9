// Key strings that two users chose, in the simulator.
//
// A client's Idempotency-Key is scoped to its user: two users who send the
// same string hold two keys, and neither may learn anything of the
// other's. Left to itself, the simulator never tested that: each client
// names its keys after itself ("c1-k4"), so no two users ever sent the same
// string, and a server that let a key string out of its user's scope (the
// processor's refund key built from the client's key, not from our refund
// id) passed. Real clients collide: a mobile app that counts its requests
// sends "order-1", "refund-1", "refund-2" for every user that runs it.
//
// So a new key is sometimes the next of such a counter, kept per user and
// per route: the users' counters run independently, and each string they
// reach is one the other user also sends, or will. Within a user the
// counter never repeats, so a user's clients never share a string by this
// structure (reusing one's own key is the key-reuse structure's), and the
// per-client lookups of the model stay per user. The model names every key
// by user and string (keyID); the database checks look a key up by its
// order or its user. A collision must never change what a user is told.

package main

import (
	"fmt"
	"slices"
	"strings"
)

// simSharedKeysCounts count the keys chosen by the shared counter scheme.
type simSharedKeysCounts struct {
	// CounterKeys counts the counter keys sent (a key reused takes one
	// and sends an earlier one instead); SharedKeys the keys sent whose
	// string another user had sent before.
	CounterKeys, SharedKeys int
}

// add adds other's counts to c.
func (c *simSharedKeysCounts) add(other simSharedKeysCounts) {
	c.CounterKeys += other.CounterKeys
	c.SharedKeys += other.SharedKeys
}

// String is the summary line's part.
func (c simSharedKeysCounts) String() string {
	return fmt.Sprintf("%d counter keys (%d keys another user also chose)", c.CounterKeys, c.SharedKeys)
}

// counterKeyChance is the chance that a new key is the next of its user's
// counter for its route rather than one in the client's own namespace.
const counterKeyChance = 0.3

// counterKey returns, some of the time, the next key of client's user's
// counter for scheme ("order", "refund"): "refund-3" for its third; or ""
// to use a key of the client's own.
func (s *simulation) counterKey(client *simClient, scheme string) string {
	if !s.chance(counterKeyChance) {
		return ""
	}
	if s.keyCounters == nil {
		s.keyCounters = map[string]int{}
	}
	counter := client.user + "\x00" + scheme
	s.keyCounters[counter]++
	return fmt.Sprintf("%s-%d", scheme, s.keyCounters[counter])
}

// sharedKeySent counts req's key, about to be sent, the first time its
// user sends it: as a counter key, and as shared if another user sent its
// string before.
func (s *simulation) sharedKeySent(req *simRequest) {
	if s.keyUsers == nil {
		s.keyUsers = map[string][]string{}
	}
	users := s.keyUsers[req.key]
	if slices.Contains(users, req.client.user) {
		return
	}
	if strings.HasPrefix(req.key, "order-") || strings.HasPrefix(req.key, "refund-") {
		s.report.Counts.CounterKeys++
	}
	if len(users) > 0 {
		s.report.Counts.SharedKeys++
	}
	s.keyUsers[req.key] = append(users, req.client.user)
}
