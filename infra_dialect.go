// This file is the one place where SQLite and PostgreSQL need different SQL.
// Every other statement in retrysafe is written once, in the SQL both
// accept, with "?" placeholders (infra_postgres.go rebinds them to "$n"). Each
// difference below says why it exists.

package main

import (
	"database/sql"
	_ "embed"
	"fmt"
	"strings"
	"unicode/utf8"
)

//go:embed schema_postgres.sql
var schemaPostgresSQL string

// dialect is what differs between the two databases.
type dialect struct {
	name string
	// schema is the migration file: schema.sql or schema_postgres.sql. The
	// tables, columns and constraints are the same; the types are spelled
	// for each database (BLOB/BYTEA, rowid/identity, WITHOUT ROWID).
	schema string

	// txOptions begin every ordinary transaction.
	//
	// SQLite runs one writer at a time: BEGIN IMMEDIATE (see openDBWith)
	// takes the write lock up front, so every transaction sees the database
	// as if it were alone, and the code relies on that (read a key, then
	// insert it; read an order's refunds, then add one). PostgreSQL runs
	// transactions side by side; SERIALIZABLE gives the same promise, by
	// failing one of two transactions that would have interleaved unsafely
	// with SQLSTATE 40001. withTx retries those, so the same code keeps the
	// same guarantee without a lock of its own in every flow.
	txOptions *sql.TxOptions
	// claimTxOptions begin the claims of relays and workers (withClaimTx).
	//
	// On PostgreSQL they run READ COMMITTED: a claim is one UPDATE that
	// locks the rows it takes and skips those another worker is taking, and
	// it re-checks its conditions on the locked row. Under SERIALIZABLE, two
	// relays scanning the same queue would keep failing each other.
	claimTxOptions *sql.TxOptions
	// fencedTxOptions begin a saga's transactions (withFencedTx).
	//
	// On PostgreSQL they run READ COMMITTED. Every one ends with the
	// compare-and-set of advanceSaga, an UPDATE of the saga's row that
	// re-checks the lease token on the row's latest version once its lock
	// is granted, so of two transactions for one saga only one counts; a
	// step's row is unique, so a step is recorded once; and a reservation's
	// "UPDATE stock_items ... WHERE available >= ?" is re-checked on the row
	// once its lock is granted, so no stock is sold twice. SERIALIZABLE
	// added nothing to that but failures: two sagas reserving the same SKU
	// at once, one of them with 40001, again and again while that SKU was
	// hot.
	fencedTxOptions *sql.TxOptions
	// keyTxOptions and lockKey begin every transaction that claims an
	// idempotency key (keyTx): createOrder's, and a refund's acquireKey.
	// One discipline for every claim: a claim that took the lock and one
	// that did not (SERIALIZABLE alone) would both find the key free, both
	// insert it, and one would fail with a unique violation.
	//
	// On PostgreSQL, SERIALIZABLE is too blunt here: looking up a key that
	// is not there takes a predicate (SIRead) lock on the index page it
	// would be on. That lock blocks nobody, but concurrent requests with
	// different keys (adjacent in the index) then fail each other's commit
	// with 40001 and retry over and over. What the transaction needs is
	// narrower: no other request may claim the same (user, key) until it
	// commits, which is what BEGIN IMMEDIATE gives on SQLite. So it runs
	// READ COMMITTED and first takes a transaction-scoped advisory lock on a
	// hash of the (user, key) pair: a duplicate request waits there, then
	// sees the committed key and replays. Everything else it writes is new
	// rows of its own, or, for a refund, one UPDATE of the key that checks
	// the row is still as it was read (see acquireKey).
	keyTxOptions *sql.TxOptions
	// lockKey takes that lock; its one parameter names the (user, key)
	// pair (see keyTx). Empty on SQLite.
	lockKey string
	// retryTx says whether withTx retries a transaction that failed with
	// err. SQLite never needs to (BEGIN IMMEDIATE waits for the lock
	// instead of failing); PostgreSQL reports serialization failures and
	// deadlocks, after which the whole transaction may simply run again.
	retryTx func(err error) bool

	// skipLocked ends the SELECT that picks the rows a claim takes. On
	// PostgreSQL, FOR UPDATE SKIP LOCKED makes two relays (or workers)
	// claiming at once take different rows instead of waiting for each
	// other. SQLite has no row locks and needs none: the claim holds the
	// write lock.
	skipLocked string
	// forShare ends a sub-SELECT that reads a lease a write depends on
	// (markPublished's relay lease). On PostgreSQL, FOR SHARE makes the
	// write wait for a takeover of the lease that is committing, and read
	// the lease again once it has: without it, a statement that started
	// before the takeover committed reads the old token and writes. SQLite
	// needs none: one writer at a time.
	forShare string

	// deliveryPosition is what a publish writes into an event's
	// delivery_position (markPublished, an inbox replay): a number no
	// reconciler's cursor can have passed yet (deliver.go). SQLite: one
	// more than the largest so far; one writer at a time, so positions
	// grow in the order their writes commit. PostgreSQL: the writing
	// transaction's id. Transactions there commit in another order than
	// they take ids, which deliveryHorizon answers.
	deliveryPosition string
	// deliveryHorizon is, in the statement that reads it, a position below
	// which every publish that will ever commit is already visible: the
	// reconciler's cursor never passes it. SQLite: one more than the
	// largest position in the statement's snapshot (any later write comes
	// after it, and stamps at least that). PostgreSQL: the oldest transaction id still running when
	// the statement's snapshot was taken (its xmin); every transaction
	// below it has ended, and every later one takes a larger id.
	deliveryHorizon string

	// readVersion returns the schema version a database is at, 0 for a new
	// one. SQLite keeps it in the file header (PRAGMA user_version);
	// PostgreSQL has nothing like it, so it is a table.
	readVersion string
	// prepareMigration runs first in each migration's transaction.
	// PostgreSQL: take an advisory lock, so two processes starting on a new
	// database do not both apply a version (their CREATE TABLEs would
	// race), then create the version table if needed. SQLite: nothing;
	// BEGIN IMMEDIATE already serializes them.
	prepareMigration []string
	// migrateTxOptions begin each migration's transaction.
	//
	// On PostgreSQL they run READ COMMITTED, so that the version read after
	// the advisory lock is granted sees what the process that held the lock
	// committed. Under SERIALIZABLE (or REPEATABLE READ) the transaction's
	// snapshot is taken when its first statement starts, which is the lock
	// itself, before it is granted: a process that waited there read the
	// version as it was and applied the same version again ("type utc_time
	// already exists"), and failed to start.
	migrateTxOptions *sql.TxOptions
	// setVersion records that version has been applied.
	setVersion func(version int) string

	// withinADay is a condition: the times a and b (TEXT columns in
	// timeFormat) are less than a day apart. SQLite has no time type and
	// converts with julianday; PostgreSQL casts the text to timestamptz.
	withinADay func(a, b string) string
	// jsonField is the text of field in the JSON object held in a BLOB
	// (BYTEA) column. SQLite's json_extract reads text; PostgreSQL decodes
	// the bytes and uses jsonb.
	jsonField func(column, field string) string
	// isInteger is a condition: an INTEGER column holds a whole number.
	// SQLite stores whatever a statement computes, so a sum that overflows
	// 64 bits silently becomes a REAL; a PostgreSQL BIGINT column raises an
	// error instead, so there it always holds.
	isInteger func(column string) string
}

// sqliteDialect is SQLite, the default.
func sqliteDialect() *dialect {
	return &dialect{
		name:             "sqlite",
		schema:           schemaSQL,
		txOptions:        nil,
		claimTxOptions:   nil,
		fencedTxOptions:  nil,
		keyTxOptions:     nil,
		lockKey:          "",
		retryTx:          func(error) bool { return false },
		skipLocked:       "",
		forShare:         "",
		deliveryPosition: sqliteNextPosition,
		deliveryHorizon:  sqliteNextPosition,
		readVersion:      `PRAGMA user_version`,
		migrateTxOptions: nil,
		setVersion:       func(version int) string { return fmt.Sprintf(`PRAGMA user_version = %d`, version) },
		withinADay:       func(a, b string) string { return fmt.Sprintf(`abs(julianday(%s) - julianday(%s)) < 1.0`, a, b) },
		jsonField: func(column, field string) string {
			return fmt.Sprintf(`json_extract(CAST(%s AS TEXT), '$.%s')`, column, field)
		},
		isInteger: func(column string) string { return fmt.Sprintf(`typeof(%s) = 'integer'`, column) },
	}
}

// sqliteNextPosition is one more than the largest delivery position (read
// off the end of outbox_events_delivery: without IS NOT NULL, SQLite reads
// the whole table), and never below the cursor: cleanup deletes the oldest events, and once it
// has deleted every one below the cursor the largest left can be smaller
// than the cursor; a position stamped there would never be read.
const sqliteNextPosition = `MAX(
	COALESCE((SELECT MAX(delivery_position) FROM outbox_events WHERE delivery_position IS NOT NULL), 0) + 1,
	(SELECT position FROM delivery_cursor WHERE name = 'outbox'))`

// postgresMigrationLock is the advisory lock key migrations hold: any
// constant that no other program on the database uses.
const postgresMigrationLock = 7365_4219

// postgresDialect is PostgreSQL.
func postgresDialect() *dialect {
	return &dialect{
		name:            "postgres",
		schema:          schemaPostgresSQL,
		txOptions:       &sql.TxOptions{Isolation: sql.LevelSerializable},
		claimTxOptions:  &sql.TxOptions{Isolation: sql.LevelReadCommitted},
		fencedTxOptions: &sql.TxOptions{Isolation: sql.LevelReadCommitted},
		keyTxOptions:    &sql.TxOptions{Isolation: sql.LevelReadCommitted},
		lockKey:         `SELECT pg_advisory_xact_lock(hashtextextended(?, 0))`,
		retryTx: func(err error) bool {
			code := postgresCode(err)
			return code == pgSerializationFailure || code == pgDeadlockDetected
		},
		skipLocked:       "FOR UPDATE SKIP LOCKED",
		forShare:         "FOR SHARE",
		deliveryPosition: `pg_current_xact_id()::text::bigint`,
		deliveryHorizon:  `pg_snapshot_xmin(pg_current_snapshot())::text::bigint`,
		readVersion:      `SELECT COALESCE(MAX(version), 0) FROM schema_migrations`,
		migrateTxOptions: &sql.TxOptions{Isolation: sql.LevelReadCommitted},
		prepareMigration: []string{
			fmt.Sprintf(`SELECT pg_advisory_xact_lock(%d)`, postgresMigrationLock),
			`CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())`,
		},
		setVersion: func(version int) string {
			return fmt.Sprintf(`INSERT INTO schema_migrations (version) VALUES (%d)`, version)
		},
		withinADay: func(a, b string) string {
			return fmt.Sprintf(`abs(extract(epoch FROM %s::timestamptz - %s::timestamptz)) < 86400`, a, b)
		},
		jsonField: func(column, field string) string {
			return fmt.Sprintf(`convert_from(%s, 'UTF8')::jsonb ->> '%s'`, column, field)
		},
		isInteger: func(string) string { return `TRUE` },
	}
}

// dialectOf returns db's dialect: PostgreSQL for a pool from
// connectPostgres, SQLite otherwise.
func dialectOf(db *sql.DB) *dialect {
	if _, ok := db.Driver().(postgresDriver); ok {
		return postgresDialect()
	}
	return sqliteDialect()
}

// skipLocked returns the clause that ends the SELECT of a claim on db (see
// dialect.skipLocked): nothing on SQLite, FOR UPDATE SKIP LOCKED on
// PostgreSQL.
func skipLocked(db *sql.DB) string {
	return dialectOf(db).skipLocked
}

// integerPairs returns "(VALUES (?, ?), ...)" with n pairs of integer
// parameters, for a "(a, b) IN" test. Each parameter is cast to BIGINT
// because PostgreSQL cannot infer the types of parameters inside VALUES;
// SQLite ignores the cast.
func integerPairs(n int) string {
	pairs := make([]string, n)
	for i := range pairs {
		pairs[i] = "(CAST(? AS BIGINT), CAST(? AS BIGINT))"
	}
	return "(VALUES " + strings.Join(pairs, ", ") + ")"
}

// storableText reports whether s can reach a text column, as a value or
// in a comparison, on both databases: PostgreSQL refuses bytes that are
// not UTF-8, and the NUL character, anywhere in a query's text parameters
// (SQLSTATE 22021), and fails the whole statement; SQLite takes any bytes.
// An id that comes from outside (a URL's path, a NATS header, a command's
// argument) is checked with it before it reaches a query, so that both
// databases answer it the same way: a 404 or a refusal, not a 500 on one
// of them, nor a transaction that fails again on every retry.
func storableText(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}
