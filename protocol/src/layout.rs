//! Where slotpool state lives: KV buckets, their keys, and NATS subjects.
//!
//! Subjects are laid out so NATS permissions can separate the four kinds of users; the
//! permissions themselves are [`crate::auth::permissions`].

use crate::ids::{BackingId, LauncherId};

/// Settings of one bucket, as created by [`crate::store::Store::open`].
#[derive(Clone, Copy, Debug)]
pub struct BucketSpec {
    pub name: &'static str,
    /// Values kept per key (1 = latest only).
    pub history: i64,
    /// Whether per-key TTLs are used (leases, heartbeats).
    pub per_key_ttl: bool,
    /// Largest value accepted.
    pub max_value_size: i32,
    /// Values older than this many seconds are dropped (0: kept until deleted).
    pub max_age_secs: u64,
    /// Beyond this many bytes (-1: no limit), the oldest values are dropped when
    /// `discard_old`, and new writes are refused otherwise (a KV bucket's default).
    pub max_bytes: i64,
    /// Whether a full bucket drops its oldest values (`discard: old`) rather than
    /// refusing new ones: for a log, whose newest entries matter most.
    pub discard_old: bool,
}

/// Node requests, key = request id.
pub const REQUESTS: BucketSpec = BucketSpec {
    name: "slotpool_requests",
    history: 1,
    per_key_ttl: true,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};
/// Slots in use, key = `<backing id>.<slot index>`, value = the [`crate::model::Node`]
/// holding it. Created only if absent: this is what makes double-booking impossible.
pub const SLOTS: BucketSpec = BucketSpec {
    name: "slotpool_slots",
    history: 1,
    per_key_ttl: false,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};
/// Backing nodes, key = `<provider>.<pool>.<seat>`. A pool has `max-servers` seats, so a
/// pool can never hold more backing nodes than that, whatever several launchers do.
pub const BACKING: BucketSpec = BucketSpec {
    name: "slotpool_backing",
    history: 1,
    per_key_ttl: false,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};
/// Agent heartbeats, key = backing id, each with a TTL so a dead agent's entry expires.
pub const AGENTS: BucketSpec = BucketSpec {
    name: "slotpool_agents",
    history: 1,
    per_key_ttl: true,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};
/// Launcher leases, key = `launcher.<launcher id>`, `backing.<provider>.<pool>.<seat>` or
/// `sweep.<provider>`; also each provider's last error, key = `provider.<provider>`
/// ([`provider_status_key`]), and revoked credentials, key = `revoked.<user nkey>`
/// ([`revocation_key`]).
pub const LEASES: BucketSpec = BucketSpec {
    name: "slotpool_leases",
    history: 1,
    per_key_ttl: true,
    max_value_size: 4 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
    discard_old: false,
};

/// The event log ([`crate::model::Event`]), key = event id (time-ordered). Written once
/// per key; kept for a day and at most 64 MiB, oldest dropped first.
pub const EVENTS: BucketSpec = BucketSpec {
    name: "slotpool_events",
    history: 1,
    per_key_ttl: false,
    max_value_size: 16 * 1024,
    max_age_secs: 24 * 3600,
    max_bytes: 64 * 1024 * 1024,
    discard_old: true,
};

/// Every bucket, for creating them all at start-up.
pub const ALL_BUCKETS: [BucketSpec; 6] = [REQUESTS, SLOTS, BACKING, AGENTS, LEASES, EVENTS];

/// How long a finished (fulfilled, failed, canceled) request record is kept.
pub const FINISHED_REQUEST_TTL_SECS: u64 = 3600;

/// Key of a slot in [`SLOTS`].
pub fn slot_key(backing: &BackingId, slot: u32) -> String {
    // Sized once: the mirror makes a key for every slot change it takes.
    let mut key = String::with_capacity(backing.as_str().len() + 11);
    key.push_str(backing.as_str());
    key.push('.');
    let _ = std::fmt::Write::write_fmt(&mut key, format_args!("{slot}"));
    key
}

/// Splits a [`SLOTS`] key into backing id and slot index.
pub fn parse_slot_key(key: &str) -> Option<(BackingId, u32)> {
    let (backing, slot) = key.rsplit_once('.')?;
    Some((BackingId::parse(backing).ok()?, slot.parse().ok()?))
}

/// Key of a seat in [`BACKING`].
pub fn seat_key(provider: &str, pool: &str, seat: u32) -> String {
    format!("{provider}.{pool}.{seat}")
}

/// Key of a launcher's liveness lease in [`LEASES`]: while it stands, no other launcher
/// takes over the requests that launcher owns.
pub fn launcher_lease_key(launcher: &LauncherId) -> String {
    format!("launcher.{launcher}")
}

/// The watch filter of every [`launcher_lease_key`].
pub const LAUNCHER_LEASE_KEYS: &str = "launcher.>";

/// Key of a backing seat's lease in [`LEASES`].
pub fn backing_lease_key(seat_key: &str) -> String {
    format!("backing.{seat_key}")
}

/// Key of the lease in [`LEASES`] held by the launcher sweeping `provider` for leaked
/// machines (one at a time per provider).
pub fn leak_sweep_lease_key(provider: &str) -> String {
    format!("sweep.{provider}")
}

/// Key in [`LEASES`] of `provider`'s last error ([`crate::model::ProviderStatus`]): not
/// a lease but a status record, without a TTL, written by any launcher whose call to the
/// provider failed (last writer wins) and deleted at the next success.
pub fn provider_status_key(provider: &str) -> String {
    format!("{PROVIDER_STATUS_PREFIX}{provider}")
}

/// What every [`provider_status_key`] starts with.
pub const PROVIDER_STATUS_PREFIX: &str = "provider.";

/// The watch filter of every [`provider_status_key`].
pub const PROVIDER_STATUS_KEYS: &str = "provider.>";

/// Key in [`LEASES`] of the revocation of the credentials of user nkey `key`
/// ([`crate::model::Revocation`]): not a lease either; written by launchers, read by
/// every launcher (its HTTP API and its push of the account's revocations).
pub fn revocation_key(key: &str) -> String {
    format!("{REVOCATION_PREFIX}{key}")
}

/// What every [`revocation_key`] starts with.
pub const REVOCATION_PREFIX: &str = "revoked.";

/// The watch filter of every [`revocation_key`].
pub const REVOCATION_KEYS: &str = "revoked.>";

/// What a lease key names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseOf {
    /// A launcher's liveness ([`launcher_lease_key`]).
    Launcher(LauncherId),
    /// The worker of a seat, by the seat's key ([`backing_lease_key`]).
    Seat(String),
}

/// The inverse of [`launcher_lease_key`] and [`backing_lease_key`]; `None` for any
/// other key.
pub fn parse_lease_key(key: &str) -> Option<LeaseOf> {
    if let Some(id) = key.strip_prefix("launcher.") {
        return LauncherId::parse(id).ok().map(LeaseOf::Launcher);
    }
    key.strip_prefix("backing.")
        .map(|seat| LeaseOf::Seat(seat.to_string()))
}

/// Subjects of the launcher's API and the agents' commands (API v2).
///
/// The sender's bus user name is a token of every API and admin subject, and the
/// server lets each user publish only under its own name ([`crate::auth::permissions`]),
/// so a launcher knows who sent a message from its subject ([`subjects::caller`]).
pub mod subjects {
    use crate::ids::{BackingId, UserName};
    use crate::model::OperatorAction;

    /// The client API operations: `slotpool.api.v2.<client>.<op>`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ApiOp {
        /// [`crate::api::SubmitRequest`] → [`crate::api::Submitted`].
        Submit,
        /// [`crate::api::ReleaseNodes`] → [`crate::api::Released`].
        Release,
        /// [`crate::api::CancelRequest`] → [`crate::api::Canceled`].
        Cancel,
        /// [`crate::api::RequestStatus`] → [`crate::model::NodeRequest`].
        Status,
        /// [`crate::api::WaitReleased`] → [`crate::api::StillHeld`].
        WaitReleased,
        /// [`crate::api::NodesQuery`] → the caller's [`crate::model::Node`]s.
        Nodes,
        /// [`crate::api::KeepAlive`] → [`crate::api::KeptAlive`].
        KeepAlive,
        /// [`crate::exec::ExecRequest`] → [`crate::exec::ExecStarted`].
        Exec,
    }

    impl ApiOp {
        pub const ALL: [ApiOp; 8] = [
            ApiOp::Submit,
            ApiOp::Release,
            ApiOp::Cancel,
            ApiOp::Status,
            ApiOp::WaitReleased,
            ApiOp::Nodes,
            ApiOp::KeepAlive,
            ApiOp::Exec,
        ];

        pub fn as_str(self) -> &'static str {
            match self {
                ApiOp::Submit => "submit",
                ApiOp::Release => "release",
                ApiOp::Cancel => "cancel",
                ApiOp::Status => "status",
                ApiOp::WaitReleased => "wait_released",
                ApiOp::Nodes => "nodes",
                ApiOp::KeepAlive => "keepalive",
                ApiOp::Exec => "exec",
            }
        }
    }

    /// `client`'s subject for `op`.
    pub fn api(client: &UserName, op: ApiOp) -> String {
        format!("slotpool.api.v2.{client}.{}", op.as_str())
    }
    /// Every client's subject for `op`, for serving it.
    pub fn api_all(op: ApiOp) -> String {
        format!("slotpool.api.v2.*.{}", op.as_str())
    }
    /// Everything `client` may send to the API (a permission pattern).
    pub fn api_of(client: &str) -> String {
        format!("slotpool.api.v2.{client}.>")
    }

    /// The system-account subject that takes a newer JWT of `account` (NATS's full
    /// resolver).
    pub fn claims_update(account: &str) -> String {
        format!("$SYS.REQ.ACCOUNT.{account}.CLAIMS.UPDATE")
    }
    /// The system-account subject that answers with the JWT of `account` the server holds.
    pub fn claims_lookup(account: &str) -> String {
        format!("$SYS.REQ.ACCOUNT.{account}.CLAIMS.LOOKUP")
    }
    /// The inbox prefix of the system user that pushes slotpool's account.
    pub const REVOKER_INBOX: &str = "_INBOX.revoker";
    /// JetStream's account information: every role may ask it (opening a bucket does).
    pub const JETSTREAM_INFO: &str = "$JS.API.INFO";

    /// `operator`'s subject for an order ([`crate::api::BackingOrder`] for hold, drain,
    /// run and kill; [`crate::api::ReleaseNodeOrder`] for release_node).
    pub fn admin(operator: &UserName, action: OperatorAction) -> String {
        format!("slotpool.admin.v2.{operator}.{}", action.as_str())
    }
    /// Every operator's subject for `action`, for serving it.
    pub fn admin_all(action: OperatorAction) -> String {
        format!("slotpool.admin.v2.*.{}", action.as_str())
    }
    /// `operator`'s subject for asking who is in a slot
    /// ([`crate::api::SlotOccupantsQuery`]); not an order, so nothing is recorded.
    pub fn slot_occupants(operator: &UserName) -> String {
        format!("slotpool.admin.v2.{operator}.{SLOT_OCCUPANTS}")
    }
    /// The last token of [`slot_occupants`].
    pub const SLOT_OCCUPANTS: &str = "slot_occupants";
    /// Every operator's [`slot_occupants`] subject, for serving it.
    pub const SLOT_OCCUPANTS_ALL: &str = "slotpool.admin.v2.*.slot_occupants";
    /// `operator`'s subject for revoking a user's credentials
    /// ([`crate::api::RevokeOrder`]).
    pub fn revoke(operator: &UserName) -> String {
        format!("slotpool.admin.v2.{operator}.{REVOKE}")
    }
    /// The last token of [`revoke`].
    pub const REVOKE: &str = "revoke";
    /// Every operator's [`revoke`] subject, for serving it.
    pub const REVOKE_ALL: &str = "slotpool.admin.v2.*.revoke";
    /// `operator`'s subject for asking a backing node's agent for its newest log lines
    /// ([`crate::api::LogTailQuery`]); not an order, so nothing is recorded.
    pub fn log_tail(operator: &UserName) -> String {
        format!("slotpool.admin.v2.{operator}.{LOG_TAIL}")
    }
    /// The last token of [`log_tail`].
    pub const LOG_TAIL: &str = "log_tail";
    /// Every operator's [`log_tail`] subject, for serving it.
    pub const LOG_TAIL_ALL: &str = "slotpool.admin.v2.*.log_tail";
    /// Every order `operator` may give (a permission pattern).
    pub fn admin_of(operator: &str) -> String {
        format!("slotpool.admin.v2.{operator}.>")
    }

    /// What `client` sends to a running command of its own on backing node `backing`
    /// (see [`crate::exec`]): `slotpool.exec.v2.<client>.<backing>.<session>.<kind>`.
    /// Only `client` may publish there and only that node's agent receives it.
    pub fn exec_input(client: &UserName, backing: &BackingId, session: &str, kind: &str) -> String {
        format!("slotpool.exec.v2.{client}.{backing}.{session}.{kind}")
    }
    /// Everything `client` may send to its running commands (a permission pattern).
    pub fn exec_input_of(client: &str) -> String {
        format!("slotpool.exec.v2.{client}.>")
    }
    /// Every client's input to the commands running on `backing` (its agent serves it).
    pub fn exec_input_to(backing: &str) -> String {
        format!("slotpool.exec.v2.*.{backing}.>")
    }
    /// The client, backing node, session and kind of an [`exec_input`] subject.
    pub fn parse_exec_input(subject: &str) -> Option<(UserName, BackingId, &str, &str)> {
        let mut t = subject.split('.');
        match (
            t.next(),
            t.next(),
            t.next(),
            t.next(),
            t.next(),
            t.next(),
            t.next(),
            t.next(),
        ) {
            (
                Some("slotpool"),
                Some("exec"),
                Some("v2"),
                Some(c),
                Some(b),
                Some(s),
                Some(k),
                None,
            ) => Some((UserName::parse(c).ok()?, BackingId::parse(b).ok()?, s, k)),
            _ => None,
        }
    }
    /// Where the agent of backing node `backing` sends a command's output and exit:
    /// `<inbox>.exec.<session>.<backing>.<kind>` under the caller's own inbox prefix
    /// (`_INBOX.<role>.<user>`), which only the caller may subscribe to. The backing
    /// node's id is there so that each agent may publish only into sessions on its own
    /// node ([`exec_output_from`]): a caller subscribed to this subject (with `.>`)
    /// hears the agent of the node its command runs on, and no other.
    pub fn exec_output(inbox_prefix: &str, session: &str, backing: &BackingId) -> String {
        format!("{inbox_prefix}.exec.{session}.{backing}")
    }
    /// The output subjects the agent of `backing` may publish to (a permission
    /// pattern): exec inboxes, in sessions on its own node only. One pattern for every
    /// role's inbox, not one each for clients' and operators' (the only callers, whose
    /// inboxes alone have such subjects: no reply inbox has `exec` for its fourth
    /// token), keeps an agent's credential, which names its node in several patterns,
    /// small (see `connect`'s test of the CONNECT line).
    pub fn exec_output_from(backing: &str) -> String {
        format!("_INBOX.*.*.exec.*.{backing}.>")
    }

    /// Every client's API subject, for serving them all in one subscription.
    pub const API_V2_ALL: &str = "slotpool.api.v2.*.>";
    /// Every operator's admin subject, for serving them all in one subscription.
    pub const ADMIN_V2_ALL: &str = "slotpool.admin.v2.*.>";

    /// What follows the caller in an API or admin subject: the operation's name
    /// (`submit`, `hold`...), or more tokens for a subject no operation has.
    pub fn operation(subject: &str) -> Option<&str> {
        let mut tokens = subject.splitn(5, '.');
        match (
            tokens.next(),
            tokens.next(),
            tokens.next(),
            tokens.next(),
            tokens.next(),
        ) {
            (Some("slotpool"), Some("api" | "admin"), Some("v2"), Some(_), Some(op)) => Some(op),
            _ => None,
        }
    }

    /// The bus user who sent a message on an API or admin subject: its fourth token.
    pub fn caller(subject: &str) -> Option<UserName> {
        let mut tokens = subject.split('.');
        match (tokens.next(), tokens.next(), tokens.next(), tokens.next()) {
            (Some("slotpool"), Some("api" | "admin"), Some("v2"), Some(name)) => {
                UserName::parse(name).ok()
            }
            _ => None,
        }
    }

    /// The retired API v1 subjects: launchers answer them with `unsupported_version`
    /// and say what to use instead, so an old client gets an error, not silence.
    pub const API_V1_ALL: &str = "slotpool.api.v1.>";
    pub const ADMIN_V1_ALL: &str = "slotpool.admin.v1.>";

    /// Queue group all launchers serve the API in, so each message is handled once.
    pub const LAUNCHER_QUEUE: &str = "slotpool-launchers";

    /// Commands from launchers to one agent ([`crate::api::AgentCommand`]).
    pub fn agent(backing: &BackingId) -> String {
        agent_of(backing.as_str())
    }
    pub fn agent_of(backing: &str) -> String {
        format!("slotpool.agent.v2.{backing}")
    }
    /// Every agent's command subject (for a process that speaks for many agents: the
    /// benchmark's simulated ones, on a bus of its own).
    pub const AGENT_ALL: &str = "slotpool.agent.v2.*";
    /// The backing id an agent command subject is for.
    pub fn agent_backing(subject: &str) -> Option<BackingId> {
        BackingId::parse(subject.strip_prefix("slotpool.agent.v2.")?).ok()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn lease_keys_parse_back_to_what_they_name() {
        let launcher = LauncherId::parse("launcher-a1").unwrap();
        assert_eq!(
            parse_lease_key(&launcher_lease_key(&launcher)),
            Some(LeaseOf::Launcher(launcher))
        );
        assert_eq!(
            parse_lease_key(&backing_lease_key("local.main.3")),
            Some(LeaseOf::Seat("local.main.3".into()))
        );
        assert_eq!(parse_lease_key("launcher.not a valid id"), None);
        assert_eq!(parse_lease_key("other.key"), None);
    }

    use super::*;

    #[test]
    fn slot_keys_round_trip() {
        let b = BackingId::parse("bn-01abc").unwrap();
        assert_eq!(slot_key(&b, 7), "bn-01abc.7");
        assert_eq!(slot_key(&b, u32::MAX), "bn-01abc.4294967295");
        assert_eq!(parse_slot_key(&slot_key(&b, 7)), Some((b, 7)));
        assert_eq!(parse_slot_key("nodots"), None);
        assert_eq!(parse_slot_key("bn-1.x"), None);
    }

    #[test]
    fn the_caller_is_read_from_the_subject() {
        use subjects::*;
        let ci = crate::UserName::parse("ci").unwrap();
        assert_eq!(caller(&api(&ci, ApiOp::Submit)), Some(ci.clone()));
        let action = crate::model::OperatorAction::Kill;
        assert_eq!(caller(&admin(&ci, action)), Some(ci));
        assert_eq!(caller("slotpool.api.v1.submit"), None);
        assert_eq!(caller("slotpool.api.v2.*.submit"), None);
        assert_eq!(caller("slotpool.agent.v2.bn-1"), None);
    }
}
