//! The workload process: started by the sidecar (local mode: a command after `--`) or found
//! through the socket's peer credentials (Kubernetes, shared process namespace). One task per
//! process watches it exit and stops it on request: SIGTERM, then SIGKILL after the grace.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use proto::common::v1::WorkloadIdentity;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::identity;

/// How often a process that is not the sidecar's child is checked for exit.
const EXIT_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the workload command is empty")]
    Empty,
    #[error("cannot start the workload {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

/// How the workload ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// A moment (clock ticks since boot, as `/proc/<pid>/stat` counts) at which the process
    /// was still running: any process started after it is not this one. Taken while the
    /// process is watched, not when its end is handled, so a container the kubelet restarts
    /// at once is never mistaken for the process that ended.
    pub alive_until_ticks: u64,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (Some(code), _) => write!(f, "exited with status {code}"),
            (None, Some(signal)) => write!(f, "killed by signal {signal}"),
            (None, None) => f.write_str("exited"),
        }
    }
}

/// The process being supervised.
#[derive(Debug)]
pub enum Process {
    /// Started by the sidecar: reaped by it.
    Child(tokio::process::Child),
    /// Started by someone else (the Pod): polled through /proc.
    Foreign(WorkloadIdentity),
}

/// Asks the watcher task to stop the process.
#[derive(Clone, Debug)]
pub struct Control {
    stop: mpsc::Sender<Duration>,
}

impl Control {
    /// SIGTERM now, SIGKILL after `grace`. Idempotent.
    pub fn stop(&self, grace: Duration) {
        let _ = self.stop.try_send(grace);
    }
}

/// Starts `command` with `OPENSHELL_SIDECAR_SOCKET` set to the workload socket and, with an
/// egress proxy, the proxy variables HTTP clients read (both cases; loopback bypasses it).
pub fn spawn(
    command: &[String],
    socket: &Path,
    egress: Option<std::net::SocketAddr>,
) -> Result<tokio::process::Child, Error> {
    let (program, args) = command.split_first().ok_or(Error::Empty)?;
    let mut child = tokio::process::Command::new(program);
    if let Some(proxy) = egress {
        for (name, value) in proxy_env(proxy) {
            child.env(name, value);
        }
    }
    child
        .args(args)
        .env("OPENSHELL_SIDECAR_SOCKET", socket)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| Error::Spawn {
            program: program.clone(),
            source,
        })
}

/// What a local workload's HTTP clients read to use the egress proxy at `proxy`. No
/// `NO_PROXY`: locally the upstreams a policy names are on loopback too.
pub fn proxy_env(proxy: std::net::SocketAddr) -> Vec<(&'static str, String)> {
    let url = format!("http://{proxy}");
    ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"]
        .into_iter()
        .map(|name| (name, url.clone()))
        .collect()
}

/// Watches `process` in its own task: the receiver yields how it ended.
pub fn watch(process: Process) -> (Control, oneshot::Receiver<Exit>) {
    let (stop_tx, stop_rx) = mpsc::channel(1);
    let (exit_tx, exit_rx) = oneshot::channel();
    tokio::spawn(async move {
        let exit = supervise(process, stop_rx).await;
        let _ = exit_tx.send(exit);
    });
    (Control { stop: stop_tx }, exit_rx)
}

async fn supervise(mut process: Process, mut stop: mpsc::Receiver<Duration>) -> Exit {
    let grace = tokio::select! {
        exit = wait(&mut process) => return exit,
        Some(grace) = stop.recv() => grace,
    };
    info!(pid = pid(&process), "stopping the workload (SIGTERM)");
    signal(&process, Signal::SIGTERM);
    if let Ok(exit) = tokio::time::timeout(grace, wait(&mut process)).await {
        return exit;
    }
    warn!(
        pid = pid(&process),
        ?grace,
        "the workload outlived its grace period: SIGKILL"
    );
    signal(&process, Signal::SIGKILL);
    wait(&mut process).await
}

async fn wait(process: &mut Process) -> Exit {
    match process {
        Process::Child(child) => {
            let alive_until_ticks = identity::ticks_since_boot().await;
            match child.wait().await {
                Ok(status) => Exit {
                    code: status.code(),
                    signal: status.signal(),
                    alive_until_ticks,
                },
                Err(err) => {
                    warn!(error = %err, "cannot wait for the workload");
                    Exit {
                        alive_until_ticks,
                        ..Exit::default()
                    }
                }
            }
        }
        Process::Foreign(id) => {
            let mut alive_until_ticks = id.start_time_ticks;
            loop {
                let now = identity::ticks_since_boot().await;
                if !identity::is_running(id) {
                    break;
                }
                alive_until_ticks = now;
                tokio::time::sleep(EXIT_POLL).await;
            }
            Exit {
                alive_until_ticks,
                ..Exit::default()
            }
        }
    }
}

fn pid(process: &Process) -> u32 {
    match process {
        Process::Child(child) => child.id().unwrap_or(0),
        Process::Foreign(id) => id.pid,
    }
}

fn signal(process: &Process, signal: Signal) {
    if let Process::Foreign(id) = process
        && !identity::is_running(id)
    {
        return; // never signal a reused PID
    }
    // PIDs 0 and 1 would address a process group or the Pod's init: never signalled.
    let Some(pid) = i32::try_from(pid(process)).ok().filter(|p| *p > 1) else {
        return;
    };
    if let Err(err) = kill(Pid::from_raw(pid), signal) {
        warn!(pid, error = %err, ?signal, "cannot signal the workload");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stop_terminates_and_reaps_a_child() {
        let child = spawn(&["sleep".into(), "600".into()], Path::new("/nonexistent"), None).unwrap();
        let pid = child.id().unwrap();
        let (control, exit) = watch(Process::Child(child));
        control.stop(Duration::from_secs(5));
        let exit = exit.await.unwrap();
        assert_eq!(exit.signal, Some(Signal::SIGTERM as i32));
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "reaped");
    }

    #[tokio::test]
    async fn sigkill_after_the_grace_and_exit_codes_are_reported() {
        // Ignores SIGTERM and leaves no orphan behind when killed.
        let stubborn = [
            "sh".into(),
            "-c".into(),
            "trap '' TERM; while :; do sleep 0.05; done".into(),
        ];
        let (control, exit) = watch(Process::Child(spawn(&stubborn, Path::new("/x"), None).unwrap()));
        // Give the shell time to install its trap before the SIGTERM.
        tokio::time::sleep(Duration::from_millis(200)).await;
        control.stop(Duration::from_millis(200));
        assert_eq!(exit.await.unwrap().signal, Some(Signal::SIGKILL as i32));
        let (_control, exit) = watch(Process::Child(
            spawn(&["sh".into(), "-c".into(), "exit 3".into()], Path::new("/x"), None).unwrap(),
        ));
        let exit = exit.await.unwrap();
        assert_eq!(exit.code, Some(3));
        assert_eq!(exit.to_string(), "exited with status 3");
    }

    #[tokio::test]
    async fn spawn_errors_are_reported() {
        assert!(matches!(spawn(&[], Path::new("/x"), None), Err(Error::Empty)));
        assert!(matches!(
            spawn(&["/nonexistent/binary".into()], Path::new("/x"), None),
            Err(Error::Spawn { .. })
        ));
    }
}
