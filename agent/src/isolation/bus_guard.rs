//! Keeps slot users off the bus. A job in a slot must never talk to NATS: it holds no
//! credential, but an open port is still a door (a server bug, a misconfigured
//! permission, a credential leaked elsewhere). In users mode the agent installs an
//! nftables table of its own that rejects every TCP connection from the slot uid range to
//! the port of each of its NATS URLs, on any address, and removes the table when it
//! stops. One table per agent (`slotpool_<namespace>`), replaced as a whole in one nft
//! transaction, so a restarted agent never stacks rules and agents never touch each
//! other's.
//!
//! The same table closes the cloud's instance metadata service ([`METADATA_V4`],
//! [`METADATA_V6`]) to slot users: on a cloud instance it hands out the instance's user
//! data (which carries this agent's secret and bus credential, docs/providers.md) and the
//! instance role's credentials to any local process that asks.

use std::io::Write;
use std::process::{Command, Stdio};

/// The port a NATS URL without one uses.
const NATS_DEFAULT_PORT: u16 = 4222;
/// The instance metadata service's address on EC2 (and GCE, Azure, OpenStack).
pub const METADATA_V4: &str = "169.254.169.254";
/// EC2's metadata service on IPv6.
pub const METADATA_V6: &str = "fd00:ec2::254";

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("NATS URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "running nft (nftables) to keep slot users off the bus: {0}; install nftables, \
         or start the agent with --bus-guard off"
    )]
    Spawn(std::io::Error),
    #[error("nft refused the bus guard table {table}: {stderr}")]
    Nft { table: String, stderr: String },
}

/// The TCP ports of a comma-separated list of NATS URLs (`nats://h:p`, `tls://h`, `h:p`).
pub fn ports_of(urls: &str) -> Result<Vec<u16>, GuardError> {
    let mut ports = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let bad = |reason: &str| GuardError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let host_port = rest.rsplit_once('@').map_or(rest, |(_, hp)| hp);
        let host_port = host_port.split('/').next().unwrap_or(host_port);
        // `[::1]:4222`, `host:4222`, or a host alone.
        let port = match host_port.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(':') && !port.contains(']') => port
                .parse::<u16>()
                .map_err(|_| bad("the port is not a number from 1 to 65535"))?,
            _ => NATS_DEFAULT_PORT,
        };
        if port == 0 {
            return Err(bad("port 0"));
        }
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    if ports.is_empty() {
        return Err(GuardError::Url {
            url: urls.to_string(),
            reason: "no URL".into(),
        });
    }
    Ok(ports)
}

/// The nft script that (re)creates `table`: a filter on locally made connections that
/// rejects TCP to `ports` (on any address), and anything to the instance metadata
/// service, from uids `first..=last`. Every packet the host sends crosses the output
/// chain: one test of its socket's uid sends only the slots' on to the rules.
pub fn script(table: &str, first: u32, last: u32, ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    format!(
        "add table inet {table}\n\
         delete table inet {table}\n\
         table inet {table} {{\n\
         \x20 chain output {{\n\
         \x20   type filter hook output priority 0; policy accept;\n\
         \x20   meta skuid {first}-{last} jump slot_output\n\
         \x20 }}\n\
         \x20 chain slot_output {{\n\
         \x20   tcp dport {{ {} }} reject with tcp reset\n\
         \x20   ip daddr {METADATA_V4} reject\n\
         \x20   ip6 daddr {METADATA_V6} reject\n\
         \x20 }}\n\
         }}\n",
        ports.join(", ")
    )
}

/// An installed guard; [`BusGuard::remove`] takes it away.
#[derive(Debug)]
pub struct BusGuard {
    table: String,
}

impl BusGuard {
    /// Installs (or replaces) the table.
    pub fn install(
        table: &str,
        first: u32,
        last: u32,
        ports: &[u16],
    ) -> Result<BusGuard, GuardError> {
        nft(table, &script(table, first, last, ports))?;
        tracing::info!(
            table,
            first,
            last,
            ?ports,
            "slot users are kept off the bus (nftables)"
        );
        Ok(BusGuard {
            table: table.to_string(),
        })
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Removes the table (the agent is stopping).
    pub fn remove(self) -> Result<(), GuardError> {
        nft(
            &self.table,
            &format!(
                "add table inet {t}\ndelete table inet {t}\n",
                t = self.table
            ),
        )
    }
}

fn nft(table: &str, script: &str) -> Result<(), GuardError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(GuardError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(GuardError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(GuardError::Spawn)?;
    if !out.status.success() {
        return Err(GuardError::Nft {
            table: table.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_every_url() {
        assert_eq!(ports_of("nats://127.0.0.1:4333").unwrap(), vec![4333]);
        assert_eq!(
            ports_of("tls://a:1, nats://user:pw@b:2,c").unwrap(),
            vec![1, 2, 4222]
        );
        assert_eq!(ports_of("nats://[::1]:7422").unwrap(), vec![7422]);
        assert_eq!(ports_of("nats://[::1]").unwrap(), vec![4222]);
        assert_eq!(ports_of("nats://h:1,nats://i:1").unwrap(), vec![1]);
        let err = ports_of("nats://h:x").unwrap_err().to_string();
        assert!(err.contains("nats://h:x") && err.contains("port"), "{err}");
        assert!(ports_of("").is_err());
    }

    #[test]
    fn the_script_replaces_one_table_and_rejects_only_the_slot_range() {
        let s = script("slotpool_spab12cd34", 2_000_000, 2_999_999, &[4222, 4333]);
        assert!(s.starts_with(
            "add table inet slotpool_spab12cd34\ndelete table inet slotpool_spab12cd34\n"
        ));
        assert!(
            s.contains("meta skuid 2000000-2999999 jump slot_output\n"),
            "{s}"
        );
        assert!(s.contains("policy accept"));
        // The rules are reached only through the uid test.
        let slot_output = &s[s.find("chain slot_output").expect("the slots' chain")..];
        for rule in [
            "tcp dport { 4222, 4333 } reject with tcp reset\n",
            "ip daddr 169.254.169.254 reject\n",
            "ip6 daddr fd00:ec2::254 reject\n",
        ] {
            assert!(slot_output.contains(rule), "{rule}: {s}");
            assert_eq!(s.matches(rule).count(), 1, "{rule}: {s}");
        }
    }

    /// nft itself accepts the script (`nft -c`: checked, not applied).
    #[test]
    fn nft_accepts_the_script() {
        let s = script("slotpool_check", 2_000_000, 2_999_999, &[4222]);
        let mut child = Command::new("nft")
            .args(["-c", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nft (nftables) is needed by this test: apt-get install nftables");
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "nft -c refused the script:\n{s}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
