//! `gateway`: one replica. Configuration in [`gateway::Settings`].

use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let settings = gateway::Settings::parse();
    init_tracing(&settings.log_format);
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(shutdown.clone()));
    let outcome = match gateway::bind(&settings).await {
        Ok(listener) => gateway::run(settings, listener, shutdown).await,
        Err(err) => Err(err),
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            // Each error's message already carries its cause: one line.
            eprintln!("error: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// First SIGINT/SIGTERM: drain (release the lease, stop). Second: exit now.
async fn watch_signals(shutdown: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(err) => {
            eprintln!("error: cannot watch SIGTERM: {err}");
            return;
        }
    };
    for round in 0..2 {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        if round == 0 {
            tracing::info!("shutting down (signal again to force)");
            shutdown.cancel();
        } else {
            std::process::exit(130);
        }
    }
}
