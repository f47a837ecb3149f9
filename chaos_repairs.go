// Chaos with repairs (chaos --repairs N): the evidence that the operator's
// way back (repair.go) holds when the process running it dies or stalls
// mid-repair. A repair is a process like any other: SIGKILL can land
// between its transaction and its output, SIGSTOP can hold it, holding the
// write lock or a row, while the workers go on. Without this run nothing
// showed that a repair retried after a kill does its work once: an event
// put back twice, a poison message delivered to its consumer twice, a
// compensation run twice, a refund sent twice.
//
// Set-aside windows make the work: the run's relays and workers are
// stopped and replaced, for a few seconds, by processes started with
// --set-aside, whose publishes, consumer applies, saga step effects and
// processor answers fail (setAsideFaults), as a broken broker, a consumer's
// broken dependency or a processor that loses its answers would; every
// clock runs ahead meanwhile, so that their retries run out in seconds.
// What they claimed ends set aside: failed outbox events, poison messages,
// compensation_failed sagas, refunds the completer gave up on. Then the
// cause is "fixed" (the usual processes come back) and an operator runs
// every repair, each as a process of its own that the run may SIGKILL (and
// run again, as an operator would) or SIGSTOP past every lease. When the
// load is done, the operator repairs until nothing is set aside; then
// check must pass and every repaired row must be in its repaired state.

package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// setAsideFaults is the fault hook of a process started with --set-aside:
// it fails where a broken dependency would, so that what the process works
// on is tried until it is set aside for an operator. Every failure is an
// ordinary (transient) error, not a crash.
func setAsideFaults(ctx context.Context, point faultPoint) error {
	switch point {
	case faultPublish:
		return errors.New("broker unreachable (set aside by the chaos run)")
	case faultConsumerApply:
		return errors.New("the consumer's database is read-only (set aside by the chaos run)")
	case faultAfterStepEffect:
		return errors.New("the stock service is down (set aside by the chaos run)")
	case faultProcessorLoseResponse:
		return errors.New("connection reset by the card processor (set aside by the chaos run)")
	}
	return nil
}

// setAsideWindow is how long the --set-aside processes run in one window,
// and setAsideClockStep how far every clock moves at each of its
// clockFileRefresh*4 steps: about 2 minutes of process time in 3 seconds,
// past maxPublishAttempts publishes (relayBackoff at chaosLeaseScale),
// maxDeliveries deliveries and maxCompensationAttempts compensations
// (consumeBackoff and sagaBackoff, which no lease scale shortens).
// setAsideWindowSlow is the window on PostgreSQL or NATS, whose passes are
// slower, and whose redeliveries (after a nak's delay) follow the NATS
// server's clock, which no clock file moves: 1+2+4+8 s for maxDeliveries.
const (
	setAsideQueueUp    = time.Second
	setAsideWindow     = 3 * time.Second
	setAsideWindowSlow = 20 * time.Second
	setAsideClockStep  = 8 * time.Second
)

// chaosRepairCounts is what the repairs of a run did, for the closing
// table.
type chaosRepairCounts struct {
	Windows int
	// SetAside counts what the operator found set aside, by kind, over
	// every round.
	FailedEvents, PoisonMessages, ParkedSagas, UnfinishedRefunds int
	// Runs are repair processes started; Killed, those SIGKILLed
	// mid-repair (and run again); Paused, those SIGSTOPped past every
	// lease.
	Runs, Killed, Paused int
	// Logged counts repair_log rows by action.
	Logged map[repairAction]int
}

// chaosOperator runs the repairs of a chaos run.
type chaosOperator struct {
	binary string
	// args are --db and the clock flags every repair process gets; broker,
	// --broker and --nats-stream for inbox replay on NATS.
	args, broker []string
	log          io.Writer
	leases       leaseTimes
	rng          *rand.Rand
	counts       *chaosRepairCounts
	violation    func(format string, args ...any)
}

// setAsideKinds counts what is set aside now: failed outbox events, poison
// messages of broker consumers (a webhook kept as poison is the run's own
// hostile webhook, which no replay can deliver), compensation_failed
// sagas and unfinished refund keys no request holds.
func setAsideKinds(ctx context.Context, db *sql.DB, now time.Time, refundLock time.Duration) (events, poison int, sagas []string, refunds int, err error) {
	err = db.QueryRowContext(ctx, `
		SELECT (SELECT COUNT(*) FROM outbox_events WHERE status = 'failed'),
		       (SELECT COUNT(*) FROM inbox_messages WHERE status = 'poison' AND consumer IN (?, ?))`,
		paymentServiceConsumer, orderServiceConsumer).Scan(&events, &poison)
	if err != nil {
		return 0, 0, nil, 0, fmt.Errorf("count what is set aside: %w", err)
	}
	parked, err := listSagas(ctx, db, sagaCompensationFailed)
	if err != nil {
		return 0, 0, nil, 0, err
	}
	for _, s := range parked {
		sagas = append(sagas, s.SagaID)
	}
	unfinished, err := listUnfinishedRefunds(ctx, db, now, refundLock)
	if err != nil {
		return 0, 0, nil, 0, err
	}
	for _, r := range unfinished {
		if !r.Held && r.OrderID != "" {
			refunds++
		}
	}
	return events, poison, sagas, refunds, nil
}

// round runs every repair once on what is set aside now: outbox retry,
// inbox replay, saga resume for each parked saga, refund finish. With
// faults, each repair process may be SIGKILLed (and run again) or paused.
// It returns how many things it found set aside.
func (o *chaosOperator) round(ctx context.Context, db *sql.DB, now time.Time, faults bool) (int, error) {
	events, poison, sagas, refunds, err := setAsideKinds(ctx, db, now, refundLockTimeout)
	if err != nil {
		return 0, err
	}
	o.counts.FailedEvents += events
	o.counts.PoisonMessages += poison
	o.counts.ParkedSagas += len(sagas)
	o.counts.UnfinishedRefunds += refunds
	operator := []string{"--operator", "chaos-operator"}
	// With faults, every repair runs each round, set aside or not: a kill
	// or a pause of one that finds nothing must not harm either.
	if events > 0 || faults {
		o.repair(ctx, faults, append([]string{"outbox", "retry", "--all-failed"}, operator...))
	}
	if poison > 0 || faults {
		// Consumer by consumer: a webhook kept as poison is not the
		// broker's to deliver again, and --all-poison alone would refuse.
		for _, c := range []string{paymentServiceConsumer, orderServiceConsumer} {
			o.repair(ctx, faults, append(append([]string{"inbox", "replay", "--all-poison", "--consumer", c}, operator...), o.broker...))
		}
	}
	for _, sagaID := range sagas {
		o.repair(ctx, faults, append([]string{"saga", "resume", sagaID}, operator...))
	}
	if refunds > 0 || faults {
		o.repair(ctx, faults, append([]string{"refund", "finish"}, operator...))
	}
	return events + poison + len(sagas) + refunds, nil
}

// repairRefusedNothingLeft are the messages of a repair that found nothing
// left to repair: the run before it was killed after its commit, or a
// worker moved the row on meanwhile. An operator reads them as done.
var repairRefusedNothingLeft = []string{
	"no outbox event is failed",
	"no message is poison",
	"has no inbox record",
	"not compensation_failed",
	"only a saga whose compensation failed is resumed",
}

// repair runs one repair command until a run of it finishes: an operator
// whose repair was killed runs it again. With faults, a run is SIGKILLed
// after a random moment (a third of the runs, at most three in a row) or
// SIGSTOPped past every lease and continued (another third). A run that
// finishes must succeed or be refused for having nothing left to do;
// anything else is a violation.
func (o *chaosOperator) repair(ctx context.Context, faults bool, args []string) {
	for attempt := 1; ctx.Err() == nil; attempt++ {
		fate := 0
		if faults && attempt <= 3 {
			fate = o.rng.IntN(3)
		}
		delay := time.Duration(o.rng.IntN(300)) * time.Millisecond
		pause := pauseLength(o.rng, o.leases)
		var out bytes.Buffer
		cmd := exec.Command(o.binary, append(append([]string(nil), args...), o.args...)...)
		cmd.Stdout = io.MultiWriter(&out, o.log)
		cmd.Stderr = cmd.Stdout
		if err := cmd.Start(); err != nil {
			o.violation("start %s: %v", strings.Join(args, " "), err)
			return
		}
		o.counts.Runs++
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		var err error
		killed, paused := false, false
		switch fate {
		case 1:
			select {
			case err = <-done:
			case <-time.After(delay):
				cmd.Process.Kill()
				<-done
				killed = true
				o.counts.Killed++
			}
		case 2:
			select {
			case err = <-done:
			case <-time.After(delay):
				cmd.Process.Signal(syscall.SIGSTOP)
				paused = true
				o.counts.Paused++
				time.Sleep(pause)
				cmd.Process.Signal(syscall.SIGCONT)
				err = <-done
			}
		default:
			err = <-done
		}
		if killed {
			continue
		}
		if err != nil && (unavailable(out.String()) || paused && timedOut(out.String())) && attempt < 20 {
			// An outage, a paused process holding SQLite's write lock
			// past busy_timeout, or a call (to NATS) whose deadline ran
			// out while this process was paused: the operator tries again.
			time.Sleep(time.Second)
			continue
		}
		if err != nil && !refusedAsDone(out.String()) && !onlyOthersSetAside(out.String()) {
			o.violation("%s: %v\n%s", strings.Join(args, " "), err, out.String())
		}
		return
	}
}

// refusedAsDone reports whether a repair's output says it found nothing
// left to repair.
func refusedAsDone(output string) bool {
	for _, message := range repairRefusedNothingLeft {
		if strings.Contains(output, message) {
			return true
		}
	}
	return false
}

// onlyOthersSetAside reports whether a repair's output says it committed
// and its audit then found only failed events: set aside by a window, for
// the operator's next repair, not a fault of this one.
func onlyOthersSetAside(output string) bool {
	if !strings.Contains(output, "the repair is committed, but check fails") {
		return false
	}
	for _, line := range strings.Split(output, "\n") {
		if strings.Contains(line, "VIOLATION ") && !strings.Contains(line, "VIOLATION "+failedEventsInvariant) {
			return false
		}
	}
	return true
}

// timedOut reports whether a repair's output says a call's deadline ran
// out: a fault of its own unless the process was paused past it.
func timedOut(output string) bool {
	return strings.Contains(output, "context deadline exceeded")
}

// unavailable reports whether a repair's output says the database could
// not be reached or locked: SQLite's busy_timeout ran out, or PostgreSQL
// terminated the connection (an outage).
func unavailable(output string) bool {
	return strings.Contains(output, "database is locked") || strings.Contains(output, "SQLITE_BUSY") ||
		strings.Contains(output, "57P01") || strings.Contains(output, "connection refused") ||
		strings.Contains(output, "unexpected EOF")
}

// bench stops p (SIGTERM, as a deploy would) and keeps it stopped: the
// kill nemesis restarts only processes that are not benched.
func (p *chaosProcess) bench() {
	p.mu.Lock()
	p.benched = true
	p.mu.Unlock()
	p.stop()
}

// unbench starts p again.
func (p *chaosProcess) unbench(binary string) error {
	p.mu.Lock()
	p.benched = false
	p.mu.Unlock()
	return p.start(binary)
}

// runSetAsideWindow replaces benched (the run's relays, or its workers) by
// setAside, a --set-aside process, for window while every clock runs
// ahead, then brings them back.
//
// In a workers' window the serves are SIGKILLed once as it opens: a refund
// request in flight is abandoned, and the set-aside worker's completer,
// whose processor answers are lost, gives up on it.
func runSetAsideWindow(ctx context.Context, binary string, clock *chaosClock, window time.Duration, benched []*chaosProcess, setAside *chaosProcess, killed []*chaosProcess) error {
	var wg sync.WaitGroup
	for _, p := range benched {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.bench()
		}()
	}
	wg.Wait()
	// Work queues up for the set-aside process meanwhile: the clients'
	// new orders' events with the workers benched, new orders with the
	// relays benched.
	select {
	case <-ctx.Done():
	case <-time.After(setAsideQueueUp):
	}
	if err := setAside.start(binary); err != nil {
		return err
	}
	for _, p := range killed {
		p.kill()
		if err := p.start(binary); err != nil {
			return err
		}
	}
	for end := time.Now().Add(window); time.Now().Before(end) && ctx.Err() == nil; {
		if err := clock.advance(setAsideClockStep); err != nil {
			return err
		}
	}
	setAside.stop()
	for _, p := range benched {
		if err := p.unbench(binary); err != nil {
			return err
		}
	}
	return nil
}

// finishRepairs repairs, without faults, until nothing is set aside twice
// in a row (a replayed message may start a saga that a repair must then
// finish), for at most chaosGiveUp. The processes must be running.
func (o *chaosOperator) finishRepairs(ctx context.Context, db *sql.DB, now func() time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, chaosGiveUp)
	defer cancel()
	clean := 0
	for clean < 2 {
		found, err := o.round(ctx, db, now(), false)
		if err != nil {
			return err
		}
		if found == 0 {
			clean++
		} else {
			clean = 0
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("still %d things set aside after repairing for %s", found, chaosGiveUp)
		case <-time.After(time.Second):
		}
	}
	return nil
}

// auditRepairs checks that every repair the run logged left its row in
// the state it repairs to, and counts the repairs by action. (That each
// repair's effect happened once, not twice, is what check's invariants
// say of the money, the stock and the inbox.)
func auditRepairs(ctx context.Context, db *sql.DB, counts *chaosRepairCounts) ([]string, error) {
	counts.Logged = map[repairAction]int{}
	rows, err := db.QueryContext(ctx, `SELECT action, COUNT(*) FROM repair_log GROUP BY action`)
	if err != nil {
		return nil, fmt.Errorf("count repairs: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var action repairAction
		var n int
		if err := rows.Scan(&action, &n); err != nil {
			return nil, fmt.Errorf("count repairs: %w", err)
		}
		counts.Logged[action] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("count repairs: %w", err)
	}
	var found []string
	for _, c := range []struct{ what, query string }{
		{"an event retried is published", `
			SELECT r.target || ' is ' || e.status FROM repair_log r JOIN outbox_events e ON e.event_id = r.target
			WHERE r.action = 'outbox retry' AND e.status <> 'published'`},
		{"a message replayed is applied", `
			SELECT r.target || ' is ' || COALESCE(i.status, 'not in the inbox') FROM repair_log r
			LEFT JOIN inbox_messages i ON i.consumer || '/' || i.message_id = r.target
			WHERE r.action = 'inbox replay' AND COALESCE(i.status, '') <> 'done'`},
		{"a saga resumed is compensated", `
			SELECT r.target || ' is ' || s.status FROM repair_log r JOIN saga_instances s ON s.saga_id = r.target
			WHERE r.action = 'saga resume' AND s.status <> 'compensated'`},
		{"a refund finished is finished", `
			SELECT r.target || ' is at ' || k.recovery_point FROM repair_log r
			JOIN idempotency_keys k ON k.user_id || '/' || k.idempotency_key = r.target
			WHERE r.action = 'refund finish' AND r.result LIKE '%; finished' AND k.recovery_point <> 'finished'`},
	} {
		rows, err := db.QueryContext(ctx, c.query)
		if err != nil {
			return nil, fmt.Errorf("check that %s: %w", c.what, err)
		}
		for rows.Next() {
			var detail string
			if err := rows.Scan(&detail); err != nil {
				rows.Close()
				return nil, fmt.Errorf("check that %s: %w", c.what, err)
			}
			found = append(found, fmt.Sprintf("after repairs, %s: %s", c.what, detail))
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return nil, fmt.Errorf("check that %s: %w", c.what, err)
		}
	}
	return found, nil
}
