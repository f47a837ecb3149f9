package main

import (
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// mutationsEnv names the variable that runs TestMutations: how many seeds
// the simulator may take to find each mutation. Each mutant is built from
// scratch, so it takes minutes; CI sets it.
const mutationsEnv = "RETRYSAFE_MUTATIONS"

// exerciseSeeds is how many seeds the simulator may take to find a mutant
// named on the command line (go test -run 'TestMutations/NAME' .) without
// RETRYSAFE_MUTATIONS: as many as CI gives it.
const exerciseSeeds = 800

// mutation puts one fault back: a fix of retrysafe's own, or a flaw of the
// article's sample where that is a small, local change. Each edit replaces
// old with new in file, and old must occur exactly once, so a mutation
// whose code has moved on fails loudly instead of testing nothing.
type mutation struct {
	name  string
	fault string // what it puts back, as the flaw tables of docs/sample-flaws.md and docs/faults-found.md name it
	edits []mutationEdit
	// catcher is the test (a -run pattern, "TestSaga/TimeoutChargesOnce")
	// that must fail on the mutant, as docs/break-it.md says it does; ""
	// for a fault that only the simulator finds.
	catcher string
	// simulatorMisses, when set, says why the simulator does not find this
	// mutant within CI's seeds today: an open gap of the simulator, kept
	// visible, and probed with a tenth of the seeds (TestMutations). The
	// catcher must still fail on it.
	simulatorMisses string
}

// mutationEdit is one textual change of a mutation.
type mutationEdit struct {
	file, old, new string
}

// mutations returns every mutation the simulator must find.
func mutations() []mutation {
	return []mutation{
		{
			name:    "SagaWritesUnfenced",
			catcher: "TestSaga/StaleWorkerCannotCancelTwice",
			fault:   "retrysafe fault 1: a saga worker paused past its lease undoes a live one's work",
			edits: []mutationEdit{
				{"saga.go", "WHERE saga_id = ? AND status = ? AND lease_token = ?`, args...)", "WHERE saga_id = ? AND ? <> '' AND ? >= 0`, args...)"},
			},
		},
		{
			name:    "ExpiredRefundKeyRunsAgain",
			catcher: "TestHTTPRefundKeyExpiry/ExpiredKeyReusedIsRefusedNot500",
			fault:   "retrysafe fault 2: a refund key reused after it expired answers 500 for ever",
			edits: []mutationEdit{
				{"refund.go", "\t\tcase err == nil:\n\t\t\treturn refuse(expiredRefundKeyProblem(", "\t\tcase err == nil && false:\n\t\t\treturn refuse(expiredRefundKeyProblem("},
			},
		},
		{
			name:    "KeyExpiresADayAfterItsClaim",
			catcher: "TestHTTPRefundKeyExpiry/CompleterFinishesRefundAbandonedPastExpiryAt_",
			fault:   "retrysafe fault 3: a refund that finishes after its key's expiry loses its answer",
			edits: []mutationEdit{
				{"idem.go", "response_location = ?, expires_at = ?", "response_location = ?, expires_at = COALESCE(expires_at, ?)"},
			},
		},
		{
			name:    "AmbiguousNamesAccepted",
			catcher: "TestHTTPWebhookHostile/AmbiguousBodyIsRefused",
			fault:   "retrysafe fault 4: two different requests share one fingerprint",
			edits: []mutationEdit{
				{"orders.go", "func checkNames(body []byte, shape reflect.Type) error {\n", "func checkNames(body []byte, shape reflect.Type) error {\n\tif true {\n\t\treturn nil\n\t}\n"},
			},
		},
		{
			name:    "WebhookAmountUnchecked",
			catcher: "TestHTTPWebhookHostile/RefundAmountBeyondTheChargeIsPoison",
			fault:   "retrysafe fault 7: a signed charge.refunded can set any amount",
			// As it was: neither the amount checked against what remains,
			// nor the refund confirmed by the processor (which alone now
			// stops a forged amount too).
			edits: []mutationEdit{
				{"webhook.go", "\tif amount > remaining {", "\tif false && amount > remaining {"},
				{"webhook.go", "\tif unconfirmed != nil {\n\t\treturn unconfirmed\n\t}", "\t_ = unconfirmed"},
			},
		},
		{
			name:    "EarlyRefundEventIsPoison",
			catcher: "TestHTTPWebhookHostile/RefundBeforeThePaymentIsRecordedIsRetried",
			fault:   "retrysafe: a refund of a charge the saga has not recorded yet is lost as poison",
			edits: []mutationEdit{
				{"webhook.go", "\tcase err == nil && sagaOrderStatus == orderCreated:", "\tcase err == nil && sagaOrderStatus == orderCreated && false:"},
				{"webhook.go", "\t\tcase err == nil && status == orderCreated:", "\t\tcase err == nil && status == orderCreated && false:"},
			},
		},
		{
			name:    "UnconfirmedRefundCounted",
			catcher: "TestHTTPWebhookHostile/OnlyRefundsTheProcessorConfirmsAreCounted",
			fault:   "retrysafe: a signed event for a refund the processor never made is counted",
			edits: []mutationEdit{
				{"webhook.go", "\tif unconfirmed != nil {\n\t\treturn unconfirmed\n\t}", "\t_ = unconfirmed"},
			},
		},
		{
			name:    "BrokerGivesUpAfterFiveDeliveries",
			catcher: "TestInbox/OutageDoesNotUseUpDeliveries",
			fault:   "retrysafe fault 5: the broker gives up on a message after five deliveries (NATS MaxDeliver 5)",
			edits: []mutationEdit{
				{"broker.go", "WHERE subscriber = ? AND status = 'pending' AND visible_at <= ?", "WHERE subscriber = ? AND status = 'pending' AND visible_at <= ? AND delivery_count < 5"},
			},
		},
		{
			name:    "TransientFailureStoredAs500",
			catcher: "TestHTTPRefund/LostProcessorResponseIsRetriable",
			fault:   "sample flaw 5: it stored any exception as a permanent 500",
			// A lost processor answer is stored on the refund key as the
			// request's outcome, as the sample stored every exception.
			edits: []mutationEdit{
				{"refund.go", "\tdefault:\n\t\t// A timeout: the refund may have happened. The retry (or the\n\t\t// completer) asks again with the same key and learns which.\n\t\treturn apiResponse{}, err\n\t}",
					"\tdefault:\n\t\tstored := problemResponse(problem{Type: problemInternal, Title: \"Internal error\", Status: 500, Detail: err.Error()})\n" +
						"\t\tif err := withTx(ctx, a.db, func(tx *sql.Tx) error { return completeKey(ctx, tx, req.UserID, req.IdempotencyKey, stored, a.now()) }); err != nil {\n" +
						"\t\t\treturn apiResponse{}, err\n\t\t}\n\t\treturn stored, nil\n\t}"},
			},
		},
		{
			name:    "ExpiresAtNotRead",
			catcher: "TestIdempotency/ExpiredKeyNoLongerReplays",
			fault:   "sample flaw 4: it wrote expires_at and never read it",
			edits: []mutationEdit{
				{"idem.go", "if key.ExpiresAt <= formatTime(now) && key.RecoveryPoint == recoveryFinished {", "if false && key.ExpiresAt <= formatTime(now) && key.RecoveryPoint == recoveryFinished {"},
			},
		},
		{
			name:    "StepsInsertedAsDone",
			catcher: "TestSaga/DeclinedCardCompensatesOnlyStepsThatRan",
			fault:   "sample flaw 6: it inserted all saga steps as done up front",
			edits: []mutationEdit{
				{"saga.go", "\tif n == 1 {\n\t\treturn nil\n\t}", "\tif n == 1 {\n\t\t_, err = tx.ExecContext(ctx, `INSERT INTO saga_steps (saga_id, step_index, step_name, status) VALUES (?, 0, 'reserve_stock', 'done'), (?, 1, 'charge_card', 'done'), (?, 2, 'confirm', 'done')`, sagaID, sagaID, sagaID)\n\t\treturn err\n\t}"},
			},
		},
		{
			name:    "NoOrderCancelled",
			catcher: "TestSaga/DeclinedCardCompensatesOnlyStepsThatRan",
			fault:   "sample flaw 8: it left the order as it was after compensating",
			edits: []mutationEdit{
				{"saga.go", "\tif err := insertOutboxEvent(ctx, tx, orderCancelled, now); err != nil {\n\t\treturn err\n\t}", "\t_ = orderCancelled"},
			},
		},
		{
			name:    "PaymentCapturedNotConsumed",
			catcher: "TestSaga/PaidOrderIsCharged",
			fault:   "sample flaw 11: it wrote PaymentCaptured and nobody consumed it",
			edits: []mutationEdit{
				{"inbox.go", "subjects: []string{eventPaymentCaptured, eventOrderCancelled}", "subjects: []string{eventOrderCancelled}"},
			},
		},
		{
			name:    "CommitErrorIgnored",
			catcher: "TestGroupCommit/EveryMemberAnsweredWhenTheCommitFails",
			fault:   "review: a COMMIT that failed is reported as done (the transaction's writes are gone, its caller is told they stand)",
			edits: []mutationEdit{
				{"db.go", "\tif err := tx.Commit(); err != nil {\n\t\treturn fmt.Errorf(\"commit: %w\", err)\n\t}", "\ttx.Commit()"},
			},
		},
		{
			name:    "ChargeKeyPerAttempt",
			catcher: "TestSaga/TimeoutChargesOnce",
			fault:   "sample: a processor key that differs per attempt (the charge is made again after a lost response)",
			edits: []mutationEdit{
				{"saga.go", "\treturn sagaID + \":\" + stepChargeCard\n}", "\treturn sagaID + \":\" + stepChargeCard + \":\" + time.Now().String()\n}"},
			},
		},
		{
			name:    "CleanupDeletesPoisonRecords",
			catcher: "TestInboxReplay/PoisonMessageOutlivesTheRetention",
			fault:   "review: cleanup deletes old poison records too, and with them the only trace of a message an operator must replay",
			edits: []mutationEdit{
				{"cleanup.go", "\t\tWHERE status = 'done' AND processed_at <= ?1 AND (consumer, message_id) IN (\n\t\t\tSELECT consumer, message_id FROM inbox_messages i WHERE status = 'done' AND processed_at <= ?1", "\t\tWHERE processed_at <= ?1 AND (consumer, message_id) IN (\n\t\t\tSELECT consumer, message_id FROM inbox_messages i WHERE processed_at <= ?1"},
			},
		},
		{
			name:    "KnownRefundLookedUpByOurID",
			catcher: "TestHTTPWebhookHostile/OurOwnRefundAnnouncedWhilePendingIsCountedOnce",
			fault:   "retrysafe: a charge.refunded for a refund we recorded is looked up by our refund id, not the processor's, and counted again",
			edits: []mutationEdit{
				{"webhook.go", "SELECT order_id, amount_cents FROM refunds WHERE processor_refund_id = ?", "SELECT order_id, amount_cents FROM refunds WHERE refund_id = ?"},
			},
		},
		{
			name:    "UnreachableProcessorConfirmsRefund",
			catcher: "TestHTTPWebhookHostile/EventWaitsWhileTheProcessorCannotConfirmIt",
			fault:   "review: a charge.refunded whose refund the processor cannot be asked about (down, timed out) is counted as confirmed",
			edits: []mutationEdit{
				{"webhook.go", "\tcase err != nil:\n\t\treturn nil, err\n", "\tcase err != nil:\n\t\treturn nil, nil\n"},
			},
		},
		{
			name:    "OutageCountsAgainstMessage",
			catcher: "TestInbox/TransientDatabaseErrorCountsNothing",
			fault:   "review: a database error in a consumer's effect is counted against the message, as its own failure, and uses up its deliveries",
			edits: []mutationEdit{
				{"inbox.go", "\tif isOurFailure(ctx, a.db, failed) {", "\tif errors.Is(failed, errCrash) || ctx.Err() != nil {"},
			},
		},
		{
			name:    "ReconcilerOff",
			catcher: "TestDelivery/MessageTheBrokerLostIsRepublishedAndAppliedOnce",
			fault:   "retrysafe: the broker's acknowledgement ends an event's life; a message the broker lost after acknowledging it leaves its order created for ever",
			edits: []mutationEdit{
				{"deliver.go", "\tevents, err := a.claimUndelivered(ctx, relayID, limit)\n", "\tevents, err := a.claimUndelivered(ctx, relayID, 0)\n"},
			},
		},
		{
			name:    "StockOversold",
			catcher: "TestSaga/OutOfStockCancelsWithoutCharging",
			fault:   "review: stock is reserved while any is available, not only while the quantity ordered is (the schema's CHECK refuses the oversell, and the order never settles)",
			edits: []mutationEdit{
				{"stock.go", "WHERE sku = ? AND available >= ?`,\n\t\t\titem.Qty, item.SKU, item.Qty)", "WHERE sku = ? AND available > 0`,\n\t\t\titem.Qty, item.SKU)"},
			},
		},
		{
			name:    "TimedOutChargeCompensated",
			catcher: "TestSagaDecisions/AfterFailure/TimeoutIsRetried",
			fault:   "review: a charge that timed out is compensated as if it never happened (no refund), though the processor may have made it",
			// A timeout counted as a business failure: the step is
			// recorded failed, and compensate undoes only done steps.
			edits: []mutationEdit{
				{"saga.go", "\treturn errors.Is(err, errCardDeclined) ||\n", "\treturn errors.Is(err, errCardDeclined) || errors.Is(err, errProcessorTimeout) ||\n"},
			},
		},
		{
			name:    "RefundTimeoutTreatedAsRefusal",
			catcher: "TestHTTPRefund/LostProcessorResponseIsRetriable",
			fault:   "review: a refund whose processor answer was lost is stored as the processor's definitive refusal (422), though the refund may have happened",
			edits: []mutationEdit{
				{"refund.go", "\tcase errors.Is(err, errRefundExceedsCharge), errors.Is(err, errProcessorKeyReused):\n", "\tcase errors.Is(err, errRefundExceedsCharge), errors.Is(err, errProcessorKeyReused), errors.Is(err, errProcessorTimeout):\n"},
			},
		},
		{
			name:    "CleanupDeletesUndeliveredEvents",
			catcher: "TestDelivery/LostMessageIsRepublishedAWeekLater",
			fault:   "review: cleanup deletes old published events that a consumer never applied, and with them the reconciler's only copy",
			edits: []mutationEdit{
				{"cleanup.go", "WHERE status = 'published' AND delivery_position < `+deliveryCursor+` AND published_at <= ?", "WHERE status = 'published' AND published_at <= ?"},
			},
		},
		{
			name:    "LostBatchAnsweredAsCommitted",
			catcher: "TestGroupCommit/EveryMemberAnsweredWhenOneLosesTheTransaction",
			fault:   "review: when a member loses a group commit's transaction, the members that ran before it are told their work committed, though it was rolled back with the rest",
			edits: []mutationEdit{
				{"infra_groupcommit.go", "\t\tb.members[atFault].done <- outcome\n\t\tb.members = slices.Delete(b.members, atFault, atFault+1)\n", "\t\tfor i := range atFault {\n\t\t\tb.members[i].done <- b.outcomes[i]\n\t\t}\n\t\tb.members[atFault].done <- outcome\n\t\tb.members = slices.Delete(b.members, 0, atFault+1)\n"},
			},
		},
		{
			name:    "ReleasedLeaseStillHeld",
			catcher: "TestHTTPRefund/StalledRequestTakenOverRecordsNothing",
			fault:   "review: a refund key that nobody holds (its lease released, or set aside by the completer) counts as held by whichever request asks, so a request paused past its lease records its phase over another's",
			edits: []mutationEdit{
				{"refund.go", "\tif lockedBy.String != lease {\n\t\treturn errKeyInProgress", "\tif lockedBy.Valid && lockedBy.String != lease {\n\t\treturn errKeyInProgress"},
			},
		},
		{
			name:    "DeliveredWhenAnyConsumerApplied",
			catcher: "TestDelivery/EventOneConsumerMissedIsRepublishedAndTheOtherAbsorbsIt",
			fault:   "review: the reconciler's cursor passes an event once any consumer applied it, not each consumer of its subject; a message the broker lost for the other is never published again",
			edits: []mutationEdit{
				{"deliver.go", "\t\t\t   AND `+undeliveredSQL(a.deliveryTargets)+`\n\t\t\t ORDER BY e.delivery_position LIMIT 1),", "\t\t\t   AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.message_id = e.event_id)\n\t\t\t ORDER BY e.delivery_position LIMIT 1),"},
			},
		},
		{
			name:    "ReplayKeepsItsDeliveryPosition",
			catcher: "TestDelivery/ReplayTheBrokerLostIsRepublished",
			fault:   "an operator's replay leaves its event at the delivery position the reconciler's cursor has passed: a replay the broker loses is never published again",
			edits: []mutationEdit{
				{"repair.go", "SET published_at = ?, delivery_position = `+dialectOf(a.db).deliveryPosition+` WHERE event_id = ?`", "SET published_at = ? WHERE event_id = ?`"},
			},
		},
		{
			name:    "ReplayCountsTheCursorAsPassed",
			catcher: "TestDelivery/ReplayOfAnEventAtTheCursorLeavesTheOthersToApplyIt",
			fault:   "review: an operator's replay counts an event at the reconciler's cursor as passed, and writes an inbox row for each other consumer of it, though one that stopped the cursor there has not applied it",
			edits: []mutationEdit{
				{"repair.go", "\t\t\t\t  AND (e.delivery_position < `+deliveryCursor+`", "\t\t\t\t  AND (e.delivery_position <= `+deliveryCursor+`"},
			},
		},
		{
			name:    "CursorMovesBack",
			catcher: "TestDelivery/SweepPausedBeforeItsMoveNeverSetsTheCursorBack",
			fault:   "review: the reconciler's sweep moves the delivery cursor to where it read it could go, even when another sweep has moved it further since",
			edits: []mutationEdit{
				{"deliver.go", "WHERE name = 'outbox' AND position < ?`, next, next)", "WHERE name = 'outbox' AND ? > 0`, next, next)"},
			},
			simulatorMisses: "a cursor set back is still true, for every event below it was delivered: sweeps read more and cleanup keeps more, which changes no outcome the simulator judges",
		},
		{
			name:    "PositionBelowTheCursorAfterCleanup",
			catcher: "TestDelivery/EventAfterCleanupEmptiedTheOutboxIsWatched",
			fault:   "on SQLite a publish stamps one more than the largest position left, which once cleanup has deleted the events the cursor passed is below the cursor: the reconciler never reads the event",
			edits: []mutationEdit{
				{"infra_dialect.go", "const sqliteNextPosition = `MAX(\n\tCOALESCE((SELECT MAX(delivery_position) FROM outbox_events WHERE delivery_position IS NOT NULL), 0) + 1,\n\t(SELECT position FROM delivery_cursor WHERE name = 'outbox'))`", "const sqliteNextPosition = `(COALESCE((SELECT MAX(delivery_position) FROM outbox_events WHERE delivery_position IS NOT NULL), 0) + 1)`"},
			},
		},
		{
			name:    "ReplayKeepsDeliveryCount",
			catcher: "TestEmbeddedBroker/StaleHolderCannotAckAReplayAway",
			fault:   "review: an operator's replay keeps the delivery's fencing token; the consumer that recorded the message poison and had not acked yet acks the replay away",
			edits: []mutationEdit{
				{"repair.go", "\t\t    delivery_count = broker_deliveries.delivery_count + 1`,", "\t\t    delivery_count = broker_deliveries.delivery_count`,"},
			},
		},
		{
			name:    "FailedMemberNotRolledBack",
			catcher: "TestGroupCommit/FailureRollsBackOnlyItsSavepoint",
			fault:   "review: a group-commit member whose work returns an error after it wrote is not rolled back to its savepoint; its order commits with the batch without its key, its client is told it failed, and the retry creates a second order",
			edits: []mutationEdit{
				{"infra_groupcommit.go", "\toutcome := runRecovered(fn, tx)\n\tif outcome.failed() {", "\toutcome := runRecovered(fn, tx)\n\tif outcome.panicked != nil {"},
			},
		},
		{
			name:    "FullRefundLeavesOrderPaid",
			catcher: "TestHTTPRefund/RefundIsMadeOnceAndReplayed",
			fault:   "review: an order is marked refunded only once more than its amount is refunded, so a fully refunded order stays paid for ever",
			edits: []mutationEdit{
				{"refund.go", "status = CASE WHEN refunded_cents + ? >= amount_cents THEN 'refunded'", "status = CASE WHEN refunded_cents + ? > amount_cents THEN 'refunded'"},
			},
		},
		{
			name:    "ConfirmReleasesStock",
			catcher: "TestSaga/PaidOrderIsCharged",
			fault:   "review: the saga's confirm step releases the order's holds, so a paid order's goods go back on the shelf",
			edits: []mutationEdit{
				{"saga.go", "confirms without a charge\", run.saga.SagaID)\n\t}\n", "confirms without a charge\", run.saga.SagaID)\n\t}\n\tif err := releaseStock(ctx, tx, run.order); err != nil {\n\t\treturn err\n\t}\n"},
			},
		},
		{
			name:    "RecoveryIgnoresCompensatingSagas",
			catcher: "TestSagaResume/CompensationsAreTriedAgain",
			fault:   "review: only sagas in progress are claimed, so an interrupted compensation is never resumed: its order is never cancelled and its stock stays held",
			edits: []mutationEdit{
				{"infra_saga.go", "WHERE status IN ('in_progress', 'compensating')", "WHERE status = 'in_progress'"},
			},
		},
		{
			name:    "RetryOutcomeAcked",
			catcher: "TestInbox/OutageDoesNotUseUpDeliveries",
			fault:   "review: a message whose consumer failed transiently is acked, not naked, so the broker never delivers it again and its event is lost",
			edits: []mutationEdit{
				{"inbox.go", "\t\tcase inboxRetry:\n\t\t\tif err := a.broker.nak(ctx, d, consumeBackoff(results[i].Failures)); err != nil && !errors.Is(err, errDeliveryLeaseLost) {\n\t\t\t\t// One failed nak must not keep the others' acks back.\n\t\t\t\terrs = append(errs, err)\n\t\t\t}\n\t\tcase inboxApplied, inboxDuplicate, inboxPoison:\n", "\t\tcase inboxApplied, inboxDuplicate, inboxPoison, inboxRetry:\n"},
			},
		},
		{
			name:    "RefundInFlightNotAwaited",
			catcher: "TestHTTPRefund/WebhookOvertakingOurRecordIsRetried",
			fault:   "review: a charge.refunded that overtakes our own record of the same refund is counted as a dashboard refund instead of waiting, and our record then collides with it",
			edits: []mutationEdit{
				{"webhook.go", "\tif refundInFlight {\n\t\treturn errRefundInFlight\n\t}\n", ""},
			},
		},
		{
			name:    "PaymentPendingKeyReleased",
			catcher: "TestHTTPRefund/TooEarlyIsNotStored",
			fault:   "review: a refund asked before the order is paid releases its key instead of forgetting it, while the client is told nothing was stored; the completer refunds it later on its own",
			edits: []mutationEdit{
				{"refund.go", "\t\tif err := a.forgetKey(ctx, req, lease); err != nil {", "\t\tif err := a.releaseKey(ctx, req, lease); err != nil {"},
			},
		},
		{
			name:    "FingerprintIgnoresPath",
			catcher: "TestHTTPRefund/KeyReusedForAnotherOrderIsRefused",
			fault:   "review: the request fingerprint hashes the body only, so a key reused for another order's refund replays the first order's answer instead of 422",
			edits: []mutationEdit{
				{"idem.go", "\tfmt.Fprintf(h, \"%d:%s\\n%d:%s\\n\", len(r.Method), r.Method, len(r.Path), r.Path)\n", ""},
			},
		},
		{
			name:    "CleanupDeletesUnfinishedKeys",
			catcher: "TestCleanup/DeletesExpiredKeys",
			fault:   "review: cleanup deletes every expired key, finished or not, so an abandoned refund loses its key and is never completed",
			edits: []mutationEdit{
				{"cleanup.go", "WHERE expires_at <= ? AND recovery_point = 'finished' LIMIT ?)", "WHERE expires_at <= ? LIMIT ?)"},
			},
		},
		{
			name:    "RefundProcessorKeyFromClientKey",
			catcher: "TestHTTPRefundKeyExpiry/ExpiredKeyReusedIsRefusedNot500",
			fault:   "review: the processor's refund key is built from the client's Idempotency-Key, scoped to its user and reusable once expired, not from our refund id; two users who chose the same key string, or one key reused after its expiry for another order, collide at the processor and a valid refund is refused",
			edits: []mutationEdit{
				{"refund.go", "a.processor.refund(ctx, \"refund:\"+refundID, order.ChargeID.String, amount)", "a.processor.refund(ctx, \"refund:\"+req.IdempotencyKey, order.ChargeID.String, amount)"},
			},
		},
		{
			name:    "RelayMarksBeforePublish",
			catcher: "TestSetAsideFaults",
			fault:   "review: the relay marks a batch published before the broker has it; a crash or a refused publish in between leaves events published that the broker never got, never retried and never failed",
			edits: []mutationEdit{
				{"outbox.go", "\t// One batch: a broker round trip per batch, not per event.\n\tif err := a.broker.publishBatch(ctx, msgs); err != nil {", "\tif _, err := a.markPublished(ctx, events); err != nil {\n\t\treturn 0, err\n\t}\n\tif err := a.broker.publishBatch(ctx, msgs); err != nil {"},
				{"outbox.go", "\tmarked, err := a.markPublished(ctx, events)\n\tif err != nil {\n\t\treturn 0, err\n\t}\n", "\tmarked := int64(len(events))\n"},
			},
		},
		{
			name:    "LaterEventNotHeldBack",
			catcher: "TestOutbox/EventsOfOneOrderStayInOrder",
			fault:   "retrysafe: the relay takes every due event, not only the oldest unpublished event of its order; an order's later event (a second refund's) goes out while an earlier one waits out its backoff",
			edits: []mutationEdit{
				{"outbox.go", "\t\t  AND NOT EXISTS (\n\t\t\tSELECT 1 FROM outbox_events earlier\n\t\t\tWHERE earlier.aggregate_id = e.aggregate_id\n\t\t\t  AND earlier.seq < e.seq\n\t\t\t  AND earlier.status <> 'published')\n", ""},
			},
		},
		{
			name:            "RelayLeaseRenewedWithItsToken",
			catcher:         "TestOutbox/StaleRelayCannotFailAnEventAnotherPublished",
			fault:           "retrysafe: a relay renewing the relay lease after it passed keeps its token, so a relay of the same name paused past the lease still counts its failures and marks against the events the new sweep is publishing",
			simulatorMisses: "a stale relay's failure counts against an event only when its publish fails on the event's last attempt while the new sweep publishes it: the simulator's publish failures rarely reach the last attempt, and an event failed early is retried by its operator and settles",
			edits: []mutationEdit{
				{"outbox.go", "CASE WHEN lease_token = ?2 AND leased_until > ?3 THEN", "CASE WHEN lease_token = ?2 THEN"},
			},
		},
		{
			name:            "RelayTakesALiveLease",
			catcher:         "TestOutbox/CrashAfterPublishRepublishes",
			fault:           "retrysafe: any relay takes the relay lease, live or not; two relays publish the same events side by side, and a relay's claims are voided while it publishes them",
			simulatorMisses: "its only effect is more copies of events that the broker's dedupe and the inboxes absorb: the simulator judges outcomes, which at-least-once publishing allows, and counts no publishes",
			edits: []mutationEdit{
				{"outbox.go", "WHERE name = ?5 AND (lease_token = ?2 OR holder = ?1 OR leased_until <= ?3)", "WHERE name = ?5"},
			},
		},
		{
			name:            "RelaysOfAProcessSweepSideBySide",
			catcher:         "TestOutbox/RelaysOfOneProcessTakeTurns",
			fault:           "retrysafe: two relays of one process sweep under its relay lease at once; a claim writes nothing, so both publish the same events",
			simulatorMisses: "as RelayTakesALiveLease: the copies it publishes are absorbed by the broker's dedupe and the inboxes, and the simulator counts no publishes (it found one run in 419 seeds, by chance, and none in 800 once its random choices moved)",
			edits: []mutationEdit{
				{"outbox.go", "\tif live && m.sweeping != 0 {\n", "\tif live && m.sweeping != 0 && false {\n"},
			},
		},
		{
			name:    "UndeliveredIgnoresConsumer",
			catcher: "TestDelivery/EventOneConsumerMissedIsRepublishedAndTheOtherAbsorbsIt",
			fault:   "review: an event counts as delivered to a consumer once any consumer has an inbox row of it; a message the broker lost for the other consumer is never published again",
			edits: []mutationEdit{
				{"deliver.go", "AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.consumer = s.consumer AND i.message_id = e.event_id))`\n}", "AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.message_id = e.event_id))`\n}"},
			},
		},
		{
			name:    "FirstStepNeverUndone",
			catcher: "TestSagaDecisions/StepsToUndo",
			fault:   "review: compensation stops before the first step, so reserve_stock is never undone and a cancelled order keeps its stock held",
			edits: []mutationEdit{
				{"saga.go", "for i := len(steps) - 1; i >= 0; i-- {", "for i := len(steps) - 1; i > 0; i-- {"},
			},
		},
		{
			name:    "PendingRefundsNotCounted",
			catcher: "TestHTTPRefund/RefundInFlightCountsAgainstWhatRemains",
			fault:   "review: what remains refundable counts the refunds that succeeded, not those still in flight; two refunds under different keys together exceed the charge",
			edits: []mutationEdit{
				{"refund.go", "FROM refunds WHERE order_id = ? AND status IN ('pending', 'succeeded')`,\n\t\t\torderID).Scan(&committed)", "FROM refunds WHERE order_id = ? AND status = 'succeeded'`,\n\t\t\torderID).Scan(&committed)"},
			},
		},
		{
			name:    "RefundFirstPhaseUnfenced",
			catcher: "TestHTTPRefund/StalledBeforeFirstPhaseTakenOverWritesNothing",
			fault:   "review: a refund's first phase writes without checking that its request still holds the key; a request paused between its claim and that phase stores its answer over the one of the retry that took the key over",
			edits: []mutationEdit{
				{"refund.go", "\t\tfinished = nil // withTx may run this again\n\t\tif err := holdsLease(ctx, tx, req, lease); err != nil {\n\t\t\treturn err\n\t\t}\n\t\tnow := a.now()", "\t\tfinished = nil // withTx may run this again\n\t\tnow := a.now()"},
			},
		},
		{
			name:    "IdemReplaySkipsRequestCheck",
			catcher: "TestIdempotency/KeyReusedWithAnotherBodyIsRejected",
			fault:   "review: a settled key's replay no longer checks that the request is the one the key made; a key reused with another body gets the first answer instead of 422",
			edits: []mutationEdit{
				{"idem.go", "\t}\n\tif err := checkSameRequest(key, req); err != nil {\n\t\treturn apiResponse{}, err\n\t}\n\treturn key.response(), nil", "\t}\n\treturn key.response(), nil"},
			},
		},
		{
			name:    "ReconcilerCopyUnderNewID",
			catcher: "TestDelivery/MessageTheBrokerLostIsRepublishedAndAppliedOnce",
			fault:   "review: the reconciler's copy of a lost message carries a new message id, so no inbox recognises it: applied twice, never counted delivered",
			edits: []mutationEdit{
				{"deliver.go", "\t\t// claim's own (see message.PublishID).\n\t\tmsgs[i] = message{ID: event.EventID, Subject: event.EventType, Payload: event.Payload, Trace: event.Trace,\n\t\t\tPublishID: fmt.Sprintf(\"%s/republish-%d\", event.EventID, event.LeaseToken)}", "\t\t// claim's own (see message.PublishID).\n\t\tmsgs[i] = message{ID: fmt.Sprintf(\"%s/republish-%d\", event.EventID, event.LeaseToken), Subject: event.EventType, Payload: event.Payload, Trace: event.Trace,\n\t\t\tPublishID: fmt.Sprintf(\"%s/republish-%d\", event.EventID, event.LeaseToken)}"},
			},
		},
		{
			name:    "InboxUpsertAppliesRedelivery",
			catcher: "TestInbox/RedeliveryIsSkipped",
			fault:   "review: the inbox row's insert updates the row on conflict instead of doing nothing, so every redelivery counts as new and is applied again",
			edits: []mutationEdit{
				{"inbox.go", "\t\tVALUES (?, ?, 'done', ?, ?)\n\t\tON CONFLICT (consumer, message_id) DO NOTHING`,\n\t\tconsumerName, messageID, deliveryCount, formatTime(now))", "\t\tVALUES (?, ?, 'done', ?, ?)\n\t\tON CONFLICT (consumer, message_id) DO UPDATE SET delivery_count = excluded.delivery_count`,\n\t\tconsumerName, messageID, deliveryCount, formatTime(now))"},
			},
		},
		{
			name:    "ForwardSagaParkedAfterRetries",
			catcher: "TestSagaDecisions/RetryAfter",
			fault:   "review: a saga going forward is parked as compensation_failed after the compensation's retry limit, not only a compensating one: an order stuck after a few transient failures",
			edits: []mutationEdit{
				{"saga.go", "\tattempts := saga.Attempts + 1\n\tif saga.Status == sagaCompensating && attempts >= maxCompensationAttempts {\n\t\treturn sagaCompensationFailed, attempts", "\tattempts := saga.Attempts + 1\n\tif attempts >= maxCompensationAttempts {\n\t\treturn sagaCompensationFailed, attempts"},
			},
		},
		{
			name:            "StepCompensatedTwice",
			catcher:         "TestReserveStockUndoneTwicePutsBackOnce",
			fault:           "review: markStepCompensated loses its status = 'done' condition, so an undo of a step already compensated counts again: a hold released twice",
			simulatorMisses: "a second undo of a compensated step needs its worker to read the step as done after the first undo committed, under the lease it still holds: the engine reads the steps afresh or knows what it wrote, and a worker that lost the lease is stopped by advanceSaga's token",
			edits: []mutationEdit{
				{"saga.go", "WHERE saga_id = ? AND step_index = ? AND status = ?`,\n\t\tstepCompensated,", "WHERE saga_id = ? AND step_index = ? AND ? <> ''`,\n\t\tstepCompensated,"},
			},
		},
		{
			name:            "StockConservedOneWay",
			catcher:         "TestCheck/ReportsStockReleasedTwice",
			fault:           "review: check's \"stock is conserved\" reports stock that went missing but not stock that grew: a hold released twice puts more on the shelf than was stocked, unreported",
			simulatorMisses: "a correct run never puts more on the shelf than was stocked, and the simulator judges the runs, not the checker: only a tampering with the stock shows the checker blind",
			edits: []mutationEdit{
				{"check.go", "HAVING s.available + COALESCE(SUM(r.qty), 0) <> s.stocked`", "HAVING s.available + COALESCE(SUM(r.qty), 0) < s.stocked`"},
			},
		},
		{
			name:            "HoldsCheckedOnlyWhileReserved",
			catcher:         "TestCheck/ReportsUnreadableItemsOfAReleasedHold",
			fault:           "review: check names an order whose items cannot be read only while its hold is reserved, not once released",
			simulatorMisses: "the simulator never writes items that cannot be read: only a tampering makes them",
			edits: []mutationEdit{
				{"check.go", "WHERE st.step_name = 'reserve_stock' AND st.status IN ('done', 'compensated')\n\t\t\t  AND NOT EXISTS", "WHERE st.step_name = 'reserve_stock' AND st.status = 'done'\n\t\t\t  AND NOT EXISTS"},
			},
		},
		{
			name:            "RefundWithoutTheLease",
			catcher:         "TestStaleWorkerAsksForNoRefund",
			fault:           "review: a compensation asks the processor for its refund without renewing the lease first, so a worker that lost the saga still calls another system",
			simulatorMisses: "the refund's key comes from the saga, so a stale worker's call refunds nothing twice and changes no outcome: it is one call more, which the simulator does not judge",
			edits: []mutationEdit{
				{"saga.go", "\t\tif err := a.inSagaTx(ctx, run, func(tx *sql.Tx, now time.Time) error {\n\t\t\treturn a.renewSagaLease(ctx, tx, run.lease, sagaCompensating, now)\n\t\t}); err != nil {\n\t\t\treturn err\n\t\t}\n", ""},
			},
		},
		{
			name:            "StepDoneOverwritten",
			catcher:         "TestReserveStockDoneTwiceTakesOnce",
			fault:           "review: markStepDone overwrites a step already recorded done instead of refusing it, so a step run twice under a lease that holds takes its effect twice",
			simulatorMisses: "a second run of a done step needs the worker that holds the saga to run it again, and the engine reads the steps afresh; a stale worker's overwrite rolls back with advanceSaga",
			edits: []mutationEdit{
				{"saga.go", "VALUES (?, ?, ?, ?, 1, ?, ?)\n\t\tON CONFLICT (saga_id, step_index) DO NOTHING`", "VALUES (?, ?, ?, ?, 1, ?, ?)\n\t\tON CONFLICT (saga_id, step_index) DO UPDATE SET status = excluded.status, result = excluded.result, done_at = excluded.done_at`"},
			},
		},
		{
			name:            "SetAsideUnfenced",
			catcher:         "TestStaleWorkerCannotSetASagaAside",
			fault:           "review: setSagaAside loses its lease token, so a stale worker's unexpected failure sets aside a saga another worker holds",
			simulatorMisses: "a stale worker must fail unexpectedly while another holds the saga; the live worker's step then rolls back and runs again a minute later: a delay, no outcome the simulator judges",
			edits: []mutationEdit{
				{"infra_saga.go", "\t\tWHERE saga_id = ? AND lease_token = ?`,\n\t\tcause.Error(), formatTime(now.Add(time.Minute))", "\t\tWHERE saga_id = ? AND ? >= 0`,\n\t\tcause.Error(), formatTime(now.Add(time.Minute))"},
			},
		},
		{
			name:    "ReleaseTakesStockAgain",
			catcher: "TestSaga/DeclinedCardCompensatesOnlyStepsThatRan",
			fault:   "review: releaseStock takes the items off the shelf again instead of putting them back: no hold is ever released",
			edits: []mutationEdit{
				{"stock.go", "`UPDATE stock_items SET available = available + ? WHERE sku = ?`", "`UPDATE stock_items SET available = available - ? WHERE sku = ?`"},
			},
		},
		{
			name:    "RefundAsksForWholeCharge",
			catcher: "TestCrashAtEveryFaultPoint/idem.after_key_claim",
			fault:   "review: the processor is asked to refund the order's whole amount, not the refund's: a partial refund moves the whole charge back",
			edits: []mutationEdit{
				{"refund.go", "\n\tprocessorRefundID, err := a.processor.refund(ctx, \"refund:\"+refundID, order.ChargeID.String, amount)\n\tswitch {", "\n\tprocessorRefundID, err := a.processor.refund(ctx, \"refund:\"+refundID, order.ChargeID.String, order.AmountCents)\n\tswitch {"},
			},
		},
		{
			name:    "PendingRefundFoundByKeyOnly",
			catcher: "TestHTTPRefundKeyExpiry/ExpiredKeyReusedIsRefusedNot500",
			fault:   "review: the pending refund is looked up by its key alone, not its order: the same key string on another order settles the wrong refund",
			edits: []mutationEdit{
				{"refund.go", "\terr := a.db.QueryRowContext(ctx, `\n\t\tSELECT refund_id, amount_cents FROM refunds WHERE order_id = ? AND idempotency_key = ?`,\n\t\torderID, req.IdempotencyKey).Scan(&refundID, &amount)\n\tif err != nil {", "\terr := a.db.QueryRowContext(ctx, `\n\t\tSELECT refund_id, amount_cents FROM refunds WHERE idempotency_key = ?`,\n\t\treq.IdempotencyKey).Scan(&refundID, &amount)\n\tif err != nil {"},
			},
		},
		{
			name:    "WebhookRefundUnderChargeID",
			catcher: "TestCrashAtEveryFaultPoint/idem.after_key_claim",
			fault:   "review: a processor-announced refund is recorded under the charge id, not its refund id: announced again, it is counted twice",
			edits: []mutationEdit{
				{"webhook.go", "\t\tVALUES (?, ?, ?, 'succeeded', ?, 'webhook', ?, ?)`,\n\t\ta.newID(\"rf\"), order.OrderID, amount, data.RefundID, formatTime(now), formatTime(now))\n\tif err != nil {", "\t\tVALUES (?, ?, ?, 'succeeded', ?, 'webhook', ?, ?)`,\n\t\ta.newID(\"rf\"), order.OrderID, amount, data.ChargeID, formatTime(now), formatTime(now))\n\tif err != nil {"},
			},
		},
		{
			name:            "CleanupIgnoresPendingDelivery",
			catcher:         "TestCleanupKeepsTheInboxRowOfAPendingDelivery",
			fault:           "review: cleanup deletes a week-old inbox row while the broker still holds an unacked delivery of it: the redelivery is applied again",
			simulatorMisses: "the redelivery that comes after the row is gone is absorbed by the effect's own guard (a saga's started_by, a payment result the order already shows): the shipped consumers apply nothing twice, which is all the simulator judges; the row is the first line of defence, and its test says it is kept",
			edits: []mutationEdit{
				{"cleanup.go", "\t\t\t  -- the redelivery a duplicate.\n\t\t\t  AND NOT EXISTS (\n\t\t\t    SELECT 1 FROM broker_messages m JOIN broker_deliveries d ON d.message_seq = m.seq\n\t\t\t    WHERE m.message_id = i.message_id AND d.subscriber = i.consumer AND d.status = 'pending')\n\t\t\t  -- Nor while the reconciler's cursor has not passed its event:", "\t\t\t  -- the redelivery a duplicate.\n\t\t\t  -- Nor while the reconciler's cursor has not passed its event:"},
			},
		},
		{
			name:    "RefundSettleUnfenced",
			catcher: "TestPauseAtEveryFaultPoint/refund.after_started/TakenOver/pass1",
			fault:   "review: a refund's processor success is recorded without checking the request still holds the key: a request paused past its lease settles over the one that took it over",
			edits: []mutationEdit{
				{"refund.go", "\terr = withTx(ctx, a.db, func(tx *sql.Tx) error {\n\t\tif err := holdsLease(ctx, tx, req, lease); err != nil {\n\t\t\treturn err\n\t\t}\n\t\tnow := a.now()", "\terr = withTx(ctx, a.db, func(tx *sql.Tx) error {\n\t\tnow := a.now()"},
			},
		},
		{
			name:    "StockExactRefused",
			catcher: "TestHotSKUUnderConcurrentSagas",
			fault:   "review: stock is reserved only while more is available than the order asks for, so an order for exactly what remains is refused and cancelled",
			edits: []mutationEdit{
				{"stock.go", "WHERE sku = ? AND available >= ?`,\n\t\t\titem.Qty, item.SKU, item.Qty)", "WHERE sku = ? AND available > ?`,\n\t\t\titem.Qty, item.SKU, item.Qty)"},
			},
		},
		{
			name:    "CompleterSkipsReleasedKeys",
			catcher: "TestHTTPRefundKeyExpiry/CompleterGoesOnPastABadKey",
			fault:   "review: the refund completer takes only keys whose lease passed, not keys a request released after a processor timeout, so a refund its client gave up on waits for an operator",
			edits: []mutationEdit{
				{"refund.go", "WHERE recovery_point <> 'finished' AND (locked_at IS NULL OR locked_at <= ?)", "WHERE recovery_point <> 'finished' AND locked_at <= ?"},
			},
		},
		{
			name:    "WebhookAmountNotConfirmed",
			catcher: "TestHTTPWebhookHostile/OnlyRefundsTheProcessorConfirmsAreCounted",
			fault:   "review: a signed charge.refunded is checked against the processor's refund by its charge only, not its amount, so an event naming a real refund with another amount is counted",
			edits: []mutationEdit{
				{"webhook.go", "case chargeID != data.ChargeID || amount != *data.AmountCents:", "case chargeID != data.ChargeID:"},
			},
		},
		{
			name:    "ReadPathReplaysAtExpiry",
			catcher: "TestReplayFromReadConnection/ExpiredOrUnfinishedKeyIsNotServed",
			fault:   "review: the read path replays a key at the very instant it expires (expires_at < now, not <=), while the write path would run the request as new",
			edits: []mutationEdit{
				{"idem.go", "key.Status != keyCompleted || key.RecoveryPoint != recoveryFinished || key.ExpiresAt <= formatTime(now)", "key.Status != keyCompleted || key.RecoveryPoint != recoveryFinished || key.ExpiresAt < formatTime(now)"},
			},
		},
		{
			name:    "CreateKeyExpiresFromClaim",
			catcher: "TestIdempotencyKeyExpiry/ClockJumpsPastExpiryMidCreate",
			fault:   "review: a create's key expires a day after its claim, not its answer: a create whose transaction spanned a clock move runs again as new when its retry comes within a day of the answer",
			edits: []mutationEdit{
				{"idem.go", "return insertCompletedKey(ctx, tx, req, response, a.now())", "return insertCompletedKey(ctx, tx, req, response, now)"},
			},
		},
		{
			name:    "PoisonNotDelivered",
			catcher: "TestDelivery/ReplayTheBrokerLostIsRepublished",
			fault:   "review: only an applied message counts as received, not one its consumer recorded poison: the reconciler publishes poison messages again and never marks their events delivered",
			edits: []mutationEdit{
				{"deliver.go", "AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.consumer = s.consumer AND i.message_id = e.event_id))`", "AND NOT EXISTS (SELECT 1 FROM inbox_messages i WHERE i.consumer = s.consumer AND i.message_id = e.event_id AND i.status = 'done'))`"},
			},
		},
		{
			name:    "WebhookFutureTimestampAccepted",
			catcher: "TestVerifyWebhookTolerance",
			fault:   "review: a webhook signature's age is checked on the past side only, so one signed with a timestamp far in the future is accepted",
			edits: []mutationEdit{
				{"webhook.go", "if age > webhookTolerance || age < -webhookTolerance {", "if age > webhookTolerance {"},
			},
		},
		{
			name:    "PoisonAfterOneMoreFailure",
			catcher: "TestInbox/TransientFailuresOfOurCodeBecomePoisonAfterMaxDeliveries",
			fault:   "review: a message becomes poison after maxDeliveries+1 failures of its consumer's own code, not maxDeliveries",
			edits: []mutationEdit{
				{"inbox.go", "if maxFailures != noFailureLimit && failures >= maxFailures {", "if maxFailures != noFailureLimit && failures > maxFailures {"},
			},
		},
		{
			name:    "RefundRetryTakesALiveLease",
			catcher: "TestHTTPRefund/CrashAt_",
			fault:   "review: a refund's retry takes the key's lease over while the first send still holds it",
			edits: []mutationEdit{
				{"refund.go", "if key.LockedBy.Valid && key.LockedAt.Valid && key.LockedAt.String > formatTime(now.Add(-a.leases.refundLock)) {", "if false {"},
			},
		},
		{
			name:    "FailedStepUndone",
			catcher: "TestSagaDecisions/StepsToUndo",
			fault:   "review: compensation undoes the step that failed as well as the done ones; its record never turns compensated, so the saga's pass runs it again for ever",
			edits: []mutationEdit{
				{"saga.go", "\t\tif steps[i].Status == stepDone {\n", "\t\tif steps[i].Status != stepPending {\n"},
			},
		},
		{
			name:    "CompensationTimeoutCountsAsRefunded",
			catcher: "TestSaga/CompensationThatKeepsFailingIsSurfaced",
			fault:   "review: the compensating refund's timeout is taken for a refund made, and the charge is recorded undone though the processor never saw the request",
			edits: []mutationEdit{
				{"saga.go", "\t\tif err != nil {\n\t\t\treturn err\n\t\t}\n\t\tif err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {", "\t\tif err != nil && !errors.Is(err, errProcessorTimeout) {\n\t\t\treturn err\n\t\t}\n\t\tif err := a.fault.at(ctx, faultAfterProcessorCall); err != nil {"},
			},
		},
	}
}

// simulateFailure matches the error simulate prints when a seed fails.
var simulateFailure = regexp.MustCompile(`seed (\d+) failed at step (\d+): (.*)`)

// namesOneMutant reports whether go test's -run names a subtest of
// TestMutations: someone breaking one guarantee on purpose, as
// docs/break-it.md suggests.
func namesOneMutant() bool {
	run := flag.Lookup("test.run")
	return run != nil && strings.Contains(run.Value.String(), "TestMutations/")
}

// Ensure the simulator finds each fault when it is put back: a simulator
// that passes with a known fault in place would pass with an unknown one
// too. Each mutant is a copy of the source with the mutation's edits,
// whose tests are built once; its TestSimulation runs up to N seeds (as
// `simulate --seeds N` would, stopping at the first that fails) and must
// fail, and the test logs the seed and step that found it. The mutation's catcher, the test that
// docs/break-it.md says catches it, must fail on the mutant too.
//
// It runs with RETRYSAFE_MUTATIONS=<seeds> (CI), or for one mutant named
// on the command line: go test -run 'TestMutations/ExpiresAtNotRead' .
func TestMutations(t *testing.T) {
	setting := os.Getenv(mutationsEnv)
	if setting == "" && namesOneMutant() {
		setting = strconv.Itoa(exerciseSeeds)
	}
	if setting == "" {
		t.Skipf("set %s=<seeds> to build each mutant and run the simulator on it (minutes), or name one: go test -run 'TestMutations/NAME' .", mutationsEnv)
	}
	seeds, err := strconv.Atoi(setting)
	if err != nil || seeds < 1 {
		t.Fatalf("%s=%q: want a number of seeds", mutationsEnv, setting)
	}
	sources, err := filepath.Glob("*")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mutations() {
		t.Run(m.name, func(t *testing.T) {
			// Each mutant is its own build and simulator process, most of
			// it on one core: run as many at once as go test's -parallel.
			t.Parallel()
			dir := t.TempDir()
			for _, name := range sources {
				// The program's sources, what it embeds (the schemas, the
				// console's template) and the tests, for the catcher.
				if !(strings.HasSuffix(name, ".go") || strings.HasSuffix(name, ".sql") || strings.HasSuffix(name, ".html") || name == "go.mod" || name == "go.sum") {
					continue
				}
				data, err := os.ReadFile(name)
				if err != nil {
					t.Fatal(err)
				}
				for _, edit := range m.edits {
					if edit.file != name {
						continue
					}
					if n := strings.Count(string(data), edit.old); n != 1 {
						t.Fatalf("%s: the code to put back occurs %d times in %s, want once: %q", m.name, n, name, edit.old)
					}
					data = []byte(strings.Replace(string(data), edit.old, edit.new, 1))
				}
				if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			// One build per mutant, of its tests: the package compiled
			// with its tests takes about twice as long as without, so
			// the simulator runs as TestSimulation in the same binary as
			// the catcher, not in a second build of the command.
			// Without DWARF (-ldflags=-w): nobody debugs a mutant, and the
			// link is about a sixth of the build (10.9 s against 8.7 s alone).
			binary := filepath.Join(dir, "retrysafe.test")
			build := exec.Command("go", "test", "-c", "-ldflags=-w", "-o", binary, ".")
			build.Dir = dir
			if out, err := build.CombinedOutput(); err != nil {
				t.Fatalf("build the mutant: %v\n%s", err, out)
			}
			// On SQLite, whatever database the catcher runs on. A known
			// gap of the simulator gets a tenth of the seeds, at most
			// 100: enough to notice the day it is found, without the
			// minutes of a whole run that finds nothing.
			mutantSeeds := seeds
			if m.simulatorMisses != "" {
				mutantSeeds = max(1, min(seeds/10, 100))
			}
			simulate := exec.Command(binary, "-test.run", "^TestSimulation$")
			simulate.Dir = dir
			simulate.Env = append(os.Environ(), simulationSeedsEnv+"="+strconv.Itoa(mutantSeeds), testPostgresEnv+"=")
			out, err := simulate.CombinedOutput()
			switch found := simulateFailure.FindStringSubmatch(string(out)); {
			case err == nil && m.simulatorMisses != "":
				t.Logf("%s: the simulator found nothing in %d seeds, a known gap: %s", m.fault, mutantSeeds, m.simulatorMisses)
			case err == nil:
				t.Fatalf("%s: the simulator found nothing in %d seeds", m.fault, seeds)
			case found == nil:
				t.Fatalf("the mutant failed without a simulator failure: %v\n%s", err, out)
			default:
				t.Logf("%s: found at seed %s, step %s: %s", m.fault, found[1], found[2], shorten(found[3], 160))
			}

			if m.catcher == "" {
				t.Logf("%s: only the simulator catches it", m.name)
				return
			}
			caught := exec.Command(binary, "-test.run", anchoredRun(m.catcher))
			caught.Dir = dir
			out, err = caught.CombinedOutput()
			failed := regexp.MustCompile(`(?m)^\s*--- FAIL: (`+regexp.QuoteMeta(m.catcher)+`\S*)`).FindAllStringSubmatch(string(out), -1)
			if err == nil || len(failed) == 0 {
				t.Fatalf("%s: %s does not fail on the mutant (%v)\n%s", m.name, m.catcher, err, shorten(string(out), 4000))
			}
			for _, f := range failed {
				t.Logf("caught by %s", f[1])
			}
		})
	}
}

// anchoredRun turns "TestSaga/TimeoutChargesOnce" into the -run pattern
// that selects that test and its subtests only: "^TestSaga$/^TimeoutChargesOnce".
// The last part stays open at its end, so "CrashAt_" selects every crash
// point.
func anchoredRun(test string) string {
	parts := strings.Split(test, "/")
	for i, part := range parts {
		parts[i] = "^" + part
		if i < len(parts)-1 {
			parts[i] += "$"
		}
	}
	return strings.Join(parts, "/")
}

// Ensure docs/break-it.md lists every mutant as an exercise: its name (the
// command that runs it), the file its edit is in, and the test that
// TestMutations checks fails on it.
func TestDocsBreakItListsEveryMutant(t *testing.T) {
	page, err := os.ReadFile("docs/break-it.md")
	if err != nil {
		t.Fatal(err)
	}
	_, mutants, found := strings.Cut(string(page), "\n## Put one fault back\n")
	if !found {
		t.Fatal("docs/break-it.md has no section \"Put one fault back\"")
	}
	rows := map[string]string{}
	for _, line := range strings.Split(mutants, "\n") {
		if name := regexp.MustCompile("^\\| `([A-Za-z0-9]+)` \\|").FindStringSubmatch(line); name != nil {
			rows[name[1]] = line
		}
	}
	for _, m := range mutations() {
		row, ok := rows[m.name]
		if !ok {
			t.Errorf("docs/break-it.md has no row for the mutant %s", m.name)
			continue
		}
		catcher := "`" + m.catcher + "`"
		if m.catcher == "" {
			catcher = "the simulator only"
		}
		if !strings.Contains(row, "`"+m.edits[0].file+"`") || !strings.Contains(row, catcher) {
			t.Errorf("docs/break-it.md's row for %s names another file or test than %s and %s:\n%s", m.name, m.edits[0].file, catcher, row)
		}
		delete(rows, m.name)
	}
	for name := range rows {
		t.Errorf("docs/break-it.md lists %s, which is no mutant", name)
	}
}
