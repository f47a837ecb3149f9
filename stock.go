// The warehouse: stock that the saga reserves, then sells or releases. Each
// hold is a stock_reservations row, so it moves out of "reserved" exactly
// once. A SKU's row counts what is on the shelf (available); what is
// reserved or sold is its reservations, so available plus the SKU's
// reservations reserved or sold always equals stocked.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// reservationStatus is stock_reservations.status.
type reservationStatus string

const (
	stockReserved reservationStatus = "reserved"
	stockReleased reservationStatus = "released"
	stockSold     reservationStatus = "sold"
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

// settleReservations moves every hold of an order that is still reserved to
// to (sold or released); a release puts the stock back on the shelf, a sale
// writes nothing more (sold stock is its reservation's row). Holds already
// settled are left alone.
func settleReservations(ctx context.Context, tx *sql.Tx, orderID string, to reservationStatus, now time.Time) error {
	switch to {
	case stockSold, stockReleased:
	default:
		return fmt.Errorf("bug: unhandled reservation status %q", to)
	}
	rows, err := tx.QueryContext(ctx, `
		UPDATE stock_reservations SET status = ?, updated_at = ?
		WHERE order_id = ? AND status = ?
		RETURNING sku, qty`, to, formatTime(now), orderID, stockReserved)
	if err != nil {
		return fmt.Errorf("settle reservations of %s: %w", orderID, err)
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
		return fmt.Errorf("settle reservations of %s: %w", orderID, err)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("settle reservations of %s: %w", orderID, err)
	}
	if to == stockSold {
		return nil
	}
	for _, h := range holds {
		_, err := tx.ExecContext(ctx, `UPDATE stock_items SET available = available + ? WHERE sku = ?`, h.qty, h.sku)
		if err != nil {
			return fmt.Errorf("settle %s: %w", h.sku, err)
		}
	}
	return nil
}
