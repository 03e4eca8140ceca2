//! The `scenarios` binary's arguments and dispatch: the failure scenarios with their
//! measurements, `chaos` (randomized faults with the history checker) and `scale` (the
//! gateway's cost as the pool grows).

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::chaos::{self, Backend};
use crate::scale;
use crate::scenarios::{self, Setup};

use super::write_json;

#[derive(Debug, Parser)]
#[command(
    about = "Failure scenarios with measurements on a local pool",
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Write the outcomes as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// PostgreSQL server URL (a fresh database per run); default: embedded SQLite.
    #[arg(long, global = true, env = "OPENSHELL_SCENARIO_DATABASE_URL")]
    database: Option<String>,
    /// Working directory of the pools.
    #[arg(long, global = true, default_value = ".local/scenarios")]
    dir: PathBuf,
    /// Sandboxes per pool instead of each scenario's own (2; 4 for drain and rebalance).
    #[arg(long)]
    sandboxes: Option<usize>,
    /// Scenarios to run (default: all).
    scenarios: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Randomized single and overlapping faults on one pool, each trial checked; exits
    /// non-zero on any violation or stopped workload.
    Chaos {
        #[arg(long, default_value_t = 20)]
        trials: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// A private PostgreSQL server, stopped and started by the database-outage faults
        /// (needs the PostgreSQL 15 server binaries).
        #[arg(long, conflicts_with = "database")]
        postgres: bool,
        /// Run each fault kind once, in order, before the seed draws the rest.
        #[arg(long)]
        every_kind_first: bool,
        /// Draw only these fault kinds (comma-separated names, as the table prints them).
        #[arg(long, value_delimiter = ',', value_parser = fault_kind)]
        kinds: Vec<chaos::plan::Fault>,
    },
    /// The gateway's cost as the pool grows: simulated members over real gRPC, registrations
    /// through the registry, placement, snapshot bytes, CPU and memory at rest.
    Scale {
        /// Pool sizes to run, one fresh pool each.
        #[arg(long, value_delimiter = ',', default_value = "1000,4000,10000")]
        instances: Vec<usize>,
        #[arg(long, default_value_t = 40)]
        members: usize,
        /// Registrations in flight at a time.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Then real processes: this many sessions on one member (0: skip).
        #[arg(long, default_value_t = 256)]
        sessions: usize,
        /// The sessions' members attach to the replica that did not start first, which then
        /// usually is not the coordinator.
        #[arg(long)]
        members_on_standby: bool,
        /// A private PostgreSQL server for the runs.
        #[arg(long, conflicts_with = "database")]
        postgres: bool,
    },
    /// The sidecar's egress proxy beside a direct connection, tinyproxy and Squid (when
    /// installed; HAProxy too, as a bare TCP relay): throughput over CONNECT, new-connection
    /// latency, many open tunnels, the proxy's CPU per GiB and RSS.
    Egress {
        /// MiB of the download.
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        /// New connections timed one after another.
        #[arg(long, default_value_t = 2000)]
        samples: usize,
        /// Tunnels open at once.
        #[arg(long, default_value_t = 1000)]
        connections: usize,
    },
    /// How soon a policy edit is enforced in every sidecar: a local pool of many sandboxes,
    /// each holding a tunnel the edit revokes; the time from the edit to each close.
    PolicyEdit {
        /// Sandboxes (sidecar and agent each).
        #[arg(long, default_value_t = 256)]
        pods: usize,
        /// Revoking edits measured.
        #[arg(long, default_value_t = 3)]
        edits: usize,
    },
}

fn backend(postgres: bool, database: Option<String>) -> Backend {
    match (postgres, database) {
        (true, _) => Backend::PrivatePostgres,
        (false, Some(url)) => Backend::Postgres(url),
        (false, None) => Backend::Sqlite,
    }
}

/// A fault kind by name, for `--kinds`.
fn fault_kind(name: &str) -> Result<chaos::plan::Fault, String> {
    chaos::plan::Fault::named(name).ok_or_else(|| {
        let known: Vec<&str> = chaos::plan::Fault::all().map(chaos::plan::Fault::name).collect();
        format!("no fault kind {name:?}; the kinds: {}", known.join(", "))
    })
}

/// Runs what `args` asks for: `scale`, `chaos`, or the named scenarios (all by default).
pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Some(Command::Scale {
            instances,
            members,
            concurrency,
            sessions,
            members_on_standby,
            postgres,
        }) => {
            let backend = backend(postgres, args.database);
            let mut reports = Vec::new();
            for n in instances.into_iter().filter(|n| *n > 0) {
                eprintln!("scale: {n} instances on {members} members ({}) ...", backend.name());
                let settings = scale::Settings {
                    members,
                    concurrency,
                    ..scale::Settings::new(n, args.dir.join("scale"), backend.clone())
                };
                reports.push(scale::run(&settings).await?);
                print!("{}", scale::table(&reports[reports.len() - 1..]));
            }
            print!("{}", scale::table(&reports));
            let mut busy = Vec::new();
            if sessions > 0 {
                eprintln!("scale: {sessions} sessions on one member ({}) ...", backend.name());
                let settings = scale::sessions::Settings {
                    sessions,
                    root: args.dir.join("sessions"),
                    backend,
                    members_on_standby,
                };
                busy.push(scale::sessions::run(&settings).await?);
                print!("{}", scale::sessions::table(&busy));
            }
            let both = serde_json::json!({ "instances": reports, "sessions": busy });
            write_json(args.json.as_deref(), &both)
        }
        Some(Command::Egress {
            mib,
            samples,
            connections,
        }) => {
            let settings = crate::egress::Settings {
                root: args.dir.join("egress"),
                bytes: mib << 20,
                samples,
                connections,
            };
            let rows = crate::egress::run(&settings).await?;
            print!("{}", crate::egress::table(&rows));
            write_json(args.json.as_deref(), &rows)
        }
        Some(Command::PolicyEdit { pods, edits }) => {
            let settings = crate::egress::edit::Settings {
                root: args.dir.join("policy-edit"),
                pods,
                edits,
            };
            let rows = crate::egress::edit::run(&settings).await?;
            print!("{}", crate::egress::edit::table(&rows));
            write_json(args.json.as_deref(), &rows)
        }
        Some(Command::Chaos {
            trials,
            seed,
            postgres,
            every_kind_first,
            kinds,
        }) => {
            let backend = backend(postgres, args.database);
            let settings = chaos::Settings {
                every_kind_first,
                kinds,
                ..chaos::Settings::new(trials, seed, args.dir.join("chaos"), backend)
            };
            let report = chaos::run(&settings).await?;
            print!("{}", chaos::table(&report));
            write_json(args.json.as_deref(), &report)?;
            anyhow::ensure!(report.passed(), "chaos: the history checker found violations");
            Ok(())
        }
        None => {
            let setup = Setup {
                root: args.dir,
                database_url: args.database,
                sandboxes: args.sandboxes,
            };
            run_scenarios(&args.scenarios, &setup, args.json.as_deref()).await
        }
    }
}

/// The named failure scenarios (all when none is named), one fresh pool each.
async fn run_scenarios(named: &[String], setup: &Setup, json: Option<&Path>) -> anyhow::Result<()> {
    let names: Vec<String> = if named.is_empty() {
        scenarios::ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        named.to_vec()
    };
    let mut outcomes = Vec::new();
    let mut failed = Vec::new();
    for name in &names {
        eprintln!("running {name} ...");
        match scenarios::run(name, setup).await {
            Ok(outcome) => outcomes.push(outcome),
            Err(err) => {
                eprintln!("{name} failed: {err}");
                failed.push(name.clone());
            }
        }
    }
    print!("{}", scenarios::table(&outcomes));
    write_json(json, &outcomes)?;
    if !failed.is_empty() {
        anyhow::bail!("scenarios failed: {}", failed.join(", "));
    }
    Ok(())
}
