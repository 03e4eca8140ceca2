//! Credentials on the wire: the workload holds only placeholders (`openshell-placeholder-<name>`)
//! and the sidecar puts the value in, in a plain-HTTP request the rule binding that credential
//! allows, and only where APIs take a credential and do not echo it: the value of an
//! [`CREDENTIAL_HEADERS`] header that is the placeholder itself, or a scheme and the placeholder
//! (`Bearer openshell-placeholder-models`). Anywhere else — another header (`Origin`, a request
//! id, which APIs reflect), the URL, another rule's destination, any request an audit-only
//! policy lets through — a placeholder of the policy goes out unchanged and is reported as an
//! attempt. A placeholder token is matched whole (the longest run of name characters after the
//! prefix), so one credential's placeholder is never taken for part of another's.

use hyper::Uri;
use hyper::header::{HeaderMap, HeaderValue};

use super::policy::{Policy, Rule};

const PREFIX: &str = "openshell-placeholder-";

/// The headers a credential is put into.
pub const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

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
/// of `policy` in `headers` and `uri`. Unless `plaintext` (outside Kubernetes, where every
/// upstream is on loopback), a value goes only over TLS the sidecar opens itself: in a Pod,
/// whatever shares its network namespace can read plain HTTP on the wire.
pub fn substitute(
    headers: &mut HeaderMap,
    uri: &Uri,
    policy: &Policy,
    rule: Option<&Rule>,
    plaintext: bool,
) -> Result<Substituted, NotHeld> {
    let mut done = Substituted::default();
    let bound = rule.and_then(|r| r.credential.as_deref());
    let attempt = |name: String, done: &mut Substituted| {
        if policy.credential(&name).is_some() && !done.attempts.contains(&name) {
            done.attempts.push(name);
        }
    };
    for name in tokens(&uri.to_string()) {
        attempt(name, &mut done);
    }
    for (header, value) in headers.iter_mut() {
        let Ok(text) = value.to_str() else { continue };
        let names = tokens(text);
        if names.is_empty() {
            continue;
        }
        let slot = CREDENTIAL_HEADERS
            .contains(&header.as_str())
            .then(|| credential_slot(text))
            .flatten();
        let (Some((scheme, name)), Some(bound)) = (slot, bound) else {
            names.into_iter().for_each(|name| attempt(name, &mut done));
            continue;
        };
        if name != bound {
            attempt(name, &mut done);
            continue;
        }
        let Some(credential) = policy.credential(&name) else {
            continue;
        };
        if !plaintext && rule.is_some_and(|r| r.originate_tls.is_none()) {
            return Err(NotHeld {
                reason: format!(
                    "the credential {name:?} goes only over TLS the sidecar opens (set originateTls on its rule): nothing was sent"
                ),
                credential: name,
            });
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
        if let Ok(new) = HeaderValue::from_str(&format!("{scheme}{}", secret.0)) {
            *value = new;
            done.replaced = Some(name);
        }
    }
    Ok(done)
}

/// `placeholder` or `Scheme placeholder` (one token and one space): the scheme with its space,
/// and the credential's name.
fn credential_slot(text: &str) -> Option<(&str, String)> {
    let (scheme, rest) = match text.split_once(' ') {
        Some((scheme, rest))
            if !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') =>
        {
            (&text[..=scheme.len()], rest)
        }
        Some(_) => return None,
        None => ("", text),
    };
    let name = rest.strip_prefix(PREFIX)?;
    let whole = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    whole.then(|| (scheme, name.to_owned()))
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
            ("x-api-key", "openshell-placeholder-key-2"),
            ("origin", "openshell-placeholder-key"),
            ("x-request-id", "a openshell-placeholder-key b"),
        ]);
        let uri: Uri = "http://models.example.com/v1".parse().expect("uri");
        let done = substitute(&mut sent, &uri, &policy, policy.rule("models"), true).expect("held");
        assert_eq!(sent["authorization"], "Bearer sk-1");
        assert_eq!(
            sent["x-api-key"], "openshell-placeholder-key-2",
            "another credential's placeholder is not a prefix match"
        );
        assert_eq!(
            sent["origin"], "openshell-placeholder-key",
            "never in a header an API may echo"
        );
        assert_eq!(
            sent["x-request-id"], "a openshell-placeholder-key b",
            "nor inside other text"
        );
        assert_eq!(done.replaced.as_deref(), Some("key"));
        assert_eq!(done.attempts, ["key-2", "key"]);
        let mut bare = headers(&[("x-api-key", "openshell-placeholder-key")]);
        substitute(&mut bare, &uri, &policy, policy.rule("models"), true).expect("held");
        assert_eq!(bare["x-api-key"], "sk-1");
        let mut many = headers(&[("authorization", &"Bearer openshell-placeholder-key ".repeat(2000))]);
        substitute(&mut many, &uri, &policy, policy.rule("models"), true).expect("held");
        assert!(
            many["authorization"].to_str().is_ok_and(|v| !v.contains("sk-1")),
            "one placeholder per value: a value of many is an attempt, not thousands of copies"
        );
    }

    #[test]
    fn a_placeholder_where_it_is_not_bound_goes_out_unchanged_and_is_an_attempt() {
        let policy = policy(true);
        let mut sent = headers(&[("authorization", "Bearer openshell-placeholder-key")]);
        let uri: Uri = "http://other.example.com/?k=openshell-placeholder-key"
            .parse()
            .expect("uri");
        let done = substitute(&mut sent, &uri, &policy, policy.rule("other"), true).expect("nothing bound");
        assert_eq!(sent["authorization"], "Bearer openshell-placeholder-key");
        assert_eq!((done.replaced, done.attempts), (None, vec!["key".to_owned()]));
        let done = substitute(&mut sent, &uri, &policy, None, true).expect("audit-only");
        assert_eq!(done.attempts, ["key"]);
    }

    #[test]
    fn a_bound_credential_not_held_sends_nothing() {
        let policy = policy(false);
        let mut sent = headers(&[("authorization", "Bearer openshell-placeholder-key")]);
        let uri: Uri = "http://models.example.com/".parse().expect("uri");
        let refused = substitute(&mut sent, &uri, &policy, policy.rule("models"), true).expect_err("not held");
        assert!(refused.reason.contains("forbidden"), "{}", refused.reason);
        let mut plain = headers(&[("accept", "*/*")]);
        assert_eq!(
            substitute(&mut plain, &uri, &policy, policy.rule("models"), true),
            Ok(Substituted::default()),
            "a request without the placeholder needs no value"
        );
    }

    #[test]
    fn in_a_pod_a_value_goes_only_over_tls_the_sidecar_opens() {
        let held = policy(true);
        let mut sent = headers(&[("authorization", "Bearer openshell-placeholder-key")]);
        let uri: Uri = "http://models.example.com/".parse().expect("uri");
        let refused = substitute(&mut sent, &uri, &held, held.rule("models"), false).expect_err("plain HTTP");
        assert!(refused.reason.contains("originateTls"), "{}", refused.reason);
        assert_eq!(sent["authorization"], "Bearer openshell-placeholder-key");
    }
}
