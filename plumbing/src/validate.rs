//! The checks every side applies to the same values, written once so that they agree: http(s)
//! addresses, routes and member names. Each answers why a value is refused, in words an
//! operator can act on (the caller adds which setting or field it was).

use tonic::codegen::http::Uri;

/// Longest address a binary dials (configured, or named by a route directory entry).
pub const MAX_ADDRESS_BYTES: usize = 2048;

/// Longest runtime address a member publishes (`host.v1.Hello.runtime_address`: 1..256 bytes).
pub const MAX_RUNTIME_ADDRESS_BYTES: usize = 256;

/// Longest member name (a DNS-1123 subdomain, `host.v1.Hello.member`).
pub const MAX_MEMBER_BYTES: usize = 253;

/// The scheme of a valid address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

/// Why a value was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("empty")]
    Empty,
    #[error("longer than {0} bytes")]
    TooLong(usize),
    #[error("not printable ASCII without whitespace")]
    NotPrintable,
    #[error("not a URI")]
    NotUri,
    #[error("the scheme must be http:// or https://")]
    Scheme,
    #[error("no host")]
    NoHost,
    #[error("no port")]
    NoPort,
    #[error("an empty DNS label")]
    EmptyLabel,
    #[error("must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.'")]
    NotDns,
    #[error("DNS labels must start and end with a letter or digit")]
    LabelEdge,
}

/// An http(s) address with a host and a port, at most `max_bytes` bytes of printable ASCII
/// (`http://` is plaintext, `https://` TLS).
pub fn address(address: &str, max_bytes: usize) -> Result<Scheme, Refusal> {
    printable(address, max_bytes)?;
    let parsed: Uri = address.parse().map_err(|_| Refusal::NotUri)?;
    let scheme = match parsed.scheme_str() {
        Some("http") => Scheme::Http,
        Some("https") => Scheme::Https,
        _ => return Err(Refusal::Scheme),
    };
    if parsed.host().is_none_or(str::is_empty) {
        return Err(Refusal::NoHost);
    }
    if parsed.port_u16().is_none() {
        return Err(Refusal::NoPort);
    }
    Ok(scheme)
}

/// A route: 1..=[`proto::MAX_ROUTE_BYTES`] bytes of printable ASCII without whitespace
/// (common.proto).
pub fn route(route: &str) -> Result<(), Refusal> {
    printable(route, proto::MAX_ROUTE_BYTES)
}

/// A member name: a DNS-1123 subdomain (the supervisor Pod's name), at most
/// [`MAX_MEMBER_BYTES`]: dot-separated labels of lowercase letters, digits and '-', each
/// non-empty and starting and ending with a letter or digit.
pub fn member_name(member: &str) -> Result<(), Refusal> {
    if member.is_empty() {
        return Err(Refusal::Empty);
    }
    if member.len() > MAX_MEMBER_BYTES {
        return Err(Refusal::TooLong(MAX_MEMBER_BYTES));
    }
    for label in member.split('.') {
        let bytes = label.as_bytes();
        if bytes.is_empty() {
            return Err(Refusal::EmptyLabel);
        }
        if !bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        {
            return Err(Refusal::NotDns);
        }
        if bytes.first() == Some(&b'-') || bytes.last() == Some(&b'-') {
            return Err(Refusal::LabelEdge);
        }
    }
    Ok(())
}

/// 1..=`max_bytes` bytes of printable ASCII without whitespace.
fn printable(text: &str, max_bytes: usize) -> Result<(), Refusal> {
    if text.is_empty() {
        return Err(Refusal::Empty);
    }
    if text.len() > max_bytes {
        return Err(Refusal::TooLong(max_bytes));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Refusal::NotPrintable);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_need_an_http_scheme_a_host_and_a_port() {
        assert_eq!(address("https://gw-0:8443", MAX_ADDRESS_BYTES), Ok(Scheme::Https));
        assert_eq!(address("http://10.1.2.3:50061", MAX_ADDRESS_BYTES), Ok(Scheme::Http));
        assert_eq!(address("http://[::1]:7443", MAX_ADDRESS_BYTES), Ok(Scheme::Http));
        for (refused, why) in [
            ("", Refusal::Empty),
            ("http://", Refusal::NotUri),
            ("https://", Refusal::NotUri),
            ("http://:80", Refusal::NoHost),
            ("https://gw", Refusal::NoPort),
            ("http://10.0.0.1", Refusal::NoPort),
            ("gw:50051", Refusal::Scheme),
            ("grpcs://gw:8443", Refusal::Scheme),
            ("ftp://gw:21", Refusal::Scheme),
            ("https://gw :8443", Refusal::NotPrintable),
            ("https://gw:8443\n", Refusal::NotPrintable),
        ] {
            assert_eq!(address(refused, MAX_ADDRESS_BYTES), Err(why), "{refused:?}");
        }
        let long = format!("https://{}:1", "a".repeat(MAX_RUNTIME_ADDRESS_BYTES));
        assert!(address(&long, MAX_ADDRESS_BYTES).is_ok());
        assert_eq!(
            address(&long, MAX_RUNTIME_ADDRESS_BYTES),
            Err(Refusal::TooLong(MAX_RUNTIME_ADDRESS_BYTES))
        );
    }

    #[test]
    fn member_names_are_dns_subdomains() {
        for good in ["m", "supervisor-0", "pool.a-1.example", &"a".repeat(63)] {
            assert_eq!(member_name(good), Ok(()), "{good:?}");
        }
        for (bad, why) in [
            ("", Refusal::Empty),
            ("a..b", Refusal::EmptyLabel),
            (".a", Refusal::EmptyLabel),
            ("a.", Refusal::EmptyLabel),
            ("Member", Refusal::NotDns),
            ("a_b", Refusal::NotDns),
            ("-a", Refusal::LabelEdge),
            ("a.-b", Refusal::LabelEdge),
        ] {
            assert_eq!(member_name(bad), Err(why), "{bad:?}");
        }
        assert_eq!(
            member_name(&"a".repeat(MAX_MEMBER_BYTES + 1)),
            Err(Refusal::TooLong(MAX_MEMBER_BYTES))
        );
    }

    #[test]
    fn routes_are_bounded_printable_ascii() {
        assert_eq!(route("team-a/agent"), Ok(()));
        assert_eq!(route(""), Err(Refusal::Empty));
        assert_eq!(route("has space"), Err(Refusal::NotPrintable));
        assert_eq!(route("é"), Err(Refusal::NotPrintable));
        let long = "r".repeat(proto::MAX_ROUTE_BYTES + 1);
        assert_eq!(route(&long), Err(Refusal::TooLong(proto::MAX_ROUTE_BYTES)));
    }
}
