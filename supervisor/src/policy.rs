//! The egress policy file this member installs in the sidecars it owns
//! (`--egress-policy`): read at start — a file that does not parse stops the member — and
//! again whenever it changes, so an edit reaches every sidecar within about a second. An edit
//! that does not parse is logged and the revision in force stays. The credentials it binds are
//! read from `--egress-secrets` (`DIR/<secret>/<key>`, as Kubernetes mounts a Secret) each
//! time, so a rotated value is installed under the same revision.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use proto::runtime::v1::{CredentialBinding, EgressPolicy};
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

async fn read(path: &Path, secrets: Option<&Path>) -> Result<EgressPolicy, String> {
    let file = tokio::fs::File::open(path).await.map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.take(MAX_POLICY_BYTES + 1)
        .read_to_string(&mut text)
        .await
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_POLICY_BYTES {
        return Err(format!("larger than {MAX_POLICY_BYTES} bytes"));
    }
    let mut policy = parse(&text)?;
    for binding in &mut policy.credentials {
        fill(binding, secrets).await;
    }
    Ok(policy)
}

/// The policy file at start, if one is configured.
pub async fn first(config: &crate::config::Config) -> Result<Option<EgressPolicy>, crate::config::ConfigError> {
    let Some(path) = &config.egress_policy else {
        return Ok(None);
    };
    read(path, config.egress_secrets.as_deref())
        .await
        .map(Some)
        .map_err(|why| crate::config::ConfigError::EgressPolicy(path.display().to_string(), why))
}

/// Puts the value of `binding` from `DIR/<secret>/<key>` ([`proto::egress::credential_value`]),
/// or why it has none.
async fn fill(binding: &mut CredentialBinding, secrets: Option<&Path>) {
    let component = |part: &str| {
        !part.is_empty()
            && part.len() <= 253
            && part != "."
            && part != ".."
            && part.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
    };
    let read = async {
        let dir = secrets.ok_or("no --egress-secrets directory is configured")?;
        if !component(&binding.secret) || !component(&binding.key) {
            return Err("the secret's name or key is not a plain file name".to_owned());
        }
        let path = dir.join(&binding.secret).join(&binding.key);
        let file = tokio::fs::File::open(&path)
            .await
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut value = Vec::new();
        // A value and its trailing whitespace.
        file.take(proto::egress::MAX_CREDENTIAL_BYTES as u64 + 64)
            .read_to_end(&mut value)
            .await
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        proto::egress::credential_value(&value).map_err(|why| format!("{}: {why}", path.display()))
    };
    match read.await {
        Ok(value) => binding.value = value,
        Err(error) => binding.error = error,
    }
}

/// Follows `path` (starting from `first`, read at start) until `shutdown`.
pub fn follow(
    path: Option<PathBuf>,
    secrets: Option<PathBuf>,
    first: Option<EgressPolicy>,
    shutdown: CancellationToken,
) -> Current {
    let (tx, current) = watch::channel(first.map(Arc::new));
    let Some(path) = path else { return current };
    tokio::spawn(async move {
        let mut last_error = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(POLL) => {}
            }
            match read(&path, secrets.as_deref()).await {
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
        let mut current = follow(Some(path.clone()), None, Some(first), shutdown.clone());
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

    #[tokio::test]
    async fn credentials_are_read_as_a_mounted_secret_and_never_from_outside_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secrets = dir.path().join("secrets");
        std::fs::create_dir_all(secrets.join("models")).expect("mkdir");
        std::fs::write(secrets.join("models").join("token"), "sk-1\n").expect("write");
        std::fs::write(dir.path().join("outside"), "not-yours").expect("write");
        let path = dir.path().join("policy.yaml");
        let policy = |secret: &str, key: &str| {
            format!("name: p\ncredentials:\n- name: k\n  secretKeyRef: {{name: {secret}, key: {key}}}\n")
        };
        std::fs::write(&path, policy("models", "token")).expect("write");
        let read_back = read(&path, Some(&secrets)).await.expect("valid");
        assert_eq!(read_back.credentials[0].value, b"sk-1", "trailing whitespace trimmed");
        std::fs::write(&path, policy("..", "outside")).expect("write");
        let escaped = read(&path, Some(&secrets)).await.expect("valid");
        assert!(escaped.credentials[0].value.is_empty() && !escaped.credentials[0].error.is_empty());
        std::fs::write(&path, policy("models", "token")).expect("write");
        let unconfigured = read(&path, None).await.expect("valid");
        assert!(unconfigured.credentials[0].error.contains("--egress-secrets"));
    }
}
