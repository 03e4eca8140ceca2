//! Who a Kubernetes ServiceAccount token speaks for: a TokenReview with the gateway's
//! audience, answered by the API server. Only Pod-bound tokens (projected ServiceAccount
//! tokens) name a Pod; the namespace, ServiceAccount, Pod name and Pod UID all come from the
//! review, never from the caller. Answers are cached briefly (by the token's SHA-256, never the
//! token), reviews are bounded in time and in concurrency, and the API server's answer — which
//! echoes the token — is never logged.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::Semaphore;

/// How long a review's answer is reused. The API server caches successful authentications
/// for about 10 s itself, so a token of a deleted Pod is refused within ~20 s either way.
pub const CACHE_FOR: Duration = Duration::from_secs(10);
/// Refusals are reused for less long: a token may be refused while its Pod is being bound.
pub const CACHE_REFUSAL_FOR: Duration = Duration::from_secs(2);
/// Most cached answers; beyond it, expired answers are dropped, then all.
pub const MAX_CACHED: usize = 4096;
/// Most reviews in flight at once: a flood of bad tokens cannot flood the API server.
pub const MAX_IN_FLIGHT: usize = 16;
/// Bound on one review (waiting for a permit included).
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";
const ACCOUNT_PREFIX: &str = "system:serviceaccount:";

/// The Pod and ServiceAccount a token was issued to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub namespace: String,
    pub service_account: String,
    pub pod_name: String,
    pub pod_uid: String,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The API server did not authenticate the token (invalid, expired, wrong audience, Pod
    /// gone). The API server's reason, bounded.
    #[error("the Kubernetes API server refused the token: {0}")]
    Refused(String),
    /// Authenticated, but not a ServiceAccount token bound to a Pod.
    #[error("the token is not a ServiceAccount token bound to a Pod")]
    NotPodBound,
    #[error("cannot review the token: {0}")]
    Unavailable(String),
}

/// Reads the review's answer.
pub fn account(status: &TokenReviewStatus) -> Result<Account, Error> {
    if status.authenticated != Some(true) {
        let reason = status.error.as_deref().unwrap_or("not authenticated");
        return Err(Error::Refused(plumbing::text::bounded(reason, 256)));
    }
    let user = status.user.as_ref().ok_or(Error::NotPodBound)?;
    let username = user.username.as_deref().ok_or(Error::NotPodBound)?;
    let (namespace, service_account) = username
        .strip_prefix(ACCOUNT_PREFIX)
        .and_then(|rest| rest.split_once(':'))
        .ok_or(Error::NotPodBound)?;
    let extra = |key: &str| {
        user.extra
            .as_ref()
            .and_then(|extra| extra.get(key))
            .and_then(|values| match values.as_slice() {
                [one] if !one.is_empty() => Some(one.clone()),
                _ => None,
            })
    };
    let (Some(pod_name), Some(pod_uid)) = (extra(POD_NAME), extra(POD_UID)) else {
        return Err(Error::NotPodBound);
    };
    if namespace.is_empty() || service_account.is_empty() {
        return Err(Error::NotPodBound);
    }
    Ok(Account {
        namespace: namespace.to_owned(),
        service_account: service_account.to_owned(),
        pod_name,
        pod_uid,
    })
}

/// Reviews a token.
#[async_trait::async_trait]
pub trait Review: Send + Sync + 'static {
    async fn review(&self, token: &str) -> Result<Account, Error>;
}

/// A review's answer and until when it is reused.
type Kept = (Instant, Result<Account, Error>);

/// Answers kept for a while, keyed by the token's digest.
#[derive(Debug, Default)]
pub struct Cache {
    answers: Mutex<HashMap<Vec<u8>, Kept>>,
}

impl Cache {
    pub fn get(&self, digest: &[u8], now: Instant) -> Option<Result<Account, Error>> {
        let answers = self.answers.lock().unwrap_or_else(|p| p.into_inner());
        answers
            .get(digest)
            .filter(|(until, _)| *until > now)
            .map(|(_, answer)| answer.clone())
    }

    /// Keep `answer` (not an `Unavailable` one: that says nothing about the token).
    pub fn put(&self, digest: Vec<u8>, answer: &Result<Account, Error>, now: Instant) {
        let keep_for = match answer {
            Ok(_) => CACHE_FOR,
            Err(Error::Unavailable(_)) => return,
            Err(_) => CACHE_REFUSAL_FOR,
        };
        let mut answers = self.answers.lock().unwrap_or_else(|p| p.into_inner());
        if answers.len() >= MAX_CACHED {
            answers.retain(|_, (until, _)| *until > now);
            if answers.len() >= MAX_CACHED {
                answers.clear();
            }
        }
        answers.insert(digest, (now + keep_for, answer.clone()));
    }
}

/// Reviews through the API server (`create tokenreviews` permission).
pub struct Kube {
    client: Client,
    audience: String,
    cache: Cache,
    permits: Semaphore,
}

impl Kube {
    pub fn new(client: Client, audience: impl Into<String>) -> Self {
        Self {
            client,
            audience: audience.into(),
            cache: Cache::default(),
            permits: Semaphore::new(MAX_IN_FLIGHT),
        }
    }

    async fn ask(&self, token: &str) -> Result<Account, Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| Error::Unavailable("shutting down".into()))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        // The answer echoes the token: only its status is read, nothing of it is logged.
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|err| Error::Unavailable(plumbing::text::bounded(&err.to_string(), 256)))?;
        account(&answer.status.unwrap_or_default())
    }
}

#[async_trait::async_trait]
impl Review for Kube {
    async fn review(&self, token: &str) -> Result<Account, Error> {
        let digest = proto::sha256(token.as_bytes());
        if let Some(answer) = self.cache.get(&digest, Instant::now()) {
            return answer;
        }
        let answer = match tokio::time::timeout(REVIEW_TIMEOUT, self.ask(token)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::Unavailable(format!("no answer within {REVIEW_TIMEOUT:?}"))),
        };
        self.cache.put(digest, &answer, Instant::now());
        answer
    }
}

/// A stand-in for tests without an API server: a token `sa:<namespace>:<account>:<pod>:<uid>`
/// is that Pod's; anything else is refused.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scripted;

impl Scripted {
    /// The token [`Scripted`] takes for `account`.
    pub fn token(account: &Account) -> String {
        format!(
            "sa:{}:{}:{}:{}",
            account.namespace, account.service_account, account.pod_name, account.pod_uid
        )
    }
}

#[async_trait::async_trait]
impl Review for Scripted {
    async fn review(&self, token: &str) -> Result<Account, Error> {
        let parts: Vec<&str> = token.split(':').collect();
        match parts.as_slice() {
            ["sa", namespace, account, pod, uid] => Ok(Account {
                namespace: (*namespace).to_owned(),
                service_account: (*account).to_owned(),
                pod_name: (*pod).to_owned(),
                pod_uid: (*uid).to_owned(),
            }),
            _ => Err(Error::Refused("not a scripted token".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> TokenReviewStatus {
        let path = format!("{}/../testdata/fixtures/kube-api/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let review: TokenReview = serde_json::from_str(&text).expect("a TokenReview");
        review.status.expect("a status")
    }

    #[test]
    fn a_pod_bound_token_names_its_namespace_account_and_pod() {
        let account = account(&fixture("tokenreview-bound-pod-token-authenticated.json")).unwrap();
        assert_eq!(
            account,
            Account {
                namespace: "team-a".into(),
                service_account: "supervision-sidecar".into(),
                pod_name: "agent-s".into(),
                pod_uid: "167e7c5f-8c50-4446-9aed-3aa37eeaac9e".into(),
            }
        );
    }

    #[test]
    fn refusals_have_no_authenticated_field_and_are_refused() {
        for name in ["tokenreview-wrong-audience.json", "tokenreview-bound-pod-deleted.json"] {
            let err = account(&fixture(name)).unwrap_err();
            assert!(
                matches!(err, Error::Refused(ref why) if why.contains("invalid bearer token")),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn tokens_not_bound_to_a_pod_or_not_of_a_service_account_are_refused() {
        let mut status = fixture("tokenreview-bound-pod-token-authenticated.json");
        let user = status.user.as_mut().unwrap();
        user.extra.as_mut().unwrap().remove(POD_UID);
        assert_eq!(account(&status), Err(Error::NotPodBound));

        let mut status = fixture("tokenreview-bound-pod-token-authenticated.json");
        status.user.as_mut().unwrap().username = Some("kubernetes-admin".into());
        assert_eq!(account(&status), Err(Error::NotPodBound));

        let mut status = fixture("tokenreview-bound-pod-token-authenticated.json");
        let extra = status.user.as_mut().unwrap().extra.as_mut().unwrap();
        extra.insert(POD_NAME.into(), vec!["a".into(), "b".into()]);
        assert_eq!(account(&status), Err(Error::NotPodBound));
    }

    #[test]
    fn the_cache_keeps_answers_briefly_and_never_an_outage() {
        let cache = Cache::default();
        let now = Instant::now();
        let ok = account(&fixture("tokenreview-bound-pod-token-authenticated.json"));
        cache.put(vec![1], &ok, now);
        cache.put(vec![2], &Err(Error::Refused("no".into())), now);
        cache.put(vec![3], &Err(Error::Unavailable("down".into())), now);
        assert_eq!(cache.get(&[1], now + Duration::from_secs(1)), Some(ok));
        assert!(cache.get(&[1], now + CACHE_FOR).is_none());
        assert!(cache.get(&[2], now + Duration::from_secs(1)).is_some());
        assert!(cache.get(&[2], now + CACHE_REFUSAL_FOR).is_none());
        assert!(cache.get(&[3], now).is_none());
    }
}
