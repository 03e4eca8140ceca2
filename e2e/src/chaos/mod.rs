//! `scenarios chaos`: randomized single and overlapping faults on one local
//! pool of real processes (3 gateway replicas, 3 members, 8 sandboxes by
//! default), each trial followed by the history checker.
//!
//! - [`plan`]: what a trial does (seeded, pure);
//! - [`history`]: the rules checked over the agents' logs and the sampled lease;
//! - [`egress`]: traffic through every sidecar's egress proxy, checked the same way, and the
//!   audit trail checked against it at the end;
//! - this file: the driver — it starts the pool (and a private PostgreSQL when
//!   outages are wanted), samples the lease every 50 ms, runs each plan's
//!   steps, heals what is left, waits until the pool has settled, checks, and
//!   prints per fault kind the trials and the recovery figures.

pub mod egress;
pub mod history;
pub mod plan;
mod report;
mod settings;
mod settle;

pub use report::{Report, Trial, Violation, table};
pub use settings::{Backend, Settings};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gateway::store::{AssignmentPhase, OperationPhase, Options, Store};
use nix::sys::signal::Signal;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom as _, SliceRandom as _};

use self::history::{CoordinatorGaps, Seen};
use self::plan::{Action, Link, Plan, Snapshot, Target, Way};
use crate::agent_log::Follower;
use crate::local::{Config, LocalPool};
use crate::postgres;
use crate::scenarios::{Error, now_ms};

/// Running, paused or down: what the driver did to each process (the lease sampler reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Up,
    Paused,
    Down,
}

#[derive(Debug)]
struct Health {
    gateways: Vec<(String, State)>,
    members: Vec<State>,
    database_up: bool,
}

impl Health {
    fn gateway_up(&self, name: &str) -> bool {
        self.gateways.iter().any(|(n, s)| n == name && *s == State::Up)
    }

    fn could_coordinate(&self) -> bool {
        self.database_up && self.gateways.iter().any(|(_, s)| *s == State::Up)
    }
}

/// How long a settled pool may take after the bound before the run gives up as wedged.
const WEDGED_AFTER: Duration = Duration::from_secs(120);

pub async fn run(settings: &Settings) -> Result<Report, Error> {
    let (mut server, database_url) = settings.backend.database("chaos").await?;
    let upstreams = egress::Upstreams::start().await?;
    // Beside the pool's directory, which the pool starts afresh.
    let policy = settings.root.with_extension("policy.yaml");
    let written = std::fs::create_dir_all(policy.parent().unwrap_or(std::path::Path::new(".")))
        .and_then(|()| std::fs::write(&policy, egress::policy(upstreams.allowed)));
    written.map_err(|err| Error::Scenario(format!("{}: {err}", policy.display())))?;
    let config = Config {
        root: settings.root.clone(),
        database_url: database_url.clone(),
        gateways: settings.gateways,
        members: settings.members,
        sandboxes: settings.sandboxes,
        lease_length_ms: settings.lease_length_ms,
        plaintext: false,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: true,
        policy: Some(policy),
        secrets: None,
    };
    let mut pool = LocalPool::start(config).await?;
    let url =
        database_url.unwrap_or_else(|| format!("sqlite://{}?mode=rwc", pool.config.root.join("gateway.db").display()));
    let store = Store::open(&url, &Options::default()).await?;
    let result = Driver::new(settings, &mut pool, &store, server.as_mut())
        .run(upstreams)
        .await;
    store.close().await;
    pool.stop().await;
    if let Some(server) = server.as_mut() {
        // Stopped here, awaited, rather than by the blocking `Drop`.
        let _ = server.halt().await;
    }
    result
}

struct Driver<'a> {
    settings: &'a Settings,
    pool: &'a mut LocalPool,
    store: &'a Store,
    database: Option<&'a mut postgres::Server>,
    health: Arc<Mutex<Health>>,
    gaps: Arc<Mutex<CoordinatorGaps>>,
    agents: Vec<(String, Follower, Seen)>,
    /// Started once the pool first settled.
    traffic: Option<egress::Traffic>,
    report: Report,
    /// The assignments as `Action::Remember` read them, for `Action::Forget`.
    remembered: Vec<gateway::store::Assignment>,
    /// The store's commits are asynchronous (`Action::CommitsAsynchronous`) until the
    /// database is resumed.
    asynchronous: bool,
    /// The server's WAL writer, stopped while commits are asynchronous; killed by the halt.
    wal_writer: Option<nix::unistd::Pid>,
}

impl<'a> Driver<'a> {
    fn new(
        settings: &'a Settings,
        pool: &'a mut LocalPool,
        store: &'a Store,
        database: Option<&'a mut postgres::Server>,
    ) -> Self {
        let health = Health {
            gateways: pool.gateways.iter().map(|g| (g.name.clone(), State::Up)).collect(),
            members: vec![State::Up; pool.members.len()],
            database_up: true,
        };
        let agents = pool
            .sandboxes
            .iter()
            .map(|s| {
                let log = pool.logs().join(format!("{}-agent.log", s.name));
                (s.name.clone(), Follower::new(log), Seen::default())
            })
            .collect();
        Self {
            report: Report {
                backend: settings.backend.name().into(),
                seed: settings.seed,
                trials: Vec::new(),
                violations: Vec::new(),
                stopped_workloads: 0,
                accepted: 0,
                aborted: None,
                egress: None,
            },
            settings,
            pool,
            store,
            database,
            health: Arc::new(Mutex::new(health)),
            gaps: Arc::new(Mutex::new(CoordinatorGaps::default())),
            agents,
            traffic: None,
            remembered: Vec::new(),
            asynchronous: false,
            wal_writer: None,
        }
    }

    async fn run(mut self, upstreams: egress::Upstreams) -> Result<Report, Error> {
        let first = now_ms();
        if self.settle(0, first, &[]).await?.is_none() || !self.report.violations.is_empty() {
            let why = self.unsettled(first).await;
            return Err(Error::Scenario(format!("the pool did not reach steady state: {why}")));
        }
        let proxies = self
            .pool
            .sandboxes
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.egress.as_deref()?.parse().ok()?)))
            .collect();
        self.traffic = Some(egress::Traffic::start(upstreams, proxies));
        self.check(0).await?;
        let embedded = self
            .pool
            .database_url()
            .starts_with("sqlite:")
            .then(|| self.pool.database_url().to_owned());
        let sampler = tokio::spawn(sample_lease(
            self.store.clone(),
            embedded,
            self.health.clone(),
            self.gaps.clone(),
        ));
        let mut rng = StdRng::seed_from_u64(self.settings.seed);
        for index in 1..=self.settings.trials {
            let snapshot = self.snapshot().await?;
            let kinds: Vec<plan::Fault> = plan::kinds(&snapshot)
                .into_iter()
                .filter(|k| self.settings.kinds.is_empty() || self.settings.kinds.contains(k))
                .collect();
            if kinds.is_empty() {
                sampler.abort();
                return Err(Error::Scenario(
                    "none of the fault kinds asked for can run on this pool (the database ones need --postgres)".into(),
                ));
            }
            // With `every_kind_first`, trial i is of the i-th kind until each was run once.
            let fault = match kinds.get(index - 1) {
                Some(fault) if self.settings.every_kind_first => *fault,
                _ => *kinds.choose(&mut rng).unwrap_or(&plan::Fault::MemberKill),
            };
            let plan = plan::plan_of(&mut rng, fault, &snapshot);
            let outcome = self.trial(index, &plan).await;
            match outcome {
                Ok(true) => {}
                Ok(false) => break,
                Err(err) => {
                    sampler.abort();
                    return Err(err);
                }
            }
        }
        sampler.abort();
        if let Some(traffic) = self.traffic.take() {
            let (found, figures) = traffic.finish(self.pool).await;
            eprintln!("{figures}");
            let last = self.report.trials.len();
            for what in found {
                self.violation(last, what);
            }
            self.report.egress = Some(figures);
        }
        Ok(self.report)
    }

    /// Run one plan; `Ok(false)` when the pool did not settle and the run must end.
    async fn trial(&mut self, index: usize, plan: &Plan) -> Result<bool, Error> {
        let steps: Vec<String> = plan
            .steps
            .iter()
            .map(|s| format!("+{}ms {}", s.at_ms, self.describe(&s.action)))
            .collect();
        // The wall-clock time (UTC, as the processes' logs print it) to find the trial in them.
        let at = now_ms() % 86_400_000;
        let clock = format!(
            "{:02}:{:02}:{:02}.{:03}",
            at / 3_600_000,
            at / 60_000 % 60,
            at / 1000 % 60,
            at % 1000
        );
        eprintln!("trial {index} {} at {clock}Z: {}", plan.fault.name(), steps.join(", "));
        let before = self.owners().await?;
        let injected = now_ms();
        let start = tokio::time::Instant::now();
        let mut operations = Vec::new();
        for step in &plan.steps {
            tokio::time::sleep_until(start + Duration::from_millis(step.at_ms)).await;
            if let Some(op) = self.act(&step.action).await? {
                operations.push(op);
            }
        }
        self.heal().await?;
        let healed = now_ms();
        let settled = self.settle(index, healed, &operations).await?;
        let Some(settled) = settled else {
            self.report.aborted = Some(format!(
                "trial {index} ({}): the pool did not settle within {} s of the heal",
                plan.fault.name(),
                (self.settings.settle_bound + WEDGED_AFTER).as_secs()
            ));
            return Ok(false);
        };
        // Everything since the last trial's check, quiet time included.
        let coordinator_gap_ms = lock(&self.gaps).take_longest(now_ms());
        if coordinator_gap_ms > self.settings.lease_length_ms + 1000 {
            self.violation(
                index,
                format!("no working coordinator for {coordinator_gap_ms} ms while a replica could have been one"),
            );
        }
        let (workload_gap_ms, refused) = self.agents.iter().fold((0, 0), |(gap, refused), (_, f, _)| {
            (
                gap.max(f.observed.max_gap_ms(injected, settled)),
                refused + f.observed.refused.iter().filter(|(at, _)| *at >= injected).count(),
            )
        });
        let after = self.owners().await?;
        let moved = before
            .iter()
            .filter(|(route, member)| after.get(*route) != Some(member))
            .count();
        self.report.trials.push(Trial {
            index,
            fault: plan.fault,
            steps,
            workload_gap_ms,
            settle_ms: settled.saturating_sub(healed),
            coordinator_gap_ms,
            refused,
            moved,
        });
        self.check(index).await?;
        Ok(true)
    }

    fn describe(&self, action: &Action) -> String {
        let name = |t: &Target| match t {
            Target::Gateway(g) => self.pool.gateways.get(*g).map_or("?".into(), |g| g.name.clone()),
            Target::Member(m) => self.pool.members.get(*m).map_or("?".into(), |m| m.name.clone()),
            Target::Database => "database".into(),
        };
        match action {
            Action::Kill(t) => format!("kill -9 {}", name(t)),
            Action::Pause(t) => format!("SIGSTOP {}", name(t)),
            Action::Resume(t) => format!("SIGCONT {}", name(t)),
            Action::Restart(t) => format!("restart {}", name(t)),
            Action::HaltDatabase => "stop the database".into(),
            Action::Cut(Link::Sidecars(m)) => format!("cut {}'s sidecars off", name(&Target::Member(*m))),
            Action::Cut(Link::Gateways(m)) => format!("cut {} off from every gateway", name(&Target::Member(*m))),
            Action::Cut(Link::OneWay { member, gateway, way }) => {
                let (member, gateway) = (name(&Target::Member(*member)), name(&Target::Gateway(*gateway)));
                match way {
                    Way::Up => format!("cut {member} → {gateway}"),
                    Way::Down => format!("cut {gateway} → {member}"),
                }
            }
            Action::Slow { member, delay_ms } => {
                format!(
                    "slow {}'s gateway links by {delay_ms} ms",
                    name(&Target::Member(*member))
                )
            }
            Action::HealLinks(m) => format!("heal {}'s links", name(&Target::Member(*m))),
            Action::CommitsAsynchronous => "commits asynchronous".into(),
            Action::ResumeDatabase => "start the database".into(),
            Action::EmptyStore => "empty the store".into(),
            Action::Remember => "remember the assignments".into(),
            Action::Forget => "the store forgets every assignment since".into(),
            Action::Drain { member, max_parallel } => {
                format!("drain {} (max_parallel {max_parallel})", name(&Target::Member(*member)))
            }
            Action::Rebalance { max_parallel } => format!("rebalance (max_parallel {max_parallel})"),
        }
    }

    /// Carry out one step; a started operation's id is returned.
    async fn act(&mut self, action: &Action) -> Result<Option<String>, Error> {
        match action {
            Action::Kill(t) => self.signal(*t, Signal::SIGKILL, State::Down)?,
            Action::Pause(t) => self.signal(*t, Signal::SIGSTOP, State::Paused)?,
            Action::Resume(t) => self.signal(*t, Signal::SIGCONT, State::Up)?,
            Action::Restart(t) => self.restart(*t).await?,
            Action::HaltDatabase => {
                if let Some(writer) = self.wal_writer.take() {
                    // A crash: what the server acknowledged and had not written is lost.
                    let _ = nix::sys::signal::kill(writer, Signal::SIGKILL);
                    if let Some(traffic) = &self.traffic {
                        traffic.store_lost_data();
                    }
                }
                if let Some(db) = self.database.as_deref_mut() {
                    lock(&self.health).database_up = false;
                    db.halt().await.map_err(|e| Error::Scenario(e.to_string()))?;
                }
            }
            Action::ResumeDatabase => self.resume_database().await?,
            Action::EmptyStore => {
                if let Some(traffic) = &self.traffic {
                    traffic.store_lost_data();
                }
                crate::scenarios::empty_database(self.pool.database_url()).await?;
            }
            Action::Remember => self.remembered = self.store.list_assignments().await?,
            Action::Forget => {
                let remembered = std::mem::take(&mut self.remembered);
                crate::scenarios::forget(self.pool.database_url(), &remembered).await?;
            }
            Action::Cut(link) => {
                let Some(member) = self.pool.members.get(link.member()) else {
                    return Ok(None);
                };
                match *link {
                    Link::Sidecars(_) => member.path.iter().for_each(testkit::fault::Path::cut),
                    Link::Gateways(_) => member.gateway_paths.iter().for_each(testkit::fault::Path::cut),
                    Link::OneWay { gateway, way, .. } => {
                        if let Some(path) = member.gateway_paths.get(gateway) {
                            path.cut_one_way(way);
                        }
                    }
                }
            }
            Action::Slow { member, delay_ms } => {
                for path in self.pool.members.get(*member).iter().flat_map(|m| &m.gateway_paths) {
                    path.slow(Duration::from_millis(*delay_ms));
                }
            }
            Action::HealLinks(m) => {
                if let Some(member) = self.pool.members.get(*m) {
                    heal_links(member);
                }
            }
            Action::CommitsAsynchronous => {
                self.wal_writer = crate::scenarios::commits_asynchronous(self.pool.database_url(), true).await?;
                self.asynchronous = true;
            }
            Action::Drain { member, max_parallel } => {
                let target = self
                    .pool
                    .members
                    .get(*member)
                    .map(|m| m.name.clone())
                    .unwrap_or_default();
                return Ok(self
                    .start_operation(proto::pool::v1::OperationKind::Drain, &target, *max_parallel)
                    .await);
            }
            Action::Rebalance { max_parallel } => {
                return Ok(self
                    .start_operation(proto::pool::v1::OperationKind::Rebalance, "", *max_parallel)
                    .await);
            }
        }
        Ok(None)
    }

    fn signal(&mut self, target: Target, signal: Signal, state: State) -> Result<(), Error> {
        let mut health = lock(&self.health);
        match target {
            Target::Gateway(g) => {
                if let Some(gateway) = self.pool.gateways.get(g) {
                    gateway.process.signal(signal)?;
                    health.gateways[g].1 = state;
                }
            }
            Target::Member(m) => {
                if let Some(member) = self.pool.members.get(m) {
                    member.process.signal(signal)?;
                    health.members[m] = state;
                }
            }
            Target::Database => {}
        }
        Ok(())
    }

    async fn restart(&mut self, target: Target) -> Result<(), Error> {
        match target {
            Target::Gateway(g) => {
                self.pool.restart_gateway(g).await?;
                lock(&self.health).gateways[g].1 = State::Up;
            }
            Target::Member(m) => {
                self.pool.restart_member(m).await?;
                lock(&self.health).members[m] = State::Up;
            }
            Target::Database => {}
        }
        Ok(())
    }

    async fn resume_database(&mut self) -> Result<(), Error> {
        if let Some(db) = self.database.as_deref_mut() {
            if !db.is_running() {
                db.resume().await.map_err(|e| Error::Scenario(e.to_string()))?;
            }
            lock(&self.health).database_up = true;
        }
        if let Some(writer) = self.wal_writer.take() {
            // Never halted (a run cut short): the writer goes on.
            let _ = nix::sys::signal::kill(writer, Signal::SIGCONT);
        }
        if std::mem::take(&mut self.asynchronous) {
            crate::scenarios::commits_asynchronous(self.pool.database_url(), false).await?;
        }
        Ok(())
    }

    /// Whatever a plan left paused or down is resumed or restarted.
    async fn heal(&mut self) -> Result<(), Error> {
        self.resume_database().await?;
        self.pool.members.iter().for_each(heal_links);
        let (gateways, members) = {
            let health = lock(&self.health);
            (
                health.gateways.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
                health.members.clone(),
            )
        };
        for (g, state) in gateways.into_iter().enumerate() {
            match state {
                State::Paused => self.signal(Target::Gateway(g), Signal::SIGCONT, State::Up)?,
                State::Down => self.restart(Target::Gateway(g)).await?,
                State::Up => {}
            }
        }
        for (m, state) in members.into_iter().enumerate() {
            match state {
                State::Paused => self.signal(Target::Member(m), Signal::SIGCONT, State::Up)?,
                State::Down => self.restart(Target::Member(m)).await?,
                State::Up => {}
            }
        }
        Ok(())
    }

    /// An operator client over the replicas that are running, in random order.
    async fn operator(&self) -> Option<poolctl::Client> {
        let mut endpoints: Vec<String> = {
            let health = lock(&self.health);
            self.pool
                .gateways
                .iter()
                .filter(|g| health.gateway_up(&g.name))
                .map(|g| g.endpoint.clone())
                .collect()
        };
        endpoints.shuffle(&mut rand::rng());
        self.pool.operator(endpoints).await.ok()
    }

    async fn start_operation(
        &self,
        kind: proto::pool::v1::OperationKind,
        target: &str,
        max_parallel: u32,
    ) -> Option<String> {
        let run = poolctl::RunArgs {
            max_parallel,
            timeout_secs: 120,
            wait: false,
        };
        let mut client = self.operator().await?;
        match tokio::time::timeout(Duration::from_secs(10), client.start(kind, target, &run)).await {
            Ok(Ok((op, _))) => Some(op.id),
            Ok(Err(err)) => {
                eprintln!("  the operation was not started: {err}");
                None
            }
            Err(_) => {
                eprintln!("  the operation was not started within 10 s");
                None
            }
        }
    }

    /// Targets for the planner.
    /// Each placed route's member.
    async fn owners(&self) -> Result<BTreeMap<String, String>, Error> {
        let assignments = self.store.list_assignments().await?;
        Ok(assignments.into_iter().map(|a| (a.route, a.member)).collect())
    }

    async fn snapshot(&self) -> Result<Snapshot, Error> {
        let lease = self.store.read_lease().await?;
        let coordinator = lease.and_then(|l| {
            let name = l.holder.split('/').next().unwrap_or_default().to_owned();
            self.pool.gateways.iter().position(|g| g.name == name)
        });
        let assignments = self.store.list_assignments().await?;
        let (_, members) = self.store.list_members().await?;
        let mut load = BTreeMap::new();
        for a in &assignments {
            *load.entry(a.member.as_str()).or_insert(0) += 1;
        }
        Ok(Snapshot {
            gateways: self.pool.gateways.len(),
            coordinator,
            load: self
                .pool
                .members
                .iter()
                .map(|m| load.get(m.name.as_str()).copied().unwrap_or(0))
                .collect(),
            stream_holder: self
                .pool
                .members
                .iter()
                .map(|m| {
                    let holder = members.iter().find(|r| r.member == m.name)?.served_by.clone();
                    self.pool.gateways.iter().position(|g| g.name == holder)
                })
                .collect(),
            database_outages: self.database.is_some(),
        })
    }
}

/// Every 50 ms: is a live lease held by a running replica? Fed to the gap tracker.
/// Samples every 50 ms whether a working coordinator holds the lease. A span without one is
/// excused while no replica could coordinate — and, on the embedded store (`embedded`: its URL),
/// while a paused gateway holds SQLite's write lock: a stopped process keeps its file lock, so
/// no replica can write until it runs again (PostgreSQL ends such a session after its idle
/// time-out; docs/operate.md says so for the embedded store).
async fn sample_lease(
    store: Store,
    embedded: Option<String>,
    health: Arc<Mutex<Health>>,
    gaps: Arc<Mutex<CoordinatorGaps>>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut locked_since: Option<u64> = None;
    // Consecutive probes that found the lock held: one could be a running replica's long write.
    let mut held_probes = 0u32;
    loop {
        tick.tick().await;
        let lease = tokio::time::timeout(Duration::from_secs(1), store.read_lease()).await;
        let (ok, mut excused, paused) = {
            let health = lock(&health);
            let ok = match &lease {
                Ok(Ok(Some(lease))) if lease.is_live() => {
                    health.gateway_up(lease.holder.split('/').next().unwrap_or_default())
                }
                _ => false,
            };
            (
                ok,
                !health.could_coordinate(),
                health.gateways.iter().any(|(_, s)| *s == State::Paused),
            )
        };
        held_probes = match &embedded {
            Some(url) if !ok && !excused && paused && write_lock_held(url).await => held_probes + 1,
            _ => 0,
        };
        let held = held_probes >= 2;
        match (held, locked_since) {
            (true, None) => locked_since = Some(now_ms()),
            (false, Some(since)) => {
                eprintln!(
                    "  a paused gateway held the embedded store's write lock for {} ms (excused)",
                    now_ms().saturating_sub(since)
                );
                locked_since = None;
            }
            _ => {}
        }
        excused |= held;
        lock(&gaps).sample(now_ms(), ok, excused);
    }
}

/// Whether another process holds the SQLite database's write lock for longer than a running
/// replica's transaction lasts (300 ms; the sampler wants two such probes in a row).
async fn write_lock_held(url: &str) -> bool {
    use sqlx::Connection as _;
    use std::str::FromStr as _;
    let Ok(options) = sqlx::sqlite::SqliteConnectOptions::from_str(url) else {
        return false;
    };
    let options = options.busy_timeout(Duration::from_millis(300));
    let Ok(Ok(mut conn)) =
        tokio::time::timeout(Duration::from_secs(1), sqlx::SqliteConnection::connect_with(&options)).await
    else {
        return false;
    };
    let begun = sqlx::Executor::execute(&mut conn, "BEGIN IMMEDIATE").await;
    let locked = match begun {
        Ok(_) => {
            let _ = sqlx::Executor::execute(&mut conn, "ROLLBACK").await;
            false
        }
        Err(sqlx::Error::Database(err)) => err.message().contains("locked") || err.code().as_deref() == Some("5"),
        Err(_) => false,
    };
    let _ = conn.close().await;
    locked
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every link of `member` open and at full speed again.
fn heal_links(member: &crate::local::Member) {
    for path in member.path.iter().chain(&member.gateway_paths) {
        path.heal();
        path.slow(Duration::ZERO);
    }
}
