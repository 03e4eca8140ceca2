//! The mounted supervision files: the token (`token`: the Pod's ServiceAccount token in Kubernetes, the route's
//! bootstrap token locally; a secret: never logged, never
//! in `Debug`) and the gateway's trust bundle (`trust.jwks`). Both are re-read when they change
//! (a Kubernetes Secret mount swaps them atomically); the bundle also on an unknown `kid`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use proto::trust::{MAX_TOKEN_BYTES, TOKEN_FILE, TRUST_BUNDLE_FILE, TrustBundle};
use tonic::metadata::{Ascii, MetadataValue};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the token in {0} is empty, larger than {MAX_TOKEN_BYTES} bytes or not ASCII")]
    BadToken(String),
    #[error(transparent)]
    Bundle(#[from] proto::trust::Error),
}

/// A bearer token (the mounted one, or the instance token a registration issued).
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The `authorization` metadata value.
    pub fn bearer(&self) -> Result<MetadataValue<Ascii>, Error> {
        let mut value =
            MetadataValue::try_from(proto::bearer_value(&self.0)).map_err(|_| Error::BadToken("(token)".into()))?;
        value.set_sensitive(true);
        Ok(value)
    }
}

/// Reads the mounted token from `dir/token` (bounded, surrounding whitespace trimmed).
pub fn read_token(dir: &Path) -> Result<Token, Error> {
    let path = dir.join(TOKEN_FILE);
    let read_error = |source| Error::Read {
        path: path.display().to_string(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .map_err(read_error)?
        .take(MAX_TOKEN_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    let text = String::from_utf8(bytes).unwrap_or_default();
    let token = text.trim();
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::BadToken(path.display().to_string()));
    }
    Ok(Token(token.to_owned()))
}

/// The trust bundle, cached and reloaded when the file's modification time changes.
#[derive(Debug)]
pub struct Trust {
    path: PathBuf,
    cached: Option<(Option<SystemTime>, TrustBundle)>,
}

impl Trust {
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join(TRUST_BUNDLE_FILE),
            cached: None,
        }
    }

    /// The current bundle; `reload` forces a fresh read (after an unknown `kid`).
    pub fn bundle(&mut self, reload: bool) -> Result<TrustBundle, Error> {
        let modified = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if let Some((seen, bundle)) = &self.cached
            && !reload
            && *seen == modified
            && modified.is_some()
        {
            return Ok(bundle.clone());
        }
        let bundle = TrustBundle::load(&self.path)?;
        self.cached = Some((modified, bundle.clone()));
        Ok(bundle)
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
        std::fs::write(dir.path().join(TOKEN_FILE), "a".repeat(MAX_TOKEN_BYTES + 1)).unwrap();
        assert!(matches!(read_token(dir.path()), Err(Error::BadToken(_))));
        std::fs::remove_file(dir.path().join(TOKEN_FILE)).unwrap();
        assert!(matches!(read_token(dir.path()), Err(Error::Read { .. })));
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
