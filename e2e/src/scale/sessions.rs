//! `scenarios scale --sessions N`: one member with many real sessions. Real processes end to
//! end — two gateway replicas, two members, N sandboxes (sidecar and counting agent each) — on
//! the chosen store. The sandboxes are first gathered on one member (its peer drained), then:
//! that member at rest (its RSS, the gateways' CPU, report and snapshot traffic, stream
//! reconnects), a drain of all N at `max_parallel` 8, one at `max_parallel` 1, and a SIGKILL of
//! the member holding all N. Each step reports its time, the agents' longest gap and refusals,
//! and whether every workload kept its PID.

use std::time::Duration;

use gateway::store::{AssignmentPhase, Options, OwnershipTerm, Store};
use nix::sys::signal::Signal;
use serde::Serialize;

use crate::agent_log::Observed;
use crate::chaos::Backend;
use crate::local::{Config, LocalPool};
use crate::scenarios::{Error, agent_pids, now_ms, observe, operator, until};

/// How long starting every sandbox, or one step, may take.
const STEP_LIMIT: Duration = Duration::from_secs(300);
/// The at-rest window.
const REST: Duration = Duration::from_secs(10);
/// Each agent counts and reports every 250 ms (the measurements): 1,024 relayed
/// requests a second at 256 sessions.
const AGENT_INTERVAL_MS: u64 = 250;

#[derive(Debug, Clone)]
pub struct Settings {
    pub sessions: usize,
    pub root: std::path::PathBuf,
    pub backend: Backend,
    /// The members attach to the replica that did not start first ([`Config::members_on_standby`]).
    pub members_on_standby: bool,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub backend: String,
    pub sessions: usize,
    /// From the first process started until every session is active and reporting.
    pub started_in_s: f64,
    /// Whether the replica holding the lease is the one the members attached to (`None`:
    /// no replica said it holds the lease).
    pub coordinator_serves_members: Option<bool>,
    pub at_rest: AtRest,
    pub steps: Vec<Step>,
}

/// The member holding every session, at rest.
#[derive(Debug, Clone, Serialize)]
pub struct AtRest {
    pub member_rss_mib: f64,
    pub member_cpu_percent: f64,
    /// CPU of each gateway replica.
    pub gateway_cpu_percent: Vec<f64>,
    pub report_bytes_per_s: f64,
    pub snapshot_bytes_per_s: f64,
    /// The member's host-stream reconnects in the window.
    pub reconnects: usize,
}

/// One planned move or fault.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub step: String,
    pub seconds: f64,
    pub moved: usize,
    /// Longest gap between two accepted progress reports of any agent during the step.
    pub max_gap_ms: u64,
    /// Answers the agents got that were not `ok` during the step.
    pub refused: usize,
    pub pids_preserved: bool,
}

pub async fn run(settings: &Settings) -> Result<Report, Error> {
    let (mut server, database_url) = settings.backend.database("sessions").await?;
    let config = Config {
        root: settings.root.clone(),
        database_url,
        gateways: 2,
        members: 2,
        sandboxes: settings.sessions,
        lease_length_ms: 5_000,
        plaintext: false,
        agent_interval_ms: AGENT_INTERVAL_MS,
        members_on_standby: settings.members_on_standby,
        cuttable_links: false,
        policy: None,
        secrets: None,
    };
    let started = now_ms();
    let pool = LocalPool::start(config).await?;
    let result = measure(settings, &pool, started).await;
    pool.stop().await;
    if let Some(server) = server.as_mut() {
        let _ = server.halt().await;
    }
    result
}

async fn measure(settings: &Settings, pool: &LocalPool, started: u64) -> Result<Report, Error> {
    let store = Store::open(pool.database_url(), &Options::default()).await?;
    let result = steps(settings, pool, &store, started).await;
    store.close().await;
    result
}

async fn steps(settings: &Settings, pool: &LocalPool, store: &Store, started: u64) -> Result<Report, Error> {
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    settle(pool, store, &sandboxes, None).await?;
    let started_in_s = seconds(started, now_ms());
    let (first, second) = (pool.members[0].name.clone(), pool.members[1].name.clone());
    let mut client = operator(pool).await?;
    let op_error = |e: poolctl::Error| Error::Scenario(format!("operation: {e}"));
    let mut steps = Vec::new();

    // Every session onto the first member: drain the second.
    let gather = drain(pool, store, &mut client, &second, 8, &sandboxes).await?;
    client.cancel(&gather.1).await.map_err(op_error)?;
    steps.push(Step {
        step: format!("gather: drain {second} (max_parallel 8)"),
        ..gather.0
    });
    let at_rest = rest(pool, &first).await?;
    let coordinator_serves_members = coordinator_serves_members(pool, settings.members_on_standby).await;

    // All of them off the first member at max_parallel 8, then back at max_parallel 1.
    let (step, id) = drain(pool, store, &mut client, &first, 8, &sandboxes).await?;
    steps.push(step);
    client.cancel(&id).await.map_err(op_error)?;
    settle(pool, store, &sandboxes, Some(&second)).await?;
    let (step, id) = drain(pool, store, &mut client, &second, 1, &sandboxes).await?;
    steps.push(step);
    client.cancel(&id).await.map_err(op_error)?;
    settle(pool, store, &sandboxes, Some(&first)).await?;

    // The member holding every session dies.
    steps.push(crash(pool, store, &first, &sandboxes).await?);
    Ok(Report {
        backend: settings.backend.name().into(),
        sessions: settings.sessions,
        started_in_s,
        coordinator_serves_members,
        at_rest,
        steps,
    })
}

/// Until every session is active (on `on` when given) and every agent reported since.
async fn settle(pool: &LocalPool, store: &Store, sandboxes: &[String], on: Option<&str>) -> Result<(), Error> {
    until("every session active", STEP_LIMIT, || async {
        let assignments = store.list_assignments().await?;
        let active = assignments
            .iter()
            .filter(|a| a.phase == AssignmentPhase::Active && on.is_none_or(|m| a.member == m))
            .count();
        Ok((active == sandboxes.len()).then_some(()))
    })
    .await?;
    let since = now_ms();
    until("every agent reporting", STEP_LIMIT, || async {
        Ok(sandboxes
            .iter()
            .all(|s| observe(pool, s).last_at_ms() > since)
            .then_some(()))
    })
    .await
}

/// Drain `member` at `max_parallel`, waiting for the operation; the step and its id.
async fn drain(
    pool: &LocalPool,
    store: &Store,
    client: &mut poolctl::Client,
    member: &str,
    max_parallel: u32,
    sandboxes: &[String],
) -> Result<(Step, String), Error> {
    let op_error = |e: poolctl::Error| Error::Scenario(format!("operation: {e}"));
    let before = store.list_assignments().await?;
    let moving = before.iter().filter(|a| a.member == member).count();
    let pids = agent_pids(pool, sandboxes);
    let started = now_ms();
    let run = poolctl::RunArgs {
        max_parallel,
        timeout_secs: 600,
        wait: true,
    };
    let (op, _) = client
        .start(proto::pool::v1::OperationKind::Drain, member, &run)
        .await
        .map_err(op_error)?;
    client
        .wait(&op.id, &mut poolctl::Progress::quiet())
        .await
        .map_err(op_error)?;
    let ended = now_ms();
    settle(pool, store, sandboxes, other_member(pool, member)).await?;
    let step = Step {
        step: format!("drain {member} (max_parallel {max_parallel})"),
        seconds: seconds(started, ended),
        moved: moving,
        ..observed(pool, sandboxes, &pids, started, ended)
    };
    Ok((step, op.id))
}

/// Whether the gateway holding the lease is the one the members attached to: the first of
/// their endpoint list ([`LocalPool::member_endpoints`]).
async fn coordinator_serves_members(pool: &LocalPool, members_on_standby: bool) -> Option<bool> {
    let mut coordinator = None;
    for index in 0..pool.gateways.len() {
        if pool.coordinator_term(index).await.is_some_and(|term| term > 0) {
            coordinator = Some(index);
        }
    }
    let serving = if members_on_standby {
        pool.gateways.len().checked_sub(1)?
    } else {
        0
    };
    coordinator.map(|c| c == serving)
}

/// The first member of `pool` that is not `member`.
fn other_member<'a>(pool: &'a LocalPool, member: &str) -> Option<&'a str> {
    pool.members.iter().map(|m| m.name.as_str()).find(|m| *m != member)
}

/// SIGKILL `member`; measured until every session it held is active elsewhere.
async fn crash(pool: &LocalPool, store: &Store, member: &str, sandboxes: &[String]) -> Result<Step, Error> {
    let held: Vec<(String, OwnershipTerm)> = store
        .list_assignments()
        .await?
        .into_iter()
        .filter(|a| a.member == member)
        .map(|a| (a.route, a.term))
        .collect();
    let pids = agent_pids(pool, sandboxes);
    let index = pool
        .members
        .iter()
        .position(|m| m.name == member)
        .ok_or_else(|| Error::Scenario(format!("{member} is not a member of this pool")))?;
    let started = now_ms();
    pool.members[index].process.signal(Signal::SIGKILL)?;
    until("every session active elsewhere", STEP_LIMIT, || async {
        let now = store.list_assignments().await?;
        let moved = held.iter().all(|(route, term)| {
            now.iter().any(|a| {
                &a.route == route && a.member != member && a.term > *term && a.phase == AssignmentPhase::Active
            })
        });
        Ok(moved.then_some(()))
    })
    .await?;
    let ended = now_ms();
    settle(pool, store, sandboxes, other_member(pool, member)).await?;
    Ok(Step {
        step: format!("SIGKILL {member}"),
        seconds: seconds(started, ended),
        moved: held.len(),
        ..observed(pool, sandboxes, &pids, started, ended)
    })
}

/// Gaps, refusals and PIDs of the agents over a step from `from` to `to` (ms).
fn observed(pool: &LocalPool, sandboxes: &[String], pids: &[u32], from: u64, to: u64) -> Step {
    let agents: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    Step {
        step: String::new(),
        seconds: 0.0,
        moved: 0,
        max_gap_ms: agents.iter().map(|o| o.max_gap_ms(from, to + 500)).max().unwrap_or(0),
        refused: agents
            .iter()
            .map(|o| {
                o.refused
                    .iter()
                    .filter(|(at, _)| (from..=to + 500).contains(at))
                    .count()
            })
            .sum(),
        pids_preserved: !pids.is_empty() && agent_pids(pool, sandboxes) == pids,
    }
}

/// `member` at rest for [`REST`]: its RSS and CPU, the gateways' CPU, the traffic counted by
/// the gateways' `/metrics`, and the member's reconnects (from its log).
async fn rest(pool: &LocalPool, member: &str) -> Result<AtRest, Error> {
    let process = pool
        .members
        .iter()
        .find(|m| m.name == member)
        .and_then(|m| m.process.pid())
        .ok_or_else(|| Error::Scenario(format!("{member} has no process")))?;
    let gateways: Vec<Option<u32>> = pool.gateways.iter().map(|g| g.process.pid()).collect();
    let log = pool.logs().join(format!("{member}.log"));
    let reconnects = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("reconnecting")
            .count()
    };
    let (reconnects_before, traffic_before) = (reconnects(), traffic(pool).await);
    let member_before = super::cpu_ticks(process);
    let gateways_before: Vec<Option<u64>> = gateways.iter().map(|p| p.and_then(super::cpu_ticks)).collect();
    tokio::time::sleep(REST).await;
    let window = REST.as_secs_f64();
    let percent = |before: Option<u64>, after: Option<u64>| match (before, after) {
        (Some(b), Some(a)) => super::ticks_as_seconds(a.saturating_sub(b)) / window * 100.0,
        _ => 0.0,
    };
    let traffic_after = traffic(pool).await;
    Ok(AtRest {
        member_rss_mib: super::rss_kib(process).map_or(0.0, |k| k as f64 / 1024.0),
        member_cpu_percent: percent(member_before, super::cpu_ticks(process)),
        gateway_cpu_percent: gateways
            .iter()
            .zip(gateways_before)
            .map(|(p, before)| percent(before, p.and_then(super::cpu_ticks)))
            .collect(),
        report_bytes_per_s: (traffic_after.0 - traffic_before.0) / window,
        snapshot_bytes_per_s: (traffic_after.1 - traffic_before.1) / window,
        reconnects: reconnects() - reconnects_before,
    })
}

/// Report and snapshot bytes the gateways counted, summed over the replicas.
async fn traffic(pool: &LocalPool) -> (f64, f64) {
    let mut sums = (0.0, 0.0);
    let names = [
        "openshell_gateway_member_report_bytes_total",
        "openshell_gateway_member_snapshot_bytes_total",
    ];
    for gateway in &pool.gateways {
        if let Some(values) = super::samples(&gateway.health, &names).await {
            sums.0 += values[0];
            sums.1 += values[1];
        }
    }
    sums
}

fn seconds(from_ms: u64, to_ms: u64) -> f64 {
    to_ms.saturating_sub(from_ms) as f64 / 1000.0
}

/// The runs as a Markdown table.
pub fn table(reports: &[Report]) -> String {
    let mut out = String::from(
        "| store | sessions | coordinator | started in | member RSS / CPU at rest | gateways' CPU at rest | reports / snapshots at rest | reconnects |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let a = &r.at_rest;
        let cpu: Vec<String> = a.gateway_cpu_percent.iter().map(|c| format!("{c:.1} %")).collect();
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} s | {:.1} MiB / {:.1} % | {} | {:.1} / {:.1} KiB/s | {} |\n",
            r.backend,
            r.sessions,
            match r.coordinator_serves_members {
                Some(true) => "serves the members",
                Some(false) => "elsewhere",
                None => "unknown",
            },
            r.started_in_s,
            a.member_rss_mib,
            a.member_cpu_percent,
            cpu.join(", "),
            a.report_bytes_per_s / 1024.0,
            a.snapshot_bytes_per_s / 1024.0,
            a.reconnects
        ));
    }
    out.push_str(
        "\n| store | step | sessions moved | took | longest agent gap | refused answers | PIDs kept |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        for s in &r.steps {
            out.push_str(&format!(
                "| {} | {} | {} | {:.2} s | {} ms | {} | {} |\n",
                r.backend,
                s.step,
                s.moved,
                s.seconds,
                s.max_gap_ms,
                s.refused,
                if s.pids_preserved { "yes" } else { "no" }
            ));
        }
    }
    out
}
