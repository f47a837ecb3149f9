// The simulator's short faults: a dependency that fails one call and is
// fine again at the next, inside work that is otherwise healthy.
//
// An outage (simulate_faults.go) fails every later call of the work it
// meets: a transaction that saw it rolls back whatever its code decides,
// so code that mistook the outage for the message's fault, or a timeout
// for an answer, was never seen to act on that mistake. Two faults fail
// one call only, and the code's decision then stands:
//
//   - the processor does not answer when it is asked what it did (a
//     refund retrieved to confirm a signed charge.refunded event): it is
//     down, or the call times out (faultProcessorRetrieve). The event must
//     wait, delivered again later, and count nothing until the processor
//     confirms it; a made-up refund counted because the processor could
//     not deny it is a finding (simModel.judgeWebhook);
//   - the database fails one statement of a consumer's effect and the
//     transaction stays usable: the database is busy for a moment. On
//     PostgreSQL that is a serialization failure or a deadlock, which the
//     server draws at every statement of every transaction
//     (simulate_postgres.go); on SQLite, where BEGIN IMMEDIATE leaves no
//     such conflict between our own transactions, the simulator plays it
//     with SQLITE_BUSY ("database is locked"), the driver's own error. The
//     message's savepoint rolls back, and the inbox must count nothing
//     against the message: only the consumer's own code uses up its
//     deliveries (checkFailuresCounted). The same busy statement meets a
//     create inside a group-commit batch that is otherwise healthy, at
//     one of the writes after its key is claimed (busyCreate): only that
//     member's savepoint rolls back, the batch commits the others, and
//     the member's client gets 503 with nothing of it stored, so that its
//     retry creates the order once.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// simTransientCounts count the short faults of a run.
type simTransientCounts struct {
	// ProcessorSilent counts processor retrieves that got no answer;
	// BusyStatements the statements of a consumer's effect that the
	// database failed for a moment; BusyCreates those of a create after
	// its key was claimed.
	ProcessorSilent, BusyStatements, BusyCreates int
}

// add adds other's counts to c.
func (c *simTransientCounts) add(other simTransientCounts) {
	c.ProcessorSilent += other.ProcessorSilent
	c.BusyStatements += other.BusyStatements
	c.BusyCreates += other.BusyCreates
}

// String is the summary line's part.
func (c simTransientCounts) String() string {
	return fmt.Sprintf("%d processor retrieves unanswered, %d statements of a consumer's effect and %d of a create failed busy",
		c.ProcessorSilent, c.BusyStatements, c.BusyCreates)
}

// simTransient is the state of the short faults in a run.
type simTransient struct {
	// busyError is SQLite's SQLITE_BUSY, made once at start-up
	// (sqliteBusyError); nil on PostgreSQL, whose server fails statements
	// itself.
	busyError error
	// busyIn counts down the statements of the running effect; the one
	// that takes it to zero fails. Zero: nothing is armed. It never
	// outlives its transaction (disarmBusy). busyCreate: it was armed in a
	// create (busyCreate), not a consumer's effect.
	busyIn     int
	busyCreate bool
	// ownFailures counts the failures of the broker consumers' own code
	// the simulator made (failingSometimes, and a broken dependency at
	// faultConsumerApply): the most the inbox may count against their
	// messages.
	ownFailures int
}

// Rates of the short faults: per retrieve, and per message a consumer
// applies.
const (
	processorSilentChance = 0.3
	busyEffectChance      = 0.1
	busyCreateChance      = 0.05
)

// processorSilent fails a retrieve at the processor now and then, as a
// processor that is down or slow does: the caller gets a timeout.
func (s *simulation) processorSilent(point faultPoint) error {
	if point != faultProcessorRetrieve || !s.chance(processorSilentChance) {
		return nil
	}
	s.report.Counts.ProcessorSilent++
	s.tracef("a%d %s: the processor does not answer a retrieve", s.current.id, s.current.process.name)
	return errors.New("i/o timeout")
}

// busySometimes returns c with an apply that, now and then, meets the
// database busy at one of its first statements. Nothing on PostgreSQL
// (see the file comment).
func (s *simulation) busySometimes(c consumer) consumer {
	if s.transient.busyError == nil {
		return c
	}
	apply := c.apply
	c.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		if s.quiescing || !s.chance(busyEffectChance) {
			return apply(ctx, tx, msg)
		}
		s.transient.busyIn = 1 + s.rng.IntN(3)
		defer s.disarmBusy()
		return apply(ctx, tx, msg)
	}
	return c
}

// busyCreate, at a create's claimed key (in its transaction, in a group
// commit's batch on SQLite), now and then arms the database busy at one
// of the create's next statements: its order, its OrderCreated event, or
// its completed key. Nothing on PostgreSQL (see the file comment).
func (s *simulation) busyCreate(point faultPoint) {
	if point != faultAfterKeyClaim || s.transient.busyError == nil || !s.chance(busyCreateChance) {
		return
	}
	s.transient.busyIn, s.transient.busyCreate = 1+s.rng.IntN(3), true
}

// disarmBusy disarms a busy statement armed in a transaction that ended
// before it was reached (a crash, an outage in between), so that it cannot
// fail a later, unrelated statement. The network calls it at each
// transaction's end (simDatabase.ended), and the simulator at quiesce.
func (s *simulation) disarmBusy() {
	s.transient.busyIn, s.transient.busyCreate = 0, false
}

// busyStatement is the network's busy hook (simDatabase.busy): it fails
// the statement that the armed count reaches, and leaves the connection
// and its transaction as they were.
func (s *simulation) busyStatement() error {
	if s.transient.busyIn == 0 {
		return nil
	}
	s.transient.busyIn--
	if s.transient.busyIn > 0 {
		return nil
	}
	what := "the effect"
	if s.transient.busyCreate {
		what = "a create"
		s.report.Counts.BusyCreates++
	} else {
		s.report.Counts.BusyStatements++
	}
	if action := s.current; action != nil {
		// It may fail, or answer 503, for that reason; in a create, so may
		// the members of the batch it leads, whichever member was busy.
		action.sawOutage = true
		if s.transient.busyCreate {
			for _, queued := range s.queuedInGroup() {
				queued.sawOutage = true
			}
		}
		s.tracef("a%d %s: the database is busy at one statement of %s", action.id, action.process.name, what)
	}
	s.transient.busyCreate = false
	return s.transient.busyError
}

// countOwnFailure counts a failure of a broker consumer's own code that
// the simulator made.
func (s *simulation) countOwnFailure() {
	s.transient.ownFailures++
}

// checkFailuresCounted checks the inbox's promise to the broker
// consumers' messages: only a failure of the consumer's own code is
// counted against a message and brings it closer to poison; the database
// failing, for a moment or for an outage, counts nothing. So the inbox may
// have counted fewer failures than the simulator made (one whose
// transaction then rolled back, or one an operator's replay forgot), never
// more. (The processor's webhooks count their own early arrivals, which
// make nothing poison: not checked here.)
func (s *simulation) checkFailuresCounted(ctx context.Context) error {
	var counted int64
	err := s.direct.QueryRowContext(ctx, `SELECT COALESCE(SUM(failures), 0) FROM inbox_failures WHERE consumer <> ?`,
		webhookConsumer).Scan(&counted)
	if err != nil {
		return fmt.Errorf("read inbox failures: %w", err)
	}
	if counted > int64(s.transient.ownFailures) {
		return s.fail("the inbox counts %d failures against the consumers' messages, but their own code failed %d times: "+
			"a failure of the database was counted against a message", counted, s.transient.ownFailures)
	}
	return nil
}

// sqliteBusyError returns the error SQLite gives a statement that cannot
// have its lock, SQLITE_BUSY, made for real on the file at path: a second
// connection that waits for no lock asks for the write lock a first one
// holds.
func sqliteBusyError(ctx context.Context, path string) (error, error) {
	db, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	holder, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer holder.Close()
	waiter, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer waiter.Close()
	if _, err := waiter.ExecContext(ctx, `PRAGMA busy_timeout = 0`); err != nil {
		return nil, fmt.Errorf("set busy timeout: %w", err)
	}
	if _, err := holder.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
		return nil, fmt.Errorf("take the write lock: %w", err)
	}
	defer holder.ExecContext(ctx, `ROLLBACK`)
	_, busy := waiter.ExecContext(ctx, `BEGIN IMMEDIATE`)
	if !isBusy(busy) {
		return nil, fmt.Errorf("simulator: a second writer got %v, want SQLITE_BUSY", busy)
	}
	return busy, nil
}
