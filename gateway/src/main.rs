//! `gateway`: one replica. Configuration in [`gateway::Settings`]; the first SIGTERM/SIGINT
//! drains (releases the lease, stops), a second exits at once.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    if let Err(err) = plumbing::cmdline::refuse_password(std::env::args_os(), "--database-url", "DATABASE_URL") {
        eprintln!("error: {err}");
        return std::process::ExitCode::from(2);
    }
    let settings = gateway::Settings::parse();
    plumbing::logging::init(settings.log.log_format, "info,sqlx=warn");
    let outcome = match (plumbing::shutdown::install(), gateway::bind(&settings).await) {
        (Ok(shutdown), Ok(listener)) => gateway::run(settings, listener, shutdown).await,
        (Err(err), _) => Err(gateway::Error::Signals(err)),
        (_, Err(err)) => Err(err),
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
