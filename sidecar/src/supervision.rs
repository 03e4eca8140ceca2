//! The mounted supervision files: the token (`token`: the Pod's ServiceAccount token in Kubernetes, the route's
//! bootstrap token locally; a secret: never logged, never
//! in `Debug`) and the gateway's trust bundle (`trust.jwks`). Both are re-read when they change
//! (a Kubernetes Secret mount swaps them atomically); the bundle also on an unknown `kid`.

use std::path::Path;
use std::sync::Arc;

use plumbing::bundle::BundleFile;

use proto::trust::{TOKEN_FILE, TRUST_BUNDLE_FILE, TrustBundle};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Token(#[from] plumbing::token::TokenError),
    #[error(transparent)]
    Bundle(#[from] proto::trust::Error),
}

/// A bearer token (the mounted one, or the instance token a registration issued).
pub use plumbing::token::Token;

/// Reads the mounted token from `dir/token` (bounded, surrounding whitespace trimmed). A few
/// bytes from a local mount, read where the engine decides (no await in between).
pub fn read_token(dir: &Path) -> Result<Token, Error> {
    Ok(plumbing::token::read_blocking(&dir.join(TOKEN_FILE))?)
}

/// The trust bundle, cached and read again when the file changes
/// ([`plumbing::bundle::BundleFile`]).
#[derive(Debug)]
pub struct Trust(BundleFile);

impl Trust {
    pub fn new(dir: &Path) -> Self {
        Self(BundleFile::new(dir.join(TRUST_BUNDLE_FILE)))
    }

    /// The current bundle; `reload` forces a fresh read (after an unknown `kid`).
    pub fn bundle(&mut self, reload: bool) -> Result<Arc<TrustBundle>, Error> {
        Ok(self.0.load_blocking(reload)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_trimmed_bounded_and_redacted() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TOKEN_FILE), "  s3cret.token \n").unwrap();
        let token = read_token(dir.path()).unwrap();
        assert_eq!(token.expose(), "s3cret.token");
        assert!(!format!("{token:?}").contains("s3cret"));
        std::fs::write(
            dir.path().join(TOKEN_FILE),
            "a".repeat(plumbing::token::MAX_TOKEN_BYTES + 1),
        )
        .unwrap();
        assert!(matches!(
            read_token(dir.path()),
            Err(Error::Token(plumbing::token::TokenError::Content { .. }))
        ));
        std::fs::remove_file(dir.path().join(TOKEN_FILE)).unwrap();
        assert!(matches!(
            read_token(dir.path()),
            Err(Error::Token(plumbing::token::TokenError::Read { .. }))
        ));
    }

    #[test]
    fn bundle_reloads_when_the_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let key = |seed| ed25519_dalek::SigningKey::from_bytes(&[seed; 32]).verifying_key();
        let mut bundle = TrustBundle::new("iss");
        bundle.keys.insert("k1".into(), key(1));
        let path = dir.path().join(TRUST_BUNDLE_FILE);
        std::fs::write(&path, bundle.to_jwks()).unwrap();
        let mut trust = Trust::new(dir.path());
        assert!(trust.bundle(false).unwrap().keys.contains_key("k1"));
        bundle.keys.insert("k2".into(), key(2));
        std::fs::write(&path, bundle.to_jwks()).unwrap();
        // Forced reload sees the new key even if the mtime did not tick.
        assert!(trust.bundle(true).unwrap().keys.contains_key("k2"));
        std::fs::write(&path, "not json").unwrap();
        assert!(trust.bundle(true).is_err());
    }
}
