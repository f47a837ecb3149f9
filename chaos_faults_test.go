package main

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// Ensure a process's clock runs ahead by what the chaos run wrote to its
// clock file, plus its own skew, and keeps the last offset when the file
// goes missing.
func TestFileClock(t *testing.T) {
	t.Run("AddsTheFileOffsetAndTheSkew", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "clock")
		if err := os.WriteFile(path, []byte("25h"), 0o644); err != nil {
			t.Fatal(err)
		}
		before := time.Now()
		got := fileClock(path, 3*time.Second)()
		if want := before.Add(25*time.Hour + 3*time.Second); got.Before(want) || got.After(want.Add(time.Minute)) {
			t.Fatalf("clock says %s, want about %s", got, want)
		}
	})
	t.Run("RunsOnTheWallClockWithoutFlags", func(t *testing.T) {
		if clock := processClock("", 0); clock != nil {
			t.Fatal("processClock without a file or skew is not nil (the wall clock)")
		}
	})
	t.Run("JumpWritesWhatEveryProcessReads", func(t *testing.T) {
		clock, err := newChaosClock(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		if err := clock.jump(clockJump); err != nil {
			t.Fatal(err)
		}
		before := time.Now()
		got := fileClock(clock.path, 0)()
		if want := before.Add(clockJump); got.Before(want) || got.After(want.Add(time.Minute)) {
			t.Fatalf("after a jump a process reads %s, want about %s", got, want)
		}
		if clock.jumpCount() != 1 || clock.now().Before(before.Add(clockJump)) {
			t.Fatalf("the orchestrator's clock is at %s after %d jumps", clock.now(), clock.jumpCount())
		}
	})
	// A process reads the file at most every clockFileRefresh, so a key
	// first sent while a jump is being read may be stamped with the old
	// time and be expired for the next process that answers it: the
	// client must not demand a replay of it then.
	t.Run("KeyFirstSentDuringAJumpMayHaveExpiredAfterIt", func(t *testing.T) {
		clock, err := newChaosClock(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		run := &chaosRun{clock: clock}
		before := clock.settledJumps()
		jumped := make(chan error, 1)
		go func() { jumped <- clock.jump(clockJump) }()
		eventually(t, "the jump to start", waitLimit, func() (bool, string) {
			return clock.jumpCount() > 0, "no jump counted"
		})
		during := clock.settledJumps()
		if err := mustReceive(t, "the jump to settle", jumped); err != nil {
			t.Fatal(err)
		}
		if !run.keyMayHaveExpired(before) || !run.keyMayHaveExpired(during) {
			t.Fatal("a key first sent before or during the jump is judged as if it cannot have expired")
		}
		if after := clock.settledJumps(); run.keyMayHaveExpired(after) {
			t.Fatal("a key first sent after the jump settled is judged as if it may have expired")
		}
	})
}

// Ensure a pause outlasts every lease of the chaos processes, and an outage
// outlasts MaxDeliver x AckWait and SQLite's busy_timeout.
func TestChaosFaultLengths(t *testing.T) {
	leases := scaledLeaseTimes(chaosLeaseScale)
	if got := leaseLongest(leases) + time.Second; got <= leases.refundLock || got <= leases.saga || got <= leases.relay || got <= leases.ackWait {
		t.Fatalf("a pause of %s does not outlast the leases %+v", got, leases)
	}
	if got, want := outageLength(leases), time.Duration(maxDeliveries)*leases.ackWait; got <= want || got <= 10*time.Second {
		t.Fatalf("an outage of %s is not longer than MaxDeliver x AckWait (%s) and busy_timeout (10s)", got, want)
	}
}

// Ensure the broker-loss nemesis gives up an attempt nobody answers (a
// JetStream request to a server that was killed, or to a stream electing
// its leader) when the load is over, instead of holding the chaos run
// until its deadline: it made a run that had settled in 30 s report "the
// load did not finish within 5m0s".
func TestBrokerLossGivesUpWhenTheLoadIsOver(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	attempting := make(chan struct{}, 1)
	unanswered := func(ctx context.Context, _ func(int) int) (int, error) {
		select {
		case attempting <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return 0, ctx.Err()
	}
	stop := make(chan struct{})
	returned := make(chan error, 1)
	var lost int
	var mu sync.Mutex
	go func() { returned <- runBrokerLosses(ctx, 1, 10, unanswered, stop, &lost, &mu) }()
	<-attempting
	close(stop)
	select {
	case err := <-returned:
		if err != nil || lost != 0 {
			t.Fatalf("got %v and %d lost, want nil and 0", err, lost)
		}
	case <-time.After(time.Minute):
		t.Fatal("the nemesis still waits on its attempt a minute after the load is over")
	}
}
