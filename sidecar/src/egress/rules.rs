//! The Pod's network rules under egress redirection (an nftables table, installed by the
//! `egress install-rules` init container, which alone holds `NET_ADMIN`, before any other
//! container of the Pod starts):
//!
//! - every new TCP connection a process of the Pod opens to another host is redirected to the
//!   sidecar's redirect listener on loopback, which decides it ([`super::redirect`]);
//! - DNS to the Pod's nameservers goes out as it is (names must resolve for the proxy's
//!   clients and the sidecar alike);
//! - everything else the Pod would send first (UDP, ICMP, IPv6 TCP, raw sockets of the IP
//!   layer) is rejected at once — never a silent hang — but IPv6 neighbour discovery, without
//!   which no IPv6 address answers;
//! - the one exception is the Pod's dialer (`egress dialer`, its own UID), which opens the
//!   connections the sidecar decided and the sidecar's own: its sockets leave as they are.
//!
//! Loopback and replies to connections made to the Pod are untouched. If the sidecar is not
//! listening, the redirected connections are refused: no sidecar, no egress.

use std::net::IpAddr;

/// The nftables table this installs (and replaces when it runs again in the same Pod).
pub const TABLE: &str = "openshell_egress";

/// What the rules need to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    /// The UID of the Pod's dialer, whose connections are not redirected.
    pub dialer_uid: u32,
    /// The sidecar's redirect listener port on 127.0.0.1.
    pub redirect_port: u16,
    /// The Pod's nameservers (from its `/etc/resolv.conf`).
    pub nameservers: Vec<IpAddr>,
}

impl Rules {
    /// The ruleset for `nft -f -`: one transaction that replaces any earlier table.
    pub fn ruleset(&self) -> String {
        let Rules {
            dialer_uid,
            redirect_port,
            nameservers,
        } = self;
        let v4: Vec<String> = nameservers
            .iter()
            .filter(|ip| ip.is_ipv4())
            .map(ToString::to_string)
            .collect();
        let v6: Vec<String> = nameservers
            .iter()
            .filter(|ip| ip.is_ipv6())
            .map(ToString::to_string)
            .collect();
        let (mut dns, mut dns_tcp) = (String::new(), String::new());
        for (family, list) in [("ip", &v4), ("ip6", &v6)] {
            if !list.is_empty() {
                let set = list.join(", ");
                dns.push_str(&format!(
                    "\t\t{family} daddr {{ {set} }} udp dport 53 accept\n\t\t{family} daddr {{ {set} }} tcp dport 53 accept\n"
                ));
                // DNS over TCP (truncated answers) goes to the nameserver, not the sidecar.
                dns_tcp.push_str(&format!("\t\t{family} daddr {{ {set} }} tcp dport 53 return\n"));
            }
        }
        format!(
            "table inet {TABLE}\n\
             delete table inet {TABLE}\n\
             table inet {TABLE} {{\n\
             \tchain to_sidecar {{\n\
             \t\ttype nat hook output priority -100; policy accept;\n\
             \t\tmeta skuid {dialer_uid} return\n\
             \t\toifname \"lo\" return\n\
             {dns_tcp}\
             \t\tmeta nfproto ipv4 meta l4proto tcp redirect to :{redirect_port}\n\
             \t}}\n\
             \tchain leave {{\n\
             \t\ttype filter hook output priority filter; policy drop;\n\
             \t\tmeta skuid {dialer_uid} accept\n\
             \t\toifname \"lo\" accept\n\
             \t\tip daddr 127.0.0.1 tcp dport {redirect_port} accept\n\
             \t\tct state established,related accept\n\
             {dns}\
             \t\ticmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit, mld2-listener-report }} accept\n\
             \t\tmeta l4proto tcp reject with tcp reset\n\
             \t\treject with icmpx admin-prohibited\n\
             \t}}\n\
             }}\n"
        )
    }
}

/// The `nameserver` addresses of a `resolv.conf`.
pub fn nameservers(resolv_conf: &str) -> Vec<IpAddr> {
    resolv_conf
        .lines()
        .filter_map(|line| line.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().split('%').next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_redirects_tcp_and_lets_only_the_dialer_and_dns_out() {
        let rules = Rules {
            dialer_uid: 15999,
            redirect_port: 15002,
            nameservers: nameservers("search a.svc\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\noptions ndots:5\n"),
        };
        let text = rules.ruleset();
        assert!(text.starts_with("table inet openshell_egress\ndelete table inet openshell_egress\n"));
        assert!(text.contains("meta skuid 15999 return\n"));
        assert!(text.contains("meta skuid 15999 accept\n"));
        assert!(text.contains("redirect to :15002\n"));
        // Redirected, a connection leaves through the filter hook before it is routed to lo.
        assert!(text.contains("ip daddr 127.0.0.1 tcp dport 15002 accept\n"));
        assert!(text.contains("ip daddr { 10.96.0.10 } udp dport 53 accept\n"));
        // DNS over TCP is not redirected.
        assert!(text.find("ip daddr { 10.96.0.10 } tcp dport 53 return") < text.find("redirect to"));
        assert!(text.contains("ip6 daddr { fe80::1 } udp dport 53 accept\n"));
        assert!(text.contains("type filter hook output priority filter; policy drop;"));
        // The dialer's exemption comes before anything is redirected or dropped.
        assert!(text.find("skuid 15999 return") < text.find("redirect to"));
        assert!(text.find("skuid 15999 accept") < text.find("reject with tcp reset"));
    }

    #[test]
    fn without_nameservers_no_dns_goes_out() {
        let rules = Rules {
            dialer_uid: 1,
            redirect_port: 2,
            nameservers: nameservers("# nothing\n"),
        };
        assert!(!rules.ruleset().contains("dport 53"));
    }
}
