// The warehouse: stock that the saga reserves, then sells or releases. A
// SKU's row counts what is on the shelf (available). An order's hold is
// the record of its saga's reserve_stock step: the step is recorded done
// in the transaction that takes its items off the shelf, and compensated
// in the one that puts them back, and that record changes from done to
// compensated once (markStepCompensated), so a hold is released at most
// once. The stock_holds view reads the holds from those records and the
// orders' items, so available plus the SKU's holds still reserved always
// equals stocked (schema version 14).
//
// A sale writes nothing here: a hold is sold when its saga completed,
// which the confirm step records in the same transaction as
// PaymentCaptured (schema version 13). Sold stock is a hold of a
// completed saga, and only a saga still running can release one.

package main

import (
	"context"
	"database/sql"
	"fmt"
)

// soldHold is the SQL condition of a hold that is sold, on a stock_holds
// row named r: still reserved, and its saga completed.
const soldHold = `(r.status = 'reserved' AND EXISTS (SELECT 1 FROM saga_instances sold_by
	WHERE sold_by.order_id = r.order_id AND sold_by.status = 'completed'))`

// reservationStatus is stock_holds.status: reserved while the
// reserve_stock step is done, released once it is compensated (the view
// writes both; no Go code writes a status since schema version 14).
type reservationStatus string

const stockReserved reservationStatus = "reserved"

// reserveStock takes every item of order off the shelf, in tx: the
// transaction that records the reserve_stock step done, which is the hold.
// Returns errOutOfStock (wrapped with the sku) if any item is short; the
// caller's savepoint then rolls back the items already taken.
//
// Until schema version 14 each item's hold was a stock_reservations row of
// its own, inserted here: one row written per item that the step's record
// already says.
func reserveStock(ctx context.Context, tx *sql.Tx, order orderRow) error {
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
	}
	return nil
}

// releaseStock puts every item of order back on the shelf, in tx: the
// compensation of reserveStock. It counts only with the reserve_stock
// step's record changed from done to compensated in the same transaction
// (markStepCompensated, which fails and rolls this back if the step is
// not done), so the hold is released once however often a compensation is
// retried.
func releaseStock(ctx context.Context, tx *sql.Tx, order orderRow) error {
	for _, item := range order.Items {
		_, err := tx.ExecContext(ctx, `UPDATE stock_items SET available = available + ? WHERE sku = ?`, item.Qty, item.SKU)
		if err != nil {
			return fmt.Errorf("release %s: %w", item.SKU, err)
		}
	}
	return nil
}
