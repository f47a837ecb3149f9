// The simulator's PostgreSQL faults: what a server and the network to it do
// to a transaction, played on a real PostgreSQL server from the seed.
//
// On SQLite the simulated network is all there is (simulate_faults.go). On
// PostgreSQL the same network sits in front of the App's connections, so
// outages, and a commit whose answer is lost, happen there as they do on
// SQLite; under it, simPostgresConn reaches the real server and makes it
// do, at statements and commits the seed picks, what a busy production
// server does to a transaction:
//
//   - terminates its backend mid-transaction (pg_terminate_backend from the
//     simulator's own handle, as an operator, a failover or the OOM killer
//     would): the server rolls the transaction back and the connection is
//     gone;
//   - fails it with a serialization failure (SQLSTATE 40001; 40P01, a
//     deadlock, for a READ COMMITTED transaction), raised by the server
//     itself in that transaction, which it aborts: withTx must run it again
//     from the start, and nobody may see the difference;
//   - lets its COMMIT land, then terminates the backend before the client
//     reads the answer, so the client is told the connection broke for work
//     that was done.
//
// A statement outside a transaction is a transaction of its own: its
// backend may be terminated before it runs, and an Exec's answer may be
// lost after it committed.
//
// Only the App's own connections meet these faults. The broker stands for
// NATS and has a network of its own (outages, no PostgreSQL faults); the
// processor, the audit and the clients' checks use a direct handle, which is
// also the one that terminates backends.
//
// What is reproducible from the seed: every decision (which statement or
// commit of which transaction fails, and how) is drawn from the seed at a
// point the code reaches in the same order every run, and only one
// coroutine runs at a time, so no two transactions are ever open at once
// and no real serialization failure or lock wait happens. What is not: the
// server's own scheduling (autovacuum, the order of rows a query without
// ORDER BY returns from a heap it has pruned), and how a terminated
// connection shows itself to pgx (a FATAL 57P01, or an EOF): the latter is
// normalized to errSimTerminated once isDatabaseUnavailable recognises it,
// so the trace does not depend on it.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// errSimTerminated is what a call on a connection whose backend the
// simulator terminated returns, whatever pgx saw first (the server's FATAL
// 57P01, or the socket's EOF), provided isDatabaseUnavailable recognised
// what it saw. Anything else is passed on as it is: a finding. It is the
// server's error, not driver.ErrBadConn: database/sql would run a
// statement outside a transaction again on another connection after
// ErrBadConn, and pgx says ErrBadConn only when nothing was sent.
var errSimTerminated = &pgconn.PgError{Severity: "FATAL", Code: "57P01",
	Message: "terminating connection due to administrator command (pg_terminate_backend, simulated)"}

// errSimAnswerLost is what a statement outside a transaction returns when
// it ran and committed, and then its backend was terminated before its
// answer was read.
var errSimAnswerLost = &pgconn.PgError{Severity: "FATAL", Code: "57P01",
	Message: "terminating connection due to administrator command (pg_terminate_backend, simulated, after the statement committed)"}

// simPostgresCounts are the PostgreSQL faults a run injected.
type simPostgresCounts struct {
	// Terminations are backends terminated before a statement (in a
	// transaction or on its own) or before COMMIT; LostCommits of the
	// simulation count those terminated just after a COMMIT, or a
	// statement on its own, that landed.
	Terminations int
	// SerializationFailures are 40001s raised in SERIALIZABLE
	// transactions; Deadlocks 40P01s raised in READ COMMITTED ones.
	SerializationFailures, Deadlocks int
}

// add adds other's counts to c.
func (c *simPostgresCounts) add(other simPostgresCounts) {
	c.Terminations += other.Terminations
	c.SerializationFailures += other.SerializationFailures
	c.Deadlocks += other.Deadlocks
}

// summary describes the PostgreSQL faults for a run's summary line; empty
// on SQLite, where there are none.
func (c simPostgresCounts) summary(onPostgres bool) string {
	if !onPostgres {
		return ""
	}
	return fmt.Sprintf(", PostgreSQL: %d backends terminated before a statement or COMMIT, %d serialization failures, %d deadlocks",
		c.Terminations, c.SerializationFailures, c.Deadlocks)
}

// postgresFault is what the server does to a transaction at one statement
// or commit.
type postgresFault int

const (
	postgresNoFault postgresFault = iota
	// postgresTerminate: the backend is terminated before the statement
	// (or the COMMIT) reaches it.
	postgresTerminate
	// postgresConflict: the server fails the statement (or the COMMIT)
	// with 40001, or 40P01 in a READ COMMITTED transaction.
	postgresConflict
	// postgresLoseCommit: the COMMIT lands, then the backend is terminated
	// before its answer is read. Drawn at commits only.
	postgresLoseCommit
)

// Rates of the PostgreSQL faults, per mille of the statements (and, for a
// lost commit, of the commits) of the App's transactions. A run of 150
// steps has a few hundred such statements: each run meets a few of each.
const (
	postgresTerminatePerMille  = 4
	postgresConflictPerMille   = 12
	postgresLoseCommitPerMille = 10
)

// openPostgresApp opens the App the simulation drives on the PostgreSQL
// database at rawURL: its connections go through the simulated network
// and simPostgresConn; the broker's through a network of its own; the
// processor's and the simulator's own through a direct handle.
func (s *simulation) openPostgresApp(ctx context.Context, rawURL string, ids func(string) string) (*App, error) {
	direct, err := openPostgres(ctx, rawURL)
	if err != nil {
		return nil, err
	}
	config, err := pgx.ParseConfig(rawURL)
	if err != nil {
		direct.Close()
		return nil, fmt.Errorf("parse database URL %s: %w", redactURL(rawURL), err)
	}
	server := rebindConnector{stdlib.GetConnector(*config)}
	s.direct = direct
	s.onPostgres = true
	s.network = s.newNetwork("the database")
	s.brokerNetwork = s.newNetwork("the broker")
	db := s.openPostgresPool(server, s.network, s.postgresFault)
	brokerDB := sql.OpenDB(&simConnector{base: server, network: s.brokerNetwork})
	brokerDB.SetMaxOpenConns(postgresMaxConns)
	brokerDB.SetMaxIdleConns(postgresMaxConns)
	app := newApp(db, s.clock.now, ids, s.faultHook)
	app.processor.db = direct
	app.broker = &simBroker{messageBroker: &embeddedBroker{db: brokerDB, now: s.clock.now, fault: s.faultHook, ackWait: app.leases.ackWait}, s: s}
	s.closeAlso = []*sql.DB{brokerDB, direct}
	if err := app.subscribeConsumers(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return app, nil
}

// openPostgresPool returns a pool of connections to server through
// network, whose transactions meet the faults draw returns. s.direct must
// be set: it terminates their backends.
func (s *simulation) openPostgresPool(server driver.Connector, network *simDatabase, draw func(commit bool) postgresFault) *sql.DB {
	db := sql.OpenDB(&simConnector{base: &simPostgresConnector{base: server, s: s, draw: draw}, network: network})
	db.SetMaxOpenConns(postgresMaxConns)
	db.SetMaxIdleConns(postgresMaxConns)
	return db
}

// postgresFault draws what the server does at the next statement of a
// transaction (commit false) or at its COMMIT, for the running action.
// Nothing while quiet, and nothing outside an action (start-up).
func (s *simulation) postgresFault(commit bool) postgresFault {
	if s.current == nil || s.quiescing {
		return postgresNoFault
	}
	switch roll := s.rng.IntN(1000); {
	case roll < postgresTerminatePerMille:
		return postgresTerminate
	case roll < postgresTerminatePerMille+postgresConflictPerMille:
		return postgresConflict
	case commit && roll < postgresTerminatePerMille+postgresConflictPerMille+postgresLoseCommitPerMille:
		return postgresLoseCommit
	}
	return postgresNoFault
}

// simPostgresConnector opens the App's connections to the server.
type simPostgresConnector struct {
	base driver.Connector
	s    *simulation
	// draw is s.postgresFault; a test gives faults of its choosing.
	draw func(commit bool) postgresFault
}

// Connect opens a connection and notes its backend's process id.
func (c *simPostgresConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.base.Connect(ctx)
	if err != nil {
		return nil, err
	}
	rebound, ok := conn.(rebindConn)
	if !ok {
		conn.Close()
		return nil, fmt.Errorf("bug: rebindConnector returned a %T", conn)
	}
	return &simPostgresConn{rebindConn: rebound, s: c.s, draw: c.draw, pid: rebound.Conn.Conn().PgConn().PID()}, nil
}

// Driver returns the PostgreSQL driver, so dialectOf sees PostgreSQL.
func (c *simPostgresConnector) Driver() driver.Driver { return c.base.Driver() }

// simPostgresConn is one of the App's connections to the server. Outside a
// transaction it is pgx's; inside one, each statement and the COMMIT may
// meet a fault (postgresFault).
type simPostgresConn struct {
	rebindConn
	s    *simulation
	draw func(commit bool) postgresFault
	pid  uint32
	// inTx is set while a transaction is open; serializable if it is a
	// SERIALIZABLE one.
	inTx, serializable bool
	// terminated is set once the simulator terminated the backend.
	terminated bool
}

// BeginTx begins a transaction.
func (c *simPostgresConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.rebindConn.BeginTx(ctx, opts)
	if err != nil {
		return nil, c.seen(err)
	}
	c.inTx = true
	c.serializable = sql.IsolationLevel(opts.Isolation) == sql.LevelSerializable
	return &simPostgresTx{tx: tx, conn: c}, nil
}

// ExecContext runs a statement, unless the server fails it first.
//
// A statement outside a transaction is a transaction of its own: its
// backend may be terminated before it runs, or it may run and commit while
// its answer is lost.
func (c *simPostgresConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if !c.inTx && !c.terminated {
		switch c.draw(true) {
		case postgresTerminate:
			if err := c.terminateMidTransaction(ctx, "a statement outside"); err != nil {
				return nil, err
			}
		case postgresLoseCommit:
			if _, err := c.rebindConn.ExecContext(ctx, query, args); err != nil {
				return nil, err
			}
			if err := c.terminate(ctx); err != nil {
				return nil, err
			}
			c.s.postgresCommitLost()
			return nil, errSimAnswerLost
		}
	}
	if err := c.beforeStatement(ctx, query); err != nil {
		return nil, err
	}
	if err := c.diskFull(ctx, query); err != nil {
		return nil, err
	}
	result, err := c.rebindConn.ExecContext(ctx, query, args)
	return result, c.seen(err)
}

// QueryContext runs a query, unless the server fails it first.
//
// Outside a transaction only its backend may be terminated first: a
// query's rows are read after it returns, so its answer cannot be lost
// here once it has one.
func (c *simPostgresConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if !c.inTx && !c.terminated && c.draw(true) == postgresTerminate {
		if err := c.terminateMidTransaction(ctx, "a statement outside"); err != nil {
			return nil, err
		}
	}
	if err := c.beforeStatement(ctx, query); err != nil {
		return nil, err
	}
	if err := c.diskFull(ctx, query); err != nil {
		return nil, err
	}
	rows, err := c.rebindConn.QueryContext(ctx, query, args)
	return rows, c.seen(err)
}

// IsValid keeps a connection whose backend was terminated out of the pool.
func (c *simPostgresConn) IsValid() bool {
	return !c.terminated
}

// beforeStatement applies the fault drawn for a statement of a
// transaction: a terminated backend (the statement then runs, and fails,
// on the dead connection) or a conflict (the server's error, returned
// instead of running the statement). Nothing is drawn for a statement the
// server would not fail that way: one in a transaction it has already
// aborted (the caller is rolling back), or a savepoint's own command.
func (c *simPostgresConn) beforeStatement(ctx context.Context, query string) error {
	if !c.inTx || c.terminated || c.Conn.Conn().PgConn().TxStatus() != 'T' || isSavepointCommand(query) {
		return nil
	}
	switch c.draw(false) {
	case postgresTerminate:
		return c.terminateMidTransaction(ctx, "a statement")
	case postgresConflict:
		return c.conflict(ctx, "a statement")
	}
	return nil
}

// diskFull fails a write while the server's disk is full, as the server
// does when it cannot extend a file: with disk_full (53100), which aborts
// the transaction it is in. Reads still run.
func (c *simPostgresConn) diskFull(ctx context.Context, query string) error {
	if c.s.network == nil || !c.s.network.diskFull || c.terminated || !isWriteStatement(query) {
		return nil
	}
	if c.inTx && c.Conn.Conn().PgConn().TxStatus() != 'T' {
		return nil
	}
	const raise = `DO $$ BEGIN RAISE EXCEPTION 'simulated: could not extend file: No space left on device' USING ERRCODE = '` + pgDiskFull + `'; END $$`
	_, err := c.rebindConn.ExecContext(ctx, raise, nil)
	if postgresCode(err) != pgDiskFull {
		return fmt.Errorf("simulator: raise %s: got %v", pgDiskFull, err)
	}
	if action := c.s.current; action != nil {
		c.s.tracef("a%d %s: the server fails a write for the full disk", action.id, action.process.name)
	}
	return err
}

// pgDiskFull is the server's disk_full; isDatabaseUnavailable knows its
// class, 53.
const pgDiskFull = "53100"

// isWriteStatement reports whether query writes rows: INSERT, UPDATE or
// DELETE (a WITH that writes is not used by the App).
func isWriteStatement(query string) bool {
	word, _, _ := strings.Cut(strings.TrimSpace(query), " ")
	switch strings.ToUpper(word) {
	case "INSERT", "UPDATE", "DELETE":
		return true
	}
	return false
}

// isSavepointCommand reports whether query is SAVEPOINT, RELEASE or
// ROLLBACK TO.
func isSavepointCommand(query string) bool {
	word, _, _ := strings.Cut(strings.TrimSpace(query), " ")
	switch strings.ToUpper(word) {
	case "SAVEPOINT", "RELEASE", "ROLLBACK":
		return true
	}
	return false
}

// terminate has the server end this connection's backend, from the
// simulator's direct handle, and waits until it has: its transaction is
// rolled back and its locks are free before anything else runs. The
// running action may then fail, or answer 503, for that reason.
func (c *simPostgresConn) terminate(ctx context.Context) error {
	var done bool
	// The second argument makes the call wait (up to 10 s) for the backend
	// to exit, instead of only signalling it.
	err := c.s.direct.QueryRowContext(ctx, `SELECT pg_terminate_backend(?, 10000)`, int64(c.pid)).Scan(&done)
	if err != nil {
		return fmt.Errorf("simulator: terminate backend: %w", err)
	}
	if !done {
		return fmt.Errorf("simulator: backend %d was not terminated within 10 s", c.pid)
	}
	c.terminated = true
	if c.s.current != nil {
		c.s.current.sawOutage = true
	}
	return nil
}

// terminateMidTransaction terminates the backend before a statement or
// the COMMIT (where) of a transaction reaches it, and counts it.
func (c *simPostgresConn) terminateMidTransaction(ctx context.Context, where string) error {
	if err := c.terminate(ctx); err != nil {
		return err
	}
	c.s.report.Counts.Terminations++
	if action := c.s.current; action != nil {
		c.s.tracef("a%d %s: the server terminates its connection before %s of a transaction", action.id, action.process.name, where)
	}
	return nil
}

// conflict has the server itself fail this connection's transaction with a
// serialization failure (a deadlock in a READ COMMITTED transaction),
// which aborts it, and returns the server's error.
func (c *simPostgresConn) conflict(ctx context.Context, where string) error {
	code, what := pgSerializationFailure, "a serialization failure"
	if !c.serializable {
		code, what = pgDeadlockDetected, "a deadlock"
	}
	// code is one of our constants, not input.
	raise := fmt.Sprintf(`DO $$ BEGIN RAISE EXCEPTION 'simulated %s' USING ERRCODE = '%s'; END $$`, what, code)
	_, err := c.rebindConn.ExecContext(ctx, raise, nil)
	if postgresCode(err) != code {
		return fmt.Errorf("simulator: raise %s: got %v", code, err)
	}
	if code == pgSerializationFailure {
		c.s.report.Counts.SerializationFailures++
	} else {
		c.s.report.Counts.Deadlocks++
	}
	if action := c.s.current; action != nil {
		c.s.tracef("a%d %s: the server fails %s of a transaction with %s", action.id, action.process.name, where, what)
	}
	return err
}

// seen returns err as the App sees it: on a terminated connection, an
// error isDatabaseUnavailable recognises becomes errSimTerminated, so the
// trace does not depend on how pgx learned of the termination.
func (c *simPostgresConn) seen(err error) error {
	if err != nil && c.terminated && isDatabaseUnavailable(err) {
		return errSimTerminated
	}
	return err
}

// simPostgresTx is a transaction on a simPostgresConn.
type simPostgresTx struct {
	tx   driver.Tx
	conn *simPostgresConn
}

// Commit commits, unless the fault drawn for it is a terminated backend
// (nothing is committed), a conflict (the server refuses the COMMIT), or a
// lost answer (it is committed, and the client is told the connection
// broke).
func (t *simPostgresTx) Commit() error {
	c := t.conn
	defer func() { c.inTx = false }()
	ctx := context.Background()
	if c.terminated || c.Conn.Conn().PgConn().TxStatus() != 'T' {
		return c.seen(t.tx.Commit())
	}
	switch c.draw(true) {
	case postgresTerminate:
		if err := c.terminateMidTransaction(ctx, "the COMMIT"); err != nil {
			// The simulator failed, not the App: the run fails with err.
			t.tx.Rollback()
			return err
		}
		return c.seen(t.tx.Commit())
	case postgresConflict:
		err := c.conflict(ctx, "the COMMIT")
		// The server aborted the transaction; ROLLBACK ends it, as the
		// server does itself when it refuses a COMMIT.
		t.tx.Rollback()
		return err
	case postgresLoseCommit:
		if err := t.tx.Commit(); err != nil {
			return c.seen(err)
		}
		if err := c.terminate(ctx); err != nil {
			return err
		}
		c.s.postgresCommitLost()
		return errSimCommitLost
	}
	return c.seen(t.tx.Commit())
}

// Rollback rolls back; on a terminated connection the server already has.
func (t *simPostgresTx) Rollback() error {
	c := t.conn
	c.inTx = false
	if c.terminated {
		// Only pgx's side is left to close; its error would say no more
		// than that the connection is gone, which ErrBadConn says to
		// database/sql, which then discards the connection.
		t.tx.Rollback()
		return driver.ErrBadConn
	}
	return c.seen(t.tx.Rollback())
}

// postgresCommitLost records a commit that landed while its answer was
// lost: the running request may then be answered 503, and the answer the
// server stored for it is one the client never got.
func (s *simulation) postgresCommitLost() {
	s.report.Counts.LostCommits++
	if s.current == nil {
		return
	}
	s.tracef("a%d %s: a COMMIT lands, and the server terminates the connection before its answer is read",
		s.current.id, s.current.process.name)
	s.current.sawOutage = true
	s.current.commitLost = true
	if s.current.request != nil {
		s.current.request.commitLostAt = s.clock.now()
	}
}
