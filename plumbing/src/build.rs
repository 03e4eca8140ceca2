//! Which build a binary is: the release (the workspace's semantic version) and, for a build
//! made by the image scripts, the commit it was made from (`OPENSHELL_BUILD_COMMIT`
//! at compile time). Every binary's `--version`, a member's `build_version` in its hello, the
//! webhook's `injected` annotation and the sidecar's registration say [`version`].

use std::sync::LazyLock;

/// The release: the workspace's version (`Cargo.toml`, `[workspace.package]`).
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// The commit the build was made from, when the build said so (`OPENSHELL_BUILD_COMMIT`;
/// `scripts/test-cluster`'s release build and `scripts/build-images.sh` through the Dockerfile
/// set it). A developer build has none.
pub const COMMIT: Option<&str> = option_env!("OPENSHELL_BUILD_COMMIT");

static VERSION: LazyLock<String> = LazyLock::new(|| version_of(RELEASE, COMMIT));

/// `RELEASE`, or `RELEASE+COMMIT` (semantic-versioning build metadata) when the commit is
/// known: `0.2.0+3f1c2ab9e0d4`.
pub fn version() -> &'static str {
    VERSION.as_str()
}

fn version_of(release: &str, commit: Option<&str>) -> String {
    // Build metadata is [0-9A-Za-z-] only; anything else in the variable is dropped.
    let commit: String = commit
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(40)
        .collect();
    if commit.is_empty() {
        release.to_owned()
    } else {
        format!("{release}+{commit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_with_and_without_its_commit() {
        assert_eq!(version_of("0.2.0", None), "0.2.0");
        assert_eq!(version_of("0.2.0", Some("")), "0.2.0");
        assert_eq!(version_of("0.2.0", Some("3f1c2ab9e0d4")), "0.2.0+3f1c2ab9e0d4");
        assert_eq!(version_of("0.2.0", Some("3f1c 2ab\n")), "0.2.0+3f1c2ab");
        assert!(version().starts_with(RELEASE));
    }
}
