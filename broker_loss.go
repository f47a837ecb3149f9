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

	"github.com/nats-io/nats.go/jetstream"
)

// loseEmbeddedMessages deletes up to n messages of the embedded broker that
// a subscriber has not acked yet, with every delivery of each (those already
// acked too, as a stream loses a message for every consumer), and returns
// their ids. pick(k) chooses one of k candidates, oldest first: the
// simulator passes its seeded random source.
func loseEmbeddedMessages(ctx context.Context, db *sql.DB, n int, pick func(int) int) ([]string, error) {
	var lost []string
	err := withTx(ctx, db, func(tx *sql.Tx) error {
		lost = nil
		// Through broker_deliveries_pending: what waits to be consumed,
		// not the history.
		rows, err := tx.QueryContext(ctx, `
			SELECT m.seq, m.message_id FROM broker_messages m
			WHERE m.seq IN (SELECT d.message_seq FROM broker_deliveries d WHERE d.status = 'pending')
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

// loseNATSMessages deletes up to n messages of the stream that a durable
// consumer has not acked yet (above the lowest ack floor of the stream's
// consumers) with JetStream's delete-message API, and returns how many it
// deleted. pick(k) chooses one of k candidates, oldest first.
func loseNATSMessages(ctx context.Context, js jetstream.JetStream, streamName string, n int, pick func(int) int) (int, error) {
	stream, err := js.Stream(ctx, streamName)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", streamName, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", streamName, err)
	}
	floor := info.State.LastSeq
	consumers := stream.ListConsumers(ctx)
	for consumer := range consumers.Info() {
		floor = min(floor, consumer.AckFloor.Stream)
	}
	if err := consumers.Err(); err != nil {
		return 0, fmt.Errorf("consumers of %s: %w", streamName, err)
	}
	var candidates []uint64
	for seq := max(floor+1, info.State.FirstSeq); seq <= info.State.LastSeq; seq++ {
		candidates = append(candidates, seq)
	}
	deleted := 0
	for range min(n, len(candidates)) {
		i := pick(len(candidates))
		seq := candidates[i]
		candidates = append(candidates[:i], candidates[i+1:]...)
		err := stream.DeleteMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			// Deleted already, or a gap: nothing to lose there.
			continue
		}
		if err != nil {
			return deleted, fmt.Errorf("delete message %d of %s: %w", seq, streamName, err)
		}
		deleted++
	}
	return deleted, nil
}
