package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Ensure a process started with --set-aside sets aside what it works on, as
// chaos --repairs needs: its relay marks events failed after
// maxPublishAttempts, its consumers record messages as poison after
// maxDeliveries, and the repairs bring both back.
func TestSetAsideFaults(t *testing.T) {
	ctx := context.Background()
	env := MustOpenApp(t)
	env.fault.set(func(point faultPoint, pass int) error { return setAsideFaults(ctx, point) })
	mustCreateOrder(t, env, "user-42", "k1", orderBody(100, "sku-1", 1, pmCardVisa))
	for attempt := 1; attempt <= maxPublishAttempts; attempt++ {
		if _, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
		env.clock.advance(relayBackoff(time.Second, attempt))
	}
	if got := env.str(t, `SELECT status FROM outbox_events`); got != string(outboxFailed) {
		t.Fatalf("the event is %s after %d failed publishes, want failed", got, maxPublishAttempts)
	}
	env.fault.set(func(point faultPoint, pass int) error {
		if point == faultPublish {
			return nil
		}
		return setAsideFaults(ctx, point)
	})
	if _, err := env.app.retryOutboxEvents(ctx, "alice", outboxRetryTarget{AllFailed: true}); err != nil {
		t.Fatal(err)
	}
	if n, err := env.app.relayOnce(ctx, "relay-1", relayBatchSize); err != nil || n != 1 {
		t.Fatalf("got %d, %v after the retry, want 1 published", n, err)
	}
	payments := consumerNamed(t, env, paymentServiceConsumer)
	eventually(t, "the OrderCreated to be poison for "+paymentServiceConsumer, waitLimit, func() (bool, string) {
		results, err := env.app.consumeOnce(ctx, payments, consumeBatchSize)
		if err != nil {
			t.Fatal(err)
		}
		env.clock.advance(time.Minute)
		return len(results) == 1 && results[0].Outcome == inboxPoison, fmt.Sprintf("%+v", results)
	})
	env.fault.set(nil)
	if _, err := env.app.replayInboxMessages(ctx, "alice", inboxReplayTarget{AllPoison: true}); err != nil {
		t.Fatal(err)
	}
	env.drain(t)
	mustAuditClean(t, env, true)
}

// Ensure that with set-aside windows in a chaos run (failed events, poison
// messages and whatever else the windows leave), an operator running every
// repair as a process that is SIGKILLed (and run again) or paused past
// every lease mid-repair repairs each thing once: check passes, every
// repaired row is in its repaired state, no client saw a violation. On
// PostgreSQL with RETRYSAFE_TEST_POSTGRES, on NATS with
// RETRYSAFE_TEST_NATS. A run takes about a minute, so it runs only with
// RETRYSAFE_SOAK, one seed after another for that long.
func TestChaosRepairs(t *testing.T) {
	soak := soakDuration(t)
	if soak == 0 {
		t.Skip("a chaos run with repairs takes about a minute; set RETRYSAFE_SOAK")
	}
	binary := buildBinary(t)
	deadline := time.Now().Add(soak)
	for seed := uint64(1); ; seed++ {
		cfg := chaosConfig{
			Binary:    binary,
			DBPath:    testDatabase(t),
			LogPath:   filepath.Join(t.TempDir(), fmt.Sprintf("chaos-%d.log", seed)),
			Orders:    300,
			Clients:   8,
			Kills:     5,
			Repairs:   4,
			Seed:      seed,
			Duration:  4 * time.Minute,
			Serves:    1,
			Relays:    1,
			Workers:   1,
			BrokerURL: os.Getenv("RETRYSAFE_TEST_NATS"),
		}
		report, err := runChaos(context.Background(), cfg)
		var table bytes.Buffer
		printChaosReport(&table, report)
		t.Logf("seed %d:%s", seed, table.String())
		if err != nil || report.failed() {
			t.Fatalf("seed %d: %v, or violations above (process logs kept in %s)", seed, err, keepLog(t, cfg.LogPath))
		}
		if report.Repairs.Logged[repairOutboxRetry] == 0 || report.Repairs.Logged[repairInboxReplay] == 0 {
			t.Fatalf("seed %d: the windows set aside no event or no message for the repairs to repair", seed)
		}
		if out, err := checkAfterChaos(binary, cfg.DBPath); err != nil {
			t.Fatalf("seed %d: retrysafe check: %v\n%s", seed, err, out)
		}
		if time.Now().After(deadline) {
			return
		}
	}
}
