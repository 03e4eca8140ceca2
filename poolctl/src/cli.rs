//! The command line: how to reach the pool, the output format, and the commands.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use plumbing::gateway::GatewayArgs;

/// The exit codes, as `--help` shows them (see [`crate::exit`]).
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  done (a --wait ended with the operation succeeded; a dry run would succeed)
  1  unexpected error (an answer poolctl cannot use, the operation vanished, output failed)
  2  usage: bad arguments, no --gateway or --token-file, an unreadable token file
  3  no gateway answered, or the operator token was refused (UNAUTHENTICATED, PERMISSION_DENIED)
  4  the operation failed (or a dry run says it would not finish)
  5  the operation was cancelled
  6  the request was refused (invalid, unknown member or operation, not allowed now,
     too many watchers)";

#[derive(Debug, Parser)]
#[command(
    name = "poolctl",
    version = plumbing::build::version(),
    about = "Operate a shared-supervision pool through the operator API of its gateways",
    after_help = EXIT_CODES_HELP
)]
pub struct Cli {
    #[command(flatten)]
    pub connection: Connection,
    /// Output format of every command: a table (plain lines) for people, JSON (one document
    /// a line) or YAML (`---`-separated documents) for programs.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

/// Which gateways, with which operator token and trust.
#[derive(Debug, Clone, Default, Args)]
pub struct Connection {
    /// The gateways (`--gateway`, alias of `--gateway-endpoints`: the first that answers is
    /// used, the next ones when a stream breaks) and their trust (`--tls-ca`,
    /// `--gateway-tls-name`).
    #[command(flatten)]
    pub gateway: GatewayArgs,
    /// File holding an operator token (platform-admin role).
    #[arg(long, env = "OPENSHELL_OPERATOR_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Coordinator, members, instances (owner, term, phase, workload PID) and operations.
    Status {
        /// Follow the pool: print again on every change the gateway streams (as `watch`).
        #[arg(long)]
        watch: bool,
    },
    /// Follow the pool status as the gateway streams it, until interrupted.
    Watch,
    /// Move every instance off a member and keep it out of placement (until cancelled).
    Drain {
        /// The member (its Pod name in Kubernetes).
        member: String,
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Even out instance counts across eligible members.
    Rebalance {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Cancel an operation (a succeeded drain: return the member to service).
    Cancel {
        /// The operation id.
        id: String,
    },
    /// The egress audit trail of one workload: every decision its sidecar made, in order,
    /// each once, across handoffs and sidecar restarts.
    Audit {
        /// The Pod, as `namespace/name` (locally the sandbox's route).
        pod: String,
        /// Keep printing new decisions as they are stored, until interrupted.
        #[arg(long)]
        follow: bool,
        /// Only decisions of the last this many seconds.
        #[arg(long, value_name = "SECONDS")]
        since: Option<u64>,
    },
    /// Print a shell completion script, e.g. `poolctl completions bash > /etc/bash_completion.d/poolctl`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// How every command prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Concurrent moves, 1..=8.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(proto::MAX_MAX_PARALLEL)))]
    pub max_parallel: u32,
    /// Time budget in seconds (0: the gateway's default).
    #[arg(long, default_value_t = 0)]
    pub timeout_secs: u64,
    /// Follow the operation (streamed, no polling) until it ends, with its progress: moves
    /// done of the planned total, elapsed time and ETA. Exits 4 if it fails, 5 if cancelled.
    #[arg(long)]
    pub wait: bool,
}

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            max_parallel: 1,
            timeout_secs: 0,
            wait: false,
        }
    }
}

/// Dry runs of drain and rebalance.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Only list the moves the operation would make (and why any would not happen); records
    /// nothing and moves nothing. Exits 4 when the operation would not finish.
    #[arg(long, conflicts_with = "wait")]
    pub dry_run: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(rest: &[&str]) -> Result<Cli, clap::Error> {
        let base = ["poolctl", "--gateway", "x", "--token-file", "/t"];
        Cli::try_parse_from(base.iter().chain(rest))
    }

    #[test]
    fn dry_run_takes_an_output_format_and_not_wait() {
        let cli = parse(&["drain", "supervisor-0", "--dry-run", "-o", "json"]).unwrap();
        let Command::Drain { plan, .. } = cli.command else {
            panic!("a drain")
        };
        assert!(plan.dry_run && cli.output == Output::Json);
        assert!(parse(&["rebalance", "--dry-run"]).is_ok());
        let refused = parse(&["rebalance", "--dry-run", "--wait"]).unwrap_err();
        assert_eq!(refused.exit_code(), 2, "a dry run has nothing to wait for");
    }

    #[test]
    fn every_command_takes_every_output_format() {
        for command in [
            &["status"][..],
            &["status", "--watch"],
            &["watch"],
            &["drain", "m-a", "--wait"],
            &["rebalance"],
            &["cancel", "op-1"],
        ] {
            for format in ["table", "json", "yaml"] {
                let mut args = command.to_vec();
                args.extend(["-o", format]);
                assert!(parse(&args).is_ok(), "{args:?}");
            }
        }
        assert!(parse(&["status", "-o", "xml"]).is_err());
    }

    #[test]
    fn the_command_line_reads_env_and_bounds_max_parallel() {
        let cli = parse(&["drain", "supervisor-0", "--max-parallel", "2", "--wait"]).unwrap();
        let Command::Drain { member, run, .. } = cli.command else {
            panic!("a drain")
        };
        assert_eq!((member.as_str(), run.max_parallel, run.wait), ("supervisor-0", 2, true));
        let two = Cli::try_parse_from([
            "poolctl",
            "--gateway",
            "https://a:8443,https://b:8443",
            "--token-file",
            "/t",
            "status",
        ])
        .unwrap();
        assert_eq!(two.connection.gateway.gateway_endpoints.len(), 2);
        assert!(parse(&["rebalance", "--max-parallel", "9"]).is_err());
    }

    #[test]
    fn completions_need_no_gateway() {
        let cli = Cli::try_parse_from(["poolctl", "completions", "zsh"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Completions {
                shell: clap_complete::Shell::Zsh
            }
        ));
    }

    #[test]
    fn help_lists_the_exit_codes() {
        let help = <Cli as clap::CommandFactory>::command().render_long_help().to_string();
        for code in [
            "0  done",
            "2  usage",
            "3  no gateway",
            "4  the operation failed",
            "5  the operation was cancelled",
            "6  the request was refused",
        ] {
            assert!(help.contains(code), "{code} missing from:\n{help}");
        }
    }
}
