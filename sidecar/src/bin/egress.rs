//! `egress`: the two parts of egress redirection that run beside the sidecar in a Pod.
//!
//! - `egress install-rules`: the init container that installs the Pod's network rules
//!   ([`sidecar::egress::rules`]) with `nft` and exits (the only container with `NET_ADMIN`);
//! - `egress dialer`: the Pod's dialer ([`plumbing::dialer`]), a container of its own UID whose
//!   connections alone leave the Pod; it opens them for the sidecar.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use sidecar::egress::rules::{self, Rules};
use tokio::io::AsyncWriteExt;

#[derive(Debug, Parser)]
#[command(
    name = "egress",
    version = plumbing::build::version(),
    about = "Egress redirection of a supervised Pod: its network rules and its dialer"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: plumbing::logging::LogArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Installs the Pod's network rules (replacing earlier ones) and exits.
    InstallRules {
        /// UID of the Pod's dialer: its connections are not redirected.
        #[arg(long, env = "OPENSHELL_EGRESS_DIALER_UID")]
        dialer_uid: u32,
        /// Port of the sidecar's redirect listener on 127.0.0.1.
        #[arg(long, env = "OPENSHELL_EGRESS_REDIRECT_PORT")]
        redirect_port: u16,
        /// The nft command.
        #[arg(long, default_value = "/usr/sbin/nft")]
        nft: PathBuf,
        /// Where the Pod's nameservers are listed.
        #[arg(long, default_value = "/etc/resolv.conf")]
        resolv_conf: PathBuf,
    },
    /// Opens the connections that leave the Pod, for the sidecar (serves until SIGTERM).
    Dialer {
        /// The socket, in a volume only the sidecar and the dialer mount.
        #[arg(long, env = "OPENSHELL_EGRESS_DIALER")]
        socket: PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    plumbing::logging::init(args.log.log_format, "info");
    match args.command {
        Command::InstallRules {
            dialer_uid,
            redirect_port,
            nft,
            resolv_conf,
        } => {
            let resolv = tokio::fs::read_to_string(&resolv_conf)
                .await
                .with_context(|| format!("reading the Pod's nameservers from {}", resolv_conf.display()))?;
            let rules = Rules {
                dialer_uid,
                redirect_port,
                nameservers: rules::nameservers(&resolv),
            };
            let ruleset = rules.ruleset();
            let mut child = tokio::process::Command::new(&nft)
                .args(["-f", "-"])
                .stdin(Stdio::piped())
                .spawn()
                .with_context(|| format!("starting {}", nft.display()))?;
            if let Some(mut stdin) = child.stdin.take() {
                stdin
                    .write_all(ruleset.as_bytes())
                    .await
                    .context("writing the ruleset to nft")?;
            }
            let status = child.wait().await.context("waiting for nft")?;
            if !status.success() {
                bail!("nft refused the ruleset ({status}):\n{ruleset}");
            }
            tracing::info!(dialer_uid, redirect_port, nameservers = ?rules.nameservers, "egress rules installed");
            Ok(())
        }
        Command::Dialer { socket } => {
            let shutdown = plumbing::shutdown::install().context("installing the SIGTERM/SIGINT handlers")?;
            let listener = plumbing::dialer::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
            tracing::info!(socket = %socket.display(), "dialer listening");
            plumbing::dialer::serve(listener, shutdown).await;
            Ok(())
        }
    }
}
