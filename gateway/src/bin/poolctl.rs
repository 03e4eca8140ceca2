//! `poolctl`: operate a shared-supervision pool. See [`gateway::poolctl`].

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = gateway::poolctl::Cli::parse();
    match gateway::poolctl::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
