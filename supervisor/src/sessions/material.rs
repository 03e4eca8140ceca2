//! The secrets a session holds, each with a redacted `Debug` and no `Display`: the instance's
//! launch material ([`Credentials`], `host.v1.OwnedInstance.credentials`), the workload
//! credential derived from it ([`WorkloadCredential`]) and a recovery grant ([`Grant`]).

use std::fmt;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use proto::common::v1::InstanceRef;
use proto::registration::Material;

/// Key of the workload's bearer token in the material's `credentials` map.
pub const TOKEN_KEY: &str = "token";
/// Expiry given to a credential whose own expiry is unknown (not a JWT): the workload fetches
/// it again after this long and so picks up material refreshed by later snapshots.
pub const OPAQUE_CREDENTIAL_LIFETIME: Duration = Duration::from_secs(300);

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

    /// The workload's bearer credential: `credentials["token"]` of the registration-material
    /// document (proto::registration), which must be bound to `route` and `instance`.
    pub fn workload_credential(&self, route: &str, instance: &InstanceRef) -> Result<WorkloadCredential, &'static str> {
        if self.0.len() > proto::MAX_REGISTRATION_MATERIAL_BYTES {
            return Err("the launch material is too large");
        }
        let material: Material =
            serde_json::from_slice(&self.0).map_err(|_| "the launch material is not a registration document")?;
        let bound = material.route == route
            && material.namespace == instance.namespace
            && material.name == instance.name
            && material.uid == instance.uid;
        if !bound {
            return Err("the launch material is bound to another instance");
        }
        let token = material
            .credentials
            .get(TOKEN_KEY)
            .filter(|t| !t.is_empty())
            .ok_or("the launch material carries no workload credential")?;
        Ok(WorkloadCredential {
            token: token.clone(),
            expires_at_ms: jwt_expiry_ms(token),
        })
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials(<redacted, {} bytes>)", self.0.len())
    }
}

/// The workload's bearer token and, for a JWT, its `exp` in Unix ms.
#[derive(Clone, PartialEq, Eq)]
pub struct WorkloadCredential {
    pub token: String,
    pub expires_at_ms: Option<i64>,
}

impl fmt::Debug for WorkloadCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WorkloadCredential(<redacted>, expires_at_ms: {:?})",
            self.expires_at_ms
        )
    }
}

/// The `exp` claim (seconds) of a compact JWT, in ms, read without verifying it: it only tells
/// the workload when to fetch again.
fn jwt_expiry_ms(token: &str) -> Option<i64> {
    let payload = token.split('.').nth(1)?;
    let claims: serde_json::Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
    claims.get("exp")?.as_i64()?.checked_mul(1000)
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
    use proto::registration::{Binding, Material};

    use super::*;

    fn instance() -> InstanceRef {
        InstanceRef {
            namespace: "team-a".into(),
            name: "agent".into(),
            uid: "u-1".into(),
            generation: 1,
        }
    }

    fn material(token: Option<&str>) -> Credentials {
        let binding = Binding {
            route: "team-a/agent",
            namespace: "team-a",
            name: "agent",
            uid: "u-1",
        };
        let mut material = Material::new(&binding, &[7; 32]);
        if let Some(token) = token {
            material.credentials.insert(TOKEN_KEY.into(), token.into());
        }
        Credentials::from_wire(&material.for_member()).unwrap()
    }

    #[test]
    fn the_workload_credential_comes_from_the_bound_material() {
        let credential = material(Some("opaque-secret"))
            .workload_credential("team-a/agent", &instance())
            .unwrap();
        assert_eq!(credential.token, "opaque-secret");
        assert_eq!(credential.expires_at_ms, None);
        assert!(!format!("{credential:?}").contains("opaque-secret"));

        let payload = URL_SAFE_NO_PAD.encode(br#"{"exp":1700000000}"#);
        let jwt = format!("e30.{payload}.sig");
        let credential = material(Some(&jwt))
            .workload_credential("team-a/agent", &instance())
            .unwrap();
        assert_eq!(credential.expires_at_ms, Some(1_700_000_000_000));
    }

    #[test]
    fn missing_or_foreign_material_is_refused_without_quoting_it() {
        let err = material(None)
            .workload_credential("team-a/agent", &instance())
            .unwrap_err();
        assert!(err.contains("no workload credential"), "{err}");
        let other = InstanceRef {
            uid: "u-2".into(),
            ..instance()
        };
        let err = material(Some("s3cret"))
            .workload_credential("team-a/agent", &other)
            .unwrap_err();
        assert!(err.contains("another instance") && !err.contains("s3cret"), "{err}");
        let garbage = Credentials::from_wire(b"launch-material-s3cret").unwrap();
        let err = garbage.workload_credential("team-a/agent", &instance()).unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
    }

    #[test]
    fn grants_are_redacted() {
        let grant = Grant::from_snapshot("header.claims.signature", 5).unwrap();
        assert!(!format!("{grant:?}").contains("claims"));
        assert!(Grant::from_snapshot("", 0).is_none());
    }
}
