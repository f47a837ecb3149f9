// Chaos: the evidence that the design holds when processes die at the worst
// moment. serve, relay and worker run as separate processes on one database
// file; concurrent clients create orders (some declined, some with the
// timeout card, some refunded twice) and retry with the same key on every
// error; meanwhile processes are SIGKILLed at random and restarted. When
// everything is quiet, the database is audited (see check.go) and every
// answer a client got is checked against it.
//
// The same code runs as 'retrysafe chaos' and as the torture test.

package main

import (
	"context"
	"encoding/json"
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
	// OnNATS is set when the run used NATS JetStream, whose dedupes and
	// redeliveries the database does not see.
	OnNATS bool
}

// failed reports whether anything went wrong.
func (r chaosReport) failed() bool {
	return len(r.Violations) > 0 || len(r.ClientViolations) > 0 || r.ServerErrors > 0
}

// chaosOrder is one client's order in the schedule.
type chaosOrder struct {
	index       int
	key         string
	body        string
	refund      bool
	retryAnyway bool
	apiKey      string
	userID      string
	gotOrderID  string
	refundBody  []byte
}

// chaosUsers are the run's callers: two users, so a key is also checked to
// stay with its owner.
var chaosUsers = []struct{ userID, apiKey string }{
	{"user-42", "sk_chaos_42"},
	{"user-7", "sk_chaos_7"},
}

// chaosSchedule returns the orders of a run, the same for the same seed.
func chaosSchedule(cfg chaosConfig) []*chaosOrder {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5eed))
	orders := make([]*chaosOrder, cfg.Orders)
	for i := range orders {
		paymentMethod := pmCardVisa
		switch roll := rng.IntN(100); {
		case roll < 15:
			paymentMethod = pmCardDeclined
		case roll < 30:
			paymentMethod = pmCardTimeout
		}
		sku := []string{"sku-1", "sku-2"}[rng.IntN(2)]
		if rng.IntN(100) < 3 {
			sku = "sku-rare"
		}
		user := chaosUsers[rng.IntN(len(chaosUsers))]
		orders[i] = &chaosOrder{
			index: i,
			// Both users use the same key names: a key must never cross users.
			key:         fmt.Sprintf("chaos-%d-%d", cfg.Seed, i/2),
			body:        fmt.Sprintf(`{"amount_cents":%d,"currency":"usd","items":[{"sku":%q,"qty":%d}],"payment_method":%q}`, 100+rng.IntN(9900), sku, 1+rng.IntN(3), paymentMethod),
			refund:      paymentMethod == pmCardVisa && rng.IntN(100) < 15,
			retryAnyway: rng.IntN(100) < 20,
			apiKey:      user.apiKey,
			userID:      user.userID,
		}
		if i%2 == 1 {
			// The pair shares a key name: give the second the other user.
			other := chaosUsers[0]
			if orders[i-1].userID == other.userID {
				other = chaosUsers[1]
			}
			orders[i].apiKey, orders[i].userID = other.apiKey, other.userID
		}
	}
	return orders
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
}

// start starts the process. It returns once the process runs.
func (p *chaosProcess) start(binary string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
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
// order (and sku-rare short, so some orders are cancelled for stock).
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
		UPDATE stock_items SET available = CASE sku WHEN 'sku-rare' THEN 20 ELSE 1000000 END,
		                       stocked   = CASE sku WHEN 'sku-rare' THEN 20 ELSE 1000000 END`)
	if err != nil {
		return fmt.Errorf("stock the warehouse: %w", err)
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
	report := chaosReport{Orders: cfg.Orders, OnNATS: cfg.BrokerURL != ""}

	if err := checkBrokerURL(cfg.BrokerURL); err != nil {
		return report, err
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

	var apiKeys []string
	for _, user := range chaosUsers {
		apiKeys = append(apiKeys, user.userID+":"+user.apiKey)
	}
	common := []string{"--db", cfg.DBPath, "--lease-scale=" + strconv.FormatFloat(chaosLeaseScale, 'f', -1, 64)}
	if cfg.BrokerURL != "" {
		// A stream of this run's own: nothing left in it by another run.
		stream := fmt.Sprintf("CHAOS%d_%d", cfg.Seed, time.Now().UnixNano())
		common = append(common, "--broker", cfg.BrokerURL, "--nats-stream", stream)
		defer deleteNATSStream(log, cfg.BrokerURL, stream)
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
			env:  []string{"RETRYSAFE_API_KEYS=" + strings.Join(apiKeys, ",")}, log: log})
	}
	for i := range cfg.Relays {
		processes = append(processes, &chaosProcess{name: fmt.Sprintf("relay-%d", i), args: append([]string{"relay"}, common...), log: log})
	}
	for i := range cfg.Workers {
		processes = append(processes, &chaosProcess{name: fmt.Sprintf("worker-%d", i), args: append([]string{"worker"}, common...), log: log})
	}
	for _, p := range processes {
		if err := p.start(cfg.Binary); err != nil {
			return report, err
		}
	}
	defer func() {
		for _, p := range processes {
			p.stop()
		}
	}()

	client := &http.Client{
		Timeout:   3 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Clients},
	}
	for _, base := range bases {
		if err := waitHealthy(ctx, client, base); err != nil {
			return report, err
		}
	}

	orders := chaosSchedule(cfg)
	var c chaosCounters
	var violationsMu sync.Mutex
	clientViolation := func(format string, args ...any) {
		violationsMu.Lock()
		defer violationsMu.Unlock()
		report.ClientViolations = append(report.ClientViolations, fmt.Sprintf(format, args...))
	}

	// The clients.
	queue := make(chan *chaosOrder)
	var clients sync.WaitGroup
	var finished atomic.Int64
	for range cfg.Clients {
		clients.Add(1)
		go func() {
			defer clients.Done()
			for order := range queue {
				runChaosOrder(ctx, client, bases[order.index%len(bases)], order, &c, clientViolation)
				finished.Add(1)
			}
		}()
	}

	// The killer: SIGKILL a random process, restart it, until cfg.Kills.
	loadDone := make(chan struct{})
	killerDone := make(chan struct{})
	var kills atomic.Int64
	go func() {
		defer close(killerDone)
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
				clientViolation("restart %s: %v", victim.name, err)
				return
			}
		}
	}()

	// Progress, until the load is done.
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		ticker := time.NewTicker(250 * time.Millisecond)
		defer ticker.Stop()
		for tick := 1; ; tick++ {
			select {
			case <-loadDone:
				printChaosProgress(cfg.Progress, tick, int(finished.Load()), cfg.Orders, int(kills.Load()), cfg.Kills, true)
				return
			case <-ticker.C:
				printChaosProgress(cfg.Progress, tick, int(finished.Load()), cfg.Orders, int(kills.Load()), cfg.Kills, false)
			}
		}
	}()

	for _, order := range orders {
		select {
		case queue <- order:
		case <-ctx.Done():
		}
	}
	close(queue)
	clients.Wait()
	<-killerDone
	close(loadDone)
	<-progressDone
	report.Kills = int(kills.Load())
	if ctx.Err() != nil {
		return report, fmt.Errorf("the run did not finish within %s", cfg.Duration)
	}

	// Every process is up again; wait until the system is quiet.
	if err := waitQuiet(ctx, cfg.DBPath); err != nil {
		return report, err
	}
	for _, p := range processes {
		p.stop()
	}

	report.Requests, report.Retries, report.Replays = c.requests.Load(), c.retries.Load(), c.replays.Load()
	report.ServerErrors, report.Unavailable = c.serverErrors.Load(), c.unavailable.Load()
	if err := auditChaos(ctx, cfg.DBPath, orders, &report); err != nil {
		return report, err
	}
	report.Elapsed = time.Since(start)
	return report, nil
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

// chaosCounters counts what the clients saw.
type chaosCounters struct {
	requests, retries, replays, serverErrors, unavailable atomic.Int64
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

// chaosAnswer is one HTTP exchange.
type chaosAnswer struct {
	status   int
	body     []byte
	replayed bool
}

// chaosPost sends one request and counts it.
func chaosPost(ctx context.Context, client *http.Client, method, url, apiKey, key, body string, c *chaosCounters) (chaosAnswer, error) {
	c.requests.Add(1)
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return chaosAnswer{}, err
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := client.Do(req)
	if err != nil {
		return chaosAnswer{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return chaosAnswer{}, err
	}
	answer := chaosAnswer{status: resp.StatusCode, body: data, replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	if answer.replayed {
		c.replays.Add(1)
	}
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable:
		c.unavailable.Add(1)
	case resp.StatusCode >= 500:
		c.serverErrors.Add(1)
	}
	return answer, nil
}

// untilDefinitive sends a request with the same key until it gets an answer
// that is not a transient failure, as a careful client does.
func untilDefinitive(ctx context.Context, client *http.Client, method, url, apiKey, key, body string, c *chaosCounters) (chaosAnswer, error) {
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			c.retries.Add(1)
			select {
			case <-ctx.Done():
				return chaosAnswer{}, ctx.Err()
			case <-time.After(time.Duration(min(20*attempt, 250)) * time.Millisecond):
			}
		}
		answer, err := chaosPost(ctx, client, method, url, apiKey, key, body, c)
		if err != nil || answer.status >= 500 || isRetriableConflict(answer) {
			// A timeout, a dropped connection (the server was killed), a
			// transient failure, or a 409 that says "not yet": retry.
			continue
		}
		return answer, nil
	}
}

// isRetriableConflict reports whether answer is a 409 that asks the client
// to come back (a request in progress, a payment in flight), as opposed to
// a stored, definitive refusal.
func isRetriableConflict(answer chaosAnswer) bool {
	if answer.status != http.StatusConflict {
		return false
	}
	var p problem
	if err := json.Unmarshal(answer.body, &p); err != nil {
		return false
	}
	return p.Type == problemKeyInProgress || p.Type == problemPaymentPending
}

// runChaosOrder plays one client: create the order, maybe retry a success,
// maybe refund it twice with one key.
func runChaosOrder(ctx context.Context, client *http.Client, base string, order *chaosOrder, c *chaosCounters, violation func(string, ...any)) {
	created, err := untilDefinitive(ctx, client, "POST", base+"/api/orders", order.apiKey, order.key, order.body, c)
	if err != nil {
		violation("%s %s: never got an answer: %v", order.userID, order.key, err)
		return
	}
	if created.status != http.StatusCreated {
		violation("%s %s: got %d %s, want 201", order.userID, order.key, created.status, created.body)
		return
	}
	order.gotOrderID = orderField(created.body, "order_id")
	if order.retryAnyway {
		again, err := untilDefinitive(ctx, client, "POST", base+"/api/orders", order.apiKey, order.key, order.body, c)
		if err == nil && (again.status != http.StatusCreated || string(again.body) != string(created.body) || !again.replayed) {
			violation("%s %s: retry got %d %s, want the replayed %s", order.userID, order.key, again.status, again.body, created.body)
		}
	}
	if !order.refund {
		return
	}
	refundURL := base + refundPath(order.gotOrderID)
	refundKey := "refund-" + order.key
	first, err := untilDefinitive(ctx, client, "POST", refundURL, order.apiKey, refundKey, `{}`, c)
	if err != nil {
		violation("%s %s: refund never got an answer: %v", order.userID, order.key, err)
		return
	}
	second, err := untilDefinitive(ctx, client, "POST", refundURL, order.apiKey, refundKey, `{}`, c)
	if err != nil {
		violation("%s %s: second refund never got an answer: %v", order.userID, order.key, err)
		return
	}
	// A paid order is refunded; one cancelled for want of stock is refused
	// for good. Either way the retry gets the very same answer.
	if (first.status != http.StatusOK && first.status != http.StatusConflict) || second.status != first.status ||
		string(first.body) != string(second.body) || !second.replayed {
		violation("%s %s: refunds got %d %s and %d %s, want one answer, then its replay", order.userID, order.key, first.status, first.body, second.status, second.body)
		return
	}
	if first.status == http.StatusOK {
		order.refundBody = first.body
	}
}

// waitQuiet waits until no work is left: every event published and
// delivered, every saga terminal, every key finished.
func waitQuiet(ctx context.Context, path string) error {
	db, err := openReadOnlyDB(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	quietFor := 0
	for {
		var pending int
		err := db.QueryRowContext(ctx, `
			SELECT (SELECT COUNT(*) FROM outbox_events WHERE status = 'pending')
			     + (SELECT COUNT(*) FROM broker_deliveries WHERE status = 'pending')
			     + (SELECT COUNT(*) FROM saga_instances WHERE status IN ('in_progress', 'compensating'))
			     + (SELECT COUNT(*) FROM idempotency_keys WHERE recovery_point <> 'finished')
			     + (SELECT COUNT(*) FROM orders WHERE status = 'created')`).Scan(&pending)
		switch {
		case err != nil && ctx.Err() != nil:
			return errors.New("the system did not become quiet in time")
		case err == nil && pending == 0:
			quietFor++
			if quietFor == 3 {
				return nil
			}
		default:
			quietFor = 0
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the system did not become quiet in time (%d things pending)", pending)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// auditChaos checks the quiet database: every invariant, and every answer a
// client got.
func auditChaos(ctx context.Context, path string, orders []*chaosOrder, report *chaosReport) error {
	db, err := openDB(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	report.Violations, err = audit(ctx, db, time.Now(), true)
	if err != nil {
		return err
	}
	report.Invariants = len(invariants(sqliteDialect()))

	for _, order := range orders {
		if order.gotOrderID == "" {
			continue
		}
		report.Created++
		var n int
		err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders WHERE order_id = ? AND user_id = ? AND idempotency_key = ?`,
			order.gotOrderID, order.userID, order.key).Scan(&n)
		if err != nil {
			return err
		}
		if n != 1 {
			report.ClientViolations = append(report.ClientViolations, fmt.Sprintf("%s %s: order %s the client got exists %d times", order.userID, order.key, order.gotOrderID, n))
		}
		if order.refundBody != nil {
			report.Refunded++
		}
	}
	var orderCount int
	if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&orderCount); err != nil {
		return err
	}
	if orderCount != report.Created {
		report.ClientViolations = append(report.ClientViolations, fmt.Sprintf("%d orders exist but clients were answered 201 for %d keys", orderCount, report.Created))
	}
	return db.QueryRowContext(ctx, `
		SELECT (SELECT COALESCE(SUM(delivery_count - 1), 0) FROM broker_deliveries),
		       (SELECT COALESCE(SUM(duplicates), 0) FROM broker_messages),
		       (SELECT COALESCE(SUM(duplicates), 0) FROM inbox_messages),
		       (SELECT COALESCE(SUM(key_hits), 0) FROM processor_charges) + (SELECT COALESCE(SUM(key_hits), 0) FROM processor_refunds),
		       (SELECT COUNT(*) FROM orders WHERE status = 'paid'),
		       (SELECT COUNT(*) FROM orders WHERE status = 'cancelled'),
		       (SELECT COUNT(*) FROM orders WHERE status = 'refunded')`,
	).Scan(&report.Redeliveries, &report.BrokerDedupes, &report.InboxSkips, &report.ProcessorKeyHits,
		&report.Paid, &report.Cancelled, &report.RefundedOrders)
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

// printChaosProgress draws a one-line progress bar: redrawn in place on a
// terminal, a new line every 20th call elsewhere (a log, a pipe).
func printChaosProgress(w io.Writer, tick, done, total, kills, totalKills int, last bool) {
	if w == nil {
		return
	}
	terminal := isTerminal(w)
	if !terminal && !last && tick%20 != 0 {
		return
	}
	const width = 30
	filled := width * done / max(total, 1)
	end := "\n"
	if terminal && !last {
		end = "\r"
	}
	fmt.Fprintf(w, "[%s%s] %d/%d orders, %d/%d kills%s", strings.Repeat("#", filled), strings.Repeat(".", width-filled), done, total, kills, totalKills, end)
}

// printChaosReport writes the closing table.
func printChaosReport(w io.Writer, r chaosReport) {
	row := func(name string, value any) { fmt.Fprintf(w, "  %-44s %v\n", name, value) }
	fmt.Fprintln(w, "\nchaos run")
	row("orders (paid / cancelled / refunded)", fmt.Sprintf("%d (%d / %d / %d)", r.Orders, r.Paid, r.Cancelled, r.RefundedOrders))
	row("HTTP requests", r.Requests)
	row("client retries", r.Retries)
	row("processes SIGKILLed and restarted", r.Kills)
	row("503 answers (transient, no outcome stored)", r.Unavailable)
	row("500 answers", r.ServerErrors)
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
		Short: "Run serve, relay and worker as processes, drive orders at them, SIGKILL them at random, then audit",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if cfg.Orders <= 0 || cfg.Clients <= 0 || cfg.Kills < 0 || cfg.Duration <= 0 || cfg.Serves <= 0 || cfg.Relays <= 0 || cfg.Workers <= 0 {
				return errors.New("--orders, --clients, --duration, --serves, --relays and --workers must be positive, --kills not negative")
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
			cfg.Progress = cmd.OutOrStdout()
			broker := "the embedded broker"
			if cfg.BrokerURL != "" {
				broker = cfg.BrokerURL
			}
			fmt.Fprintf(cmd.OutOrStdout(), "chaos: %d orders from %d clients to %d serve, %d relay and %d worker processes on %s; %d kills, seed %d, database %s, process log %s\n",
				cfg.Orders, cfg.Clients, cfg.Serves, cfg.Relays, cfg.Workers, broker, cfg.Kills, cfg.Seed, redactURL(cfg.DBPath), cfg.LogPath)
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
	cmd.Flags().StringVar(&cfg.BrokerURL, "broker", "", "NATS JetStream URL instead of the embedded broker")
	return cmd
}
