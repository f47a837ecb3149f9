package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"

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
		hooked.RegisterCommitHook(func() int32 {
			hook()
			return 0 // go on with the commit
		})
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
		for _, req := range followers {
			outcome := <-req.done
			got = append(got, fmt.Sprintf("%v/%v", outcome.err, outcome.panicked))
		}
		if want := "[business rule says no/<nil> <nil>/<nil> <nil>/bug <nil>/<nil>]"; fmt.Sprint(got) != want {
			t.Fatalf("got %v, want %s", got, want)
		}
		if got := env.str(t, `SELECT group_concat(order_id) FROM (SELECT order_id FROM orders ORDER BY order_id)`); got != "ord_1,ord_2,ord_3" {
			t.Fatalf("stored %s, want ord_1,ord_2,ord_3", got)
		}
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
		if outcome := <-followers[0].done; !outcome.lead {
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
			if outcome := <-req.done; outcome.err != nil {
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
			if outcome := <-req.done; outcome.err != nil {
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
				for {
					g.mu.Lock()
					queued := len(g.waiting)
					g.mu.Unlock()
					if queued == 1 {
						return
					}
					runtime.Gosched()
				}
			})
		})
		if err := g.do(ctx, insertTestOrder("ord_1")); err != nil {
			t.Fatalf("first: %v", err)
		}
		r := <-next
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
