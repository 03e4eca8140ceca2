//! The coordinator lease: acquiring, renewing, releasing and taking it over (each in a
//! transaction that locks the lease row before it samples the database clock), the term
//! log, and whether a holder's process still lives.

use std::time::Duration;

use sqlx::{Any, Transaction};

use super::columns::decoded;
use super::dialect::LockMode;
use super::{Acquire, CoordinatorTerm, Error, Lease, LeaseView, Result, Store, TermRecord, decide, liveness, millis};

impl Store {
    /// This process's liveness key: the suffix of its lease holder id.
    pub fn liveness_key(&self) -> &str {
        &self.key
    }

    /// Whether the process of lease holder `holder` is still alive, as far
    /// as the database (or the machine, for SQLite) can tell.
    pub async fn holder_alive(&self, holder: &str) -> Result<bool> {
        let key = liveness::key_of(holder);
        match &self.locks {
            Some((dir, _)) => Ok(liveness::file_holder_alive(dir, key)),
            None => Ok(sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(liveness::application_name(key))
            .fetch_one(&self.pool)
            .await?
                > 0),
        }
    }

    /// Take over a live lease whose holder's process is gone: compare-and-set
    /// on the observed holder and term, to the next term. `None` when the
    /// lease changed since it was observed.
    pub async fn take_over_lease(&self, holder: &str, length: Duration, observed: &LeaseView) -> Result<Option<Lease>> {
        let (holder, observed) = (holder.to_owned(), observed.clone());
        self.detached(move |store| async move { store.take_over_lease_now(&holder, length, &observed).await })
            .await
    }

    async fn take_over_lease_now(&self, holder: &str, length: Duration, observed: &LeaseView) -> Result<Option<Lease>> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        if row.holder != observed.holder || row.term != observed.term {
            return Ok(None);
        }
        let lease = Lease {
            holder: holder.to_owned(),
            term: row.term.next(),
            expires_at_ms: row.now_ms.saturating_add(millis(length)),
        };
        set_lease(&mut tx, &lease).await?;
        log_term(&mut tx, &lease, row.now_ms).await?;
        tx.commit().await?;
        Ok(Some(lease))
    }

    /// Begin a transaction, lock the lease row, and only then sample the
    /// database clock.
    pub(super) async fn lock_lease(&self, mode: LockMode) -> Result<(Transaction<'static, Any>, LeaseView)> {
        let mut tx = self.pool.begin_with(self.backend.begin_sql()).await?;
        let (holder, term, expires_at_ms) = sqlx::query_as(&self.backend.lock_lease_sql(mode))
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(Error::Corrupt {
                table: "coordinator_lease",
                detail: "the lease row is missing".into(),
            })?;
        let now_ms = self.clock(&mut *tx).await?;
        let view = LeaseView {
            holder,
            term,
            expires_at_ms,
            now_ms,
        };
        Ok((tx, view))
    }

    /// Try to become (or stay) the coordinator; see [`decide::acquire`].
    pub async fn acquire_lease(&self, holder: &str, length: Duration) -> Result<Acquire> {
        let holder = holder.to_owned();
        self.detached(move |store| async move { store.acquire_lease_now(&holder, length).await })
            .await
    }

    async fn acquire_lease_now(&self, holder: &str, length: Duration) -> Result<Acquire> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        let outcome = decide::acquire(&row, holder, millis(length));
        if let Acquire::Acquired(lease) = &outcome {
            set_lease(&mut tx, lease).await?;
            if lease.term != row.term {
                log_term(&mut tx, lease, row.now_ms).await?;
            }
            tx.commit().await?;
        }
        Ok(outcome)
    }

    /// Extend the caller's lease: only the same holder and term, before expiry.
    pub async fn renew_lease(&self, lease: &Lease, length: Duration) -> Result<Lease> {
        let lease = lease.clone();
        self.detached(move |store| async move { store.renew_lease_now(&lease, length).await })
            .await
    }

    async fn renew_lease_now(&self, lease: &Lease, length: Duration) -> Result<Lease> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        decide::fence(&row, lease)?;
        let renewed = Lease {
            expires_at_ms: row.now_ms.saturating_add(millis(length)),
            ..lease.clone()
        };
        set_lease(&mut tx, &renewed).await?;
        tx.commit().await?;
        Ok(renewed)
    }

    /// Graceful release: expires the lease at once and keeps its term, so the
    /// next acquire (by anyone) takes the next term without waiting. Returns
    /// `false` when the lease was already lost (nothing changes then).
    pub async fn release_lease(&self, lease: &Lease) -> Result<bool> {
        let lease = lease.clone();
        self.detached(move |store| async move { store.release_lease_now(&lease).await })
            .await
    }

    async fn release_lease_now(&self, lease: &Lease) -> Result<bool> {
        let (mut tx, row) = self.lock_lease(LockMode::Exclusive).await?;
        if decide::fence(&row, lease).is_err() {
            return Ok(false);
        }
        let released = Lease {
            expires_at_ms: row.now_ms,
            ..lease.clone()
        };
        set_lease(&mut tx, &released).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The lease row as it stands (`None` if never held), with the database
    /// time of the read.
    pub async fn read_lease(&self) -> Result<Option<LeaseView>> {
        let sql = format!(
            "SELECT holder, term, expires_at_ms, ({}) AS now_ms FROM coordinator_lease WHERE id = 1",
            self.backend.clock_expr()
        );
        let view: Option<LeaseView> = sqlx::query_as(&sql)
            .fetch_optional(&self.pool)
            .await
            .map_err(decoded("coordinator_lease"))?;
        Ok(view.filter(|view| view.term > CoordinatorTerm::ZERO))
    }

    /// Every term ever granted, oldest first.
    pub async fn lease_history(&self) -> Result<Vec<TermRecord>> {
        sqlx::query_as("SELECT term, holder, acquired_at_ms, started_at_ms FROM coordinator_terms ORDER BY term")
            .fetch_all(&self.pool)
            .await
            .map_err(decoded("coordinator_terms"))
    }
}

async fn set_lease(tx: &mut Transaction<'static, Any>, lease: &Lease) -> Result<()> {
    sqlx::query("UPDATE coordinator_lease SET holder = $1, term = $2, expires_at_ms = $3 WHERE id = 1")
        .bind(&lease.holder)
        .bind(lease.term)
        .bind(lease.expires_at_ms)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Add a newly granted term to the term log.
async fn log_term(tx: &mut Transaction<'static, Any>, lease: &Lease, now_ms: i64) -> Result<()> {
    sqlx::query("INSERT INTO coordinator_terms (term, holder, acquired_at_ms) VALUES ($1, $2, $3)")
        .bind(lease.term)
        .bind(&lease.holder)
        .bind(now_ms)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
