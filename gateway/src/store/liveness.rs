//! Is a lease holder's process still alive? A coordinator that crashes stops
//! renewing, but waiting out its lease costs seconds. Its database
//! connections, though, close the instant it dies: on PostgreSQL every
//! connection of a gateway process carries the process's liveness key as its
//! `application_name`, so a standby sees at once when none is left; with
//! SQLite (one machine) every process holds an exclusive lock on a file named
//! after its key, which the kernel frees when it dies.
//!
//! This only lets a standby take over early. Safety stays with the term
//! fence: a holder judged dead that is in fact alive (say, cut off from the
//! database) is fenced out by the next term like any stale coordinator.

use std::path::{Path, PathBuf};

/// The liveness key of a holder id (`replica/key`): the part after the last
/// slash, unique per process.
pub fn key_of(holder: &str) -> &str {
    holder.rsplit('/').next().unwrap_or(holder)
}

/// A fresh liveness key for this process: 32 hex digits, short enough for
/// PostgreSQL's `application_name` (63 bytes) with its prefix.
pub fn new_key() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// PostgreSQL `application_name` of the connections of the process `key`.
pub fn application_name(key: &str) -> String {
    format!("openshell-gw-{key}")
}

/// SQLite: the directory of the liveness lock files beside the database file.
pub fn lock_dir(url: &str) -> Option<PathBuf> {
    let mut dir = super::files::sqlite_path(url)?.into_os_string();
    dir.push(".holders");
    Some(PathBuf::from(dir))
}

/// SQLite: this process's lock, held (open and locked) for as long as it lives.
#[derive(Debug)]
pub struct FileLock {
    _file: std::fs::File,
    path: PathBuf,
}

impl FileLock {
    pub fn take(dir: &Path, key: &str) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("{key}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)?;
        file.try_lock().map_err(std::io::Error::other)?;
        Ok(Self { _file: file, path })
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// SQLite: whether the process `key` still holds its lock. A lock file that
/// can be locked (or does not exist) belongs to a process that is gone.
pub fn file_holder_alive(dir: &Path, key: &str) -> bool {
    let path = dir.join(format!("{key}.lock"));
    let Ok(file) = std::fs::OpenOptions::new().write(true).open(&path) else {
        return false;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = std::fs::remove_file(&path);
            false
        }
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_paths() {
        assert_eq!(key_of("gateway-0/abc"), "abc");
        assert!(application_name(&new_key()).len() <= 63);
        assert_eq!(
            lock_dir("sqlite:///tmp/x/gw.db?mode=rwc"),
            Some(PathBuf::from("/tmp/x/gw.db.holders"))
        );
        assert_eq!(lock_dir("sqlite::memory:"), None);
    }

    #[test]
    fn a_released_lock_reads_as_a_dead_holder() {
        let dir = tempfile_dir();
        let lock = FileLock::take(&dir, "k1").unwrap();
        assert!(file_holder_alive(&dir, "k1"), "held by this open file description");
        drop(lock);
        assert!(!file_holder_alive(&dir, "k1"));
        assert!(!file_holder_alive(&dir, "never-existed"));
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("liveness-{}", new_key()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
