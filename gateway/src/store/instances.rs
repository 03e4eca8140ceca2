//! Desired instances and their owners' reports (any replica): registration with its
//! generations and namespace quota, withdrawal (with the reason of a missed recovery
//! deadline), and the latest report per route, which never goes back in term.

use sqlx::any::AnyArguments;
use sqlx::query::Query;
use sqlx::{Any, Transaction};

use super::columns::{Flag, decoded};
use super::sealing;
use super::{
    Error, InstanceRecord, OwnershipTerm, Registered, Registration, Report, Result, Resume, SecretBytes, Store,
    WithdrawnKind,
};

impl Store {
    /// Register an instance and assign its generation: the same workload (uid) keeps its
    /// generation; another workload on the same route gets the next one and starts fresh —
    /// its own material (receipt key), no workload checkpoint — while the workload it
    /// replaced is remembered and can never register the route again. A withdrawn workload
    /// stays withdrawn.
    pub async fn register_instance(&self, r: &Registration) -> Result<Registered> {
        self.register_instance_within(r, None).await
    }

    /// [`Store::register_instance`], refused ([`Registered::OverQuota`], nothing stored) when
    /// a new workload would give its namespace more than `limit` registered instances. The
    /// same workload registering again is never refused.
    pub async fn register_instance_within(&self, r: &Registration, limit: Option<u32>) -> Result<Registered> {
        self.register_resuming(r, limit, &Resume::default()).await
    }

    /// [`Store::register_instance_within`] for a sidecar that says where its instance stands
    /// ([`Resume`]). A route the store does not know is recorded at the sidecar's generation
    /// with its workload as the checkpoint; known or not, no term at or below the sidecar's
    /// fence is reserved for the route again. So a store emptied or restored from an older
    /// backup places the instance above the term its sidecar activated, and the running
    /// workload is taken over, never stopped.
    pub async fn register_resuming(&self, r: &Registration, limit: Option<u32>, resume: &Resume) -> Result<Registered> {
        let (r, resume) = (r.clone(), resume.clone());
        self.detached(move |store| async move { store.register_instance_now(&r, limit, &resume).await })
            .await
    }

    async fn register_instance_now(&self, r: &Registration, limit: Option<u32>, resume: &Resume) -> Result<Registered> {
        // The material (its receipt key) is stored sealed; the rest of the row in clear.
        let sealed = Registration {
            material: SecretBytes(self.seal_material(&r.route, &r.uid, &r.material.0)?),
            ..r.clone()
        };
        let r = &sealed;
        /// Whether a newer workload already replaced this one under its route.
        async fn replaced(tx: &mut Transaction<'static, Any>, r: &Registration) -> Result<bool> {
            let count: i64 =
                sqlx::query_scalar("SELECT count(*) FROM replaced_instances WHERE route = $1 AND uid = $2")
                    .bind(&r.route)
                    .bind(&r.uid)
                    .fetch_one(&mut **tx)
                    .await?;
            Ok(count > 0)
        }
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        if replaced(&mut tx, r).await? {
            return Ok(Registered::Replaced);
        }
        if let Some(refused) = self.over_quota(&mut tx, r, limit).await? {
            return Ok(refused);
        }
        let clock = self.backend.clock_expr();
        let generation = resume.generation.max(1);
        let checkpoint = Some(&resume.workload).filter(|w| w.pid > 0);
        // Only with a fence: a holder of no term is none.
        let holder = resume.holder.as_ref().filter(|_| resume.fence > OwnershipTerm::ZERO);
        let inserted = bind_registration(
            &format!(
                "INSERT INTO instances (route, namespace, name, uid, generation, material, registered_at_ms, withdrawn, \
                   last_term, checkpoint_pid, checkpoint_start_ticks, checkpoint_exe_digest, \
                   fence_member, fence_process_id, fence_term, fence_generation) \
                 VALUES ($1, $2, $3, $4, $6, $5, ({clock}), FALSE, $7, $8, $9, $10, $11, $12, $13, $14) \
                 ON CONFLICT (route) DO NOTHING"
            ),
            r,
        )
        .bind(generation)
        .bind(resume.fence)
        .bind(checkpoint.map(|w| w.pid))
        .bind(checkpoint.map(|w| w.start_ticks))
        .bind(checkpoint.map(|w| w.exe_digest.clone()))
        .bind(holder.map(|h| &h.0))
        .bind(holder.map(|h| &h.1))
        .bind(holder.map(|_| resume.fence))
        .bind(holder.map(|_| generation))
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() > 0 {
            tx.commit().await?;
            if resume.fence > OwnershipTerm::ZERO {
                tracing::warn!(route = %r.route, generation, fence = %resume.fence,
                               "the store did not know this instance, whose sidecar activated a term before \
                                (the database was emptied or restored): recorded again, to be placed above that term");
            }
            return Ok(Registered::Desired { generation });
        }
        let (uid, generation, withdrawn): (String, i64, Flag) = sqlx::query_as(&format!(
            "SELECT uid, generation, CASE WHEN withdrawn THEN 1 ELSE 0 END AS withdrawn FROM instances \
             WHERE route = $1{}",
            self.backend.row_lock()
        ))
        .bind(&r.route)
        .fetch_one(&mut *tx)
        .await
        .map_err(decoded("instances"))?;
        if uid == r.uid {
            if bool::from(withdrawn) {
                return Ok(Registered::Withdrawn { generation });
            }
            // The same workload again (a sidecar restart, a token renewal): new material, same
            // generation; terms above the sidecar's fence (a store restored from an older
            // backup may have forgotten the latest), and the fence's holder when no later term
            // was used on the route (every SET reads the row as it was).
            bind_registration(
                &format!(
                    "UPDATE instances SET namespace = $2, name = $3, material = $5, registered_at_ms = ({clock}), \
                       last_term = CASE WHEN last_term < $6 THEN $6 ELSE last_term END, \
                       fence_member = CASE WHEN $6 >= last_term THEN $7 ELSE fence_member END, \
                       fence_process_id = CASE WHEN $6 >= last_term THEN $8 ELSE fence_process_id END, \
                       fence_term = CASE WHEN $6 >= last_term THEN $9 ELSE fence_term END, \
                       fence_generation = CASE WHEN $6 >= last_term THEN generation ELSE fence_generation END \
                     WHERE route = $1 AND uid = $4"
                ),
                r,
            )
            .bind(resume.fence)
            .bind(holder.map(|h| &h.0))
            .bind(holder.map(|h| &h.1))
            .bind(holder.map(|_| resume.fence))
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Registered::Desired { generation });
        }
        // Another workload under the route. Checked again under the row lock: a registration
        // that replaced this very workload may have committed while this one waited for the
        // lock (the check above ran before it), and a replaced workload never comes back.
        if replaced(&mut tx, r).await? {
            return Ok(Registered::Replaced);
        }
        // The next generation, from scratch.
        sqlx::query(&format!(
            "INSERT INTO replaced_instances (route, uid, replaced_at_ms) VALUES ($1, $2, ({clock})) \
             ON CONFLICT DO NOTHING"
        ))
        .bind(&r.route)
        .bind(&uid)
        .execute(&mut *tx)
        .await?;
        bind_registration(
            &format!(
                "UPDATE instances SET namespace = $2, name = $3, uid = $4, generation = generation + 1, material = $5, \
                   registered_at_ms = ({clock}), withdrawn = FALSE, withdrawn_at_ms = NULL, withdrawn_reason = NULL, withdrawn_owner = NULL, \
                   withdrawn_term = NULL, checkpoint_pid = NULL, checkpoint_start_ticks = NULL, \
                   checkpoint_exe_digest = NULL, fence_member = NULL, fence_process_id = NULL, fence_term = NULL, \
                   fence_generation = NULL \
                 WHERE route = $1"
            ),
            r,
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Registered::Desired {
            generation: generation + 1,
        })
    }

    /// The same workload (Pod UID) asking for the generation after `withdrawn_generation`
    /// (its container restarted after the sidecar stopped it, or after the process exited;
    /// the row is withdrawn, or still desired when the deregistration was lost): desired at
    /// that next generation, from scratch — its new material, no workload checkpoint, no
    /// withdrawal. Only if the row is still that generation of that workload (else
    /// [`Store::register_instance`] decides), and within the namespace's quota like any new
    /// workload.
    pub async fn revive_instance_within(
        &self,
        r: &Registration,
        withdrawn_generation: i64,
        limit: Option<u32>,
    ) -> Result<Registered> {
        let r = r.clone();
        self.detached(move |store| async move {
            let sealed = Registration {
                material: SecretBytes(store.seal_material(&r.route, &r.uid, &r.material.0)?),
                ..r.clone()
            };
            let mut tx = store.pool.begin_with(store.backend.begin_sql()).await?;
            if let Some(refused) = store.over_quota(&mut tx, &sealed, limit).await? {
                return Ok(refused);
            }
            let revived = bind_registration(
                &format!(
                    "UPDATE instances SET namespace = $2, name = $3, generation = generation + 1, material = $5, \
                       registered_at_ms = ({clock}), withdrawn = FALSE, withdrawn_at_ms = NULL, withdrawn_reason = NULL, \
                       withdrawn_owner = NULL, withdrawn_term = NULL, checkpoint_pid = NULL, checkpoint_start_ticks = NULL, \
                       checkpoint_exe_digest = NULL, fence_member = NULL, fence_process_id = NULL, fence_term = NULL, \
                       fence_generation = NULL \
                     WHERE route = $1 AND uid = $4 AND generation = $6",
                    clock = store.backend.clock_expr()
                ),
                &sealed,
            )
            .bind(withdrawn_generation)
            .execute(&mut *tx)
            .await?;
            if revived.rows_affected() == 0 {
                drop(tx);
                return store.register_instance_now(&r, limit, &Resume::default()).await;
            }
            tx.commit().await?;
            Ok(Registered::Desired {
                generation: withdrawn_generation + 1,
            })
        })
        .await
    }

    /// [`Registered::OverQuota`] when `r` is a new workload of its namespace and the
    /// namespace already has `limit` registered instances. Counted under a lock on the
    /// namespace's registrations (SQLite: the write lock), so concurrent ones count right.
    async fn over_quota(
        &self,
        tx: &mut Transaction<'static, Any>,
        r: &Registration,
        limit: Option<u32>,
    ) -> Result<Option<Registered>> {
        let Some(limit) = limit.map(i64::from) else {
            return Ok(None);
        };
        if let Some(lock) = self.backend.namespace_lock_sql() {
            sqlx::query(lock).bind(&r.namespace).execute(&mut **tx).await?;
        }
        let same: i64 =
            sqlx::query_scalar("SELECT count(*) FROM instances WHERE route = $1 AND uid = $2 AND NOT withdrawn")
                .bind(&r.route)
                .bind(&r.uid)
                .fetch_one(&mut **tx)
                .await?;
        if same > 0 {
            return Ok(None);
        }
        let registered: i64 =
            sqlx::query_scalar("SELECT count(*) FROM instances WHERE namespace = $1 AND NOT withdrawn AND route <> $2")
                .bind(&r.namespace)
                .bind(&r.route)
                .fetch_one(&mut **tx)
                .await?;
        Ok((registered >= limit).then_some(Registered::OverQuota { registered, limit }))
    }

    /// Withdraw the instance of `route` if it is still the workload `uid` (and, when given,
    /// still its `generation`: a late deregistration of an earlier generation of the same Pod
    /// leaves the next one alone). Returns whether a desired instance was withdrawn.
    pub async fn withdraw_instance(&self, route: &str, uid: &str, generation: Option<i64>) -> Result<bool> {
        let sql = format!(
            "UPDATE instances SET withdrawn = TRUE, withdrawn_at_ms = ({}) WHERE route = $1 AND uid = $2 AND NOT withdrawn{}",
            self.backend.clock_expr(),
            of_generation(generation, 3)
        );
        let mut query = sqlx::query(&sql).bind(route).bind(uid);
        if let Some(generation) = generation {
            query = query.bind(generation);
        }
        Ok(query.execute(&self.pool).await?.rows_affected() > 0)
    }

    /// The sidecar of the workload `uid` stopped it at the recovery deadline: withdraw the
    /// instance of `route` (if it is still that workload, still `generation` when given, and
    /// still desired) and record why, with the assignment it last had — its owner and term —
    /// or, without one, `fence_term` (the last term the sidecar activated, when it reports
    /// one). Returns whether a desired instance was withdrawn: a repeated report changes
    /// nothing.
    pub async fn report_recovery_failed(
        &self,
        route: &str,
        uid: &str,
        generation: Option<i64>,
        fence_term: Option<OwnershipTerm>,
    ) -> Result<bool> {
        let current = "FROM assignments a WHERE a.route = instances.route AND a.generation >= instances.generation";
        let sql = format!(
            "UPDATE instances SET withdrawn = TRUE, withdrawn_at_ms = ({clock}), withdrawn_reason = $3, \
               withdrawn_owner = (SELECT a.member {current}), \
               withdrawn_term = COALESCE((SELECT a.term {current}), $4) \
             WHERE route = $1 AND uid = $2 AND NOT withdrawn{generation}",
            clock = self.backend.clock_expr(),
            generation = of_generation(generation, 5)
        );
        let mut query = sqlx::query(&sql)
            .bind(route)
            .bind(uid)
            .bind(WithdrawnKind::RecoveryFailed)
            .bind(fence_term);
        if let Some(generation) = generation {
            query = query.bind(generation);
        }
        Ok(query.execute(&self.pool).await?.rows_affected() > 0)
    }

    /// Record an owner's report (see [`Store::record_reports`]).
    pub async fn record_report(&self, r: &Report) -> Result<()> {
        self.record_reports(std::slice::from_ref(r)).await
    }

    /// Record owners' reports in one transaction, each unless a report of a higher term of its
    /// route is already there — except the report of the route's current owner at its
    /// assigned term, which always counts: after the store rolled back, a report of a term it
    /// forgot (a reservation elsewhere that failed) must not hide that the owner it points at
    /// gave the term up. A report without progress (its owner accepted none yet: a move's new
    /// owner) keeps the progress shown, unless its workload stopped or another PID runs now.
    pub async fn record_reports(&self, reports: &[Report]) -> Result<()> {
        let reports: Vec<(Report, Option<i64>)> = reports.iter().map(|r| (r.clone(), None)).collect();
        self.record_stream_reports(reports).await.map(drop)
    }

    /// As [`Store::record_reports`], each report from its member's stream of the connection
    /// epoch given: written only while that stream is the member's current one. A batch of an
    /// ended stream that lands late (a replica that lost the store and wrote once it was back)
    /// never overwrites what the member's newer stream reported. Returns how many reports were
    /// not written (their stream ended, or a higher term's report stands).
    pub async fn record_stream_reports(&self, reports: Vec<(Report, Option<i64>)>) -> Result<u64> {
        if reports.is_empty() {
            return Ok(0);
        }
        self.detached(move |store| async move { store.record_reports_now(&reports).await })
            .await
    }

    async fn record_reports_now(&self, reports: &[(Report, Option<i64>)]) -> Result<u64> {
        let sql = format!(
            "INSERT INTO instance_reports (route, term, member, process_id, phase, message, workload_pid, reported_by, progress, \
               policy_name, policy_revision, policy_error, updated_at_ms) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, COALESCE(CAST($9 AS BIGINT), 0), $10, $11, $12, ({}) \
             WHERE CAST($13 AS BIGINT) IS NULL \
               OR EXISTS (SELECT 1 FROM members m WHERE m.member = $3 AND m.process_id = $4 AND m.epoch = $13) \
             ON CONFLICT (route) DO UPDATE SET term = excluded.term, member = excluded.member, \
               process_id = excluded.process_id, phase = excluded.phase, message = excluded.message, \
               workload_pid = excluded.workload_pid, reported_by = excluded.reported_by, \
               progress = CASE WHEN CAST($9 AS BIGINT) IS NULL \
                 AND instance_reports.phase NOT IN ('INSTANCE_PHASE_STOPPED', 'INSTANCE_PHASE_FAILED') \
                 AND (excluded.workload_pid = 0 OR instance_reports.workload_pid IN (0, excluded.workload_pid)) \
                 THEN instance_reports.progress ELSE excluded.progress END, \
               policy_name = excluded.policy_name, policy_revision = excluded.policy_revision, \
               policy_error = excluded.policy_error, updated_at_ms = excluded.updated_at_ms \
             WHERE instance_reports.term <= excluded.term \
               OR EXISTS (SELECT 1 FROM assignments a WHERE a.route = excluded.route AND a.term = excluded.term \
                          AND a.member = excluded.member AND a.process_id = excluded.process_id)",
            self.backend.clock_expr()
        );
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let mut not_written = 0;
        for (r, epoch) in reports {
            let done = sqlx::query(&sql)
                .bind(&r.route)
                .bind(r.term)
                .bind(&r.member)
                .bind(&r.process_id)
                .bind(r.phase)
                .bind(&r.message)
                .bind(r.workload_pid)
                .bind(&r.reported_by)
                .bind(r.progress)
                .bind(r.policy.as_ref().map(|p| p.name.clone()))
                .bind(r.policy.as_ref().map(|p| p.revision))
                .bind(r.policy.as_ref().map(|p| p.error.clone()))
                .bind(*epoch)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() == 0 {
                not_written += 1;
            }
        }
        tx.commit().await?;
        Ok(not_written)
    }

    pub async fn list_reports(&self) -> Result<Vec<Report>> {
        sqlx::query_as(
            "SELECT route, term, member, process_id, phase, message, workload_pid, reported_by, progress, updated_at_ms, \
             policy_name, policy_revision, policy_error FROM instance_reports ORDER BY route",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(decoded("instance_reports"))
    }

    /// One registered instance (withdrawn or not).
    pub async fn instance(&self, route: &str) -> Result<Option<InstanceRecord>> {
        Ok(self.list_instances_where(Some(route)).await?.pop())
    }

    pub async fn list_instances(&self) -> Result<Vec<InstanceRecord>> {
        self.list_instances_where(None).await
    }

    async fn list_instances_where(&self, route: Option<&str>) -> Result<Vec<InstanceRecord>> {
        let filter = if route.is_some() { "WHERE route = $1" } else { "" };
        let sql = format!(
            "SELECT route, namespace, name, uid, generation, material, registered_at_ms, last_term, \
             CASE WHEN withdrawn THEN 1 ELSE 0 END AS withdrawn, withdrawn_reason, withdrawn_owner, withdrawn_term, \
             displaced_member, displaced_process_id, displaced_term, displaced_for, \
             CASE WHEN checkpoint_pid IS NULL THEN 0 ELSE 1 END AS checkpointed, \
             fence_member, fence_process_id, fence_term, fence_generation \
             FROM instances {filter} ORDER BY route"
        );
        let mut query = sqlx::query_as(&sql);
        if let Some(route) = route {
            query = query.bind(route);
        }
        let mut instances: Vec<InstanceRecord> = query.fetch_all(&self.pool).await.map_err(decoded("instances"))?;
        for instance in &mut instances {
            // Material that does not open (a KEK not configured) reads as none: a member is
            // given no credentials for it and an activation is refused; the start says so.
            let opened = sealing::open_material(self.keks(), &instance.route, &instance.uid, &instance.material.0);
            instance.material = SecretBytes(opened.map(|m| m.to_vec()).unwrap_or_default());
        }
        Ok(instances)
    }

    /// `material` as stored for `route` and `uid`: sealed with the current KEK (in clear only
    /// for a store opened without KEKs, as tests do).
    fn seal_material(&self, route: &str, uid: &str, material: &[u8]) -> Result<Vec<u8>> {
        match self.keks() {
            Some(keks) => sealing::seal_material(keks.current(), route, uid, material)
                .map_err(|err| Error::Invalid(err.to_string())),
            None => Ok(material.to_vec()),
        }
    }

    /// Seal every stored registration material that is in clear (an older gateway wrote it) or
    /// sealed with a previous KEK, each by a compare-and-set on the stored value (a
    /// registration meanwhile wins). Run at every start. Returns how many were sealed anew,
    /// and the routes whose material does not open with the configured KEKs.
    pub async fn seal_materials(&self) -> Result<(usize, Vec<String>)> {
        let Some(keks) = self.keks() else {
            return Ok((0, Vec::new()));
        };
        let rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as("SELECT route, uid, material FROM instances")
            .fetch_all(&self.pool)
            .await
            .map_err(decoded("instances"))?;
        let (mut sealed, mut unopened) = (0, Vec::new());
        for (route, uid, stored) in rows {
            if sealing::material_sealed_with(&stored) == Some(keks.current().id()) {
                continue;
            }
            let Ok(material) = sealing::open_material(Some(keks), &route, &uid, &stored) else {
                unopened.push(route);
                continue;
            };
            let resealed = self.seal_material(&route, &uid, &material)?;
            let done =
                sqlx::query("UPDATE instances SET material = $3 WHERE route = $1 AND uid = $2 AND material = $4")
                    .bind(&route)
                    .bind(&uid)
                    .bind(&resealed)
                    .bind(&stored)
                    .execute(&self.pool)
                    .await?;
            sealed += usize::try_from(done.rows_affected()).unwrap_or(0);
        }
        Ok((sealed, unopened))
    }
}

/// `sql` with a registration bound as `$1..$5` (route, namespace, name, uid, material).
/// ` AND generation = $n` when `generation` is given.
fn of_generation(generation: Option<i64>, n: usize) -> String {
    generation.map_or_else(String::new, |_| format!(" AND generation = ${n}"))
}

fn bind_registration<'q>(sql: &'q str, r: &'q Registration) -> Query<'q, Any, AnyArguments<'q>> {
    sqlx::query(sql)
        .bind(&r.route)
        .bind(&r.namespace)
        .bind(&r.name)
        .bind(&r.uid)
        .bind(&r.material)
}
