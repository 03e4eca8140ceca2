//! The floor no policy lifts: addresses a workload must never reach through its sidecar —
//! the Pod's own loopback (the sidecar's other ports among them), unspecified and broadcast
//! addresses, link-local ranges (cloud metadata at 169.254.169.254 among them), multicast,
//! the other well-known metadata addresses, and the pool's own endpoints.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Metadata services outside the link-local ranges.
const METADATA: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)), // Alibaba Cloud
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),     // Oracle Cloud (classic)
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)), // AWS over IPv6
];

/// What is refused, whatever the policy says.
#[derive(Debug, Clone, Default)]
pub struct Floor {
    /// The pool's own endpoints (gateways, supervisor route), by name and by address and
    /// port (locally they share loopback with the upstreams a local policy names).
    pub pool_names: Vec<String>,
    pub pool_endpoints: Vec<SocketAddr>,
    /// The sidecar runs outside Kubernetes (local processes, where every upstream is on
    /// loopback too): a rule naming a loopback address or `localhost` exactly lifts the
    /// loopback part of the floor for it. Never in a Pod.
    pub local: bool,
}

impl Floor {
    /// Why `endpoint` is refused, or `None`. `loopback_rule`: a rule names the destination's
    /// loopback address exactly.
    pub fn refuses(&self, endpoint: SocketAddr, loopback_rule: bool) -> Option<&'static str> {
        let address = canonical(endpoint.ip());
        let pool = |a: &SocketAddr| canonical(a.ip()) == address && a.port() == endpoint.port();
        if self.pool_endpoints.iter().any(pool) {
            return Some("the pool's own endpoints");
        }
        if address.is_loopback() {
            return (!(self.local && loopback_rule)).then_some("loopback");
        }
        if METADATA.contains(&address) {
            return Some("a cloud metadata address");
        }
        match address {
            IpAddr::V4(v4) if v4.is_link_local() => Some("link-local (cloud metadata)"),
            IpAddr::V4(v4) if v4.is_unspecified() || v4.is_broadcast() || v4.is_multicast() => {
                Some("unspecified, broadcast or multicast")
            }
            IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => Some("link-local (cloud metadata)"),
            IpAddr::V6(v6) if v6.is_unspecified() || v6.is_multicast() => Some("unspecified or multicast"),
            _ => None,
        }
    }

    /// Why a host name is refused before it is resolved, or `None`: a name of the pool's own
    /// endpoints, a cloud metadata service's well-known name, or (in a Pod) `localhost` and
    /// the names below it. Any other name is resolved and each address checked.
    pub fn refuses_name(&self, name: &str) -> Option<&'static str> {
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        if self.pool_names.iter().any(|n| n.eq_ignore_ascii_case(&name)) {
            return Some("the pool's own endpoints");
        }
        if METADATA_NAMES.contains(&name.as_str()) {
            return Some("a cloud metadata name");
        }
        let loopback = name == "localhost" || name.ends_with(".localhost");
        (loopback && !self.local).then_some("loopback")
    }
}

/// Names of metadata services (GCP, AWS) that resolve into the floor.
const METADATA_NAMES: [&str; 4] = [
    "metadata.google.internal",
    "metadata.goog",
    "instance-data",
    "instance-data.ec2.internal",
];

/// IPv4-mapped and -compatible IPv6 addresses are their IPv4 address.
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> SocketAddr {
        SocketAddr::new(text.parse().expect("an address"), 443)
    }

    #[test]
    fn the_floor_refuses_loopback_metadata_link_local_and_the_pool() {
        let floor = Floor {
            pool_names: vec!["openshell-gateway.openshell-supervision.svc".into()],
            pool_endpoints: vec![ip("10.96.0.20")],
            local: false,
        };
        for refused in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "169.254.169.254",
            "::ffff:169.254.169.254",
            "fe80::1",
            "fd00:ec2::254",
            "100.100.100.200",
            "0.0.0.0",
            "::",
            "255.255.255.255",
            "224.0.0.1",
            "10.96.0.20",
            "::ffff:10.96.0.20",
        ] {
            assert!(floor.refuses(ip(refused), true).is_some(), "{refused}");
        }
        for open in ["10.96.0.21", "93.184.216.34", "2606:2800:220:1::1", "fd00::1"] {
            assert_eq!(floor.refuses(ip(open), false), None, "{open}");
        }
        let other_port = SocketAddr::new("10.96.0.20".parse().expect("ip"), 80);
        assert_eq!(
            floor.refuses(other_port, false),
            None,
            "the pool is its endpoints, not whole hosts"
        );
        assert_eq!(
            floor.refuses_name("OpenShell-Gateway.openshell-supervision.svc."),
            Some("the pool's own endpoints")
        );
        assert_eq!(floor.refuses_name("gateway.example.com"), None);
        assert_eq!(
            floor.refuses_name("Metadata.Google.Internal"),
            Some("a cloud metadata name")
        );
        assert_eq!(floor.refuses_name("localhost"), Some("loopback"));
        assert_eq!(floor.refuses_name("api.localhost."), Some("loopback"));
        let local = Floor {
            local: true,
            ..floor.clone()
        };
        assert_eq!(local.refuses_name("localhost"), None, "locally a rule may name it");
    }

    #[test]
    fn only_a_local_sidecar_honours_a_loopback_rule() {
        let local = Floor {
            local: true,
            ..Floor::default()
        };
        assert_eq!(local.refuses(ip("127.0.0.1"), true), None);
        let pool = Floor {
            pool_endpoints: vec![ip("127.0.0.1")],
            ..local.clone()
        };
        assert!(
            pool.refuses(ip("127.0.0.1"), true).is_some(),
            "not the pool's own, even locally"
        );
        assert!(
            local.refuses(ip("127.0.0.1"), false).is_some(),
            "not without a rule naming it"
        );
        assert!(
            local.refuses(ip("169.254.169.254"), true).is_some(),
            "the rest of the floor holds"
        );
        assert!(
            Floor::default().refuses(ip("127.0.0.1"), true).is_some(),
            "in a Pod never"
        );
    }
}
