//! `probe sidecar`: run inside a workload container (`kubectl exec … -c <app> -- probe
//! sidecar`), it finds its Pod's sidecar in the shared PID namespace and tries every path to
//! the sidecar's token, fence state, environment and memory: the `/proc/<pid>` entries, the
//! sidecar's root through `/proc/<pid>/root` and `/proc/<pid>/task/*/root`, `ptrace` and
//! `process_vm_readv`, and the injected directories in its own container. One line per
//! attempt, `probe path=<what> result=<refused|absent|reached> detail=<…>`; then the same
//! read of a plain process of the Pod (the agent) as the control,
//! `probe control=<comm> environ=<reached|refused>`, so that the cluster test can tell that a
//! refusal comes from the sidecar and not from the probe's own limits. Exits 0 once every
//! attempt was made.

use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

use nix::sys::ptrace;
use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The sidecar's process name (`comm`).
    #[arg(long, default_value = "sidecar")]
    comm: String,
    /// A plain process of the Pod whose environment is read as the control.
    #[arg(long, default_value = "agent")]
    control: String,
    /// Where the sidecar mounts the token volume.
    #[arg(long, default_value = "/var/run/openshell/supervision")]
    supervision_dir: PathBuf,
    /// Where the sidecar keeps its state (`fence.json`).
    #[arg(long, default_value = "/var/run/openshell/sidecar-state")]
    state_dir: PathBuf,
}

/// What one attempt found.
enum Found {
    /// The kernel refused the access (EACCES / EPERM).
    Refused(String),
    /// Nothing there (a path of the probe's own container).
    Absent,
    /// The access was granted.
    Reached(String),
}

fn report(path: &str, found: Found) {
    let (result, detail) = match found {
        Found::Refused(why) => ("refused", why),
        Found::Absent => ("absent", String::new()),
        Found::Reached(what) => ("reached", what),
    };
    println!("probe path={path} result={result} detail={detail}");
}

fn io(result: std::io::Result<String>, absent_is_refusal: bool) -> Found {
    match result {
        Ok(what) => Found::Reached(what),
        Err(e) if e.kind() == ErrorKind::PermissionDenied => Found::Refused(e.to_string()),
        Err(e) if e.kind() == ErrorKind::NotFound && absent_is_refusal => Found::Absent,
        // Any other answer (ENOENT below /proc/<pid>/root, EIO from mem) means the kernel
        // let the probe in.
        Err(e) => Found::Reached(format!("access granted, then: {e}")),
    }
}

fn read(path: &Path) -> std::io::Result<String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(4096).read_to_end(&mut bytes)?;
    Ok(format!("{} bytes", bytes.len()))
}

fn list(path: &Path) -> std::io::Result<String> {
    Ok(format!("{} entries", std::fs::read_dir(path)?.count()))
}

fn errno(e: nix::Error) -> Found {
    match e {
        nix::Error::EPERM | nix::Error::EACCES => Found::Refused(e.desc().to_owned()),
        other => Found::Reached(format!("access granted, then: {}", other.desc())),
    }
}

/// The processes of the PID namespace whose `comm` is `comm`.
fn processes(comm: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| stat.contains(&format!("({comm})")))
        })
        .collect()
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let sidecars = processes(&args.comm);
    anyhow::ensure!(
        !sidecars.is_empty(),
        "no process named {} in this PID namespace",
        args.comm
    );
    for pid in sidecars {
        println!("probe sidecar pid={pid}");
        attack(pid, args);
    }
    // The injected directories are not in the probe's own container.
    let token = args.supervision_dir.join(proto::trust::TOKEN_FILE);
    report("own:token", io(read(&token), true));
    report("own:fence", io(read(&args.state_dir.join("fence.json")), true));
    for pid in processes(&args.control) {
        let environ = match read(Path::new(&format!("/proc/{pid}/environ"))) {
            Ok(_) => "reached",
            Err(_) => "refused",
        };
        println!("probe control={} pid={pid} environ={environ}", args.control);
    }
    Ok(())
}

fn attack(pid: i32, args: &Args) {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let root = proc.join("root");
    let inside = |dir: &Path, file: &str| root.join(dir.strip_prefix("/").unwrap_or(dir)).join(file);
    report("environ", io(read(&proc.join("environ")), false));
    report("mem", io(read(&proc.join("mem")), false));
    report("maps", io(read(&proc.join("maps")), false));
    report("exe", io(read(&proc.join("exe")), false));
    report("root", io(list(&root), false));
    report(
        "root:token",
        io(read(&inside(&args.supervision_dir, proto::trust::TOKEN_FILE)), false),
    );
    report("root:fence", io(read(&inside(&args.state_dir, "fence.json")), false));
    report("cwd", io(list(&proc.join("cwd")), false));
    report("fd", io(list(&proc.join("fd")), false));
    report("map_files", io(list(&proc.join("map_files")), false));
    let tasks: Vec<PathBuf> = std::fs::read_dir(proc.join("task"))
        .map(|entries| entries.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    for task in &tasks {
        let name = format!("task:{}:root", task.file_name().and_then(|n| n.to_str()).unwrap_or("?"));
        report(&name, io(list(&task.join("root")), false));
    }
    let target = Pid::from_raw(pid);
    report(
        "ptrace",
        match ptrace::attach(target) {
            Ok(()) => {
                let _ = ptrace::detach(target, None);
                Found::Reached("attached".into())
            }
            Err(e) => errno(e),
        },
    );
    let mut byte = [0u8; 1];
    let remote = [RemoteIoVec { base: 0x1000, len: 1 }];
    report(
        "process_vm_readv",
        match process_vm_readv(target, &mut [std::io::IoSliceMut::new(&mut byte)], &remote) {
            Ok(n) => Found::Reached(format!("{n} bytes")),
            Err(e) => errno(e),
        },
    );
}
