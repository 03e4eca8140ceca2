//! Signing-key rotation: [`plan`], a pure function of the stored keys and the database time,
//! and [`rotate`], the coordinator's thin applier through [`Store::write_fenced`].
//!
//! Lifecycle of a key: created (published in the trust bundle at once) → signer (the oldest
//! key not retired) → retired (still published) → deleted. A new key is created when the
//! signer is `rotate_after` old and no newer key is pending; it becomes the signer once it
//! has been published for `publish_ahead`, which retires every older key — so verifiers that
//! refresh their bundle within `publish_ahead` (the mounted Secret lags) know a key before
//! any token carries it. A retired key is deleted once every token it could have signed has
//! expired: `max_token_lifetime` + clock skew + `publish_ahead` (the bound on how long a
//! replica with a stale keyring may still sign with it) after its retirement.
//!
//! Every pass also re-seals the private key of each kept row that is not sealed with the
//! current key-encryption key (rows under the previous KEK, or stored unsealed by an older
//! gateway), through the same fenced write.

use std::time::Duration;

use proto::timing::{MAX_CLOCK_SKEW, SUPERVISOR_TOKEN_LIFETIME};

use super::Error;
use super::keys::KeyPair;
use crate::store::sealing::{self, Keks};
use crate::store::{FencedWrite, Lease, SigningKey, Store};

/// Rotation periods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Age of the signer at which its successor is created (12 h).
    pub rotate_after: Duration,
    /// How long a new key is published before it signs (10 min). Every replica must reload
    /// its keyring, and every verifier its trust bundle, more often than this.
    pub publish_ahead: Duration,
    /// Longest lifetime of any token the gateway mints ([`SUPERVISOR_TOKEN_LIFETIME`]).
    pub max_token_lifetime: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            rotate_after: Duration::from_secs(12 * 3600),
            publish_ahead: Duration::from_secs(600),
            max_token_lifetime: SUPERVISOR_TOKEN_LIFETIME,
        }
    }
}

impl Policy {
    /// How long a retired key stays published.
    pub fn retention(&self) -> Duration {
        self.max_token_lifetime + MAX_CLOCK_SKEW + self.publish_ahead
    }

    /// Whether `key` still verifies tokens at `now_ms`: live, or retired within the
    /// retention. A rotation deletes only keys past it, so such a key missing from the store
    /// was lost, not deleted.
    pub fn still_needed(&self, key: &SigningKey, now_ms: i64) -> bool {
        key.retired_at_ms
            .is_none_or(|retired| now_ms < retired.saturating_add(millis(self.retention())))
    }
}

/// What one rotation step writes, and the `kid`s it concerns.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub writes: Vec<FencedWrite>,
    pub created: Option<String>,
    pub retired: Vec<String>,
    pub deleted: Vec<String>,
    /// Rows re-sealed with the current key-encryption key.
    pub resealed: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }
}

/// The key tokens are signed with: the oldest key not retired (ties by `kid`).
pub fn signer(keys: &[SigningKey]) -> Option<&SigningKey> {
    live(keys).into_iter().next()
}

/// Keys not retired, oldest first.
fn live(keys: &[SigningKey]) -> Vec<&SigningKey> {
    let mut live: Vec<&SigningKey> = keys.iter().filter(|k| k.retired_at_ms.is_none()).collect();
    live.sort_by(|a, b| (a.created_at_ms, &a.kid).cmp(&(b.created_at_ms, &b.kid)));
    live
}

/// The rotation step for `keys` at database time `now_ms`. `fresh` is called only when a key
/// must be created (it returns the new record, sealed); rows kept and not sealed with `keks`'
/// current KEK are re-sealed with it. Pure but for `fresh` and the sealing's random nonces.
pub fn plan(
    keys: &[SigningKey],
    now_ms: i64,
    policy: &Policy,
    keks: &Keks,
    fresh: impl FnOnce() -> Result<SigningKey, Error>,
) -> Result<Plan, Error> {
    let age = |k: &SigningKey| now_ms.saturating_sub(k.created_at_ms);
    let live = live(keys);
    let mut plan = Plan::default();

    match live.as_slice() {
        [] => create(&mut plan, fresh, now_ms)?,
        [only] if age(only) >= millis(policy.rotate_after) => create(&mut plan, fresh, now_ms)?,
        _ => {}
    }
    for key in keys {
        if let Some(retired_at) = key.retired_at_ms
            && now_ms >= retired_at.saturating_add(millis(policy.retention()))
        {
            plan.deleted.push(key.kid.clone());
        }
    }
    // Kept rows as they will be written: re-sealed, then retired, one write per row.
    let mut updated: Vec<SigningKey> = Vec::new();
    for key in keys {
        if !plan.deleted.contains(&key.kid) && sealing::sealed_with(key) != Some(keks.current().id()) {
            plan.resealed.push(key.kid.clone());
            updated.push(KeyPair::reseal(key, keks)?);
        }
    }
    // The newest key published long enough becomes the signer; older live keys retire.
    let promoted = live.iter().rposition(|k| age(k) >= millis(policy.publish_ahead));
    for key in &live[..promoted.unwrap_or(0)] {
        plan.retired.push(key.kid.clone());
        match updated.iter_mut().find(|u| u.kid == key.kid) {
            Some(resealed) => resealed.retired_at_ms = Some(now_ms),
            None => updated.push(SigningKey {
                retired_at_ms: Some(now_ms),
                ..(*key).clone()
            }),
        }
    }
    plan.writes.extend(updated.into_iter().map(FencedWrite::PutSigningKey));
    plan.writes.extend(
        plan.deleted
            .iter()
            .map(|kid| FencedWrite::DeleteSigningKey { kid: kid.clone() }),
    );
    Ok(plan)
}

fn create(plan: &mut Plan, fresh: impl FnOnce() -> Result<SigningKey, Error>, now_ms: i64) -> Result<(), Error> {
    let key = SigningKey {
        created_at_ms: now_ms,
        retired_at_ms: None,
        ..fresh()?
    };
    plan.created = Some(key.kid.clone());
    plan.writes.push(FencedWrite::PutSigningKey(key));
    Ok(())
}

/// One rotation step by the coordinator: read the keys, [`plan`] at `now_ms` (pass the
/// database clock, [`Store::now_ms`]), and apply the plan in one fenced write. A stale lease
/// gets `Error::Store(store::Error::Fenced(_))` and nothing is written. Call it from the
/// coordinator only, from one task, about once a minute.
///
/// New keys are sealed with the store's current key-encryption key ([`Store::keks`]); a
/// store without one refuses (`sealing::Error::NoKek`): keys are never stored unsealed.
pub async fn rotate(store: &Store, lease: &Lease, policy: &Policy, now_ms: i64) -> Result<Plan, Error> {
    let keks = store.keks().ok_or(sealing::Error::NoKek)?;
    let keys = store.list_signing_keys().await?;
    let plan = plan(&keys, now_ms, policy, keks, || {
        KeyPair::generate()?.to_record(keks.current())
    })?;
    if !plan.is_empty() {
        store.write_fenced(lease, &plan.writes).await?;
    }
    Ok(plan)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;
    use crate::store::SecretBytes;
    use crate::store::sealing::Kek;

    const H: i64 = 3600 * 1000;
    const MIN: i64 = 60 * 1000;

    fn keks() -> &'static Keks {
        static KEKS: OnceLock<Keks> = OnceLock::new();
        KEKS.get_or_init(|| Keks::new(Kek::generate().unwrap(), None))
    }

    /// A real key named `kid`, sealed with `keks()`.
    fn key(kid: &str, created_at_ms: i64, retired_at_ms: Option<i64>) -> SigningKey {
        let pair = KeyPair::generate().unwrap().with_kid(kid);
        SigningKey {
            created_at_ms,
            retired_at_ms,
            ..pair.to_record(keks().current()).unwrap()
        }
    }

    /// Apply a plan to an in-memory key list, as the store would.
    fn apply(keys: &mut Vec<SigningKey>, plan: &Plan) {
        for write in &plan.writes {
            match write {
                FencedWrite::PutSigningKey(k) => {
                    keys.retain(|old| old.kid != k.kid);
                    keys.push(k.clone());
                }
                FencedWrite::DeleteSigningKey { kid } => keys.retain(|old| &old.kid != kid),
                other => panic!("unexpected write {other:?}"),
            }
        }
    }

    fn step(keys: &mut Vec<SigningKey>, now: i64, kid: &str) -> Plan {
        let plan = plan(keys, now, &Policy::default(), keks(), || Ok(key(kid, 0, None))).unwrap();
        apply(keys, &plan);
        plan
    }

    fn kids(keys: &[SigningKey]) -> Vec<(&str, bool)> {
        let mut kids: Vec<_> = keys
            .iter()
            .map(|k| (k.kid.as_str(), k.retired_at_ms.is_some()))
            .collect();
        kids.sort();
        kids
    }

    #[test]
    fn a_full_key_lifecycle() {
        let mut keys = Vec::new();
        let t0 = 1_000 * H;
        // First key, signing at once.
        assert_eq!(step(&mut keys, t0, "k1").created.as_deref(), Some("k1"));
        assert_eq!(signer(&keys).unwrap().kid, "k1");
        // Nothing to do before the period.
        assert!(step(&mut keys, t0 + 12 * H - 1, "x").is_empty());
        // The successor is published, not yet signing.
        let t1 = t0 + 12 * H;
        assert_eq!(step(&mut keys, t1, "k2").created.as_deref(), Some("k2"));
        assert_eq!(signer(&keys).unwrap().kid, "k1");
        assert!(
            step(&mut keys, t1 + 10 * MIN - 1, "x").is_empty(),
            "no second successor"
        );
        // Published long enough: it signs, the previous key retires.
        let t2 = t1 + 10 * MIN;
        let plan = step(&mut keys, t2, "x");
        assert_eq!((plan.created, plan.retired), (None, vec!["k1".to_owned()]));
        assert_eq!(signer(&keys).unwrap().kid, "k2");
        assert_eq!(kids(&keys), vec![("k1", true), ("k2", false)]);
        // The retired key stays until every token it signed has expired.
        let gone = t2 + millis(Policy::default().retention());
        assert!(step(&mut keys, gone - 1, "x").is_empty());
        assert_eq!(step(&mut keys, gone, "x").deleted, vec!["k1".to_owned()]);
        assert_eq!(kids(&keys), vec![("k2", false)]);
    }

    #[test]
    fn retention_covers_the_longest_token_and_the_skew() {
        let p = Policy::default();
        assert!(p.retention() >= SUPERVISOR_TOKEN_LIFETIME + MAX_CLOCK_SKEW);
        assert!(p.publish_ahead < p.rotate_after);
    }

    #[test]
    fn no_live_key_creates_one_and_stray_keys_converge() {
        // Everything retired (long ago): a new key, and the old ones are deleted.
        let mut keys = vec![key("old", 0, Some(H))];
        let plan = step(&mut keys, 100 * H, "k9");
        assert_eq!(
            (plan.created.as_deref(), plan.deleted),
            (Some("k9"), vec!["old".to_owned()])
        );
        // Three live keys, two published long enough: the newest of those signs.
        let now = 50 * H;
        let mut keys = vec![
            key("a", now - 2 * H, None),
            key("b", now - H, None),
            key("c", now - MIN, None),
        ];
        let plan = step(&mut keys, now, "x");
        assert_eq!((plan.created, plan.retired), (None, vec!["a".to_owned()]));
        assert_eq!(signer(&keys).unwrap().kid, "b");
    }

    #[test]
    fn key_generation_errors_propagate_and_are_not_needed_otherwise() {
        let failing = || Err(Error::Random("no entropy".into()));
        assert!(plan(&[], 0, &Policy::default(), keks(), failing).is_err());
        assert!(
            plan(&[key("k", 0, None)], 1, &Policy::default(), keks(), failing)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn rows_under_another_kek_or_unsealed_are_resealed_once() {
        let old = Keks::new(Kek::generate().unwrap(), None);
        let rotating = Keks::new(keks().current().copy_for_test(), Some(old.current().copy_for_test()));
        let now = 50 * H;
        let under_old = SigningKey {
            created_at_ms: now - H,
            ..KeyPair::generate()
                .unwrap()
                .with_kid("a")
                .to_record(old.current())
                .unwrap()
        };
        let pair = KeyPair::generate().unwrap().with_kid("b");
        let plain_pem = sealing::open(Some(keks()), &pair.to_record(keks().current()).unwrap()).unwrap();
        let unsealed = SigningKey {
            created_at_ms: now - 2 * H,
            retired_at_ms: Some(now - MIN),
            private_pem: SecretBytes(plain_pem.to_vec()),
            ..pair.to_record(keks().current()).unwrap()
        };
        let current = key("c", now - 3 * H, Some(now - H));
        let mut keys = vec![under_old, unsealed, current.clone()];
        let plan = plan(&keys, now, &Policy::default(), &rotating, || unreachable!()).unwrap();
        assert_eq!(plan.resealed, vec!["a".to_owned(), "b".to_owned()]);
        assert!(plan.created.is_none() && plan.retired.is_empty() && plan.deleted.is_empty());
        apply(&mut keys, &plan);
        for key in &keys {
            assert_eq!(sealing::sealed_with(key), Some(keks().current().id()), "{}", key.kid);
            KeyPair::from_record(key, Some(keks())).unwrap();
        }
        assert!(keys.contains(&current), "a row already sealed is not rewritten");
        assert_eq!(
            keys.iter().find(|k| k.kid == "b").unwrap().retired_at_ms,
            Some(now - MIN)
        );
        let again = super::plan(&keys, now, &Policy::default(), &rotating, || unreachable!()).unwrap();
        assert!(again.is_empty(), "{again:?}");

        // A row under a KEK this gateway does not have stops the pass with a clear error.
        let stranger = Keks::new(Kek::generate().unwrap(), None);
        let foreign = SigningKey {
            created_at_ms: now - H,
            ..KeyPair::generate()
                .unwrap()
                .with_kid("x")
                .to_record(stranger.current())
                .unwrap()
        };
        let err = super::plan(&[foreign], now, &Policy::default(), keks(), || unreachable!()).unwrap_err();
        assert!(
            matches!(err, Error::Sealing(sealing::Error::UnknownKek { .. })),
            "{err}"
        );
        assert!(err.to_string().contains(stranger.current().id()), "{err}");
    }
}
