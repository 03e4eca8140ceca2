//! What the binaries run, so that each `main` only parses its arguments: one module a binary,
//! each with its clap `Args` and a `run`.

pub mod local_pool;
pub mod scenarios;

use std::path::Path;

/// Writes `value` as pretty JSON to `path`, when one was given, and says so on stderr.
pub fn write_json(path: Option<&Path>, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
