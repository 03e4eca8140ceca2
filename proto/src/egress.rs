//! An egress policy as people write it: the YAML or JSON of a local policy file (`local-pool
//! --policy`, `supervisor --egress-policy`), in the field names of the `SandboxPolicy` spec.
//! What each field means is `runtime.v1.EgressPolicy`; the sidecar validates what it loads.
//!
//! ```yaml
//! name: team-a-default
//! revision: 3
//! enforcement: enforce        # or audit
//! rules:
//!   - name: models
//!     host: api.example.com   # or 10.0.0.7, or *.example.com
//!     ports: [443]
//!   - name: read-docs
//!     host: docs.example.com
//!     ports: [80]
//!     methods: [GET]          # plain http:// only
//!     pathPrefixes: [/v1/]
//!   - name: models-api
//!     host: models.example.com
//!     ports: [443]
//!     credential: models-key  # the workload sends http://models.example.com:443/ with the
//!     originateTls: true      # placeholder; the sidecar puts the key in and speaks TLS
//! credentials:
//!   - name: models-key        # placeholder: openshell-placeholder-models-key
//!     env: MODELS_API_KEY     # set to the placeholder in every workload container
//!     secretKeyRef: {name: models, key: token}
//! ```

use serde::{Deserialize, Serialize};

use crate::runtime::v1::{CredentialBinding, EgressPolicy, EgressRule, Enforcement};

/// The answer to a workload asking for a credential (runtime.v1.FetchCredential, the socket's
/// `{"op":"credential"}`): it holds none.
pub const NO_CREDENTIAL: &str = "a workload holds no credential: the egress policy binds credentials to destinations and the sidecar puts them into requests; use the placeholders {\"op\":\"policy\"} lists";

/// Largest credential value.
pub const MAX_CREDENTIAL_BYTES: usize = 8 * 1024;

/// A credential value as a Secret or file holds it, made fit for a header: trailing whitespace
/// (a file's last newline) removed, then at most [`MAX_CREDENTIAL_BYTES`] of visible ASCII and
/// spaces; otherwise why not (never quoting it).
pub fn credential_value(raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut value = raw.to_vec();
    while value.last().is_some_and(u8::is_ascii_whitespace) {
        value.pop();
    }
    if value.is_empty() {
        return Err("the value is empty".into());
    }
    if value.len() > MAX_CREDENTIAL_BYTES {
        return Err(format!("the value is longer than {MAX_CREDENTIAL_BYTES} bytes"));
    }
    if !value.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        return Err("the value holds bytes a header cannot carry (only visible ASCII and spaces)".into());
    }
    Ok(value)
}

/// What the workload sees instead of the credential `name`'s value.
pub fn placeholder(name: &str) -> String {
    format!("openshell-placeholder-{name}")
}

impl std::fmt::Debug for CredentialBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialBinding")
            .field("name", &self.name)
            .field("env", &self.env)
            .field("secret", &self.secret)
            .field("key", &self.key)
            .field("value", &format_args!("<{} bytes>", self.value.len()))
            .field("error", &self.error)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Document {
    pub name: String,
    #[serde(default)]
    pub revision: u64,
    #[serde(default)]
    pub enforcement: Mode,
    #[serde(default)]
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub credentials: Vec<Credential>,
}

/// A credential rules may bind (`runtime.v1.CredentialBinding`); its value is never in the
/// document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Credential {
    pub name: String,
    #[serde(default)]
    pub env: String,
    pub secret_key_ref: SecretKeyRef,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    #[default]
    Enforce,
    Audit,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    pub name: String,
    pub host: String,
    pub ports: Vec<u32>,
    #[serde(default)]
    pub methods: Vec<String>,
    #[serde(default)]
    pub path_prefixes: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub credential: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub originate_tls: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_bundle: String,
}

impl From<&Document> for EgressPolicy {
    fn from(document: &Document) -> Self {
        let enforcement = match document.enforcement {
            Mode::Enforce => Enforcement::Enforce,
            Mode::Audit => Enforcement::Audit,
        };
        EgressPolicy {
            name: document.name.clone(),
            revision: document.revision,
            enforcement: enforcement.into(),
            rules: document
                .rules
                .iter()
                .map(|rule| EgressRule {
                    name: rule.name.clone(),
                    host: rule.host.clone(),
                    ports: rule.ports.clone(),
                    methods: rule.methods.clone(),
                    path_prefixes: rule.path_prefixes.clone(),
                    credential: rule.credential.clone(),
                    originate_tls: rule.originate_tls,
                    ca_bundle: rule.ca_bundle.clone(),
                })
                .collect(),
            credentials: document
                .credentials
                .iter()
                .map(|credential| CredentialBinding {
                    name: credential.name.clone(),
                    env: credential.env.clone(),
                    secret: credential.secret_key_ref.name.clone(),
                    key: credential.secret_key_ref.key.clone(),
                    ..CredentialBinding::default()
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_reads_in_the_spec_field_names() {
        let text = r#"{"name":"p","revision":3,"enforcement":"audit",
            "rules":[{"name":"r","host":"*.example.com","ports":[443],"pathPrefixes":["/v1/"]}]}"#;
        let document: Document = serde_json::from_str(text).expect("a document");
        let policy = EgressPolicy::from(&document);
        assert_eq!((policy.name.as_str(), policy.revision), ("p", 3));
        assert_eq!(policy.enforcement(), Enforcement::Audit);
        assert_eq!(policy.rules[0].path_prefixes, ["/v1/"]);
        let bound = r#"{"name":"p","credentials":[{"name":"k","env":"K","secretKeyRef":{"name":"s","key":"t"}}],
            "rules":[{"name":"r","host":"a","ports":[443],"credential":"k","originateTls":true}]}"#;
        let bound = EgressPolicy::from(&serde_json::from_str::<Document>(bound).expect("a document"));
        assert_eq!(
            (bound.credentials[0].secret.as_str(), bound.credentials[0].key.as_str()),
            ("s", "t")
        );
        assert!(bound.rules[0].originate_tls && bound.rules[0].credential == "k");
        let mut held = bound.credentials[0].clone();
        held.value = b"sk-very-secret".to_vec();
        assert!(
            !format!("{held:?}").contains("very-secret"),
            "a value is never in Debug"
        );
        assert_eq!(credential_value(b"sk-1 \n"), Ok(b"sk-1".to_vec()));
        assert!(credential_value(b"line\nbreak").is_err() && credential_value(b"\n").is_err());
        assert!(credential_value(&vec![b'a'; MAX_CREDENTIAL_BYTES + 1]).is_err());
        let unknown = r#"{"name":"p","rules":[{"name":"r","host":"a","ports":[1],"port":2}]}"#;
        assert!(
            serde_json::from_str::<Document>(unknown).is_err(),
            "a misspelt field is an error"
        );
    }
}
