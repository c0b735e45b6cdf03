//! The resolver configuration a slot with a network namespace of its own sees.
//!
//! A slot's namespace reaches the world over IPv4 through the host, but not the host's
//! loopback: a resolver the host names on `127.0.0.x` or `::1` (systemd-resolved's
//! `127.0.0.53`, Ubuntu's default) is out of its reach, and so is any IPv6 server (the
//! namespace has no IPv6 route out). As Docker does, the agent then gives the slot's
//! logins a resolv.conf of their own, bound on `/etc/resolv.conf` in the slot's private
//! mount namespace ([`crate::isolation::private_tmp`]): the host's without the servers a
//! slot cannot reach or, when none is left, the upstream servers systemd-resolved uses
//! (`/run/systemd/resolve/resolv.conf`). With no server left at all the agent says so in
//! its log at start, and slots keep the host's file.

use std::net::IpAddr;

/// Where the agent reads the host's resolver configuration (`--resolv-conf`).
pub const HOST_RESOLV_CONF: &str = "/etc/resolv.conf";
/// systemd-resolved's list of the upstream servers (`--upstream-resolv-conf`).
pub const UPSTREAM_RESOLV_CONF: &str = "/run/systemd/resolve/resolv.conf";

/// What a slot's `/etc/resolv.conf` is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotDns {
    /// The host's: every server it names is reachable from a slot.
    Host,
    /// A file of the slot's own with this text.
    Own(String),
    /// No server a slot can reach is known: the slot keeps the host's file.
    Unreachable,
}

/// Whether a slot's namespace can reach the server at `addr`: IPv4, not loopback.
fn reachable(addr: &str) -> bool {
    match addr.split('%').next().unwrap_or(addr).parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => !v4.is_loopback() && !v4.is_unspecified(),
        _ => false,
    }
}

/// The server of a `nameserver` line.
fn nameserver(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    (words.next() == Some("nameserver")).then(|| words.next().unwrap_or(""))
}

/// `text` without the servers a slot cannot reach, if any server is left.
fn reachable_only(text: &str) -> Option<String> {
    let kept: Vec<&str> = text
        .lines()
        .filter(|line| nameserver(line).is_none_or(reachable))
        .collect();
    kept.iter()
        .any(|l| nameserver(l).is_some())
        .then(|| kept.join("\n") + "\n")
}

/// What a slot's resolv.conf is, given the host's (`host`) and systemd-resolved's list
/// of upstream servers (`upstream`, when there is one).
pub fn slot_dns(host: &str, upstream: Option<&str>) -> SlotDns {
    let servers: Vec<&str> = host.lines().filter_map(nameserver).collect();
    if !servers.is_empty() && servers.iter().all(|s| reachable(s)) {
        return SlotDns::Host;
    }
    let header = "# Made by slotpool-agent for the slots' network namespaces, which do not \
                  reach the host's loopback:\n";
    if let Some(text) = reachable_only(host) {
        return SlotDns::Own(format!(
            "{header}# the host's servers they can reach.\n{text}"
        ));
    }
    match upstream.and_then(reachable_only) {
        Some(text) => SlotDns::Own(format!(
            "{header}# systemd-resolved's upstream servers.\n{text}"
        )),
        None => SlotDns::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reachable_servers_keep_the_hosts_file() {
        assert_eq!(
            slot_dns("nameserver 10.0.0.2\nsearch x\n", None),
            SlotDns::Host
        );
    }

    #[test]
    fn a_loopback_resolver_gives_way_to_the_upstream_servers() {
        let host = "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch lan\n";
        let upstream = "# This is /run/systemd/resolve/resolv.conf\nnameserver 192.0.2.53\n\
                        nameserver fe80::1%eth0\nsearch lan\n";
        let SlotDns::Own(text) = slot_dns(host, Some(upstream)) else {
            panic!("no own file");
        };
        assert!(text.contains("nameserver 192.0.2.53\n"), "{text}");
        assert!(
            !text.contains("127.0.0.53") && !text.contains("fe80"),
            "{text}"
        );
        assert!(text.contains("search lan"), "{text}");
    }

    #[test]
    fn loopback_and_ipv6_servers_are_dropped_from_a_mixed_file() {
        let host = "nameserver 127.0.0.1\nnameserver ::1\nnameserver 2001:db8::53\n\
                    nameserver 198.51.100.7\n";
        assert_eq!(
            slot_dns(host, None),
            SlotDns::Own(
                "# Made by slotpool-agent for the slots' network namespaces, which do not \
                 reach the host's loopback:\n# the host's servers they can reach.\n\
                 nameserver 198.51.100.7\n"
                    .into()
            )
        );
    }

    #[test]
    fn no_reachable_server_anywhere_is_said() {
        assert_eq!(
            slot_dns("nameserver 127.0.0.53\n", Some("nameserver 127.0.0.1\n")),
            SlotDns::Unreachable
        );
        assert_eq!(
            slot_dns("nameserver 127.0.0.53\n", None),
            SlotDns::Unreachable
        );
        assert_eq!(slot_dns("", None), SlotDns::Unreachable);
    }
}
