//! Authenticating sidecars: their instance token (a gateway-signed JWT, `Kind::Instance`) is
//! verified against the gateway trust bundle; its subject names the route and its claims the
//! workload (namespace, name and, when bound, the Pod UID).
//!
//! The bundle comes from the file `trust.jwks` beside the supervisor token file (the gateway
//! delivers both into one directory or Secret), re-read when its modification time or size
//! changes and at once on an unknown `kid`; a `kid` the re-read file still lacks is looked up
//! in the gateway's own bundle (the file may lag: a kubelet sync, a stale delivery). Without a
//! token file, or while that file cannot be read, it comes from the gateway (`recovery.v1.TrustBundle`), fetched again after the
//! bundle's `refresh_after_ms` and on an unknown `kid` (at most once per
//! [`MIN_FORCED_REFRESH`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use plumbing::bundle::BundleFile;

use proto::common::v1::InstanceRef;
use proto::trust::{self, Claims, Expectation, InstanceTokenClaims, Kind, TrustBundle};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::gateway::Gateway;

/// Fastest re-fetch of the gateway bundle forced by an unknown `kid`: a stream of tokens with
/// made-up key ids must not turn into a stream of gateway calls.
pub const MIN_FORCED_REFRESH: Duration = Duration::from_secs(1);

/// Why a sidecar was not authenticated; the message is safe to return to it.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("instance token refused: {0}")]
    Token(#[from] trust::Error),
    #[error("the instance token names no route")]
    NoRoute,
    #[error("the gateway trust bundle is unavailable: {0}")]
    Unavailable(String),
}

pub(crate) struct TrustStore {
    /// The file beside the token file, when one is configured.
    file: Option<Mutex<BundleFile>>,
    gateway: Arc<Gateway>,
    /// The bundle last fetched from the gateway.
    cached: Mutex<Option<Cached>>,
    /// The gateway's bundle, fetched when a token's key is in neither the cached nor the
    /// re-read file (a delivery not yet refreshed by the kubelet, or overwritten by a stale
    /// writer): at most once per [`MIN_FORCED_REFRESH`].
    fetched: Mutex<Option<(Instant, Arc<TrustBundle>)>>,
}

struct Cached {
    bundle: Arc<TrustBundle>,
    /// Fetch again after this long.
    refresh_after: Duration,
    loaded: Instant,
}

impl TrustStore {
    /// `file`: the `trust.jwks` path, when a token file is configured.
    pub(crate) fn new(file: Option<PathBuf>, gateway: Arc<Gateway>) -> Self {
        Self {
            file: file.map(|path| Mutex::new(BundleFile::new(path))),
            gateway,
            cached: Mutex::new(None),
            fetched: Mutex::new(None),
        }
    }

    /// Verifies an instance token and returns the workload it is for.
    pub(crate) async fn instance_of(&self, token: &str) -> Result<Bound, AuthError> {
        let bundle = self.bundle(false).await?;
        let claims = match verify(&bundle, token) {
            Err(trust::Error::UnknownKid(_)) => match verify(self.bundle(true).await?.as_ref(), token) {
                // The file lags behind the gateway: ask the gateway itself.
                Err(trust::Error::UnknownKid(_)) if self.file.is_some() => {
                    verify(self.gateway_bundle().await?.as_ref(), token)?
                }
                other => other?,
            },
            other => other?,
        };
        let route = trust::route_of(&claims.sub).ok_or(AuthError::NoRoute)?.to_owned();
        Ok(Bound {
            route,
            claims: claims.extra,
        })
    }

    async fn bundle(&self, unknown_kid: bool) -> Result<Arc<TrustBundle>, AuthError> {
        let mut file_error = None;
        if let Some(file) = &self.file {
            match file.lock().await.load(unknown_kid).await {
                Ok(bundle) => return Ok(bundle),
                Err(err) => file_error = Some(err.to_string()),
            }
        }
        let mut cached = self.cached.lock().await;
        if let Some(c) = cached.as_ref() {
            let age = c.loaded.elapsed();
            let fresh = if unknown_kid {
                age < MIN_FORCED_REFRESH
            } else {
                age < c.refresh_after
            };
            if fresh {
                return Ok(Arc::clone(&c.bundle));
            }
        }
        match self.fetch().await {
            Ok((bundle, refresh_after)) => Ok(store(&mut cached, bundle, refresh_after)),
            Err(fetch_error) => {
                if let Some(file_error) = &file_error {
                    tracing::warn!(%file_error, %fetch_error, "no trust bundle");
                }
                Err(AuthError::Unavailable(fetch_error))
            }
        }
    }

    /// The gateway's own bundle, fetched at most once per [`MIN_FORCED_REFRESH`].
    async fn gateway_bundle(&self) -> Result<Arc<TrustBundle>, AuthError> {
        let mut fetched = self.fetched.lock().await;
        if let Some((at, bundle)) = fetched.as_ref()
            && at.elapsed() < MIN_FORCED_REFRESH
        {
            return Ok(Arc::clone(bundle));
        }
        let (bundle, _) = self.fetch().await.map_err(AuthError::Unavailable)?;
        let bundle = Arc::new(bundle);
        *fetched = Some((Instant::now(), Arc::clone(&bundle)));
        Ok(bundle)
    }

    async fn fetch(&self) -> Result<(TrustBundle, Duration), String> {
        let response = self.gateway.trust_bundle().await.map_err(|e| e.to_string())?;
        // The JWKS normally names its issuer; the response's issuer field is authoritative.
        let mut set: serde_json::Value =
            serde_json::from_str(&response.jwks_json).map_err(|_| "the gateway's JWKS is not JSON".to_owned())?;
        if !response.issuer.is_empty()
            && let Some(object) = set.as_object_mut()
        {
            object.insert("issuer".into(), response.issuer.clone().into());
        }
        let bundle = TrustBundle::from_jwks(set.to_string().as_bytes()).map_err(|e| e.to_string())?;
        let refresh_after = match response.refresh_after_ms {
            0 => Duration::from_secs(60),
            ms => Duration::from_millis(ms),
        };
        Ok((bundle, refresh_after))
    }
}

/// The workload an instance token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bound {
    pub route: String,
    pub claims: InstanceTokenClaims,
}

impl Bound {
    /// The token names exactly this route and workload (its UID when it carries one).
    pub(crate) fn names(&self, route: &str, instance: &InstanceRef) -> bool {
        self.route == route
            && self.claims.namespace == instance.namespace
            && self.claims.name == instance.name
            && self.claims.uid.as_deref().is_none_or(|uid| uid == instance.uid)
    }
}

fn verify(bundle: &TrustBundle, token: &str) -> Result<Claims<InstanceTokenClaims>, trust::Error> {
    bundle.verify(token, &Expectation::kind(Kind::Instance, &bundle.issuer))
}

fn store(cached: &mut Option<Cached>, bundle: TrustBundle, refresh_after: Duration) -> Arc<TrustBundle> {
    let bundle = Arc::new(bundle);
    *cached = Some(Cached {
        bundle: Arc::clone(&bundle),
        refresh_after,
        loaded: Instant::now(),
    });
    bundle
}
