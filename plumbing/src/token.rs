//! The bearer token every client of the gateway presents: one bounded reader (async, and a
//! blocking twin for code off the runtime), one redacted type and one `authorization` header.
//! A token is a secret: no `Display`, a redacted `Debug`, errors that never quote it, and a
//! header value marked sensitive.

use std::fmt;
use std::io::Read as _;
use std::path::Path;

use tonic::metadata::{Ascii, MetadataValue};

/// Largest token accepted, in bytes (after trimming): the verifiers' bound.
pub const MAX_TOKEN_BYTES: usize = proto::trust::MAX_TOKEN_BYTES;

/// A bearer token (a compact JWT). A secret: no `Display`, redacted `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the token file {path} is {problem}")]
    Content { path: String, problem: &'static str },
    #[error("the token is not valid `authorization` metadata")]
    Header,
}

impl Token {
    /// A token received over an authenticated channel (e.g. an instance token); checked when
    /// it is made a header.
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// A token from file content: surrounding whitespace trimmed, non-empty, at most
    /// [`MAX_TOKEN_BYTES`] of printable ASCII. The error names the problem, never the content.
    pub fn parse(text: &[u8]) -> Result<Self, &'static str> {
        if text.len() > MAX_TOKEN_BYTES + TRIM_ALLOWANCE {
            return Err("larger than the 8 KiB a token may be");
        }
        let text = std::str::from_utf8(text).map_err(|_| "not UTF-8")?;
        let token = text.trim();
        if token.is_empty() {
            return Err("empty");
        }
        if token.len() > MAX_TOKEN_BYTES {
            return Err("larger than the 8 KiB a token may be");
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("not a single printable ASCII token");
        }
        Ok(Self(token.to_owned()))
    }

    /// The token text, for the `authorization` metadata only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The `authorization: Bearer <token>` value, marked sensitive (never logged by tonic).
    pub fn bearer(&self) -> Result<MetadataValue<Ascii>, TokenError> {
        let mut value = MetadataValue::try_from(proto::bearer_value(&self.0)).map_err(|_| TokenError::Header)?;
        value.set_sensitive(true);
        Ok(value)
    }

    /// Puts the bearer header on `request`.
    pub fn authorize<T>(&self, request: &mut tonic::Request<T>) -> Result<(), TokenError> {
        request
            .metadata_mut()
            .insert(proto::AUTHORIZATION_METADATA_KEY, self.bearer()?);
        Ok(())
    }
}

/// Whitespace a token file may carry around the token (a trailing newline, indentation).
const TRIM_ALLOWANCE: usize = 1024;

/// Most bytes read from a token file: anything longer is refused unread.
const READ_LIMIT: u64 = (MAX_TOKEN_BYTES + TRIM_ALLOWANCE + 1) as u64;

/// Reads a token file (bounded; see [`Token::parse`]).
pub async fn read(path: &Path) -> Result<Token, TokenError> {
    use tokio::io::AsyncReadExt as _;
    let read = async {
        let mut bytes = Vec::new();
        tokio::fs::File::open(path)
            .await?
            .take(READ_LIMIT)
            .read_to_end(&mut bytes)
            .await?;
        Ok(bytes)
    };
    checked(path, read.await)
}

/// [`read`] for code that runs off the async runtime (or on a tiny local file between
/// awaits where a blocking read is the documented choice).
pub fn read_blocking(path: &Path) -> Result<Token, TokenError> {
    let read = || {
        let mut bytes = Vec::new();
        std::fs::File::open(path)?.take(READ_LIMIT).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    checked(path, read())
}

fn checked(path: &Path, bytes: std::io::Result<Vec<u8>>) -> Result<Token, TokenError> {
    let shown = || path.display().to_string();
    let bytes = bytes.map_err(|source| TokenError::Read { path: shown(), source })?;
    Token::parse(&bytes).map_err(|problem| TokenError::Content { path: shown(), problem })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tokens_are_trimmed_bounded_and_never_shown() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("token");
        std::fs::write(&path, "  header.claims.signature \n")?;
        let token = read(&path).await?;
        assert_eq!(token.expose(), "header.claims.signature");
        assert_eq!(read_blocking(&path)?, token);
        assert!(!format!("{token:?}").contains("claims"));
        let bearer = token.bearer()?;
        assert!(bearer.is_sensitive());
        assert_eq!(bearer.to_str()?, "Bearer header.claims.signature");

        for (content, problem) in [
            ("secret part\n".to_owned(), "printable"),
            (" \n".to_owned(), "empty"),
            ("a".repeat(MAX_TOKEN_BYTES + 1), "8 KiB"),
            ("a".repeat(64 * 1024), "8 KiB"),
        ] {
            std::fs::write(&path, &content)?;
            for err in [read(&path).await, read_blocking(&path)].map(|r| r.map(|_| ()).unwrap_err().to_string()) {
                assert!(err.contains(problem) && !err.contains("secret"), "{err}");
            }
        }
        std::fs::write(&path, "a".repeat(MAX_TOKEN_BYTES))?;
        assert!(read(&path).await.is_ok(), "the bound itself is accepted");
        let missing = dir.path().join("missing");
        assert!(matches!(read(&missing).await, Err(TokenError::Read { .. })));
        assert!(matches!(read_blocking(&missing), Err(TokenError::Read { .. })));
        Ok(())
    }
}
