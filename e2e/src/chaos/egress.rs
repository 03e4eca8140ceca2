//! The egress side of the history. While the trials run, the driver keeps traffic going
//! through every sidecar's proxy; the faults of the pool (members, gateways, the database)
//! must change nothing of what the sidecars enforce:
//!
//! - a tunnel to the allowed upstream, held for the whole run, answers every echo: no allowed
//!   connection is broken by a handoff;
//! - every [`EVERY`], a new tunnel to the allowed upstream is let through, and one to the
//!   denied upstream gets the 403 — which never accepts a connection: no denied connection
//!   is ever opened;
//! - at the end ([`Traffic::finish`]), each sidecar's audit trail holds its sequences once
//!   each, from 1 without a gap, with as many denials as the driver was refused and as many
//!   allowed tunnels as it opened: no record lost or duplicated across the handoffs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::egress::connect;
use crate::local::LocalPool;
use crate::scenarios::{Error, now_ms};

/// How often each sidecar is asked for a new allowed and a new denied tunnel, and its held
/// tunnel echoes.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long one step of a connection may take.
const STEP: Duration = Duration::from_secs(5);
/// How long the audit trail may take to hold everything after the traffic stopped.
const DELIVERED_WITHIN: Duration = Duration::from_secs(60);

/// The policy file the chaos pool runs: the allowed upstream and nothing else.
pub fn policy(allowed: SocketAddr) -> String {
    format!(
        "name: chaos\nrevision: 1\nrules:\n  - name: allowed\n    host: {}\n    ports: [{}]\n",
        allowed.ip(),
        allowed.port()
    )
}

/// What the driver did through one sidecar.
#[derive(Debug, Default)]
struct Counts {
    /// Tunnels to the allowed upstream the proxy let through (the held ones included).
    allowed: AtomicU64,
    /// CONNECTs to the denied upstream answered 403.
    denied: AtomicU64,
    /// `allowed` and `denied` when the store last lost data: the records acknowledged
    /// before may be gone with it (the sidecar dropped them once the store had them).
    lost_at: Mutex<(u64, u64)>,
}

/// The two upstreams: one that echoes, one that must never see a connection.
pub struct Upstreams {
    pub allowed: SocketAddr,
    pub denied: SocketAddr,
    /// Connections the denied upstream accepted.
    breaches: Arc<AtomicU64>,
}

impl Upstreams {
    pub async fn start() -> Result<Self, Error> {
        let failed = |err: std::io::Error| Error::Scenario(format!("egress upstreams: {err}"));
        let allowed = TcpListener::bind("127.0.0.1:0").await.map_err(failed)?;
        let denied = TcpListener::bind("127.0.0.1:0").await.map_err(failed)?;
        let (allowed_at, denied_at) = (
            allowed.local_addr().map_err(failed)?,
            denied.local_addr().map_err(failed)?,
        );
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = allowed.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let breaches = Arc::new(AtomicU64::new(0));
        let counted = breaches.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = denied.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                drop(stream);
            }
        });
        Ok(Self {
            allowed: allowed_at,
            denied: denied_at,
            breaches,
        })
    }
}

/// The traffic through every sidecar, and what went wrong with it.
pub struct Traffic {
    upstreams: Upstreams,
    counts: BTreeMap<String, Arc<Counts>>,
    violations: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
    breaches_told: u64,
}

impl Traffic {
    /// Starts the traffic through each sandbox's proxy (`name`, `proxy`); each first waits
    /// until its sidecar lets the held tunnel through.
    pub fn start(upstreams: Upstreams, proxies: Vec<(String, SocketAddr)>) -> Self {
        let violations = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut counts = BTreeMap::new();
        for (name, proxy) in proxies {
            let count = Arc::new(Counts::default());
            counts.insert(name.clone(), count.clone());
            let through = Through {
                name,
                proxy,
                allowed: upstreams.allowed,
                denied: upstreams.denied,
                counts: count,
                violations: violations.clone(),
            };
            tasks.spawn(through.run(stop.clone()));
        }
        Self {
            upstreams,
            counts,
            violations,
            stop,
            tasks,
            breaches_told: 0,
        }
    }

    /// The violations found since the last call.
    pub fn violations(&mut self) -> Vec<String> {
        let mut out: Vec<String> = std::mem::take(&mut *lock(&self.violations));
        let breaches = self.upstreams.breaches.load(Ordering::Relaxed);
        if breaches > self.breaches_told {
            out.push(format!(
                "egress: the denied upstream accepted {} connection(s)",
                breaches - self.breaches_told
            ));
            self.breaches_told = breaches;
        }
        out
    }

    /// The store lost data (emptied, or commits it acknowledged): the trail may lack what was
    /// decided before now, no more.
    pub fn store_lost_data(&self) {
        for counts in self.counts.values() {
            *lock(&counts.lost_at) = (
                counts.allowed.load(Ordering::Relaxed),
                counts.denied.load(Ordering::Relaxed),
            );
        }
    }

    /// Stops the traffic (the held tunnels close) and checks each sandbox's audit trail
    /// against what was done: the violations found, and a line of figures.
    pub async fn finish(mut self, pool: &LocalPool) -> (Vec<String>, String) {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
        let mut out = self.violations();
        let mut records = 0;
        for (name, counts) in &self.counts {
            let expected = (
                counts.allowed.load(Ordering::Relaxed),
                counts.denied.load(Ordering::Relaxed),
            );
            // What a store that lost data lost: at most what was decided before.
            let lost = *lock(&counts.lost_at);
            let least = (expected.0 - lost.0, expected.1 - lost.1);
            let deadline = tokio::time::Instant::now() + DELIVERED_WITHIN;
            let trail = loop {
                let trail = pool.audit(name).await.unwrap_or_default();
                let (allowed, denied) = tally(&trail).0;
                let done = allowed >= expected.0 && denied >= expected.1;
                let enough = lost != (0, 0) && allowed >= least.0 && denied >= least.1;
                if done || enough || tokio::time::Instant::now() > deadline {
                    break trail;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            };
            let ((allowed, denied), sequences) = tally(&trail);
            records += sequences.len();
            let held = allowed >= least.0 && denied >= least.1 && allowed <= expected.0 && denied <= expected.1;
            if !held {
                out.push(format!(
                    "egress: {name}'s audit trail holds {allowed} allowed tunnels and {denied} denials; \
                     the driver opened {} and was refused {} ({} and {} of them before the store lost data)",
                    expected.0, expected.1, lost.0, lost.1
                ));
            }
            // Once each, in order, from 1. A store that lost data may lack some of what it had
            // acknowledged (the start of an emptied store's trail, the commits of a server
            // stopped before it wrote them): then once each, in order.
            let held = if lost == (0, 0) {
                sequences.iter().zip(1..).all(|(s, n)| *s == n)
            } else {
                sequences.windows(2).all(|w| w[0] < w[1])
            };
            if !held {
                let shown: Vec<u64> = sequences.iter().take(20).copied().collect();
                out.push(format!(
                    "egress: {name}'s audit sequences are not {} once each: {shown:?}…",
                    if lost == (0, 0) {
                        format!("1..={}", sequences.len())
                    } else {
                        "increasing".to_owned()
                    }
                ));
            }
        }
        let figures = format!(
            "egress: {} sidecars, {} audit records checked, the denied upstream accepted {}",
            self.counts.len(),
            records,
            self.upstreams.breaches.load(Ordering::Relaxed)
        );
        (out, figures)
    }
}

/// (allowed, denied) records of the driver's tunnels, and every sequence in storing order.
fn tally(trail: &[proto::pool::v1::AuditEntry]) -> ((u64, u64), Vec<u64>) {
    let mut counts = (0, 0);
    let mut sequences = Vec::with_capacity(trail.len());
    for record in trail.iter().filter_map(|e| e.record.as_ref()) {
        sequences.push(record.sequence);
        match record.decision.as_str() {
            "allow" => counts.0 += 1,
            "deny" => counts.1 += 1,
            _ => {}
        }
    }
    (counts, sequences)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The traffic through one sidecar.
struct Through {
    name: String,
    proxy: SocketAddr,
    allowed: SocketAddr,
    denied: SocketAddr,
    counts: Arc<Counts>,
    violations: Arc<Mutex<Vec<String>>>,
}

impl Through {
    async fn run(self, stop: CancellationToken) {
        let mut held = None;
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => {}
            }
            match held.as_mut() {
                // Not yet: the first tunnel waits for the sidecar to enforce the policy.
                None => held = self.tunnel().await.ok(),
                Some(stream) => {
                    if let Err(err) = echo(stream).await {
                        self.violation(format!("the held tunnel broke: {err}"));
                        held = None;
                        continue;
                    }
                    match self.tunnel().await {
                        Ok(mut fresh) => {
                            if let Err(err) = echo(&mut fresh).await {
                                self.violation(format!("a new allowed tunnel did not echo: {err}"));
                            }
                        }
                        Err(err) => self.violation(format!("a new allowed tunnel was refused: {err}")),
                    }
                    match connect(self.proxy, self.denied, STEP).await {
                        Ok((403, _)) => {
                            self.counts.denied.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok((status, _)) => self.violation(format!("the denied upstream answered {status}, not 403")),
                        Err(err) => self.violation(format!("the denied upstream got no 403: {err}")),
                    }
                }
            }
        }
    }

    /// A tunnel to the allowed upstream, counted when let through — and when refused (before
    /// the owner installed the policy the sidecar denies everything, and records it).
    async fn tunnel(&self) -> Result<TcpStream, String> {
        match connect(self.proxy, self.allowed, STEP).await {
            Ok((200, stream)) => {
                self.counts.allowed.fetch_add(1, Ordering::Relaxed);
                Ok(stream)
            }
            Ok((403, _)) => {
                self.counts.denied.fetch_add(1, Ordering::Relaxed);
                Err("status 403".into())
            }
            Ok((status, _)) => Err(format!("status {status}")),
            Err(err) => Err(err.to_string()),
        }
    }

    fn violation(&self, what: String) {
        lock(&self.violations).push(format!("egress: {} at {}: {what}", self.name, now_ms()));
    }
}

/// One byte there and back within [`STEP`].
async fn echo(stream: &mut TcpStream) -> Result<(), String> {
    let exchange = async {
        stream.write_all(b"e").await?;
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await?;
        Ok::<_, std::io::Error>(())
    };
    match tokio::time::timeout(STEP, exchange).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no echo within {} s", STEP.as_secs())),
    }
}
