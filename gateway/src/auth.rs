//! The replica's signing keys in memory: bearer authentication of gRPC calls
//! against the current trust bundle, and the keyring that mints grants and
//! proofs. Verification itself — algorithm pinned, kid, audience, issuer,
//! expiry — is `proto::trust`.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use proto::trust::{self, Claims, Expectation, Kind};
use serde::de::DeserializeOwned;
use tonic::Status;
use tracing::warn;

use crate::store::Store;
use crate::tokens::Keyring;

/// A token naming a key this replica has not loaded yet triggers a reload
/// from the store, at most this often.
const RELOAD_AT_MOST_EVERY: Duration = Duration::from_millis(500);

/// Who a verified token speaks for, and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub subject: String,
    /// Milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
}

/// The latest keyring: verifies bearer tokens, mints grants and proofs.
#[derive(Debug)]
pub struct Keys {
    issuer: String,
    store: Store,
    keyring: RwLock<Arc<Keyring>>,
    last_reload: Mutex<Option<Instant>>,
}

impl Keys {
    pub fn new(issuer: impl Into<String>, store: Store) -> Self {
        let issuer = issuer.into();
        Self {
            keyring: RwLock::new(Arc::new(Keyring::empty(&issuer))),
            issuer,
            store,
            last_reload: Mutex::new(None),
        }
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// Replace the keyring (after a reload or a rotation).
    pub fn set(&self, keyring: Keyring) {
        let mut current = self.keyring.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        *current = Arc::new(keyring);
    }

    pub fn keyring(&self) -> Arc<Keyring> {
        self.keyring
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Verify a token of `kind` with its extra claims `E`, reloading the
    /// keyring once when the token names a key not loaded yet.
    pub async fn verify_claims<E: DeserializeOwned>(&self, kind: Kind, token: &str) -> Result<Claims<E>, trust::Error> {
        let expected = Expectation::kind(kind, &self.issuer);
        let outcome = self.keyring().trust_bundle().verify::<Claims<E>>(token, &expected);
        if !matches!(outcome, Err(trust::Error::UnknownKid(_))) || !self.may_reload() {
            return outcome;
        }
        match Keyring::load(&self.store, &self.issuer).await {
            Ok(keyring) => self.set(keyring),
            Err(err) => warn!(error = %err, "cannot reload signing keys"),
        }
        self.keyring().trust_bundle().verify::<Claims<E>>(token, &expected)
    }

    /// Verify a bearer token of `kind`; the error is the gRPC status to
    /// answer with (it never quotes the token).
    pub async fn verify(&self, kind: Kind, token: &str) -> Result<Principal, Status> {
        let claims: Claims = self
            .verify_claims(kind, token)
            .await
            .map_err(|err| Status::unauthenticated(format!("{} token refused: {err}", kind.audience())))?;
        Ok(Principal {
            subject: claims.sub,
            expires_at_ms: claims.exp.saturating_mul(1000),
        })
    }

    /// Verify the call's `authorization: Bearer` token of `kind`.
    pub async fn verify_request<T>(&self, kind: Kind, request: &tonic::Request<T>) -> Result<Principal, Status> {
        self.verify(kind, bearer(request)?).await
    }

    fn may_reload(&self) -> bool {
        let mut last = self.last_reload.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < RELOAD_AT_MOST_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

/// The call's bearer token.
pub fn bearer<T>(request: &tonic::Request<T>) -> Result<&str, Status> {
    proto::bearer_token_from_metadata(request.metadata())
        .ok_or_else(|| Status::unauthenticated("missing authorization: Bearer token"))
}

/// The namespace a verified instance token may act for.
pub fn token_namespace(principal: &Principal) -> Result<&str, Status> {
    trust::namespace_of(&principal.subject)
        .ok_or_else(|| Status::permission_denied("the token does not name a namespace"))
}
