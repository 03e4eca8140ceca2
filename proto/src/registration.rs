//! Registration material (`registry.v1.RegisterRequest.registration_material`):
//! the document a sidecar sends when it registers its
//! instance. It binds route, namespace, name and uid together and carries the
//! instance's credentials, including the receipt key only the sidecar and the
//! gateway may know. Decoding is size-bounded and its errors never quote the
//! material (it carries secrets).

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

/// Current document version.
pub const VERSION: u32 = 1;
/// Shortest receipt key accepted.
pub const MIN_RECEIPT_KEY_BYTES: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("registration material is {0} bytes, more than the {max} allowed", max = crate::MAX_REGISTRATION_MATERIAL_BYTES)]
    TooLarge(usize),
    #[error("registration material is not a valid version {VERSION} document")]
    Undecodable,
    #[error("registration material is bound to another {0}")]
    Mismatch(&'static str),
    #[error("registration material's receipt key is shorter than {MIN_RECEIPT_KEY_BYTES} bytes")]
    WeakReceiptKey,
}

/// What the material must be bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding<'a> {
    pub route: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
}

/// The decoded document. Its secrets are never printed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Material {
    pub v: u32,
    pub route: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// base64url, no padding.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub receipt_key: String,
    /// Further credentials the member's session needs (opaque to the gateway).
    #[serde(default)]
    pub credentials: BTreeMap<String, String>,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Material")
            .field("route", &self.route)
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .field("credentials", &self.credentials.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Material {
    /// New material for an instance with a receipt key.
    pub fn new(binding: &Binding<'_>, receipt_key: &[u8]) -> Self {
        Self {
            v: VERSION,
            route: binding.route.into(),
            namespace: binding.namespace.into(),
            name: binding.name.into(),
            uid: binding.uid.into(),
            receipt_key: URL_SAFE_NO_PAD.encode(receipt_key),
            credentials: BTreeMap::new(),
        }
    }

    /// Decode and check the binding.
    pub fn decode(bytes: &[u8], binding: &Binding<'_>) -> Result<Self, Error> {
        if bytes.len() > crate::MAX_REGISTRATION_MATERIAL_BYTES {
            return Err(Error::TooLarge(bytes.len()));
        }
        let material: Material = serde_json::from_slice(bytes).map_err(|_| Error::Undecodable)?;
        if material.v != VERSION {
            return Err(Error::Undecodable);
        }
        let checks = [
            (material.route == binding.route, "route"),
            (material.namespace == binding.namespace, "namespace"),
            (material.name == binding.name, "name"),
            (material.uid == binding.uid, "uid"),
        ];
        if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
            return Err(Error::Mismatch(what));
        }
        if material.receipt_key()?.len() < MIN_RECEIPT_KEY_BYTES {
            return Err(Error::WeakReceiptKey);
        }
        Ok(material)
    }

    pub fn receipt_key(&self) -> Result<Vec<u8>, Error> {
        URL_SAFE_NO_PAD
            .decode(&self.receipt_key)
            .map_err(|_| Error::Undecodable)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// What a member's session receives: everything but the receipt key, so
    /// a member can never forge the sidecar's receipts.
    pub fn for_member(&self) -> Vec<u8> {
        Self {
            receipt_key: String::new(),
            ..self.clone()
        }
        .encode()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BINDING: Binding<'static> = Binding {
        route: "team-a/agent",
        namespace: "team-a",
        name: "agent",
        uid: "u-1",
    };

    fn material() -> Material {
        let mut m = Material::new(&BINDING, &[7u8; 32]);
        m.credentials.insert("api-token".into(), "s3cret-value".into());
        m
    }

    #[test]
    fn round_trips_and_checks_the_binding() {
        let bytes = material().encode();
        assert_eq!(Material::decode(&bytes, &BINDING), Ok(material()));
        let other = Binding { uid: "u-2", ..BINDING };
        assert_eq!(Material::decode(&bytes, &other), Err(Error::Mismatch("uid")));
        let other = Binding {
            route: "team-a/other",
            ..BINDING
        };
        assert_eq!(Material::decode(&bytes, &other), Err(Error::Mismatch("route")));
    }

    #[test]
    fn refuses_bad_material_without_quoting_it() {
        let huge = vec![b'x'; crate::MAX_REGISTRATION_MATERIAL_BYTES + 1];
        assert!(matches!(Material::decode(&huge, &BINDING), Err(Error::TooLarge(_))));
        let garbage = br#"{"v":1,"route":"s3cret-value"#;
        let err = Material::decode(garbage, &BINDING).unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
        let weak = Material::new(&BINDING, &[1u8; 8]).encode();
        assert_eq!(Material::decode(&weak, &BINDING), Err(Error::WeakReceiptKey));
        let unknown_field =
            br#"{"v":1,"route":"team-a/agent","namespace":"team-a","name":"agent","uid":"u-1","extra":1}"#;
        assert_eq!(Material::decode(unknown_field, &BINDING), Err(Error::Undecodable));
    }

    #[test]
    fn members_never_see_the_receipt_key_and_debug_hides_secrets() {
        let member_view: Material = serde_json::from_slice(&material().for_member()).unwrap();
        assert!(member_view.receipt_key.is_empty());
        assert_eq!(
            member_view.credentials.get("api-token").map(String::as_str),
            Some("s3cret-value")
        );
        let shown = format!("{:?}", material());
        assert!(
            !shown.contains("s3cret") && !shown.contains(&material().receipt_key),
            "{shown}"
        );
    }
}
