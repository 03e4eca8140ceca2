//! `scenarios`: run the failure scenarios on local pools of real processes
//! and print what they measured (and write it as JSON); `scenarios chaos`:
//! randomized faults with the history checker.
//!
//! cargo run --release -p e2e --bin scenarios -- [--json FILE] [--database URL] [SCENARIO…]
//! cargo run --release -p e2e --bin scenarios -- chaos --trials N --seed S [--postgres | --database URL]
//! cargo run --release -p e2e --bin scenarios -- scale [--instances 1000,4000,10000] [--sessions 256] [--postgres | --database URL]

use clap::Parser;
use e2e::cli::scenarios::{Args, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    plumbing::cmdline::refuse_password(std::env::args_os(), "--database", "OPENSHELL_SCENARIO_DATABASE_URL")?;
    run(Args::parse()).await
}
