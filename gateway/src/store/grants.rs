//! Recovery grants and activation: the one grant of a reserved term (single use), and
//! the compare-and-set that activates the term when the sidecar's receipt is bound to
//! that grant and names the instance's workload.

use sqlx::{Any, Transaction};

use super::columns::decoded;
use super::{Activation, AssignmentPhase, Checkpoint, Error, GrantRecord, OwnershipTerm, Result, Store};

impl Store {
    /// Record the one grant of a reserved term: only for the route's current reserved term,
    /// only when the reservation is `grant.member`'s (`Error::Denied` otherwise) and its
    /// process is both `grant.process_id` and the live process the store records for the
    /// member, and only once per term (a second call fails even if the first caller lost the
    /// response). All checked in the transaction that records the grant.
    pub async fn issue_grant(&self, grant: &GrantRecord) -> Result<()> {
        let grant = grant.clone();
        self.detached(move |store| async move { store.issue_grant_now(&grant).await })
            .await
    }

    async fn issue_grant_now(&self, grant: &GrantRecord) -> Result<()> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let current = self.locked_assignment(&mut tx, &grant.route).await?;
        let subject = || format!("grant for {}", grant.route);
        let refuse = |detail: String| Error::Conflict {
            subject: subject(),
            detail,
        };
        let Some(LockedAssignment {
            term,
            member,
            process_id,
            phase,
            ..
        }) = current
        else {
            return Err(refuse("the route has no assignment".into()));
        };
        if term != grant.term || phase != AssignmentPhase::Reserved {
            return Err(refuse(format!(
                "term {} is not the reserved term (current: term {term}, {phase})",
                grant.term
            )));
        }
        if process_id != grant.process_id {
            return Err(refuse("the term is reserved for another process".into()));
        }
        // The process id is no secret (every route directory names it): the reservation must
        // be the caller's member's.
        if member != grant.member {
            return Err(Error::Denied {
                subject: subject(),
                detail: format!("the term is not reserved for member {}", grant.member),
            });
        }
        let live: Option<(String,)> = sqlx::query_as(&format!(
            "SELECT process_id FROM members WHERE member = $1 AND expires_at_ms > ({})",
            self.backend.clock_expr()
        ))
        .bind(&grant.member)
        .fetch_optional(&mut *tx)
        .await?;
        if live.is_none_or(|(live,)| live != process_id) {
            return Err(refuse(
                "the reserved process is not the member's live process (attach first)".into(),
            ));
        }
        let inserted = sqlx::query(&format!(
            "INSERT INTO grants (route, term, jti, member, process_id, digest, issued_at_ms, expires_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, ({}), $7) ON CONFLICT (route, term) DO NOTHING",
            self.backend.clock_expr()
        ))
        .bind(&grant.route)
        .bind(grant.term)
        .bind(&grant.jti)
        .bind(&grant.member)
        .bind(&grant.process_id)
        .bind(&grant.digest)
        .bind(grant.expires_at_ms)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            return Err(refuse(format!(
                "the grant of term {} was already issued (single use)",
                grant.term
            )));
        }
        tx.commit().await?;
        Ok(())
    }

    /// Activate a reserved ownership term by compare-and-set, when a receipt
    /// proves the sidecar fenced for it: the term must still be the route's
    /// reserved term for its process, reserved for the calling member, the receipt must be
    /// bound to the grant minted for it (`jti`, `digest`) and issued to that member and
    /// process (`Error::Denied` when the reservation or the grant is another member's), and
    /// the workload must equal the
    /// instance's checkpoint (adopted when none is recorded). Returns the
    /// database time of the activation.
    pub async fn activate(&self, activation: Activation) -> Result<i64> {
        self.detached(move |store| async move { store.activate_now(&activation).await })
            .await
    }

    async fn activate_now(&self, activation: &Activation) -> Result<i64> {
        let Activation {
            route,
            term,
            member,
            process_id,
            jti,
            digest,
            workload,
        } = activation;
        let (route, term) = (route.as_str(), *term);
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let refuse = |detail: &str| Error::Conflict {
            subject: format!("activation of {route} at term {term}"),
            detail: detail.to_owned(),
        };
        let assignment = self
            .locked_assignment(&mut tx, route)
            .await?
            .ok_or_else(|| refuse("term no longer current"))?;
        let denied = |detail: &str| Error::Denied {
            subject: format!("activation of {route} at term {term}"),
            detail: detail.to_owned(),
        };
        if assignment.term != term || assignment.process_id != *process_id {
            return Err(refuse("term no longer current"));
        }
        if assignment.member != *member {
            return Err(denied("the term is not reserved for the calling member"));
        }
        if assignment.phase == AssignmentPhase::Active {
            return Err(refuse("already activated"));
        }
        let grant: Option<MintedGrant> =
            sqlx::query_as("SELECT jti, digest, member, process_id FROM grants WHERE route = $1 AND term = $2")
                .bind(route)
                .bind(term)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(grant) = grant.filter(|g| g.jti == *jti && g.digest == *digest) else {
            return Err(refuse(
                "the receipt is not bound to the grant minted for this reservation",
            ));
        };
        if grant.member != *member || grant.process_id != assignment.process_id {
            return Err(denied("the grant was issued to another member or process"));
        }
        let instance: RecordedWorkload = sqlx::query_as(&format!(
            "SELECT generation, checkpoint_pid, checkpoint_start_ticks, checkpoint_exe_digest FROM instances \
             WHERE route = $1{}",
            self.backend.row_lock()
        ))
        .bind(route)
        .fetch_optional(&mut *tx)
        .await
        .map_err(decoded("instances"))?
        .ok_or_else(|| refuse("the instance is not registered"))?;
        if assignment.generation < instance.generation {
            // Reserved for a workload that another one (a new Pod UID) replaced since.
            return Err(refuse("the term was reserved for a workload the route no longer has"));
        }
        let recorded = instance.checkpoint();
        if !recorded.is_empty() && &recorded != workload {
            return Err(refuse("workload identity differs from checkpoint"));
        }
        let now_ms = self.clock(&mut *tx).await?;
        sqlx::query("UPDATE assignments SET phase = $3, updated_at_ms = $2 WHERE route = $1")
            .bind(route)
            .bind(now_ms)
            .bind(AssignmentPhase::Active)
            .execute(&mut *tx)
            .await?;
        // The sidecar took the term: whoever the reservation displaced no longer serves it.
        sqlx::query(
            "UPDATE instances SET displaced_member = NULL, displaced_process_id = NULL, displaced_term = NULL, \
             displaced_for = NULL WHERE route = $1 AND displaced_member IS NOT NULL",
        )
        .bind(route)
        .execute(&mut *tx)
        .await?;
        if recorded.is_empty() && !workload.is_empty() {
            sqlx::query(
                "UPDATE instances SET checkpoint_pid = $2, checkpoint_start_ticks = $3, checkpoint_exe_digest = $4 \
                 WHERE route = $1",
            )
            .bind(route)
            .bind(workload.pid)
            .bind(workload.start_ticks)
            .bind(&workload.exe_digest)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(now_ms)
    }

    /// The assignment of `route`, locked for the rest of `tx`.
    async fn locked_assignment(
        &self,
        tx: &mut Transaction<'static, Any>,
        route: &str,
    ) -> Result<Option<LockedAssignment>> {
        sqlx::query_as(&format!(
            "SELECT term, member, process_id, phase, generation FROM assignments WHERE route = $1{}",
            self.backend.row_lock()
        ))
        .bind(route)
        .fetch_optional(&mut **tx)
        .await
        .map_err(decoded("assignments"))
    }
}

/// What a grant and an activation check of a route's assignment.
#[derive(sqlx::FromRow)]
struct LockedAssignment {
    term: OwnershipTerm,
    member: String,
    process_id: String,
    phase: AssignmentPhase,
    generation: i64,
}

/// The grant row of a reserved term, as its activation checks it.
#[derive(sqlx::FromRow)]
struct MintedGrant {
    jti: String,
    digest: Vec<u8>,
    member: String,
    process_id: String,
}

/// The instance's generation and the workload its checkpoint names (none before the first
/// activation of a generation).
#[derive(sqlx::FromRow)]
struct RecordedWorkload {
    generation: i64,
    checkpoint_pid: Option<i64>,
    checkpoint_start_ticks: Option<i64>,
    checkpoint_exe_digest: Option<Vec<u8>>,
}

impl RecordedWorkload {
    fn checkpoint(self) -> Checkpoint {
        Checkpoint {
            pid: self.checkpoint_pid.unwrap_or(0),
            start_ticks: self.checkpoint_start_ticks.unwrap_or(0),
            exe_digest: self.checkpoint_exe_digest.unwrap_or_default(),
        }
    }
}
