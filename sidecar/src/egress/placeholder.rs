//! Credentials on the wire: the workload holds only placeholders (`openshell-placeholder-<name>`)
//! and the sidecar puts the value in, in the header values of a plain-HTTP request the rule
//! binding that credential allows. A placeholder token is matched whole (the longest run of
//! name characters after the prefix), so one credential's placeholder is never taken for part
//! of another's. A placeholder of the policy sent where its credential is not bound — another
//! rule's destination, the URL, or any request an audit-only policy lets through — goes out
//! unchanged and is reported as an attempt.

use hyper::Uri;
use hyper::header::{HeaderMap, HeaderValue};

use super::policy::{Policy, Rule};

const PREFIX: &str = "openshell-placeholder-";

/// What was done to a request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Substituted {
    /// The bound credential, when its placeholder was replaced.
    pub replaced: Option<String>,
    /// Credentials whose placeholder the request carries where they are not bound.
    pub attempts: Vec<String>,
}

/// Why a request was not sent: its rule's credential is not held (`reason` is safe to show).
#[derive(Debug, PartialEq, Eq)]
pub struct NotHeld {
    pub credential: String,
    pub reason: String,
}

/// Replaces the placeholder of `rule`'s credential in `headers`; notes every other placeholder
/// of `policy` in `headers` and `uri`.
pub fn substitute(
    headers: &mut HeaderMap,
    uri: &Uri,
    policy: &Policy,
    rule: Option<&Rule>,
) -> Result<Substituted, NotHeld> {
    let mut done = Substituted::default();
    let bound = rule.and_then(|r| r.credential.as_deref());
    for name in tokens(&uri.to_string()) {
        if policy.credential(&name).is_some() && !done.attempts.contains(&name) {
            done.attempts.push(name);
        }
    }
    for value in headers.values_mut() {
        let Ok(text) = value.to_str() else { continue };
        let mut replaced = None;
        for name in tokens(text) {
            let Some(credential) = policy.credential(&name) else {
                continue;
            };
            if bound != Some(name.as_str()) {
                if !done.attempts.contains(&name) {
                    done.attempts.push(name);
                }
                continue;
            }
            let Some(secret) = &credential.value else {
                let why = match credential.error.as_str() {
                    "" => "its owner has not installed it since the sidecar started",
                    error => error,
                };
                return Err(NotHeld {
                    reason: format!("the credential {name:?} is not held by this sidecar ({why}): nothing was sent"),
                    credential: name,
                });
            };
            replaced = Some(text.replace(&credential.placeholder, &secret.0));
            done.replaced = Some(name);
        }
        if let Some(new) = replaced.and_then(|r| HeaderValue::from_str(&r).ok()) {
            *value = new;
        }
    }
    Ok(done)
}

/// The credential names of the placeholders in `text`.
fn tokens(text: &str) -> Vec<String> {
    text.match_indices(PREFIX)
        .map(|(at, _)| {
            let rest = &text[at + PREFIX.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .unwrap_or(rest.len());
            rest[..end].to_owned()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use proto::runtime::v1::{CredentialBinding, EgressPolicy, EgressRule};

    use super::*;

    fn policy(held: bool) -> Policy {
        let binding = |name: &str, value: &str| CredentialBinding {
            name: name.into(),
            value: if held { value.as_bytes().to_vec() } else { Vec::new() },
            error: if held { String::new() } else { "forbidden".into() },
            ..CredentialBinding::default()
        };
        let rule = |name: &str, credential: &str| EgressRule {
            name: name.into(),
            host: format!("{name}.example.com"),
            ports: vec![80],
            credential: credential.into(),
            ..EgressRule::default()
        };
        let policy = EgressPolicy {
            name: "p".into(),
            revision: 1,
            credentials: vec![binding("key", "sk-1"), binding("key-2", "sk-2")],
            rules: vec![rule("models", "key"), rule("other", "")],
            ..EgressPolicy::default()
        };
        Policy::try_from(&policy).expect("valid")
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    hyper::header::HeaderName::from_static(name),
                    HeaderValue::from_str(value).expect("a value"),
                )
            })
            .collect()
    }

    #[test]
    fn the_bound_placeholder_is_replaced_and_no_other() {
        let policy = policy(true);
        let mut sent = headers(&[
            ("authorization", "Bearer openshell-placeholder-key"),
            ("x-other", "openshell-placeholder-key-2"),
        ]);
        let uri: Uri = "http://models.example.com/v1".parse().expect("uri");
        let done = substitute(&mut sent, &uri, &policy, policy.rule("models")).expect("held");
        assert_eq!(sent["authorization"], "Bearer sk-1");
        assert_eq!(
            sent["x-other"], "openshell-placeholder-key-2",
            "another credential's placeholder is not a prefix match"
        );
        assert_eq!(done.replaced.as_deref(), Some("key"));
        assert_eq!(done.attempts, ["key-2"]);
    }

    #[test]
    fn a_placeholder_where_it_is_not_bound_goes_out_unchanged_and_is_an_attempt() {
        let policy = policy(true);
        let mut sent = headers(&[("authorization", "Bearer openshell-placeholder-key")]);
        let uri: Uri = "http://other.example.com/?k=openshell-placeholder-key"
            .parse()
            .expect("uri");
        let done = substitute(&mut sent, &uri, &policy, policy.rule("other")).expect("nothing bound");
        assert_eq!(sent["authorization"], "Bearer openshell-placeholder-key");
        assert_eq!((done.replaced, done.attempts), (None, vec!["key".to_owned()]));
        let done = substitute(&mut sent, &uri, &policy, None).expect("audit-only");
        assert_eq!(done.attempts, ["key"]);
    }

    #[test]
    fn a_bound_credential_not_held_sends_nothing() {
        let policy = policy(false);
        let mut sent = headers(&[("authorization", "Bearer openshell-placeholder-key")]);
        let uri: Uri = "http://models.example.com/".parse().expect("uri");
        let refused = substitute(&mut sent, &uri, &policy, policy.rule("models")).expect_err("not held");
        assert!(refused.reason.contains("forbidden"), "{}", refused.reason);
        let mut plain = headers(&[("accept", "*/*")]);
        assert_eq!(
            substitute(&mut plain, &uri, &policy, policy.rule("models")),
            Ok(Substituted::default()),
            "a request without the placeholder needs no value"
        );
    }
}
