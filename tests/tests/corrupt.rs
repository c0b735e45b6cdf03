//! Records that cannot be read: a launcher neither spins on them nor leaks what they
//! hold, and says so once.

use slotpool_protocol::api::ErrorCode;
use slotpool_protocol::connect::BusError;
use slotpool_protocol::layout;
use slotpool_protocol::model::RequestState;
use slotpool_tests::{label, wait_for, Pool};
use std::time::Duration;

/// CPU time (user + system) the process `pid` has used, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("reading stat");
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after ")".
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a system setting.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as u64
}

/// Submits a request that cannot be served now, and checks over a 3 s window (a
/// measurement, not a wait for anything) that the launcher does not spin while it
/// waits: under 0.3 s of CPU.
async fn submit_one_that_waits_and_check_no_spin(pool: &Pool) {
    let pid = pool.launcher_pid(0);
    let before = cpu_ticks(pid);
    let stuck = pool.submit(&["small"]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let used = (cpu_ticks(pid) - before) as f64 / ticks_per_second() as f64;
    assert!(
        used < 0.3,
        "the launcher used {used:.2} s of CPU in 3 s with a request waiting"
    );
    assert_eq!(
        pool.client.request(&stuck).await.unwrap().unwrap().state,
        RequestState::Requested
    );
}

/// Garbage in a free slot key of a node with other free slots: the request is served
/// from another slot, the launcher does not spin on the bad key, and it says so once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_slot_record_is_occupied_and_requests_go_to_the_other_slots() {
    let pool = Pool::start(1, 3, &label("small", 3, 60, &[]), 1).await;
    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let node = pool.node(&first.nodes[0]).await;
    assert_eq!(node.slot, 0);
    pool.release_and_wait(&first.nodes).await;

    let key = layout::slot_key(&node.backing_id, 0);
    let bus = pool.nats.bus().await;
    bus.slots
        .put(&key, &"not a node record", None)
        .await
        .expect("writing garbage");

    let second = pool.submit(&["small"]).await;
    let r = pool.wait_final(&second, Duration::from_secs(20)).await;
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    let served = pool.node(&r.nodes[0]).await;
    assert_eq!(served.backing_id, node.backing_id);
    assert_ne!(served.slot, 0, "never the slot with the unreadable record");

    // With a request waiting for the label, the bad key is not tried over and over.
    let waiting = pool.submit(&["small"]).await;
    let also = pool.fulfilled(&waiting).await;
    submit_one_that_waits_and_check_no_spin(&pool).await;
    assert_ne!(pool.node(&also.nodes[0]).await.slot, 0);

    let log = pool.launcher_log(0);
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("unreadable record") && l.contains(&key))
        .count();
    assert_eq!(warnings, 1, "warned once about {key}:\n{log}");
    let events = pool.client.list_events().await.expect("events");
    assert!(
        events.iter().any(|e| e.message.contains(&key)),
        "an event names the key: {events:?}"
    );
}

/// A request whose record becomes garbage: cancel says the record is unreadable, and
/// the slot claimed for it is freed (nothing can prove whose it is any more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_request_record_gets_a_clear_error_and_its_slot_is_freed() {
    let pool = Pool::start(1, 3, &label("small", 2, 60, &[]), 1).await;
    let id = pool.submit(&["small"]).await;
    pool.fulfilled(&id).await;
    assert!(pool.nodes().await.iter().any(|n| n.request_id == id));

    let bus = pool.nats.bus().await;
    bus.requests
        .put(id.as_str(), &"not a request record", None)
        .await
        .expect("writing garbage");

    match pool.client.cancel(id.clone()).await {
        Err(BusError::Api(e)) => {
            assert_eq!(e.code, ErrorCode::Unreadable, "{e:?}");
            assert!(e.message.contains("unreadable"), "{e:?}");
        }
        other => panic!("cancel of an unreadable request: {other:?}"),
    }
    wait_for(
        "the slot claimed for the unreadable request freed",
        Duration::from_secs(40),
        || async { !pool.nodes().await.iter().any(|n| n.request_id == id) },
    )
    .await;
}

/// Garbage in a backing node's seat: the seat counts as taken, a backing node in another
/// seat serves the request, the launcher does not spin on the bad seat, and says so once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_seat_record_is_taken_and_another_seat_serves() {
    let pool = Pool::start(2, 3, &label("small", 1, 60, &[]), 1).await;
    let key = layout::seat_key("local", "main", 0);
    let bus = pool.nats.bus().await;
    bus.backing
        .put(&key, &"not a backing record", None)
        .await
        .expect("writing garbage");

    let first = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let served = pool.node(&first.nodes[0]).await;
    let backing = pool.backing().await;
    assert_eq!(backing.len(), 1, "{backing:?}");
    assert_eq!(backing[0].id, served.backing_id);
    assert_eq!(
        backing[0].seat, 1,
        "never the seat with the unreadable record"
    );

    submit_one_that_waits_and_check_no_spin(&pool).await;
    let log = pool.launcher_log(0);
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("unreadable record") && l.contains(&key))
        .count();
    assert_eq!(warnings, 1, "warned once about {key}:\n{log}");
}
