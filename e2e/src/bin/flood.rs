//! `flood`: the hostile-load probe on a local pool and a webhook — admission latency,
//! `poolctl status` latency and fresh handshake success without and under a flood of idle TCP
//! and request-less TLS connections.
//!
//! cargo run --release -p e2e --bin flood -- [--idle N] [--silent N] [--samples N] [--seconds N] [--json FILE]

use std::path::PathBuf;

use clap::Parser;
use e2e::flood::{self, Setup};

#[derive(Debug, Parser)]
#[command(about = "Connection flood against a local pool and a webhook, with measurements")]
struct Args {
    /// Idle TCP connections per port (from 127.0.0.2), re-opened as the server closes them.
    #[arg(long, default_value_t = 400)]
    idle: usize,
    /// TLS connections per port that never send a request (from 127.0.0.3), re-opened likewise.
    #[arg(long, default_value_t = 200)]
    silent: usize,
    /// Measurement rounds per phase: a review and a handshake to every port (poolctl status
    /// every fifth round).
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Shortest measurement under the flood, in seconds (the flood meets the time-outs).
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Working directory of the pool.
    #[arg(long, default_value = ".local/flood")]
    dir: PathBuf,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let setup = Setup {
        root: args.dir.clone(),
        idle: args.idle,
        silent: args.silent,
        samples: args.samples,
        lasting: std::time::Duration::from_secs(args.seconds),
    };
    let (figures, counters) = flood::run(&setup).await?;
    print!("{}", flood::table(&figures));
    println!("\nwebhook connection counters after the flood:\n{counters}");
    e2e::cli::write_json(args.json.as_deref(), &figures)
}
