//! The workload process as the kernel knows it: PID (from the peer credentials of its socket
//! connection, or from spawning it), start time (field 22 of `/proc/<pid>/stat`) and the
//! SHA-256 of its executable (`/proc/<pid>/exe`). Never what the workload claims.

use std::io::Read;

use proto::common::v1::WorkloadIdentity;
use sha2::{Digest, Sha256};

/// Longest ancestry walked when checking that a process descends from the workload.
const MAX_ANCESTRY: usize = 64;
/// Largest `/proc/<pid>/stat` read.
const MAX_STAT_BYTES: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read /proc/{pid}: {source}")]
    Proc {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("/proc/{0}/stat is malformed")]
    Malformed(u32),
    #[error("process {0} changed while it was observed (exited or PID reused)")]
    Changed(u32),
}

/// `/proc/<pid>/stat` reports start times in these (`USER_HZ`, 100 on Linux whatever the
/// kernel's own tick).
const USER_HZ: f64 = 100.0;
/// How often [`wait_for_new_process`] looks.
const NEW_PROCESS_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Now, in the clock ticks since boot that `/proc/<pid>/stat` field 22 counts in.
pub async fn ticks_since_boot() -> u64 {
    let uptime = tokio::fs::read_to_string("/proc/uptime").await.unwrap_or_default();
    let seconds: f64 = uptime
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    (seconds * USER_HZ) as u64
}

/// Every process of the PID namespace but this one and PID 1, with its stat.
async fn processes() -> Vec<(u32, Stat)> {
    let own = std::process::id();
    let mut found = Vec::new();
    let Ok(mut dir) = tokio::fs::read_dir("/proc").await else {
        return found;
    };
    while let Ok(Some(entry)) = dir.next_entry().await {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == own || pid == 1 {
            continue;
        }
        let stat = tokio::fs::read_to_string(entry.path().join("stat")).await;
        if let Some(stat) = stat.ok().and_then(|text| parse_stat(&text)) {
            found.push((pid, stat));
        }
    }
    found
}

/// Wait until a process other than this one, started after `since` (ticks since boot),
/// runs in the PID namespace — the workload's container started again — and say `true`;
/// `false` once `shutdown` is cancelled first.
pub async fn wait_for_new_process(since: u64, shutdown: &tokio_util::sync::CancellationToken) -> bool {
    loop {
        let started = processes().await;
        if started.iter().any(|(_, s)| s.start_time_ticks > since && !s.is_gone()) {
            return true;
        }
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(NEW_PROCESS_POLL) => {}
        }
    }
}

/// The main processes of the Pod's containers other than this one, in a shared PID
/// namespace: running processes whose parent is outside the namespace (`ppid` 0), not PID 1
/// (the Pod's pause process) and with an executable this process may read (not a kernel
/// thread, not another UID's). A workload container's main process is the one such process
/// when there is exactly one.
pub async fn container_main_processes() -> Vec<u32> {
    let mut found = Vec::new();
    for (pid, stat) in processes().await {
        if main_process(&stat) && tokio::fs::read_link(format!("/proc/{pid}/exe")).await.is_ok() {
            found.push(pid);
        }
    }
    found.sort_unstable();
    found
}

/// See [`container_main_processes`] (PID 1 and this process are never among them).
fn main_process(stat: &Stat) -> bool {
    stat.ppid == 0 && !stat.is_gone()
}

/// The fields of `/proc/<pid>/stat` the sidecar uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// Field 3: R, S, D, Z, T, X, ...
    pub state: char,
    /// Field 4.
    pub ppid: u32,
    /// Field 22: start time in clock ticks since boot.
    pub start_time_ticks: u64,
}

impl Stat {
    pub fn is_gone(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses a stat line. The comm field (2) is in parentheses and may itself contain spaces and
/// parentheses, so fields are counted after the LAST ')'.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3.
    let state = fields.first()?.chars().next()?;
    let ppid = fields.get(1)?.parse().ok()?;
    let start_time_ticks = fields.get(19)?.parse().ok()?;
    Some(Stat {
        state,
        ppid,
        start_time_ticks,
    })
}

pub fn read_stat(pid: u32) -> Result<Stat, Error> {
    let proc_error = |source| Error::Proc { pid, source };
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/stat"))
        .map_err(proc_error)?
        .take(MAX_STAT_BYTES)
        .read_to_string(&mut text)
        .map_err(proc_error)?;
    parse_stat(&text).ok_or(Error::Malformed(pid))
}

/// Observes process `pid` (blocking: hashes its executable).
pub fn observe(pid: u32) -> Result<WorkloadIdentity, Error> {
    let before = read_stat(pid)?;
    let mut exe = std::fs::File::open(format!("/proc/{pid}/exe")).map_err(|source| Error::Proc { pid, source })?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut exe, &mut hasher).map_err(|source| Error::Proc { pid, source })?;
    let after = read_stat(pid)?;
    if before.start_time_ticks != after.start_time_ticks || after.is_gone() {
        return Err(Error::Changed(pid));
    }
    Ok(WorkloadIdentity {
        pid,
        start_time_ticks: before.start_time_ticks,
        exe_digest: hasher.finalize().to_vec(),
    })
}

/// True while the process `identity` names still runs (same PID and start time, not a zombie).
pub fn is_running(identity: &WorkloadIdentity) -> bool {
    identity.pid != 0
        && read_stat(identity.pid).is_ok_and(|s| s.start_time_ticks == identity.start_time_ticks && !s.is_gone())
}

/// True when `pid` is `ancestor` or one of its descendants.
pub fn descends_from(pid: u32, ancestor: u32) -> bool {
    let mut current = pid;
    for _ in 0..MAX_ANCESTRY {
        if current == ancestor {
            return true;
        }
        match read_stat(current) {
            Ok(stat) if stat.ppid > 1 => current = stat.ppid,
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_main_process_has_its_parent_outside_the_namespace() {
        let stat = |ppid, state| Stat {
            state,
            ppid,
            start_time_ticks: 1,
        };
        assert!(main_process(&stat(0, 'S')));
        assert!(!main_process(&stat(42, 'S')), "a child of a main process");
        assert!(!main_process(&stat(0, 'Z')), "ended");
    }

    #[tokio::test]
    async fn a_process_started_after_the_end_is_found_and_none_before_is() {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let since = ticks_since_boot().await;
        // Ticks are 10 ms: the child must start in a later one.
        while ticks_since_boot().await <= since {
            tokio::task::yield_now().await;
        }
        let mut child = tokio::process::Command::new("sleep")
            .arg("5")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let found = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            wait_for_new_process(since, &shutdown),
        );
        assert_eq!(found.await, Ok(true));
        let _ = child.kill().await;
        // Nothing started after the end of time: waits until the shutdown.
        shutdown.cancel();
        assert!(!wait_for_new_process(u64::MAX, &shutdown).await);
    }

    #[test]
    fn stat_parsing_survives_hostile_comm_fields() {
        let tail = "S 17 42 42 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 1 0 987654 1000 50";
        for comm in ["sleep", "my prog", "a) S 1 2 (b", ")", "(("] {
            let line = format!("42 ({comm}) {tail}");
            let stat = parse_stat(&line).unwrap_or_else(|| panic!("{comm}"));
            assert_eq!(
                stat,
                Stat {
                    state: 'S',
                    ppid: 17,
                    start_time_ticks: 987_654
                },
                "{comm}"
            );
        }
        assert_eq!(parse_stat("42 (x) S 1"), None);
        assert_eq!(parse_stat("no parens at all"), None);
        assert_eq!(parse_stat(&format!("42 (x) {}", tail.replace("987654", "-5"))), None);
    }

    #[test]
    fn observes_this_process_and_its_ancestry() {
        let pid = std::process::id();
        let me = observe(pid).unwrap();
        assert_eq!(me.pid, pid);
        assert_eq!(me.exe_digest.len(), 32);
        assert!(me.start_time_ticks > 0);
        assert!(is_running(&me));
        let reused = WorkloadIdentity {
            start_time_ticks: me.start_time_ticks + 1,
            ..me.clone()
        };
        assert!(!is_running(&reused), "a different start time is another process");
        assert!(descends_from(pid, pid));
        let parent = read_stat(pid).unwrap().ppid;
        if parent > 1 {
            assert!(descends_from(pid, parent));
            assert!(!descends_from(parent, pid));
        }
    }

    #[test]
    fn exited_children_are_not_running() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let gone = WorkloadIdentity {
            pid,
            start_time_ticks: 1,
            exe_digest: vec![],
        };
        assert!(!is_running(&gone));
        assert!(observe(pid).is_err());
    }
}
