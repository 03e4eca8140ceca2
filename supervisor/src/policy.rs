//! The egress policy file this member installs in the sidecars it owns
//! (`--egress-policy`): read at start — a file that does not parse stops the member — and
//! again whenever it changes, so an edit reaches every sidecar within about a second. An edit
//! that does not parse is logged and the revision in force stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use proto::runtime::v1::EgressPolicy;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Largest policy file read.
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;
/// How often the file is looked at again.
pub const POLL: Duration = Duration::from_secs(1);

/// What sessions install: `None` without a file.
pub type Current = watch::Receiver<Option<Arc<EgressPolicy>>>;

/// Parses a policy document (YAML or JSON, `proto::egress::Document`).
pub fn parse(text: &str) -> Result<EgressPolicy, String> {
    let document: proto::egress::Document = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    Ok((&document).into())
}

async fn read(path: &Path) -> Result<EgressPolicy, String> {
    let file = tokio::fs::File::open(path).await.map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.take(MAX_POLICY_BYTES + 1)
        .read_to_string(&mut text)
        .await
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_POLICY_BYTES {
        return Err(format!("larger than {MAX_POLICY_BYTES} bytes"));
    }
    parse(&text)
}

/// Follows `path` (starting from `first`, read at start) until `shutdown`.
pub fn follow(path: Option<PathBuf>, first: Option<EgressPolicy>, shutdown: CancellationToken) -> Current {
    let (tx, current) = watch::channel(first.map(Arc::new));
    let Some(path) = path else { return current };
    tokio::spawn(async move {
        let mut last_error = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(POLL) => {}
            }
            match read(&path).await {
                Ok(policy) => {
                    last_error = None;
                    let changed = tx.borrow().as_deref() != Some(&policy);
                    if changed {
                        info!(policy = %policy.name, revision = policy.revision, "egress policy file changed: installing it");
                        tx.send_replace(Some(Arc::new(policy)));
                    }
                }
                Err(error) if last_error.as_ref() != Some(&error) => {
                    warn!(path = %path.display(), %error, "cannot read the egress policy file; the revision in force stays");
                    last_error = Some(error);
                }
                Err(_) => {}
            }
        }
    });
    current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn edits_are_followed_and_one_that_does_not_parse_is_not_installed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policy.yaml");
        let write = |revision: u64| {
            let text = format!("name: p\nrevision: {revision}\nrules: []\n");
            std::fs::write(&path, text).expect("write");
        };
        write(1);
        let first = parse(&std::fs::read_to_string(&path).expect("read")).expect("valid");
        let shutdown = CancellationToken::new();
        let mut current = follow(Some(path.clone()), Some(first), shutdown.clone());
        assert_eq!(current.borrow().as_ref().map(|p| p.revision), Some(1));
        write(2);
        tokio::time::timeout(Duration::from_secs(10), current.changed())
            .await
            .expect("followed")
            .expect("open");
        assert_eq!(current.borrow_and_update().as_ref().map(|p| p.revision), Some(2));
        let misspelt = "name: p\nrevision: 9\nrules: [{name: r, host: a, ports: [1], port: 2}]\n";
        assert!(parse(misspelt).is_err());
        std::fs::write(&path, misspelt).expect("write");
        write(3);
        tokio::time::timeout(Duration::from_secs(10), current.changed())
            .await
            .expect("followed")
            .expect("open");
        assert_eq!(current.borrow().as_ref().map(|p| p.revision), Some(3));
        shutdown.cancel();
    }
}
