//! The `local-pool` binary (the quick start): its arguments, the pool it starts and the status
//! it prints until interrupted.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::local::{self, Config, LocalPool};

#[derive(Debug, Parser)]
#[command(about = "Run a local shared-supervision pool and watch its status")]
pub struct Args {
    /// Working directory (database, credentials, logs); emptied at start.
    #[arg(long, env = "OPENSHELL_LOCAL_DIR", default_value = ".local/pool")]
    dir: PathBuf,
    /// PostgreSQL URL instead of the embedded SQLite store.
    #[arg(long, env = "OPENSHELL_LOCAL_DATABASE_URL")]
    database_url: Option<String>,
    #[arg(long, default_value_t = 2)]
    gateways: usize,
    #[arg(long, default_value_t = 2)]
    members: usize,
    /// Sandboxes: a sidecar and a counting agent each.
    #[arg(long, default_value_t = 3)]
    sandboxes: usize,
    /// Print the status this often (ms).
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Stop after this many status prints (0: until interrupted).
    #[arg(long, default_value_t = 0)]
    rounds: u64,
    /// Plaintext gRPC everywhere (for debugging with plain tools); default: TLS with a
    /// throwaway CA in the working directory (ca.crt, tls.crt, tls.key).
    #[arg(long, env = "OPENSHELL_LOCAL_PLAINTEXT")]
    plaintext: bool,
    /// An egress policy file (YAML: name, revision, enforcement, rules) every sandbox's
    /// sidecar enforces; each then has an egress proxy (its address is printed). Locally a
    /// rule may name a loopback upstream (`host: 127.0.0.1`); in a Pod the floor refuses it.
    #[arg(long, env = "OPENSHELL_LOCAL_POLICY")]
    policy: Option<PathBuf>,
    /// Where the policy's credentials are: the value of key K of secret S is the file
    /// `DIR/S/K` (as Kubernetes mounts a Secret); read again with the policy file.
    #[arg(long, env = "OPENSHELL_LOCAL_SECRETS", requires = "policy")]
    secrets: Option<PathBuf>,
}

/// Starts the pool, prints its status every `--interval-ms` until Ctrl-C (or `--rounds`), stops it.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = Config {
        root: args.dir.clone(),
        database_url: args.database_url.clone(),
        gateways: args.gateways,
        members: args.members,
        sandboxes: args.sandboxes,
        lease_length_ms: 5000,
        plaintext: args.plaintext,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: false,
        policy: args.policy.as_ref().map(std::fs::canonicalize).transpose()?,
        secrets: args.secrets.as_ref().map(std::fs::canonicalize).transpose()?,
    };
    println!(
        "starting {} gateway replicas, {} supervisor members and {} sandboxes in {} ...",
        args.gateways,
        args.members,
        args.sandboxes,
        args.dir.display()
    );
    let pool = LocalPool::start(config).await?;
    println!("logs: {}   (Ctrl-C stops everything)", pool.logs().display());
    println!("operate it from another terminal (status, drain <member> --wait, rebalance --wait, cancel <id>):");
    println!("  {}\n", poolctl_command(&pool));
    for sandbox in &pool.sandboxes {
        if let Some(egress) = &sandbox.egress {
            println!(
                "{}: egress through http://{egress}   (curl -x http://{egress} http://127.0.0.1:PORT/)",
                sandbox.name
            );
        }
    }
    let mut tick = tokio::time::interval(Duration::from_millis(args.interval_ms));
    let mut printed = 0;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = tick.tick() => {}
        }
        match pool.status().await {
            Ok(status) => println!("{}", poolctl::render::status_table(&status)),
            Err(err) => println!("status unavailable: {err}\n"),
        }
        printed += 1;
        if args.rounds > 0 && printed >= args.rounds {
            break;
        }
    }
    println!("stopping ...");
    pool.stop().await;
    Ok(())
}

/// The poolctl command line that reaches this pool.
fn poolctl_command(pool: &LocalPool) -> String {
    let mut command = format!(
        "{} --gateway {} --token-file {}",
        local::binary_dir().join("poolctl").display(),
        pool.endpoints().join(","),
        pool.credentials().join("operator").join("token").display()
    );
    if let Some(ca) = pool.client_tls().ca {
        command.push_str(&format!(" --tls-ca {}", ca.display()));
    }
    command.push_str(" status");
    command
}
