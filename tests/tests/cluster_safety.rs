//! Safety through leader elections: two launchers on a three-server JetStream cluster
//! (R3 buckets), real agents and several clients submitting and releasing, while the
//! server leading the buckets and a launcher are killed in a seeded order, one at a time
//! or together. What the agents did is read from their own logs (JSON lines: each
//! "slot prepared" and "slot released" with its command's slot and node): no slot is
//! ever prepared for a node while it holds another, no node a client holds is released
//! or replaced under it, and every node a client was handed was prepared for it. The
//! clients' ledger and the records in KV say nothing was lost or double-booked, and
//! every slot comes back once the load stops.
//!
//! The suite runs a quick profile (a leader and a launcher killed together, then one
//! more kill); `SLOTPOOL_SAFETY_KILLS=N cargo test --test cluster_safety -- --ignored`
//! runs N kills. `SLOTPOOL_CHAOS_SEED` repeats a run.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::Bus;
use slotpool_protocol::model::{AgentHeartbeat, Event, Node};
use slotpool_protocol::store::Placement;
use slotpool_protocol::{BackingId, NodeId};
use slotpool_tests::chaos::{self, Load};
use slotpool_tests::{
    config_yaml_with, label, spawn_serve, wait_for, wait_for_some, wait_served, AgentsGuard,
    ChildGuard, NatsCluster, POLL_INTERVAL,
};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::time::Instant;

/// How long the load may take to get going again after a kill.
const RECOVERY: Duration = Duration::from_secs(60);

/// Fulfilments to see after each kill, before the next: each kill happens under load.
const FULFILMENTS_PER_STEP: usize = 6;

/// Kills in the suite's run.
const QUICK_KILLS: usize = 2;

/// Kills in the long run: `$SLOTPOOL_SAFETY_KILLS`, or 10.
fn long_kills() -> usize {
    std::env::var("SLOTPOOL_SAFETY_KILLS")
        .ok()
        .map(|v| v.trim().parse().expect("SLOTPOOL_SAFETY_KILLS: a number"))
        .unwrap_or(10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_slot_is_prepared_for_two_nodes_through_leader_and_launcher_kills() {
    run(QUICK_KILLS).await;
}

#[ignore = "long: SLOTPOOL_SAFETY_KILLS kills (10 by default)"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_slot_is_prepared_for_two_nodes_through_many_kills() {
    run(long_kills()).await;
}

/// What one step kills.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kill {
    /// The server leading the slots bucket.
    Leader,
    /// One of the two launchers (SIGKILL), started again afterwards.
    Launcher,
    /// The leader, and a launcher a moment later, while the servers elect.
    Both,
}

/// The test's temp dir; on failure it prints the launchers' last lines and keeps the
/// dir when `SLOTPOOL_KEEP_FAILED` is set.
struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    fn path(&self) -> &Path {
        self.0.as_ref().expect("the dir").path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for n in 0..2 {
                let text = std::fs::read_to_string(self.path().join(format!("launcher-{n}.log")))
                    .unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(40)..];
                eprintln!("--- launcher {n} (last lines)\n{}", tail.join("\n"));
            }
            if std::env::var_os("SLOTPOOL_KEEP_FAILED").is_some() {
                let kept = self.0.take().expect("the dir").keep();
                eprintln!("test files kept in {}", kept.display());
            }
        }
    }
}

/// The two launchers, each started again after a kill (its log goes on in one file).
struct Launchers {
    args: Vec<String>,
    dir: PathBuf,
    running: Vec<ChildGuard>,
}

impl Launchers {
    fn start(args: Vec<String>, dir: &Path) -> Launchers {
        let mut l = Launchers {
            args,
            dir: dir.to_path_buf(),
            running: Vec::new(),
        };
        l.running = (0..2).map(|n| l.spawn(n)).collect();
        l
    }

    fn spawn(&self, n: usize) -> ChildGuard {
        spawn_serve(
            &format!("launcher-{n}"),
            &self.args,
            &self.dir.join(format!("launcher-{n}.log")),
        )
    }

    fn kill(&mut self, n: usize) {
        self.running[n].kill();
    }

    fn log(&self, n: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("launcher-{n}.log"))).unwrap_or_default()
    }

    /// Starts launcher `n` again and waits until it has loaded the state. One that
    /// exits at start (its first server has just come back and its JetStream is not up
    /// yet) is started again, as its service manager would (`Restart=on-failure` in
    /// packaging/systemd/slotpool.service).
    async fn restart(&mut self, n: usize) {
        let started = |log: &str| log.matches("state loaded").count();
        let before = started(&self.log(n));
        self.running[n] = self.spawn(n);
        let deadline = Instant::now() + RECOVERY;
        while started(&self.log(n)) <= before {
            assert!(
                Instant::now() < deadline,
                "launcher {n} did not start within {RECOVERY:?}"
            );
            if let Some(status) = self.running[n].try_wait() {
                eprintln!("launcher {n} exited at start ({status}); starting it again");
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.running[n] = self.spawn(n);
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

/// The placement of the slots and requests buckets once both have `replicas` current
/// copies and a leader.
async fn settled(bus: &Bus, replicas: usize) -> Placement {
    wait_for_some(
        format!("the buckets to have a leader and {replicas} current copies"),
        RECOVERY,
        || async {
            let slots = bus.slots.placement().await.ok()??;
            let requests = bus.requests.placement().await.ok()??;
            let whole = |p: &Placement| p.leader.is_some() && p.current.len() == replicas;
            (whole(&slots) && whole(&requests)).then_some(slots)
        },
    )
    .await
}

async fn wait_fulfilments(load: &Load, more: usize, what: &str) {
    let target = load.fulfilments() + more;
    wait_for(
        format!("{more} more fulfilments {what}"),
        RECOVERY,
        || async { load.fulfilments() >= target },
    )
    .await;
}

/// The kills of a run of `count`: the first is both at once (the election during which
/// a launcher's watches are away and its peer takes over), then a seeded mix.
fn plan_kills(count: usize, rng: &mut StdRng) -> Vec<Kill> {
    (0..count)
        .map(|i| match (i, rng.random_range(0..3)) {
            (0, _) => Kill::Both,
            (_, 0) => Kill::Leader,
            (_, 1) => Kill::Launcher,
            _ => Kill::Both,
        })
        .collect()
}

async fn run(kills: usize) {
    let seed = chaos::seed();
    eprintln!("seed {seed} (set SLOTPOOL_CHAOS_SEED to repeat)");
    let mut rng = StdRng::seed_from_u64(seed);
    let plan = plan_kills(kills, &mut rng);
    eprintln!("kills: {plan:?}");
    let mut cluster = NatsCluster::start(3).await;
    let dir = TestDir(Some(tempfile::tempdir().expect("temp dir")));
    let work_dir = dir.path().join("agents");
    let _agents = AgentsGuard(work_dir.clone());
    let config = dir.path().join("pool.yaml");
    // JSON logs: each line carries its command's slot and node. Heartbeats as in
    // tests/tests/cluster.rs: a TTL longer than an election on a loaded machine.
    let agent_args = [
        "--heartbeat-interval-ms",
        "300",
        "--heartbeat-ttl-secs",
        "6",
        "--isolation",
        "none",
        "--log-format",
        "json",
    ];
    // A grace-time longer than the run: a backing node released takes its agent's log
    // with its dir.
    let yaml = config_yaml_with(&work_dir, 3, 3, &label("small", 4, 3600, &[]), &agent_args)
        .replacen("launcher:\n", "launcher:\n  kv-replicas: 3\n", 1);
    std::fs::write(&config, yaml).expect("writing config");
    let mut launchers = Launchers::start(cluster.serve_args(&config), dir.path());

    let bus = cluster.bus().await;
    let client = Client::connect(&cluster.options_as(Role::Client, "client"))
        .await
        .expect("client connects");
    wait_served(&client).await;
    let mut placement = settled(&bus, 3).await;
    // Six clients on up to 3 × 4 slots: some wait, so slots change hands all the time.
    let load = Load::start(&client, 6, &["small"], Duration::from_millis(400), seed);
    wait_fulfilments(&load, FULFILMENTS_PER_STEP, "before any kill").await;

    for (step, kill) in plan.iter().enumerate() {
        let leader = placement.leader.clone().expect("a leader");
        let victim = rng.random_range(0..2);
        if matches!(kill, Kill::Leader | Kill::Both) {
            cluster.crash(&leader);
        }
        if *kill == Kill::Both {
            // While the servers elect: the launcher's peer takes its requests over on a
            // bus that answers late.
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
        }
        if matches!(kill, Kill::Launcher | Kill::Both) {
            launchers.kill(victim);
        }
        eprintln!(
            "kill {}: {kill:?} (leader {leader}, launcher {victim})",
            step + 1
        );
        wait_fulfilments(
            &load,
            FULFILMENTS_PER_STEP,
            &format!("after kill {}", step + 1),
        )
        .await;
        if matches!(kill, Kill::Launcher | Kill::Both) {
            launchers.restart(victim).await;
        }
        if matches!(kill, Kill::Leader | Kill::Both) {
            cluster.resume(&leader).await;
            placement = settled(&bus, 3).await;
        }
    }
    let ledger = load.finish().await;

    // KV: every request ended once and is so now, no slot held by two at once...
    let operator = Client::from_bus(bus.clone());
    let last = wait_for_some("the requests listed", RECOVERY, || async {
        operator.list_requests().await.ok()
    })
    .await;
    let verdict = ledger.verdict(&last);
    // ...and every slot comes back once nothing holds it.
    let left: Vec<Node> = wait_for_some("every slot to come back", RECOVERY, || async {
        let nodes: Vec<Node> = bus
            .slots
            .list::<Node>()
            .await
            .ok()?
            .into_iter()
            .filter_map(|n| n.ok().map(|n| n.value))
            .collect();
        nodes.is_empty().then_some(nodes)
    })
    .await;
    // The agents' own word: once nothing is claimed, no slot is prepared for anyone (a
    // node prepared after its claim was given back would stay).
    let held = wait_for_some("the agents to hold no slot", RECOVERY, || async {
        let agents = bus.agents.list::<AgentHeartbeat>().await.ok()?;
        let held: Vec<String> = agents
            .into_iter()
            .filter_map(|a| a.ok())
            .flat_map(|a| {
                a.value
                    .slots
                    .into_iter()
                    .map(move |s| format!("{} slot {}: {}", a.value.backing_id, s.slot, s.node_id))
            })
            .collect();
        held.is_empty().then_some(held)
    })
    .await;
    let events: Vec<Event> = wait_for_some("the events listed", RECOVERY, || async {
        bus.events.list::<Event>().await.ok()
    })
    .await
    .into_iter()
    .filter_map(|e| e.ok().map(|e| e.value))
    .collect();
    let live_failed = chaos::live_failures(&events, &HashSet::new());

    // The agents' side.
    let agent_log = AgentLog::read(&work_dir);
    let agent_violations = agent_log.violations(ledger.holds());
    // Fulfilments the launchers stopped because a node's claim had changed since its
    // prepare (`request::exec::claims_stand`), and leases they gave up.
    let said = |what: &str| {
        (0..2)
            .map(|n| launchers.log(n).matches(what).count())
            .sum::<usize>()
    };
    eprintln!(
        "launchers: {} nodes not handed out for a claim changed since its prepare, {} \
         not given back for a request another launcher drives or handed out, {} holders \
         left alone by a release finished elsewhere, {} leases lost",
        said("claim changed since its prepare"),
        said("not giving the node back"),
        said("this release was finished elsewhere"),
        said("lease lost;")
    );
    eprintln!(
        "cluster safety: {} kills, {} requests, {} fulfilled, {} nodes held by clients, \
         {} prepares ({} nodes) and {} releases in the agents' logs; violations: {} in KV, \
         {} at the agents; live nodes failed {}",
        plan.len(),
        verdict.requests,
        verdict.fulfilled,
        ledger.holds().len(),
        agent_log.count("slot prepared"),
        agent_log.nodes_prepared(),
        agent_log.count("slot released"),
        verdict.violations.len(),
        agent_violations.len(),
        live_failed.len(),
    );
    assert!(
        agent_violations.is_empty(),
        "the agents prepared a slot for two nodes, or took a node from its holder: {agent_violations:#?}"
    );
    assert!(
        verdict.violations.is_empty(),
        "requests lost or double-booked: {:#?}",
        verdict.violations
    );
    assert!(left.is_empty(), "slots never came back: {left:#?}");
    assert!(held.is_empty(), "agents still hold: {held:#?}");
    assert!(
        live_failed.is_empty(),
        "live backing nodes failed: {live_failed:#?}"
    );
    assert!(
        ledger.holds().len() >= FULFILMENTS_PER_STEP * (plan.len() + 1),
        "too few nodes handed out to tell anything"
    );
    drop(launchers);
}

/// What an agent did to one slot, from its log.
#[derive(Clone, Debug, PartialEq)]
struct SlotEvent {
    /// Microseconds since the epoch.
    at_us: u64,
    backing: String,
    slot: u32,
    node: String,
    what: &'static str,
}

/// Every agent's prepares and releases, in each agent's log order.
struct AgentLog {
    events: Vec<SlotEvent>,
}

impl AgentLog {
    /// Reads `<work_dir>/<backing id>/agent.log` of every agent the local provider ran.
    fn read(work_dir: &Path) -> AgentLog {
        let mut events = Vec::new();
        for entry in std::fs::read_dir(work_dir).expect("reading the agents' dir") {
            let dir = entry.expect("an agent dir").path();
            let Ok(text) = std::fs::read_to_string(dir.join("agent.log")) else {
                continue;
            };
            let backing = dir
                .file_name()
                .expect("a backing id")
                .to_string_lossy()
                .to_string();
            events.extend(text.lines().filter_map(|line| parse_line(&backing, line)));
        }
        AgentLog { events }
    }

    fn count(&self, what: &str) -> usize {
        self.events.iter().filter(|e| e.what == what).count()
    }

    /// Distinct nodes some agent prepared.
    fn nodes_prepared(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.what == "slot prepared")
            .map(|e| &e.node)
            .collect::<HashSet<_>>()
            .len()
    }

    /// Each broken promise, in words: a slot prepared while it holds another node; a
    /// node a client held (as [`chaos::Hold`] says, on the wall clock the agents date
    /// their lines by) not prepared for it first, released before the client let go, or
    /// another node prepared in its slot meanwhile.
    fn violations(&self, holds: &[chaos::Hold]) -> Vec<String> {
        let mut out = Vec::new();
        let mut by_slot: BTreeMap<(&str, u32), Vec<&SlotEvent>> = BTreeMap::new();
        for e in &self.events {
            by_slot.entry((&e.backing, e.slot)).or_default().push(e);
        }
        for ((backing, slot), events) in &by_slot {
            let mut holder: Option<&str> = None;
            for e in events {
                match (e.what, holder) {
                    ("slot prepared", Some(held)) if held != e.node => out.push(format!(
                        "{backing} slot {slot}: prepared for {} while it holds {held}",
                        e.node
                    )),
                    ("slot prepared", _) => holder = Some(&e.node),
                    (_, Some(held)) if held == e.node => holder = None,
                    _ => {}
                }
            }
        }
        for hold in holds {
            let (backing, slot) = (&hold.slot.0, hold.slot.1);
            let node = hold.node.to_string();
            let (from, to) = (hold.from_unix_us, hold.to_unix_us);
            let events = by_slot
                .get(&(backing.as_str(), slot))
                .map(Vec::as_slice)
                .unwrap_or_default();
            if !events
                .iter()
                .any(|e| e.what == "slot prepared" && e.node == node && e.at_us <= from)
            {
                out.push(format!(
                    "{node} handed to a client without its agent's prepare ({backing} slot {slot})"
                ));
            }
            for e in events
                .iter()
                .filter(|e| e.at_us > from && to.is_none_or(|to| e.at_us < to))
            {
                if e.what == "slot released" && e.node == node {
                    out.push(format!(
                        "{node} released by its agent while its client held it ({backing} slot {slot})"
                    ));
                } else if e.what == "slot prepared" && e.node != node {
                    out.push(format!(
                        "{backing} slot {slot} prepared for {} while its client held {node}",
                        e.node
                    ));
                }
            }
        }
        out
    }
}

/// A "slot prepared" or "slot released" line of an agent's JSON log, with the slot and
/// node of its command's span.
fn parse_line(backing: &str, line: &str) -> Option<SlotEvent> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let what = match v.get("message")?.as_str()? {
        "slot prepared" => "slot prepared",
        "slot released" => "slot released",
        _ => return None,
    };
    let command = v
        .get("spans")?
        .as_array()?
        .iter()
        .find(|s| s.get("name").and_then(|n| n.as_str()) == Some("command"))?;
    Some(SlotEvent {
        at_us: unix_us(v.get("timestamp")?.as_str()?)?,
        backing: backing.to_string(),
        slot: u32::try_from(command.get("slot")?.as_u64()?).ok()?,
        node: command.get("node_id")?.as_str()?.to_string(),
        what,
    })
}

/// `YYYY-MM-DDTHH:MM:SS[.f]Z` as microseconds since the epoch.
fn unix_us(text: &str) -> Option<u64> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (h, min, s) = (t.next()??, t.next()??, t.next()??);
    let micros: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some(((days * 86_400 + h * 3600 + min * 60 + s) * 1_000_000) + micros)
}

#[test]
fn agent_log_lines_and_their_times_are_read() {
    assert_eq!(unix_us("1970-01-01T00:00:01.5Z"), Some(1_500_000));
    assert_eq!(
        unix_us("2026-01-01T12:00:00.000250Z"),
        Some(1_767_268_800_000_250)
    );
    let line = r#"{"timestamp":"2026-01-01T12:00:00.000250Z","level":"INFO","message":"slot prepared","spans":[{"name":"agent","backing_id":"bn-1"},{"name":"command","op":"prepare_slot","slot":3,"node_id":"node-a_3_bn-1"}]}"#;
    assert_eq!(
        parse_line("bn-1", line),
        Some(SlotEvent {
            at_us: 1_767_268_800_000_250,
            backing: "bn-1".into(),
            slot: 3,
            node: "node-a_3_bn-1".into(),
            what: "slot prepared",
        })
    );
}

/// The checks over the agents' logs find a node taken from its holder and a slot
/// prepared for two nodes: what the fulfilment after a give-back did.
#[test]
fn a_node_released_under_its_holder_is_a_violation() {
    let start = chaos::unix_us_now();
    let t = |ms: u64| start + ms * 1000;
    let ev = |ms, node: &str, what| SlotEvent {
        at_us: t(ms),
        backing: "bn-01jq3m2f7h8g9k0m1n2p3q4r00".into(),
        slot: 1,
        node: node.into(),
        what,
    };
    let a = "node-01jq3m8x5v9k2c7t4r6y0a1b2d_1_bn-01jq3m2f7h8g9k0m1n2p3q4r00";
    let b = "node-01jq3m8x5v9k2c7t4r6y0a1b2e_1_bn-01jq3m2f7h8g9k0m1n2p3q4r00";
    let hold = chaos::Hold {
        node: NodeId::parse(a).unwrap(),
        slot: (
            BackingId::parse("bn-01jq3m2f7h8g9k0m1n2p3q4r00").unwrap(),
            1,
        ),
        request: slotpool_protocol::RequestId::parse("req-01jq3m8x5v9k2c7t4r6y0a1b2d").unwrap(),
        from: Instant::now(),
        to: None,
        from_unix_us: t(100),
        to_unix_us: Some(t(5000)),
    };
    let kept = AgentLog {
        events: vec![
            ev(50, a, "slot prepared"),
            ev(5100, a, "slot released"),
            ev(5200, b, "slot prepared"),
        ],
    };
    assert_eq!(
        kept.violations(std::slice::from_ref(&hold)),
        Vec::<String>::new()
    );
    let wiped = AgentLog {
        events: vec![
            ev(50, a, "slot prepared"),
            ev(2000, a, "slot released"),
            ev(2100, b, "slot prepared"),
        ],
    };
    let found = wiped.violations(std::slice::from_ref(&hold));
    assert_eq!(found.len(), 2, "{found:#?}");
    let twice = AgentLog {
        events: vec![ev(50, a, "slot prepared"), ev(60, b, "slot prepared")],
    };
    assert!(twice.violations(&[])[0].contains("while it holds"));
}
