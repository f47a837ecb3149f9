// Group commit, for --durability=full. With synchronous=FULL every commit
// waits for an fsync, and SQLite has one writer: one commit per request
// caps the API at what the disk can fsync per second, however many clients
// wait. Here one goroutine gathers the requests that are waiting, runs each
// in its own SAVEPOINT of one transaction, and commits them together: one
// fsync for the batch. A request that fails rolls back to its savepoint and
// takes nothing else with it. No request returns before the commit that
// holds its writes is on disk.
//
// The default path (durabilityNormal) does not use this file: createOrder's
// transaction is an ordinary withTx, the one a reader steps through.

package main

import (
	"context"
	"database/sql"
	"fmt"
)

// maxGroupCommit bounds a batch. Past a few dozen requests the fsync is
// amortised already, and a bigger batch only makes its first request wait.
const maxGroupCommit = 128

// groupCommitter commits the work of concurrent requests together.
type groupCommitter struct {
	db       *sql.DB
	requests chan groupRequest
}

// groupRequest is one request's work and where its result goes.
type groupRequest struct {
	fn   func(tx *sql.Tx) error
	done chan error
}

// newGroupCommitter returns a groupCommitter over db; run must be running
// for do to return.
func newGroupCommitter(db *sql.DB) *groupCommitter {
	return &groupCommitter{db: db, requests: make(chan groupRequest)}
}

// do runs fn in the next group commit and returns fn's error, or the
// commit's. It returns only once the commit is durable (or failed), even if
// ctx ends meanwhile: the caller must not answer before it knows. fn runs
// with a context that is never cancelled: one client hanging up mid-batch
// must not interrupt the statements of the others' shared transaction.
func (g *groupCommitter) do(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) error {
	req := newGroupRequest(ctx, fn)
	select {
	case g.requests <- req:
	case <-ctx.Done():
		return ctx.Err()
	}
	return <-req.done
}

// newGroupRequest wraps fn for a batch: it runs with ctx's values but never
// its cancellation.
func newGroupRequest(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) groupRequest {
	uncancelled := context.WithoutCancel(ctx)
	return groupRequest{
		fn:   func(tx *sql.Tx) error { return fn(uncancelled, tx) },
		done: make(chan error, 1),
	}
}

// run commits batches until ctx is done; then it returns. Each batch is the
// first waiting request plus every other already waiting: nobody waits for
// a batch to fill, so a lone request commits at once, and under load the
// batch grows by itself while the previous one fsyncs.
func (g *groupCommitter) run(ctx context.Context) {
	for {
		var batch []groupRequest
		select {
		case <-ctx.Done():
			return
		case first := <-g.requests:
			batch = append(batch, first)
		}
	gather:
		for len(batch) < maxGroupCommit {
			select {
			case req := <-g.requests:
				batch = append(batch, req)
			default:
				break gather
			}
		}
		g.commit(batch)
	}
}

// commit runs a batch in one transaction, each request in a savepoint, and
// tells every request how it went.
func (g *groupCommitter) commit(batch []groupRequest) {
	results := make([]error, len(batch))
	err := withTx(context.Background(), g.db, func(tx *sql.Tx) error {
		for i, req := range batch {
			if _, err := tx.Exec(`SAVEPOINT request`); err != nil {
				return fmt.Errorf("savepoint: %w", err)
			}
			results[i] = runRecovered(req.fn, tx)
			if results[i] != nil {
				if _, err := tx.Exec(`ROLLBACK TO request`); err != nil {
					return fmt.Errorf("rollback to savepoint: %w", err)
				}
			}
			if _, err := tx.Exec(`RELEASE request`); err != nil {
				return fmt.Errorf("release savepoint: %w", err)
			}
		}
		return nil
	})
	for i, req := range batch {
		if err != nil {
			// The commit failed: nothing of the batch is stored.
			req.done <- err
			continue
		}
		req.done <- results[i]
	}
}

// runRecovered runs fn, turning a panic into an error so that one request's
// bug rolls back its savepoint instead of taking the whole batch down.
func runRecovered(fn func(tx *sql.Tx) error, tx *sql.Tx) (err error) {
	defer func() {
		if recovered := recover(); recovered != nil {
			err = fmt.Errorf("panic in request: %v", recovered)
		}
	}()
	return fn(tx)
}

// writeTx runs fn, which claims the idempotency key (userID, key), in a
// transaction of its own (keyTx), or, when the App group commits, in a
// savepoint of the next group commit. fn must use the context it is given,
// not its caller's.
func (a *App) writeTx(ctx context.Context, userID, key string, fn func(ctx context.Context, tx *sql.Tx) error) error {
	if a.group != nil {
		return a.group.do(ctx, fn)
	}
	return keyTx(ctx, a.db, userID, key, func(tx *sql.Tx) error { return fn(ctx, tx) })
}
