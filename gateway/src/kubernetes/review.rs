//! Who a Kubernetes ServiceAccount token speaks for: a TokenReview with the gateway's
//! audience, answered by the API server. Only Pod-bound tokens (projected ServiceAccount
//! tokens) name a Pod; the namespace, ServiceAccount, Pod name and Pod UID all come from the
//! review, never from the caller. Answers are cached briefly (by the token's SHA-256, never the
//! token), reviews are bounded in time and in concurrency — [`MAX_IN_FLIGHT`] in all and
//! [`MAX_IN_FLIGHT_PER_SOURCE`] per peer, so one source cannot hold every slot — and the API
//! server's answer — which echoes the token — is never logged.
//!
//! Only what could be a projected ServiceAccount token for the gateway is reviewed
//! ([`plausible`]): a compact JWT within [`proto::trust::MAX_TOKEN_BYTES`], a JSON header with
//! an `alg`, an unverified payload whose `aud` includes the gateway's audience and whose `exp`
//! is in the future. That is a pre-filter only: the claims are not trusted, the TokenReview
//! stays the authority; it keeps distinct garbage strings from costing a review each.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
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
/// Most reviews in flight at once for one source (peer IP address).
pub const MAX_IN_FLIGHT_PER_SOURCE: usize = 4;
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
    /// Not worth a review: not a compact JWT for the gateway's audience, or expired. Says
    /// which check failed, never what the token holds.
    #[error("not a ServiceAccount token for this gateway: {0}")]
    Malformed(&'static str),
    /// The caller's source has [`MAX_IN_FLIGHT_PER_SOURCE`] reviews in flight already.
    #[error(
        "too many token reviews in flight from this peer (at most {MAX_IN_FLIGHT_PER_SOURCE}); retry when they are answered"
    )]
    Busy,
}

/// Where a call came from: the peer's IP address, when the transport says.
pub type Source = Option<IpAddr>;

/// Whether `token` could be a projected ServiceAccount token for `audience`, valid at
/// `now_s` (seconds since the Unix epoch), judging by its unverified parts only.
pub fn plausible(token: &str, audience: &str, now_s: i64) -> Result<(), Error> {
    use base64::Engine as _;

    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Audiences {
        One(String),
        Many(Vec<String>),
    }
    #[derive(serde::Deserialize)]
    struct Unverified {
        aud: Option<Audiences>,
        exp: Option<i64>,
    }
    if token.len() > proto::trust::MAX_TOKEN_BYTES {
        return Err(Error::Malformed("longer than a token can be"));
    }
    let segments: Vec<&str> = token.split('.').collect();
    let [_, _, signature] = segments.as_slice() else {
        return Err(Error::Malformed("not three dot-separated segments"));
    };
    if signature.is_empty()
        || base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(signature)
            .is_err()
    {
        return Err(Error::Malformed("the signature segment is not base64url"));
    }
    let decoded = jsonwebtoken::dangerous::insecure_decode::<Unverified>(token)
        .map_err(|_| Error::Malformed("the header or payload is not base64url JSON with an alg"))?;
    let audiences = match decoded.claims.aud {
        Some(Audiences::One(one)) => vec![one],
        Some(Audiences::Many(many)) => many,
        None => Vec::new(),
    };
    if !audiences.iter().any(|a| a == audience) {
        return Err(Error::Malformed("its audience is not the gateway's"));
    }
    if decoded.claims.exp.is_none_or(|exp| exp <= now_s) {
        return Err(Error::Malformed("expired, or no expiry"));
    }
    Ok(())
}

/// Reviews in flight per source.
#[derive(Debug, Default)]
pub struct PerSource {
    in_flight: Arc<Mutex<HashMap<Source, usize>>>,
}

/// One review in flight for its source; dropping it ends it.
#[derive(Debug)]
pub struct InFlight {
    source: Source,
    in_flight: Arc<Mutex<HashMap<Source, usize>>>,
}

impl PerSource {
    /// A slot for one more review of `source`, unless it has `limit` in flight.
    pub fn enter(&self, source: Source, limit: usize) -> Result<InFlight, Error> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let count = in_flight.entry(source).or_default();
        if *count >= limit {
            return Err(Error::Busy);
        }
        *count += 1;
        Ok(InFlight {
            source,
            in_flight: self.in_flight.clone(),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = in_flight.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&self.source);
            }
        }
    }
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

/// Reviews a token a call from `source` carried.
#[async_trait::async_trait]
pub trait Review: Send + Sync + 'static {
    async fn review(&self, token: &str, source: Source) -> Result<Account, Error>;
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
            Err(Error::Unavailable(_) | Error::Busy | Error::Malformed(_)) => return,
            Err(Error::Refused(_) | Error::NotPodBound) => CACHE_REFUSAL_FOR,
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
    per_source: PerSource,
}

impl Kube {
    pub fn new(client: Client, audience: impl Into<String>) -> Self {
        Self {
            client,
            audience: audience.into(),
            cache: Cache::default(),
            permits: Semaphore::new(MAX_IN_FLIGHT),
            per_source: PerSource::default(),
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
    async fn review(&self, token: &str, source: Source) -> Result<Account, Error> {
        plausible(
            token,
            &self.audience,
            proto::trust::unix_ms(std::time::SystemTime::now()) / 1000,
        )?;
        let digest = proto::sha256(token.as_bytes());
        if let Some(answer) = self.cache.get(&digest, Instant::now()) {
            return answer;
        }
        let _in_flight = self.per_source.enter(source, MAX_IN_FLIGHT_PER_SOURCE)?;
        let answer = match tokio::time::timeout(REVIEW_TIMEOUT, self.ask(token)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::Unavailable(format!("no answer within {REVIEW_TIMEOUT:?}"))),
        };
        self.cache.put(digest, &answer, Instant::now());
        answer
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

    /// A compact JWT with `payload` (unsigned: only its shape matters here).
    pub(crate) fn jwt(payload: &serde_json::Value) -> String {
        use base64::Engine as _;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        format!(
            "{}.{}.{}",
            b64(br#"{"alg":"RS256","kid":"k"}"#),
            b64(payload.to_string().as_bytes()),
            b64(b"signature")
        )
    }

    #[test]
    fn only_a_compact_jwt_for_the_gateway_audience_and_not_expired_is_worth_a_review() {
        let now = 1_700_000_000;
        let aud = "openshell-gateway";
        let good = jwt(&serde_json::json!({"aud": [aud, "other"], "exp": now + 3600, "sub": "x"}));
        assert_eq!(plausible(&good, aud, now), Ok(()));
        let one = jwt(&serde_json::json!({"aud": aud, "exp": now + 1}));
        assert_eq!(plausible(&one, aud, now), Ok(()));
        let refused = [
            "garbage".to_owned(),
            "a.b".to_owned(),
            "a.b.c.d".to_owned(),
            "!!.??.**".to_owned(),
            format!("{}.", &good[..good.rfind('.').unwrap()]),
            jwt(&serde_json::json!({"aud": ["kubernetes"], "exp": now + 3600})),
            jwt(&serde_json::json!({"aud": [aud], "exp": now})),
            jwt(&serde_json::json!({"aud": [aud]})),
            jwt(&serde_json::json!({"exp": now + 3600})),
            "x".repeat(proto::trust::MAX_TOKEN_BYTES + 1),
        ];
        for token in refused {
            assert!(
                matches!(plausible(&token, aud, now), Err(Error::Malformed(_))),
                "{token:.60}"
            );
        }
        // A header without alg.
        use base64::Engine as _;
        let b64 = |t: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(t);
        let no_alg = format!(
            "{}.{}.{}",
            b64("{}"),
            b64(r#"{"aud":"openshell-gateway","exp":9999999999}"#),
            b64("s")
        );
        assert!(matches!(plausible(&no_alg, aud, now), Err(Error::Malformed(_))));
    }

    #[test]
    fn one_source_holds_at_most_its_share_of_reviews() {
        let per_source = PerSource::default();
        let a: Source = Some("10.0.0.1".parse().unwrap());
        let b: Source = Some("10.0.0.2".parse().unwrap());
        let held: Vec<InFlight> = (0..MAX_IN_FLIGHT_PER_SOURCE)
            .map(|_| per_source.enter(a, MAX_IN_FLIGHT_PER_SOURCE).unwrap())
            .collect();
        assert!(matches!(
            per_source.enter(a, MAX_IN_FLIGHT_PER_SOURCE),
            Err(Error::Busy)
        ));
        let other = per_source.enter(b, MAX_IN_FLIGHT_PER_SOURCE).unwrap();
        drop(held);
        drop(other);
        assert!(per_source.in_flight.lock().unwrap().is_empty());
        assert!(per_source.enter(a, MAX_IN_FLIGHT_PER_SOURCE).is_ok());
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
