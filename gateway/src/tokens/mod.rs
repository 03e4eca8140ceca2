//! Gateway signing keys and tokens.
//!
//! - [`keys`](KeyPair): Ed25519 key pairs, PEM, and the store's [`SigningKey`] records.
//! - `rotation`: the pure rotation [`plan`] and the coordinator's [`rotate`] through
//!   `write_fenced` (lifecycle: created and published → signer → retired → deleted).
//! - `keyring`: the [`Keyring`] every replica loads from the store: [`Keyring::mint`],
//!   [`Keyring::trust_bundle`], [`Keyring::verify`] (through [`proto::trust`]).
//! - private keys are kept sealed by the store ([`crate::store::sealing`]); the coordinator's
//!   rotation re-seals rows under another key-encryption key.
//! - `delivery`: handing tokens and the trust bundle to members, sidecars and the operator
//!   ([`Delivery`]; [`FileDelivery`] in local mode).
//!
//! Token kinds ([`Kind`]) fix audience, header `typ` and longest lifetime: [`SUPERVISOR`]
//! (one member's token, subject [`member_subject`]), [`SIDECAR`] (recovery grants and
//! activation proofs), [`INSTANCE`] (one instance's token, subject [`instance_subject`],
//! claims [`InstanceTokenClaims`]) and [`OPERATOR`] (claims [`OperatorClaims`] with `roles`).
//! In Kubernetes members and sidecars authenticate with their Pods' ServiceAccount tokens
//! instead (`kubernetes::review`); registration still issues each instance its token.
//!
//! [`SigningKey`]: crate::store::SigningKey

mod delivery;
mod keyring;
mod keys;
mod rotation;

use std::time::Duration;

pub use delivery::{Delivered, Delivery, FileDelivery};
pub use keyring::{Keyring, Minted};
pub use keys::{ALGORITHM, KeyPair, public_key};
pub use proto::trust::{
    Claims, DEFAULT_ISSUER, GrantClaims, InstanceClaim, InstanceTokenClaims, Kind, NoExtra, OperatorClaims,
    ProofClaims, TrustBundle, instance_subject, member_subject, route_of,
};
pub use rotation::{Plan, Policy, plan, rotate, signer};

use crate::store;

/// Audience of supervisor tokens.
pub const SUPERVISOR: &str = proto::trust::SUPERVISOR_AUDIENCE;
/// Audience of recovery grants and activation proofs.
pub const SIDECAR: &str = proto::trust::SIDECAR_AUDIENCE;
/// Audience of namespace (instance) tokens.
pub const INSTANCE: &str = proto::trust::INSTANCE_AUDIENCE;
/// Audience of operator tokens.
pub const OPERATOR: &str = proto::trust::OPERATOR_AUDIENCE;
/// The operator role the operator API requires.
pub const PLATFORM_ADMIN: &str = "platform_admin";

/// Errors of minting, key handling, rotation and delivery. Never contain key material or
/// tokens.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no signing key yet: the coordinator creates the first one")]
    NoSigningKey,
    #[error("signing key {kid}: {reason}")]
    Key { kid: String, reason: &'static str },
    #[error("cannot generate a signing key: {0}")]
    Random(String),
    #[error("{kind:?} token lifetime {lifetime:?} is outside 1 s..={max:?}")]
    Lifetime {
        kind: Kind,
        lifetime: Duration,
        max: Duration,
    },
    #[error("extra claims {0}")]
    Extra(String),
    #[error("cannot sign a token: {0}")]
    Sign(#[from] jsonwebtoken::errors::Error),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error(transparent)]
    Sealing(#[from] crate::store::sealing::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Open every stored private key with the store's key-encryption keys (and check it matches
/// its public key); the number of keys. A gateway given the wrong KEK calls this at start and
/// refuses to run, naming the key and the KEK ids, rather than fail at every mint.
pub async fn check_stored_keys(store: &store::Store) -> Result<usize, Error> {
    let records = store.list_signing_keys().await?;
    for record in &records {
        KeyPair::from_record(record, store.keks())?;
    }
    Ok(records.len())
}

/// True from half the token's lifetime on (and for a token whose expiry is not after its
/// issue).
pub fn needs_renewal(issued_at_ms: i64, expires_at_ms: i64, now_ms: i64) -> bool {
    let half = expires_at_ms.saturating_sub(issued_at_ms) / 2;
    half <= 0 || now_ms >= issued_at_ms.saturating_add(half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_starts_at_half_the_lifetime() {
        assert!(!needs_renewal(1_000, 3_001_000, 1_500_999));
        assert!(needs_renewal(1_000, 3_001_000, 1_501_000));
        assert!(needs_renewal(1_000, 1_000, 0));
    }
}
