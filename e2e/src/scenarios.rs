//! Failure and maintenance scenarios on a local pool of real processes, with
//! measurements: coordinator failover (kill -9 and pause), supervisor crash
//! recovery, paused-owner recovery with the resumed owner fenced out, and the
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

/// The scenarios, in the order they run.
pub const ALL: [&str; 6] = [
    "coordinator-failover",
    "coordinator-pause",
    "supervisor-crash",
    "paused-owner",
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
    pub notes: String,
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
            .unwrap_or(if matches!(name, "drain" | "rebalance") { 4 } else { 2 }),
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
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
            "supervisor-crash" => owner(&mut pool, &store, Signal::SIGKILL).await,
            "paused-owner" => owner(&mut pool, &store, Signal::SIGSTOP).await,
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
async fn coordinator(pool: &mut LocalPool, store: &Store, signal: Signal) -> Result<Outcome, Error> {
    let lease = store
        .read_lease()
        .await?
        .ok_or_else(|| Error::Scenario("no coordinator".into()))?;
    let name = lease.holder.split('/').next().unwrap_or_default().to_owned();
    let index = pool
        .gateways
        .iter()
        .position(|g| g.name == name)
        .ok_or_else(|| Error::Scenario(format!("coordinator {name} is not a gateway of this pool")))?;
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &sandboxes);
    let injected = now_ms();
    pool.gateways[index].process.signal(signal)?;
    let started = until(
        "a new coordinator's first fenced write",
        Duration::from_secs(30),
        || async {
            let history = store.lease_history().await?;
            Ok(history
                .iter()
                .find(|t| t.term > lease.term)
                .and_then(|t| t.started_at_ms))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    if signal == Signal::SIGSTOP {
        pool.gateways[index].process.signal(Signal::SIGCONT)?;
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &sandboxes);
    let end = u64::try_from(started).unwrap_or(0);
    Ok(Outcome {
        scenario: String::new(),
        backend: String::new(),
        seconds: end.saturating_sub(injected) as f64 / 1000.0,
        measures: format!("{signal} of the coordinator → first fenced write of the next term"),
        pids_preserved: pids_before == pids_after && !pids_before.is_empty(),
        pids_before,
        pids_after,
        counter_continuous: observed.iter().all(Observed::continuous),
        max_counter_gap_ms: observed.iter().map(|o| o.max_gap_ms(injected, end)).max().unwrap_or(0),
        dual_owner_violations: observed.iter().map(Observed::dual_owner_violations).sum(),
        notes: format!("coordinator {} term {} → term {}", name, lease.term, lease.term + 1),
    })
}

/// Kill (or pause) the member owning the most instances; measure until all
/// its instances are active under another owner. A paused owner is resumed
/// afterwards and must stay fenced out.
async fn owner(pool: &mut LocalPool, store: &Store, signal: Signal) -> Result<Outcome, Error> {
    let assignments = store.list_assignments().await?;
    let mut load: BTreeMap<&str, usize> = BTreeMap::new();
    for a in &assignments {
        *load.entry(a.member.as_str()).or_default() += 1;
    }
    let victim = load
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(m, _)| (*m).to_owned())
        .ok_or_else(|| Error::Scenario("no owner".into()))?;
    let moved: Vec<(String, i64)> = assignments
        .iter()
        .filter(|a| a.member == victim)
        .map(|a| (a.route.clone(), a.term))
        .collect();
    let routes: Vec<String> = moved.iter().map(|(r, _)| r.clone()).collect();
    let sandboxes: Vec<String> = routes
        .iter()
        .map(|r| r.rsplit('/').next().unwrap_or(r).to_owned())
        .collect();
    let pids_before = agent_pids(pool, &sandboxes);
    let index = pool
        .members
        .iter()
        .position(|m| m.name == victim)
        .ok_or_else(|| Error::Scenario(format!("owner {victim} is not a member of this pool")))?;

    let injected = now_ms();
    pool.members[index].process.signal(signal)?;
    let activated = until(
        "the instances active under a new owner",
        Duration::from_secs(90),
        || async {
            let now = store.list_assignments().await?;
            let done: Option<Vec<i64>> = moved
                .iter()
                .map(|(route, term)| {
                    now.iter()
                        .find(|a| &a.route == route && a.member != victim && a.term > *term)
                        .filter(|a| a.phase == AssignmentPhase::Active)
                        .map(|a| a.updated_at_ms)
                })
                .collect();
            Ok(done.and_then(|times| times.into_iter().max()))
        },
    )
    .await?;
    let end = u64::try_from(activated).unwrap_or(0);
    // Let the agents report through their new owners.
    until("every moved agent reporting again", Duration::from_secs(30), || async {
        Ok(sandboxes
            .iter()
            .all(|s| observe(pool, s).last_at_ms() > end + 500)
            .then_some(()))
    })
    .await?;

    let mut notes = format!("owner {victim} held {}", routes.join(", "));
    if signal == Signal::SIGSTOP {
        let resumed = now_ms();
        pool.members[index].process.signal(Signal::SIGCONT)?;
        // The resumed owner reconnects; nothing may move back to it, and no
        // answer from its old term may reach a workload.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let after = store.list_assignments().await?;
        let back = after
            .iter()
            .filter(|a| routes.contains(&a.route) && a.member == victim)
            .count();
        if back > 0 {
            return Err(Error::Scenario(format!(
                "{back} instance(s) went back to the resumed owner"
            )));
        }
        let late: usize = sandboxes
            .iter()
            .map(|s| {
                observe(pool, s)
                    .accepted
                    .iter()
                    .filter(|a| {
                        a.at_ms > resumed
                            && moved
                                .iter()
                                .any(|(_, t)| a.term == Some(u64::try_from(*t).unwrap_or(0)))
                    })
                    .count()
            })
            .sum();
        if late > 0 {
            return Err(Error::Scenario(format!(
                "{late} answer(s) from the paused owner's old term after it resumed"
            )));
        }
        notes.push_str("; resumed owner fenced out (no answers from its old term, nothing moved back)");
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = reported_pids(store, &routes).await?;
    Ok(Outcome {
        scenario: String::new(),
        backend: String::new(),
        seconds: end.saturating_sub(injected) as f64 / 1000.0,
        measures: format!("{signal} of the owner → its instances active under a new owner"),
        pids_preserved: pids_before == pids_after && !pids_before.is_empty(),
        pids_before,
        pids_after,
        counter_continuous: observed.iter().all(Observed::continuous),
        max_counter_gap_ms: observed
            .iter()
            .map(|o| o.max_gap_ms(injected, end + 500))
            .max()
            .unwrap_or(0),
        dual_owner_violations: observed.iter().map(Observed::dual_owner_violations).sum(),
        notes,
    })
}

/// Stop the database server for 30 s. Nothing may be stopped early: the workloads keep
/// running under their owners, the coordinator keeps its authority to the end of its lease
/// and no longer (read from its `/metrics`), nothing moves, and the pool has a coordinator
/// again soon after the database returns — measured from its return.
async fn outage(pool: &LocalPool, store: &Store, server: &mut crate::postgres::Server) -> Result<Outcome, Error> {
    let lease = store
        .read_lease()
        .await?
        .ok_or_else(|| Error::Scenario("no coordinator".into()))?;
    let holder = lease.holder.split('/').next().unwrap_or_default().to_owned();
    let index = pool
        .gateways
        .iter()
        .position(|g| g.name == holder)
        .ok_or_else(|| Error::Scenario(format!("coordinator {holder} is not a gateway of this pool")))?;
    let owners = |assignments: Vec<gateway::store::Assignment>| -> BTreeMap<String, (String, i64)> {
        assignments.into_iter().map(|a| (a.route, (a.member, a.term))).collect()
    };
    let before = owners(store.list_assignments().await?);
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &sandboxes);

    let halted = now_ms();
    server.halt().await.map_err(|e| Error::Scenario(e.to_string()))?;
    // The coordinator's authority: held until its lease runs out, then given up.
    let stepped_down = until("the coordinator stepping down", OUTAGE, || async {
        Ok((pool.coordinator_term(index).await == Some(0)).then(now_ms))
    })
    .await?;
    let authority_ms = stepped_down.saturating_sub(halted);
    let lease_ms = pool.config.lease_length_ms;
    if authority_ms > lease_ms + 500 {
        return Err(Error::Scenario(format!(
            "the coordinator kept its authority {authority_ms} ms into the outage, past its {lease_ms} ms lease"
        )));
    }
    let elsewhere = other_coordinator(pool, index).await;
    if let Some(other) = elsewhere {
        return Err(Error::Scenario(format!(
            "{other} claims the coordinator term without a database"
        )));
    }
    tokio::time::sleep(OUTAGE.saturating_sub(Duration::from_millis(now_ms().saturating_sub(halted)))).await;
    let during: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let resumed_at = now_ms();
    let outage_gap = during
        .iter()
        .map(|o| o.max_gap_ms(halted, resumed_at))
        .max()
        .unwrap_or(0);
    let stopped = during.iter().filter(|o| o.last_at_ms() + 2000 < resumed_at).count();
    if stopped > 0 {
        return Err(Error::Scenario(format!(
            "{stopped} workload(s) got no answer in the last 2 s of the outage"
        )));
    }
    server.resume().await.map_err(|e| Error::Scenario(e.to_string()))?;
    let returned = now_ms();
    let coordinating = until(
        "a coordinator after the database returned",
        Duration::from_secs(30),
        || async {
            for g in 0..pool.gateways.len() {
                if pool.coordinator_term(g).await.is_some_and(|t| t > 0) {
                    return Ok(Some(now_ms()));
                }
            }
            Ok(None)
        },
    )
    .await?;
    // A fenced write after the return proves the pool works again, not only the lease.
    until(
        "every agent answered after the return",
        Duration::from_secs(30),
        || async {
            Ok(sandboxes
                .iter()
                .all(|s| observe(pool, s).last_at_ms() > coordinating + 500)
                .then_some(()))
        },
    )
    .await?;
    let after = owners(store.list_assignments().await?);
    if after != before {
        return Err(Error::Scenario(format!(
            "instances moved because of the outage: {before:?} -> {after:?}"
        )));
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &sandboxes);
    Ok(Outcome {
        scenario: String::new(),
        backend: String::new(),
        seconds: coordinating.saturating_sub(returned) as f64 / 1000.0,
        measures: format!(
            "database stopped {} s → a coordinator again, from the database's return",
            OUTAGE.as_secs()
        ),
        pids_preserved: pids_before == pids_after && !pids_before.is_empty(),
        pids_before,
        pids_after,
        counter_continuous: observed.iter().all(Observed::continuous),
        max_counter_gap_ms: outage_gap,
        dual_owner_violations: observed.iter().map(Observed::dual_owner_violations).sum(),
        notes: format!(
            "the coordinator held its authority {authority_ms} ms into the outage (lease {lease_ms} ms); \
             no instance moved; the database took {} ms to start again",
            returned.saturating_sub(resumed_at)
        ),
    })
}

/// A replica other than `except` that says it holds a coordinator term.
async fn other_coordinator(pool: &LocalPool, except: usize) -> Option<String> {
    for (g, gateway) in pool.gateways.iter().enumerate() {
        if g != except && pool.coordinator_term(g).await.is_some_and(|t| t > 0) {
            return Some(gateway.name.clone());
        }
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Planned {
    Drain,
    Rebalance,
}

/// An operator client of the pool over every replica.
pub(crate) async fn operator(pool: &LocalPool) -> Result<poolctl::Client, Error> {
    pool.operator(pool.endpoints())
        .await
        .map_err(|e| Error::Scenario(format!("operator client: {e}")))
}

/// Drain: move the two sessions of the busiest member off it (max_parallel 2); measured from
/// the request to the operation's success. Rebalance: first drain a member and return it to
/// service (so it is empty), then even out; measured from the rebalance request to its success.
pub(crate) async fn planned(pool: &LocalPool, store: &Store, kind: Planned) -> Result<Outcome, Error> {
    let mut client = operator(pool).await?;
    let run = |parallel| poolctl::RunArgs {
        max_parallel: parallel,
        timeout_secs: 120,
        wait: true,
    };
    let busiest = |assignments: &[gateway::store::Assignment]| {
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        for a in assignments {
            *load.entry(a.member.clone()).or_default() += 1;
        }
        load.into_iter().max_by_key(|(_, n)| *n).map(|(m, _)| m)
    };
    let assignments = store.list_assignments().await?;
    let member = busiest(&assignments).ok_or_else(|| Error::Scenario("no owner".into()))?;
    let op_error = |e: poolctl::Error| Error::Scenario(format!("operation: {e}"));
    if kind == Planned::Rebalance {
        // Empty one member: drain it, then cancel the drain so it takes instances again.
        let (drain, _) = client
            .start(proto::pool::v1::OperationKind::Drain, &member, &run(2))
            .await
            .map_err(op_error)?;
        client
            .wait(&drain.id, &mut poolctl::Progress::quiet())
            .await
            .map_err(op_error)?;
        steady(pool, store).await?;
        client.cancel(&drain.id).await.map_err(op_error)?;
        until(
            "the drained member back in service",
            Duration::from_secs(30),
            || async {
                let ops = store.list_operations().await?;
                Ok(ops
                    .iter()
                    .any(|o| o.id == drain.id && o.phase == gateway::store::OperationPhase::Cancelled)
                    .then_some(()))
            },
        )
        .await?;
    }
    let before = store.list_assignments().await?;
    let moving: Vec<(String, i64)> = match kind {
        Planned::Drain => before
            .iter()
            .filter(|a| a.member == member)
            .map(|a| (a.route.clone(), a.term))
            .collect(),
        Planned::Rebalance => before.iter().map(|a| (a.route.clone(), a.term)).collect(),
    };
    let all: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &all);
    let started = now_ms();
    let (op, proto_kind) = match kind {
        Planned::Drain => (
            client
                .start(proto::pool::v1::OperationKind::Drain, &member, &run(2))
                .await
                .map_err(op_error)?,
            "drain",
        ),
        Planned::Rebalance => (
            client
                .start(proto::pool::v1::OperationKind::Rebalance, "", &run(2))
                .await
                .map_err(op_error)?,
            "rebalance",
        ),
    };
    let done = client
        .wait(&op.0.id, &mut poolctl::Progress::quiet())
        .await
        .map_err(op_error)?;
    let finished = store
        .list_operations()
        .await?
        .into_iter()
        .find(|o| o.id == done.id)
        .map_or(0, |o| u64::try_from(o.updated_at_ms).unwrap_or(0));
    let after = store.list_assignments().await?;
    let moved: Vec<String> = moving
        .iter()
        .filter(|(route, term)| after.iter().any(|a| &a.route == route && a.term > *term))
        .map(|(route, _)| route.clone())
        .collect();
    let end = finished.max(started);
    until(
        "every agent reporting after the moves",
        Duration::from_secs(30),
        || async {
            Ok(all
                .iter()
                .all(|s| observe(pool, s).last_at_ms() > end + 500)
                .then_some(()))
        },
    )
    .await?;
    let observed: Vec<Observed> = all.iter().map(|s| observe(pool, s)).collect();
    Ok(Outcome {
        scenario: String::new(),
        backend: String::new(),
        seconds: end.saturating_sub(started) as f64 / 1000.0,
        measures: format!("{proto_kind} request (max_parallel 2) → operation succeeded"),
        pids_preserved: pids_before == agent_pids(pool, &all) && !pids_before.is_empty(),
        pids_after: agent_pids(pool, &all),
        pids_before,
        counter_continuous: observed.iter().all(Observed::continuous),
        max_counter_gap_ms: observed
            .iter()
            .map(|o| o.max_gap_ms(started, end + 500))
            .max()
            .unwrap_or(0),
        dual_owner_violations: observed.iter().map(Observed::dual_owner_violations).sum(),
        notes: format!("{} moved ({}); {}", moved.len(), moved.join(", "), done.message),
    })
}

/// A fresh database on the PostgreSQL server of `admin_url`.
pub(crate) async fn fresh_database(admin_url: &str, scenario: &str) -> Result<String, Error> {
    use sqlx::{Connection as _, Executor as _};
    sqlx::any::install_default_drivers();
    let name = format!("scenario_{}_{}", scenario.replace('-', "_"), now_ms());
    let mut admin = sqlx::AnyConnection::connect(admin_url).await.map_err(|e| {
        Error::Scenario(format!(
            "cannot connect to {}: {}",
            gateway::store::redact_url(admin_url),
            gateway::store::scrub(&e.to_string(), admin_url)
        ))
    })?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .map_err(|e| Error::Scenario(format!("cannot create database {name}: {e}")))?;
    let _ = admin.close().await;
    let mut url = url_with_database(admin_url, &name);
    if url.is_empty() {
        url = admin_url.to_owned();
    }
    Ok(url)
}

fn url_with_database(url: &str, database: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, query) = match rest.split_once('?') {
                Some((a, q)) => (a, Some(q)),
                None => (rest, None),
            };
            let host = authority.split('/').next().unwrap_or(authority);
            let mut out = format!("{scheme}://{host}/{database}");
            if let Some(q) = query {
                out.push('?');
                out.push_str(q);
            }
            out
        }
        None => String::new(),
    }
}

/// The table the command prints.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out = format!(
        "{:<22} {:<10} {:>8} {:>10} {:>6} {:>9} {:>5}  {}\n",
        "SCENARIO", "BACKEND", "SECONDS", "GAP (ms)", "PIDS", "COUNTER", "DUAL", "MEASURES"
    );
    for o in outcomes {
        out.push_str(&format!(
            "{:<22} {:<10} {:>8.2} {:>10} {:>6} {:>9} {:>5}  {}\n",
            o.scenario,
            o.backend,
            o.seconds,
            o.max_counter_gap_ms,
            if o.pids_preserved { "same" } else { "CHANGED" },
            if o.counter_continuous { "kept" } else { "RESET" },
            o.dual_owner_violations,
            o.measures
        ));
    }
    for o in outcomes.iter().filter(|o| !o.notes.is_empty()) {
        out.push_str(&format!("  {} ({}): {}\n", o.scenario, o.backend, o.notes));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_keep_host_and_query() {
        assert_eq!(
            url_with_database("postgres://u@127.0.0.1:5432/postgres?sslmode=disable", "x"),
            "postgres://u@127.0.0.1:5432/x?sslmode=disable"
        );
        assert_eq!(url_with_database("postgres://h", "x"), "postgres://h/x");
    }
}
