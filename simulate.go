// The deterministic simulator (retrysafe simulate): every layer, driven from
// one seed, in one goroutine at a time, with the faults that SIGKILL never
// reaches.
//
// A crash test kills a process at each named point; a chaos run kills real
// processes at random. Neither explores many interleavings, and neither
// replays a failure. Here, as in FoundationDB's simulator and TigerBeetle's
// VOPR, one seeded random source decides everything: which virtual client
// sends what (new requests, retries after a timeout, concurrent duplicates,
// keys reused after their expiry, refunds, hostile bodies, signed
// webhooks), which worker runs a one-shot pass (relayOnce, consumeOnce,
// sagaOnce, completeRefundsOnce, cleanupOnce), and when the clock jumps
// (a little, past a lease, past a key's expiry), a process crashes, the
// processor loses a response, the database becomes unreachable for a few
// steps (sometimes mid-transaction, sometimes just after a commit whose
// answer is lost), or the broker hands a batch over out of order, loses an
// ack or gets a publish twice (simulate_faults.go). A dependency also
// fails one call and is fine at the next: the processor does not answer a
// retrieve, the database is busy at one statement of a consumer's effect
// (simulate_transient.go). On PostgreSQL the
// server also terminates a transaction's backend, fails it with a
// serialization failure, or loses a commit's answer (simulate_postgres.go).
// OrderCreated has a second consumer, a ledger, so that the broker's loss
// can reach one consumer of a subject after the other applied the message;
// and a consumer that records a message poison is held before its ack
// while the reconciler sweeps and the operator replays it
// (simulate_consumers.go). Some structures land on the value where an
// answer changes: the last units of stock, a key's expiry to the
// microsecond, a signature just beyond the tolerance
// (simulate_boundaries.go), the failure that makes a message poison
// (simulate_poison.go). An order is refunded twice in a row while the
// broker refuses the first refund's event, and the broker checks that
// each event first goes out after those of its order written before it
// (simulate_outboxorder.go). The saga workers lose their way to the
// processor until their sagas have failed five times in a row, and a
// charge is undone meanwhile (simulate_cutoff.go).
//
// Every client request and worker pass is an action that runs as a
// coroutine (iter.Pull): at each fault point outside a transaction it hands
// control back to the simulator, which may run something else first. An
// action left waiting there while the clock passes its lease is a paused
// process: it resumes with its stale view while another worker has taken its
// work over. Crashing a process abandons all its actions: each returns
// errCrash from the point where it waits and unwinds, rolling back what it
// had not committed. Only one coroutine runs at a time, the clock is fake,
// ids come from the seed, and nothing iterates over a map, so a seed gives
// the same run, byte for byte.
//
// Every answer a client gets is judged at once against a reference model
// of what that request must get (simulate_model.go). After every step the
// in-flight invariants of check must hold; at the end faults stop, clients
// retry what they never got an answer to, workers run until quiet, and the
// full check and the clients' view must hold.

package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// simOptions are the settings of one simulated run.
type simOptions struct {
	seed  uint64
	steps int
	// path is the SQLite file; empty means a temporary one, removed at the
	// end.
	path string
	// progress, if set, gets every trace line as it happens.
	progress io.Writer
}

// simReport is what a run did and found.
type simReport struct {
	Seed  uint64
	Steps int
	// Trace has one line per step, and one per action that ends.
	Trace []string
	// Failure is the first broken promise, with the step it was found at;
	// empty if the run passed.
	Failure     string
	FailureStep int
	Counts      simCounts
}

// simCounts are what a run exercised.
type simCounts struct {
	Requests, Retries, Hostile, Webhooks, Refunds int
	WorkerPasses, Suspensions, Pauses, Crashes    int
	ClockJumps, LostResponses, Answers5xx         int
	Outages, LostCommits, Answers503              int
	Reorders, LostAcks, DuplicatePublishes        int
	// LostMessages counts messages the broker lost after acknowledging
	// them.
	LostMessages int
	simPostgresCounts
	// The structures the model-based oracle added: orders of several
	// items, keys reused on another route or order, clock jumps inside a
	// transaction, consumers whose apply fails, group commits of several
	// members, refunds of ours announced while in flight, a full disk.
	MultiItemOrders, KeysReused, ClockJumpsInTx int
	ConsumerErrors, GroupBatches, GroupMembers  int
	OwnRefundsAnnounced, FullDisks, AnswersFull int
	// Refunds abandoned mid-call and asked for again a day later
	// (simulate_abandon.go).
	simAbandonedCounts
	// FrozenSagaWorkers counts saga passes frozen past their lease while
	// another worker took their sagas over (simulate_freeze.go).
	FrozenSagaWorkers int
	// Processor retrieves unanswered and statements failed busy
	// (simulate_transient.go).
	simTransientCounts
	// Messages lost for one of two consumers of a subject, and poison
	// messages replayed before their ack (simulate_consumers.go).
	simConsumersCounts
	// Outages of the processor's API with a forged refund event in them
	// (simulate_forged.go).
	simForgedCounts
	// Keys of a counter scheme two users share (simulate_sharedkeys.go).
	simSharedKeysCounts
	// The last units of a SKU, retries at a key's expiry, creates whose
	// transaction spans a clock move, webhooks signed off our clock
	// (simulate_boundaries.go).
	simBoundaryCounts
	// Messages failed at every delivery, and poison's place in delivery
	// (simulate_poison.go).
	simPoisonCounts
	// Processor requests lost on the way, and refund retries while a
	// lease is held (simulate_held.go).
	simHeldCounts
	// Orders refunded twice in a row while the broker refused the first
	// refund's event (simulate_outboxorder.go).
	simOutboxOrderCounts
	// The saga workers cut off from the processor
	// (simulate_cutoff.go).
	simCutOffCounts
	Repairs simRepairCounts
}

// add adds other's counts to c.
func (c *simCounts) add(other simCounts) {
	c.Requests += other.Requests
	c.Retries += other.Retries
	c.Hostile += other.Hostile
	c.Webhooks += other.Webhooks
	c.Refunds += other.Refunds
	c.WorkerPasses += other.WorkerPasses
	c.Suspensions += other.Suspensions
	c.Pauses += other.Pauses
	c.Crashes += other.Crashes
	c.ClockJumps += other.ClockJumps
	c.LostResponses += other.LostResponses
	c.Answers5xx += other.Answers5xx
	c.Outages += other.Outages
	c.LostCommits += other.LostCommits
	c.Answers503 += other.Answers503
	c.Reorders += other.Reorders
	c.LostAcks += other.LostAcks
	c.DuplicatePublishes += other.DuplicatePublishes
	c.LostMessages += other.LostMessages
	c.simPostgresCounts.add(other.simPostgresCounts)
	c.MultiItemOrders += other.MultiItemOrders
	c.KeysReused += other.KeysReused
	c.ClockJumpsInTx += other.ClockJumpsInTx
	c.ConsumerErrors += other.ConsumerErrors
	c.GroupBatches += other.GroupBatches
	c.GroupMembers += other.GroupMembers
	c.OwnRefundsAnnounced += other.OwnRefundsAnnounced
	c.FullDisks += other.FullDisks
	c.AnswersFull += other.AnswersFull
	c.AbandonedRefunds += other.AbandonedRefunds
	c.CatchUps += other.CatchUps
	c.GaveUpRefunds += other.GaveUpRefunds
	c.FrozenSagaWorkers += other.FrozenSagaWorkers
	c.simTransientCounts.add(other.simTransientCounts)
	c.simConsumersCounts.add(other.simConsumersCounts)
	c.simForgedCounts.add(other.simForgedCounts)
	c.simSharedKeysCounts.add(other.simSharedKeysCounts)
	c.simBoundaryCounts.add(other.simBoundaryCounts)
	c.simPoisonCounts.add(other.simPoisonCounts)
	c.simHeldCounts.add(other.simHeldCounts)
	c.simOutboxOrderCounts.add(other.simOutboxOrderCounts)
	c.simCutOffCounts.add(other.simCutOffCounts)
	c.Repairs.add(other.Repairs)
}

// structures says how often a run reached each structure the oracle's
// model added, for the summary.
func (c simCounts) structures() string {
	return fmt.Sprintf("%d orders of several items, %d keys reused, %d clock jumps inside a transaction, "+
		"%d consumer failures, %d group commits of %d members, %d own refunds announced in flight, "+
		"%d full disks (%d answers 503 for it), %s, %d saga workers frozen past their lease, %s, %s, %s, %s, %s, %s, %s, %s, %s",
		c.MultiItemOrders, c.KeysReused, c.ClockJumpsInTx, c.ConsumerErrors, c.GroupBatches, c.GroupMembers,
		c.OwnRefundsAnnounced, c.FullDisks, c.AnswersFull, c.simAbandonedCounts, c.FrozenSagaWorkers, c.simTransientCounts, c.simConsumersCounts, c.simForgedCounts, c.simSharedKeysCounts,
		c.simBoundaryCounts, c.simPoisonCounts, c.simHeldCounts, c.simOutboxOrderCounts, c.simCutOffCounts)
}

// simProcess is a virtual serve, relay or worker process. Its name is its
// worker id, kept across restarts, as a restarted process would.
type simProcess struct {
	name string
	kind string
}

// simAction is one client request or worker pass, run as a coroutine.
type simAction struct {
	id      int
	process *simProcess
	what    string
	next    func() (faultPoint, bool)
	stop    func()
	yield   func(faultPoint) bool
	// waitingAt is the fault point where the action waits for the
	// simulator; suspendedAt is the time it started waiting there.
	waitingAt   faultPoint
	suspendedAt time.Time
	// crashed is set when its process crashed: the point where it waits
	// returns errCrash.
	crashed bool
	// sawOutage is set when a database call of the action failed for an
	// outage, or for the database busy at one statement: it may then
	// fail, or answer 503, for that reason.
	sawOutage bool
	// sentAt is when a client request was sent; keyMayBeBusy whether
	// another send of it may hold its key's lease then.
	sentAt       time.Time
	keyMayBeBusy bool
	sendsBefore  int
	// request and recorder are a client request's; result a worker pass's.
	request  *simRequest
	recorder *httptest.ResponseRecorder
	result   string
	err      error
	// waited is set once the action has waited at a fault point;
	// commitLost once a commit of it landed and its answer was lost.
	waited, commitLost bool
	// processorTimedOut is set when a processor call of the action got no
	// answer (a lost response).
	processorTimedOut bool
	// clockMovedFrom and clockMovedTo are set when the clock jumped inside
	// the transaction of a create that ran alone: from the reading before
	// the first jump to the one after the last (simulate_boundaries.go).
	clockMovedFrom, clockMovedTo time.Time
	// horizon is, for a sweep of the reconciler, the delivery horizon
	// read before it began (checkReceivedPassed).
	horizon int64
	// probe is the expiry probe a client request sends, if it is one.
	probe *simExpiryProbe
	// consumer is the consumer a consumeOnce pass ran, and consumed what
	// it did with each message if its batch committed (nil otherwise).
	consumer string
	consumed []receiveResult
}

// simClient is a virtual API client: one user, with the requests it has
// sent so far (to retry them with the same key) and the orders it was told
// about.
type simClient struct {
	name, user, apiKey string
	requests           []*simRequest
	orders             []string
	keys               int
}

// simRequest is one logical request: a method, a path, a key and a body.
// A retry sends the same again.
type simRequest struct {
	client            *simClient
	kind              string // create, refund, hostile, webhook
	method, path, key string
	body              string
	answers           []simAnswer
	inFlight          int
	orderID           string
	// commitLostAt is when a commit of this request landed while the
	// connection dropped before its answer arrived: the server stored an
	// answer then that the client never got.
	commitLostAt time.Time
	// sends counts the times it was sent; firstSentAt is the first,
	// lifeStart the first of the key's current life (see simModel.sent),
	// lastEnd when the last send ended, answered or not.
	sends                           int
	firstSentAt, lifeStart, lastEnd time.Time
	// lastDropped is set when the last send's connection dropped: its
	// outcome is unknown whatever an earlier send was answered (a key
	// that expired since runs the request as new).
	lastDropped bool
	// A webhook's event: its id, what it announces (a "dashboard" refund,
	// a "made-up" one, or our "own" API refund), and the refund's amount.
	eventID, eventKind string
	refundAmount       int64
	// unsettledAt is when the simulator last knew this refund's key was
	// claimed and not settled: its process was killed mid-call, and
	// nothing ran since (simulate_abandon.go).
	unsettledAt time.Time
	// gaveUp is set when the client gave up on this refund after the
	// processor timed out: it never sends it again (simulate_abandon.go).
	gaveUp bool
	// signSkew is how far off our clock a webhook's signature is made
	// (simulate_boundaries.go).
	signSkew time.Duration
	// leaseHolder is the send of this refund that claimed its key last
	// and has not answered since (simulate_held.go).
	leaseHolder *simAction
}

// simAnswer is one HTTP answer a client got.
type simAnswer struct {
	step   int
	status int
	body   string
	at     time.Time
	// sentAt is when the send it answers began; lifeStart the key's life
	// it was given in (see simModel.sent).
	sentAt, lifeStart time.Time
	// replayed is set when the answer came from the key, stored by an
	// earlier send or the refund completer (Idempotent-Replayed: true).
	replayed bool
}

// simulation is the state of one run.
type simulation struct {
	opts  simOptions
	rng   *rand.Rand
	clock *fakeClock
	app   *App
	// direct is a handle on the database that no outage reaches: the
	// processor's, and the simulator's own for its checks.
	direct *sql.DB
	// network is the connection between the App and its database, and
	// brokerNetwork between the App and its broker.
	network, brokerNetwork *simDatabase
	// closeAlso are the handles to close with the App's.
	closeAlso []*sql.DB
	auditor   *auditor
	handler   http.Handler
	secret    []byte
	processes []*simProcess
	clients   []*simClient
	actions   []*simAction
	current   *simAction
	nextID    int
	step      int
	quiescing bool
	webhooks  []string
	// sagaSteps counts the saga steps started since the simulation's
	// last step, or quiescing's last pass (simulate_held.go).
	sagaSteps int
	// refusedEvents are the ids of the signed events the simulator made
	// invalid on purpose: poison is the right outcome for them.
	refusedEvents []string
	// events are the webhooks the processor sent, by event id: a
	// redelivery is the same request sent again.
	events map[string]*simRequest
	// announced are the processor's events for our own refunds, to be
	// delivered.
	announced []*simRequest
	// consumerFailures counts the failures made per consumer and message
	// (see failingSometimes).
	consumerFailures map[string]int
	// model is the reference model every answer is judged against.
	model *simModel
	// diskFullUntil is the step the full disk ends at (see fillDisk).
	diskFullUntil int
	// onPostgres is set when the App's database is a PostgreSQL server.
	onPostgres bool
	// groupProcess is the process whose group commit holds a batch, until
	// step groupReleaseAt (see holdGroupCommit).
	groupProcess   *simProcess
	groupReleaseAt int
	// abandoned is the refund whose process is killed mid-call, until its
	// client comes back; timingOut the refund whose processor call loses
	// its answer, until it is answered (simulate_abandon.go).
	abandoned *simAbandoned
	timingOut *simRequest
	// frozen is the saga pass frozen past its lease, until it wakes up
	// (simulate_freeze.go).
	frozen *simFrozen
	// replayRace is the poison message replayed before its consumer's
	// ack, until that consumer wakes up (simulate_consumers.go).
	replayRace *simReplayRace
	// ledgerFault is the first copy of a message the ledger's inbox let
	// through while it should still remember it (bookOrder).
	ledgerFault string
	operator    simOperator
	transient   simTransient
	report      simReport

	// processorDownUntil is the step the processor's API is down until
	// (simulate_forged.go).
	processorDownUntil int
	// keyCounters are the users' counter keys, by user and scheme, and
	// keyUsers the users who sent each key string (simulate_sharedkeys.go).
	keyCounters map[string]int
	keyUsers    map[string][]string

	// lastStock is how much of lastSKU is stocked and asked for;
	// expiryProbe the retry scheduled at a chosen instant of its key's
	// life (simulate_boundaries.go).
	lastStock   simLastStock
	expiryProbe *simExpiryProbe
	// poisonRun is the message a consumer fails on at every delivery
	// (simulate_poison.go).
	poisonRun *simPoisonRun
	// heldEvent is the order refunded twice in a row, whose first refund
	// event the broker refuses (simulate_outboxorder.go).
	heldEvent *simHeldEvent
	// cutOffState is the stretch in which the saga workers cannot reach
	// the processor (simulate_cutoff.go).
	cutOffState *simCutOff
	// refuseConfirmIn is the saga pass in which the warehouse refuses a
	// confirm (simulate_cutoff.go).
	refuseConfirmIn *simAction
	// violation is the first broken promise found by a check that runs
	// inside the App's own calls, where an error would be taken for the
	// App's: the run fails with it at the end of the step.
	violation error
}

// simulationSteps is how many steps `go test` runs per seed by default.
const simulationSteps = 150

// simulateOnce runs one seed and returns its report. It returns an error
// only if the simulation itself could not run (the database could not be
// opened); a broken promise is the report's Failure.
func simulateOnce(ctx context.Context, opts simOptions) (simReport, error) {
	path := opts.path
	if path == "" {
		dir, err := os.MkdirTemp("", "retrysafe-sim-")
		if err != nil {
			return simReport{}, fmt.Errorf("temporary directory: %w", err)
		}
		defer os.RemoveAll(dir)
		path = filepath.Join(dir, "sim.db")
	} else if err := requireNewDatabase(ctx, path); err != nil {
		return simReport{}, err
	}
	s := &simulation{
		opts:   opts,
		rng:    rand.New(rand.NewPCG(opts.seed, 0x5eed)),
		clock:  newFakeClock(time.Date(2026, 1, 5, 9, 0, 0, 0, time.UTC)),
		secret: []byte("whsec_simulation"),
		events: map[string]*simRequest{},

		consumerFailures: map[string]int{},
		model:            newSimModel(),
		report:           simReport{Seed: opts.seed},
	}
	var seed [32]byte
	for i := range 8 {
		seed[i] = byte(opts.seed >> (8 * i))
	}
	app, err := s.openApp(ctx, path, newIDs(rand.NewChaCha8(seed)))
	if err != nil {
		return simReport{}, err
	}
	defer app.db.Close()
	for _, db := range s.closeAlso {
		defer db.Close()
	}
	s.app = app
	if err := s.wireLedger(ctx); err != nil {
		return simReport{}, err
	}
	if err := s.stockLastSKU(ctx); err != nil {
		return simReport{}, err
	}
	s.auditor, err = prepareAuditor(ctx, s.direct)
	if err != nil {
		return simReport{}, err
	}
	defer s.auditor.close()
	srv := &server{
		app:           app,
		apiKeys:       map[string]string{"sk_sim_a": "user-42", "sk_sim_b": "user-7"},
		webhookSecret: s.secret,
		logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	s.handler = srv.routes()
	s.processes = []*simProcess{
		{"serve-1", "serve"}, {"serve-2", "serve"},
		{"relay-1", "relay"}, {"relay-2", "relay"},
		{"worker-1", "worker"}, {"worker-2", "worker"},
	}
	s.clients = []*simClient{
		{name: "c1", user: "user-42", apiKey: "sk_sim_a"},
		{name: "c2", user: "user-42", apiKey: "sk_sim_a"},
		{name: "c3", user: "user-7", apiKey: "sk_sim_b"},
	}
	err = s.run(ctx)
	var failure *simFailure
	if errors.As(err, &failure) {
		s.report.Failure = failure.reason
		s.report.FailureStep = failure.step
		s.tracef("FAILED at step %d: %s", failure.step, failure.reason)
		// Stop what is still waiting, so no coroutine outlives the run.
		for _, action := range s.actions {
			action.crashed = true
			action.stop()
		}
		return s.report, nil
	}
	return s.report, err
}

// openApp opens the App the simulation drives. Its database is reached
// through the simulated network (simulate_faults.go; on PostgreSQL also
// simulate_postgres.go), and the
// processor, which is another company's system, through a direct handle
// that the network's outages do not reach. Its broker delivers through
// simBroker.
func (s *simulation) openApp(ctx context.Context, path string, ids func(string) string) (*App, error) {
	if isPostgresURL(path) {
		return s.openPostgresApp(ctx, path, ids)
	}
	s.network = s.newNetwork("the database")
	s.brokerNetwork = s.newNetwork("the broker")
	db, readers, err := openSimDatabase(ctx, path, s.network)
	if err != nil {
		return nil, err
	}
	brokerDB, brokerReaders, err := openSimDatabase(ctx, path, s.brokerNetwork)
	if err != nil {
		db.Close()
		readers.Close()
		return nil, err
	}
	brokerReaders.Close()
	if s.transient.busyError, err = sqliteBusyError(ctx, path); err != nil {
		db.Close()
		readers.Close()
		brokerDB.Close()
		return nil, err
	}
	s.network.busy, s.network.ended = s.busyStatement, s.disarmBusy
	direct, err := openDB(ctx, path)
	if err != nil {
		db.Close()
		readers.Close()
		brokerDB.Close()
		return nil, err
	}
	app := newApp(db, s.clock.now, ids, s.faultHook)
	app.group.wait = s.waitInQueue
	app.readDB = readers
	app.processor.db = direct
	// The embedded broker stands for a broker of its own (NATS
	// JetStream): it stays up while the database is down, and has
	// outages of its own.
	app.broker = &simBroker{messageBroker: &embeddedBroker{db: brokerDB, now: s.clock.now, fault: s.faultHook, ackWait: app.leases.ackWait}, s: s}
	s.closeAlso = []*sql.DB{readers, direct, brokerDB}
	if err := app.subscribeConsumers(ctx); err != nil {
		db.Close()
		return nil, err
	}
	s.direct = direct
	return app, nil
}

// newNetwork returns the simulated network to the system named name: a
// call that fails for its outage marks the running action; a commit whose
// answer is lost begins an outage.
func (s *simulation) newNetwork(name string) *simDatabase {
	network := &simDatabase{name: name}
	network.refused = func() {
		if s.current != nil {
			s.current.sawOutage = true
			for _, queued := range s.queuedInGroup() {
				queued.sawOutage = true
			}
		}
	}
	network.commitLost = func() {
		if s.current != nil {
			for _, action := range append(s.queuedInGroup(), s.current) {
				action.sawOutage = true
				action.commitLost = true
				if action.request != nil {
					action.request.commitLostAt = s.clock.now()
				}
			}
		}
		s.report.Counts.LostCommits++
		s.tracef("a commit to %s lands, and the connection drops before its answer does", name)
		s.beginOutage(network)
	}
	network.commitFailed = func() {
		s.tracef("the connection to %s drops as a commit is sent: nothing of it lands", name)
		s.beginOutage(network)
	}
	return network
}

// beginOutage makes network's system unreachable for a few steps.
func (s *simulation) beginOutage(network *simDatabase) {
	network.down = true
	network.ends = s.step + 2 + s.rng.IntN(12)
	if s.chance(0.25) {
		// A long one: longer than the broker's ackWait, longer than five
		// deliveries of a message whose consumer cannot commit.
		network.ends = s.step + 20 + s.rng.IntN(40)
	}
	s.report.Counts.Outages++
	s.tracef("%s is unreachable until step %d", network.name, network.ends)
}

// endOutage makes network's system reachable again. It also disarms a
// lost or failed commit armed in a transaction that rolled back before its
// commit: at quiesce, none may fire.
func (s *simulation) endOutage(network *simDatabase) {
	if network == nil {
		return
	}
	network.loseCommit, network.failCommit = false, false
	if !network.down {
		return
	}
	network.down = false
	s.tracef("%s is reachable again", network.name)
}

// simFailure is a broken promise: an invariant, or an answer a client
// should never have got.
type simFailure struct {
	step   int
	reason string
}

// Error says which promise broke, and when.
func (f *simFailure) Error() string { return fmt.Sprintf("step %d: %s", f.step, f.reason) }

// fail returns a simFailure at the current step.
func (s *simulation) fail(format string, args ...any) error {
	return &simFailure{step: s.step, reason: fmt.Sprintf(format, args...)}
}

// tracef adds a line to the trace.
func (s *simulation) tracef(format string, args ...any) {
	line := fmt.Sprintf("%4d  ", s.step) + fmt.Sprintf(format, args...)
	s.report.Trace = append(s.report.Trace, line)
	if s.opts.progress != nil {
		fmt.Fprintln(s.opts.progress, line)
	}
}

// chance returns true with probability p.
func (s *simulation) chance(p float64) bool {
	return s.rng.Float64() < p
}

// pick returns a random element of items.
func pick[T any](s *simulation, items []T) T {
	return items[s.rng.IntN(len(items))]
}

// run is the main loop: steps, then quiescence.
func (s *simulation) run(ctx context.Context) error {
	for s.step = 1; s.step <= s.opts.steps; s.step++ {
		if err := s.oneStep(ctx); err != nil {
			return err
		}
		if s.violation != nil {
			return s.violation
		}
		if err := s.checkInFlight(ctx); err != nil {
			return err
		}
		s.report.Steps = s.step
	}
	return s.quiesce(ctx)
}

// oneStep picks and does one thing.
func (s *simulation) oneStep(ctx context.Context) error {
	for _, network := range []*simDatabase{s.network, s.brokerNetwork} {
		if network != nil && network.down && s.step >= network.ends {
			s.endOutage(network)
		}
	}
	if s.groupProcess != nil && s.step >= s.groupReleaseAt {
		if err := s.releaseGroupCommit(ctx); err != nil {
			return err
		}
	}
	if s.network != nil && s.network.diskFull && s.step >= s.diskFullUntil {
		if err := s.freeDisk(ctx); err != nil {
			return err
		}
	}
	s.sagaSteps = 0
	// Time passes between any two events, a little.
	s.clock.advance(time.Duration(s.rng.IntN(400)) * time.Millisecond)
	if returned, err := s.clientReturns(ctx); returned {
		return err
	}
	if moved, err := s.frozenWorkerStep(ctx); moved {
		return err
	}
	if moved, err := s.stepReplayRace(ctx); moved {
		return err
	}
	if sent, err := s.stepExpiryProbe(ctx); sent {
		return err
	}
	if moved, err := s.stepPoisonRun(ctx); moved {
		return err
	}
	if sent, err := s.stepHeldEvent(ctx); sent {
		return err
	}
	if moved, err := s.stepCutOff(ctx); moved {
		return err
	}
	roll := s.rng.IntN(100)
	switch {
	case roll < 25 && len(s.actions) > 0:
		return s.resume(ctx, pick(s, s.actions))
	case roll < 50:
		return s.clientRequest(ctx)
	case roll < 88:
		return s.workerPass(ctx)
	case roll < 95:
		s.jumpClock()
		return nil
	case roll < 99 || s.network == nil:
		return s.crash(ctx, pick(s, s.processes))
	default:
		if s.chance(0.4) {
			return s.fillDisk(ctx)
		}
		if network := pick(s, []*simDatabase{s.network, s.brokerNetwork}); !network.down {
			s.beginOutage(network)
		}
		return nil
	}
}

// fillDisk makes the App's disk full for a few steps: the file may not
// grow past the pages it has now. A write that needs another page fails
// with SQLITE_FULL and takes its whole transaction down; every request
// must still get one answer (503), and nothing may be lost.
func (s *simulation) fillDisk(ctx context.Context) error {
	if s.network.down || s.network.diskFull {
		return nil
	}
	if s.onPostgres {
		s.network.diskFull = true
		s.diskFullUntil = s.step + 2 + s.rng.IntN(15)
		s.report.Counts.FullDisks++
		s.tracef("the server's disk is full until step %d", s.diskFullUntil)
		return nil
	}
	var pages int64
	if err := s.direct.QueryRowContext(ctx, `PRAGMA page_count`).Scan(&pages); err != nil {
		return fmt.Errorf("read page count: %w", err)
	}
	if _, err := setMaxPages(ctx, s.app.db, s.network, pages); err != nil {
		return err
	}
	s.diskFullUntil = s.step + 2 + s.rng.IntN(15)
	s.report.Counts.FullDisks++
	s.tracef("the disk is full at %d pages until step %d", pages, s.diskFullUntil)
	return nil
}

// freeDisk gives the disk room again.
func (s *simulation) freeDisk(ctx context.Context) error {
	if s.network == nil || !s.network.diskFull {
		return nil
	}
	if s.onPostgres {
		s.network.diskFull = false
		s.tracef("the server's disk has room again")
		return nil
	}
	if s.network.down {
		// Not yet: a connection that made no call during the outage is
		// still open, and still capped. The disk gets room on the first
		// step after the outage.
		return nil
	}
	if _, err := setMaxPages(ctx, s.app.db, s.network, 0); err != nil {
		return err
	}
	s.tracef("the disk has room again")
	return nil
}

// jumpClock moves the clock: mostly a little, sometimes past every lease,
// rarely past a key's expiry; but as often as not past the expiry while a
// refund is left unfinished (its answer lost, its process crashed): the
// completer may then finish it only after its key's first day has passed,
// and the client that comes back must still get its answer. (By chance
// alone a refund is rarely unfinished at a jump: simulate_abandon.go
// builds that scenario on purpose.) While
// something waits for an operator, a jump past a key's expiry is as often
// a week: the operator is away, and cleanup passes the message retention.
func (s *simulation) jumpClock() {
	var d time.Duration
	roll := s.rng.IntN(100)
	if roll >= 50 && s.refundUnfinished() {
		roll = 85
	}
	switch {
	case roll < 50:
		d = time.Duration(1+s.rng.IntN(3000)) * time.Millisecond
	case roll < 85:
		d = s.app.leases.refundLock + time.Duration(s.rng.IntN(60))*time.Second
	case len(s.operator.setAside) > 0 && s.chance(0.5):
		d = messageRetention + time.Duration(1+s.rng.IntN(60))*time.Minute
	default:
		d = idempotencyKeyTTL + time.Duration(1+s.rng.IntN(60))*time.Minute
	}
	s.clock.advance(d)
	s.report.Counts.ClockJumps++
	s.tracef("clock +%s", d)
}

// refundUnfinished reports whether a refund is still pending, read from
// the handle no fault reaches.
func (s *simulation) refundUnfinished() bool {
	var pending bool
	err := s.direct.QueryRow(`SELECT EXISTS (SELECT 1 FROM refunds WHERE status = 'pending')`).Scan(&pending)
	return err == nil && pending
}

// crash kills process: every action it was running returns errCrash from
// where it waits and unwinds; the process "restarts" under the same name.
func (s *simulation) crash(ctx context.Context, process *simProcess) error {
	var victims []*simAction
	for _, action := range s.actions {
		if action.process == process {
			victims = append(victims, action)
		}
	}
	s.report.Counts.Crashes++
	s.tracef("crash %s (%d actions in flight)", process.name, len(victims))
	for _, action := range victims {
		action.crashed = true
		if err := s.resume(ctx, action); err != nil {
			return err
		}
	}
	return nil
}

// faultHook is the App's fault hook. Inside a transaction the action may
// only go on or crash (it holds the write lock: nothing else could run).
// Elsewhere it hands control back to the simulator and waits to be resumed.
func (s *simulation) faultHook(ctx context.Context, point faultPoint) error {
	if err := s.countSagaStep(point); err != nil {
		return err
	}
	action := s.current
	if action == nil || s.quiescing {
		return nil
	}
	if action.crashed {
		return errCrash
	}
	s.heldLease(action, point)
	if err := s.cutOff(ctx, action, point); err != nil {
		return err
	}
	if action == s.refuseConfirmIn {
		// The last pass of a stretch cut off from the processor runs
		// straight through, to a refused confirm (simulate_cutoff.go).
		return s.refuseShipment(ctx, action, point)
	}
	if err := s.loseRequest(action, point); err != nil {
		return err
	}
	if err := s.refuseShipment(ctx, action, point); err != nil {
		return err
	}
	if abandoned, err := s.killAbandoned(ctx, action, point); abandoned {
		return err
	}
	if s.timeoutLoses(action, point) {
		return errors.New("connection reset")
	}
	if err := s.brokenDependency(point); err != nil {
		if point == faultConsumerApply {
			s.countOwnFailure()
		}
		action.processorTimedOut = action.processorTimedOut || point == faultProcessorLoseResponse
		return err
	}
	if point == faultProcessorLoseResponse && s.chance(0.1) {
		s.report.Counts.LostResponses++
		action.processorTimedOut = true
		return errors.New("connection reset")
	}
	if err := s.processorUnreachable(point); err != nil {
		return err
	}
	if err := s.processorSilent(point); err != nil {
		return err
	}
	if point.insideTransaction() {
		if s.chance(0.03) {
			// The process dies: every action of it, the requests queued
			// in its group commit among them, and its transaction with it.
			for _, other := range s.actions {
				if other.process == action.process {
					other.crashed = true
				}
			}
			if queued := s.queuedInGroup(); len(queued) > 0 && s.network != nil && action.request != nil && action.request.kind == "create" {
				for _, other := range queued {
					other.crashed = true
				}
				s.network.processDied = true
			}
			action.crashed = true
			s.report.Counts.Crashes++
			return errCrash
		}
		s.busyCreate(point)
		if s.chance(0.05) {
			// The clock moves while the transaction is open (a stall, a
			// paused process that holds the write lock): code that reads
			// the clock twice in it sees two times.
			s.report.Counts.ClockJumpsInTx++
			s.tracef("a%d %s: the clock jumps inside a transaction, at %s", action.id, action.process.name, point)
			from := s.clock.now()
			s.jumpClock()
			if action.request != nil && action.request.kind == "create" && len(s.queuedInGroup()) == 0 {
				// Its claim read the clock at from or before; its answer
				// will read it at the clock's now or after.
				if action.clockMovedFrom.IsZero() {
					action.clockMovedFrom = from
				}
				action.clockMovedTo = s.clock.now()
			}
		}
		if s.network != nil && !s.network.down {
			switch roll := s.rng.IntN(100); {
			case roll < 1:
				// The connection drops mid-transaction: its next
				// statement, or its commit, fails.
				s.tracef("a%d %s: the database becomes unreachable at %s", action.id, action.process.name, point)
				s.beginOutage(s.network)
			case roll < 2:
				s.network.loseCommit = true
			case roll < 3:
				s.network.failCommit = true
			}
		}
		return nil
	}
	if s.poisonRun != nil && action.consumer == s.poisonRun.consumer {
		// A pass of the consumer that fails a message at every delivery
		// runs straight through: the simulator counts its failures in the
		// order they commit (simulate_poison.go).
		return nil
	}
	hold := false
	if point == faultRefundAfterProcessor && action.request != nil && s.chance(0.6) {
		// The processor announces the refund it just made, ours, while
		// our side has not recorded it: the event must wait, and then
		// count nothing twice.
		hold = s.announceOwnRefund(ctx, action.request)
	}
	hold = hold || s.freezeSagaWorker(action, point)
	hold = hold || s.holdBeforeAck(ctx, action, point)
	// Mostly the process just goes on; sometimes it is held here while
	// others run (and the clock may pass its leases).
	if !hold && !s.chance(0.25) {
		return nil
	}
	action.waitingAt = point
	action.suspendedAt = s.clock.now()
	action.waited = true
	s.current = nil
	if !action.yield(point) {
		action.crashed = true
	}
	s.current = action
	if action.crashed {
		return errCrash
	}
	return nil
}

// announceOwnRefund queues the processor's charge.refunded event for the
// refund it just made under req, a client's refund, to be delivered soon.
// It reports whether there is one.
func (s *simulation) announceOwnRefund(ctx context.Context, req *simRequest) bool {
	var chargeID, refundID string
	var amount int64
	err := s.direct.QueryRowContext(ctx, `
		SELECT p.charge_id, p.refund_id, p.amount_cents
		FROM refunds r JOIN processor_refunds p ON p.idempotency_key = 'refund:' || r.refund_id
		WHERE r.order_id = ? AND r.idempotency_key = ?`, req.orderID, req.key).Scan(&chargeID, &refundID, &amount)
	if err != nil {
		return false
	}
	event := s.newRefundEvent(req.client, len(s.webhooks)+1, "own", chargeID, refundID, req.orderID, amount)
	if event == nil {
		return false
	}
	s.report.Counts.OwnRefundsAnnounced++
	s.announced = append(s.announced, event)
	// Delivered in a moment, or once quiet at the latest.
	req.client.requests = append(req.client.requests, event)
	s.tracef("the processor announces refund %s of %s, ours, as %s", refundID, req.orderID, event.eventID)
	return true
}

// groupQueued is where a create waits in the group commit's queue for its
// batch's leader (see holdGroupCommit). It is the simulator's, not a fault
// point of the App: the request waits there until its outcome comes.
const groupQueued faultPoint = "groupcommit.queued"

// waitInQueue is the group commit's wait (groupCommitter.wait) in the
// simulator: the running create waits for its outcome by handing control
// back, so that other requests can queue behind it and a leader can run
// them all. A crash does not end the wait: the leader may still commit
// the request's work, and its client, gone, never hears of it.
func (s *simulation) waitInQueue(done chan groupOutcome) groupOutcome {
	for {
		select {
		case outcome := <-done:
			return outcome
		default:
		}
		action := s.current
		if action == nil {
			return <-done
		}
		action.waitingAt = groupQueued
		action.suspendedAt = s.clock.now()
		action.waited = true
		s.current = nil
		if !action.yield(groupQueued) {
			// The run is over (it failed): stop waiting.
			s.current = action
			return groupOutcome{err: errCrash}
		}
		s.current = action
	}
}

// holdGroupCommit makes the group commit look busy, as while a batch
// waits for the write lock: the creates that come next queue behind it,
// on one serve process, until releaseGroupCommit hands the lead to the
// first of them, which runs them all in one transaction, a savepoint
// each. Some members fail (a key reused, a full disk, an outage) and
// every member must get its one answer.
func (s *simulation) holdGroupCommit() bool {
	g := s.app.group
	if g == nil || s.groupProcess != nil || s.quiescing {
		return false
	}
	g.mu.Lock()
	busy := g.leading
	if !busy {
		g.leading = true
	}
	g.mu.Unlock()
	if busy {
		return false
	}
	s.groupProcess = pick(s, s.processes[:2])
	s.groupReleaseAt = s.step + 2 + s.rng.IntN(8)
	s.report.Counts.GroupBatches++
	s.tracef("the group commit of %s holds its next batch until step %d", s.groupProcess.name, s.groupReleaseAt)
	return true
}

// releaseGroupCommit lets the held batch run now: its first request leads,
// and the others learn their outcome.
func (s *simulation) releaseGroupCommit(ctx context.Context) error {
	g := s.app.group
	if g == nil || s.groupProcess == nil {
		return nil
	}
	g.mu.Lock()
	queued := len(g.waiting)
	g.mu.Unlock()
	s.report.Counts.GroupMembers += queued
	s.tracef("the group commit of %s runs a batch of %d queued requests", s.groupProcess.name, queued)
	s.groupProcess = nil
	g.handOver()
	// The leader first, wherever it stands in the queue; then the others.
	for range 2 {
		for _, action := range s.queuedInGroup() {
			if err := s.resume(ctx, action); err != nil {
				return err
			}
		}
	}
	return nil
}

// queuedInGroup returns the actions waiting in the group commit's queue:
// they run in the leader's transaction, so what befalls it befalls them.
func (s *simulation) queuedInGroup() []*simAction {
	var queued []*simAction
	for _, action := range s.actions {
		if action.waitingAt == groupQueued && action != s.current {
			queued = append(queued, action)
		}
	}
	return queued
}

// start runs a new action until it first waits at a fault point or ends.
func (s *simulation) start(ctx context.Context, action *simAction, body func(ctx context.Context)) error {
	s.nextID++
	action.id = s.nextID
	action.next, action.stop = iter.Pull(func(yield func(faultPoint) bool) {
		action.yield = yield
		body(ctx)
	})
	s.actions = append(s.actions, action)
	return s.resume(ctx, action)
}

// resume lets action go on until it waits at its next fault point or ends.
func (s *simulation) resume(ctx context.Context, action *simAction) error {
	if action.waitingAt != "" {
		if s.clock.now().Sub(action.suspendedAt) >= s.app.leases.saga && !action.crashed {
			s.report.Counts.Pauses++
			s.tracef("a%d %s resumes after a pause of %s at %s", action.id, action.process.name,
				s.clock.now().Sub(action.suspendedAt), action.waitingAt)
		}
	}
	if s.network != nil && s.network.diskFull {
		// A write of it, or of a batch it leads, may fail for the full
		// disk, as for an outage.
		action.sawOutage = true
		for _, queued := range s.queuedInGroup() {
			queued.sawOutage = true
		}
	}
	s.current = action
	point, waiting := action.next()
	s.current = nil
	if waiting {
		s.report.Counts.Suspensions++
		s.tracef("a%d %s %s: waits at %s", action.id, action.process.name, action.what, point)
		return nil
	}
	for i, a := range s.actions {
		if a == action {
			s.actions = append(s.actions[:i], s.actions[i+1:]...)
			break
		}
	}
	if action.request != nil {
		return s.answered(ctx, action)
	}
	s.tracef("a%d %s %s: %s", action.id, action.process.name, action.what, action.result)
	if action.err != nil && !action.crashed && !(action.sawOutage && onlyUnavailable(action.err)) {
		// A worker pass reports only what it could not handle: a bug, or
		// the database it could not reach.
		return s.fail("%s %s failed: %v", action.process.name, action.what, action.err)
	}
	if action.consumer != "" {
		return s.judgePoisonRun(action)
	}
	if action.what == "reconcileOnce" && action.err == nil && !action.crashed && !action.waited {
		// A sweep that ran straight through: its cursor is the last word
		// on the inboxes as they are now.
		return s.checkReceivedPassed(ctx, action.horizon)
	}
	return nil
}

// violate records the first broken promise that a check found inside the
// App's own calls (a broker's publish, an operator's repair), where
// returning it would make the App take it for its own error: the run
// fails with it at the end of the step.
func (s *simulation) violate(err error) {
	if s.violation == nil {
		s.violation = err
	}
}

// workerPass starts one pass of one background job on a relay or worker.
func (s *simulation) workerPass(ctx context.Context) error {
	process := pick(s, s.processes[2:])
	action := &simAction{process: process}
	s.report.Counts.WorkerPasses++
	if process.kind == "relay" && s.chance(0.25) {
		return s.reconcilePass(ctx, action)
	}
	if process.kind == "relay" {
		action.what = "relayOnce"
		return s.start(ctx, action, func(ctx context.Context) {
			n, err := s.app.relayOnce(ctx, process.name, 4)
			action.result = workerResult(n, "published", err)
			action.err = err
		})
	}
	// The App's consumers: jobs 0 and 1 run the payment and the order
	// service, 6 the ledger the simulation wires in after them
	// (simulate_consumers.go).
	consumers := s.app.consumers()
	switch job := s.rng.IntN(7); job {
	case 0, 1, 6:
		return s.consumePass(ctx, action, consumers[min(job, len(consumers)-1)])
	case 2:
		action.what = "sagaOnce"
		return s.start(ctx, action, func(ctx context.Context) {
			n, err := s.app.sagaOnce(ctx, process.name, 2)
			action.result = workerResult(n, "sagas run", err)
			action.err = err
		})
	case 3:
		action.what = "completeRefundsOnce"
		return s.start(ctx, action, func(ctx context.Context) {
			n, err := s.app.completeRefundsOnce(ctx, 4)
			action.result = workerResult(n, "refunds finished", err)
			action.err = err
		})
	case 5:
		return s.operatorPass(ctx)
	default:
		action.what = "cleanupOnce"
		return s.start(ctx, action, func(ctx context.Context) {
			result, err := s.app.cleanupOnce(ctx)
			action.result = workerResult(result.Keys, "keys deleted", err)
			action.err = err
		})
	}
}

// reconcilePass starts a sweep of the reconciler as action, on its
// process.
func (s *simulation) reconcilePass(ctx context.Context, action *simAction) error {
	action.what = "reconcileOnce"
	err := s.direct.QueryRowContext(ctx, `SELECT `+dialectOf(s.direct).deliveryHorizon).Scan(&action.horizon)
	if err != nil {
		return fmt.Errorf("read the delivery horizon: %w", err)
	}
	return s.start(ctx, action, func(ctx context.Context) {
		n, err := s.app.reconcileOnce(ctx, action.process.name, 4)
		action.result = workerResult(n, "republished", err)
		action.err = err
	})
}

// consumePass starts a pass of c as action, c failing as the simulator's
// consumers do: now and then, or at every delivery of one message, or
// rejecting one as invalid, or meeting the database busy.
func (s *simulation) consumePass(ctx context.Context, action *simAction, c consumer) error {
	c = s.busySometimes(s.failingSometimes(s.failingInARow(s.releasedWithABug(c))))
	action.what = "consumeOnce " + c.name
	action.consumer = c.name
	return s.start(ctx, action, func(ctx context.Context) {
		results, err := s.app.consumeOnce(ctx, c, 4)
		action.consumed = results
		action.result = workerResult(len(results), "handled", err)
		action.err = err
	})
}

// consumerFailuresPerMessage is how often the simulator makes a consumer's
// own code fail on one message: fewer than maxDeliveries, whose last makes
// the message poison.
const consumerFailuresPerMessage = maxDeliveries - 2

// failingSometimes returns c with an apply that sometimes fails with an
// ordinary error, as a consumer's own call to another service does:
// before its writes, or after them (the inbox must roll them back). The
// inbox counts each, and the message comes again after a backoff.
func (s *simulation) failingSometimes(c consumer) consumer {
	apply := c.apply
	c.apply = func(ctx context.Context, tx *sql.Tx, msg message) error {
		id := c.name + "/" + msg.ID
		if s.quiescing || s.consumerFailures[id] >= consumerFailuresPerMessage || !s.chance(0.08) {
			return apply(ctx, tx, msg)
		}
		s.consumerFailures[id]++
		s.countOwnFailure()
		s.report.Counts.ConsumerErrors++
		if s.chance(0.5) {
			s.tracef("%s fails on %s before its writes", c.name, msg.ID)
			return errors.New("the fraud check timed out (simulated)")
		}
		if err := apply(ctx, tx, msg); err != nil {
			return err
		}
		s.tracef("%s fails on %s after its writes", c.name, msg.ID)
		return errors.New("the notification service refused the call (simulated)")
	}
	return c
}

// workerResult describes the outcome of a worker pass for the trace.
func workerResult(n int, what string, err error) string {
	if err != nil {
		return fmt.Sprintf("%d %s, then %v", n, what, err)
	}
	return fmt.Sprintf("%d %s", n, what)
}

// clientRequest has a client send something: a new order, a retry of an
// earlier request (after a timeout, or while it is still in flight: a
// concurrent duplicate), a refund, an earlier key with another body, a
// hostile body, or a signed webhook.
func (s *simulation) clientRequest(ctx context.Context) error {
	client := pick(s, s.clients)
	if s.abandoned == nil && s.chance(0.04) {
		// A refund of a paid order, abandoned mid-call, asked for again
		// a day later (simulate_abandon.go).
		if started, err := s.abandonRefund(ctx, client); started || err != nil {
			return err
		}
	}
	if s.timingOut == nil && s.chance(0.03) {
		// A refund of a paid order whose processor answer is lost; its
		// client gives up (simulate_abandon.go).
		if sent, err := s.timeOutRefund(ctx, client); sent || err != nil {
			return err
		}
	}
	if s.heldEvent == nil && s.chance(refundTwiceChance) {
		// An order refunded twice in a row, while the broker refuses the
		// first refund's event (simulate_outboxorder.go).
		if sent, err := s.refundTwice(ctx); sent || err != nil {
			return err
		}
	}
	if s.chance(forgedRefundChance) {
		// A forged refund event of a paid order, while the processor's
		// API is down (simulate_forged.go).
		if sent, err := s.sendForgedDuringOutage(ctx, client); sent || err != nil {
			return err
		}
	}
	if s.chance(expiryProbeChance) {
		// A retry at its key's expiry, or a microsecond before
		// (simulate_boundaries.go).
		if sent, err := s.probeKeyExpiry(ctx); sent || err != nil {
			return err
		}
	}
	var req *simRequest
	switch roll := s.rng.IntN(100); {
	case len(s.announced) > 0 && s.chance(0.5):
		// The processor delivers an event it announced.
		req = s.announced[0]
		s.announced = s.announced[1:]
		client = req.client
	case s.groupProcess != nil && len(client.requests) > 0 && s.chance(0.5):
		// While a batch is held, creates queue behind it: new ones, and
		// some under a key already taken, which fail in the batch.
		req = s.queuedCreate(client)
	case roll < 35 || len(client.requests) == 0:
		if req = s.lastStockCreate(client); req == nil {
			req = s.newCreate(client)
		}
	case roll < 60:
		// Mostly one of the last few: a client retries what just timed
		// out, or what it sent before its process restarted.
		recent := client.requests
		if len(recent) > 3 && s.chance(0.7) {
			recent = recent[len(recent)-3:]
		}
		req = pick(s, recent)
		if (req.kind == "webhook" && s.processorGaveUp(req)) || req.gaveUp {
			// Its retry window is over: the processor sends it no more. Or
			// its client gave up on it.
			req = s.newCreate(client)
			break
		}
		s.report.Counts.Retries++
	case roll < 75 && len(client.orders) > 0:
		// Mostly one of the older orders, which have had time to be paid.
		orderID := pick(s, client.orders[:(len(client.orders)+1)/2])
		if other := pick(s, s.clients); other.user != client.user && len(other.orders) > 0 && s.chance(0.15) {
			// Another user's order: 404, as for one that does not exist.
			orderID = pick(s, other.orders)
		}
		req = s.newRefund(client, orderID)
		if s.chance(0.3) {
			// Two refunds of one order at once, under two keys: together
			// they may not exceed it.
			if err := s.sendRequest(ctx, client, s.newRefund(client, orderID)); err != nil {
				return err
			}
		}
	case roll < 82:
		req = s.reuseKey(client)
	case roll < 90:
		req = s.newHostile(client)
	default:
		if s.chance(0.25) {
			// An event signed too far off our clock (simulate_boundaries.go).
			req = s.newStaleSignature(client)
		}
		if req == nil {
			req = s.newWebhook(ctx, client)
		}
		if req == nil {
			req = s.newCreate(client)
		}
	}
	if req.kind == "create" && s.chance(0.06) && s.holdGroupCommit() {
		// Several requests queue at once behind the held batch.
		for range 1 + s.rng.IntN(4) {
			other := pick(s, s.clients)
			if err := s.sendRequest(ctx, other, s.queuedCreate(other)); err != nil {
				return err
			}
		}
	}
	return s.sendRequest(ctx, client, req)
}

// queuedCreate returns a create to queue behind a held batch: mostly a new
// one, sometimes under a key already taken, which fails in the batch.
func (s *simulation) queuedCreate(client *simClient) *simRequest {
	req := s.newCreate(client)
	if len(client.requests) == 0 || !s.chance(0.3) {
		return req
	}
	earlier := pick(s, client.requests)
	if earlier.kind != "create" && earlier.kind != "refund" {
		return req
	}
	req.key = earlier.key
	s.report.Counts.KeysReused++
	return sameRequest(client, req)
}

// sameRequest returns the request client sent before with req's key, path
// and body, if any (then req is a retry of it), or req.
func sameRequest(client *simClient, req *simRequest) *simRequest {
	for _, same := range client.requests {
		if same.key == req.key && same.path == req.path && same.body == req.body {
			return same
		}
	}
	return req
}

// sendRequest has client send req.
func (s *simulation) sendRequest(ctx context.Context, client *simClient, req *simRequest) error {
	return s.sendRequestProbing(ctx, client, req, nil)
}

// sendRequestProbing has client send req, as the retry probe sends, if
// probe is set (simulate_boundaries.go).
func (s *simulation) sendRequestProbing(ctx context.Context, client *simClient, req *simRequest, probe *simExpiryProbe) error {
	if len(req.answers) == 0 && req.inFlight == 0 && !containsRequest(client.requests, req) {
		client.requests = append(client.requests, req)
	}
	s.report.Counts.Requests++
	process := pick(s, s.processes[:2])
	if s.groupProcess != nil && req.kind == "create" {
		// The batch being held is this process's.
		process = s.groupProcess
	}
	action := &simAction{process: process, request: req, recorder: httptest.NewRecorder(), probe: probe,
		what: fmt.Sprintf("%s %s %s key=%s %s", client.name, req.method, req.path, req.key, req.body)}
	s.sending(action)
	return s.start(ctx, action, func(ctx context.Context) {
		s.send(ctx, action)
	})
}

// sending records that action's request is about to be sent, in the
// request and in the model.
func (s *simulation) sending(action *simAction) {
	req := action.request
	action.sentAt = s.clock.now()
	// An earlier send may hold the key's lease: one still in flight, one
	// answered only "try again", or one whose connection dropped less than
	// a lease ago, after whatever answer came before it (it claimed the
	// key before it ended).
	dropped := req.sends > len(req.answers)+req.inFlight
	action.keyMayBeBusy = req.inFlight > 0 || (req.sends > 0 && undecided(req)) ||
		(dropped && action.sentAt.Sub(req.lastEnd) < s.app.leases.refundLock)
	s.model.sent(req, action.sentAt)
	s.sharedKeySent(req)
	action.sendsBefore = req.sends
	req.inFlight++
}

// reuseKey returns a request under one of client's earlier keys: a create
// with another body, a refund under a create's key (another route), or a
// refund under a refund's key for another order. While the key lives it
// is refused as reused; once it expired it is a new request (or, for a
// refund key sent again for the order it refunded, refused as expired).
func (s *simulation) reuseKey(client *simClient) *simRequest {
	earlier := pick(s, client.requests)
	if earlier.kind != "create" && earlier.kind != "refund" {
		return s.newCreate(client)
	}
	s.report.Counts.KeysReused++
	var req *simRequest
	if len(client.orders) > 0 && s.chance(0.5) {
		req = s.newRefund(client, pick(s, client.orders))
	} else {
		req = s.newCreate(client)
	}
	req.key = earlier.key
	if same := sameRequest(client, req); !same.gaveUp {
		return same
	}
	// The very request its client gave up on: it never sends it again.
	return s.newCreate(client)
}

// containsRequest reports whether requests holds req.
func containsRequest(requests []*simRequest, req *simRequest) bool {
	for _, r := range requests {
		if r == req {
			return true
		}
	}
	return false
}

// newKey returns a fresh idempotency key of client's: its user's next for
// scheme, which another user may send too (simulate_sharedkeys.go), or one
// of its own.
func (s *simulation) newKey(client *simClient, scheme string) string {
	if key := s.counterKey(client, scheme); key != "" {
		return key
	}
	client.keys++
	return fmt.Sprintf("%s-k%d", client.name, client.keys)
}

// newCreate returns a new create-order request: a good, declined or
// timing-out card, and often the one unit of sku-rare. Some orders have
// several items, sku-rare after another: when it is gone, the reservation
// runs out of stock half-way, and the holds already taken must go back.
func (s *simulation) newCreate(client *simClient) *simRequest {
	card := pick(s, []string{pmCardVisa, pmCardVisa, pmCardVisa, pmCardDeclined, pmCardTimeout})
	skus := []string{pick(s, []string{"sku-1", "sku-2", "sku-rare", "sku-rare"})}
	if s.chance(0.35) {
		skus = []string{"sku-1", "sku-2", "sku-rare"}
		s.rng.Shuffle(len(skus), func(i, j int) { skus[i], skus[j] = skus[j], skus[i] })
		skus = skus[:2+s.rng.IntN(2)]
		s.report.Counts.MultiItemOrders++
	}
	var items []orderItem
	for _, sku := range skus {
		items = append(items, orderItem{SKU: sku, Qty: int64(1 + s.rng.IntN(2))})
	}
	body := orderBodyJSON(int64(100*(1+s.rng.IntN(90))), items, card)
	return &simRequest{client: client, kind: "create", method: "POST", path: "/api/orders", key: s.newKey(client, "order"), body: body}
}

// orderBodyJSON is a create-order body.
func orderBodyJSON(amount int64, items []orderItem, paymentMethod string) string {
	var lines []string
	for _, item := range items {
		lines = append(lines, fmt.Sprintf(`{"sku":%q,"qty":%d}`, item.SKU, item.Qty))
	}
	return fmt.Sprintf(`{"amount_cents":%d,"currency":"usd","items":[%s],"payment_method":%q}`,
		amount, strings.Join(lines, ","), paymentMethod)
}

// newRefund returns a refund of orderID: all that remains, or a part.
func (s *simulation) newRefund(client *simClient, orderID string) *simRequest {
	s.report.Counts.Refunds++
	body := "{}"
	if s.chance(0.6) {
		body = fmt.Sprintf(`{"amount_cents":%d}`, 100*(1+s.rng.IntN(40)))
	}
	return &simRequest{client: client, kind: "refund", method: "POST", path: refundPath(orderID), key: s.newKey(client, "refund"), body: body, orderID: orderID}
}

// newHostile returns a body that must be refused with 400 and leave
// nothing behind: valid JSON whose meaning is ambiguous (a key twice, or
// in two spellings) or that breaks a rule.
func (s *simulation) newHostile(client *simClient) *simRequest {
	s.report.Counts.Hostile++
	bodies := []string{
		`{"amount_cents":100,"AMOUNT_CENTS":999,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`,
		`{"amount_cents":100,"amount_cents":999,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`,
		`{"amount_cents":-5,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`,
		`{"amount_cents":100,"currency":"usd","items":[{"sku":"sku-1","qty":1,"QTY":7}],"payment_method":"pm_card_visa"}`,
		`{"amount_cents":9223372036854775807,"currency":"usd","items":[{"sku":"sku-1","qty":1}],"payment_method":"pm_card_visa"}`,
	}
	return &simRequest{client: client, kind: "hostile", method: "POST", path: "/api/orders", key: s.newKey(client, "order"), body: pick(s, bodies)}
}

// newWebhook returns a signed charge.refunded event, as the processor sends
// it: mostly for a refund really made at its dashboard (of one cent, or of
// all that remains), sometimes a redelivery of an earlier event, and
// sometimes a signed event whose amount no refund could have (more than
// remains, or absurd), which must change nothing. The charge may not be
// recorded on its order yet: the event then arrives early. nil if the
// processor has made no charge yet.
func (s *simulation) newWebhook(ctx context.Context, client *simClient) *simRequest {
	if len(s.webhooks) > 0 && s.chance(0.3) {
		// A redelivery: the processor sends the same event again, within
		// its retry window.
		if event := s.events[pick(s, s.webhooks)]; !s.processorGaveUp(event) {
			s.report.Counts.Webhooks++
			return event
		}
	}
	var chargeID, orderID string
	var amount, refunded int64
	err := s.direct.QueryRowContext(ctx, `
		SELECT charge_id, order_id, amount_cents, refunded_cents FROM processor_charges
		WHERE status = 'succeeded' ORDER BY charge_id LIMIT 1 OFFSET ?`, s.rng.IntN(8)).Scan(&chargeID, &orderID, &amount, &refunded)
	if err != nil {
		return nil
	}
	n := len(s.webhooks) + 1
	refundID := fmt.Sprintf("re_sim_%d", n)
	refundAmount := pick(s, []int64{1, amount - refunded, amount - refunded + 1, 1 << 62})
	kind := "made-up"
	// Sometimes a forged event: signed, of an amount that fits, naming a
	// refund the processor never made. Only asking the processor tells.
	forged := s.chance(0.15)
	if refundAmount > 0 && refundAmount <= amount-refunded && !forged {
		// Made at the processor's dashboard: the processor's ledger has it
		// before the event is sent.
		refundID, err = s.app.processor.refund(ctx, fmt.Sprintf("dashboard:%d", n), chargeID, refundAmount)
		if err != nil {
			return nil
		}
		kind = "dashboard"
		s.tracef("the processor's dashboard refunds %d of %s as %s", refundAmount, chargeID, refundID)
	} else {
		s.refusedEvents = append(s.refusedEvents, fmt.Sprintf("evt_sim_%d", n))
	}
	req := s.newRefundEvent(client, n, kind, chargeID, refundID, orderID, refundAmount)
	if req != nil && kind == "dashboard" {
		s.model.dashboard[orderID] = append(s.model.dashboard[orderID], req)
		if mismatched := s.mismatchedAmount(client, req, chargeID, refundID, amount-refunded); mismatched != nil {
			// Sent first; the processor's own event comes later
			// (simulate_forged.go).
			return mismatched
		}
	}
	return req
}

// processorRetryWindow is how long the processor delivers an event, again
// and again until it is answered: Stripe retries for up to three days.
// The inbox remembers a message id for messageRetention, a week: longer,
// so that no redelivery finds its id forgotten and is applied twice.
const processorRetryWindow = 3 * 24 * time.Hour

// processorGaveUp reports whether the processor no longer sends event: it
// was first sent longer than processorRetryWindow ago, and one delivery
// was answered with its outcome (the processor does not give up on an
// event that was never received; an operator resends it from its
// dashboard).
func (s *simulation) processorGaveUp(event *simRequest) bool {
	if event.sends == 0 || s.clock.now().Sub(event.firstSentAt) < processorRetryWindow {
		return false
	}
	for _, answer := range event.answers {
		if webhookOutcome(answer) != "" {
			return true
		}
	}
	return false
}

// newRefundEvent returns the n-th signed charge.refunded event the
// processor sends, of kind (see simRequest.eventKind).
func (s *simulation) newRefundEvent(client *simClient, n int, kind, chargeID, refundID, orderID string, amount int64) *simRequest {
	data, err := json.Marshal(chargeRefundedData{ChargeID: chargeID, RefundID: refundID, AmountCents: &amount, OrderID: orderID})
	if err != nil {
		return nil
	}
	eventID := fmt.Sprintf("evt_sim_%d", n)
	event, err := json.Marshal(processorEvent{ID: eventID, Type: "charge.refunded", Data: data})
	if err != nil {
		return nil
	}
	req := &simRequest{client: client, kind: "webhook", method: "POST", path: "/webhooks/processor", body: string(event),
		eventID: eventID, eventKind: kind, refundAmount: amount, orderID: orderID, signSkew: s.signingSkew()}
	s.webhooks = append(s.webhooks, eventID)
	s.events[eventID] = req
	s.report.Counts.Webhooks++
	return req
}

// answered records the answer of a finished client request and checks that
// it is one the client may get. A request whose process crashed got no
// answer: its client saw the connection drop.
func (s *simulation) answered(ctx context.Context, action *simAction) error {
	req := action.request
	req.inFlight--
	req.lastEnd = s.clock.now()
	req.lastDropped = action.crashed
	timedOutOnPurpose := req == s.timingOut
	if timedOutOnPurpose {
		s.timingOut = nil
	}
	if action.crashed {
		s.tracef("a%d %s %s: connection dropped", action.id, action.process.name, action.what)
		return nil
	}
	answer := simAnswer{step: s.step, status: action.recorder.Code, body: action.recorder.Body.String(), at: s.clock.now(),
		sentAt: action.sentAt, lifeStart: req.lifeStart, replayed: action.recorder.Header().Get("Idempotent-Replayed") == "true"}
	req.answers = append(req.answers, answer)
	s.tracef("a%d %s %s: %d %s", action.id, action.process.name, action.what, answer.status, shorten(answer.body, 120))
	if err := s.judgeHeldLease(action, answer); err != nil {
		return err
	}
	if answer.status >= 500 && answer.status != http.StatusServiceUnavailable {
		s.report.Counts.Answers5xx++
		return s.fail("%s %s key %s got %d: %s", req.method, req.path, req.key, answer.status, answer.body)
	}
	if answer.status == http.StatusServiceUnavailable {
		s.report.Counts.Answers503++
		if s.network != nil && s.network.diskFull {
			s.report.Counts.AnswersFull++
		}
		if req.kind == "refund" && !s.quiescing && s.chance(0.5) {
			// The processor's answer may have been lost after it refunded:
			// its event may come while our refund is still pending.
			s.announceOwnRefund(ctx, req)
		}
		if req.kind == "refund" && action.processorTimedOut {
			s.giveUpRefund(req, timedOutOnPurpose)
		}
		// A create has nothing transient to wait for but its database. (A
		// refund may wait for the processor, a webhook for its order's
		// payment to be recorded.)
		if !action.sawOutage && (req.kind == "create" || req.kind == "hostile") {
			return s.fail("%s %s key %s got 503 with the database up: %s", req.method, req.path, req.key, answer.body)
		}
	}
	// Once a request has its answer, the same request (same key, same body)
	// gets that answer again, byte for byte, while the key lives: a day from
	// when the answer was stored at least, which is no earlier than the
	// first send of the key's life. (A webhook has no key: its redelivery
	// is answered "duplicate".)
	if definitive(answer) && req.kind != "webhook" && req.kind != "stale-signed" {
		// A refusal as reused binds only while another request certainly
		// holds the key: once the holder's key may have expired (a day
		// from its answer, which may fall within a day of req's first
		// send), req may run. The model judges the refusals themselves.
		_, held := s.model.keyHolders(req, action.sentAt, answer.at)
		for _, earlier := range req.answers[:len(req.answers)-1] {
			if freedSince(req, earlier) || (!held && refusedAsReused(earlier)) {
				continue
			}
			if definitive(earlier) && earlier.body != answer.body && earlier.lifeStart.Equal(answer.lifeStart) &&
				answer.at.Before(earlier.lifeStart.Add(idempotencyKeyTTL)) {
				return s.fail("%s key %s of %s answered differently within a day:\n  %d %s\n  %d %s",
					req.path, req.key, req.client.user, earlier.status, earlier.body, answer.status, answer.body)
			}
		}
	}
	switch req.kind {
	case "hostile":
		if answer.status != http.StatusBadRequest && answer.status != http.StatusServiceUnavailable {
			return s.fail("hostile body %s got %d, want 400: %s", req.body, answer.status, answer.body)
		}
	case "create":
		if !action.clockMovedFrom.IsZero() {
			s.probeClockMovedCreate(action, answer)
		}
		if answer.status == http.StatusCreated {
			orderID := orderField([]byte(answer.body), "order_id")
			if orderID == "" {
				return s.fail("a 201 without an order id: %s", answer.body)
			}
			if !containsString(req.client.orders, orderID) {
				req.client.orders = append(req.client.orders, orderID)
			}
		}
		// A key is "reused" only while it lives: a day after every answer
		// given under it, it is free for a new request.
		if answer.status == http.StatusUnprocessableEntity && problemType(orderField([]byte(answer.body), "type")) == problemKeyReused {
			// (From when it was sent: a request that waited in a group
			// commit's queue was decided before its client heard.)
			// (Unless a request under the key whose outcome is in doubt
			// may hold it: see heldInDoubt.)
			if last, ok := lastAnswerUnderKey(req.client, req.key, req); ok && action.sentAt.Sub(last) >= idempotencyKeyTTL &&
				!heldInDoubt(req.client, req.key, req, action.sentAt) {
				return s.fail("key %s of %s is refused as reused %s after its last answer: it has expired", req.key, req.client.user, action.sentAt.Sub(last))
			}
		}
	case "refund":
		if answer.status == http.StatusOK && orderField([]byte(answer.body), "refund_id") == "" {
			return s.fail("a refund 200 without a refund id: %s", answer.body)
		}
		s.probeRefundExpiry(req, answer)
		// A refund key replays its answer for a day from that answer; only
		// then may it be refused as expired.
		if answer.status == http.StatusUnprocessableEntity && problemType(orderField([]byte(answer.body), "type")) == problemKeyExpired {
			var settledAt string
			err := s.direct.QueryRowContext(ctx, `SELECT updated_at FROM refunds WHERE order_id = ? AND idempotency_key = ?`,
				req.orderID, req.key).Scan(&settledAt)
			if err != nil {
				return s.fail("refund key %s refused as expired, but no refund was made under it: %v", req.key, err)
			}
			settled, err := time.Parse(timeFormat, settledAt)
			if err != nil {
				return fmt.Errorf("refund time %q: %w", settledAt, err)
			}
			if answer.at.Sub(settled) < idempotencyKeyTTL {
				return s.fail("refund key %s refused as expired %s after its refund was settled, within a day", req.key, answer.at.Sub(settled))
			}
		}
	}
	if err := s.judgeProbe(action, answer); err != nil {
		return err
	}
	return s.model.judge(s, action, answer)
}

// definitive reports whether answer is the request's outcome, one that a
// retry must get again: not a "try again" (503, or a 409 that says the key
// or the payment is busy).
func definitive(answer simAnswer) bool {
	if answer.status == http.StatusServiceUnavailable {
		return false
	}
	kind := problemType(orderField([]byte(answer.body), "type"))
	return answer.status != http.StatusConflict || (kind != problemKeyInProgress && kind != problemPaymentPending)
}

// refusedAsReused reports whether answer refused its key as reused.
func refusedAsReused(answer simAnswer) bool {
	return answer.status == http.StatusUnprocessableEntity && problemType(orderField([]byte(answer.body), "type")) == problemKeyReused
}

// freedSince reports whether earlier, an answer req got, was a refusal of
// its key as reused by another request of its client (whose answer the
// key does not store) that has since freed the key: it was refused as too
// early (409 payment-pending) or failed transiently (503), which leave
// nothing under the key. The key is then new again, and req may get
// another answer.
func freedSince(req *simRequest, earlier simAnswer) bool {
	if !refusedAsReused(earlier) {
		return false
	}
	for _, other := range req.client.requests {
		if other == req || other.key != req.key {
			continue
		}
		for _, answer := range other.answers {
			if answer.at.Before(earlier.at) {
				continue
			}
			kind := problemType(orderField([]byte(answer.body), "type"))
			if answer.status == http.StatusServiceUnavailable || (answer.status == http.StatusConflict && kind == problemPaymentPending) {
				return true
			}
		}
	}
	return false
}

// lastAnswerUnderKey returns the time of the latest definitive answer that
// a request of client other than except got under key, or that the server
// stored for it when the answer was lost on the way.
func lastAnswerUnderKey(client *simClient, key string, except *simRequest) (time.Time, bool) {
	var last time.Time
	found := false
	for _, req := range client.requests {
		if req == except || req.key != key {
			continue
		}
		for _, answer := range req.answers {
			if definitive(answer) && (!found || answer.at.After(last)) {
				last, found = answer.at, true
			}
		}
		if !req.commitLostAt.IsZero() && (!found || req.commitLostAt.After(last)) {
			last, found = req.commitLostAt, true
		}
	}
	return last, found
}

// heldInDoubt reports whether a request of client under key, other than
// except, whose outcome its client never learned may hold the key at at:
// a send whose connection dropped (a create queued in a group commit
// whose process crashed may still be committed by its leader) holds it
// for a day from when it ended; a refund in doubt, until it is finished,
// however long that takes, since an unfinished key never expires (see
// lookupKey and mayHoldUntil).
func heldInDoubt(client *simClient, key string, except *simRequest, at time.Time) bool {
	for _, req := range client.requests {
		inDoubt := req.sends > len(req.answers) || (req.kind == "refund" && undecided(req))
		if req != except && req.key == key && inDoubt && mayHaveClaimed(req) && at.Before(mayHoldUntil(req)) {
			return true
		}
	}
	return false
}

// shorten cuts s to n bytes for the trace.
func shorten(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// containsString reports whether items holds item.
func containsString(items []string, item string) bool {
	for _, i := range items {
		if i == item {
			return true
		}
	}
	return false
}

// checkInFlight runs check --in-flight.
func (s *simulation) checkInFlight(ctx context.Context) error {
	violations, err := s.auditor.audit(ctx, s.clock.now(), false)
	if err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	violations = s.withoutSetAside(violations)
	for _, v := range violations {
		if v.Invariant == undeliveredInvariant {
			// The clock jumps a day between two worker passes here:
			// checked once quiet (see invariant.publishedBefore).
			continue
		}
		return s.fail("invariant broken: %s: %s", v.Invariant, v.Detail)
	}
	if err := s.checkFailuresCounted(ctx); err != nil {
		return err
	}
	if err := s.checkPublishedInBroker(ctx); err != nil {
		return err
	}
	return s.checkSetAside(ctx)
}

// quiesce ends the run: no more faults; what waits goes on; clients retry
// every request they got no definitive answer to; the workers run until
// quiet; then the full check and the clients' view.
func (s *simulation) quiesce(ctx context.Context) error {
	s.quiescing = true
	s.poisonRun, s.expiryProbe = nil, nil
	s.tracef("quiesce: no more faults")
	s.endOutage(s.network)
	s.endOutage(s.brokerNetwork)
	s.disarmBusy()
	if err := s.freeDisk(ctx); err != nil {
		return err
	}
	if err := s.releaseGroupCommit(ctx); err != nil {
		return err
	}
	// In turn: a request queued in the group commit waits for the one
	// that leads its batch.
	for turn := 0; len(s.actions) > 0; turn++ {
		if turn == 100*simulationSteps {
			return s.fail("%d actions never finished, the first %s %s waiting at %s", len(s.actions),
				s.actions[0].process.name, s.actions[0].what, s.actions[0].waitingAt)
		}
		if err := s.resume(ctx, s.actions[turn%len(s.actions)]); err != nil {
			return err
		}
	}
	if s.violation != nil {
		return s.violation
	}
	// Every client asks once more for each refund it was answered: the
	// same answer while the key lives, a day from when it was settled.
	for _, client := range s.clients {
		for _, req := range client.requests {
			if req.kind == "refund" && !undecided(req) {
				if err := s.resend(ctx, req); err != nil {
					return err
				}
			}
		}
	}
	released, err := s.releasedGaveUp(ctx)
	if err != nil {
		return err
	}
	waitedForDelivery := false
	for round := 0; ; round++ {
		if round == 50 {
			return s.fail("the system did not settle after 50 rounds%s", s.whyUnsettled(ctx))
		}
		busy := false
		for _, client := range s.clients {
			for _, req := range client.requests {
				// A send whose connection dropped is asked again even if an
				// earlier one was answered: its client does not know what
				// it did.
				inDoubt := undecided(req) || (req.lastDropped && req.kind != "hostile")
				if !inDoubt || (req.kind == "webhook" && s.processorGaveUp(req)) || req.gaveUp {
					continue
				}
				busy = true
				if err := s.resend(ctx, req); err != nil {
					return err
				}
			}
		}
		for _, process := range s.processes[2:] {
			s.sagaSteps = 0
			n, err := s.app.runWorkersOnce(ctx, process.name)
			if s.violation != nil {
				return s.violation
			}
			if err != nil {
				return s.fail("workers while quiet: %v", err)
			}
			busy = busy || n > 0
		}
		if round == 0 {
			if err := s.checkCompleterFinished(ctx, released); err != nil {
				return err
			}
		}
		repaired, err := s.repairWhileQuiet(ctx)
		if err != nil {
			return err
		}
		if s.violation != nil {
			return s.violation
		}
		busy = busy || repaired
		if !busy && waitedForDelivery {
			break
		}
		// Past every lease and backoff, and the reconciler's bound: a round
		// with nothing due must mean nothing is left, not that it waits for
		// a later time. A message the broker lost shows only once the bound
		// has passed: one more round after an idle one.
		waitedForDelivery = !busy
		s.clock.advance(s.pastEveryWait())
	}
	violations, err := s.auditor.audit(ctx, s.clock.now(), true)
	if err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	for _, v := range violations {
		if s.refusedOnPurpose(v) {
			continue
		}
		return s.fail("once quiet, invariant broken: %s: %s", v.Invariant, v.Detail)
	}
	if err := s.checkLedger(ctx); err != nil {
		return err
	}
	return s.checkClientsAgainstDatabase(ctx)
}

// pastEveryWait is a time longer than any lease or backoff of the App: the
// longest wait of the relay, of a consumer's redelivery and of a saga (each
// backoff at its cap, which a millionth failure has reached), every lease
// and the reconciler's bound; plus a minute.
func (s *simulation) pastEveryWait() time.Duration {
	const capped = 1 << 20
	leases := s.app.leases
	return time.Minute + max(
		relayBackoff(leases.publishBackoff, capped),
		consumeBackoff(capped),
		sagaBackoff(capped),
		leases.relay, leases.ackWait, leases.saga, leases.refundLock, leases.deliver)
}

// whyUnsettled returns ": " and the first promise of a quiet system that
// does not hold yet, or nothing: what kept the system from settling (an
// order stuck created has its clients ask for refunds for ever).
func (s *simulation) whyUnsettled(ctx context.Context) string {
	violations, err := s.auditor.audit(ctx, s.clock.now(), true)
	if err != nil || len(violations) == 0 {
		return ""
	}
	return fmt.Sprintf(": %s: %s", violations[0].Invariant, violations[0].Detail)
}

// refusedOnPurpose reports whether v is the poison record of an event the
// simulator made invalid on purpose.
func (s *simulation) refusedOnPurpose(v violation) bool {
	if v.Invariant != "once quiet, no message is poison" {
		return false
	}
	_, rest, _ := strings.Cut(v.Detail, " gave up on ")
	messageID, _, _ := strings.Cut(rest, ":")
	return strings.HasPrefix(v.Detail, webhookConsumer+" ") && containsString(s.refusedEvents, messageID)
}

// undecided reports whether the client still waits for a definitive answer
// to req: none yet, or only "in progress" and "try again".
func undecided(req *simRequest) bool {
	if req.kind == "hostile" || req.kind == "stale-signed" {
		return false
	}
	if len(req.answers) == 0 {
		// A webhook the processor sent got no answer: it sends it again.
		return true
	}
	return !definitive(req.answers[len(req.answers)-1])
}

// resend sends req again, synchronously, while quiet.
func (s *simulation) resend(ctx context.Context, req *simRequest) error {
	action := &simAction{process: s.processes[0], request: req, recorder: httptest.NewRecorder(),
		what: fmt.Sprintf("%s retries %s %s key=%s", req.client.name, req.method, req.path, req.key)}
	s.sending(action)
	return s.start(ctx, action, func(ctx context.Context) {
		s.send(ctx, action)
	})
}

// send is the HTTP side of a client action: the request goes through the
// whole handler chain, in this coroutine.
func (s *simulation) send(ctx context.Context, action *simAction) {
	req := action.request
	httpReq := httptest.NewRequestWithContext(ctx, req.method, req.path, strings.NewReader(req.body))
	httpReq.Header.Set("Content-Type", "application/json")
	if req.kind == "webhook" || req.kind == "stale-signed" {
		httpReq.Header.Set(signatureHeader, signWebhook(s.secret, s.clock.now().Add(req.signSkew), []byte(req.body)))
	} else {
		httpReq.Header.Set("Authorization", "Bearer "+req.client.apiKey)
		httpReq.Header.Set("Idempotency-Key", req.key)
	}
	s.handler.ServeHTTP(action.recorder, httpReq)
}

// checkClientsAgainstDatabase checks what clients were told against what
// the database holds: each order a client got a 201 for exists once and is
// its user's; every order made under a key was told to some client; every
// refund a client got a 200 for succeeded with that amount; a hostile
// request left no key behind.
func (s *simulation) checkClientsAgainstDatabase(ctx context.Context) error {
	told := map[string]bool{}
	for _, client := range s.clients {
		for _, orderID := range client.orders {
			told[orderID] = true
			var n int
			// NULL when the order does not exist.
			var user sql.NullString
			err := s.direct.QueryRowContext(ctx, `SELECT COUNT(*), MIN(user_id) FROM orders WHERE order_id = ?`, orderID).Scan(&n, &user)
			if err != nil {
				return fmt.Errorf("read order: %w", err)
			}
			if n != 1 || user.String != client.user {
				return s.fail("%s was told of order %s, which exists %d times (user %q)", client.name, orderID, n, user.String)
			}
		}
		for _, req := range client.requests {
			for _, answer := range req.answers {
				switch {
				case req.kind == "refund" && answer.status == http.StatusOK:
					refundID := orderField([]byte(answer.body), "refund_id")
					var status string
					err := s.direct.QueryRowContext(ctx, `SELECT status FROM refunds WHERE refund_id = ?`, refundID).Scan(&status)
					if err != nil || status != "succeeded" {
						return s.fail("%s got 200 for refund %s, which is %q (%v)", client.name, refundID, status, err)
					}
				case req.kind == "hostile":
					var n int
					err := s.direct.QueryRowContext(ctx, `SELECT COUNT(*) FROM idempotency_keys WHERE user_id = ? AND idempotency_key = ?`,
						client.user, req.key).Scan(&n)
					if err != nil || n != 0 {
						return s.fail("hostile request under key %s left %d key rows (%v)", req.key, n, err)
					}
				}
			}
		}
	}
	rows, err := s.direct.QueryContext(ctx, `SELECT order_id FROM orders ORDER BY order_id`)
	if err != nil {
		return fmt.Errorf("read orders: %w", err)
	}
	var untold []string
	for rows.Next() {
		var orderID string
		if err := rows.Scan(&orderID); err != nil {
			rows.Close()
			return fmt.Errorf("read orders: %w", err)
		}
		if !told[orderID] {
			untold = append(untold, orderID)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read orders: %w", err)
	}
	for _, orderID := range untold {
		if !s.answerLostAndKeyExpired(ctx, orderID) {
			return s.fail("order %s exists, but no client was ever told of it", orderID)
		}
	}
	return s.model.checkFinal(ctx, s)
}

// answerLostAndKeyExpired reports whether order orderID, which no client
// was told of, was made by a request whose commit landed while its answer
// was lost (the client got a 503), and whose client did not ask again
// under that key until the key had expired: the client gave up on the
// request too late to learn its outcome, which the 503 told it to do. Any
// other untold order is a broken promise.
func (s *simulation) answerLostAndKeyExpired(ctx context.Context, orderID string) bool {
	var user, key, createdAt string
	err := s.direct.QueryRowContext(ctx, `SELECT user_id, idempotency_key, created_at FROM orders WHERE order_id = ?`, orderID).
		Scan(&user, &key, &createdAt)
	if err != nil {
		return false
	}
	created, err := time.Parse(timeFormat, createdAt)
	if err != nil {
		return false
	}
	for _, client := range s.clients {
		if client.user != user {
			continue
		}
		for _, req := range client.requests {
			if req.key != key || req.commitLostAt.IsZero() {
				continue
			}
			askedInTime := false
			for _, answer := range req.answers {
				since := answer.at.Sub(created)
				askedInTime = askedInTime || (definitive(answer) && since >= 0 && since < idempotencyKeyTTL)
			}
			if !askedInTime {
				s.tracef("order %s was made under key %s, whose answer was lost; %s did not ask again within the key's day",
					orderID, key, client.name)
				return true
			}
		}
	}
	return false
}

// newSimulateCommand builds "retrysafe simulate".
func newSimulateCommand() *cobra.Command {
	var seed uint64
	var seeds, steps int
	var dbPath string
	var trace bool
	cmd := &cobra.Command{
		Use:   "simulate",
		Short: "Run the deterministic simulator: clients, workers, crashes, pauses and clock jumps from a seed",
		Long: `simulate runs every layer in one process, driven by one seeded random
source: virtual clients (new requests, retries, concurrent duplicates, keys
reused after expiry, refunds, hostile bodies, signed webhooks), workers
under leases, process crashes, pauses past a lease, clock jumps, lost
processor responses, a processor that does not answer a retrieve (or whose
API is down for a few steps while a forged refund event arrives), database
outages (one may begin inside a transaction, or just after a commit, whose
answer is then lost; on PostgreSQL also backends terminated mid-transaction
and serialization failures), a database busy at one statement of a
consumer's effect or of a create inside a group commit, a full disk, group
commits of several members, consumers that fail, orders of several items,
keys reused on another route, two users who choose the same key strings, our
own refunds announced in flight, refunds abandoned mid-call and asked for
again a day later, saga workers frozen past their lease, a second consumer
of OrderCreated (a ledger) that a lost message may miss while the payment
service applied it, a poison message replayed before its consumer's ack,
replays that reach every consumer of the subject (one whose inbox forgot the
message after a week included) or that the broker loses, a broker that
delivers a batch out of order, loses acks and gets publishes twice, orders
for exactly the stock that remains, retries at a key's expiry (or a
microsecond before) and of a create whose transaction spanned a clock move,
refunds given up on after a processor timeout, signed events of a real
refund with another amount or signed beyond the tolerance, a message
that fails at every delivery until it is poison, orders refunded twice
in a row while the broker refuses the first refund's event, and saga
workers cut off from the processor until their sagas have failed five times
in a row. Every
answer is judged, as it is given, against a reference model of what the
request must get; after every step the in-flight invariants of check must
hold and every event marked published must be in the broker, and each event
must reach the broker first after the events of its order written before it;
at the end the
system is made quiet and the full check, each order's fate and every answer
the clients got are checked.

The same seed gives the same run, byte for byte: a failure prints its seed
and step, and 'retrysafe simulate --seed N --trace' replays it.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if seeds < 1 || steps < 1 {
				return fmt.Errorf("--seeds and --steps must be at least 1 (got %d and %d)", seeds, steps)
			}
			if dbPath != "" && seeds > 1 {
				return errors.New("--db keeps the database of one run; use it with one seed, not --seeds")
			}
			out := cmd.OutOrStdout()
			start := time.Now()
			totalSteps := 0
			var total simCounts
			for i := range uint64(seeds) {
				opts := simOptions{seed: seed + i, steps: steps, path: dbPath}
				if trace {
					opts.progress = out
				}
				report, err := simulateOnce(cmd.Context(), opts)
				if err != nil {
					return err
				}
				totalSteps += report.Steps
				total.add(report.Counts)
				if report.Failure != "" {
					if !trace {
						fmt.Fprintln(out, strings.Join(report.Trace, "\n"))
					}
					return fmt.Errorf("seed %d failed at step %d: %s\nreplay: retrysafe simulate --seed %d --steps %d --trace",
						report.Seed, report.FailureStep, report.Failure, report.Seed, steps)
				}
				if seeds == 1 || trace {
					c := report.Counts
					fmt.Fprintf(out, "seed %d: %d steps, %d requests (%d retries, %d refunds, %d webhooks, %d hostile), "+
						"%d worker passes, %d waits at fault points, %d pauses past a lease, %d crashes, %d clock jumps, %d lost responses, "+
						"%d database outages (%d commits whose answer was lost, %d answers 503), "+
						"%d batches delivered out of order, %d lost acks, %d publishes sent twice, %d acknowledged messages lost, "+
						"%s%s: ok\n",
						report.Seed, report.Steps, c.Requests, c.Retries, c.Refunds, c.Webhooks, c.Hostile,
						c.WorkerPasses, c.Suspensions, c.Pauses, c.Crashes, c.ClockJumps, c.LostResponses,
						c.Outages, c.LostCommits, c.Answers503, c.Reorders, c.LostAcks, c.DuplicatePublishes, c.LostMessages, c.structures(),
						c.summary(isPostgresURL(dbPath)))
					fmt.Fprintf(out, "  %s\n", c.Repairs)
				}
			}
			elapsed := time.Since(start)
			fmt.Fprintf(out, "%d seeds from %d passed: %d steps in %s (%.0f steps/s, %.0f seeds/min); "+
				"%d requests, %d worker passes, %d waits at fault points, %d pauses past a lease, %d crashes, %d clock jumps, "+
				"%d database outages, %d lost commit answers, %d batches out of order, %d lost acks, %d acknowledged messages lost, %s%s\n",
				seeds, seed, totalSteps, elapsed.Round(time.Millisecond),
				float64(totalSteps)/elapsed.Seconds(), float64(seeds)/elapsed.Minutes(),
				total.Requests, total.WorkerPasses, total.Suspensions, total.Pauses, total.Crashes, total.ClockJumps,
				total.Outages, total.LostCommits, total.Reorders, total.LostAcks, total.LostMessages, total.structures(),
				total.summary(isPostgresURL(dbPath)))
			fmt.Fprintf(out, "  %s\n", total.Repairs)
			return nil
		},
	}
	cmd.Flags().Uint64Var(&seed, "seed", 1, "the seed of the (first) run")
	cmd.Flags().IntVar(&seeds, "seeds", 1, "how many seeds to run, from --seed on; stops at the first failure")
	cmd.Flags().IntVar(&steps, "steps", simulationSteps, "steps per run before the system is made quiet")
	cmd.Flags().StringVar(&dbPath, "db", "", "keep the run's database: a new SQLite file, or the postgres:// URL of an empty database (one seed only)")
	cmd.Flags().BoolVar(&trace, "trace", false, "print every step as it happens")
	return cmd
}
