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
        let mut stdout = std::io::stdout().lock();
        return Ok(stdout.write_all(&out).and_then(|()| stdout.flush())?);
    }
    let mut client = Client::connect(&cli.connection).await?;
    match &cli.command {
        Command::Status { watch: false } => {
            let status = client.status().await?;
            print_line(&render::render(
                output,
                || render::status_json(&status),
                || render::status_table(&status),
            ))?;
            Ok(())
        }
        Command::Status { watch: true } | Command::Watch => watch(&mut client, output).await,
        Command::Drain { member, run, plan } => {
            operate(&mut client, OperationKind::Drain, member, run, plan, output).await
        }
        Command::Rebalance { run, plan } => operate(&mut client, OperationKind::Rebalance, "", run, plan, output).await,
        Command::Cancel { id } => {
            let op = client.cancel(id).await?;
            print_line(&render::render(
                output,
                || render::operation_json(&op),
                || render::operation_line(&op),
            ))?;
            Ok(())
        }
        Command::Audit { pod, follow, since } => audit(&mut client, pod, *follow, *since, output).await,
        Command::Completions { .. } => Ok(()),
    }
}

/// Prints the audit trail of `pod` (and, with `follow`, what is stored after, every second).
async fn audit(client: &mut Client, pod: &str, follow: bool, since: Option<u64>, output: Output) -> Result<(), Error> {
    let Some((namespace, name)) = pod.split_once('/') else {
        return Err(Error::Usage(format!("{pod:?} is not namespace/name")));
    };
    let since_ms = since.map_or(0, |seconds| {
        let now = proto::trust::unix_ms(std::time::SystemTime::now());
        now.saturating_sub(i64::try_from(seconds.saturating_mul(1000)).unwrap_or(i64::MAX))
    });
    let mut after = 0;
    loop {
        let entries = client.audit(namespace, name, after, since_ms).await?;
        for entry in &entries {
            after = after.max(entry.record.as_ref().map_or(0, |r| r.sequence));
            print_line(&render::render(
                output,
                || render::audit_json(entry),
                || render::audit_line(entry),
            ))?;
        }
        if !follow {
            return Ok(());
        }
        if entries.len() < 1000 {
            tokio::select! {
                () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
        }
    }
}

/// Writes `text` and a newline to stdout, flushed. Every line poolctl prints goes through
/// here, so a reader that stopped reading ends the command quietly ([`Error::Closed`]) instead
/// of panicking as `println!` does.
pub(crate) fn print_line(text: &str) -> Result<(), Error> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")?;
    Ok(stdout.flush()?)
}

fn print_raw(text: &str) -> Result<(), Error> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    Ok(stdout.flush()?)
}

/// The completion script of `shell`.
pub fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "poolctl", &mut out);
    out
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
            print_raw("\x1b[2J\x1b[H")?;
        } else if output == Output::Table {
            print_line("")?;
        }
        print_line(&text)?;
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
        print_line(&render::render(
            output,
            || render::plan_json(&plan),
            || render::plan_table(&plan),
        ))?;
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
    print_line(&render::started(output, &op, created))?;
    if run.wait {
        let mut progress = Progress::new(total, output);
        client.wait(&op.id, &mut progress).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    async fn exit_code(args: &[&str]) -> u8 {
        let cli = Cli::try_parse_from(args).unwrap();
        run(cli).await.map_or_else(|err| err.exit_code(), |()| exit::OK)
    }

    #[tokio::test]
    async fn a_missing_gateway_or_token_is_a_usage_error() {
        assert_eq!(exit_code(&["poolctl", "status"]).await, exit::USAGE);
        assert_eq!(
            exit_code(&["poolctl", "--gateway", "http://127.0.0.1:1", "status"]).await,
            exit::USAGE
        );
        let missing = [
            "poolctl",
            "--gateway",
            "http://127.0.0.1:1",
            "--token-file",
            "/nonexistent/token",
            "status",
        ];
        assert_eq!(exit_code(&missing).await, exit::USAGE);
    }

    #[tokio::test]
    async fn no_gateway_answering_is_exit_3() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "not-a-real-token").unwrap();
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let gateway = format!("http://127.0.0.1:{port}");
        let args = [
            "poolctl",
            "--gateway",
            &gateway,
            "--token-file",
            token.to_str().unwrap(),
            "status",
        ];
        assert_eq!(exit_code(&args).await, exit::UNREACHABLE);
    }

    #[test]
    fn it_depends_on_the_contracts_and_no_server_crate() {
        let manifest = include_str!("../Cargo.toml");
        let dependencies = manifest
            .split("[dependencies]")
            .nth(1)
            .and_then(|rest| rest.split("\n[").next())
            .unwrap();
        assert!(dependencies.contains("proto.workspace"), "{dependencies}");
        for server in ["gateway", "sqlx", "kube", "k8s-openapi"] {
            assert!(!dependencies.contains(server), "{server} in {dependencies}");
        }
    }

    #[test]
    fn completions_cover_the_commands() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let script = String::from_utf8(completions(shell)).unwrap();
            for word in ["poolctl", "drain", "rebalance", "watch", "completions"] {
                assert!(script.contains(word), "{shell}: {word} missing");
            }
        }
    }
}
