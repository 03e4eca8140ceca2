//! The other binaries of the workspace the pool runs: where they are, built when run through
//! cargo.

use super::*;

/// Where the project's binaries are: beside the running executable (or the
/// directory above, for test executables in `deps/`), or `OPENSHELL_BIN_DIR`.
pub fn binary_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("OPENSHELL_BIN_DIR") {
        return dir.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.parent().map(Path::to_path_buf).unwrap_or(dir)
    } else {
        dir
    }
}

/// When launched through cargo (`cargo run -p e2e --bin …`), build the
/// other binaries the pool runs with the same profile first: cargo builds
/// only the binary it runs.
pub fn ensure_binaries() -> Result<(), Error> {
    let Ok(cargo) = std::env::var("CARGO") else {
        return Ok(());
    };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut command = std::process::Command::new(cargo);
    command.current_dir(&workspace).args(["build", "--bins"]);
    // What `cargo run` set for this binary is not the user's environment: build scripts that
    // watch such a variable (ring's watches `CARGO_MANIFEST_DIR`) would see it changed and
    // rebuild everything above them, a second full build on a fresh clone.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_run) {
            command.env_remove(&name);
        }
    }
    // Someone at a terminal sees the build go (a first run builds for minutes); tests and logs
    // get no progress lines.
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("building the pool's binaries (gateway, supervisor, sidecar, poolctl, webhook) ...");
    } else {
        command.arg("--quiet");
    }
    command.args([
        "-p",
        "gateway",
        "-p",
        "poolctl",
        "-p",
        "supervisor",
        "-p",
        "sidecar",
        "-p",
        "e2e",
    ]);
    command.args(["-p", "webhook"]);
    if binary_dir().ends_with("release") {
        command.arg("--release");
    }
    let status = command.status().map_err(|source| Error::Io {
        path: "cargo build".into(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::MissingBinary(format!("cargo build failed ({status})")))
    }
}

/// Whether `cargo run` sets the variable `name` for the binary it runs (the Cargo book,
/// "Environment variables Cargo sets for crates"); `CARGO` itself names the cargo to run.
fn set_by_cargo_run(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}

pub(super) fn binary(name: &str) -> Result<PathBuf, Error> {
    let path = binary_dir().join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::MissingBinary(path.display().to_string()))
    }
}
