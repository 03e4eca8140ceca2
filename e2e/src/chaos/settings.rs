//! What a chaos run is given: the backend (SQLite, a private PostgreSQL it may stop, or a
//! server by URL) and the pool's size and bounds.

use std::path::PathBuf;
use std::time::Duration;

use crate::postgres;
use crate::scenarios::Error;

/// Where the pool keeps its state.
#[derive(Debug, Clone)]
pub enum Backend {
    /// The embedded store (an SQLite file).
    Sqlite,
    /// A private PostgreSQL server the driver starts, and stops for outage faults.
    PrivatePostgres,
    /// A PostgreSQL server by URL (a fresh database on it; no outage faults).
    Postgres(String),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::PrivatePostgres | Self::Postgres(_) => "postgresql",
        }
    }

    /// The database of a run named `run`: a private server started for it (stop it with an
    /// awaited `halt` at the end) and a fresh database's URL, or `None` for SQLite.
    pub async fn database(&self, run: &str) -> Result<(Option<postgres::Server>, Option<String>), Error> {
        let server = match self {
            Self::PrivatePostgres => Some(
                postgres::Server::start()
                    .await
                    .map_err(|e| Error::Scenario(e.to_string()))?,
            ),
            _ => None,
        };
        let admin = match (self, &server) {
            (Self::Postgres(url), _) => Some(url.clone()),
            (_, Some(server)) => Some(server.url()),
            _ => None,
        };
        let url = match admin {
            Some(admin) => Some(crate::scenarios::fresh_database(&admin, run).await?),
            None => None,
        };
        Ok((server, url))
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub trials: usize,
    pub seed: u64,
    pub root: PathBuf,
    pub backend: Backend,
    pub gateways: usize,
    pub members: usize,
    pub sandboxes: usize,
    pub lease_length_ms: u64,
    /// Every instance active and every agent answered again within this, from the heal.
    pub settle_bound: Duration,
    /// The first trials run each kind once, in order, before the seed draws the rest: a short
    /// run still has every kind.
    pub every_kind_first: bool,
    /// The kinds trials are drawn from; empty: every kind the pool can have.
    pub kinds: Vec<super::plan::Fault>,
}

impl Settings {
    pub fn new(trials: usize, seed: u64, root: PathBuf, backend: Backend) -> Self {
        Self {
            trials,
            seed,
            root,
            backend,
            gateways: 3,
            members: 3,
            sandboxes: 8,
            lease_length_ms: 5000,
            settle_bound: Duration::from_secs(30),
            every_kind_first: false,
            kinds: Vec::new(),
        }
    }
}
