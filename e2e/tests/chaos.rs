//! A short seeded chaos run on each backend (the long runs are the `scenarios chaos`
//! command): each fault kind of the run once, then random ones, on one local pool, the history
//! checker after every trial. Between them the two runs have every kind. Fails on any violation — an answer from a lower term after a higher
//! one, a term answered by two members, a PID changed, a counter reset, a workload stopped,
//! a pool not settled within its bound, no working coordinator for longer than lease + 1 s.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use e2e::chaos::plan::Fault;
use e2e::chaos::{self, Backend, Settings};

/// One pool at a time: each is some twenty processes on a small machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run(trials: usize, seed: u64, backend: Backend, kinds: &[Fault]) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let root = tempfile::tempdir().unwrap();
    let settings = Settings {
        every_kind_first: true,
        kinds: kinds.to_vec(),
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
    // Every kind but the stopped server's (16).
    run(16, 20_261_201, Backend::Sqlite, &[]).await;
}

/// With a private PostgreSQL server: the faults where the store matters — its outages, lost
/// commits, an emptied store, a forgotten drain — and the coordinator's and a member's own,
/// beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_and_database_outages_on_postgresql_break_no_rule() {
    if std::env::var_os("REQUIRE_POSTGRES").is_none() && !std::path::Path::new("/usr/lib/postgresql").is_dir() {
        eprintln!("skipped: no PostgreSQL server binaries (REQUIRE_POSTGRES unset)");
        return;
    }
    let kinds = [
        Fault::DatabaseOutage,
        Fault::DatabaseLosesCommits,
        Fault::StoreEmptied,
        Fault::StoreForgetsDrain,
        Fault::CoordinatorKill,
        Fault::CoordinatorPause,
        Fault::MemberKill,
        Fault::MemberCutOff,
        Fault::DrainDuringFault,
        Fault::Overlapping,
    ];
    run(12, 7, Backend::PrivatePostgres, &kinds).await;
}
