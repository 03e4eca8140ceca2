//! The gateway's trust bundle file (`trust.jwks`), cached and read again when it changes: one
//! cache for the sidecar and the supervisor. A change is a new modification time or size (a
//! Kubernetes Secret mount swaps the file atomically; a rewrite within the clock's resolution
//! still changes the size, or is caught by a forced reload on an unknown `kid`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use proto::trust::{self, TrustBundle};

/// What identifies one version of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: SystemTime,
    len: u64,
}

impl Stamp {
    /// `None` where the file system keeps no modification time: never cached then.
    fn of(metadata: &std::fs::Metadata) -> Option<Self> {
        Some(Self {
            modified: metadata.modified().ok()?,
            len: metadata.len(),
        })
    }
}

/// A trust bundle file and the version of it last read.
#[derive(Debug)]
pub struct BundleFile {
    path: PathBuf,
    cached: Option<(Stamp, Arc<TrustBundle>)>,
}

impl BundleFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            cached: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bundle: the cached one while the file is unchanged, else read again (bounded,
    /// [`TrustBundle::load`]). `reload` forces a read (after an unknown `kid`). A failed read
    /// keeps nothing.
    pub async fn load(&mut self, reload: bool) -> Result<Arc<TrustBundle>, trust::Error> {
        let stamp = tokio::fs::metadata(&self.path).await.map_err(|e| self.read_error(e))?;
        let stamp = Stamp::of(&stamp);
        if let Some(bundle) = self.cached_for(stamp, reload) {
            return Ok(bundle);
        }
        let path = self.path.clone();
        let bundle = tokio::task::spawn_blocking(move || TrustBundle::load(&path))
            .await
            .map_err(|e| self.read_error(std::io::Error::other(e)))??;
        Ok(self.keep(stamp, bundle))
    }

    /// [`load`](Self::load) for code off the async runtime, or where a blocking read of a
    /// small local file is the documented choice.
    pub fn load_blocking(&mut self, reload: bool) -> Result<Arc<TrustBundle>, trust::Error> {
        let stamp = std::fs::metadata(&self.path).map_err(|e| self.read_error(e))?;
        let stamp = Stamp::of(&stamp);
        if let Some(bundle) = self.cached_for(stamp, reload) {
            return Ok(bundle);
        }
        let bundle = TrustBundle::load(&self.path)?;
        Ok(self.keep(stamp, bundle))
    }

    fn cached_for(&self, stamp: Option<Stamp>, reload: bool) -> Option<Arc<TrustBundle>> {
        match &self.cached {
            Some((seen, bundle)) if !reload && Some(*seen) == stamp => Some(Arc::clone(bundle)),
            _ => None,
        }
    }

    fn keep(&mut self, stamp: Option<Stamp>, bundle: TrustBundle) -> Arc<TrustBundle> {
        let bundle = Arc::new(bundle);
        self.cached = stamp.map(|stamp| (stamp, Arc::clone(&bundle)));
        bundle
    }

    fn read_error(&self, source: std::io::Error) -> trust::Error {
        trust::Error::Read {
            path: self.path.display().to_string(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle_with(kids: &[&str]) -> TrustBundle {
        let mut bundle = TrustBundle::new("iss");
        for (seed, kid) in kids.iter().enumerate() {
            let seed = u8::try_from(seed).unwrap_or(0) + 1;
            bundle.keys.insert(
                (*kid).into(),
                ed25519_dalek::SigningKey::from_bytes(&[seed; 32]).verifying_key(),
            );
        }
        bundle
    }

    #[tokio::test]
    async fn the_bundle_is_read_again_when_the_file_changes() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(proto::trust::TRUST_BUNDLE_FILE);
        std::fs::write(&path, bundle_with(&["k1"]).to_jwks())?;
        let mut file = BundleFile::new(&path);
        let mut blocking = BundleFile::new(&path);
        assert!(file.load(false).await?.keys.contains_key("k1"));
        assert!(blocking.load_blocking(false)?.keys.contains_key("k1"));

        // A second key makes the file longer: seen even if the modification time did not tick.
        std::fs::write(&path, bundle_with(&["k1", "k2"]).to_jwks())?;
        assert!(file.load(false).await?.keys.contains_key("k2"));
        assert!(blocking.load_blocking(false)?.keys.contains_key("k2"));

        std::fs::write(&path, "not json")?;
        assert!(file.load(true).await.is_err());
        assert!(blocking.load_blocking(true).is_err());
        std::fs::remove_file(&path)?;
        assert!(matches!(file.load(false).await, Err(trust::Error::Read { .. })));
        assert!(matches!(blocking.load_blocking(false), Err(trust::Error::Read { .. })));
        Ok(())
    }
}
