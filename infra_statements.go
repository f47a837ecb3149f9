// This file keeps each SQLite connection's prepared statements, so that a
// statement is parsed and planned once per connection instead of on every
// call. Parsing was a sixth of the create path's CPU. The queries stay
// where they are, as backtick strings next to the code that runs them: the
// text of a query is the key under which its prepared statement is kept.
//
// PostgreSQL needs nothing of the kind: pgx already keeps a cache of
// prepared statements per connection, keyed by the query text, and so does
// the SQLite module of Python, which the article's sample uses.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	mathrand "math/rand/v2"
	"time"
)

// maxCachedStatements bounds the statements one connection keeps. The code
// has about a hundred distinct queries; the bound only matters for queries
// built at run time (an IN list of n placeholders), which past it are
// prepared for one use and closed, as before.
const maxCachedStatements = 256

// sqliteConnector opens SQLite connections that keep their prepared
// statements (see statementConn).
type sqliteConnector struct {
	driver.Connector
	// readers, if set, is the pool of read connections beside this write
	// pool (see openSQLiteReaders); it is closed with the write pool.
	readers *sql.DB
	// checkpoints, if set, checkpoints the file beside the writer (see
	// infra_checkpoint.go); it hears of each commit and is closed with the
	// write pool.
	checkpoints *checkpointer
}

// Driver returns the SQLite driver, with the readers readersOf finds and
// the checkpointer.
func (c sqliteConnector) Driver() driver.Driver {
	return sqliteDriver{Driver: c.Connector.Driver(), readers: c.readers, checkpoints: c.checkpoints}
}

// Close closes the readers and the checkpointer. database/sql calls it when
// the write pool is closed.
func (c sqliteConnector) Close() error {
	var errs []error
	if c.checkpoints != nil {
		errs = append(errs, c.checkpoints.Close())
	}
	if c.readers != nil {
		errs = append(errs, c.readers.Close())
	}
	return errors.Join(errs...)
}

// sqliteDriver is the driver of a SQLite pool; readers are the read
// connections beside it, and checkpoints its checkpointer, if any.
type sqliteDriver struct {
	driver.Driver
	readers     *sql.DB
	checkpoints *checkpointer
}

// Connect opens a connection.
func (c sqliteConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := connectWaiting(ctx, c.Connector)
	if err != nil {
		return nil, err
	}
	sqliteConn, ok := conn.(sqliteDriverConn)
	if !ok {
		conn.Close()
		return nil, fmt.Errorf("bug: the SQLite driver returned a %T, which lacks a method database/sql uses", conn)
	}
	return &statementConn{sqliteDriverConn: sqliteConn, statements: map[string]*cachedStatement{}, checkpoints: c.checkpoints}, nil
}

// sqliteDriverConn is what database/sql uses of a SQLite connection besides
// running queries, which statementConn does itself.
type sqliteDriverConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
}

// preparedStatement is what statementConn needs of a driver statement.
type preparedStatement interface {
	driver.Stmt
	driver.StmtExecContext
	driver.StmtQueryContext
}

// statementConn is a SQLite connection that prepares each query once and
// runs the prepared statement again on later calls with the same text.
//
// database/sql hands a connection to one caller at a time and serializes
// its calls on it (closing Rows included), so the map needs no lock.
type statementConn struct {
	sqliteDriverConn
	statements map[string]*cachedStatement
	// checkpoints, if set, hears of each commit: a transaction's, or a
	// statement's run outside one (inTx).
	checkpoints *checkpointer
	inTx        bool
}

// BeginTx begins a transaction whose commit the checkpointer hears of.
func (c *statementConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.sqliteDriverConn.BeginTx(ctx, opts)
	if err != nil || c.checkpoints == nil {
		return tx, err
	}
	c.inTx = true
	return &checkpointedTx{Tx: tx, conn: c}, nil
}

// checkpointedTx is a transaction of a connection with a checkpointer.
type checkpointedTx struct {
	driver.Tx
	conn *statementConn
}

// Commit commits, then wakes the checkpointer.
func (t *checkpointedTx) Commit() error {
	t.conn.inTx = false
	err := t.Tx.Commit()
	if err == nil {
		t.conn.checkpoints.committed()
	}
	return err
}

// Rollback rolls back.
func (t *checkpointedTx) Rollback() error {
	t.conn.inTx = false
	return t.Tx.Rollback()
}

// statementRan wakes the checkpointer after a statement that ran outside a
// transaction, which committed on its own if it wrote anything.
func (c *statementConn) statementRan() {
	if c.checkpoints != nil && !c.inTx {
		c.checkpoints.committed()
	}
}

// cachedStatement is a prepared statement and whether a call is using it.
// A statement runs one query at a time: while the Rows of a SELECT are
// open, the same text asked for again (a query inside a loop over its own
// results) gets a statement of its own, prepared for that one use.
type cachedStatement struct {
	stmt  preparedStatement
	inUse bool
	// temporary is true for a statement outside the cache: it is closed
	// when its call ends.
	temporary bool
}

// statement returns a prepared statement for query, marked in use; the
// caller calls release when the statement's call (its Rows, for a query)
// is over.
func (c *statementConn) statement(ctx context.Context, query string) (*cachedStatement, error) {
	cached, inCache := c.statements[query]
	if inCache && !cached.inUse {
		cached.inUse = true
		return cached, nil
	}
	stmt, err := c.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	prepared, ok := stmt.(preparedStatement)
	if !ok {
		stmt.Close()
		return nil, fmt.Errorf("bug: the SQLite driver prepared a %T, which cannot run with a context", stmt)
	}
	cached = &cachedStatement{stmt: prepared, inUse: true, temporary: inCache || len(c.statements) >= maxCachedStatements}
	if !cached.temporary {
		c.statements[query] = cached
	}
	return cached, nil
}

// release ends a call's use of s.
func (s *cachedStatement) release() error {
	s.inUse = false
	if s.temporary {
		return s.stmt.Close()
	}
	return nil
}

// ExecContext runs query with the connection's prepared statement for it.
func (c *statementConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	s, err := c.statement(ctx, query)
	if err != nil {
		return nil, err
	}
	result, err := s.stmt.ExecContext(ctx, args)
	c.statementRan()
	return result, errors.Join(err, s.release())
}

// QueryContext runs query with the connection's prepared statement for it.
// The statement stays in use until the Rows are closed.
func (c *statementConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	s, err := c.statement(ctx, query)
	if err != nil {
		return nil, err
	}
	rows, err := s.stmt.QueryContext(ctx, args)
	if err != nil {
		c.statementRan()
		return nil, errors.Join(err, s.release())
	}
	return &statementRows{Rows: rows, statement: s, closed: c.statementRan}, nil
}

// Close closes the connection's statements, then the connection: SQLite
// does not close a connection that still has statements.
func (c *statementConn) Close() error {
	var errs []error
	for query, s := range c.statements {
		errs = append(errs, s.stmt.Close())
		delete(c.statements, query)
	}
	errs = append(errs, c.sqliteDriverConn.Close())
	return errors.Join(errs...)
}

// statementRows are the Rows of a cached statement; closing them frees the
// statement for the next call, and calls closed: a statement outside a
// transaction that writes (INSERT ... RETURNING) commits when its rows
// are done.
type statementRows struct {
	driver.Rows
	statement *cachedStatement
	closed    func()
}

// Close closes the rows (which resets the statement) and releases it.
func (r *statementRows) Close() error {
	err := r.Rows.Close()
	if r.statement == nil {
		return err
	}
	r.closed()
	s := r.statement
	r.statement = nil
	return errors.Join(err, s.release())
}

// connectWaiting opens a connection with connector, waiting out another
// connection's lock as busy_timeout would. Opening a connection runs the
// DSN's pragmas, and journal_mode(WAL) on a file that is not yet in WAL
// mode (a new file, opened by several processes at once) needs the file to
// itself: SQLite then fails at once with SQLITE_BUSY, without waiting
// through busy_timeout. Once one connection has switched the file, the
// pragma changes nothing and the others open.
func connectWaiting(ctx context.Context, connector driver.Connector) (driver.Conn, error) {
	deadline := time.Now().Add(sqliteBusyTimeout)
	wait := time.Millisecond
	for {
		conn, err := connector.Connect(ctx)
		if err == nil || !isBusy(err) || time.Now().Add(wait).After(deadline) {
			return conn, err
		}
		select {
		case <-ctx.Done():
			return nil, errors.Join(err, ctx.Err())
		case <-time.After(wait + mathrand.N(wait)):
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}
