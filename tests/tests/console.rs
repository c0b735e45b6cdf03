//! End-to-end test of `slotpool-console`: the real binary runs in tmux against a real
//! nats-server, launcher and agents, and is driven with key presses. Plus an ignored
//! start-up benchmark with 10,000 backing nodes.

use futures::StreamExt;
use slotpool_protocol::connect::Bus;
use slotpool_protocol::model::{
    BackingNode, BackingState, IdleBehaviour, Node, NodeRequest, NodeState,
};
use slotpool_protocol::{BackingId, NodeId, RequestId};
use slotpool_tests::{bin_path, label, wait_for, wait_for_some, NatsServer, Pool, Tmux};
use std::time::{Duration, Instant};

const SOON: Duration = Duration::from_secs(20);

/// Presses `D` and confirms with Enter once the dialog names backing node `id`.
async fn drain(console: &Tmux, id: &BackingId) {
    console.keys(&["D"]);
    console
        .wait_screen("the drain confirmation naming the node", |s| {
            s.contains(&format!("Drain backing node {id}")) && s.contains("Enter confirm")
        })
        .await;
    console.keys(&["Enter"]);
}

/// The line of the screen that shows backing node `id`.
fn row_of<'a>(screen: &'a str, id: &BackingId) -> Option<&'a str> {
    screen.lines().find(|l| l.starts_with(id.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_drains_a_backing_node_with_key_presses() {
    // Long grace-time: nothing is released by itself.
    let pool = Pool::start(2, 5, &label("small", 2, 600, &[]), 1).await;
    let request = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (a, _) = request.nodes[0].slot().expect("node id names its slot");

    let log = tempfile::NamedTempFile::new().unwrap();
    let console = Tmux::start(&console_command(&pool, log.path()), 120, 40);
    // The existing pool is on screen at start: the backing node, ready, one slot in use.
    let screen = console
        .wait_screen("the ready backing node", |s| {
            row_of(s, &a).is_some_and(|row| row.contains("ready") && row.contains("1/2"))
        })
        .await;
    assert!(row_of(&screen, &a).unwrap().contains(" run "), "{screen}");

    // Drain it: D on the selected (only) backing node, confirmed with Enter in the
    // dialog that names it.
    console.keys(&["D"]);
    console
        .wait_screen("the drain confirmation", |s| {
            s.contains("Drain backing node") && s.contains("Enter confirm")
        })
        .await;
    console.keys(&["Enter"]);
    let screen = console
        .wait_screen("the node draining", |s| {
            row_of(s, &a).is_some_and(|row| row.contains("drain"))
                && s.contains("released once its 1 slots in use are returned")
        })
        .await;
    eprintln!("after D:\n{screen}");
    assert!(
        row_of(&screen, &a).unwrap().contains("ready"),
        "in use, so not released yet:\n{screen}"
    );
    let b: BackingNode = pool
        .backing()
        .await
        .into_iter()
        .find(|b| b.id == a)
        .expect("still there while its slot is in use");
    assert_eq!(b.idle, IdleBehaviour::Drain);
    assert_eq!(b.order.expect("order recorded").actor, "e2e");

    // The Events view shows the order (Tab from Backing: Slots, Requests, Events).
    console.keys(&["Tab", "Tab", "Tab"]);
    let screen = console
        .wait_screen("the order in the Events view", |s| {
            s.contains("TIME UTC") && s.contains("operator") && s.contains("drain by e2e")
        })
        .await;
    eprintln!("Events view:\n{screen}");

    // The requestor returns its node: the drained node is released at once (grace-time
    // ignored), leaves KV and leaves the screen.
    console.keys(&["2"]);
    pool.client
        .release(request.nodes.clone())
        .await
        .expect("release");
    wait_for("the drained node released", SOON, || async {
        !pool.backing().await.iter().any(|b| b.id == a)
    })
    .await;
    console
        .wait_screen("the node gone from the Backing view", |s| {
            row_of(s, &a).is_none() && s.contains("No backing nodes")
        })
        .await;
    // Its state changes were logged as events too.
    console.keys(&["5"]);
    console
        .wait_screen("backing-node events", |s| {
            s.contains("backing ") && s.contains("drain by e2e")
        })
        .await;
    // q quits; the console restores the terminal and exits.
    console.keys(&["q"]);
    wait_for_some("the console to exit", SOON, || async {
        let out = console.cmd().args(["list-sessions"]).output().ok()?;
        (!String::from_utf8_lossy(&out.stdout).contains(&console.session)).then_some(())
    })
    .await;
}

/// The console's command line against `pool`, as operator `e2e`.
fn console_command(pool: &Pool, log: &std::path::Path) -> String {
    format!(
        "NO_COLOR=1 {} {} --config {} --log-file {} --log debug",
        bin_path("slotpool-console").display(),
        pool.nats
            .args_as(slotpool_protocol::auth::Role::Operator, "e2e")
            .join(" "),
        pool.config_path().display(),
        log.display(),
    )
}

/// A pool of one-slot backing nodes, two of them busy with a request each, and the
/// console on it showing both ready.
struct TwoBusy {
    pool: Pool,
    console: Tmux,
    _log: tempfile::NamedTempFile,
    /// The backing node on the first row (selected at start) and its request.
    first: (BackingId, NodeRequest),
    /// The other one and its request.
    other: (BackingId, NodeRequest),
}

async fn two_busy_nodes() -> TwoBusy {
    let pool = Pool::start(2, 5, &label("small", 1, 600, &[]), 1).await;
    let one = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let two = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let backing_of = |r: &NodeRequest| r.nodes[0].slot().expect("node id names its slot").0;
    let (a, b) = (backing_of(&one), backing_of(&two));
    assert_ne!(a, b);

    let log = tempfile::NamedTempFile::new().unwrap();
    let console = Tmux::start(&console_command(&pool, log.path()), 120, 40);
    let screen = console
        .wait_screen("both backing nodes ready", |s| {
            [&a, &b].iter().all(|id| {
                row_of(s, id).is_some_and(|row| row.contains("ready") && row.contains("1/1"))
            })
        })
        .await;
    let a_first = screen
        .lines()
        .find_map(|l| {
            (l.starts_with(a.as_str()) || l.starts_with(b.as_str()))
                .then(|| l.starts_with(a.as_str()))
        })
        .unwrap();
    let (first, other) = if a_first {
        ((a, one), (b, two))
    } else {
        ((b, two), (a, one))
    };
    TwoBusy {
        pool,
        console,
        _log: log,
        first,
        other,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_that_goes_away_leaves_nothing_selected() {
    // The first row is selected at start: that is the node to drain; the other stays.
    let TwoBusy {
        pool,
        console,
        first: (drained, request),
        other: (other, kept),
        ..
    } = two_busy_nodes().await;
    drain(&console, &drained).await;
    console
        .wait_screen("the node draining", |s| {
            row_of(s, &drained).is_some_and(|row| row.contains("drain"))
        })
        .await;

    // Its node comes back: the drained node is released and its row disappears; the
    // selection does not fall on the other node, which now has the first row.
    pool.client
        .release(request.nodes.clone())
        .await
        .expect("release");
    let screen = console
        .wait_screen("the drained node gone and nothing selected", |s| {
            row_of(s, &drained).is_none()
                && row_of(s, &other).is_some()
                && s.contains("went away: nothing is selected")
        })
        .await;
    eprintln!("after the drained node went away:\n{screen}");
    assert!(
        screen.contains(&format!("{drained} went away")),
        "the detail line names the node that went away:\n{screen}"
    );
    // A second D has no target: no dialog naming the other node.
    console.keys(&["D"]);
    let screen = console
        .wait_screen("D refused for want of a selection", |s| {
            s.contains("drain: select a backing node")
        })
        .await;
    assert!(!screen.contains("Drain backing node"), "{screen}");
    let b: BackingNode = pool
        .backing()
        .await
        .into_iter()
        .find(|b| b.id == other)
        .expect("the other node is still there");
    assert_eq!(b.idle, IdleBehaviour::Run, "the other node was not ordered");
    assert!(b.order.is_none(), "{:?}", b.order);

    // Selecting the other node on purpose, its detail pane shows who holds its slot.
    console.keys(&["j", "i"]);
    let screen = console
        .wait_screen("the detail pane of the other node", |s| {
            s.contains(&format!(" {other} "))
                && s.contains(&format!("{} by ", kept.id))
                && s.contains("record")
        })
        .await;
    eprintln!("detail pane:\n{screen}");
    console.keys(&["q"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selected_slot_whose_row_goes_away_leaves_nothing_selected() {
    let TwoBusy {
        pool,
        console,
        first: (gone, request),
        other: (other, kept),
        ..
    } = two_busy_nodes().await;
    // Enter on the first node: its Slots view, its one slot selected (the detail line
    // names the node in it).
    console.keys(&["Enter"]);
    console
        .wait_screen("the slot of the first node selected", |s| {
            s.contains(&format!(" {} · request", request.nodes[0]))
        })
        .await;
    // Drain it from its Slots view (the dialog names the backing node), then its node
    // comes back: the backing node is released and the slot's row goes away.
    drain(&console, &gone).await;
    wait_for("the drain recorded", SOON, || async {
        (pool.backing().await.iter()).any(|b| b.id == gone && b.idle == IdleBehaviour::Drain)
    })
    .await;
    pool.client
        .release(request.nodes.clone())
        .await
        .expect("release");
    let screen = console
        .wait_screen("the slot gone and nothing selected", |s| {
            s.contains(&format!("slot 0 of {gone} went away: nothing is selected"))
        })
        .await;
    eprintln!("after the slot went away:\n{screen}");
    assert!(
        screen.contains("the selected slot went away"),
        "the status line says so:\n{screen}"
    );
    assert!(
        !screen.contains(kept.nodes[0].as_str()),
        "the other node's slot is not shown, let alone selected:\n{screen}"
    );
    // X has no target: no dialog naming the other node's node.
    console.keys(&["X"]);
    let screen = console
        .wait_screen("X refused for want of a selection", |s| {
            s.contains("release: select a used slot")
        })
        .await;
    assert!(!screen.contains("Release node"), "{screen}");

    // The operator picks the other node on purpose: its Slots view starts on its slot,
    // not on a leftover of the node that went.
    console.keys(&["2"]);
    console
        .wait_screen("the Backing view without the released node", |s| {
            row_of(s, &gone).is_none() && row_of(s, &other).is_some()
        })
        .await;
    console.keys(&["j", "3"]);
    let screen = console
        .wait_screen("the other node's slot selected", |s| {
            s.contains(&format!(" {} · request", kept.nodes[0]))
        })
        .await;
    assert!(!screen.contains("nothing is selected"), "{screen}");
    let held = pool.nodes().await;
    assert!(
        held.iter().any(|n| n.id == kept.nodes[0]),
        "the other node was not released: {held:?}"
    );
    console.keys(&["q"]);
}

fn backing_record(seat: u32) -> BackingNode {
    let now = slotpool_protocol::time::now_ms();
    BackingNode {
        v: 1,
        id: BackingId::parse(&format!("bn-bench{seat:06}")).unwrap(),
        provider: "cloud".into(),
        pool: format!("pool{}", seat % 10),
        seat: seat / 10,
        label: "small".into(),
        backing_label: "vm".into(),
        slots: 8,
        state: BackingState::Ready,
        idle: IdleBehaviour::Run,
        instance: None,
        secret_sha256: "x".into(),
        created_at: now - 3_600_000,
        launched_at: Some(now - 3_600_000),
        ready_at: Some(now - 3_500_000),
        idle_since: seat.is_multiple_of(3).then_some(now - 10_000),
        attempts: 1,
        failure: None,
        attributes: Default::default(),
        order: None,
        interruption: None,
        out_of_capacity: false,
        create_queued: false,
        uses: 0,
        updated_at: now,
    }
}

/// Start-up time with 10,000 backing nodes (and 5,000 slots in use) in KV: from connecting
/// to the first frame with every bucket loaded, on ratatui's TestBackend. Run with
/// `cargo test --release -p slotpool-tests --test console -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: fills a bucket with 10,000 records"]
async fn console_starts_quickly_with_10000_backing_nodes() {
    const NODES: u32 = 10_000;
    let nats = NatsServer::start().await;
    let bus = nats.bus().await;
    let filled = Instant::now();
    futures::stream::iter(0..NODES)
        .map(|i| {
            let bus = bus.clone();
            async move {
                let b = backing_record(i);
                let key = slotpool_protocol::layout::seat_key(&b.provider, &b.pool, b.seat);
                bus.backing
                    .create(&key, &b, None)
                    .await
                    .expect("create backing");
                if i.is_multiple_of(2) {
                    let node = Node {
                        v: 1,
                        id: NodeId::parse(&format!("node-bench{i:06}_0_{}", b.id)).unwrap(),
                        request_id: RequestId::parse(&format!("req-bench{i}")).unwrap(),
                        index: 0,
                        label: "small".into(),
                        backing_id: b.id.clone(),
                        slot: 0,
                        state: NodeState::Ready,
                        requestor: "bench".into(),
                        client: None,
                        host: String::new(),
                        workspace: None,
                        attributes: Default::default(),
                        allocated_at: b.created_at,
                        released_at: None,
                        failure: None,
                        login: Default::default(),
                    };
                    let key = slotpool_protocol::layout::slot_key(&b.id, 0);
                    bus.slots
                        .create(&key, &node, None)
                        .await
                        .expect("create slot");
                }
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<()>>()
        .await;
    eprintln!("filled KV in {:?}", filled.elapsed());

    let mut times = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        let opts = nats.options_as(slotpool_protocol::auth::Role::Operator, "bench");
        let (bus, link) = Bus::connect_watching(&opts).await.expect("connect");
        let mut terminal =
            ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
        let settings = slotpool_tui::Settings {
            rules: slotpool_tui::Rules::unknown(),
            theme: slotpool_tui::Theme::plain(),
            exit_after_first_render: true,
        };
        let outcome = slotpool_tui::run_on(
            &mut terminal,
            bus,
            link,
            &opts.url,
            futures::stream::pending(),
            settings,
            tokio_util::sync::CancellationToken::new(),
            started,
        )
        .await
        .expect("console run");
        let t = outcome.first_full_render.expect("rendered");
        assert_eq!(outcome.backing_nodes, NODES as usize);
        let screen = terminal.backend().to_string();
        assert!(
            screen.contains("10000 backing · 5000/80000 slots"),
            "{screen}"
        );
        eprintln!("first full render after {t:?}");
        times.push(t);
    }
    times.sort();
    eprintln!("start-up with {NODES} backing nodes: median {:?}", times[1]);
    assert!(times[1] < Duration::from_secs(2), "{times:?}");
}

/// The backing node's detail pane shows its agent's newest log lines, asked of the real
/// agent through the launcher when the pane opens and again while it stays open: once the
/// agent is gone, the open pane comes to say it cannot be reached, no key pressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_detail_pane_shows_the_agents_log_tail_and_says_when_it_cannot_be_reached() {
    let pool = Pool::start(1, 5, &label("small", 2, 600, &[]), 1).await;
    let request = pool.fulfilled(&pool.submit(&["small"]).await).await;
    let (a, _) = request.nodes[0].slot().expect("node id names its slot");

    let log = tempfile::NamedTempFile::new().unwrap();
    let console = Tmux::start(&console_command(&pool, log.path()), 200, 50);
    console
        .wait_screen("the ready backing node", |s| {
            row_of(s, &a).is_some_and(|row| row.contains("ready"))
        })
        .await;
    console.keys(&["i"]);
    let screen = console
        .wait_screen("the agent's log in the pane", |s| {
            s.contains("agent log, newest first") && s.contains("slot prepared")
        })
        .await;
    eprintln!("pane:\n{screen}");

    let pid: i32 = std::fs::read_to_string(pool.agent_dir(a.as_str()).join("agent.pid"))
        .expect("the agent's pid file")
        .trim()
        .parse()
        .expect("a pid");
    // SAFETY: kill has no memory preconditions; the pid is the pool's own agent.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let screen = console
        .wait_screen("the pane saying the agent cannot be reached", |s| {
            s.contains("agent log: cannot be reached")
        })
        .await;
    eprintln!("agent gone:\n{screen}");
}
