//! SQLite: the database file and its `-wal`/`-shm` companions are readable by the owner only
//! (0600), in a directory only the owner can enter (0700). Created so when missing; an
//! existing directory or file is tightened. SQLite gives its companions the mode of the
//! database file, which exists (empty is a valid new database) before SQLite opens it.

use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode of the directory holding a database or a secret file.
pub const PRIVATE_DIR: u32 = 0o700;
/// Mode of a database file or a secret file.
pub const PRIVATE_FILE: u32 = 0o600;

/// The database file an `sqlite:` URL names; `None` for an in-memory database or another
/// backend.
pub fn sqlite_path(url: &str) -> Option<PathBuf> {
    let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let path = path.split('?').next().filter(|p| !p.is_empty() && *p != ":memory:")?;
    Some(PathBuf::from(path))
}

/// Create `dir` (and missing parents) with mode 0700, or tighten it to 0700. Blocking.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(PRIVATE_DIR).create(dir)?;
    std::fs::set_permissions(dir, Permissions::from_mode(PRIVATE_DIR))
}

/// Secure the SQLite database at `path`: its directory 0700, the file (created empty when
/// missing) and any `-wal`, `-shm` or `-journal` companion 0600. Blocking.
pub fn secure_sqlite(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    private_dir(dir)?;
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(PRIVATE_FILE)
        .open(path)?;
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        match std::fs::set_permissions(&name, Permissions::from_mode(PRIVATE_FILE)) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            other => other?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn existing_files_and_directories_are_tightened() {
        let root = std::env::temp_dir().join(format!("files-{}", uuid::Uuid::new_v4().simple()));
        let dir = root.join("data");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, Permissions::from_mode(0o755)).unwrap();
        let db = dir.join("gateway.db");
        for name in ["gateway.db-wal", "gateway.db-shm"] {
            std::fs::write(dir.join(name), b"").unwrap();
            std::fs::set_permissions(dir.join(name), Permissions::from_mode(0o644)).unwrap();
        }
        secure_sqlite(&db).unwrap();
        assert_eq!(mode(&dir), 0o700);
        for name in ["gateway.db", "gateway.db-wal", "gateway.db-shm"] {
            assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
        }
        assert_eq!(sqlite_path("sqlite:///a/b.db?mode=rwc"), Some(PathBuf::from("/a/b.db")));
        assert_eq!(sqlite_path("sqlite::memory:"), None);
        assert_eq!(sqlite_path("postgres://h/db"), None);
        std::fs::remove_dir_all(root).unwrap();
    }
}
