//! `poolctl`, the operator's command line for the pool (the binary is a thin shell around
//! [`run`]): status and watch, drain, rebalance (either also as a dry run) and cancel,
//! through the operator API of any gateway replica with an operator token. Depends only on
//! the contracts (`proto`); rendering is pure and tested without I/O.

pub mod cli;
pub mod client;
pub mod exit;
pub mod progress;
pub mod render;

use std::io::{IsTerminal, Write};

use clap::CommandFactory;
use proto::pool::v1::OperationKind;

pub use cli::{Cli, Command, Connection, Output, PlanArgs, RunArgs};
pub use client::Client;
pub use exit::Error;
pub use progress::Progress;

/// Run one command; what to print goes to stdout.
pub async fn run(cli: Cli) -> Result<(), Error> {
    let output = cli.output;
    if let Command::Completions { shell } = cli.command {
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "poolctl", &mut out);
        return std::io::stdout()
            .write_all(&out)
            .map_err(|err| Error::Output(err.to_string()));
    }
    let mut client = Client::connect(&cli.connection).await?;
    match &cli.command {
        Command::Status { watch: false } => {
            let status = client.status().await?;
            println!(
                "{}",
                render::render(
                    output,
                    || render::status_json(&status),
                    || render::status_table(&status)
                )
            );
            Ok(())
        }
        Command::Status { watch: true } | Command::Watch => watch(&mut client, output).await,
        Command::Drain { member, run, plan } => {
            operate(&mut client, OperationKind::Drain, member, run, plan, output).await
        }
        Command::Rebalance { run, plan } => operate(&mut client, OperationKind::Rebalance, "", run, plan, output).await,
        Command::Cancel { id } => {
            let op = client.cancel(id).await?;
            println!(
                "{}",
                render::render(output, || render::operation_json(&op), || render::operation_line(&op))
            );
            Ok(())
        }
        Command::Completions { .. } => Ok(()),
    }
}

/// Print every streamed status until interrupted (Ctrl-C ends it with 0).
async fn watch(client: &mut Client, output: Output) -> Result<(), Error> {
    let clear = output == Output::Table && std::io::stdout().is_terminal();
    let mut statuses = client.watch();
    loop {
        let status = tokio::select! {
            status = statuses.next() => status?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let text = render::render(
            output,
            || render::status_json(&status),
            || render::status_table(&status),
        );
        if clear {
            // Redraw in place.
            print!("\x1b[2J\x1b[H");
        } else if output == Output::Table {
            println!();
        }
        println!("{text}");
    }
}

async fn operate(
    client: &mut Client,
    kind: OperationKind,
    target: &str,
    run: &RunArgs,
    plan: &PlanArgs,
    output: Output,
) -> Result<(), Error> {
    if plan.dry_run {
        let plan = client.plan(kind, target, run).await?;
        println!(
            "{}",
            render::render(output, || render::plan_json(&plan), || render::plan_table(&plan))
        );
        return if plan.completes {
            Ok(())
        } else {
            Err(Error::WouldNotFinish(plan.message))
        };
    }
    // The planned moves are the progress bar's total (unknown if the plan is refused).
    let total = if run.wait {
        client.plan(kind, target, run).await.map_or(0, |p| p.moves.len() as u64)
    } else {
        0
    };
    let (op, created) = client.start(kind, target, run).await?;
    println!("{}", render::started(output, &op, created));
    if run.wait {
        let mut progress = Progress::new(total, output);
        client.wait(&op.id, &mut progress).await?;
    }
    Ok(())
}
