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
//! ```

use serde::{Deserialize, Serialize};

use crate::runtime::v1::{EgressPolicy, EgressRule, Enforcement};

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
        let unknown = r#"{"name":"p","rules":[{"name":"r","host":"a","ports":[1],"port":2}]}"#;
        assert!(
            serde_json::from_str::<Document>(unknown).is_err(),
            "a misspelt field is an error"
        );
    }
}
