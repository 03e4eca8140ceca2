//! Tokens against a real store: minting and verification (SQLite), every refusal a verifier
//! must make, key rotation through `write_fenced` (SQLite, and PostgreSQL when
//! `DATABASE_URL` is set), file delivery, and secrets kept out of `Debug`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use gateway::store::{self, Acquire, Lease, Store};
use gateway::tokens::{
    self, Delivered, Delivery, FileDelivery, KeyPair, Keyring, Kind, NoExtra, Policy, TrustBundle, member_subject,
};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use proto::timing::MAX_CLOCK_SKEW;
use proto::trust::{self, Claims, Error as Refused};
use serde_json::json;

const ISS: &str = tokens::DEFAULT_ISSUER;
const LIFETIME: Duration = Duration::from_secs(3600);

#[path = "common/db.rs"]
#[macro_use]
mod support;

/// The rotation tests, instantiated per backend by `on_both_backends!`.
mod rotation {
    pub use super::*;
}

async fn acquire(store: &Store, holder: &str) -> Lease {
    match store.acquire_lease(holder, Duration::from_secs(60)).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        Acquire::HeldBy(row) => panic!("lease held by {row:?}"),
    }
}

/// A store with its first key, its keyring, and the database time.
async fn ready(store: &Store) -> (Keyring, i64) {
    let lease = acquire(store, "gw-a/1").await;
    let now = store.now_ms().await.unwrap();
    tokens::rotate(store, &lease, &Policy::default(), now).await.unwrap();
    (Keyring::load(store, ISS).await.unwrap(), now)
}

/// The private key PEM of a stored record, opened with the store's KEK.
fn private_pem(store: &Store, record: &store::SigningKey) -> Vec<u8> {
    store::sealing::open(store.keks(), record).unwrap().to_vec()
}

fn supervisor_token(ring: &Keyring, now: i64) -> String {
    ring.mint_at(Kind::Supervisor, &member_subject("main"), LIFETIME, &NoExtra {}, now)
        .unwrap()
        .token
}

fn verify(ring: &Keyring, token: &str, now: i64) -> Result<Claims, Refused> {
    ring.verify_at(Kind::Supervisor, token, now)
}

fn b64(value: &serde_json::Value) -> String {
    URL_SAFE_NO_PAD.encode(value.to_string())
}

fn claims_at(now: i64) -> serde_json::Value {
    json!({"iss": ISS, "aud": tokens::SUPERVISOR, "sub": "pool:main",
           "iat": now / 1000, "exp": now / 1000 + 600, "jti": "j"})
}

// ---- minting and verification (SQLite) ---------------------------------------------------

#[tokio::test]
async fn mint_and_verify_round_trip() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let minted = ring
        .mint_at(Kind::Supervisor, &member_subject("main"), LIFETIME, &NoExtra {}, now)
        .unwrap();
    let claims = verify(&ring, &minted.token, now).unwrap();
    assert_eq!(
        (claims.iss.as_str(), claims.aud.as_str(), claims.sub.as_str()),
        (ISS, tokens::SUPERVISOR, "member:main")
    );
    assert_eq!((claims.exp - claims.iat, claims.jti), (3600, minted.jti.clone()));
    assert_eq!(Some(minted.kid.as_str()), ring.signing_kid());
    // Verifiers elsewhere use the published bundle, as JWKS.
    let published = TrustBundle::from_jwks(ring.trust_bundle().to_jwks().as_bytes()).unwrap();
    let expected = trust::Expectation::kind(Kind::Supervisor, ISS);
    let claims: Claims = published.verify_at(&minted.token, &expected, now).unwrap();
    assert_eq!(claims.sub, "member:main");
    assert!(!minted.needs_renewal(now + 1_799_000) && minted.needs_renewal(now + 1_800_000));
    db.finish().await;
}

#[tokio::test]
async fn expired_beyond_the_leeway_is_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let minted = ring
        .mint_at(Kind::Supervisor, "pool:main", LIFETIME, &NoExtra {}, now)
        .unwrap();
    let skew = i64::try_from(MAX_CLOCK_SKEW.as_millis()).unwrap();
    assert!(
        verify(&ring, &minted.token, minted.expires_at_ms + skew - 1).is_ok(),
        "within the leeway"
    );
    let refused = verify(&ring, &minted.token, minted.expires_at_ms + skew);
    assert!(matches!(refused, Err(Refused::Expired)), "{refused:?}");
    db.finish().await;
}

#[tokio::test]
async fn wrong_audience_and_wrong_issuer_are_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let instance = ring
        .mint_at(
            Kind::Instance,
            &tokens::instance_subject("team-a/web-0"),
            LIFETIME,
            &NoExtra {},
            now,
        )
        .unwrap();
    assert!(ring.verify_at::<NoExtra>(Kind::Instance, &instance.token, now).is_ok());
    let refused = verify(&ring, &instance.token, now);
    assert!(matches!(refused, Err(Refused::Audience { .. })), "{refused:?}");

    // Same keys, another issuer.
    let other = Keyring::load(&db.store, "another-gateway").await.unwrap();
    let refused = verify(&other, &supervisor_token(&ring, now), now);
    assert!(matches!(refused, Err(Refused::Issuer { .. })), "{refused:?}");
    db.finish().await;
}

#[tokio::test]
async fn unknown_and_missing_kid_are_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    // Signed by a key this gateway never stored.
    let keks = support::test_keks();
    let record = KeyPair::generate().unwrap().to_record(keks.current()).unwrap();
    let stranger = Keyring::from_records(ISS, &[record], Some(&keks)).unwrap();
    let refused = verify(&ring, &supervisor_token(&stranger, now), now);
    assert!(matches!(refused, Err(Refused::UnknownKid(_))), "{refused:?}");

    // Correctly signed with the gateway's own key, but no kid in the header.
    let record = db.store.list_signing_keys().await.unwrap().remove(0);
    let key = EncodingKey::from_ed_pem(&private_pem(&db.store, &record)).unwrap();
    let no_kid = jsonwebtoken::encode(&Header::new(Algorithm::EdDSA), &claims_at(now), &key).unwrap();
    let refused = verify(&ring, &no_kid, now);
    assert!(matches!(refused, Err(Refused::MissingKid)), "{refused:?}");
    // The same token with the kid verifies: the refusal was the missing kid.
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some(record.kid.clone());
    let with_kid = jsonwebtoken::encode(&header, &claims_at(now), &key).unwrap();
    assert!(verify(&ring, &with_kid, now).is_ok());
    db.finish().await;
}

#[tokio::test]
async fn alg_none_is_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let kid = ring.signing_kid().unwrap();
    for alg in ["none", "None", "NONE"] {
        let header = json!({"alg": alg, "kid": kid, "typ": "JWT"});
        let token = format!("{}.{}.", b64(&header), b64(&claims_at(now)));
        let refused = verify(&ring, &token, now);
        assert!(matches!(refused, Err(Refused::Algorithm(_))), "{alg}: {refused:?}");
    }
    db.finish().await;
}

#[tokio::test]
async fn hs256_keyed_with_the_public_key_is_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let kid = ring.signing_kid().unwrap().to_owned();
    let record = db.store.list_signing_keys().await.unwrap().remove(0);
    let public = tokens::public_key(&record).unwrap();
    let jwks_x = URL_SAFE_NO_PAD.encode(public.as_bytes());
    // Every form an attacker could take the public key in.
    let secrets: [&[u8]; 3] = [public.as_bytes(), record.public_pem.as_bytes(), jwks_x.as_bytes()];
    for secret in secrets {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.clone());
        let token = jsonwebtoken::encode(&header, &claims_at(now), &EncodingKey::from_secret(secret)).unwrap();
        let refused = verify(&ring, &token, now);
        assert!(
            matches!(&refused, Err(Refused::Algorithm(alg)) if alg == "HS256"),
            "{refused:?}"
        );
    }
    db.finish().await;
}

#[tokio::test]
async fn tampered_payload_and_oversized_tokens_are_refused() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let token = supervisor_token(&ring, now);
    let parts: Vec<&str> = token.split('.').collect();
    let mut claims: serde_json::Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
    claims["sub"] = json!("pool:other");
    let tampered = format!("{}.{}.{}", parts[0], b64(&claims), parts[2]);
    assert!(matches!(verify(&ring, &tampered, now), Err(Refused::Signature)));

    // Validly signed, but larger than any verifier reads.
    let record = db.store.list_signing_keys().await.unwrap().remove(0);
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some(record.kid.clone());
    let mut big = claims_at(now);
    big["pad"] = json!("x".repeat(trust::MAX_TOKEN_BYTES));
    let key = EncodingKey::from_ed_pem(&private_pem(&db.store, &record)).unwrap();
    let oversized = jsonwebtoken::encode(&header, &big, &key).unwrap();
    let refused = verify(&ring, &oversized, now);
    assert!(matches!(refused, Err(Refused::TooLarge { .. })), "{refused:?}");
    db.finish().await;
}

// ---- rotation (SQLite and PostgreSQL) ----------------------------------------------------

on_both_backends!(rotation;
    first_key_is_created_through_write_fenced,
    rotation_keeps_old_tokens_verifiable_until_deletion,
    a_stale_coordinator_cannot_rotate,
);

pub async fn first_key_is_created_through_write_fenced(db: &support::TestDb) {
    let store = &db.store;
    let lease = acquire(store, "gw-a/1").await;
    assert!(matches!(
        Keyring::load(store, ISS)
            .await
            .unwrap()
            .mint(Kind::Supervisor, "p", LIFETIME, &NoExtra {}),
        Err(tokens::Error::NoSigningKey)
    ));
    let now = store.now_ms().await.unwrap();
    let plan = tokens::rotate(store, &lease, &Policy::default(), now).await.unwrap();
    let keys = store.list_signing_keys().await.unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(plan.created.as_deref(), Some(keys[0].kid.as_str()));
    assert_eq!((keys[0].algorithm.as_str(), keys[0].retired_at_ms), ("EdDSA", None));
    assert!(keys[0].created_at_ms > 0, "stamped by the database clock");
    let ring = Keyring::load(store, ISS).await.unwrap();
    assert_eq!(ring.signing_kid(), Some(keys[0].kid.as_str()));
    // Nothing more to do at the same time.
    assert!(
        tokens::rotate(store, &lease, &Policy::default(), now)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.list_signing_keys().await.unwrap().len(), 1);
}

pub async fn rotation_keeps_old_tokens_verifiable_until_deletion(db: &support::TestDb) {
    let store = &db.store;
    let policy = Policy::default();
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap();
    let lease = acquire(store, "gw-a/1").await;
    let t0 = store.now_ms().await.unwrap();
    let k1 = tokens::rotate(store, &lease, &policy, t0)
        .await
        .unwrap()
        .created
        .unwrap();
    // Keys are ordered by their database creation stamp: let the clock move past k1's.
    let k1_created = store.list_signing_keys().await.unwrap()[0].created_at_ms;
    for _ in 0..1000 {
        if store.now_ms().await.unwrap() > k1_created {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    // The period passed (counted from k1's database stamp): the successor is published, k1
    // still signs.
    let t1 = k1_created + ms(policy.rotate_after);
    let plan = tokens::rotate(store, &lease, &policy, t1).await.unwrap();
    let k2 = plan.created.unwrap();
    assert!(plan.retired.is_empty());
    let ring = Keyring::load(store, ISS).await.unwrap();
    assert_eq!(ring.signing_kid(), Some(k1.as_str()));
    assert!(ring.trust_bundle().keys.contains_key(&k2), "published before it signs");

    // A token signed by k1 just before the switch.
    let t2 = t1 + ms(policy.publish_ahead);
    let old = ring
        .mint_at(Kind::Supervisor, "pool:main", LIFETIME, &NoExtra {}, t2 - 1000)
        .unwrap();
    assert_eq!(old.kid, k1);

    // k2 has been published long enough: it signs and k1 retires, still published.
    let plan = tokens::rotate(store, &lease, &policy, t2).await.unwrap();
    assert_eq!((plan.created, plan.retired), (None, vec![k1.clone()]));
    let ring = Keyring::load(store, ISS).await.unwrap();
    assert_eq!(ring.signing_kid(), Some(k2.as_str()));
    let new = ring
        .mint_at(Kind::Supervisor, "pool:main", LIFETIME, &NoExtra {}, t2)
        .unwrap();
    assert_eq!(new.kid, k2);
    let last_valid = old.expires_at_ms + ms(MAX_CLOCK_SKEW) - 1;
    assert!(
        verify(&ring, &old.token, last_valid).is_ok(),
        "old token verifies after rotation"
    );

    // Right before the deletion deadline k1 is still there (and verifies its last token).
    let deadline = t2 + ms(policy.retention());
    assert!(deadline > last_valid);
    let plan = tokens::rotate(store, &lease, &policy, deadline - 1).await.unwrap();
    assert!(plan.deleted.is_empty(), "{plan:?}");
    let ring = Keyring::load(store, ISS).await.unwrap();
    assert!(verify(&ring, &old.token, last_valid).is_ok());

    // At the deadline k1 is deleted; tokens it signed are refused by kid.
    let plan = tokens::rotate(store, &lease, &policy, deadline).await.unwrap();
    assert_eq!(plan.deleted, vec![k1.clone()]);
    let ring = Keyring::load(store, ISS).await.unwrap();
    assert!(!ring.trust_bundle().keys.contains_key(&k1));
    assert!(matches!(
        verify(&ring, &old.token, last_valid),
        Err(Refused::UnknownKid(_))
    ));
    assert!(verify(&ring, &new.token, t2).is_ok(), "k2's tokens are unaffected");
}

pub async fn a_stale_coordinator_cannot_rotate(db: &support::TestDb) {
    let store = &db.store;
    let stale = acquire(store, "gw-a/1").await;
    assert!(store.release_lease(&stale).await.unwrap());
    let current = acquire(store, "gw-b/1").await;
    assert!(current.term > stale.term);
    let now = store.now_ms().await.unwrap();
    let refused = tokens::rotate(store, &stale, &Policy::default(), now).await;
    assert!(
        matches!(refused, Err(tokens::Error::Store(store::Error::Fenced(_)))),
        "{refused:?}"
    );
    assert!(store.list_signing_keys().await.unwrap().is_empty(), "nothing written");
    // The current coordinator can.
    let plan = tokens::rotate(store, &current, &Policy::default(), now).await.unwrap();
    assert!(plan.created.is_some());
    assert_eq!(store.list_signing_keys().await.unwrap().len(), 1);
}

// ---- delivery and secrecy ----------------------------------------------------------------

#[tokio::test]
async fn delivery_replaces_files_atomically_and_keeps_the_token_private() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let dir = tempfile::tempdir().unwrap();
    let delivery = FileDelivery::new(dir.path().join("pool"));
    let first = Delivered::new(
        Some(
            &ring
                .mint_at(Kind::Supervisor, "member:main", LIFETIME, &NoExtra {}, now)
                .unwrap(),
        ),
        ring.trust_bundle(),
    );
    delivery.deliver(&first).await.unwrap();
    let token_path = delivery.token_path();
    assert_eq!(
        std::fs::read_to_string(&token_path).unwrap(),
        first.token.clone().unwrap()
    );
    assert_eq!(
        std::fs::metadata(&token_path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let bundle = TrustBundle::load(&delivery.bundle_path()).unwrap();
    assert_eq!(&bundle, ring.trust_bundle());

    // A reader holding the old file keeps reading the old token: the new one replaces it by
    // rename, never by rewriting it in place.
    let held = std::fs::File::open(&token_path).unwrap();
    let old_inode = held.metadata().unwrap().ino();
    let second = Delivered::new(
        Some(
            &ring
                .mint_at(Kind::Supervisor, "member:main", LIFETIME, &NoExtra {}, now + 1000)
                .unwrap(),
        ),
        ring.trust_bundle(),
    );
    assert_ne!(first.token, second.token);
    delivery.deliver(&second).await.unwrap();
    assert_eq!(std::io::read_to_string(&held).unwrap(), first.token.clone().unwrap());
    assert_eq!(
        std::fs::read_to_string(&token_path).unwrap(),
        second.token.clone().unwrap()
    );
    let meta = std::fs::metadata(&token_path).unwrap();
    assert_ne!(meta.ino(), old_inode);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("pool"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![trust::TOKEN_FILE, trust::TRUST_BUNDLE_FILE],
        "no temporary files left"
    );
    db.finish().await;
}

#[tokio::test]
async fn debug_output_never_shows_private_keys_or_tokens() {
    let db = support::TestDb::sqlite().await;
    let (ring, now) = ready(&db.store).await;
    let record = db.store.list_signing_keys().await.unwrap().remove(0);
    let pem = String::from_utf8(private_pem(&db.store, &record)).unwrap();
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    assert!(body.len() > 40, "a real PKCS#8 body");
    let minted = ring
        .mint_at(Kind::Supervisor, "pool:main", LIFETIME, &NoExtra {}, now)
        .unwrap();
    let delivered = Delivered::new(Some(&minted), ring.trust_bundle());
    let pair = KeyPair::from_record(&record, db.store.keks()).unwrap();
    let shown = format!("{ring:?} {pair:?} {record:?} {minted:?} {delivered:?}");
    assert!(!shown.contains(&body), "{shown}");
    assert!(!shown.contains(&minted.token), "{shown}");
    assert!(shown.contains(&record.kid), "the kid is shown: {shown}");
    db.finish().await;
}

// ---- keys at rest: a real gateway on SQLite ----------------------------------------------

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

type Running = (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Result<(), gateway::Error>>,
);

/// A gateway replica on this runtime with the SQLite database `gateway.db` in `data` and
/// `args` (an explicit URL: `DATABASE_URL` may name a PostgreSQL server in the environment).
async fn start_gateway(data: &std::path::Path, args: &[&str]) -> Running {
    use clap::Parser;
    let url = format!("sqlite://{}?mode=rwc", data.join("gateway.db").display());
    let mut all = vec![
        "gateway",
        "--database-url",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--status-interval-ms",
        "0",
    ];
    all.extend_from_slice(args);
    let settings = gateway::Settings::parse_from(all);
    let listener = gateway::bind(&settings).await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(gateway::run(settings, listener, shutdown.clone()));
    (shutdown, task)
}

async fn stop_gateway((shutdown, task): Running) {
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// The signing-key rows as stored: `(kid, private_pem bytes)`, read with plain sqlx.
async fn dump_rows(url: &str) -> Vec<(String, Vec<u8>)> {
    use sqlx::{Connection, Row};
    sqlx::any::install_default_drivers();
    let mut conn = sqlx::AnyConnection::connect(url).await.unwrap();
    let rows = sqlx::query("SELECT kid, private_pem FROM signing_keys")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    rows.iter()
        .map(|r| (r.try_get("kid").unwrap(), r.try_get("private_pem").unwrap()))
        .collect()
}

fn write_kek(path: &std::path::Path) -> String {
    let (kek, created) = store::sealing::Kek::load_or_create(path).unwrap();
    assert!(created);
    kek.id().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_sqlite_keeps_its_files_private_and_its_signing_keys_sealed() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let credentials = root.path().join("credentials");
    let credentials_arg = credentials.to_str().unwrap();
    let operator_token = credentials.join("operator").join(trust::TOKEN_FILE);

    // No KEK configured: the embedded store's gateway generates one beside the database.
    let running = start_gateway(
        &data,
        &[
            "--credentials-dir",
            credentials_arg,
            "--members",
            "m-a",
            "--instances",
            "default/web-0",
        ],
    )
    .await;
    // The instances' tokens are written last.
    let last = credentials.join("instances/default/web-0").join(trust::TOKEN_FILE);
    support::wait_for("the first token delivery", 3000, || async {
        assert!(!running.1.is_finished(), "the gateway stopped");
        last.is_file().then_some(())
    })
    .await;
    let db = data.join("gateway.db");
    support::wait_for("the WAL files", 3000, || async {
        (db.with_extension("db-wal").is_file() && db.with_extension("db-shm").is_file()).then_some(())
    })
    .await;
    assert_eq!(mode(&data), 0o700, "the existing data directory was tightened");
    for name in ["gateway.db", "gateway.db-wal", "gateway.db-shm", "key-encryption-key"] {
        assert_eq!(mode(&data.join(name)), 0o600, "{name}");
    }
    for dir in [
        credentials.clone(),
        credentials.join("operator"),
        credentials.join("members/m-a"),
        credentials.join("instances/default/web-0"),
    ] {
        assert_eq!(mode(&dir), 0o700, "{}", dir.display());
    }
    for token in ["operator", "members/m-a", "instances/default/web-0"] {
        assert_eq!(mode(&credentials.join(token).join(trust::TOKEN_FILE)), 0o600, "{token}");
    }
    stop_gateway(running).await;

    // A dump of the table holds no usable private key.
    let url = format!("sqlite://{}", db.display());
    let kek_file = data.join("key-encryption-key");
    let generated = store::sealing::Keks::load(&kek_file, None).unwrap();
    let store = Store::open(&url, &store::Options::default())
        .await
        .unwrap()
        .with_keks(std::sync::Arc::new(
            store::sealing::Keks::load(&kek_file, None).unwrap(),
        ));
    let records = store.list_signing_keys().await.unwrap();
    assert_eq!(records.len(), 1);
    let rows = dump_rows(&url).await;
    assert_eq!(rows.len(), 1);
    for (kid, bytes) in &rows {
        let record = records.iter().find(|r| &r.kid == kid).unwrap();
        let pem = String::from_utf8(private_pem(&store, record)).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD.decode(&body).unwrap();
        let seed = &der[der.len() - 32..];
        assert!(!bytes.starts_with(b"-----BEGIN"));
        assert!(EncodingKey::from_ed_pem(bytes).is_err(), "the row parses as a key");
        assert!(
            !bytes.windows(body.len()).any(|w| w == body.as_bytes()),
            "PEM body in the row"
        );
        assert!(!bytes.windows(32).any(|w| w == seed), "raw seed in the row");
        assert!(!String::from_utf8_lossy(bytes).contains(&URL_SAFE_NO_PAD.encode(seed)));
        assert_eq!(store::sealing::sealed_with(record), Some(generated.current().id()));
    }
    store.close().await;

    // The wrong KEK: the gateway refuses to start, naming the key and both KEK ids.
    let wrong = root.path().join("wrong-kek");
    let wrong_id = write_kek(&wrong);
    let wrong_content = std::fs::read_to_string(&wrong).unwrap();
    let (_, task) = start_gateway(&data, &["--key-encryption-key-file", wrong.to_str().unwrap()]).await;
    let refused = task
        .await
        .unwrap()
        .expect_err("a wrong KEK must stop the gateway")
        .to_string();
    assert!(
        refused.contains("key-encryption key") && refused.contains(&rows[0].0),
        "{refused}"
    );
    assert!(
        refused.contains(generated.current().id()) && refused.contains(&wrong_id),
        "{refused}"
    );
    assert!(!refused.contains(wrong_content.trim()), "{refused}");
    assert_eq!(dump_rows(&url).await, rows, "nothing was written");

    // KEK rotation: the new key current, the generated one previous; the coordinator
    // re-seals the row; then the new key alone opens it.
    let running = start_gateway(
        &data,
        &[
            "--key-encryption-key-file",
            wrong.to_str().unwrap(),
            "--previous-key-encryption-key-file",
            kek_file.to_str().unwrap(),
        ],
    )
    .await;
    let marker = format!("openshell-sealed-v1.{wrong_id}.");
    support::wait_for("the row re-sealed with the new KEK", 3000, || async {
        let rows = dump_rows(&url).await;
        rows.iter().all(|(_, b)| b.starts_with(marker.as_bytes())).then_some(())
    })
    .await;
    stop_gateway(running).await;
    std::fs::remove_file(&operator_token).unwrap();
    let running = start_gateway(
        &data,
        &[
            "--credentials-dir",
            credentials_arg,
            "--key-encryption-key-file",
            wrong.to_str().unwrap(),
        ],
    )
    .await;
    support::wait_for("a delivery signed with the re-sealed key", 3000, || async {
        operator_token.is_file().then_some(())
    })
    .await;
    stop_gateway(running).await;
}
