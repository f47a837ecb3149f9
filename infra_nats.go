// The NATS JetStream broker, for --broker nats://...: the same small
// interface as the embedded broker, on a real one.
//   - The relay publishes each event to subject <prefix>.<event type> with
//     the event id as Nats-Msg-Id: JetStream drops a second publish of the
//     same id within the stream's duplicate window (natsDuplicateWindow).
//     A relay that republishes later than that (it was down longer) gets a
//     second copy through, and the consumers' inboxes absorb it: the window
//     is an optimisation, the inbox is the guarantee.
//   - Each (consumer, subject) is a durable pull consumer with explicit
//     acks, AckWait and MaxDeliver unlimited (-1). (One durable per
//     subject, because servers before 2.10 take one filter subject per
//     consumer; events of one order never span two subjects' ordering
//     needs here.) A MaxDeliver of its own would count deliveries whose
//     transaction failed on our side (the database down for longer than
//     MaxDeliver x AckWait) and then silently never deliver the message
//     again. The inbox counts the failures of our own code instead
//     (inbox_failures) and records the message as poison on the
//     maxDeliveries-th, then acks it: nothing loops for ever, and nothing
//     stops being delivered without a record.
//   - A message without Nats-Msg-Id (not published by our relay) cannot be
//     deduplicated. It is handed to the consumer as Malformed under the id
//     nats-seq-<stream>-<sequence>, recorded as poison and terminated; the
//     rest of its batch is handled as usual. So is a message whose id is
//     not text that PostgreSQL takes (not UTF-8, or holding a NUL; see
//     storableText), with that id quoted in its error, or is longer than
//     an inbox keys on (maxMessageIDLength).
//   - The stream and the consumers are created if missing; the stream with
//     three replicas when the client knows of three servers or more (a
//     cluster: --broker nats://a,nats://b,nats://c, or one URL whose server
//     tells of the others), with one otherwise. A stream of one replica
//     loses what its server loses, and JetStream acknowledges a publish
//     before it is on disk unless the server runs with sync_interval:
//     always; natsDurabilityWarnings names both at start (README "PostgreSQL
//     and NATS").
//   - A fetch takes what is there and does not wait: the consumer loops
//     sleep between polls, and are woken by an announcement that the relay
//     publishes, on a plain subject outside the stream, once JetStream has
//     stored a batch (see infra_wakeup.go). A fetch that finds nothing has
//     the server count the consumer's pending messages again (see fetch).

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsDuplicateWindow is how long JetStream remembers message ids. It must
// exceed the time a relay may take to republish after a crash (its lease,
// 30s, plus a restart); two minutes is JetStream's default.
const natsDuplicateWindow = 2 * time.Minute

// natsPublishTimeout bounds the wait for JetStream's acknowledgement of one
// publish. Without it a publish whose acknowledgement was lost (the stream
// leader died or was paused after receiving it) waits for ever, and so does
// its relay. It fails the batch instead, which the relay retries with
// backoff; a leader election in a cluster takes up to about ten seconds.
const natsPublishTimeout = 5 * time.Second

// natsPingInterval and natsMaxPingsOutstanding make a client notice within
// about three seconds that its server stopped answering (paused, or its
// host gone without closing the connection), and move to another server of
// the cluster; the defaults (two minutes, two pings) would take four.
const (
	natsPingInterval        = time.Second
	natsMaxPingsOutstanding = 2
)

// natsClusterReplicas is the stream's replica count on a cluster: it
// survives the loss of one server, and a majority of two keeps it writable.
const natsClusterReplicas = 3

// natsBroker is a messageBroker on NATS JetStream.
type natsBroker struct {
	conn    *nats.Conn
	js      jetstream.JetStream
	stream  string
	prefix  string
	ackWait time.Duration

	mu sync.Mutex
	// durables maps a subscriber to its durable consumers, one per subject:
	// the handles subscribe got, so that a fetch is one request (a pull),
	// not two (looking the consumer up again first).
	durables map[string][]jetstream.Consumer
	// dropped counts, per message id, the publishes of this process that
	// JetStream reported as duplicates.
	dropped map[string]int
	// recounted is when fetch last asked the server to count each
	// durable's pending messages again.
	recounted map[string]time.Time
}

// openNATSBroker connects to url (one nats:// URL, or several separated by
// commas: the servers of a cluster) and makes sure the stream exists.
// stream names the JetStream stream; its subjects are "<stream>.>", so
// separate streams (one per test, say) never see each other's messages.
func openNATSBroker(ctx context.Context, url, stream string, ackWait time.Duration) (*natsBroker, error) {
	conn, err := nats.Connect(url, nats.Name("retrysafe"), nats.MaxReconnects(-1),
		nats.PingInterval(natsPingInterval), nats.MaxPingsOutstanding(natsMaxPingsOutstanding))
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", url, err)
	}
	js, err := jetstream.New(conn, jetstream.WithPublishAsyncTimeout(natsPublishTimeout))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	b := &natsBroker{conn: conn, js: js, stream: stream, prefix: strings.ToLower(stream), ackWait: ackWait,
		durables: map[string][]jetstream.Consumer{}, dropped: map[string]int{}, recounted: map[string]time.Time{}}
	replicas := 1
	if natsServerCount(url, conn) >= natsClusterReplicas {
		replicas = natsClusterReplicas
	}
	if err := b.ensureStream(ctx, replicas); err != nil {
		conn.Close()
		return nil, err
	}
	return b, nil
}

// ensureStream creates the stream with replicas copies, or updates an
// existing one to our configuration, never lowering its replicas: a
// process given one URL of a cluster, or connecting before the cluster has
// told it of the other servers, counts one server, and its update must not
// scale a stream of three copies down to one.
func (b *natsBroker) ensureStream(ctx context.Context, replicas int) error {
	if existing, err := b.js.Stream(ctx, b.stream); err == nil {
		replicas = max(replicas, existing.CachedInfo().Config.Replicas)
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("read stream %s: %w", b.stream, err)
	}
	_, err := b.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       b.stream,
		Subjects:   []string{b.prefix + ".>"},
		Storage:    jetstream.FileStorage,
		Duplicates: natsDuplicateWindow,
		Replicas:   replicas,
	})
	if err != nil {
		return fmt.Errorf("create stream %s: %w", b.stream, err)
	}
	return nil
}

// natsServerCount returns how many servers the client knows of: those url
// names and those the connected server told of (the other members of its
// cluster), without repeats.
func natsServerCount(url string, conn *nats.Conn) int {
	servers := map[string]bool{}
	for _, server := range strings.Split(url, ",") {
		if server = strings.TrimSpace(server); server != "" {
			servers[server] = true
		}
	}
	for _, server := range conn.Servers() {
		servers[server] = true
	}
	return len(servers)
}

// deleteStream deletes the broker's stream with everything in it: the
// demo's and the chaos run's, which belong to one run.
func (b *natsBroker) deleteStream(ctx context.Context) error {
	if err := b.js.DeleteStream(ctx, b.stream); err != nil {
		return fmt.Errorf("delete stream %s: %w", b.stream, err)
	}
	return nil
}

// close drains nothing and disconnects.
func (b *natsBroker) close() {
	b.conn.Close()
}

// subject is the NATS subject of an event type.
func (b *natsBroker) subject(eventType string) string {
	return b.prefix + "." + eventType
}

// subscribe creates or updates subscriber's durable pull consumers, one
// per subject. A durable created by an older version with MaxDeliver 5 is
// updated in place to MaxDeliver -1 (JetStream allows that edit; the
// consumer keeps its position and pending acks).
func (b *natsBroker) subscribe(ctx context.Context, subscriber string, subjects ...string) error {
	var durables []jetstream.Consumer
	for _, subject := range subjects {
		durable := subscriber + "_" + subject
		consumer, err := b.js.CreateOrUpdateConsumer(ctx, b.stream, jetstream.ConsumerConfig{
			Durable:       durable,
			FilterSubject: b.subject(subject),
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       b.ackWait,
			// Unlimited: see the file comment; the inbox gives up, not
			// the broker.
			MaxDeliver:    -1,
			DeliverPolicy: jetstream.DeliverAllPolicy,
		})
		if err != nil {
			return fmt.Errorf("create consumer %s: %w", durable, err)
		}
		durables = append(durables, consumer)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.durables[subscriber] = durables
	return nil
}

// publishBatch publishes msgs asynchronously and waits until JetStream has
// acknowledged every one (stored, or dropped as a duplicate).
func (b *natsBroker) publishBatch(ctx context.Context, msgs []message) error {
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	for _, msg := range msgs {
		natsMsg := nats.NewMsg(b.subject(msg.Subject))
		natsMsg.Header.Set(jetstream.MsgIDHeader, msg.ID)
		if msg.PublishID != "" {
			// A copy: an id of its own for JetStream's dedupe, the
			// original for the inbox, as a replay (repair.go).
			natsMsg.Header.Set(jetstream.MsgIDHeader, msg.PublishID)
			natsMsg.Header.Set(replayedMessageIDHeader, msg.ID)
		}
		// The event's creation context travels as W3C Trace Context
		// headers (tracing.go).
		if msg.Trace.TraceParent != "" {
			natsMsg.Header.Set("traceparent", msg.Trace.TraceParent)
		}
		if msg.Trace.TraceState != "" {
			natsMsg.Header.Set("tracestate", msg.Trace.TraceState)
		}
		natsMsg.Data = msg.Payload
		future, err := b.js.PublishMsgAsync(natsMsg)
		if err != nil {
			return fmt.Errorf("publish %s: %w", msg.ID, err)
		}
		futures = append(futures, future)
	}
	for i, future := range futures {
		select {
		case ack := <-future.Ok():
			if ack.Duplicate {
				b.mu.Lock()
				b.dropped[msgs[i].ID]++
				b.mu.Unlock()
			}
		case err := <-future.Err():
			return fmt.Errorf("publish %s: %w", msgs[i].ID, err)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// Only now: a consumer woken before JetStream stored the batch would
	// find nothing and sleep through it.
	if err := b.conn.Publish(b.announceSubject(), nil); err != nil {
		return fmt.Errorf("announce %d published messages: %w", len(msgs), err)
	}
	return nil
}

// announceSubject is where publishBatch announces a stored batch: a plain
// NATS subject, outside the stream's.
func (b *natsBroker) announceSubject() string {
	return b.prefix + "-published"
}

// onAnnounce calls published, on a NATS goroutine, whenever a relay of
// any process announces a stored batch on this stream. published must not
// block. It lasts until the broker closes.
func (b *natsBroker) onAnnounce(published func()) error {
	_, err := b.conn.Subscribe(b.announceSubject(), func(*nats.Msg) { published() })
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", b.announceSubject(), err)
	}
	return nil
}

// fetch pulls up to max messages for subscriber from its consumers: those
// that are there now. It does not wait for more (a JetStream fetch that
// waits returns only once its batch is full or its wait is over, however
// soon the first message came); the consume loop is woken when there are
// (see onAnnounce).
//
// A fetch that does not wait is answered from the server's own count of
// the consumer's pending messages, and nats-server 2.9 can let that count
// fall behind: in a run with a NATS restart and paused consumers, the last
// message of a consumer was pending for good while every fetch got "no
// messages". Asking for the consumer's info makes the server count again.
// So when a durable's fetch comes back empty, fetch asks for its info (at
// most once per pendingRecount per durable) and, if the server then counts
// messages pending, fetches again.
//
// This is a workaround for nats-server 2.9 (Debian's package, which one CI
// job runs). The count falling behind has not been seen on the pinned
// current server (2.15) that the other jobs run; there the recount costs
// one consumer info request per idle durable and pendingRecount, and what
// it finds (4 times in a 1200-order scale-out chaos run) can as well be
// messages stored between the empty fetch and the info request.
func (b *natsBroker) fetch(ctx context.Context, subscriber string, max int) ([]delivery, error) {
	b.mu.Lock()
	durables := b.durables[subscriber]
	b.mu.Unlock()
	if len(durables) == 0 {
		return nil, fmt.Errorf("bug: fetch for %s, which never subscribed", subscriber)
	}
	var deliveries []delivery
	for _, consumer := range durables {
		if len(deliveries) >= max {
			break
		}
		batch, err := b.fetchNoWait(consumer, subscriber, max-len(deliveries))
		if err != nil {
			return nil, err
		}
		if len(batch) == 0 && b.recountDue(consumer.CachedInfo().Name) {
			// Best effort: a failed info request must not fail the
			// deliveries already fetched from the other durables (they
			// would come back only after ackWait); a pass a second later
			// asks again, and a broker that is down fails its fetch.
			if info, err := consumer.Info(ctx); err == nil && info.NumPending > 0 {
				if batch, err = b.fetchNoWait(consumer, subscriber, max-len(deliveries)); err != nil {
					return nil, err
				}
			}
		}
		deliveries = append(deliveries, batch...)
	}
	return deliveries, nil
}

// pendingRecount is how often fetch may ask the server to count a durable's
// pending messages again (see fetch).
const pendingRecount = time.Second

// recountDue reports whether durable's pending messages may be counted
// again now, and if so notes that they are.
func (b *natsBroker) recountDue(durable string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if time.Since(b.recounted[durable]) < pendingRecount {
		return false
	}
	b.recounted[durable] = time.Now()
	return true
}

// fetchNoWait pulls up to max messages that are there now from one durable
// consumer of subscriber.
func (b *natsBroker) fetchNoWait(consumer jetstream.Consumer, subscriber string, max int) ([]delivery, error) {
	durable := consumer.CachedInfo().Name
	batch, err := consumer.FetchNoWait(max)
	if err != nil {
		return nil, fmt.Errorf("fetch from %s: %w", durable, err)
	}
	var deliveries []delivery
	for natsMsg := range batch.Messages() {
		metadata, err := natsMsg.Metadata()
		if err != nil {
			return nil, fmt.Errorf("message metadata: %w", err)
		}
		// A replay (repair.go) carries the id of the message it
		// replays: the one the inbox keys on.
		idHeader := replayedMessageIDHeader
		id := natsMsg.Headers().Get(idHeader)
		if id == "" {
			idHeader = jetstream.MsgIDHeader
			id = natsMsg.Headers().Get(idHeader)
		}
		seqID := fmt.Sprintf("nats-seq-%s-%d", b.stream, metadata.Sequence.Stream)
		var malformed error
		switch {
		case id == "":
			// Not one of ours: nothing could deduplicate it. Failing
			// the fetch would fail its batch-mates with it, for ever;
			// the consumer records it as poison instead.
			id = seqID
			malformed = permanent(fmt.Errorf("message %d on %s has no %s header, so nothing could deduplicate it",
				metadata.Sequence.Stream, natsMsg.Subject(), jetstream.MsgIDHeader))
		case !storableText(id):
			// Not one of ours either (our ids are ASCII), and no inbox
			// can key on it: PostgreSQL refused it in the inbox row,
			// then in the failure count, and the whole batch rolled
			// back, to fail again at every delivery. Poison under the
			// made-up id too, with the id it carried quoted in the
			// error, which is text.
			malformed = permanent(fmt.Errorf("message %d on %s has %s %q, which no inbox can key on: an id is UTF-8 text without NUL",
				metadata.Sequence.Stream, natsMsg.Subject(), idHeader, id))
			id = seqID
		case len(id) > maxMessageIDLength:
			// Not one of ours either, and PostgreSQL cannot key on it
			// (maxMessageIDLength): the same stalled batch.
			malformed = permanent(fmt.Errorf("message %d on %s has a %s of %d bytes, which no inbox can key on: an id is at most %d bytes",
				metadata.Sequence.Stream, natsMsg.Subject(), idHeader, len(id), maxMessageIDLength))
			id = seqID
		}
		deliveries = append(deliveries, delivery{
			message: message{
				ID:      id,
				Subject: strings.TrimPrefix(natsMsg.Subject(), b.prefix+"."),
				Payload: natsMsg.Data(),
				Trace: traceContext{
					TraceParent: natsMsg.Headers().Get("traceparent"),
					TraceState:  natsMsg.Headers().Get("tracestate"),
				},
			},
			Subscriber:    subscriber,
			Seq:           int64(metadata.Sequence.Stream),
			DeliveryCount: int(metadata.NumDelivered),
			Malformed:     malformed,
			natsMsg:       natsMsg,
		})
	}
	if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
		return nil, fmt.Errorf("fetch from %s: %w", durable, err)
	}
	return deliveries, nil
}

// ack acknowledges each delivery and waits for the server to confirm it, so
// that a returned nil means the message will not come back. A Malformed
// delivery is terminated instead (Term, which the server does not confirm;
// TermWithReason would do nothing on servers before 2.10.4), so that it
// never loops.
//
// Unlike the embedded broker's, this ack is not fenced: JetStream acks the
// message, not the delivery, so a consumer paused past AckWait acks the
// delivery another consumer fetched since (seen on nats-server 2.9). That is
// harmless here because consumeOnce acks only after its transaction
// committed: the inbox row is there, the other consumer's run is a
// duplicate, and its own ack still succeeds.
func (b *natsBroker) ack(ctx context.Context, deliveries ...delivery) error {
	for _, d := range deliveries {
		if d.natsMsg == nil {
			return fmt.Errorf("bug: ack of %s without its NATS message", d.ID)
		}
		if d.Malformed != nil {
			if err := d.natsMsg.Term(); err != nil {
				return fmt.Errorf("terminate %s for %s: %w", d.ID, d.Subscriber, err)
			}
			continue
		}
		if err := d.natsMsg.DoubleAck(ctx); err != nil {
			return fmt.Errorf("ack %s for %s: %w", d.ID, d.Subscriber, err)
		}
	}
	return nil
}

// nak asks JetStream to deliver d again after delay.
//
// Not fenced either: a nak from a consumer paused past AckWait moves the
// redelivery of the delivery another consumer fetched since, so a third
// may get the message while the second still works on it. The inbox makes
// that safe, not the broker: both insert the inbox row first, in the
// effect's transaction, so one applies and the other finds a duplicate.
func (b *natsBroker) nak(ctx context.Context, d delivery, delay time.Duration) error {
	if d.natsMsg == nil {
		return fmt.Errorf("bug: nak of %s without its NATS message", d.ID)
	}
	if err := d.natsMsg.NakWithDelay(delay); err != nil {
		return fmt.Errorf("nak %s for %s: %w", d.ID, d.Subscriber, err)
	}
	return nil
}

// held returns how many copies of messageID the stream stores, and how many
// of this process's publishes of it JetStream dropped as duplicates. It
// reads every message in the stream, which suits the demo's small stream,
// not a production one.
func (b *natsBroker) held(ctx context.Context, messageID string) (int, int, error) {
	stream, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		return 0, 0, fmt.Errorf("stream %s: %w", b.stream, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("stream %s: %w", b.stream, err)
	}
	stored := 0
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		msg, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return 0, 0, fmt.Errorf("read message %d of %s: %w", seq, b.stream, err)
		}
		if msg.Header.Get(jetstream.MsgIDHeader) == messageID {
			stored++
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return stored, b.dropped[messageID], nil
}

// natsDurabilityWarning is a setting of the broker that lets it lose a
// message it acknowledged, found at start (natsDurabilityWarnings).
type natsDurabilityWarning struct {
	// Setting names what to change: "replicas" or "sync_interval".
	Setting string
	Message string
}

// natsDurabilityWarnings reads the stream's configuration and, from each
// of monitorURLs (the servers' HTTP monitoring endpoints, if the operator
// gave them), the server's sync policy, and returns what makes an
// acknowledged publish less durable than the outbox assumes: a stream of
// one replica (the server's disk is the only copy), and a server that
// flushes JetStream's writes to disk on a timer (by default every two
// minutes) instead of before it acknowledges, so that an OS crash or a
// power failure loses what it acknowledged since (Jepsen, NATS 2.12.1).
// A server that does not report its sync policy (nats-server 2.9 has no
// such setting) gets no warning: there is nothing to read, and nothing
// to set.
func natsDurabilityWarnings(ctx context.Context, b *natsBroker, monitorURLs []string) ([]natsDurabilityWarning, error) {
	stream, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", b.stream, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", b.stream, err)
	}
	var warnings []natsDurabilityWarning
	if info.Config.Replicas <= 1 {
		warnings = append(warnings, natsDurabilityWarning{Setting: "replicas", Message: fmt.Sprintf(
			"the NATS stream %s has 1 replica: losing its server's disk loses every message it acknowledged and no consumer has acked; "+
				"run a cluster of three servers and give --broker all three (a new stream then gets 3 replicas; an existing one: nats stream edit %s --replicas 3)",
			b.stream, b.stream)})
	}
	for _, monitorURL := range monitorURLs {
		policy, err := natsSyncPolicy(ctx, monitorURL)
		if err != nil {
			return warnings, err
		}
		if policy.known && !policy.always {
			warnings = append(warnings, natsDurabilityWarning{Setting: "sync_interval", Message: fmt.Sprintf(
				"the nats-server at %s writes JetStream's messages to disk every %s, not before it acknowledges them: "+
					"an OS crash or power failure loses what it acknowledged since; set jetstream { sync_interval: always } in its configuration",
				monitorURL, policy.interval)})
		}
	}
	return warnings, nil
}

// natsSync is a server's JetStream sync policy as its /varz reports it.
type natsSync struct {
	// known is false when the server does not report one (before 2.10).
	known    bool
	always   bool
	interval time.Duration
}

// natsSyncPolicy reads the JetStream sync policy of the server whose HTTP
// monitoring endpoint is monitorURL (http://host:8222).
func natsSyncPolicy(ctx context.Context, monitorURL string) (natsSync, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(monitorURL, "/")+"/varz", nil)
	if err != nil {
		return natsSync{}, fmt.Errorf("--nats-monitor %q: %w", monitorURL, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return natsSync{}, fmt.Errorf("read the sync policy from %s: %w", monitorURL, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return natsSync{}, fmt.Errorf("read the sync policy from %s/varz: %s", monitorURL, resp.Status)
	}
	var varz struct {
		JetStream struct {
			Config struct {
				// Both are missing before nats-server 2.10.
				SyncInterval *time.Duration `json:"sync_interval"`
				SyncAlways   bool           `json:"sync_always"`
			} `json:"config"`
		} `json:"jetstream"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&varz); err != nil {
		return natsSync{}, fmt.Errorf("read the sync policy from %s/varz: %w", monitorURL, err)
	}
	config := varz.JetStream.Config
	if config.SyncInterval == nil && !config.SyncAlways {
		return natsSync{}, nil
	}
	policy := natsSync{known: true, always: config.SyncAlways}
	if config.SyncInterval != nil {
		policy.interval = *config.SyncInterval
	}
	return policy, nil
}
