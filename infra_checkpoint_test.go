package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// walPages returns the pages in the log of db's file and how many of them
// a checkpoint has copied into the file, without copying any itself.
func walPages(tb testing.TB, db *sql.DB) (logPages, copied int) {
	tb.Helper()
	var busy int
	if err := readersOf(db).QueryRow(`PRAGMA wal_checkpoint(NOOP)`).Scan(&busy, &logPages, &copied); err != nil {
		tb.Fatal(err)
	}
	return logPages, copied
}

// waitAllCopied waits until every page of the log of db's file has been
// copied into the file, failing after 10 s.
func waitAllCopied(t *testing.T, db *sql.DB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		logPages, copied := walPages(t, db)
		if logPages > 0 && copied == logPages {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d pages of log copied 10 s after the last commit", copied, logPages)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestCheckpointer(t *testing.T) {
	ctx := context.Background()

	// Ensure a commit does not copy the log into the file itself until
	// the backstop: with SQLite's default, one commit in every 1,000
	// pages of log waited for the copy and two fsyncs.
	t.Run("CommitsLeaveTheCopyToTheCheckpointer", func(t *testing.T) {
		if pages := queryInt(t, mustOpenSQLite(t), `PRAGMA wal_autocheckpoint`); pages != checkpointBackstop {
			t.Fatalf("the writer checkpoints past %d pages of log, want %d", pages, checkpointBackstop)
		}
	})

	// Ensure a writer at FULL checkpoints itself, as SQLite does by
	// default: its commits wait for the disk already, and a checkpoint's
	// fsyncs beside them made them wait longer.
	t.Run("AtFullTheWriterCheckpointsItself", func(t *testing.T) {
		db, err := openDBWith(ctx, filepath.Join(t.TempDir(), "test.db"), durabilityFull)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		pages := queryInt(t, db, `PRAGMA wal_autocheckpoint`)
		if pages != 1000 || db.Driver().(sqliteDriver).checkpoints != nil {
			t.Fatalf("at FULL the writer checkpoints past %d pages, with a checkpointer: %v; want 1000 pages, without",
				pages, db.Driver().(sqliteDriver).checkpoints != nil)
		}
	})

	// Ensure the checkpointer copies the log while the writer goes on,
	// well before the backstop.
	t.Run("CopiesTheLogBesideTheWriter", func(t *testing.T) {
		db := mustOpenSQLite(t)
		app := newApp(db, nil, nil, nil)
		for i := range 50 {
			if _, err := app.createOrder(ctx, benchRequest("k", i), benchOrder); err != nil {
				t.Fatal(err)
			}
		}
		waitAllCopied(t, db)
	})

	// Ensure a commit made by a statement outside any transaction wakes
	// the checkpointer too, after a transaction rolled back on the same
	// connection.
	t.Run("HearsOfStatementsOutsideATransaction", func(t *testing.T) {
		db := mustOpenSQLite(t)
		waitAllCopied(t, db)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, `INSERT INTO stock_items (sku, available, stocked) VALUES ('sku-checkpoint', 1, 1)`); err != nil {
			t.Fatal(err)
		}
		waitAllCopied(t, db)
	})

	// Ensure pages a reader held back are copied once it lets go, though
	// no commit follows: the commits before a pause in the writes must not
	// wait for the next write to reach the file.
	t.Run("CopiesWhatAReaderHeldBackOnceItEnds", func(t *testing.T) {
		db := mustOpenSQLite(t)
		waitAllCopied(t, db)
		reader, err := readersOf(db).BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := reader.QueryRowContext(ctx, `SELECT COUNT(*) FROM stock_items`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		app := newApp(db, nil, nil, nil)
		for i := range 5 {
			if _, err := app.createOrder(ctx, benchRequest("k", i), benchOrder); err != nil {
				t.Fatal(err)
			}
		}
		// The checkpointer's tries while the reader holds its snapshot
		// copy nothing of what came after it.
		time.Sleep(10 * checkpointEvery)
		if logPages, copied := walPages(t, db); copied == logPages {
			t.Fatalf("all %d pages of log copied past a reader's snapshot", logPages)
		}
		if err := reader.Rollback(); err != nil {
			t.Fatal(err)
		}
		waitAllCopied(t, db)
	})

	// Ensure the log starts again from its beginning under writes that
	// never pause: a checkpoint beside a busy writer never sees every page
	// copied when a write begins, so without the writer's own checkpoint
	// at the backstop the log grew for as long as the writes went on.
	t.Run("TheLogStaysBoundedUnderSteadyWrites", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "test.db")
		db, err := openDB(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		pageSize := queryInt(t, db, `PRAGMA page_size`)
		// 100 pages a commit, six times the backstop in all.
		payload := strings.Repeat("x", 100*pageSize)
		for i := range 6 * checkpointBackstop / 100 {
			_, err := db.ExecContext(ctx, `INSERT INTO outbox_events (event_id, event_type, aggregate_id, payload, next_attempt_at, created_at)
				VALUES (?, 'Filler', 'filler', ?, '', '')`, fmt.Sprintf("evt_filler_%d", i), payload)
			if err != nil {
				t.Fatal(err)
			}
		}
		info, err := os.Stat(path + "-wal")
		if err != nil {
			t.Fatal(err)
		}
		// A page in the log takes a 24-byte frame header besides itself.
		// The log goes past the backstop by what the writer commits during
		// the checkpointer's copy that crosses it (the writer's own
		// checkpoint gives way to it), which depends on the disk: here
		// commits come as fast as the copy goes (seen: 1.6 to 2.2 times
		// the backstop; 5.3 times without the backstop, under five times
		// its writes).
		limit := int64(4*checkpointBackstop) * int64(pageSize+24)
		if info.Size() > limit {
			t.Fatalf("the log grew to %d MB under %d MB of writes; want at most %d MB", info.Size()>>20, 6*checkpointBackstop*pageSize>>20, limit>>20)
		}
		if testing.Verbose() {
			t.Logf("the log at %d MB", info.Size()>>20)
		}
	})

	// Ensure closing the write pool stops the checkpointer.
	t.Run("StopsWithTheWritePool", func(t *testing.T) {
		db, err := openDB(ctx, filepath.Join(t.TempDir(), "test.db"))
		if err != nil {
			t.Fatal(err)
		}
		checkpoints := db.Driver().(sqliteDriver).checkpoints
		if checkpoints == nil {
			t.Fatal("the write pool has no checkpointer")
		}
		if err := db.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-checkpoints.done:
		default:
			t.Fatal("the checkpointer still runs after the write pool closed")
		}
		if err := checkpoints.db.PingContext(ctx); err == nil {
			t.Fatal("the checkpointer's connection still answers after the write pool closed")
		}
	})
}
