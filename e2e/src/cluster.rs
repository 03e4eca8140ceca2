//! A real cluster through `kubectl` (for the cluster test, which runs only where `KUBECONFIG`
//! is set): bounded calls, JSON output, and waiting on conditions.

use std::future::Future;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Bound on one kubectl call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot run kubectl: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("kubectl {args} timed out after {CALL_TIMEOUT:?}")]
    Timeout { args: String },
    #[error("kubectl {args} failed: {stderr}")]
    Failed { args: String, stderr: String },
    #[error("kubectl {args} printed no JSON: {source}")]
    Json {
        args: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("gave up after {after:?} waiting for {what}")]
    GaveUp { what: String, after: Duration },
}

/// `kubectl`, with the ambient `KUBECONFIG`.
#[derive(Debug, Clone, Default)]
pub struct Kubectl;

impl Kubectl {
    /// Run `kubectl args…` (with `stdin` piped in when given) and return its stdout.
    pub async fn run_with(&self, args: &[&str], stdin: Option<&str>) -> Result<String, Error> {
        let mut child = Command::new("kubectl")
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes()).await?;
        }
        let joined = args.join(" ");
        let output = tokio::time::timeout(CALL_TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| Error::Timeout { args: joined.clone() })??;
        if !output.status.success() {
            return Err(Error::Failed {
                args: joined,
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    pub async fn run(&self, args: &[&str]) -> Result<String, Error> {
        self.run_with(args, None).await
    }

    /// `kubectl args… -o json`, parsed.
    pub async fn json(&self, args: &[&str]) -> Result<Value, Error> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.run(&all).await?;
        serde_json::from_str(&out).map_err(|source| Error::Json {
            args: args.join(" "),
            source,
        })
    }

    /// `kubectl apply -f -` of `manifest`.
    pub async fn apply(&self, manifest: &str) -> Result<String, Error> {
        self.run_with(&["apply", "-f", "-"], Some(manifest)).await
    }
}

/// Poll `check` every second until it yields a value, for at most `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if started.elapsed() >= limit {
            return Err(Error::GaveUp {
                what: what.to_owned(),
                after: limit,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The events (core/v1 view) in `namespace` with `reason` about the object `name`.
pub async fn events(kubectl: &Kubectl, namespace: &str, name: &str, reason: &str) -> Result<Vec<Value>, Error> {
    let selector = format!("involvedObject.name={name},reason={reason}");
    let list = kubectl
        .json(&["get", "events", "-n", namespace, "--field-selector", &selector])
        .await?;
    Ok(list.get("items").and_then(Value::as_array).cloned().unwrap_or_default())
}
