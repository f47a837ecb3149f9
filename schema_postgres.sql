-- The retrysafe schema for PostgreSQL: the same tables, columns, indexes
-- and constraints as schema.sql (TestSchemasAgree checks the columns), and
-- the same comment on each table. Each
-- "-- version N" section is a migration, applied in order in its own
-- transaction and recorded in schema_migrations (see dialect.go). Never edit
-- a section that has shipped; add a new one below, in both files.
--
-- What differs from schema.sql, and why:
--   * INTEGER is BIGINT: SQLite's INTEGER is 64-bit, PostgreSQL's 32-bit.
--   * BLOB is BYTEA.
--   * seq columns are identity columns; SQLite uses the rowid.
--   * No WITHOUT ROWID: a PostgreSQL table is a heap plus indexes anyway.
--   * Times are utc_time: TEXT in timeFormat with the "C" collation, so they
--     compare byte by byte as in SQLite, whatever the database's locale.

-- version 1

CREATE DOMAIN utc_time AS TEXT COLLATE "C";

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
    locked_at       utc_time,
    -- locked_by is the holder's lease token. Every phase checks it in its
    -- own transaction, so a slow request whose lease was taken over can
    -- never record its phase on top of the new holder's.
    locked_by       TEXT,
    response_status BIGINT,
    response_body   BYTEA,
    -- response_location is replayed as the Location header of a 201.
    response_location TEXT,
    created_at      utc_time NOT NULL,
    -- expires_at is read: an expired key no longer replays, and cleanup
    -- deletes it. The article wrote it and never looked at it again.
    expires_at      utc_time NOT NULL,
    PRIMARY KEY (user_id, idempotency_key)
);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
-- The completer looks for unfinished multi-phase keys; they are few.
CREATE INDEX idempotency_keys_unfinished ON idempotency_keys (locked_at)
    WHERE recovery_point <> 'finished';

-- orders is the business row the client asked for.
CREATE TABLE orders (
    order_id        TEXT PRIMARY KEY,
    user_id         TEXT NOT NULL,
    amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
    currency        TEXT NOT NULL,
    items           TEXT NOT NULL, -- JSON array of {"sku","qty"}
    payment_method  TEXT NOT NULL,
    -- status: created | paid | cancelled | refunded
    status          TEXT NOT NULL CHECK (status IN ('created', 'paid', 'cancelled', 'refunded')),
    idempotency_key TEXT,
    charge_id       TEXT,
    refunded_cents  BIGINT NOT NULL DEFAULT 0 CHECK (refunded_cents >= 0),
    cancel_reason   TEXT,
    created_at      utc_time NOT NULL,
    updated_at      utc_time NOT NULL
);
CREATE INDEX orders_idempotency_key ON orders (user_id, idempotency_key);

-- refunds are the order service's own record of money it asked the processor
-- to give back, written before the processor is called so that two refunds in
-- flight can never together exceed what was captured.
CREATE TABLE refunds (
    refund_id       TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL REFERENCES orders (order_id),
    amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
    -- status: pending | succeeded | failed
    status          TEXT NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    processor_refund_id TEXT UNIQUE,
    -- source: api | webhook (a refund made at the processor's dashboard)
    source          TEXT NOT NULL,
    -- idempotency_key is the API key the refund was asked under; a resumed
    -- request finds its refund by it instead of creating a second one.
    idempotency_key TEXT,
    created_at      utc_time NOT NULL,
    updated_at      utc_time NOT NULL,
    UNIQUE (order_id, idempotency_key)
);
CREATE INDEX refunds_order_id ON refunds (order_id);

-- outbox_events holds each event in the same transaction as the business row
-- it announces, so there is never an order nobody heard of nor an event for an
-- order that does not exist. The relay publishes them later.
--
-- seq is taken from a sequence at INSERT, not at COMMIT: a transaction that
-- commits later may hold a lower seq than one already visible. A relay that
-- remembered "the last seq I published" and read past it would skip that
-- event forever. The relay claims pending rows by status instead (see
-- claimOutboxEvents), and orders by seq only among what it sees.
-- event_id stays the article's key and is the message id end to end (broker
-- dedupe, inbox).
CREATE TABLE outbox_events (
    seq             BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    event_id        TEXT NOT NULL UNIQUE,
    event_type      TEXT NOT NULL,
    aggregate_id    TEXT NOT NULL,
    payload         TEXT NOT NULL,
    -- status: pending | published | failed. failed is kept and shown by
    -- inspect, never dropped.
    status          TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published', 'failed')),
    attempts        BIGINT NOT NULL DEFAULT 0,
    next_attempt_at utc_time NOT NULL,
    -- claimed_by/claimed_until are the relay's lease: two relays never
    -- publish the same event in the same sweep.
    claimed_by      TEXT,
    claimed_until   utc_time,
    last_error      TEXT,
    created_at      utc_time NOT NULL,
    published_at    utc_time
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
    seq          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    message_id   TEXT NOT NULL UNIQUE,
    subject      TEXT NOT NULL,
    payload      TEXT NOT NULL,
    published_at utc_time NOT NULL,
    -- duplicates counts publishes that the dedupe absorbed.
    duplicates   BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE broker_deliveries (
    subscriber     TEXT NOT NULL,
    message_seq    BIGINT NOT NULL REFERENCES broker_messages (seq),
    -- status: pending | acked
    status         TEXT NOT NULL CHECK (status IN ('pending', 'acked')),
    delivery_count BIGINT NOT NULL DEFAULT 0,
    -- visible_at: when the message may be delivered (again). A fetch moves it
    -- ackWait ahead, so a consumer that dies without acking gets it back.
    visible_at     utc_time NOT NULL,
    acked_at       utc_time,
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
    delivery_count BIGINT NOT NULL,
    -- duplicates counts deliveries the inbox recognised and skipped.
    duplicates     BIGINT NOT NULL DEFAULT 0,
    processed_at   utc_time NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX inbox_messages_processed_at ON inbox_messages (processed_at);

-- saga_instances is the fulfilment saga's state machine, one per order.
CREATE TABLE saga_instances (
    saga_id         TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL UNIQUE REFERENCES orders (order_id),
    status          TEXT NOT NULL CHECK (status IN
        ('in_progress', 'compensating', 'completed', 'compensated', 'compensation_failed')),
    current_step    TEXT NOT NULL,
    attempts        BIGINT NOT NULL DEFAULT 0,
    next_attempt_at utc_time NOT NULL,
    -- locked_until is the lease of the worker running the saga; when a worker
    -- dies, recovery picks the saga up after it passes.
    locked_by       TEXT,
    locked_until    utc_time,
    failure_reason  TEXT,
    last_error      TEXT,
    created_at      utc_time NOT NULL,
    updated_at      utc_time NOT NULL
);
CREATE INDEX saga_instances_runnable ON saga_instances (next_attempt_at)
    WHERE status IN ('in_progress', 'compensating');

-- saga_steps records each step when, and only when, it ran. The article
-- inserted every step as done up front, so compensation undid steps that
-- never happened.
CREATE TABLE saga_steps (
    saga_id        TEXT NOT NULL REFERENCES saga_instances (saga_id),
    step_index     BIGINT NOT NULL,
    step_name      TEXT NOT NULL,
    -- status: pending | done | failed | compensated
    status         TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed', 'compensated')),
    attempts       BIGINT NOT NULL DEFAULT 0,
    result         TEXT,
    error          TEXT,
    done_at        utc_time,
    compensated_at utc_time,
    PRIMARY KEY (saga_id, step_index)
);

-- stock_items is the warehouse: available + reserved + sold always equals
-- stocked. (Since version 11 reserved and sold are counted from
-- stock_reservations instead.) No code deletes a row: the create path
-- remembers the SKUs it found here (checkSKUs).
CREATE TABLE stock_items (
    sku       TEXT PRIMARY KEY,
    available BIGINT NOT NULL CHECK (available >= 0),
    reserved  BIGINT NOT NULL CHECK (reserved >= 0),
    sold      BIGINT NOT NULL DEFAULT 0 CHECK (sold >= 0),
    stocked   BIGINT NOT NULL
);
-- stock_reservations ties each hold to its order so it is released or sold
-- exactly once.
CREATE TABLE stock_reservations (
    order_id   TEXT NOT NULL REFERENCES orders (order_id),
    sku        TEXT NOT NULL REFERENCES stock_items (sku),
    qty        BIGINT NOT NULL CHECK (qty > 0),
    -- status: reserved | released (and sold, until version 13)
    status     TEXT NOT NULL CHECK (status IN ('reserved', 'released', 'sold')),
    created_at utc_time NOT NULL,
    updated_at utc_time NOT NULL,
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
    amount_cents    BIGINT NOT NULL,
    currency        TEXT NOT NULL,
    payment_method  TEXT NOT NULL,
    -- status: succeeded | declined
    status          TEXT NOT NULL CHECK (status IN ('succeeded', 'declined')),
    refunded_cents  BIGINT NOT NULL DEFAULT 0,
    -- key_hits counts calls answered from the key instead of charging again.
    key_hits        BIGINT NOT NULL DEFAULT 0,
    created_at      utc_time NOT NULL
);
CREATE TABLE processor_refunds (
    refund_id       TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    charge_id       TEXT NOT NULL REFERENCES processor_charges (charge_id),
    amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
    key_hits        BIGINT NOT NULL DEFAULT 0,
    created_at      utc_time NOT NULL
);

-- version 2

-- The fencing tokens of the saga's and the relay's leases, and the inbox's
-- own count of failed deliveries: see version 2 of schema.sql for why.
ALTER TABLE saga_instances ADD COLUMN lease_token BIGINT NOT NULL DEFAULT 0;
ALTER TABLE outbox_events ADD COLUMN lease_token BIGINT NOT NULL DEFAULT 0;
CREATE TABLE inbox_failures (
    consumer       TEXT NOT NULL,
    message_id     TEXT NOT NULL,
    failures       INTEGER NOT NULL CHECK (failures > 0),
    last_error     TEXT NOT NULL,
    last_failed_at utc_time NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

-- version 3

-- Wake-ups across processes (see infra_wakeup.go): a new outbox event wakes the
-- relays, a new delivery the consumers, of every process that LISTENs.
-- pg_notify in the writing transaction is delivered only if, and when, it
-- commits, so a woken relay always finds what it was woken for. One
-- notification per statement: a batch insert wakes once.
CREATE FUNCTION notify_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION notify_work('retrysafe_outbox');
CREATE TRIGGER broker_deliveries_notify AFTER INSERT ON broker_deliveries
    FOR EACH STATEMENT EXECUTE FUNCTION notify_work('retrysafe_deliveries');

-- version 4

-- repair_log records every repair an operator made: see version 4 of
-- schema.sql for why.
CREATE TABLE repair_log (
    repair_id  TEXT PRIMARY KEY,
    operator   TEXT NOT NULL,
    action     TEXT NOT NULL,
    target     TEXT NOT NULL,
    result     TEXT NOT NULL,
    created_at utc_time NOT NULL
);
CREATE INDEX repair_log_created_at ON repair_log (created_at);

-- version 5

-- The W3C Trace Context of each event's creation, of the embedded broker's
-- copy, and of the OrderCreated that started a saga: see version 5 of
-- schema.sql for why.
ALTER TABLE outbox_events ADD COLUMN traceparent TEXT;
ALTER TABLE outbox_events ADD COLUMN tracestate TEXT;
ALTER TABLE broker_messages ADD COLUMN traceparent TEXT;
ALTER TABLE broker_messages ADD COLUMN tracestate TEXT;
ALTER TABLE saga_instances ADD COLUMN traceparent TEXT;
ALTER TABLE saga_instances ADD COLUMN tracestate TEXT;

-- version 6

-- The partial indexes that every scrape of /metrics reads instead of the
-- tables' history: see version 6 of schema.sql for why. Built inside the
-- migration's transaction, each blocks writes to its table while it reads
-- it once (CREATE INDEX CONCURRENTLY cannot run in a transaction): on a
-- table of a hundred million rows, build them by hand beforehand with
-- CONCURRENTLY and IF NOT EXISTS, under these names.
CREATE INDEX IF NOT EXISTS outbox_events_pending_since ON outbox_events (created_at)
    WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS outbox_events_failed ON outbox_events (seq)
    WHERE status = 'failed';
CREATE INDEX IF NOT EXISTS saga_instances_compensation_failed ON saga_instances (saga_id)
    WHERE status = 'compensation_failed';

-- version 7

-- Delivery, not the broker's acknowledgement, ends an event's life: see
-- version 7 of schema.sql for why, and deliver.go. Built inside the
-- migration's transaction, like version 6's indexes.
ALTER TABLE outbox_events ADD COLUMN delivered_at utc_time;
ALTER TABLE outbox_events ADD COLUMN republished_at utc_time;
ALTER TABLE outbox_events ADD COLUMN republishes BIGINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS outbox_events_undelivered ON outbox_events (published_at)
    WHERE status = 'published' AND delivered_at IS NULL;

-- A poison message waits for an operator's replay, and so does what the
-- replay delivers: cleanup keeps the outbox event and the broker's copy of
-- any message an inbox holds as poison, past the message retention, until
-- the replay (or never). It looks them up here; only a message made poison
-- writes to it.
CREATE INDEX IF NOT EXISTS inbox_messages_poison ON inbox_messages (message_id)
    WHERE status = 'poison';

-- version 8

-- The OrderCreated that started each saga: see version 8 of schema.sql.
ALTER TABLE saga_instances ADD COLUMN started_by TEXT;

-- version 9

-- The oldest pending event is read from outbox_events_pending: see
-- version 9 of schema.sql.
DROP INDEX IF EXISTS outbox_events_pending_since;

-- version 10

-- The relay lease: see version 10 of schema.sql.
CREATE TABLE relay_leases (
    name         TEXT PRIMARY KEY,
    holder       TEXT NOT NULL,
    lease_token  BIGINT NOT NULL,
    leased_until utc_time NOT NULL
);
INSERT INTO relay_leases (name, holder, lease_token, leased_until)
VALUES ('outbox', '', 0, '0001-01-01T00:00:00.000000Z');

-- version 11

-- What is reserved and what is sold are the stock_reservations of each
-- status: see version 11 of schema.sql.
ALTER TABLE stock_items DROP COLUMN reserved;
ALTER TABLE stock_items DROP COLUMN sold;

-- version 12

-- Delivery is read from the inboxes, and the reconciler keeps a cursor: see
-- version 12 of schema.sql. Here a publish stamps its transaction's id
-- (pg_current_xact_id, as a number): transactions commit in another order
-- than they take ids, so the reconciler never moves the cursor past the
-- oldest transaction still running (deliveryHorizon). This migration's own
-- id is where the cursor starts, and what the events in flight get.
ALTER TABLE outbox_events ADD COLUMN delivery_position BIGINT;
UPDATE outbox_events
    SET delivery_position = CASE WHEN delivered_at IS NULL THEN pg_current_xact_id()::text::bigint ELSE 0 END
    WHERE status = 'published';
DROP INDEX IF EXISTS outbox_events_undelivered;
ALTER TABLE outbox_events DROP COLUMN delivered_at;
CREATE INDEX IF NOT EXISTS outbox_events_delivery ON outbox_events (delivery_position)
    WHERE delivery_position IS NOT NULL;
CREATE TABLE delivery_cursor (
    name     TEXT PRIMARY KEY,
    position BIGINT NOT NULL
);
INSERT INTO delivery_cursor (name, position) VALUES ('outbox', pg_current_xact_id()::text::bigint);
-- A published event always has its position: see version 12 of schema.sql.
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_published_has_position
    CHECK (status <> 'published' OR delivery_position IS NOT NULL);

-- version 13

-- A sale writes nothing: a hold stays reserved, and it is sold when its
-- order's saga completed. See version 13 of schema.sql.
UPDATE stock_reservations SET status = 'reserved' WHERE status = 'sold';
ALTER TABLE stock_reservations DROP CONSTRAINT stock_reservations_status_check;
ALTER TABLE stock_reservations ADD CONSTRAINT stock_reservations_status_check
    CHECK (status IN ('reserved', 'released'));

-- version 14

-- A hold is the record of its saga's reserve_stock step: see version 14 of
-- schema.sql. order_items reads an order's items, or none if they are not a
-- JSON array of objects (a broken row, which check names), so that one
-- unreadable order does not fail every reader of the holds.
CREATE FUNCTION order_items(items TEXT) RETURNS TABLE (sku TEXT, qty BIGINT)
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN QUERY SELECT e ->> 'sku', (e ->> 'qty')::bigint FROM jsonb_array_elements(items::jsonb) AS e;
EXCEPTION WHEN OTHERS THEN
    RETURN;
END $$;
CREATE VIEW stock_holds AS
SELECT s.order_id AS order_id,
       item.sku AS sku,
       item.qty AS qty,
       CASE st.status WHEN 'done' THEN 'reserved' ELSE 'released' END AS status,
       st.done_at AS created_at,
       COALESCE(st.compensated_at, st.done_at) AS updated_at
FROM saga_steps st
JOIN saga_instances s ON s.saga_id = st.saga_id
JOIN orders o ON o.order_id = s.order_id
CROSS JOIN LATERAL order_items(o.items) AS item
WHERE st.step_name = 'reserve_stock' AND st.status IN ('done', 'compensated');
DO $$
BEGIN
    IF EXISTS (SELECT order_id, sku, qty, status FROM stock_reservations
               EXCEPT SELECT order_id, sku, qty, status FROM stock_holds)
       OR EXISTS (SELECT order_id, sku, qty, status FROM stock_holds
                  EXCEPT SELECT order_id, sku, qty, status FROM stock_reservations) THEN
        RAISE EXCEPTION 'stock_reservations and the reserve_stock steps differ: not migrated to schema version 14';
    END IF;
END $$;
DROP TABLE stock_reservations;
