package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"modernc.org/sqlite"
)

// This file counts, for BenchmarkEndToEnd, every transaction the App's
// connections commit and every statement they run, by the loop and the
// function that ran them: where the commits of one order go. Every commit
// is a round trip, a WAL flush and a lock held; the count is what says how
// many an order costs, and which loop to take them out of.
//
// The count is made at the connection, under database/sql, so that it sees
// what withTx sees and what it does not: a statement outside a transaction
// (markPublished's UPDATE, a poll's SELECT) is a transaction of its own on
// both databases, and on PostgreSQL counts in pg_stat_database like any
// other. Where a transaction or statement comes from is read from the
// goroutine's stack when it begins, so the code under test carries no
// labels; the stack costs a few microseconds a statement, nothing beside
// an order's milliseconds.

// commitLedger counts what an App's connections commit, by place.
type commitLedger struct {
	mu      sync.Mutex
	byPlace map[commitPlace]*placeCount
}

// commitPlace is where a transaction began: the loop (relay, consumers,
// saga, refund completer, cleanup, or the API) and the function of ours
// that began it.
type commitPlace struct {
	loop, site string
}

// placeCount is what was committed at one place.
type placeCount struct {
	// commits are transactions committed, statements outside a
	// transaction included (autocommits counts those apart).
	commits, autocommits int64
	// empty are the commits that returned and changed no row: a poll or a
	// claim that found nothing to do.
	empty int64
	// readOnly are the commits that ran no INSERT, UPDATE or DELETE.
	readOnly int64
	// wrote are the commits that changed a row: on PostgreSQL those are
	// given a transaction id and wait for their WAL to be flushed
	// (synchronous_commit=on); the others end without either.
	wrote     int64
	rollbacks int64
	// statements counts the statements of committed transactions by their
	// text (shortened).
	statements map[string]int64
}

// ledgerTotals are a ledger's sums over every place.
type ledgerTotals struct {
	commits, wrote, empty, statements int64
}

// newCommitLedger returns an empty ledger.
func newCommitLedger() *commitLedger {
	return &commitLedger{byPlace: map[commitPlace]*placeCount{}}
}

// add records one finished transaction (or statement outside one).
func (l *commitLedger) add(u *ledgerUnit, committed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	count := l.byPlace[u.place]
	if count == nil {
		count = &placeCount{statements: map[string]int64{}}
		l.byPlace[u.place] = count
	}
	if !committed {
		count.rollbacks++
		return
	}
	count.commits++
	if u.autocommit {
		count.autocommits++
	}
	if u.touched == 0 {
		count.empty++
	}
	if !u.writes {
		count.readOnly++
	}
	if u.changed > 0 {
		count.wrote++
	}
	for _, statement := range u.statements {
		count.statements[statement]++
	}
}

// totals returns the ledger's sums so far.
func (l *commitLedger) totals() ledgerTotals {
	l.mu.Lock()
	defer l.mu.Unlock()
	var t ledgerTotals
	for _, count := range l.byPlace {
		t.commits += count.commits
		t.wrote += count.wrote
		t.empty += count.empty
		for _, n := range count.statements {
			t.statements += n
		}
	}
	return t
}

// snapshot returns a copy of the counts so far, to subtract from later
// ones (since).
func (l *commitLedger) snapshot() map[commitPlace]placeCount {
	l.mu.Lock()
	defer l.mu.Unlock()
	copied := map[commitPlace]placeCount{}
	for place, count := range l.byPlace {
		c := *count
		c.statements = maps.Clone(count.statements)
		copied[place] = c
	}
	return copied
}

// since returns the counts of now minus those of before, place by place.
func since(now, before map[commitPlace]placeCount) map[commitPlace]placeCount {
	diff := map[commitPlace]placeCount{}
	for place, count := range now {
		old := before[place]
		d := placeCount{
			commits:     count.commits - old.commits,
			autocommits: count.autocommits - old.autocommits,
			empty:       count.empty - old.empty,
			readOnly:    count.readOnly - old.readOnly,
			wrote:       count.wrote - old.wrote,
			rollbacks:   count.rollbacks - old.rollbacks,
			statements:  map[string]int64{},
		}
		for statement, n := range count.statements {
			if n -= old.statements[statement]; n != 0 {
				d.statements[statement] = n
			}
		}
		if d.commits != 0 || d.rollbacks != 0 {
			diff[place] = d
		}
	}
	return diff
}

// logCommitBreakdown logs counts (since the benchmark began) per order:
// one line per place, most commits first, then the statements of the
// places that commit most. For benchmarks the log is always printed.
func logCommitBreakdown(b *testing.B, counts map[commitPlace]placeCount, orders int) {
	b.Helper()
	places := make([]commitPlace, 0, len(counts))
	for place := range counts {
		places = append(places, place)
	}
	slices.SortFunc(places, func(x, y commitPlace) int {
		if d := counts[y].commits - counts[x].commits; d != 0 {
			return int(d)
		}
		return strings.Compare(x.loop+x.site, y.loop+y.site)
	})
	perOrder := func(n int64) float64 { return float64(n) / float64(orders) }
	var text strings.Builder
	fmt.Fprintf(&text, "where the commits of %d orders go, per order:\n", orders)
	fmt.Fprintf(&text, "%-17s %-38s %8s %8s %8s %8s %8s %8s %8s\n", "loop", "began in", "commits", "wrote", "read", "nothing", "outside", "rollback", "stmts")
	for _, place := range places {
		c := counts[place]
		var statements int64
		for _, n := range c.statements {
			statements += n
		}
		fmt.Fprintf(&text, "%-17s %-38s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f\n", place.loop, place.site,
			perOrder(c.commits), perOrder(c.wrote), perOrder(c.readOnly), perOrder(c.empty), perOrder(c.autocommits), perOrder(c.rollbacks), perOrder(statements))
	}
	fmt.Fprintf(&text, "(wrote: changed a row; read: ran no INSERT, UPDATE or DELETE; nothing: returned and changed no row; outside: a statement outside a transaction)\n")
	fmt.Fprintf(&text, "statements per order, by place:\n")
	for _, place := range places {
		c := counts[place]
		statements := make([]string, 0, len(c.statements))
		for statement := range c.statements {
			statements = append(statements, statement)
		}
		slices.SortFunc(statements, func(x, y string) int {
			if d := c.statements[y] - c.statements[x]; d != 0 {
				return int(d)
			}
			return strings.Compare(x, y)
		})
		for _, statement := range statements {
			fmt.Fprintf(&text, "  %-17s %-38s %7.2f  %s\n", place.loop, place.site, perOrder(c.statements[statement]), statement)
		}
	}
	b.Log(text.String())
}

// ledgerUnit is one transaction, or one statement outside a transaction,
// while it runs.
type ledgerUnit struct {
	place      commitPlace
	autocommit bool
	// touched counts the rows its statements returned or changed.
	touched int64
	// writes is set once it ran an INSERT, UPDATE or DELETE; changed
	// counts the rows those changed (or locked).
	writes     bool
	changed    int64
	statements []string
}

// writing matches a statement that may write rows (SELECT ... FOR UPDATE
// included: a row lock is written to the row).
var writing = regexp.MustCompile(`(?i)\b(INSERT|UPDATE|DELETE)\b`)

// noteStatement records that query ran in u and touched rows, and returns
// whether it may write.
func (u *ledgerUnit) noteStatement(query string, rows int64) bool {
	seen := readStatement(query)
	u.statements = append(u.statements, seen.label)
	writes := seen.writes
	u.noteRows(rows, writes)
	u.writes = u.writes || writes
	return writes
}

// noteRows records that a statement, which may write, touched rows.
func (u *ledgerUnit) noteRows(rows int64, writes bool) {
	u.touched += rows
	if writes {
		u.changed += rows
	}
}

// seenStatement is what the ledger needs of a query text.
type seenStatement struct {
	label  string
	writes bool
}

// seenStatements holds each query text's seenStatement, read once: the
// App runs a few dozen texts, and a label and a regular expression for
// every statement made the count cost a tenth of what it measures.
var seenStatements sync.Map // query -> seenStatement

// readStatement returns query's label and whether it may write.
func readStatement(query string) seenStatement {
	if seen, ok := seenStatements.Load(query); ok {
		return seen.(seenStatement)
	}
	seen := seenStatement{label: statementLabel(query), writes: writing.MatchString(query)}
	seenStatements.Store(query, seen)
	return seen
}

// statementLabel shortens query for the breakdown: its first words, on one
// line.
func statementLabel(query string) string {
	label := strings.Join(strings.Fields(query), " ")
	if len(label) > 90 {
		label = label[:90] + "..."
	}
	return label
}

// Where a transaction began, read from the stack (placeOf).
var (
	// loopsByFunction name the loop whose pass a function is.
	loopsByFunction = []struct{ function, loop string }{
		{"(*App).relayOnce", "relay"},
		{"(*App).consumeOnce", "consumers"},
		{"(*App).sagaOnce", "saga"},
		{"(*App).completeRefundsOnce", "refund completer"},
		{"(*App).cleanupOnce", "cleanup"},
		{"(*server).", "API"},
	}
	// plumbing are the functions that run a transaction for someone else:
	// the place is their caller.
	plumbing = []string{"runTxOnce", "runTx", "withTx", "withClaimTx", "withFencedTx", "keyTx", "inSavepoint", "withItems", "(*itemUndo).",
		"runInSavepoint", "runRecovered", "ownTxWriter", "groupWriter", "(*groupCommitter).", "(*batch).",
		"newGroupRequest", "(*ledgerConn).", "(*ledgerTx).", "(*ledgerRows).", "placeOf"}
	// closureSuffix is what Go appends to a function's name for the
	// closures inside it.
	closureSuffix = regexp.MustCompile(`(\.func\d+)?(\.\d+)*$`)
)

// placesByStack holds placeOf's answer for each stack it has read: the
// App begins its transactions from a few dozen stacks, and reading the
// frames' names of each, with a regular expression per frame, cost
// about an eighth of the orders a second the count measures on SQLite.
var placesByStack sync.Map // [64]uintptr -> commitPlace

// placeOf returns where the calling goroutine is: the loop its stack
// passes through, and the first function of ours that is not plumbing.
func placeOf() commitPlace {
	var pcs [64]uintptr
	n := runtime.Callers(2, pcs[:])
	if place, ok := placesByStack.Load(pcs); ok {
		return place.(commitPlace)
	}
	place := placeOfFrames(pcs[:n])
	placesByStack.Store(pcs, place)
	return place
}

// placeOfFrames is placeOf for the stack pcs.
func placeOfFrames(pcs []uintptr) commitPlace {
	frames := runtime.CallersFrames(pcs)
	place := commitPlace{loop: "other"}
	for {
		frame, more := frames.Next()
		function, ours := ourFunction(frame.Function)
		if ours {
			// Contains, not HasPrefix: an inlined closure is named after
			// the function it was inlined into (newApp.groupWriter).
			if place.site == "" && !slices.ContainsFunc(plumbing, func(p string) bool { return strings.Contains(function, p) }) {
				place.site = function
			}
			for _, l := range loopsByFunction {
				if place.loop == "other" && strings.HasPrefix(function, l.function) {
					place.loop = l.loop
				}
			}
		}
		if !more {
			return place
		}
	}
}

// ourFunction returns the name of a function of this package, without
// the package and closure suffixes, and whether it is one.
func ourFunction(name string) (string, bool) {
	for _, prefix := range []string{"main.", "retrysafe."} {
		if rest, ok := strings.CutPrefix(name, prefix); ok {
			return closureSuffix.ReplaceAllString(rest, ""), true
		}
	}
	return "", false
}

// ledgerConnector hands out connections that count into ledger.
type ledgerConnector struct {
	driver.Connector
	ledger *commitLedger
}

// Connect opens a counted connection.
func (c ledgerConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &ledgerConn{Conn: conn, ledger: c.ledger}, nil
}

// Close closes what the wrapped connector holds (SQLite's readers).
func (c ledgerConnector) Close() error {
	if closer, ok := c.Connector.(io.Closer); ok {
		return closer.Close()
	}
	return nil
}

// ledgerConn is a connection that counts its transactions and statements.
// database/sql uses a connection from one goroutine at a time.
type ledgerConn struct {
	driver.Conn
	ledger *commitLedger
	// tx is the transaction open on the connection, nil outside one.
	tx *ledgerUnit
}

// BeginTx begins a transaction and notes where.
func (c *ledgerConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	c.tx = &ledgerUnit{place: placeOf()}
	return &ledgerTx{Tx: tx, conn: c}, nil
}

// unit returns the transaction a statement runs in: the open one, or a
// new one of its own.
func (c *ledgerConn) unit() *ledgerUnit {
	if c.tx != nil {
		return c.tx
	}
	return &ledgerUnit{place: placeOf(), autocommit: true}
}

// ExecContext runs a statement and counts it.
func (c *ledgerConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	u := c.unit()
	result, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	var rows int64
	if err == nil && result != nil {
		rows, _ = result.RowsAffected()
	}
	u.noteStatement(query, rows)
	if u.autocommit {
		c.ledger.add(u, err == nil)
	}
	return result, err
}

// QueryContext runs a query and counts it, and the rows read from it.
func (c *ledgerConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	u := c.unit()
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	writes := u.noteStatement(query, 0)
	if err != nil {
		if u.autocommit {
			c.ledger.add(u, false)
		}
		return nil, err
	}
	return &ledgerRows{Rows: rows, unit: u, writes: writes, ledger: c.ledger}, nil
}

// PrepareContext prepares a statement (not counted: every statement of
// the App runs through ExecContext or QueryContext).
func (c *ledgerConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	return c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
}

// Ping passes on, where the driver pings.
func (c *ledgerConn) Ping(ctx context.Context) error {
	if pinger, ok := c.Conn.(driver.Pinger); ok {
		return pinger.Ping(ctx)
	}
	return nil
}

// ResetSession passes on, where the driver resets sessions.
func (c *ledgerConn) ResetSession(ctx context.Context) error {
	if resetter, ok := c.Conn.(driver.SessionResetter); ok {
		return resetter.ResetSession(ctx)
	}
	return nil
}

// IsValid passes on, where the driver says.
func (c *ledgerConn) IsValid() bool {
	if validator, ok := c.Conn.(driver.Validator); ok {
		return validator.IsValid()
	}
	return true
}

// CheckNamedValue passes on, where the driver converts values itself.
func (c *ledgerConn) CheckNamedValue(value *driver.NamedValue) error {
	if checker, ok := c.Conn.(driver.NamedValueChecker); ok {
		return checker.CheckNamedValue(value)
	}
	return driver.ErrSkip
}

// ledgerTx is a counted transaction.
type ledgerTx struct {
	driver.Tx
	conn *ledgerConn
}

// Commit commits and counts.
func (t *ledgerTx) Commit() error {
	err := t.Tx.Commit()
	t.conn.ledger.add(t.conn.tx, err == nil)
	t.conn.tx = nil
	return err
}

// Rollback rolls back and counts.
func (t *ledgerTx) Rollback() error {
	err := t.Tx.Rollback()
	t.conn.ledger.add(t.conn.tx, false)
	t.conn.tx = nil
	return err
}

// ledgerRows counts the rows read; for a query outside a transaction, it
// counts its transaction when closed.
type ledgerRows struct {
	driver.Rows
	unit *ledgerUnit
	// writes: the query may write (UPDATE ... RETURNING).
	writes bool
	ledger *commitLedger
}

// Next reads a row.
func (r *ledgerRows) Next(dest []driver.Value) error {
	err := r.Rows.Next(dest)
	if err == nil {
		r.unit.noteRows(1, r.writes)
	}
	return err
}

// Close closes the rows.
func (r *ledgerRows) Close() error {
	err := r.Rows.Close()
	if r.unit.autocommit {
		r.ledger.add(r.unit, err == nil)
	}
	return err
}

// openCountedDB opens target as openDB does, on connections that count
// into ledger.
func openCountedDB(ctx context.Context, target string, ledger *commitLedger) (*sql.DB, error) {
	var db *sql.DB
	if isPostgresURL(target) {
		config, err := pgx.ParseConfig(target)
		if err != nil {
			return nil, err
		}
		// As connectPostgres.
		db = sql.OpenDB(ledgerConnector{Connector: rebindConnector{stdlib.GetConnector(*config)}, ledger: ledger})
		db.SetMaxOpenConns(postgresMaxConns)
		db.SetMaxIdleConns(postgresMaxConns)
		db.SetConnMaxIdleTime(time.Minute)
	} else {
		// As openDBWith, at the default durability.
		dsn, err := sqliteDSN(target, durabilityNormal)
		if err != nil {
			return nil, err
		}
		connector, err := sqlite.NewConnector(dsn)
		if err != nil {
			return nil, err
		}
		readers, err := openSQLiteReaders(target)
		if err != nil {
			return nil, err
		}
		db = sql.OpenDB(ledgerConnector{Connector: sqliteConnector{Connector: connector, readers: readers}, ledger: ledger})
		db.SetMaxOpenConns(1)
		db.SetMaxIdleConns(1)
		db.SetConnMaxIdleTime(time.Minute)
	}
	if err := migrate(ctx, db); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// pgStatsSettle is how long the meter waits before it reads
// pg_stat_database: a backend flushes its counters at most once a second,
// and one that went idle within that second keeps them until it has been
// idle for PGSTAT_IDLE_INTERVAL, 10 s (PostgreSQL 15 and later; older
// servers send them to the collector within half a second).
const pgStatsSettle = 11 * time.Second

// databaseCounts are a PostgreSQL database's counters: pg_stat_database's,
// and pg_stat_statements' calls where that extension is loaded.
type databaseCounts struct {
	commits, rollbacks, inserted, updated, deleted int64
	// statements is the sum of pg_stat_statements' calls in the database,
	// if hasStatements.
	statements    int64
	hasStatements bool
}

// readDatabaseCounts reads the counters of db's database, after asking the
// server to flush those of db's own session.
func readDatabaseCounts(ctx context.Context, db *sql.DB) (databaseCounts, error) {
	var version int
	if err := db.QueryRowContext(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
		return databaseCounts{}, err
	}
	if version >= 150000 {
		if _, err := db.ExecContext(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			return databaseCounts{}, err
		}
	}
	var c databaseCounts
	err := db.QueryRowContext(ctx, `
		SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted
		FROM pg_stat_database WHERE datname = current_database()`).
		Scan(&c.commits, &c.rollbacks, &c.inserted, &c.updated, &c.deleted)
	if err != nil {
		return databaseCounts{}, err
	}
	// Fails where the extension is not created (or not in
	// shared_preload_libraries): then there is no statement count.
	err = db.QueryRowContext(ctx, `
		SELECT COALESCE(SUM(calls), 0)::bigint FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&c.statements)
	c.hasStatements = err == nil
	return c, nil
}

// commitMeter measures what a benchmark's orders cost the database: the
// App's own count (commitLedger) on both databases, and on PostgreSQL the
// server's counters around it.
type commitMeter struct {
	ledger *commitLedger
	before map[commitPlace]placeCount
	// stats reads the server's counters; nil on SQLite.
	stats  *sql.DB
	server databaseCounts
}

// startCommitMeter begins a measurement of what the Apps counting into
// ledger commit on target. On PostgreSQL it first waits for the set-up's
// counters to reach pg_stat_database (pgStatsSettle).
func startCommitMeter(b *testing.B, target string, ledger *commitLedger) *commitMeter {
	b.Helper()
	m := &commitMeter{ledger: ledger}
	if isPostgresURL(target) {
		stats, err := connectPostgres(context.Background(), target)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { stats.Close() })
		m.stats = stats
		time.Sleep(pgStatsSettle)
		if m.server, err = readDatabaseCounts(context.Background(), stats); err != nil {
			b.Fatal(err)
		}
	}
	m.before = ledger.snapshot()
	return m
}

// report reports the counts per order since the meter started, and logs
// where the commits went. benchmarkCommits are the benchmark's own
// transactions on the database (its watcher's polls), left out of
// commits/order.
//
// commits/order is the server's count on PostgreSQL (pg_stat_database,
// less the benchmark's own and the Apps' idle polls while the counters
// settle), the App's own on SQLite; app-commits/order the App's own on
// both, so the two can be compared; writing-commits/order those of the
// App's that changed a row (the ones that flush WAL), empty-commits/order
// those that returned and changed no row; rows-written/order is
// pg_stat_database's inserted + updated + deleted; statements/order is
// pg_stat_statements' count where that extension is loaded, and
// app-statements/order the App's own count.
func (m *commitMeter) report(b *testing.B, orders int, benchmarkCommits int64) {
	b.Helper()
	end := m.ledger.snapshot()
	counts := since(end, m.before)
	var app ledgerTotals
	for _, c := range counts {
		app.commits += c.commits
		app.wrote += c.wrote
		app.empty += c.empty
		for _, n := range c.statements {
			app.statements += n
		}
	}
	perOrder := func(n int64) float64 { return float64(n) / float64(orders) }
	if m.stats == nil {
		b.ReportMetric(perOrder(app.commits), "commits/order")
		b.ReportMetric(perOrder(app.wrote), "writing-commits/order")
	} else {
		committedAtEnd := m.ledger.totals().commits
		time.Sleep(pgStatsSettle)
		after, err := readDatabaseCounts(context.Background(), m.stats)
		if err != nil {
			b.Fatal(err)
		}
		settling := m.ledger.totals().commits - committedAtEnd
		server := after.commits - m.server.commits - benchmarkCommits - settling
		b.ReportMetric(perOrder(server), "commits/order")
		b.ReportMetric(perOrder(app.commits), "app-commits/order")
		b.ReportMetric(perOrder(app.wrote), "writing-commits/order")
		b.ReportMetric(perOrder(after.inserted+after.updated+after.deleted-m.server.inserted-m.server.updated-m.server.deleted), "rows-written/order")
		b.ReportMetric(perOrder(benchmarkCommits), "watcher-commits/order")
		if after.hasStatements && m.server.hasStatements {
			b.ReportMetric(perOrder(after.statements-m.server.statements), "statements/order")
		}
		b.Logf("pg_stat_database per order: %.2f commits (%.2f of them the benchmark's watcher, %.2f idle polls while the counters settled), %.2f rollbacks, %.2f rows inserted, %.2f updated, %.2f deleted",
			perOrder(after.commits-m.server.commits), perOrder(benchmarkCommits), perOrder(settling), perOrder(after.rollbacks-m.server.rollbacks),
			perOrder(after.inserted-m.server.inserted), perOrder(after.updated-m.server.updated), perOrder(after.deleted-m.server.deleted))
	}
	b.ReportMetric(perOrder(app.empty), "empty-commits/order")
	b.ReportMetric(perOrder(app.statements), "app-statements/order")
	logCommitBreakdown(b, counts, orders)
}

// countedApp returns an App on target whose connections count into the
// ledger it returns, closed when t ends.
func countedApp(t *testing.T, target string) (*App, *commitLedger) {
	t.Helper()
	ledger := newCommitLedger()
	db, err := openCountedDB(context.Background(), target, ledger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return newApp(db, nil, nil, nil), ledger
}

// Ensure the ledger names the loop and the function each commit came from,
// counts a statement outside a transaction as a commit of its own, and
// tells a commit that changed rows from one that found nothing.
func TestCommitLedgerCountsWhereCommitsGo(t *testing.T) {
	ctx := context.Background()
	app, ledger := countedApp(t, testDatabase(t))
	if _, err := app.createOrder(ctx, benchRequest("ledger-", 1), benchOrder); err != nil {
		t.Fatal(err)
	}
	before := ledger.snapshot()
	for range 2 { // the second pass finds nothing
		if _, err := app.relayOnce(ctx, "ledger-relay", relayBatchSize); err != nil {
			t.Fatal(err)
		}
	}
	counts := since(ledger.snapshot(), before)
	// The first pass takes the relay lease; the second holds it still and
	// asks nothing.
	lease := counts[commitPlace{loop: "relay", site: "(*App).holdRelayLease"}]
	if lease.commits != 1 || lease.wrote != 1 || lease.autocommits != 1 {
		t.Errorf("lease: got %d commits, %d wrote, %d outside a transaction; want 1, 1, 1", lease.commits, lease.wrote, lease.autocommits)
	}
	claim := counts[commitPlace{loop: "relay", site: "(*App).claimOutboxEvents"}]
	if claim.commits != 2 || claim.wrote != 0 || claim.empty != 1 || claim.autocommits != 2 {
		t.Errorf("claims: got %d commits, %d wrote, %d found nothing, %d outside a transaction; want 2, 0, 1, 2",
			claim.commits, claim.wrote, claim.empty, claim.autocommits)
	}
	mark := counts[commitPlace{loop: "relay", site: "(*App).markPublished"}]
	if mark.commits != 1 || mark.wrote != 1 || mark.autocommits != 1 {
		t.Errorf("marks: got %d commits, %d wrote, %d outside a transaction; want 1, 1, 1", mark.commits, mark.wrote, mark.autocommits)
	}
	for place := range counts {
		if place.loop != "relay" {
			t.Errorf("got a commit at %v; want only the relay's", place)
		}
	}
}

// Ensure a fresh create on PostgreSQL commits one transaction: the look for
// a settled key and the SKU check run in it, not each in a transaction of
// its own before it. A retry still replays, and an unknown SKU is still
// refused.
func TestPostgresCreateIsOneTransaction(t *testing.T) {
	if !onPostgres() {
		t.Skip("SQLite reads the key and the SKUs on a read connection first")
	}
	target := testDatabase(t)
	app, ledger := countedApp(t, target)
	ts := serveInProcess(t, app, target, false)
	client := benchClient(1)
	commitsOf := func(key, body string) (int, string, int64) {
		t.Helper()
		before := ledger.snapshot()
		status, answer, err := postOrder(client, ts.URL, key, body)
		if err != nil {
			t.Fatal(err)
		}
		var commits int64
		for _, count := range since(ledger.snapshot(), before) {
			commits += count.commits
		}
		return status, string(answer), commits
	}
	status, created, commits := commitsOf("one-tx", orderBody(5000, "sku-1", 1, pmCardVisa))
	if status != 201 || commits != 1 {
		t.Fatalf("fresh create: got %d in %d commits; want 201 in 1", status, commits)
	}
	status, replayed, commits := commitsOf("one-tx", orderBody(5000, "sku-1", 1, pmCardVisa))
	if status != 201 || replayed != created || commits != 1 {
		t.Fatalf("retry: got %d %s in %d commits; want the same 201 in 1", status, replayed, commits)
	}
	status, refused, _ := commitsOf("no-such-sku", orderBody(5000, "sku-none", 1, pmCardVisa))
	if status != 400 || !strings.Contains(refused, `unknown sku \"sku-none\"`) {
		t.Fatalf("unknown SKU: got %d %s; want 400 naming it", status, refused)
	}
}

// Ensure the saga loop, after a pass, waits for the next signal instead of
// claiming again at once: the pass ended after a round whose claim found
// no saga due, so that claim would find nothing too (a transaction of its
// own on PostgreSQL).
func TestSagaLoopWaitsAfterAPass(t *testing.T) {
	ctx := context.Background()
	target := testDatabase(t)
	app, ledger := countedApp(t, target)
	if err := app.subscribeConsumers(ctx); err != nil {
		t.Fatal(err)
	}
	// Only a signal moves a loop on.
	app.idle = idleTimes{relay: time.Hour, worker: time.Hour}
	ts := serveInProcess(t, app, target, true)
	createPaidOrder(t, benchClient(1), ts.URL, watchFinal(t, target), "one-pass")
	rounds := ledger.snapshot()[commitPlace{loop: "saga", site: "(*App).sagaRound"}]
	// The loop's first pass, at start, claimed nothing; the pass the
	// order's saga started claimed it and ran its three steps, one round
	// each, the last claim finding nothing more. Another pass would be
	// another round that finds nothing.
	if rounds.commits != 4 || rounds.empty != 1 {
		t.Fatalf("got %d saga rounds, %d of them finding nothing; want 4, 1: the one at start", rounds.commits, rounds.empty)
	}
}

// Ensure charges under different keys, made side by side (as a saga round
// makes them on PostgreSQL), do not fail each other: each commits the
// first time, with none rolled back to run again.
func TestChargesSideBySideDoNotFailEachOther(t *testing.T) {
	ctx := context.Background()
	app, ledger := countedApp(t, testDatabase(t))
	const callers, charges = 8, 10
	var wg sync.WaitGroup
	errs := make([]error, callers)
	for c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range charges {
				_, err := app.processor.charge(ctx, chargeRequest{
					IdempotencyKey: fmt.Sprintf("saga_%d_%d:charge_card", c, i),
					OrderID:        fmt.Sprintf("ord_%d_%d", c, i),
					AmountCents:    5000, Currency: "usd", PaymentMethod: pmCardVisa,
				})
				if err != nil {
					errs[c] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	got := ledger.snapshot()[commitPlace{loop: "other", site: "(*Processor).charge"}]
	if got.commits != callers*charges || got.rollbacks != 0 {
		t.Fatalf("got %d charges committed, %d rolled back; want %d, 0", got.commits, got.rollbacks, callers*charges)
	}
}

// Ensure a consumer's batch runs its messages without savepoints while
// none fails, and that one failing message, once the batch runs again with
// a savepoint around each, undoes only its own writes, is counted once,
// and does not run a second time, while the others apply once.
func TestBatchesTakeSavepointsOnlyWhenAnItemFails(t *testing.T) {
	ctx := context.Background()
	app, ledger := countedApp(t, testDatabase(t))
	env := &testEnv{app: app}
	if err := app.broker.subscribe(ctx, "batch", "Ping"); err != nil {
		t.Fatal(err)
	}
	apply, applied := countingEffect(t, env, "batch")
	calls := map[string]int{}
	c := consumer{name: "batch", subjects: []string{"Ping"}, apply: func(ctx context.Context, tx *sql.Tx, msg message) error {
		calls[msg.ID]++
		if err := apply(tx); err != nil {
			return err
		}
		if msg.ID == "msg-5" {
			return errors.New("stock service unavailable")
		}
		return nil
	}}
	savepoints := func(from map[commitPlace]placeCount) (n int64) {
		for _, count := range from {
			for statement, times := range count.statements {
				if strings.HasPrefix(statement, "SAVEPOINT") {
					n += times
				}
			}
		}
		return n
	}
	for _, ids := range [][]string{{"msg-1", "msg-2", "msg-3"}, {"msg-4", "msg-5", "msg-6"}} {
		var batch []message
		for _, id := range ids {
			batch = append(batch, message{ID: id, Subject: "Ping", Payload: []byte(`{}`)})
		}
		if err := app.broker.publishBatch(ctx, batch); err != nil {
			t.Fatal(err)
		}
		before := ledger.snapshot()
		results, err := app.consumeOnce(ctx, c, 10)
		if err != nil {
			t.Fatal(err)
		}
		taken := savepoints(since(ledger.snapshot(), before))
		if ids[0] == "msg-1" {
			if taken != 0 || len(results) != 3 {
				t.Fatalf("a batch that did not fail: got %d results and %d savepoints committed; want 3 and none", len(results), taken)
			}
			continue
		}
		if taken != 2 {
			t.Errorf("a batch with a failing message: got %d savepoints committed; want one per message that ran again, 2", taken)
		}
		got := fmt.Sprint(results[0].Outcome, results[1].Outcome, results[2].Outcome)
		if want := fmt.Sprint(inboxApplied, inboxRetry, inboxApplied); got != want {
			t.Errorf("got outcomes %s; want %s", got, want)
		}
	}
	if got := applied(); got != 5 {
		t.Errorf("the effect counted %d; want 5 (msg-5's write undone, no message applied twice)", got)
	}
	if calls["msg-5"] != 1 || calls["msg-4"] != 2 {
		t.Errorf("msg-5 ran %d times, msg-4 %d; want once (its failure is decided once) and twice (the batch ran again)", calls["msg-5"], calls["msg-4"])
	}
	if got := env.count(t, `SELECT failures FROM inbox_failures WHERE consumer = 'batch' AND message_id = 'msg-5'`); got != 1 {
		t.Errorf("counted %d failures of msg-5; want 1", got)
	}
}

// Ensure a saga pass claims in its first round, and in a later one only
// if a saga was started since: a lone saga's three rounds make one claim,
// not three.
func TestSagaPassClaimsWhenASagaStarted(t *testing.T) {
	ctx := context.Background()
	app, ledger := countedApp(t, testDatabase(t))
	if err := app.subscribeConsumers(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := app.createOrder(ctx, benchRequest("claims-", 1), benchOrder); err != nil {
		t.Fatal(err)
	}
	if _, err := app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
		t.Fatal(err)
	}
	for _, c := range app.consumers() {
		if _, err := app.consumeOnce(ctx, c, 10); err != nil {
			t.Fatal(err)
		}
	}
	claims := func() (n int64) {
		for _, count := range ledger.snapshot() {
			for statement, times := range count.statements {
				if strings.HasPrefix(statement, "SELECT saga_id, lease_token FROM saga_instances") {
					n += times
				}
			}
		}
		return n
	}
	before := claims()
	if _, err := app.sagaOnce(ctx, "worker", sagaBatchSize); err != nil {
		t.Fatal(err)
	}
	if got := claims() - before; got != 1 {
		t.Errorf("a pass of one saga claimed %d times; want once", got)
	}
	var status string
	if err := app.db.QueryRow(`SELECT status FROM saga_instances`).Scan(&status); err != nil || status != string(sagaCompleted) {
		t.Fatalf("saga %s, %v; want completed in one pass", status, err)
	}
}

// TestSagaPassTakesWhatItLeftBehind: a pass whose claim took as many sagas
// as it had room for claims again once room frees, without a signal: a
// backlog started before the pass is run in that pass, not one pass's
// worth at each idle wait of the saga loop (at 64 a pass, half the settled
// orders per second of a backlog on PostgreSQL).
func TestSagaPassTakesWhatItLeftBehind(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	app := env.app
	if err := app.subscribeConsumers(ctx); err != nil {
		t.Fatal(err)
	}
	const orders = 5
	for i := range orders {
		if _, err := app.createOrder(ctx, benchRequest("left-behind-", i), benchOrder); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := app.relayOnce(ctx, "relay", relayBatchSize); err != nil {
		t.Fatal(err)
	}
	for _, c := range app.consumers() {
		if _, err := app.consumeOnce(ctx, c, orders); err != nil {
			t.Fatal(err)
		}
	}
	claimed, err := app.sagaOnce(ctx, "worker", 2)
	if err != nil {
		t.Fatal(err)
	}
	var completed int
	if err := app.db.QueryRow(`SELECT COUNT(*) FROM saga_instances WHERE status = ?`, sagaCompleted).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if claimed != orders || completed != orders {
		t.Errorf("a pass of 2 sagas at a time over %d due claimed %d and completed %d; want all %d", orders, claimed, completed, orders)
	}
}
