package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"modernc.org/sqlite"
)

// mustOpenDurableApp returns an App over a new synchronous=FULL database;
// its creates group commit, as every SQLite App's do.
func mustOpenDurableApp(tb testing.TB) *testEnv {
	tb.Helper()
	env := MustOpenApp(tb)
	db, err := openDBWith(context.Background(), filepath.Join(tb.TempDir(), "full.db"), durabilityFull)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	env.app = newApp(db, env.clock.now, env.ids, env.fault.hook)
	return env
}

// goroutineID returns the id of the calling goroutine, from the first line
// of its stack ("goroutine 42 [running]:").
func goroutineID(tb testing.TB) int {
	tb.Helper()
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	field := bytes.Fields(buf)[1]
	id, err := strconv.Atoi(string(field))
	if err != nil {
		tb.Fatalf("read goroutine id from %q: %v", buf, err)
	}
	return id
}

// onCommit calls hook whenever the write connection of db commits. db must
// have one connection, as every SQLite write pool does.
func onCommit(tb testing.TB, db *sql.DB, hook func()) {
	tb.Helper()
	setCommitHook(tb, db, func() int32 {
		hook()
		return 0 // go on with the commit
	})
}

// refuseCommits makes every COMMIT on the write connection of db fail and
// roll back, as a commit that cannot reach the disk does.
func refuseCommits(tb testing.TB, db *sql.DB) {
	tb.Helper()
	setCommitHook(tb, db, func() int32 { return 1 }) // non-zero turns the COMMIT into a ROLLBACK
}

// setCommitHook registers hook as the commit hook of the write connection
// of db, which must have one connection.
func setCommitHook(tb testing.TB, db *sql.DB, hook sqlite.CommitHookFn) {
	tb.Helper()
	conn, err := db.Conn(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Close()
	err = conn.Raw(func(driverConn any) error {
		hooked, ok := driverConn.(*statementConn).sqliteDriverConn.(interface {
			RegisterCommitHook(sqlite.CommitHookFn)
		})
		if !ok {
			return fmt.Errorf("%T has no commit hook", driverConn)
		}
		hooked.RegisterCommitHook(hook)
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// insertTestOrder returns work that writes the order orderID.
func insertTestOrder(orderID string) func(ctx context.Context, tx *sql.Tx) error {
	return func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `
			INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, created_at, updated_at)
			VALUES (?, 'u', 1, 'usd', '[]', 'pm_card_visa', 'created', '', '')`, orderID)
		return err
	}
}

// queueFollowers makes g look as if a leader were running and fns had
// queued behind it, and returns their requests.
func queueFollowers(g *groupCommitter, fns ...func(ctx context.Context, tx *sql.Tx) error) []groupRequest {
	g.leading = true
	for _, fn := range fns {
		g.waiting = append(g.waiting, newGroupRequest(context.Background(), fn))
	}
	return g.waiting
}

// mustOpenSimDB returns the write pool of a new database reached through a
// simulated network (simulate_faults.go), which the test may take down.
func mustOpenSimDB(tb testing.TB) (*sql.DB, *simDatabase) {
	tb.Helper()
	network := &simDatabase{name: "database"}
	db, readers, err := openSimDatabase(context.Background(), filepath.Join(tb.TempDir(), "sim.db"), network)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close(); readers.Close() })
	return db, network
}

// mustStoreNoOrder fails tb if db holds an order.
func mustStoreNoOrder(tb testing.TB, db *sql.DB) {
	tb.Helper()
	var stored int
	if err := db.QueryRow(`SELECT COUNT(*) FROM orders`).Scan(&stored); err != nil || stored != 0 {
		tb.Fatalf("stored %d orders (%v)", stored, err)
	}
}

// leadWithin runs g.lead(first) and returns the panic it went on with,
// or its error. It fails tb if lead does not return within a minute: a
// request answered twice would block it.
func leadWithin(tb testing.TB, g *groupCommitter, first groupRequest) (panicked any, err error) {
	tb.Helper()
	type result struct {
		err      error
		panicked any
	}
	done := make(chan result, 1)
	go func() {
		defer func() {
			if recovered := recover(); recovered != nil {
				done <- result{panicked: recovered}
			}
		}()
		done <- result{err: g.lead(first)}
	}()
	select {
	case r := <-done:
		return r.panicked, r.err
	case <-time.After(time.Minute):
		tb.Fatal("lead did not return within a minute")
		return nil, nil
	}
}

// answersOf returns the answer each of followers has been sent, failing tb
// naming those that have none, or more than one.
func answersOf(tb testing.TB, followers []groupRequest) []groupOutcome {
	tb.Helper()
	var answers []groupOutcome
	var unanswered []int
	for i, req := range followers {
		select {
		case outcome := <-req.done:
			answers = append(answers, outcome)
		default:
			unanswered = append(unanswered, i)
		}
		if len(req.done) != 0 {
			tb.Fatalf("follower %d was answered twice", i)
		}
	}
	if len(unanswered) > 0 {
		tb.Fatalf("followers %v of %d were never answered", unanswered, len(followers))
	}
	return answers
}

// holdFirstBatch makes the first create that claims its key wait, inside
// its batch's transaction, until followers more requests have queued
// behind it: they all join its batch when it goes on. If they do not queue
// within a minute, that create fails saying how many did.
func holdFirstBatch(env *testEnv, followers int) {
	env.fault.set(func(point faultPoint, pass int) error {
		if point != faultAfterKeyClaim || pass != 1 {
			return nil
		}
		deadline := time.Now().Add(time.Minute)
		for {
			env.app.group.mu.Lock()
			queued := len(env.app.group.waiting)
			env.app.group.mu.Unlock()
			if queued >= followers {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%d requests queued behind the held batch, want %d", queued, followers)
			}
			runtime.Gosched()
		}
	})
}

// capFileAtItsSize sets the write connection's max_page_count to the
// file's size, and returns a function that lifts the cap. Until then an
// insert that needs a new page fails with SQLITE_FULL, as on a full disk,
// while one that fits in a page with room succeeds: a batch fails
// part-way. The pragma belongs to the connection (db.go opens one write
// connection), so that connection must not be closed for idling meanwhile.
func capFileAtItsSize(tb testing.TB, env *testEnv) (lift func()) {
	tb.Helper()
	env.app.db.SetConnMaxIdleTime(0)
	pages := env.count(tb, `PRAGMA page_count`)
	if got := env.count(tb, fmt.Sprintf(`PRAGMA max_page_count = %d`, pages)); got != pages {
		tb.Fatalf("max_page_count is %d, want the file's %d pages", got, pages)
	}
	return func() {
		tb.Helper()
		if got := env.count(tb, `PRAGMA max_page_count = 1000000000`); got <= pages {
			tb.Fatalf("max_page_count is still %d", got)
		}
	}
}

// keyedResponse is what the client that sent key saw, or why it saw
// nothing.
type keyedResponse struct {
	key string
	response
	err error
}

func TestGroupCommit(t *testing.T) {
	if onPostgres() {
		t.Skip("group commit is SQLite's; on PostgreSQL each create is its own keyTx")
	}
	ctx := context.Background()

	// Ensure a lone request runs its transaction on the goroutine that
	// called it, so that a debugger steps from the handler into it.
	t.Run("LoneRequestRunsOnItsOwnGoroutine", func(t *testing.T) {
		env := MustOpenApp(t)
		caller := goroutineID(t)
		var worker int
		env.app.fault = func(ctx context.Context, point faultPoint) error {
			if point == faultAfterKeyClaim {
				worker = goroutineID(t)
			}
			return nil
		}
		mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
		if worker != caller {
			t.Fatalf("the transaction ran on goroutine %d, want the caller's %d", worker, caller)
		}
	})

	// Ensure one failing request in a batch rolls back only its own writes,
	// and a panic goes on in its own request, not in the batch.
	t.Run("FailureRollsBackOnlyItsSavepoint", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		failing := func(ctx context.Context, tx *sql.Tx) error {
			if err := insertTestOrder("ord_failing")(ctx, tx); err != nil {
				return err
			}
			return errors.New("business rule says no")
		}
		panicking := func(ctx context.Context, tx *sql.Tx) error {
			if err := insertTestOrder("ord_panicking")(ctx, tx); err != nil {
				return err
			}
			panic("bug")
		}
		followers := queueFollowers(g, failing, insertTestOrder("ord_2"), panicking, insertTestOrder("ord_3"))
		if err := g.lead(newGroupRequest(ctx, insertTestOrder("ord_1"))); err != nil {
			t.Fatalf("leader: %v", err)
		}
		var got []string
		for i, req := range followers {
			outcome := mustReceive(t, fmt.Sprintf("follower %d's answer", i), req.done)
			got = append(got, fmt.Sprintf("%v/%v", outcome.err, outcome.panicked))
		}
		if want := "[business rule says no/<nil> <nil>/<nil> <nil>/bug <nil>/<nil>]"; fmt.Sprint(got) != want {
			t.Fatalf("got %v, want %s", got, want)
		}
		if got := env.str(t, `SELECT group_concat(order_id) FROM (SELECT order_id FROM orders ORDER BY order_id)`); got != "ord_1,ord_2,ord_3" {
			t.Fatalf("stored %s, want ord_1,ord_2,ord_3", got)
		}
	})

	// Ensure that when a member loses the batch's transaction (SQLite
	// rolls it all back on SQLITE_FULL, IOERR or NOMEM), or its savepoint
	// cannot be released, every request taken into the batch gets exactly
	// one answer: the member at fault its failure, and the others, run
	// again without it, their commit. Nothing of the member at fault is
	// stored.
	t.Run("EveryMemberAnsweredWhenOneLosesTheTransaction", func(t *testing.T) {
		tests := []struct {
			name string
			// lose writes ord_faulty and breaks the transaction.
			lose func(ctx context.Context, tx *sql.Tx) error
		}{
			// What SQLite does on SQLITE_FULL, IOERR or NOMEM: the whole
			// transaction rolls back, and the statement fails.
			{"WorkFailsAndTheTransactionRollsBack", func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `ROLLBACK`); err != nil {
					return err
				}
				return errors.New("database or disk is full")
			}},
			// Work that ignored such a failure and went on.
			{"WorkSucceedsAfterTheTransactionRolledBack", func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, `ROLLBACK`)
				return err
			}},
			// A write statement still running: SQLite refuses to release
			// the savepoint (SQLITE_BUSY).
			{"ReleaseFails", func(ctx context.Context, tx *sql.Tx) error {
				_, err := tx.QueryContext(ctx, `UPDATE orders SET status = status RETURNING order_id`)
				return err
			}},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				env := MustOpenApp(t)
				g := newGroupCommitter(env.app.db)
				faulty := func(ctx context.Context, tx *sql.Tx) error {
					if err := insertTestOrder("ord_faulty")(ctx, tx); err != nil {
						return err
					}
					return tt.lose(ctx, tx)
				}
				followers := queueFollowers(g, insertTestOrder("ord_2"), insertTestOrder("ord_3"), faulty, insertTestOrder("ord_4"), insertTestOrder("ord_5"))
				if panicked, err := leadWithin(t, g, newGroupRequest(ctx, insertTestOrder("ord_1"))); err != nil || panicked != nil {
					t.Fatalf("leader: %v %v, want its commit", err, panicked)
				}
				for i, outcome := range answersOf(t, followers) {
					if i == 2 && outcome.err == nil {
						t.Fatalf("the follower at fault got no error")
					}
					if i != 2 && outcome.failed() {
						t.Fatalf("follower %d got %v %v, want its commit", i, outcome.err, outcome.panicked)
					}
				}
				if got := env.str(t, `SELECT group_concat(order_id) FROM (SELECT order_id FROM orders ORDER BY order_id)`); got != "ord_1,ord_2,ord_3,ord_4,ord_5" {
					t.Fatalf("stored %s, want ord_1 to ord_5", got)
				}
				if g.leading {
					t.Fatal("still leading after the batch")
				}
			})
		}
	})

	// Ensure a failed COMMIT answers every request in the batch, the
	// leader too, with its error, and stores nothing.
	t.Run("EveryMemberAnsweredWhenTheCommitFails", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		followers := queueFollowers(g, insertTestOrder("ord_2"), insertTestOrder("ord_3"))
		refuseCommits(t, env.app.db)
		if _, err := leadWithin(t, g, newGroupRequest(ctx, insertTestOrder("ord_1"))); err == nil {
			t.Fatal("the leader got no error")
		}
		for i, outcome := range answersOf(t, followers) {
			if outcome.err == nil {
				t.Fatalf("follower %d got no error", i)
			}
		}
		setCommitHook(t, env.app.db, nil)
		if n := env.count(t, `SELECT COUNT(*) FROM orders`); n != 0 {
			t.Fatalf("stored %d orders", n)
		}
	})

	// Ensure that when the database goes away in the middle of a batch,
	// every request in it is answered with an error that says so (an HTTP
	// 503), and nothing is stored.
	t.Run("EveryMemberAnsweredWhenTheDatabaseGoesAway", func(t *testing.T) {
		db, network := mustOpenSimDB(t)
		g := newGroupCommitter(db)
		goingAway := func(ctx context.Context, tx *sql.Tx) error {
			network.down = true
			return insertTestOrder("ord_gone")(ctx, tx)
		}
		followers := queueFollowers(g, insertTestOrder("ord_2"), goingAway, insertTestOrder("ord_3"))
		_, err := leadWithin(t, g, newGroupRequest(ctx, insertTestOrder("ord_1")))
		if !isDatabaseUnavailable(err) {
			t.Fatalf("the leader got %v, want the database unavailable", err)
		}
		for i, outcome := range answersOf(t, followers) {
			if !isDatabaseUnavailable(outcome.err) {
				t.Fatalf("follower %d got %v, want the database unavailable", i, outcome.err)
			}
		}
		network.down = false
		mustStoreNoOrder(t, db)
	})

	// Ensure that a panic of the batch's own code (here, the driver's, as
	// a member's savepoint is released) still answers every request taken
	// into the batch, and hands the lead on to the request that queued
	// after them.
	t.Run("EveryMemberAnsweredWhenTheBatchPanics", func(t *testing.T) {
		db, network := mustOpenSimDB(t)
		var once sync.Once
		network.refused = func() { once.Do(func() { panic("driver bug") }) }
		g := newGroupCommitter(db)
		next := newGroupRequest(ctx, insertTestOrder("ord_next"))
		breaking := func(ctx context.Context, tx *sql.Tx) error {
			if err := insertTestOrder("ord_breaking")(ctx, tx); err != nil {
				return err
			}
			g.mu.Lock()
			g.waiting = append(g.waiting, next) // queued after the batch was taken
			g.mu.Unlock()
			network.down = true // its RELEASE panics
			return nil
		}
		followers := queueFollowers(g, insertTestOrder("ord_2"), breaking, insertTestOrder("ord_3"))
		if panicked, _ := leadWithin(t, g, newGroupRequest(ctx, insertTestOrder("ord_1"))); panicked != "driver bug" {
			t.Fatalf("lead went on with %v, want the driver's panic", panicked)
		}
		for i, outcome := range answersOf(t, followers) {
			if !errors.Is(outcome.err, errBatchLost) {
				t.Fatalf("follower %d got %v %v, want %v", i, outcome.err, outcome.panicked, errBatchLost)
			}
		}
		if outcome := mustReceive(t, "the next request's answer", next.done); !outcome.lead {
			t.Fatalf("the request queued after the batch got %+v, want the lead", outcome)
		}
		network.down = false
		mustStoreNoOrder(t, db)
	})

	// Ensure a leader whose own work fails rolls back alone, and the
	// request that queued behind it leads the next batch.
	t.Run("FailedLeaderHandsTheLeadOn", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		followers := queueFollowers(g, insertTestOrder("ord_2"))
		failing := func(ctx context.Context, tx *sql.Tx) error {
			if err := insertTestOrder("ord_failing")(ctx, tx); err != nil {
				return err
			}
			return errors.New("business rule says no")
		}
		if err := g.lead(newGroupRequest(ctx, failing)); err == nil || err.Error() != "business rule says no" {
			t.Fatalf("leader got %v, want its own error", err)
		}
		if outcome := mustReceive(t, "the follower's answer", followers[0].done); !outcome.lead {
			t.Fatalf("follower got %+v, want the lead", outcome)
		}
		if err := g.lead(followers[0]); err != nil {
			t.Fatalf("next leader: %v", err)
		}
		if got := env.str(t, `SELECT group_concat(order_id) FROM orders`); got != "ord_2" {
			t.Fatalf("stored %s, want ord_2", got)
		}
	})

	// Ensure a client that hangs up while its work runs in a batch does not
	// interrupt the others' shared transaction.
	t.Run("CancelledClientDoesNotFailTheBatch", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		gone, hangUp := context.WithCancel(ctx)
		g.leading = true
		g.waiting = []groupRequest{
			newGroupRequest(gone, func(ctx context.Context, tx *sql.Tx) error {
				hangUp()
				return insertTestOrder("ord_gone")(ctx, tx)
			}),
			newGroupRequest(ctx, insertTestOrder("ord_2")),
		}
		followers := g.waiting
		if err := g.lead(newGroupRequest(ctx, insertTestOrder("ord_1"))); err != nil {
			t.Fatalf("leader: %v", err)
		}
		for i, req := range followers {
			if outcome := mustReceive(t, fmt.Sprintf("follower %d's answer", i), req.done); outcome.err != nil {
				t.Fatalf("follower %d: %v", i, outcome.err)
			}
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 3 {
			t.Fatalf("got %d orders, want 3", got)
		}
	})

	// Ensure no follower hears how its work went before the commit that
	// holds it.
	t.Run("NoRequestReturnsBeforeItsCommit", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		followers := queueFollowers(g, insertTestOrder("ord_2"), insertTestOrder("ord_3"))
		commits := 0
		onCommit(t, env.app.db, func() {
			commits++
			for i, req := range followers {
				if len(req.done) != 0 {
					t.Errorf("follower %d was answered before the commit", i)
				}
			}
		})
		if err := g.lead(newGroupRequest(ctx, insertTestOrder("ord_1"))); err != nil {
			t.Fatalf("leader: %v", err)
		}
		for i, req := range followers {
			if outcome := mustReceive(t, fmt.Sprintf("follower %d's answer", i), req.done); outcome.err != nil {
				t.Fatalf("follower %d: %v", i, outcome.err)
			}
		}
		if commits != 1 {
			t.Fatalf("got %d commits, want the batch's one", commits)
		}
	})

	// Ensure a request that queues while a batch commits is handed the lead
	// of the next batch and runs it on its own goroutine.
	t.Run("RequestQueuedDuringCommitLeadsTheNext", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		type result struct {
			err       error
			goroutine int
			ranOn     int
		}
		next := make(chan result, 1)
		once := sync.Once{}
		onCommit(t, env.app.db, func() {
			once.Do(func() {
				go func() {
					var r result
					r.goroutine = goroutineID(t)
					r.err = g.do(ctx, func(ctx context.Context, tx *sql.Tx) error {
						r.ranOn = goroutineID(t)
						return insertTestOrder("ord_next")(ctx, tx)
					})
					next <- r
				}()
				// Hold the commit until the request has queued.
				eventually(t, "the next request to queue", waitLimit, func() (bool, string) {
					g.mu.Lock()
					queued := len(g.waiting)
					g.mu.Unlock()
					return queued == 1, fmt.Sprintf("%d queued", queued)
				})
			})
		})
		if err := g.do(ctx, insertTestOrder("ord_1")); err != nil {
			t.Fatalf("first: %v", err)
		}
		r := mustReceive(t, "the queued request's answer", next)
		if r.err != nil {
			t.Fatalf("next: %v", r.err)
		}
		if r.ranOn != r.goroutine {
			t.Fatalf("the next batch ran on goroutine %d, want its leader's %d", r.ranOn, r.goroutine)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 2 {
			t.Fatalf("got %d orders, want 2", got)
		}
		if g.leading {
			t.Fatal("still leading after the last batch")
		}
	})

	// Ensure that when SQLite rolls a batch's whole transaction back
	// part-way (SQLITE_FULL: the file can grow no more), every request taken
	// into the batch gets one answer: a 201, or a 503 problem saying to
	// retry under the same key. A 503 stored nothing, and its retry, once
	// there is room, makes exactly one order.
	t.Run("EveryMemberAnsweredWhenTheDiskIsFull", func(t *testing.T) {
		env := MustOpenApp(t)
		baseURL := newUnwaitedTestServer(t, env)
		client := &http.Client{Transport: &http.Transport{}}
		t.Cleanup(client.CloseIdleConnections)
		const clients = 25
		body := orderBody(100, "sku-1", 1, pmCardVisa)
		holdFirstBatch(env, clients-1)
		liftCap := capFileAtItsSize(t, env)
		answers := make(chan keyedResponse, clients)
		for i := range clients {
			go func() {
				key := fmt.Sprintf("disk-full-%02d", i)
				r, err := sendWith(client, "POST", baseURL+"/api/orders", keyUser42, key, body)
				answers <- keyedResponse{key: key, response: r, err: err}
			}()
		}
		got := map[string]response{}
		deadline := time.After(time.Minute)
		for len(got) < clients {
			select {
			case answer := <-answers:
				if answer.err != nil {
					t.Fatalf("%s: %v", answer.key, answer.err)
				}
				got[answer.key] = answer.response
			case <-deadline:
				var unanswered []string
				for i := range clients {
					if key := fmt.Sprintf("disk-full-%02d", i); got[key].Status == 0 {
						unanswered = append(unanswered, key)
					}
				}
				t.Fatalf("%d of the %d requests held in one batch were never answered: %v", len(unanswered), clients, unanswered)
			}
		}
		created := 0
		for key, r := range got {
			switch r.Status {
			case 201:
				created++
			case 503:
				if problemTypeOf(t, r) != problemUnavailable || r.Header.Get("Retry-After") == "" {
					t.Fatalf("%s: got 503 %s with Retry-After %q, want %s with Retry-After", key, r.Body, r.Header.Get("Retry-After"), problemUnavailable)
				}
				if n := env.count(t, `SELECT COUNT(*) FROM idempotency_keys WHERE idempotency_key = ?`, key); n != 0 {
					t.Fatalf("%s was answered 503, and its key was stored", key)
				}
			default:
				t.Fatalf("%s: got %d %s, want 201, or 503 to retry", key, r.Status, r.Body)
			}
		}
		if created == clients {
			t.Fatalf("all %d were created: the cap on the file never failed an insert", clients)
		}
		if n := env.count(t, `SELECT COUNT(*) FROM orders`); n != created {
			t.Fatalf("got %d orders for %d 201s", n, created)
		}
		t.Logf("with the file full: %d created, %d answered 503", created, clients-created)

		liftCap()
		for key, first := range got {
			retry, err := sendWith(client, "POST", baseURL+"/api/orders", keyUser42, key, body)
			if err != nil || retry.Status != 201 {
				t.Fatalf("the retry of %s (first answered %d) got %d %s %v, want 201", key, first.Status, retry.Status, retry.Body, err)
			}
			if first.Status == 201 && retry.Body != first.Body {
				t.Fatalf("the retry of %s got %s, want its replay %s", key, retry.Body, first.Body)
			}
		}
		if n := env.count(t, `SELECT COUNT(*) FROM (SELECT DISTINCT idempotency_key FROM orders)`); n != clients || env.count(t, `SELECT COUNT(*) FROM orders`) != clients {
			t.Fatalf("got %d orders under %d keys, want one under each of %d", env.count(t, `SELECT COUNT(*) FROM orders`), n, clients)
		}
		mustAudit(t, env, false)
	})

	// Ensure concurrent orders through the group committer each commit once,
	// and duplicates of one key in the same run replay.
	t.Run("ConcurrentOrdersCommitOnce", func(t *testing.T) {
		env := mustOpenDurableApp(t)
		const clients = 64
		var wg sync.WaitGroup
		responses := make([]apiResponse, clients)
		errs := make([]error, clients)
		for i := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Every fourth client retries another's key.
				key := fmt.Sprintf("k%d", i-i%4)
				req, order := newOrderRequest(t, "user-42", key, orderBody(100, "sku-1", 1, pmCardVisa))
				responses[i], errs[i] = env.app.createOrder(context.Background(), req, order)
			}()
		}
		wg.Wait()
		fresh := 0
		for i := range clients {
			if errs[i] != nil {
				t.Fatalf("client %d: %v", i, errs[i])
			}
			if !responses[i].Replayed {
				fresh++
			}
		}
		if fresh != clients/4 || env.count(t, `SELECT COUNT(*) FROM orders`) != clients/4 {
			t.Fatalf("got %d fresh responses and %d orders, want %d", fresh, env.count(t, `SELECT COUNT(*) FROM orders`), clients/4)
		}
		mustAudit(t, env, false)
	})
}
