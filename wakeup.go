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
// This works within one process. Processes that share the database find
// each other's work by polling.

package main

// wakeup wakes one loop. Signals sent while the loop is busy collapse into
// one: the loop runs passes until one finds nothing, so one pass after the
// last signal is all that signal needs.
type wakeup struct {
	ready chan struct{}
}

// newWakeup returns a wakeup with no signal pending.
func newWakeup() *wakeup {
	return &wakeup{ready: make(chan struct{}, 1)}
}

// signal wakes the loop, or leaves a signal for its next wait if it is
// busy. It never blocks.
func (w *wakeup) signal() {
	select {
	case w.ready <- struct{}{}:
	default:
		// A signal is pending already; the loop will look after this
		// commit anyway.
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
}

// newWakeups returns the wakeups of the relay, the saga loop and one per
// consumer in consumerNames.
func newWakeups(consumerNames ...string) wakeups {
	w := wakeups{relay: newWakeup(), saga: newWakeup(), consumers: map[string]*wakeup{}}
	for _, name := range consumerNames {
		w.consumers[name] = newWakeup()
	}
	return w
}

// published wakes every consumer: messages were published, for one or
// more of them.
func (w wakeups) published() {
	for _, consumer := range w.consumers {
		consumer.signal()
	}
}
