//! `poolctl`: operate a shared-supervision pool. See the [`poolctl`] library.

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = poolctl::Cli::parse();
    match poolctl::run(cli).await {
        Ok(()) | Err(poolctl::Error::Closed) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            std::process::ExitCode::from(err.exit_code())
        }
    }
}
