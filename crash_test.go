package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
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
		// What a hold released twice leaves: more on the shelf than was
		// stocked (sku-2's declined order released its hold once).
		{"StockReleasedTwice", `UPDATE stock_items SET available = available + 1 WHERE sku = 'sku-2'`,
			"stock is conserved"},
		// A hold is read from the order's items: one that cannot be read
		// is named, and fails no other reader of the holds.
		{"UnreadableItems", `UPDATE orders SET items = 'not json' WHERE order_id = :paid`,
			"an order whose stock was reserved holds each of its items"},
		// The same for a hold that was released: the declined order's.
		{"UnreadableItemsOfAReleasedHold", `UPDATE orders SET items = 'not json' WHERE idempotency_key = 'k2'`,
			"an order whose stock was reserved holds each of its items"},
		{"LostEvent", `DELETE FROM outbox_events WHERE aggregate_id = :paid AND event_type = 'OrderCreated'`,
			"every order has exactly one OrderCreated event"},
		{"DuplicateOrderCreated", `INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, status, next_attempt_at, created_at, delivery_position)
			SELECT 'evt_extra', event_type, aggregate_id, payload, status, next_attempt_at, created_at, delivery_position FROM outbox_events
			WHERE aggregate_id = :paid AND event_type = 'OrderCreated'`,
			"every order has exactly one OrderCreated event"},
		{"PaidButNotCharged", `UPDATE processor_charges SET refunded_cents = amount_cents WHERE order_id = :paid`,
			"no charge is refunded beyond what it captured"},
		{"StuckSaga", `UPDATE saga_instances SET status = 'in_progress' WHERE order_id = :paid`,
			"once quiet, every saga is terminal"},
		{"PendingEvent", `UPDATE outbox_events SET status = 'pending' WHERE aggregate_id = :paid AND event_type = 'PaymentCaptured'`,
			"once quiet, no event is left unpublished"},
		{"SagaStepsDisagree", `UPDATE saga_steps SET status = 'compensated' WHERE step_index = 0 AND saga_id = (SELECT saga_id FROM saga_instances WHERE order_id = :paid)`,
			"a saga's status agrees with its steps"},
		{"SagaPulledBack", `UPDATE saga_instances SET status = 'in_progress' WHERE status = 'compensated'`,
			"a saga's status agrees with its steps"},
		{"RefundedBeyondTheOrder", `UPDATE orders SET refunded_cents = amount_cents + 1 WHERE order_id = :paid`,
			"an order's refunded amount is a whole number no larger than the order"},
		{"FailedEventHoldsBackItsOrder", `UPDATE outbox_events SET status = 'failed', last_error = 'broker down' WHERE aggregate_id = :paid AND event_type = 'OrderCreated'`,
			failedEventsInvariant},
	}
	// Ensure inspect shows the stock of a database where one order's items
	// cannot be read: its holds are not counted, and nothing else fails.
	t.Run("InspectReadsPastUnreadableItems", func(t *testing.T) {
		env, paid := settledEnv(t)
		if _, err := env.app.db.Exec(`UPDATE orders SET items = '[{"sku": 7' WHERE order_id = ?`, paid); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		if err := inspect(context.Background(), env.app.db, &out, inspectOptions{view: inspectWide}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), "stock_items") {
			t.Fatalf("inspect says:\n%s\nwant the stock", out.String())
		}
	})

	// Ensure inspect says which order a failed event holds back, and how
	// many of its events wait behind it: nothing but an operator releases
	// them.
	t.Run("InspectNamesTheOrderAFailedEventHoldsBack", func(t *testing.T) {
		env, paid := settledEnv(t)
		_, err := env.app.db.Exec(`
			UPDATE outbox_events SET status = CASE event_type WHEN 'OrderCreated' THEN 'failed' ELSE 'pending' END,
			       last_error = 'broker down', attempts = 10
			WHERE aggregate_id = ?`, paid)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		if err := inspect(context.Background(), env.app.db, &out, inspectOptions{view: inspectWide}); err != nil {
			t.Fatal(err)
		}
		want := "failed after 10 attempts (broker down); 1 later events of " + paid + " wait behind it"
		if !strings.Contains(out.String(), "ATTENTION: OrderCreated ") || !strings.Contains(out.String(), want) {
			t.Fatalf("inspect says:\n%s\nwant an ATTENTION line ending %q", out.String(), want)
		}
	})

	// Ensure an event a consumer never applied is reported once quiet, and
	// while work is in flight once deliveryLag has passed since its
	// publish, not before: a consumer may be merely behind.
	t.Run("ReportsAnEventAConsumerNeverApplied", func(t *testing.T) {
		env, paid := settledEnv(t)
		eventID := env.str(t, `SELECT event_id FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`, paid)
		if _, err := env.app.db.Exec(`UPDATE outbox_events SET delivery_position = `+deliveryCursor+`, published_at = ? WHERE event_id = ?`,
			formatTime(env.clock.now()), eventID); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.db.Exec(`DELETE FROM inbox_messages WHERE message_id = ?`, eventID); err != nil {
			t.Fatal(err)
		}
		reported := func(settled bool, invariant string) bool {
			violations, err := audit(context.Background(), env.app.db, env.clock.now(), settled)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range violations {
				if v.Invariant == invariant && strings.Contains(v.Detail, eventID) && strings.Contains(v.Detail, paymentServiceConsumer) {
					return true
				}
			}
			return false
		}
		if !reported(true, "once quiet, every published event is applied by each consumer of its subject") {
			t.Error("once quiet, the event nobody applied is not reported")
		}
		if reported(false, undeliveredInvariant) {
			t.Error("in flight, an event published just now is reported undelivered")
		}
		env.clock.advance(deliveryLag)
		if !reported(false, undeliveredInvariant) {
			t.Errorf("in flight, %s after its publish, the event nobody applied is not reported", deliveryLag)
		}
	})

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
// refunds, the workers, and the event of a refund made at the processor's
// dashboard, each retried by its client (or the processor) or by the next
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
			if errors.Is(err, errKeyInProgress) {
				// A refund whose key another process holds (it took the
				// request over while this one was paused, and is paused
				// itself): 409, and the client tries again after the lease.
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
		// The last unit of sku-rare: workers racing for it must not
		// both reserve it, nor one undo the other's reservation.
		"lastunit": orderBody(600, "sku-rare", 1, pmCardVisa),
	}
	orderIDs := map[string]string{}
	for _, name := range []string{"visa", "declined", "timeout", "rare", "second", "lastunit"} {
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
	// A refund made at the processor's dashboard, announced by a signed
	// event that the processor delivers until it is acknowledged: the
	// handler asks the processor to confirm the refund first.
	chargeID := env.str(t, `SELECT charge_id FROM orders WHERE order_id = ?`, orderIDs["second"])
	var refundID string
	retry("refund at the processor's dashboard", func() error {
		var err error
		refundID, err = env.app.processor.refund(ctx, "dashboard:second", chargeID, 500)
		return err
	})
	var event processorEvent
	if err := json.Unmarshal(chargeRefundedEvent("evt_dashboard", chargeID, refundID, 500), &event); err != nil {
		t.Fatal(err)
	}
	retry("deliver the dashboard refund's event", func() error {
		result, err := env.app.receiveProcessorEvent(ctx, event)
		if err == nil && result.Outcome != inboxApplied && result.Outcome != inboxDuplicate {
			return fmt.Errorf("the event got %s: %v", result.Outcome, result.Err)
		}
		return err
	})
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
				// The processor losing a request or a response, or not
				// answering, is not our process dying: the caller sees a
				// timeout.
				fired = true
				if point == faultProcessorLoseRequest || point == faultProcessorLoseResponse || point == faultProcessorRetrieve {
					return errors.New("connection reset")
				}
				return errCrash
			})
			crashWorkload(t, env)
			if !fired {
				t.Fatalf("the workload never reached %s", point)
			}
			mustHaveDoneTheWorkloadOnce(t, env)
		})
	}
}

// mustHaveDoneTheWorkloadOnce fails the test unless crashWorkload's orders
// and refunds each happened once and every invariant holds.
func mustHaveDoneTheWorkloadOnce(tb testing.TB, env *testEnv) {
	tb.Helper()
	mustAudit(tb, env, true)
	if got := env.count(tb, `SELECT COUNT(*) FROM orders`); got != 6 {
		tb.Fatalf("got %d orders, want 6", got)
	}
	if got := env.str(tb, `SELECT string_agg(status, ',' ORDER BY amount_cents) FROM orders`); got != "paid,cancelled,cancelled,paid,paid,paid" {
		tb.Fatalf("order statuses by amount: %s", got)
	}
	if got := env.count(tb, `SELECT COUNT(*) FROM processor_refunds`); got != 3 {
		tb.Fatalf("got %d refunds, want 3", got)
	}
	if got := env.str(tb, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM refunds WHERE source = 'webhook'`); got != "1:500" {
		tb.Fatalf("the dashboard refund's event counted %s (refunds:cents), want 1:500", got)
	}
}

// Ensure that for every registered fault point outside a transaction, and
// for each time the workload passes it, a process paused there for longer
// than every lease, while another process takes its work over, changes
// nothing when it resumes with its stale view: every write it makes after
// the pause is fenced. (The crash test above cannot see this: a crashed
// process never comes back.) Two ways the other process acts:
//   - TakenOver: it runs until there is nothing left to do, then the paused
//     one resumes;
//   - Interleaved: it runs until it reaches a fault point itself and is
//     paused there; the first resumes and the workload runs to its end;
//     then the second resumes, staler still.
func TestPauseAtEveryFaultPoint(t *testing.T) {
	// One run without faults counts how often the workload passes each
	// point.
	dry := MustOpenApp(t)
	crashWorkload(t, dry)
	for _, point := range allFaultPoints() {
		if point.insideTransaction() {
			continue
		}
		passes := min(dry.fault.hitCount(point), 4)
		if passes == 0 {
			t.Fatalf("the workload never reached %s", point)
		}
		for _, interleaved := range []bool{false, true} {
			mode := "TakenOver"
			if interleaved {
				mode = "Interleaved"
			}
			for pass := 1; pass <= passes; pass++ {
				t.Run(fmt.Sprintf("%s/%s/pass%d", point, mode, pass), func(t *testing.T) {
					env := MustOpenApp(t)
					other := &pausedProcess{env: env, worker: "worker-B"}
					fired := false
					env.fault.setCtx(func(ctx context.Context, p faultPoint, n int) error {
						if workerOf(ctx) == other.worker {
							return other.atFaultPoint(p)
						}
						if p != point || n != pass || fired {
							return nil
						}
						fired = true
						// Paused here past every lease; meanwhile the
						// other process takes the work over.
						env.clock.advance(env.app.leases.refundLock + time.Second)
						if interleaved {
							other.startUntilPaused(withWorker(ctx, other.worker))
						} else {
							other.runUntilQuiet(t, withWorker(ctx, other.worker))
						}
						return nil
					})
					crashWorkload(t, env)
					if !fired {
						t.Fatalf("the workload passed %s fewer than %d times", point, pass)
					}
					if err := other.resumeAndWait(); err != nil {
						t.Fatalf("the other process: %v", err)
					}
					env.fault.setCtx(nil)
					env.drain(t)
					mustHaveDoneTheWorkloadOnce(t, env)
				})
			}
		}
	}
}

// pausedProcess is the second process of TestPauseAtEveryFaultPoint: a
// worker under its own name, run on a goroutine of its own when it must be
// paused halfway.
type pausedProcess struct {
	env    *testEnv
	worker string

	pauseAtNextPoint bool
	paused, resume   chan struct{}
	done             chan error
}

// runUntilQuiet runs every worker under p's name until a pass finds nothing
// to do.
func (p *pausedProcess) runUntilQuiet(tb testing.TB, ctx context.Context) {
	tb.Helper()
	for range 100 {
		n, err := p.env.app.runWorkersOnce(ctx, p.worker)
		if err != nil {
			tb.Fatalf("%s: %v", p.worker, err)
		}
		if n == 0 {
			return
		}
	}
	tb.Fatalf("%s did not settle", p.worker)
}

// startUntilPaused starts p's workers on a goroutine and returns once they
// are paused at a fault point outside a transaction (or have finished
// without reaching one).
func (p *pausedProcess) startUntilPaused(ctx context.Context) {
	p.pauseAtNextPoint = true
	p.paused, p.resume, p.done = make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		// Exits when the workers are quiet, after resumeAndWait.
		var err error
		for range 100 {
			var n int
			if n, err = p.env.app.runWorkersOnce(ctx, p.worker); err != nil || n == 0 {
				break
			}
		}
		p.done <- err
	}()
	select {
	case <-p.paused:
	case err := <-p.done:
		p.done <- err
	case <-time.After(waitLimit):
		// Neither paused nor quiet: resumeAndWait says so.
	}
}

// atFaultPoint is the fault hook of p's workers: the first point outside a
// transaction after startUntilPaused pauses them until resumeAndWait.
func (p *pausedProcess) atFaultPoint(point faultPoint) error {
	if !p.pauseAtNextPoint || point.insideTransaction() {
		return nil
	}
	p.pauseAtNextPoint = false
	close(p.paused)
	_, err := await("the crashed process to restart and let the paused one go on", p.resume)
	return err
}

// resumeAndWait lets a paused p go on and returns what its workers returned.
func (p *pausedProcess) resumeAndWait() error {
	if p.done == nil {
		return nil
	}
	close(p.resume)
	err, waitErr := await("the paused process's workers to go quiet", p.done)
	return errors.Join(err, waitErr)
}
