-- The whole retrysafe schema, one SQLite file. Each "-- version N" section is
-- a migration: openDB applies the sections above the file's user_version, in
-- order, each in its own transaction, so an existing database is migrated
-- instead of failing on "table already exists". Never edit a section that has
-- shipped; add a new one below.
--
-- Times are TEXT in one fixed-width UTC format (see timeFormat in db.go) so
-- that comparing strings compares instants.

-- version 1

-- idempotency_keys remembers what the API answered to each (caller, key) so a
-- retried request gets the first answer instead of doing the work again.
-- The article keyed it by idempotency_key alone: one user's key could then
-- replay another user's response. The key is scoped to the caller.
CREATE TABLE idempotency_keys (
    user_id         TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    request_method  TEXT NOT NULL,
    request_path    TEXT NOT NULL,
    -- request_hash is the fingerprint: method, path and canonical body. A key
    -- reused with another request is rejected instead of replaying the wrong
    -- answer.
    request_hash    TEXT NOT NULL,
    -- request_params is the canonical body, so the completer can finish a
    -- multi-phase request whose client never came back.
    request_params  TEXT NOT NULL,
    -- status: processing | completed. Creating an order claims and completes
    -- the key in one transaction, so it is never seen as processing; a refund
    -- spans a processor call and moves through recovery points instead.
    status          TEXT NOT NULL CHECK (status IN ('processing', 'completed')),
    -- recovery_point: started | refund_requested | finished (see refund.go).
    recovery_point  TEXT NOT NULL,
    -- locked_at is the lease of the request working on the key; a second
    -- request while it is fresh gets 409, after refundLockTimeout it may take
    -- over.
    locked_at       TEXT,
    -- locked_by is the holder's lease token. Every phase checks it in its
    -- own transaction, so a slow request whose lease was taken over can
    -- never record its phase on top of the new holder's.
    locked_by       TEXT,
    response_status INTEGER,
    response_body   BLOB,
    -- response_location is replayed as the Location header of a 201.
    response_location TEXT,
    created_at      TEXT NOT NULL,
    -- expires_at is read: an expired key no longer replays, and cleanup
    -- deletes it. The article wrote it and never looked at it again.
    expires_at      TEXT NOT NULL,
    PRIMARY KEY (user_id, idempotency_key)
) WITHOUT ROWID; -- the key is how every row is found: store rows in its b-tree
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
-- The completer looks for unfinished multi-phase keys; they are few.
CREATE INDEX idempotency_keys_unfinished ON idempotency_keys (locked_at)
    WHERE recovery_point <> 'finished';

-- orders is the business row the client asked for.
CREATE TABLE orders (
    order_id        TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL,
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    currency        TEXT NOT NULL,
    items           TEXT NOT NULL, -- JSON array of {"sku","qty"}
    payment_method  TEXT NOT NULL,
    -- status: created | paid | cancelled | refunded
    status          TEXT NOT NULL CHECK (status IN ('created', 'paid', 'cancelled', 'refunded')),
    idempotency_key TEXT,
    charge_id       TEXT,
    refunded_cents  INTEGER NOT NULL DEFAULT 0 CHECK (refunded_cents >= 0),
    cancel_reason   TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL
);
CREATE INDEX orders_idempotency_key ON orders (user_id, idempotency_key);

-- refunds are the order service's own record of money it asked the processor
-- to give back, written before the processor is called so that two refunds in
-- flight can never together exceed what was captured.
CREATE TABLE refunds (
    refund_id       TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL REFERENCES orders (order_id),
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    -- status: pending | succeeded | failed
    status          TEXT NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    processor_refund_id TEXT UNIQUE,
    -- source: api | webhook (a refund made at the processor's dashboard)
    source          TEXT NOT NULL,
    -- idempotency_key is the API key the refund was asked under; a resumed
    -- request finds its refund by it instead of creating a second one.
    idempotency_key TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    UNIQUE (order_id, idempotency_key)
);
CREATE INDEX refunds_order_id ON refunds (order_id);

-- outbox_events holds each event in the same transaction as the business row
-- it announces, so there is never an order nobody heard of nor an event for an
-- order that does not exist. The relay publishes them later.
--
-- seq is the rowid: publication order (a new row always gets a seq above every
-- existing one; AUTOINCREMENT would cost a write per insert for nothing).
-- event_id stays the article's key and is the message id end to end (broker
-- dedupe, inbox).
CREATE TABLE outbox_events (
    seq             INTEGER PRIMARY KEY,
    event_id        TEXT NOT NULL UNIQUE,
    event_type      TEXT NOT NULL,
    aggregate_id    TEXT NOT NULL,
    payload         TEXT NOT NULL,
    -- status: pending | published | failed. failed is kept and shown by
    -- inspect, never dropped.
    status          TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL,
    -- claimed_by/claimed_until were the relay's claim on the event until
    -- version 10 (relay_leases); the reconciler's claims use them now
    -- (version 7).
    claimed_by      TEXT,
    claimed_until   TEXT,
    last_error      TEXT,
    created_at      TEXT NOT NULL,
    published_at    TEXT
);
-- The relay claims the oldest unpublished event of each aggregate; the index
-- holds only unpublished rows, so it stays small however long the table grows.
CREATE INDEX outbox_events_unpublished ON outbox_events (aggregate_id, seq)
    WHERE status <> 'published';
CREATE INDEX outbox_events_pending ON outbox_events (seq)
    WHERE status = 'pending';

-- broker_* is the embedded broker: a stand-in for NATS, Kafka or RabbitMQ kept
-- in the same file so the demo needs nothing else. It gives what those give:
-- dedupe on publish by message id, at-least-once delivery per subscriber, and
-- redelivery when a delivery is not acked in time.
CREATE TABLE broker_subscriptions (
    subscriber TEXT NOT NULL,
    subject    TEXT NOT NULL,
    PRIMARY KEY (subscriber, subject)
);
CREATE TABLE broker_messages (
    seq          INTEGER PRIMARY KEY,
    message_id   TEXT NOT NULL UNIQUE,
    subject      TEXT NOT NULL,
    payload      TEXT NOT NULL,
    published_at TEXT NOT NULL,
    -- duplicates counts publishes that the dedupe absorbed.
    duplicates   INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE broker_deliveries (
    subscriber     TEXT NOT NULL,
    message_seq    INTEGER NOT NULL REFERENCES broker_messages (seq),
    -- status: pending | acked
    status         TEXT NOT NULL CHECK (status IN ('pending', 'acked')),
    delivery_count INTEGER NOT NULL DEFAULT 0,
    -- visible_at: when the message may be delivered (again). A fetch moves it
    -- ackWait ahead, so a consumer that dies without acking gets it back.
    visible_at     TEXT NOT NULL,
    acked_at       TEXT,
    PRIMARY KEY (subscriber, message_seq)
);
CREATE INDEX broker_deliveries_pending ON broker_deliveries (subscriber, visible_at, message_seq)
    WHERE status = 'pending';

-- inbox_messages remembers which consumer already applied which message, so
-- a redelivery changes nothing. The article keyed it by message_id alone: a
-- second consumer of the same message then collided with the first.
CREATE TABLE inbox_messages (
    consumer       TEXT NOT NULL,
    message_id     TEXT NOT NULL,
    -- status: done | poison
    status         TEXT NOT NULL CHECK (status IN ('done', 'poison')),
    error          TEXT,
    delivery_count INTEGER NOT NULL,
    -- duplicates counts deliveries the inbox recognised and skipped.
    duplicates     INTEGER NOT NULL DEFAULT 0,
    processed_at   TEXT NOT NULL,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID; -- rows are found by their key only
CREATE INDEX inbox_messages_processed_at ON inbox_messages (processed_at);

-- saga_instances is the fulfilment saga's state machine, one per order.
CREATE TABLE saga_instances (
    saga_id         TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL UNIQUE REFERENCES orders (order_id),
    status          TEXT NOT NULL CHECK (status IN
        ('in_progress', 'compensating', 'completed', 'compensated', 'compensation_failed')),
    current_step    TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL,
    -- locked_until is the lease of the worker running the saga; when a worker
    -- dies, recovery picks the saga up after it passes.
    locked_by       TEXT,
    locked_until    TEXT,
    failure_reason  TEXT,
    last_error      TEXT,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL
);
CREATE INDEX saga_instances_runnable ON saga_instances (next_attempt_at)
    WHERE status IN ('in_progress', 'compensating');

-- saga_steps records each step when, and only when, it ran. The article
-- inserted every step as done up front, so compensation undid steps that
-- never happened.
CREATE TABLE saga_steps (
    saga_id        TEXT NOT NULL REFERENCES saga_instances (saga_id),
    step_index     INTEGER NOT NULL,
    step_name      TEXT NOT NULL,
    -- status: pending | done | failed | compensated
    status         TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed', 'compensated')),
    attempts       INTEGER NOT NULL DEFAULT 0,
    result         TEXT,
    error          TEXT,
    done_at        TEXT,
    compensated_at TEXT,
    PRIMARY KEY (saga_id, step_index)
) WITHOUT ROWID; -- rows are found by their key only

-- stock_items is the warehouse: available + reserved + sold always equals
-- stocked. (Since version 11 reserved and sold are counted from
-- stock_reservations instead.) No code deletes a row: the create path
-- remembers the SKUs it found here (checkSKUs).
CREATE TABLE stock_items (
    sku       TEXT PRIMARY KEY,
    available INTEGER NOT NULL CHECK (available >= 0),
    reserved  INTEGER NOT NULL CHECK (reserved >= 0),
    sold      INTEGER NOT NULL DEFAULT 0 CHECK (sold >= 0),
    stocked   INTEGER NOT NULL
);
-- stock_reservations ties each hold to its order so it is released or sold
-- exactly once.
CREATE TABLE stock_reservations (
    order_id   TEXT NOT NULL REFERENCES orders (order_id),
    sku        TEXT NOT NULL REFERENCES stock_items (sku),
    qty        INTEGER NOT NULL CHECK (qty > 0),
    -- status: reserved | released (and sold, until version 13)
    status     TEXT NOT NULL CHECK (status IN ('reserved', 'released', 'sold')),
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (order_id, sku)
);

INSERT INTO stock_items (sku, available, reserved, sold, stocked) VALUES
    ('sku-1', 1000, 0, 0, 1000),
    ('sku-2', 1000, 0, 0, 1000),
    ('sku-rare', 1, 0, 0, 1);

-- processor_charges is the fake card processor's own ledger: what it would
-- show on its dashboard. It honours idempotency keys the way Stripe does,
-- hence the UNIQUE key.
CREATE TABLE processor_charges (
    charge_id       TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    order_id        TEXT NOT NULL,
    amount_cents    INTEGER NOT NULL,
    currency        TEXT NOT NULL,
    payment_method  TEXT NOT NULL,
    -- status: succeeded | declined
    status          TEXT NOT NULL CHECK (status IN ('succeeded', 'declined')),
    refunded_cents  INTEGER NOT NULL DEFAULT 0,
    -- key_hits counts calls answered from the key instead of charging again.
    key_hits        INTEGER NOT NULL DEFAULT 0,
    created_at      TEXT NOT NULL
);
CREATE TABLE processor_refunds (
    refund_id       TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    charge_id       TEXT NOT NULL REFERENCES processor_charges (charge_id),
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    key_hits        INTEGER NOT NULL DEFAULT 0,
    created_at      TEXT NOT NULL
);

-- version 2

-- lease_token is the fencing token of a saga's lease: every claim adds one,
-- and every write the worker makes afterwards (step, reservation,
-- compensation, status) checks it in the same statement. A worker that was
-- paused past its lease while another claimed the saga finds its token gone
-- and stops without writing; locked_by alone cannot tell a stale claim of
-- the same worker name from a fresh one.
ALTER TABLE saga_instances ADD COLUMN lease_token INTEGER NOT NULL DEFAULT 0;

-- lease_token is the fencing token of a claim on an event: a worker that
-- was paused past its lease cannot write for an event that another has
-- claimed since. The relay's claims used it until version 10 (relay_leases
-- has the relay's token now); the reconciler's still do (deliver.go).
ALTER TABLE outbox_events ADD COLUMN lease_token INTEGER NOT NULL DEFAULT 0;

-- inbox_failures counts, per consumer and message, the deliveries on which
-- the consumer's own code failed for a reason that may pass (a transient
-- error), recorded in the transaction that rolled that message back. A
-- delivery whose whole transaction failed (the database down, the process
-- dead) leaves no count: our side failing never uses up a message's tries,
-- so an outage longer than the broker's redelivery limit loses nothing. The
-- maxDeliveries-th counted failure makes the message poison.
CREATE TABLE inbox_failures (
    consumer       TEXT NOT NULL,
    message_id     TEXT NOT NULL,
    failures       INTEGER NOT NULL CHECK (failures > 0),
    last_error     TEXT NOT NULL,
    last_failed_at TEXT NOT NULL,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID; -- rows are found by their key only

-- version 3

-- Nothing: version 3 of schema_postgres.sql adds the triggers that wake
-- other processes' relays and consumers (see infra_wakeup.go). SQLite has no way
-- to tell another process; processes on one file find each other's work by
-- polling. The section keeps the two files' versions in step.

-- version 4

-- repair_log records every repair an operator made (retrysafe outbox retry,
-- inbox replay, saga resume, refund finish, or the same under /admin): who,
-- what, to which row, when, and what came of it. A repair writes its row in
-- the transaction that changes the state it repairs, so the log never
-- claims a repair that did not happen nor misses one that did. A refusal
-- changes nothing and is not logged.
CREATE TABLE repair_log (
    repair_id  TEXT PRIMARY KEY,
    -- operator: --operator (default $USER), or admin-api.
    operator   TEXT NOT NULL,
    -- action: outbox retry | inbox replay | saga resume | refund finish
    action     TEXT NOT NULL,
    -- target: the event id, consumer/message id, saga id, or user/key.
    target     TEXT NOT NULL,
    -- result: what the row was, and what it became.
    result     TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX repair_log_created_at ON repair_log (created_at);

-- version 5

-- traceparent and tracestate are the W3C Trace Context of the span that
-- created the event, written in the event's own transaction, so the trace
-- of POST /api/orders (or of the saga step that wrote PaymentCaptured)
-- reaches the consumers however long the event waits and whichever relay
-- publishes it. NULL when tracing is off (tracing.go).
ALTER TABLE outbox_events ADD COLUMN traceparent TEXT;
ALTER TABLE outbox_events ADD COLUMN tracestate TEXT;
-- The embedded broker keeps the event's creation context with the message,
-- as NATS keeps it in the message's headers.
ALTER TABLE broker_messages ADD COLUMN traceparent TEXT;
ALTER TABLE broker_messages ADD COLUMN tracestate TEXT;
-- A saga runs its steps long after the OrderCreated that started it was
-- consumed: it keeps that message's creation context, and each step's
-- span links to it.
ALTER TABLE saga_instances ADD COLUMN traceparent TEXT;
ALTER TABLE saga_instances ADD COLUMN tracestate TEXT;

-- version 6

-- What every scrape of /metrics counts (metrics.go) it reads through partial
-- indexes that hold only the rows waiting for work or for an operator, so a
-- scrape costs the same after a million orders as on the first day. The
-- pending events are counted through outbox_events_pending, and the sagas
-- in progress or compensating through saga_instances_runnable; the sagas
-- that ended are counted by the processes that end them, not in the
-- database. Building each index reads the table once, at this migration.
--
-- The age of the oldest pending event: its first entry. An event enters it
-- when written and leaves when published, in the transactions that already
-- write the row; no commit or row is added. (Dropped in version 9.)
CREATE INDEX outbox_events_pending_since ON outbox_events (created_at)
    WHERE status = 'pending';
-- Events the relay gave up on, counted without reading the others. Only a
-- failure writes to it: the create path never does.
CREATE INDEX outbox_events_failed ON outbox_events (seq)
    WHERE status = 'failed';
-- Sagas waiting for an operator; likewise written only when a compensation
-- gives up.
CREATE INDEX saga_instances_compensation_failed ON saga_instances (saga_id)
    WHERE status = 'compensation_failed';

-- version 7

-- A broker's acknowledgement ends an event's publication, not its life: a
-- broker can lose a message it acknowledged (JetStream with its default
-- sync policy loses what it had not flushed when its host crashes), and
-- the order it announced would then wait for ever. The reconciler
-- (deliver.go) ends it instead, once every consumer that subscribes to the
-- event's subject has its inbox row.
--
-- delivered_at is when the reconciler found every such inbox row (an event
-- no consumer subscribes to is delivered as soon as it is published).
-- republished_at and republishes record the reconciler's copies of an
-- event that was not delivered in time; it claims such an event under the
-- relay's lease columns (claimed_by, claimed_until, lease_token), which a
-- published event no longer uses for anything else.
ALTER TABLE outbox_events ADD COLUMN delivered_at TEXT;
ALTER TABLE outbox_events ADD COLUMN republished_at TEXT;
ALTER TABLE outbox_events ADD COLUMN republishes INTEGER NOT NULL DEFAULT 0;
-- The reconciler reads only the events published and not yet delivered:
-- those in flight, a few hundred at most, however long the history. An
-- event enters the index when markPublished writes its row anyway, and
-- leaves it when the reconciler marks it delivered; the create path never
-- writes to it. (Events published before this version enter it at once;
-- the reconciler's first sweeps mark them.)
CREATE INDEX outbox_events_undelivered ON outbox_events (published_at)
    WHERE status = 'published' AND delivered_at IS NULL;

-- A poison message waits for an operator's replay, and so does what the
-- replay delivers: cleanup keeps the outbox event and the broker's copy of
-- any message an inbox holds as poison, past the message retention, until
-- the replay (or never). It looks them up here; only a message made poison
-- writes to it.
CREATE INDEX inbox_messages_poison ON inbox_messages (message_id)
    WHERE status = 'poison';

-- version 8

-- A saga records the OrderCreated that started it: a copy of that event
-- that comes after cleanup deleted the payment service's inbox row of it
-- (a week on) is then a duplicate, not a second order created
-- (sagaAlreadyStarted). Sagas started before this version have none.
ALTER TABLE saga_instances ADD COLUMN started_by TEXT;

-- version 9

-- The age of the oldest pending event is read from outbox_events_pending,
-- the first pending event by seq (metrics.go), not from an index of its
-- own: that index was one more b-tree page written and flushed by every
-- create (a tenth of a create without its key on SQLite; 4% with it).
DROP INDEX IF EXISTS outbox_events_pending_since;

-- version 10

-- relay_leases holds the relay lease: one relay at a time publishes the
-- outbox, the one whose lease has not passed. With it a relay's claim is a
-- read, and an event's row is written once, when it is marked published,
-- instead of once more for a claim of its own (claimed_by, claimed_until
-- and lease_token on outbox_events are the reconciler's now: deliver.go).
-- lease_token is the fencing token: every taking of the lease, and every
-- renewal after it passed, adds one; a relay's marks count only under the
-- token it claimed with, so a relay paused past its lease marks nothing.
-- One row, 'outbox', made here; a holder of '' is nobody.
CREATE TABLE relay_leases (
    name         TEXT PRIMARY KEY,
    holder       TEXT NOT NULL,
    lease_token  INTEGER NOT NULL,
    leased_until TEXT NOT NULL
);
INSERT INTO relay_leases (name, holder, lease_token, leased_until)
VALUES ('outbox', '', 0, '0001-01-01T00:00:00.000000Z');

-- version 11

-- stock_items keeps only what is on the shelf: available, taken down when
-- the saga reserves and put back when it releases. What is reserved and
-- what is sold are the stock_reservations of each status, and nowhere
-- else: a sale changes the reservation's row alone, not the SKU's row as
-- well (one row written less per paid order, and a hot SKU's row is not
-- locked again by the confirm). available + the SKU's reservations
-- reserved or sold = stocked, which check reads.
ALTER TABLE stock_items DROP COLUMN reserved;
ALTER TABLE stock_items DROP COLUMN sold;

-- version 12

-- Delivery is read, not written: an event is delivered when every consumer
-- of its subject has its inbox row, and nothing marks it (the mark was two
-- row writes per order). What the reconciler needs instead is to know which
-- events it no longer has to look at: delivery_cursor, a position below
-- which every published event was found delivered (deliver.go). A publish
-- (markPublished, an operator's inbox replay) stamps the event with
-- delivery_position, larger than any position a reconciler could have
-- passed: on SQLite one more than the largest so far (one writer at a
-- time, so positions grow in the order their writes commit); on
-- PostgreSQL the writing transaction's id. The reconciler reads the events
-- from the cursor on, and moves the cursor up to the first one a consumer
-- lacks: one row written per sweep, not one per event.
--
-- Events published and delivered before this version get position 0,
-- below the cursor; those in flight get 1, at the cursor.
ALTER TABLE outbox_events ADD COLUMN delivery_position INTEGER;
UPDATE outbox_events SET delivery_position = CASE WHEN delivered_at IS NULL THEN 1 ELSE 0 END
    WHERE status = 'published';
DROP INDEX outbox_events_undelivered;
ALTER TABLE outbox_events DROP COLUMN delivered_at;
CREATE INDEX outbox_events_delivery ON outbox_events (delivery_position)
    WHERE delivery_position IS NOT NULL;
CREATE TABLE delivery_cursor (
    name     TEXT PRIMARY KEY,
    position INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO delivery_cursor (name, position) VALUES ('outbox', 1);
-- A published event always has its position: without one, no sweep would
-- ever read it, and a message of it the broker lost would never be
-- published again. What this stops is a process built before this version
-- (its relay marks events published and stamps nothing) still running
-- beside one that migrated: its marks fail, and the events wait for a
-- relay that stamps them.
CREATE TRIGGER outbox_events_published_has_position
BEFORE UPDATE OF status ON outbox_events
WHEN NEW.status = 'published' AND NEW.delivery_position IS NULL
BEGIN
    SELECT RAISE(ABORT, 'a published outbox event needs its delivery_position (a process older than schema version 12?)');
END;

-- version 13

-- A sale writes nothing: a hold stays reserved, and it is sold when its
-- order's saga completed, which the confirm step writes in the same
-- transaction as PaymentCaptured (one row written less per paid order).
-- Sold stock is a reserved hold of a completed saga, and only a saga still
-- running releases a hold, so available + the SKU's reservations still
-- reserved = stocked. Holds sold before this version become reserved.
-- A process built before this version, still running beside one that
-- migrated, would mark its sales 'sold' again, which nothing here counts:
-- its confirm fails instead, and the saga waits for a process that
-- confirms the new way.
UPDATE stock_reservations SET status = 'reserved' WHERE status = 'sold';
CREATE TRIGGER stock_reservations_never_sold
BEFORE UPDATE OF status ON stock_reservations
WHEN NEW.status = 'sold'
BEGIN
    SELECT RAISE(ABORT, 'a sale writes no reservation status since schema version 13 (a process older than it?)');
END;

-- version 14

-- A hold is the record of its saga's reserve_stock step, and nothing else
-- (one row written less per item of a paid order). The step is recorded
-- done in the transaction that takes its order's items off the shelf, and
-- compensated in the one that puts them back; that record changes from
-- done to compensated once, so a hold is still released at most once.
-- stock_holds reads the holds as stock_reservations held them: one row per
-- item of an order whose reserve_stock ran, reserved while the step is
-- done, released once it is compensated. (Sold is still a reserved hold of
-- a completed saga, as since version 13.) An order whose items cannot be
-- read (a broken row) holds nothing here rather than failing every reader
-- of the holds; check names it.
CREATE VIEW stock_holds AS
SELECT s.order_id AS order_id,
       json_extract(item.value, '$.sku') AS sku,
       json_extract(item.value, '$.qty') AS qty,
       CASE st.status WHEN 'done' THEN 'reserved' ELSE 'released' END AS status,
       st.done_at AS created_at,
       COALESCE(st.compensated_at, st.done_at) AS updated_at
FROM saga_steps st
JOIN saga_instances s ON s.saga_id = st.saga_id
JOIN orders o ON o.order_id = s.order_id,
     json_each(CASE WHEN json_valid(o.items) THEN o.items ELSE '[]' END) AS item
WHERE st.step_name = 'reserve_stock' AND st.status IN ('done', 'compensated');
-- Every hold made before this version is one of the view's, with the same
-- quantity and status: the step's record and the hold were always written
-- in one transaction. Checked before the table goes, all the same: a
-- difference fails this migration (the CHECK below) and loses nothing.
CREATE TEMP TABLE stock_holds_differ (holds INTEGER NOT NULL CHECK (holds = 0));
INSERT INTO stock_holds_differ (holds)
SELECT (SELECT COUNT(*) FROM (SELECT order_id, sku, qty, status FROM stock_reservations
                              EXCEPT SELECT order_id, sku, qty, status FROM stock_holds))
     + (SELECT COUNT(*) FROM (SELECT order_id, sku, qty, status FROM stock_holds
                              EXCEPT SELECT order_id, sku, qty, status FROM stock_reservations));
DROP TABLE stock_holds_differ;
-- A process built before this version, still running beside one that
-- migrated, writes holds into a table that is gone: its reserve_stock
-- fails and rolls back, and the saga waits for a process that reserves
-- the new way; its compensation fails the same way, and a saga whose
-- compensation only such processes tried becomes compensation_failed, for
-- an operator's saga resume, which releases the hold once.
DROP TABLE stock_reservations;
