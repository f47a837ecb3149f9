// Group commit: concurrent creates share one transaction. SQLite has one
// writer, and every commit costs a WAL append (and, with
// --durability=full, an fsync): one commit per request caps the API at
// what one commit at a time allows, however many clients wait. Here the
// requests that arrive while a transaction is running wait for it, then
// run together, each in its own SAVEPOINT of one transaction, and commit
// together. A request that fails rolls back to its savepoint and takes
// nothing else with it; one whose failure takes SQLite's whole
// transaction down (a full disk) is answered alone, and the others run
// again without it. No request returns before the commit that holds its
// writes (durable, at --durability=full), and every request taken into a
// batch gets exactly one answer, whatever fails.
//
// Leader and follower, as PostgreSQL's WAL-insert leader: the request that
// finds no batch running leads one, on its own goroutine: its own work
// first, then that of the followers that queued meanwhile. So a lone
// request, as in the demo, runs its transaction on the goroutine that
// handles it, exactly as in a transaction of its own, and a debugger steps
// from the handler into it.
//
// PostgreSQL does not use this file: it runs transactions side by side,
// and createOrder's is an ordinary keyTx.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
)

// maxGroupCommit bounds a batch. Past a few dozen requests the commit is
// amortised already, and a bigger batch only makes its first request wait.
const maxGroupCommit = 128

// groupCommitter commits the work of concurrent requests together.
type groupCommitter struct {
	db *sql.DB

	mu sync.Mutex
	// leading is true while a request leads a batch (see do).
	leading bool
	// waiting are the followers queued for a batch.
	waiting []groupRequest

	// wait is how a follower waits for its outcome: a receive from done.
	// The deterministic simulator, which runs one request at a time,
	// waits by handing control back to its scheduler instead, so that it
	// can queue several requests behind a leader.
	wait func(done chan groupOutcome) groupOutcome
}

// groupRequest is one request's work and where its outcome goes.
type groupRequest struct {
	fn   func(tx *sql.Tx) error
	done chan groupOutcome
}

// groupOutcome is how a request's work went, once its batch has committed;
// or, sent to a follower, that it leads the next batch.
type groupOutcome struct {
	err error
	// panicked is what the work panicked with, if it did: its savepoint is
	// rolled back, and the panic goes on in the request's own goroutine.
	panicked any
	lead     bool
}

// failed reports whether the work returned an error or panicked.
func (o groupOutcome) failed() bool {
	return o.err != nil || o.panicked != nil
}

// result returns the request's error, or goes on with its panic.
func (o groupOutcome) result() error {
	if o.panicked != nil {
		panic(o.panicked)
	}
	return o.err
}

// newGroupCommitter returns a groupCommitter over db.
func newGroupCommitter(db *sql.DB) *groupCommitter {
	return &groupCommitter{db: db, wait: receiveOutcome}
}

// receiveOutcome waits for the outcome sent on done.
func receiveOutcome(done chan groupOutcome) groupOutcome {
	return <-done
}

// do runs fn in a group commit and returns fn's error, or the commit's. It returns only once the commit is done (or failed), even
// if ctx ends meanwhile: the caller must not answer before it knows. fn runs
// with a context that is never cancelled: one client hanging up mid-batch
// must not interrupt the statements of the others' shared transaction.
//
// If no batch is running, the caller leads one, on its own goroutine; else
// it queues, and either gets its outcome from that batch's leader or is
// handed the lead of the next batch.
func (g *groupCommitter) do(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) error {
	req := newGroupRequest(ctx, fn)
	g.mu.Lock()
	if !g.leading {
		g.leading = true
		g.mu.Unlock()
		return g.lead(req)
	}
	g.waiting = append(g.waiting, req)
	g.mu.Unlock()
	outcome := g.wait(req.done)
	if outcome.lead {
		return g.lead(req)
	}
	return outcome.result()
}

// newGroupRequest wraps fn for a batch: it runs with ctx's values but never
// its cancellation.
func newGroupRequest(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) groupRequest {
	uncancelled := context.WithoutCancel(ctx)
	return groupRequest{
		fn:   func(tx *sql.Tx) error { return fn(uncancelled, tx) },
		done: make(chan groupOutcome, 1),
	}
}

// lead runs one batch: first's work, then that of the followers waiting,
// each in a savepoint, all in one transaction; commits it; answers every
// request it took, first included, exactly once; and hands the lead to the
// first request that queued since, if any. Returns first's error (or goes
// on with its panic). The caller must have set g.leading.
//
// A request whose work fails rolls back its savepoint only. But SQLite
// rolls back the whole transaction when a statement fails with
// SQLITE_FULL (the file reached max_page_count, or the disk is full),
// SQLITE_IOERR or SQLITE_NOMEM: the savepoint is gone, and with it every
// member's writes. Then the member at fault is answered with its failure,
// and the others run again, in a fresh transaction without it (see
// runAgain).
func (g *groupCommitter) lead(first groupRequest) error {
	b := &batch{members: []groupRequest{first}}
	defer func() {
		// Only a panic of the batch's own code gets here with members
		// unanswered (runRecovered catches a request's): each still gets
		// its answer, or it would wait for ever, and serve's shutdown
		// with it; the panic goes on in first's goroutine.
		b.answerAll(groupOutcome{err: fmt.Errorf("%w: the group commit panicked", errBatchLost)})
		g.handOver()
	}()
	err := withTx(context.Background(), g.db, func(tx *sql.Tx) error {
		b.outcomes = nil
		// The leader's work runs first, alone in the transaction: if it
		// fails, the transaction rolls back with nothing else in it, so it
		// needs no savepoint, and a lone request runs exactly as in a
		// transaction of its own.
		own := runRecovered(first.fn, tx)
		b.outcomes = append(b.outcomes, own)
		if own.failed() {
			return errLeaderFailed
		}
		// Those that queued while the batch ran join it: nobody waits for a
		// batch to fill, so a lone request commits at once, and under load
		// a batch grows by itself while the previous one commits.
		for len(b.members) < maxGroupCommit {
			joining := g.takeWaiting(maxGroupCommit - len(b.members))
			if len(joining) == 0 {
				break
			}
			b.members = append(b.members, joining...)
			for _, follower := range joining {
				if err := b.runMember(tx, follower); err != nil {
					return err
				}
			}
		}
		return nil
	})
	for b.settle(err) {
		err = b.runAgain(g.db)
	}
	return (<-first.done).result()
}

// runAgain runs the work of b's members again, each in a savepoint of a
// fresh transaction, after their previous transaction was lost to another
// member (see settle).
//
// They run again, rather than being answered 503 with the member at
// fault, because what lost the transaction was one statement of one
// member, and without it the others may well fit: the members before it
// did, on a file with room for a few more orders; the statement that ran
// out of memory may have been the one big request. It cannot go on for
// ever on a disk that stays full: each lost transaction answers its member
// at fault, so there are at most as many runs as members, and no new
// follower joins them (those wait for the next leader). The price, on a
// full disk, is running the members before the one at fault again for
// each run: at most about maxGroupCommit²/2 members' work, once, instead
// of failing requests that fit.
func (b *batch) runAgain(db *sql.DB) error {
	return withTx(context.Background(), db, func(tx *sql.Tx) error {
		b.outcomes = nil
		for _, member := range b.members {
			if err := b.runMember(tx, member); err != nil {
				return err
			}
		}
		return nil
	})
}

// batch is the requests that one leader has taken, until each has had its
// one answer.
type batch struct {
	// members are the requests taken and not answered yet, in the order
	// their work runs.
	members []groupRequest
	// outcomes say how the work of members[:len(outcomes)] went in the
	// current transaction.
	outcomes []groupOutcome
}

// runMember runs member's work in a savepoint of tx and records how it
// went. Returns an error wrapping errBatchLost if the transaction is lost
// or unusable: the member's savepoint could not be opened, rolled back or
// released.
func (b *batch) runMember(tx *sql.Tx, member groupRequest) error {
	outcome, err := runInSavepoint(tx, member.fn)
	b.outcomes = append(b.outcomes, outcome)
	if err != nil {
		return fmt.Errorf("%w: %w", errBatchLost, err)
	}
	return nil
}

// settle answers b's members after a transaction that ended with err, and
// reports whether the members left must run again:
//   - committed (err nil): each gets how its work went;
//   - first's own work failed (errLeaderFailed): it rolled back alone, and
//     first gets how its work failed;
//   - lost part-way (errBatchLost): the member whose work or savepoint lost
//     it gets its failure, and the others must run again;
//   - BEGIN or COMMIT failed: nothing of it is stored, and each gets err.
func (b *batch) settle(err error) bool {
	switch {
	case err == nil, errors.Is(err, errLeaderFailed):
		for i, member := range b.members {
			member.done <- b.outcomes[i]
		}
		b.members = nil
		return false
	case errors.Is(err, errBatchLost):
		atFault := len(b.outcomes) - 1
		outcome := b.outcomes[atFault]
		if !outcome.failed() {
			// Its work went well, and its savepoint did not: it is the
			// one the transaction was lost at all the same.
			outcome = groupOutcome{err: err}
		}
		b.members[atFault].done <- outcome
		b.members = slices.Delete(b.members, atFault, atFault+1)
		return len(b.members) > 0
	default:
		b.answerAll(groupOutcome{err: err})
		return false
	}
}

// answerAll answers every member not answered yet with outcome.
func (b *batch) answerAll(outcome groupOutcome) {
	for _, member := range b.members {
		member.done <- outcome
	}
	b.members = nil
}

// Why a batch failed as a whole.
var (
	// errLeaderFailed rolls back a batch whose leader's work failed; it
	// never reaches a caller (the leader gets its work's own error).
	errLeaderFailed = errors.New("the leader's work failed")
	// errBatchLost: a group commit's transaction was lost part-way (SQLite
	// rolled it all back, or a savepoint statement failed), so nothing of
	// it is stored. It is transient: the request may be retried under the
	// same key, and an HTTP client gets 503, never 500.
	errBatchLost = errors.New("the group commit's transaction was lost")
)

// takeWaiting removes up to n waiting followers from the queue and returns
// them.
func (g *groupCommitter) takeWaiting(n int) []groupRequest {
	g.mu.Lock()
	defer g.mu.Unlock()
	n = min(n, len(g.waiting))
	taken := g.waiting[:n:n]
	g.waiting = g.waiting[n:]
	return taken
}

// handOver ends a leader's turn: the first follower still waiting leads the
// next batch, or, if none is, the next request to come leads.
func (g *groupCommitter) handOver() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.waiting) == 0 {
		g.leading = false
		return
	}
	next := g.waiting[0]
	g.waiting = g.waiting[1:]
	next.done <- groupOutcome{lead: true}
}

// runInSavepoint runs fn in a savepoint of tx and returns how it went; fn's
// writes are rolled back if it fails or panics. The error is the
// savepoint's own (the outcome says how fn went, if it ran): the
// transaction is lost or unusable, and the whole batch with it.
func runInSavepoint(tx *sql.Tx, fn func(tx *sql.Tx) error) (groupOutcome, error) {
	if _, err := tx.Exec(`SAVEPOINT request`); err != nil {
		return groupOutcome{}, fmt.Errorf("savepoint: %w", err)
	}
	outcome := runRecovered(fn, tx)
	if outcome.failed() {
		if _, err := tx.Exec(`ROLLBACK TO request`); err != nil {
			return outcome, fmt.Errorf("rollback to savepoint: %w", err)
		}
	}
	if _, err := tx.Exec(`RELEASE request`); err != nil {
		return outcome, fmt.Errorf("release savepoint: %w", err)
	}
	return outcome, nil
}

// runRecovered runs fn and returns its error, or the panic it raised: one
// request's bug rolls back its savepoint instead of taking the whole batch
// down.
func runRecovered(fn func(tx *sql.Tx) error, tx *sql.Tx) (outcome groupOutcome) {
	defer func() {
		if recovered := recover(); recovered != nil {
			outcome = groupOutcome{panicked: recovered}
		}
	}()
	return groupOutcome{err: fn(tx)}
}

// groupWriter is the keyWriter of a SQLite App that serves many clients:
// fn runs in a savepoint of the next group commit (BEGIN IMMEDIATE, one
// fsync for the whole group).
func groupWriter(g *groupCommitter) keyWriter {
	return func(ctx context.Context, userID, key string, fn func(ctx context.Context, tx *sql.Tx) error) error {
		return g.do(ctx, fn)
	}
}

// withoutGroupCommit makes a's creates commit one by one, each in a
// transaction of its own.
func (a *App) withoutGroupCommit() {
	a.group = nil
	a.writeTx = ownTxWriter(a.db)
}
