// This file opens the one SQLite file that holds every layer, applies the
// embedded schema, and provides the one transaction helper the rest of the
// code uses.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	_ "embed"
	"errors"
	"fmt"
	"io"
	mathrand "math/rand/v2"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

//go:embed schema.sql
var schemaSQL string

// timeFormat is how every time is stored: fixed width and UTC, so comparing
// the TEXT columns in SQL compares instants. RFC 3339 with trimmed zeros
// would not sort.
const timeFormat = "2006-01-02T15:04:05.000000Z"

// formatTime returns t as stored: in timeFormat, in UTC.
func formatTime(t time.Time) string {
	return t.UTC().Format(timeFormat)
}

// sqliteBusyTimeout is how long a SQLite connection waits for another's
// lock before it fails with SQLITE_BUSY; busyTimeoutPragma sets it.
const sqliteBusyTimeout = 10 * time.Second

var busyTimeoutPragma = fmt.Sprintf("busy_timeout(%d)", sqliteBusyTimeout.Milliseconds())

// sqlitePragmas are set on every connection through the DSN, so each pooled
// connection gets them, not only the one that happened to run an Exec.
var sqlitePragmas = []string{
	// WAL lets readers go on while one writer commits, and a crash never
	// leaves a half-written transaction behind.
	"journal_mode(WAL)",
	// Several goroutines and processes share the file: wait for the write
	// lock instead of failing at once with SQLITE_BUSY.
	busyTimeoutPragma,
	// SQLite does not check foreign keys unless asked, per connection.
	"foreign_keys(1)",
}

// durability is how far a commit has got when it returns.
type durability string

const (
	// durabilityNormal (synchronous=NORMAL, the default): in WAL mode a
	// commit is in the operating system's hands. It survives any process
	// crash and never corrupts the file; a power loss or kernel panic may
	// lose the last commits since the previous checkpoint. For most services
	// that is the right trade: it costs no fsync per commit.
	durabilityNormal durability = "normal"
	// durabilityFull (synchronous=FULL): a commit has been fsynced to the
	// disk. One fsync per commit caps a serial writer near what the disk
	// allows (a few thousand per second); the API gathers concurrent
	// requests into one commit (see infra_groupcommit.go), as it does at NORMAL.
	durabilityFull durability = "full"
)

// parseDurability reads a --durability value.
func parseDurability(s string) (durability, error) {
	switch durability(s) {
	case durabilityNormal, durabilityFull:
		return durability(s), nil
	default:
		return "", fmt.Errorf("durability %q: want normal or full", s)
	}
}

// openDB opens (creating if needed) the SQLite file at path with the
// default durability and migrates it to the schema embedded in schema.sql.
// A postgres:// URL opens PostgreSQL instead (see infra_postgres.go).
func openDB(ctx context.Context, path string) (*sql.DB, error) {
	return openDBWith(ctx, path, durabilityNormal)
}

// openDBWith is openDB with a chosen durability. The durability is SQLite's:
// PostgreSQL's is the server's synchronous_commit, so a postgres:// URL
// accepts only the default.
func openDBWith(ctx context.Context, path string, d durability) (*sql.DB, error) {
	if path == "" {
		return nil, errors.New("database path is empty")
	}
	if isPostgresURL(path) {
		if d != durabilityNormal {
			return nil, fmt.Errorf("--durability %s is for SQLite; on PostgreSQL set synchronous_commit on the server", d)
		}
		return openPostgres(ctx, path)
	}
	dsn, err := sqliteDSN(path, d)
	if err != nil {
		return nil, err
	}
	// At NORMAL the writer checkpoints only past checkpointBackstop pages
	// of log; the checkpointer does it before then, beside the writer (see
	// infra_checkpoint.go). At FULL the writer checkpoints itself, as
	// SQLite does by default: every commit waits for an fsync of the log
	// already, and a checkpoint's fsyncs beside it made commits wait behind
	// them on the one disk.
	if d == durabilityNormal {
		dsn += fmt.Sprintf("&_pragma=wal_autocheckpoint(%d)", checkpointBackstop)
	}
	connector, err := sqlite.NewConnector(dsn)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	readers, err := openSQLiteReaders(path)
	if err != nil {
		return nil, err
	}
	var checkpoints *checkpointer
	if d == durabilityNormal {
		if checkpoints, err = startCheckpointer(path, checkpointEvery); err != nil {
			readers.Close()
			return nil, err
		}
	}
	// Each connection keeps its prepared statements (see infra_statements.go);
	// closing db closes its readers and its checkpointer too.
	db := sql.OpenDB(sqliteConnector{Connector: connector, readers: readers, checkpoints: checkpoints})
	// One connection per process. SQLite has one writer at a time anyway;
	// with several connections, goroutines that want the write lock wait in
	// SQLite's busy handler, which sleeps for milliseconds between tries.
	// With one, they queue in database/sql and get the connection the
	// moment it is free (HTTP throughput went up 1.7 times; see
	// BENCHMARKS.md).
	// Other processes on the same file still wait through busy_timeout.
	// The price: nothing may use db while it holds a transaction or an open
	// Rows, or it waits for itself.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxIdleTime(time.Minute)

	if err := migrate(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("migrate %s: %w", path, err)
	}
	return db, nil
}

// sqliteDSN returns the data source name of the SQLite file at path, with
// every connection's pragmas and durability d.
func sqliteDSN(path string, d durability) (string, error) {
	query := url.Values{}
	for _, pragma := range sqlitePragmas {
		query.Add("_pragma", pragma)
	}
	switch d {
	case durabilityNormal:
		query.Add("_pragma", "synchronous(NORMAL)")
	case durabilityFull:
		query.Add("_pragma", "synchronous(FULL)")
	default:
		return "", fmt.Errorf("bug: unhandled durability %q", d)
	}
	// Every transaction starts with BEGIN IMMEDIATE: it takes the write lock
	// up front, so a transaction that reads and then writes never fails with
	// SQLITE_BUSY halfway (which a deferred one does in WAL mode, whatever
	// the busy timeout). A concurrent duplicate request simply waits.
	query.Set("_txlock", "immediate")
	return "file:" + path + "?" + query.Encode(), nil
}

// maxSQLiteReaders is the size of a process's pool of SQLite read
// connections: enough for GETs and replays to go on beside the writer and
// each other on a few cores. In WAL mode a reader never waits for the
// writer, nor the writer for it.
const maxSQLiteReaders = 4

// openSQLiteReaders returns a pool of read connections to the SQLite file at
// path, which openDBWith has created and migrated. A reader sees only
// committed transactions, each read as of the moment it starts, so what it
// reads was there, whole, at that moment.
//
// They are not openReadOnlyDB's mode=ro connections: a connection that may
// not write cannot create the WAL index either, and fails to open the file
// whenever the last writer has closed and removed it. query_only refuses
// every write from these connections all the same.
func openSQLiteReaders(path string) (*sql.DB, error) {
	connector, err := sqlite.NewConnector(sqliteReadersDSN(path))
	if err != nil {
		return nil, fmt.Errorf("open %s for reading: %w", path, err)
	}
	readers := sql.OpenDB(sqliteConnector{Connector: connector})
	readers.SetMaxOpenConns(maxSQLiteReaders)
	readers.SetMaxIdleConns(maxSQLiteReaders)
	readers.SetConnMaxIdleTime(time.Minute)
	return readers, nil
}

// sqliteReadersDSN returns the data source name of a read connection to
// the SQLite file at path.
func sqliteReadersDSN(path string) string {
	query := url.Values{}
	query.Add("_pragma", busyTimeoutPragma)
	query.Add("_pragma", "query_only(1)")
	return "file:" + path + "?" + query.Encode()
}

// readersOf returns the pool that reads of committed data may use beside
// db: on SQLite, db's read connections (see openSQLiteReaders); otherwise db
// itself, since PostgreSQL's pool has many connections, each reading
// committed data only.
func readersOf(db *sql.DB) *sql.DB {
	if d, ok := db.Driver().(sqliteDriver); ok && d.readers != nil {
		return d.readers
	}
	return db
}

// openReadOnlyDB opens an existing database for reading only, as inspect and
// check do: they may run beside a live system, and must never write to it,
// not even a migration. Returns an error if the file does not exist or is
// at another schema version than this program's.
func openReadOnlyDB(ctx context.Context, path string) (*sql.DB, error) {
	if isPostgresURL(path) {
		return openReadOnlyPostgres(ctx, path)
	}
	if _, err := os.Stat(path); err != nil {
		return nil, noDatabaseError(path)
	}
	query := url.Values{}
	query.Set("mode", "ro")
	query.Add("_pragma", busyTimeoutPragma)
	db, err := sql.Open("sqlite", "file:"+path+"?"+query.Encode())
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	if err := checkSchemaVersion(ctx, db, path); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// noDatabaseError says that there is no SQLite file at path, and how to
// make one.
func noDatabaseError(path string) error {
	return fmt.Errorf("no database at %s; create one with 'retrysafe serve --db %s' or 'retrysafe demo --db %s'", path, path, path)
}

// requireNewDatabase returns an error unless target is a database that
// retrysafe has not created yet: no SQLite file at the path, or a PostgreSQL
// database without retrysafe's tables. The demo and chaos runs tell a story
// from an empty database, and must not write into someone's data.
func requireNewDatabase(ctx context.Context, target string) error {
	if !isPostgresURL(target) {
		if _, err := os.Stat(target); err == nil {
			return fmt.Errorf("%s already exists; this starts from a new database, so remove it or name another file", target)
		}
		return nil
	}
	db, err := connectPostgres(ctx, target)
	if err != nil {
		return err
	}
	defer db.Close()
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('schema_migrations') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("look at %s: %w", redactURL(target), err)
	}
	if exists {
		return fmt.Errorf("%s already holds retrysafe's tables; this starts from a new database, so drop and create it again (dropdb, createdb) or name another", redactURL(target))
	}
	return nil
}

// checkSchemaVersion returns an error unless the database called name is at
// this program's schema version.
func checkSchemaVersion(ctx context.Context, db *sql.DB, name string) error {
	d := dialectOf(db)
	migrations, err := schemaMigrations(d.schema)
	if err != nil {
		return err
	}
	var version int
	err = db.QueryRowContext(ctx, d.readVersion).Scan(&version)
	if postgresCode(err) == pgUndefinedTable {
		version = 0
	} else if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	if version != len(migrations) {
		return fmt.Errorf("%s is at schema version %d, this program reads version %d; run 'retrysafe serve --db %s' once to migrate it", name, version, len(migrations), name)
	}
	return nil
}

// migrationHeader matches the "-- version N" lines that start each section
// of schema.sql and schema_postgres.sql.
var migrationHeader = regexp.MustCompile(`(?m)^-- version (\d+)\s*$`)

// schemaMigrations splits a schema file into its numbered sections. It
// returns an error if the numbers do not run 1, 2, 3...
func schemaMigrations(schemaSQL string) ([]string, error) {
	headers := migrationHeader.FindAllStringSubmatchIndex(schemaSQL, -1)
	var migrations []string
	for i, header := range headers {
		version, err := strconv.Atoi(schemaSQL[header[2]:header[3]])
		if err != nil || version != i+1 {
			return nil, fmt.Errorf("bug: schema section %d is labelled version %s", i+1, schemaSQL[header[2]:header[3]])
		}
		end := len(schemaSQL)
		if i+1 < len(headers) {
			end = headers[i+1][0]
		}
		migrations = append(migrations, schemaSQL[header[1]:end])
	}
	return migrations, nil
}

// migrate applies the schema sections newer than the database's version.
// Each runs in its own transaction with the version bump, so a crash leaves
// the database at a whole version, and two processes opening a database at
// once do not both apply a version: the second waits for the first's lock
// (d.prepareMigration), then reads the version it committed
// (d.migrateTxOptions) and skips it.
func migrate(ctx context.Context, db *sql.DB) error {
	migrations, err := schemaMigrations(dialectOf(db).schema)
	if err != nil {
		return err
	}
	return applyMigrations(ctx, db, migrations)
}

// applyMigrations is migrate with the schema's sections given:
// migrations[v-1] is version v.
func applyMigrations(ctx context.Context, db *sql.DB, migrations []string) error {
	d := dialectOf(db)
	for version := 1; version <= len(migrations); version++ {
		err := runTx(ctx, db, d, d.migrateTxOptions, func(tx *sql.Tx) error {
			for _, statement := range d.prepareMigration {
				if _, err := tx.ExecContext(ctx, statement); err != nil {
					return fmt.Errorf("prepare migration: %w", err)
				}
			}
			var current int
			if err := tx.QueryRowContext(ctx, d.readVersion).Scan(&current); err != nil {
				return fmt.Errorf("read schema version: %w", err)
			}
			if current >= version {
				return nil
			}
			if _, err := tx.ExecContext(ctx, migrations[version-1]); err != nil {
				return fmt.Errorf("apply version %d: %w", version, err)
			}
			// version is our own integer, not input.
			if _, err := tx.ExecContext(ctx, d.setVersion(version)); err != nil {
				return fmt.Errorf("set schema version: %w", err)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	var current int
	if err := db.QueryRowContext(ctx, d.readVersion).Scan(&current); err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if current > len(migrations) {
		return fmt.Errorf("database is at schema version %d, newer than this program's %d; upgrade retrysafe", current, len(migrations))
	}
	return nil
}

// withTx runs fn in one transaction (BEGIN IMMEDIATE on SQLite, see
// openDB; SERIALIZABLE on PostgreSQL, see infra_dialect.go) and commits if fn
// returns nil. Any error or panic rolls back everything fn wrote: that is
// what lets several writes "happen together or not at all".
//
// On PostgreSQL a transaction that lost a serialization conflict runs again
// from the start, so fn must not keep state from an earlier run: set
// results, do not append to them.
func withTx(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	d := dialectOf(db)
	return runTx(ctx, db, d, d.txOptions, fn)
}

// withClaimTx is withTx for a claim: one UPDATE that leases rows to a relay
// or worker with d.skipLocked (READ COMMITTED on PostgreSQL; see infra_dialect.go).
func withClaimTx(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	d := dialectOf(db)
	return runTx(ctx, db, d, d.claimTxOptions, fn)
}

// withFencedTx is withTx for a saga's transaction, whose last statement
// for each saga is advanceSaga: an UPDATE of the saga's row, under the
// worker's lease token, which counts only if the token is still the
// worker's on the row's latest version. What else the transaction writes
// is new rows keyed by the saga or its order (a step's row is unique), and
// UPDATEs whose WHERE re-checks, on the locked row, the very condition
// they rely on (the step done, the stock still there); all of it rolls
// back if advanceSaga finds the lease lost. READ COMMITTED on PostgreSQL
// (d.fencedTxOptions).
func withFencedTx(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	d := dialectOf(db)
	return runTx(ctx, db, d, d.fencedTxOptions, fn)
}

// keyTx is withTx for a transaction that claims the idempotency key
// (userID, key): no other transaction can claim the same key before it
// ends. On SQLite that is BEGIN IMMEDIATE; on PostgreSQL an advisory lock
// on the key (see keyTxOptions in infra_dialect.go). Every claim of a key goes
// through it, whatever the endpoint, so two claims of one key always wait
// for each other. (On SQLite a create's claim runs in a group commit's
// transaction instead, see infra_groupcommit.go: BEGIN IMMEDIATE all the same.)
// Returns fn's error, or the database's.
func keyTx(ctx context.Context, db *sql.DB, userID, key string, fn func(tx *sql.Tx) error) error {
	d := dialectOf(db)
	return runTx(ctx, db, d, d.keyTxOptions, func(tx *sql.Tx) error {
		if d.lockKey != "" {
			// Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
			lockName := fmt.Sprintf("%d:%s:%s", len(userID), userID, key)
			if _, err := tx.ExecContext(ctx, d.lockKey, lockName); err != nil {
				return fmt.Errorf("lock idempotency key: %w", err)
			}
		}
		return fn(tx)
	})
}

// keyWriter runs fn, which claims the idempotency key (userID, key), in a
// transaction that no other claim of the same key can overlap. fn must use
// the context it is given, not its caller's.
type keyWriter func(ctx context.Context, userID, key string, fn func(ctx context.Context, tx *sql.Tx) error) error

// ownTxWriter is the keyWriter that gives fn a transaction of its own: on
// PostgreSQL always (keyTx, which locks the key), and on SQLite where one
// request at a time is the point (the demo, stepped through in a debugger,
// and the benchmark that measures what group commit saves), where BEGIN
// IMMEDIATE is the key's lock and withTx is all it takes.
func ownTxWriter(db *sql.DB) keyWriter {
	if dialectOf(db).lockKey == "" {
		return func(ctx context.Context, userID, key string, fn func(ctx context.Context, tx *sql.Tx) error) error {
			return withTx(ctx, db, func(tx *sql.Tx) error { return fn(ctx, tx) })
		}
	}
	return func(ctx context.Context, userID, key string, fn func(ctx context.Context, tx *sql.Tx) error) error {
		return keyTx(ctx, db, userID, key, func(tx *sql.Tx) error { return fn(ctx, tx) })
	}
}

// maxTxAttempts bounds how often withTx runs a transaction that keeps losing
// serialization conflicts. Each lost conflict means another transaction
// committed, so the system as a whole moves on; one transaction losing this
// often means a hot row, and the caller gets a transient error (HTTP 503).
const maxTxAttempts = 20

// runTx runs fn in a transaction begun with opts, again while d says the
// failure is worth retrying.
func runTx(ctx context.Context, db *sql.DB, d *dialect, opts *sql.TxOptions, fn func(tx *sql.Tx) error) error {
	for attempt := 1; ; attempt++ {
		err := runTxOnce(ctx, db, opts, fn)
		if err == nil || attempt == maxTxAttempts || !d.retryTx(err) {
			return err
		}
		// Back off a little, with jitter, so the transactions that just
		// collided do not collide again.
		wait := time.Duration(attempt) * time.Duration(1+mathrand.IntN(1000)) * time.Microsecond
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}

// runTxOnce runs fn in one transaction.
func runTxOnce(ctx context.Context, db *sql.DB, opts *sql.TxOptions, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	// Rollback after Commit is a no-op that returns ErrTxDone; on the error
	// and panic paths it undoes fn's writes.
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// inSavepoint runs fn in SAVEPOINT name of tx and rolls tx back to it if fn
// fails, so a batch's other work in tx stands. It returns fn's failure as
// failed, and err if the savepoint itself could not be taken, rolled back
// or released: then tx must roll back.
func inSavepoint(ctx context.Context, tx *sql.Tx, name string, fn func() error) (failed, err error) {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT `+name); err != nil {
		return nil, fmt.Errorf("savepoint: %w", err)
	}
	failed = fn()
	if failed != nil {
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO `+name); err != nil {
			// The connection went away: that is what the caller must see.
			if isDatabaseUnavailable(err) {
				return failed, fmt.Errorf("rollback to savepoint after %v: %w", failed, err)
			}
			// SQLite already rolled the whole transaction back (a full
			// disk, SQLITE_FULL): the cause, not the missing savepoint,
			// says the failure is transient.
			return failed, fmt.Errorf("rollback to savepoint after %w: %v", failed, err)
		}
	}
	if _, err := tx.ExecContext(ctx, `RELEASE `+name); err != nil {
		return failed, fmt.Errorf("release savepoint: %w", err)
	}
	return failed, nil
}

// itemUndo is how a transaction that runs several items (a consumer's
// batch of messages, a saga round's steps) undoes the writes of one item
// that fails, so that the others' stand: a savepoint around each item. But
// items rarely fail, and two statements per item (SAVEPOINT, RELEASE) were
// a quarter of an order's statements. So a batch runs first without them
// (withItems); if an item fails, the whole transaction rolls back, and the
// batch runs again with a savepoint around each item. The item that failed
// does not run again: its failure is recorded as it was (a failure count,
// a retry, a compensation), as if it had been undone to its savepoint the
// first time. Either way an item's writes commit only if it succeeded, and
// a failure is decided once.
type itemUndo struct {
	db *sql.DB
	// savepoints: each item runs in a savepoint of its own.
	savepoints bool
	// failed holds, by item, the failures of the run without savepoints;
	// seen counts the items run so far in this run, by id, so that two
	// items of one id (a message delivered twice in one batch) are told
	// apart.
	failed map[string]error
	seen   map[string]int
}

// errRedoWithSavepoints rolls back a batch's transaction in which an item
// failed while the batch ran without savepoints (itemUndo).
var errRedoWithSavepoints = errors.New("an item of the batch failed: the batch runs again, each item in a savepoint")

// run runs fn, the writes of item (a message or saga id, unique in the
// batch), in tx: in SAVEPOINT name if the batch runs with savepoints
// (inSavepoint, whose results it returns), unless item failed in the run
// without them: then fn does not run, and its failure is returned as
// failed. Without savepoints, a failure of fn is returned as failed if it
// is ours (isOurFailure: tx rolls back whatever the mode), and otherwise as
// err, wrapping errRedoWithSavepoints: tx must roll back, and withItems
// runs the batch again.
func (u *itemUndo) run(ctx context.Context, tx *sql.Tx, name, item string, fn func() error) (failed, err error) {
	u.seen[item]++
	item = fmt.Sprintf("%s#%d", item, u.seen[item])
	if u.savepoints {
		if failed, ok := u.failed[item]; ok {
			return failed, nil
		}
		return inSavepoint(ctx, tx, name, fn)
	}
	failed = fn()
	switch {
	case failed == nil:
		return nil, nil
	case isOurFailure(ctx, u.db, failed):
		return failed, nil
	}
	u.failed[item] = failed
	return failed, fmt.Errorf("%w (%s: %v)", errRedoWithSavepoints, item, failed)
}

// withItems runs fn, a batch's transaction begun by begin (withTx,
// withFencedTx), with its items run by undo.run: without savepoints, and
// again with them if an item failed. fn must not keep state from the first
// run (as for begin's own retries): set results, do not append to them.
func withItems(ctx context.Context, db *sql.DB, begin func(context.Context, *sql.DB, func(*sql.Tx) error) error, fn func(tx *sql.Tx, undo *itemUndo) error) error {
	undo := &itemUndo{db: db, failed: map[string]error{}}
	run := func(tx *sql.Tx) error {
		undo.seen = map[string]int{}
		return fn(tx, undo)
	}
	err := begin(ctx, db, run)
	if errors.Is(err, errRedoWithSavepoints) {
		undo.savepoints = true
		err = begin(ctx, db, run)
	}
	return err
}

// isOurFailure reports whether err, returned by a message's or a saga
// step's work, is our side failing rather than the work: the process must
// stop (errCrash); we are stopping (the context ended: shut down, past a
// deadline); PostgreSQL failed the transaction to keep it serializable and
// it must run again; or another transaction held the database, or it went
// away. The transaction must roll back, and nothing is counted against the
// message or the step.
func isOurFailure(ctx context.Context, db *sql.DB, err error) bool {
	return errors.Is(err, errCrash) || ctx.Err() != nil || dialectOf(db).retryTx(err) || isBusy(err) || isDatabaseUnavailable(err)
}

// isBusy reports whether err is the database saying another transaction
// got in the way: SQLite's lock held past the busy timeout, or PostgreSQL
// still failing a serialization or lock conflict after withTx's retries. It
// is transient: the caller may retry, and an HTTP client gets 503 with
// Retry-After, never a 500.
func isBusy(err error) bool {
	switch postgresCode(err) {
	case pgSerializationFailure, pgDeadlockDetected, pgLockNotAvailable:
		return true
	}
	var sqliteErr *sqlite.Error
	if !errors.As(err, &sqliteErr) {
		return false
	}
	code := sqliteErr.Code() & 0xff // the primary code; extended codes add bits above
	return code == sqlite3.SQLITE_BUSY || code == sqlite3.SQLITE_LOCKED
}

// isDatabaseUnavailable reports whether err is the database out of reach or
// out of room: PostgreSQL closed or refused the connection (shut down,
// restarted, the backend terminated, too many clients) or it could not be
// reached; or the database could not write (SQLite's SQLITE_FULL, when the
// file reaches max_page_count or the disk fills, SQLITE_IOERR and
// SQLITE_NOMEM; PostgreSQL's disk full, out of memory and I/O error). Like
// isBusy it is transient and says nothing about the request: whatever the
// transaction wrote rolled back with it, the caller may retry, and an HTTP
// client gets 503, never 500; a consumer counts nothing against the
// message.
func isDatabaseUnavailable(err error) bool {
	code := postgresCode(err)
	switch {
	case strings.HasPrefix(code, "08"): // connection exception
		return true
	case code == "57P01", code == "57P02", code == "57P03": // admin or crash shutdown, cannot connect now
		return true
	case strings.HasPrefix(code, "53"): // insufficient resources: disk full, out of memory, too many connections
		return true
	case code == "58030": // I/O error
		return true
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) ||
		errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, driver.ErrBadConn) ||
		errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var sqliteErr *sqlite.Error
	if !errors.As(err, &sqliteErr) {
		return false
	}
	switch sqliteErr.Code() & 0xff { // the primary code; extended codes add bits above
	case sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_NOMEM:
		return true
	}
	return false
}

// isUniqueViolation reports whether err is a UNIQUE or PRIMARY KEY conflict.
func isUniqueViolation(err error) bool {
	if postgresCode(err) == pgUniqueViolation {
		return true
	}
	var sqliteErr *sqlite.Error
	if !errors.As(err, &sqliteErr) {
		return false
	}
	code := sqliteErr.Code()
	return code == sqlite3.SQLITE_CONSTRAINT_UNIQUE || code == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY
}

// placeholders returns "?, ?, ?" for n values.
func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}
