//! Recovery with real processes: a supervisor killed, a supervisor paused
//! and resumed, and the coordinator killed — each on a local pool of
//! gateways, supervisors, sidecars and counting agents. The workloads must
//! keep their PIDs and their in-memory counters, no answer may come from
//! a fenced owner, and where no owner died or was cut off no request may
//! fail. Durations are measured and printed (by the `scenarios` command),
//! never asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use e2e::scenarios::{self, Outcome, Setup};

/// One pool at a time: each is a dozen processes on a small machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run(name: &str) -> Outcome {
    let _turn = ONE_AT_A_TIME.lock().await;
    let root = tempfile::tempdir().unwrap();
    let setup = Setup {
        root: root.path().to_path_buf(),
        database_url: None,
        sandboxes: None,
    };
    let outcome = scenarios::run(name, &setup)
        .await
        .unwrap_or_else(|err| panic!("{name}: {err}"));
    eprintln!("{}", scenarios::table(std::slice::from_ref(&outcome)));
    outcome
}

fn assert_workloads_survived(outcome: &Outcome) {
    assert!(
        outcome.pids_preserved,
        "PIDs {:?} -> {:?}",
        outcome.pids_before, outcome.pids_after
    );
    assert!(outcome.counter_continuous, "an agent's counter went backwards");
    assert_eq!(outcome.dual_owner_violations, 0, "an answer came from a fenced owner");
}

/// No workload got an error: what moved (if anything) moved to the member that ran it or
/// was never in flight anywhere that failed. Only a dead or cut-off owner may lose a request.
fn assert_nothing_refused(outcome: &Outcome) {
    assert_eq!(
        outcome.refused_answers, 0,
        "{}: a workload's request was refused or lost",
        outcome.scenario
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owners_workloads_move_without_restarting() {
    assert_workloads_survived(&run("supervisor-crash").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_is_replaced_and_fenced_out_when_it_resumes() {
    let outcome = run("paused-owner").await;
    assert_workloads_survived(&outcome);
    assert!(outcome.notes.contains("fenced out"), "{}", outcome.notes);
}

/// The path from an owner's sidecars to it cut (no reset), the owner fine towards the
/// gateways: before, nothing moved and every workload was stopped at its recovery deadline
/// (its PID would change).
/// The owner gives the terms up, its instances move to the other member, and once the path
/// heals nothing moves back and no answer of the old terms reaches a workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_its_sidecars_cannot_reach_is_replaced_before_their_deadline() {
    let outcome = run("unreachable-owner").await;
    assert_workloads_survived(&outcome);
    assert!(outcome.notes.contains("fenced out"), "{}", outcome.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_store_stops_nothing_and_moves_nothing() {
    let outcome = run("store-wipe").await;
    assert_workloads_survived(&outcome);
    assert_nothing_refused(&outcome);
    assert!(outcome.notes.contains("nothing moved"), "{}", outcome.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_forgot_a_drain_catches_up_without_moving_anything() {
    let outcome = run("store-rollback").await;
    assert_workloads_survived(&outcome);
    assert_nothing_refused(&outcome);
    assert!(outcome.notes.contains("nothing moved"), "{}", outcome.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_coordinator_is_replaced_without_touching_workloads() {
    let outcome = run("coordinator-failover").await;
    assert_workloads_survived(&outcome);
    assert_nothing_refused(&outcome);
}

/// PostgreSQL stopped for 30 s under a running pool: nothing moves, nothing stops, the
/// coordinator gives up its authority at the end of its lease, and the pool has a coordinator
/// again once the database is back (the scenario checks each; the figures are printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_stops_nothing_and_the_pool_resumes() {
    if std::env::var_os("REQUIRE_POSTGRES").is_none() && !std::path::Path::new("/usr/lib/postgresql").is_dir() {
        eprintln!("skipped: no PostgreSQL server binaries (REQUIRE_POSTGRES unset)");
        return;
    }
    let outcome = run("database-outage").await;
    assert_workloads_survived(&outcome);
    assert!(outcome.notes.contains("no instance moved"), "{}", outcome.notes);
}
