//! What the store forgets, and what it never holds in clear.

use gateway::store::{FencedWrite, Registered, Registration, SecretBytes};
use sqlx::Row;

use crate::suite::{acquire, active_report, assignment};
use crate::support::{TestDb, wait_until_db_time};

const LONG: std::time::Duration = std::time::Duration::from_secs(30);

fn registration(route: &str, uid: &str) -> Registration {
    Registration {
        route: route.into(),
        namespace: "ns".into(),
        name: route.into(),
        uid: uid.into(),
        material: SecretBytes(format!("material of {uid}").into_bytes()),
    }
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    let mut raw = db.raw().await;
    sqlx::query(sql).fetch_one(&mut raw).await.unwrap().get::<i64, _>(0)
}

/// A route re-registered by 300 workloads keeps 299 replaced rows until their retention
/// passed; then they, and withdrawn instances nothing names, are forgotten — by the fenced
/// write, and only what retired before the retention.
pub async fn retired_workloads_and_withdrawn_instances_are_forgotten_after_their_retention(db: &TestDb) {
    let lease = acquire(&db.store, "gw-a/1", LONG).await;
    for n in 0..300 {
        let registered = db
            .store
            .register_instance(&registration("r1", &format!("u{n}")))
            .await
            .unwrap();
        assert_eq!(registered, Registered::Desired { generation: n + 1 });
    }
    // Withdrawn, with a report: forgotten with it. Withdrawn but still assigned: kept.
    db.store.register_instance(&registration("r2", "v1")).await.unwrap();
    db.store.record_report(&active_report("r2")).await.unwrap();
    assert!(db.store.withdraw_instance("r2", "v1", None).await.unwrap());
    db.store.register_instance(&registration("r3", "w1")).await.unwrap();
    let assign = FencedWrite::Assign {
        expected_term: None,
        next: assignment("r3", "m1", 1),
    };
    db.store.write_fenced(&lease, &[assign]).await.unwrap();
    assert!(db.store.withdraw_instance("r3", "w1", None).await.unwrap());
    assert_eq!(count(db, "SELECT count(*) FROM replaced_instances").await, 299);

    // Within the retention nothing goes.
    let day = FencedWrite::ForgetRetired {
        retention_ms: 24 * 3600 * 1000,
    };
    db.store.write_fenced(&lease, &[day]).await.unwrap();
    assert_eq!(count(db, "SELECT count(*) FROM replaced_instances").await, 299);
    assert_eq!(count(db, "SELECT count(*) FROM instances").await, 3);

    let now = db.store.now_ms().await.unwrap();
    wait_until_db_time(&db.store, now + 5).await;
    db.store
        .write_fenced(&lease, &[FencedWrite::ForgetRetired { retention_ms: 1 }])
        .await
        .unwrap();
    assert_eq!(count(db, "SELECT count(*) FROM replaced_instances").await, 0);
    let routes: Vec<String> = db
        .store
        .list_instances()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.route)
        .collect();
    assert_eq!(routes, ["r1", "r3"], "the desired and the still-assigned instance stay");
    assert!(db.store.list_reports().await.unwrap().iter().all(|r| r.route != "r2"));
    // The forgotten route starts afresh.
    assert_eq!(
        db.store.register_instance(&registration("r2", "v2")).await.unwrap(),
        Registered::Desired { generation: 1 }
    );
    // A stale lease forgets nothing.
    let stale = gateway::store::Lease {
        term: lease.term.next(),
        ..lease.clone()
    };
    assert!(
        db.store
            .write_fenced(&stale, &[FencedWrite::ForgetRetired { retention_ms: 0 }])
            .await
            .is_err()
    );
}

/// The stored bytes of `route`'s material, read past the store.
async fn stored_material(db: &TestDb, route: &str) -> Vec<u8> {
    let mut raw = db.raw().await;
    sqlx::query("SELECT material FROM instances WHERE route = $1")
        .bind(route)
        .fetch_one(&mut raw)
        .await
        .unwrap()
        .get::<Vec<u8>, _>(0)
}

fn holds(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A dump of the instances table holds no receipt key: the material is sealed with the KEK,
/// bound to its row; one an older gateway stored in clear is sealed at the next start.
pub async fn a_dump_of_the_material_holds_no_receipt_key(db: &TestDb) {
    use base64::Engine as _;
    use gateway::registration::{Binding, Material};
    let receipt_key = [0xA5u8; 32];
    let material = |route: &str, uid: &str| {
        let binding = Binding {
            route,
            namespace: "ns",
            name: route,
            uid,
        };
        Material::new(&binding, &receipt_key).encode()
    };
    let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(receipt_key);
    let leaks = |stored: &[u8]| holds(stored, &receipt_key) || holds(stored, encoded.as_bytes());
    assert!(leaks(&material("r1", "u1")), "the material holds the receipt key");

    let r1 = Registration {
        material: SecretBytes(material("r1", "u1")),
        ..registration("r1", "u1")
    };
    db.store.register_instance(&r1).await.unwrap();
    let stored = stored_material(db, "r1").await;
    assert!(!leaks(&stored), "a dump holds the receipt key");
    assert!(stored.starts_with(b"openshell-sealed-v1."));
    // Every reader gets it opened.
    assert_eq!(db.store.instance("r1").await.unwrap().unwrap().material, r1.material);
    assert_eq!(db.store.list_instances().await.unwrap()[0].material, r1.material);

    // A sealed material moved to another row does not open there.
    let r2 = Registration {
        material: SecretBytes(material("r2", "u2")),
        ..registration("r2", "u2")
    };
    db.store.register_instance(&r2).await.unwrap();
    let mut raw = db.raw().await;
    sqlx::query("UPDATE instances SET material = $1 WHERE route = $2")
        .bind(&stored)
        .bind("r2")
        .execute(&mut raw)
        .await
        .unwrap();
    assert!(db.store.instance("r2").await.unwrap().unwrap().material.0.is_empty());

    // An older gateway's row in clear still reads, and is sealed by the start's pass.
    sqlx::query("UPDATE instances SET material = $1 WHERE route = $2")
        .bind(material("r2", "u2"))
        .bind("r2")
        .execute(&mut raw)
        .await
        .unwrap();
    assert_eq!(db.store.instance("r2").await.unwrap().unwrap().material, r2.material);
    assert_eq!(db.store.seal_materials().await.unwrap(), (1, Vec::new()));
    let resealed = stored_material(db, "r2").await;
    assert!(!leaks(&resealed) && resealed.starts_with(b"openshell-sealed-v1."));
    assert_eq!(db.store.instance("r2").await.unwrap().unwrap().material, r2.material);
    assert_eq!(db.store.seal_materials().await.unwrap(), (0, Vec::new()));
}
