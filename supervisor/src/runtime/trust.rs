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
//!
//! No lock is held across a gateway call: one fetch is in flight at a time, shared by every
//! caller that needs it (`futures::future::Shared`), while callers the cached bundle serves
//! are answered from it at once. A fetch runs in a task of its own and keeps its answer, so
//! it progresses and counts whether or not a caller still waits.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as SyncMutex, PoisonError};
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use plumbing::bundle::BundleFile;
use proto::common::v1::InstanceRef;
use proto::trust::{self, Claims, Expectation, InstanceTokenClaims, Kind, TrustBundle};
use tokio::sync::Mutex;
use tokio::time::Instant;

use proto::recovery::v1::TrustBundleResponse;

use crate::gateway::{CallError, Gateway};

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
    /// The file beside the token file, when one is configured (held while it is read).
    file: Option<Mutex<BundleFile>>,
    /// recovery.v1.TrustBundle (the gateway's client; a scripted one in the unit tests).
    ask: Ask,
    /// The bundle last fetched from the gateway, kept by the fetch itself (whether or not a
    /// caller still waits). Also asked for when a token's key is in neither the cached nor the
    /// re-read file (a delivery not yet refreshed by the kubelet, or overwritten by a stale
    /// writer): then fetched at most once per [`MIN_FORCED_REFRESH`].
    cached: Arc<SyncMutex<Option<Cached>>>,
    /// The one TrustBundle call in flight, joined by every caller that needs one.
    inflight: SyncMutex<Option<(Fetch, Arc<AtomicBool>)>>,
}

/// Starts a recovery.v1.TrustBundle call.
type Ask = Arc<dyn Fn() -> BoxFuture<'static, Result<TrustBundleResponse, CallError>> + Send + Sync>;

/// A TrustBundle call and its parsed answer, shareable between callers.
type Fetch = Shared<BoxFuture<'static, Result<Arc<TrustBundle>, String>>>;

struct Cached {
    bundle: Arc<TrustBundle>,
    /// Fetch again after this long.
    refresh_after: Duration,
    loaded: Instant,
}

impl TrustStore {
    /// `file`: the `trust.jwks` path, when a token file is configured.
    pub(crate) fn new(file: Option<PathBuf>, gateway: Arc<Gateway>) -> Self {
        let ask: Ask = Arc::new(move || {
            let gateway = Arc::clone(&gateway);
            async move { gateway.trust_bundle().await }.boxed()
        });
        Self::asking(file, ask)
    }

    fn asking(file: Option<PathBuf>, ask: Ask) -> Self {
        Self {
            file: file.map(|path| Mutex::new(BundleFile::new(path))),
            ask,
            cached: Arc::default(),
            inflight: SyncMutex::new(None),
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
        if let Some(c) = lock(&self.cached).as_ref() {
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
            Ok(bundle) => Ok(bundle),
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
        if let Some(c) = lock(&self.cached).as_ref()
            && c.loaded.elapsed() < MIN_FORCED_REFRESH
        {
            return Ok(Arc::clone(&c.bundle));
        }
        self.fetch().await.map_err(AuthError::Unavailable)
    }

    /// Joins the TrustBundle call in flight, or starts one; no lock is held while it runs. The
    /// call runs in a task of its own and keeps its bundle: a caller that gave up (a sidecar's
    /// hello has a deadline) neither stalls it nor throws its answer away.
    async fn fetch(&self) -> Result<Arc<TrustBundle>, String> {
        let call = {
            let mut inflight = lock(&self.inflight);
            match inflight.as_ref() {
                // Joined only while the task runs: an ended one's answer is in the cache, or
                // was an error worth asking again.
                Some((call, done)) if !done.load(Ordering::Acquire) => call.clone(),
                _ => {
                    let cached = Arc::clone(&self.cached);
                    let ask = (self.ask)();
                    let done = Arc::new(AtomicBool::new(false));
                    let ended = Arc::clone(&done);
                    let task = tokio::spawn(async move {
                        let _ended = SetOnDrop(ended);
                        let (bundle, refresh_after) = fetch(ask).await?;
                        *lock(&cached) = Some(Cached {
                            bundle: Arc::clone(&bundle),
                            refresh_after,
                            loaded: Instant::now(),
                        });
                        Ok(bundle)
                    });
                    let call = async move {
                        task.await
                            .unwrap_or_else(|err| Err(format!("the TrustBundle call ended: {err}")))
                    }
                    .boxed()
                    .shared();
                    *inflight = Some((call.clone(), done));
                    call
                }
            }
        };
        call.await
    }
}

/// Sets its flag when dropped: at the end of the task that holds it, however it ends.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// recovery.v1.TrustBundle, parsed.
async fn fetch(
    call: BoxFuture<'static, Result<TrustBundleResponse, CallError>>,
) -> Result<(Arc<TrustBundle>, Duration), String> {
    let response = call.await.map_err(|e| e.to_string())?;
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
    Ok((Arc::new(bundle), refresh_after))
}

/// The lock's value; nothing panics while holding these locks, and their values stay valid.
fn lock<T>(mutex: &SyncMutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::{mpsc, oneshot};

    use super::*;

    type Answer = oneshot::Sender<Result<TrustBundleResponse, CallError>>;

    /// A store without a trust file whose TrustBundle calls the test answers.
    fn scripted() -> (TrustStore, mpsc::UnboundedReceiver<Answer>, Arc<AtomicUsize>) {
        let (calls, asked) = mpsc::unbounded_channel();
        let count = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&count);
        let ask: Ask = Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            let (answer, answered) = oneshot::channel();
            let _ = calls.send(answer);
            async move { answered.await.unwrap_or(Err(CallError::Invalid("not answered"))) }.boxed()
        });
        (TrustStore::asking(None, ask), asked, count)
    }

    fn bundle() -> TrustBundleResponse {
        let mut bundle = TrustBundle::new(trust::DEFAULT_ISSUER);
        let key = ed25519_dalek::SigningKey::from_bytes(&[1; 32]).verifying_key();
        bundle.keys.insert("gateway-key-1".into(), key);
        TrustBundleResponse {
            jwks_json: bundle.to_jwks(),
            issuer: trust::DEFAULT_ISSUER.into(),
            refresh_after_ms: 0,
        }
    }

    async fn within<T>(future: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), future)
            .await
            .unwrap_or_else(|_| panic!("still waiting"))
    }

    #[tokio::test(start_paused = true)]
    async fn a_forced_refresh_in_flight_holds_up_no_caller_the_cached_bundle_serves() {
        let (store, mut asked, count) = scripted();
        let store = Arc::new(store);
        let first = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.bundle(false).await.map(|_| ()) }
        });
        within(asked.recv()).await.unwrap().send(Ok(bundle())).unwrap();
        within(first).await.unwrap().unwrap();

        // An unknown key a second later forces a fetch; the gateway does not answer it yet.
        tokio::time::advance(MIN_FORCED_REFRESH).await;
        let forced = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.bundle(true).await.map(|_| ()) }
        });
        let held = within(asked.recv()).await.unwrap();
        // Callers the cached bundle serves are answered meanwhile; other forced ones join the
        // call in flight instead of making another.
        within(store.bundle(false)).await.unwrap();
        let joined = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.bundle(true).await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert!(!forced.is_finished() && !joined.is_finished());
        held.send(Ok(bundle())).unwrap();
        within(forced).await.unwrap().unwrap();
        within(joined).await.unwrap().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 2, "one call per refresh");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fetch_whose_caller_gave_up_still_completes_and_serves_the_next_caller() {
        let (store, mut asked, count) = scripted();
        // The caller (a sidecar's hello with its deadline) gives up before the gateway answers.
        let gave_up = tokio::time::timeout(Duration::from_millis(100), store.bundle(false)).await;
        assert!(gave_up.is_err());
        within(asked.recv()).await.unwrap().send(Ok(bundle())).unwrap();
        // Nobody waits now: the fetch completes on its own and keeps its bundle.
        within(async {
            while lock(&store.cached).is_none() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        within(store.bundle(false)).await.unwrap();
        within(store.gateway_bundle()).await.unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1, "no second call");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_fetch_nobody_waited_for_is_asked_again_not_joined() {
        let (store, mut asked, count) = scripted();
        let gave_up = tokio::time::timeout(Duration::from_millis(100), store.bundle(false)).await;
        assert!(gave_up.is_err());
        within(asked.recv())
            .await
            .unwrap()
            .send(Err(CallError::Invalid("down")))
            .unwrap();
        // The failed fetch ends with nobody waiting; a later caller asks again.
        within(async {
            while !lock(&store.inflight)
                .as_ref()
                .is_some_and(|(_, done)| done.load(Ordering::Acquire))
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        let again = tokio::spawn({
            let store = Arc::new(store);
            async move { store.bundle(false).await.map(|_| ()) }
        });
        within(asked.recv()).await.unwrap().send(Ok(bundle())).unwrap();
        within(again).await.unwrap().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }
}
