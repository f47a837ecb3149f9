package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// This file measures the inputs of the capacity model (docs/capacity.md):
// what one order costs in CPU time of PostgreSQL, of nats-server and of our
// process, and in WAL bytes; and how fast one stock row takes reservations
// when every order buys the same SKU (BenchmarkHotRow).
//
// CPU time is read from /proc (utime + stime of a process, in clock
// ticks), so these metrics are reported on Linux only, and only for a
// PostgreSQL or NATS server on this machine. Everything else running on
// the machine is reported too (other-cpu-cores), because on a shared
// machine throughput says more about the neighbours than about the code.

// clockTicks is Linux's USER_HZ, the unit of /proc's CPU times: 100 on
// every architecture Go supports (sysconf(_SC_CLK_TCK)).
const clockTicks = 100

// processCPU returns the CPU time, user and system, that process pid has
// used so far. It fails where /proc is missing or the process is gone.
func processCPU(pid int) (time.Duration, error) {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return cpuOfStat(stat)
}

// cpuOfStat returns utime + stime from the text of a /proc/<pid>/stat.
func cpuOfStat(stat []byte) (time.Duration, error) {
	// The command, field 2, is in parentheses and may hold spaces; utime
	// and stime are fields 14 and 15, the 12th and 13th after it.
	end := bytes.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, fmt.Errorf("stat: no command")
	}
	fields := strings.Fields(string(stat[end+1:]))
	if len(fields) < 13 {
		return 0, fmt.Errorf("stat: %d fields after the command", len(fields))
	}
	utime, err := strconv.ParseInt(fields[11], 10, 64)
	if err != nil {
		return 0, err
	}
	stime, err := strconv.ParseInt(fields[12], 10, 64)
	if err != nil {
		return 0, err
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}

// machineBusy returns the CPU time the whole machine has spent not idle
// (every field of /proc/stat's cpu line but idle and iowait).
func machineBusy() (time.Duration, error) {
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	fields := strings.Fields(line)
	if len(fields) < 8 || fields[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var busy int64
	// user nice system idle iowait irq softirq steal (guest time is
	// already in user).
	for i, field := range fields[1:min(len(fields), 9)] {
		ticks, err := strconv.ParseInt(field, 10, 64)
		if err != nil {
			return 0, err
		}
		if i != 3 && i != 4 {
			busy += ticks
		}
	}
	return time.Duration(busy) * time.Second / clockTicks, nil
}

// natsServerPID returns the pid of the nats-server at natsURL, on this
// machine: the one process named nats-server that listens on the URL's
// port (or the only one, where its sockets cannot be read), or
// RETRYSAFE_BENCH_NATS_PID. ok is false when there is none to measure.
func natsServerPID(natsURL string) (pid int, ok bool) {
	if given := os.Getenv("RETRYSAFE_BENCH_NATS_PID"); given != "" {
		pid, err := strconv.Atoi(given)
		return pid, err == nil
	}
	var servers []int
	comms, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, comm := range comms {
		name, err := os.ReadFile(comm)
		if err != nil || strings.TrimSpace(string(name)) != "nats-server" {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(comm)))
		servers = append(servers, pid)
	}
	port := "4222"
	if u, err := url.Parse(natsURL); err == nil && u.Port() != "" {
		port = u.Port()
	}
	listening := listeningSockets(port)
	for _, server := range servers {
		fds, _ := filepath.Glob("/proc/" + strconv.Itoa(server) + "/fd/*")
		for _, fd := range fds {
			if target, err := os.Readlink(fd); err == nil && listening[target] {
				return server, true
			}
		}
	}
	if len(servers) == 1 {
		return servers[0], true
	}
	return 0, false
}

// listeningSockets returns the sockets ("socket:[inode]", as /proc/<pid>/fd
// links name them) that listen on TCP port on this machine.
func listeningSockets(port string) map[string]bool {
	sockets := map[string]bool{}
	number, err := strconv.Atoi(port)
	if err != nil {
		return sockets
	}
	hexPort := fmt.Sprintf(":%04X", number)
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		text, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(text), "\n")[1:] {
			// sl local_address rem_address st ... inode (the 10th field)
			fields := strings.Fields(line)
			if len(fields) >= 10 && strings.HasSuffix(fields[1], hexPort) && fields[3] == "0A" {
				sockets["socket:["+fields[9]+"]"] = true
			}
		}
	}
	return sockets
}

// costMeter measures, over a benchmark's timed part, the CPU time of the
// PostgreSQL backends serving the benchmark's database (the benchmark's
// own watcher excepted), of nats-server and of this process, the WAL that
// PostgreSQL wrote, and the CPU that everything else on the machine used.
type costMeter struct {
	start time.Time
	// stats is a connection to the benchmark's PostgreSQL database; nil on
	// SQLite, or where the server is not on this machine.
	stats *sql.DB
	// backends is the CPU time of each backend of the database at start;
	// ignored are the benchmark's own (its watcher's).
	backends map[int]time.Duration
	ignored  map[int]bool
	walStart string
	natsPID  int
	nats     time.Duration
	self     time.Duration
	busy     time.Duration
}

// startCostMeter begins a measurement. target is the benchmark's database;
// watcher, the benchmark's own poller, whose backend is left out.
func startCostMeter(b *testing.B, target string, watcher *finalWatcher) *costMeter {
	b.Helper()
	ctx := context.Background()
	m := &costMeter{ignored: map[int]bool{}}
	if _, err := processCPU(os.Getpid()); err != nil {
		b.Logf("no CPU times (%v): the cost metrics are Linux's", err)
		return nil
	}
	if isPostgresURL(target) {
		stats, err := connectPostgres(ctx, target)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { stats.Close() })
		// The watcher polls from one goroutine, so on the one connection
		// that this query leaves idle in its pool.
		var watcherPID int
		if err := watcher.db.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&watcherPID); err != nil {
			b.Fatal(err)
		}
		m.ignored[watcherPID] = true
		backends, err := m.backendCPU(ctx, stats)
		if err != nil {
			b.Fatal(err)
		}
		if len(backends) == 0 {
			b.Logf("no PostgreSQL backend of this database readable in /proc: the server is elsewhere, no pg-cpu-ms/order")
		} else {
			m.stats, m.backends = stats, backends
			if err := stats.QueryRowContext(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&m.walStart); err != nil {
				b.Fatal(err)
			}
		}
	}
	if natsURL := os.Getenv("RETRYSAFE_TEST_NATS"); natsURL != "" {
		if pid, ok := natsServerPID(natsURL); ok {
			if cpu, err := processCPU(pid); err == nil {
				m.natsPID, m.nats = pid, cpu
			}
		}
		if m.natsPID == 0 {
			b.Logf("no nats-server listening at %s found on this machine (set RETRYSAFE_BENCH_NATS_PID): no nats-cpu-ms/order", natsURL)
		}
	}
	m.self, _ = processCPU(os.Getpid())
	m.busy, _ = machineBusy()
	m.start = time.Now()
	return m
}

// backendCPU returns the CPU time so far of every backend connected to the
// database of stats, but stats' own and the ignored ones.
func (m *costMeter) backendCPU(ctx context.Context, stats *sql.DB) (map[int]time.Duration, error) {
	rows, err := stats.QueryContext(ctx, `
		SELECT pid FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()`)
	if err != nil {
		return nil, fmt.Errorf("list backends: %w", err)
	}
	defer rows.Close()
	cpu := map[int]time.Duration{}
	for rows.Next() {
		var pid int
		if err := rows.Scan(&pid); err != nil {
			return nil, err
		}
		if m.ignored[pid] {
			continue
		}
		// A server in a container has pids of its own namespace, which
		// here may name another process or none: only a postgres counts.
		comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
		if err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			continue
		}
		// A backend that ended since the list was read is not counted.
		if used, err := processCPU(pid); err == nil {
			cpu[pid] = used
		}
	}
	return cpu, rows.Err()
}

// report reports the costs per order since the meter started. Call it
// right after b.StopTimer, before anything else runs.
//
// pg-cpu-ms/order is the CPU time of the backends of the benchmark's
// database (a backend that ended during the run is missed, and is logged);
// wal-bytes/order is the WAL of this database's records and transactions
// (databaseWAL, where the WAL can be read here), server-wal-bytes/order
// how far the whole server's WAL position moved, another database's
// writes included; nats-cpu-ms/order
// is nats-server's; app-cpu-ms/order is this test process's, which holds
// the Apps and also the benchmark's clients and watcher, so it is an upper
// bound of what the Apps use; other-cpu-cores is the CPU the rest of the
// machine used meanwhile, in cores (the shared machine's load).
func (m *costMeter) report(b *testing.B, orders int) {
	b.Helper()
	if m == nil {
		return
	}
	ctx := context.Background()
	elapsed := time.Since(m.start)
	self, _ := processCPU(os.Getpid())
	busy, _ := machineBusy()
	perOrder := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(orders) }
	ours := self - m.self
	b.ReportMetric(perOrder(ours), "app-cpu-ms/order")
	if m.natsPID != 0 {
		if nats, err := processCPU(m.natsPID); err == nil {
			ours += nats - m.nats
			b.ReportMetric(perOrder(nats-m.nats), "nats-cpu-ms/order")
		}
	}
	if m.stats != nil {
		backends, err := m.backendCPU(ctx, m.stats)
		if err != nil {
			b.Fatal(err)
		}
		var pg time.Duration
		ended := 0
		for pid, before := range m.backends {
			if now, ok := backends[pid]; ok {
				pg += now - before
			} else {
				ended++
			}
		}
		started := 0
		for pid, now := range backends {
			if _, ok := m.backends[pid]; !ok {
				pg += now
				started++
			}
		}
		ours += pg
		b.ReportMetric(perOrder(pg), "pg-cpu-ms/order")
		var server int64
		var walEnd string
		err = m.stats.QueryRowContext(ctx, `
			SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), ?::pg_lsn)::bigint, pg_current_wal_lsn()::text`,
			m.walStart).Scan(&server, &walEnd)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(server)/float64(orders), "server-wal-bytes/order")
		wal, ok, err := databaseWAL(ctx, m.stats, m.walStart, walEnd)
		if err != nil {
			b.Fatal(err)
		}
		if ok {
			b.ReportMetric(float64(wal)/float64(orders), "wal-bytes/order")
		} else {
			b.Logf("the WAL cannot be read here (pg_waldump, the data directory): no wal-bytes/order of this database, only the whole server's")
		}
		b.Logf("PostgreSQL: %d backends of this database measured, %d began and %d ended during the run (an ended one's CPU is missed)",
			len(backends), started, ended)
	}
	others := busy - m.busy - ours
	b.ReportMetric(others.Seconds()/elapsed.Seconds(), "other-cpu-cores")
	if load, err := os.ReadFile("/proc/loadavg"); err == nil {
		b.Logf("load average at the end: %s", strings.Join(strings.Fields(string(load))[:3], " "))
	}
}

// walRecord matches a line of pg_waldump: the record's total length and
// its transaction id.
var walRecord = regexp.MustCompile(`len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*(\d+),`)

// walRelation matches a block reference of a pg_waldump line; its group
// is the database's oid.
var walRelation = regexp.MustCompile(`rel \d+/(\d+)/\d+`)

// databaseWAL returns how many of the WAL bytes between the positions
// start and end belong to the database of stats: the records that change
// its relations, and every record (commits included) of a transaction that
// changed one. It reads the WAL with pg_waldump, so it needs the server's
// data directory on this machine, readable; ok is false where it is not.
// The whole server's WAL position also moves with other databases' work,
// which on a shared server would be counted as ours.
func databaseWAL(ctx context.Context, stats *sql.DB, start, end string) (walBytes int64, ok bool, err error) {
	var dataDir, oid string
	var version int
	err = stats.QueryRowContext(ctx, `
		SELECT current_setting('data_directory'), current_setting('server_version_num')::int, oid::text
		FROM pg_database WHERE datname = current_database()`).Scan(&dataDir, &version, &oid)
	if err != nil {
		return 0, false, err
	}
	// Both positions are pg_current_wal_lsn's, what has been written to
	// the WAL files: pg_waldump fails on a position inserted but not yet
	// written (another database's asynchronous commit).
	walDir := filepath.Join(dataDir, "pg_wal")
	if _, err := os.ReadDir(walDir); err != nil {
		return 0, false, nil
	}
	waldump, err := exec.LookPath("pg_waldump")
	if err != nil {
		waldump = fmt.Sprintf("/usr/lib/postgresql/%d/bin/pg_waldump", version/10000)
	}
	out, err := exec.CommandContext(ctx, waldump, "--path", walDir, "--start", start, "--end", end).Output()
	if err != nil {
		return 0, false, nil
	}
	return walBytesOf(string(out), oid), true, nil
}

// walBytesOf returns the bytes of the records in dump (pg_waldump's
// output) that belong to the database with oid: those that change one of
// its relations, and every record of a transaction that changed one (its
// commit record names no relation).
func walBytesOf(dump, oid string) int64 {
	type record struct {
		length int64
		xid    string
		ours   bool
	}
	var records []record
	oursByXID := map[string]bool{}
	for _, line := range strings.Split(dump, "\n") {
		m := walRecord.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		length, _ := strconv.ParseInt(m[1], 10, 64)
		r := record{length: length, xid: m[2]}
		for _, rel := range walRelation.FindAllStringSubmatch(line, -1) {
			r.ours = r.ours || rel[1] == oid
		}
		if r.ours && r.xid != "0" {
			oursByXID[r.xid] = true
		}
		records = append(records, r)
	}
	var total int64
	for _, r := range records {
		if r.ours || oursByXID[r.xid] {
			total += r.length
		}
	}
	return total
}

// Ensure a process's CPU time is read from the right fields of its stat,
// even when its command holds spaces and parentheses.
func TestCPUOfStat(t *testing.T) {
	stat := "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 5000 0 3 0 250 75 0 0 20 0 12 0 1234 567890 1234 18446744073709551615\n"
	got, err := cpuOfStat([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	if want := 3250 * time.Millisecond; got != want {
		t.Errorf("got %v; want %v (utime 250 + stime 75 ticks)", got, want)
	}
}

// Ensure the WAL of a database is told from another's: its records, and
// the commit of its transaction, which names no relation; not another
// database's records, nor the server's own.
func TestWALBytesOfOneDatabase(t *testing.T) {
	dump := `rmgr: Heap        len (rec/tot):     79/    79, tx:        760, lsn: 0/0174A0F0, prev 0/0174A0B8, desc: INSERT off 5 flags 0x00, blkref #0: rel 1663/17957/16425 blk 0
rmgr: Btree       len (rec/tot):     64/  8256, tx:        760, lsn: 0/0174A140, prev 0/0174A0F0, desc: INSERT_LEAF off 270, blkref #0: rel 1663/17957/16430 blk 6 FPW
rmgr: Heap        len (rec/tot):    211/   211, tx:        761, lsn: 0/0176A180, prev 0/0174A140, desc: INSERT+INIT off 1 flags 0x00, blkref #0: rel 1663/17284/1247 blk 19
rmgr: Transaction len (rec/tot):     34/    34, tx:        761, lsn: 0/0176A258, prev 0/0176A180, desc: COMMIT 2026-12-02 03:00:00.000000 UTC
rmgr: Transaction len (rec/tot):     46/    46, tx:        760, lsn: 0/0176A280, prev 0/0176A258, desc: COMMIT 2026-12-02 03:00:00.000001 UTC
rmgr: Heap2       len (rec/tot):     59/    59, tx:          0, lsn: 0/0176A2B0, prev 0/0176A280, desc: PRUNE latestRemovedXid 750 nredirected 0 ndead 1, blkref #0: rel 1663/17957/16425 blk 3
rmgr: Standby     len (rec/tot):     50/    50, tx:          0, lsn: 0/0176A2F0, prev 0/0176A2B0, desc: RUNNING_XACTS nextXid 762 latestCompletedXid 761 oldestRunningXid 762
`
	got := walBytesOf(dump, "17957")
	if want := int64(79 + 8256 + 46 + 59); got != want {
		t.Errorf("got %d bytes; want %d (the insert, its index entry with a full page, its commit, the prune)", got, want)
	}
}

// BenchmarkHotRow is the saga's use of the stock alone: each order's
// reservation (reserveStock: a counter UPDATE of the SKU's stock_items row,
// as reserve_stock runs it, without the step's record that is the hold;
// until schema version 14 it also inserted the hold's own row, so runs
// from before then are not comparable), from 8 clients. Its sale writes no stock (since schema version 13 a hold
// is sold when its saga completed; before, since version 11, the sale
// wrote the hold's row, and before that the SKU's row again). sku-1 is the flash sale, every order on one row; skus-16
// spreads them over 16 rows. On PostgreSQL the row's lock is held from
// the UPDATE until the commit has flushed its WAL, so one SKU takes at
// most one reservation per lock hold, whatever the cores; the
// ratio of the two runs is what the hot row costs. On SQLite every write
// transaction takes the one write lock anyway.
func BenchmarkHotRow(b *testing.B) {
	for _, skus := range []int{1, 16} {
		name := "sku-1"
		if skus > 1 {
			name = "skus-" + strconv.Itoa(skus)
		}
		b.Run(name+"/clients-8", func(b *testing.B) {
			ctx := context.Background()
			app := benchApp(b, durabilityNormal)
			orders := make([]orderRow, b.N)
			err := withTx(ctx, app.db, func(tx *sql.Tx) error {
				for k := range skus {
					_, err := tx.ExecContext(ctx, `INSERT INTO stock_items (sku, available, stocked) VALUES (?, ?, ?)`,
						"hot-sku-"+strconv.Itoa(k), b.N, b.N)
					if err != nil {
						return err
					}
				}
				for i := range orders {
					orders[i] = orderRow{OrderID: app.newID("ord"), UserID: "user-42", AmountCents: 5000, Currency: "usd",
						Items:         []orderItem{{SKU: "hot-sku-" + strconv.Itoa(i%skus), Qty: 1}},
						PaymentMethod: pmCardVisa, Status: orderCreated, CreatedAt: formatTime(app.now())}
					if err := insertOrder(ctx, tx, orders[i]); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			runClients(b, 8, func(i int) error {
				order := orders[i-1]
				// withFencedTx, as the saga's steps: READ COMMITTED on
				// PostgreSQL, where SERIALIZABLE (withTx) would fail
				// every UPDATE of the row that another transaction
				// changed since this one began.
				return withFencedTx(ctx, app.db, func(tx *sql.Tx) error {
					return reserveStock(ctx, tx, order)
				})
			})
			b.StopTimer()
			reportOpsPerSecond(b, "orders/s")
			var available int64
			if err := app.db.QueryRow(`SELECT SUM(available) FROM stock_items WHERE sku LIKE 'hot-sku-%'`).Scan(&available); err != nil {
				b.Fatal(err)
			}
			if available != int64(skus-1)*int64(b.N) {
				b.Fatalf("%d of %d reserved, %d left on the shelves", int64(skus)*int64(b.N)-available, b.N, available)
			}
		})
	}
}
