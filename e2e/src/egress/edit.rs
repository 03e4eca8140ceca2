//! `scenarios policy-edit`: how soon a policy edit is enforced in every sidecar of a pool. A
//! local pool of N sandboxes (two gateways, two members) runs a policy file that allows one
//! upstream; every sidecar holds a tunnel to it. The file is then replaced by the next
//! revision, which no longer allows the upstream, and each sidecar closes its tunnel when it
//! installs that revision: the time from the file's replacement to each close is the edit's
//! latency in that sidecar, measured without asking anything of the sidecars meanwhile. Each
//! edit is first undone (the rule allowed again, the tunnels reopened) and then measured again.
//!
//! Locally the members look at the file every second (`supervisor/src/policy.rs`); in Kubernetes
//! the edit goes from the `SandboxPolicy` watch through the coordinator's snapshot to the
//! members instead, which the cluster test measures for one Pod.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use tokio::io::AsyncReadExt;

use super::{Error, Via, open, ping, upstream_on};
use crate::local::{Config, LocalPool};
use crate::scale::percentile;

/// How long starting the pool, or reopening every tunnel, may take.
const START_LIMIT: Duration = Duration::from_secs(600);
/// How long one sidecar may take to enforce an edit before it counts as never.
const EDIT_LIMIT: Duration = Duration::from_secs(30);
/// Tunnels opened at once.
const OPENING: usize = 32;

#[derive(Debug, Clone)]
pub struct Settings {
    pub root: PathBuf,
    pub pods: usize,
    /// Revoking edits measured, one after another.
    pub edits: usize,
}

/// One revoking edit across the pool.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub pods: usize,
    pub revision: u64,
    /// Sidecars that closed their tunnel within [`EDIT_LIMIT`].
    pub enforced: usize,
    pub first_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub last_ms: f64,
}

/// The policy document of `revision`: odd revisions allow `upstream`, even ones do not.
fn document(revision: u64, upstream: SocketAddr) -> String {
    let rules = if revision % 2 == 1 {
        format!(
            "rules:\n  - name: upstream\n    host: {}\n    ports: [{}]\n",
            upstream.ip(),
            upstream.port()
        )
    } else {
        "rules: []\n".to_owned()
    };
    format!("name: edit-bench\nrevision: {revision}\n{rules}")
}

/// Replaces `path` at once (a member never reads half a file).
fn replace(path: &Path, text: &str) -> Result<(), Error> {
    let next = path.with_extension("next");
    std::fs::write(&next, text)?;
    std::fs::rename(&next, path)?;
    Ok(())
}

pub async fn run(settings: &Settings) -> Result<Vec<Row>, Error> {
    std::fs::create_dir_all(&settings.root)?;
    let upstream = upstream_on(std::net::Ipv4Addr::LOCALHOST.into()).await?;
    let policy = settings.root.join("policy.yaml");
    replace(&policy, &document(1, upstream))?;
    eprintln!("policy-edit: starting {} sandboxes ...", settings.pods);
    let started = Instant::now();
    let pool = LocalPool::start(Config {
        root: settings.root.join("pool"),
        database_url: None,
        gateways: 2,
        members: 2,
        sandboxes: settings.pods,
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: 1000,
        members_on_standby: false,
        cuttable_links: false,
        policy: Some(policy.clone()),
        secrets: None,
    })
    .await?;
    let proxies: Vec<SocketAddr> = pool
        .sandboxes
        .iter()
        .filter_map(|s| s.egress.as_deref()?.parse().ok())
        .collect();
    let result = measure(settings, &policy, upstream, &proxies, started).await;
    pool.stop().await;
    result
}

async fn measure(
    settings: &Settings,
    policy: &Path,
    upstream: SocketAddr,
    proxies: &[SocketAddr],
    started: Instant,
) -> Result<Vec<Row>, Error> {
    let mut rows = Vec::new();
    for edit in 0..settings.edits {
        let allowing = 1 + 2 * edit as u64;
        if edit > 0 {
            replace(policy, &document(allowing, upstream))?;
        }
        let tunnels = open_all(proxies, upstream).await?;
        if edit == 0 {
            eprintln!(
                "policy-edit: {} sidecars enforce revision 1, {:.1} s after the first process started",
                tunnels.len(),
                started.elapsed().as_secs_f64()
            );
        }
        let revoking = allowing + 1;
        let t0 = Instant::now();
        replace(policy, &document(revoking, upstream))?;
        let mut closed: Vec<f64> = futures::stream::iter(tunnels)
            .map(|mut tunnel| async move {
                let mut buf = [0u8; 64];
                let closed = tokio::time::timeout(EDIT_LIMIT, async {
                    while matches!(tunnel.read(&mut buf).await, Ok(n) if n > 0) {}
                })
                .await;
                closed.ok().map(|()| t0.elapsed().as_secs_f64() * 1000.0)
            })
            .buffer_unordered(proxies.len().max(1))
            .filter_map(|ms| async move { ms })
            .collect()
            .await;
        closed.sort_by(f64::total_cmp);
        let row = Row {
            pods: proxies.len(),
            revision: revoking,
            enforced: closed.len(),
            first_ms: closed.first().copied().unwrap_or(f64::NAN),
            p50_ms: percentile(&closed, 0.50),
            p99_ms: percentile(&closed, 0.99),
            last_ms: closed.last().copied().unwrap_or(f64::NAN),
        };
        eprintln!(
            "policy-edit: revision {revoking} enforced by {}/{} sidecars, the last after {:.0} ms",
            row.enforced, row.pods, row.last_ms
        );
        rows.push(row);
    }
    Ok(rows)
}

/// A tunnel to `upstream` through each proxy, each retried until its sidecar lets it through
/// (it may still enforce the previous revision).
async fn open_all(proxies: &[SocketAddr], upstream: SocketAddr) -> Result<Vec<tokio::net::TcpStream>, Error> {
    let deadline = Instant::now() + START_LIMIT;
    let opened: Vec<Option<tokio::net::TcpStream>> = futures::stream::iter(proxies.iter().copied())
        .map(|proxy| async move {
            loop {
                if let Ok(mut stream) = open(&Via::Proxy(proxy), upstream).await
                    && ping(&mut stream).await.is_ok()
                {
                    return Some(stream);
                }
                if Instant::now() > deadline {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .buffered(OPENING)
        .collect()
        .await;
    let open = opened.iter().filter(|t| t.is_some()).count();
    if open < proxies.len() {
        return Err(Error::Bench(format!(
            "only {open} of {} sidecars let a tunnel through the allowing revision",
            proxies.len()
        )));
    }
    Ok(opened.into_iter().flatten().collect())
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| Pods | revision | enforced | first / p50 / p99 / last (ms after the edit) |\n|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {}/{} | {:.0} / {:.0} / {:.0} / {:.0} |\n",
            r.pods, r.revision, r.enforced, r.pods, r.first_ms, r.p50_ms, r.p99_ms, r.last_ms
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_revisions_allow_the_upstream_and_even_ones_revoke_it() {
        let upstream: SocketAddr = "127.0.0.1:8080".parse().expect("address");
        let allowing: proto::egress::Document = serde_yaml_ng::from_str(&document(1, upstream)).expect("yaml");
        let revoking: proto::egress::Document = serde_yaml_ng::from_str(&document(2, upstream)).expect("yaml");
        assert_eq!((allowing.revision, allowing.rules.len()), (1, 1));
        assert_eq!((revoking.revision, revoking.rules.len()), (2, 0));
    }
}
