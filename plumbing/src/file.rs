//! Replacing a file atomically and durably: a private temporary file beside it (created with
//! the final mode, so its content is never more readable than that), written and fsynced,
//! renamed over the target, then the directory fsynced. A reader sees the old content or the
//! new, never a mix; after a crash the new content is there once this returned. A failed
//! write removes its temporary file.

use std::fs::{File, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Replace `dir/name` with `bytes`, the file having `mode`. Blocking: call it off the async
/// runtime (`spawn_blocking`).
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> io::Result<()> {
    let mut file = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(Permissions::from_mode(mode))
        .tempfile_in(dir)?;
    // The umask may have narrowed the mode at creation; never widened it.
    file.as_file().set_permissions(Permissions::from_mode(mode))?;
    file.write_all(bytes)?;
    file.as_file().sync_all()?;
    file.persist(dir.join(name)).map_err(|e| e.error)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn replaces_the_file_with_its_mode_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "state.json", b"one", 0o600).unwrap();
        write_atomic(dir.path(), "state.json", b"two", 0o600).unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_failed_replacement_keeps_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "state.json", b"one", 0o644).unwrap();
        // The target is now a directory: the rename fails.
        let blocked = dir.path().join("blocked");
        fs::create_dir(blocked.join("x").parent().unwrap()).unwrap();
        fs::write(blocked.join("x"), b"").unwrap();
        assert!(write_atomic(dir.path(), "blocked", b"two", 0o644).is_err());
        assert_eq!(fs::read(dir.path().join("state.json")).unwrap(), b"one");
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["blocked", "state.json"], "no temporary file is left");
    }
}
