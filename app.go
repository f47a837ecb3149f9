// This file wires the layers together: one database, one clock, one source
// of ids and one fault hook, shared by the API, the relay, the consumers, the
// saga and the fake card processor.

package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Durations and limits of the protocol. Each says why it has its value.
const (
	// idempotencyKeyTTL is how long a key replays. Clients give up retrying
	// well within a day; Stripe keeps keys for 24 hours.
	idempotencyKeyTTL = 24 * time.Hour

	// relayLease is how long a relay holds the relay lease (holdRelayLease)
	// without renewing it. Publishing a batch takes milliseconds; a relay
	// that has not renewed after 30s has died or stalled, and another may
	// take the lease over.
	relayLease = 30 * time.Second
	// maxPublishAttempts is how often the relay tries one event before it
	// marks it failed for an operator. With relayBackoff that is about 8.5
	// minutes of trying.
	maxPublishAttempts = 10

	// ackWait is how long the broker waits for an ack before it delivers the
	// message again. It must exceed the slowest consumer's transaction.
	ackWait = 30 * time.Second
	// maxDeliveries is how many times the consumer's own code may fail a
	// message for a transient reason before the inbox records it poison
	// (an outage counts nothing: it is not the message's fault).
	maxDeliveries = 5

	// sagaLease is how long a worker owns a saga it is running; recovery
	// resumes sagas whose lease passed.
	sagaLease = 30 * time.Second
	// maxCompensationAttempts is how often a compensation that fails for a
	// transient reason is tried before the saga becomes compensation_failed
	// and waits for an operator.
	maxCompensationAttempts = 5

	// refundLockTimeout is the lease of a refund request on its key: far
	// longer than a processor call and a few transactions take, so a retry
	// rarely takes over a request that is merely slow. If it does, the slow
	// request finds its lease gone at its next phase and stops (holdsLease).
	refundLockTimeout = 90 * time.Second

	// deliveryBound is how long after an event's publish the reconciler
	// (deliver.go) waits for every consumer's inbox row before it takes
	// the message for lost and publishes it again. Ten ackWaits: a
	// consumer that is merely slow, or a message redelivered a few times,
	// rarely gets a copy; a consumer whose backlog is older than this gets
	// copies its inbox absorbs (and on NATS every consumer of the subject
	// gets each copy). A shorter bound finds a loss sooner and sends more
	// copies that were not needed.
	deliveryBound = 5 * time.Minute
)

// leaseTimes are how long a worker owns what it claimed. Production uses
// scaledLeaseTimes(1): the constants above. The chaos run shortens them all
// by one factor, so that the work of a killed process is taken over within
// seconds and a run takes a minute instead of ten.
type leaseTimes struct {
	relay, ackWait, saga, refundLock time.Duration
	// deliver is the reconciler's deliveryBound.
	deliver time.Duration
	// publishBackoff is the relay's first wait after a failed publish; it
	// doubles with each attempt (relayBackoff).
	publishBackoff time.Duration
}

// scaledLeaseTimes returns the lease constants multiplied by scale.
func scaledLeaseTimes(scale float64) leaseTimes {
	scaled := func(d time.Duration) time.Duration { return time.Duration(float64(d) * scale) }
	return leaseTimes{
		relay:          scaled(relayLease),
		publishBackoff: scaled(time.Second),
		ackWait:        scaled(ackWait),
		saga:           scaled(sagaLease),
		refundLock:     scaled(refundLockTimeout),
		deliver:        scaled(deliveryBound),
	}
}

// App holds what every layer shares. Its function fields are the test seams:
// tests and the demo pass a fixed clock, predictable ids and a fault hook.
type App struct {
	db *sql.DB
	// readDB reads committed data beside db, without the write lock: GETs
	// and the replay of a settled key (see readersOf).
	readDB    *sql.DB
	broker    messageBroker
	processor *Processor

	// now is the clock; every stored time comes from it.
	now func() time.Time
	// newID returns a fresh id with a readable prefix ("ord", "evt", ...).
	newID func(prefix string) string
	// fault is called at every faultPoint; nil in production.
	fault faultHook
	// leases are the lease durations; see leaseTimes.
	leases leaseTimes
	// group, if set, commits concurrent creates together (see
	// infra_groupcommit.go); on SQLite only.
	group *groupCommitter
	// writeTx runs a transaction that claims an idempotency key: in a
	// group commit (SQLite) or a transaction of its own (PostgreSQL, and
	// the demo). Chosen once, in newApp, so that a debugger's step from a
	// handler goes straight to the one that runs.
	writeTx keyWriter
	// entry is where the server, the consumers and the saga engine enter
	// the layers that demo --without can replace: a.createOrder,
	// a.receiveIn and a.compensate, unless withoutLayer (demo_without.go)
	// swapped one for the naive code the article warns against. Chosen
	// once, when the App is wired: the layers have no demo branches.
	entry layerEntries
	// createReadsInTx makes the create path read what it checks (is the
	// key settled, does each SKU it has not seen exist) in its own
	// transaction rather than first, outside it, on a read connection.
	// Set in newApp on
	// PostgreSQL, which has no read connection beside the pool: there a
	// read outside a transaction is a transaction of its own, a fresh key
	// paid for a look that found nothing, and the write path's look
	// answers a replay just as well, in the one transaction.
	createReadsInTx bool
	// stockedSKUs holds the SKUs checkSKUs found stocked, which it need
	// not look up again: no code deletes a row of stock_items.
	stockedSKUs sync.Map
	// sagaCallsSideBySide makes the processor calls of a saga round side
	// by side rather than one after another (sagaCalls). serve and worker
	// set it on PostgreSQL (startWorkerLoops); on SQLite, and wherever a
	// pass must be the same every time (the demo, tests, the simulator),
	// they run in order.
	sagaCallsSideBySide bool
	// log records each background action (a relay publish, an inbox
	// outcome, a saga step) with its order id; serve, relay and worker
	// give it theirs, and it discards everything otherwise.
	log *slog.Logger
	// metrics counts what this process does (metrics.go); nil, and free,
	// unless serve or --metrics-addr asked for them.
	metrics *metrics
	// wake wakes the loops when there is work for them (infra_wakeup.go).
	wake wakeups
	// idle is how long the loops sleep when they find nothing and nobody
	// wakes them: the safety net for a signal that never came.
	idle idleTimes
	// repairAudits holds a token while an audit after a repair runs: one
	// at a time (auditAfterRepair).
	repairAudits chan struct{}
	// relayLeases remembers the relay lease each of this process's relays
	// holds, so that a sweep reads no lease row while half of it remains
	// (holdRelayLease).
	relayLeases relayLeaseMemory
	// repairAuditBudget bounds the audit that an /admin or console repair
	// answers with (see answerAudit).
	repairAuditBudget time.Duration
	// tracerProvider makes the spans that follow an order through every
	// layer (tracing.go): a no-op one unless serve, relay or worker found
	// OTEL_EXPORTER_OTLP_ENDPOINT set.
	tracerProvider trace.TracerProvider
	// deliveryTargets are the consumers the reconciler waits for, per
	// subject: deliveryTargets(), read off consumers(), and those of the
	// consumers addConsumer wired in. A test adds one to stand for a
	// second consumer of a subject.
	deliveryTargets []deliveryTarget
	// addedConsumers are the consumers wired in beside the system's own
	// (addConsumer), after them in consumers().
	addedConsumers []consumer
}

// idleTimes are the loops' sleeps when idle. Production uses relayIdle and
// workerIdle; a test sets them to an hour, to show that a wake-up, not a
// poll, moved an order on.
type idleTimes struct {
	relay, worker time.Duration
}

// newApp returns an App over db. clock, ids and fault may be nil for the
// wall clock, random UUIDs and no faults.
func newApp(db *sql.DB, clock func() time.Time, ids func(prefix string) string, fault faultHook) *App {
	if clock == nil {
		clock = time.Now
	}
	if ids == nil {
		ids = newIDs(rand.Reader)
	}
	leases := scaledLeaseTimes(1)
	var group *groupCommitter
	writeTx := ownTxWriter(db)
	if dialectOf(db).name == "sqlite" {
		group = newGroupCommitter(db)
		writeTx = groupWriter(group)
	}
	app := &App{
		db:        db,
		readDB:    readersOf(db),
		broker:    &embeddedBroker{db: db, now: clock, fault: fault, ackWait: leases.ackWait},
		processor: &Processor{db: db, now: clock, newID: ids, fault: fault},
		now:       clock,
		newID:     ids,
		fault:     fault,
		leases:    leases,
		group:     group,
		writeTx:   writeTx,

		createReadsInTx: dialectOf(db).name == "postgres",
		idle:            idleTimes{relay: relayIdle, worker: workerIdle},
		log:             slog.New(slog.DiscardHandler),

		repairAudits: make(chan struct{}, 1),

		repairAuditBudget: repairAuditBudget,
		tracerProvider:    noop.NewTracerProvider(),
	}
	var consumerNames []string
	for _, c := range app.consumers() {
		consumerNames = append(consumerNames, c.name)
	}
	app.wake = newWakeups(consumerNames...)
	app.deliveryTargets = deliveryTargets()
	app.entry = layerEntries{
		createOrder: app.createOrder,
		receiveIn:   app.receiveIn,
		compensate:  app.compensate,
	}
	return app
}

// layerEntries are the entry points of the layers that demo --without can
// replace (see App.entry).
type layerEntries struct {
	createOrder func(ctx context.Context, req idempotentRequest, order orderRequest) (apiResponse, error)
	receiveIn   func(ctx context.Context, tx *sql.Tx, undo *itemUndo, consumerName, messageID string, deliveryCount, maxFailures int, apply func(tx *sql.Tx) error) (receiveResult, error)
	compensate  func(ctx context.Context, run *sagaRun) error
}

// setLeaseTimes changes every lease of the App, the embedded broker's
// ackWait too.
func (a *App) setLeaseTimes(leases leaseTimes) {
	a.leases = leases
	if embedded, ok := a.broker.(*embeddedBroker); ok {
		embedded.ackWait = leases.ackWait
	}
}

// newIDs returns an id generator that reads UUID randomness from r: crypto
// randomness in production, a seeded source in the demo so that its output
// is the same on every run.
func newIDs(r io.Reader) func(prefix string) string {
	var mu sync.Mutex
	return func(prefix string) string {
		mu.Lock()
		defer mu.Unlock()
		id, err := uuid.NewRandomFromReader(r)
		if err != nil {
			panic(fmt.Sprintf("bug: read uuid randomness: %v", err))
		}
		return prefix + "_" + id.String()
	}
}

// fakeClock is a clock that moves only when told, for the demo and tests:
// leases and backoffs expire when the story says so, not when the machine is
// slow.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

// newFakeClock returns a fakeClock at t.
func newFakeClock(t time.Time) *fakeClock {
	return &fakeClock{t: t}
}

// now returns the clock's time.
func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// advance moves the clock forward by d.
func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// runWorkersOnce runs one pass of every background job: relay, consumers,
// sagas, the refund completer. It returns how many things it did, so callers
// can run it until quiet.
func (a *App) runWorkersOnce(ctx context.Context, workerID string) (int, error) {
	total := 0
	published, err := a.relayOnce(ctx, workerID, relayBatchSize)
	if err != nil {
		return total, fmt.Errorf("relay: %w", err)
	}
	total += published
	republished, err := a.reconcileOnce(ctx, workerID, relayBatchSize)
	if err != nil {
		return total, fmt.Errorf("reconciler: %w", err)
	}
	total += republished
	for _, c := range a.consumers() {
		results, err := a.consumeOnce(ctx, c, consumeBatchSize)
		if err != nil {
			return total, fmt.Errorf("consume %s: %w", c.name, err)
		}
		total += len(results)
	}
	advanced, err := a.sagaOnce(ctx, workerID, sagaBatchSize)
	if err != nil {
		return total, fmt.Errorf("saga: %w", err)
	}
	total += advanced
	completed, err := a.completeRefundsOnce(ctx, refundBatchSize)
	if err != nil {
		return total, fmt.Errorf("refund completer: %w", err)
	}
	total += completed
	return total, nil
}
