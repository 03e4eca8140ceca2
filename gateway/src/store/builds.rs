//! Which build each part of the pool runs: gateway replicas, members and sidecars record their
//! [`plumbing::build::version`] (`builds` table), and the status reads the builds of what is
//! live now ([`Store::builds`]); [`crate::skew`] says what is outside the compatibility policy.

use proto::timing;

use super::{Result, Store};

/// The parts of the pool that report a build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    Gateway,
    Member,
    Sidecar,
}

impl Component {
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Gateway => "gateway",
            Component::Member => "member",
            Component::Sidecar => "sidecar",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [Component::Gateway, Component::Member, Component::Sidecar]
            .into_iter()
            .find(|c| c.as_str() == text)
    }
}

/// One live part and its build.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Build {
    pub component: Component,
    /// The replica, the member, or the sidecar's route.
    pub name: String,
    pub version: String,
}

/// How often a replica writes its build again (its build counts while its liveness record,
/// refreshed every second, does: [`Store::builds`]).
pub const GATEWAY_BUILD_EVERY: std::time::Duration = std::time::Duration::from_secs(3 * 60);
/// The longest version kept (a build's version is `0.2.0+<40 hex>` at most).
pub const MAX_VERSION_BYTES: usize = 96;
/// How long a caller's write of its build may take: it is recorded inline (bounded, after the
/// call is admitted), never in a task of its own per call.
pub const RECORD_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// What a peer said its version is, as it may be stored and shown: semantic-version characters
/// only (`[0-9A-Za-z.+-]`), at most [`MAX_VERSION_BYTES`]; anything else is kept as `""`
/// ("no build reported"), so no control character or escape reaches a log line or a terminal.
pub fn sanitized(version: &str) -> &str {
    let fits = version.len() <= MAX_VERSION_BYTES
        && version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-'));
    if fits { version } else { "" }
}

/// How often [`Latest`] reads the builds again (they change with rollouts and new Pods).
pub const READ_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
/// The bound on one read of [`Latest`]; on failure the last read stands.
pub const READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The builds as last read, for a status shown again and again (the `SupervisorPool` object, a
/// watch of the pool): read at most every [`READ_EVERY`], each read bounded by [`READ_LIMIT`];
/// a failed or slow read keeps the last.
#[derive(Debug, Default)]
pub struct Latest {
    builds: Vec<Build>,
    read_at: Option<tokio::time::Instant>,
}

impl Latest {
    /// The builds, read again first if the last read is older than [`READ_EVERY`].
    pub async fn get(&mut self, store: &Store) -> &[Build] {
        if self.read_at.is_none_or(|at| at.elapsed() >= READ_EVERY) {
            self.read_at = Some(tokio::time::Instant::now());
            match tokio::time::timeout(READ_LIMIT, store.builds()).await {
                Ok(Ok(read)) => self.builds = read,
                Ok(Err(err)) => tracing::debug!(error = %err, "cannot read the builds; the last read stands"),
                Err(_) => tracing::debug!("the builds took too long to read; the last read stands"),
            }
        }
        &self.builds
    }
}

impl Store {
    /// Records that `name` of `component` runs `version` ([`sanitized`]).
    pub async fn record_build(&self, component: Component, name: &str, version: &str) -> Result<()> {
        let version = sanitized(version);
        let clock = self.backend.clock_expr();
        sqlx::query(&format!(
            "INSERT INTO builds (component, name, version, seen_at_ms) VALUES ($1, $2, $3, ({clock})) \
             ON CONFLICT (component, name) DO UPDATE SET version = excluded.version, seen_at_ms = excluded.seen_at_ms"
        ))
        .bind(component.as_str())
        .bind(name)
        .bind(version)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The builds of what is live now: gateway replicas that recorded that they run within
    /// [`timing::replica_silence_bound`] (so a replica a rollout replaced drops out within
    /// seconds), members with a live membership record, sidecars of desired instances. Sorted
    /// by component, then name.
    pub async fn builds(&self) -> Result<Vec<Build>> {
        self.builds_within(timing::replica_silence_bound()).await
    }

    /// [`Store::builds`], with gateway replicas live while their record of running is younger
    /// than `replica_live`.
    pub async fn builds_within(&self, replica_live: std::time::Duration) -> Result<Vec<Build>> {
        let clock = self.backend.clock_expr();
        let rows: Vec<(String, String, String)> = sqlx::query_as(&format!(
            "SELECT b.component, b.name, b.version FROM builds b WHERE \
               (b.component = 'gateway' AND EXISTS \
                    (SELECT 1 FROM replicas r WHERE r.replica = b.name AND r.refreshed_at_ms > ({clock}) - $1)) \
               OR (b.component = 'member' AND EXISTS \
                    (SELECT 1 FROM members m WHERE m.member = b.name AND m.expires_at_ms > ({clock}))) \
               OR (b.component = 'sidecar' AND EXISTS \
                    (SELECT 1 FROM instances i WHERE i.route = b.name AND NOT i.withdrawn)) \
             ORDER BY b.component, b.name"
        ))
        .bind(i64::try_from(replica_live.as_millis()).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(component, name, version)| {
                Some(Build {
                    component: Component::parse(&component)?,
                    name,
                    version,
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_version_characters_are_kept() {
        assert_eq!(sanitized("0.2.0+3f1c2ab9e0d4"), "0.2.0+3f1c2ab9e0d4");
        assert_eq!(sanitized("1.0.0-rc.1"), "1.0.0-rc.1");
        assert_eq!(sanitized("0.2.0\nlevel=ERROR fake line"), "");
        assert_eq!(sanitized("\u{1b}[31m0.2.0"), "");
        assert_eq!(sanitized(&"1".repeat(MAX_VERSION_BYTES + 1)), "");
        assert_eq!(sanitized(""), "");
    }
}
