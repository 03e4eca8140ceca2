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
    fn a_failed_replacement_leaves_the_target_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory as the target: the rename over it fails (for root too).
        let target = dir.path().join("state.json");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("kept"), b"one").unwrap();
        assert!(write_atomic(dir.path(), "state.json", b"two", 0o644).is_err());
        assert_eq!(
            fs::read(target.join("kept")).unwrap(),
            b"one",
            "the target is untouched"
        );
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"], "no temporary file is left");
    }
}
