//! The fenced writes: one transaction that locks the lease row, checks the caller's
//! lease against the database clock sampled after the lock, and applies a batch of
//! coordinator writes, all or nothing; and the assignments they keep (compare-and-set on
//! the route's term, which never repeats on a route).

use sqlx::{Any, Transaction};

use super::columns::decoded;
use super::dialect::LockMode;
use super::keys::{delete_signing_key, put_signing_key};
use super::operations::{delete_operation, put_operation};
use super::{Assignment, CoordinatorTerm, Error, FencedWrite, Lease, OwnershipTerm, Result, Store, decide};

impl Store {
    /// Apply `writes` in one transaction that first locks the lease row in a
    /// mode that conflicts with a takeover (PostgreSQL `FOR SHARE`; SQLite's
    /// write lock), then checks holder, term and expiry against the database
    /// clock sampled after the lock. All or nothing: a stale holder's batch,
    /// or a batch with one failed compare-and-set, changes nothing.
    pub async fn write_fenced(&self, lease: &Lease, writes: &[FencedWrite]) -> Result<()> {
        decide::validate(writes)?;
        let (lease, writes) = (lease.clone(), writes.to_vec());
        self.detached(move |store| async move { store.write_fenced_now(&lease, &writes).await })
            .await
    }

    async fn write_fenced_now(&self, lease: &Lease, writes: &[FencedWrite]) -> Result<()> {
        let (mut tx, row) = self.lock_lease(LockMode::Shared).await?;
        decide::fence(&row, lease)?;
        for write in writes {
            apply(&mut tx, write, lease.term, row.now_ms).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn list_assignments(&self) -> Result<Vec<Assignment>> {
        sqlx::query_as(
            "SELECT route, member, process_id, term, phase, generation, placed_term, coordinator_term, updated_at_ms \
             FROM assignments ORDER BY route",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(decoded("assignments"))
    }
}

/// Apply one fenced write inside the fenced transaction.
async fn apply(
    tx: &mut Transaction<'static, Any>,
    write: &FencedWrite,
    coordinator_term: CoordinatorTerm,
    now_ms: i64,
) -> Result<()> {
    match write {
        FencedWrite::Assign { expected_term, next } => {
            assign(tx, *expected_term, next, coordinator_term, now_ms).await?
        }
        FencedWrite::Unassign { route, expected_term } => {
            let done = sqlx::query("DELETE FROM assignments WHERE route = $1 AND term = $2")
                .bind(route)
                .bind(expected_term)
                .execute(&mut **tx)
                .await?;
            if done.rows_affected() == 0 {
                return Err(conflict(tx, route, Some(*expected_term)).await);
            }
        }
        FencedWrite::PutOperation(op) => put_operation(tx, op, coordinator_term, now_ms).await?,
        FencedWrite::DeleteOperation { id } => delete_operation(tx, id).await?,
        FencedWrite::PutSigningKey(key) => put_signing_key(tx, key, coordinator_term, now_ms).await?,
        FencedWrite::DeleteSigningKey { kid } => delete_signing_key(tx, kid).await?,
        FencedWrite::ForgetRetired { retention_ms } => {
            forget_retired(tx, now_ms.saturating_sub(*retention_ms)).await?;
            sqlx::query("DELETE FROM audit_records WHERE recorded_at_ms < $1")
                .bind(now_ms.saturating_sub(super::AUDIT_RETENTION_MS))
                .execute(&mut **tx)
                .await?;
        }
        FencedWrite::Displace { route, displaced } => {
            sqlx::query(
                "UPDATE instances SET displaced_member = $2, displaced_process_id = $3, displaced_term = $4, \
                 displaced_for = $5 WHERE route = $1",
            )
            .bind(route)
            .bind(displaced.as_ref().map(|d| d.member.as_str()))
            .bind(displaced.as_ref().map(|d| d.process_id.as_str()))
            .bind(displaced.as_ref().map(|d| d.term))
            .bind(displaced.as_ref().map(|d| d.for_term))
            .execute(&mut **tx)
            .await?;
        }
        FencedWrite::EndDisplacement { route, for_term } => {
            let done = sqlx::query(
                "UPDATE instances SET displaced_member = NULL, displaced_process_id = NULL, displaced_term = NULL, \
                 displaced_for = NULL WHERE route = $1 AND displaced_for = $2",
            )
            .bind(route)
            .bind(for_term)
            .execute(&mut **tx)
            .await?;
            if done.rows_affected() == 0 {
                return Err(Error::Conflict {
                    subject: format!("displacement of {route}"),
                    detail: format!("the reservation at term {for_term} displaces nobody any more (activated)"),
                });
            }
        }
        FencedWrite::StartTerm => {
            sqlx::query("UPDATE coordinator_terms SET started_at_ms = $2 WHERE term = $1 AND started_at_ms IS NULL")
                .bind(coordinator_term)
                .bind(now_ms)
                .execute(&mut **tx)
                .await?;
        }
    }
    Ok(())
}

/// Forget replaced workloads and withdrawn instances that retired before `before_ms` and
/// that no assignment or operation record names; then the grants and reports of routes that have no instance any more. The
/// instance goes first, so a registration that brings the route back meanwhile keeps it.
async fn forget_retired(tx: &mut Transaction<'static, Any>, before_ms: i64) -> Result<()> {
    sqlx::query("DELETE FROM replaced_instances WHERE replaced_at_ms < $1")
        .bind(before_ms)
        .execute(&mut **tx)
        .await?;
    let forgotten = sqlx::query(
        "DELETE FROM instances WHERE withdrawn AND withdrawn_at_ms < $1 \
         AND NOT EXISTS (SELECT 1 FROM assignments a WHERE a.route = instances.route) \
         AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.target = instances.route)",
    )
    .bind(before_ms)
    .execute(&mut **tx)
    .await?;
    // Builds of what is gone: sidecars of forgotten routes, members without a record, gateway
    // replicas silent for the retention.
    sqlx::query(
        "DELETE FROM builds WHERE (component = 'sidecar' AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.route = builds.name)) \
           OR (component = 'member' AND NOT EXISTS (SELECT 1 FROM members m WHERE m.member = builds.name)) \
           OR (component = 'gateway' AND seen_at_ms < $1)",
    )
    .bind(before_ms)
    .execute(&mut **tx)
    .await?;
    if forgotten.rows_affected() > 0 {
        for table in ["grants", "instance_reports"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE NOT EXISTS (SELECT 1 FROM instances i WHERE i.route = {table}.route)"
            ))
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}

/// Compare-and-set the assignment of `a.route` from `expected_term` to `a`.
async fn assign(
    tx: &mut Transaction<'static, Any>,
    expected_term: Option<OwnershipTerm>,
    a: &Assignment,
    coordinator_term: CoordinatorTerm,
    now_ms: i64,
) -> Result<()> {
    // Terms never repeat on a route, whatever became of its earlier assignments: a placement,
    // or a compare-and-set that moves the term, goes above the route's last term — which a
    // sidecar's registration may have raised since the coordinator read it.
    let last: Option<OwnershipTerm> = sqlx::query_scalar("SELECT last_term FROM instances WHERE route = $1")
        .bind(&a.route)
        .fetch_optional(&mut **tx)
        .await?;
    if let Some(last) = last.filter(|last| a.term <= *last) {
        return Err(Error::Conflict {
            subject: format!("assignment {}", a.route),
            detail: format!("term {} was already used on the route (last term {last})", a.term),
        });
    }
    let sql = match expected_term {
        None => {
            "INSERT INTO assignments (route, member, process_id, term, phase, coordinator_term, updated_at_ms, \
               generation, placed_term) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (route) DO NOTHING"
        }
        Some(_) => {
            "UPDATE assignments SET member = $2, process_id = $3, term = $4, phase = $5, coordinator_term = $6, \
             updated_at_ms = $7, generation = $8, placed_term = $9 WHERE route = $1 AND term = $10"
        }
    };
    let mut query = sqlx::query(sql)
        .bind(&a.route)
        .bind(&a.member)
        .bind(&a.process_id)
        .bind(a.term)
        .bind(a.phase)
        .bind(coordinator_term)
        .bind(now_ms)
        .bind(a.generation)
        .bind(a.placed_term);
    if let Some(expected) = expected_term {
        query = query.bind(expected);
    }
    let done = query.execute(&mut **tx).await?;
    if done.rows_affected() == 0 {
        return Err(conflict(tx, &a.route, expected_term).await);
    }
    let raised = sqlx::query("UPDATE instances SET last_term = $2 WHERE route = $1 AND last_term < $2")
        .bind(&a.route)
        .bind(a.term)
        .execute(&mut **tx)
        .await?;
    // The read above takes no lock (activation locks assignments, then instances: locking
    // instances first here would invert that order): a registration that raised the last term
    // to this one or above committed in between — on PostgreSQL the update then sees its row.
    if raised.rows_affected() == 0 && last.is_some() {
        return Err(Error::Conflict {
            subject: format!("assignment {}", a.route),
            detail: format!("term {} was used on the route meanwhile", a.term),
        });
    }
    Ok(())
}

/// Describe a failed compare-and-set on an assignment.
async fn conflict(tx: &mut Transaction<'static, Any>, route: &str, expected: Option<OwnershipTerm>) -> Error {
    let found: Result<Option<OwnershipTerm>, _> = sqlx::query_scalar("SELECT term FROM assignments WHERE route = $1")
        .bind(route)
        .fetch_optional(&mut **tx)
        .await;
    let show = |t: Option<OwnershipTerm>| t.map_or_else(|| "no assignment".to_owned(), |t| format!("term {t}"));
    // The conflict stands either way; a term that cannot be read is said so, not guessed.
    let found = found.map_or_else(|err| format!("an unreadable assignment ({err})"), show);
    Error::Conflict {
        subject: format!("assignment {route}"),
        detail: format!("expected {}, found {found}", show(expected)),
    }
}
