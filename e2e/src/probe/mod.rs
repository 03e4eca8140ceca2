//! The cluster test's attacker (binary `probe`, in the agent image), in two places:
//! - [`registry`]: a Pod of another namespace that tries to act for a workload it is not;
//! - [`sidecar`]: a workload container that tries to reach its own sidecar's token, fence
//!   state and memory through the shared PID namespace;
//! - [`grant`]: a pool member that tries to take the grants reserved for another member;
//! - [`egress`]: a workload's requests through its sidecar's proxy, and the upstream it asks.

use clap::{Parser, Subcommand};

pub mod egress;
pub mod grant;
pub mod registry;
pub mod sidecar;

#[derive(Debug, Parser)]
#[command(about = "The cluster test's attacker")]
pub struct Args {
    #[command(subcommand)]
    target: Target,
}

#[derive(Debug, Subcommand)]
enum Target {
    /// Act for another namespace's instance at the gateway's registry.
    Registry(registry::Args),
    /// Reach this Pod's sidecar through /proc.
    Sidecar(sidecar::Args),
    /// Take another member's recovery grants with one member's credential.
    Grant(grant::Args),
    /// Answer HTTP requests, naming this upstream.
    Upstream(egress::UpstreamArgs),
    /// Ask for destinations through the proxy HTTP_PROXY names.
    Egress(egress::EgressArgs),
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.target {
        Target::Registry(args) => registry::run(args).await,
        Target::Sidecar(args) => sidecar::run(&args),
        Target::Grant(args) => grant::run(args).await,
        Target::Upstream(args) => egress::upstream(args).await,
        Target::Egress(args) => egress::egress(args).await,
    }
}
