//! Since when this launcher has been connected to the bus with every mirror synced: the
//! only time over which it judges a heartbeat missing ([`crate::backing::lifecycle`]). While the
//! connection is down, or a mirror reloads after a reconnect, the mirror says nothing
//! about which agents are alive.

use slotpool_protocol::time::{now_ms, UnixMillis};
use std::sync::Mutex;
use tokio::sync::watch;

/// Which mirrors are synced now, and since when all of them are.
pub struct MirrorSync {
    /// One bit per mirror, set while it is synced.
    synced: Mutex<u32>,
    all: u32,
    since: watch::Sender<Option<UnixMillis>>,
}

impl MirrorSync {
    /// For `mirrors` mirrors (at most 32), none of them synced yet.
    pub fn new(mirrors: usize) -> MirrorSync {
        assert!(mirrors <= 32, "at most 32 mirrors");
        MirrorSync {
            synced: Mutex::new(0),
            all: if mirrors == 32 {
                u32::MAX
            } else {
                (1 << mirrors) - 1
            },
            since: watch::channel(None).0,
        }
    }

    /// Mirror `index` holds every value of its bucket and follows its changes.
    pub fn synced(&self, index: usize) {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        *synced |= 1 << index;
        if *synced == self.all {
            self.since.send_if_modified(|since| {
                let was = since.is_none();
                since.get_or_insert_with(now_ms);
                was
            });
        }
    }

    /// Mirror `index` lost its connection or its watch, and reloads.
    pub fn lost(&self, index: usize) {
        let mut synced = self.synced.lock().unwrap_or_else(|p| p.into_inner());
        *synced &= !(1 << index);
        self.since.send_if_modified(|since| since.take().is_some());
    }

    /// Since when every mirror is synced; `None` while one is not.
    pub fn since(&self) -> Option<UnixMillis> {
        *self.since.borrow()
    }

    /// Changes with [`MirrorSync::since`].
    pub fn subscribe(&self) -> watch::Receiver<Option<UnixMillis>> {
        self.since.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synced_only_while_every_mirror_is() {
        let sync = MirrorSync::new(3);
        sync.synced(0);
        sync.synced(2);
        assert_eq!(sync.since(), None);
        sync.synced(1);
        let first = sync.since().expect("all synced");
        sync.synced(1);
        assert_eq!(sync.since(), Some(first), "a second sync keeps the time");
        sync.lost(2);
        assert_eq!(sync.since(), None);
        sync.synced(2);
        assert!(sync.since().is_some_and(|t| t >= first));
    }
}
