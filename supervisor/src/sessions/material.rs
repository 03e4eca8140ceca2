//! The secrets a session holds, each with a redacted `Debug` and no `Display`: the instance's
//! launch material ([`Credentials`], `host.v1.OwnedInstance.credentials`) and a recovery
//! grant ([`Grant`]).

use std::fmt;

/// Launch material of one instance (`OwnedInstance.credentials`).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials(Vec<u8>);

impl Credentials {
    /// `None` for empty material ("keep what you hold").
    pub fn from_wire(bytes: &[u8]) -> Option<Self> {
        (!bytes.is_empty()).then(|| Self(bytes.to_vec()))
    }

    /// The material, for the session only.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials(<redacted, {} bytes>)", self.0.len())
    }
}

/// A single-use recovery grant (compact JWS) and what the member knows about it.
#[derive(Clone, PartialEq, Eq)]
pub struct Grant {
    pub token: String,
    /// The grant's jti when IssueGrant told it (snapshot grants: unknown).
    pub id: Option<String>,
    /// Unix ms; 0 when unknown.
    pub expires_at_ms: i64,
}

impl Grant {
    /// The grant a snapshot carries (`OwnedInstance.grant`), if any and not oversized.
    pub fn from_snapshot(token: &str, expires_at_ms: i64) -> Option<Self> {
        (!token.is_empty() && token.len() <= proto::trust::MAX_TOKEN_BYTES).then(|| Self {
            token: token.to_owned(),
            id: None,
            expires_at_ms,
        })
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Grant(<redacted>, id: {:?}, expires_at_ms: {})",
            self.id, self.expires_at_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn material_and_grants_are_redacted() {
        let material = Credentials::from_wire(b"launch-material-s3cret").unwrap();
        assert!(!format!("{material:?}").contains("s3cret"));
        assert!(Credentials::from_wire(b"").is_none(), "empty means keep what you hold");
        let grant = Grant::from_snapshot("header.claims.signature", 5).unwrap();
        assert!(!format!("{grant:?}").contains("claims"));
        assert!(Grant::from_snapshot("", 0).is_none());
    }
}
