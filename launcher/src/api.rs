//! The launcher's request-reply API: submit, release, cancel, keepalive, status and wait_released
//! (see [`crate::status`]), and operators' orders (see [`crate::admin`]). The caller is the
//! bus user named in the subject, which the server let only that user publish on; a
//! client may see, release and cancel only its own requests and nodes. Every launcher
//! serves it in
//! one queue group, so each message is handled once. Bad input is answered with a
//! specific error; nothing about it disturbs other requests.

use crate::admin;
use crate::inbound::{bad, check_owner, decode, internal};
use crate::nodes;
use crate::release::{self, Finish};
use crate::request::observe::{self, Memory};
use crate::request::plan::{self, RequestStep};
use crate::request::{self, exec};
use crate::shared::{request_topic, Shared};
use crate::status;
use crate::world::SlotRef;
use futures::StreamExt;
use slotpool_protocol::api::{
    ApiError, CancelRequest, Canceled, ErrorCode, KeepAlive, KeptAlive, ReleaseNodes, Released,
    Reply, SubmitRequest, Submitted, DEFAULT_PRIORITY, MAX_KEEP_ALIVE_SECS, MAX_LABELS_PER_REQUEST,
    MIN_KEEP_ALIVE_SECS,
};
use slotpool_protocol::connect::{BusError, Incoming};
use slotpool_protocol::layout::subjects::{self, ApiOp};
use slotpool_protocol::layout::FINISHED_REQUEST_TTL_SECS;
use slotpool_protocol::model::{Node, NodeRequest, OperatorAction, RequestState};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{RequestId, UserName, PROTOCOL_VERSION};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

const MAX_REQUESTOR_LEN: usize = 256;

/// Serves the API until shutdown: every client's API subject and every operator's
/// admin subject, each family in one subscription of the launchers' queue group. A
/// subject that names no operation is answered `unknown_operation`, not left to time
/// out (a client would take "no responders" for no launcher running).
pub async fn serve(shared: Arc<Shared>) -> Result<(), BusError> {
    let bus = &shared.bus;
    let served = [
        subjects::API_V2_ALL,
        subjects::ADMIN_V2_ALL,
        subjects::API_V1_ALL,
        subjects::ADMIN_V1_ALL,
    ];
    let mut streams = Vec::with_capacity(served.len());
    for subject in served {
        let messages = bus.serve(subject, Some(subjects::LAUNCHER_QUEUE)).await?;
        streams.push(messages.boxed());
    }
    let mut all = futures::stream::select_all(streams);
    loop {
        let msg = tokio::select! {
            _ = shared.shutdown.cancelled() => return Ok(()),
            next = all.next() => match next { Some(m) => m, None => return Ok(()) },
        };
        let sh = shared.clone();
        let caller = subjects::caller(&msg.subject);
        let op = Op::of(&msg.subject);
        let span =
            tracing::info_span!("api", op = ?op, caller = caller.as_ref().map(|c| c.as_str()));
        shared.spawn_task(async move { handle(sh, op, caller, msg).await }.instrument(span));
    }
}

#[derive(Clone, Debug)]
enum Op {
    Api(ApiOp),
    Admin(OperatorAction),
    /// An operator's question: who is in a slot.
    SlotOccupants,
    /// An operator's question: an agent's newest log lines.
    LogTail,
    /// An operator's order: revoke a user's credentials.
    Revoke,
    /// A subject of API v1, answered with `unsupported_version`.
    Retired,
    /// An API or admin subject that names no operation.
    Unknown,
}

impl Op {
    /// The operation a message's subject names.
    fn of(subject: &str) -> Op {
        let admin = subject.starts_with("slotpool.admin.");
        match subjects::operation(subject) {
            None => Op::Retired,
            Some(name) if admin => OperatorAction::ALL
                .into_iter()
                .find(|a| a.as_str() == name)
                .map(Op::Admin)
                .or_else(|| (name == subjects::SLOT_OCCUPANTS).then_some(Op::SlotOccupants))
                .or_else(|| (name == subjects::LOG_TAIL).then_some(Op::LogTail))
                .or_else(|| (name == subjects::REVOKE).then_some(Op::Revoke))
                .unwrap_or(Op::Unknown),
            Some(name) => ApiOp::ALL
                .into_iter()
                .find(|op| op.as_str() == name)
                .map_or(Op::Unknown, Op::Api),
        }
    }
}

/// The error for a subject that names no operation, listing those there are.
fn unknown_operation(subject: &str) -> ApiError {
    let admin = subject.starts_with("slotpool.admin.");
    let known: Vec<&str> = if admin {
        OperatorAction::ALL
            .iter()
            .map(|a| a.as_str())
            .chain([
                subjects::SLOT_OCCUPANTS,
                subjects::LOG_TAIL,
                subjects::REVOKE,
            ])
            .collect()
    } else {
        ApiOp::ALL.iter().map(|op| op.as_str()).collect()
    };
    let name = subjects::operation(subject).unwrap_or_default();
    ApiError::new(
        ErrorCode::UnknownOperation,
        format!(
            "{subject}: no operation {name:?}; the {} has: {}",
            if admin { "admin API" } else { "API" },
            known.join(", ")
        ),
    )
}

async fn handle(sh: Arc<Shared>, op: Op, caller: Option<UserName>, msg: Incoming) {
    let Some(reply_to) = msg.reply_to.clone() else {
        tracing::debug!("message without a reply subject ignored");
        return;
    };
    let Some(caller) = caller else {
        let err = ApiError::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "{} is API v1, which this launcher no longer serves: send to \
                 slotpool.api.v2.<your bus user>.<op> (operators: slotpool.admin.v2.<user>.<action>); \
                 see docs/protocol.md",
                msg.subject
            ),
        );
        let _ = respond::<()>(&sh, &reply_to, Err(err)).await;
        return;
    };
    let sent = match op {
        Op::Api(ApiOp::Submit) => respond(&sh, &reply_to, submit(&sh, &caller, &msg).await).await,
        Op::Api(ApiOp::Release) => respond(&sh, &reply_to, release(&sh, &caller, &msg).await).await,
        Op::Api(ApiOp::Cancel) => respond(&sh, &reply_to, cancel(&sh, &caller, &msg).await).await,
        Op::Api(ApiOp::KeepAlive) => {
            respond(&sh, &reply_to, keep_alive(&sh, &caller, &msg).await).await
        }
        Op::Api(ApiOp::Status) => {
            respond(&sh, &reply_to, status::request(&sh, &caller, &msg).await).await
        }
        Op::Api(ApiOp::Nodes) => {
            respond(&sh, &reply_to, status::nodes(&sh, &caller, &msg).await).await
        }
        Op::Api(ApiOp::Exec) => {
            respond(
                &sh,
                &reply_to,
                crate::exec_api::exec(&sh, &caller, &msg).await,
            )
            .await
        }
        Op::Api(ApiOp::WaitReleased) => {
            respond(&sh, &reply_to, status::released(&sh, &caller, &msg).await).await
        }
        Op::Admin(OperatorAction::ReleaseNode) => {
            respond(
                &sh,
                &reply_to,
                admin::release_node(&sh, &caller, &msg).await,
            )
            .await
        }
        Op::Admin(action) => {
            respond(
                &sh,
                &reply_to,
                admin::order_backing(&sh, &caller, action, &msg).await,
            )
            .await
        }
        Op::SlotOccupants => respond(&sh, &reply_to, admin::slot_occupants(&sh, &msg).await).await,
        Op::LogTail => respond(&sh, &reply_to, admin::log_tail(&sh, &msg).await).await,
        Op::Revoke => respond(&sh, &reply_to, admin::revoke(&sh, &caller, &msg).await).await,
        Op::Retired => unreachable!("a v1 subject has no caller"),
        Op::Unknown => respond::<()>(&sh, &reply_to, Err(unknown_operation(&msg.subject))).await,
    };
    if let Err(err) = sent {
        tracing::warn!(%err, "cannot send the reply");
    }
}

async fn respond<T: serde::Serialize>(
    sh: &Shared,
    reply_to: &str,
    result: Result<T, ApiError>,
) -> Result<(), BusError> {
    if let Err(err) = &result {
        tracing::info!(code = ?err.code, message = %err.message, "refused");
    }
    sh.bus.respond(reply_to, &Reply::from(result)).await
}

/// Checks a submission against the limits and the configured labels.
fn validate(sh: &Shared, s: &SubmitRequest) -> Result<(), ApiError> {
    if s.labels.is_empty() {
        return Err(bad("labels is empty: name at least one label"));
    }
    if s.labels.len() > MAX_LABELS_PER_REQUEST {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "{} labels asked for; at most {MAX_LABELS_PER_REQUEST} per request",
                s.labels.len()
            ),
        ));
    }
    if s.requestor.trim().is_empty() || s.requestor.len() > MAX_REQUESTOR_LEN {
        return Err(bad(format!(
            "requestor must be 1 to {MAX_REQUESTOR_LEN} characters"
        )));
    }
    if let Some(Err(err)) = s
        .ssh_public_key
        .as_deref()
        .map(slotpool_protocol::ssh_key::validate_public_key)
    {
        return Err(bad(format!("invalid ssh_public_key: {err}")));
    }
    if let Some(secs) = s.keep_alive_secs {
        if !(MIN_KEEP_ALIVE_SECS..=MAX_KEEP_ALIVE_SECS).contains(&secs) {
            return Err(bad(format!(
                "keep_alive_secs must be {MIN_KEEP_ALIVE_SECS} to {MAX_KEEP_ALIVE_SECS}, got {secs}"
            )));
        }
    }
    if let Some(unknown) = s.labels.iter().find(|l| sh.config.sites(l).is_empty()) {
        let known = sh.config.label_names().join(", ");
        return Err(ApiError::new(
            ErrorCode::UnknownLabel,
            format!("unknown label {unknown:?}; this pool serves: {known}"),
        ));
    }
    // A node set the pools serving its labels could never hold at once would wait (or
    // hold slots) for ever: refused now, with what it would need.
    let mut wanted: std::collections::BTreeMap<&str, u64> = Default::default();
    for label in &s.labels {
        *wanted.entry(label.as_str()).or_default() += 1;
    }
    for (label, count) in &wanted {
        let most = sh.config.max_nodes(label);
        if *count > most {
            return Err(bad(format!(
                "{count} nodes of label {label:?} asked for in one request; the pools serving \
                 it hold at most {most} at once (max-servers x max-parallel-jobs)"
            )));
        }
    }
    if let Err(cannot) = sh.config.hold_at_once(&wanted) {
        return Err(bad(cannot.to_string()));
    }
    Ok(())
}

async fn submit(
    sh: &Arc<Shared>,
    caller: &UserName,
    msg: &Incoming,
) -> Result<Submitted, ApiError> {
    let s: SubmitRequest = decode(msg, "submit request", |s: &SubmitRequest| s.v)?;
    validate(sh, &s)?;
    // A submit again of a request already made is its answer, never a new request.
    let known =
        s.id.as_ref()
            .is_some_and(|id| sh.world().requests.contains_key(id));
    if !known {
        if let Err(over) = sh.world().admits(Some(caller), now_ms()) {
            return Err(ApiError::new(ErrorCode::OverLimit, over.to_string()));
        }
    }
    let Some(wait_ms) = s.wait_ms else {
        return accept(sh, caller, s, None).await;
    };
    // Asked to wait: the reply is the request once it ends or the wait is over, from
    // the change signal taken before the request exists.
    let id = s.id.clone().unwrap_or_else(RequestId::generate);
    let changes = status::follow_from_now(sh, &id);
    let accepted = accept(
        sh,
        caller,
        SubmitRequest {
            id: Some(id.clone()),
            ..s
        },
        Some(wait_ms),
    )
    .await?;
    if accepted.request.is_some() {
        return Ok(accepted);
    }
    let request = status::follow(sh, caller, &id, wait_ms, changes).await?;
    Ok(Submitted {
        request: Some(Box::new(request)),
        ..accepted
    })
}

/// The shortest `wait_ms` for which a submit is served before its request is recorded
/// ([`serve_at_once`]): a client that waits less hears of its request sooner the usual
/// way.
const AT_ONCE_MIN_WAIT_MS: u64 = 1_000;
/// How long [`serve_at_once`] waits for the agents' prepares, at most (and at most half
/// the client's wait) before it leaves the request to its worker.
const AT_ONCE_PREPARE_MS: u64 = 2_000;

/// Creates the request `s` asks for (or finds it made by an earlier submit of the same
/// id) and starts working on it. A client that waits for the outcome (`wait_ms`) and
/// finds a free slot for every label is served before the request is recorded
/// ([`serve_at_once`]); the reply then carries the fulfilled request.
async fn accept(
    sh: &Arc<Shared>,
    caller: &UserName,
    s: SubmitRequest,
    wait_ms: Option<u64>,
) -> Result<Submitted, ApiError> {
    let now = now_ms();
    let retried_id = s.id.is_some();
    let req = NodeRequest {
        v: PROTOCOL_VERSION,
        id: s.id.clone().unwrap_or_else(RequestId::generate),
        labels: s.labels,
        requestor: s.requestor,
        priority: s.priority.unwrap_or(DEFAULT_PRIORITY),
        timeout_secs: s.timeout_secs,
        ssh_public_key: s.ssh_public_key,
        created_at: now,
        state: RequestState::Requested,
        status: "queued".into(),
        nodes: vec![],
        failure: None,
        updated_at: now,
        owner: Some(sh.id.clone()),
        nodes_released_at: None,
        client: Some(caller.clone()),
        keep_alive_secs: s.keep_alive_secs,
        alive_until: s.keep_alive_secs.map(|secs| keep_alive_from(now, secs)),
        fulfilled_at: None,
        hold_until: None,
        nodes_failed: Vec::new(),
        waiting: None,
    };
    // Free slots are claimed in the same round trip as the request is created (both
    // writes in flight at once): the worker starts with its slots claimed, ready to have
    // them prepared. A slot claimed for a request whose creation fails is given back;
    // one left behind by a launcher that died in between is swept
    // ([`release::sweep_left_behind`]). The request names this launcher its owner, so no
    // other launcher drives it while this one is alive. It is marked as driven here
    // before it exists: its watch delivery must not start a second worker, which would
    // not know of the slots claimed here.
    let mine = request::begin(sh, &req.id);
    // The plan is asked as the worker would ask it: for a new request with free slots,
    // it says claim them.
    let look = observe::look(sh, &req, &Memory::default());
    let (slots, every_label) = match plan::next(&req, &look, now) {
        RequestStep::Claim { slots, missing } => (slots, missing.is_empty()),
        _ => {
            observe::unreserve(sh, &look);
            (Vec::new(), false)
        }
    };
    let prepare_within = wait_ms
        .filter(|ms| *ms >= AT_ONCE_MIN_WAIT_MS)
        .map(|ms| Duration::from_millis((ms / 2).min(AT_ONCE_PREPARE_MS)));
    if let (true, true, Some(within)) = (mine, every_label, prepare_within) {
        return serve_at_once(sh, caller, req, &slots, within).await;
    }
    let key = req.id.to_string();
    let sent_at = now_ms();
    let (created, claimed) = tokio::join!(
        sh.bus.requests.create(&key, &req, None),
        exec::claim(sh, &req, &slots)
    );
    let claimed: Vec<Versioned<Node>> = claimed.into_iter().filter_map(Result::ok).collect();
    // The worker knows these claims for its own ([`exec::claims_stand`]).
    let mut memory = Memory::default();
    for node in &claimed {
        memory.claim_won(&node.value.id, sent_at);
    }
    let made = Made {
        request: req,
        claimed,
        mine,
        memory,
    };
    made.recorded(sh, caller, created, retried_id).await
}

/// The submit fast path for a client that waits for the outcome, when a free slot is
/// there for every label: the slots are claimed, their agents prepare them, and the
/// request is created already fulfilled: one write on the request instead of two (the
/// create, then the fulfilled update) and no worker. The request is still durable
/// before the client hears of it. Claims made before their request exists are what the
/// sweep gives back should this launcher die in between (a claim without a request).
/// Whatever stops it half-way (a claim lost, a prepare refused, failed or slower than
/// `prepare_within`) leaves the request to its worker, created `requested` with what was
/// done (an agent answers a second prepare of the same node as it did the first).
async fn serve_at_once(
    sh: &Arc<Shared>,
    caller: &UserName,
    req: NodeRequest,
    slots: &[(u32, SlotRef)],
    prepare_within: Duration,
) -> Result<Submitted, ApiError> {
    let mut memory = Memory::default();
    let claimed = exec::claim_noting(sh, &req, slots, &mut memory).await;
    if let Some(err) = &claimed.error {
        tracing::warn!(request_id = %req.id, %err, "cannot claim a slot; the request's worker looks again");
    }
    let mut record = None;
    if !claimed.short {
        let keys: Vec<String> = claimed.won.iter().map(|n| n.key.clone()).collect();
        let prepared = tokio::time::timeout(
            prepare_within,
            exec::prepare_all(sh, &req, &keys, &mut memory),
        )
        .await;
        match prepared {
            Ok(Ok(())) => {
                let look = observe::look(sh, &req, &memory);
                match plan::next(&req, &look, now_ms()) {
                    // Without `exec::claims_stand`: these claims were made by this call
                    // moments ago for a request not created yet, and no launcher gives
                    // such a claim back before it is 45 s old (a stray).
                    RequestStep::Fulfil { nodes, hold_until } => {
                        record = Some(exec::fulfilled(&req, nodes, hold_until));
                    }
                    _ => observe::unreserve(sh, &look),
                }
            }
            Ok(Err(err)) => {
                tracing::info!(request_id = %req.id, %err, "cannot prepare at once; the request's worker goes on");
            }
            Err(_) => tracing::info!(
                request_id = %req.id,
                within = ?prepare_within,
                "the agents did not prepare in time; the request's worker goes on"
            ),
        }
    }
    let request = record.unwrap_or(req);
    let created = sh
        .bus
        .requests
        .create(request.id.as_str(), &request, None)
        .await;
    let made = Made {
        request,
        claimed: claimed.won,
        mine: true,
        memory,
    };
    made.recorded(sh, caller, created, true).await
}

/// A request about to be created by a submit, with what was done for it already.
struct Made {
    request: NodeRequest,
    /// The nodes claimed for it (some may have been given back since: the mirror
    /// refuses a record older than the slot's deletion).
    claimed: Vec<Versioned<Node>>,
    /// Whether this submit marked it driven here ([`request::begin`]).
    mine: bool,
    /// What its worker starts from.
    memory: Memory,
}

impl Made {
    /// What follows the request's create (`created`): the mirror gets it and its nodes,
    /// and its worker starts unless it is fulfilled and not held; a create that failed
    /// gives the claims back, and a retried submission of the same id (`retried_id`)
    /// is answered with the first.
    async fn recorded(
        self,
        sh: &Arc<Shared>,
        caller: &UserName,
        created: Result<u64, KvError>,
        retried_id: bool,
    ) -> Result<Submitted, ApiError> {
        let Made {
            request: req,
            claimed,
            mine,
            memory,
        } = self;
        let key = req.id.to_string();
        let revision = match created {
            Ok(revision) => revision,
            Err(err) => {
                if mine {
                    request::abandon(sh, &req.id);
                }
                let read = if reads_holder(&err, retried_id) {
                    let direct = sh
                        .bus
                        .requests
                        .get::<NodeRequest>(&key)
                        .await
                        .map_err(internal)?;
                    // The create conflicted, so the key was there: a direct get that
                    // finds nothing may have been answered by a replica that lags
                    // behind a leader change; the leader says whether it is gone.
                    Some(match direct {
                        Some(found) => Some(found),
                        None => sh
                            .bus
                            .requests
                            .get_from_leader::<NodeRequest>(&key)
                            .await
                            .map_err(internal)?,
                    })
                } else {
                    None
                };
                let holder = match &read {
                    None => Holder::NotRead,
                    Some(None) => Holder::Gone,
                    Some(Some(first)) => Holder::Found(&first.value),
                };
                let decided = create_failed(holder, &req, caller);
                if !decided.keep_claims {
                    // Given back by node: a slot given back already may hold another's
                    // node by now.
                    for node in &claimed {
                        if let Err(err) = release::release(sh, &node.value.id, Finish::Wait).await {
                            tracing::warn!(slot = %node.key, %err, "cannot give back a slot claimed for a request not created");
                        }
                    }
                }
                return match decided.answer {
                    FailedAnswer::TheFirst => Ok(Submitted {
                        request_id: req.id,
                        request: None,
                    }),
                    FailedAnswer::IdTaken => Err(bad(format!(
                        "request id {key} is already used by a different request"
                    ))),
                    FailedAnswer::Error => Err(internal(err)),
                };
            }
        };
        tracing::debug!(request_id = %req.id, labels = ?req.labels, requestor = %req.requestor, state = ?req.state, "request accepted");
        let id = req.id.clone();
        let fulfilled = req.state == RequestState::Fulfilled;
        let held = req.hold_deadline().is_some();
        {
            let mut world = sh.world();
            world.put_request(Versioned {
                key,
                revision,
                value: req.clone(),
            });
            for node in claimed {
                world.put_slot(node);
            }
        }
        if fulfilled {
            exec::note_fulfilled(sh, &req);
            sh.signals.bump(&request_topic(&id));
        }
        if mine {
            if fulfilled && !held {
                request::abandon(sh, &id);
            } else {
                request::spawn_remembering(sh, id.clone(), memory);
            }
        }
        Ok(Submitted {
            request_id: id,
            request: fulfilled.then(|| Box::new(req)),
        })
    }
}

/// Whether a submit whose create failed reads the request that holds the id: only on a
/// conflict for an id the client chose (a retried submission); a generated id is new.
fn reads_holder(err: &KvError, retried_id: bool) -> bool {
    matches!(err, KvError::Conflict { .. }) && retried_id
}

/// What a submit whose create failed learnt of the request holding the id.
#[derive(Clone, Copy, Debug)]
enum Holder<'a> {
    /// Not read ([`reads_holder`]).
    NotRead,
    /// Read, and gone since the create failed.
    Gone,
    Found(&'a NodeRequest),
}

/// What a submit whose create failed answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FailedAnswer {
    /// The request it retries: a submission of the same id, labels and client.
    TheFirst,
    /// Another request (or one gone since) holds the id: a bad request.
    IdTaken,
    /// The create's own error.
    Error,
}

/// The decision on a create that failed ([`create_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CreateFailed {
    answer: FailedAnswer,
    /// Whether the slots claimed for this submit stay claimed: they are the first
    /// request's to use while it waits (its driver takes them or gives them back);
    /// otherwise this submit gives them back.
    keep_claims: bool,
}

/// What a submit of `req` by `caller` whose create failed answers and does with its
/// claims, given what it learnt of the request that holds the id. A retried submission
/// (the same id, labels and client) is answered with the first request; any other
/// holder makes the id taken.
fn create_failed(holder: Holder<'_>, req: &NodeRequest, caller: &UserName) -> CreateFailed {
    let first = match holder {
        Holder::NotRead => {
            return CreateFailed {
                answer: FailedAnswer::Error,
                keep_claims: false,
            }
        }
        Holder::Gone => None,
        Holder::Found(first) => Some(first),
    };
    match first.filter(|f| f.labels == req.labels && f.client.as_ref() == Some(caller)) {
        Some(same) => CreateFailed {
            answer: FailedAnswer::TheFirst,
            keep_claims: same.state == RequestState::Requested,
        },
        None => CreateFailed {
            answer: FailedAnswer::IdTaken,
            keep_claims: false,
        },
    }
}

async fn release(
    sh: &Arc<Shared>,
    caller: &UserName,
    msg: &Incoming,
) -> Result<Released, ApiError> {
    let r: ReleaseNodes = decode(msg, "release request", |r: &ReleaseNodes| r.v)?;
    if r.nodes.len() > MAX_LABELS_PER_REQUEST {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "{} nodes; at most {MAX_LABELS_PER_REQUEST} per release",
                r.nodes.len()
            ),
        ));
    }
    let mut held = HashSet::new();
    for id in &r.nodes {
        if let Some(node) = nodes::record(sh, id).await.map_err(internal)? {
            check_owner(caller, node.client.as_ref(), || format!("node {id}"))?;
            held.insert(id);
        }
    }
    let mut out = Released::default();
    let results = futures::future::join_all(r.nodes.iter().map(|id| async move {
        let released = release::release(sh, id, Finish::Background).await;
        (id, released.map_err(internal))
    }))
    .await;
    for (id, result) in results {
        // A node of the caller's gone from its slot was released before: by this
        // release's first sending (whose answer was lost), say. It is answered alike.
        let before = || held.contains(id) || sh.world().released.was_of(id, caller, now_ms());
        match result? || before() {
            true => out.released.push(id.clone()),
            false => out.not_found.push(id.clone()),
        }
    }
    if !out.released.is_empty() {
        tracing::info!(released = ?out.released, "nodes released");
    }
    Ok(out)
}

async fn cancel(sh: &Arc<Shared>, caller: &UserName, msg: &Incoming) -> Result<Canceled, ApiError> {
    let c: CancelRequest = decode(msg, "cancel request", |c: &CancelRequest| c.v)?;
    let key = c.request_id.to_string();
    loop {
        let current = read_request(sh, &key).await?;
        check_owner(caller, current.value.client.as_ref(), || {
            format!("request {key}")
        })?;
        if current.value.state.is_final() {
            return Ok(Canceled {
                request_id: c.request_id,
                state: current.value.state,
            });
        }
        let mut r = current.value.clone();
        r.state = RequestState::Canceled;
        r.status = "canceled by its requestor".into();
        r.updated_at = now_ms();
        let ttl = Some(Duration::from_secs(FINISHED_REQUEST_TTL_SECS));
        match sh
            .bus
            .requests
            .update(&key, &r, current.revision, ttl)
            .await
        {
            Ok(_) => {
                return Ok(Canceled {
                    request_id: c.request_id,
                    state: RequestState::Canceled,
                })
            }
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(internal(err)),
        }
    }
}

/// Reads request `key` from KV, refusing in our terms a request that is not there or
/// whose record cannot be read.
async fn read_request(sh: &Shared, key: &str) -> Result<Versioned<NodeRequest>, ApiError> {
    sh.bus
        .requests
        .get::<NodeRequest>(key)
        .await
        .map_err(|err| match err {
            KvError::Decode { .. } => ApiError::new(
                ErrorCode::Unreadable,
                format!(
                    "request record {key} is unreadable; the slots claimed for it are released"
                ),
            ),
            err => internal(err),
        })?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no request {key}")))
}

fn keep_alive_from(now: u64, secs: u64) -> u64 {
    now.saturating_add(secs.saturating_mul(1000))
}

/// Renews a request's keep-alive: one revision-checked write of `alive_until`, starting
/// from this launcher's mirror (a stale record costs a conflict and a read). The worker
/// of the request's owner sees the change and moves its timer.
async fn keep_alive(
    sh: &Arc<Shared>,
    caller: &UserName,
    msg: &Incoming,
) -> Result<KeptAlive, ApiError> {
    let k: KeepAlive = decode(msg, "keepalive", |k: &KeepAlive| k.v)?;
    let key = k.request_id.to_string();
    let mut read = sh.world().requests.get(&k.request_id).cloned();
    loop {
        let current = match read.take() {
            Some(current) => current,
            None => read_request(sh, &key).await?,
        };
        check_owner(caller, current.value.client.as_ref(), || {
            format!("request {key}")
        })?;
        let r = &current.value;
        let Some(secs) = r.keep_alive_secs else {
            return Err(bad(format!(
                "request {key} was submitted without keep_alive_secs: it has no keep-alive to renew"
            )));
        };
        let now = now_ms();
        let ended = match r.state {
            RequestState::Requested => None,
            RequestState::Fulfilled if r.nodes_released_at.is_none() => None,
            RequestState::Fulfilled => Some("its nodes were released".to_string()),
            _ => Some(format!(
                "it is {}: {}",
                format!("{:?}", r.state).to_lowercase(),
                r.failure.as_deref().unwrap_or(&r.status)
            )),
        };
        if let Some(why) = ended {
            return Err(ApiError::new(
                ErrorCode::Ended,
                format!("request {key} has ended: {why}"),
            ));
        }
        if let Some(at) = r.alive_until.filter(|at| now >= *at) {
            return Err(ApiError::new(
                ErrorCode::Ended,
                format!(
                    "request {key}: keep-alive lapsed {} ms ago (not renewed within {secs}s); its nodes are being reclaimed",
                    now - at
                ),
            ));
        }
        let mut renewed = r.clone();
        let alive_until = keep_alive_from(now, secs);
        renewed.alive_until = Some(alive_until);
        match sh
            .bus
            .requests
            .update(&key, &renewed, current.revision, None)
            .await
        {
            Ok(revision) => {
                let state = renewed.state;
                sh.world().put_request(Versioned {
                    key,
                    revision,
                    value: renewed,
                });
                return Ok(KeptAlive {
                    request_id: k.request_id,
                    state,
                    alive_until,
                });
            }
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(internal(err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::tests_support::request;

    #[test]
    fn every_subject_is_read_as_an_operation_or_as_none() {
        assert!(matches!(
            Op::of("slotpool.api.v2.ci.submit"),
            Op::Api(ApiOp::Submit)
        ));
        assert!(matches!(
            Op::of("slotpool.api.v2.ci.wait_released"),
            Op::Api(ApiOp::WaitReleased)
        ));
        assert!(matches!(
            Op::of("slotpool.admin.v2.alice.release_node"),
            Op::Admin(OperatorAction::ReleaseNode)
        ));
        assert!(matches!(
            Op::of("slotpool.admin.v2.alice.log_tail"),
            Op::LogTail
        ));
        assert!(matches!(Op::of("slotpool.api.v1.submit"), Op::Retired));
        for unknown in [
            "slotpool.api.v2.ci.frobnicate",
            "slotpool.api.v2.ci.submit.now",
            "slotpool.api.v2.ci.hold",
            "slotpool.admin.v2.alice.submit",
        ] {
            assert!(matches!(Op::of(unknown), Op::Unknown), "{unknown}");
        }
        let err = unknown_operation("slotpool.api.v2.ci.frobnicate");
        assert_eq!(err.code, ErrorCode::UnknownOperation);
        assert!(
            err.message.contains("no operation \"frobnicate\"")
                && err.message.contains("submit, release"),
            "{}",
            err.message
        );
    }

    fn user(name: &str) -> UserName {
        UserName::parse(name).unwrap()
    }

    #[test]
    fn only_a_conflict_on_an_id_the_client_chose_is_worth_a_read() {
        let kv = |conflict| {
            let (bucket, key) = ("requests".to_string(), "r".to_string());
            if conflict {
                KvError::Conflict { bucket, key }
            } else {
                KvError::Timeout { bucket, key }
            }
        };
        // (conflict, retried id) -> read the holder
        for (conflict, retried, reads) in [
            (true, true, true),
            (true, false, false),
            (false, true, false),
            (false, false, false),
        ] {
            assert_eq!(
                reads_holder(&kv(conflict), retried),
                reads,
                "{conflict} {retried}"
            );
        }
    }

    #[test]
    fn a_failed_create_answers_the_first_request_only_for_the_same_submission() {
        let mut req = request("req-1", &["small", "big"]);
        req.client = Some(user("ci"));
        let caller = user("ci");
        let first = |f: &dyn Fn(&mut NodeRequest)| {
            let mut r = req.clone();
            f(&mut r);
            r
        };
        let waiting = first(&|_| {});
        let fulfilled = first(&|r| r.state = RequestState::Fulfilled);
        let failed = first(&|r| r.state = RequestState::Failed);
        let other_labels = first(&|r| r.labels = vec!["small".into()]);
        let reordered = first(&|r| r.labels = vec!["big".into(), "small".into()]);
        let other_client = first(&|r| r.client = Some(user("mallory")));
        let no_client = first(&|r| r.client = None);
        use FailedAnswer::*;
        // holder -> (answer, claims kept)
        let cases: [(&str, Holder, FailedAnswer, bool); 9] = [
            ("not read", Holder::NotRead, Error, false),
            ("gone since", Holder::Gone, IdTaken, false),
            ("the same, waiting", Holder::Found(&waiting), TheFirst, true),
            (
                "the same, fulfilled",
                Holder::Found(&fulfilled),
                TheFirst,
                false,
            ),
            ("the same, failed", Holder::Found(&failed), TheFirst, false),
            ("other labels", Holder::Found(&other_labels), IdTaken, false),
            (
                "labels in another order",
                Holder::Found(&reordered),
                IdTaken,
                false,
            ),
            (
                "another client",
                Holder::Found(&other_client),
                IdTaken,
                false,
            ),
            ("no client", Holder::Found(&no_client), IdTaken, false),
        ];
        for (what, holder, answer, keep_claims) in cases {
            assert_eq!(
                create_failed(holder, &req, &caller),
                CreateFailed {
                    answer,
                    keep_claims
                },
                "{what}"
            );
        }
        assert_eq!(
            create_failed(Holder::Found(&waiting), &req, &user("mallory")).answer,
            IdTaken,
            "another caller retrying the id"
        );
    }
}
