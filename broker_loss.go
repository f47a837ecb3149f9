// The broker-loss nemesis: a broker that loses messages it acknowledged.
// Jepsen found NATS JetStream 2.12.1 doing it with its default settings (it
// acknowledges before the message is on disk, and a host crash loses what
// it had not flushed); a misconfigured retention limit or an operator's
// purge does it on any broker. The outbox's relay sees a successful publish
// and marks the event published; only the reconciler (deliver.go) notices
// that no consumer ever applied it.
//
// The nemesis deletes messages that some subscriber has not yet acked: from
// the embedded broker's tables, which stand for the stream, or from a
// JetStream stream with its delete-message API. chaos --broker-loss and the
// simulator use it; nothing else does.

package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// loseEmbeddedMessages deletes up to n messages of the embedded broker that
// a subscriber has not acked yet, with every delivery of each (those already
// acked too, as a stream loses a message for every consumer), and returns
// their ids. pick(k) chooses one of k candidates, oldest first: the
// simulator passes its seeded random source.
func loseEmbeddedMessages(ctx context.Context, db *sql.DB, n int, pick func(int) int) ([]string, error) {
	return loseEmbeddedMessagesWhere(ctx, db, n, pick, "")
}

// loseEmbeddedMessagesAckedByOne is loseEmbeddedMessages among the messages
// that one subscriber has acked already and another has not: the loss
// reaches only the subscribers still waiting, while the others have
// applied the message (the simulator's second consumer of a subject).
func loseEmbeddedMessagesAckedByOne(ctx context.Context, db *sql.DB, n int, pick func(int) int) ([]string, error) {
	return loseEmbeddedMessagesWhere(ctx, db, n, pick,
		`AND m.seq IN (SELECT d.message_seq FROM broker_deliveries d WHERE d.status = 'acked')`)
}

// loseEmbeddedMessagesWhere is loseEmbeddedMessages among the messages
// that also meet condition, SQL on broker_messages m ("" for all).
func loseEmbeddedMessagesWhere(ctx context.Context, db *sql.DB, n int, pick func(int) int, condition string) ([]string, error) {
	var lost []string
	err := withTx(ctx, db, func(tx *sql.Tx) error {
		lost = nil
		// Through broker_deliveries_pending: what waits to be consumed,
		// not the history.
		rows, err := tx.QueryContext(ctx, `
			SELECT m.seq, m.message_id FROM broker_messages m
			WHERE m.seq IN (SELECT d.message_seq FROM broker_deliveries d WHERE d.status = 'pending')
			  `+condition+`
			ORDER BY m.seq`)
		if err != nil {
			return fmt.Errorf("find unconsumed messages: %w", err)
		}
		var seqs []int64
		var ids []string
		for rows.Next() {
			var seq int64
			var id string
			if err := rows.Scan(&seq, &id); err != nil {
				rows.Close()
				return fmt.Errorf("scan unconsumed message: %w", err)
			}
			seqs = append(seqs, seq)
			ids = append(ids, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return fmt.Errorf("find unconsumed messages: %w", err)
		}
		for range min(n, len(seqs)) {
			i := pick(len(seqs))
			if _, err := tx.ExecContext(ctx, `DELETE FROM broker_deliveries WHERE message_seq = ?`, seqs[i]); err != nil {
				return fmt.Errorf("lose the deliveries of %s: %w", ids[i], err)
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM broker_messages WHERE seq = ?`, seqs[i]); err != nil {
				return fmt.Errorf("lose message %s: %w", ids[i], err)
			}
			lost = append(lost, ids[i])
			seqs = append(seqs[:i], seqs[i+1:]...)
			ids = append(ids[:i], ids[i+1:]...)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return lost, nil
}

// loseNATSMessages deletes up to n messages of the stream that the durable
// consumer of their subject has not acked yet (above its ack floor) with
// JetStream's delete-message API, and returns how many it deleted: those
// not yet delivered to it first, whose loss is certain (a message
// delivered and not acked is lost only if its consumer fails before the
// ack). pick(k) chooses one of k candidates, oldest first.
func loseNATSMessages(ctx context.Context, js jetstream.JetStream, streamName string, n int, pick func(int) int) (int, error) {
	stream, err := js.Stream(ctx, streamName)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", streamName, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", streamName, err)
	}
	// Each durable reads one subject (natsBroker.subscribe).
	acked, delivered := map[string]uint64{}, map[string]uint64{}
	consumers := stream.ListConsumers(ctx)
	for consumer := range consumers.Info() {
		acked[consumer.Config.FilterSubject] = consumer.AckFloor.Stream
		delivered[consumer.Config.FilterSubject] = consumer.Delivered.Stream
	}
	if err := consumers.Err(); err != nil {
		return 0, fmt.Errorf("consumers of %s: %w", streamName, err)
	}
	deleted := 0
	for _, floors := range []map[string]uint64{delivered, acked} {
		more, err := deleteMessagesAbove(ctx, stream, info.State, floors, n-deleted, pick)
		deleted += more
		if err != nil || deleted == n {
			return deleted, err
		}
	}
	return deleted, nil
}

// deleteMessagesAbove deletes up to n messages of stream above the floor
// of their subject's consumer, and returns how many it deleted.
func deleteMessagesAbove(ctx context.Context, stream jetstream.Stream, state jetstream.StreamState, floors map[string]uint64, n int, pick func(int) int) (int, error) {
	lowest := state.LastSeq
	for _, floor := range floors {
		lowest = min(lowest, floor)
	}
	var candidates []uint64
	for seq := max(lowest+1, state.FirstSeq); seq <= state.LastSeq; seq++ {
		candidates = append(candidates, seq)
	}
	deleted := 0
	for deleted < n && len(candidates) > 0 {
		i := pick(len(candidates))
		seq := candidates[i]
		candidates = append(candidates[:i], candidates[i+1:]...)
		msg, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue // deleted already, or a gap
		}
		if err != nil {
			return deleted, fmt.Errorf("read message %d: %w", seq, err)
		}
		if floor, read := floors[msg.Subject]; !read || seq <= floor {
			// Below the floor (acked, or delivered: see the caller), or
			// nobody reads it: losing it now would lose nothing.
			continue
		}
		err = stream.DeleteMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return deleted, fmt.Errorf("delete message %d: %w", seq, err)
		}
		deleted++
	}
	return deleted, nil
}

// brokerLoss deletes up to one unconsumed message and returns how many it
// deleted: none when nothing waits to be consumed.
type brokerLoss func(ctx context.Context, pick func(int) int) (int, error)

// embeddedBrokerLoss returns the nemesis of the embedded broker in db.
func embeddedBrokerLoss(db *sql.DB) brokerLoss {
	return func(ctx context.Context, pick func(int) int) (int, error) {
		lost, err := loseEmbeddedMessages(ctx, db, 1, pick)
		return len(lost), err
	}
}

// natsBrokerLoss connects to url and returns the nemesis of stream, and a
// function that disconnects.
func natsBrokerLoss(url, stream string) (brokerLoss, func(), error) {
	conn, err := nats.Connect(url, nats.MaxReconnects(-1))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to %s: %w", url, err)
	}
	js, err := jetstream.New(conn)
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	lose := func(ctx context.Context, pick func(int) int) (int, error) {
		return loseNATSMessages(ctx, js, stream, 1, pick)
	}
	return lose, conn.Close, nil
}

// brokerLossAttempt bounds one attempt of the broker-loss nemesis. A
// JetStream request that nobody answers (its server killed, the stream
// electing a leader) waits as long as its context allows, and the run's
// lasts minutes.
const brokerLossAttempt = 10 * time.Second

// runBrokerLosses makes the broker lose n acknowledged messages that no
// consumer has acked yet, one every 0.2 to 1 s, until it has lost n, ctx
// is done, or stop is closed (the load is over: nothing may be left to
// lose). An attempt that takes longer than brokerLossAttempt, or is under
// way when stop is closed, is given up. It adds each loss to *lost, under
// mu.
func runBrokerLosses(ctx context.Context, seed uint64, n int, lose brokerLoss, stop <-chan struct{}, lost *int, mu *sync.Mutex) error {
	rng := rand.New(rand.NewPCG(seed, 0x1055))
	for done := 0; done < n; {
		select {
		case <-ctx.Done():
			return nil
		case <-stop:
			return nil
		case <-time.After(time.Duration(200+rng.IntN(800)) * time.Millisecond):
		}
		attempt, cancel := context.WithTimeout(ctx, brokerLossAttempt)
		go func() {
			select {
			case <-stop:
				cancel()
			case <-attempt.Done():
			}
		}()
		deleted, err := lose(attempt, rng.IntN)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// A database outage or a NATS restart of the run's own: the
			// nemesis waits it out like everyone else.
			continue
		}
		done += deleted
		mu.Lock()
		*lost += deleted
		mu.Unlock()
	}
	return nil
}
