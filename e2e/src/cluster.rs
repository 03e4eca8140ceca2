//! A real cluster through `kubectl` (for the cluster test, which runs only where `KUBECONFIG`
//! is set): bounded calls, JSON output, and waiting on conditions.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

/// Bound on one kubectl call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot run kubectl: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("kubectl {args} did not finish in time")]
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
    #[error("{0}")]
    Check(String),
}

/// `Ok` when `holds`, otherwise a failed check saying `what`.
pub fn check(holds: bool, what: impl FnOnce() -> String) -> Result<(), Error> {
    if holds { Ok(()) } else { Err(Error::Check(what())) }
}

/// The row of `kubectl get` output `table` whose first column is `name`, by column header
/// (values without spaces, as the printer columns of the pool's resources are).
pub fn table_row(table: &str, name: &str) -> Option<BTreeMap<String, String>> {
    let mut lines = table.lines();
    let headers: Vec<&str> = lines.next()?.split_whitespace().collect();
    let row = lines.find(|l| l.split_whitespace().next() == Some(name))?;
    Some(
        headers
            .into_iter()
            .zip(row.split_whitespace())
            .map(|(h, v)| (h.to_owned(), v.to_owned()))
            .collect(),
    )
}

/// `(status, reason)` of the condition `type_` in a custom resource's `status`.
pub fn condition_of(status: &Value, type_: &str) -> Option<(String, String)> {
    let found = status["conditions"].as_array()?.iter().find(|c| c["type"] == type_)?;
    Some((
        found["status"].as_str()?.to_owned(),
        found["reason"].as_str()?.to_owned(),
    ))
}

/// The bound on one call: [`CALL_TIMEOUT`], or half a minute more than the call's own
/// `--timeout=Ns` (`rollout status`, `wait`, `delete --wait`).
fn call_limit(args: &[&str]) -> Duration {
    let secs = |a: &str| {
        let value = a.strip_prefix("--timeout=")?;
        match value.strip_suffix('m') {
            Some(minutes) => minutes.parse::<u64>().ok()?.checked_mul(60),
            None => value.strip_suffix('s')?.parse::<u64>().ok(),
        }
    };
    args.iter().find_map(|a| secs(a)).map_or(CALL_TIMEOUT, |secs| {
        Duration::from_secs(secs.saturating_add(30)).max(CALL_TIMEOUT)
    })
}

/// The install guide's five commands (`docs/install.md`, "The five commands"), which the
/// cluster test runs as written: `{overlay}` is the overlay (the guide's
/// `kustomize/overlays/dev`, the test's `kustomize/overlays/test`) and `{namespace}` the
/// namespace labelled (the guide's `team-a`). A unit test fails when the guide and this list
/// differ, so the guide cannot drift from what CI runs.
pub const INSTALL_GUIDE: [&str; 5] = [
    "kubectl apply -k {overlay}",
    "kustomize/pool-certs.sh",
    "kubectl -n openshell-supervision rollout status deploy/openshell-supervisor --timeout=5m",
    "kubectl create namespace {namespace}",
    "kubectl label namespace {namespace} supervision.openshell.ai/shared=enabled",
];

/// One of [`INSTALL_GUIDE`]'s commands with its placeholders filled, word by word.
pub fn guide_command(template: &str, overlay: &str, namespace: &str) -> Vec<String> {
    template
        .split_whitespace()
        .map(|word| word.replace("{overlay}", overlay).replace("{namespace}", namespace))
        .collect()
}

/// `kubectl`, with the ambient `KUBECONFIG`.
#[derive(Debug, Clone, Default)]
pub struct Kubectl;

impl Kubectl {
    /// Run `kubectl args…` (with `stdin` piped in when given) and return its stdout.
    pub async fn run_with(&self, args: &[&str], stdin: Option<&str>) -> Result<String, Error> {
        self.output(args, stdin).await.map(|(stdout, _)| stdout)
    }

    /// `kubectl apply -f -` of `manifest`: its stdout and stderr (where kubectl prints the
    /// admission warnings).
    pub async fn apply_warned(&self, manifest: &str) -> Result<(String, String), Error> {
        self.output(&["apply", "-f", "-"], Some(manifest)).await
    }

    async fn output(&self, args: &[&str], stdin: Option<&str>) -> Result<(String, String), Error> {
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
        let output = tokio::time::timeout(call_limit(args), child.wait_with_output())
            .await
            .map_err(|_| Error::Timeout { args: joined.clone() })??;
        if !output.status.success() {
            return Err(Error::Failed {
                args: joined,
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok((
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ))
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

    /// `kubectl args…` left running with its input and output piped (an `exec -i`): killed
    /// when dropped.
    pub fn attach(&self, args: &[&str]) -> Result<Attached, Error> {
        let mut child = Command::new("kubectl")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::Check("kubectl without pipes".into()));
        };
        Ok(Attached {
            _child: child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            args: args.join(" "),
        })
    }
}

/// A running `kubectl` (see [`Kubectl::attach`]).
pub struct Attached {
    _child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    args: String,
}

impl Attached {
    /// The next line of output that starts with `prefix`, within `limit`.
    pub async fn line_starting(&mut self, prefix: &str, limit: Duration) -> Result<String, Error> {
        let wanted = async {
            while let Some(line) = self.lines.next_line().await? {
                if line.starts_with(prefix) {
                    return Ok(line);
                }
            }
            Err(Error::Check(format!(
                "kubectl {} ended before printing {prefix:?}",
                self.args
            )))
        };
        tokio::time::timeout(limit, wanted).await.map_err(|_| Error::GaveUp {
            what: format!("{prefix:?} from kubectl {}", self.args),
            after: limit,
        })?
    }

    /// Write `line` (and a newline) to its input.
    pub async fn send(&mut self, line: &str) -> Result<(), Error> {
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        Ok(self.stdin.flush().await?)
    }
}

/// Poll `check` every second until it yields a value, for at most `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, check: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll(what, limit, Duration::from_secs(1), check).await
}

/// Poll `check` every `every` until it yields a value, for at most `limit`.
pub async fn poll<T, F, Fut>(what: &str, limit: Duration, every: Duration, mut check: F) -> Result<T, Error>
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
        tokio::time::sleep(every).await;
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

/// One instance as `poolctl status -o json` shows it.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    pub route: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub owner: String,
    pub term: u64,
    pub reserved: bool,
    pub phase: String,
    pub workload_pid: u32,
    pub progress: u64,
}

impl Instance {
    /// Active under an owner whose term is activated.
    pub fn settled(&self) -> bool {
        !self.owner.is_empty() && !self.reserved && self.phase == "active"
    }
}

/// One member as `poolctl status -o json` shows it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Member {
    pub name: String,
    pub state: String,
    pub instances: u32,
    pub capacity: u32,
    /// The member's attached process (what every member reads in its route directory).
    #[serde(default, rename = "processId")]
    pub process_id: String,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct Coordinator {
    pub holder: String,
    pub term: u64,
}

impl Coordinator {
    /// The replica (its Pod name) of `replica/key`.
    pub fn replica(&self) -> &str {
        self.holder.split('/').next().unwrap_or_default()
    }
}

/// One durable operation as `poolctl status -o json` shows it.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub id: String,
    pub kind: String,
    pub target: String,
    /// `pending`, `running`, `succeeded`, `failed` or `cancelled`.
    pub phase: String,
    pub requested_by: String,
    /// The moves it made.
    #[serde(default)]
    pub moves: u32,
}

/// One live part of the pool and the build it runs, as `poolctl status -o json` shows it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Build {
    /// `gateway`, `member` or `sidecar`.
    pub component: String,
    /// The replica, the member, or the sidecar's route.
    pub name: String,
    pub version: String,
}

/// `poolctl status -o json`, the parts the test reads.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Status {
    pub coordinator: Option<Coordinator>,
    pub members: Vec<Member>,
    pub instances: Vec<Instance>,
    #[serde(default)]
    pub operations: Vec<Operation>,
    #[serde(default)]
    pub builds: Vec<Build>,
    /// What is outside the compatibility policy.
    #[serde(default, rename = "buildWarnings")]
    pub build_warnings: Vec<String>,
}

impl Status {
    /// The instances of `namespace`.
    pub fn of(&self, namespace: &str) -> Vec<&Instance> {
        self.instances.iter().filter(|i| i.namespace == namespace).collect()
    }

    /// The versions the live parts of `component` run.
    pub fn versions_of(&self, component: &str) -> BTreeSet<&str> {
        self.builds
            .iter()
            .filter(|b| b.component == component)
            .map(|b| b.version.as_str())
            .collect()
    }
}

/// The pool seen through `poolctl` in a gateway Pod of the install, as an operator runs it.
#[derive(Debug, Clone)]
pub struct Pool {
    pub kubectl: Kubectl,
    pub namespace: String,
}

impl Pool {
    pub async fn poolctl(&self, args: &[&str]) -> Result<String, Error> {
        let mut all = vec![
            "exec",
            "-n",
            &self.namespace,
            "deploy/openshell-gateway",
            "-c",
            "gateway",
            "--",
            "poolctl",
        ];
        all.extend_from_slice(args);
        self.kubectl.run(&all).await
    }

    pub async fn status(&self) -> Result<Status, Error> {
        let out = self.poolctl(&["status", "-o", "json"]).await?;
        serde_json::from_str(&out).map_err(|source| Error::Json {
            args: "poolctl status -o json".into(),
            source,
        })
    }
}

/// Write every container's log (and the previous one after a restart), the Pods and the
/// Events of `namespaces` into `dir`, and print the end of each log to stderr.
pub async fn dump_logs(kubectl: &Kubectl, namespaces: &[&str], dir: &std::path::Path) {
    // One directory per run, so an earlier run's logs never mix in (nothing is deleted).
    let dir = &dir.join(format!("run-{}", std::process::id()));
    let _ = tokio::fs::create_dir_all(dir).await;
    for namespace in namespaces {
        for (what, args) in [
            ("pods", vec!["get", "pods", "-n", namespace, "-o", "wide"]),
            (
                "events",
                vec!["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"],
            ),
        ] {
            let out = kubectl.run(&args).await.unwrap_or_else(|e| e.to_string());
            eprintln!("---- {namespace} {what}\n{out}");
            let _ = tokio::fs::write(dir.join(format!("{namespace}.{what}.txt")), out).await;
        }
        let Ok(pods) = kubectl.json(&["get", "pods", "-n", namespace]).await else {
            continue;
        };
        for pod in pods["items"].as_array().into_iter().flatten() {
            let name = pod
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let statuses = ["/status/initContainerStatuses", "/status/containerStatuses"]
                .iter()
                .filter_map(|p| pod.pointer(p).and_then(Value::as_array))
                .flatten();
            for status in statuses {
                let container = status["name"].as_str().unwrap_or_default();
                let restarted = status["restartCount"].as_u64().unwrap_or(0) > 0;
                for previous in [false, true] {
                    if previous && !restarted {
                        continue;
                    }
                    let mut args = vec!["logs", "-n", namespace, name, "-c", container];
                    if previous {
                        args.push("--previous");
                    }
                    let log = kubectl.run(&args).await.unwrap_or_else(|e| e.to_string());
                    let suffix = if previous { ".previous" } else { "" };
                    let file = format!("{namespace}.{name}.{container}{suffix}.log");
                    let tail: Vec<&str> = log.lines().rev().take(25).collect();
                    eprintln!("---- {file} (last {} lines)", tail.len());
                    for line in tail.iter().rev() {
                        eprintln!("{line}");
                    }
                    let _ = tokio::fs::write(dir.join(file), log).await;
                }
            }
        }
    }
    eprintln!("---- logs written to {}", dir.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_with_its_own_timeout_is_bounded_a_little_after_it() {
        assert_eq!(call_limit(&["get", "pods"]), CALL_TIMEOUT);
        assert_eq!(
            call_limit(&["rollout", "status", "--timeout=180s"]),
            Duration::from_secs(210)
        );
        assert_eq!(call_limit(&["wait", "--timeout=5s"]), CALL_TIMEOUT);
        assert_eq!(call_limit(&["wait", "--timeout=5m"]), Duration::from_secs(330));
        assert_eq!(call_limit(&["wait", "--timeout=soon"]), CALL_TIMEOUT);
    }

    /// The sh block under "The five commands" of docs/install.md is, line for line, what the
    /// cluster test runs (with the guide's overlay and namespace).
    #[test]
    fn the_install_guide_runs_what_the_cluster_test_runs() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/install.md");
        let guide = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        let after = guide
            .split_once("The five commands")
            .map(|(_, after)| after)
            .unwrap_or_else(|| panic!("no \"The five commands\" in {}", path.display()));
        let block = after
            .split_once("```sh\n")
            .and_then(|(_, rest)| rest.split_once("```"))
            .map(|(block, _)| block)
            .unwrap_or_else(|| panic!("no sh block after \"The five commands\" in {}", path.display()));
        let documented: Vec<Vec<String>> = block
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| line.split_whitespace().map(str::to_owned).collect())
            .collect();
        let tested: Vec<Vec<String>> = INSTALL_GUIDE
            .iter()
            .map(|command| guide_command(command, "kustomize/overlays/dev", "team-a"))
            .collect();
        assert_eq!(
            documented, tested,
            "docs/install.md and e2e::cluster::INSTALL_GUIDE (what the cluster test runs) differ"
        );
    }

    #[test]
    fn a_table_row_is_read_by_header_and_a_condition_by_type() {
        let table = "NAME          KIND    MEMBER   PHASE       SUCCEEDED   MOVES   AGE\n\
                     drain-other   Drain   b        Running     Unknown     0/0     3s\n\
                     drain-a       Drain   a        Succeeded   True        2/2     20s\n";
        let row = table_row(table, "drain-a").unwrap_or_default();
        assert_eq!((row["SUCCEEDED"].as_str(), row["MOVES"].as_str()), ("True", "2/2"));
        assert!(table_row(table, "drain").is_none());
        let status = serde_json::json!({ "conditions": [
            { "type": "Complete", "status": "True", "reason": "Failed" },
            { "type": "Succeeded", "status": "False", "reason": "Failed" },
        ]});
        assert_eq!(
            condition_of(&status, "Succeeded"),
            Some(("False".to_owned(), "Failed".to_owned()))
        );
        assert_eq!(condition_of(&status, "Ready"), None);
    }
}
