// This file copies SQLite's write-ahead log into the database file beside
// the writer, instead of in the commit that happens to fill it.
//
// In WAL mode a commit appends pages to the -wal file; a checkpoint later
// copies them into the database file and syncs it, so that the log can
// start again from its beginning. By default SQLite checkpoints in the
// commit that takes the log past 1,000 pages: that commit's caller waits
// for the copy and two fsyncs, and a page written by many commits (a
// b-tree's last leaf, its parents, the file's header) is copied once per
// 1,000 pages. On the create path that was four tenths of a create's time
// (BENCHMARKS.md, "The checkpoint beside the writer").
//
// Here a goroutine of the process's own checkpoints on a connection of its
// own, at most once per checkpointEvery while commits come in and never
// while none do. A PASSIVE checkpoint waits for nobody: readers and the
// writer go on, and it copies what no reader still needs. The writer's own
// checkpoint stays, at checkpointBackstop pages: the log starts again from
// its beginning only when a write begins with every page copied, which a
// checkpoint running beside a writer that never pauses may never see, and
// without the backstop the log grew for as long as the writes went on.
// Past the backstop, while the writer commits, the checkpointer stands
// aside for the writer's checkpoint, which copies what came since its last
// copy. How far past the backstop the log goes is what the writer commits
// during the checkpointer's copy that crosses it, which depends on the
// disk: 1.6 to 2.2 times the backstop in TestCheckpointer, where commits
// come as fast as the copy goes. A checkpoint that left pages in the log
// (a reader still needed them) is tried again, commit or not.
//
// At --durability=full the writer checkpoints itself, as before (db.go).
//
// Nothing here changes what a commit promises: a checkpoint copies
// committed pages only, and may stop at any point (a crash included).

package main

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"modernc.org/sqlite"
)

const (
	// checkpointEvery is the least time between two checkpoints: the
	// commits of that time share one copy and one pair of fsyncs.
	checkpointEvery = 20 * time.Millisecond
	// checkpointBackstop is the log's size in pages past which a commit
	// checkpoints itself (SQLite's wal_autocheckpoint): 40 MB of log at the
	// default page size.
	checkpointBackstop = 10000
)

// checkpointer runs the WAL checkpoints of one SQLite file beside its
// writer. committed tells it that a commit added to the log.
type checkpointer struct {
	db    *sql.DB
	every time.Duration
	// nudge holds at most one wake-up: commits while a checkpoint is due
	// share it.
	nudge chan struct{}
	stop  chan struct{}
	done  chan struct{}
}

// startCheckpointer opens a connection to the SQLite file at path and
// starts checkpointing it, at most once per every.
func startCheckpointer(path string, every time.Duration) (*checkpointer, error) {
	// The checkpointer's connection changes no row (query_only); copying
	// the log's pages into the file is not a write in SQLite's sense.
	connector, err := sqlite.NewConnector(sqliteReadersDSN(path))
	if err != nil {
		return nil, fmt.Errorf("open %s to checkpoint it: %w", path, err)
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	// Like the other pools' connections, it closes after a minute unused,
	// so that a process that stopped writing lets go of the file: the
	// last connection to close checkpoints the log and removes it.
	db.SetConnMaxIdleTime(time.Minute)
	c := &checkpointer{db: db, every: every, nudge: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go c.run()
	return c, nil
}

// committed wakes the checkpointer after a commit; it never waits.
func (c *checkpointer) committed() {
	select {
	case c.nudge <- struct{}{}:
	default:
	}
}

// run checkpoints after each wake-up, once every has passed since the
// previous checkpoint, until Close. A checkpoint that left pages in the
// log (a reader still needed them, another checkpoint was running, it
// stood aside or failed) is tried again every, wake-up or not: the commits
// before a pause in the writes must not wait for the next one to reach
// the file.
func (c *checkpointer) run() {
	defer close(c.done)
	copiedAll := true
	for {
		if copiedAll {
			select {
			case <-c.stop:
				return
			case <-c.nudge:
			}
		}
		select {
		case <-c.stop:
			return
		case <-time.After(c.every):
		}
		// Commits came while it waited: the writer is at work.
		committing := false
		select {
		case <-c.nudge:
			committing = true
		default:
		}
		copiedAll = c.checkpoint(committing)
	}
}

// checkpoint copies into the database file every page of the log that no
// reader still needs, and says whether the log is all copied. Past the
// backstop, while the writer is committing, it stands aside: the
// writer's own checkpoint is due, and of two checkpoints at once the
// second gives up. A checkpoint that failed leaves the pages in the log,
// where they are as safe, for the next try.
func (c *checkpointer) checkpoint(committing bool) (copiedAll bool) {
	ctx := context.Background()
	var busy, logPages, copied int
	err := c.db.QueryRowContext(ctx, `PRAGMA wal_checkpoint(NOOP)`).Scan(&busy, &logPages, &copied)
	if err != nil || logPages >= checkpointBackstop && committing {
		return false
	}
	err = c.db.QueryRowContext(ctx, `PRAGMA wal_checkpoint(PASSIVE)`).Scan(&busy, &logPages, &copied)
	return err == nil && busy == 0 && copied == logPages
}

// Close stops the checkpointer and closes its connection.
func (c *checkpointer) Close() error {
	close(c.stop)
	<-c.done
	return c.db.Close()
}
