//! The replica's signing keys in memory: bearer authentication of gRPC calls
//! against the current trust bundle, and the keyring that mints grants and
//! proofs. Verification itself — algorithm pinned, kid, audience, issuer,
//! expiry — is `proto::trust`.
//!
//! Who is calling ([`InstanceCaller`], [`MemberCaller`]) comes only from the
//! credential: a gateway-minted JWT (subject `instance:<route>` or
//! `member:<name>`), or in Kubernetes a Pod's projected ServiceAccount token,
//! which the API server reviews ([`Accounts`]). Never from the request.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use proto::common::v1::InstanceRef;
use proto::trust::{self, Claims, Expectation, InstanceTokenClaims, Kind};
use serde::de::DeserializeOwned;
use tonic::Status;
use tracing::warn;

use crate::kubernetes::review::{self, Review};
use crate::refusals::About;
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

/// The workload an instance credential was issued to: its calls act on this route only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceCaller {
    pub route: String,
    pub namespace: String,
    pub name: String,
    /// The Pod UID the credential is bound to (Kubernetes, and tokens issued at
    /// registration); `None` for a local bootstrap token bound to the route only.
    pub uid: Option<String>,
}

impl InstanceCaller {
    /// The call may act on `route` and `instance` only when they are the caller's own. The
    /// refusal is logged where every refused call is, rate-limited (`refusals`).
    pub fn owns(&self, route: &str, instance: &InstanceRef) -> Result<(), Status> {
        let uid_ok = self.uid.as_deref().is_none_or(|uid| uid == instance.uid);
        if route == self.route && instance.namespace == self.namespace && instance.name == self.name && uid_ok {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "the credential is for instance {} and may act only on it",
            self.route
        )))
    }
}

/// The pool member a member credential was issued to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberCaller {
    pub member: String,
    /// When the credential expires (ms since the Unix epoch).
    pub expires_at_ms: i64,
}

impl MemberCaller {
    /// The call may act for `member` only when it is the caller (refusal logged by `refusals`).
    pub fn is(&self, member: &str) -> Result<(), Status> {
        if member == self.member {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "the credential is for member {} and may act only for it",
            self.member
        )))
    }
}

/// Kubernetes ServiceAccount tokens: reviewed by the API server; the supervisor
/// ServiceAccount of the install namespace is the pool's members', any other
/// account's Pod is an instance.
pub struct Accounts {
    pub review: Arc<dyn Review>,
    pub install_namespace: String,
    pub supervisor_account: String,
}

impl std::fmt::Debug for Accounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounts")
            .field("install_namespace", &self.install_namespace)
            .field("supervisor_account", &self.supervisor_account)
            .finish_non_exhaustive()
    }
}

impl Accounts {
    fn is_member(&self, account: &review::Account) -> bool {
        account.namespace == self.install_namespace && account.service_account == self.supervisor_account
    }
}

/// The latest keyring: verifies bearer tokens, mints grants and proofs.
#[derive(Debug)]
pub struct Keys {
    issuer: String,
    store: Store,
    keyring: RwLock<Arc<Keyring>>,
    last_reload: Mutex<Option<Instant>>,
    accounts: Option<Accounts>,
}

impl Keys {
    pub fn new(issuer: impl Into<String>, store: Store) -> Self {
        let issuer = issuer.into();
        Self {
            keyring: RwLock::new(Arc::new(Keyring::empty(&issuer))),
            issuer,
            store,
            last_reload: Mutex::new(None),
            accounts: None,
        }
    }

    /// Also accept Kubernetes ServiceAccount tokens, reviewed through `accounts`.
    #[must_use]
    pub fn with_accounts(mut self, accounts: Option<Accounts>) -> Self {
        self.accounts = accounts;
        self
    }

    /// A Kubernetes token (another issuer than ours) reviewed by the API server;
    /// `None` when this replica takes only its own tokens or the token is ours.
    async fn account<T>(&self, token: &str, request: &tonic::Request<T>) -> Option<Result<review::Account, Status>> {
        let accounts = self.accounts.as_ref()?;
        if trust::unverified(token).is_some_and(|t| t.iss == self.issuer) {
            return None;
        }
        let source = request.remote_addr().map(|addr| addr.ip());
        Some(accounts.review.review(token, source).await.map_err(|err| match err {
            review::Error::Unavailable(_) => Status::unavailable(err.to_string()),
            review::Error::Refused(_)
            | review::Error::NotPodBound
            | review::Error::Malformed(_)
            | review::Error::Busy => Status::unauthenticated(err.to_string()),
        }))
    }

    /// The instance whose credential the call carries.
    pub async fn instance<T>(&self, request: &tonic::Request<T>) -> Result<InstanceCaller, Status> {
        let token = bearer(request)?;
        if let Some(account) = self.account(token, request).await {
            let account = account?;
            if self.accounts.as_ref().is_some_and(|a| a.is_member(&account)) {
                return Err(Status::permission_denied(
                    "a pool member's credential is not an instance's",
                ));
            }
            let route = format!("{}/{}", account.namespace, account.pod_name);
            crate::refusals::record(About {
                route: Some(&route),
                ..About::default()
            });
            return Ok(InstanceCaller {
                route,
                namespace: account.namespace,
                name: account.pod_name,
                uid: Some(account.pod_uid),
            });
        }
        let claims: Claims<InstanceTokenClaims> = self
            .verify_claims(Kind::Instance, token)
            .await
            .map_err(|err| Status::unauthenticated(format!("instance token refused: {err}")))?;
        let route =
            trust::route_of(&claims.sub).ok_or_else(|| Status::unauthenticated("the instance token names no route"))?;
        crate::refusals::record(About {
            route: Some(route),
            ..About::default()
        });
        Ok(InstanceCaller {
            route: route.to_owned(),
            namespace: claims.extra.namespace,
            name: claims.extra.name,
            uid: claims.extra.uid,
        })
    }

    /// The pool member whose credential the call carries.
    pub async fn member<T>(&self, request: &tonic::Request<T>) -> Result<MemberCaller, Status> {
        let token = bearer(request)?;
        if let Some(account) = self.account(token, request).await {
            let account = account?;
            if !self.accounts.as_ref().is_some_and(|a| a.is_member(&account)) {
                return Err(Status::permission_denied(
                    "the credential is not a pool member's (the supervisor ServiceAccount of the install namespace)",
                ));
            }
            // The API server verified the token: its own expiry is authentic. (Pod-bound tokens
            // always carry one; without it the stream is re-authenticated within the usual
            // token lifetime.)
            let lifetime_ms = i64::try_from(proto::timing::SUPERVISOR_TOKEN_LIFETIME.as_millis()).unwrap_or(i64::MAX);
            let expires_at_ms = trust::unverified(token)
                .and_then(|t| t.exp)
                .map(|exp| exp.saturating_mul(1000))
                .unwrap_or_else(|| trust::unix_ms(std::time::SystemTime::now()).saturating_add(lifetime_ms));
            crate::refusals::record(About {
                member: Some(&account.pod_name),
                ..About::default()
            });
            return Ok(MemberCaller {
                member: account.pod_name,
                expires_at_ms,
            });
        }
        let principal = self.verify(Kind::Supervisor, token).await?;
        let member = trust::member_of(&principal.subject)
            .ok_or_else(|| Status::unauthenticated("the supervisor token names no member"))?;
        crate::refusals::record(About {
            member: Some(member),
            ..About::default()
        });
        Ok(MemberCaller {
            member: member.to_owned(),
            expires_at_ms: principal.expires_at_ms,
        })
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
