//! Durable operations: operators' requests and cancellations (any replica, recorded
//! idempotently), the reads, and the coordinator's fenced writes of the table.

use sqlx::{Any, Transaction};

use super::columns::decoded;
use super::{CoordinatorTerm, Error, Operation, OperationKind, OperationPhase, Result, Store};

impl Store {
    pub async fn list_operations(&self) -> Result<Vec<Operation>> {
        sqlx::query_as(&format!(
            "SELECT {OPERATION_COLUMNS} FROM operations ORDER BY created_at_ms, id"
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(decoded("operations"))
    }

    /// One operation by id.
    pub async fn operation(&self, id: &str) -> Result<Option<Operation>> {
        sqlx::query_as(&format!("SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("operations"))
    }

    /// Record an operator's request (any replica; the coordinator admits it with a fenced
    /// write). An equivalent operation — an open one of the same kind and target, or a
    /// drain of the member that succeeded and was not cancelled — is returned instead:
    /// `(operation, created)`. The new operation is `Pending`; `op.deadline_at_ms` is taken
    /// as its time budget from now (database clock), which the store turns into the deadline.
    pub async fn request_operation(&self, op: &Operation) -> Result<(Operation, bool)> {
        let equivalent = || async {
            sqlx::query_as(&format!(
                "SELECT {OPERATION_COLUMNS} FROM operations WHERE kind = $1 AND target = $2 \
                   AND (phase IN ({open}) OR ({succeeded_drain} AND cancel_requested_at_ms IS NULL)) \
                 ORDER BY created_at_ms DESC LIMIT 1",
                open = phases(&OPEN),
                succeeded_drain = succeeded_drain(),
            ))
            .bind(op.kind)
            .bind(&op.target)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("operations"))
        };
        if let Some(existing) = equivalent().await? {
            return Ok((existing, false));
        }
        let inserted = sqlx::query(&format!(
            "INSERT INTO operations (id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
               requested_by, coordinator_term, created_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, 0, 0, ({clock}) + $6, $7, $8, 0, ({clock}), ({clock})) \
             ON CONFLICT DO NOTHING",
            clock = self.backend.clock_expr()
        ))
        .bind(&op.id)
        .bind(op.kind)
        .bind(&op.target)
        .bind(OperationPhase::Pending)
        .bind(&op.message)
        .bind(op.deadline_at_ms)
        .bind(op.max_parallel)
        .bind(&op.requested_by)
        .execute(&self.pool)
        .await?;
        if inserted.rows_affected() == 0 {
            // Another replica recorded an equivalent one first.
            let existing = equivalent().await?;
            return existing
                .map(|e| (e, false))
                .ok_or_else(|| Error::Invalid("an operation request conflicted with nothing".into()));
        }
        let created = self
            .operation(&op.id)
            .await?
            .ok_or_else(|| Error::Invalid("a recorded operation cannot be read back".into()))?;
        Ok((created, true))
    }

    /// Record an operator's cancellation of an open operation (or of a drain that
    /// succeeded: the member returns to service); the coordinator applies it. Returns the
    /// operation as stored, `None` for an unknown id.
    pub async fn request_cancel(&self, id: &str) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "UPDATE operations SET cancel_requested_at_ms = COALESCE(cancel_requested_at_ms, ({clock})) \
             WHERE id = $1 AND (phase IN ({open}) OR {succeeded_drain})",
            clock = self.backend.clock_expr(),
            open = phases(&OPEN),
            succeeded_drain = succeeded_drain(),
        ))
        .bind(id)
        .execute(&self.pool)
        .await?;
        self.operation(id).await
    }
}

const OPERATION_COLUMNS: &str = "id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
     requested_by, created_at_ms, updated_at_ms, \
     CASE WHEN cancel_requested_at_ms IS NULL THEN 0 ELSE 1 END AS cancel_requested";

/// The phases of an open operation, and of one that ended.
const OPEN: [OperationPhase; 2] = [OperationPhase::Pending, OperationPhase::Running];
const ENDED: [OperationPhase; 3] = [
    OperationPhase::Succeeded,
    OperationPhase::Failed,
    OperationPhase::Cancelled,
];

/// `phases` as an SQL list (`'pending', 'running'`): the enum's own text, never input.
fn phases(phases: &[OperationPhase]) -> String {
    let quoted: Vec<String> = phases.iter().map(|phase| format!("'{phase}'")).collect();
    quoted.join(", ")
}

/// SQL condition: a drain that succeeded (its member stays drained until it is cancelled).
fn succeeded_drain() -> String {
    format!(
        "(kind = '{}' AND phase = '{}')",
        OperationKind::Drain,
        OperationPhase::Succeeded
    )
}

/// Fenced: insert or replace an operation as the coordinator of `coordinator_term` sees it.
pub(super) async fn put_operation(
    tx: &mut Transaction<'static, Any>,
    op: &Operation,
    coordinator_term: CoordinatorTerm,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operations (id, kind, target, phase, message, attempts, moves, deadline_at_ms, max_parallel, \
           requested_by, coordinator_term, created_at_ms, updated_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12) \
         ON CONFLICT (id) DO UPDATE SET kind = excluded.kind, target = excluded.target, phase = excluded.phase, \
           message = excluded.message, attempts = excluded.attempts, moves = excluded.moves, \
           deadline_at_ms = excluded.deadline_at_ms, max_parallel = excluded.max_parallel, \
           requested_by = excluded.requested_by, coordinator_term = excluded.coordinator_term, \
           updated_at_ms = excluded.updated_at_ms",
    )
    .bind(&op.id)
    .bind(op.kind)
    .bind(&op.target)
    .bind(op.phase)
    .bind(&op.message)
    .bind(op.attempts)
    .bind(op.moves)
    .bind(op.deadline_at_ms)
    .bind(op.max_parallel)
    .bind(&op.requested_by)
    .bind(coordinator_term)
    .bind(now_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Fenced: forget an ended operation; an open one is never deleted.
pub(super) async fn delete_operation(tx: &mut Transaction<'static, Any>, id: &str) -> Result<()> {
    sqlx::query(&format!(
        "DELETE FROM operations WHERE id = $1 AND phase IN ({})",
        phases(&ENDED)
    ))
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
