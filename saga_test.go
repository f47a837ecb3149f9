package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// startSagas relays every pending event and lets the consumers apply them
// once, so that new orders have their sagas, but runs no saga.
func startSagas(tb testing.TB, env *testEnv) {
	tb.Helper()
	ctx := context.Background()
	if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
		tb.Fatalf("relay: %v", err)
	}
	for _, c := range env.app.consumers() {
		if _, err := env.app.consumeOnce(ctx, c, consumeBatchSize); err != nil {
			tb.Fatalf("consume %s: %v", c.name, err)
		}
	}
}

// createAndDrain creates an order and runs every worker until quiet. It
// returns the order id.
func createAndDrain(tb testing.TB, env *testEnv, key, body string) string {
	tb.Helper()
	response := mustCreateOrder(tb, env, "user-42", key, body)
	orderID := orderField(response.Body, "order_id")
	env.drain(tb)
	return orderID
}

// sagaSteps returns "status: name=status ..." for the order's saga, a
// step that has not run shown pending (it has no row).
func sagaSteps(tb testing.TB, env *testEnv, orderID string) string {
	tb.Helper()
	sagaID := env.str(tb, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID)
	saga, steps, err := readSaga(context.Background(), env.app.db, sagaID)
	if err != nil {
		tb.Fatal(err)
	}
	return string(saga.Status) + ": " + stepsLine(withPendingSteps(steps))
}

// stockOf returns "available/reserved/sold" of a sku: reserved and sold are
// its reservations, sold those of completed sagas.
func stockOf(tb testing.TB, env *testEnv, sku string) string {
	tb.Helper()
	return env.str(tb, `
		SELECT available || '/' ||
		       (SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku = s.sku AND r.status = 'reserved' AND NOT `+soldHold+`) || '/' ||
		       (SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku = s.sku AND `+soldHold+`)
		FROM stock_items s WHERE sku = ?`, sku)
}

// failConfirm makes the confirm step fail for a business reason, so a saga
// that has charged the card must refund it; then also applies then.
func failConfirm(env *testEnv, then func(point faultPoint, pass int) error) {
	env.fault.set(func(point faultPoint, pass int) error {
		// The first pass of faultAfterStepEffect is reserve_stock, the second
		// is confirm.
		if point == faultAfterStepEffect && pass == 2 {
			return permanent(errors.New("warehouse rejected the shipment"))
		}
		if then != nil {
			return then(point, pass)
		}
		return nil
	})
}

// Ensure a sale writes no stock (schema version 13): a paid order's holds
// stay reserved, sold because their saga completed; a database migrated
// from version 12 counts the holds it had sold the same way; and a mark
// of an older process, which nothing would count, is refused.
func TestSaleWritesNoStock(t *testing.T) {
	ctx := context.Background()
	t.Run("PaidOrdersHoldsStayReserved", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		if got := env.str(t, `SELECT string_agg(status, ',') FROM stock_holds WHERE order_id = ?`, orderID); got != string(stockReserved) {
			t.Fatalf("the paid order's holds are %s, want reserved", got)
		}
		if got := stockOf(t, env, "sku-1"); got != "998/0/2" {
			t.Fatalf("sku-1 stock %s, want 998/0/2 (the reserved hold of a completed saga is sold)", got)
		}
		mustAudit(t, env, true)
	})
	t.Run("HoldsSoldBeforeVersion13AreReserved", func(t *testing.T) {
		target := testDatabase(t)
		migrateTo(t, target, 12)
		db := openUnmigrated(t, target)
		defer db.Close()
		now := formatTime(time.Now())
		err := withTx(ctx, db, func(tx *sql.Tx) error {
			order := orderRow{OrderID: "ord-sold", UserID: "user-42", AmountCents: 5000, Currency: "usd",
				Items: []orderItem{{SKU: "sku-1", Qty: 2}}, PaymentMethod: pmCardVisa, Status: orderPaid, CreatedAt: now}
			if err := insertOrder(ctx, tx, order); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, `
				INSERT INTO stock_reservations (order_id, sku, qty, status, created_at, updated_at)
				VALUES ('ord-sold', 'sku-1', 2, 'sold', ?, ?)`, now, now)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		mustMigrateUpTo(t, db, 13)
		var status string
		if err := db.QueryRowContext(ctx, `SELECT status FROM stock_reservations WHERE order_id = 'ord-sold'`).Scan(&status); err != nil {
			t.Fatal(err)
		}
		if status != string(stockReserved) {
			t.Fatalf("a hold sold at version 12 is %s at version 13, want reserved", status)
		}
		if _, err := db.ExecContext(ctx, `UPDATE stock_reservations SET status = 'sold' WHERE order_id = 'ord-sold'`); err == nil {
			t.Fatal("a hold was marked sold, as a process older than version 13 would, and nothing refused it")
		}
	})
}

// mustMigrateUpTo applies the schema's sections after db's version up to
// version, as a program of that version would.
func mustMigrateUpTo(tb testing.TB, db *sql.DB, version int) {
	tb.Helper()
	migrations, err := schemaMigrations(dialectOf(db).schema)
	if err != nil {
		tb.Fatal(err)
	}
	if err := applyMigrations(context.Background(), db, migrations[:version]); err != nil {
		tb.Fatal(err)
	}
}

// Ensure a hold is its saga's reserve_stock record (schema version 14): the
// holds of a database at version 13 are read from the steps' records as
// they were, reserved and released, once their table is gone; and a hold
// that no step's record says (which no version of retrysafe wrote) stops
// the migration, so nothing is lost.
func TestHoldsAreReserveStepRecords(t *testing.T) {
	ctx := context.Background()
	// atVersion13 makes a database at version 13 with two orders whose
	// reserve_stock ran: ord-held holds 2 of sku-1 and 1 of sku-2; ord-undone
	// had its 3 of sku-1 released. stray is a hold with no step, or none.
	atVersion13 := func(t *testing.T, stray bool) (target string, db *sql.DB) {
		target = testDatabase(t)
		migrateTo(t, target, 13)
		db = openUnmigrated(t, target)
		t.Cleanup(func() { db.Close() })
		now := formatTime(time.Now())
		err := withTx(ctx, db, func(tx *sql.Tx) error {
			for _, o := range []struct {
				id, step, hold string
				items          []orderItem
			}{
				{"ord-held", "done", "reserved", []orderItem{{SKU: "sku-1", Qty: 2}, {SKU: "sku-2", Qty: 1}}},
				{"ord-undone", "compensated", "released", []orderItem{{SKU: "sku-1", Qty: 3}}},
			} {
				order := orderRow{OrderID: o.id, UserID: "user-42", AmountCents: 5000, Currency: "usd",
					Items: o.items, PaymentMethod: pmCardVisa, Status: orderCreated, CreatedAt: now}
				if err := insertOrder(ctx, tx, order); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, `
					INSERT INTO saga_instances (saga_id, order_id, status, current_step, next_attempt_at, created_at, updated_at)
					VALUES (?, ?, 'in_progress', 'charge_card', ?, ?, ?)`, "saga-"+o.id, o.id, now, now, now); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, `
					INSERT INTO saga_steps (saga_id, step_index, step_name, status, attempts, done_at)
					VALUES (?, 0, 'reserve_stock', ?, 1, ?)`, "saga-"+o.id, o.step, now); err != nil {
					return err
				}
				for _, item := range o.items {
					if _, err := tx.ExecContext(ctx, `
						INSERT INTO stock_reservations (order_id, sku, qty, status, created_at, updated_at)
						VALUES (?, ?, ?, ?, ?, ?)`, o.id, item.SKU, item.Qty, o.hold, now, now); err != nil {
						return err
					}
				}
			}
			if !stray {
				return nil
			}
			_, err := tx.ExecContext(ctx, `
				INSERT INTO stock_reservations (order_id, sku, qty, status, created_at, updated_at)
				VALUES ('ord-undone', 'sku-2', 4, 'reserved', ?, ?)`, now, now)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return target, db
	}
	holds := func(t *testing.T, db *sql.DB, table string) string {
		t.Helper()
		rows, err := db.QueryContext(ctx, `SELECT order_id, sku, qty, status FROM `+table+` ORDER BY order_id, sku`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var got []string
		for rows.Next() {
			var orderID, sku, status string
			var qty int64
			if err := rows.Scan(&orderID, &sku, &qty, &status); err != nil {
				t.Fatal(err)
			}
			got = append(got, fmt.Sprintf("%s %d %s %s", orderID, qty, sku, status))
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return strings.Join(got, ", ")
	}
	t.Run("HoldsAreReadFromTheSteps", func(t *testing.T) {
		target, db := atVersion13(t, false)
		before := holds(t, db, "stock_reservations")
		db.Close()
		migrated, err := openDB(ctx, target)
		if err != nil {
			t.Fatal(err)
		}
		defer migrated.Close()
		if got := holds(t, migrated, "stock_holds"); got != before {
			t.Fatalf("after the migration the holds are\n%s\nbefore it\n%s", got, before)
		}
		if before != "ord-held 2 sku-1 reserved, ord-held 1 sku-2 reserved, ord-undone 3 sku-1 released" {
			t.Fatalf("the holds at version 13 are %s", before)
		}
		if _, err := migrated.ExecContext(ctx, `SELECT 1 FROM stock_reservations`); err == nil {
			t.Fatal("stock_reservations is still there: a process older than version 14 would go on writing holds into it")
		}
	})
	t.Run("AHoldNoStepSaysStopsTheMigration", func(t *testing.T) {
		target, db := atVersion13(t, true)
		before := holds(t, db, "stock_reservations")
		db.Close()
		if migrated, err := openDB(ctx, target); err == nil {
			migrated.Close()
			t.Fatal("a hold that no reserve_stock record says was migrated away")
		}
		db = openUnmigrated(t, target)
		defer db.Close()
		if got := holds(t, db, "stock_reservations"); got != before {
			t.Fatalf("after the failed migration the holds are\n%s\nbefore it\n%s", got, before)
		}
	})
}

func TestSaga(t *testing.T) {
	ctx := context.Background()

	// Ensure a good card ends with the order paid, the stock sold and one
	// charge; PaymentCaptured is relayed and consumed (the sample wrote it
	// and nobody read it).
	t.Run("PaidOrderIsCharged", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		if got := sagaSteps(t, env, orderID); got != "completed: reserve_stock=done charge_card=done confirm=done" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		if got := env.count(t, `
			SELECT COUNT(*) FROM inbox_messages i JOIN outbox_events e ON e.event_id = i.message_id
			WHERE i.consumer = 'order-svc' AND e.event_type = 'PaymentCaptured' AND i.status = 'done'`); got != 1 {
			t.Fatalf("PaymentCaptured applied %d times by the order service, want 1", got)
		}
		if got := stockOf(t, env, "sku-1"); got != "998/0/2" {
			t.Fatalf("sku-1 stock %s, want 998/0/2", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges WHERE order_id = ? AND status = 'succeeded' AND amount_cents = 5000`, orderID); got != 1 {
			t.Fatalf("got %d charges, want 1", got)
		}
	})

	// Ensure a copy of the OrderCreated that started an order's saga,
	// arriving after cleanup deleted the payment service's inbox row of it,
	// is a duplicate, not poison: cleanup keeps an inbox row a week, and a
	// copy can come later (NATS delivers an operator's replay for another
	// consumer of the subject to every consumer). As poison it came back
	// with every replay, for ever. A second OrderCreated under another id
	// is still refused: no order gets two sagas.
	t.Run("OrderCreatedAgainAfterCleanupIsADuplicate", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		var msg message
		if err := env.app.db.QueryRowContext(ctx, `
			SELECT event_id, event_type, payload FROM outbox_events WHERE aggregate_id = ? AND event_type = 'OrderCreated'`,
			orderID).Scan(&msg.ID, &msg.Subject, &msg.Payload); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.db.ExecContext(ctx, `DELETE FROM inbox_messages WHERE consumer = ? AND message_id = ?`,
			paymentServiceConsumer, msg.ID); err != nil {
			t.Fatal(err)
		}
		apply := func(msg message) func(tx *sql.Tx) error {
			return func(tx *sql.Tx) error { return env.app.startFulfilment(ctx, tx, msg) }
		}
		again, err := env.app.receive(ctx, paymentServiceConsumer, msg.ID, 1, apply(msg))
		if err != nil || again.Outcome != inboxApplied {
			t.Fatalf("the copy after cleanup: %s, %v; want it applied as the duplicate it is", again.Outcome, err)
		}
		if got := sagaSteps(t, env, orderID); got != "completed: reserve_stock=done charge_card=done confirm=done" {
			t.Fatalf("saga after the copy: %s", got)
		}
		forged := msg
		forged.ID = "evt_another"
		second, err := env.app.receive(ctx, paymentServiceConsumer, forged.ID, 1, apply(forged))
		if err != nil || second.Outcome != inboxPoison {
			t.Fatalf("a second OrderCreated of the order: %s, %v; want poison", second.Outcome, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances WHERE order_id = ?`, orderID); got != 1 {
			t.Fatalf("order has %d sagas, want 1", got)
		}
	})

	// Ensure a copy of a payment result (PaymentCaptured, OrderCancelled)
	// that the order already shows, arriving after cleanup deleted the
	// order service's inbox row of it, is a duplicate, not poison: a relay
	// paused a week in the middle of its publish sends its copy after
	// cleanup forgot the message, and as poison every replay made it
	// poison again. A result that contradicts the order is still refused.
	t.Run("PaymentResultAgainAfterCleanupIsADuplicate", func(t *testing.T) {
		env := MustOpenApp(t)
		paidID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		cancelledID := createAndDrain(t, env, "k2", orderBody(1200, "sku-2", 1, pmCardDeclined))
		deliverAgain := func(orderID, eventType string) (message, receiveResult) {
			t.Helper()
			var msg message
			if err := env.app.db.QueryRowContext(ctx, `
				SELECT event_id, event_type, payload FROM outbox_events WHERE aggregate_id = ? AND event_type = ?`,
				orderID, eventType).Scan(&msg.ID, &msg.Subject, &msg.Payload); err != nil {
				t.Fatal(err)
			}
			if _, err := env.app.db.ExecContext(ctx, `DELETE FROM inbox_messages WHERE consumer = ? AND message_id = ?`,
				orderServiceConsumer, msg.ID); err != nil {
				t.Fatal(err)
			}
			result, err := env.app.receive(ctx, orderServiceConsumer, msg.ID, 1, func(tx *sql.Tx) error {
				return env.app.applyPaymentResult(ctx, tx, msg)
			})
			if err != nil {
				t.Fatal(err)
			}
			return msg, result
		}
		captured, again := deliverAgain(paidID, eventPaymentCaptured)
		if again.Outcome != inboxApplied {
			t.Errorf("PaymentCaptured after cleanup: %s (%v); want it applied as the duplicate it is", again.Outcome, again.Err)
		}
		if _, again := deliverAgain(cancelledID, eventOrderCancelled); again.Outcome != inboxApplied {
			t.Errorf("OrderCancelled after cleanup: %s (%v); want it applied as the duplicate it is", again.Outcome, again.Err)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, paidID) + "/" +
			env.str(t, `SELECT status FROM orders WHERE order_id = ?`, cancelledID); got != "paid/cancelled" {
			t.Fatalf("orders after the copies: %s, want paid/cancelled", got)
		}
		other := captured
		other.ID = "evt_another"
		other.Payload = []byte(`{"order_id":"` + paidID + `","charge_id":"ch_another","amount_cents":5000}`)
		if result, err := env.app.receive(ctx, orderServiceConsumer, other.ID, 1, func(tx *sql.Tx) error {
			return env.app.applyPaymentResult(ctx, tx, other)
		}); err != nil || result.Outcome != inboxPoison {
			t.Fatalf("a PaymentCaptured of another charge for a paid order: %s, %v; want poison", result.Outcome, err)
		}
	})

	// Ensure a charge whose response is lost is retried with the same key
	// and charges once.
	t.Run("TimeoutChargesOnce", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardTimeout))
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(key_hits) FROM processor_charges`); got != "1:1" {
			t.Fatalf("charges:key hits = %s, want 1:1", got)
		}
	})

	// Ensure a declined card undoes only the steps that ran: the stock comes
	// back, nothing is refunded, and the order ends cancelled, not paid.
	t.Run("DeclinedCardCompensatesOnlyStepsThatRan", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(1200, "sku-2", 3, pmCardDeclined))
		if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=failed confirm=pending" {
			t.Fatalf("saga: %s", got)
		}
		if got := stockOf(t, env, "sku-2"); got != "1000/0/0" {
			t.Fatalf("sku-2 stock %s, want 1000/0/0", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 0 {
			t.Fatalf("refunded %d times a charge that never happened", got)
		}
		if got := env.str(t, `SELECT status || ':' || cancel_reason FROM orders WHERE order_id = ?`, orderID); got != "cancelled:card declined" {
			t.Fatalf("order %s, want cancelled:card declined", got)
		}
	})

	// Ensure too little stock cancels the order without charging.
	t.Run("OutOfStockCancelsWithoutCharging", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := createAndDrain(t, env, "k1", orderBody(1200, "sku-rare", 2, pmCardVisa))
		if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=failed charge_card=pending confirm=pending" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM processor_charges`); got != 0 {
			t.Fatalf("charged %d times", got)
		}
		if got := stockOf(t, env, "sku-rare"); got != "1/0/0" {
			t.Fatalf("sku-rare stock %s, want 1/0/0", got)
		}
	})

	// Ensure a failure after the charge refunds it and releases the stock, in
	// reverse order, and cancels the order.
	t.Run("LateFailureRefundsAndReleases", func(t *testing.T) {
		env := MustOpenApp(t)
		failConfirm(env, nil)
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=compensated confirm=failed" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.str(t, `SELECT amount_cents || ':' || refunded_cents FROM processor_charges`); got != "5000:5000" {
			t.Fatalf("charge captured:refunded = %s, want 5000:5000", got)
		}
		if got := stockOf(t, env, "sku-1"); got != "1000/0/0" {
			t.Fatalf("sku-1 stock %s, want 1000/0/0", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderCancelled) {
			t.Fatalf("order is %s, want cancelled", got)
		}
	})

	// Ensure a compensation whose charge was refunded in part or in full
	// from the processor's dashboard meanwhile refunds what remains, and
	// nothing more: the processor refused the refund of the whole amount
	// at every attempt, and the order was never cancelled.
	for _, dashboard := range []int64{1500, 5000} {
		t.Run(fmt.Sprintf("CompensationRefundsWhatRemainsAfterADashboardRefundOf%d", dashboard), func(t *testing.T) {
			env := MustOpenApp(t)
			failConfirm(env, func(point faultPoint, pass int) error {
				if point == faultAfterProcessorCall && pass == 1 {
					chargeID := env.str(t, `SELECT charge_id FROM processor_charges`)
					if _, err := env.app.processor.refund(ctx, "dashboard-1", chargeID, dashboard); err != nil {
						t.Fatal(err)
					}
				}
				return nil
			})
			orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
			if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=compensated confirm=failed" {
				t.Fatalf("saga: %s", got)
			}
			if got := env.str(t, `SELECT amount_cents || ':' || refunded_cents FROM processor_charges`); got != "5000:5000" {
				t.Fatalf("charge captured:refunded = %s, want 5000:5000", got)
			}
			// refunds:sum:smallest
			want := "2:5000:1500"
			if dashboard == 5000 {
				want = "1:5000:5000"
			}
			if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) || ':' || MIN(amount_cents) FROM processor_refunds`); got != want {
				t.Fatalf("refunds:sum:smallest %s, want %s", got, want)
			}
			if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderCancelled) {
				t.Fatalf("order is %s, want cancelled", got)
			}
		})
	}

	// Ensure a crash anywhere in the compensation, then a resume, undoes
	// each step exactly once (the sample ran a compensation before recording
	// it).
	for _, point := range []faultPoint{faultBeforeProcessorCall, faultAfterProcessorCall, faultMidCompensation, faultAfterStepEffect} {
		t.Run("CrashMidCompensationAt_"+string(point), func(t *testing.T) {
			env := MustOpenApp(t)
			compensating := false
			failConfirm(env, func(p faultPoint, pass int) error {
				if p == faultMidCompensation {
					compensating = true
				}
				// faultBeforeProcessorCall and faultAfterProcessorCall pass once
				// for the charge, then for the refund; faultAfterStepEffect a
				// third time for the release; faultMidCompensation first after
				// the refund.
				crashPass := map[faultPoint]int{faultBeforeProcessorCall: 2, faultAfterProcessorCall: 2, faultMidCompensation: 1, faultAfterStepEffect: 3}
				if p == point && pass == crashPass[point] {
					return errCrash
				}
				return nil
			})
			mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
			var crashed bool
			for range 20 {
				_, err := env.app.runWorkersOnce(ctx, "worker-1")
				if errors.Is(err, errCrash) {
					crashed = true
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if !crashed {
				t.Fatalf("never crashed at %s (compensating=%v)", point, compensating)
			}
			env.restart(t)
			env.drain(t)
			if got := stockOf(t, env, "sku-1"); got != "1000/0/0" {
				t.Fatalf("sku-1 stock %s, want 1000/0/0", got)
			}
			if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(amount_cents) FROM processor_refunds`); got != "1:5000" {
				t.Fatalf("refunds count:sum = %s, want 1:5000", got)
			}
			if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'cancelled'`); got != 1 {
				t.Fatal("order not cancelled")
			}
		})
	}

	// Ensure a compensation that keeps failing is retried, then leaves the
	// saga compensation_failed for an operator instead of looping.
	t.Run("CompensationThatKeepsFailingIsSurfaced", func(t *testing.T) {
		env := MustOpenApp(t)
		failConfirm(env, func(p faultPoint, pass int) error {
			// The first response (the charge's) arrives; every refund's is lost.
			if p == faultProcessorLoseResponse && pass >= 2 {
				return errors.New("connection reset")
			}
			return nil
		})
		orderID := createAndDrain(t, env, "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		if got := sagaSteps(t, env, orderID); got != "compensation_failed: reserve_stock=done charge_card=done confirm=failed" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.count(t, `SELECT attempts FROM saga_instances`); got != maxCompensationAttempts {
			t.Fatalf("tried %d times, want %d", got, maxCompensationAttempts)
		}
		// Every attempt used one key: the processor refunded once.
		if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 1 {
			t.Fatalf("got %d refunds, want 1", got)
		}
	})

	// Ensure sagas claimed together run their steps in one transaction per
	// round, and one saga's failing step undoes only its own writes: the
	// hold on sku-2 that the short order took before it found sku-rare
	// short is released, the other order's steps stand.
	t.Run("FailingStepInARoundUndoesOnlyItsOwnWrites", func(t *testing.T) {
		env := MustOpenApp(t)
		paidID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 2, pmCardVisa)).Body, "order_id")
		shortID := orderField(mustCreateOrder(t, env, "user-42", "k2",
			`{"amount_cents":1200,"currency":"usd","items":[{"sku":"sku-2","qty":1},{"sku":"sku-rare","qty":2}],"payment_method":"pm_card_visa"}`).Body, "order_id")
		if _, err := env.app.relayOnce(ctx, "worker-1", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		payment := env.app.consumers()[0]
		if _, err := env.app.consumeOnce(ctx, payment, consumeBatchSize); err != nil {
			t.Fatal(err)
		}
		inProgress := env.count(t, `SELECT COUNT(*) FROM saga_instances WHERE status = 'in_progress'`)
		ran, err := env.app.sagaOnce(ctx, "worker-1", sagaBatchSize)
		if err != nil || ran != 2 || inProgress != 2 {
			t.Fatalf("got %d sagas run of %d, %v; want both in one pass", ran, inProgress, err)
		}
		if got := sagaSteps(t, env, paidID); got != "completed: reserve_stock=done charge_card=done confirm=done" {
			t.Fatalf("saga of the paid order: %s", got)
		}
		if got := sagaSteps(t, env, shortID); got != "compensated: reserve_stock=failed charge_card=pending confirm=pending" {
			t.Fatalf("saga of the short order: %s", got)
		}
		if got := stockOf(t, env, "sku-2"); got != "1000/0/0" {
			t.Fatalf("sku-2 stock %s, want 1000/0/0: the failed step's hold stayed", got)
		}
		if got := stockOf(t, env, "sku-1"); got != "998/0/2" {
			t.Fatalf("sku-1 stock %s, want 998/0/2", got)
		}
	})

	// Ensure a saga started while a pass is under way joins it at the next
	// round, claimed in that round's commit, instead of waiting for the
	// pass to end.
	t.Run("SagaStartedDuringAPassJoinsIt", func(t *testing.T) {
		env := MustOpenApp(t)
		firstID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
		startSagas(t, env)
		var secondID string
		env.fault.set(func(point faultPoint, pass int) error {
			// The first saga is about to be charged: its pass is under way.
			if point == faultBeforeProcessorCall && pass == 1 {
				secondID = orderField(mustCreateOrder(t, env, "user-42", "k2", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
				startSagas(t, env)
			}
			return nil
		})
		ran, err := env.app.sagaOnce(ctx, "worker-1", sagaBatchSize)
		if err != nil || ran != 2 {
			t.Fatalf("got %d sagas run, %v; want 2: the one started during the pass joined it", ran, err)
		}
		for _, orderID := range []string{firstID, secondID} {
			if got := sagaSteps(t, env, orderID); got != "completed: reserve_stock=done charge_card=done confirm=done" {
				t.Fatalf("saga of %s: %s", orderID, got)
			}
		}
	})

	// Ensure a saga that fails unexpectedly is set aside and reported, and
	// the others claimed with it still run.
	t.Run("BrokenSagaDoesNotHoldUpTheOthers", func(t *testing.T) {
		env := MustOpenApp(t)
		for i := range 3 {
			mustCreateOrder(t, env, "user-42", fmt.Sprintf("k%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
		}
		for range 3 {
			if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
				t.Fatal(err)
			}
			if _, err := env.app.consumeOnce(ctx, env.app.consumers()[0], 10); err != nil {
				t.Fatal(err)
			}
		}
		// The first saga's order loses its items: a broken row.
		if _, err := env.app.db.Exec(`UPDATE orders SET items = 'not json' WHERE idempotency_key = 'k0'`); err != nil {
			t.Fatal(err)
		}
		n, err := env.app.sagaOnce(ctx, "worker-1", 10)
		if n != 3 || err == nil || !strings.Contains(err.Error(), "decode items") {
			t.Fatalf("got %d, %v; want 3 sagas run and the broken one reported", n, err)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM saga_instances WHERE status = 'completed'`); got != 2 {
			t.Fatalf("got %d completed sagas, want the 2 healthy ones", got)
		}
		if got := env.str(t, `SELECT s.status || ':' || COALESCE(s.locked_by, 'free') FROM saga_instances s JOIN orders o ON o.order_id = s.order_id WHERE o.idempotency_key = 'k0'`); got != "in_progress:free" {
			t.Fatalf("the broken saga is %s, want in_progress:free", got)
		}
	})

	// Ensure a saga whose worker died is resumed by another after the lease,
	// and charges once.
	t.Run("RecoveryResumesAfterWorkerDied", func(t *testing.T) {
		env := MustOpenApp(t)
		mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 2, pmCardVisa))
		env.fault.crashAt(faultAfterProcessorCall)
		for range 10 {
			if _, err := env.app.runWorkersOnce(ctx, "worker-1"); errors.Is(err, errCrash) {
				break
			}
		}
		env.restart(t)
		if n, err := env.app.sagaOnce(ctx, "worker-2", 10); err != nil || n != 0 {
			t.Fatalf("worker-2 took a saga still leased to worker-1 (%d, %v)", n, err)
		}
		env.clock.advance(sagaLease)
		if n, err := env.app.sagaOnce(ctx, "worker-2", 10); err != nil || n != 1 {
			t.Fatalf("got %d, %v, want worker-2 to resume 1 saga", n, err)
		}
		env.drain(t)
		if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(key_hits) FROM processor_charges`); got != "1:1" {
			t.Fatalf("charges:key hits = %s, want 1:1", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'paid'`); got != 1 {
			t.Fatal("order not paid")
		}
	})

	// Ensure a saga worker paused past its lease cannot undo the work of the
	// worker that took its saga over. Worker A claims the saga and, in the
	// claim's transaction, reserves the last unit of sku-rare; its next
	// round reads charge_card pending and stalls before the charge, past
	// its lease. B takes the saga over, charges the card, records
	// charge_card done and stalls before confirm. A resumes with its old
	// lease token: its charge, under the same key, is answered from the
	// processor's key (B's charge); its record of charge_card finds B's
	// row (errStepNotPending), so it reads the saga again and runs
	// confirm, whose write ends with the compare-and-set on the token
	// (advanceSaga): B's claim and charge moved the token on, so A's write fails
	// (errSagaLeaseLost), confirm's effect rolls back with it, and A
	// stops. B confirms: one charge, none refunded, no OrderCancelled.
	//
	// In this interleaving A's confirm without the compare-and-set would
	// commit in B's place, to the same end: the test passes with
	// advanceSaga unfenced (mutant SagaWritesUnfenced), which
	// StaleWorkerCannotCancelTwice below catches.
	t.Run("StaleWorkerCannotUndoALiveOne", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-rare", 1, pmCardVisa)).Body, "order_id")
		startSagas(t, env)

		bCharged, resumeB, bDone := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		// A test that fails while B is held still lets B go.
		releaseB := sync.OnceFunc(func() { close(resumeB) })
		t.Cleanup(releaseB)
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			if point != faultBeforeStep {
				return nil
			}
			switch worker := workerOf(ctx); {
			case worker == "A" && pass == 1:
				// A has reserved the stock and read "charge_card pending",
				// and stalls past its lease; B takes the saga over
				// meanwhile.
				env.clock.advance(env.app.leases.saga + time.Second)
				go func() {
					_, err := env.app.sagaOnce(withWorker(ctx, "B"), "worker-B", sagaBatchSize)
					bDone <- err
				}()
				mustReceive(t, "worker B to take the saga over and charge", bCharged)
			case worker == "B" && pass == 3:
				// B has charged and is about to confirm: it stalls, and A
				// resumes.
				close(bCharged)
				_, err := await("the test to let worker B confirm", resumeB)
				return err
			}
			return nil
		})
		_, errA := env.app.sagaOnce(withWorker(ctx, "A"), "worker-A", sagaBatchSize)
		releaseB()
		if errB := mustReceive(t, "worker B to finish", bDone); errA != nil || errB != nil {
			t.Fatalf("worker A: %v, worker B: %v", errA, errB)
		}
		env.fault.setCtx(nil)
		env.drain(t)

		mustAudit(t, env, true)
		if got := sagaSteps(t, env, orderID); got != "completed: reserve_stock=done charge_card=done confirm=done" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
			t.Fatalf("order is %s, want paid", got)
		}
		if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(refunded_cents) FROM processor_charges WHERE status = 'succeeded'`); got != "1:0" {
			t.Fatalf("charges:refunded = %s, want 1:0", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE event_type = 'OrderCancelled'`); got != 0 {
			t.Fatalf("got %d OrderCancelled events, want none", got)
		}
	})

	// Ensure a saga worker paused past its lease in the middle of a
	// compensation writes nothing once another worker has finished it: the
	// fence (advanceSaga's compare-and-set on status and token) is what
	// stops it. Worker A undoes the reservation of a declined order and
	// stalls past its lease before it cancels the order. B takes the saga
	// over, finds the reservation undone, and cancels the order: one
	// OrderCancelled, the saga compensated. A resumes with its old token and
	// cancels the order again: its write ends with advanceSaga, which finds
	// neither A's token nor the status A read, and the OrderCancelled A
	// inserted rolls back with it. Without the fence (mutant
	// SagaWritesUnfenced) A's cancellation commits, and the order service is
	// told twice.
	t.Run("StaleWorkerCannotCancelTwice", func(t *testing.T) {
		env := MustOpenApp(t)
		orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardDeclined)).Body, "order_id")
		startSagas(t, env)

		tookOver := false
		env.fault.setCtx(func(ctx context.Context, point faultPoint, pass int) error {
			if point != faultMidCompensation || workerOf(ctx) != "A" || tookOver {
				return nil
			}
			// A has recorded the reservation released, and stalls before
			// it cancels the order, past its lease; B takes the saga over
			// and finishes it.
			tookOver = true
			env.clock.advance(env.app.leases.saga + time.Second)
			bDone := make(chan error, 1)
			go func() {
				_, err := env.app.sagaOnce(withWorker(ctx, "B"), "worker-B", sagaBatchSize)
				bDone <- err
			}()
			if err := mustReceive(t, "worker B to finish the compensation", bDone); err != nil {
				t.Errorf("worker B: %v", err)
			}
			return nil
		})
		if _, err := env.app.sagaOnce(withWorker(ctx, "A"), "worker-A", sagaBatchSize); err != nil {
			t.Fatalf("worker A: %v", err)
		}
		env.fault.setCtx(nil)
		if !tookOver {
			t.Fatal("worker A never stalled in the middle of a compensation")
		}
		env.drain(t)

		mustAudit(t, env, true)
		if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=failed confirm=pending" {
			t.Fatalf("saga: %s", got)
		}
		if got := env.count(t, `SELECT COUNT(*) FROM outbox_events WHERE event_type = 'OrderCancelled' AND aggregate_id = ?`, orderID); got != 1 {
			t.Fatalf("got %d OrderCancelled events for the order, want 1", got)
		}
	})
}

// sagaStepsOf makes a saga's steps in step order from their statuses, one
// per step of fulfilmentSteps.
func sagaStepsOf(statuses ...stepStatus) []sagaStepRow {
	var steps []sagaStepRow
	for i, name := range fulfilmentSteps() {
		steps = append(steps, sagaStepRow{Index: i, Name: name, Status: statuses[i]})
	}
	return steps
}

// TestSagaDecisions pins the saga's state machine on its own, without a
// database: what a saga does next given its row and its steps, which steps
// compensate undoes and in what order, where a done step leads, and what a
// failure leads to.
func TestSagaDecisions(t *testing.T) {
	// Ensure the next action follows the article: run the first pending
	// step, compensate once compensating, nothing once ended.
	t.Run("NextAction", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			status sagaStatus
			steps  []sagaStepRow
			want   string
		}{
			{"NewSagaReservesStock", sagaInProgress, sagaStepsOf(stepPending, stepPending, stepPending), "run reserve_stock"},
			{"ReservedSagaCharges", sagaInProgress, sagaStepsOf(stepDone, stepPending, stepPending), "run charge_card"},
			{"ChargedSagaConfirms", sagaInProgress, sagaStepsOf(stepDone, stepDone, stepPending), "run confirm"},
			{"CompensatingSagaCompensates", sagaCompensating, sagaStepsOf(stepDone, stepFailed, stepPending), "compensate"},
			{"CompletedSagaIsLeft", sagaCompleted, sagaStepsOf(stepDone, stepDone, stepDone), "none"},
			{"CompensatedSagaIsLeft", sagaCompensated, sagaStepsOf(stepCompensated, stepFailed, stepPending), "none"},
			{"FailedCompensationIsLeftForAnOperator", sagaCompensationFailed, sagaStepsOf(stepDone, stepDone, stepFailed), "none"},
			{"InProgressWithNothingPendingIsABug", sagaInProgress, sagaStepsOf(stepDone, stepDone, stepDone), "error"},
			{"UnknownStatusIsABug", sagaStatus("paused"), sagaStepsOf(stepPending, stepPending, stepPending), "error"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				action, err := nextSagaAction(sagaRow{SagaID: "saga_1", Status: tc.status}, tc.steps)
				got := "error"
				if err == nil {
					got = map[sagaActionKind]string{actionNone: "none", actionRunStep: "run " + action.step.Name, actionCompensate: "compensate"}[action.kind]
				}
				if got != tc.want {
					t.Fatalf("got %s (%v), want %s", got, err, tc.want)
				}
			})
		}
	})

	// Ensure compensate undoes only the steps that ran, the last first (the
	// sample undid steps that never ran).
	t.Run("StepsToUndo", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			steps []sagaStepRow
			want  string
		}{
			{"DeclinedCardUndoesTheReservationOnly", sagaStepsOf(stepDone, stepFailed, stepPending), "reserve_stock"},
			{"LateFailureRefundsThenReleases", sagaStepsOf(stepDone, stepDone, stepFailed), "charge_card,reserve_stock"},
			{"OutOfStockUndoesNothing", sagaStepsOf(stepFailed, stepPending, stepPending), ""},
			{"ResumedCompensationSkipsWhatWasUndone", sagaStepsOf(stepDone, stepCompensated, stepFailed), "reserve_stock"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				var names []string
				for _, step := range stepsToUndo(tc.steps) {
					names = append(names, step.Name)
				}
				if got := strings.Join(names, ","); got != tc.want {
					t.Fatalf("got %q, want %q", got, tc.want)
				}
			})
		}
	})

	// Ensure a done step leads to the next one, and the last to completion.
	t.Run("AfterStepDone", func(t *testing.T) {
		var got []string
		for _, step := range sagaStepsOf(stepDone, stepDone, stepDone) {
			status, current := afterStepDone(step)
			got = append(got, string(status)+"@"+current)
		}
		want := "in_progress@charge_card in_progress@confirm completed@confirm"
		if strings.Join(got, " ") != want {
			t.Fatalf("got %s, want %s", strings.Join(got, " "), want)
		}
	})

	// Ensure a business failure compensates, a transient one (a charge
	// that timed out may have happened) is retried, and a compensation
	// that fails is retried, never compensated.
	t.Run("AfterFailure", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			status sagaStatus
			err    error
			want   failureAction
		}{
			{"DeclinedCardCompensates", sagaInProgress, fmt.Errorf("charge: %w", errCardDeclined), failureCompensate},
			{"OutOfStockCompensates", sagaInProgress, errOutOfStock, failureCompensate},
			{"PermanentFailureCompensates", sagaInProgress, permanent(errors.New("broken order")), failureCompensate},
			{"TimeoutIsRetried", sagaInProgress, errProcessorTimeout, failureRetryLater},
			{"FailingCompensationIsRetried", sagaCompensating, errCardDeclined, failureRetryLater},
			{"StepRecordedByAnotherWorkerIsReread", sagaInProgress, errStepNotPending, failureReread},
			{"LostLeaseLeavesTheSaga", sagaCompensating, errSagaLeaseLost, failureLeave},
		} {
			t.Run(tc.name, func(t *testing.T) {
				if got := afterFailure(tc.status, tc.err); got != tc.want {
					t.Fatalf("got %d, want %d", got, tc.want)
				}
			})
		}
	})

	// Ensure a compensation that keeps failing stops at
	// maxCompensationAttempts, and a forward step never does.
	t.Run("RetryAfter", func(t *testing.T) {
		status, attempts := retryAfter(sagaRow{Status: sagaCompensating, Attempts: maxCompensationAttempts - 2})
		if status != sagaCompensating || attempts != maxCompensationAttempts-1 {
			t.Fatalf("got %s after %d, want compensating", status, attempts)
		}
		status, _ = retryAfter(sagaRow{Status: sagaCompensating, Attempts: maxCompensationAttempts - 1})
		if status != sagaCompensationFailed {
			t.Fatalf("got %s, want compensation_failed", status)
		}
		status, _ = retryAfter(sagaRow{Status: sagaInProgress, Attempts: 100})
		if status != sagaInProgress {
			t.Fatalf("got %s, want in_progress", status)
		}
	})
}

// Ensure what a saga round keeps of each saga whose step it recorded done
// (readAfterStepDone: the round does not read the saga again) is what the
// database holds: the step's row, the charge's id, the saga's next step.
func TestSagaRoundKnowsWhatItWrote(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	for i := range 2 {
		mustCreateOrder(t, env, "user-42", fmt.Sprintf("k%d", i), orderBody(100, "sku-1", 1, pmCardVisa))
	}
	for range 2 {
		if _, err := env.app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := env.app.consumeOnce(ctx, env.app.consumers()[0], 10); err != nil {
			t.Fatal(err)
		}
	}
	var runs []*sagaRun
	var failures []error
	// Round 1 reserves, round 2 records the charges; round 3 confirms, and
	// the sagas end.
	for round := 1; round <= 2; round++ {
		var err error
		if runs, _, _, err = env.app.sagaRound(ctx, "worker-1", 10, runs, true, &failures); err != nil || len(failures) > 0 {
			t.Fatal(err, failures)
		}
		if len(runs) != 2 {
			t.Fatalf("round %d: %d sagas go on; want 2", round, len(runs))
		}
		for _, run := range runs {
			fresh := &sagaRun{lease: run.lease, order: run.order}
			if err := env.app.readSagaRuns(ctx, env.app.db, []*sagaRun{fresh}); err != nil {
				t.Fatal(err)
			}
			kept, read := fmt.Sprintf("%+v %+v", run.read.saga, run.read.steps), fmt.Sprintf("%+v %+v", fresh.read.saga, fresh.read.steps)
			if kept != read {
				t.Errorf("round %d: the round kept\n%s\nthe database holds\n%s", round, kept, read)
			}
		}
	}
	if runs, _, _, err := env.app.sagaRound(ctx, "worker-1", 10, runs, true, &failures); err != nil || len(runs) != 0 {
		t.Fatalf("round 3: %d sagas go on, %v; want none", len(runs), err)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM orders o JOIN saga_instances s ON s.order_id = o.order_id WHERE s.status = 'completed'`); got != 2 {
		t.Fatalf("%d sagas completed; want 2", got)
	}
}

// Ensure a hold is released once however often its compensation runs:
// releaseStock puts the items back unconditionally, and counts only with
// the reserve_stock step's record changed from done to compensated in the
// same transaction. A second undo of the step (a worker that read the
// step as done before the first committed, a repair) finds it compensated
// already, and its release rolls back.
func TestReserveStockUndoneTwicePutsBackOnce(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 2, pmCardDeclined)).Body, "order_id")
	startSagas(t, env)
	// Round by round, until the card is declined: the saga compensates,
	// and its reserve_stock is done, not undone yet.
	roundsUntil(t, env, orderID, "compensating", stepReserveStock)
	if got := stockOf(t, env, "sku-1"); got != "998/2/0" {
		t.Fatalf("sku-1 stock %s before the compensation, want 998/2/0", got)
	}
	run := currentRun(t, env, orderID)
	step := sagaStepRow{Index: 0, Name: stepReserveStock, Status: stepDone}
	if err := env.app.undoStep(ctx, run, step); err != nil {
		t.Fatalf("first undo: %v", err)
	}
	if err := env.app.undoStep(ctx, run, step); !errors.Is(err, errStepNotPending) {
		t.Fatalf("second undo of a compensated step: %v, want errStepNotPending", err)
	}
	if got := stockOf(t, env, "sku-1"); got != "1000/0/0" {
		t.Fatalf("sku-1 stock %s after two undos, want 1000/0/0", got)
	}
	env.drain(t)
	if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderCancelled) {
		t.Fatalf("order is %s, want cancelled", got)
	}
	mustAudit(t, env, true)
}

// roundsUntil runs the saga engine's rounds, one at a time, until the saga
// of orderID has status and its step doneStep is done.
func roundsUntil(tb testing.TB, env *testEnv, orderID string, status sagaStatus, doneStep string) {
	tb.Helper()
	var runs []*sagaRun
	var failures []error
	reached := func() bool {
		return env.count(tb, `SELECT COUNT(*) FROM saga_instances s
			JOIN saga_steps st ON st.saga_id = s.saga_id AND st.step_name = ?
			WHERE s.order_id = ? AND s.status = ? AND st.status = 'done'`, doneStep, orderID, status) == 1
	}
	for round := 0; !reached(); round++ {
		if round == 5 {
			tb.Fatalf("after %d rounds the saga is %s; want %s with %s done", round, sagaSteps(tb, env, orderID), status, doneStep)
		}
		var err error
		if runs, _, _, err = env.app.sagaRound(context.Background(), "worker-1", 10, runs, true, &failures); err != nil {
			tb.Fatal(err)
		}
	}
}

// currentRun returns the saga of orderID as a worker holding it now would
// have it: its order, and its lease's current token.
func currentRun(tb testing.TB, env *testEnv, orderID string) *sagaRun {
	tb.Helper()
	order, err := readOrder(context.Background(), env.app.db, orderID)
	if err != nil {
		tb.Fatal(err)
	}
	run := &sagaRun{order: order}
	run.lease.WorkerID = "worker-1"
	run.lease.SagaID = env.str(tb, `SELECT saga_id FROM saga_instances WHERE order_id = ?`, orderID)
	run.lease.Token = int64(env.count(tb, `SELECT lease_token FROM saga_instances WHERE saga_id = ?`, run.lease.SagaID))
	run.saga.SagaID, run.saga.OrderID = run.lease.SagaID, orderID
	return run
}

// Ensure a step already recorded done is not done again, even by the
// worker that holds the saga: its record refuses a second one
// (errStepNotPending), and the step's effect rolls back with it. A record
// that overwrote the first would take the stock twice under a token that
// still holds.
func TestReserveStockDoneTwiceTakesOnce(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 2, pmCardVisa)).Body, "order_id")
	startSagas(t, env)
	roundsUntil(t, env, orderID, sagaInProgress, stepReserveStock)
	if got := stockOf(t, env, "sku-1"); got != "998/2/0" {
		t.Fatalf("sku-1 stock %s after the reservation, want 998/2/0", got)
	}
	run := currentRun(t, env, orderID)
	run.step = sagaStepRow{Index: 0, Name: stepReserveStock, Status: stepPending}
	err := withFencedTx(ctx, env.app.db, func(tx *sql.Tx) error {
		return env.app.reserveStockStep(ctx, tx, run, env.clock.now())
	})
	if !errors.Is(err, errStepNotPending) {
		t.Fatalf("reserve_stock again: %v, want errStepNotPending", err)
	}
	if got := stockOf(t, env, "sku-1"); got != "998/2/0" {
		t.Fatalf("sku-1 stock %s after a second reservation, want 998/2/0", got)
	}
	env.drain(t)
	if got := env.str(t, `SELECT status FROM orders WHERE order_id = ?`, orderID); got != string(orderPaid) {
		t.Fatalf("order is %s, want paid", got)
	}
	mustAudit(t, env, true)
}

// Ensure a worker whose claim another worker's write has moved on asks
// the processor for no refund: it renews its lease first, as before any
// call to another system, finds the saga gone (errSagaLeaseLost) and
// stops. The refund is owed all the same; the saga's holder asks for it.
func TestStaleWorkerAsksForNoRefund(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	failConfirm(env, nil)
	orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
	startSagas(t, env)
	roundsUntil(t, env, orderID, sagaCompensating, stepChargeCard)
	stale := currentRun(t, env, orderID)
	stale.lease.Token--
	charge := sagaStepRow{Index: 1, Name: stepChargeCard, Status: stepDone}
	charge.Result.String, charge.Result.Valid = env.str(t, `SELECT result FROM saga_steps WHERE saga_id = ? AND step_name = ?`, stale.lease.SagaID, stepChargeCard), true
	if err := env.app.undoStep(ctx, stale, charge); !errors.Is(err, errSagaLeaseLost) {
		t.Fatalf("a stale worker's refund: %v, want errSagaLeaseLost", err)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM processor_refunds`); got != 0 {
		t.Fatalf("the processor was asked for %d refunds by a worker that lost the saga, want none", got)
	}
	env.drain(t)
	if got := sagaSteps(t, env, orderID); got != "compensated: reserve_stock=compensated charge_card=compensated confirm=failed" {
		t.Fatalf("saga: %s", got)
	}
	if got := env.str(t, `SELECT COUNT(*) || ':' || SUM(key_hits) FROM processor_refunds`); got != "1:0" {
		t.Fatalf("refunds:key hits = %s, want 1:0", got)
	}
	mustAudit(t, env, true)
}

// Ensure a worker whose claim another worker's write has moved on cannot
// set the saga aside: its failure is not the saga's, and the saga keeps
// its attempts, its next attempt, its error and its token.
func TestStaleWorkerCannotSetASagaAside(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	orderID := orderField(mustCreateOrder(t, env, "user-42", "k1", orderBody(5000, "sku-1", 1, pmCardVisa)).Body, "order_id")
	startSagas(t, env)
	roundsUntil(t, env, orderID, sagaInProgress, stepReserveStock)
	stale := currentRun(t, env, orderID)
	stale.lease.Token--
	row := func() string {
		return env.str(t, `SELECT attempts || '|' || COALESCE(last_error, '') || '|' || next_attempt_at || '|' || lease_token || '|' || COALESCE(locked_by, '')
			FROM saga_instances WHERE saga_id = ?`, stale.lease.SagaID)
	}
	before := row()
	err := withFencedTx(ctx, env.app.db, func(tx *sql.Tx) error {
		return env.app.setSagaAside(ctx, tx, stale.lease, errors.New("a stale worker's failure"))
	})
	if !errors.Is(err, errSagaLeaseLost) {
		t.Fatalf("a stale worker set the saga aside: %v, want errSagaLeaseLost", err)
	}
	if after := row(); after != before {
		t.Fatalf("saga %s, was %s: a stale worker changed it", after, before)
	}
}
