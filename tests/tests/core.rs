//! End-to-end tests of the core: real nats-server, real `slotpool serve` processes, real
//! `slotpool-agent` processes started by the local provider.

use slotpool_protocol::api::ErrorCode;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::layout::{slot_key, subjects};
use slotpool_protocol::model::{BackingState, Node, NodeRequest, NodeState, RequestState};
use slotpool_protocol::store::Change;
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{LauncherId, NodeId, RequestId};
use slotpool_tests::metrics::{scrape_as, value};
use slotpool_tests::{label, next_within, wait_for, wait_for_some, Pool, AGENT_ARGS};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);
/// How long a round trip to the test's nats-server may take ([`Bus::sync`]).
///
/// [`Bus::sync`]: slotpool_protocol::connect::Bus::sync
const SYNC: Duration = Duration::from_secs(10);

fn ids(reqs: &[NodeRequest]) -> Vec<NodeId> {
    reqs.iter().flat_map(|r| r.nodes.clone()).collect()
}

/// Every request fulfilled with its own nodes, and no slot held twice.
async fn assert_exactly_once(pool: &Pool, reqs: &[NodeRequest]) {
    let nodes = ids(reqs);
    let unique: HashSet<_> = nodes.iter().collect();
    assert_eq!(
        unique.len(),
        nodes.len(),
        "a node was handed to two requests"
    );
    let held = pool.nodes().await;
    let slots: HashSet<_> = held
        .iter()
        .map(|n| (n.backing_id.clone(), n.slot))
        .collect();
    assert_eq!(slots.len(), held.len(), "a slot is held by two nodes");
    let by_id: HashMap<_, _> = held.iter().map(|n| (n.id.clone(), n)).collect();
    for r in reqs {
        assert_eq!(r.state, RequestState::Fulfilled);
        assert_eq!(r.nodes.len(), r.labels.len());
        for id in &r.nodes {
            let n = by_id
                .get(id)
                .unwrap_or_else(|| panic!("node {id} of {} is not held", r.id));
            assert_eq!(n.request_id, r.id, "node {id} names another request");
        }
    }
    let extra: Vec<_> = held.iter().filter(|n| !unique.contains(&n.id)).collect();
    assert!(
        extra.is_empty(),
        "slots held by no fulfilled request: {extra:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_fill_backing_nodes_which_are_released_after_grace_time() {
    let pool = Pool::start(4, 5, &label("small", 4, 2, &[]), 1).await;
    let mut first = Vec::new();
    for _ in 0..3 {
        let id = pool.submit(&["small"]).await;
        first.push(pool.fulfilled(&id).await);
    }
    assert_eq!(
        pool.backing().await.len(),
        1,
        "3 nodes fit on one backing node of 4 slots"
    );
    let mut all = first.clone();
    for _ in 0..2 {
        let id = pool.submit(&["small"]).await;
        all.push(pool.fulfilled(&id).await);
    }
    assert_eq!(
        pool.backing().await.len(),
        2,
        "the 5th node needs a second backing node"
    );
    assert_exactly_once(&pool, &all).await;
    let released = pool.client.release(ids(&all)).await.expect("release");
    assert_eq!(released.released.len(), 5);
    let last_release = Instant::now();
    wait_for(
        "both backing nodes released",
        Duration::from_secs(10),
        || async { pool.backing().await.is_empty() },
    )
    .await;
    let took = last_release.elapsed();
    assert!(
        took >= Duration::from_secs(2),
        "released {took:?} after the last slot: earlier than grace-time"
    );
    assert!(
        took <= Duration::from_secs(4),
        "released {took:?} after the last slot: more than 2 s after grace-time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_retention_holds_and_max_age_retires() {
    let labels =
        label("kept", 2, 1, &["min-retention-time: 6"]) + &label("aging", 2, 60, &["max-age: 3"]);
    let http = ["--http", "127.0.0.1:0"];
    let pool = Pool::start_serving_with(4, 5, &labels, 1, &AGENT_ARGS, &http).await;
    let kept = pool.fulfilled(&pool.submit(&["kept"]).await).await;
    let aging = pool.fulfilled(&pool.submit(&["aging"]).await).await;
    let started = Instant::now();
    pool.client.release(kept.nodes.clone()).await.unwrap();
    // Past grace-time (1 s) the kept node is still there: min-retention-time holds it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        pool.backing().await.iter().any(|b| b.label == "kept"),
        "released before min-retention-time"
    );
    wait_for(
        "the kept node released after min-retention",
        Duration::from_secs(10),
        || async { !pool.backing().await.iter().any(|b| b.label == "kept") },
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "released before min-retention-time"
    );

    wait_for(
        "the aging node retired at max-age",
        Duration::from_secs(10),
        || async {
            pool.backing()
                .await
                .iter()
                .any(|b| b.label == "aging" && b.state == BackingState::Retiring)
        },
    )
    .await;
    // Retired: a new request for the label gets a new backing node.
    let other = pool.fulfilled(&pool.submit(&["aging"]).await).await;
    let old = pool.node(&aging.nodes[0]).await.backing_id;
    let new = pool.node(&other.nodes[0]).await.backing_id;
    assert_ne!(old, new, "a retired backing node took a new slot");
    pool.client.release(aging.nodes.clone()).await.unwrap();
    wait_for(
        "the retired node released once empty",
        Duration::from_secs(10),
        || async { !pool.backing().await.iter().any(|b| b.id == old) },
    )
    .await;
    // `/metrics` counts each release for its reason.
    let s = scrape_as(pool.http_addr(0).await, Some(&pool.operator_token())).await;
    let deleted = |label, reason| {
        value(
            &s,
            "slotpool_backing_deletions_total",
            &[("label", label), ("reason", reason)],
        )
    };
    assert_eq!(deleted("kept", "grace"), 1.0);
    assert_eq!(deleted("aging", "max-age"), 1.0);
    assert_eq!(value(&s, "slotpool_backing_deletions_total", &[]), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_servers_bounds_backing_nodes_and_waiting_requests_are_served_later() {
    let pool = Pool::start(2, 5, &label("small", 4, 30, &[]), 1).await;
    let mut reqs = Vec::new();
    for _ in 0..12 {
        reqs.push(pool.submit(&["small"]).await);
    }
    wait_for("8 requests fulfilled", LONG, || async {
        let all = pool.client.list_requests().await.unwrap();
        all.iter()
            .filter(|r| r.state == RequestState::Fulfilled)
            .count()
            == 8
    })
    .await;
    // A waiting request's status says why once it has waited a moment.
    wait_for("the waiting requests' status to say why", LONG, || async {
        let all = pool.client.list_requests().await.unwrap();
        let waiting: Vec<_> = all
            .iter()
            .filter(|r| r.state == RequestState::Requested)
            .collect();
        // A listing races the waiting requests' status writes, and can miss a record
        // being rewritten: look again rather than conclude from one listing.
        waiting.len() == 4 && waiting.iter().all(|r| r.status.contains("max-servers"))
    })
    .await;
    assert_eq!(
        pool.backing().await.len(),
        2,
        "never more than max-servers backing nodes"
    );
    // Release the fulfilled ones: the waiting ones get their slots.
    let all = pool.client.list_requests().await.unwrap();
    let fulfilled: Vec<NodeRequest> = all
        .into_iter()
        .filter(|r| r.state == RequestState::Fulfilled)
        .collect();
    pool.client.release(ids(&fulfilled)).await.unwrap();
    let mut done = Vec::new();
    for id in &reqs {
        let r = pool.wait_final(id, LONG).await;
        assert_eq!(r.state, RequestState::Fulfilled);
        if !fulfilled.iter().any(|f| &f.id == id) {
            done.push(r);
        }
    }
    assert_eq!(done.len(), 4);
    // A release is acknowledged before the agent has wiped the slot.
    tokio::time::timeout(LONG, pool.client.wait_released(&ids(&fulfilled)))
        .await
        .expect("the released slots freed")
        .unwrap();
    assert_exactly_once(&pool, &done).await;
    assert_eq!(pool.backing().await.len(), 2);
}

async fn burst(pool: &Pool, n: usize) -> Vec<RequestId> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(pool.submit(&["small"]).await);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_launcher_is_restarted_and_every_request_is_fulfilled_once() {
    let http = ["--http", "127.0.0.1:0"];
    let labels = label("small", 4, 30, &[]);
    let mut pool = Pool::start_serving_with(6, 2, &labels, 1, &AGENT_ARGS, &http).await;
    let ids = burst(&pool, 20).await;
    // Kill it mid-burst: as soon as the first request is fulfilled.
    pool.wait_final(&ids[0], LONG).await;
    pool.kill_launcher(0);
    let next = pool.spawn_launcher();
    let mut reqs = Vec::new();
    for id in &ids {
        reqs.push(pool.wait_final(id, LONG).await);
    }
    assert_exactly_once(&pool, &reqs).await;
    assert!(pool.backing().await.len() <= 6);
    // The new launcher took over the requests the killed one still owned, once its
    // liveness lease lapsed; `/metrics` counts each.
    let addr = pool.http_addr(next).await;
    let counted = wait_for_some("/metrics to count every take-over logged", LONG, || async {
        let took = pool
            .launcher_log(next)
            .matches("took the request over")
            .count();
        let counted = value(
            &scrape_as(addr, Some(&pool.operator_token())).await,
            "slotpool_lease_takeovers_total",
            &[],
        );
        (counted == took as f64).then_some(counted)
    })
    .await;
    assert!(counted > 0.0, "no request was taken over");
}

/// A release acknowledged but never finished (its launcher was killed), and slots
/// claimed (`preparing`, or `ready` from the agent's slot names) for a request that was
/// never created, are finished by the next launcher: the agent wipes the slots and they
/// are handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_and_claims_left_behind_by_a_killed_launcher_are_finished() {
    let mut pool = Pool::start(1, 2, &label("small", 3, 30, &[]), 1).await;
    let r = pool
        .fulfilled(&pool.submit(&["small", "small", "small"]).await)
        .await;
    pool.kill_launcher(0);
    let a_minute_ago = now_ms() - 60_000;
    rewrite_node(&pool, &r.nodes[0], |n| {
        n.state = NodeState::Releasing;
        n.released_at = Some(a_minute_ago);
    })
    .await;
    for (id, state) in r.nodes[1..]
        .iter()
        .zip([NodeState::Preparing, NodeState::Ready])
    {
        rewrite_node(&pool, id, |n| {
            n.state = state;
            n.request_id = RequestId::parse("req-never-created").unwrap();
            n.allocated_at = a_minute_ago;
        })
        .await;
    }
    pool.spawn_launcher();
    tokio::time::timeout(LONG, pool.client.wait_released(&r.nodes))
        .await
        .expect("both slots freed")
        .unwrap();
    wait_for("the agent to report its slots wiped", LONG, || async {
        let agents = pool.client.list_agents().await.unwrap();
        agents.len() == 1 && agents[0].slots.is_empty()
    })
    .await;
    let again = pool
        .fulfilled(&pool.submit(&["small", "small", "small"]).await)
        .await;
    assert_eq!(again.nodes.len(), 3, "the slots are handed out again");
}

/// A claim of a `ready` slot with no request behind it is freed whatever date it
/// carries, once the server's time of its write is old enough: one dated two hours ago
/// (older than a finished request's record lives) and one dated five minutes in the
/// future (a clock ahead by less than any skew allowance), written while the launcher
/// runs. A fulfilled
/// request's record stays while its nodes are held and is marked released (then
/// expires) once they are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_claims_are_freed_whatever_their_date_and_requests_live_as_long_as_their_nodes() {
    let pool = Pool::start(1, 1, &label("small", 3, 30, &[]), 1).await;
    let r = pool
        .fulfilled(&pool.submit(&["small", "small", "small"]).await)
        .await;
    let held = &r.nodes[0];
    let two_hours_ago = now_ms() - 2 * 3_600_000;
    let in_five_minutes = now_ms() + 300_000;
    for (id, at) in r.nodes[1..].iter().zip([two_hours_ago, in_five_minutes]) {
        rewrite_node(&pool, id, |n| {
            n.request_id = RequestId::parse("req-forged").unwrap();
            n.allocated_at = at;
        })
        .await;
    }
    // Judged by the server's time of the rewrite (45 s), at a sweep (every 15 s).
    tokio::time::timeout(
        Duration::from_secs(90),
        pool.client.wait_released(&r.nodes[1..]),
    )
    .await
    .expect("the forged claims freed")
    .unwrap();
    let record = |pool: &Pool| {
        let bus = pool.client.bus().clone();
        let id = r.id.clone();
        async move {
            bus.requests
                .get::<NodeRequest>(id.as_str())
                .await
                .unwrap()
                .expect("the fulfilled request's record is kept")
                .value
        }
    };
    assert_eq!(
        record(&pool).await.nodes_released_at,
        None,
        "a node is held"
    );
    assert!(
        pool.nodes().await.iter().any(|n| &n.id == held),
        "the real claim is kept"
    );
    pool.client.release(vec![held.clone()]).await.unwrap();
    wait_for("the request marked released", LONG, || async {
        record(&pool).await.nodes_released_at.is_some()
    })
    .await;
}

/// A node is claimed `ready`, with the workspace and login its agent's heartbeat names,
/// before the agent prepares it. One claimed so by a launcher that died before the
/// prepare is prepared by the launcher that takes the request over, before the request
/// is fulfilled. The local agent outlives the launcher killed with SIGKILL (unlike the
/// demo's, a `slotpool serve`'s agents are not tied to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_claimed_before_its_launcher_died_is_prepared_by_the_next_one() {
    let mut pool = Pool::start(1, 2, &label("small", 2, 30, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    pool.kill_launcher(0);
    // As the dead launcher left it: its request, and a node claimed on the other slot.
    let held = pool.nodes().await.pop().unwrap();
    let pid_file = pool.agent_dir(held.backing_id.as_str()).join("agent.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let slot = 1 - held.slot;
    // Straight from KV (the test's bus user is a launcher's): no launcher runs now.
    let mut request: NodeRequest = pool
        .client
        .bus()
        .requests
        .get(first.id.as_str())
        .await
        .unwrap()
        .unwrap()
        .value;
    request.id = RequestId::generate();
    request.state = RequestState::Requested;
    request.nodes.clear();
    request.owner = Some(LauncherId::parse("launcher-dead").unwrap());
    let agents = pool.client.list_agents().await.unwrap();
    let names = agents[0]
        .slot_names
        .as_ref()
        .expect("the agent names its slots");
    let node = Node {
        id: NodeId::for_slot(&held.backing_id, slot),
        request_id: request.id.clone(),
        slot,
        workspace: Some(names.workspace_of(slot)),
        ..held.clone()
    };
    let bus = pool.client.bus();
    bus.requests
        .create(request.id.as_str(), &request, None)
        .await
        .unwrap();
    bus.slots
        .create(&slot_key(&node.backing_id, slot), &node, None)
        .await
        .unwrap();
    pool.spawn_launcher();
    let r = pool.fulfilled(&request.id).await;
    assert_eq!(r.nodes, vec![node.id.clone()]);
    wait_for("the agent to report the slot prepared", LONG, || async {
        let agents = pool.client.list_agents().await.unwrap();
        agents[0]
            .slots
            .iter()
            .any(|s| s.slot == slot && s.node_id == node.id)
    })
    .await;
    // The same agent process, which has lived on since its launcher's death.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(") ")
        .next()
        .and_then(|rest| rest.chars().next());
    assert!(
        matches!(state, Some(s) if s != 'Z' && s != 'X'),
        "the local agent {pid} died with its launcher: {stat:?}"
    );
}

/// A slot is written once when its agent names its slots: claimed `ready`, prepared,
/// and the request fulfilled, with no second write of the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_allocation_writes_its_slot_once() {
    let pool = Pool::start(1, 2, &label("small", 2, 30, &[]), 1).await;
    // The first request waits for the backing node; the second finds a free slot.
    pool.fulfilled(&pool.submit(&["small"]).await).await;
    let mut changes = Box::pin(pool.client.bus().slots.watch_new(">").await.unwrap());
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node = pool.node(&r.nodes[0]).await;
    assert_eq!(node.state, NodeState::Ready);
    let agents = pool.client.list_agents().await.unwrap();
    let names = agents[0]
        .slot_names
        .as_ref()
        .expect("the agent names its slots");
    assert_eq!(node.workspace, Some(names.workspace_of(node.slot)));
    // The slot's first write since the watch began (the claim) is its current revision.
    let key = slot_key(&node.backing_id, node.slot);
    let now = pool
        .client
        .bus()
        .slots
        .get::<Node>(&key)
        .await
        .unwrap()
        .unwrap();
    let claimed = loop {
        match next_within(&mut changes, LONG, "the claim of the slot")
            .await
            .unwrap()
        {
            Change::Put {
                key: k, revision, ..
            } if k == key => break revision,
            _ => {}
        }
    };
    assert_eq!(
        claimed, now.revision,
        "the slot was written again after its claim"
    );
}

/// Changes a node's record behind the launchers' backs (revision-checked).
async fn rewrite_node(pool: &Pool, id: &NodeId, change: impl FnOnce(&mut Node)) {
    let (backing, slot) = id.slot().unwrap();
    let key = slot_key(&backing, slot);
    let slots = &pool.client.bus().slots;
    let node = slots.get::<Node>(&key).await.unwrap().unwrap();
    let mut changed = node.value.clone();
    change(&mut changed);
    slots
        .update(&key, &changed, node.revision, None)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_launchers_share_a_burst_and_one_finishes_when_the_other_dies() {
    let mut pool = Pool::start(12, 2, &label("small", 4, 30, &[]), 2).await;
    let first = burst(&pool, 20).await;
    let mut reqs = Vec::new();
    for id in &first {
        reqs.push(pool.wait_final(id, LONG).await);
    }
    assert_exactly_once(&pool, &reqs).await;
    // Second half: kill one launcher in the middle of it.
    let second = burst(&pool, 20).await;
    pool.kill_launcher(0);
    for id in &second {
        reqs.push(pool.wait_final(id, LONG).await);
    }
    assert_eq!(reqs.len(), 40);
    assert_exactly_once(&pool, &reqs).await;
    assert!(pool.backing().await.len() <= 12);
}

/// One launcher takes seats, the live one with the lowest id; when it dies, the next one
/// launches for the requests waiting once the planner's liveness lease has lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_launcher_launches_once_the_planner_dies() {
    let mut pool = Pool::start(4, 2, &label("small", 1, 600, &[]), 2).await;
    let id_of = |pool: &Pool, n: usize| {
        let log = pool.launcher_log(n);
        let at = log.find("launcher starting launcher=")?;
        let id = log[at..].split('=').nth(1)?.split_whitespace().next()?;
        LauncherId::parse(id).ok()
    };
    let ids = wait_for_some("both launchers to say their ids", SYNC, || async {
        Some([id_of(&pool, 0)?, id_of(&pool, 1)?])
    })
    .await;
    let (planner, other) = if ids[0] < ids[1] { (0, 1) } else { (1, 0) };
    let launches = |pool: &Pool, n: usize| {
        pool.launcher_log(n)
            .matches("requested a backing node")
            .count()
    };

    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    assert_eq!(
        launches(&pool, planner),
        1,
        "the planner launched the first node"
    );
    assert_eq!(launches(&pool, other), 0, "only the planner takes seats");

    pool.kill_launcher(planner);
    // Its node stays held: the next request needs a launch, planned once the planner's
    // lease (2 s) lapses, well before the launcher's resync (15 s) would.
    let id = pool.submit(&["small"]).await;
    let second = pool.wait_final(&id, Duration::from_secs(8)).await;
    assert_eq!(second.state, RequestState::Fulfilled, "{second:?}");
    assert_ne!(
        pool.node(&second.nodes[0]).await.backing_id,
        pool.node(&first.nodes[0]).await.backing_id
    );
    assert_eq!(launches(&pool, other), 1, "the next launcher launched it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agent_fails_its_backing_node_and_new_requests_go_elsewhere() {
    let pool = Pool::start(2, 5, &label("small", 4, 30, &[]), 1).await;
    let r = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node = pool.node(&r.nodes[0]).await;
    // Kill the agent process of its backing node.
    let pid: i32 = std::fs::read_to_string(
        pool.work_dir()
            .join(node.backing_id.as_str())
            .join("agent.pid"),
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap();
    let killed = Instant::now();
    // SAFETY: the agent was started by this test's launcher.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_for(
        "the backing node marked failed",
        Duration::from_secs(10),
        || async {
            pool.backing()
                .await
                .iter()
                .any(|b| b.id == node.backing_id && b.state == BackingState::Failed)
        },
    )
    .await;
    let took = killed.elapsed();
    assert!(
        took <= Duration::from_secs(4),
        "failed {took:?} after the agent died (heartbeat TTL 2 s)"
    );
    let failed_node = pool.node(&node.id).await;
    assert!(
        failed_node
            .failure
            .as_deref()
            .unwrap_or("")
            .contains("failed"),
        "{failed_node:?}"
    );
    let later = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let later_node = pool.node(&later.nodes[0]).await;
    assert_ne!(
        later_node.backing_id, node.backing_id,
        "a new request landed on the dead backing node"
    );
    // The failed node can still be released by its requestor.
    assert_eq!(
        pool.client.release(r.nodes.clone()).await.unwrap().released,
        r.nodes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_the_launcher_keeps_serving() {
    let pool = Pool::start(2, 5, &label("small", 2, 30, &[]), 1).await;
    let bus = pool.client.bus();
    let timeout = Duration::from_secs(10);
    let submit = subjects::api(pool.client.name(), subjects::ApiOp::Submit);
    let submit = &submit;
    let reply = |raw: &'static [u8]| async move {
        bus.call_raw(submit, bytes::Bytes::from_static(raw), timeout)
            .await
            .unwrap()
    };

    let r = reply(b"{not json").await;
    let v: serde_json::Value = serde_json::from_slice(&r).unwrap();
    assert_eq!(v["error"]["code"], "bad_request");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("malformed submit request"),
        "{v}"
    );

    let r = reply(br#"{"labels":["small"],"requestor":"t","colour":"red"}"#).await;
    let v: serde_json::Value = serde_json::from_slice(&r).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown field `colour`"),
        "{v}"
    );

    let big = format!(
        r#"{{"labels":["small"],"requestor":"{}"}}"#,
        "x".repeat(70_000)
    );
    let r = bus
        .call_raw(submit, bytes::Bytes::from(big), timeout)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r).unwrap();
    assert_eq!(v["error"]["code"], "too_large", "{v}");

    let sub = slotpool_protocol::client::submission(vec!["small".into(), "huge".into()], "t");
    match pool.client.submit(&sub).await {
        Err(BusError::Api(e)) => {
            assert_eq!(e.code, ErrorCode::UnknownLabel);
            assert!(
                e.message.contains("\"huge\"") && e.message.contains("small"),
                "{}",
                e.message
            );
        }
        other => panic!("unknown label accepted: {other:?}"),
    }

    // 2 servers x 2 slots: a set of 5 could never be served, and would wait for ever.
    let sub = slotpool_protocol::client::submission(vec!["small".into(); 5], "t");
    match pool.client.submit(&sub).await {
        Err(BusError::Api(e)) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(
                e.message.contains("5 nodes of label \"small\"") && e.message.contains("at most 4"),
                "{}",
                e.message
            );
        }
        other => panic!("an unservable node set accepted: {other:?}"),
    }

    let released = pool
        .client
        .release(vec![NodeId::parse("node-nosuch").unwrap()])
        .await
        .unwrap();
    assert_eq!(released.not_found.len(), 1);

    // Still serving.
    pool.fulfilled(&pool.submit(&["small"]).await).await;
}

/// A submit with `wait_ms` is answered once the request ends, with the request: one
/// exchange where a client would otherwise submit, then ask `status`. A request that
/// does not end within the wait is answered as it stands then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_that_waits_is_answered_with_the_request_once_it_ends() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let bus = pool.client.bus();
    let submit = subjects::api(pool.client.name(), subjects::ApiOp::Submit);
    let call = |body: &'static str| {
        let submit = submit.clone();
        async move {
            let r = bus
                .call_raw(
                    &submit,
                    bytes::Bytes::from_static(body.as_bytes()),
                    Duration::from_secs(20),
                )
                .await
                .unwrap();
            serde_json::from_slice::<serde_json::Value>(&r).unwrap()
        }
    };
    // No backing node yet: the reply waits for one to boot and the slot to be prepared.
    let v = call(r#"{"v":1,"id":"req-waits-1","labels":["small"],"requestor":"t","wait_ms":8000}"#)
        .await;
    assert_eq!(v["ok"]["request_id"], "req-waits-1", "{v}");
    assert_eq!(v["ok"]["request"]["state"], "fulfilled", "{v}");
    let node = v["ok"]["request"]["nodes"][0]
        .as_str()
        .expect("a node")
        .to_string();
    // The one slot is held: the next request waits, and is answered as it stands after
    // its wait.
    let v = call(r#"{"v":1,"id":"req-waits-2","labels":["small"],"requestor":"t","wait_ms":300}"#)
        .await;
    assert_eq!(v["ok"]["request"]["state"], "requested", "{v}");
    // Without wait_ms the reply is the id alone, at once, as before.
    let v = call(r#"{"v":1,"id":"req-waits-3","labels":["small"],"requestor":"t"}"#).await;
    assert_eq!(
        v["ok"],
        serde_json::json!({"request_id": "req-waits-3"}),
        "{v}"
    );
    // The typed client takes the same way; the held slot is given back for it.
    pool.client
        .release(vec![NodeId::parse(&node).unwrap()])
        .await
        .unwrap();
    for id in ["req-waits-2", "req-waits-3"] {
        let r = pool.fulfilled(&RequestId::parse(id).unwrap()).await;
        pool.release_and_wait(&r.nodes).await;
    }
    let watcher = pool.client.watcher().await.unwrap();
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "t");
    let done = watcher.submit_and_wait(&sub).await.unwrap();
    assert_eq!(done.state, RequestState::Fulfilled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_times_out_with_its_reason_and_can_be_canceled() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let held = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let mut sub = slotpool_protocol::client::submission(vec!["small".into()], "t");
    sub.timeout_secs = Some(1);
    let id = pool.client.submit(&sub).await.unwrap();
    let r = pool.wait_final(&id, LONG).await;
    assert_eq!(r.state, RequestState::Failed);
    assert!(
        r.failure
            .as_deref()
            .unwrap()
            .starts_with("timed out after 1s: waiting for a free slot of small"),
        "{r:?}"
    );

    let waiting = pool.submit(&["small"]).await;
    let c = pool.client.cancel(waiting.clone()).await.unwrap();
    assert_eq!(c.state, RequestState::Canceled);
    pool.client.release(held.nodes).await.unwrap();
    // The canceled request never takes the freed slot.
    let next = pool.fulfilled(&pool.submit(&["small"]).await).await;
    assert_eq!(pool.nodes().await.len(), 1);
    assert_eq!(pool.nodes().await[0].id, next.nodes[0]);
}

/// The client sends a call again while no launcher answered (a message or a reply lost
/// with a server that died), so every call must be answered alike when it comes twice:
/// a release sent again after the first finished lists the nodes `released` as the
/// first did, even once the slot holds another request's node (which it leaves alone),
/// and a cancel sent again answers `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_or_cancel_sent_again_is_answered_as_the_first() {
    let pool = Pool::start(1, 5, &label("small", 1, 30, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    assert_eq!(
        pool.release_and_wait(&first.nodes).await.released,
        first.nodes
    );
    let again = pool.client.release(first.nodes.clone()).await.unwrap();
    assert_eq!(
        (again.released, again.not_found),
        (first.nodes.clone(), vec![]),
        "a release sent again after the first finished"
    );

    // The only slot now holds the next request's node: a release of the first node sent
    // again still answers as the first did, and takes nothing from the next request.
    let next = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let again = pool.client.release(first.nodes.clone()).await.unwrap();
    assert_eq!(
        (again.released, again.not_found),
        (first.nodes.clone(), vec![])
    );
    assert_eq!(pool.node(&next.nodes[0]).await.state, NodeState::Ready);

    let waiting = pool.submit(&["small"]).await;
    for _ in 0..2 {
        let c = pool.client.cancel(waiting.clone()).await.unwrap();
        assert_eq!(c.state, RequestState::Canceled);
    }
    // A node that was never handed out is still not found.
    let never =
        NodeId::parse("node-01jq3m8x5v9k2c7t4r6y0a1b2d_0_bn-01jq3m2f7h8g9k0m1n2p3q4r5s").unwrap();
    let released = pool.client.release(vec![never.clone()]).await.unwrap();
    assert_eq!(
        (released.released, released.not_found),
        (vec![], vec![never])
    );
    pool.release_and_wait(&next.nodes).await;
}

/// A client's call whose message (or reply) is lost, as with a server that dies on its
/// way while the client's own connection stays up, is sent again after a second
/// (`API_RESEND`), not given up after the whole time-out; a submit sent again carries
/// the same request id, so that the launcher takes it for the same request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_an_answer_is_sent_again_after_a_second() {
    use futures::StreamExt;
    use slotpool_protocol::api::{Released, Reply, SubmitRequest, Submitted};
    use slotpool_protocol::auth::Role;
    use slotpool_protocol::client::{submission, Client, API_RESEND};
    use slotpool_protocol::connect::Bus;

    let nats = slotpool_tests::NatsServer::start().await;
    let responder = nats.bus().await;
    let client = Client::connect(&nats.options_as(Role::Client, "ci"))
        .await
        .expect("client connects");
    // Every message the launcher got: its subject and payload.
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;
    let seen: Seen = Default::default();
    // A launcher whose first message of each operation is lost on the way.
    let mut incoming = responder
        .serve("slotpool.api.v2.ci.*", None)
        .await
        .expect("subscribed");
    // A flush only writes the subscription to the socket: the client's first copy,
    // on its own connection, could reach the server before it and meet no responders.
    responder
        .sync(SYNC)
        .await
        .expect("the server took in the subscription");
    let answering = {
        let seen = seen.clone();
        let responder: Bus = responder.clone();
        tokio::spawn(async move {
            while let Some(msg) = incoming.next().await {
                let first = {
                    let mut seen = seen.lock().unwrap();
                    let first = !seen.iter().any(|(s, _)| *s == msg.subject);
                    seen.push((msg.subject.clone(), msg.payload.to_vec()));
                    first
                };
                let Some(reply_to) = msg.reply_to.filter(|_| !first) else {
                    continue;
                };
                if msg.subject.ends_with(".submit") {
                    let s: SubmitRequest = serde_json::from_slice(&msg.payload).unwrap();
                    let reply = Reply::Ok(Submitted {
                        request_id: s.id.expect("a submit sent again has an id"),
                        request: None,
                    });
                    responder.respond(&reply_to, &reply).await.unwrap();
                } else {
                    let reply = Reply::Ok(Released::default());
                    responder.respond(&reply_to, &reply).await.unwrap();
                }
            }
        })
    };

    let started = Instant::now();
    client
        .release(vec![])
        .await
        .expect("a release sent again is answered");
    let took = started.elapsed();
    assert!(
        took >= API_RESEND && took < API_RESEND * 2,
        "answered after {took:?}: sent again after {API_RESEND:?}"
    );
    let started = Instant::now();
    let id = client
        .submit(&submission(vec!["small".into()], "t"))
        .await
        .expect("a submit sent again is answered");
    assert!(
        started.elapsed() < API_RESEND * 2,
        "{:?}",
        started.elapsed()
    );
    let submits: Vec<SubmitRequest> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(s, _)| s.ends_with(".submit"))
        .map(|(_, p)| serde_json::from_slice(p).unwrap())
        .collect();
    assert_eq!(submits.len(), 2, "{submits:?}");
    assert!(
        submits.iter().all(|s| s.id.as_ref() == Some(&id)),
        "{submits:?}"
    );
    answering.abort();
}

/// A copy of a call sent again that meets no responders, as one can in a cluster whose
/// server does not know a launcher's subscription yet (the launcher reconnecting, or
/// its server's routes), does not end a call whose first copy may still be answered.
/// The launcher here takes the first copy of a release, is gone from the bus while the
/// copy sent after a second (`API_RESEND`) arrives, is back for the one sent two seconds
/// later, and then answers the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_sent_again_that_meets_no_responders_does_not_end_the_call() {
    use futures::StreamExt;
    use slotpool_protocol::api::{Released, Reply};
    use slotpool_protocol::auth::Role;
    use slotpool_protocol::client::{Client, API_RESEND};
    use slotpool_protocol::layout::subjects::ApiOp;

    let nats = slotpool_tests::NatsServer::start().await;
    let responder = nats.bus().await;
    let client = Client::connect(&nats.options_as(Role::Client, "ci"))
        .await
        .expect("client connects");
    let subject = subjects::api(client.name(), ApiOp::Release);
    let mut incoming = responder.serve(&subject, None).await.expect("subscribed");
    responder
        .sync(SYNC)
        .await
        .expect("the server took in the subscription");
    let answering = tokio::spawn(async move {
        let first = incoming.next().await.expect("the first copy arrives");
        let first_at = Instant::now();
        drop(incoming);
        responder
            .sync(SYNC)
            .await
            .expect("the server took in the unsubscribe");
        // Away from the bus across the second copy's sending (`API_RESEND` after the
        // first) and back well before the third's (twice that later): what is waited
        // on here is the client's schedule, and the test checks below which copy came.
        tokio::time::sleep(API_RESEND * 2).await;
        let mut incoming = responder.serve(&subject, None).await.expect("subscribed");
        responder
            .sync(SYNC)
            .await
            .expect("the server took in the subscription");
        incoming.next().await.expect("a later copy arrives");
        let later = first_at.elapsed();
        let reply_to = first.reply_to.expect("a call has a reply subject");
        responder
            .respond(&reply_to, &Reply::Ok(Released::default()))
            .await
            .expect("the first copy is answered");
        // The answer is on its way before this connection closes with the task.
        responder
            .sync(SYNC)
            .await
            .expect("the server took in the answer");
        later
    });
    let answered = client.release(vec![]);
    let released = match tokio::time::timeout(LONG, answered).await {
        Ok(Ok(released)) => released,
        Ok(Err(err)) => {
            answering.abort();
            panic!("the first copy's answer ends the call: {err}");
        }
        Err(_) => panic!("the release was answered nothing within {LONG:?}"),
    };
    let later = answering.await.expect("the responder ran");
    // The third copy is sent three `API_RESEND` after the first; the second, had it
    // been heard, would have come at once when the responder was back, two after.
    assert!(
        later >= API_RESEND * 5 / 2,
        "the copy heard after the gap came {later:?} after the first: the second copy was \
         heard, so none met no responders"
    );
    assert_eq!(released, Released::default());
}

#[test]
fn config_errors_name_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "providers:\n  - name: p\n    driver: local\n    pools:\n      - name: main\n        max-servers: 1\n        labls: []\n").unwrap();
    let out = std::process::Command::new(slotpool_tests::bin_path("slotpool"))
        .args(["config", "validate"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:7:9: unknown field `labls`", path.display())),
        "{err}"
    );
}

/// A provider removed from the configuration while a backing node of it is up: the
/// restarted launcher still serves the label, and retires and releases that node
/// without panicking, saying why it cannot delete the instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_removed_from_the_config_fails_its_steps_with_a_reason() {
    let mut pool = Pool::start(2, 2, &label("small", 2, 1, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    pool.release_and_wait(&first.nodes).await;
    pool.kill_launcher(0);
    let config = std::fs::read_to_string(pool.config_path()).unwrap();
    let renamed = config.replacen("- name: local\n", "- name: replacement\n", 1);
    assert_ne!(config, renamed, "the provider is renamed");
    std::fs::write(pool.config_path(), renamed).unwrap();
    pool.spawn_launcher();
    pool.wait_served().await;
    let again = pool.fulfilled(&pool.submit(&["small"]).await).await;
    pool.release_and_wait(&again.nodes).await;
    wait_for("the launcher to say why it cannot delete", LONG, || async {
        pool.logs()
            .contains("provider local is no longer in the configuration")
    })
    .await;
    assert!(!pool.logs().contains("panicked"), "{}", pool.logs());
}
