//! `agent`: the sample workload ([`e2e::agent`]).

use clap::Parser;
use e2e::agent::{Args, run};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    run(Args::parse()).await
}
