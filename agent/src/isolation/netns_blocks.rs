//! The address plan of slot network namespaces: which block of `--slot-netns-range` an
//! agent numbers its slots from.
//!
//! - **The range** (`--slot-netns-range`, default [`DEFAULT_RANGE`])
//!   is shared by every agent on the host. No slot's traffic may go to any address of it
//!   but its own /30's host end (each agent's slot table drops the rest), so no slot reaches
//!   another's, whichever agent it belongs to.
//! - **A block per agent**: at start each agent takes the first block of the range
//!   that holds its `--slots` /30s (a power of two of them: 1 slot a /30, 8 slots a /27)
//!   and overlaps no IPv4 route of the host (`ip -4 route show table all`: every address
//!   and route of every interface, the other agents' veths included) and no block another
//!   running agent holds. Slot `n` is the `n`-th /30 of the block: `.1` the host end, `.2`
//!   the slot's `eth0`.
//! - **Claims**: a block is held by a file `<block>.claim` (content: the agent's
//!   namespace) in [`CLAIMS_DIR`], which its agent keeps locked (`flock`) for as long as it
//!   runs. Agents choose one at a time under the lock of `CLAIMS_DIR/lock`, so two agents
//!   starting together never take the same block.
//! - **Restarts and crashes**: an agent finding its own namespace's claim (after a
//!   restart) takes that block again, so warm slots keep their addresses. A claim whose
//!   agent is gone (its lock is free) stays taken while the host still has routes in the
//!   block (the dead agent's veths; they go with its slots' namespaces) and is freed by
//!   the next agent that chooses once none is left, so blocks never leak for good.

use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

/// Each slot gets a /30: network, host end, slot end, broadcast.
const ADDRESSES_PER_SLOT: u32 = 4;
/// Default `--slot-netns-range`.
pub const DEFAULT_RANGE: &str = "10.213.0.0/16";

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

    /// The block of length `prefix` (1 to 32) holding `addr`.
    pub fn covering(addr: Ipv4Addr, prefix: u8) -> AddressRange {
        AddressRange {
            base: Ipv4Addr::from(u32::from(addr) & mask(prefix)),
            prefix,
        }
    }

    fn holds(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.base)
    }

    /// Whether `other` lies wholly inside this range.
    pub fn contains(&self, other: AddressRange) -> bool {
        other.prefix >= self.prefix && self.holds(other.base)
    }

    /// Whether the two ranges share an address.
    pub fn overlaps(&self, other: &AddressRange) -> bool {
        self.holds(other.base) || other.holds(self.base)
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
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

/// A step of choosing or claiming a block that failed.
#[derive(Debug, thiserror::Error)]
#[error("{action}: {reason}")]
pub struct BlockError {
    pub action: String,
    pub reason: String,
}

/// Where agents claim their blocks (one host-wide directory; under the packaged unit's
/// `RuntimeDirectory`).
pub const CLAIMS_DIR: &str = "/run/slotpool/netns-blocks";

/// The prefix length of a block holding `slots` /30s (rounded up to a power of two).
pub fn block_prefix(slots: u32) -> u8 {
    let quads = slots.max(1).next_power_of_two();
    30 - quads.trailing_zeros() as u8
}

/// The first block of `range` holding `slots` /30s that overlaps nothing in `taken`.
pub fn choose_block(
    range: AddressRange,
    slots: u32,
    taken: &[AddressRange],
) -> Option<AddressRange> {
    let prefix = block_prefix(slots);
    if prefix < range.prefix {
        return None;
    }
    let size = 1u64 << (32 - prefix);
    let count = 1u64 << (prefix - range.prefix);
    (0..count)
        .map(|i| AddressRange {
            base: Ipv4Addr::from((u64::from(u32::from(range.base)) + i * size) as u32),
            prefix,
        })
        .find(|block| !taken.iter().any(|t| t.overlaps(block)))
}

/// The destinations of `ip -4 route show table all` output, default routes left out.
pub fn routes_in(output: &str) -> Vec<AddressRange> {
    const TYPES: [&str; 10] = [
        "unicast",
        "local",
        "broadcast",
        "multicast",
        "throw",
        "unreachable",
        "prohibit",
        "blackhole",
        "nat",
        "anycast",
    ];
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let mut dst = words.next()?;
            if TYPES.contains(&dst) {
                dst = words.next()?;
            }
            let (addr, prefix) = dst.split_once('/').unwrap_or((dst, "32"));
            let addr: Ipv4Addr = addr.parse().ok()?;
            let prefix: u8 = prefix.parse().ok().filter(|p| (1..=32).contains(p))?;
            Some(AddressRange::covering(addr, prefix))
        })
        .collect()
}

/// The claim file's name of `block`.
fn claim_name(block: AddressRange) -> String {
    format!("{}-{}.claim", block.base, block.prefix)
}

fn parse_claim_name(name: &str) -> Option<AddressRange> {
    let (addr, prefix) = name.strip_suffix(".claim")?.split_once('-')?;
    let block = AddressRange {
        base: addr.parse().ok()?,
        prefix: prefix.parse().ok().filter(|p| (1..=30).contains(p))?,
    };
    (AddressRange::covering(block.base, block.prefix) == block).then_some(block)
}

/// A block held by this agent for as long as the value lives (its claim file locked).
#[derive(Debug)]
pub struct BlockClaim {
    pub block: AddressRange,
    /// Whether the block is the one this agent's namespace held before (a restart).
    pub reused: bool,
    _file: fs::File,
}

fn io_fail(action: String) -> impl FnOnce(std::io::Error) -> BlockError {
    move |e| BlockError {
        action,
        reason: e.to_string(),
    }
}

/// Takes a block of `range` for `slots` slots for the agent of `namespace`, under the
/// lock of `dir` (see the module's doc).
pub fn claim_block(
    dir: &Path,
    range: AddressRange,
    slots: u32,
    namespace: &str,
) -> Result<BlockClaim, BlockError> {
    crate::isolation::create_private_dir_all(dir)
        .map_err(io_fail(format!("creating {}", dir.display())))?;
    let lock_path = dir.join("lock");
    let lock = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .map_err(io_fail(format!("opening {}", lock_path.display())))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).map_err(|e| {
        io_fail(format!("locking {}", lock_path.display()))(std::io::Error::from(e))
    })?;
    let out = Command::new("ip")
        .args(["-4", "route", "show", "table", "all"])
        .output()
        .map_err(io_fail("running ip -4 route show table all".into()))?;
    if !out.status.success() {
        return Err(BlockError {
            action: "running ip -4 route show table all".into(),
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let routes = routes_in(&String::from_utf8_lossy(&out.stdout));
    let mut taken = routes.clone();
    let entries = fs::read_dir(dir).map_err(io_fail(format!("reading {}", dir.display())))?;
    let mut own: Option<(AddressRange, fs::File)> = None;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(block) = parse_claim_name(&name) else {
            continue;
        };
        let path = entry.path();
        let Ok(file) = fs::OpenOptions::new().read(true).write(true).open(&path) else {
            taken.push(block);
            continue;
        };
        let owner = fs::read_to_string(&path).unwrap_or_default();
        let owner_alive =
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err();
        if owner.trim() == namespace {
            if owner_alive {
                return Err(BlockError {
                    action: format!("claiming a block of {range}"),
                    reason: format!(
                        "a running agent of namespace {namespace} holds {block} ({})",
                        path.display()
                    ),
                });
            }
            if own.is_none() && range.contains(block) && block.capacity() >= slots {
                own = Some((block, file));
                continue;
            }
        } else if owner_alive || routes.iter().any(|r| r.overlaps(&block)) {
            taken.push(block);
            continue;
        }
        // A claim of a gone agent with nothing left in its block (or of ours, unfit).
        let _ = fs::remove_file(&path);
    }
    if let Some((block, file)) = own {
        return Ok(BlockClaim {
            block,
            reused: true,
            _file: file,
        });
    }
    let block = choose_block(range, slots, &taken).ok_or_else(|| BlockError {
        action: format!("choosing a block of {range} for {slots} slots"),
        reason: format!(
            "every /{} of it overlaps a route of the host or another agent's block; \
             give the agent a --slot-netns-range of its own",
            block_prefix(slots)
        ),
    })?;
    let path = dir.join(claim_name(block));
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_fail(format!("creating {}", path.display())))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io_fail(format!("locking {}", path.display()))(std::io::Error::from(e)))?;
    writeln!(file, "{namespace}").map_err(io_fail(format!("writing {}", path.display())))?;
    Ok(BlockClaim {
        block,
        reused: false,
        _file: file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn r(text: &str) -> AddressRange {
        let (a, p) = text.split_once('/').unwrap();
        AddressRange::covering(a.parse().unwrap(), p.parse().unwrap())
    }

    #[test]
    fn blocks_are_a_power_of_two_of_slash_30s() {
        assert_eq!(block_prefix(0), 30);
        assert_eq!(block_prefix(1), 30);
        assert_eq!(block_prefix(2), 29);
        assert_eq!(block_prefix(3), 28);
        assert_eq!(block_prefix(8), 27);
        assert_eq!(block_prefix(9), 26);
    }

    #[test]
    fn the_first_free_block_is_chosen() {
        let range = r("10.213.0.0/16");
        assert_eq!(choose_block(range, 8, &[]), Some(r("10.213.0.0/27")));
        let taken = [r("10.213.0.4/30"), r("10.213.0.32/28")];
        assert_eq!(choose_block(range, 8, &taken), Some(r("10.213.0.64/27")));
        assert_eq!(choose_block(range, 1, &taken), Some(r("10.213.0.0/30")));
        // A route covering the whole range (a VPN's, say) leaves nothing.
        assert_eq!(choose_block(range, 1, &[r("10.0.0.0/8")]), None);
        assert_eq!(choose_block(r("10.1.2.0/29"), 3, &[]), None);
    }

    #[test]
    fn routes_are_read_from_ip_route_output() {
        let out = "default via 192.0.2.1 dev eth0 \n\
                   192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2 \n\
                   10.213.0.0/30 dev spn1a2b3c4d0 proto kernel scope link src 10.213.0.1 \n\
                   local 10.213.0.1 dev spn1a2b3c4d0 table local proto kernel scope host\n\
                   broadcast 127.255.255.255 dev lo table local proto kernel scope link\n\
                   blackhole 10.9.0.0/16 \n";
        assert_eq!(
            routes_in(out),
            vec![
                r("192.0.2.0/24"),
                r("10.213.0.0/30"),
                r("10.213.0.1/32"),
                r("127.255.255.255/32"),
                r("10.9.0.0/16"),
            ]
        );
    }

    #[test]
    fn claim_names_round_trip() {
        let b = r("10.213.1.64/26");
        assert_eq!(parse_claim_name(&claim_name(b)), Some(b));
        assert_eq!(parse_claim_name("10.213.1.65-26.claim"), None);
        assert_eq!(parse_claim_name("lock"), None);
    }

    proptest! {
        /// Whatever is taken, a chosen block lies in the range, holds the slots and
        /// overlaps nothing taken; none is chosen only when every block overlaps.
        #[test]
        fn a_chosen_block_is_free_and_fits(
            slots in 1u32..40,
            taken in proptest::collection::vec((0u32..1024, 22u8..=32), 0..12),
        ) {
            let range = r("10.213.0.0/22");
            let taken: Vec<AddressRange> = taken
                .into_iter()
                .map(|(off, p)| AddressRange::covering(
                    Ipv4Addr::from(u32::from(range.base) + off), p))
                .collect();
            match choose_block(range, slots, &taken) {
                Some(b) => {
                    prop_assert!(range.contains(b));
                    prop_assert!(b.capacity() >= slots);
                    prop_assert!(!taken.iter().any(|t| t.overlaps(&b)));
                }
                None => {
                    let prefix = block_prefix(slots);
                    let size = 1u32 << (32 - prefix);
                    for i in 0..(1u32 << (prefix - range.prefix)) {
                        let b = AddressRange::covering(
                            Ipv4Addr::from(u32::from(range.base) + i * size), prefix);
                        prop_assert!(taken.iter().any(|t| t.overlaps(&b)));
                    }
                }
            }
        }
    }

    #[test]
    fn two_agents_never_claim_the_same_block_and_a_gone_ones_is_freed() {
        let dir = tempfile::tempdir().unwrap();
        let claims = dir.path().join("blocks");
        // A range no host route overlaps (TEST-NET-2 is never routed here).
        let range = r("198.51.100.0/24");
        let a = claim_block(&claims, range, 4, "spaaaa").unwrap();
        let b = claim_block(&claims, range, 4, "spbbbb").unwrap();
        assert_eq!(a.block, r("198.51.100.0/28"));
        assert_eq!(b.block, r("198.51.100.16/28"));
        assert!(!a.reused);
        let again = claim_block(&claims, range, 4, "spaaaa").unwrap_err();
        assert!(again.to_string().contains("a running agent"), "{again}");
        drop(a);
        // The same agent back (a restart) takes its block again.
        let a = claim_block(&claims, range, 4, "spaaaa").unwrap();
        assert_eq!((a.block, a.reused), (r("198.51.100.0/28"), true));
        drop(a);
        // Gone for good: its block goes to the next agent.
        let c = claim_block(&claims, range, 4, "spcccc").unwrap();
        assert_eq!(c.block, r("198.51.100.0/28"));
        let owner = fs::read_to_string(claims.join("198.51.100.0-28.claim")).unwrap();
        assert_eq!(owner, "spcccc\n");
    }
}
