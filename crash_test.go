package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// mustAudit fails the test if any invariant is violated.
func mustAudit(tb testing.TB, env *testEnv, settled bool) {
	tb.Helper()
	violations, err := audit(context.Background(), env.app.db, env.clock.now(), settled)
	if err != nil {
		tb.Fatal(err)
	}
	for _, v := range violations {
		tb.Errorf("violation: %s: %s", v.Invariant, v.Detail)
	}
}

func TestCheck(t *testing.T) {
	// settledEnv returns an env where a paid, a declined and a refunded
	// order have gone through every layer.
	settledEnv := func(t *testing.T) (*testEnv, string) {
		env := MustOpenApp(t)
		paid := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		createAndDrain(t, env, "k2", orderBody(700, "sku-2", 1, pmCardDeclined))
		refunded := createAndDrain(t, env, "k3", orderBody(900, "sku-2", 1, pmCardTimeout))
		req, refund := refundRequestFor(t, refunded, "r1", "")
		if _, err := env.app.refundOrder(context.Background(), req, refunded, refund); err != nil {
			t.Fatal(err)
		}
		env.drain(t)
		return env, paid
	}

	// Ensure a system that went through every layer passes every invariant.
	t.Run("SettledSystemPasses", func(t *testing.T) {
		env, _ := settledEnv(t)
		mustAudit(t, env, true)
	})

	// Ensure each kind of damage is reported by the invariant it breaks.
	tamperings := []struct {
		name      string
		sql       string
		invariant string
	}{
		{"DoubleCharge", `INSERT INTO processor_charges (charge_id, idempotency_key, order_id, amount_cents, currency, payment_method, status, created_at)
			SELECT 'ch_extra', 'other-key', order_id, amount_cents, currency, payment_method, 'succeeded', created_at FROM processor_charges WHERE status = 'succeeded' LIMIT 1`,
			"no order is charged twice"},
		{"DuplicateOrderForKey", `INSERT INTO orders (order_id, user_id, amount_cents, currency, items, payment_method, status, idempotency_key, created_at, updated_at)
			SELECT 'ord_extra', user_id, amount_cents, currency, items, payment_method, status, idempotency_key, created_at, updated_at FROM orders WHERE order_id = :paid`,
			"an idempotency key maps to at most one order"},
		{"LeakedStock", `UPDATE stock_items SET available = available - 1 WHERE sku = 'sku-1'`,
			"stock is conserved"},
		{"LostEvent", `DELETE FROM outbox_events WHERE aggregate_id = :paid AND event_type = 'OrderCreated'`,
			"every order has exactly one OrderCreated event"},
		{"PaidButNotCharged", `UPDATE processor_charges SET refunded_cents = amount_cents WHERE order_id = :paid`,
			"no charge is refunded beyond what it captured"},
		{"StuckSaga", `UPDATE saga_instances SET status = 'in_progress' WHERE order_id = :paid`,
			"once quiet, every saga is terminal"},
		{"PendingEvent", `UPDATE outbox_events SET status = 'pending' WHERE aggregate_id = :paid AND event_type = 'PaymentCaptured'`,
			"once quiet, no event is left unpublished"},
	}
	for _, tt := range tamperings {
		t.Run("Reports"+tt.name, func(t *testing.T) {
			env, paid := settledEnv(t)
			if _, err := env.app.db.Exec(strings.ReplaceAll(tt.sql, ":paid", "'"+paid+"'")); err != nil {
				t.Fatal(err)
			}
			violations, err := audit(context.Background(), env.app.db, env.clock.now(), true)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range violations {
				if strings.HasPrefix(v.Invariant, tt.invariant) {
					return
				}
			}
			t.Fatalf("got %v, want a violation of %q", violations, tt.invariant)
		})
	}
}

// crashWorkload is what the exhaustive crash test runs: every kind of order,
// refunds, and the workers, each retried by its client or by the next
// process after a crash.
func crashWorkload(t *testing.T, env *testEnv) {
	ctx := context.Background()
	// retry runs op as a client or supervisor would: after a crash the
	// process is restarted and op is tried again, with the same keys.
	retry := func(what string, op func() error) {
		t.Helper()
		for range 5 {
			err := op()
			if errors.Is(err, errCrash) {
				env.restart(t)
				// Leases of the dead process must pass before its work is
				// taken over.
				env.clock.advance(env.app.leases.refundLock)
				continue
			}
			if err != nil && !errors.Is(err, errProcessorTimeout) {
				t.Fatalf("%s: %v", what, err)
			}
			if err == nil {
				return
			}
		}
		t.Fatalf("%s did not succeed", what)
	}
	drain := func() {
		retry("workers", func() error {
			for range 200 {
				n, err := env.app.runWorkersOnce(ctx, "worker")
				if err != nil {
					return err
				}
				if n == 0 {
					env.clock.advance(env.app.leases.refundLock)
					if n, err = env.app.runWorkersOnce(ctx, "worker"); err != nil || n == 0 {
						return err
					}
				}
			}
			return fmt.Errorf("workers did not settle")
		})
	}

	bodies := map[string]string{
		"visa":     orderBody(5000, "sku-1", 2, pmCardVisa),
		"declined": orderBody(1200, "sku-2", 3, pmCardDeclined),
		"timeout":  orderBody(3000, "sku-2", 1, pmCardTimeout),
		"rare":     orderBody(800, "sku-rare", 2, pmCardVisa),
		"second":   orderBody(4000, "sku-1", 1, pmCardVisa),
	}
	orderIDs := map[string]string{}
	for _, name := range []string{"visa", "declined", "timeout", "rare", "second"} {
		retry("create "+name, func() error {
			req, order := newOrderRequest(t, "user-42", "key-"+name, bodies[name])
			response, err := env.app.createOrder(ctx, req, order)
			orderIDs[name] = orderField(response.Body, "order_id")
			return err
		})
	}
	drain()
	for _, name := range []string{"visa", "timeout"} {
		retry("refund "+name, func() error {
			req, refund := refundRequestFor(t, orderIDs[name], "refund-"+name, `{"amount_cents":1000}`)
			_, err := env.app.refundOrder(ctx, req, orderIDs[name], refund)
			return err
		})
	}
	drain()
}

// Ensure that for every registered fault point, a crash there, a restart on
// the same file and recovery leave a system that passes every invariant and
// did each thing once.
func TestCrashAtEveryFaultPoint(t *testing.T) {
	for _, point := range allFaultPoints() {
		t.Run(string(point), func(t *testing.T) {
			env := MustOpenApp(t)
			fired := false
			env.fault.set(func(p faultPoint, pass int) error {
				if p != point || fired {
					return nil
				}
				// The processor losing a response is not our process dying:
				// the caller sees a timeout.
				fired = true
				if point == faultProcessorLoseResponse {
					return errors.New("connection reset")
				}
				return errCrash
			})
			crashWorkload(t, env)
			if !fired {
				t.Fatalf("the workload never reached %s", point)
			}
			mustAudit(t, env, true)
			if got := env.count(t, `SELECT COUNT(*) FROM orders`); got != 5 {
				t.Fatalf("got %d orders, want 5", got)
			}
			if got := env.str(t, `SELECT string_agg(status, ',' ORDER BY amount_cents) FROM orders`); got != "cancelled,cancelled,paid,paid,paid" {
				t.Fatalf("order statuses by amount: %s", got)
			}
			if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 2 {
				t.Fatalf("got %d refunds, want 2", got)
			}
		})
	}
}
