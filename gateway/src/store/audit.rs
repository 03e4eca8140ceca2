//! The egress audit trail (any replica): the decisions a workload's sidecar recorded, stored
//! once per (Pod UID, sequence), only for the member that owns the route at the term it names
//! (checked in the transaction that stores them), and read back by Pod.

use super::{Error, OwnershipTerm, Result, Store};

/// How long records are kept (the coordinator's retention round forgets older ones).
pub const AUDIT_RETENTION_MS: i64 = 7 * 24 * 3600 * 1000;

/// One stored decision (the columns of `audit_records`).
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct AuditEntry {
    pub uid: String,
    pub sequence: i64,
    pub route: String,
    pub namespace: String,
    pub name: String,
    pub member: String,
    pub term: super::OwnershipTerm,
    pub recorded_at_ms: i64,
    pub at_ms: i64,
    pub decision: String,
    pub destination: String,
    pub method: String,
    pub path: String,
    pub rule: String,
    pub policy: String,
    pub revision: i64,
    pub reason: String,
    pub bytes_sent: i64,
    pub bytes_received: i64,
    pub duration_ms: i64,
}

/// What one delivery stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The highest sequence of the delivery.
    pub through: i64,
    /// The decision of each record stored now (not those stored before).
    pub new: Vec<String>,
}

/// Denials of one destination by one Pod's sidecar under one policy revision, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct Denials {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub destination: String,
    pub policy: String,
    pub revision: i64,
    /// One of the reasons given (they differ only by path).
    pub reason: String,
    pub count: i64,
    /// This destination's place among the Pod's, most denied first (from 1).
    pub rank: i64,
    /// All the Pod's denied destinations and attempts in the window.
    pub destinations: i64,
    pub attempts: i64,
}

const COLUMNS: &str = "uid, sequence, route, namespace, name, member, term, recorded_at_ms, at_ms, decision, \
     destination, method, path, rule, policy, revision, reason, bytes_sent, bytes_received, duration_ms";

impl Store {
    /// Stores `records` (their uid, route, namespace, name, member, term and storing time are
    /// set here) for the route `member` owns at `term` (its ACTIVE assignment): `Denied`
    /// otherwise, nothing stored. A sequence stored before is kept as it was.
    pub async fn record_audit(
        &self,
        route: &str,
        member: &str,
        term: OwnershipTerm,
        records: Vec<AuditEntry>,
    ) -> Result<Recorded> {
        let (route, member) = (route.to_owned(), member.to_owned());
        self.detached(move |store| async move { store.record_audit_now(&route, &member, term, records).await })
            .await
    }

    async fn record_audit_now(
        &self,
        route: &str,
        member: &str,
        term: OwnershipTerm,
        records: Vec<AuditEntry>,
    ) -> Result<Recorded> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let owner: Option<(String, OwnershipTerm, String, String, String, String)> = sqlx::query_as(
            "SELECT a.member, a.term, a.phase, i.uid, i.namespace, i.name FROM assignments a \
             JOIN instances i ON i.route = a.route WHERE a.route = $1",
        )
        .bind(route)
        .fetch_optional(&mut *tx)
        .await?;
        let denied = |detail: String| Error::Denied {
            subject: route.to_owned(),
            detail,
        };
        let Some((owner, owned_term, phase, uid, namespace, name)) = owner else {
            return Err(denied("no member owns it".into()));
        };
        if owner != member || owned_term != term || phase != "active" {
            return Err(denied(format!(
                "{member} does not own it at term {term} (the store has {owner} at term {owned_term}, {phase})"
            )));
        }
        let now_ms = self.clock(&mut *tx).await?;
        let mut recorded = Recorded::default();
        let insert = format!(
            "INSERT INTO audit_records ({COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20) \
             ON CONFLICT (uid, sequence) DO NOTHING"
        );
        for r in records {
            recorded.through = recorded.through.max(r.sequence);
            let decision = r.decision.clone();
            let stored = sqlx::query(&insert)
                .bind(&uid)
                .bind(r.sequence)
                .bind(route)
                .bind(&namespace)
                .bind(&name)
                .bind(member)
                .bind(term)
                .bind(now_ms)
                .bind(r.at_ms)
                .bind(r.decision)
                .bind(r.destination)
                .bind(r.method)
                .bind(r.path)
                .bind(r.rule)
                .bind(r.policy)
                .bind(r.revision)
                .bind(r.reason)
                .bind(r.bytes_sent)
                .bind(r.bytes_received)
                .bind(r.duration_ms)
                .execute(&mut *tx)
                .await?;
            if stored.rows_affected() > 0 {
                recorded.new.push(decision);
            }
        }
        tx.commit().await?;
        Ok(recorded)
    }

    /// The denials stored after `after_ms` and at or before `upto_ms` (storing time), counted by
    /// Pod, destination and policy revision: of each Pod its `per_pod` most denied
    /// destinations, each with the Pod's totals (destinations, attempts), so one Pod with many
    /// destinations cannot crowd out the others. Ordered by each Pod's rank (every Pod's first
    /// destination before any Pod's second), then most denied first; at most `limit` rows.
    pub async fn audit_denials(&self, after_ms: i64, upto_ms: i64, per_pod: i64, limit: i64) -> Result<Vec<Denials>> {
        Ok(sqlx::query_as(
            "SELECT namespace, name, uid, destination, policy, revision, reason, count, rank, destinations, attempts \
             FROM (SELECT namespace, name, uid, destination, policy, revision, MIN(reason) AS reason, \
                     COUNT(*) AS count, \
                     ROW_NUMBER() OVER (PARTITION BY uid ORDER BY COUNT(*) DESC, destination) AS rank, \
                     COUNT(*) OVER (PARTITION BY uid) AS destinations, \
                     CAST(SUM(COUNT(*)) OVER (PARTITION BY uid) AS BIGINT) AS attempts \
                   FROM audit_records \
                   WHERE recorded_at_ms > $1 AND recorded_at_ms <= $2 AND decision = 'deny' \
                   GROUP BY namespace, name, uid, destination, policy, revision) counted \
             WHERE rank <= $3 ORDER BY rank, count DESC, namespace, name, destination LIMIT $4",
        )
        .bind(after_ms)
        .bind(upto_ms)
        .bind(per_pod)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The stored decisions of Pod `namespace/name`, by sequence after `after_sequence` and
    /// made at or after `since_ms`, at most `limit`, oldest first (across the Pod's UIDs, by
    /// storing time).
    pub async fn list_audit(
        &self,
        namespace: &str,
        name: &str,
        after_sequence: i64,
        since_ms: i64,
        limit: i64,
    ) -> Result<Vec<AuditEntry>> {
        Ok(sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM audit_records WHERE namespace = $1 AND name = $2 AND sequence > $3 \
             AND at_ms >= $4 ORDER BY recorded_at_ms, sequence LIMIT $5"
        ))
        .bind(namespace)
        .bind(name)
        .bind(after_sequence)
        .bind(since_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }
}
