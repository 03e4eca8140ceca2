//! An egress policy revision as the sidecar enforces it, and its decisions over plain data:
//! default deny; a rule allows a host (exact, IP literal or `*.` wildcard) on some ports and,
//! for plain HTTP, some methods and path prefixes. Addresses are checked by [`super::floor`].

use std::net::IpAddr;

use proto::runtime::v1::{CredentialBinding, EgressPolicy, EgressRule, Enforcement};
use serde::{Deserialize, Serialize};

pub const MAX_RULES: usize = 256;
const MAX_NAME_BYTES: usize = 253;
const MAX_RULE_NAME_BYTES: usize = 63;
const MAX_PORTS: usize = 32;
const MAX_METHODS: usize = 16;
const MAX_PATH_PREFIXES: usize = 32;
const MAX_PATH_PREFIX_BYTES: usize = 1024;
pub const MAX_CREDENTIALS: usize = 32;
const MAX_CA_BUNDLE_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("the policy has no name or one longer than {MAX_NAME_BYTES} bytes")]
    Name,
    #[error("more than {MAX_RULES} rules")]
    TooManyRules,
    #[error("rule {0}: its name must be 1..{MAX_RULE_NAME_BYTES} bytes")]
    RuleName(usize),
    #[error("rule {0:?}: host {1:?} is neither a DNS name, an IP address nor `*.` and a DNS name")]
    Host(String, String),
    #[error("rule {0:?}: 1..{MAX_PORTS} ports, each 1..65535")]
    Ports(String),
    #[error("rule {0:?}: at most {MAX_METHODS} methods, each an upper-case token")]
    Methods(String),
    #[error("rule {0:?}: at most {MAX_PATH_PREFIXES} path prefixes, each starting with `/`")]
    Paths(String),
    #[error("rule {0:?} binds the credential {1:?}, which the policy does not name")]
    UnknownCredential(String, String),
    #[error("rule {0:?} binds a credential to a wildcard host: the workload could choose where it goes")]
    WildcardCredential(String),
    #[error("two rules are named {0:?}: a decision must name one rule")]
    DuplicateRule(String),
    #[error("rule {0:?}: a CA bundle of at most {MAX_CA_BUNDLE_BYTES} bytes of PEM certificates")]
    CaBundle(String),
    #[error(
        "more than {MAX_CREDENTIALS} credentials, or one whose name is not 1..63 lower-case letters, digits and `-`, named twice, with an invalid env name or a value that is not at most 8 KiB of visible ASCII"
    )]
    Credential,
}

/// Which part of a host a rule matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Host {
    /// A lower-case DNS name.
    Name(String),
    /// Any name strictly below this lower-case DNS name.
    Below(String),
    Address(IpAddr),
}

impl Host {
    fn parse(text: &str) -> Option<Self> {
        if let Ok(address) = text.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
            return Some(Host::Address(address));
        }
        let lower = text.to_ascii_lowercase();
        match lower.strip_prefix("*.") {
            Some(rest) if dns_name(rest) => Some(Host::Below(rest.to_owned())),
            None if dns_name(&lower) => Some(Host::Name(lower)),
            _ => None,
        }
    }

    fn matches(&self, host: &Target) -> bool {
        match (self, host) {
            (Host::Name(name), Target::Name(asked)) => name == asked,
            (Host::Below(parent), Target::Name(asked)) => asked
                .strip_suffix(parent.as_str())
                .is_some_and(|label| label.len() > 1 && label.ends_with('.')),
            (Host::Address(address), Target::Address(asked)) => address == asked,
            _ => false,
        }
    }

    /// A loopback address or `localhost`, named exactly (see [`super::floor::Floor`]).
    pub fn is_loopback(&self) -> bool {
        match self {
            Host::Name(name) => name == "localhost",
            Host::Below(_) => false,
            Host::Address(address) => address.is_loopback(),
        }
    }
}

/// A path a prefix can be judged by: no dot segment, and no encoded or backslash form of `.`,
/// `/` or `\` that the upstream could read as one (`/v1/../admin` is not under `/v1/`).
fn plain_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    !path.contains('\\')
        && !["%2e", "%2f", "%5c"].iter().any(|encoded| lower.contains(encoded))
        && !path.split('/').any(|segment| segment == "." || segment == "..")
}

/// An RFC 1123 host name: labels of 1..63 letters, digits and inner hyphens, 253 bytes at most.
fn dns_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// The host a connection asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Name(String),
    Address(IpAddr),
}

impl Target {
    /// `None` for something that is no host at all.
    pub fn parse(text: &str) -> Option<Self> {
        match Host::parse(text)? {
            Host::Name(name) => Some(Target::Name(name.strip_suffix('.').unwrap_or(&name).to_owned())),
            Host::Address(address) => Some(Target::Address(address)),
            Host::Below(_) => None,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Name(name) => f.write_str(name),
            Target::Address(IpAddr::V6(address)) => write!(f, "[{address}]"),
            Target::Address(address) => write!(f, "{address}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub name: String,
    pub host: Host,
    pub ports: Vec<u16>,
    pub methods: Vec<String>,
    pub path_prefixes: Vec<String>,
    /// The credential whose placeholder is replaced in the requests this rule allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// Requests this rule allows go upstream over TLS the sidecar opens (and so are plain
    /// HTTP only); the PEM certificates it trusts besides the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub originate_tls: Option<String>,
}

/// A credential rules may bind. Its value is held in memory only: never persisted (the
/// owner installs it again after a restart), logged or shown.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Credential {
    pub name: String,
    pub env: String,
    pub placeholder: String,
    #[serde(skip)]
    pub value: Option<Secret>,
    /// Why the value is not held, as its resolver said (empty: the owner has not installed it
    /// since this sidecar started).
    #[serde(skip)]
    pub error: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("name", &self.name)
            .field("held", &self.value.is_some())
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

/// A credential's value, as a header value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl Rule {
    /// Limited to some methods or paths: plain HTTP only.
    fn inspects(&self) -> bool {
        !self.methods.is_empty() || !self.path_prefixes.is_empty() || self.originate_tls.is_some()
    }
}

/// One installed revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    pub name: String,
    pub revision: u64,
    /// Denials are recorded, not made (the floor still is).
    pub audit_only: bool,
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub credentials: Vec<Credential>,
}

/// What a connection asks for.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub host: &'a Target,
    pub port: u16,
    /// Plain HTTP: the method and path; a tunnel shows neither.
    pub http: Option<(&'a str, &'a str)>,
}

/// The decision on one request, before the addresses are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed by this rule.
    Allowed { rule: String },
    /// No rule allows it; `enforced` false in an audit-only policy (it goes through).
    Denied { enforced: bool, reason: String },
}

impl Policy {
    pub fn decide(&self, request: &Request<'_>) -> Verdict {
        let candidates: Vec<&Rule> = self
            .rules
            .iter()
            .filter(|rule| rule.host.matches(request.host) && rule.ports.contains(&request.port))
            .collect();
        let allowed = candidates.iter().find(|rule| match request.http {
            None => !rule.inspects(),
            Some((method, path)) => {
                (rule.methods.is_empty() || rule.methods.iter().any(|m| m == method))
                    && (rule.path_prefixes.is_empty()
                        || (plain_path(path) && rule.path_prefixes.iter().any(|p| path.starts_with(p.as_str()))))
            }
        });
        if let Some(rule) = allowed {
            return Verdict::Allowed {
                rule: rule.name.clone(),
            };
        }
        if let (Some(rule), None) = (candidates.iter().find(|r| r.originate_tls.is_some()), request.http) {
            return Verdict::Denied {
                enforced: !self.audit_only,
                reason: format!(
                    "rule {:?} has the sidecar open TLS itself: send http://{}:{}/ through the proxy instead of a tunnel",
                    rule.name, request.host, request.port
                ),
            };
        }
        let reason = match (candidates.first(), request.http) {
            (None, _) => format!("no rule allows {}:{}", request.host, request.port),
            (Some(rule), None) => format!(
                "rule {:?} allows only some methods or paths, which a tunnel does not show: send plain http:// through the proxy",
                rule.name
            ),
            (Some(_), Some((method, path))) => {
                format!("no rule allows {method} {path} on {}:{}", request.host, request.port)
            }
        };
        Verdict::Denied {
            enforced: !self.audit_only,
            reason,
        }
    }

    /// The rule named `name`.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The credential named `name`.
    pub fn credential(&self, name: &str) -> Option<&Credential> {
        self.credentials.iter().find(|c| c.name == name)
    }

    /// The same revision (name, revision, rules and bindings), whatever values each holds.
    pub fn same_revision(&self, other: &Policy) -> bool {
        fn bindings(p: &Policy) -> Vec<(&str, &str)> {
            p.credentials
                .iter()
                .map(|c| (c.name.as_str(), c.env.as_str()))
                .collect()
        }
        self.name == other.name
            && self.revision == other.revision
            && self.audit_only == other.audit_only
            && self.rules == other.rules
            && bindings(self) == bindings(other)
    }

    /// A rule names the request's loopback host and port exactly (honoured only outside
    /// Kubernetes, see [`super::floor::Floor::local`]).
    pub fn names_loopback(&self, request: &Request<'_>) -> bool {
        self.rules.iter().any(|rule| {
            rule.host.is_loopback() && rule.host.matches(request.host) && rule.ports.contains(&request.port)
        })
    }
}

impl TryFrom<&EgressPolicy> for Policy {
    type Error = Invalid;

    fn try_from(policy: &EgressPolicy) -> Result<Self, Invalid> {
        if policy.name.is_empty() || policy.name.len() > MAX_NAME_BYTES {
            return Err(Invalid::Name);
        }
        if policy.rules.len() > MAX_RULES {
            return Err(Invalid::TooManyRules);
        }
        if policy.credentials.len() > MAX_CREDENTIALS {
            return Err(Invalid::Credential);
        }
        let credentials: Vec<Credential> = policy
            .credentials
            .iter()
            .map(parse_credential)
            .collect::<Result<_, _>>()?;
        let mut names: Vec<&str> = credentials.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err(Invalid::Credential);
        }
        let rules: Vec<Rule> = policy
            .rules
            .iter()
            .enumerate()
            .map(|(index, rule)| parse_rule(index, rule))
            .collect::<Result<_, _>>()?;
        let mut rule_names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        rule_names.sort_unstable();
        if let Some(twice) = rule_names.windows(2).find(|w| w[0] == w[1]) {
            return Err(Invalid::DuplicateRule(twice[0].to_owned()));
        }
        if let Some(rule) = rules.iter().find(|r| {
            r.credential
                .as_deref()
                .is_some_and(|c| names.binary_search(&c).is_err())
        }) {
            return Err(Invalid::UnknownCredential(
                rule.name.clone(),
                rule.credential.clone().unwrap_or_default(),
            ));
        }
        Ok(Policy {
            name: policy.name.clone(),
            revision: policy.revision,
            audit_only: policy.enforcement() == Enforcement::Audit,
            rules,
            credentials,
        })
    }
}

fn parse_rule(index: usize, rule: &EgressRule) -> Result<Rule, Invalid> {
    if rule.name.is_empty() || rule.name.len() > MAX_RULE_NAME_BYTES {
        return Err(Invalid::RuleName(index));
    }
    let name = rule.name.clone();
    let host =
        Host::parse(&rule.host).ok_or_else(|| Invalid::Host(name.clone(), plumbing::text::bounded(&rule.host, 256)))?;
    let ports: Vec<u16> = rule
        .ports
        .iter()
        .map(|p| u16::try_from(*p).ok().filter(|p| *p > 0))
        .collect::<Option<_>>()
        .filter(|ports: &Vec<u16>| !ports.is_empty() && ports.len() <= MAX_PORTS)
        .ok_or_else(|| Invalid::Ports(name.clone()))?;
    let token = |m: &String| !m.is_empty() && m.len() <= 32 && m.bytes().all(|b| b.is_ascii_uppercase());
    if rule.methods.len() > MAX_METHODS || !rule.methods.iter().all(token) {
        return Err(Invalid::Methods(name));
    }
    let prefix = |p: &String| p.starts_with('/') && p.len() <= MAX_PATH_PREFIX_BYTES;
    if rule.path_prefixes.len() > MAX_PATH_PREFIXES || !rule.path_prefixes.iter().all(prefix) {
        return Err(Invalid::Paths(name));
    }
    if rule.ca_bundle.len() > MAX_CA_BUNDLE_BYTES || (!rule.ca_bundle.is_empty() && !rule.originate_tls) {
        return Err(Invalid::CaBundle(name));
    }
    if rule.originate_tls && super::origin::roots(&rule.ca_bundle).is_err() {
        return Err(Invalid::CaBundle(name));
    }
    if !rule.credential.is_empty() && matches!(host, Host::Below(_)) {
        return Err(Invalid::WildcardCredential(name));
    }
    Ok(Rule {
        name,
        host,
        ports,
        methods: rule.methods.clone(),
        path_prefixes: rule.path_prefixes.clone(),
        credential: Some(rule.credential.clone()).filter(|c| !c.is_empty()),
        originate_tls: rule.originate_tls.then(|| rule.ca_bundle.clone()),
    })
}

fn parse_credential(binding: &CredentialBinding) -> Result<Credential, Invalid> {
    let name = &binding.name;
    let name_ok = !name.is_empty()
        && name.len() <= MAX_RULE_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    let env_ok = binding.env.is_empty()
        || (binding.env.len() <= 128
            && binding.env.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !binding.env.as_bytes()[0].is_ascii_digit());
    let value_ok =
        binding.value.is_empty() || proto::egress::credential_value(&binding.value).as_ref() == Ok(&binding.value);
    if !(name_ok && env_ok && value_ok) {
        return Err(Invalid::Credential);
    }
    let value = String::from_utf8(binding.value.clone()).ok().filter(|v| !v.is_empty());
    Ok(Credential {
        name: name.clone(),
        env: binding.env.clone(),
        placeholder: proto::egress::placeholder(name),
        error: match (&value, binding.error.is_empty()) {
            (None, true) => "its owner installed no value".to_owned(),
            (None, false) => plumbing::text::bounded(&binding.error, 256),
            (Some(_), _) => String::new(),
        },
        value: value.map(Secret),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, host: &str, ports: &[u32]) -> EgressRule {
        EgressRule {
            name: name.into(),
            host: host.into(),
            ports: ports.to_vec(),
            ..EgressRule::default()
        }
    }

    fn policy(rules: Vec<EgressRule>) -> Policy {
        let policy = EgressPolicy {
            name: "p".into(),
            revision: 1,
            rules,
            ..EgressPolicy::default()
        };
        Policy::try_from(&policy).expect("valid")
    }

    fn decide(policy: &Policy, host: &str, port: u16, http: Option<(&str, &str)>) -> Verdict {
        let host = Target::parse(host).expect("a host");
        policy.decide(&Request {
            host: &host,
            port,
            http,
        })
    }

    fn allowed(verdict: &Verdict) -> bool {
        matches!(verdict, Verdict::Allowed { .. })
    }

    #[test]
    fn default_deny_and_exact_hosts_and_ports() {
        let p = policy(vec![rule("api", "API.example.com", &[443])]);
        assert!(allowed(&decide(&p, "api.example.com", 443, None)));
        assert!(
            allowed(&decide(&p, "api.example.com.", 443, None)),
            "a trailing dot is the same name"
        );
        assert!(!allowed(&decide(&p, "api.example.com", 80, None)));
        assert!(!allowed(&decide(&p, "example.com", 443, None)));
        assert!(!allowed(&decide(&p, "api.example.com.evil.net", 443, None)));
        assert!(!allowed(&decide(&policy(Vec::new()), "api.example.com", 443, None)));
    }

    #[test]
    fn a_wildcard_matches_names_below_it_only() {
        let p = policy(vec![rule("any", "*.example.com", &[443])]);
        assert!(allowed(&decide(&p, "a.example.com", 443, None)));
        assert!(allowed(&decide(&p, "a.b.example.com", 443, None)));
        assert!(!allowed(&decide(&p, "example.com", 443, None)));
        assert!(!allowed(&decide(&p, "badexample.com", 443, None)));
        assert!(!allowed(&decide(&p, "10.0.0.1", 443, None)));
    }

    #[test]
    fn methods_and_paths_limit_plain_http_and_refuse_tunnels() {
        let mut limited = rule("read", "api.example.com", &[80, 443]);
        limited.methods = vec!["GET".into()];
        limited.path_prefixes = vec!["/v1/".into()];
        let p = policy(vec![limited]);
        assert!(allowed(&decide(&p, "api.example.com", 80, Some(("GET", "/v1/items")))));
        assert!(!allowed(&decide(
            &p,
            "api.example.com",
            80,
            Some(("POST", "/v1/items"))
        )));
        assert!(!allowed(&decide(&p, "api.example.com", 80, Some(("GET", "/admin")))));
        let Verdict::Denied { reason, enforced } = decide(&p, "api.example.com", 443, None) else {
            panic!("a tunnel cannot show its method")
        };
        assert!(enforced && reason.contains("plain http://"), "{reason}");
    }

    #[test]
    fn a_path_prefix_holds_against_dot_segments_and_encodings() {
        let mut limited = rule("read", "api.example.com", &[80]);
        limited.path_prefixes = vec!["/v1/".into()];
        let p = policy(vec![limited]);
        for path in [
            "/v1/../admin",
            "/v1/%2e%2e/admin",
            "/v1/..%2Fadmin",
            "/v1\\..\\admin",
            "/v1/./x",
        ] {
            assert!(
                !allowed(&decide(&p, "api.example.com", 80, Some(("GET", path)))),
                "{path}"
            );
        }
        assert!(allowed(&decide(
            &p,
            "api.example.com",
            80,
            Some(("GET", "/v1/items.json"))
        )));
    }

    #[test]
    fn rule_names_are_unique_and_a_credential_never_binds_a_wildcard() {
        let refused = |rules: Vec<EgressRule>, credentials: Vec<CredentialBinding>| {
            Policy::try_from(&EgressPolicy {
                name: "p".into(),
                rules,
                credentials,
                ..EgressPolicy::default()
            })
            .expect_err("invalid")
        };
        let key = CredentialBinding {
            name: "key".into(),
            ..CredentialBinding::default()
        };
        let mut bound = rule("models", "api.example.com", &[443]);
        bound.credential = "key".into();
        let twin = rule("models", "collector.example.net", &[443]);
        assert_eq!(
            refused(vec![bound, twin], vec![key.clone()]),
            Invalid::DuplicateRule("models".into())
        );
        let mut wild = rule("any", "*.example.com", &[443]);
        wild.credential = "key".into();
        assert_eq!(
            refused(vec![wild], vec![key]),
            Invalid::WildcardCredential("any".into())
        );
    }

    #[test]
    fn audit_only_records_instead_of_refusing() {
        let mut p = policy(Vec::new());
        p.audit_only = true;
        assert_eq!(
            decide(&p, "x.example.com", 443, None),
            Verdict::Denied {
                enforced: false,
                reason: "no rule allows x.example.com:443".into()
            }
        );
    }

    #[test]
    fn invalid_policies_are_refused_with_the_reason() {
        let refused = |rules: Vec<EgressRule>| {
            Policy::try_from(&EgressPolicy {
                name: "p".into(),
                rules,
                ..EgressPolicy::default()
            })
            .expect_err("invalid")
        };
        assert!(matches!(refused(vec![rule("a", "*", &[443])]), Invalid::Host(..)));
        assert!(matches!(refused(vec![rule("a", "a b.com", &[443])]), Invalid::Host(..)));
        assert!(matches!(refused(vec![rule("a", "*.*.com", &[443])]), Invalid::Host(..)));
        assert!(matches!(refused(vec![rule("a", "a.com", &[])]), Invalid::Ports(_)));
        assert!(matches!(refused(vec![rule("a", "a.com", &[0])]), Invalid::Ports(_)));
        assert!(matches!(
            refused(vec![rule("a", "a.com", &[70_000])]),
            Invalid::Ports(_)
        ));
        assert!(matches!(refused(vec![rule("", "a.com", &[1])]), Invalid::RuleName(0)));
        let mut lower = rule("a", "a.com", &[80]);
        lower.methods = vec!["get".into()];
        assert!(matches!(refused(vec![lower]), Invalid::Methods(_)));
        let mut relative = rule("a", "a.com", &[80]);
        relative.path_prefixes = vec!["v1".into()];
        assert!(matches!(refused(vec![relative]), Invalid::Paths(_)));
        assert!(matches!(
            refused((0..=MAX_RULES).map(|i| rule(&format!("r{i}"), "a.com", &[1])).collect()),
            Invalid::TooManyRules
        ));
        assert_eq!(
            Policy::try_from(&EgressPolicy::default()).expect_err("no name"),
            Invalid::Name
        );
    }

    #[test]
    fn ip_literals_match_as_addresses() {
        let p = policy(vec![rule("v4", "10.1.2.3", &[80]), rule("v6", "[fd00::1]", &[80])]);
        assert!(allowed(&decide(&p, "10.1.2.3", 80, None)));
        assert!(allowed(&decide(&p, "[fd00::1]", 80, None)));
        assert!(!allowed(&decide(&p, "10.1.2.4", 80, None)));
        assert!(p.rules[0].host == Host::Address("10.1.2.3".parse().expect("ip")));
    }
}
