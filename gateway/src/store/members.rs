//! Members (any replica): the record of each admitted member process with its TTL, its
//! refresh and removal by the same process and connection epoch only; and replicas'
//! liveness, by which the members of a silent replica expire.

use std::time::Duration;

use sqlx::Any;
use sqlx::any::AnyArguments;
use sqlx::query::QueryAs;

use super::columns::decoded;
use super::{Error, MemberRecord, MemberUpdate, Result, Store, millis};

impl Store {
    /// Record a member process that was just admitted. A member name is held by its live
    /// process: a newer connection epoch of the recorded process replaces the record, another
    /// process only once the record is gone or expired (its stream closed, was left, fell
    /// silent or its replica went silent) — a token of the member and a new process id are no
    /// proof that the recorded process is dead. Decided at database time in the one statement
    /// (`Error::Conflict` otherwise, nothing written). The record expires at database now +
    /// `ttl`.
    pub async fn record_member(&self, m: &MemberUpdate, ttl: Duration) -> Result<MemberRecord> {
        let sql = format!(
            "{} ON CONFLICT (member) DO UPDATE SET process_id = excluded.process_id, epoch = excluded.epoch, \
               runtime_address = excluded.runtime_address, capacity = excluded.capacity, served_by = excluded.served_by, \
               leaving = excluded.leaving, expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms \
             WHERE (members.process_id = excluded.process_id AND members.epoch < excluded.epoch) \
                OR (members.process_id <> excluded.process_id AND members.expires_at_ms <= ({clock})) \
             RETURNING {MEMBER_COLUMNS}",
            self.insert_member_sql(),
            clock = self.backend.clock_expr()
        );
        let row = bind_member(sqlx::query_as(&sql), m, ttl)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("members"))?;
        match row {
            Some(record) => Ok(record),
            None => {
                let (_, held) = self.member(&m.member).await?;
                let detail = match held {
                    Some(held) if held.process_id == m.process_id => format!(
                        "process {} is recorded at connection epoch {}, not older than {}",
                        m.process_id, held.epoch, m.epoch
                    ),
                    _ => format!(
                        "member {} is held by another live process; a new process is admitted once \
                         that one's stream ends or its record expires",
                        m.member
                    ),
                };
                Err(Error::Conflict {
                    subject: format!("member {}", m.member),
                    detail,
                })
            }
        }
    }

    /// Extend (and update) the record of a member stream, only if the record still names its
    /// process at its connection epoch and has not expired. Never re-creates a removed or
    /// revives an expired record (the other replicas expire the members of a silent replica:
    /// once it resumes, it must not write them back as live). `None`: the record was
    /// replaced, removed or expired (see [`Store::member`] for which), and this stream must end.
    pub async fn refresh_member(&self, m: &MemberUpdate, ttl: Duration) -> Result<Option<MemberRecord>> {
        let sql = format!(
            "UPDATE members SET runtime_address = $4, capacity = $5, served_by = $6, leaving = $7, \
               expires_at_ms = ({clock}) + $8, updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3 AND expires_at_ms > ({clock}) \
             RETURNING {MEMBER_COLUMNS}",
            clock = self.backend.clock_expr()
        );
        bind_member(sqlx::query_as(&sql), m, ttl)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("members"))
    }

    fn insert_member_sql(&self) -> String {
        format!(
            "INSERT INTO members (member, process_id, epoch, runtime_address, capacity, served_by, leaving, expires_at_ms, updated_at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, ({clock}) + $8, ({clock}))",
            clock = self.backend.clock_expr()
        )
    }

    /// Record that replica `name` is running (database time).
    pub async fn refresh_replica(&self, name: &str) -> Result<()> {
        sqlx::query(&format!(
            "INSERT INTO replicas (replica, refreshed_at_ms) VALUES ($1, ({clock})) \
             ON CONFLICT (replica) DO UPDATE SET refreshed_at_ms = excluded.refreshed_at_ms",
            clock = self.backend.clock_expr()
        ))
        .bind(name)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// When each replica last recorded that it is running.
    pub async fn list_replicas(&self) -> Result<Vec<(String, i64)>> {
        Ok(
            sqlx::query_as("SELECT replica, refreshed_at_ms FROM replicas ORDER BY replica")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// Expire the live record `m` now, only if it is unchanged (same process, epoch and
    /// serving replica: the member did not attach elsewhere) and its serving replica has not
    /// recorded that it is running for longer than `silence` — both checked at database time
    /// in the same statement, so a replica that resumed in the meantime keeps its members.
    pub async fn expire_member_of_silent_replica(&self, m: &MemberRecord, silence: Duration) -> Result<bool> {
        let done = sqlx::query(&format!(
            "UPDATE members SET expires_at_ms = ({clock}), updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3 AND served_by = $4 \
               AND expires_at_ms > ({clock}) \
               AND EXISTS (SELECT 1 FROM replicas r WHERE r.replica = $4 AND r.refreshed_at_ms < ({clock}) - $5)",
            clock = self.backend.clock_expr()
        ))
        .bind(&m.member)
        .bind(&m.process_id)
        .bind(m.epoch)
        .bind(&m.served_by)
        .bind(millis(silence))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The record of one member, if it has one, and the database time of the read.
    pub async fn member(&self, member: &str) -> Result<(i64, Option<MemberRecord>)> {
        let now_ms = self.now_ms().await?;
        let record = sqlx::query_as(&format!("SELECT {MEMBER_COLUMNS} FROM members WHERE member = $1"))
            .bind(member)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("members"))?;
        Ok((now_ms, record))
    }

    /// Remove a member record, only if it still names `process_id` at
    /// connection `epoch` (a newer stream of the member keeps its record).
    pub async fn remove_member(&self, member: &str, process_id: &str, epoch: i64) -> Result<bool> {
        self.change_process_record(
            "DELETE FROM members WHERE member = $1 AND process_id = $2 AND epoch = $3",
            (member, process_id, epoch),
        )
        .await
    }

    /// A member process that announced it was leaving ended its stream: its record stays,
    /// expired now and marked leaving, so whoever reads the pool next knows it left on purpose
    /// (a removed record would look like a member that stopped answering). Only if the
    /// record still names `process_id` at connection `epoch`.
    pub async fn member_left(&self, member: &str, process_id: &str, epoch: i64) -> Result<bool> {
        let sql = format!(
            "UPDATE members SET leaving = TRUE, expires_at_ms = ({clock}), updated_at_ms = ({clock}) \
             WHERE member = $1 AND process_id = $2 AND epoch = $3",
            clock = self.backend.clock_expr()
        );
        self.change_process_record(&sql, (member, process_id, epoch)).await
    }

    /// A member process whose stream a replica ended for silence: its record expires within
    /// `grace` (sooner if it already would), unless a newer stream of the member refreshes it
    /// meanwhile — a member cut off from one replica attaches through another and keeps its
    /// instances; a hung one is gone once the grace passed. Only if the record still names
    /// `process_id` at connection `epoch`.
    pub async fn member_detached(&self, member: &str, process_id: &str, epoch: i64, grace: Duration) -> Result<bool> {
        let sql = format!(
            "UPDATE members SET expires_at_ms = CASE WHEN expires_at_ms < ({clock}) + $4 \
             THEN expires_at_ms ELSE ({clock}) + $4 END \
             WHERE member = $1 AND process_id = $2 AND epoch = $3",
            clock = self.backend.clock_expr()
        );
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let done = sqlx::query(&sql)
            .bind(member)
            .bind(process_id)
            .bind(epoch)
            .bind(grace_ms)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Run `sql` on the record of one member process (`$1..$3`: member, process, connection
    /// epoch); whether it changed a row.
    async fn change_process_record(&self, sql: &str, (member, process_id, epoch): (&str, &str, i64)) -> Result<bool> {
        let done = sqlx::query(sql)
            .bind(member)
            .bind(process_id)
            .bind(epoch)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// All member records, live or expired, and the database time of the read.
    pub async fn list_members(&self) -> Result<(i64, Vec<MemberRecord>)> {
        let now_ms = self.now_ms().await?;
        let members = sqlx::query_as(&format!("SELECT {MEMBER_COLUMNS} FROM members ORDER BY member"))
            .fetch_all(&self.pool)
            .await
            .map_err(decoded("members"))?;
        Ok((now_ms, members))
    }
}

const MEMBER_COLUMNS: &str = "member, process_id, epoch, runtime_address, capacity, served_by, \
    CASE WHEN leaving THEN 1 ELSE 0 END AS leaving, expires_at_ms, updated_at_ms";

/// Bind a member update as `$1..$8` (member, process, epoch, address, capacity, served by,
/// leaving, TTL in ms).
fn bind_member<'q>(
    query: QueryAs<'q, Any, MemberRecord, AnyArguments<'q>>,
    m: &'q MemberUpdate,
    ttl: Duration,
) -> QueryAs<'q, Any, MemberRecord, AnyArguments<'q>> {
    query
        .bind(&m.member)
        .bind(&m.process_id)
        .bind(m.epoch)
        .bind(&m.runtime_address)
        .bind(m.capacity)
        .bind(&m.served_by)
        .bind(m.leaving)
        .bind(millis(ttl))
}
