//! One queue for every launcher: priority, then age, orders requests whichever launcher
//! owns them.

use slotpool_protocol::client::submission;
use slotpool_protocol::model::{NodeRequest, RequestState};
use slotpool_protocol::{LauncherId, NodeId, RequestId};
use slotpool_tests::{label, wait_for, Pool};
use std::time::Duration;

/// How many slots the pool has, and requests of each priority wait for them.
const SLOTS: usize = 3;

/// The launcher that owns request `id`, read from KV.
async fn owner(pool: &Pool, id: &RequestId) -> LauncherId {
    let bus = pool.nats.bus().await;
    let r = bus
        .requests
        .get::<NodeRequest>(id.as_str())
        .await
        .expect("reading the request")
        .expect("the request exists");
    r.value.owner.expect("an owner")
}

/// Submits requests of `priority` until `SLOTS` of them are owned by a launcher that
/// `pick` accepts (the others are canceled); returns them and their owner.
async fn owned_by(
    pool: &Pool,
    priority: i32,
    pick: impl Fn(&LauncherId) -> bool,
) -> (Vec<RequestId>, LauncherId) {
    let mut kept = Vec::new();
    let mut chosen: Option<LauncherId> = None;
    for _ in 0..60 {
        let mut sub = submission(vec!["small".into()], "test");
        sub.priority = Some(priority);
        let id = pool.client.submit(&sub).await.expect("submit");
        let o = owner(pool, &id).await;
        if pick(&o) && chosen.as_ref().is_none_or(|c| *c == o) {
            chosen = Some(o);
            kept.push(id);
            if kept.len() == SLOTS {
                return (kept, chosen.unwrap());
            }
        } else {
            pool.client.cancel(id).await.expect("cancel");
        }
    }
    panic!("queue-group submits never reached the launcher wanted");
}

async fn state(pool: &Pool, id: &RequestId) -> RequestState {
    pool.client.request(id).await.unwrap().unwrap().state
}

/// The index of the pool's launcher whose id is `id` (each logs it at start).
fn index_of(pool: &Pool, id: &LauncherId, launchers: usize) -> usize {
    (0..launchers)
        .find(|n| pool.launcher_log(*n).contains(id.as_str()))
        .unwrap_or_else(|| panic!("no launcher logged {id}"))
}

/// Sends `signal` to launcher process `pid` alone (not to the agents it started).
fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: plain syscall on a child of this test that is not reaped yet.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

/// The pool is full; launcher A owns older priority-100 requests, launcher B newer
/// priority-10 ones (lower is more urgent). Slots come free while B is paused (for
/// less than its lease): A leaves them to B's requests, which B claims once it runs
/// again; A's requests come next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_orders_the_requests_of_all_launchers_as_one_queue() {
    let pool = Pool::start(1, 15, &label("small", SLOTS as u32, 60, &[]), 2).await;
    let mut held: Vec<NodeId> = Vec::new();
    for _ in 0..SLOTS {
        held.extend(pool.fulfilled(&pool.submit(&["small"]).await).await.nodes);
    }
    let (late, a) = owned_by(&pool, 100, |_| true).await;
    let (urgent, b) = owned_by(&pool, 10, |o| *o != a).await;
    assert_ne!(a, b);
    for id in late.iter().chain(&urgent) {
        assert_eq!(state(&pool, id).await, RequestState::Requested);
    }

    let b_pid = pool.launcher_pid(index_of(&pool, &b, 2));
    signal(b_pid, libc::SIGSTOP);
    // The release must reach A: a call that went to the paused B is sent again.
    let mut released = false;
    for _ in 0..40 {
        if let Ok(r) = tokio::time::timeout(
            Duration::from_millis(500),
            pool.client.release(held.clone()),
        )
        .await
        {
            r.expect("release");
            released = true;
            break;
        }
    }
    assert!(released, "no launcher took the release");
    wait_for("the held slots freed", Duration::from_secs(30), || async {
        !pool.nodes().await.iter().any(|n| held.contains(&n.id))
    })
    .await;
    // Time for A to claim, were it to.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    signal(b_pid, libc::SIGCONT);

    for id in &urgent {
        let r = pool.wait_final(id, Duration::from_secs(30)).await;
        assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    }
    for id in &late {
        assert_eq!(
            state(&pool, id).await,
            RequestState::Requested,
            "a priority-100 request of launcher {a} was served before the priority-10 \
             requests of launcher {b}"
        );
    }
    // They are next.
    let mut nodes: Vec<NodeId> = Vec::new();
    for id in &urgent {
        nodes.extend(pool.client.request(id).await.unwrap().unwrap().nodes);
    }
    pool.client.release(nodes).await.expect("release");
    wait_for(
        "the priority-100 requests served",
        Duration::from_secs(30),
        || async {
            let mut all = true;
            for id in &late {
                all &= state(&pool, id).await == RequestState::Fulfilled;
            }
            all
        },
    )
    .await;
}
