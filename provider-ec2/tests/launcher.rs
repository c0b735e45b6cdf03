//! The whole launcher path with the EC2 provider: `slotpool serve` runs
//! `slotpool-provider-ec2` as its exec provider against moto. moto runs no machine, so
//! the test plays each instance: it reads the user data moto recorded, checks it, writes
//! its files under a directory of the instance's own and starts `slotpool-agent` as the
//! unit would; when moto says an instance is terminated, its agent is killed. moto has
//! no metadata service either: an instance whose agent watches for the spot interruption
//! notice gets a [`FakeImds`] of its own, at which its `--spot-notice-url` is pointed.

mod support;

use slotpool_protocol::client::Client;
use slotpool_protocol::model::{BackingState, NodeState, RequestState};
use slotpool_provider_ec2::{decide, user_data};
use slotpool_tests::ec2_proxy::{Ec2Proxy, Fault};
use slotpool_tests::imds::FakeImds;
use slotpool_tests::{bin_path, wait_for, wait_for_some, ChildGuard, Moto, NatsServer, AGENT_ARGS};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(60);
/// The backing ids of machines the test makes behind the launcher's back: nobody boots
/// them.
const STRAY: &str = "bn-stray";

/// The fake metadata services of the instances, by instance id.
type MetadataServices = Arc<Mutex<BTreeMap<String, Arc<FakeImds>>>>;

/// Plays the instances of one installation: starts an agent from each new instance's user
/// data, kills it when the instance is terminated.
struct Instances {
    agents: Arc<Mutex<BTreeMap<String, ChildGuard>>>,
    imds: MetadataServices,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Instances {
    fn play(cloud: Arc<Cloud>, installation: &'static str, root: PathBuf) -> Instances {
        let agents: Arc<Mutex<BTreeMap<String, ChildGuard>>> = Arc::default();
        let imds: MetadataServices = Arc::default();
        let stop = CancellationToken::new();
        let (a, m, s) = (agents.clone(), imds.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut started = std::collections::BTreeSet::new();
            while !s.is_cancelled() {
                for i in cloud.instances().await {
                    if tag(&i, "slotpool:installation").as_deref() != Some(installation)
                        || tag(&i, "slotpool:backing-id").is_some_and(|b| b.starts_with(STRAY))
                    {
                        continue;
                    }
                    let id = i.instance_id().unwrap().to_string();
                    let ending = matches!(
                        i.state().and_then(|s| s.name()).map(|n| n.as_str()),
                        Some("terminated" | "shutting-down")
                    );
                    if ending {
                        if let Some(mut agent) = a.lock().unwrap().remove(&id) {
                            agent.kill();
                        }
                    } else if started.insert(id.clone()) {
                        let text = cloud.user_data(&id).await;
                        let service = Arc::new(FakeImds::start().await);
                        let agent = boot(&text, &root.join(&id), &service.url());
                        m.lock().unwrap().insert(id.clone(), service);
                        a.lock().unwrap().insert(id, agent);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Instances {
            agents,
            imds,
            stop,
            task,
        }
    }

    fn running(&self) -> usize {
        self.agents.lock().unwrap().len()
    }

    /// The metadata service of instance `id`, once it booted.
    fn imds(&self, id: &str) -> Option<Arc<FakeImds>> {
        self.imds.lock().unwrap().get(id).cloned()
    }
}

impl Drop for Instances {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
        self.agents.lock().unwrap().clear();
    }
}

/// Boots an "instance" from its user data under `root`: checks what the user data says,
/// writes its files there with their modes, and starts the agent the way the packaged
/// unit does (`EnvironmentFile`s, `--secret-file`, `$SLOTPOOL_AGENT_ARGS`), its
/// `--spot-notice-url`, if any, pointed at `imds` instead of EC2's.
fn boot(text: &str, root: &Path, imds: &str) -> ChildGuard {
    let parsed = user_data::parse(text).unwrap_or_else(|e| panic!("user data: {e}\n{text}"));
    let mut env = BTreeMap::new();
    for f in &parsed.files {
        let path = root.join(f.path.trim_start_matches('/'));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &f.content).unwrap();
        let mode = u32::from_str_radix(&f.permissions, 8).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        if f.path == user_data::ENV_PATH {
            for line in f
                .content
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
            {
                let (k, v) = line.split_once('=').unwrap();
                env.insert(k.to_string(), v.trim_matches('"').to_string());
            }
        }
    }
    for secret in [
        user_data::SECRET_PATH,
        user_data::CREDS_PATH,
        user_data::ENV_PATH,
    ] {
        let f = parsed
            .files
            .iter()
            .find(|f| f.path == secret)
            .unwrap_or_else(|| panic!("{secret} missing"));
        assert_eq!(
            (f.permissions.as_str(), f.owner.as_str()),
            ("0600", "root:root"),
            "{secret}"
        );
    }
    assert_eq!(
        parsed.commands.last().unwrap(),
        &["systemctl", "enable", "--now", "slotpool-agent"]
    );
    let creds = env
        .remove("SLOTPOOL_NATS_CREDS")
        .expect("the agent gets a credential");
    let mut args: Vec<String> = env
        .remove("SLOTPOOL_AGENT_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if let Some(at) = args.iter().position(|a| a == "--spot-notice-url") {
        assert_eq!(args[at + 1], decide::IMDS_URL, "{args:?}");
        args[at + 1] = imds.to_string();
    }
    let mut cmd = Command::new(bin_path("slotpool-agent"));
    cmd.envs(&env)
        .env(
            "SLOTPOOL_NATS_CREDS",
            root.join(creds.trim_start_matches('/')),
        )
        .arg("--secret-file")
        .arg(root.join(user_data::SECRET_PATH.trim_start_matches('/')))
        .args(&args)
        .args(AGENT_ARGS)
        .arg("--work-dir")
        .arg(root.join("work"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(root.join("agent.log")).unwrap());
    ChildGuard::spawn(format!("agent of {}", root.display()), cmd).unwrap()
}

/// A `slotpool serve` with the AWS test keys in its environment (its providers inherit it).
struct Launcher {
    _child: ChildGuard,
    log: PathBuf,
    /// An operator's HTTP token: `/metrics` asks every caller for one.
    token: String,
}

impl Launcher {
    fn start(nats: &NatsServer, dir: &Path, config: &str) -> Launcher {
        Launcher::start_with(nats, dir, config, &[])
    }

    /// With further `serve` arguments.
    fn start_with(nats: &NatsServer, dir: &Path, config: &str, extra: &[&str]) -> Launcher {
        let path = dir.join("pool.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.join("launcher.log");
        let mut cmd = Command::new(bin_path("slotpool"));
        cmd.args(nats.serve_args(&path))
            .args(extra)
            .envs(Moto::aws_env())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        Launcher {
            _child: ChildGuard::spawn("launcher", cmd).unwrap(),
            log,
            token: nats.http_token(slotpool_protocol::auth::Role::Operator, "ops"),
        }
    }
}

impl Launcher {
    /// The value of `metric` with `labels` on `/metrics` of its `--http` listener.
    async fn metric(&self, metric: &str, labels: &[(&str, &str)]) -> f64 {
        let addr = wait_for_some("the launcher's http listener", SOON, || async {
            slotpool_tests::metrics::http_addr_in(&std::fs::read_to_string(&self.log).unwrap())
        })
        .await;
        let scrape = slotpool_tests::metrics::scrape_as(addr, Some(&self.token)).await;
        slotpool_tests::metrics::value(&scrape, metric, labels)
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- launcher log\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// An exec provider entry of pool.yaml running the EC2 provider with `config`.
fn provider_yaml(name: &str, config: &Path, pools: &str) -> String {
    let cmd = |op: &str| format!("[{PROVIDER}, --config, {}, {op}]", config.display());
    format!(
        "  - name: {name}\n    driver: exec\n    exec:\n      create: {}\n      delete: {}\n      list: {}\n      console: {}\n    leak-sweep-interval: 1\n    leak-grace: 2\n    pools:\n{pools}",
        cmd("create"),
        cmd("delete"),
        cmd("list"),
        cmd("console")
    )
}

fn pool_yaml(name: &str, priority: u32) -> String {
    format!(
        "      - name: {name}\n        max-servers: 1\n        priority: {priority}\n        boot-timeout: 60\n        labels:\n          - {{name: small, backing-label: vm, max-parallel-jobs: 2, grace-time: 0}}\n"
    )
}

async fn fulfilled(client: &Client) -> slotpool_protocol::model::NodeRequest {
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "ec2-test");
    let id = client.submit(&sub).await.expect("submit");
    let r = tokio::time::timeout(SOON, client.wait(&id, |_| {}))
        .await
        .unwrap_or_else(|_| panic!("request {id} not final in time"))
        .unwrap();
    assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_launches_through_ec2_falls_back_on_capacity_and_sweeps_leaks() {
    let nats = NatsServer::start().await;
    let cloud = Arc::new(Cloud::start().await);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The first pool's provider is out of capacity in every zone, every time.
    let full = Ec2Proxy::start(format!("127.0.0.1:{}", cloud.moto.port()).parse().unwrap()).await;
    full.fail_next("RunInstances", 1000, Fault::insufficient_capacity());
    let full_cfg = write_config(d, "full.yaml", &full.url(), "it-full", &cloud.image, "", "");
    let cfg = write_config(
        d,
        "ec2.yaml",
        &cloud.moto.url(),
        "it-main",
        &cloud.image,
        "",
        "",
    );
    let pool = format!(
        "providers:\n{}{}",
        provider_yaml("aws-full", &full_cfg, &pool_yaml("full", 1)),
        provider_yaml("aws", &cfg, &pool_yaml("main", 2))
    );
    let instances = Instances::play(cloud.clone(), "it-main", d.join("instances"));
    let _launcher = Launcher::start(&nats, d, &pool);
    let client = Client::from_bus(nats.bus().await);
    slotpool_tests::wait_served(&client).await;

    let r = fulfilled(&client).await;
    let backing = client.list_backing().await.unwrap();
    let ours: Vec<_> = backing
        .iter()
        .filter(|b| b.state == BackingState::Ready)
        .collect();
    assert_eq!(ours.len(), 1, "{backing:?}");
    assert_eq!(
        ours[0].provider, "aws",
        "served by the second pool after the first's capacity exit"
    );
    let instance = ours[0].instance.clone().expect("instance recorded");
    assert!(instance.id.starts_with("i-"), "{instance:?}");
    assert!(
        !full.seen_of("RunInstances").is_empty(),
        "the first pool was never asked"
    );
    let node = &client.list_nodes().await.unwrap()[0];
    assert_eq!(node.attributes["instance-type"], "t3.micro", "{node:?}");
    assert_eq!(node.attributes["market"], "on-demand", "{node:?}");
    assert_eq!(instances.running(), 1);

    // A machine the launcher never asked for, tagged as the installation's: the leak
    // sweep deletes it.
    let stray = run_async(
        &cfg,
        "create",
        create_request(STRAY, "s", &nats.url(), None),
    )
    .await;
    assert!(stray.status.success(), "{}", shown(&stray));
    let stray: slotpool_protocol::provider::Created =
        serde_json::from_slice(&stray.stdout).unwrap();
    wait_for(
        "the leak sweep to delete the stray machine",
        SOON,
        || async {
            !cloud
                .live()
                .await
                .iter()
                .any(|i| i.instance_id() == Some(stray.id.as_str()))
        },
    )
    .await;

    // Released: its instance is terminated, its agent gone with it.
    client.release(r.nodes.clone()).await.unwrap();
    wait_for("the instance to be terminated", SOON, || async {
        !cloud
            .live()
            .await
            .iter()
            .any(|i| i.instance_id() == Some(instance.id.as_str()))
    })
    .await;
    wait_for("the seat to be free", SOON, || async {
        client
            .list_backing()
            .await
            .unwrap()
            .iter()
            .all(|b| b.provider != "aws")
    })
    .await;
    let events = client.list_events().await.unwrap();
    let said = |what: &str| events.iter().any(|e| e.message.contains(what));
    assert!(said("out of capacity"), "{events:?}");
    assert!(said("leak"), "{events:?}");
}

/// Create to agent ready through moto, twenty times one after another: the launcher's
/// `launched_at` (before it runs create) to its `ready_at` (the agent's first heartbeat
/// seen), with the test playing the instance as soon as moto lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_to_agent_ready_through_moto() {
    const RUNS: usize = 20;
    let nats = NatsServer::start().await;
    let cloud = Arc::new(Cloud::start().await);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write_config(
        d,
        "ec2.yaml",
        &cloud.moto.url(),
        "it-boot",
        &cloud.image,
        "",
        "",
    );
    let pool = format!(
        "providers:\n{}",
        provider_yaml("aws", &cfg, &pool_yaml("main", 1))
    );
    let _instances = Instances::play(cloud.clone(), "it-boot", d.join("instances"));
    let _launcher = Launcher::start(&nats, d, &pool);
    let client = Client::from_bus(nats.bus().await);
    slotpool_tests::wait_served(&client).await;

    let mut samples = Vec::new();
    for _ in 0..RUNS {
        let r = fulfilled(&client).await;
        let b = client
            .list_backing()
            .await
            .unwrap()
            .into_iter()
            .find(|b| b.state == BackingState::Ready)
            .expect("a ready backing node");
        samples.push(Duration::from_millis(
            b.ready_at.unwrap() - b.launched_at.unwrap(),
        ));
        client.release(r.nodes.clone()).await.unwrap();
        wait_for("the seat to be free", SOON, || async {
            client.list_backing().await.unwrap().is_empty()
        })
        .await;
    }
    samples.sort();
    println!(
        "create -> agent ready through moto, {RUNS} runs: p50 {:?}, min {:?}, max {:?}",
        samples[RUNS / 2 - 1],
        samples[0],
        samples[RUNS - 1]
    );
    assert_eq!(cloud.live().await.len(), 0);
}

/// A spot instance's agent reads EC2's interruption notice (from the fake metadata
/// service the test plays, as moto has none): the launcher fails its node and the nodes
/// on its slots with `spot interruption`, records it in the event log and `/metrics`,
/// deletes the instance, and launches into the seat again (`max-servers: 1`) for the job
/// the CI system sends again, with no failed seat's rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_fails_the_nodes_and_the_seat_is_launched_into_again_at_once() {
    use slotpool_protocol::time::now_ms;
    let nats = NatsServer::start().await;
    let cloud = Arc::new(Cloud::start().await);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write_config(
        d,
        "ec2.yaml",
        &cloud.moto.url(),
        "it-spot",
        &cloud.image,
        "    market: spot\n",
        "",
    );
    let pool = format!(
        "providers:\n{}",
        provider_yaml("aws", &cfg, &pool_yaml("main", 1))
    );
    let instances = Instances::play(cloud.clone(), "it-spot", d.join("instances"));
    let launcher = Launcher::start_with(&nats, d, &pool, &["--http", "127.0.0.1:0"]);
    let client = Client::from_bus(nats.bus().await);
    slotpool_tests::wait_served(&client).await;

    let first = fulfilled(&client).await;
    let node = client.nodes(&first.nodes).await.unwrap().remove(0);
    assert_eq!(node.attributes["market"], "spot", "{node:?}");
    let interrupted = node.backing_id.clone();
    let record = |id: slotpool_protocol::BackingId| {
        let client = &client;
        async move {
            client
                .list_backing()
                .await
                .unwrap()
                .into_iter()
                .find(|b| b.id == id)
        }
    };
    let instance = record(interrupted.clone())
        .await
        .and_then(|b| b.instance)
        .expect("the instance recorded");
    let imds = wait_for_some("the instance to boot", SOON, || async {
        instances.imds(&instance.id)
    })
    .await;
    wait_for("the agent to ask for the notice", SOON, || async {
        imds.asked() > 0
    })
    .await;
    assert_eq!(
        imds.refused(),
        0,
        "every ask carries an IMDSv2 session token"
    );
    assert_eq!(imds.tokens(), 1, "one session token, kept");

    // EC2 posts the notice, two minutes ahead of the end.
    let posted = now_ms();
    imds.interrupt("terminate", "2026-11-26T17:40:00Z");
    // What the CI system sees: its node failed, and why.
    let failed = wait_for_some("the node to fail", SOON, || async {
        client
            .nodes(std::slice::from_ref(&node.id))
            .await
            .ok()?
            .pop()
            .filter(|n| n.state == NodeState::Failed)
    })
    .await;
    let seen_failed = now_ms();
    // Its agent's heartbeat says so (read before the instance is gone with it).
    let noticed = client
        .list_agents()
        .await
        .unwrap()
        .into_iter()
        .find(|a| a.backing_id == interrupted)
        .and_then(|a| a.interruption)
        .map(|n| n.noticed_at);
    assert_eq!(
        failed.failure.as_deref(),
        Some(
            format!(
                "backing node {interrupted} failed: spot interruption: the cloud takes the \
                 machine back (terminate at 2026-11-26T17:40:00Z)"
            )
            .as_str()
        )
    );
    // A client following its request by `status` is told too.
    let held = wait_for_some("the request to name its failed node", SOON, || async {
        client
            .request(&first.id)
            .await
            .ok()
            .flatten()
            .filter(|r| !r.nodes_failed.is_empty())
    })
    .await;
    assert_eq!(held.nodes_failed, vec![node.id.clone()]);
    assert!(
        held.status.contains(": spot interruption: "),
        "{}",
        held.status
    );
    // So it sends the job again.
    let again = fulfilled(&client).await;
    let replacement = client.nodes(&again.nodes).await.unwrap().remove(0);
    assert_ne!(replacement.backing_id, interrupted, "{replacement:?}");
    let b2 = record(replacement.backing_id.clone())
        .await
        .expect("the replacement's record");
    assert_eq!(b2.seat, 0, "the one seat of the pool, taken again");

    wait_for(
        "the interrupted instance to be terminated",
        SOON,
        || async {
            !cloud
                .live()
                .await
                .iter()
                .any(|i| i.instance_id() == Some(instance.id.as_str()))
        },
    )
    .await;
    let events = client.list_events().await.unwrap();
    let of_it: Vec<_> = events
        .iter()
        .filter(|e| e.backing_id.as_ref() == Some(&interrupted))
        .collect();
    let failure = of_it
        .iter()
        .find(|e| e.message.starts_with("failed: spot interruption"))
        .unwrap_or_else(|| panic!("no failure event: {of_it:?}"));
    assert_eq!(
        failure.reason.as_deref(),
        Some(slotpool_protocol::model::SPOT_INTERRUPTION)
    );
    let deleted = of_it
        .iter()
        .find(|e| e.message == "failed node's instance deleted")
        .unwrap_or_else(|| panic!("no clean-up event: {of_it:?}"));
    let launched = b2.launched_at.expect("the replacement's launch");
    let rest = slotpool_launcher::backing::lifecycle::FAILED_SEAT_COOLDOWN;
    assert!(
        launched < deleted.at + rest.as_millis() as u64,
        "the seat rested: launched into again {} ms after its instance was deleted",
        launched - deleted.at
    );
    assert_eq!(
        launcher
            .metric(
                "slotpool_backing_deletions_total",
                &[("reason", "spot-interruption")]
            )
            .await,
        1.0
    );
    assert_eq!(
        launcher
            .metric("slotpool_backing_deletions_total", &[("reason", "failure")])
            .await,
        0.0
    );
    let noticed = noticed.expect("the interrupted agent's heartbeat carries the notice");
    println!(
        "spot interruption: notice posted -> node failed, as the client sees it: {} ms \
         (the agent asks every 5 s); read by the agent -> node failed: {} ms; node failed \
         -> instance deleted: {} ms; instance deleted -> the replacement's launch begins: \
         {} ms (a failed seat's rest: {} ms)",
        seen_failed - posted,
        failure.at.saturating_sub(noticed),
        deleted.at.saturating_sub(failure.at),
        launched.saturating_sub(deleted.at),
        rest.as_millis(),
    );
    client.release(again.nodes.clone()).await.unwrap();
    client.release(first.nodes.clone()).await.unwrap();
}

/// An instance whose agent never comes up (the test does not play it): at boot-timeout
/// the launcher reads its console through the provider (`GetConsoleOutput`) and puts its
/// end, escaped on one line, into the event of the relaunch and of the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boot_that_times_out_brings_the_instances_console_into_its_events() {
    let nats = NatsServer::start().await;
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write_config(
        d,
        "ec2.yaml",
        &cloud.moto.url(),
        "it-console",
        &cloud.image,
        "",
        "",
    );
    let pool = format!(
        "providers:\n{}",
        provider_yaml(
            "aws",
            &cfg,
            "      - name: main\n        max-servers: 1\n        boot-timeout: 3\n        launch-retries: 2\n        labels:\n          - {name: small, backing-label: vm, max-parallel-jobs: 2}\n"
        )
    );
    let _launcher = Launcher::start(&nats, d, &pool);
    let client = Client::from_bus(nats.bus().await);
    slotpool_tests::wait_served(&client).await;
    let sub = slotpool_protocol::client::submission(vec!["small".into()], "ec2-test");
    let id = client.submit(&sub).await.expect("submit");

    // moto's sample boot log ends so.
    const LAST_LINE: &str = "Enabling fast FPU save and restore... done.";
    let events = wait_for_some("the failure's event", SOON, || async {
        let events = client.list_events().await.ok()?;
        events
            .iter()
            .any(|e| e.message.starts_with("failed: "))
            .then_some(events)
    })
    .await;
    let boot = |prefix: &str| {
        events
            .iter()
            .find(|e| e.message.starts_with(prefix))
            .unwrap_or_else(|| panic!("no event {prefix:?}: {events:#?}"))
            .message
            .clone()
    };
    let relaunched = boot("launch attempt 1 failed: ");
    let failed = boot("failed: ");
    for message in [&relaunched, &failed] {
        assert!(
            message.contains("its agent did not report within boot-timeout 3s"),
            "{message}"
        );
        assert!(
            message.contains("; its console ends: Linux version 2.6.16-xenU"),
            "{message}"
        );
        assert!(
            message.ends_with(&format!("\\u{{a}}{LAST_LINE}")),
            "{message}"
        );
        assert!(
            !message.chars().any(char::is_control),
            "one line, nothing a terminal acts on: {message:?}"
        );
    }
    assert!(failed.contains("(attempt 2 of 2)"), "{failed}");
    let r = tokio::time::timeout(SOON, client.wait(&id, |_| {}))
        .await
        .expect("the request final")
        .unwrap();
    assert_eq!(r.state, RequestState::Failed, "{r:?}");
    wait_for("both instances to be terminated", SOON, || async {
        cloud.live().await.is_empty()
    })
    .await;
    println!("the failure's event: {failed}");
}
