// Group commit: concurrent creates share one transaction. SQLite has one
// writer, and every commit costs a WAL append (and, with
// --durability=full, an fsync): one commit per request caps the API at
// what one commit at a time allows, however many clients wait. Here the
// requests that arrive while a transaction is running wait for it, then
// run together, each in its own SAVEPOINT of one transaction, and commit
// together. A request that fails rolls back to its savepoint and takes
// nothing else with it. No request returns before the commit that holds
// its writes (durable, at --durability=full).
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
	return &groupCommitter{db: db}
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
	outcome := <-req.done
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
// each in a savepoint, all in one transaction; commits it; tells each
// follower how its work went; and hands the lead to the first request that
// queued since, if any. Returns first's error (or goes on with its panic).
// The caller must have set g.leading.
func (g *groupCommitter) lead(first groupRequest) error {
	var own groupOutcome
	var followers []groupRequest
	var outcomes []groupOutcome
	err := withTx(context.Background(), g.db, func(tx *sql.Tx) error {
		followers, outcomes = nil, nil
		// The leader's work runs first, alone in the transaction: if it
		// fails, the transaction rolls back with nothing else in it, so it
		// needs no savepoint, and a lone request runs exactly as in a
		// transaction of its own.
		own = runRecovered(first.fn, tx)
		if own.failed() {
			return errLeaderFailed
		}
		// Those that queued while the batch ran join it: nobody waits for a
		// batch to fill, so a lone request commits at once, and under load
		// a batch grows by itself while the previous one commits.
		for len(followers) < maxGroupCommit-1 {
			joining := g.takeWaiting(maxGroupCommit - 1 - len(followers))
			if len(joining) == 0 {
				break
			}
			for _, follower := range joining {
				outcome, err := runInSavepoint(tx, follower.fn)
				if err != nil {
					return err
				}
				followers = append(followers, follower)
				outcomes = append(outcomes, outcome)
			}
		}
		return nil
	})
	for i, follower := range followers {
		if err != nil {
			// The commit failed: nothing of the batch is stored.
			follower.done <- groupOutcome{err: err}
			continue
		}
		follower.done <- outcomes[i]
	}
	g.handOver()
	if own.failed() {
		return own.result()
	}
	if err != nil {
		return err
	}
	return own.result()
}

// errLeaderFailed rolls back a batch whose leader's work failed; it never
// reaches a caller (lead returns the work's own error).
var errLeaderFailed = errors.New("the leader's work failed")

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
// savepoint's own: the transaction is unusable and the whole batch fails.
func runInSavepoint(tx *sql.Tx, fn func(tx *sql.Tx) error) (groupOutcome, error) {
	if _, err := tx.Exec(`SAVEPOINT request`); err != nil {
		return groupOutcome{}, fmt.Errorf("savepoint: %w", err)
	}
	outcome := runRecovered(fn, tx)
	if outcome.failed() {
		if _, err := tx.Exec(`ROLLBACK TO request`); err != nil {
			return groupOutcome{}, fmt.Errorf("rollback to savepoint: %w", err)
		}
	}
	if _, err := tx.Exec(`RELEASE request`); err != nil {
		return groupOutcome{}, fmt.Errorf("release savepoint: %w", err)
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
