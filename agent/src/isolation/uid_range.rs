//! Slot uids: handed out in order from a configured range, never the one just freed.
//!
//! `useradd` alone takes the lowest free uid, so the next user of a slot would get the
//! uid of the user just deleted, and with it anything of the old uid that escaped the
//! clean-up. Instead the agent counts through `--slot-uid-range` ([`UidRange`]) and
//! passes each uid to `useradd -u`: a uid comes back only after the whole range was used,
//! and uids some user has are skipped.
//!
//! The count survives restarts in `<work-dir>/uids.json`. It is **recorded before** a uid
//! is handed out, a block of [`RESERVE_BLOCK`] at a time: the file always names a count
//! past every uid handed out, so a crash between recording and `useradd` can only skip
//! uids, never hand one out twice.
//!
//! A new agent (no state file yet) starts its count at a random place in the range, so
//! that agents sharing a host and a range (the local provider's, a test host's) do not
//! count through the same uids in step and take each other's next uid at every warm-up;
//! such a collision costs a retry with the next uid. Agents sharing a host should still
//! have ranges of their own.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The default `--slot-uid-range`.
pub const DEFAULT_RANGE: &str = "2000000-2999999";
/// How many uids one write of the state file reserves.
pub const RESERVE_BLOCK: u64 = 64;
/// The state file, under the work dir.
pub const STATE_FILE: &str = "uids.json";

/// Why a range or an allocation is refused.
#[derive(Debug, thiserror::Error)]
pub enum UidError {
    #[error("invalid uid range {0:?}: write FIRST-LAST, e.g. {DEFAULT_RANGE}")]
    Syntax(String),
    #[error("invalid uid range {first}-{last}: the first uid is above the last")]
    Empty { first: u32, last: u32 },
    #[error("invalid uid range {first}-{last}: slot uids must be at least {min}")]
    TooLow { first: u32, last: u32, min: u32 },
    #[error("invalid uid range {first}-{last}: {max} is the highest uid allowed")]
    TooHigh { first: u32, last: u32, max: u32 },
    #[error("every uid of {first}-{last} is in use")]
    Exhausted { first: u32, last: u32 },
    #[error("{action} {path}: {error}")]
    State {
        action: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
}

/// An inclusive range of uids for slot users.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

impl UidRange {
    /// The highest uid allowed: `(uid_t)-1` and `-2` mean "no uid" to many tools.
    pub const MAX: u32 = u32::MAX - 2;

    /// Parses `FIRST-LAST` and checks it holds only ordinary user uids.
    pub fn parse(text: &str) -> Result<UidRange, UidError> {
        let syntax = || UidError::Syntax(text.to_string());
        let (first, last) = text.trim().split_once('-').ok_or_else(syntax)?;
        let first: u32 = first.trim().parse().map_err(|_| syntax())?;
        let last: u32 = last.trim().parse().map_err(|_| syntax())?;
        if first > last {
            return Err(UidError::Empty { first, last });
        }
        let min = crate::isolation::passwd::MIN_SLOT_UID;
        if first < min {
            return Err(UidError::TooLow { first, last, min });
        }
        if last > UidRange::MAX {
            return Err(UidError::TooHigh {
                first,
                last,
                max: UidRange::MAX,
            });
        }
        Ok(UidRange { first, last })
    }

    fn size(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    /// The uid at position `count` of the endless walk through the range.
    pub fn at(&self, count: u64) -> u32 {
        self.first + (count % self.size()) as u32
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// What the state file holds: a count past every uid handed out.
#[derive(serde::Serialize, serde::Deserialize)]
struct Recorded {
    reserved: u64,
}

#[derive(Debug)]
struct Counter {
    /// Position of the next uid to try.
    next: u64,
    /// The count recorded in the file; `next` may not pass it without a new record.
    reserved: u64,
}

/// Hands out uids of a range in order, recording its count in a file first.
#[derive(Debug)]
pub struct UidAllocator {
    range: UidRange,
    file: PathBuf,
    counter: Mutex<Counter>,
}

impl UidAllocator {
    /// Reads the count from `<work_dir>/uids.json` (none yet: a random place in the
    /// range).
    pub fn open(work_dir: &Path, range: UidRange) -> Result<UidAllocator, UidError> {
        use std::hash::{BuildHasher, Hasher};
        // A random u64 from the standard library's per-process random hash keys.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        UidAllocator::open_from(work_dir, range, random % range.size())
    }

    /// [`UidAllocator::open`], a new count starting at position `start`.
    fn open_from(work_dir: &Path, range: UidRange, start: u64) -> Result<UidAllocator, UidError> {
        let file = work_dir.join(STATE_FILE);
        let reserved = match std::fs::read_to_string(&file) {
            Ok(text) => {
                serde_json::from_str::<Recorded>(&text)
                    .map_err(|e| UidError::State {
                        action: "parsing",
                        path: file.clone(),
                        error: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
                    })?
                    .reserved
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => start,
            Err(error) => {
                return Err(UidError::State {
                    action: "reading",
                    path: file,
                    error,
                })
            }
        };
        Ok(UidAllocator {
            range,
            file,
            counter: Mutex::new(Counter {
                next: reserved,
                reserved,
            }),
        })
    }

    pub fn range(&self) -> UidRange {
        self.range
    }

    /// The next uid of the range for which `in_use` is false, recorded as handed out
    /// before it is returned.
    pub fn allocate(&self, in_use: impl Fn(u32) -> bool) -> Result<u32, UidError> {
        let mut counter = self.counter.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..self.range.size() {
            if counter.next >= counter.reserved {
                let reserved = counter.next + RESERVE_BLOCK;
                self.record(reserved)?;
                counter.reserved = reserved;
            }
            let uid = self.range.at(counter.next);
            counter.next += 1;
            if !in_use(uid) {
                return Ok(uid);
            }
        }
        Err(UidError::Exhausted {
            first: self.range.first,
            last: self.range.last,
        })
    }

    /// Writes the count durably (temp file, fsync, rename, fsync of the directory).
    fn record(&self, reserved: u64) -> Result<(), UidError> {
        use std::io::Write;
        let tmp = self.file.with_extension("json.tmp");
        let err = |action: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |error| UidError::State {
                action,
                path,
                error,
            }
        };
        let json = serde_json::to_string(&Recorded { reserved }).expect("serializes");
        let mut f = std::fs::File::create(&tmp).map_err(err("creating", &tmp))?;
        f.write_all(format!("{json}\n").as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(err("writing", &tmp))?;
        std::fs::rename(&tmp, &self.file).map_err(err("renaming", &tmp))?;
        if let Some(dir) = self.file.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(err("syncing", dir))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert_eq!(
            UidRange::parse("2000000-2999999").unwrap(),
            UidRange {
                first: 2_000_000,
                last: 2_999_999
            }
        );
        assert_eq!(
            UidRange::parse(DEFAULT_RANGE).unwrap().to_string(),
            DEFAULT_RANGE
        );
        for (bad, says) in [
            ("2000000", "FIRST-LAST"),
            ("a-b", "FIRST-LAST"),
            ("-5-9", "FIRST-LAST"),
            ("3000-2000", "above the last"),
            ("0-5000", "at least 1000"),
            ("5000-4294967295", "highest uid"),
        ] {
            let err = UidRange::parse(bad).unwrap_err().to_string();
            assert!(
                err.contains(says) && err.contains(bad.split('-').next().unwrap()),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn uids_go_up_skip_those_in_use_and_wrap_only_at_the_end() {
        let work = tempfile::tempdir().unwrap();
        let range = UidRange::parse("5000-5003").unwrap();
        let alloc = UidAllocator::open_from(work.path(), range, 0).unwrap();
        let free = |_| false;
        assert_eq!(alloc.allocate(free).unwrap(), 5000);
        assert_eq!(alloc.allocate(|uid| uid == 5001).unwrap(), 5002);
        assert_eq!(alloc.allocate(free).unwrap(), 5003);
        assert_eq!(
            alloc.allocate(free).unwrap(),
            5000,
            "wraps once the range is used"
        );
        let err = alloc.allocate(|_| true).unwrap_err().to_string();
        assert_eq!(err, "every uid of 5000-5003 is in use");
    }

    /// Two new agents on one range do not start at the same uid (1 chance in a million
    /// to, with the default range), and a new count wraps through the whole range.
    #[test]
    fn new_agents_start_at_random_places_in_the_range() {
        let range = UidRange::parse(DEFAULT_RANGE).unwrap();
        let starts: Vec<u32> = (0..2)
            .map(|_| {
                let work = tempfile::tempdir().unwrap();
                let alloc = UidAllocator::open(work.path(), range).unwrap();
                alloc.allocate(|_| false).unwrap()
            })
            .collect();
        assert_ne!(starts[0], starts[1]);
        let work = tempfile::tempdir().unwrap();
        let small = UidRange::parse("5000-5003").unwrap();
        let alloc = UidAllocator::open_from(work.path(), small, 3).unwrap();
        let uids: Vec<u32> = (0..5).map(|_| alloc.allocate(|_| false).unwrap()).collect();
        assert_eq!(uids, vec![5003, 5000, 5001, 5002, 5003]);
    }

    #[test]
    fn a_restart_never_hands_out_a_uid_again() {
        let work = tempfile::tempdir().unwrap();
        let range = UidRange::parse("5000-9999").unwrap();
        let alloc = UidAllocator::open_from(work.path(), range, 0).unwrap();
        let first: Vec<u32> = (0..3).map(|_| alloc.allocate(|_| false).unwrap()).collect();
        assert_eq!(first, vec![5000, 5001, 5002]);
        // A crash right after: the recorded count is past every uid handed out.
        drop(alloc);
        let again = UidAllocator::open_from(work.path(), range, 0).unwrap();
        let next = again.allocate(|_| false).unwrap();
        assert!(next > 5002, "{next}");
        assert_eq!(u64::from(next - 5000), RESERVE_BLOCK);
        std::fs::write(work.path().join(STATE_FILE), "garbage").unwrap();
        let err = UidAllocator::open_from(work.path(), range, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains(STATE_FILE), "{err}");
    }
}
