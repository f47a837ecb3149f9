package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// buildBinary builds the retrysafe binary into a temporary directory, for
// tests that run it as separate processes.
func buildBinary(tb testing.TB) string {
	tb.Helper()
	// go test puts the bin directory of its own Go first on PATH, so this
	// is the Go that built the test; a test binary run by hand needs go
	// on PATH.
	goTool, err := exec.LookPath("go")
	if err != nil {
		tb.Fatalf("no go command on PATH to build retrysafe with: %v", err)
	}
	binary := filepath.Join(tb.TempDir(), "retrysafe")
	build := exec.Command(goTool, "build", "-o", binary, ".")
	if out, err := build.CombinedOutput(); err != nil {
		tb.Fatalf("go build: %v\n%s", err, out)
	}
	return binary
}

// checkAfterChaos runs 'retrysafe check' on a chaos run's database. The
// run sends forged and unknown-charge webhooks on purpose; the server keeps
// them as poison for an operator, which check lists. Those, and only those,
// are expected; any other line of check's output fails.
func checkAfterChaos(binary, db string) ([]byte, error) {
	out, err := exec.Command(binary, "check", "--db", db).CombinedOutput()
	if err == nil {
		return out, nil
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		expected := strings.HasPrefix(line, "VIOLATION once quiet, no message is poison: "+webhookConsumer+" gave up on evt_forged_") ||
			strings.HasPrefix(line, "VIOLATION once quiet, no message is poison: "+webhookConsumer+" gave up on evt_unknown_") ||
			(strings.HasPrefix(line, "Error: ") && strings.Contains(line, " violations of "))
		if !expected {
			return out, err
		}
	}
	return out, nil
}

// soakDuration returns RETRYSAFE_SOAK, or 0 if it is not set.
func soakDuration(tb testing.TB) time.Duration {
	tb.Helper()
	value := os.Getenv("RETRYSAFE_SOAK")
	if value == "" {
		return 0
	}
	soak, err := time.ParseDuration(value)
	if err != nil {
		tb.Fatalf("RETRYSAFE_SOAK=%q: %v", value, err)
	}
	return soak
}

// withSoakFaults adds to cfg the faults only the soak has time for: pauses
// past every lease, a database outage longer than MaxDeliver x AckWait, a
// clock jump past the key TTL (with expired keys reused), a worker whose
// clock runs ahead, and a broker that loses messages it acknowledged (the
// reconciler republishes them). Each of them stalls the load for seconds.
func withSoakFaults(cfg chaosConfig) chaosConfig {
	cfg.Pauses = 8
	cfg.Outages = 1
	cfg.ClockJumps = 1
	cfg.ClockSkew = 3 * time.Second
	cfg.BrokerLosses = 10
	return cfg
}

// Ensure that with serve, relay and worker as separate processes on one
// database (SQLite, or PostgreSQL with RETRYSAFE_TEST_POSTGRES), concurrent
// retrying clients (refunds in parts and at once, webhooks with edge
// amounts, bodies with case-variant duplicate keys, one key sent to a
// create and a refund at once) and processes SIGKILLed at random, every
// answer a client got agrees with the database, nothing is charged twice,
// no stock is lost or leaked, every saga ends, no client ever gets a 500,
// and 'retrysafe check' passes.
//
// By default it makes one short run (400 orders, 8 kills: a few seconds),
// enough to see a process killed mid-request and the system recover.
// RETRYSAFE_SOAK=10m (CI sets 2m) repeats longer runs with new seeds for
// that long, with processes also paused past their leases, a database
// outage and a clock jump past the key TTL in every run.
func TestTorture(t *testing.T) {
	if testing.Short() {
		t.Skip("the torture test runs processes for about a minute; skipped with -short")
	}
	soak := soakDuration(t)
	binary := buildBinary(t)
	deadline := time.Now().Add(soak)
	for seed := uint64(1); ; seed++ {
		cfg := chaosConfig{
			Binary:   binary,
			DBPath:   testDatabase(t),
			LogPath:  filepath.Join(t.TempDir(), fmt.Sprintf("chaos-%d.log", seed)),
			Orders:   400,
			Clients:  8,
			Kills:    8,
			Seed:     seed,
			Duration: 4 * time.Minute,
			Serves:   1,
			Relays:   1,
			Workers:  1,
		}
		if soak > 0 {
			cfg = withSoakFaults(cfg)
			cfg.Orders, cfg.Clients, cfg.Kills = 1500, 16, 25
		}
		report, err := runChaos(context.Background(), cfg)
		var table bytes.Buffer
		printChaosReport(&table, report)
		t.Logf("seed %d:%s", seed, table.String())
		if err != nil {
			t.Fatalf("seed %d: %v (process logs in %s)", seed, err, cfg.LogPath)
		}
		if report.failed() {
			t.Fatalf("seed %d: violations, see above (process logs in %s)", seed, cfg.LogPath)
		}
		if report.Kills != cfg.Kills || report.Created != cfg.Orders {
			t.Fatalf("seed %d: %d kills and %d orders, want %d and %d", seed, report.Kills, report.Created, cfg.Kills, cfg.Orders)
		}
		if out, err := checkAfterChaos(binary, cfg.DBPath); err != nil {
			t.Fatalf("seed %d: retrysafe check: %v\n%s", seed, err, out)
		}
		if time.Now().After(deadline) {
			return
		}
	}
}

// natsClusterNemeses are the cases of the scale-out torture on a NATS
// cluster: one nemesis each, injected twice in a run. The leader kills
// come with messages the stream loses (JetStream's delete-message API on
// a stream of three replicas), which the reconciler must republish.
var natsClusterNemeses = []struct {
	name string
	set  func(cfg *chaosConfig)
}{
	{"leader-kill-and-loss", func(cfg *chaosConfig) { cfg.NATSLeaderKills, cfg.BrokerLosses = 2, 5 }},
	{"leader-pause", func(cfg *chaosConfig) { cfg.NATSLeaderPauses = 2 }},
	{"truncated-restart", func(cfg *chaosConfig) { cfg.NATSTruncations = 2 }},
	{"full-restart", func(cfg *chaosConfig) { cfg.NATSFullRestarts = 2 }},
}

// Ensure the same holds with three serve, two relay and two worker
// processes sharing one database, on the embedded broker and, when
// RETRYSAFE_TEST_NATS is set, on NATS JetStream. With
// RETRYSAFE_TEST_POSTGRES set the database is PostgreSQL. With
// RETRYSAFE_SOAK set, processes are also paused, the database goes away
// for longer than MaxDeliver x AckWait and every clock jumps; on NATS the
// run then uses a nats-server of its own, which it restarts.
//
// It runs only with RETRYSAFE_SOAK set (CI sets it): seven processes take
// most of a minute, too long for the default go test ./... . TestTorture
// kills processes in every run.
//
// With RETRYSAFE_TEST_NATS_CLUSTER naming a nats-server binary, it also
// runs (with or without RETRYSAFE_SOAK) on a three-node JetStream cluster
// of its own (the stream at three replicas, sync_interval: always), once
// per cluster nemesis: the stream's leader SIGKILLed (with messages the
// stream loses), paused past the election timeout, a follower restarted
// with its files truncated, all three SIGKILLed at once (chaos_nats.go).
func TestTortureScaleOut(t *testing.T) {
	if testing.Short() {
		t.Skip("the torture test runs processes for about a minute; skipped with -short")
	}
	soak := soakDuration(t)
	natsCluster := os.Getenv("RETRYSAFE_TEST_NATS_CLUSTER")
	if soak == 0 && natsCluster == "" {
		t.Skip("seven processes for most of a minute: set RETRYSAFE_SOAK (for example 1s, one run) to run it, or RETRYSAFE_TEST_NATS_CLUSTER for the NATS cluster cases; CI does")
	}
	var brokers []string
	if soak > 0 {
		brokers = append(brokers, "embedded")
		if natsURL := os.Getenv("RETRYSAFE_TEST_NATS"); natsURL != "" {
			brokers = append(brokers, natsURL)
		} else {
			t.Log("RETRYSAFE_TEST_NATS is not set: the run on NATS JetStream is skipped")
		}
	}
	if natsCluster == "" {
		t.Log("RETRYSAFE_TEST_NATS_CLUSTER is not set: the runs on a NATS cluster are skipped")
	}
	binary := buildBinary(t)
	if natsCluster != "" {
		for _, nemesis := range natsClusterNemeses {
			t.Run("nats-cluster/"+nemesis.name, func(t *testing.T) {
				cfg := chaosConfig{
					Binary:      binary,
					DBPath:      testDatabase(t),
					LogPath:     filepath.Join(t.TempDir(), "chaos.log"),
					Orders:      600,
					Clients:     16,
					Kills:       5,
					Seed:        7,
					Duration:    4 * time.Minute,
					Serves:      3,
					Relays:      2,
					Workers:     2,
					NATSServer:  natsCluster,
					NATSCluster: true,
				}
				nemesis.set(&cfg)
				runTortureScaleOut(t, binary, cfg)
			})
		}
	}
	for _, broker := range brokers {
		name := "embedded"
		if broker != "embedded" {
			name = "nats"
		}
		t.Run(name, func(t *testing.T) {
			cfg := chaosConfig{
				Binary:   binary,
				DBPath:   testDatabase(t),
				LogPath:  filepath.Join(t.TempDir(), "chaos.log"),
				Orders:   1200,
				Clients:  16,
				Kills:    15,
				Seed:     42,
				Duration: 4 * time.Minute,
				Serves:   3,
				Relays:   2,
				Workers:  2,
			}
			if broker != "embedded" {
				cfg.BrokerURL = broker
			}
			if soak > 0 {
				cfg = withSoakFaults(cfg)
				cfg.Orders = 1000
				if natsServer, err := testNATSServerBinary(); err == nil && broker != "embedded" {
					// Never the shared server: one the run may restart.
					cfg.BrokerURL, cfg.NATSServer = "", natsServer
				}
			}
			runTortureScaleOut(t, binary, cfg)
		})
	}
}

// runTortureScaleOut runs one scale-out chaos run and fails t unless it
// made every fault it was asked for, created every order, found no
// violation, and 'retrysafe check' passes afterwards.
func runTortureScaleOut(t *testing.T, binary string, cfg chaosConfig) {
	t.Helper()
	report, err := runChaos(context.Background(), cfg)
	var table bytes.Buffer
	printChaosReport(&table, report)
	t.Logf("%s", table.String())
	wantNATS := natsClusterFaults{LeaderKills: cfg.NATSLeaderKills, LeaderPauses: cfg.NATSLeaderPauses,
		Truncations: cfg.NATSTruncations, FullRestarts: cfg.NATSFullRestarts}
	gotNATS := report.Faults.NATS
	gotNATS.BytesTruncated, gotNATS.LongestRecovery = 0, 0
	if err != nil || report.failed() || report.Kills != cfg.Kills || report.Created != cfg.Orders || gotNATS != wantNATS {
		// The run's directory goes with the test: keep its log,
		// and say where each unfinished order's messages are.
		kept := keepLog(t, cfg.LogPath)
		t.Logf("what the unfinished orders left behind:\n%s", unfinishedOrders(cfg.DBPath))
		if err != nil {
			t.Fatalf("%v (process logs kept in %s)", err, kept)
		}
		t.Fatalf("violations, or %d kills, %d orders and NATS faults %+v (want %d, %d and %+v); process logs kept in %s",
			report.Kills, report.Created, gotNATS, cfg.Kills, cfg.Orders, wantNATS, kept)
	}
	if out, err := checkAfterChaos(binary, cfg.DBPath); err != nil {
		t.Fatalf("retrysafe check: %v\n%s", err, out)
	}
}

// keepLog copies a failed run's process log out of the test's directory,
// which is removed when the test ends, and returns where it went.
func keepLog(t *testing.T, path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("%s (could not read it: %v)", path, err)
	}
	kept := filepath.Join(os.TempDir(), fmt.Sprintf("retrysafe-%s-%d.log", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().Unix()))
	if err := os.WriteFile(kept, data, 0o644); err != nil {
		return fmt.Sprintf("%s (could not keep it: %v)", path, err)
	}
	return kept
}

// unfinishedOrders describes each order still created, with its saga, its
// outbox events and the inbox rows of its messages: enough to tell a
// message never written, never published, never delivered or never
// applied apart.
func unfinishedOrders(target string) string {
	ctx := context.Background()
	db, err := openReadOnlyDB(ctx, target)
	if err != nil {
		return fmt.Sprintf("could not open %s: %v", target, err)
	}
	defer db.Close()
	var out strings.Builder
	lines := func(query string, args ...any) {
		rows, err := db.QueryContext(ctx, query, args...)
		if err != nil {
			fmt.Fprintf(&out, "    %v\n", err)
			return
		}
		defer rows.Close()
		columns, _ := rows.Columns()
		for rows.Next() {
			values := make([]sql.NullString, len(columns))
			pointers := make([]any, len(columns))
			for i := range values {
				pointers[i] = &values[i]
			}
			if err := rows.Scan(pointers...); err != nil {
				fmt.Fprintf(&out, "    %v\n", err)
				return
			}
			fmt.Fprint(&out, "   ")
			for i, column := range columns {
				fmt.Fprintf(&out, " %s=%s", column, values[i].String)
			}
			fmt.Fprintln(&out)
		}
	}
	rows, err := db.QueryContext(ctx, `SELECT order_id FROM orders WHERE status = 'created' ORDER BY order_id LIMIT 5`)
	if err != nil {
		return err.Error()
	}
	var orders []string
	for rows.Next() {
		var orderID string
		if rows.Scan(&orderID) == nil {
			orders = append(orders, orderID)
		}
	}
	rows.Close()
	for _, orderID := range orders {
		fmt.Fprintf(&out, "  order %s\n", orderID)
		lines(`SELECT saga_id, status, current_step, attempts, last_error, updated_at FROM saga_instances WHERE order_id = ?`, orderID)
		lines(`SELECT seq, event_id, event_type, status, attempts, last_error, created_at, published_at FROM outbox_events WHERE aggregate_id = ? ORDER BY seq`, orderID)
		lines(`SELECT i.consumer, i.message_id, i.status, i.delivery_count, i.processed_at FROM inbox_messages i
			JOIN outbox_events e ON e.event_id = i.message_id WHERE e.aggregate_id = ? ORDER BY i.processed_at`, orderID)
		lines(`SELECT f.consumer, f.message_id, f.failures, f.last_error FROM inbox_failures f
			JOIN outbox_events e ON e.event_id = f.message_id WHERE e.aggregate_id = ?`, orderID)
	}
	if len(orders) == 0 {
		return "  (no order is still created)"
	}
	return out.String()
}

// testNATSServerBinary returns the nats-server binary that
// RETRYSAFE_TEST_NATS_SERVER names (CI's pinned one), or else the one on
// the PATH.
func testNATSServerBinary() (string, error) {
	if binary := os.Getenv("RETRYSAFE_TEST_NATS_SERVER"); binary != "" {
		return binary, nil
	}
	return exec.LookPath("nats-server")
}
