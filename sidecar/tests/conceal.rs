//! Nothing of the sidecar is reachable from a workload process of the same UID: the real
//! sidecar binary is started, and processes of its UID without capabilities (as in a
//! restricted Pod) try every `/proc/<pid>` path to its environment, memory, descriptors and
//! files. A plain process of the same UID is the control: the same reads of it succeed, so
//! the refusals come from the sidecar being non-dumpable, not from the test's set-up.
//! Run as root, the test drops to an unprivileged UID (setuid clears the capabilities).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The UID both sides run as when the test runs as root (distroless's `nonroot`).
const UNPRIVILEGED: u32 = 65532;
const MARKER: &str = "OPENSHELL_TEST_MARKER=the-sidecar-environment";

fn is_root() -> bool {
    std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

fn as_workload_uid(command: &mut Command) -> &mut Command {
    if is_root() {
        command.uid(UNPRIVILEGED).gid(UNPRIVILEGED);
    }
    command
}

/// Every path of `/proc/<pid>` that would reveal the process's secrets, each as a shell
/// command that succeeds only if the access was granted.
fn attempts(pid: u32) -> Vec<(&'static str, String)> {
    vec![
        ("environ", format!("grep -q OPENSHELL_TEST_MARKER /proc/{pid}/environ")),
        ("mem (open)", format!("exec 3</proc/{pid}/mem")),
        ("maps", format!("cat /proc/{pid}/maps >/dev/null")),
        ("root", format!("ls /proc/{pid}/root/ >/dev/null")),
        ("cwd", format!("ls /proc/{pid}/cwd/ >/dev/null")),
        ("fd", format!("ls /proc/{pid}/fd/ >/dev/null")),
        (
            "task root",
            format!("for t in /proc/{pid}/task/*; do ls $t/root/ >/dev/null || exit 1; done"),
        ),
        ("exe", format!("head -c1 /proc/{pid}/exe >/dev/null")),
    ]
}

fn granted(pid: u32) -> Vec<&'static str> {
    attempts(pid)
        .into_iter()
        .filter(|(_, script)| {
            as_workload_uid(Command::new("/bin/sh").args(["-c", script]))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("sh")
                .success()
        })
        .map(|(what, _)| what)
        .collect()
}

fn private_dir(path: &Path) {
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).unwrap();
    if is_root() {
        std::os::unix::fs::chown(path, Some(UNPRIVILEGED), Some(UNPRIVILEGED)).unwrap();
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `pid` has exec'd `exe` (its `/proc/<pid>/stat` names it), so that the reads
/// below are of the sidecar itself and not of the forked test process.
fn wait_for_exec(pid: u32, comm: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(&format!("({comm})")) {
            return;
        }
        assert!(Instant::now() < deadline, "{comm} did not start: {stat:?}");
        std::thread::yield_now();
    }
}

#[test]
fn no_process_of_the_workloads_uid_reaches_the_sidecars_memory_environment_or_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for sub in ["supervision", "state", "run"] {
        private_dir(&dir.path().join(sub));
    }
    // The sidecar waits for a workload to connect (Kubernetes mode) and retries its
    // unreachable gateway meanwhile: it stays up for as long as the test needs.
    let sidecar = as_workload_uid(&mut Command::new(env!("CARGO_BIN_EXE_sidecar")))
        .env_clear()
        .env("OPENSHELL_SUPERVISOR_ROUTE", "http://127.0.0.1:9")
        .env("OPENSHELL_GATEWAY_ENDPOINTS", "http://127.0.0.1:9")
        .env("OPENSHELL_POD_NAMESPACE", "team-a")
        .env("OPENSHELL_POD_NAME", "agent")
        .env("OPENSHELL_POD_UID", "4f1f5a4e-0000-4000-8000-000000000001")
        .env("OPENSHELL_SUPERVISION_DIR", dir.path().join("supervision"))
        .env("OPENSHELL_SIDECAR_SOCKET", dir.path().join("run/workload.sock"))
        .env("OPENSHELL_SIDECAR_STATE_DIR", dir.path().join("state"))
        .env("RUST_LOG", "off")
        .env(MARKER.split_once('=').unwrap().0, MARKER.split_once('=').unwrap().1)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the sidecar binary");
    let sidecar = Killed(sidecar);
    let control = as_workload_uid(Command::new("/bin/sleep").arg("600"))
        .env(MARKER.split_once('=').unwrap().0, MARKER.split_once('=').unwrap().1)
        .spawn()
        .expect("sleep");
    let control = Killed(control);
    wait_for_exec(sidecar.0.id(), "sidecar");
    wait_for_exec(control.0.id(), "sleep");

    let everything: Vec<&str> = attempts(0).into_iter().map(|(what, _)| what).collect();
    assert_eq!(
        granted(control.0.id()),
        everything,
        "the control (a plain process of the same UID) is readable: the test can tell"
    );
    let granted = granted(sidecar.0.id());
    assert!(
        granted.is_empty(),
        "a process of the workload's UID reached the sidecar's {granted:?}"
    );
    assert!(
        sidecar.0.id() > 0 && Path::new(&format!("/proc/{}", sidecar.0.id())).exists(),
        "the sidecar was still running when it was probed"
    );
}
