package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
)

// mustOpenDurableApp returns an App over a new synchronous=FULL database
// that group commits its API writes until the test ends.
func mustOpenDurableApp(tb testing.TB) *testEnv {
	tb.Helper()
	env := MustOpenApp(tb)
	db, err := openDBWith(context.Background(), filepath.Join(tb.TempDir(), "full.db"), durabilityFull)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	env.app = newApp(db, env.clock.now, env.ids, env.fault.hook)
	ctx, cancel := context.WithCancel(context.Background())
	env.app.group = newGroupCommitter(db)
	go env.app.group.run(ctx)
	tb.Cleanup(cancel)
	return env
}

func TestGroupCommit(t *testing.T) {
	// Ensure one failing request in a batch rolls back only its own writes,
	// and a panic is that request's error, not the batch's.
	t.Run("FailureRollsBackOnlyItsSavepoint", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		insert := func(orderID string) func(tx *sql.Tx) error {
			return func(tx *sql.Tx) error {
				return insertOrder(context.Background(), tx, orderRow{OrderID: orderID, UserID: "u", AmountCents: 1, Currency: "usd",
					Items: []orderItem{{SKU: "sku-1", Qty: 1}}, PaymentMethod: pmCardVisa, Status: orderCreated, CreatedAt: formatTime(env.clock.now())})
			}
		}
		failing := func(tx *sql.Tx) error {
			if err := insert("ord_failing")(tx); err != nil {
				return err
			}
			return errors.New("business rule says no")
		}
		panicking := func(tx *sql.Tx) error {
			if err := insert("ord_panicking")(tx); err != nil {
				return err
			}
			panic("bug")
		}
		fns := []func(tx *sql.Tx) error{insert("ord_1"), failing, insert("ord_2"), panicking, insert("ord_3")}
		var batch []groupRequest
		for _, fn := range fns {
			batch = append(batch, groupRequest{fn: fn, done: make(chan error, 1)})
		}
		g.commit(batch)
		var got []string
		for _, req := range batch {
			got = append(got, fmt.Sprint(<-req.done))
		}
		if want := "[<nil> business rule says no <nil> panic in request: bug <nil>]"; fmt.Sprint(got) != want {
			t.Fatalf("got %v, want %s", got, want)
		}
		if got := env.str(t, `SELECT string_agg(order_id, ',' ORDER BY order_id) FROM orders`); got != "ord_1,ord_2,ord_3" {
			t.Fatalf("stored %s, want ord_1,ord_2,ord_3", got)
		}
	})

	// Ensure a client that hangs up while its work runs in a batch does not
	// interrupt the others' shared transaction.
	t.Run("CancelledClientDoesNotFailTheBatch", func(t *testing.T) {
		env := MustOpenApp(t)
		g := newGroupCommitter(env.app.db)
		insertAs := func(orderID string, hangUp func()) func(ctx context.Context, tx *sql.Tx) error {
			return func(ctx context.Context, tx *sql.Tx) error {
				if hangUp != nil {
					hangUp()
				}
				_, err := tx.ExecContext(ctx, `
					INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, created_at, updated_at)
					VALUES (?, 'u', 1, 'usd', '[]', 'pm_card_visa', 'created', '', '')`, orderID)
				return err
			}
		}
		gone, hangUp := context.WithCancel(context.Background())
		batch := []groupRequest{
			newGroupRequest(context.Background(), insertAs("ord_1", nil)),
			newGroupRequest(gone, insertAs("ord_gone", hangUp)),
			newGroupRequest(context.Background(), insertAs("ord_2", nil)),
		}
		g.commit(batch)
		for i, req := range batch {
			if err := <-req.done; err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 3 {
			t.Fatalf("got %d orders, want 3", got)
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
