//! What the launcher keeps of an agent's heartbeat ([`AgentReport`]): whether its
//! backing node gets slots, and what a slot claimed there will say once prepared
//! ([`SlotLoginPlan`]).

use slotpool_protocol::model::{BackingNode, HeartbeatGist, Interruption, SlotLogin, SlotNames};

/// What the launcher keeps of an agent's heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentReport {
    pub secret_sha256: String,
    pub healthy: bool,
    pub draining: bool,
    /// Slots never to be handed out again until an operator acts.
    pub dirty_slots: Vec<u32>,
    /// What a prepare of a slot will answer; `None` for an agent that does not say.
    pub login: Option<SlotLoginPlan>,
    /// The heartbeat record's TTL, when the agent says.
    pub ttl_secs: Option<u64>,
    /// The cloud is taking the machine back: no slot goes there any more.
    pub interruption: Option<Interruption>,
}

/// An agent's slot names, SSH port and host keys: what a prepare of a slot answers, known
/// before the prepare, so a node can be claimed complete ([`crate::nodes::claim`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SlotLoginPlan {
    pub names: SlotNames,
    pub port: Option<u16>,
    pub host_keys: Vec<String>,
}

impl SlotLoginPlan {
    /// Slot `slot`'s workspace and login.
    pub fn of_slot(&self, slot: u32) -> (String, SlotLogin) {
        let login = SlotLogin {
            username: self.names.username_of(slot),
            port: self.port,
            host_keys: self.host_keys.clone(),
        };
        (self.names.workspace_of(slot), login)
    }

    fn says_the_same_as(&self, hb: &HeartbeatGist<'_>) -> bool {
        hb.slot_names.as_ref().is_some_and(|n| {
            n.workspace == self.names.workspace
                && n.username.as_deref() == self.names.username.as_deref()
        }) && self.port == hb.ssh_port
            && self.host_keys.iter().eq(&hb.ssh_host_keys)
    }
}

impl AgentReport {
    pub(super) fn says_the_same_as(&self, hb: &HeartbeatGist<'_>) -> bool {
        self.secret_sha256 == hb.secret_sha256
            && self.healthy == hb.health.healthy
            && self.draining == hb.draining
            && self.dirty_slots == hb.dirty_slots
            && self.ttl_secs == hb.ttl_secs
            && self.interruption == hb.interruption
            && match &self.login {
                Some(plan) => plan.says_the_same_as(hb),
                None => hb.slot_names.is_none(),
            }
    }
}

impl From<HeartbeatGist<'_>> for AgentReport {
    fn from(hb: HeartbeatGist<'_>) -> Self {
        let login = hb.slot_names.map(|n| SlotLoginPlan {
            names: SlotNames {
                workspace: n.workspace.into_owned(),
                username: n.username.map(|u| u.into_owned()),
            },
            port: hb.ssh_port,
            host_keys: hb
                .ssh_host_keys
                .into_iter()
                .map(|k| k.into_owned())
                .collect(),
        });
        AgentReport {
            secret_sha256: hb.secret_sha256.into_owned(),
            healthy: hb.health.healthy,
            draining: hb.draining,
            dirty_slots: hb.dirty_slots,
            login,
            ttl_secs: hb.ttl_secs,
            interruption: hb.interruption,
        }
    }
}

/// Whether an agent's report makes a backing node usable: its own, healthy, not
/// shutting down, and not on a machine the cloud is taking back.
pub fn agent_ok(backing: &BackingNode, agent: Option<&AgentReport>) -> bool {
    agent.is_some_and(|a| {
        a.secret_sha256 == backing.secret_sha256
            && a.healthy
            && !a.draining
            && a.interruption.is_none()
    })
}
