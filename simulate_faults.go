// The simulator's outages and broker faults: what a network between the
// processes and their database or broker does, played inside one process.
//
// A database outage is a connection wrapper (simConnector) over the SQLite
// driver: while the database is "down", opening a connection, starting a
// transaction, running a statement and committing all fail the way a
// dropped connection does (driver.ErrBadConn, which isDatabaseUnavailable
// recognises); a connection that saw the outage is thrown away, rolling
// back what it held. The nastiest case of all is armed separately: a commit
// that lands, after which the connection drops before its answer arrives,
// so the caller sees an error for work that was done.
//
// The embedded broker stands for a broker of its own (NATS JetStream), so
// it is reached through a network of its own: it stays up while the
// database is down (consumers fetch, fail to apply, and the message comes
// again, and again), and it has outages of its own. On top of it,
// simBroker plays what at-least-once brokers do
// within their promises: a fetch hands a batch over in another order, an
// ack is lost on the way (the message comes again after ackWait), and a
// publish is sent twice (the broker's dedupe drops the copy).
//
// The processor is another company's system: it does not share our
// outages, so it, and the simulator's own reads (the audit, the clients'
// checks), use a second, direct handle on the file.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"modernc.org/sqlite"
)

// errSimOutage is what every database call gets while the simulated
// database is down.
var errSimOutage = fmt.Errorf("the database is unreachable (a simulated outage): %w", driver.ErrBadConn)

// errSimCommitLost is what a commit that landed returns when the
// connection dropped before its answer arrived.
var errSimCommitLost = fmt.Errorf("the connection dropped after the commit was sent (a simulated outage): %w", driver.ErrBadConn)

// simDatabase is the network between the App and its database (or its
// broker, which lives in the same file).
type simDatabase struct {
	// name names the system for the trace.
	name string
	// down: every call fails until the outage ends, at step ends.
	down bool
	ends int
	// loseCommit: the next commit lands, then the connection drops and an
	// outage begins. failCommit: the connection drops as the next commit
	// is sent, so nothing of it lands, and an outage begins.
	loseCommit, failCommit bool
	// diskFull: the disk has no room (see fillDisk). On SQLite, maxPages
	// is then the file's max_page_count on every connection (see
	// setMaxPages); on PostgreSQL the server fails each write with
	// disk_full (simPostgresConn.diskFull).
	diskFull bool
	maxPages int64
	// busy, if set, is asked before each statement whether the database
	// fails it for a moment (simulate_transient.go): its error is then
	// returned instead of running the statement, and the connection and
	// its transaction stay as they were.
	busy func() error
	// ended, if set, is called as each transaction ends, committed or
	// not: a busy statement armed in it is disarmed.
	ended func()
	// processDied: the process running the open transaction died in it;
	// its commit must not land (the connection closed with it).
	processDied bool
	// refused is called each time a call fails for the outage (the
	// simulator marks the running action with it); commitLost when a
	// commit landed but its answer was lost; commitFailed when a commit
	// failed with the connection.
	refused, commitLost, commitFailed func()
}

// refuse returns errSimOutage while the database is down.
func (d *simDatabase) refuse() error {
	if !d.down {
		return nil
	}
	if d.refused != nil {
		d.refused()
	}
	return errSimOutage
}

// end is called as a transaction ends.
func (d *simDatabase) end() {
	if d.ended != nil {
		d.ended()
	}
}

// openSimDatabase opens the SQLite file at path (created and migrated as
// openDB does) through a simConnector: a write pool of one connection, as
// openDB's, and its read connections, both reached through network.
func openSimDatabase(ctx context.Context, path string, network *simDatabase) (db, readers *sql.DB, err error) {
	migrated, err := openDB(ctx, path)
	if err != nil {
		return nil, nil, err
	}
	migrated.Close()
	dsn, err := sqliteDSN(path, durabilityNormal)
	if err != nil {
		return nil, nil, err
	}
	writer, err := sqlite.NewConnector(dsn)
	if err != nil {
		return nil, nil, err
	}
	reader, err := sqlite.NewConnector(sqliteReadersDSN(path))
	if err != nil {
		return nil, nil, err
	}
	db = sql.OpenDB(&simConnector{base: sqliteConnector{Connector: writer}, network: network})
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	readers = sql.OpenDB(&simConnector{base: sqliteConnector{Connector: reader}, network: network})
	readers.SetMaxOpenConns(maxSQLiteReaders)
	return db, readers, nil
}

// simConnector opens connections through the simulated network.
type simConnector struct {
	base    driver.Connector
	network *simDatabase
}

// Connect opens a connection, unless the database is down.
func (c *simConnector) Connect(ctx context.Context) (driver.Conn, error) {
	if err := c.network.refuse(); err != nil {
		return nil, err
	}
	conn, err := c.base.Connect(ctx)
	if err != nil {
		return nil, err
	}
	if c.network.maxPages > 0 {
		// max_page_count is a setting of each connection: a new one
		// finds the disk as full as the others do.
		if err := execPragma(ctx, conn, fmt.Sprintf("PRAGMA max_page_count = %d", c.network.maxPages)); err != nil {
			conn.Close()
			return nil, err
		}
	}
	return &simConn{conn: conn, network: c.network}, nil
}

// execPragma runs a PRAGMA on conn, reading the row it returns.
func execPragma(ctx context.Context, conn driver.Conn, pragma string) error {
	rows, err := conn.(driver.QueryerContext).QueryContext(ctx, pragma, nil)
	if err != nil {
		return fmt.Errorf("%s: %w", pragma, err)
	}
	return rows.Close()
}

// A full disk. SQLite's max_page_count caps the file at a number of
// pages: set to the pages it has now, any write that needs a new page
// fails with SQLITE_FULL, and SQLite rolls back the whole transaction (a
// savepoint cannot keep it). Raised again, the disk has room.
const (
	// roomyPages is SQLite's largest max_page_count: no limit.
	roomyPages = 4294967294
)

// setMaxPages sets max_page_count on db's connections (the App's write
// pool is one connection, kept open) and on those network opens later.
// 0 lifts the cap. It returns the cap set.
func setMaxPages(ctx context.Context, db *sql.DB, network *simDatabase, pages int64) (int64, error) {
	setting := pages
	if setting == 0 {
		setting = roomyPages
	}
	var set int64
	if err := db.QueryRowContext(ctx, fmt.Sprintf("PRAGMA max_page_count = %d", setting)).Scan(&set); err != nil {
		return 0, fmt.Errorf("set max_page_count: %w", err)
	}
	network.maxPages = pages
	network.diskFull = pages > 0
	return set, nil
}

// Driver returns the SQLite driver.
func (c *simConnector) Driver() driver.Driver { return c.base.Driver() }

// simConn is one connection through the simulated network. Once it has
// seen an outage it is broken: database/sql closes it (SQLite rolls back
// whatever transaction it held) and opens another when the outage is over.
type simConn struct {
	conn    driver.Conn
	network *simDatabase
	broken  bool
}

// check fails, and breaks the connection, while the database is down.
func (c *simConn) check() error {
	if c.broken {
		return errSimOutage
	}
	if err := c.network.refuse(); err != nil {
		c.broken = true
		return err
	}
	return nil
}

// checkStatement is check for a statement, which the database may also
// fail for a moment without breaking the connection.
func (c *simConn) checkStatement() error {
	if err := c.check(); err != nil {
		return err
	}
	if c.network.busy != nil {
		return c.network.busy()
	}
	return nil
}

func (c *simConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *simConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	stmt, err := c.conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return &simStmt{stmt: stmt, conn: c}, nil
}

func (c *simConn) Close() error { return c.conn.Close() }

func (c *simConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *simConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	tx, err := c.conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &simTx{tx: tx, conn: c}, nil
}

func (c *simConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if err := c.checkStatement(); err != nil {
		return nil, err
	}
	return c.conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (c *simConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if err := c.checkStatement(); err != nil {
		return nil, err
	}
	return c.conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

// CheckNamedValue lets the driver convert arguments as it would unwrapped.
func (c *simConn) CheckNamedValue(v *driver.NamedValue) error {
	if checker, ok := c.conn.(driver.NamedValueChecker); ok {
		return checker.CheckNamedValue(v)
	}
	return driver.ErrSkip
}

// ResetSession throws a broken connection away.
func (c *simConn) ResetSession(ctx context.Context) error {
	if c.broken {
		return driver.ErrBadConn
	}
	if resetter, ok := c.conn.(driver.SessionResetter); ok {
		return resetter.ResetSession(ctx)
	}
	return nil
}

// IsValid reports whether the connection may go back to the pool.
func (c *simConn) IsValid() bool {
	if validator, ok := c.conn.(driver.Validator); ok && !validator.IsValid() {
		return false
	}
	return !c.broken
}

// simTx is a transaction through the simulated network.
type simTx struct {
	tx   driver.Tx
	conn *simConn
}

// Commit commits, unless the database is down (then nothing is committed:
// the connection drops with the transaction open). Armed with loseCommit,
// it commits and then reports the connection dropped; armed with
// failCommit, the connection drops first.
func (t *simTx) Commit() error {
	t.conn.network.end()
	// The transaction ends here, whatever happens: if its process died in
	// it, that is known now and not at some later commit.
	died := t.conn.network.processDied
	t.conn.network.processDied = false
	if t.conn.network.failCommit {
		t.conn.network.failCommit = false
		if t.conn.network.commitFailed != nil {
			t.conn.network.commitFailed()
		}
	}
	if err := t.conn.check(); err != nil {
		t.tx.Rollback()
		return err
	}
	if died {
		t.tx.Rollback()
		return errCrash
	}
	if err := t.tx.Commit(); err != nil {
		return err
	}
	if t.conn.network.loseCommit {
		t.conn.network.loseCommit = false
		t.conn.network.down = true
		t.conn.broken = true
		if t.conn.network.commitLost != nil {
			t.conn.network.commitLost()
		}
		return errSimCommitLost
	}
	return nil
}

// Rollback rolls back on the connection, whatever the network: a dropped
// connection takes its transaction with it.
func (t *simTx) Rollback() error {
	t.conn.network.end()
	t.conn.network.processDied = false
	return t.tx.Rollback()
}

// simStmt is a prepared statement on a simConn.
type simStmt struct {
	stmt driver.Stmt
	conn *simConn
}

func (s *simStmt) Close() error  { return s.stmt.Close() }
func (s *simStmt) NumInput() int { return s.stmt.NumInput() }

func (s *simStmt) Exec(args []driver.Value) (driver.Result, error) {
	return nil, errors.New("bug: simStmt.Exec without a context")
}

func (s *simStmt) Query(args []driver.Value) (driver.Rows, error) {
	return nil, errors.New("bug: simStmt.Query without a context")
}

func (s *simStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	if err := s.conn.checkStatement(); err != nil {
		return nil, err
	}
	return s.stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *simStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	if err := s.conn.checkStatement(); err != nil {
		return nil, err
	}
	return s.stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}

// onlyUnavailable reports whether err, and every error joined in it, says
// the database was unavailable, or busy for a moment: what a worker pass
// may fail with during an outage (or after a busy statement,
// simulate_transient.go), and nothing else.
func onlyUnavailable(err error) bool {
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range joined.Unwrap() {
			if !onlyUnavailable(e) {
				return false
			}
		}
		return len(joined.Unwrap()) > 0
	}
	return isDatabaseUnavailable(err) || isBusy(err)
}

// simBroker is the broker as the network delivers it: at least once, in
// an order the broker does not promise within a batch, with acks that may
// be lost and publishes that may be sent twice.
type simBroker struct {
	messageBroker
	s *simulation
	// accepted are the ids of every message whose publish it acknowledged,
	// and lost those of the messages it lost (loseAcknowledged): together
	// what the broker ever had, whatever cleanup deleted since.
	accepted, lost map[string]bool
}

// publishBatch publishes, and sometimes publishes again, as a relay whose
// answer was lost would. It remembers what it acknowledged, and checks
// that each event it acknowledges for the first time goes out in the
// order of its order's events.
func (b *simBroker) publishBatch(ctx context.Context, msgs []message) error {
	if len(msgs) > 0 && msgs[0].PublishID != "" {
		// The reconciler's copies, claimed a moment ago: only of messages
		// a consumer has not received (simulate_poison.go).
		if err := b.s.checkRepublishedUndelivered(ctx, msgs); err != nil {
			b.s.violate(err)
		}
	}
	// Now and then it refuses an order's refund event, and stores the
	// rest of the batch, while the order is refunded again
	// (simulate_outboxorder.go).
	msgs, refused := b.s.refuseHeldEvent(msgs)
	if err := b.messageBroker.publishBatch(ctx, msgs); err != nil {
		return err
	}
	if b.accepted == nil {
		b.accepted = map[string]bool{}
	}
	for _, msg := range msgs {
		if !b.accepted[msg.ID] {
			if err := b.s.checkFirstPublishedInOrder(ctx, msg.ID, b.accepted); err != nil {
				b.s.violate(err)
			}
		}
		b.accepted[msg.ID] = true
	}
	if refused != nil {
		return refused
	}
	if !b.s.quiescing && len(msgs) > 0 && b.s.chance(0.1) {
		b.s.report.Counts.DuplicatePublishes++
		b.s.tracef("the broker gets %d messages twice (%s...)", len(msgs), msgs[0].ID)
		return b.messageBroker.publishBatch(ctx, msgs)
	}
	if !b.s.quiescing && len(msgs) > 0 && b.s.chance(0.05) {
		return b.loseAcknowledged(ctx)
	}
	return nil
}

// loseAcknowledged makes the broker lose a message it acknowledged and a
// subscriber has not acked yet, as JetStream does when its host crashes
// before it flushed (broker_loss.go): the relay marks the event published,
// and only the reconciler can tell that a consumer never applied it (the
// other consumer of its subject may have: loseAMessage). Through the
// simulator's own handle: the loss is the broker's, no outage stops it.
func (b *simBroker) loseAcknowledged(ctx context.Context) error {
	lost, err := b.s.loseAMessage(ctx)
	if err != nil {
		return fmt.Errorf("lose a message: %w", err)
	}
	for _, id := range lost {
		b.markLost(id)
		b.s.report.Counts.LostMessages++
		b.s.tracef("the broker loses %s, which it acknowledged", id)
	}
	return nil
}

// markLost records that the broker lost the message id.
func (b *simBroker) markLost(id string) {
	if b.lost == nil {
		b.lost = map[string]bool{}
	}
	b.lost[id] = true
}

// checkPublishedInBroker fails the run if an event the outbox says is
// published was never in the broker, and the broker did not lose it: the
// relay records an event published only after the broker acknowledged it
// (relayOnce), so a crash, an outage or a refused publish in between
// leaves it pending, to be published again. What the broker had is what
// it acknowledged (simBroker.accepted), not what it holds now: cleanup
// deletes the broker's copy of a message every consumer acked a week
// ago, and a relay paused a week between the publish and its record
// (its claim still its own, since nobody claimed the events meanwhile)
// rightly records events whose copies cleanup has deleted.
func (s *simulation) checkPublishedInBroker(ctx context.Context) error {
	b, ok := s.app.broker.(*simBroker)
	if !ok {
		return nil
	}
	rows, err := s.direct.QueryContext(ctx, `
		SELECT e.event_id FROM outbox_events e
		WHERE e.status = 'published'
		  AND NOT EXISTS (SELECT 1 FROM broker_messages m WHERE m.message_id = e.event_id)`)
	if err != nil {
		return fmt.Errorf("read the published events: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return fmt.Errorf("read the published events: %w", err)
		}
		if !b.accepted[id] && !b.lost[id] {
			return s.fail("the outbox says %s is published, and the broker never had it (nor lost it)", id)
		}
	}
	return rows.Err()
}

// checkFirstPublishedInOrder fails the run unless the event id, which the
// broker has just acknowledged for the first time, goes out in the order
// the events of its order were written: after every event of the order
// written before it, and before every event written after it. accepted
// holds what the broker acknowledged before, the events of id's batch
// ahead of it included. Only a first publication counts: a relay that
// crashed before its mark, or was paused past its lease, and the
// reconciler publish again what the broker already had, and such a copy
// goes out whenever it does. Called as the broker acknowledges the batch,
// before anything else runs.
func (s *simulation) checkFirstPublishedInOrder(ctx context.Context, id string, accepted map[string]bool) error {
	rows, err := s.direct.QueryContext(ctx, `
		SELECT e.event_id, e.event_type, e.aggregate_id, e.seq < first.seq, first.event_type
		FROM outbox_events e JOIN outbox_events first ON first.aggregate_id = e.aggregate_id
		WHERE first.event_id = ? AND e.seq <> first.seq
		ORDER BY e.seq`, id)
	if err != nil {
		return fmt.Errorf("read the events of %s's order: %w", id, err)
	}
	defer rows.Close()
	for rows.Next() {
		var other, otherType, orderID, firstType string
		var before bool
		if err := rows.Scan(&other, &otherType, &orderID, &before, &firstType); err != nil {
			return fmt.Errorf("read the events of %s's order: %w", id, err)
		}
		switch {
		case before && !accepted[other]:
			return s.fail("%s %s of %s went out before %s %s, written before it and not published yet: "+
				"events of one order go out in the order they were written", firstType, id, orderID, otherType, other)
		case !before && accepted[other]:
			return s.fail("%s %s of %s went out after %s %s, written after it: "+
				"events of one order go out in the order they were written", firstType, id, orderID, otherType, other)
		}
	}
	return rows.Err()
}

// fetch hands a batch over, sometimes in another order.
func (b *simBroker) fetch(ctx context.Context, subscriber string, max int) ([]delivery, error) {
	deliveries, err := b.messageBroker.fetch(ctx, subscriber, max)
	if err != nil || len(deliveries) < 2 || b.s.quiescing || !b.s.chance(0.3) {
		return deliveries, err
	}
	b.s.rng.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	b.s.report.Counts.Reorders++
	b.s.tracef("the broker hands %s %d messages out of order", subscriber, len(deliveries))
	return deliveries, nil
}

// ack acks, unless the ack is lost on the way: then the caller thinks it
// acked, and the broker delivers the messages again after ackWait.
func (b *simBroker) ack(ctx context.Context, deliveries ...delivery) error {
	if len(deliveries) > 0 && !b.s.quiescing && b.s.chance(0.1) {
		b.s.report.Counts.LostAcks++
		b.s.tracef("the ack of %d deliveries to %s is lost", len(deliveries), deliveries[0].Subscriber)
		return nil
	}
	if err := b.messageBroker.ack(ctx, deliveries...); err != nil {
		return err
	}
	return b.s.loseAfterAnAck(ctx)
}

// nak asks for d again, unless the nak is lost: then d comes again after
// ackWait instead of delay.
func (b *simBroker) nak(ctx context.Context, d delivery, delay time.Duration) error {
	if !b.s.quiescing && b.s.chance(0.1) {
		b.s.report.Counts.LostAcks++
		b.s.tracef("the nak of %s to %s is lost", d.ID, d.Subscriber)
		return nil
	}
	return b.messageBroker.nak(ctx, d, delay)
}

// replay delivers msg again to subscriber, as the embedded broker does;
// but a message this broker lost is published again first, from the copy
// the repair read (the outbox's), as JetStream's replay publishes a new
// message (natsBroker.replay). The embedded broker, which loses nothing,
// refuses a replay it holds no copy of; the simulated one stands for
// JetStream, which loses messages and replays them all the same. It may
// lose the replay too (loseTheReplay). And half the time, as JetStream's
// new message does, the replay reaches every consumer of the subject, not
// only subscriber (replayToEvery).
func (b *simBroker) replay(ctx context.Context, tx *sql.Tx, subscriber string, msg message, replayID string) error {
	if b.lost[msg.ID] {
		_, err := tx.ExecContext(ctx, `
			INSERT INTO broker_messages (message_id, subject, payload, published_at) VALUES (?, ?, ?, ?)
			ON CONFLICT (message_id) DO NOTHING`,
			msg.ID, msg.Subject, string(msg.Payload), formatTime(b.s.clock.now()))
		if err != nil {
			return fmt.Errorf("publish %s again: %w", msg.ID, err)
		}
	}
	if err := b.messageBroker.replay(ctx, tx, subscriber, msg, replayID); err != nil {
		return err
	}
	if err := b.s.loseTheReplay(ctx, tx, subscriber, msg); err != nil {
		return err
	}
	if b.s.chance(0.5) {
		return b.replayToEvery(ctx, tx, subscriber, msg, replayID)
	}
	return nil
}
