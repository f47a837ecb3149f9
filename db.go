// This file opens the one SQLite file that holds every layer, applies the
// embedded schema, and provides the one transaction helper the rest of the
// code uses.

package main

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

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

// sqlitePragmas are set on every connection through the DSN, so each pooled
// connection gets them, not only the one that happened to run an Exec.
var sqlitePragmas = []string{
	// WAL lets readers go on while one writer commits, and a crash never
	// leaves a half-written transaction behind.
	"journal_mode(WAL)",
	// Several goroutines and processes share the file: wait for the write
	// lock instead of failing at once with SQLITE_BUSY.
	"busy_timeout(10000)",
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
	// allows (a few thousand per second), so the API gathers concurrent
	// requests into one commit (see groupcommit.go).
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
func openDB(ctx context.Context, path string) (*sql.DB, error) {
	return openDBWith(ctx, path, durabilityNormal)
}

// openDBWith is openDB with a chosen durability.
func openDBWith(ctx context.Context, path string, d durability) (*sql.DB, error) {
	if path == "" {
		return nil, errors.New("database path is empty")
	}
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
		return nil, fmt.Errorf("bug: unhandled durability %q", d)
	}
	// Every transaction starts with BEGIN IMMEDIATE: it takes the write lock
	// up front, so a transaction that reads and then writes never fails with
	// SQLITE_BUSY halfway (which a deferred one does in WAL mode, whatever
	// the busy timeout). A concurrent duplicate request simply waits.
	query.Set("_txlock", "immediate")
	dsn := "file:" + path + "?" + query.Encode()

	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
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

// openReadOnlyDB opens an existing database for reading only, as inspect and
// check do: they may run beside a live system, and must never write to it,
// not even a migration. Returns an error if the file does not exist or is
// at another schema version than this program's.
func openReadOnlyDB(ctx context.Context, path string) (*sql.DB, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("no database at %s; create one with 'retrysafe serve --db %s' or 'retrysafe demo --db %s'", path, path, path)
	}
	query := url.Values{}
	query.Set("mode", "ro")
	query.Add("_pragma", "busy_timeout(10000)")
	db, err := sql.Open("sqlite", "file:"+path+"?"+query.Encode())
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	migrations, err := schemaMigrations()
	if err != nil {
		db.Close()
		return nil, err
	}
	var version int
	if err := db.QueryRowContext(ctx, `PRAGMA user_version`).Scan(&version); err != nil {
		db.Close()
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if version != len(migrations) {
		db.Close()
		return nil, fmt.Errorf("%s is at schema version %d, this program reads version %d; run 'retrysafe serve --db %s' once to migrate it", path, version, len(migrations), path)
	}
	return db, nil
}

// migrationHeader matches the "-- version N" lines that start each section
// of schema.sql.
var migrationHeader = regexp.MustCompile(`(?m)^-- version (\d+)\s*$`)

// schemaMigrations splits schema.sql into its numbered sections. It returns
// an error if the numbers do not run 1, 2, 3...
func schemaMigrations() ([]string, error) {
	headers := migrationHeader.FindAllStringSubmatchIndex(schemaSQL, -1)
	var migrations []string
	for i, header := range headers {
		version, err := strconv.Atoi(schemaSQL[header[2]:header[3]])
		if err != nil || version != i+1 {
			return nil, fmt.Errorf("bug: schema.sql section %d is labelled version %s", i+1, schemaSQL[header[2]:header[3]])
		}
		end := len(schemaSQL)
		if i+1 < len(headers) {
			end = headers[i+1][0]
		}
		migrations = append(migrations, schemaSQL[header[1]:end])
	}
	return migrations, nil
}

// migrate applies the schema sections newer than the file's user_version.
// Each runs in its own transaction with the version bump, so a crash leaves
// the file at a whole version, and two processes opening a new file at once
// do not both apply it.
func migrate(ctx context.Context, db *sql.DB) error {
	migrations, err := schemaMigrations()
	if err != nil {
		return err
	}
	for version := 1; version <= len(migrations); version++ {
		err := withTx(ctx, db, func(tx *sql.Tx) error {
			var current int
			if err := tx.QueryRowContext(ctx, `PRAGMA user_version`).Scan(&current); err != nil {
				return fmt.Errorf("read user_version: %w", err)
			}
			if current >= version {
				return nil
			}
			if _, err := tx.ExecContext(ctx, migrations[version-1]); err != nil {
				return fmt.Errorf("apply version %d: %w", version, err)
			}
			// PRAGMA takes no bound parameters; version is our own integer.
			if _, err := tx.ExecContext(ctx, fmt.Sprintf(`PRAGMA user_version = %d`, version)); err != nil {
				return fmt.Errorf("set user_version: %w", err)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	var current int
	if err := db.QueryRowContext(ctx, `PRAGMA user_version`).Scan(&current); err != nil {
		return fmt.Errorf("read user_version: %w", err)
	}
	if current > len(migrations) {
		return fmt.Errorf("database is at schema version %d, newer than this program's %d; upgrade retrysafe", current, len(migrations))
	}
	return nil
}

// withTx runs fn in one transaction (BEGIN IMMEDIATE, see openDB) and commits
// if fn returns nil. Any error or panic rolls back everything fn wrote: that
// is what lets several writes "happen together or not at all".
func withTx(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
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

// isBusy reports whether err is SQLite saying another connection held the
// lock for longer than the busy timeout. It is transient: the caller may
// retry, and an HTTP client gets 503 with Retry-After, never a 500.
func isBusy(err error) bool {
	var sqliteErr *sqlite.Error
	if !errors.As(err, &sqliteErr) {
		return false
	}
	code := sqliteErr.Code() & 0xff // the primary code; extended codes add bits above
	return code == sqlite3.SQLITE_BUSY || code == sqlite3.SQLITE_LOCKED
}

// isUniqueViolation reports whether err is a UNIQUE or PRIMARY KEY conflict.
func isUniqueViolation(err error) bool {
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
