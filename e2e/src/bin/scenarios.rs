//! `scenarios`: run the failure scenarios on local pools of real processes
//! and print what they measured (and write it as JSON).
//!
//! cargo run --release -p e2e --bin scenarios -- [--json FILE] [--database URL] [SCENARIO…]

use std::path::PathBuf;

use clap::Parser;
use e2e::scenarios::{self, Setup};

#[derive(Debug, Parser)]
#[command(about = "Failure scenarios with measurements on a local pool")]
struct Args {
    /// Write the outcomes as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// PostgreSQL server URL (a fresh database per scenario); default: embedded SQLite.
    #[arg(long, env = "OPENSHELL_SCENARIO_DATABASE_URL")]
    database: Option<String>,
    /// Working directory of the pools.
    #[arg(long, default_value = ".local/scenarios")]
    dir: PathBuf,
    /// Scenarios to run (default: all).
    scenarios: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let names: Vec<String> = if args.scenarios.is_empty() {
        scenarios::ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.scenarios.clone()
    };
    let setup = Setup {
        root: args.dir.clone(),
        database_url: args.database.clone(),
    };
    let mut outcomes = Vec::new();
    let mut failed = Vec::new();
    for name in &names {
        eprintln!("running {name} ...");
        match scenarios::run(name, &setup).await {
            Ok(outcome) => outcomes.push(outcome),
            Err(err) => {
                eprintln!("{name} failed: {err}");
                failed.push(name.clone());
            }
        }
    }
    print!("{}", scenarios::table(&outcomes));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&outcomes)?)?;
        eprintln!("wrote {}", path.display());
    }
    if !failed.is_empty() {
        anyhow::bail!("scenarios failed: {}", failed.join(", "));
    }
    Ok(())
}
