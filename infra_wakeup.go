// Wake-ups. A worker loop that finds nothing to do sleeps before it looks
// again (startLoop in main.go), and an order passes five such loops on its
// way from POST to paid: the relay, the payment service's consumer, the
// saga, the relay again, the order service's consumer. Sleeping in each was
// most of the time an order took. So whoever commits work for a loop
// signals it, and the loop looks again at once. The sleep stays, as the
// safety net for a signal that never came: the work was written by another
// process, a notification was lost, the process restarted.
//
// A signal is only a hint: a loop that wakes and finds nothing sleeps again,
// and a loop that misses one finds the work at its next poll. So sending
// one never blocks, and it is sent after the commit, never inside the
// transaction: a loop woken before the commit would find nothing and then
// sleep through the work it was woken for.
//
// Across processes:
//   - On PostgreSQL, inserting an outbox event or a delivery notifies a
//     channel, in the writing transaction (schema_postgres.sql, version 3),
//     and PostgreSQL delivers the notification only when that transaction
//     commits. listenForWork, in every long-running process, turns the
//     notifications into the same signals.
//   - On NATS JetStream, the relay announces each batch JetStream has
//     stored on a plain subject that every process subscribes to
//     (natsBroker.announce).
//
// Processes that share one SQLite file have neither, and find each other's
// work by polling.

package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// wakeup wakes one loop. Signals sent while the loop is busy collapse into
// one: the loop runs passes until one finds nothing (the relay: less than a
// full batch), so one pass after the last signal is all that signal needs.
type wakeup struct {
	ready chan struct{}
	// sent counts the signals ever sent: a loop compares it before and
	// after a pass (dropIfSeen).
	sent atomic.Uint64
	// keepSeen: the loop's look may miss what a signal sent before it
	// announced (a JetStream consumer's FetchNoWait right after the
	// publish it was told of: the server hands the message to the consumer
	// a moment later), so a pass that found nothing keeps the signal.
	keepSeen atomic.Bool
}

// newWakeup returns a wakeup with no signal pending.
func newWakeup() *wakeup {
	return &wakeup{ready: make(chan struct{}, 1)}
}

// signal wakes the loop, or leaves a signal for its next wait if it is
// busy. It never blocks.
func (w *wakeup) signal() {
	w.sent.Add(1)
	select {
	case w.ready <- struct{}{}:
	default:
		// A signal is pending already; the loop will look after this
		// commit anyway.
	}
}

// count returns how many signals were sent so far (0 for a loop without a
// wakeup).
func (w *wakeup) count() uint64 {
	if w == nil {
		return 0
	}
	return w.sent.Load()
}

// dropIfSeen drops the pending signal if none was sent since count was
// seen, before a pass that has now ended: that signal was sent before the
// pass began, for work committed before it, which the pass's look found.
// Waking for it again was a look that found nothing (on PostgreSQL, a
// transaction) after most passes. A signal sent since stays, or is put
// back: the pass may have looked before that work was committed.
func (w *wakeup) dropIfSeen(seen uint64) {
	if w == nil || w.keepSeen.Load() {
		return
	}
	select {
	case <-w.ready:
	default:
	}
	if w.sent.Load() != seen {
		select {
		case w.ready <- struct{}{}:
		default:
		}
	}
}

// signaled returns the channel a waiting loop selects on; nil (never
// ready) for a loop without a wakeup.
func (w *wakeup) signaled() <-chan struct{} {
	if w == nil {
		return nil
	}
	return w.ready
}

// wakeups are the signals of an App's loops.
type wakeups struct {
	// relay: an outbox event was committed.
	relay *wakeup
	// saga: a saga was started.
	saga *wakeup
	// consumers: a message was published, one wakeup per consumer name.
	consumers map[string]*wakeup
	// outboxNotified: listenForWork listens, so PostgreSQL tells the
	// relay of every outbox event committed (outboxWritten).
	outboxNotified *atomic.Bool
}

// newWakeups returns the wakeups of the relay, the saga loop and one per
// consumer in consumerNames.
func newWakeups(consumerNames ...string) wakeups {
	w := wakeups{relay: newWakeup(), saga: newWakeup(), consumers: map[string]*wakeup{}, outboxNotified: &atomic.Bool{}}
	for _, name := range consumerNames {
		w.consumers[name] = newWakeup()
	}
	return w
}

// outboxWritten wakes the relay after a commit that wrote to the outbox,
// unless PostgreSQL does: while listenForWork listens, the commit's
// notification (the trigger outbox_events_notify) reaches the relay of
// every process, this one's too, and a signal sent here as well woke the
// relay a second time for the same event, for a claim that found nothing
// (0.4 of an order's statements at 8 clients).
func (w wakeups) outboxWritten() {
	if w.outboxNotified.Load() {
		return
	}
	w.relay.signal()
}

// published wakes every consumer: messages were published, for one or
// more of them.
func (w wakeups) published() {
	for _, consumer := range w.consumers {
		consumer.signal()
	}
}

// The PostgreSQL notification channels, notified by the triggers in
// schema_postgres.sql (version 3).
const (
	notifyOutbox     = "retrysafe_outbox"
	notifyDeliveries = "retrysafe_deliveries"
)

// listenRetry bounds the pause before listenForWork connects again.
const listenRetry = 30 * time.Second

// listenerName is the listening connection's application_name, so that
// pg_stat_activity tells it from the pool's.
const listenerName = "retrysafe listener"

// startListener starts listenForWork in a goroutine if dbURL is a
// PostgreSQL database; it exits when ctx is done.
func startListener(ctx context.Context, wg *sync.WaitGroup, app *App, dbURL string, logger *slog.Logger) {
	if !isPostgresURL(dbURL) {
		return
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		listenForWork(ctx, app, dbURL, logger)
	}()
}

// listenForWork LISTENs on a connection of its own to the PostgreSQL
// database at dbURL and signals app's loops for each notification, until
// ctx is done. A failed connection is opened again after a growing pause;
// meanwhile the loops poll.
func listenForWork(ctx context.Context, app *App, dbURL string, logger *slog.Logger) {
	failures := 0
	for ctx.Err() == nil {
		err := listenOnce(ctx, app, dbURL, func() { failures = 0 })
		if ctx.Err() != nil {
			return
		}
		failures++
		wait := min(time.Second<<min(failures-1, 5), listenRetry)
		logger.Error("listen for work failed", "error", err, "retry_in", wait)
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

// listenOnce connects, LISTENs, calls listening, and signals app's loops
// for each notification until the connection fails or ctx is done.
func listenOnce(ctx context.Context, app *App, dbURL string, listening func()) error {
	config, err := pgx.ParseConfig(dbURL)
	if err != nil {
		return fmt.Errorf("parse database URL %s: %w", redactURL(dbURL), err)
	}
	config.RuntimeParams["application_name"] = listenerName
	conn, err := pgx.ConnectConfig(ctx, config)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redactURL(dbURL), err)
	}
	// A cancelled ctx must not keep Close from telling the server goodbye.
	defer conn.Close(context.WithoutCancel(ctx))
	for _, channel := range []string{notifyOutbox, notifyDeliveries} {
		if _, err := conn.Exec(ctx, `LISTEN `+channel); err != nil {
			return fmt.Errorf("listen %s: %w", channel, err)
		}
	}
	listening()
	// From now on each outbox event committed is notified, by this
	// process's commits too; until this connection fails.
	app.wake.outboxNotified.Store(true)
	defer app.wake.outboxNotified.Store(false)
	// Work committed while nobody listened (before this connection, or
	// while it was down) was announced to no one: look once.
	app.wake.relay.signal()
	app.wake.published()
	for {
		notification, err := conn.WaitForNotification(ctx)
		if err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		switch notification.Channel {
		case notifyOutbox:
			app.wake.relay.signal()
		case notifyDeliveries:
			app.wake.published()
		default:
			return fmt.Errorf("bug: notification on unknown channel %q", notification.Channel)
		}
	}
}
