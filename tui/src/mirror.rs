//! The mirror: the KV records as the watches have shown them, nothing derived. Changes
//! are applied in watch order; a restarted watch opens a new epoch, and on `Synced` the
//! records not seen in it are dropped. It also remembers when a slot of each backing node
//! was last seen coming back (`last_release`), a term of the release rule.
//!
//! Pure: no NATS, no terminal, no clock (the time of a removal is passed in).

use slotpool_protocol::model::{
    AgentHeartbeat, BackingNode, Event, Lease, Node, NodeRequest, ProviderStatus,
};
use slotpool_protocol::time::UnixMillis;
use std::collections::{BTreeMap, HashMap};

/// How many event log entries the console keeps (and asks the watch for).
pub const EVENT_HISTORY: usize = 500;

/// The buckets the console watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bucket {
    Backing,
    Slots,
    Requests,
    Agents,
    Events,
    Providers,
    /// The launchers' liveness leases (in the leases bucket).
    Launchers,
}

impl Bucket {
    pub const ALL: [Bucket; 7] = [
        Bucket::Backing,
        Bucket::Slots,
        Bucket::Requests,
        Bucket::Agents,
        Bucket::Events,
        Bucket::Providers,
        Bucket::Launchers,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// A decoded record from a watch.
#[derive(Clone, Debug)]
pub enum Record {
    Backing(Box<BackingNode>),
    Slot(Box<Node>),
    Request(Box<NodeRequest>),
    Agent(Box<AgentHeartbeat>),
    Event(Box<Event>),
    Provider(Box<ProviderStatus>),
    Launcher(Box<Lease>),
}

impl Record {
    pub fn bucket(&self) -> Bucket {
        match self {
            Record::Backing(_) => Bucket::Backing,
            Record::Slot(_) => Bucket::Slots,
            Record::Request(_) => Bucket::Requests,
            Record::Agent(_) => Bucket::Agents,
            Record::Event(_) => Bucket::Events,
            Record::Provider(_) => Bucket::Providers,
            Record::Launcher(_) => Bucket::Launchers,
        }
    }
}

/// What a watch reports.
#[derive(Clone, Debug)]
pub enum Change {
    Put {
        key: String,
        record: Record,
    },
    Removed {
        bucket: Bucket,
        key: String,
    },
    /// Everything that existed when the watch (re)started has been delivered: keys not
    /// seen since [`Change::Restarted`] are gone.
    Synced(Bucket),
    /// A new watch of the bucket starts (first start, or after the connection came back).
    Restarted(Bucket),
    /// The watch failed; the feed retries.
    Failed {
        bucket: Bucket,
        error: String,
    },
}

/// A record with the watch epoch it was last seen in.
#[derive(Clone, Debug)]
struct Seen<T> {
    value: T,
    epoch: u32,
}

/// The records of every watched bucket, by key.
#[derive(Debug, Default)]
pub struct Mirror {
    backing: HashMap<String, Seen<BackingNode>>,
    slots: HashMap<String, Seen<Node>>,
    requests: HashMap<String, Seen<NodeRequest>>,
    agents: HashMap<String, Seen<AgentHeartbeat>>,
    events: BTreeMap<String, Seen<Event>>,
    providers: BTreeMap<String, Seen<ProviderStatus>>,
    launchers: BTreeMap<String, Seen<Lease>>,
    epochs: [u32; 7],
    synced: [bool; 7],
    /// When a slot of each backing node (by id) was last seen coming back: a term of the
    /// release rule ([`slotpool_config::timing::release_at`]).
    last_release: HashMap<String, UnixMillis>,
}

impl Mirror {
    /// Applies one watch change; `now` dates a slot's removal. Returns the bucket and
    /// error of a failed watch, for the status line.
    pub fn apply(&mut self, change: Change, now: UnixMillis) -> Option<(Bucket, String)> {
        match change {
            Change::Put { key, record } => {
                let epoch = self.epochs[record.bucket().index()];
                match record {
                    Record::Backing(v) => {
                        self.backing.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Slot(v) => {
                        self.slots.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Request(v) => {
                        self.requests.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Agent(v) => {
                        self.agents.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Event(v) => {
                        self.events.insert(key, Seen { value: *v, epoch });
                        while self.events.len() > EVENT_HISTORY {
                            self.events.pop_first();
                        }
                    }
                    Record::Provider(v) => {
                        self.providers.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Launcher(v) => {
                        self.launchers.insert(key, Seen { value: *v, epoch });
                    }
                }
            }
            Change::Removed { bucket, key } => match bucket {
                Bucket::Backing => drop(self.backing.remove(&key)),
                Bucket::Slots => {
                    if let Some(gone) = self.slots.remove(&key) {
                        self.last_release
                            .insert(gone.value.backing_id.to_string(), now);
                    }
                }
                Bucket::Requests => drop(self.requests.remove(&key)),
                Bucket::Agents => drop(self.agents.remove(&key)),
                Bucket::Events => drop(self.events.remove(&key)),
                Bucket::Providers => drop(self.providers.remove(&key)),
                Bucket::Launchers => drop(self.launchers.remove(&key)),
            },
            Change::Restarted(bucket) => {
                self.epochs[bucket.index()] += 1;
                self.synced[bucket.index()] = false;
            }
            Change::Synced(bucket) => {
                let epoch = self.epochs[bucket.index()];
                match bucket {
                    Bucket::Backing => self.backing.retain(|_, s| s.epoch == epoch),
                    Bucket::Slots => self.slots.retain(|_, s| s.epoch == epoch),
                    Bucket::Requests => self.requests.retain(|_, s| s.epoch == epoch),
                    Bucket::Agents => self.agents.retain(|_, s| s.epoch == epoch),
                    Bucket::Events => self.events.retain(|_, s| s.epoch == epoch),
                    Bucket::Providers => self.providers.retain(|_, s| s.epoch == epoch),
                    Bucket::Launchers => self.launchers.retain(|_, s| s.epoch == epoch),
                }
                self.synced[bucket.index()] = true;
            }
            Change::Failed { bucket, error } => return Some((bucket, error)),
        }
        None
    }

    /// Whether every bucket's initial values have arrived.
    pub fn loaded(&self) -> bool {
        self.synced.iter().all(|s| *s)
    }

    pub fn backing_count(&self) -> usize {
        self.backing.len()
    }

    pub fn backing(&self, key: &str) -> Option<&BackingNode> {
        self.backing.get(key).map(|b| &b.value)
    }

    /// Every backing node with its seat key.
    pub fn backing_nodes(&self) -> impl Iterator<Item = (&String, &BackingNode)> {
        self.backing.iter().map(|(k, b)| (k, &b.value))
    }

    pub fn slot(&self, key: &str) -> Option<&Node> {
        self.slots.get(key).map(|s| &s.value)
    }

    /// Every used slot.
    pub fn slots(&self) -> impl Iterator<Item = &Node> {
        self.slots.values().map(|s| &s.value)
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    pub fn request(&self, key: &str) -> Option<&NodeRequest> {
        self.requests.get(key).map(|r| &r.value)
    }

    /// Every request with its key.
    pub fn requests(&self) -> impl Iterator<Item = (&String, &NodeRequest)> {
        self.requests.iter().map(|(k, r)| (k, &r.value))
    }

    /// The heartbeat of the agent of backing node `id`.
    pub fn agent(&self, id: &str) -> Option<&AgentHeartbeat> {
        self.agents.get(id).map(|a| &a.value)
    }

    pub fn event(&self, key: &str) -> Option<&Event> {
        self.events.get(key).map(|e| &e.value)
    }

    /// The event log, newest first.
    pub fn events_newest_first(&self) -> impl Iterator<Item = (&String, &Event)> {
        self.events.iter().rev().map(|(k, e)| (k, &e.value))
    }

    /// The last error of each provider whose last call failed.
    pub fn provider_errors(&self) -> impl Iterator<Item = &ProviderStatus> {
        self.providers.values().map(|p| &p.value)
    }

    /// Every launcher's liveness lease, by launcher id.
    pub fn launchers(&self) -> impl Iterator<Item = &Lease> {
        self.launchers.values().map(|l| &l.value)
    }

    /// When a slot of backing node `id` was last seen coming back.
    pub fn last_release(&self, id: &str) -> Option<UnixMillis> {
        self.last_release.get(id).copied()
    }
}
