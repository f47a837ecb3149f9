package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Ensure rebind numbers every placeholder and leaves a "?" in a literal, a
// quoted identifier or a comment alone.
func TestRebind(t *testing.T) {
	tests := []struct{ in, want string }{
		{`SELECT 1`, `SELECT 1`},
		{`SELECT ? , ?`, `SELECT $1 , $2`},
		{`INSERT INTO t (a, b) VALUES (?, ?) RETURNING a`, `INSERT INTO t (a, b) VALUES ($1, $2) RETURNING a`},
		{`SELECT COALESCE(x, '?') || ? FROM t`, `SELECT COALESCE(x, '?') || $1 FROM t`},
		{`SELECT 'it''s ?', ?`, `SELECT 'it''s ?', $1`},
		{`SELECT "odd?name" FROM t WHERE a = ?`, `SELECT "odd?name" FROM t WHERE a = $1`},
		{"SELECT ? -- why?\nFROM t WHERE a = ?", "SELECT $1 -- why?\nFROM t WHERE a = $2"},
		{`SELECT /* ? */ ?`, `SELECT /* ? */ $1`},
		{`SELECT 'unterminated ?`, `SELECT 'unterminated ?`},
		{`SELECT ? -- trailing ?`, `SELECT $1 -- trailing ?`},
		{`SELECT ?2, ?1, ?2`, `SELECT $2, $1, $2`},
	}
	for _, test := range tests {
		if got := rebind(test.in); got != test.want {
			t.Errorf("rebind(%q) = %q, want %q", test.in, got, test.want)
		}
	}
}

// Ensure a --db value is PostgreSQL only when it is a postgres:// URL: a
// file that happens to be named "postgres" is still SQLite.
func TestIsPostgresURL(t *testing.T) {
	for target, want := range map[string]bool{
		"postgres://127.0.0.1/retrysafe":   true,
		"postgresql://u@db:5432/retrysafe": true,
		"retrysafe.db":                     false,
		"postgres":                         false,
		"./postgres://x":                   false,
	} {
		if got := isPostgresURL(target); got != want {
			t.Errorf("isPostgresURL(%q) = %v, want %v", target, got, want)
		}
	}
}

// Ensure withTx keeps read-then-write transactions serializable on
// PostgreSQL as BEGIN IMMEDIATE does on SQLite: concurrent read-modify-write
// cycles lose no update (READ COMMITTED would), and they fail only as busy
// (503 to a client), after maxTxAttempts lost serialization conflicts in a
// row: without the retry, nearly every one would. Eight writers on one row
// on a loaded machine now and then exhaust the attempts; what counts is
// that every cycle that succeeded is in the row.
func TestConcurrentReadModifyWrite(t *testing.T) {
	env := MustOpenApp(t)
	ctx := context.Background()
	const writers, rounds = 8, 10
	var wg sync.WaitGroup
	errs := make(chan error, writers*rounds)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				errs <- withTx(ctx, env.app.db, func(tx *sql.Tx) error {
					var available int
					if err := tx.QueryRowContext(ctx, `SELECT available FROM stock_items WHERE sku = 'sku-1'`).Scan(&available); err != nil {
						return err
					}
					_, err := tx.ExecContext(ctx, `UPDATE stock_items SET available = ? WHERE sku = 'sku-1'`, available-1)
					return err
				})
			}
		}()
	}
	wg.Wait()
	close(errs)
	succeeded, busy := 0, 0
	for err := range errs {
		switch {
		case err == nil:
			succeeded++
		case isBusy(err):
			busy++
		default:
			t.Fatal(err)
		}
	}
	if busy > writers*rounds/10 {
		t.Fatalf("%d of %d cycles failed busy: the retry is not retrying", busy, writers*rounds)
	}
	if got := env.count(t, `SELECT available FROM stock_items WHERE sku = 'sku-1'`); got != 1000-succeeded {
		t.Fatalf("available = %d after %d decrements from 1000, want %d", got, succeeded, 1000-succeeded)
	}
}

// tableColumns returns "table.column" for every column of db's tables, in
// order, from a query that lists table and column names.
func tableColumns(tb testing.TB, db *sql.DB, query string) []string {
	tb.Helper()
	rows, err := db.Query(query)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	var columns []string
	for rows.Next() {
		var table, column string
		if err := rows.Scan(&table, &column); err != nil {
			tb.Fatal(err)
		}
		columns = append(columns, table+"."+column)
	}
	if err := rows.Err(); err != nil {
		tb.Fatal(err)
	}
	sort.Strings(columns)
	return columns
}

// Ensure both schema files have the same versions. A header mistyped in one
// file leaves its change inside the version before it, which a database
// already at that version never runs: it would keep what the change drops.
func TestSchemaFilesHaveTheSameVersions(t *testing.T) {
	sqliteVersions, err := schemaMigrations(schemaSQL)
	if err != nil {
		t.Fatal(err)
	}
	postgresVersions, err := schemaMigrations(schemaPostgresSQL)
	if err != nil {
		t.Fatal(err)
	}
	if len(sqliteVersions) != len(postgresVersions) {
		t.Fatalf("schema.sql has %d versions, schema_postgres.sql %d", len(sqliteVersions), len(postgresVersions))
	}
}

// Ensure schema.sql and schema_postgres.sql describe the same tables and
// columns: a migration added to one file and forgotten in the other fails
// here.
func TestSchemasAgree(t *testing.T) {
	if !onPostgres() {
		t.Skipf("set %s to compare the PostgreSQL schema with SQLite's", testPostgresEnv)
	}
	ctx := context.Background()
	sqliteDB, err := openDB(ctx, filepath.Join(t.TempDir(), "schema.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer sqliteDB.Close()
	postgresDB, err := openDB(ctx, testDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer postgresDB.Close()
	sqliteColumns := tableColumns(t, sqliteDB, `
		SELECT m.name, c.name FROM sqlite_schema m, pragma_table_info(m.name) c WHERE m.type IN ('table', 'view')`)
	postgresColumns := tableColumns(t, postgresDB, `
		SELECT table_name, column_name FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name <> 'schema_migrations'`)
	if got, want := strings.Join(postgresColumns, "\n"), strings.Join(sqliteColumns, "\n"); got != want {
		t.Fatalf("PostgreSQL columns:\n%s\n\nSQLite columns:\n%s", got, want)
	}
}

// Ensure a request that loses its PostgreSQL connection (the server shut
// down or restarted, the backend terminated, no connection to be had) is
// answered 503 with Retry-After, as a busy database is: nothing was stored,
// and the client may retry with the same key. A chaos outage on
// PostgreSQL answered 753 requests 500 before. So is one that finds the
// database out of room (a full disk, no memory, a failed write).
func TestDatabaseUnavailableIs503(t *testing.T) {
	s := &server{logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, err := range []error{
		fmt.Errorf("begin: %w", &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}),
		fmt.Errorf("read order: %w", &pgconn.PgError{Code: "08006", Message: "connection failure"}),
		fmt.Errorf("begin: %w", &pgconn.PgError{Code: "53300", Message: "too many clients already"}),
		fmt.Errorf("read order: %w", driver.ErrBadConn),
		fmt.Errorf("commit: %w", pgconn.ErrConnClosed),
		// Out of room: the disk is full, memory ran out, the disk failed.
		fmt.Errorf("insert order: %w", &pgconn.PgError{Code: "53100", Message: "could not extend file: No space left on device"}),
		fmt.Errorf("insert order: %w", &pgconn.PgError{Code: "53200", Message: "out of memory"}),
		fmt.Errorf("commit: %w", &pgconn.PgError{Code: "58030", Message: "could not fsync file"}),
		// A group commit whose transaction another member lost.
		fmt.Errorf("%w: release savepoint: %w", errBatchLost, errors.New("no such savepoint: request")),
	} {
		recorder := httptest.NewRecorder()
		s.writeError(recorder, httptest.NewRequest("POST", "/api/orders", nil), err)
		if recorder.Code != 503 || recorder.Header().Get("Retry-After") == "" {
			t.Errorf("%v: got %d %s, want 503 with Retry-After", err, recorder.Code, recorder.Body)
		}
	}
}

// TestFencedTxIsolation checks which isolation level each transaction
// helper runs at on PostgreSQL: a saga's fenced transactions READ
// COMMITTED (their fencing UPDATE already serializes them; see
// withFencedTx), everything else that withTx runs SERIALIZABLE.
func TestFencedTxIsolation(t *testing.T) {
	if !onPostgres() {
		t.Skip("isolation levels are PostgreSQL's; SQLite runs one writer at a time")
	}
	env := MustOpenApp(t)
	ctx := context.Background()
	levelIn := func(run func(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error) string {
		t.Helper()
		var level string
		err := run(ctx, env.app.db, func(tx *sql.Tx) error {
			return tx.QueryRowContext(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&level)
		})
		if err != nil {
			t.Fatal(err)
		}
		return level
	}
	if got := levelIn(withFencedTx); got != "read committed" {
		t.Errorf("withFencedTx runs %q, want read committed", got)
	}
	if got := levelIn(withTx); got != "serializable" {
		t.Errorf("withTx runs %q, want serializable", got)
	}
}

// TestHotSKUUnderConcurrentSagas runs many sagas at once, from several
// workers, for one SKU with less stock than orders: the stock is never
// sold twice (available + reserved + sold stays stocked, the reserved
// units are exactly the paid orders' items), every order ends paid or
// cancelled, and no saga fails on our side. On PostgreSQL the
// reservations run READ COMMITTED (withFencedTx); this is what shows they
// still cannot oversell.
func TestHotSKUUnderConcurrentSagas(t *testing.T) {
	env := MustOpenApp(t)
	ctx := context.Background()
	const orders, stock, workers = 24, 10, 6
	if _, err := env.app.db.ExecContext(ctx, `UPDATE stock_items SET available = ?, stocked = ? WHERE sku = 'sku-2'`, stock, stock); err != nil {
		t.Fatal(err)
	}
	for i := range orders {
		mustCreateOrder(t, env, "user-42", fmt.Sprintf("hot-%d", i), orderBody(5000, "sku-2", 1, pmCardVisa))
	}
	startSagas(t, env)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n, err := env.app.sagaOnce(ctx, fmt.Sprintf("worker-%d", w), 1)
				if err != nil || n == 0 {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	env.drain(t)
	if got := stockOf(t, env, "sku-2"); got != fmt.Sprintf("0/0/%d", stock) {
		t.Errorf("sku-2 available/reserved/sold = %s, want 0/0/%d", got, stock)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'paid'`); got != stock {
		t.Errorf("%d orders paid, want %d (one per unit)", got, stock)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM orders WHERE status = 'cancelled'`); got != orders-stock {
		t.Errorf("%d orders cancelled, want %d", got, orders-stock)
	}
	if got := env.count(t, `SELECT COUNT(*) FROM stock_holds r WHERE r.sku = 'sku-2' AND `+soldHold); got != stock {
		t.Errorf("%d reservations sold, want %d", got, stock)
	}
}

// TestPostgresRunsSagasSideBySide checks that a saga round makes its
// processor calls side by side on PostgreSQL (startWorkerLoops sets
// sagaCallsSideBySide): two sagas of one round wait for each other before
// their calls, which calls made one after another could never let happen.
func TestPostgresRunsSagasSideBySide(t *testing.T) {
	if !onPostgres() {
		t.Skip("SQLite makes a round's processor calls one after another")
	}
	target := testDatabase(t)
	// waiting counts the sagas now waiting before their processor call;
	// together closes when two are.
	var waiting atomic.Int32
	together := make(chan struct{})
	var closeTogether sync.Once
	fault := func(ctx context.Context, point faultPoint) error {
		if point != faultBeforeProcessorCall {
			return nil
		}
		defer waiting.Add(-1)
		if waiting.Add(1) == 2 {
			closeTogether.Do(func() { close(together) })
		}
		// Wait for the other saga, or give up: calls made one after
		// another never bring it here while this one waits.
		select {
		case <-together:
			return nil
		case <-time.After(wakeDeadline):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	app, err := openApp(context.Background(), target, nil, nil, fault)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { app.db.Close() })
	// Both sagas are started before any saga loop runs, so its first
	// claim takes both, and they reach charge_card in the same round.
	api := serveInProcess(t, app, target, false)
	client := benchClient(2)
	var orderIDs []string
	for i := range 2 {
		status, answer, err := postOrder(client, api.URL, fmt.Sprintf("side-by-side-%d", i), orderBody(5000, "sku-1", 1, pmCardVisa))
		if err != nil || status != http.StatusCreated {
			t.Fatalf("POST: got %d %s, %v; want 201", status, answer, err)
		}
		var order struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(answer, &order); err != nil {
			t.Fatalf("decode %s: %v", answer, err)
		}
		orderIDs = append(orderIDs, order.OrderID)
	}
	ctx := context.Background()
	payment := app.consumers()[0]
	for sagas := 0; sagas < 2; {
		if _, err := app.relayOnce(ctx, "test-relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
		if _, err := app.consumeOnce(ctx, payment, consumeBatchSize); err != nil {
			t.Fatal(err)
		}
		if err := app.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM saga_instances`).Scan(&sagas); err != nil {
			t.Fatal(err)
		}
	}
	watcher := watchFinal(t, target)
	serveInProcess(t, app, target, true)
	for _, orderID := range orderIDs {
		final := make(chan struct{})
		go func() {
			watcher.wait(orderID)
			close(final)
		}()
		select {
		case <-final:
		case <-time.After(3 * wakeDeadline):
			// Two calls made one after another, each waiting wakeDeadline
			// for the other, still end within this.
			t.Fatalf("order %s not final after %s", orderID, 3*wakeDeadline)
		}
	}
	select {
	case <-together:
	default:
		t.Fatal("the second saga reached the processor only after the first had given up waiting: the round made its calls one after another")
	}
}

// Ensure two and three processes starting at once on one database, new or
// at any older schema version, all start, and leave it at this program's
// version. On PostgreSQL a waiter on the migration lock used to read the
// version as it was before the lock was granted (its snapshot was taken
// when the lock statement began) and apply the same version again: "type
// utc_time already exists", one process out of two failing to start.
func TestMigrateConcurrently(t *testing.T) {
	ctx := context.Background()
	schema := schemaSQL
	if onPostgres() {
		schema = schemaPostgresSQL
	}
	migrations, err := schemaMigrations(schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, processes := range []int{2, 3} {
		for from := 0; from < len(migrations); from++ {
			t.Run(fmt.Sprintf("%dProcessesFromVersion%d", processes, from), func(t *testing.T) {
				target := testDatabase(t)
				migrateTo(t, target, from)
				errs := atOnce(processes, func(int) error {
					db, err := openDB(ctx, target)
					if err != nil {
						return err
					}
					return db.Close()
				})
				for i, err := range errs {
					if err != nil {
						t.Fatalf("process %d of %d: %v", i+1, processes, err)
					}
				}
				db, err := openReadOnlyDB(ctx, target)
				if err != nil {
					t.Fatal(err)
				}
				db.Close()
			})
		}
	}
}

// openUnmigrated opens the database at target as it is, at whatever schema
// version (on SQLite with the connection settings of a program before
// this one: a file in WAL mode).
func openUnmigrated(tb testing.TB, target string) *sql.DB {
	tb.Helper()
	var db *sql.DB
	var err error
	if isPostgresURL(target) {
		db, err = connectPostgres(context.Background(), target)
	} else {
		var dsn string
		if dsn, err = sqliteDSN(target, durabilityNormal); err == nil {
			db, err = sql.Open("sqlite", dsn)
		}
	}
	if err != nil {
		tb.Fatal(err)
	}
	return db
}

// migrateTo applies the first version sections of the schema to the new
// database at target, as a program of that version would have (on SQLite
// with the connection settings it had: a file in WAL mode).
func migrateTo(tb testing.TB, target string, version int) {
	tb.Helper()
	ctx := context.Background()
	if version == 0 && !isPostgresURL(target) {
		return
	}
	db := openUnmigrated(tb, target)
	defer db.Close()
	d := dialectOf(db)
	migrations, err := schemaMigrations(d.schema)
	if err != nil {
		tb.Fatal(err)
	}
	for v := 1; v <= version; v++ {
		statements := append(append([]string{}, d.prepareMigration...), migrations[v-1], d.setVersion(v))
		for _, statement := range statements {
			if _, err := db.ExecContext(ctx, statement); err != nil {
				tb.Fatalf("version %d: %v", v, err)
			}
		}
	}
}
