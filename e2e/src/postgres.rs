//! A private PostgreSQL server the harness can stop and start again: what the
//! database-outage scenario and the chaos command's outage faults need (a
//! server given by URL cannot be stopped from here). The same recipe as
//! `scripts/with-postgres`: initdb into a temporary directory (as the
//! `postgres` user when run as root), trust authentication on loopback only,
//! one fixed port across restarts. Removed on drop.

use std::path::PathBuf;
use std::time::Duration;

use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the PostgreSQL server binaries (initdb, pg_ctl) are not installed; install Debian's postgresql-15")]
    Missing,
    #[error("cannot run {what}: {source}")]
    Run {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed: {output}")]
    Failed { what: String, output: String },
    #[error(transparent)]
    Port(#[from] crate::local::Error),
}

/// How long `pg_ctl` may wait for the server to start or stop.
const PG_CTL_WAIT_SECS: &str = "60";

pub struct Server {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    running: bool,
}

impl Server {
    /// initdb and start a server on a free loopback port.
    pub async fn start() -> Result<Self, Error> {
        let bin = find_bin().ok_or(Error::Missing)?;
        let dir = tempfile::Builder::new()
            .prefix("openshell-pg.")
            .tempdir()
            .map_err(|source| Error::Run {
                what: "a temporary directory".into(),
                source,
            })?;
        if as_root() {
            // initdb runs as `postgres`, which must own the directory.
            if let Some(user) = nix::unistd::User::from_name("postgres").ok().flatten() {
                nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).map_err(|e| Error::Run {
                    what: "chown of the data directory".into(),
                    source: e.into(),
                })?;
            }
        }
        let port = crate::local::free_port()?;
        let mut server = Self {
            bin,
            dir,
            port,
            running: false,
        };
        let data = server.data().display().to_string();
        server
            .run("initdb", &["-D", &data, "-U", "postgres", "--auth=trust", "-E", "UTF8"])
            .await?;
        server.resume().await?;
        Ok(server)
    }

    /// The admin URL (database `postgres`).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Stop the server at once (`-m immediate`: what a crash or a lost node looks like to
    /// the clients; every connection is cut).
    pub async fn halt(&mut self) -> Result<(), Error> {
        let data = self.data().display().to_string();
        self.run(
            "pg_ctl stop",
            &["-D", &data, "-m", "immediate", "-w", "-t", PG_CTL_WAIT_SECS, "stop"],
        )
        .await?;
        self.running = false;
        Ok(())
    }

    /// Start the (stopped) server again on the same port, and wait until it accepts.
    pub async fn resume(&mut self) -> Result<(), Error> {
        let data = self.data().display().to_string();
        let log = self.dir.path().join("server.log").display().to_string();
        let socket_dir = self.dir.path().display().to_string();
        // `synchronous_commit` stays on: `halt` is a crash of the server's processes, and a
        // commit acknowledged before its WAL was written would be lost with it (a store that
        // forgets what it confirmed is not what the outage faults are about). `fsync=off` only
        // risks data on a crash of the machine, which the faults never cause. The background
        // writer writes no pages (each would write the WAL before it), so commits a fault made
        // asynchronous stay unwritten while it holds the WAL writer
        // (`scenarios::commits_asynchronous`).
        let options = format!(
            "-p {} -k {socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c synchronous_commit=on -c bgwriter_lru_maxpages=0 -c full_page_writes=off -c max_connections=300",
            self.port
        );
        self.run(
            "pg_ctl start",
            &[
                "-D",
                &data,
                "-l",
                &log,
                "-w",
                "-t",
                PG_CTL_WAIT_SECS,
                "-o",
                &options,
                "start",
            ],
        )
        .await?;
        self.running = true;
        Ok(())
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    async fn run(&self, what: &str, args: &[&str]) -> Result<(), Error> {
        let program = self.bin.join(what.split_whitespace().next().unwrap_or(what));
        let mut command = if as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        command.args(args).kill_on_drop(true);
        let output = tokio::time::timeout(Duration::from_secs(90), command.output())
            .await
            .map_err(|_| Error::Failed {
                what: what.into(),
                output: "no answer within 90 s".into(),
            })?
            .map_err(|source| Error::Run {
                what: what.into(),
                source,
            })?;
        if output.status.success() {
            Ok(())
        } else {
            Err(Error::Failed {
                what: what.into(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            })
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.running {
            // Only when the owner did not `halt` it (an early return, a panic): Drop cannot
            // await, so a blocking pg_ctl, bounded by its own -t.
            let program = self.bin.join("pg_ctl");
            let data = self.data();
            let mut command = if as_root() {
                let mut c = std::process::Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&program);
                c
            } else {
                std::process::Command::new(&program)
            };
            let _ = command
                .arg("-D")
                .arg(&data)
                .args(["-m", "immediate", "-w", "-t", "30", "stop"])
                .output();
        }
    }
}

fn as_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

fn find_bin() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("/usr/lib/postgresql/15/bin")];
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        candidates.extend(entries.filter_map(|e| e.ok()).map(|e| e.path().join("bin")));
    }
    candidates
        .into_iter()
        .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
}
