//! A short seeded chaos run on each backend (the long runs are the `scenarios chaos`
//! command): every fault kind once, then random ones, on one local pool, the history checker
//! after every trial. Fails on any violation — an answer from a lower term after a higher
//! one, a term answered by two members, a PID changed, a counter reset, a workload stopped,
//! a pool not settled within its bound, no working coordinator for longer than lease + 1 s.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use e2e::chaos::{self, Backend, Settings};

/// One pool at a time: each is some twenty processes on a small machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run(trials: usize, seed: u64, backend: Backend) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let root = tempfile::tempdir().unwrap();
    let settings = Settings {
        every_kind_first: true,
        ..Settings::new(trials, seed, root.path().join("chaos"), backend)
    };
    let report = chaos::run(&settings).await.unwrap_or_else(|err| panic!("chaos: {err}"));
    eprintln!("{}", chaos::table(&report));
    assert_eq!(report.trials.len(), trials, "{:?}", report.aborted);
    assert!(report.accepted > 0, "the checker read no answers");
    assert!(
        report.passed(),
        "violations: {:#?}; stopped workloads: {}; aborted: {:?}",
        report.violations,
        report.stopped_workloads,
        report.aborted
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_on_the_embedded_store_break_no_rule() {
    run(16, 20_261_201, Backend::Sqlite).await;
}

/// With a private PostgreSQL server, outages of the database are among the faults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_and_database_outages_on_postgresql_break_no_rule() {
    if std::env::var_os("REQUIRE_POSTGRES").is_none() && !std::path::Path::new("/usr/lib/postgresql").is_dir() {
        eprintln!("skipped: no PostgreSQL server binaries (REQUIRE_POSTGRES unset)");
        return;
    }
    run(14, 7, Backend::PrivatePostgres).await;
}
