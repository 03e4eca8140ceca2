//! `sidecar`: makes itself unreachable from the workload ([`sidecar::conceal`]), parses the
//! configuration, installs logging and signal handling (the first SIGTERM/SIGINT drains, a
//! second one forces an exit) and runs [`sidecar::run`].

use anyhow::Context;
use clap::Parser;
use sidecar::{Config, Outcome};
use tracing::Instrument;

fn main() -> anyhow::Result<()> {
    // Before anything reads a secret: no workload process may read this one's memory,
    // environment, descriptors or files.
    sidecar::conceal::seal()?;
    let config = Config::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    plumbing::logging::init(config.log.log_format, "info");
    // Under egress redirection a workload process that opened this one's root during a
    // dumpable window could reach the dialer's socket later: no such window is allowed.
    if config.egress_dialer.is_some() && !sidecar::conceal::sealed_from_exec() {
        anyhow::bail!(
            "under egress redirection the sidecar must be non-dumpable from exec: install it execute-only (mode 0111), as the images do"
        );
    }
    if sidecar::conceal::sealed_from_exec() {
        tracing::info!("non-dumpable from exec (execute-only binary): workload processes cannot read this process");
    } else if config.command.is_empty() {
        tracing::warn!(
            "the sidecar's executable is readable: it is non-dumpable only from its first instruction on; \
             install it execute-only (mode 0111) as the images do"
        );
    }
    let shutdown = plumbing::shutdown::install().context("installing the SIGTERM/SIGINT handlers")?;
    // Without a command the sidecar is a Pod's long-lived container: once the instance has
    // ended it stays up (idle) until the Pod stops it, instead of being restarted.
    let idle_after_end = config.command.is_empty();
    // Every line names the route this sidecar serves, so one Pod's story reads the same in
    // the sidecar's log as in the gateways' and members' (their spans carry `route` too).
    let span = tracing::info_span!("sidecar", route = %config.route());
    let mut outcome = sidecar::run(config.clone(), shutdown.clone())
        .instrument(span.clone())
        .await
        .context("sidecar failed")?;
    // The workload's process ended (or was stopped at the recovery deadline) and the kubelet
    // restarts its container: the next run supervises its next process as the next generation.
    while config.supervises_next(outcome) && !shutdown.is_cancelled() {
        outcome = sidecar::run(config.clone(), shutdown.clone())
            .instrument(span.clone())
            .await
            .context("sidecar failed")?;
    }
    if idle_after_end && outcome != Outcome::Shutdown {
        shutdown.cancelled().await;
    }
    if outcome == Outcome::RecoveryFailed {
        std::process::exit(1);
    }
    Ok(())
}
