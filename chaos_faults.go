// Chaos faults beyond SIGKILL: the nemeses a lease-based design must also
// survive (Jepsen's pause nemesis, Kleppmann's "a lease is not a lock").
// SIGKILL only ever produces a process that is gone; these produce one that
// comes back:
//
//	pause   SIGSTOP a process for longer than any of its leases, then SIGCONT:
//	        it wakes up believing it still owns what others took over
//	outage  the database refuses every process for longer than MaxDeliver x
//	        AckWait; a private NATS server is restarted meanwhile
//	clock   every process's clock jumps past idempotencyKeyTTL, so clients
//	        reuse keys that have expired; one worker runs ahead of the others
//
// The processes learn the clock from a file (the hidden --clock-file flag);
// nothing here is used outside the chaos run.

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// clockFileRefresh is how often a process re-reads its clock file. The
// orchestrator holds time-stamped requests (signed webhooks) back for
// longer than this around a jump, so no process checks a signature against
// the old time after the orchestrator signed with the new one.
const clockFileRefresh = 50 * time.Millisecond

// clockJump is how far one clock jump moves every process: past
// idempotencyKeyTTL, so every key made before the jump has expired.
const clockJump = idempotencyKeyTTL + time.Hour

// fileClock returns a clock that runs ahead of the wall clock by skew plus
// the duration written in path (Go syntax, "25h"), re-read at most every
// clockFileRefresh. A file that is missing or unreadable leaves the last
// offset in place: the orchestrator replaces it atomically, so this happens
// only before its first write.
func fileClock(path string, skew time.Duration) func() time.Time {
	var mu sync.Mutex
	var offset time.Duration
	var readAt time.Time
	return func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		now := time.Now()
		if path != "" && now.Sub(readAt) >= clockFileRefresh {
			readAt = now
			if data, err := os.ReadFile(path); err == nil {
				if d, err := time.ParseDuration(strings.TrimSpace(string(data))); err == nil {
					offset = d
				}
			}
		}
		return now.Add(skew + offset)
	}
}

// processClock returns the clock of a serve, relay or worker process: the
// wall clock unless the chaos run gave it --clock-file or --clock-skew.
func processClock(clockFile string, skew time.Duration) func() time.Time {
	if clockFile == "" && skew == 0 {
		return nil
	}
	return fileClock(clockFile, skew)
}

// chaosClock is the orchestrator's side of the processes' clock: the offset
// it has written, and a lock that signers of time-stamped requests hold so
// that a jump never falls between signing and checking.
type chaosClock struct {
	path string
	// stamping is held for reading while a signed request is on its way,
	// for writing during a jump.
	stamping sync.RWMutex
	mu       sync.Mutex
	offset   time.Duration
	// jumps counts the jumps written to the file; settled, those that every
	// running process has read since (a process re-reads the file at most
	// every clockFileRefresh, so for that long it may still stamp a key
	// with the old time).
	jumps, settled int
}

// newChaosClock writes a zero offset to dir/clock and returns the clock.
func newChaosClock(dir string) (*chaosClock, error) {
	c := &chaosClock{path: filepath.Join(dir, "clock")}
	return c, c.write(0)
}

// write replaces the clock file atomically with offset.
func (c *chaosClock) write(offset time.Duration) error {
	tmp := c.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(offset.String()), 0o644); err != nil {
		return fmt.Errorf("write the clock file: %w", err)
	}
	if err := os.Rename(tmp, c.path); err != nil {
		return fmt.Errorf("write the clock file: %w", err)
	}
	return nil
}

// now is the time every process (but a skewed one) reads.
func (c *chaosClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.offset)
}

// jump moves every process's clock forward by d and returns once every
// process that is running reads the new time. A paused process reads it as
// soon as it wakes up.
func (c *chaosClock) jump(d time.Duration) error { return c.move(d, true) }

// advance moves every process's clock forward by d, as jump does, without
// counting a jump: d is far short of idempotencyKeyTTL, so no key expires.
func (c *chaosClock) advance(d time.Duration) error { return c.move(d, false) }

// move writes the clock d further on and waits until every running process
// has read it (within clockFileRefresh); a counted jump is counted in jumps
// while it settles and in settled once it has.
func (c *chaosClock) move(d time.Duration, counted bool) error {
	c.stamping.Lock()
	defer c.stamping.Unlock()
	c.mu.Lock()
	offset := c.offset + d
	c.mu.Unlock()
	if err := c.write(offset); err != nil {
		return err
	}
	c.mu.Lock()
	c.offset = offset
	if counted {
		c.jumps++
	}
	c.mu.Unlock()
	time.Sleep(4 * clockFileRefresh)
	if counted {
		c.mu.Lock()
		c.settled++
		c.mu.Unlock()
	}
	return nil
}

// leaseLongest returns the longest lease of leases: a pause must outlast
// it for someone else to take over what the paused process holds.
func leaseLongest(leases leaseTimes) time.Duration {
	return max(leases.saga, leases.relay, leases.ackWait, leases.refundLock)
}

// pauseLength returns how long one pause lasts: past the longest lease,
// with a little jitter so pauses do not end in step.
func pauseLength(rng *rand.Rand, leases leaseTimes) time.Duration {
	return leaseLongest(leases) + time.Second + time.Duration(rng.IntN(2000))*time.Millisecond
}

// outageLength returns how long one database outage lasts: longer than
// MaxDeliver x AckWait (so NATS, left alone, would give up on every message
// that arrived meanwhile) and longer than SQLite's busy_timeout of 10s (so
// a waiting writer fails and its client is answered).
func outageLength(leases leaseTimes) time.Duration {
	return max(time.Duration(maxDeliveries+1)*leases.ackWait, 12*time.Second)
}

// pause stops the process with SIGSTOP for d, then continues it. The
// process keeps its sockets and its leases and wakes up believing it still
// holds them. A process killed meanwhile is simply gone; the SIGCONT then
// reaches nobody.
func (p *chaosProcess) pause(ctx context.Context, d time.Duration) {
	cmd, _ := p.current()
	if cmd == nil {
		return
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return
	}
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	cmd.Process.Signal(syscall.SIGCONT)
}

// chaosFaultCounts counts the injected faults for the closing table.
type chaosFaultCounts struct {
	Pauses, Outages, ClockJumps, NATSRestarts int
	BackendsTerminated                        int
	// BrokerLosses counts the acknowledged messages the broker lost
	// (broker_loss.go).
	BrokerLosses              int
	PauseLength, OutageLength time.Duration
	// OutageWindows are when the outages ran (from the start of the run),
	// so 503 answers can be told apart.
	OutageWindows [][2]time.Duration
	// NATS counts the faults of a NATS cluster (chaos_nats.go), and
	// NATSSyncAlways says whether its servers ran with sync_interval:
	// always.
	NATS           natsClusterFaults
	NATSSyncAlways bool
}

// runPauses pauses random processes until it has made n pauses, at most
// three at a time, never the same process twice at once. It returns when
// every pause has ended.
func runPauses(ctx context.Context, seed uint64, n int, processes []*chaosProcess, leases leaseTimes, counts *chaosFaultCounts) {
	rng := rand.New(rand.NewPCG(seed, 0x57095))
	var wg sync.WaitGroup
	busy := make([]bool, len(processes))
	var mu sync.Mutex
	slots := make(chan struct{}, 3)
	counts.PauseLength = leaseLongest(leases) + time.Second
	for i := 0; i < n; i++ {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case slots <- struct{}{}:
		}
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-time.After(time.Duration(200+rng.IntN(500)) * time.Millisecond):
		}
		mu.Lock()
		victim := rng.IntN(len(processes))
		for busy[victim] {
			victim = (victim + 1) % len(processes)
		}
		busy[victim] = true
		length := pauseLength(rng, leases)
		counts.Pauses++
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			processes[victim].pause(ctx, length)
			mu.Lock()
			busy[victim] = false
			mu.Unlock()
			<-slots
		}()
	}
	wg.Wait()
}

// outage makes the database unavailable to the run's processes for d.
type outage func(ctx context.Context, d time.Duration) (terminated int, err error)

// sqliteOutage holds SQLite's write lock for d from a connection of its
// own (BEGIN IMMEDIATE, then nothing): every writer waits through its
// busy_timeout and fails with SQLITE_BUSY. Readers go on, as they would.
func sqliteOutage(path string) outage {
	return func(ctx context.Context, d time.Duration) (int, error) {
		db, err := openDB(ctx, path)
		if err != nil {
			return 0, err
		}
		defer db.Close()
		conn, err := db.Conn(ctx)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		if _, err := conn.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
			return 0, fmt.Errorf("take the write lock: %w", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
		// A fresh context: the lock must be given back even if the run is over.
		if _, err := conn.ExecContext(context.Background(), `ROLLBACK`); err != nil {
			return 0, fmt.Errorf("release the write lock: %w", err)
		}
		return 0, nil
	}
}

// postgresOutage terminates, again and again for d, every backend of the
// run's processes: those connected to this database under applicationName.
// The server is shared, so nothing else is touched; the processes
// reconnect and are cut off again until the window ends.
func postgresOutage(dbURL, applicationName string) outage {
	return func(ctx context.Context, d time.Duration) (int, error) {
		db, err := connectPostgres(ctx, dbURL)
		if err != nil {
			return 0, err
		}
		defer db.Close()
		terminated := 0
		end := time.Now().Add(d)
		for time.Now().Before(end) && ctx.Err() == nil {
			var n int
			err := db.QueryRowContext(ctx, `
				SELECT COUNT(*) FROM (
					SELECT pg_terminate_backend(pid) FROM pg_stat_activity
					WHERE datname = current_database() AND application_name = ? AND pid <> pg_backend_pid()) t`,
				applicationName).Scan(&n)
			if err != nil && ctx.Err() == nil {
				return terminated, fmt.Errorf("terminate the run's backends: %w", err)
			}
			terminated += n
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
		return terminated, nil
	}
}

// withApplicationName returns the PostgreSQL URL dbURL with its
// application_name set, so that an outage can find the run's backends and
// only those.
func withApplicationName(dbURL, name string) (string, error) {
	u, err := url.Parse(dbURL)
	if err != nil {
		return "", fmt.Errorf("parse database URL %s: %w", redactURL(dbURL), err)
	}
	query := u.Query()
	query.Set("application_name", name)
	u.RawQuery = query.Encode()
	return u.String(), nil
}

// privateNATS is a nats-server the chaos run started for itself on a free
// loopback port, and may therefore stop and start. (The shared server is
// never touched.)
type privateNATS struct {
	binary, addr, storeDir string
	log                    io.Writer
	serverProcess
}

// serverProcess is a server a chaos run started for itself (a nats-server)
// and may stop, kill or pause.
type serverProcess struct {
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// run starts cmd and waits until addr accepts connections; name names the
// server in errors.
func (p *serverProcess) run(ctx context.Context, cmd *exec.Cmd, addr, name string) error {
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	for {
		if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			conn.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s on %s did not start: %w", name, addr, ctx.Err())
		case <-done:
			return fmt.Errorf("%s on %s exited at start (see the process log)", name, addr)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// exited reports whether the process it ran last has exited.
func (p *serverProcess) exited() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// stop shuts the server down (SIGTERM, as an operator's restart does; a
// paused one is continued first), or kills it if it has not within 10 s,
// and waits for it to be gone.
func (p *serverProcess) stop() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGCONT)
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

// kill sends SIGKILL and waits for the process to be gone: nothing it had
// not written reaches its files.
func (p *serverProcess) kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-done
}

// pause stops the process with SIGSTOP for d, then continues it.
func (p *serverProcess) pause(ctx context.Context, d time.Duration) {
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil || cmd.Process.Signal(syscall.SIGSTOP) != nil {
		return
	}
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	cmd.Process.Signal(syscall.SIGCONT)
}

// startPrivateNATS starts binary with JetStream on a free loopback port,
// storing its streams under dir so that a restart keeps them, and waits
// until it accepts connections.
func startPrivateNATS(ctx context.Context, binary, dir string, log io.Writer) (*privateNATS, error) {
	addr, err := freeLoopbackAddr()
	if err != nil {
		return nil, err
	}
	n := &privateNATS{binary: binary, addr: addr, storeDir: filepath.Join(dir, "jetstream"), log: log}
	return n, n.start(ctx)
}

// url is the server's nats:// URL.
func (n *privateNATS) url() string { return "nats://" + n.addr }

// start runs the server and waits until its port accepts connections.
func (n *privateNATS) start(ctx context.Context) error {
	host, port, _ := strings.Cut(n.addr, ":")
	cmd := exec.Command(n.binary, "-a", host, "-p", port, "-js", "-sd", n.storeDir)
	cmd.Stdout, cmd.Stderr = n.log, n.log
	return n.run(ctx, cmd, n.addr, "nats-server")
}

// restart stops the server, leaves it down for down, and starts it again on
// the same port with the same store.
func (n *privateNATS) restart(ctx context.Context, down time.Duration) error {
	n.stop()
	select {
	case <-ctx.Done():
	case <-time.After(down):
	}
	return n.start(ctx)
}

// runOutage runs one outage of length d, restarting the private NATS
// server (if any) in its middle, and records it in counts.
func runOutage(ctx context.Context, start time.Time, d time.Duration, dbOutage outage, nats *privateNATS, ackWait time.Duration, counts *chaosFaultCounts, mu *sync.Mutex) error {
	began := time.Since(start)
	var natsErr error
	var wg sync.WaitGroup
	if nats != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-ctx.Done():
				return
			case <-time.After(d / 3):
			}
			natsErr = nats.restart(ctx, 2*ackWait)
			mu.Lock()
			counts.NATSRestarts++
			mu.Unlock()
		}()
	}
	terminated, err := dbOutage(ctx, d)
	wg.Wait()
	mu.Lock()
	counts.Outages++
	counts.BackendsTerminated += terminated
	counts.OutageWindows = append(counts.OutageWindows, [2]time.Duration{began, time.Since(start)})
	mu.Unlock()
	if err != nil {
		return err
	}
	return natsErr
}

// duringOutage reports whether at (since the run's start) falls in an
// outage window, or within grace after one: a request that waited out the
// outage is answered just after it ends.
func (c *chaosFaultCounts) duringOutage(at, grace time.Duration) bool {
	for _, w := range c.OutageWindows {
		if at >= w[0] && at <= w[1]+grace {
			return true
		}
	}
	return false
}

// jumpCount returns how many jumps the clock has made.
func (c *chaosClock) jumpCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.jumps
}

// settledJumps returns how many jumps every running process has read.
func (c *chaosClock) settledJumps() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.settled
}

// describeNATS says, for a run that did not become quiet, what the NATS
// stream holds and where each of its durable consumers stands, and at which
// stream sequence each of eventIDs is stored (or that it is not): enough to
// tell a message the stream never stored from one a consumer skipped or
// still holds unacked. It reads every message of the stream, which suits a
// chaos run's, not a production one.
func describeNATS(ctx context.Context, url, streamName string, eventIDs []string) string {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	broker, err := openNATSBroker(ctx, url, streamName, ackWait)
	if err != nil {
		return fmt.Sprintf("NATS: %v", err)
	}
	defer broker.close()
	stream, err := broker.js.Stream(ctx, streamName)
	if err != nil {
		return fmt.Sprintf("NATS: stream %s: %v", streamName, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Sprintf("NATS: stream %s: %v", streamName, err)
	}
	var out strings.Builder
	fmt.Fprintf(&out, "NATS stream %s: %d messages, sequences %d to %d\n", streamName, info.State.Msgs, info.State.FirstSeq, info.State.LastSeq)
	consumers := stream.ListConsumers(ctx)
	for c := range consumers.Info() {
		fmt.Fprintf(&out, "  consumer %s: delivered stream seq %d, ack floor %d, %d pending, %d acks pending, %d redelivered, %d pulls waiting\n",
			c.Name, c.Delivered.Stream, c.AckFloor.Stream, c.NumPending, c.NumAckPending, c.NumRedelivered, c.NumWaiting)
	}
	if err := consumers.Err(); err != nil {
		fmt.Fprintf(&out, "  list consumers: %v\n", err)
	}
	wanted := map[string]bool{}
	for _, id := range eventIDs {
		wanted[id] = true
	}
	for seq := info.State.FirstSeq; len(wanted) > 0 && seq > 0 && seq <= info.State.LastSeq; seq++ {
		msg, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			fmt.Fprintf(&out, "  read message %d: %v\n", seq, err)
			break
		}
		if id := msg.Header.Get(jetstream.MsgIDHeader); wanted[id] {
			fmt.Fprintf(&out, "  %s is stored at stream seq %d on %s\n", id, seq, msg.Subject)
			delete(wanted, id)
		}
	}
	for _, id := range eventIDs {
		if wanted[id] {
			fmt.Fprintf(&out, "  %s is not in the stream\n", id)
		}
	}
	return out.String()
}

// unfinishedEventIDs returns the outbox event ids of the orders still
// created (at most 20 orders), for describeNATS.
func unfinishedEventIDs(path string) []string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	db, err := openReadOnlyDB(ctx, path)
	if err != nil {
		return nil
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, `
		SELECT e.event_id FROM outbox_events e
		WHERE e.aggregate_id IN (SELECT order_id FROM orders WHERE status = 'created' ORDER BY order_id LIMIT 20)
		ORDER BY e.seq`)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if rows.Scan(&id) == nil {
			ids = append(ids, id)
		}
	}
	return ids
}
