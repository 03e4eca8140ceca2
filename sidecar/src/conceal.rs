//! Nothing of the sidecar is reachable from the workload's processes.
//!
//! The sidecar shares the Pod's PID namespace with the workload (it has to: it identifies and
//! stops the workload through `/proc`) and, under the restricted Pod Security Standard, its
//! UID. A process of the same UID may read another one's `/proc/<pid>/{environ,mem,fd,root,
//! cwd,maps}` — and through `root` the sidecar's token and fence files — unless that process
//! is **not dumpable**: the kernel then requires `CAP_SYS_PTRACE` for every such access (and
//! for `ptrace` and `process_vm_readv`), which no container of a baseline or restricted Pod
//! has and which the webhook refuses to a workload container.
//!
//! Two layers make the sidecar non-dumpable:
//! - its image installs the binary execute-only (mode 0111, owned by root): the kernel makes a
//!   process that executes a file it cannot read non-dumpable from `execve` on, so there is no
//!   window between the start and [`seal`];
//! - [`seal`] clears the flag explicitly as the first thing `main` does (for a binary that is
//!   readable, as in a local pool), and checks that it holds.
//!
//! Nothing here helps against a process that has `CAP_SYS_PTRACE` or is privileged: that is
//! why the webhook refuses such workload containers (`webhook/README.md`).

use nix::sys::prctl;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot make the sidecar non-dumpable: {0}")]
    Prctl(#[from] nix::Error),
    #[error("the sidecar is still dumpable after PR_SET_DUMPABLE 0")]
    StillDumpable,
}

/// Makes this process non-dumpable (no core dumps; its `/proc` entries, memory and root are
/// closed to processes without `CAP_SYS_PTRACE`, whatever their UID) and checks it.
pub fn seal() -> Result<(), Error> {
    prctl::set_dumpable(false)?;
    if prctl::get_dumpable()? {
        return Err(Error::StillDumpable);
    }
    Ok(())
}

/// Whether this process was non-dumpable from `execve` on: its executable is not readable to
/// it (the images install it execute-only). When it is readable (a local pool, an image built
/// otherwise) there is a window of microseconds between the start and [`seal`].
pub fn sealed_from_exec() -> bool {
    matches!(
        std::fs::File::open("/proc/self/exe"),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied
    )
}
