//! `local-pool`: the quick start. Starts, as real processes on loopback with
//! the embedded SQLite store, two gateway replicas, two supervisor members
//! and three sandboxes (a sidecar and a counting agent each), then prints
//! live pool status (members, owners, terms, counters) until interrupted.
//! Every gRPC connection is TLS unless `--plaintext`.

use clap::Parser;
use e2e::cli::local_pool::{Args, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    plumbing::cmdline::refuse_password(std::env::args_os(), "--database-url", "OPENSHELL_LOCAL_DATABASE_URL")?;
    run(Args::parse()).await
}
