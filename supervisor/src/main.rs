//! `supervisor`: one pool member. Configuration in [`supervisor::Config`]. The first
//! SIGTERM/SIGINT leaves the pool gracefully; a second exits at once (workloads keep running;
//! their sidecars recover to another member).

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = supervisor::Config::parse();
    plumbing::logging::init(config.log.log_format, "info");
    let shutdown = plumbing::shutdown::install()?;
    supervisor::run(config, shutdown).await?;
    Ok(())
}
