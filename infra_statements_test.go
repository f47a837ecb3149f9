package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	"modernc.org/sqlite"
)

// mustOpenSQLite opens a new SQLite database; it is closed when the test
// ends. The statement cache is SQLite's (pgx has its own).
func mustOpenSQLite(tb testing.TB) *sql.DB {
	tb.Helper()
	db, err := openDB(context.Background(), filepath.Join(tb.TempDir(), "test.db"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	return db
}

// cachedStatements returns the statements the connection of conn keeps.
func cachedStatements(tb testing.TB, conn *sql.Conn) map[string]*cachedStatement {
	tb.Helper()
	var statements map[string]*cachedStatement
	err := conn.Raw(func(driverConn any) error {
		statementConn, ok := driverConn.(*statementConn)
		if !ok {
			return fmt.Errorf("got a %T, want a *statementConn", driverConn)
		}
		statements = statementConn.statements
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return statements
}

func TestStatementCache(t *testing.T) {
	ctx := context.Background()
	const query = `SELECT available FROM stock_items WHERE sku = ?`

	// Ensure a query is prepared once per connection and its statement
	// runs again, with new arguments, on the next call.
	t.Run("PreparesOncePerConnection", func(t *testing.T) {
		conn, err := mustOpenSQLite(t).Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		var first, second int
		if err := conn.QueryRowContext(ctx, query, "sku-1").Scan(&first); err != nil {
			t.Fatal(err)
		}
		prepared := cachedStatements(t, conn)[query]
		if prepared == nil {
			t.Fatalf("got no cached statement for %q after a call", query)
		}
		if _, err := conn.ExecContext(ctx, `UPDATE stock_items SET available = available + 1 WHERE sku = ?`, "sku-1"); err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRowContext(ctx, query, "sku-1").Scan(&second); err != nil {
			t.Fatal(err)
		}
		if got := cachedStatements(t, conn)[query]; got != prepared {
			t.Fatalf("got statement %p on the second call, want the first's %p", got, prepared)
		}
		if second != first+1 {
			t.Fatalf("got %d after the update, want %d: the statement returned a stale row", second, first+1)
		}
	})

	// Ensure the same query run inside a loop over its own rows gets a
	// statement of its own instead of resetting the one being read.
	t.Run("SameQueryInsideItsOwnRows", func(t *testing.T) {
		db := mustOpenSQLite(t)
		const all = `SELECT sku FROM stock_items WHERE sku >= ? ORDER BY sku`
		err := withTx(ctx, db, func(tx *sql.Tx) error {
			rows, err := tx.QueryContext(ctx, all, "")
			if err != nil {
				return err
			}
			defer rows.Close()
			n := 0
			for rows.Next() {
				var sku, first string
				if err := rows.Scan(&sku); err != nil {
					return err
				}
				if err := tx.QueryRowContext(ctx, all, sku).Scan(&first); err != nil {
					return err
				}
				if first != sku {
					return fmt.Errorf("inner query got %s, want %s", first, sku)
				}
				n++
			}
			if err := rows.Err(); err != nil {
				return err
			}
			if n < 2 {
				return fmt.Errorf("got %d SKUs, want a few to loop over", n)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	})

	// Ensure queries past maxCachedStatements still run, prepared for one
	// use, and the cache stops growing.
	t.Run("BoundedCache", func(t *testing.T) {
		conn, err := mustOpenSQLite(t).Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		for i := range maxCachedStatements + 10 {
			var got int
			if err := conn.QueryRowContext(ctx, fmt.Sprintf(`SELECT %d`, i)).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if got != i {
				t.Fatalf("got %d, want %d", got, i)
			}
		}
		if got := len(cachedStatements(t, conn)); got > maxCachedStatements {
			t.Fatalf("got %d cached statements, want at most %d", got, maxCachedStatements)
		}
	})

	// Ensure a statement that failed (a constraint) is fit to run again.
	t.Run("ReusableAfterAnError", func(t *testing.T) {
		db := mustOpenSQLite(t)
		const insert = `INSERT INTO stock_items (sku, available, stocked) VALUES (?, 1, 1)`
		if _, err := db.ExecContext(ctx, insert, "sku-new"); err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, insert, "sku-new"); !isUniqueViolation(err) {
			t.Fatalf("got %v, want a unique violation", err)
		}
		if _, err := db.ExecContext(ctx, insert, "sku-newer"); err != nil {
			t.Fatalf("got %v after the failed insert, want the statement to run again", err)
		}
	})
}

func TestSQLiteReaders(t *testing.T) {
	ctx := context.Background()

	// Ensure a read connection refuses to write: a bug that wrote through
	// one would write outside the write lock's discipline.
	t.Run("RefuseWrites", func(t *testing.T) {
		readers := readersOf(mustOpenSQLite(t))
		_, err := readers.ExecContext(ctx, `UPDATE stock_items SET available = 0`)
		if err == nil {
			t.Fatal("a read connection wrote")
		}
	})

	// Ensure closing the write pool closes its readers, so a process (or a
	// test's restart) leaves no connection behind.
	t.Run("CloseWithTheWritePool", func(t *testing.T) {
		db, err := openDB(ctx, filepath.Join(t.TempDir(), "test.db"))
		if err != nil {
			t.Fatal(err)
		}
		readers := readersOf(db)
		if readers == db {
			t.Fatal("got the write pool as its own readers")
		}
		if err := readers.PingContext(ctx); err != nil {
			t.Fatal(err)
		}
		if err := db.Close(); err != nil {
			t.Fatal(err)
		}
		if err := readers.PingContext(ctx); err == nil {
			t.Fatal("the readers still answer after the write pool closed")
		}
	})
}

// TestNewFileOpenedByManyAtOnce opens a new SQLite file from several
// connections at once, as several processes starting together do. Each
// switches the file to WAL mode as it opens, which SQLite refuses at once
// with SQLITE_BUSY while another holds the file; sqliteConnector waits
// that out.
func TestNewFileOpenedByManyAtOnce(t *testing.T) {
	const files, openers = 40, 8
	for range files {
		dsn, err := sqliteDSN(filepath.Join(t.TempDir(), "test.db"), durabilityNormal)
		if err != nil {
			t.Fatal(err)
		}
		driverConnector, err := sqlite.NewConnector(dsn)
		if err != nil {
			t.Fatal(err)
		}
		connector := sqliteConnector{Connector: driverConnector}
		errs := atOnce(openers, func(int) error {
			conn, err := connector.Connect(context.Background())
			if err != nil {
				return err
			}
			return conn.Close()
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("%d connections opening a new file at once: %v", openers, err)
		}
	}
}
