//! Failure and maintenance scenarios on a local pool of real processes, with
//! measurements: coordinator failover (kill -9 and pause), supervisor crash
//! recovery, paused-owner recovery with the resumed owner fenced out, an owner its sidecars
//! cannot reach (a cut path, no reset) replaced before their deadline, and the
//! planned moves — a drain of two sessions and a rebalance — through the
//! operator API. Each scenario starts a fresh pool, waits for steady state,
//! injects the failure or starts the operation, and measures from the store
//! and the agents' own logs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use gateway::store::{AssignmentPhase, Options, Store};
use nix::sys::signal::Signal;
use serde::Serialize;

use crate::agent_log::{self, Observed};
use crate::local::{self, Config, LocalPool};

mod database;
mod faults;
mod planned;

pub(crate) use database::fresh_database;
use faults::{OwnerFault, coordinator, outage, owner, rollback, wipe};
pub(crate) use faults::{commits_asynchronous, empty_database, forget};
pub(crate) use planned::{Planned, busiest, emptied, operator, planned};

/// The scenarios, in the order they run.
pub const ALL: [&str; 9] = [
    "coordinator-failover",
    "coordinator-pause",
    "supervisor-crash",
    "paused-owner",
    "unreachable-owner",
    "store-wipe",
    "store-rollback",
    "drain",
    "rebalance",
];

/// Scenarios that run only when named: they need a private PostgreSQL server (the
/// PostgreSQL 15 server binaries), which they start and stop themselves.
pub const ON_REQUEST: [&str; 1] = ["database-outage"];

/// How long `database-outage` keeps the database down.
const OUTAGE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Pool(#[from] local::Error),
    #[error(transparent)]
    Process(#[from] crate::process::Error),
    #[error("store: {0}")]
    Store(#[from] gateway::store::Error),
    #[error("{0}")]
    Scenario(String),
}

/// What one scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub scenario: String,
    pub backend: String,
    /// Failure injected → the measured end point (see `measures`).
    pub seconds: f64,
    pub measures: String,
    pub pids_before: Vec<u32>,
    pub pids_after: Vec<u32>,
    pub pids_preserved: bool,
    pub counter_continuous: bool,
    /// Longest gap between two accepted progress reports of an affected agent.
    pub max_counter_gap_ms: u64,
    pub dual_owner_violations: u64,
    /// Answers a workload got that were not `ok` (a refusal, a request lost with its owner).
    pub refused_answers: u64,
    pub notes: String,
}

impl Outcome {
    /// What a scenario measured from `from` to `to` (Unix ms): the agents' PIDs before and
    /// after, and their logs `observed` (gaps counted until half a second after `to`).
    pub(crate) fn measured(
        measures: String,
        (from, to): (u64, u64),
        (pids_before, pids_after): (Vec<u32>, Vec<u32>),
        observed: &[Observed],
        notes: String,
    ) -> Self {
        Self {
            scenario: String::new(),
            backend: String::new(),
            seconds: to.saturating_sub(from) as f64 / 1000.0,
            measures,
            pids_preserved: pids_before == pids_after && !pids_before.is_empty(),
            pids_before,
            pids_after,
            counter_continuous: observed.iter().all(Observed::continuous),
            max_counter_gap_ms: observed.iter().map(|o| o.max_gap_ms(from, to + 500)).max().unwrap_or(0),
            dual_owner_violations: observed.iter().map(Observed::dual_owner_violations).sum(),
            refused_answers: observed.iter().map(|o| o.refused_between(from, to + 500)).sum(),
            notes,
        }
    }
}

/// Where scenarios run.
#[derive(Debug, Clone)]
pub struct Setup {
    pub root: PathBuf,
    /// A PostgreSQL server URL (a fresh database is created per scenario);
    /// `None` for the embedded SQLite store.
    pub database_url: Option<String>,
    /// Sandboxes per pool instead of the scenario's own number (2; 4 for the planned moves):
    /// the same scenarios with busy members.
    pub sandboxes: Option<usize>,
}

pub async fn run(name: &str, setup: &Setup) -> Result<Outcome, Error> {
    let mut server = if name == "database-outage" {
        Some(
            crate::postgres::Server::start()
                .await
                .map_err(|e| Error::Scenario(e.to_string()))?,
        )
    } else {
        None
    };
    let admin = server
        .as_ref()
        .map(crate::postgres::Server::url)
        .or(setup.database_url.clone());
    let database_url = match &admin {
        Some(admin) => Some(fresh_database(admin, name).await?),
        None => None,
    };
    let config = Config {
        root: setup.root.join(name),
        database_url: database_url.clone(),
        gateways: 2,
        members: 2,
        // The planned-move scenarios drain two sessions off one member, as the seed did.
        sandboxes: setup
            .sandboxes
            .unwrap_or(if matches!(name, "drain" | "rebalance" | "store-rollback") {
                4
            } else {
                2
            }),
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: name == "unreachable-owner",
        policy: None,
        secrets: None,
    };
    let mut pool = LocalPool::start(config).await?;
    let url =
        database_url.unwrap_or_else(|| format!("sqlite://{}?mode=rwc", pool.config.root.join("gateway.db").display()));
    let store = Store::open(&url, &Options::default()).await?;
    let outcome = async {
        steady(&pool, &store).await?;
        match name {
            "coordinator-failover" => coordinator(&mut pool, &store, Signal::SIGKILL).await,
            "coordinator-pause" => coordinator(&mut pool, &store, Signal::SIGSTOP).await,
            "supervisor-crash" => owner(&mut pool, &store, OwnerFault::Signal(Signal::SIGKILL)).await,
            "paused-owner" => owner(&mut pool, &store, OwnerFault::Signal(Signal::SIGSTOP)).await,
            "unreachable-owner" => owner(&mut pool, &store, OwnerFault::Unreachable).await,
            "store-wipe" => wipe(&pool, &store).await,
            "store-rollback" => rollback(&pool, &store).await,
            "drain" => planned(&pool, &store, Planned::Drain).await,
            "rebalance" => planned(&pool, &store, Planned::Rebalance).await,
            "database-outage" => match server.as_mut() {
                Some(server) => outage(&pool, &store, server).await,
                None => Err(Error::Scenario("no private database server".into())),
            },
            other => Err(Error::Scenario(format!(
                "unknown scenario {other}; known: {}, {}",
                ALL.join(", "),
                ON_REQUEST.join(", ")
            ))),
        }
    }
    .await;
    store.close().await;
    pool.stop().await;
    if let Some(server) = server.as_mut() {
        // Stopped here, awaited, rather than by the blocking `Drop`.
        let _ = server.halt().await;
    }
    drop(server);
    let mut outcome = outcome?;
    outcome.scenario = name.to_owned();
    outcome.backend = if admin.is_some() { "postgresql" } else { "sqlite" }.into();
    Ok(outcome)
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Poll `check` every 10 ms until it yields, or fail after `limit`.
pub(crate) async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Error>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(Error::Scenario(format!(
                "{what} did not happen within {} s",
                limit.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every sandbox's instance active, and every agent's reports accepted.
async fn steady(pool: &LocalPool, store: &Store) -> Result<(), Error> {
    let expected = pool.sandboxes.len();
    until(
        "steady state (every instance active)",
        Duration::from_secs(60),
        || async {
            let active = store
                .list_assignments()
                .await?
                .iter()
                .filter(|a| a.phase == AssignmentPhase::Active)
                .count();
            Ok((active == expected).then_some(()))
        },
    )
    .await?;
    until("every agent reporting", Duration::from_secs(30), || async {
        Ok(pool
            .sandboxes
            .iter()
            .all(|s| observe(pool, &s.name).accepted.len() > 5)
            .then_some(()))
    })
    .await
}

pub(crate) fn observe(pool: &LocalPool, sandbox: &str) -> Observed {
    let log = pool.logs().join(format!("{sandbox}-agent.log"));
    agent_log::parse(&std::fs::read_to_string(log).unwrap_or_default())
}

/// Agent PIDs by sandbox name, as the agents logged them.
pub(crate) fn agent_pids(pool: &LocalPool, sandboxes: &[String]) -> Vec<u32> {
    sandboxes.iter().filter_map(|s| observe(pool, s).pid).collect()
}

/// Workload PIDs by route, as the owners reported them from their sidecars.
async fn reported_pids(store: &Store, routes: &[String]) -> Result<Vec<u32>, Error> {
    let reports = store.list_reports().await?;
    Ok(routes
        .iter()
        .filter_map(|r| reports.iter().find(|x| &x.route == r))
        .map(|r| u32::try_from(r.workload_pid).unwrap_or(0))
        .collect())
}

/// Kill (or pause) the coordinator's gateway process; measure until the next
/// term's coordinator made its first fenced write.
/// The table the command prints.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out = format!(
        "{:<22} {:<10} {:>8} {:>10} {:>6} {:>9} {:>5} {:>8}  {}\n",
        "SCENARIO", "BACKEND", "SECONDS", "GAP (ms)", "PIDS", "COUNTER", "DUAL", "REFUSED", "MEASURES"
    );
    for o in outcomes {
        out.push_str(&format!(
            "{:<22} {:<10} {:>8.2} {:>10} {:>6} {:>9} {:>5} {:>8}  {}\n",
            o.scenario,
            o.backend,
            o.seconds,
            o.max_counter_gap_ms,
            if o.pids_preserved { "same" } else { "CHANGED" },
            if o.counter_continuous { "kept" } else { "RESET" },
            o.dual_owner_violations,
            o.refused_answers,
            o.measures
        ));
    }
    for o in outcomes.iter().filter(|o| !o.notes.is_empty()) {
        out.push_str(&format!("  {} ({}): {}\n", o.scenario, o.backend, o.notes));
    }
    out
}
