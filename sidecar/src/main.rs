//! `sidecar`: parses the configuration, installs logging and signal handling (the first
//! SIGTERM/SIGINT drains, a second one forces an exit) and runs [`sidecar::run`].

use anyhow::Context;
use clap::Parser;
use sidecar::config::LogFormat;
use sidecar::{Config, Outcome};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).init(),
    }
    let shutdown = CancellationToken::new();
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            tokio::select! { _ = terminate.recv() => {}, _ = interrupt.recv() => {} }
            tracing::info!("shutting down (a second signal forces it)");
            shutdown.cancel();
            tokio::select! { _ = terminate.recv() => {}, _ = interrupt.recv() => {} }
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        }
    });
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
