// The warehouse: stock that the saga reserves, then sells or releases. Each
// hold is a stock_reservations row, so it is released at most once. A
// SKU's row counts what is on the shelf (available); what is held is its
// reservations, so available plus the SKU's reservations still reserved
// always equals stocked.
//
// A sale writes nothing here: a hold is sold when its saga completed,
// which the confirm step records in the same transaction as
// PaymentCaptured (schema version 13). Sold stock is a reservation of a
// completed saga, and only a saga still running can release one.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// soldHold is the SQL condition of a hold that is sold, on a
// stock_reservations row named r: still reserved, and its saga completed.
const soldHold = `(r.status = 'reserved' AND EXISTS (SELECT 1 FROM saga_instances sold_by
	WHERE sold_by.order_id = r.order_id AND sold_by.status = 'completed'))`

// reservationStatus is stock_reservations.status.
type reservationStatus string

const (
	stockReserved reservationStatus = "reserved"
	stockReleased reservationStatus = "released"
)

// reserveStock holds every item of order, in tx. Returns errOutOfStock
// (wrapped with the sku) if any item is short; the caller's savepoint then
// rolls back the holds already taken.
func reserveStock(ctx context.Context, tx *sql.Tx, order orderRow, now time.Time) error {
	for _, item := range order.Items {
		updated, err := tx.ExecContext(ctx, `
			UPDATE stock_items SET available = available - ?
			WHERE sku = ? AND available >= ?`,
			item.Qty, item.SKU, item.Qty)
		if err != nil {
			return fmt.Errorf("reserve %s: %w", item.SKU, err)
		}
		n, err := updated.RowsAffected()
		if err != nil {
			return fmt.Errorf("reserve %s: %w", item.SKU, err)
		}
		if n == 0 {
			return fmt.Errorf("%w: %d of %s", errOutOfStock, item.Qty, item.SKU)
		}
		_, err = tx.ExecContext(ctx, `
			INSERT INTO stock_reservations (order_id, sku, qty, status, created_at, updated_at)
			VALUES (?, ?, ?, ?, ?, ?)`,
			order.OrderID, item.SKU, item.Qty, stockReserved, formatTime(now), formatTime(now))
		if err != nil {
			return fmt.Errorf("record reservation of %s: %w", item.SKU, err)
		}
	}
	return nil
}

// releaseReservations puts every hold of an order that is still reserved
// back on the shelf, and marks it released: the compensation of
// reserveStock. Holds already released are left alone.
func releaseReservations(ctx context.Context, tx *sql.Tx, orderID string, now time.Time) error {
	rows, err := tx.QueryContext(ctx, `
		UPDATE stock_reservations SET status = ?, updated_at = ?
		WHERE order_id = ? AND status = ?
		RETURNING sku, qty`, stockReleased, formatTime(now), orderID, stockReserved)
	if err != nil {
		return fmt.Errorf("release reservations of %s: %w", orderID, err)
	}
	type hold struct {
		sku string
		qty int64
	}
	var holds []hold
	for rows.Next() {
		var h hold
		if err := rows.Scan(&h.sku, &h.qty); err != nil {
			rows.Close()
			return fmt.Errorf("scan reservation: %w", err)
		}
		holds = append(holds, h)
	}
	if err := rows.Close(); err != nil {
		return fmt.Errorf("release reservations of %s: %w", orderID, err)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("release reservations of %s: %w", orderID, err)
	}
	for _, h := range holds {
		_, err := tx.ExecContext(ctx, `UPDATE stock_items SET available = available + ? WHERE sku = ?`, h.qty, h.sku)
		if err != nil {
			return fmt.Errorf("release %s: %w", h.sku, err)
		}
	}
	return nil
}
