//! A child process of the harness: started with its environment, its output
//! in a log file, stopped gracefully (SIGTERM) or not (SIGKILL, SIGSTOP).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        name: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open log file {path}: {source}")]
    Log {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot signal {name}: {source}")]
    Signal {
        name: String,
        #[source]
        source: nix::Error,
    },
}

/// A running child. Killed when dropped (no orphans after a failed run).
#[derive(Debug)]
pub struct Process {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Process {
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Result<Self, Error> {
        // Appended: a restarted process (chaos restarts them under the same name) keeps its
        // predecessor's lines before its own.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|source| Error::Log {
                path: log.display().to_string(),
                source,
            })?;
        let stderr = file.try_clone().map_err(|source| Error::Log {
            path: log.display().to_string(),
            source,
        })?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Spawn {
                name: name.into(),
                program: program.display().to_string(),
                source,
            })?;
        Ok(Self {
            name: name.into(),
            log,
            child,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub fn signal(&self, signal: Signal) -> Result<(), Error> {
        let Some(pid) = self.pid().and_then(|p| i32::try_from(p).ok()) else {
            return Ok(()); // already reaped
        };
        kill(Pid::from_raw(pid), signal).map_err(|source| Error::Signal {
            name: self.name.clone(),
            source,
        })
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGTERM, then wait up to `grace` before SIGKILL.
    pub async fn stop(mut self, grace: std::time::Duration) {
        let _ = self.signal(Signal::SIGTERM);
        if tokio::time::timeout(grace, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }

    /// SIGKILL and reap (nothing when already reaped).
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}
