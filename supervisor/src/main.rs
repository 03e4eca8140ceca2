//! `supervisor`: one pool member. Configuration in [`supervisor::Config`].

use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = supervisor::Config::parse();
    init_tracing(config.log_format);
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(shutdown.clone()));
    supervisor::run(config, shutdown).await?;
    Ok(())
}

fn init_tracing(format: supervisor::config::LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        supervisor::config::LogFormat::Json => builder.json().init(),
        supervisor::config::LogFormat::Text => builder.init(),
    }
}

/// First SIGINT/SIGTERM: leave the pool gracefully. Second: exit at once (workloads keep
/// running; their sidecars recover to another member).
async fn watch_signals(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(err) => {
            tracing::error!(%err, "cannot watch SIGTERM");
            return;
        }
    };
    for round in 0..2 {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        if round == 0 {
            shutdown.cancel();
        } else {
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        }
    }
}
