//! A network namespace per slot (`--slot-netns`, users mode; on by default, see
//! docs/slot-network.md).
//!
//! Without it every slot shares the host's network namespace: a service a job runs on
//! `127.0.0.1` in one slot is reachable from every other slot. With it each slot has a
//! loopback of its own and reaches the outside through the host:
//!
//! - **The namespace.** The first warm-up of a slot makes it: the agent starts a holder
//!   process that unshares a network namespace (owned by the host's user namespace: no
//!   process of a slot has any capability in it, so no job changes its addresses, routes
//!   or settings), bind-mounts `/proc/<holder>/ns/net` on
//!   `<run-dir>/netns/<namespace>/<slot>.net` (directory 0700, root) and kills the
//!   holder: the mount keeps the namespace alive, across agent restarts too. It is the
//!   slot's for as long as the slot exists: every later tenancy finds it made. What a
//!   tenancy leaves in it goes with the tenancy's processes, which release kills (their
//!   sockets with them; connections they closed last may wait out TCP's `TIME_WAIT`, as
//!   on any host). Making and removing a namespace and its veth pair cost more than
//!   everything else of a tenancy (docs/benchmarks.md).
//! - **Logins** are started inside it by the agent, as root, before they become the slot
//!   user ([`crate::isolation::start`]); nobody else can join it: setns needs
//!   `CAP_SYS_ADMIN` over the host's user namespace.
//! - **Egress.** A veth pair: `eth0` inside (`.2` of the slot's /30 of
//!   `--slot-netns-range`, default route via `.1`), the host end `spn<hash><slot>`,
//!   both set up by the agent over route-netlink ([`crate::isolation::rtnl`]). One
//!   table per agent, `slotpool_<namespace>_slotnet` ([`agent_table_script`]), written
//!   once when the agent starts and covering every slot it has (sets keyed by veth name
//!   and slot address), masquerades what a slot sends out of the host, drops what comes
//!   from a slot's veth with another source address than the slot's or goes anywhere in
//!   the range (another slot's /30, another agent's), and rejects TCP from the slots'
//!   veths to the bus ports (input and forward: traffic of the namespace does not pass
//!   the host's output hook, where the agent's bus guard keys on the uid), and the
//!   instance metadata service with them. Its rules match only the agent's own veths,
//!   which exist only while their slot is warm or prepared, so warm-ups and releases
//!   touch no nftables at all. The agent turns `net.ipv4.ip_forward` on (and
//!   never back off), with a filter that forwards nothing else ([`ensure_forwarding`]).
//! - **Addresses**: each agent numbers its slots from a block of the range of its own
//!   ([`crate::isolation::netns_blocks`], the address plan).
//! - **Release** keeps the namespace and its veth pair for the slot's next tenancy.
//!   Removing a slot (destroyed, dirty, or the agent removing its slots) deletes the veth
//!   and unmounts the namespace, and checks that neither the slot's veth name nor a mount
//!   point is left; what could not be removed makes the slot dirty. The agent's table
//!   stays while the agent runs; removing every slot ([`SlotNetworks::close`]) removes it.

use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::isolation::bus_guard::METADATA_V4;
use crate::isolation::private_tmp::Holder;
use crate::isolation::rtnl::{Rtnl, LOOPBACK_INDEX};
use crate::step_clock::StepClock;

pub use crate::isolation::netns_blocks::{AddressRange, DEFAULT_RANGE};

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";
/// The table holding the forward filter an agent installs when it turns forwarding on.
pub const FORWARD_TABLE: &str = "slotpool_forward";

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
    /// The user namespace earlier agents made each slot's network namespace in (owned by
    /// the tenancy's uid): such a namespace is removed, and made anew, where found.
    pub user_ns: PathBuf,
    pub net_ns: PathBuf,
    /// The host end of the veth pair.
    pub veth: String,
    pub host_addr: Ipv4Addr,
    pub slot_addr: Ipv4Addr,
}

/// The per-slot network namespaces of one agent.
#[derive(Clone, Debug)]
pub struct SlotNetworks {
    dir: PathBuf,
    namespace: String,
    /// `--slot-netns-range`, shared by every agent of the host: no slot reaches into it.
    range: AddressRange,
    /// This agent's block of `range`, its slots' /30s
    /// ([`crate::isolation::netns_blocks`]).
    block: AddressRange,
    /// Holds `block` for as long as the agent runs.
    _claim: Option<std::sync::Arc<crate::isolation::netns_blocks::BlockClaim>>,
    /// TCP ports the slots may not reach (the bus); empty with the bus guard off.
    bus_ports: Vec<u16>,
    /// The namespace (its inode) each slot's file named when this agent last made or
    /// checked it, so that a warm-up finding it kept checks no more than that.
    checked: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<u32, u64>>>,
}

impl SlotNetworks {
    /// Uses (and creates, 0700) `dir` for the namespace mounts, makes sure the host
    /// forwards the slots' traffic ([`ensure_forwarding`]) and claims a block of `range`
    /// for `slots` slots in `claims_dir`.
    pub fn new(
        dir: PathBuf,
        namespace: String,
        range: AddressRange,
        slots: u32,
        claims_dir: &Path,
        bus_ports: Vec<u16>,
    ) -> Result<SlotNetworks, NetnsError> {
        crate::isolation::create_private_dir_all(&dir)
            .map_err(|e| fail(format!("creating {}", dir.display()))(e.to_string()))?;
        ensure_forwarding()?;
        let claim =
            crate::isolation::netns_blocks::claim_block(claims_dir, range, slots, &namespace)
                .map_err(|e| NetnsError {
                    action: e.action,
                    reason: e.reason,
                })?;
        tracing::info!(
            block = %claim.block,
            %range,
            again = claim.reused,
            "slot network namespaces are numbered from this block"
        );
        let networks = SlotNetworks {
            dir,
            namespace,
            range,
            block: claim.block,
            _claim: Some(std::sync::Arc::new(claim)),
            bus_ports,
            checked: Default::default(),
        };
        let slots: Vec<SlotNetNames> = (0..slots).filter_map(|s| networks.names(s)).collect();
        let script = agent_table_script(
            &networks.table(),
            &legacy_tables(&networks.namespace, slots.len() as u32),
            &slots,
            networks.range,
            &networks.bus_ports,
        );
        run(Command::new("nft").args(["-f", "-"]), Some(&script))?;
        tracing::info!(
            table = networks.table(),
            "the slots' nftables table is installed"
        );
        Ok(networks)
    }

    /// The agent's nftables table of its slots' traffic ([`agent_table_script`]).
    pub fn table(&self) -> String {
        format!("slotpool_{}_slotnet", self.namespace)
    }

    /// Removes the agent's table (every slot is removed; the agent is stopping).
    pub fn close(&self) -> Result<(), NetnsError> {
        run(
            Command::new("nft").args(["-f", "-"]),
            Some(&format!(
                "add table inet {t}\ndelete table inet {t}\n",
                t = self.table()
            )),
        )
    }

    /// This agent's block of `--slot-netns-range`.
    pub fn block(&self) -> AddressRange {
        self.block
    }

    pub fn names(&self, slot: u32) -> Option<SlotNetNames> {
        let (host_addr, slot_addr) = self.block.slot_addresses(slot)?;
        Some(SlotNetNames {
            user_ns: self.dir.join(format!("{slot}.user")),
            net_ns: self.dir.join(format!("{slot}.net")),
            veth: veth_name(&self.namespace, slot),
            host_addr,
            slot_addr,
        })
    }

    fn names_or_err(&self, slot: u32) -> Result<SlotNetNames, NetnsError> {
        self.names(slot).ok_or_else(|| NetnsError {
            action: format!("addressing slot {slot}"),
            reason: format!("the agent's block {} has no room for it", self.block),
        })
    }

    /// Makes the slot's namespace unless it has one (kept from its last tenancy); on
    /// failure removes what was made.
    pub fn create(&self, slot: u32) -> Result<(), NetnsError> {
        self.create_timed(slot, &mut StepClock::start())
    }

    /// [`SlotNetworks::create`], each step noted on `clock`.
    pub fn create_timed(&self, slot: u32, clock: &mut StepClock) -> Result<(), NetnsError> {
        let names = self.names_or_err(slot)?;
        if self.kept(slot, &names) {
            clock.lap("netns_kept");
            return Ok(());
        }
        // Whatever is left of one (an older agent's, or half made): gone first.
        let problems = self.remove(slot);
        if !problems.is_empty() {
            return Err(fail(format!(
                "removing what is left of slot {slot}'s namespace"
            ))(problems.join("; ")));
        }
        let result = self.try_create(&names, clock);
        match &result {
            Ok(()) => {
                if let Ok(st) = rustix::fs::stat(&names.net_ns) {
                    self.checked().insert(slot, st.st_ino);
                }
            }
            Err(_) => {
                let _ = self.remove(slot);
            }
        }
        result
    }

    /// Whether the slot has its namespace, as this agent makes it (not the host's, no
    /// user namespace beside it, the slot's end of the veth in it), and its veth. The
    /// namespace this agent made or checked last is known by its inode.
    fn kept(&self, slot: u32, n: &SlotNetNames) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(net) = open_ns(&n.net_ns) else {
            return false;
        };
        let Ok(inode) = rustix::fs::fstat(&net).map(|st| st.st_ino) else {
            return false;
        };
        if !veth_exists(&n.veth) || fs::symlink_metadata(&n.user_ns).is_ok() {
            return false;
        }
        if self.checked().get(&slot) == Some(&inode) {
            return true;
        }
        let host = fs::metadata("/proc/self/ns/net").map(|m| m.ino()).ok();
        let ours = Some(inode) != host
            && Rtnl::open_in(net.as_fd())
                .and_then(|mut inside| inside.index(SLOT_LINK))
                .is_ok();
        if ours {
            self.checked().insert(slot, inode);
        }
        ours
    }

    fn checked(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u32, u64>> {
        self.checked.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn try_create(&self, n: &SlotNetNames, clock: &mut StepClock) -> Result<(), NetnsError> {
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&n.net_ns)
            .map_err(|e| fail(format!("creating {}", n.net_ns.display()))(e.to_string()))?;
        // The holder, still root, makes the namespace: a child of the agent that runs no
        // other program.
        let mut steps = || -> std::io::Result<()> {
            // SAFETY: a plain system call, async-signal-safe.
            match unsafe { libc::unshare(libc::CLONE_NEWNET) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        };
        // SAFETY: the steps make only an async-signal-safe system call.
        let holder = unsafe { Holder::spawn(&mut steps) }
            .map_err(|e| fail("making a network namespace")(e.to_string()))?;
        clock.lap("netns_holder");
        self.set_up(n, holder.id(), clock)
    }

    fn set_up(&self, n: &SlotNetNames, pid: u32, clock: &mut StepClock) -> Result<(), NetnsError> {
        let source = PathBuf::from(format!("/proc/{pid}/ns/net"));
        rustix::mount::mount_bind(&source, &n.net_ns).map_err(|e| {
            fail(format!(
                "bind-mounting {} on {}",
                source.display(),
                n.net_ns.display()
            ))(e.to_string())
        })?;
        clock.lap("netns_mounts");
        // A veth still under the slot's name (one a removal could not delete) goes
        // first. The kernel may take it meanwhile: its name is free before its entry in
        // /sys goes.
        let mut host =
            Rtnl::open().map_err(|e| fail("opening a route-netlink socket")(e.to_string()))?;
        if veth_exists(&n.veth) {
            delete_veth(&mut host, &n.veth)?;
        }
        let host_end = (|| {
            host.add_veth(&n.veth, SLOT_LINK, pid)?;
            let index = host.index(&n.veth)?;
            host.add_address(index, n.host_addr, SLOT_PREFIX)
        })();
        clock.lap("netns_host_end");
        host_end.map_err(|e| {
            fail(format!(
                "adding the veth pair {} ({SLOT_LINK} in the namespace of pid {pid}), {}/{SLOT_PREFIX}",
                n.veth, n.host_addr
            ))(e.to_string())
        })?;
        let net_ns = open_ns(&n.net_ns)?;
        let inside = (|| {
            let mut inside = Rtnl::open_in(net_ns.as_fd())?;
            inside.set_up(LOOPBACK_INDEX)?;
            let index = inside.index(SLOT_LINK)?;
            inside.add_address(index, n.slot_addr, SLOT_PREFIX)?;
            inside.set_up(index)?;
            inside.add_default_route(n.host_addr)
        })();
        clock.lap("netns_inside");
        inside.map_err(|e| {
            fail(format!(
                "setting up lo and {SLOT_LINK} ({}/{SLOT_PREFIX}, default route via {}) in {}",
                n.slot_addr,
                n.host_addr,
                n.net_ns.display()
            ))(e.to_string())
        })
    }

    /// Removes everything of the slot's namespace that is there; returns what failed.
    pub fn remove(&self, slot: u32) -> Vec<String> {
        self.checked().remove(&slot);
        let Some(n) = self.names(slot) else {
            return Vec::new();
        };
        let mut problems = Vec::new();
        if veth_exists(&n.veth) {
            let removed = Rtnl::open()
                .map_err(|e| fail("opening a route-netlink socket")(e.to_string()))
                .and_then(|mut host| delete_veth(&mut host, &n.veth));
            if let Err(e) = removed {
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

    /// What is left of the slot's namespace after [`SlotNetworks::remove`].
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

    /// Whether the slot's namespace is there.
    pub fn exists(&self, slot: u32) -> bool {
        self.open(slot).is_ok()
    }

    /// The slot's network namespace, for a login to join.
    pub fn open(&self, slot: u32) -> Result<OwnedFd, NetnsError> {
        open_ns(&self.names_or_err(slot)?.net_ns)
    }
}

/// How the host came to forward the slots' traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forwarding {
    /// `net.ipv4.ip_forward` was 1 and no slotpool filter is there: the host routed
    /// before (Docker, a router); its own firewall decides, the agent adds no filter.
    HostRoutes,
    /// Forwarding is on with slotpool's filter ([`forward_filter_script`]): turned on by
    /// this agent now, or by an agent before.
    SlotsOnly,
}

/// Makes sure IPv4 forwarding is on. When it is off, first installs the filter that
/// forwards nothing but slot traffic ([`forward_filter_script`]), then turns it on; a
/// filter an agent installed before is kept (and renewed). Forwarding is never turned
/// back off, and the filter stays with it.
///
/// IPv4 decides forwarding by the flag of the interface a packet comes in on, so the
/// replies arriving on the uplink need `all` forwarding, not only the veths': hence the
/// host-wide `net.ipv4.ip_forward` and the filter beside it.
pub fn ensure_forwarding() -> Result<Forwarding, NetnsError> {
    let forward = fs::read_to_string(IP_FORWARD).unwrap_or_default();
    let filter_there = Command::new("nft")
        .args(["list", "table", "ip", FORWARD_TABLE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if forward.trim() == "1" && !filter_there {
        tracing::info!(
            "the host forwards IPv4 already: its own firewall decides what it forwards \
             besides the slots' traffic"
        );
        return Ok(Forwarding::HostRoutes);
    }
    run(
        Command::new("nft").args(["-f", "-"]),
        Some(&forward_filter_script()),
    )?;
    if forward.trim() != "1" {
        if let Err(e) = fs::write(IP_FORWARD, "1\n") {
            let _ = Command::new("nft")
                .args(["delete", "table", "ip", FORWARD_TABLE])
                .status();
            return Err(fail(format!("writing 1 to {IP_FORWARD}"))(format!(
                "{e}; slots reach out through the host only if it forwards: set \
                 net.ipv4.ip_forward = 1 (sysctl) before starting the agent, or let it \
                 write the file (or pass --slot-netns off)"
            )));
        }
        tracing::warn!(
            table = FORWARD_TABLE,
            "turned net.ipv4.ip_forward on, with a filter forwarding only the slots' traffic"
        );
    }
    Ok(Forwarding::SlotsOnly)
}

/// The nft script of the forward filter: forward what comes from a slot's veth (every
/// agent's, `spn*`; each agent's slot table then restricts it) and the replies to it, drop
/// every other forwarded IPv4 packet. IPv4 only (`ip` family): IPv6 forwarding is not
/// touched.
pub fn forward_filter_script() -> String {
    format!(
        "add table ip {t}\n\
         delete table ip {t}\n\
         table ip {t} {{\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority 0; policy drop;\n\
         \x20   iifname \"{VETH_PREFIX}*\" accept\n\
         \x20   oifname \"{VETH_PREFIX}*\" ct state established,related accept\n\
         \x20 }}\n\
         }}\n",
        t = FORWARD_TABLE
    )
}

/// What the host end of every slot's veth is named with.
pub const VETH_PREFIX: &str = "spn";

/// Opens the namespace file `path` ([`super::nsfs::open`]).
fn open_ns(path: &Path) -> Result<OwnedFd, NetnsError> {
    super::nsfs::open(path).map_err(|(action, reason)| NetnsError { action, reason })
}

/// The host end's name: at most 15 bytes (`spn`, 8 hex of the namespace's hash, the
/// slot), the same for the same agent namespace and slot.
pub fn veth_name(namespace: &str, slot: u32) -> String {
    use sha2::Digest;
    let hash = hex::encode(sha2::Sha256::digest(namespace.as_bytes()));
    format!("{VETH_PREFIX}{}{slot}", &hash[..8])
}

fn veth_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// The slot's end of its veth pair, inside its network namespace.
pub const SLOT_LINK: &str = "eth0";
/// Each slot's link is a /30: the host's end, the slot's end.
const SLOT_PREFIX: u8 = 30;

/// Deletes the veth `name` (and its peer); one already gone is no error.
fn delete_veth(host: &mut Rtnl, name: &str) -> Result<(), NetnsError> {
    match host.delete_link(name) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(fail(format!("deleting the veth {name}"))(e.to_string()))
        }
        _ => Ok(()),
    }
}

/// The per-slot tables (`slotpool_<namespace>_n<slot>`) agents made before the agent's
/// table replaced them: removed with the agent's table written, so an agent upgraded with
/// warm slots keeps no stale copy.
fn legacy_tables(namespace: &str, slots: u32) -> Vec<String> {
    (0..slots)
        .map(|slot| format!("slotpool_{namespace}_n{slot}"))
        .collect()
}

/// The nft script of the agent's table `table` over its `slots` (replacing one left
/// over, and removing the tables named in `remove`), in one transaction. For each slot's
/// veth: traffic whose source address is not the slot's is dropped (input and forward),
/// traffic to anywhere in `range` is not forwarded, and what the slot sends out of the
/// host is masqueraded. With the bus guard on (`bus_ports` not empty) it also closes the
/// bus ports and the instance metadata service to the slots, as the guard does for slot
/// uids in the host's namespace ([`crate::isolation::bus_guard`]): the slots' traffic is
/// forwarded, past the uid rule. The input and forward chains, which every packet the
/// host gets or forwards crosses, test only whether it came from a slot's veth; the
/// rules are in the chains they jump to.
pub fn agent_table_script(
    table: &str,
    remove: &[String],
    slots: &[SlotNetNames],
    range: AddressRange,
    bus_ports: &[u16],
) -> String {
    let t = table;
    let list = |items: Vec<String>| {
        if items.is_empty() {
            String::new()
        } else {
            format!(" elements = {{ {} }};", items.join(", "))
        }
    };
    let ifs = list(slots.iter().map(|n| format!("\"{}\"", n.veth)).collect());
    let addrs = list(slots.iter().map(|n| n.slot_addr.to_string()).collect());
    let pairs = list(
        slots
            .iter()
            .map(|n| format!("\"{}\" . {}", n.veth, n.slot_addr))
            .collect(),
    );
    let bus = if bus_ports.is_empty() {
        String::new()
    } else {
        let ports: Vec<String> = bus_ports.iter().map(u16::to_string).collect();
        format!(
            "tcp dport {{ {} }} reject with tcp reset\n\
             \x20   ip daddr {METADATA_V4} reject\n",
            ports.join(", ")
        )
    };
    let mut script = String::new();
    for old in remove.iter().map(String::as_str).chain([t]) {
        script.push_str(&format!("add table inet {old}\ndelete table inet {old}\n"));
    }
    script.push_str(&format!(
        "table inet {t} {{\n\
         \x20 set slot_ifs {{ type ifname;{ifs} }}\n\
         \x20 set slot_addrs {{ type ipv4_addr;{addrs} }}\n\
         \x20 set slot_pairs {{ type ifname . ipv4_addr;{pairs} }}\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority 0; policy accept;\n\
         \x20   iifname @slot_ifs jump slot_input\n\
         \x20 }}\n\
         \x20 chain slot_input {{\n\
         \x20   iifname . ip saddr != @slot_pairs drop\n\
         \x20   {bus}\
         \x20 }}\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority 0; policy accept;\n\
         \x20   iifname @slot_ifs jump slot_forward\n\
         \x20 }}\n\
         \x20 chain slot_forward {{\n\
         \x20   iifname . ip saddr != @slot_pairs drop\n\
         \x20   ip daddr {range} drop\n\
         \x20   {bus}\
         \x20 }}\n\
         \x20 chain postrouting {{\n\
         \x20   type nat hook postrouting priority srcnat; policy accept;\n\
         \x20   ip saddr @slot_addrs oifname . ip saddr != @slot_pairs masquerade\n\
         \x20 }}\n\
         }}\n"
    ));
    script
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

    /// Runs `script` (`ip -batch`) in the network namespace of `pid`.
    fn ip_in(pid: u32, script: &str) {
        run(
            Command::new("nsenter")
                .arg(format!("--net=/proc/{pid}/ns/net"))
                .args(["ip", "-batch", "-"]),
            Some(script),
        )
        .unwrap();
    }

    /// Calls `f` on a thread of its own in the network namespace of `pid`.
    fn in_netns<T: Send + 'static>(pid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            let ns = fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
            rustix::thread::move_into_link_name_space(
                AsFd::as_fd(&ns),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .unwrap();
            f()
        })
        .join()
        .unwrap()
    }

    /// A process in a network namespace of its own, made from this thread's.
    fn hold(name: &str) -> std::process::Child {
        let child = Command::new("unshare")
            .args(["-n", "sleep", "60"])
            .spawn()
            .unwrap();
        // Wait until the child has its own namespace.
        let mine = fs::read_link("/proc/thread-self/ns/net").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while fs::read_link(format!("/proc/{}/ns/net", child.id())).ok() == Some(mine.clone()) {
            assert!(
                std::time::Instant::now() < deadline,
                "{name} has no namespace"
            );
            std::thread::yield_now();
        }
        child
    }

    /// Joins this thread's namespace to that of `pid` by a veth pair: `veth` here with
    /// `<net>.1/30`, `eth0` there with `<net>.2/30` and a default route back.
    fn link(veth: &str, pid: u32, net: &str) {
        link_at(veth, pid, &format!("{net}.1"), &format!("{net}.2"));
    }

    /// [`link`] with the two ends' addresses (of one /30) given.
    fn link_at(veth: &str, pid: u32, here: &str, there: &str) {
        run(
            Command::new("ip").args([
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &pid.to_string(),
            ]),
            None,
        )
        .unwrap();
        run(
            Command::new("ip").args(["-batch", "-"]),
            Some(&format!(
                "addr add {here}/30 dev {veth}\nlink set {veth} up\n"
            )),
        )
        .unwrap();
        ip_in(
            pid,
            &format!(
                "link set lo up\naddr add {there}/30 dev eth0\nlink set eth0 up\n\
                 route add default via {here}\n"
            ),
        );
    }

    fn listen(pid: u32, addr: &'static str) -> std::net::TcpListener {
        in_netns(pid, move || std::net::TcpListener::bind(addr).unwrap())
    }

    /// `connected`, or why not, within half a second.
    fn connect(pid: u32, to: std::net::SocketAddr) -> String {
        in_netns(pid, move || {
            std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(500))
                .map(|_| "connected".to_string())
                .unwrap_or_else(|e| e.to_string())
        })
    }

    /// [`connect`] from the source address `from` (which the namespace must have).
    fn connect_from(pid: u32, from: Ipv4Addr, to: std::net::SocketAddr) -> String {
        use rustix::net::{sockopt, AddressFamily, SocketType};
        in_netns(pid, move || {
            let attempt = || -> rustix::io::Result<()> {
                let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None)?;
                // A connect waits at most the send timeout.
                sockopt::set_socket_timeout(
                    &fd,
                    sockopt::Timeout::Send,
                    Some(std::time::Duration::from_millis(500)),
                )?;
                rustix::net::bind(&fd, &std::net::SocketAddr::from((from, 0)))?;
                rustix::net::connect(&fd, &to)
            };
            match attempt() {
                Ok(()) => "connected".to_string(),
                // What connect(2) says when the send timeout ends it.
                Err(rustix::io::Errno::INPROGRESS) => "connection timed out".to_string(),
                Err(e) => e.to_string(),
            }
        })
    }

    /// The agent's table keeps its slots off the instance metadata service (which their
    /// forwarded traffic would otherwise reach past the uid-keyed bus guard), off each
    /// other, and from sending with an address not their own: in a network namespace of
    /// the test's standing for the host, with two slots and a "world" namespace answering
    /// on 169.254.169.254, slot 0 reaches the world from its address and nothing else;
    /// the same table without the bus guard's rules lets it reach the metadata service,
    /// and without the table everything connects.
    #[test]
    fn the_agents_table_keeps_slots_off_the_metadata_service_and_each_other() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let got = std::thread::spawn(|| {
            // SAFETY: a new network namespace for this thread only.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
                .unwrap();
            fs::write(IP_FORWARD, "1\n").unwrap();
            let (slot0, slot1, world) = (hold("slot 0"), hold("slot 1"), hold("world"));
            link_at("spnmdtest0", slot0.id(), "10.251.0.1", "10.251.0.2");
            link_at("spnmdtest1", slot1.id(), "10.251.0.5", "10.251.0.6");
            link("wmdtest", world.id(), "10.251.1");
            ip_in(world.id(), "addr add 169.254.169.254/32 dev lo\n");
            // An address that is not the slot's, routed back to it by the host.
            ip_in(slot0.id(), "addr add 10.251.0.9/32 dev eth0\n");
            run(
                Command::new("ip").args(["-batch", "-"]),
                Some(&format!(
                    "route add {METADATA_V4} via 10.251.1.2\n\
                     route add 10.251.0.9/32 dev spnmdtest0\n"
                )),
            )
            .unwrap();
            let listeners = [
                listen(world.id(), "169.254.169.254:0"),
                listen(world.id(), "10.251.1.2:0"),
                listen(slot1.id(), "10.251.0.6:0"),
            ];
            let [metadata, out, neighbour] = listeners.each_ref().map(|l| l.local_addr().unwrap());
            let names = |slot: u32, veth: &str| {
                let (host_addr, slot_addr) = AddressRange::parse("10.251.0.0/24")
                    .unwrap()
                    .slot_addresses(slot)
                    .unwrap();
                SlotNetNames {
                    user_ns: PathBuf::new(),
                    net_ns: PathBuf::new(),
                    veth: veth.into(),
                    host_addr,
                    slot_addr,
                }
            };
            let slots = [names(0, "spnmdtest0"), names(1, "spnmdtest1")];
            let range = AddressRange::parse("10.251.0.0/24").unwrap();
            let table = "slotpool_mdtest_slotnet";
            let mut got = Vec::new();
            for ports in [Some(&[4222][..]), Some(&[]), None] {
                let script = match ports {
                    Some(ports) => agent_table_script(table, &[], &slots, range, ports),
                    None => format!("delete table inet {table}\n"),
                };
                run(Command::new("nft").args(["-f", "-"]), Some(&script)).unwrap();
                let spoofed: Ipv4Addr = "10.251.0.9".parse().unwrap();
                got.push([
                    connect(slot0.id(), metadata),
                    connect(slot0.id(), neighbour),
                    connect_from(slot0.id(), spoofed, out),
                    connect(slot0.id(), out),
                ]);
            }
            for mut child in [slot0, slot1, world] {
                let _ = child.kill();
                let _ = child.wait();
            }
            got
        })
        .join()
        .unwrap();
        for (run, [metadata, neighbour, spoofed, out]) in
            ["with the guard", "without the guard", "without the table"]
                .iter()
                .zip(&got)
        {
            eprintln!(
                "{run}: slot 0 to the metadata service: {metadata}; to slot 1: {neighbour}; \
                 to the world with another address: {spoofed}; from its own: {out}"
            );
        }
        let connected = |r: &[String; 4]| r.clone().map(|c| c == "connected");
        assert_eq!(connected(&got[0]), [false, false, false, true], "{got:?}");
        assert_eq!(connected(&got[1]), [true, false, false, true], "{got:?}");
        // Without the table the test's network connects everything: the refusals above
        // are the table's.
        assert_eq!(connected(&got[2]), [true, true, true, true], "{got:?}");
    }

    /// On a host (a network namespace of the test's) that did not forward, the agent
    /// turns forwarding on with its filter: a slot's veth reaches the world and gets
    /// its replies, while the host forwards nothing between its other interfaces and
    /// nothing new into the slot.
    #[test]
    fn forwarding_turned_on_forwards_only_slot_traffic() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let router = std::thread::spawn(|| {
            // SAFETY: a new network namespace for this thread only; it shares nothing the
            // rest of the test relies on.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
                .unwrap();
            fs::write(IP_FORWARD, "0\n").unwrap();
            let (slot, world, other) = (hold("slot"), hold("world"), hold("other"));
            for (veth, child, net) in [
                ("spntest0", &slot, 0),
                ("wtest", &world, 1),
                ("otest", &other, 2),
            ] {
                link(veth, child.id(), &format!("10.250.{net}"));
            }
            let turned = ensure_forwarding().unwrap();
            let forward = fs::read_to_string(IP_FORWARD).unwrap();
            let world_port = listen(world.id(), "10.250.1.2:0");
            let slot_port = listen(slot.id(), "10.250.0.2:0");
            let results = [
                connect(slot.id(), world_port.local_addr().unwrap()),
                connect(other.id(), world_port.local_addr().unwrap()),
                connect(world.id(), slot_port.local_addr().unwrap()),
            ];
            // Already on with the filter: kept.
            let again = ensure_forwarding().unwrap();
            for mut child in [slot, world, other] {
                let _ = child.kill();
                let _ = child.wait();
            }
            (turned, again, forward, results)
        });
        let (turned, again, forward, [slot_out, other_out, into_slot]) = router.join().unwrap();
        eprintln!(
            "slot to world: {slot_out}; other to world: {other_out}; world to slot: {into_slot}"
        );
        assert_eq!(
            (turned, again),
            (Forwarding::SlotsOnly, Forwarding::SlotsOnly)
        );
        assert_eq!(forward.trim(), "1");
        assert_eq!(slot_out, "connected");
        assert_ne!(
            other_out, "connected",
            "the host forwarded between other interfaces"
        );
        assert_ne!(
            into_slot, "connected",
            "the host forwarded a new connection into a slot"
        );
    }

    /// A host that forwarded before gets no filter from the agent.
    #[test]
    fn a_host_that_routes_already_gets_no_filter() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let (turned, tables) = std::thread::spawn(|| {
            // SAFETY: a new network namespace for this thread only; it shares nothing the
            // rest of the test relies on.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
                .unwrap();
            fs::write(IP_FORWARD, "1\n").unwrap();
            let turned = ensure_forwarding().unwrap();
            let out = Command::new("nft")
                .args(["list", "tables"])
                .output()
                .unwrap();
            (turned, String::from_utf8_lossy(&out.stdout).into_owned())
        })
        .join()
        .unwrap();
        assert_eq!(turned, Forwarding::HostRoutes);
        assert!(!tables.contains(FORWARD_TABLE), "{tables}");
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
            range: AddressRange::parse("10.9.0.0/16").unwrap(),
            block: AddressRange::parse("10.9.0.0/24").unwrap(),
            _claim: None,
            bus_ports: vec![4222, 7422],
            checked: Default::default(),
        };
        let n = nets.names(1).unwrap();
        assert_eq!(nets.table(), "slotpool_spab12cd34_slotnet");
        assert_eq!(n.user_ns, PathBuf::from("/run/x/1.user"));
        let slots = [nets.names(0).unwrap(), n.clone()];
        let old = legacy_tables("spab12cd34", 2);
        let s = agent_table_script(&nets.table(), &old, &slots, nets.range, &nets.bus_ports);
        assert!(s.starts_with(
            "add table inet slotpool_spab12cd34_n0\ndelete table inet slotpool_spab12cd34_n0\n\
             add table inet slotpool_spab12cd34_n1\ndelete table inet slotpool_spab12cd34_n1\n\
             add table inet slotpool_spab12cd34_slotnet\n\
             delete table inet slotpool_spab12cd34_slotnet\n"
        ));
        let (v0, v1) = (&slots[0].veth, &n.veth);
        assert!(
            s.contains(&format!(
                "set slot_pairs {{ type ifname . ipv4_addr; elements = \
                 {{ \"{v0}\" . 10.9.0.2, \"{v1}\" . 10.9.0.6 }}; }}"
            )),
            "{s}"
        );
        assert!(
            s.contains(&format!("elements = {{ \"{v0}\", \"{v1}\" }}")),
            "{s}"
        );
        assert!(s.contains("elements = { 10.9.0.2, 10.9.0.6 }"), "{s}");
        assert_eq!(
            s.matches("tcp dport { 4222, 7422 } reject with tcp reset")
                .count(),
            2,
            "{s}"
        );
        assert_eq!(
            s.matches("iifname . ip saddr != @slot_pairs drop").count(),
            2,
            "{s}"
        );
        for hook in ["input", "forward"] {
            assert!(
                s.contains(&format!(
                    "type filter hook {hook} priority 0; policy accept;\n    \
                     iifname @slot_ifs jump slot_{hook}\n  }}"
                )),
                "{hook}: {s}"
            );
        }
        assert!(s.contains("ip daddr 10.9.0.0/16 drop"), "{s}");
        assert!(
            s.contains("ip saddr @slot_addrs oifname . ip saddr != @slot_pairs masquerade"),
            "{s}"
        );
        assert_eq!(
            s.matches("ip daddr 169.254.169.254 reject\n").count(),
            2,
            "{s}"
        );
        let no_bus = agent_table_script(&nets.table(), &[], &slots, nets.range, &[]);
        assert!(!no_bus.contains("dport"), "{no_bus}");
        assert!(!no_bus.contains("169.254"), "{no_bus}");
    }
}
