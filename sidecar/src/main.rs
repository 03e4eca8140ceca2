//! `sidecar`: parses the configuration, installs logging and signal handling (the first
//! SIGTERM/SIGINT drains, a second one forces an exit) and runs [`sidecar::run`].

use anyhow::Context;
use clap::Parser;
use sidecar::{Config, Outcome};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    plumbing::logging::init(config.log.log_format, "info");
    let shutdown = plumbing::shutdown::install().context("installing the SIGTERM/SIGINT handlers")?;
    // Without a command the sidecar is a Pod's long-lived container: once the instance has
    // ended it stays up (idle) until the Pod stops it, instead of being restarted.
    let idle_after_end = config.command.is_empty();
    let outcome = sidecar::run(config, shutdown.clone()).await.context("sidecar failed")?;
    if idle_after_end && outcome != Outcome::Shutdown {
        shutdown.cancelled().await;
    }
    if outcome == Outcome::RecoveryFailed {
        std::process::exit(1);
    }
    Ok(())
}
