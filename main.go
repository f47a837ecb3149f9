// Command retrysafe is a reference implementation, and teaching demo, of
// retry-safe workflows: a client retries "Pay", and the business result
// still happens exactly once. Four layers work together on one SQLite file:
// idempotency keys (idem.go, refund.go), a transactional outbox (outbox.go),
// an inbox (inbox.go) and a saga with compensation (saga.go).
//
// Usage:
//
//	retrysafe demo      run the scripted scenario, narrating each layer
//	retrysafe serve     serve the HTTP API (and, by default, the workers)
//	retrysafe relay     run only the outbox relay
//	retrysafe worker    run only the consumers, sagas and completers
//	retrysafe inspect   print the tables
//	retrysafe trace ORDER_ID   one order's journey through every table
//	retrysafe cleanup   delete expired keys and old delivered messages
//	retrysafe check     audit a database: nothing twice, nothing lost
//	retrysafe chaos     kill processes at random under load, then audit
//	retrysafe sign-webhook BODY   print the signature header for a webhook
//	retrysafe outbox retry       put failed outbox events back to pending
//	retrysafe inbox replay       deliver poison messages again
//	retrysafe saga resume|list   resume a saga whose compensation failed
//	retrysafe refund finish|list finish abandoned refunds now
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		os.Exit(1)
	}
}

// run executes the command line args. Cobra has printed the error, if any.
// What the commands print passes through a terminalWriter (terminal.go).
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	out, errOut := newTerminalWriter(stdout), newTerminalWriter(stderr)
	root := newRootCommand()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(out)
	root.SetErr(errOut)
	err := root.ExecuteContext(ctx)
	for _, w := range []*terminalWriter{out, errOut} {
		if flushErr := w.flush(); err == nil {
			err = flushErr
		}
	}
	return err
}

// newRootCommand builds the command tree. It is built fresh for every run, so
// nothing is shared through package state.
func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "retrysafe",
		Short:         "Retry-safe workflows: idempotency keys, outbox, inbox and saga on one SQLite file",
		SilenceUsage:  true,
		SilenceErrors: false,
	}
	root.AddCommand(
		newDemoCommand(),
		newServeCommand(),
		newRelayCommand(),
		newWorkerCommand(),
		newInspectCommand(),
		newTraceCommand(),
		newCleanupCommand(),
		newSignWebhookCommand(),
		newCheckCommand(),
		newChaosCommand(),
		newSimulateCommand(),
		newOutboxCommand(),
		newInboxCommand(),
		newSagaCommand(),
		newRefundCommand(),
	)
	return root
}

// openExistingApp opens an App over a database that must already exist: a
// typo in --db should say so, not quietly create an empty file. Its
// consumers are not subscribed yet; see startProcess.
func openExistingApp(ctx context.Context, path string, clock func() time.Time, fault faultHook) (*App, error) {
	// (A PostgreSQL URL with a typo fails to connect instead.)
	if !isPostgresURL(path) {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return nil, noDatabaseError(path)
		}
	}
	db, err := openDB(ctx, path)
	if err != nil {
		return nil, err
	}
	return newApp(db, clock, nil, fault), nil
}

// openApp opens (creating if needed) the database at path and returns an App
// over it with the consumers subscribed.
func openApp(ctx context.Context, path string, clock func() time.Time, ids func(string) string, fault faultHook) (*App, error) {
	db, err := openDB(ctx, path)
	if err != nil {
		return nil, err
	}
	app := newApp(db, clock, ids, fault)
	if err := app.subscribeConsumers(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return app, nil
}

// newServeCommand builds "retrysafe serve".
func newServeCommand() *cobra.Command {
	var dbPath, addr, durabilityFlag, brokerURL, stream, natsMonitor, metricsAddr, logFormatFlag string
	var workers bool
	var drill drillFlags
	var clock chaosClockFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the HTTP API, and run the workers unless --workers=false",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			d, err := parseDurability(durabilityFlag)
			if err != nil {
				return err
			}
			format, err := parseLogFormat(logFormatFlag)
			if err != nil {
				return err
			}
			return serve(cmd.Context(), cmd.OutOrStdout(), dbPath, addr, metricsAddr, workers, d, brokerURL, stream, natsMonitor, drill, clock, format)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file (created if missing) or postgres:// URL")
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "address to listen on")
	cmd.Flags().BoolVar(&workers, "workers", true, "also run the relay, consumers, sagas, completer and cleanup")
	cmd.Flags().StringVar(&durabilityFlag, "durability", string(durabilityNormal),
		"normal: commits survive a process crash, not a power loss (no fsync per commit); full: every commit is fsynced; either way concurrent orders are committed in groups")
	addBrokerFlags(cmd, &brokerURL, &stream)
	addNATSMonitorFlag(cmd, &natsMonitor)
	addDrillFlags(cmd, &drill)
	addClockFlags(cmd, &clock)
	addMetricsAddrFlag(cmd, &metricsAddr, "127.0.0.1:9100")
	addLogFormatFlag(cmd, &logFormatFlag)
	return cmd
}

// addMetricsAddrFlag adds --metrics-addr, example being an address to show
// in its help. Empty by default, as a port nobody asked for should not be
// open: metrics are then off, and never on the API's address, where
// customers reach (they hold no order, but say how much business there
// is, and every scrape reads the database); and several processes on one
// host (serve, relay, worker, or the chaos run's serves) do not fight
// over one default port.
func addMetricsAddrFlag(cmd *cobra.Command, addr *string, example string) {
	cmd.Flags().StringVar(addr, "metrics-addr", "", "serve GET /metrics on this address ("+example+"), reachable only by monitoring; empty: no metrics")
}

// listenMetrics listens on --metrics-addr addr, or returns nil if it is
// empty. The commands call it before they touch the database, so a busy
// port or a bad address fails before anything starts.
func listenMetrics(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --metrics-addr %s: %w", addr, err)
	}
	return listener, nil
}

// serveConfig reads the server's settings from the environment, and tells
// say when it falls back to a dev setting.
func serveConfig(say func(message string)) (apiKeys map[string]string, webhookSecret []byte, err error) {
	if spec := os.Getenv("RETRYSAFE_API_KEYS"); spec != "" {
		apiKeys, err = parseAPIKeys(spec)
		if err != nil {
			return nil, nil, err
		}
	} else {
		apiKeys = map[string]string{devAPIKey: devUserID}
		say(fmt.Sprintf("RETRYSAFE_API_KEYS is not set: accepting the dev key %s for %s", devAPIKey, devUserID))
	}
	secret := os.Getenv("RETRYSAFE_WEBHOOK_SECRET")
	if secret == "" {
		secret = devWebhookSecret
		say(fmt.Sprintf("RETRYSAFE_WEBHOOK_SECRET is not set: webhooks are checked against the dev secret %s", devWebhookSecret))
	}
	return apiKeys, []byte(secret), nil
}

// serve runs the API until ctx is done, then shuts down in order: stop
// accepting, finish in-flight requests, stop the loops, close the database.
func serve(ctx context.Context, out io.Writer, dbPath, addr, metricsAddr string, workers bool, d durability, brokerURL, stream, natsMonitor string, drill drillFlags, clock chaosClockFlags, format logFormat) error {
	if err := drill.check(brokerURL); err != nil {
		return err
	}
	if err := checkBrokerURL(brokerURL); err != nil {
		return err
	}
	if err := checkOTLPEndpoint(); err != nil {
		return err
	}
	logger := newLogger(out, format, nil)
	say := func(message string) { notice(out, logger, format, message) }
	apiKeys, webhookSecret, err := serveConfig(say)
	if err != nil {
		return err
	}
	adminKey, err := adminKeyConfig(say, apiKeys)
	if err != nil {
		return err
	}
	// Listen first: a busy port or a bad address fails before any database
	// file is created.
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	defer listener.Close()
	metricsListener, err := listenMetrics(metricsAddr)
	if err != nil {
		return err
	}
	if metricsListener != nil {
		defer metricsListener.Close()
	}
	db, err := openDBWith(ctx, dbPath, d)
	if err != nil {
		return err
	}
	defer db.Close()
	app := newApp(db, processClock(clock.file, clock.skew), nil, nil)
	stopTracing, err := startTracing(ctx, app, out, "serve", workerName("serve"))
	if err != nil {
		return err
	}
	// It runs at return, once the requests and loops are done: it flushes
	// their last spans.
	defer stopTracing()
	closeBroker, err := startProcess(ctx, app, drill, brokerURL, stream, logger)
	if err != nil {
		return err
	}
	defer closeBroker()
	if err := warnNATSDurability(ctx, app, natsMonitor, logger); err != nil {
		return err
	}
	app.log = logger
	if metricsListener != nil {
		app.enableMetrics()
	}
	s := &server{app: app, apiKeys: apiKeys, webhookSecret: webhookSecret, adminKey: adminKey, logger: logger}
	httpServer := newHTTPServer(addr, s.routes())
	durabilityName := "durability " + string(d)
	if isPostgresURL(dbPath) {
		durabilityName = "durability set by the server's synchronous_commit"
	}
	say(fmt.Sprintf("retrysafe serving http://%s (database %s, %s, %s)", listener.Addr(), redactURL(dbPath), durabilityName, brokerName(brokerURL, stream)))

	loopCtx, stopLoops := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	if metricsListener != nil {
		// Stopped with the loops, after the last request: a scrape during
		// shutdown still answers.
		serveMetrics(loopCtx, &loops, metricsListener, app, logger)
		logger.Info("serving metrics", "url", "http://"+metricsListener.Addr().String()+"/metrics")
	}
	if workers {
		startRelayLoop(loopCtx, &loops, app, workerName("serve"), logger)
		startWorkerLoops(loopCtx, &loops, app, workerName("serve"), logger)
		startListener(loopCtx, &loops, app, dbPath, logger)
	}

	served := make(chan error, 1)
	go func() { served <- httpServer.Serve(listener) }()
	select {
	case <-ctx.Done():
	case err = <-served:
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	shutdownErr := httpServer.Shutdown(shutdownCtx)
	stopLoops()
	loops.Wait()
	logger.Info("stopped")
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return err
	}
	return shutdownErr
}

// newRelayCommand builds "retrysafe relay".
func newRelayCommand() *cobra.Command {
	return newLoopCommand("relay", "Run the outbox relay as its own process", startRelayLoop)
}

// newWorkerCommand builds "retrysafe worker".
func newWorkerCommand() *cobra.Command {
	return newLoopCommand("worker", "Run the consumers, saga recovery, refund completer and cleanup as their own process", startWorkerLoops)
}

// newLoopCommand builds a command that runs the loops start starts, as a
// process of its own beside serve.
func newLoopCommand(role, short string,
	start func(ctx context.Context, wg *sync.WaitGroup, app *App, workerID string, logger *slog.Logger)) *cobra.Command {
	var dbPath, brokerURL, stream, natsMonitor, metricsAddr, logFormatFlag string
	var drill drillFlags
	var clock chaosClockFlags
	cmd := &cobra.Command{
		Use:   role,
		Short: short,
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseLogFormat(logFormatFlag)
			if err != nil {
				return err
			}
			return runLoops(cmd.Context(), cmd.OutOrStdout(), dbPath, role, brokerURL, stream, natsMonitor, drill, clock, metricsAddr, format, start)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	addBrokerFlags(cmd, &brokerURL, &stream)
	addNATSMonitorFlag(cmd, &natsMonitor)
	addDrillFlags(cmd, &drill)
	addClockFlags(cmd, &clock)
	addMetricsAddrFlag(cmd, &metricsAddr, "127.0.0.1:9101")
	addLogFormatFlag(cmd, &logFormatFlag)
	return cmd
}

// runLoops runs the loops that start starts until ctx is done, and serves
// their metrics on metricsAddr unless it is empty.
func runLoops(ctx context.Context, out io.Writer, dbPath, role, brokerURL, stream, natsMonitor string, drill drillFlags, clock chaosClockFlags, metricsAddr string, format logFormat,
	start func(ctx context.Context, wg *sync.WaitGroup, app *App, workerID string, logger *slog.Logger)) error {
	if err := drill.check(brokerURL); err != nil {
		return err
	}
	if err := checkBrokerURL(brokerURL); err != nil {
		return err
	}
	if err := checkOTLPEndpoint(); err != nil {
		return err
	}
	logger := newLogger(out, format, nil)
	metricsListener, err := listenMetrics(metricsAddr)
	if err != nil {
		return err
	}
	if metricsListener != nil {
		defer metricsListener.Close()
	}
	// The relay and the worker serve a database that serve created; a typo
	// in --db must not start them on a new, empty one.
	var fault faultHook
	if clock.setAside {
		fault = setAsideFaults
	}
	app, err := openExistingApp(ctx, dbPath, processClock(clock.file, clock.skew), fault)
	if err != nil {
		return err
	}
	defer app.db.Close()
	stopTracing, err := startTracing(ctx, app, out, role, workerName(role))
	if err != nil {
		return err
	}
	defer stopTracing()
	closeBroker, err := startProcess(ctx, app, drill, brokerURL, stream, logger)
	if err != nil {
		return err
	}
	defer closeBroker()
	if err := warnNATSDurability(ctx, app, natsMonitor, logger); err != nil {
		return err
	}
	var loops sync.WaitGroup
	app.log = logger
	if metricsListener != nil {
		app.enableMetrics()
		serveMetrics(ctx, &loops, metricsListener, app, logger)
		logger.Info("serving metrics", "url", "http://"+metricsListener.Addr().String()+"/metrics")
	}
	start(ctx, &loops, app, workerName(role), logger)
	startListener(ctx, &loops, app, dbPath, logger)
	logger.Info("started", "role", role, "db", redactURL(dbPath), "broker", brokerName(brokerURL, stream))
	loops.Wait()
	logger.Info("stopped", "role", role)
	return nil
}

// drillFlags are --lease-scale and --broker-down, for drills: the drill of
// docs/operate-and-repair.md breaks the broker and shortens every wait so that a
// publish gives up in seconds, and the chaos run shortens every lease so
// that a killed process's work is taken over within seconds.
type drillFlags struct {
	leaseScale float64
	brokerDown bool
}

// addDrillFlags adds --lease-scale and --broker-down to cmd.
func addDrillFlags(cmd *cobra.Command, drill *drillFlags) {
	cmd.Flags().Float64Var(&drill.leaseScale, "lease-scale", 1, "multiply every lease, ack wait and publish backoff by this factor (for drills)")
	cmd.Flags().BoolVar(&drill.brokerDown, "broker-down", false, "a drill: the embedded broker refuses every publish, as if unreachable")
}

// check rejects a --lease-scale that is not positive, and --broker-down
// with NATS (to break NATS, stop its server).
func (drill drillFlags) check(brokerURL string) error {
	if drill.leaseScale <= 0 {
		return fmt.Errorf("--lease-scale must be positive, not %v", drill.leaseScale)
	}
	if drill.brokerDown && brokerURL != "" {
		return errors.New("--broker-down breaks the embedded broker; to break NATS, stop the NATS server")
	}
	return nil
}

// startProcess readies app for a long-running process (serve, relay,
// worker): its leases, its broker, its consumers' subscriptions. It returns
// what closes the broker.
func startProcess(ctx context.Context, app *App, drill drillFlags, brokerURL, stream string, logger *slog.Logger) (func(), error) {
	app.setLeaseTimes(scaledLeaseTimes(drill.leaseScale))
	if embedded, ok := app.broker.(*embeddedBroker); ok {
		embedded.down = drill.brokerDown
	}
	if brokerURL == "" {
		return func() {}, app.subscribeConsumers(ctx)
	}
	// A NATS cluster answers stream and consumer requests only once they
	// have a leader: a new stream of three replicas, or one whose leader
	// just died, elects one in 4 to 9 s. A process that starts meanwhile
	// waits, instead of exiting (JetStream's default of 5 s per request
	// would have it give up before the election ends).
	giveUp := time.Now().Add(natsStartPatience)
	for {
		attemptCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
		closeBroker, err := useBroker(attemptCtx, app, brokerURL, stream)
		if err == nil {
			err = app.subscribeConsumers(attemptCtx)
			if err != nil {
				closeBroker()
			}
		}
		cancel()
		if err == nil {
			return closeBroker, nil
		}
		// No server answering at all is a wrong --broker more often than
		// an election: say so at once.
		if errors.Is(err, nats.ErrNoServers) || time.Now().After(giveUp) || ctx.Err() != nil {
			return nil, err
		}
		logger.Warn("NATS JetStream is not ready; trying again", "error", err.Error())
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// natsStartPatience is how long a starting process keeps trying to set up
// its NATS stream and consumers before it gives up and exits.
const natsStartPatience = 2 * time.Minute

// natsStream is the JetStream stream retrysafe publishes to.
const natsStream = "RETRYSAFE"

// addBrokerFlags adds --broker and --nats-stream. A stream belongs to one
// database: its durable consumers would hand a new database the old one's
// events.
func addBrokerFlags(cmd *cobra.Command, url, stream *string) {
	cmd.Flags().StringVar(url, "broker", "", "NATS JetStream URL (nats://127.0.0.1:4222), or a cluster's URLs separated by commas, instead of the embedded broker")
	cmd.Flags().StringVar(stream, "nats-stream", natsStream, "JetStream stream name with --broker; one stream per database")
}

// brokerName says which broker a process uses, for its start-up line.
func brokerName(url, stream string) string {
	if url == "" {
		return "embedded broker"
	}
	return "NATS JetStream " + url + " stream " + stream
}

// checkBrokerURL returns an error unless url is empty (the embedded broker)
// or nats:// URLs separated by commas (the servers of one cluster).
// Commands check it before they touch the database.
func checkBrokerURL(url string) error {
	if url == "" {
		return nil
	}
	for _, server := range strings.Split(url, ",") {
		if !strings.HasPrefix(strings.TrimSpace(server), "nats://") {
			return fmt.Errorf("--broker %q: want a nats:// URL, or several separated by commas", url)
		}
	}
	return nil
}

// addNATSMonitorFlag adds --nats-monitor, which serve, relay and worker
// read the servers' sync policy from at start.
func addNATSMonitorFlag(cmd *cobra.Command, monitor *string) {
	cmd.Flags().StringVar(monitor, "nats-monitor", "",
		"with --broker: the NATS servers' HTTP monitoring URLs (http://127.0.0.1:8222), separated by commas, to warn at start if one acknowledges publishes before they are on disk")
}

// warnNATSDurability logs a warning for each setting of the NATS stream or
// servers that lets the broker lose what it acknowledged (see
// natsDurabilityWarnings). A process starts anyway: the settings are the
// operator's to choose, and the warning says what each costs.
func warnNATSDurability(ctx context.Context, app *App, monitor string, logger *slog.Logger) error {
	broker, ok := app.broker.(*natsBroker)
	if !ok {
		if monitor != "" {
			return errors.New("--nats-monitor needs --broker")
		}
		return nil
	}
	var monitorURLs []string
	for _, monitorURL := range strings.Split(monitor, ",") {
		if monitorURL = strings.TrimSpace(monitorURL); monitorURL != "" {
			monitorURLs = append(monitorURLs, monitorURL)
		}
	}
	warnings, err := natsDurabilityWarnings(ctx, broker, monitorURLs)
	for _, warning := range warnings {
		logger.Warn(warning.Message, "setting", warning.Setting)
	}
	return err
}

// useBroker switches app to NATS JetStream and stream if url is set, and
// returns what closes it. Every process of one system must use the same
// broker and stream.
func useBroker(ctx context.Context, app *App, url, stream string) (func(), error) {
	if url == "" {
		return func() {}, nil
	}
	if err := checkBrokerURL(url); err != nil {
		return nil, err
	}
	broker, err := openNATSBroker(ctx, url, stream, app.leases.ackWait)
	if err != nil {
		return nil, err
	}
	if err := broker.onAnnounce(app.wake.published); err != nil {
		broker.close()
		return nil, err
	}
	app.broker = broker
	return broker.close, nil
}

// chaosClockFlags are the hidden --clock-file and --clock-skew.
type chaosClockFlags struct {
	file string
	skew time.Duration
	// setAside makes the process fail where a broken dependency would,
	// so that what it works on is set aside for an operator (see
	// setAsideFaults).
	setAside bool
}

// addClockFlags adds the hidden --clock-file and --clock-skew flags: the
// chaos run moves every process's clock past the idempotency key TTL (a
// duration it writes to the file) and runs one process's clock ahead, to
// produce the faults a real clock produces rarely. Nobody else should need
// them.
func addClockFlags(cmd *cobra.Command, clock *chaosClockFlags) {
	cmd.Flags().StringVar(&clock.file, "clock-file", "", "add the duration written in this file to the clock")
	cmd.Flags().DurationVar(&clock.skew, "clock-skew", 0, "run the clock this far ahead")
	cmd.Flags().BoolVar(&clock.setAside, "set-aside", false, "fail every publish, consumer apply, saga step effect and processor answer")
	cmd.Flags().MarkHidden("clock-file")
	cmd.Flags().MarkHidden("clock-skew")
	cmd.Flags().MarkHidden("set-aside")
}

// noArgs rejects positional arguments with a hint: the database is named
// with --db, not as an argument.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("%s takes no arguments (got %q); name the database with --db FILE", cmd.CommandPath(), args[0])
	}
	return nil
}

// workerName names this process in leases, so inspect shows who holds what.
func workerName(role string) string {
	host, err := os.Hostname()
	if err != nil {
		host = "localhost"
	}
	return role + "@" + host + ":" + strconv.Itoa(os.Getpid())
}

// Idle waits of the loops: how long a loop sleeps when a pass found nothing
// and nobody woke it (see infra_wakeup.go). Short enough that work no signal
// announced (written by a process on the same SQLite file, or while a
// listener reconnected) still moves on soon.
const (
	relayIdle   = 200 * time.Millisecond
	workerIdle  = 200 * time.Millisecond
	cleanupIdle = time.Hour
)

// startRelayLoop starts the relay loop (the article's run_relay()) and the
// reconciler's (deliver.go), which is part of the relay: every relay
// process sweeps, and their claims keep them apart. Both exit when ctx is
// done.
func startRelayLoop(ctx context.Context, wg *sync.WaitGroup, app *App, workerID string, logger *slog.Logger) {
	// A claim that took fewer than a batch took every event that was due:
	// the relay waits for the next signal instead of claiming again at
	// once, a claim that would find nothing (a transaction and a commit on
	// PostgreSQL). An event committed meanwhile signals it.
	startLoop(ctx, wg, logger, "relay", app.idle.relay, app.wake.relay, relayBatchSize, func(ctx context.Context) (int, error) {
		return app.relayOnce(ctx, workerID, relayBatchSize)
	})
	// Nothing announces a lost message: the reconciler looks, a tenth of
	// the bound apart, so an event is republished at most a tenth late.
	startLoop(ctx, wg, logger, "reconciler", app.leases.deliver/10, nil, 0, func(ctx context.Context) (int, error) {
		republished, err := app.reconcileOnce(ctx, workerID, relayBatchSize)
		if republished > 0 {
			logger.Warn("republished events not delivered in time", "events", republished, "bound", app.leases.deliver)
		}
		return republished, err
	})
}

// startWorkerLoops starts one loop per consumer, the saga loop (which is also
// saga recovery), the refund completer and cleanup. They exit when ctx is
// done.
func startWorkerLoops(ctx context.Context, wg *sync.WaitGroup, app *App, workerID string, logger *slog.Logger) {
	for _, c := range app.consumers() {
		if _, onNATS := app.broker.(*natsBroker); onNATS {
			// A fetch that found nothing may have come a moment before
			// the message it was woken for (keepSeen).
			app.wake.consumers[c.name].keepSeen.Store(true)
		}
		startLoop(ctx, wg, logger, "consume "+c.name, app.idle.worker, app.wake.consumers[c.name], 0, func(ctx context.Context) (int, error) {
			results, err := app.consumeOnce(ctx, c, consumeBatchSize)
			for _, result := range results {
				if result.Outcome == inboxPoison {
					logger.Warn("poison message", "consumer", c.name, "message_id", result.MessageID, "error", result.Err)
				}
			}
			return len(results), err
		})
	}
	// One saga loop: its rounds take every saga under way one step, in one
	// commit, and claim those started meanwhile (sagaOnce), so sagas share
	// commits instead of each loop paying its own. On PostgreSQL a round's
	// processor calls run side by side, so a round waits for its slowest
	// call rather than for all of them; on SQLite they run in order, and
	// `step` in a debugger meets one saga at a time.
	app.sagaCallsSideBySide = dialectOf(app.db).name == "postgres"
	startLoop(ctx, wg, logger, "saga", app.idle.worker, app.wake.saga, 0, func(ctx context.Context) (int, error) {
		_, err := app.sagaOnce(ctx, workerID, sagaBatchSize)
		// A pass ends after a round whose claim found no saga due: the
		// loop waits, as after a pass that found nothing, instead of
		// claiming again at once a claim that would find nothing (a
		// transaction on PostgreSQL). A saga started since signals it.
		return 0, err
	})
	// The completer and cleanup look for what is left over (a refund whose
	// request died, keys past their TTL): nothing to wake them for.
	startLoop(ctx, wg, logger, "refund completer", time.Second, nil, 0, func(ctx context.Context) (int, error) {
		return app.completeRefundsOnce(ctx, refundBatchSize)
	})
	startLoop(ctx, wg, logger, "cleanup", cleanupIdle, nil, 0, func(ctx context.Context) (int, error) {
		result, err := app.cleanupOnce(ctx)
		if err == nil && result != (cleanupResult{}) {
			logger.Info("cleanup", "keys", result.Keys, "outbox_events", result.OutboxEvents,
				"broker_messages", result.BrokerMessages, "inbox_messages", result.InboxMessages)
		}
		return 0, err
	})
}

// startLoop runs once in a goroutine until ctx is done: again at once while
// it finds work; when it finds none, after idle or as soon as wake is
// signalled (wake may be nil); after a growing pause when it fails (a
// signal does not cut that short: a failing database is not hammered). The
// goroutine exits when ctx is done.
//
// If batch is set, once takes at most batch things a pass, and a pass that
// found fewer took all there was when it looked: the loop waits as if it
// had found none, and work committed since wakes it (a signal sent during
// the pass is kept for the wait).
func startLoop(ctx context.Context, wg *sync.WaitGroup, logger *slog.Logger, name string, idle time.Duration, wake *wakeup, batch int, once func(ctx context.Context) (int, error)) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		failures := 0
		for ctx.Err() == nil {
			seen := wake.count()
			n, err := once(ctx)
			wait := time.Duration(0)
			woken := wake.signaled()
			switch {
			case err != nil && ctx.Err() != nil:
				return
			case err != nil:
				failures++
				wait = min(idle<<min(failures, 6), 30*time.Second)
				woken = nil
				logger.Error("loop failed", "loop", name, "error", err, "retry_in", wait)
			case n == 0, n < batch:
				failures = 0
				wait = idle
				wake.dropIfSeen(seen)
			default:
				failures = 0
			}
			if wait == 0 {
				continue
			}
			timer := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
				return
			case <-woken:
				timer.Stop()
			case <-timer.C:
			}
		}
	}()
}

// newInspectCommand builds "retrysafe inspect".
func newInspectCommand() *cobra.Command {
	var dbPath, orderID string
	var asJSON, wide bool
	cmd := &cobra.Command{
		Use:   "inspect",
		Short: "Print every layer's tables (aligned text to 120 columns, --wide, or --json)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			db, err := openReadOnlyDB(cmd.Context(), dbPath)
			if err != nil {
				return err
			}
			defer db.Close()
			opts := inspectOptions{view: inspectBrief, orderID: orderID}
			if wide {
				opts.view = inspectWide
			}
			if asJSON {
				opts.view = inspectJSON
			}
			err = inspect(cmd.Context(), db, cmd.OutOrStdout(), opts)
			return orderNotFound(err, orderID, dbPath)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON instead of aligned text")
	cmd.Flags().BoolVar(&wide, "wide", false, "print every column and whole ids, however wide the lines")
	cmd.Flags().StringVar(&orderID, "order", "", "print only this order's rows (ORDER_ID as in the orders table)")
	return cmd
}

// orderNotFound says what to do when err is that orderID, given on the
// command line for the database at dbPath, names no order or several; any
// other err is returned as it is.
func orderNotFound(err error, orderID, dbPath string) error {
	switch {
	case errors.Is(err, errNoSuchOrder):
		return fmt.Errorf("no order %s in %s; 'go run . inspect --db %s' lists the orders", terminalSafe(orderID), redactURL(dbPath), redactURL(dbPath))
	case errors.Is(err, errAmbiguousOrder):
		return fmt.Errorf("%s in %s: %w", terminalSafe(orderID), redactURL(dbPath), errAmbiguousOrder)
	}
	return err
}

// newTraceCommand builds "retrysafe trace".
func newTraceCommand() *cobra.Command {
	var dbPath string
	var mermaid, svg bool
	cmd := &cobra.Command{
		Use:   "trace ORDER_ID",
		Short: "Print one order's journey through every table, in time order (or --mermaid, --svg)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return fmt.Errorf("%s takes one ORDER_ID (got %d arguments); 'retrysafe inspect --db FILE' lists the orders", cmd.CommandPath(), len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if !isPostgresURL(dbPath) {
				if err := requireRetrysafeFile(cmd.Context(), dbPath); err != nil {
					return err
				}
			}
			db, err := openReadOnlyDB(cmd.Context(), dbPath)
			if err != nil {
				return err
			}
			defer db.Close()
			t, err := traceOrder(cmd.Context(), db, args[0])
			if err != nil {
				return orderNotFound(err, args[0], dbPath)
			}
			switch {
			case mermaid && svg:
				return fmt.Errorf("%s takes --mermaid or --svg, not both", cmd.CommandPath())
			case mermaid:
				return printMermaid(cmd.OutOrStdout(), t)
			case svg:
				return printSVG(cmd.OutOrStdout(), t)
			}
			return printTrace(cmd.OutOrStdout(), t)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	cmd.Flags().BoolVar(&mermaid, "mermaid", false, "print a Mermaid sequenceDiagram instead of text")
	cmd.Flags().BoolVar(&svg, "svg", false, "print the sequence diagram as an SVG image instead of text")
	return cmd
}

// newCleanupCommand builds "retrysafe cleanup".
func newCleanupCommand() *cobra.Command {
	var dbPath string
	cmd := &cobra.Command{
		Use:   "cleanup",
		Short: "Delete expired idempotency keys and delivered messages older than a week",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			app, err := openExistingApp(cmd.Context(), dbPath, nil, nil)
			if err != nil {
				return err
			}
			defer app.db.Close()
			result, err := app.cleanupOnce(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "deleted %d expired idempotency keys, %d published outbox events, %d broker messages, %d inbox rows\n",
				result.Keys, result.OutboxEvents, result.BrokerMessages, result.InboxMessages)
			return nil
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	return cmd
}

// newSignWebhookCommand builds "retrysafe sign-webhook", which plays the
// processor's part in the curl walkthrough: it prints the Retrysafe-Signature
// header value for a body, signed now.
func newSignWebhookCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "sign-webhook BODY",
		Short: "Print the Retrysafe-Signature header value for a webhook body, signed now",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			secret := os.Getenv("RETRYSAFE_WEBHOOK_SECRET")
			if secret == "" {
				secret = devWebhookSecret
			}
			fmt.Fprintln(cmd.OutOrStdout(), signWebhook([]byte(secret), time.Now(), []byte(args[0])))
			return nil
		},
	}
	return cmd
}

// newCheckCommand builds "retrysafe check".
func newCheckCommand() *cobra.Command {
	var dbPath string
	var inFlight bool
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Audit a database: exits 1 and prints each violation if anything happened twice or was lost",
		Long: `check audits a database, read-only, for what the four layers promise: no
key maps to two orders, every order has one OrderCreated event and announces
its payment at most once, no order is charged twice, refunds add up, stock is
conserved, no event published more than 10 minutes ago is missing from the
inbox of a consumer of its subject.
By default it also checks what holds once the system is quiet (every saga
terminal, every event published and applied by each of its consumers, every
key finished); stop the workers first, or pass --in-flight to skip those
while work is still going on.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			db, err := openReadOnlyDB(cmd.Context(), dbPath)
			if err != nil {
				return err
			}
			defer db.Close()
			violations, err := audit(cmd.Context(), db, time.Now(), !inFlight)
			if err != nil {
				return err
			}
			return printAudit(cmd.OutOrStdout(), violations, !inFlight)
		},
	}
	cmd.Flags().StringVar(&dbPath, "db", "retrysafe.db", "SQLite file or postgres:// URL")
	cmd.Flags().BoolVar(&inFlight, "in-flight", false, "skip the invariants that hold only once the system is quiet")
	return cmd
}
