// Chaos: the evidence that the design holds when processes die, stall or
// lose their database at the worst moment. serve, relay and worker run as
// separate processes on one database; concurrent clients create orders
// (some declined, some with the timeout card, some for the last unit of a
// rare SKU), refund them whole or in parts, send webhooks and hostile
// bodies, and retry with the same key on every error; meanwhile processes
// are SIGKILLed, paused past their leases (SIGSTOP), cut off from the
// database, and every clock jumps past the keys' expiry (chaos_faults.go).
// When everything is quiet, the database is audited (see check.go) and
// every answer a client got is checked against it (chaos_workload.go).
//
// The same code runs as 'retrysafe chaos' and as the torture test.

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// chaosLeaseScale shortens every lease of the chaos processes: a killed
// process's claims are taken over after a second or two instead of 30s, so
// a run settles quickly. (The refund lock becomes 4.5s.)
const chaosLeaseScale = 0.05

// chaosConfig is one chaos run.
type chaosConfig struct {
	// Binary is the retrysafe executable to run as serve, relay and worker.
	Binary string
	// DBPath is the database (a SQLite path or a PostgreSQL URL), which
	// must not exist yet or hold no tables.
	DBPath string
	// LogPath receives the processes' output.
	LogPath string
	Orders  int
	Clients int
	Kills   int
	// Seed makes the orders and the kill schedule reproducible.
	Seed uint64
	// Duration bounds the whole run.
	Duration time.Duration
	// Serves, Relays and Workers are how many processes of each to run.
	Serves, Relays, Workers int
	// BrokerURL is a NATS JetStream URL, or empty for the embedded broker.
	BrokerURL string
	// Pauses is how many times a process is SIGSTOPped past its leases.
	Pauses int
	// Outages is how many times the database becomes unavailable for
	// longer than MaxDeliver x AckWait.
	Outages int
	// ClockJumps is how many times every process's clock jumps past
	// idempotencyKeyTTL; clients then reuse expired keys.
	ClockJumps int
	// ClockSkew runs the first worker's clock ahead of the others by this
	// much: it takes leases over before they have passed.
	ClockSkew time.Duration
	// NATSServer is a nats-server binary: the run starts its own server on
	// a free loopback port (and restarts it during outages) instead of
	// using BrokerURL.
	NATSServer string
	// NATSCluster makes NATSServer a three-node JetStream cluster, with
	// sync_interval: always where the server knows it and the stream at
	// three replicas; the NATS nemeses below then count how often each of
	// the cluster's faults is injected (chaos_nats.go).
	NATSCluster                                                          bool
	NATSLeaderKills, NATSLeaderPauses, NATSTruncations, NATSFullRestarts int
	// BrokerLosses is how many acknowledged messages that no consumer
	// has acked yet the broker loses during the load (broker_loss.go).
	BrokerLosses int
	// Repairs is how many set-aside windows the run opens, each followed
	// by an operator running every repair on what it set aside, with the
	// repair processes SIGKILLed and paused (chaos_repairs.go).
	Repairs int
	// Progress receives a progress line, or is nil.
	Progress io.Writer
}

// chaosReport is what a chaos run saw.
type chaosReport struct {
	Orders, Created, Refunded       int
	Requests, Retries, Replays      int64
	ServerErrors, Unavailable       int64
	Kills                           int
	Redeliveries, BrokerDedupes     int
	InboxSkips, ProcessorKeyHits    int
	Paid, Cancelled, RefundedOrders int
	Violations                      []violation
	ClientViolations                []string
	Elapsed                         time.Duration
	Invariants                      int
	Faults                          chaosFaultCounts
	Repairs                         chaosRepairCounts
	// UnavailableDuringOutages and UnavailableOutside split the 503
	// answers; UnavailableWhen lists when the first of the others came.
	UnavailableDuringOutages, UnavailableOutside int
	UnavailableWhen                              string
	ServerErrorsDuringOutages                    int
	ServerErrorsWhen                             string
	// What the clients sent beyond plain creates, and what they got.
	RefundRequests, RefundOK, RefundRefused                                int64
	WebhooksSent, WebhookApplied, WebhookDuplicate, WebhookPoison          int64
	WebhookRejected, HostileBodies, KeyRaces, ReusedCreates, ReusedRefunds int64
	RareSKUSold                                                            int
	// ExpectedPoison counts hostile webhooks kept as poison for an operator.
	ExpectedPoison int
	// OnNATS is set when the run used NATS JetStream, whose dedupes and
	// redeliveries the database does not see.
	OnNATS bool
}

// failed reports whether anything went wrong.
func (r chaosReport) failed() bool {
	return len(r.Violations) > 0 || len(r.ClientViolations) > 0 || r.ServerErrors > 0
}

// chaosOrder is one client's order in the schedule, and what became of it.
type chaosOrder struct {
	orderIntent
	index       int
	key         string
	body        string
	refundPlan  chaosRefundPlan
	webhooks    bool
	keyRace     bool
	hostile     int // index into chaosHostileCreates, or -1
	retryAnyway bool
	apiKey      string
	userID      string
	gotOrderID  string

	mu         sync.Mutex
	refundKeys []chaosRefundKey
	done       bool
	doneAtJump int
}

// chaosUsers are the run's callers: two users, so a key is also checked to
// stay with its owner.
var chaosUsers = []struct{ userID, apiKey string }{
	{"user-42", "sk_chaos_42"},
	{"user-7", "sk_chaos_7"},
}

// chaosProcess is one retrysafe process the run starts, kills and restarts.
type chaosProcess struct {
	name string
	args []string
	env  []string
	log  io.Writer

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	// benched is set while a set-aside window keeps the process stopped.
	benched bool
}

// start starts the process. It returns once the process runs.
func (p *chaosProcess) start(binary string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.benched {
		return nil
	}
	cmd := exec.Command(binary, p.args...)
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Stdout = p.log
	cmd.Stderr = p.log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	p.cmd, p.done = cmd, done
	return nil
}

// current returns the running command, if any, and what closes when it
// exits.
func (p *chaosProcess) current() (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// kill sends SIGKILL, the crash no code can clean up after, and waits for
// the process to be gone.
func (p *chaosProcess) kill() {
	cmd, done := p.current()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-done
}

// stop asks the process to shut down gracefully (SIGTERM) and kills it if
// it has not within 15s.
func (p *chaosProcess) stop() {
	cmd, done := p.current()
	if cmd == nil {
		return
	}
	// A paused process would never see the SIGTERM.
	cmd.Process.Signal(syscall.SIGCONT)
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		p.kill()
	}
}

// freeLoopbackAddr returns a loopback address with a free port.
func freeLoopbackAddr() (string, error) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	addr := listener.Addr().String()
	return addr, listener.Close()
}

// prepareChaosDB creates the run's database with enough stock for every
// order, except the rare SKUs: one unit each, so orders race for the last
// unit and those that lose are cancelled for want of stock.
func prepareChaosDB(ctx context.Context, path string) error {
	if err := requireNewDatabase(ctx, path); err != nil {
		return err
	}
	app, err := openApp(ctx, path, nil, nil, nil)
	if err != nil {
		return err
	}
	defer app.db.Close()
	_, err = app.db.ExecContext(ctx, `
		UPDATE stock_items SET available = 1000000, stocked = 1000000 WHERE sku NOT LIKE 'sku-rare%'`)
	if err != nil {
		return fmt.Errorf("stock the warehouse: %w", err)
	}
	// sku-rare comes with the schema; the others are the run's own.
	for _, sku := range chaosRareSKUs[1:] {
		_, err = app.db.ExecContext(ctx, `
			INSERT INTO stock_items (sku, available, stocked) VALUES (?, 1, 1)`, sku)
		if err != nil {
			return fmt.Errorf("stock %s: %w", sku, err)
		}
	}
	return nil
}

// runChaos runs one chaos run and returns what it saw. It returns an error
// only if the run itself could not be carried out; broken invariants are in
// the report.
func runChaos(ctx context.Context, cfg chaosConfig) (chaosReport, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	report := chaosReport{Orders: cfg.Orders, OnNATS: cfg.BrokerURL != "" || cfg.NATSServer != ""}

	if cfg.NATSServer != "" && cfg.BrokerURL != "" {
		return report, errors.New("--nats-server starts the run's own NATS server: leave --broker out")
	}
	if err := checkBrokerURL(cfg.BrokerURL); err != nil {
		return report, err
	}
	natsNemeses := cfg.NATSLeaderKills + cfg.NATSLeaderPauses + cfg.NATSTruncations + cfg.NATSFullRestarts
	if cfg.NATSCluster && cfg.NATSServer == "" {
		return report, errors.New("--nats-cluster starts a cluster of the run's own: name its binary with --nats-server")
	}
	if natsNemeses > 0 && !cfg.NATSCluster {
		return report, errors.New("the NATS nemeses (--nats-leader-kills, --nats-leader-pauses, --nats-truncations, --nats-full-restarts) need --nats-cluster")
	}
	if err := prepareChaosDB(ctx, cfg.DBPath); err != nil {
		return report, err
	}
	logFile, err := os.Create(cfg.LogPath)
	if err != nil {
		return report, fmt.Errorf("create the process log: %w", err)
	}
	defer logFile.Close()
	log := &lockedWriter{w: logFile}
	stateDir, err := os.MkdirTemp("", "retrysafe-chaos-state-")
	if err != nil {
		return report, err
	}
	defer os.RemoveAll(stateDir)
	clock, err := newChaosClock(stateDir)
	if err != nil {
		return report, err
	}
	leases := scaledLeaseTimes(chaosLeaseScale)

	// The processes' database: on PostgreSQL under a name of the run's own,
	// so an outage cuts off these processes and nobody else on the server.
	processDB := cfg.DBPath
	dbOutage := sqliteOutage(cfg.DBPath)
	if isPostgresURL(cfg.DBPath) {
		applicationName := fmt.Sprintf("retrysafe_chaos_%d_%d", cfg.Seed, time.Now().UnixNano())
		processDB, err = withApplicationName(cfg.DBPath, applicationName)
		if err != nil {
			return report, err
		}
		dbOutage = postgresOutage(cfg.DBPath, applicationName)
	}
	brokerURL := cfg.BrokerURL
	var nats *privateNATS
	var cluster *natsCluster
	switch {
	case cfg.NATSCluster:
		cluster, err = startNATSCluster(ctx, cfg.NATSServer, filepath.Join(stateDir, "nats"), natsClusterReplicas, true, log)
		if err != nil {
			return report, err
		}
		defer cluster.stop()
		brokerURL = cluster.url()
		report.Faults.NATSSyncAlways = cluster.syncAlways
	case cfg.NATSServer != "":
		nats, err = startPrivateNATS(ctx, cfg.NATSServer, stateDir, log)
		if err != nil {
			return report, err
		}
		defer nats.stop()
		brokerURL = nats.url()
	}

	var apiKeys []string
	for _, user := range chaosUsers {
		apiKeys = append(apiKeys, user.userID+":"+user.apiKey)
	}
	const webhookSecret = "whsec_chaos"
	common := []string{"--db", processDB, "--lease-scale=" + strconv.FormatFloat(chaosLeaseScale, 'f', -1, 64), "--clock-file", clock.path}
	stream := ""
	if brokerURL != "" {
		// A stream of this run's own: nothing left in it by another run.
		stream = fmt.Sprintf("CHAOS%d_%d", cfg.Seed, time.Now().UnixNano())
		common = append(common, "--broker", brokerURL, "--nats-stream", stream)
		defer deleteNATSStream(log, brokerURL, stream)
	}
	if cluster != nil {
		// The processes read the servers' sync policy at start and log a
		// warning if it is lazy.
		common = append(common, "--nats-monitor", cluster.monitorURL())
	}
	var processes []*chaosProcess
	var bases []string
	for i := range cfg.Serves {
		addr, err := freeLoopbackAddr()
		if err != nil {
			return report, err
		}
		bases = append(bases, "http://"+addr)
		processes = append(processes, &chaosProcess{name: fmt.Sprintf("serve-%d", i),
			args: append([]string{"serve", "--addr", addr, "--workers=false"}, common...),
			env:  []string{"RETRYSAFE_API_KEYS=" + strings.Join(apiKeys, ","), "RETRYSAFE_WEBHOOK_SECRET=" + webhookSecret}, log: log})
	}
	for i := range cfg.Relays {
		processes = append(processes, &chaosProcess{name: fmt.Sprintf("relay-%d", i), args: append([]string{"relay"}, common...), log: log})
	}
	for i := range cfg.Workers {
		args := append([]string{"worker"}, common...)
		if i == 0 && cfg.ClockSkew != 0 {
			args = append(args, "--clock-skew", cfg.ClockSkew.String())
		}
		processes = append(processes, &chaosProcess{name: fmt.Sprintf("worker-%d", i), args: args, log: log})
	}
	for _, p := range processes {
		if err := p.start(cfg.Binary); err != nil {
			return report, err
		}
	}
	// Set-aside windows replace the relays and workers (all but the
	// serves) by processes that fail where a broken dependency would. The
	// relay publishes to the embedded broker, whose publish the fault
	// reaches, even on NATS: a relay cut off from its broker.
	// Windows alternate: the relays' (failed events), then the workers'
	// (poison messages, refunds the completer gives up on, compensations
	// that fail), so that each has work: a broken relay publishes nothing
	// for a broken worker to fail on.
	relays, workers := processes[cfg.Serves:cfg.Serves+cfg.Relays], processes[cfg.Serves+cfg.Relays:]
	setAsideRelay := &chaosProcess{name: "set-aside-relay", log: log, args: []string{"relay", "--set-aside", "--db", processDB,
		"--lease-scale=" + strconv.FormatFloat(chaosLeaseScale, 'f', -1, 64), "--clock-file", clock.path}}
	setAsideWorker := &chaosProcess{name: "set-aside-worker", log: log, args: append([]string{"worker", "--set-aside"}, common...)}
	defer func() {
		for _, p := range append(processes, setAsideRelay, setAsideWorker) {
			p.stop()
		}
	}()

	client := &http.Client{
		// A paused serve looks like a slow one: the client gives up after
		// this and retries with the same key on the next serve.
		Timeout:   3 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Clients},
	}
	for _, base := range bases {
		if err := waitHealthy(ctx, client, base); err != nil {
			return report, err
		}
	}
	// The processor's dashboard: the run refunds charges there, as a person
	// would, and announces them by webhook.
	dashboard, err := openDB(ctx, cfg.DBPath)
	if err != nil {
		return report, err
	}
	defer dashboard.Close()

	orders := chaosSchedule(cfg)
	run := &chaosRun{
		client:        client,
		patient:       &http.Client{Timeout: 15 * time.Second, Transport: client.Transport},
		bases:         bases,
		c:             &chaosCounters{},
		clock:         clock,
		processor:     newApp(dashboard, clock.now, nil, nil).processor,
		webhookSecret: []byte(webhookSecret),
		start:         start,
	}

	// The clients.
	queue := make(chan func(context.Context))
	var clients sync.WaitGroup
	var finished atomic.Int64
	for range cfg.Clients {
		clients.Add(1)
		go func() {
			defer clients.Done()
			for task := range queue {
				task(ctx)
			}
		}()
	}

	// The nemeses, each until its count: SIGKILL and restart, pauses past
	// the leases, outages when the feeder says so.
	var faultsMu sync.Mutex
	var nemeses sync.WaitGroup
	var kills atomic.Int64
	nemeses.Add(1)
	go func() {
		defer nemeses.Done()
		rng := rand.New(rand.NewPCG(cfg.Seed, 0xdead))
		for kills.Load() < int64(cfg.Kills) {
			pause := time.Duration(200+rng.IntN(400)) * time.Millisecond
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause):
			}
			victim := processes[rng.IntN(len(processes))]
			victim.kill()
			kills.Add(1)
			time.Sleep(time.Duration(50+rng.IntN(200)) * time.Millisecond)
			if err := victim.start(cfg.Binary); err != nil {
				run.violation("restart %s: %v", victim.name, err)
				return
			}
		}
	}()
	nemeses.Add(1)
	go func() {
		defer nemeses.Done()
		runPauses(ctx, cfg.Seed, cfg.Pauses, processes, leases, &report.Faults)
	}()
	clientsDone := make(chan struct{})
	if cfg.BrokerLosses > 0 {
		lose, closeLoss := embeddedBrokerLoss(dashboard), func() {}
		if brokerURL != "" {
			lose, closeLoss, err = natsBrokerLoss(brokerURL, stream)
			if err != nil {
				return report, err
			}
		}
		defer closeLoss()
		nemeses.Add(1)
		go func() {
			defer nemeses.Done()
			if err := runBrokerLosses(ctx, cfg.Seed, cfg.BrokerLosses, lose, clientsDone, &report.Faults.BrokerLosses, &faultsMu); err != nil {
				run.violation("broker loss: %v", err)
			}
		}()
	}
	if cluster != nil && natsNemeses > 0 {
		nemeses.Add(1)
		go func() {
			defer nemeses.Done()
			if err := runNATSNemeses(ctx, cfg, cluster, stream, &report.Faults.NATS, &faultsMu); err != nil {
				run.violation("NATS nemesis: %v", err)
			}
		}()
	}
	operator := &chaosOperator{
		binary: cfg.Binary,
		args:   []string{"--db", processDB, "--clock-file", clock.path},
		log:    log,
		leases: leases,
		rng:    rand.New(rand.NewPCG(cfg.Seed, 0x4e9a1)),
		counts: &report.Repairs,
		violation: func(format string, args ...any) {
			run.violation("repair: "+format, args...)
		},
	}
	if brokerURL != "" {
		operator.broker = []string{"--broker", brokerURL, "--nats-stream", stream}
	}
	// The windows open while the load runs; the operator repairs behind
	// them, at its own pace (a paused repair takes seconds).
	windows, repairRounds := make(chan int, cfg.Repairs), make(chan struct{}, cfg.Repairs)
	nemeses.Add(2)
	go func() {
		defer nemeses.Done()
		defer close(repairRounds)
		for window := range windows {
			benched, setAside, killed := relays, setAsideRelay, []*chaosProcess(nil)
			if window%2 == 1 {
				benched, setAside, killed = workers, setAsideWorker, processes[:cfg.Serves]
			}
			length := setAsideWindow
			if brokerURL != "" || isPostgresURL(cfg.DBPath) {
				length = setAsideWindowSlow
			}
			if err := runSetAsideWindow(ctx, cfg.Binary, clock, length, benched, setAside, killed); err != nil {
				run.violation("set-aside window: %v", err)
				return
			}
			repairRounds <- struct{}{}
		}
	}()
	go func() {
		defer nemeses.Done()
		for range repairRounds {
			report.Repairs.Windows++
			if _, err := operator.round(ctx, dashboard, clock.now(), true); err != nil {
				run.violation("repair round: %v", err)
			}
		}
	}()
	report.Faults.OutageLength = outageLength(leases)
	outages := make(chan struct{}, cfg.Outages)
	nemeses.Add(1)
	go func() {
		defer nemeses.Done()
		for range outages {
			if err := runOutage(ctx, start, report.Faults.OutageLength, dbOutage, nats, leases.ackWait, &report.Faults, &faultsMu); err != nil {
				run.violation("outage: %v", err)
			}
		}
	}()

	// Progress, until the load is done.
	loadDone := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		ticker := time.NewTicker(250 * time.Millisecond)
		defer ticker.Stop()
		for tick := 1; ; tick++ {
			last := false
			select {
			case <-loadDone:
				last = true
			case <-ticker.C:
			}
			faultsMu.Lock()
			progress := chaosProgress{done: int(finished.Load()), total: cfg.Orders, kills: int(kills.Load()), totalKills: cfg.Kills,
				outages: report.Faults.Outages, totalOutages: cfg.Outages, jumps: clock.jumpCount(), totalJumps: cfg.ClockJumps}
			faultsMu.Unlock()
			printChaosProgress(cfg.Progress, tick, progress, last)
			if last {
				return
			}
		}
	}()

	// The feeder: orders in schedule order; at evenly spaced points an
	// outage starts, or every clock jumps and some clients come back with
	// the keys that just expired.
	reuseRNG := rand.New(rand.NewPCG(cfg.Seed, 0x7e7e))
	outagesStarted, jumpsMade, windowsOpened := 0, 0, 0
	for i, order := range orders {
		if windowsOpened < cfg.Repairs && i >= (windowsOpened+1)*cfg.Orders/(cfg.Repairs+1) {
			windows <- windowsOpened
			windowsOpened++
		}
		if outagesStarted < cfg.Outages && i >= (2*outagesStarted+1)*cfg.Orders/(2*cfg.Outages+1) {
			outages <- struct{}{}
			outagesStarted++
		}
		if jumpsMade < cfg.ClockJumps && i >= (jumpsMade+1)*cfg.Orders/(cfg.ClockJumps+1) {
			if err := clock.jump(clockJump); err != nil {
				run.violation("clock jump: %v", err)
			}
			jumpsMade++
			for _, old := range pickExpired(orders[:i], jumpsMade, reuseRNG) {
				select {
				case queue <- func(ctx context.Context) { run.reuseExpiredKeys(ctx, old) }:
				case <-ctx.Done():
				}
			}
		}
		select {
		case queue <- func(ctx context.Context) {
			run.runChaosOrder(ctx, order)
			finished.Add(1)
		}:
		case <-ctx.Done():
		}
	}
	close(queue)
	close(outages)
	close(windows)
	clients.Wait()
	close(clientsDone)
	nemeses.Wait()
	close(loadDone)
	<-progressDone
	report.Kills = int(kills.Load())
	report.Faults.ClockJumps = clock.jumpCount()

	// Every process is up again; wait until the system is quiet. A run
	// that is stuck (a lost message leaves an order unpaid for ever) is
	// still audited: what is stuck, and every answer so far, is the finding.
	runErr := ctx.Err()
	if runErr != nil {
		runErr = fmt.Errorf("the load did not finish within %s", cfg.Duration)
	}
	if runErr == nil && cfg.Repairs > 0 {
		// What the windows set aside, repaired until nothing is.
		runErr = operator.finishRepairs(ctx, dashboard, clock.now)
	}
	if runErr == nil {
		// Every lease and backoff of a settling system is seconds long; one
		// that is not quiet after this is stuck, and waiting longer hides it.
		quietCtx, cancelQuiet := context.WithTimeout(ctx, chaosGiveUp)
		runErr = waitQuiet(quietCtx, cfg.DBPath)
		cancelQuiet()
		if runErr != nil && stream != "" {
			// Where are the stuck orders' messages: never stored, skipped
			// by a consumer, or held unacked?
			runErr = fmt.Errorf("%w\n%s", runErr, describeNATS(context.Background(), brokerURL, stream, unfinishedEventIDs(cfg.DBPath)))
		}
	}
	for _, p := range processes {
		p.stop()
	}
	auditCtx, cancelAudit := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancelAudit()

	c := run.c
	report.Requests, report.Retries, report.Replays = c.requests.Load(), c.retries.Load(), c.replays.Load()
	report.ServerErrors, report.Unavailable = c.serverErrors.Load(), c.unavailable.Load()
	report.UnavailableDuringOutages, report.UnavailableOutside, report.UnavailableWhen =
		timesSummary(c.unavailableAt, &report.Faults, 3*time.Second)
	report.ServerErrorsDuringOutages, _, report.ServerErrorsWhen = timesSummary(c.serverErrorAt, &report.Faults, 3*time.Second)
	report.RefundRequests, report.RefundOK, report.RefundRefused = c.refundRequests.Load(), c.refundOK.Load(), c.refundRefused.Load()
	report.WebhooksSent, report.WebhookApplied, report.WebhookDuplicate = c.webhooksSent.Load(), c.webhookApplied.Load(), c.webhookDuplicate.Load()
	report.WebhookPoison, report.WebhookRejected = c.webhookPoison.Load(), c.webhookRejected.Load()
	report.HostileBodies, report.KeyRaces = c.hostileBodies.Load(), c.keyRaces.Load()
	report.ReusedCreates, report.ReusedRefunds = c.reusedCreates.Load(), c.reusedRefunds.Load()
	run.mu.Lock()
	report.ClientViolations = append([]string(nil), run.violations...)
	run.mu.Unlock()
	if err := auditChaos(auditCtx, cfg.DBPath, clock.now(), orders, run, &report); err != nil {
		return report, errors.Join(runErr, err)
	}
	report.Elapsed = time.Since(start)
	return report, runErr
}

// chaosReusePerJump is how many clients come back after a clock jump with
// a key that expired in it.
const chaosReusePerJump = 25

// pickExpired picks up to chaosReusePerJump orders whose clients finished
// before the jump'th clock jump, preferring those that refunded (their
// refund keys are reused too).
func pickExpired(orders []*chaosOrder, jump int, rng *rand.Rand) []*chaosOrder {
	var withRefunds, others []*chaosOrder
	for _, order := range orders {
		if !order.finishedBefore(jump) {
			continue
		}
		if len(order.refundKeysSnapshot()) > 0 {
			withRefunds = append(withRefunds, order)
		} else {
			others = append(others, order)
		}
	}
	rng.Shuffle(len(withRefunds), func(i, j int) { withRefunds[i], withRefunds[j] = withRefunds[j], withRefunds[i] })
	rng.Shuffle(len(others), func(i, j int) { others[i], others[j] = others[j], others[i] })
	picked := append(withRefunds[:min(len(withRefunds), chaosReusePerJump*2/3)], others...)
	return picked[:min(len(picked), chaosReusePerJump)]
}

// deleteNATSStream removes a chaos run's stream. The run is over by then,
// so a failure is only reported.
func deleteNATSStream(w io.Writer, url, stream string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	broker, err := openNATSBroker(ctx, url, stream, ackWait)
	if err == nil {
		defer broker.close()
		err = broker.deleteStream(ctx)
	}
	if err != nil {
		fmt.Fprintf(w, "could not delete the NATS stream %s: %v\n", stream, err)
	}
}

// lockedWriter serialises writes of several processes to one log.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

// Write writes p whole before another process's output.
func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// waitHealthy waits until /healthz answers.
func waitHealthy(ctx context.Context, client *http.Client, base string) error {
	for {
		resp, err := client.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("serve did not become healthy: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitQuiet waits until no work is left: every event published and
// delivered, every saga terminal, every key finished. If that does not
// happen in time, it says what is left.
func waitQuiet(ctx context.Context, path string) error {
	db, err := openReadOnlyDB(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	quietFor := 0
	var outbox, deliveries, sagas, keys, unpaid int
	for {
		err := db.QueryRowContext(ctx, `
			SELECT (SELECT COUNT(*) FROM outbox_events WHERE status = 'pending'),
			       (SELECT COUNT(*) FROM broker_deliveries WHERE status = 'pending'),
			       (SELECT COUNT(*) FROM saga_instances WHERE status IN ('in_progress', 'compensating')),
			       (SELECT COUNT(*) FROM idempotency_keys WHERE recovery_point <> 'finished'),
			       (SELECT COUNT(*) FROM orders WHERE status = 'created')`).Scan(&outbox, &deliveries, &sagas, &keys, &unpaid)
		switch {
		case err != nil && ctx.Err() != nil:
		case err == nil && outbox+deliveries+sagas+keys+unpaid == 0:
			quietFor++
			if quietFor == 3 {
				return nil
			}
		default:
			quietFor = 0
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the system did not become quiet in time: %d events unpublished, %d deliveries pending, %d sagas running, %d keys unfinished, %d orders unpaid",
				outbox, deliveries, sagas, keys, unpaid)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// auditChaos checks the quiet database: every invariant (as of now, the
// processes' clock), and every answer a client got.
func auditChaos(ctx context.Context, path string, now time.Time, orders []*chaosOrder, run *chaosRun, report *chaosReport) error {
	db, err := openDB(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	report.Violations, err = audit(ctx, db, now, true)
	if err != nil {
		// A query that fails on what the run stored (an absurd amount that
		// overflows a sum) is itself a finding; the answers are still checked.
		report.Violations = append(report.Violations, violation{Invariant: "check could run", Detail: err.Error()})
	}
	report.Invariants = len(invariants(sqliteDialect()))
	for _, order := range orders {
		if order.gotOrderID != "" {
			report.Created++
		}
		if order.refundPlan != refundNone {
			report.Refunded++
		}
	}
	// A forged or unknown-charge webhook answered "poison" is kept in the
	// inbox for an operator, as designed: check lists it, and it is the
	// answer this run asked for, so it is not counted against the run. So
	// is one answered "duplicate": the process that recorded it as poison
	// was killed before it answered, and the retry found the record (had
	// it been applied instead, check would list no poison for it, and the
	// money invariants would catch it).
	expectedPoison := map[string]bool{}
	for _, event := range run.webhooks {
		if !event.legit && (event.outcome == string(inboxPoison) || event.outcome == string(inboxDuplicate)) {
			expectedPoison[webhookConsumer+" gave up on "+event.eventID+":"] = true
		}
	}
	kept := report.Violations[:0]
	for _, v := range report.Violations {
		prefix, _, _ := strings.Cut(v.Detail, ":")
		if v.Invariant == "once quiet, no message is poison" && expectedPoison[prefix+":"] {
			report.ExpectedPoison++
			continue
		}
		kept = append(kept, v)
	}
	report.Violations = kept
	found, err := run.auditWorkload(ctx, db)
	if err != nil {
		return err
	}
	report.ClientViolations = append(report.ClientViolations, found...)
	if report.Repairs.Runs > 0 {
		found, err := auditRepairs(ctx, db, &report.Repairs)
		if err != nil {
			return err
		}
		for _, detail := range found {
			report.Violations = append(report.Violations, violation{Invariant: "a repair's effect holds", Detail: detail})
		}
	}
	return db.QueryRowContext(ctx, `
		SELECT (SELECT COALESCE(SUM(delivery_count - 1), 0) FROM broker_deliveries),
		       (SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages),
		       (SELECT COALESCE(SUM(duplicates), 0) FROM inbox_messages),
		       (SELECT COALESCE(SUM(key_hits), 0) FROM processor_charges) + (SELECT COALESCE(SUM(key_hits), 0) FROM processor_refunds),
		       (SELECT COUNT(*) FROM orders WHERE status = 'paid'),
		       (SELECT COUNT(*) FROM orders WHERE status = 'cancelled'),
		       (SELECT COUNT(*) FROM orders WHERE status = 'refunded'),
		       (SELECT COALESCE(SUM(qty), 0) FROM stock_holds r WHERE r.sku LIKE 'sku-rare%' AND `+soldHold+`)`,
	).Scan(&report.Redeliveries, &report.BrokerDedupes, &report.InboxSkips, &report.ProcessorKeyHits,
		&report.Paid, &report.Cancelled, &report.RefundedOrders, &report.RareSKUSold)
}

// isTerminal reports whether w is a terminal, where a progress bar can
// redraw itself in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	info, err := f.Stat()
	return err == nil && info.Mode()&os.ModeCharDevice != 0
}

// chaosProgress is what the progress line shows.
type chaosProgress struct {
	done, total, kills, totalKills, outages, totalOutages, jumps, totalJumps int
}

// printChaosProgress draws a one-line progress bar: redrawn in place on a
// terminal, a new line every 20th call elsewhere (a log, a pipe).
func printChaosProgress(w io.Writer, tick int, p chaosProgress, last bool) {
	if w == nil {
		return
	}
	terminal := isTerminal(w)
	if !terminal && !last && tick%20 != 0 {
		return
	}
	const width = 30
	filled := width * p.done / max(p.total, 1)
	end := "\n"
	if terminal && !last {
		end = "\r"
	}
	fmt.Fprintf(w, "[%s%s] %d/%d orders, %d/%d kills, %d/%d outages, %d/%d clock jumps%s", strings.Repeat("#", filled), strings.Repeat(".", width-filled),
		p.done, p.total, p.kills, p.totalKills, p.outages, p.totalOutages, p.jumps, p.totalJumps, end)
}

// printChaosReport writes the closing table.
func printChaosReport(w io.Writer, r chaosReport) {
	row := func(name string, value any) { fmt.Fprintf(w, "  %-44s %v\n", name, value) }
	fmt.Fprintln(w, "\nchaos run")
	row("orders (paid / cancelled / refunded)", fmt.Sprintf("%d (%d / %d / %d)", r.Orders, r.Paid, r.Cancelled, r.RefundedOrders))
	row("HTTP requests", r.Requests)
	row("client retries", r.Retries)
	fmt.Fprintln(w, "faults injected")
	row("processes SIGKILLed and restarted", r.Kills)
	row("processes paused past their leases", fmt.Sprintf("%d (SIGSTOP for %s+)", r.Faults.Pauses, r.Faults.PauseLength))
	outages := fmt.Sprintf("%d (%s each)", r.Faults.Outages, r.Faults.OutageLength)
	if r.Faults.BackendsTerminated > 0 {
		outages += fmt.Sprintf(", %d backends terminated", r.Faults.BackendsTerminated)
	}
	if r.Faults.NATSRestarts > 0 {
		outages += fmt.Sprintf(", NATS restarted %d times", r.Faults.NATSRestarts)
	}
	row("database outages", outages)
	row("clock jumps (every process, past the key TTL)", fmt.Sprintf("%d (+%s each)", r.Faults.ClockJumps, clockJump))
	row("acknowledged messages the broker lost", r.Faults.BrokerLosses)
	if n := r.Faults.NATS; n != (natsClusterFaults{}) || r.Faults.NATSSyncAlways {
		sync := "sync_interval: always"
		if !r.Faults.NATSSyncAlways {
			sync = "the server's default sync"
		}
		row("NATS cluster of 3, stream at 3 replicas", sync)
		row("  stream leader SIGKILLed and restarted", n.LeaderKills)
		row("  stream leader paused past the election", fmt.Sprintf("%d (SIGSTOP for %s)", n.LeaderPauses, natsLeaderPause))
		row("  follower restarted with truncated files", fmt.Sprintf("%d (%d bytes cut)", n.Truncations, n.BytesTruncated))
		row("  all three SIGKILLed and restarted at once", n.FullRestarts)
		row("  longest wait for every replica current", n.LongestRecovery.Round(100*time.Millisecond))
	}
	if r.Repairs.Runs > 0 {
		rp := r.Repairs
		row("set-aside windows", rp.Windows)
		row("set aside (events / poison / sagas / refunds)", fmt.Sprintf("%d / %d / %d / %d", rp.FailedEvents, rp.PoisonMessages, rp.ParkedSagas, rp.UnfinishedRefunds))
		row("repair processes (SIGKILLed / paused)", fmt.Sprintf("%d (%d / %d)", rp.Runs, rp.Killed, rp.Paused))
		row("repairs logged (retry / replay / resume / finish)", fmt.Sprintf("%d / %d / %d / %d", rp.Logged[repairOutboxRetry], rp.Logged[repairInboxReplay],
			rp.Logged[repairSagaResume], rp.Logged[repairRefundFinish]))
	}
	fmt.Fprintln(w, "what the clients sent")
	row("refunds (200 / refused)", fmt.Sprintf("%d (%d / %d)", r.RefundRequests, r.RefundOK, r.RefundRefused))
	row("webhooks (applied / duplicate / poison / 4xx)", fmt.Sprintf("%d (%d / %d / %d / %d)", r.WebhooksSent, r.WebhookApplied, r.WebhookDuplicate, r.WebhookPoison, r.WebhookRejected))
	row("hostile webhooks kept as poison for an operator", r.ExpectedPoison)
	row("hostile requests (2-meaning bodies / key races)", fmt.Sprintf("%d / %d", r.HostileBodies, r.KeyRaces))
	row("expired keys reused (creates / refunds)", fmt.Sprintf("%d / %d", r.ReusedCreates, r.ReusedRefunds))
	row("last units of rare SKUs sold", r.RareSKUSold)
	fmt.Fprintln(w, "answers")
	unavailable := fmt.Sprintf("%d (%d during outages, %d outside)", r.Unavailable, r.UnavailableDuringOutages, r.UnavailableOutside)
	if r.UnavailableWhen != "" {
		unavailable += "; outside at " + r.UnavailableWhen
	}
	row("503 answers (transient: retry the key)", unavailable)
	if len(r.Faults.OutageWindows) > 0 {
		var windows []string
		for _, w := range r.Faults.OutageWindows {
			windows = append(windows, w[0].Round(100*time.Millisecond).String()+"-"+w[1].Round(100*time.Millisecond).String())
		}
		row("outage windows (from the start)", strings.Join(windows, " "))
	}
	serverErrors := fmt.Sprintf("%d (%d during outages)", r.ServerErrors, r.ServerErrorsDuringOutages)
	if r.ServerErrorsWhen != "" {
		serverErrors += "; outside at " + r.ServerErrorsWhen
	}
	row("500 answers", serverErrors)
	fmt.Fprintln(w, "duplicates absorbed")
	row("idempotency key replays", r.Replays)
	if r.OnNATS {
		row("broker dedupes and redeliveries", "counted by NATS, not here")
	} else {
		row("broker dedupes (republished events)", r.BrokerDedupes)
		row("broker redeliveries", r.Redeliveries)
	}
	row("inbox skips", r.InboxSkips)
	row("processor key hits", r.ProcessorKeyHits)
	fmt.Fprintln(w, "results")
	row("invariants checked", r.Invariants)
	row("invariant violations", len(r.Violations))
	row("client-visible violations", len(r.ClientViolations))
	row("elapsed", r.Elapsed.Round(100*time.Millisecond))
	for _, v := range r.Violations {
		fmt.Fprintf(w, "VIOLATION %s: %s\n", v.Invariant, v.Detail)
	}
	for _, v := range r.ClientViolations {
		fmt.Fprintf(w, "CLIENT VIOLATION %s\n", v)
	}
}

// newChaosCommand builds "retrysafe chaos".
func newChaosCommand() *cobra.Command {
	cfg := chaosConfig{}
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Run serve, relay and worker as processes, drive orders at them, kill, pause and cut them off at random, then audit",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if cfg.Orders <= 0 || cfg.Clients <= 0 || cfg.Duration <= 0 || cfg.Serves <= 0 || cfg.Relays <= 0 || cfg.Workers <= 0 {
				return errors.New("--orders, --clients, --duration, --serves, --relays and --workers must be positive")
			}
			if cfg.Kills < 0 || cfg.Pauses < 0 || cfg.Outages < 0 || cfg.ClockJumps < 0 || cfg.Repairs < 0 || cfg.BrokerLosses < 0 ||
				cfg.NATSLeaderKills < 0 || cfg.NATSLeaderPauses < 0 || cfg.NATSTruncations < 0 || cfg.NATSFullRestarts < 0 {
				return errors.New("--kills, --pauses, --outages, --clock-jumps, --repairs, --broker-loss and the --nats-* fault counts must not be negative")
			}
			binary, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find this program's binary: %w", err)
			}
			cfg.Binary = binary
			if cfg.DBPath == "" {
				dir, err := os.MkdirTemp("", "retrysafe-chaos-")
				if err != nil {
					return err
				}
				defer os.RemoveAll(dir)
				cfg.DBPath = filepath.Join(dir, "chaos.db")
			}
			if cfg.LogPath == "" && !isPostgresURL(cfg.DBPath) {
				cfg.LogPath = cfg.DBPath + ".log"
			}
			if cfg.LogPath == "" {
				logFile, err := os.CreateTemp("", "retrysafe-chaos-*.log")
				if err != nil {
					return err
				}
				logFile.Close()
				cfg.LogPath = logFile.Name()
			}
			// The progress bar redraws itself with a CR: it goes around
			// the terminalWriter, and holds only numbers.
			cfg.Progress = underTerminalWriter(cmd.OutOrStdout())
			broker := "the embedded broker"
			switch {
			case cfg.NATSCluster:
				broker = "a three-node NATS cluster of its own (" + cfg.NATSServer + ")"
			case cfg.NATSServer != "":
				broker = "a NATS server of its own (" + cfg.NATSServer + ")"
			case cfg.BrokerURL != "":
				broker = cfg.BrokerURL
			}
			fmt.Fprintf(cmd.OutOrStdout(), "chaos: %d orders from %d clients to %d serve, %d relay and %d worker processes on %s; %d kills, %d pauses, %d outages, %d clock jumps, %d repair windows, seed %d, database %s, process log %s\n",
				cfg.Orders, cfg.Clients, cfg.Serves, cfg.Relays, cfg.Workers, broker, cfg.Kills, cfg.Pauses, cfg.Outages, cfg.ClockJumps, cfg.Repairs, cfg.Seed, redactURL(cfg.DBPath), cfg.LogPath)
			report, err := runChaos(cmd.Context(), cfg)
			printChaosReport(cmd.OutOrStdout(), report)
			if err != nil {
				return err
			}
			if report.failed() {
				return errors.New("chaos found violations")
			}
			fmt.Fprintln(cmd.OutOrStdout(), "\nok: nothing lost, nothing done twice")
			return nil
		},
	}
	cmd.Flags().StringVar(&cfg.DBPath, "db", "", "new database: a SQLite file to create or an empty PostgreSQL database's postgres:// URL (default: a temporary file, removed afterwards)")
	cmd.Flags().StringVar(&cfg.LogPath, "log", "", "file for the processes' output (default: the database file's name with .log, or a temporary file)")
	cmd.Flags().IntVar(&cfg.Orders, "orders", 2000, "orders to create")
	cmd.Flags().IntVar(&cfg.Clients, "clients", 16, "concurrent clients")
	cmd.Flags().IntVar(&cfg.Kills, "kills", 20, "processes to SIGKILL (and restart) during the run")
	cmd.Flags().Uint64Var(&cfg.Seed, "seed", 1, "seed of the order mix and the kill schedule")
	cmd.Flags().DurationVar(&cfg.Duration, "duration", 5*time.Minute, "give up if the run takes longer")
	cmd.Flags().IntVar(&cfg.Serves, "serves", 1, "serve processes (clients are spread across them)")
	cmd.Flags().IntVar(&cfg.Relays, "relays", 1, "relay processes")
	cmd.Flags().IntVar(&cfg.Workers, "workers", 1, "worker processes")
	cmd.Flags().StringVar(&cfg.BrokerURL, "broker", "", "NATS JetStream URL, or a cluster's URLs separated by commas, instead of the embedded broker")
	cmd.Flags().StringVar(&cfg.NATSServer, "nats-server", "", "nats-server binary: start a NATS JetStream server of the run's own on a free loopback port, and restart it during outages (instead of --broker)")
	cmd.Flags().BoolVar(&cfg.NATSCluster, "nats-cluster", false, "with --nats-server: start a three-node JetStream cluster on loopback (sync_interval: always where the server knows it, the stream at 3 replicas)")
	cmd.Flags().IntVar(&cfg.NATSLeaderKills, "nats-leader-kills", 0, "with --nats-cluster: times to SIGKILL the stream's leader and restart it")
	cmd.Flags().IntVar(&cfg.NATSLeaderPauses, "nats-leader-pauses", 0, "with --nats-cluster: times to pause (SIGSTOP) the stream's leader past the election timeout")
	cmd.Flags().IntVar(&cfg.NATSTruncations, "nats-truncations", 0, "with --nats-cluster: times to SIGKILL a follower, truncate its stream files and restart it")
	cmd.Flags().IntVar(&cfg.NATSFullRestarts, "nats-full-restarts", 0, "with --nats-cluster: times to SIGKILL all three servers at once and restart them")
	cmd.Flags().IntVar(&cfg.Pauses, "pauses", 0, "processes to pause (SIGSTOP) past their leases, then continue")
	cmd.Flags().IntVar(&cfg.BrokerLosses, "broker-loss", 0, "acknowledged messages no consumer has acked yet to delete from the broker (NATS: JetStream's delete-message API; embedded: its rows)")
	cmd.Flags().IntVar(&cfg.Outages, "outages", 0, "database outages longer than MaxDeliver x AckWait (SQLite: a held write lock; PostgreSQL: the run's backends terminated)")
	cmd.Flags().IntVar(&cfg.ClockJumps, "clock-jumps", 0, "times every process's clock jumps past the idempotency key TTL; clients then reuse expired keys")
	cmd.Flags().DurationVar(&cfg.ClockSkew, "clock-skew", 0, "run the first worker's clock this far ahead of the others")
	cmd.Flags().IntVar(&cfg.Repairs, "repairs", 0, "set-aside windows (relays and workers replaced by ones whose dependencies fail), each followed by every repair run as a process that is SIGKILLed or paused mid-repair")
	return cmd
}
