//! `scenarios scale`: how the gateway's cost grows with the pool. Real gateway processes
//! (TLS, the chosen store) with simulated members over real gRPC ([`member`]): 40 members
//! attach to one replica, then instances register through the registry RPC with bootstrap
//! tokens, 32 at a time. Measured: registration latency and rate, time from the last
//! registration until the members' snapshots hold every instance, the snapshot bytes that
//! took (against the final snapshots' size), and at rest the CPU and RSS of each replica and,
//! on PostgreSQL, the database's transactions and rows read per second.

pub mod member;
pub mod sessions;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gateway::registration::{Binding, Material};
use gateway::store::sealing::Keks;
use gateway::store::{Options, Store};
use gateway::tokens::Keyring;
use proto::common::v1::InstanceRef;
use proto::registry::v1::RegisterRequest;
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use self::member::Tally;
use crate::chaos::Backend;
use crate::local::{Config, LocalPool, http_get};
use crate::scenarios::Error;

/// Instances per namespace (the default namespace quota is 256).
const PER_NAMESPACE: usize = 200;
/// How long the pool may take to place everything after the last registration.
const PLACED_WITHIN: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct Settings {
    pub instances: usize,
    pub members: usize,
    /// Registrations in flight at a time.
    pub concurrency: usize,
    /// How long the at-rest figures are sampled.
    pub rest: Duration,
    pub root: PathBuf,
    pub backend: Backend,
}

impl Settings {
    pub fn new(instances: usize, root: PathBuf, backend: Backend) -> Self {
        Self {
            instances,
            members: 40,
            concurrency: 32,
            rest: Duration::from_secs(10),
            root,
            backend,
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub backend: String,
    pub instances: usize,
    pub members: usize,
    pub registered_in_s: f64,
    pub registrations_per_s: f64,
    pub register_ms_p50: f64,
    pub register_ms_p90: f64,
    pub register_ms_p99: f64,
    /// Registrations refused (any status).
    pub refused: usize,
    /// From the last registration's answer until the members' snapshots held every instance.
    pub placed_after_s: f64,
    pub snapshots: u64,
    pub snapshot_bytes: u64,
    /// Encoded size of the members' final snapshots, summed.
    pub final_snapshot_bytes: u64,
    /// Member streams that ended during the run (none should).
    pub streams_ended: u64,
    pub replicas: Vec<AtRest>,
    /// PostgreSQL only: database activity at rest.
    pub database: Option<DatabaseRate>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AtRest {
    pub replica: String,
    /// Serves the members' streams and the registrations.
    pub serving: bool,
    pub coordinator: bool,
    pub cpu_percent: f64,
    pub rss_mib: f64,
    /// Coordinator passes (plans of a pool view) during the window, and their mean duration.
    pub passes: u64,
    pub pass_ms_mean: f64,
}

const PASS_SUM: &str = "openshell_gateway_coordinator_pass_seconds_sum";
const PASS_COUNT: &str = "openshell_gateway_coordinator_pass_seconds_count";

/// The values of unlabelled samples `names` in a gateway's `/metrics` (0 for one not there).
pub(crate) async fn samples(health: &str, names: &[&str]) -> Option<Vec<f64>> {
    let body = http_get(health, "/metrics", Duration::from_secs(2)).await?;
    let value = |name: &str| {
        body.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Some(names.iter().map(|name| value(name)).collect())
}

#[derive(Debug, Clone, Serialize)]
pub struct DatabaseRate {
    pub transactions_per_s: f64,
    pub rows_read_per_s: f64,
}

pub async fn run(settings: &Settings) -> Result<Report, Error> {
    let (mut server, database_url) = settings.backend.database("scale").await?;
    let config = Config {
        root: settings.root.clone(),
        database_url,
        gateways: 2,
        members: 0,
        sandboxes: 0,
        lease_length_ms: 5_000,
        plaintext: false,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: false,
        policy: None,
        secrets: None,
    };
    let pool = LocalPool::start(config).await?;
    let result = measure(settings, &pool).await;
    pool.stop().await;
    if let Some(server) = server.as_mut() {
        let _ = server.halt().await;
    }
    result
}

async fn measure(settings: &Settings, pool: &LocalPool) -> Result<Report, Error> {
    let keks = Keks::load(pool.kek(), None).map_err(|e| Error::Scenario(e.to_string()))?;
    let store = Store::open(pool.database_url(), &Options::default())
        .await?
        .with_keks(Arc::new(keks));
    let keyring = Keyring::load(&store, proto::trust::DEFAULT_ISSUER)
        .await
        .map_err(|e| Error::Scenario(format!("cannot load the signing keys: {e}")))?;
    let serving = &pool.gateways[0];
    let tls = pool.client_tls();
    let connect = || async {
        tls.connect(&serving.endpoint, Duration::from_secs(5))
            .await
            .map_err(|e| Error::Scenario(format!("cannot connect to {}: {e}", serving.endpoint)))
    };

    // Members.
    let tally = Arc::new(Tally::default());
    let stop = CancellationToken::new();
    let capacity = u32::try_from(settings.instances.div_ceil(settings.members.max(1)) + 16)
        .unwrap_or(u32::MAX)
        .min(proto::MAX_INSTANCES_PER_MEMBER);
    for i in 0..settings.members {
        let name = format!("sim-{i}");
        let token = mint(
            &keyring,
            proto::trust::Kind::Supervisor,
            &proto::trust::member_subject(&name),
            &proto::trust::NoExtra {},
        )?;
        member::attach(connect().await?, &token, &name, capacity, tally.clone(), stop.clone())
            .await
            .map_err(|s| Error::Scenario(format!("{name} cannot attach: {}", s.message())))?;
    }
    let members_live = || async {
        let (now, all) = store.list_members().await.ok()?;
        (all.iter().filter(|m| m.is_live(now)).count() >= settings.members).then_some(())
    };
    poll("every member live", Duration::from_secs(30), members_live).await?;

    // Registrations, `concurrency` at a time over a few shared connections.
    let channels = [connect().await?, connect().await?, connect().await?, connect().await?];
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(settings.instances);
    let mut refused = 0;
    let mut in_flight = JoinSet::new();
    for i in 0..settings.instances {
        if in_flight.len() >= settings.concurrency
            && let Some(done) = in_flight.join_next().await
        {
            record(done, &mut latencies, &mut refused);
        }
        let (namespace, name) = (format!("scale-{}", i / PER_NAMESPACE), format!("agent-{i}"));
        let claims = proto::trust::InstanceTokenClaims {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: None,
        };
        let route = format!("{namespace}/{name}");
        let token = mint(
            &keyring,
            proto::trust::Kind::Instance,
            &proto::trust::instance_subject(&route),
            &claims,
        )?;
        let channel = channels[i % channels.len()].clone();
        in_flight.spawn(register(channel, token, namespace, name));
    }
    while let Some(done) = in_flight.join_next().await {
        record(done, &mut latencies, &mut refused);
    }
    let registered_in = started.elapsed();
    let last_answer = Instant::now();
    let expected = settings.instances - refused;
    poll("every instance in a member's snapshot", PLACED_WITHIN, || async {
        (tally.owned.load(Ordering::Relaxed) >= expected).then_some(())
    })
    .await?;
    let placed_after = last_answer.elapsed();

    // At rest: let the last reports land, then sample.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pids: Vec<Option<u32>> = pool.gateways.iter().map(|g| g.process.pid()).collect();
    let cpu_before: Vec<Option<u64>> = pids.iter().map(|p| p.and_then(cpu_ticks)).collect();
    let db_before = database_counters(&store).await;
    let mut passes_before = Vec::new();
    for gateway in &pool.gateways {
        passes_before.push(samples(&gateway.health, &[PASS_SUM, PASS_COUNT]).await);
    }
    let rest_started = Instant::now();
    tokio::time::sleep(settings.rest).await;
    let rest = rest_started.elapsed().as_secs_f64();
    let db_after = database_counters(&store).await;
    let mut replicas = Vec::new();
    for (i, gateway) in pool.gateways.iter().enumerate() {
        let cpu = match (cpu_before[i], pids[i].and_then(cpu_ticks)) {
            (Some(before), Some(after)) => ticks_as_seconds(after.saturating_sub(before)) / rest * 100.0,
            _ => f64::NAN,
        };
        let (passes, pass_ms_mean) = match (
            &passes_before[i],
            samples(&gateway.health, &[PASS_SUM, PASS_COUNT]).await,
        ) {
            (Some(before), Some(after)) => {
                let count = after[1] - before[1];
                (
                    count as u64,
                    if count > 0.0 {
                        (after[0] - before[0]) / count * 1000.0
                    } else {
                        0.0
                    },
                )
            }
            _ => (0, f64::NAN),
        };
        replicas.push(AtRest {
            replica: gateway.name.clone(),
            serving: i == 0,
            coordinator: pool.coordinator_term(i).await.is_some_and(|term| term > 0),
            cpu_percent: cpu,
            rss_mib: pids[i].and_then(rss_kib).map_or(f64::NAN, |k| k as f64 / 1024.0),
            passes,
            pass_ms_mean,
        });
    }
    let database = match (db_before, db_after) {
        (Some((tx0, rows0)), Some((tx1, rows1))) => Some(DatabaseRate {
            transactions_per_s: (tx1 - tx0) as f64 / rest,
            rows_read_per_s: (rows1 - rows0) as f64 / rest,
        }),
        _ => None,
    };
    store.close().await;
    latencies.sort_by(f64::total_cmp);
    // Read before the members stop (a stopped member takes its snapshot out of the tally).
    let report = Report {
        backend: settings.backend.name().into(),
        instances: settings.instances,
        members: settings.members,
        registered_in_s: registered_in.as_secs_f64(),
        registrations_per_s: latencies.len() as f64 / registered_in.as_secs_f64().max(f64::EPSILON),
        register_ms_p50: percentile(&latencies, 0.50),
        register_ms_p90: percentile(&latencies, 0.90),
        register_ms_p99: percentile(&latencies, 0.99),
        refused,
        placed_after_s: placed_after.as_secs_f64(),
        snapshots: tally.snapshots.load(Ordering::Relaxed),
        snapshot_bytes: tally.snapshot_bytes.load(Ordering::Relaxed),
        final_snapshot_bytes: tally.latest_bytes.load(Ordering::Relaxed),
        streams_ended: tally.ended.load(Ordering::Relaxed),
        replicas,
        database,
    };
    stop.cancel();
    Ok(report)
}

fn mint<E: Serialize>(keyring: &Keyring, kind: proto::trust::Kind, subject: &str, extra: &E) -> Result<String, Error> {
    keyring
        .mint(kind, subject, Duration::from_secs(3600), extra)
        .map(|m| m.token)
        .map_err(|e| Error::Scenario(format!("cannot mint a token: {e}")))
}

/// One registration as a sidecar makes it; its latency in ms, or the refusal.
async fn register(channel: Channel, token: String, namespace: String, name: String) -> Result<f64, tonic::Status> {
    let route = format!("{namespace}/{name}");
    let uid = format!("uid-{name}");
    let binding = Binding {
        route: &route,
        namespace: &namespace,
        name: &name,
        uid: &uid,
    };
    let request = RegisterRequest {
        registration_material: Material::new(&binding, &[7u8; 32]).encode(),
        instance: Some(InstanceRef {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
            generation: 0,
        }),
        route,
        workload: None,
        build_version: plumbing::build::version().to_owned(),
        ..RegisterRequest::default()
    };
    let mut request = tonic::Request::new(request);
    request.set_timeout(Duration::from_secs(30));
    plumbing::token::Token::new(token)
        .authorize(&mut request)
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
    let started = Instant::now();
    InstanceRegistryClient::new(channel).register(request).await?;
    Ok(started.elapsed().as_secs_f64() * 1000.0)
}

fn record(
    done: Result<Result<f64, tonic::Status>, tokio::task::JoinError>,
    latencies: &mut Vec<f64>,
    refused: &mut usize,
) {
    match done {
        Ok(Ok(ms)) => latencies.push(ms),
        Ok(Err(status)) => {
            if *refused == 0 {
                eprintln!(
                    "scale: a registration was refused: {:?} {}",
                    status.code(),
                    status.message()
                );
            }
            *refused += 1;
        }
        Err(_) => *refused += 1,
    }
}

async fn poll<F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<(), Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<()>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await.is_some() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Scenario(format!("timed out waiting for {what}")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// User + system CPU ticks of process `pid`.
pub(crate) fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU `ticks` as seconds.
pub(crate) fn ticks_as_seconds(ticks: u64) -> f64 {
    let per_s = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64);
    ticks as f64 / per_s
}

pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// PostgreSQL: committed transactions and rows read (returned + fetched) in this database.
async fn database_counters(store: &Store) -> Option<(i64, i64)> {
    store.database_activity().await.ok().flatten()
}

/// The figures as a markdown table, one row per run.
pub fn table(reports: &[Report]) -> String {
    let mut out = String::from(
        "| store | instances | members | registered in | registrations/s (p50 / p90 / p99) | refused | all placed after | snapshot bytes (final) | streams ended | serving replica at rest | other replica at rest | database at rest |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let rest = |serving: bool| {
            r.replicas
                .iter()
                .find(|a| a.serving == serving)
                .map_or("-".to_owned(), |a| {
                    let coordinator = if a.coordinator {
                        format!(" (coordinator: {} passes, {:.1} ms each)", a.passes, a.pass_ms_mean)
                    } else {
                        String::new()
                    };
                    format!("{:.1} % CPU, {:.0} MiB{coordinator}", a.cpu_percent, a.rss_mib)
                })
        };
        let database = r.database.as_ref().map_or("-".to_owned(), |d| {
            format!("{:.0} tx/s, {:.0} rows read/s", d.transactions_per_s, d.rows_read_per_s)
        });
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} s | {:.0} ({:.0} / {:.0} / {:.0} ms) | {} | {:.2} s | {:.1} MiB ({:.2} MiB) | {} | {} | {} | {} |\n",
            r.backend,
            r.instances,
            r.members,
            r.registered_in_s,
            r.registrations_per_s,
            r.register_ms_p50,
            r.register_ms_p90,
            r.register_ms_p99,
            r.refused,
            r.placed_after_s,
            r.snapshot_bytes as f64 / 1048576.0,
            r.final_snapshot_bytes as f64 / 1048576.0,
            r.streams_ended,
            rest(true),
            rest(false),
            database,
        ));
    }
    out
}
