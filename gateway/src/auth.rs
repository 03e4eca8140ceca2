//! Bearer authentication of gRPC calls against the gateway's current trust
//! bundle (its published public keys). Verification itself — algorithm
//! pinned, kid, audience, issuer, expiry — is `proto::trust`.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use proto::trust::{self, Claims, Expectation, Kind, TrustBundle};
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

/// Verifies bearer tokens against the latest trust bundle.
#[derive(Debug)]
pub struct Verifier {
    issuer: String,
    store: Store,
    bundle: RwLock<Arc<TrustBundle>>,
    last_reload: Mutex<Option<Instant>>,
}

impl Verifier {
    pub fn new(issuer: impl Into<String>, store: Store) -> Self {
        let issuer = issuer.into();
        Self {
            bundle: RwLock::new(Arc::new(TrustBundle::new(issuer.clone()))),
            issuer,
            store,
            last_reload: Mutex::new(None),
        }
    }

    /// Replace the bundle (after a key rotation).
    pub fn set_bundle(&self, bundle: TrustBundle) {
        let mut current = self.bundle.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        *current = Arc::new(bundle);
    }

    pub fn bundle(&self) -> Arc<TrustBundle> {
        self.bundle
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Verify a token of `kind`; the error is the gRPC status to answer with
    /// (it never quotes the token).
    pub async fn verify(&self, kind: Kind, token: &str) -> Result<Principal, Status> {
        let expected = Expectation::kind(kind, &self.issuer);
        let mut outcome = self.bundle().verify::<Claims>(token, &expected);
        if matches!(outcome, Err(trust::Error::UnknownKid(_))) && self.may_reload() {
            match Keyring::load(&self.store, &self.issuer).await {
                Ok(keyring) => self.set_bundle(keyring.trust_bundle().clone()),
                Err(err) => warn!(error = %err, "cannot reload signing keys"),
            }
            outcome = self.bundle().verify::<Claims>(token, &expected);
        }
        let claims =
            outcome.map_err(|err| Status::unauthenticated(format!("{} token refused: {err}", kind.audience())))?;
        Ok(Principal {
            subject: claims.sub,
            expires_at_ms: claims.exp.saturating_mul(1000),
        })
    }

    /// Verify the call's `authorization: Bearer` token of `kind`.
    pub async fn verify_request<T>(&self, kind: Kind, request: &tonic::Request<T>) -> Result<Principal, Status> {
        let token = proto::bearer_token_from_metadata(request.metadata())
            .ok_or_else(|| Status::unauthenticated("missing authorization: Bearer token"))?;
        self.verify(kind, token).await
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

/// The namespace a verified instance token may act for.
pub fn token_namespace(principal: &Principal) -> Result<&str, Status> {
    trust::namespace_of(&principal.subject)
        .ok_or_else(|| Status::permission_denied("the token does not name a namespace"))
}
