// This file connects to PostgreSQL, for teams that outgrow one SQLite file:
// several API instances, relays and workers on several machines, one
// database. The rest of the code does not know which database it talks to;
// the few statements that must differ are in infra_dialect.go.

package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// isPostgresURL reports whether --db names a PostgreSQL server rather than
// a SQLite file.
func isPostgresURL(target string) bool {
	return strings.HasPrefix(target, "postgres://") || strings.HasPrefix(target, "postgresql://")
}

// postgresMaxConns is each process's pool. Unlike SQLite's one writer,
// PostgreSQL runs transactions side by side; ten per process lets a serve
// process overlap requests, and the chaos topology (three serve, two relay,
// two worker processes, plus check) stays under PostgreSQL's default
// max_connections of 100.
const postgresMaxConns = 10

// openPostgres connects to the database at rawURL and migrates it to
// schema_postgres.sql.
func openPostgres(ctx context.Context, rawURL string) (*sql.DB, error) {
	db, err := connectPostgres(ctx, rawURL)
	if err != nil {
		return nil, err
	}
	if err := migrate(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("migrate %s: %w", redactURL(rawURL), err)
	}
	return db, nil
}

// connectPostgres opens a pool to rawURL and checks that the server answers.
func connectPostgres(ctx context.Context, rawURL string) (*sql.DB, error) {
	config, err := pgx.ParseConfig(rawURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL %s: %w", redactURL(rawURL), err)
	}
	return connectPostgresWith(ctx, config)
}

// connectPostgresWith is connectPostgres with a parsed configuration (a
// test's carries a tracer that pauses its statements).
func connectPostgresWith(ctx context.Context, config *pgx.ConnConfig) (*sql.DB, error) {
	db := sql.OpenDB(rebindConnector{stdlib.GetConnector(*config)})
	db.SetMaxOpenConns(postgresMaxConns)
	db.SetMaxIdleConns(postgresMaxConns)
	db.SetConnMaxIdleTime(time.Minute)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("connect to %s: %w", redactURL(config.ConnString()), err)
	}
	return db, nil
}

// openReadOnlyPostgres opens the database at rawURL for inspect and check:
// every transaction is read-only, so they cannot write to a live system, and
// the schema must already be this program's.
func openReadOnlyPostgres(ctx context.Context, rawURL string) (*sql.DB, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL %s: %w", redactURL(rawURL), err)
	}
	query := u.Query()
	query.Set("default_transaction_read_only", "on")
	u.RawQuery = query.Encode()
	db, err := connectPostgres(ctx, u.String())
	if err != nil {
		return nil, err
	}
	if err := checkSchemaVersion(ctx, db, redactURL(rawURL)); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// redactURL returns a --db value fit for messages and logs: a PostgreSQL
// URL without its password; a SQLite path as it is.
func redactURL(rawURL string) string {
	if !isPostgresURL(rawURL) {
		return rawURL
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return "the database URL"
	}
	return u.Redacted()
}

// PostgreSQL error codes the code reacts to
// (https://www.postgresql.org/docs/current/errcodes-appendix.html).
const (
	pgSerializationFailure = "40001"
	pgDeadlockDetected     = "40P01"
	pgLockNotAvailable     = "55P03"
	pgUniqueViolation      = "23505"
	pgUndefinedTable       = "42P01"
)

// postgresCode returns err's SQLSTATE, or "" if err is not from PostgreSQL.
func postgresCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// rebindConnector hands out connections whose queries may use SQLite's "?"
// placeholders: one spelling of every query serves both databases.
type rebindConnector struct {
	driver.Connector
}

// Connect returns a connection that rebinds its queries.
func (c rebindConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	stdConn, ok := conn.(*stdlib.Conn)
	if !ok {
		conn.Close()
		return nil, fmt.Errorf("bug: pgx returned a %T, not a *stdlib.Conn", conn)
	}
	return rebindConn{stdConn}, nil
}

// Driver returns postgresDriver: how dialectOf tells a PostgreSQL pool from a
// SQLite one.
func (c rebindConnector) Driver() driver.Driver {
	return postgresDriver{c.Connector.Driver()}
}

// postgresDriver marks a *sql.DB as PostgreSQL. Only Connect is ever used to
// open connections; Open, for a DSN, is not rebound and refuses.
type postgresDriver struct {
	driver.Driver
}

// Open refuses: connections come from rebindConnector.
func (postgresDriver) Open(string) (driver.Conn, error) {
	return nil, errors.New("bug: open PostgreSQL through connectPostgres")
}

// rebindConn is a pgx connection that turns "?" into "$1", "$2" ... before a
// query reaches PostgreSQL. Everything else is pgx's own.
type rebindConn struct {
	*stdlib.Conn
}

// Prepare rebinds query and prepares it.
func (c rebindConn) Prepare(query string) (driver.Stmt, error) {
	return c.Conn.Prepare(rebind(query))
}

// PrepareContext rebinds query and prepares it.
func (c rebindConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	return c.Conn.PrepareContext(ctx, rebind(query))
}

// ExecContext rebinds query and runs it.
func (c rebindConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	return c.Conn.ExecContext(ctx, rebind(query), args)
}

// QueryContext rebinds query and runs it.
func (c rebindConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	return c.Conn.QueryContext(ctx, rebind(query), args)
}

// rebind replaces each "?" placeholder in query with PostgreSQL's numbered
// "$n", and SQLite's numbered "?n" with "$n". A "?" inside a string literal,
// a quoted identifier or a comment is left alone.
func rebind(query string) string {
	if !strings.Contains(query, "?") {
		return query
	}
	var b strings.Builder
	b.Grow(len(query) + 8)
	n := 0
	for i := 0; i < len(query); i++ {
		c := query[i]
		switch {
		case c == '\'' || c == '"':
			// Copy through the closing quote; a doubled quote is an escaped
			// one and simply reopens the literal on the next turn.
			end := strings.IndexByte(query[i+1:], c)
			if end < 0 {
				b.WriteString(query[i:])
				return b.String()
			}
			b.WriteString(query[i : i+end+2])
			i += end + 1
		case c == '-' && strings.HasPrefix(query[i:], "--"):
			end := strings.IndexByte(query[i:], '\n')
			if end < 0 {
				b.WriteString(query[i:])
				return b.String()
			}
			b.WriteString(query[i : i+end])
			i += end - 1
		case c == '/' && strings.HasPrefix(query[i:], "/*"):
			end := strings.Index(query[i+2:], "*/")
			if end < 0 {
				b.WriteString(query[i:])
				return b.String()
			}
			b.WriteString(query[i : i+end+4])
			i += end + 3
		case c == '?' && i+1 < len(query) && query[i+1] >= '0' && query[i+1] <= '9':
			b.WriteByte('$')
		case c == '?':
			n++
			fmt.Fprintf(&b, "$%d", n)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
