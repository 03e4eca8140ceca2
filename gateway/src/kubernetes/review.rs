//! Who a Kubernetes ServiceAccount token speaks for: a TokenReview with the gateway's
//! audience, answered by the API server. Only Pod-bound tokens (projected ServiceAccount
//! tokens) name a Pod; the namespace, ServiceAccount, Pod name and Pod UID all come from the
//! review, never from the caller. Answers are cached briefly (by the token's SHA-256, never the
//! token), each review runs to its end in a task of its own and a caller of the same token
//! joins it ([`Answers`]: a caller that gave up does not throw the review away), reviews are bounded in time and in concurrency — [`MAX_IN_FLIGHT`] in all and
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
use std::future::Future;

use tokio::sync::{Semaphore, watch};

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

/// What is known of one token: an answer reused until an instant, or a review in flight.
#[derive(Debug)]
enum Entry {
    Kept(Instant, Result<Account, Error>),
    Asking(watch::Receiver<Option<Result<Account, Error>>>),
}

/// Answers kept for a while, keyed by the token's digest, and the reviews in flight.
///
/// A review runs to its end in a task of its own and its answer is kept whoever still waits:
/// a member must have its Attach answered within [`proto::timing::CONNECT_TIMEOUT`], so a
/// review slower than that, dropped with the call and started over by the retry, would keep
/// the member out for as long as the API server stays slow. A token asked about again joins
/// the review in flight (one review per token at a time).
#[derive(Debug, Default)]
pub struct Answers {
    entries: Mutex<HashMap<Vec<u8>, Entry>>,
}

impl Answers {
    /// Keep `answer` (not an `Unavailable` one: that says nothing about the token).
    pub fn put(&self, digest: Vec<u8>, answer: &Result<Account, Error>, now: Instant) {
        let keep_for = match answer {
            Ok(_) => Some(CACHE_FOR),
            Err(Error::Unavailable(_) | Error::Busy | Error::Malformed(_)) => None,
            Err(Error::Refused(_) | Error::NotPodBound) => Some(CACHE_REFUSAL_FOR),
        };
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let Some(keep_for) = keep_for else {
            entries.remove(&digest);
            return;
        };
        Self::make_room(&mut entries, now);
        entries.insert(digest, Entry::Kept(now + keep_for, answer.clone()));
    }

    /// The answer for `digest`: kept, joined in flight, or asked by `ask` in a task of its own
    /// (holding `in_flight` until it ends), waiting at most [`REVIEW_TIMEOUT`] for it.
    pub async fn answer<A>(
        self: &Arc<Self>,
        digest: Vec<u8>,
        in_flight: impl FnOnce() -> Result<InFlight, Error>,
        ask: A,
    ) -> Result<Account, Error>
    where
        A: Future<Output = Result<Account, Error>> + Send + 'static,
    {
        let mut answer = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            match entries.get(&digest) {
                Some(Entry::Kept(until, answer)) if *until > now => return answer.clone(),
                Some(Entry::Asking(answer)) => answer.clone(),
                _ => {
                    let in_flight = in_flight()?;
                    let (tell, answer) = watch::channel(None);
                    Self::make_room(&mut entries, now);
                    entries.insert(digest.clone(), Entry::Asking(answer.clone()));
                    let answers = Arc::clone(self);
                    tokio::spawn(async move {
                        let _in_flight = in_flight;
                        // However the task ends, the token is not left "asking" for good.
                        let mut asking = Pending {
                            answers,
                            digest: Some(digest),
                        };
                        let answer = match tokio::time::timeout(REVIEW_TIMEOUT, ask).await {
                            Ok(answer) => answer,
                            Err(_) => Err(Error::Unavailable(format!("no answer within {REVIEW_TIMEOUT:?}"))),
                        };
                        asking.answered(&answer);
                        tell.send_replace(Some(answer));
                    });
                    answer
                }
            }
        };
        let waited = tokio::time::timeout(REVIEW_TIMEOUT, answer.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(answer)) => answer
                .clone()
                .unwrap_or_else(|| Err(Error::Unavailable("no answer".into()))),
            Ok(Err(_)) => Err(Error::Unavailable("the review ended without an answer".into())),
            Err(_) => Err(Error::Unavailable(format!("no answer within {REVIEW_TIMEOUT:?}"))),
        }
    }

    /// The answer kept for `digest` at `now`, if any.
    #[cfg(test)]
    fn kept(&self, digest: &[u8], now: Instant) -> Option<Result<Account, Error>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        match entries.get(digest) {
            Some(Entry::Kept(until, answer)) if *until > now => Some(answer.clone()),
            _ => None,
        }
    }

    /// Room for one more entry: expired answers go, then every answer (reviews in flight
    /// stay: each is bounded by its task).
    fn make_room(entries: &mut HashMap<Vec<u8>, Entry>, now: Instant) {
        if entries.len() < MAX_CACHED {
            return;
        }
        entries.retain(|_, entry| match entry {
            Entry::Kept(until, _) => *until > now,
            Entry::Asking(_) => true,
        });
        if entries.len() >= MAX_CACHED {
            entries.retain(|_, entry| matches!(entry, Entry::Asking(_)));
        }
    }
}

/// A review in flight; dropped before its answer (the task ended otherwise), it forgets the
/// token's entry so that the next caller asks again.
struct Pending {
    answers: Arc<Answers>,
    /// `None` once answered.
    digest: Option<Vec<u8>>,
}

impl Pending {
    fn answered(&mut self, answer: &Result<Account, Error>) {
        if let Some(digest) = self.digest.take() {
            self.answers.put(digest, answer, Instant::now());
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(digest) = self.digest.take() else {
            return;
        };
        let mut entries = self.answers.entries.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(entries.get(&digest), Some(Entry::Asking(_))) {
            entries.remove(&digest);
        }
    }
}

/// Reviews through the API server (`create tokenreviews` permission).
pub struct Kube {
    asker: Arc<Asker>,
    answers: Arc<Answers>,
    per_source: PerSource,
}

/// What a review task needs.
struct Asker {
    client: Client,
    audience: String,
    permits: Semaphore,
}

impl Kube {
    pub fn new(client: Client, audience: impl Into<String>) -> Self {
        Self {
            asker: Arc::new(Asker {
                client,
                audience: audience.into(),
                permits: Semaphore::new(MAX_IN_FLIGHT),
            }),
            answers: Arc::default(),
            per_source: PerSource::default(),
        }
    }
}

impl Asker {
    async fn ask(&self, token: String) -> Result<Account, Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| Error::Unavailable("shutting down".into()))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token,
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
            &self.asker.audience,
            proto::trust::unix_ms(std::time::SystemTime::now()) / 1000,
        )?;
        let digest = proto::sha256(token.as_bytes());
        let asker = Arc::clone(&self.asker);
        let token = token.to_owned();
        self.answers
            .answer(
                digest,
                || self.per_source.enter(source, MAX_IN_FLIGHT_PER_SOURCE),
                async move { asker.ask(token).await },
            )
            .await
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
    fn answers_are_kept_briefly_and_never_an_outage() {
        let answers = Answers::default();
        let now = Instant::now();
        let ok = account(&fixture("tokenreview-bound-pod-token-authenticated.json"));
        answers.put(vec![1], &ok, now);
        answers.put(vec![2], &Err(Error::Refused("no".into())), now);
        answers.put(vec![3], &Err(Error::Unavailable("down".into())), now);
        assert_eq!(answers.kept(&[1], now + Duration::from_secs(1)), Some(ok));
        assert!(answers.kept(&[1], now + CACHE_FOR).is_none());
        assert!(answers.kept(&[2], now + Duration::from_secs(1)).is_some());
        assert!(answers.kept(&[2], now + CACHE_REFUSAL_FOR).is_none());
        assert!(answers.kept(&[3], now).is_none());
    }

    /// A review that answers `answer` once `gate` opens, counting how often it was asked.
    fn gated(
        asked: &Arc<std::sync::atomic::AtomicUsize>,
        gate: &watch::Receiver<bool>,
        answer: Result<Account, Error>,
    ) -> impl Future<Output = Result<Account, Error>> + Send + 'static {
        asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut gate = gate.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            answer
        }
    }

    /// Answers, a source's slots, a count of reviews asked, a gate they wait on, a good answer.
    struct Setup {
        answers: Arc<Answers>,
        per_source: PerSource,
        asked: Arc<std::sync::atomic::AtomicUsize>,
        open: watch::Sender<bool>,
        gate: watch::Receiver<bool>,
        ok: Result<Account, Error>,
    }

    impl Setup {
        fn new() -> Self {
            let (open, gate) = watch::channel(false);
            Self {
                answers: Arc::default(),
                per_source: PerSource::default(),
                asked: Arc::default(),
                open,
                gate,
                ok: account(&fixture("tokenreview-bound-pod-token-authenticated.json")),
            }
        }
    }

    fn slot(per_source: &PerSource) -> impl FnOnce() -> Result<InFlight, Error> + '_ {
        || per_source.enter(None, MAX_IN_FLIGHT_PER_SOURCE)
    }

    #[tokio::test]
    async fn a_review_slower_than_its_caller_is_still_kept_and_the_retry_does_not_ask_again() {
        let t = Setup::new();

        // The caller gives up (a member's 1 s connect time-out) before the API server t.answers.
        let first = t
            .answers
            .answer(vec![7], slot(&t.per_source), gated(&t.asked, &t.gate, t.ok.clone()));
        assert!(tokio::time::timeout(Duration::from_millis(20), first).await.is_err());
        t.open.send_replace(true);

        // Its retry joins the review still in flight, or finds its answer kept: never a second review.
        let retry = t.answers.answer(vec![7], slot(&t.per_source), async {
            Err(Error::Unavailable("t.asked again".into()))
        });
        assert_eq!(retry.await, t.ok);
        assert_eq!(t.asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The review's slot of its source is given back when it ends.
        tokio::time::timeout(Duration::from_secs(5), async {
            while !t.per_source.in_flight.lock().unwrap().is_empty() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the review's slot is given back");
    }

    #[tokio::test]
    async fn callers_of_one_token_share_one_review() {
        let t = Setup::new();
        let first = t
            .answers
            .answer(vec![7], slot(&t.per_source), gated(&t.asked, &t.gate, t.ok.clone()));
        let second = t.answers.answer(vec![7], slot(&t.per_source), async {
            Err(Error::Unavailable("t.asked again".into()))
        });
        let other = t.answers.answer(
            vec![8],
            slot(&t.per_source),
            gated(&t.asked, &t.gate, Err(Error::NotPodBound)),
        );
        t.open.send_replace(true);
        let (first, second, other) = tokio::join!(first, second, other);
        assert_eq!((first, second), (t.ok.clone(), t.ok));
        assert_eq!(other, Err(Error::NotPodBound));
        assert_eq!(t.asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_outage_is_asked_again_and_a_busy_source_asks_nothing() {
        let answers = Arc::new(Answers::default());
        let per_source = PerSource::default();
        let down = answers.answer(vec![7], slot(&per_source), async {
            Err(Error::Unavailable("down".into()))
        });
        assert!(matches!(down.await, Err(Error::Unavailable(_))));
        let ok = account(&fixture("tokenreview-bound-pod-token-authenticated.json"));
        let answer = ok.clone();
        assert_eq!(
            answers.answer(vec![7], slot(&per_source), async move { answer }).await,
            ok
        );

        let busy = answers.answer(vec![9], || Err(Error::Busy), async { panic!("asked while busy") });
        assert_eq!(busy.await, Err(Error::Busy));
    }
}
