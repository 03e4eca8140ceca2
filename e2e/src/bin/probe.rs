//! `probe`: a Pod that tries to act for a workload it is not ([`e2e::probe`]).

use clap::Parser;
use e2e::probe::{Args, run};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    run(Args::parse()).await
}
