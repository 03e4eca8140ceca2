//! Signing keys: the reads, and the coordinator's fenced writes (rotation, retirement,
//! removal). Private halves are stored sealed (see [`crate::store::sealing`]).

use sqlx::{Any, Transaction};

use super::columns::decoded;
use super::{CoordinatorTerm, Result, SigningKey, Store};

impl Store {
    pub async fn list_signing_keys(&self) -> Result<Vec<SigningKey>> {
        sqlx::query_as(
            "SELECT kid, algorithm, public_pem, private_pem, created_at_ms, retired_at_ms FROM signing_keys \
             ORDER BY created_at_ms, kid",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(decoded("signing_keys"))
    }
}

/// Fenced: insert a key, or retire or re-seal one.
pub(super) async fn put_signing_key(
    tx: &mut Transaction<'static, Any>,
    key: &SigningKey,
    coordinator_term: CoordinatorTerm,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO signing_keys (kid, algorithm, public_pem, private_pem, coordinator_term, created_at_ms, retired_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (kid) DO UPDATE SET retired_at_ms = excluded.retired_at_ms, \
           private_pem = excluded.private_pem, coordinator_term = excluded.coordinator_term",
    )
    .bind(&key.kid)
    .bind(&key.algorithm)
    .bind(&key.public_pem)
    .bind(&key.private_pem)
    .bind(coordinator_term)
    .bind(now_ms)
    .bind(key.retired_at_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Fenced: remove a key.
pub(super) async fn delete_signing_key(tx: &mut Transaction<'static, Any>, kid: &str) -> Result<()> {
    sqlx::query("DELETE FROM signing_keys WHERE kid = $1")
        .bind(kid)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
