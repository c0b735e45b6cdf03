//! Optional per-slot network namespace (`--slot-netns on`, users mode; off by default).
//!
//! Without it every slot shares the host's network namespace: a service a job runs on
//! `127.0.0.1` in one slot is reachable from every other slot. With it each slot has a
//! loopback of its own and reaches the outside through the host:
//!
//! - **Namespaces.** At warm-up the agent forks a holder process that becomes the slot
//!   user and unshares a user namespace and a network namespace in one call (the kernel
//!   makes the user namespace first, so it owns the network namespace, and the slot's
//!   uid owns the user namespace). The agent writes the maps (only the slot's uid and gid,
//!   each to itself; `setgroups` denied), bind-mounts `/proc/<holder>/ns/{user,net}` on
//!   `<run-dir>/netns/<namespace>/<slot>.{user,net}` (directory 0700, root) and kills
//!   the holder: the mounts keep the namespaces alive, across agent restarts too.
//! - **Logins.** The agent hands both namespaces to `enter-slot` over the placement
//!   socket (`SCM_RIGHTS`, answer `ok netns`). The helper, running as the slot user, joins
//!   the user namespace (allowed: its uid owns it), then the network namespace (allowed:
//!   the user namespace owns it), then execs the shell; that execve as a non-root uid
//!   drops every capability it had in the user namespace. A helper that was told `ok
//!   netns` but got no namespaces refuses the login. Nobody else can join: setns needs
//!   `CAP_SYS_ADMIN` over the user namespace, which only its owner uid (and root) has.
//! - **Egress.** A veth pair: `eth0` inside (`.2` of the slot's /30 of
//!   `--slot-netns-range`, default route via `.1`), the host end `spn<hash><slot>`. A
//!   table `slotpool_<namespace>_n<slot>` of the slot's own masquerades what the slot
//!   sends out of the host, drops what comes from the veth with another source address or
//!   goes to another slot's /30, and rejects TCP from the veth to the bus ports (input and
//!   forward: traffic of the namespace does not pass the host's output hook, where the
//!   agent's bus guard keys on the uid). The agent turns `net.ipv4.ip_forward` on (and
//!   never back off).
//! - **Release** removes the table, the veth and the mounts, and checks that neither
//!   the veth nor the mount points are left; what could not be removed makes the slot
//!   dirty.

use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Each slot gets a /30: network, host end, slot end, broadcast.
const ADDRESSES_PER_SLOT: u32 = 4;
/// Default `--slot-netns-range`.
pub const DEFAULT_RANGE: &str = "10.213.0.0/16";
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// An IPv4 block the slots' /30s are cut from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressRange {
    pub base: Ipv4Addr,
    pub prefix: u8,
}

impl AddressRange {
    /// Parses `A.B.C.D/N` (host bits must be zero, N from 8 to 30).
    pub fn parse(text: &str) -> Result<AddressRange, String> {
        let (addr, prefix) = text
            .split_once('/')
            .ok_or_else(|| format!("{text:?}: expected A.B.C.D/N"))?;
        let base: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{text:?}: {addr:?} is not an IPv4 address"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| (8..=30).contains(p))
            .ok_or_else(|| format!("{text:?}: the prefix length must be 8 to 30"))?;
        if u32::from(base) & !mask(prefix) != 0 {
            return Err(format!("{text:?}: host bits are set"));
        }
        Ok(AddressRange { base, prefix })
    }

    /// How many slots the range holds.
    pub fn capacity(&self) -> u32 {
        (1u32 << (32 - self.prefix)) / ADDRESSES_PER_SLOT
    }

    /// The host end and the slot end of `slot`'s /30, if the range holds it.
    pub fn slot_addresses(&self, slot: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
        if slot >= self.capacity() {
            return None;
        }
        let net = u32::from(self.base) + slot * ADDRESSES_PER_SLOT;
        Some((Ipv4Addr::from(net + 1), Ipv4Addr::from(net + 2)))
    }
}

impl std::fmt::Display for AddressRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

fn mask(prefix: u8) -> u32 {
    u32::MAX << (32 - u32::from(prefix))
}

/// A step of setting up or removing a slot's namespace that failed.
#[derive(Debug, thiserror::Error)]
#[error("{action}: {reason}")]
pub struct NetnsError {
    pub action: String,
    pub reason: String,
}

fn fail(action: impl Into<String>) -> impl FnOnce(String) -> NetnsError {
    let action = action.into();
    move |reason| NetnsError { action, reason }
}

/// What one slot's namespace is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotNetNames {
    pub user_ns: PathBuf,
    pub net_ns: PathBuf,
    /// The host end of the veth pair.
    pub veth: String,
    /// The slot's nftables table.
    pub table: String,
    pub host_addr: Ipv4Addr,
    pub slot_addr: Ipv4Addr,
}

/// The per-slot network namespaces of one agent.
#[derive(Clone, Debug)]
pub struct SlotNetworks {
    dir: PathBuf,
    namespace: String,
    range: AddressRange,
    /// TCP ports the slots may not reach (the bus); empty with the bus guard off.
    bus_ports: Vec<u16>,
}

impl SlotNetworks {
    /// Uses (and creates, 0700) `dir` for the namespace mounts and turns IPv4 forwarding
    /// on.
    pub fn new(
        dir: PathBuf,
        namespace: String,
        range: AddressRange,
        bus_ports: Vec<u16>,
    ) -> Result<SlotNetworks, NetnsError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| fail(format!("creating {}", dir.display()))(e.to_string()))?;
        let forward = fs::read_to_string(IP_FORWARD).unwrap_or_default();
        if forward.trim() != "1" {
            fs::write(IP_FORWARD, "1\n").map_err(|e| {
                fail(format!("writing 1 to {IP_FORWARD}"))(format!(
                    "{e}; slots reach out through the host only if it forwards: set \
                     net.ipv4.ip_forward = 1 (sysctl) before starting the agent"
                ))
            })?;
            tracing::warn!(
                "turned net.ipv4.ip_forward on: slot namespaces reach out through the host"
            );
        }
        Ok(SlotNetworks {
            dir,
            namespace,
            range,
            bus_ports,
        })
    }

    pub fn names(&self, slot: u32) -> Option<SlotNetNames> {
        let (host_addr, slot_addr) = self.range.slot_addresses(slot)?;
        Some(SlotNetNames {
            user_ns: self.dir.join(format!("{slot}.user")),
            net_ns: self.dir.join(format!("{slot}.net")),
            veth: veth_name(&self.namespace, slot),
            table: format!("slotpool_{}_n{slot}", self.namespace),
            host_addr,
            slot_addr,
        })
    }

    fn names_or_err(&self, slot: u32) -> Result<SlotNetNames, NetnsError> {
        self.names(slot).ok_or_else(|| NetnsError {
            action: format!("addressing slot {slot}"),
            reason: format!("--slot-netns-range {} has no room for it", self.range),
        })
    }

    /// Makes the slot's namespaces for the user `uid`/`gid`; on failure removes what was
    /// made.
    pub fn create(&self, slot: u32, uid: u32, gid: u32) -> Result<(), NetnsError> {
        let names = self.names_or_err(slot)?;
        let result = self.try_create(&names, uid, gid);
        if result.is_err() {
            let _ = self.remove(slot);
        }
        result
    }

    fn try_create(&self, n: &SlotNetNames, uid: u32, gid: u32) -> Result<(), NetnsError> {
        for file in [&n.user_ns, &n.net_ns] {
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(file)
                .map_err(|e| fail(format!("creating {}", file.display()))(e.to_string()))?;
        }
        let mut holder = Command::new("sleep");
        holder
            .arg("600")
            .uid(uid)
            .gid(gid)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only the async-signal-safe unshare(2) runs between fork and exec.
        unsafe {
            holder.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = holder.spawn().map_err(|e| {
            fail(format!(
                "making the user and network namespace of uid {uid}"
            ))(e.to_string())
        })?;
        let made = self.set_up(n, child.id(), uid, gid);
        let _ = child.kill();
        let _ = child.wait();
        made
    }

    fn set_up(&self, n: &SlotNetNames, pid: u32, uid: u32, gid: u32) -> Result<(), NetnsError> {
        let proc = PathBuf::from(format!("/proc/{pid}"));
        for (file, text) in [
            ("uid_map", format!("{uid} {uid} 1\n")),
            ("setgroups", "deny\n".to_string()),
            ("gid_map", format!("{gid} {gid} 1\n")),
        ] {
            let path = proc.join(file);
            fs::write(&path, &text).map_err(|e| {
                fail(format!("writing {:?} to {}", text.trim(), path.display()))(e.to_string())
            })?;
        }
        for (kind, file) in [("user", &n.user_ns), ("net", &n.net_ns)] {
            let source = proc.join("ns").join(kind);
            rustix::mount::mount_bind(&source, file).map_err(|e| {
                fail(format!(
                    "bind-mounting {} on {}",
                    source.display(),
                    file.display()
                ))(e.to_string())
            })?;
        }
        let pid = pid.to_string();
        run(
            Command::new("ip").args([
                "link", "add", &n.veth, "type", "veth", "peer", "name", "eth0", "netns", &pid,
            ]),
            None,
        )?;
        run(
            Command::new("ip").args(["-batch", "-"]),
            Some(&format!(
                "addr add {}/30 dev {v}\nlink set {v} up\n",
                n.host_addr,
                v = n.veth
            )),
        )?;
        run(
            Command::new("nsenter")
                .arg(format!("--net={}", n.net_ns.display()))
                .args(["ip", "-batch", "-"]),
            Some(&inside_script(n)),
        )?;
        run(
            Command::new("nft").args(["-f", "-"]),
            Some(&table_script(n, self.range, &self.bus_ports)),
        )
    }

    /// Removes everything of the slot's namespace that is there; returns what failed.
    pub fn remove(&self, slot: u32) -> Vec<String> {
        let Some(n) = self.names(slot) else {
            return Vec::new();
        };
        let mut problems = Vec::new();
        let drop_table = format!("add table inet {t}\ndelete table inet {t}\n", t = n.table);
        if let Err(e) = run(Command::new("nft").args(["-f", "-"]), Some(&drop_table)) {
            problems.push(e.to_string());
        }
        if veth_exists(&n.veth) {
            if let Err(e) = run(Command::new("ip").args(["link", "del", &n.veth]), None) {
                problems.push(e.to_string());
            }
        }
        for file in [&n.user_ns, &n.net_ns] {
            match rustix::mount::unmount(file, rustix::mount::UnmountFlags::DETACH) {
                // EINVAL: not a mount point; ENOENT: no file.
                Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => problems.push(format!("unmounting {}: {e}", file.display())),
            }
            match fs::remove_file(file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => problems.push(format!("removing {}: {e}", file.display())),
            }
        }
        problems
    }

    /// What is left of the slot's namespace (after [`SlotNetworks::remove`]).
    pub fn leftovers(&self, slot: u32) -> Vec<String> {
        let Some(n) = self.names(slot) else {
            return Vec::new();
        };
        let mut left = Vec::new();
        if veth_exists(&n.veth) {
            left.push(format!("veth {}", n.veth));
        }
        for file in [&n.user_ns, &n.net_ns] {
            if fs::symlink_metadata(file).is_ok() {
                left.push(format!("namespace mount {}", file.display()));
            }
        }
        left
    }

    /// Whether the slot's namespaces are there (both mounts).
    pub fn exists(&self, slot: u32) -> bool {
        self.open(slot).is_ok()
    }

    /// The slot's user and network namespaces, to hand to a login.
    pub fn open(&self, slot: u32) -> Result<[OwnedFd; 2], NetnsError> {
        let n = self.names_or_err(slot)?;
        let open = |path: &Path| -> Result<OwnedFd, NetnsError> {
            let fd = rustix::fs::open(
                path,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| fail(format!("opening {}", path.display()))(e.to_string()))?;
            // An empty mount point left by a failed set-up is no namespace.
            let is_nsfs = rustix::fs::fstatfs(&fd).is_ok_and(|s| s.f_type == NSFS_MAGIC);
            if !is_nsfs {
                return Err(fail(format!("opening {}", path.display()))(
                    "not a namespace".into(),
                ));
            }
            Ok(fd)
        };
        Ok([open(&n.user_ns)?, open(&n.net_ns)?])
    }
}

/// `statfs` type of the namespace file system.
const NSFS_MAGIC: rustix::fs::FsWord = 0x6e73_6673;

/// The host end's name: at most 15 bytes (`spn`, 8 hex of the namespace's hash, the
/// slot), the same for the same agent namespace and slot.
pub fn veth_name(namespace: &str, slot: u32) -> String {
    use sha2::Digest;
    let hash = hex::encode(sha2::Sha256::digest(namespace.as_bytes()));
    format!("spn{}{slot}", &hash[..8])
}

fn veth_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// `ip -batch` lines run inside the slot's network namespace.
pub fn inside_script(n: &SlotNetNames) -> String {
    format!(
        "link set lo up\naddr add {}/30 dev eth0\nlink set eth0 up\nroute add default via {}\n",
        n.slot_addr, n.host_addr
    )
}

/// The nft script of the slot's table (replacing one left over).
pub fn table_script(n: &SlotNetNames, range: AddressRange, bus_ports: &[u16]) -> String {
    let t = &n.table;
    let v = &n.veth;
    let bus = if bus_ports.is_empty() {
        String::new()
    } else {
        let ports: Vec<String> = bus_ports.iter().map(u16::to_string).collect();
        format!(
            "iifname \"{v}\" tcp dport {{ {} }} reject with tcp reset\n",
            ports.join(", ")
        )
    };
    format!(
        "add table inet {t}\n\
         delete table inet {t}\n\
         table inet {t} {{\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority 0; policy accept;\n\
         \x20   iifname \"{v}\" ip saddr != {slot} drop\n\
         \x20   {bus}\
         \x20 }}\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority 0; policy accept;\n\
         \x20   iifname \"{v}\" ip saddr != {slot} drop\n\
         \x20   iifname \"{v}\" ip daddr {range} drop\n\
         \x20   {bus}\
         \x20 }}\n\
         \x20 chain postrouting {{\n\
         \x20   type nat hook postrouting priority srcnat; policy accept;\n\
         \x20   ip saddr {slot} oifname != \"{v}\" masquerade\n\
         \x20 }}\n\
         }}\n",
        slot = n.slot_addr,
    )
}

/// Runs `cmd` (with `input` on stdin); an error says what it was and what it printed.
fn run(cmd: &mut Command, input: Option<&str>) -> Result<(), NetnsError> {
    let what = format!("{cmd:?}").replace('"', "");
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| fail(what.clone())(e.to_string()))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| fail(what.clone())(e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| fail(what.clone())(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(what)(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_cut_a_slash_30_per_slot() {
        let r = AddressRange::parse("10.213.0.0/16").unwrap();
        assert_eq!(r.capacity(), 16384);
        assert_eq!(
            r.slot_addresses(0),
            Some(("10.213.0.1".parse().unwrap(), "10.213.0.2".parse().unwrap()))
        );
        assert_eq!(
            r.slot_addresses(65),
            Some(("10.213.1.5".parse().unwrap(), "10.213.1.6".parse().unwrap()))
        );
        let small = AddressRange::parse("192.168.7.0/29").unwrap();
        assert_eq!(small.capacity(), 2);
        assert_eq!(small.slot_addresses(2), None);
        assert!(AddressRange::parse("10.0.0.1/16").is_err());
        assert!(AddressRange::parse("10.0.0.0/31").is_err());
        assert!(AddressRange::parse("10.0.0.0").is_err());
        assert!(AddressRange::parse("nope/16").is_err());
    }

    #[test]
    fn veth_names_fit_ifnamsiz_and_differ_by_agent() {
        let a = veth_name("spab12cd34", 9999);
        assert!(a.len() <= 15, "{a}");
        assert!(a.starts_with("spn") && a.ends_with("9999"));
        assert_ne!(veth_name("spab12cd34", 1), veth_name("spab12cd35", 1));
    }

    #[test]
    fn the_table_guards_the_bus_and_other_slots_and_masquerades() {
        let nets = SlotNetworks {
            dir: PathBuf::from("/run/x"),
            namespace: "spab12cd34".into(),
            range: AddressRange::parse("10.9.0.0/24").unwrap(),
            bus_ports: vec![4222, 7422],
        };
        let n = nets.names(1).unwrap();
        assert_eq!(n.table, "slotpool_spab12cd34_n1");
        assert_eq!(n.user_ns, PathBuf::from("/run/x/1.user"));
        let s = table_script(&n, nets.range, &nets.bus_ports);
        assert!(s.starts_with(&format!(
            "add table inet {t}\ndelete table inet {t}\n",
            t = n.table
        )));
        let v = &n.veth;
        assert_eq!(
            s.matches(&format!(
                "iifname \"{v}\" tcp dport {{ 4222, 7422 }} reject with tcp reset"
            ))
            .count(),
            2,
            "{s}"
        );
        assert!(s.contains(&format!("iifname \"{v}\" ip daddr 10.9.0.0/24 drop")));
        assert!(s.contains(&format!("iifname \"{v}\" ip saddr != 10.9.0.6 drop")));
        assert!(s.contains(&format!("ip saddr 10.9.0.6 oifname != \"{v}\" masquerade")));
        let no_bus = table_script(&n, nets.range, &[]);
        assert!(!no_bus.contains("dport"), "{no_bus}");
        assert_eq!(
            inside_script(&n),
            "link set lo up\naddr add 10.9.0.6/30 dev eth0\nlink set eth0 up\n\
             route add default via 10.9.0.5\n"
        );
    }
}
