//! The limits every slot gets when its label sets none: a slot always has a pids limit
//! and a memory limit, so a job without `limits` in its label can neither fork-bomb the
//! host nor take all of its memory.
//!
//! Stated once ([`DEFAULT_PIDS_MAX`], [`MemoryDefault::Auto`]), validated once (in
//! [`crate::config`]), resolved once at start-up ([`DefaultLimits::resolve`]) and applied
//! once, to every prepare ([`crate::slots::Slots::prepare`]). A label's own value wins.
//! Users mode gives warm slots' cgroups these limits already
//! ([`crate::isolation::user_isolation::UserIsolation::with_warm_limits`]): the prepare of
//! a label without limits then writes none.
//!
//! The disk quota default (`--slot-disk-quota-mb`) is off unless configured: a slot
//! whose label sets no `limits.disk-mb` then writes its workspace on the host's file
//! system, as before (see [`crate::isolation::disk_quota`]).
//!
//! The memory default `auto` is [`AUTO_MEMORY_PERCENT`] of the host's `MemTotal` shared
//! evenly among the slots: full slots together stay below the host's memory, leaving the
//! rest to the agent, sshd and the system, and no slot can take another's share.

use super::Limits;
use std::str::FromStr;

/// Default of `--default-pids-max`: plenty for builds (`make -j`, test runners), far
/// below what exhausts a host's pid space.
pub const DEFAULT_PIDS_MAX: u32 = 4096;
/// Share of the host's memory the slots' `auto` memory limits add up to, in percent.
pub const AUTO_MEMORY_PERCENT: u64 = 90;

/// What `--default-memory-max-mb` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryDefault {
    /// [`AUTO_MEMORY_PERCENT`] of `MemTotal`, divided by the slot count.
    Auto,
    /// A fixed size in MiB (at least 1).
    Mib(u64),
}

impl FromStr for MemoryDefault {
    type Err = String;

    fn from_str(s: &str) -> Result<MemoryDefault, String> {
        if s == "auto" {
            return Ok(MemoryDefault::Auto);
        }
        match s.parse::<u64>() {
            Ok(0) => Err("must be at least 1 MiB".into()),
            Ok(mib) => Ok(MemoryDefault::Mib(mib)),
            Err(_) => Err(format!("{s:?} is neither `auto` nor a number of MiB")),
        }
    }
}

/// The validated defaults, before the host's memory is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DefaultLimits {
    /// At least 1.
    pub pids: u32,
    pub memory: MemoryDefault,
    /// Workspace file-system size in MiB (at least [`slotpool_protocol::api::MIN_DISK_MB`]); `None`: no quota.
    pub disk_mb: Option<u64>,
}

impl DefaultLimits {
    /// The limits a prepare without them gets, on a host with `mem_total_kb` of memory
    /// carved into `slots` slots (`slots` at least 1). Never 0 bytes.
    pub fn resolve(&self, mem_total_kb: u64, slots: u32) -> Limits {
        let memory_bytes = match self.memory {
            MemoryDefault::Mib(mib) => mib.saturating_mul(1024 * 1024),
            MemoryDefault::Auto => {
                (mem_total_kb.saturating_mul(1024) / 100 * AUTO_MEMORY_PERCENT)
                    / u64::from(slots.max(1))
            }
        };
        Limits {
            cpu_millis: None,
            memory_bytes: Some(memory_bytes.max(1024 * 1024)),
            pids: Some(self.pids),
            disk_bytes: self.disk_bytes(),
        }
    }

    /// The default workspace size in bytes, if there is one.
    pub fn disk_bytes(&self) -> Option<u64> {
        self.disk_mb.map(|mb| mb.saturating_mul(1024 * 1024))
    }
}

/// `limits` with every limit it leaves unset taken from `defaults`.
pub fn with_defaults(limits: Limits, defaults: &Limits) -> Limits {
    Limits {
        cpu_millis: limits.cpu_millis.or(defaults.cpu_millis),
        memory_bytes: limits.memory_bytes.or(defaults.memory_bytes),
        pids: limits.pids.or(defaults.pids),
        disk_bytes: limits.disk_bytes.or(defaults.disk_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_default_parses_auto_or_mib() {
        assert_eq!("auto".parse(), Ok(MemoryDefault::Auto));
        assert_eq!("512".parse(), Ok(MemoryDefault::Mib(512)));
        assert!("0".parse::<MemoryDefault>().is_err());
        assert!("512M".parse::<MemoryDefault>().is_err());
    }

    #[test]
    fn auto_shares_ninety_percent_of_the_host_among_the_slots() {
        let d = DefaultLimits {
            pids: 4096,
            memory: MemoryDefault::Auto,
            disk_mb: None,
        };
        // 16 GiB, 8 slots: 1.8 GiB each.
        let l = d.resolve(16 * 1024 * 1024, 8);
        assert_eq!(l.memory_bytes, Some(16 * (1 << 30) / 100 * 90 / 8));
        assert_eq!(l.pids, Some(4096));
        assert_eq!(l.cpu_millis, None);
        // Never 0, whatever the host says.
        assert_eq!(d.resolve(0, 8).memory_bytes, Some(1 << 20));
        let fixed = DefaultLimits {
            pids: 7,
            memory: MemoryDefault::Mib(256),
            disk_mb: Some(64),
        };
        assert_eq!(fixed.resolve(1, 1).memory_bytes, Some(256 << 20));
        assert_eq!(fixed.resolve(1, 1).disk_bytes, Some(64 << 20));
        assert_eq!(l.disk_bytes, None, "no disk quota unless configured");
    }

    #[test]
    fn the_labels_own_limits_win() {
        let defaults = Limits {
            cpu_millis: None,
            memory_bytes: Some(1 << 30),
            pids: Some(4096),
            disk_bytes: Some(1 << 30),
        };
        assert_eq!(with_defaults(Limits::default(), &defaults), defaults);
        let label = Limits {
            cpu_millis: Some(1500),
            memory_bytes: None,
            pids: Some(64),
            disk_bytes: Some(64 << 20),
        };
        assert_eq!(
            with_defaults(label, &defaults),
            Limits {
                cpu_millis: Some(1500),
                memory_bytes: Some(1 << 30),
                pids: Some(64),
                disk_bytes: Some(64 << 20),
            }
        );
    }
}
