//! The EC2 provider through the exec contract against moto's EC2 server (one per test),
//! with a loopback proxy in front of it where EC2's behaviour is needed that moto lacks:
//! lost answers, capacity and quota errors, throttling, spot refusals.

mod support;

use slotpool_protocol::provider::{
    ConsoleOutput, ConsoleRequest, Created, DeleteRequest, ListedMachine, EXIT_CAPACITY,
};
use slotpool_provider_ec2::user_data;
use slotpool_tests::ec2_proxy::{Ec2Proxy, Fault};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use support::*;

fn created(out: &std::process::Output) -> Created {
    assert!(out.status.success(), "create failed: {}", shown(out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", shown(out)))
}

fn listed(out: &std::process::Output) -> Vec<ListedMachine> {
    assert!(out.status.success(), "list failed: {}", shown(out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", shown(out)))
}

fn delete_request(c: &Created) -> String {
    serde_json::to_string(&DeleteRequest {
        v: DeleteRequest::VERSION,
        id: c.id.clone(),
        host: c.host.clone(),
        data: c.data.clone(),
    })
    .unwrap()
}

fn upstream(cloud: &Cloud) -> SocketAddr {
    format!("127.0.0.1:{}", cloud.moto.port()).parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_list_and_delete_an_instance() {
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Ec2Proxy::start(upstream(&cloud)).await;
    let subnets = format!("    subnets: [{}]\n    tags: {{team: ci}}\n    root-volume: {{device: /dev/xvda, size-gb: 30}}\n", cloud.subnets[0]);
    let config = write_config(
        dir.path(),
        "ec2.yaml",
        &proxy.url(),
        "it-1",
        &cloud.image,
        &subnets,
        "",
    );

    let req = create_request(
        "bn-one",
        "secret-one",
        "nats://10.0.0.1:4222",
        Some("CREDS TEXT\n"),
    );
    let made = created(&run_async(&config, "create", req.clone()).await);
    assert!(made.id.starts_with("i-"), "{made:?}");
    assert!(made.host.starts_with("172.31."), "{made:?}");
    assert_eq!(made.attributes["instance-type"], "t3.micro");
    assert_eq!(made.attributes["market"], "on-demand");
    assert_eq!(made.data["subnet"], cloud.subnets[0].as_str());

    // What EC2 was asked: one RunInstances, with a client token, IMDSv2 and the tags.
    let runs = proxy.seen_of("RunInstances");
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert!(
        run.param("ClientToken").unwrap().starts_with("sp-"),
        "{run:?}"
    );
    assert_eq!(run.param("MetadataOptions.HttpTokens"), Some("required"));
    assert_eq!(
        run.param("MetadataOptions.HttpPutResponseHopLimit"),
        Some("1")
    );
    assert_eq!(
        run.param("TagSpecification.1.ResourceType"),
        Some("instance")
    );
    assert_eq!(run.param("TagSpecification.2.ResourceType"), Some("volume"));

    // moto holds it with every tag, from the start.
    let live = cloud.live().await;
    assert_eq!(live.len(), 1);
    let i = &live[0];
    assert_eq!(i.instance_id(), Some(made.id.as_str()));
    assert_eq!(tag(i, "slotpool:backing-id").as_deref(), Some("bn-one"));
    assert_eq!(tag(i, "slotpool:installation").as_deref(), Some("it-1"));
    assert_eq!(tag(i, "slotpool:provider").as_deref(), Some("aws"));
    assert_eq!(tag(i, "team").as_deref(), Some("ci"));
    assert_eq!(tag(i, "Name").as_deref(), Some("slotpool bn-one"));
    assert_eq!(
        i.metadata_options()
            .and_then(|m| m.http_tokens())
            .map(|t| t.as_str()),
        Some("required")
    );

    // Its user data starts the agent with its secret and credential in 0600 files.
    let text = cloud.user_data(&made.id).await;
    assert!(
        !text.contains("secret-one"),
        "the secret is readable in the user data:\n{text}"
    );
    let boot = user_data::parse(&text).unwrap();
    let file = |p: &str| {
        boot.files
            .iter()
            .find(|f| f.path == p)
            .unwrap_or_else(|| panic!("{p} missing"))
    };
    assert_eq!(file(user_data::SECRET_PATH).content, "secret-one\n");
    assert_eq!(file(user_data::CREDS_PATH).content, "CREDS TEXT\n");
    assert_eq!(file(user_data::SECRET_PATH).permissions, "0600");
    assert!(file(user_data::ENV_PATH)
        .content
        .contains("SLOTPOOL_BACKING_ID=bn-one\n"));

    // The same create again (its answer lost to the launcher): the same instance.
    let again = created(&run_async(&config, "create", req).await);
    assert_eq!(again, made);
    assert_eq!(cloud.live().await.len(), 1);

    let list = listed(&run_async(&config, "list", String::new()).await);
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].id, made.id);
    assert_eq!(list[0].backing_id.as_deref(), Some("bn-one"));
    // Another installation's list does not see it.
    let other = write_config(
        dir.path(),
        "other.yaml",
        &cloud.moto.url(),
        "it-2",
        &cloud.image,
        "",
        "",
    );
    assert!(listed(&run_async(&other, "list", String::new()).await).is_empty());
    // ... and its delete refuses it.
    let out = run_async(&other, "delete", delete_request(&made)).await;
    assert_eq!(out.status.code(), Some(1), "{}", shown(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not one of installation \"it-2\""),
        "{}",
        shown(&out)
    );

    // Its console (moto answers a sample boot log), for this installation only, and
    // only to a request of the version that added console.
    let console = |v: u32| {
        serde_json::to_string(&ConsoleRequest {
            v,
            id: made.id.clone(),
            host: made.host.clone(),
            data: made.data.clone(),
        })
        .unwrap()
    };
    let out = run_async(&config, "console", console(ConsoleRequest::VERSION)).await;
    assert!(out.status.success(), "{}", shown(&out));
    let printed: ConsoleOutput = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        printed.output.starts_with("Linux version 2.6.16-xenU"),
        "{printed:?}"
    );
    let out = run_async(&other, "console", console(ConsoleRequest::VERSION)).await;
    assert_eq!(out.status.code(), Some(1), "{}", shown(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not reading its console"),
        "{}",
        shown(&out)
    );
    let out = run_async(&config, "console", console(2)).await;
    assert_eq!(out.status.code(), Some(1), "{}", shown(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("the console request is contract version 2; this provider speaks version 3"),
        "{}",
        shown(&out)
    );
    assert_eq!(
        proxy.seen_of("GetConsoleOutput").len(),
        1,
        "the request of version 2 read no console"
    );

    for _ in 0..2 {
        let out = run_async(&config, "delete", delete_request(&made)).await;
        assert!(out.status.success(), "{}", shown(&out));
    }
    assert!(cloud.live().await.is_empty());
    assert!(listed(&run_async(&config, "list", String::new()).await).is_empty());
}

/// 100 creates with a fifth of RunInstances' answers lost after moto carried them out:
/// not one instance twice. Five more creates are killed while their RunInstances hangs
/// (as the launcher kills a create at its launch-timeout): their instances have no owner,
/// and one sweep by the launcher's own rule finds and deletes every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_make_no_duplicate_and_one_sweep_leaves_no_leak() {
    const CREATES: usize = 100;
    const LOST_SHARE: f64 = 0.2;
    const KILLED: usize = 5;
    const IN_FLIGHT: usize = 8;
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Ec2Proxy::start(upstream(&cloud)).await;
    let config = write_config(
        dir.path(),
        "ec2.yaml",
        &proxy.url(),
        "it-lost",
        &cloud.image,
        "",
        "",
    );
    proxy.lose_answers("RunInstances", LOST_SHARE, 30);

    let started = std::time::Instant::now();
    let mut outcomes = Vec::new();
    for chunk in (0..CREATES).collect::<Vec<_>>().chunks(IN_FLIGHT) {
        let runs = chunk.iter().map(|n| {
            let req = create_request(
                &format!("bn-{n:03}"),
                &format!("secret-{n}"),
                "nats://10.0.0.1:4222",
                None,
            );
            run_async(&config, "create", req)
        });
        outcomes.extend(futures::future::join_all(runs).await);
    }
    let elapsed = started.elapsed();
    let made: Vec<Created> = outcomes.iter().map(created).collect();
    let lost = proxy
        .seen_of("RunInstances")
        .iter()
        .filter(|s| s.fault == Some(Fault::LoseAnswer))
        .count();
    let sent = proxy.seen_of("RunInstances").len();

    let mut per_backing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in cloud.instances().await {
        per_backing
            .entry(tag(&i, "slotpool:backing-id").unwrap_or_default())
            .or_default()
            .push(i.instance_id().unwrap().to_string());
    }
    let duplicates: usize = per_backing.values().map(|v| v.len() - 1).sum();
    println!(
        "{CREATES} creates, {sent} RunInstances sent, {lost} answers lost ({:.0} %), {} instances, {duplicates} duplicates, in {elapsed:.1?}",
        100.0 * lost as f64 / sent as f64,
        per_backing.values().map(Vec::len).sum::<usize>()
    );
    assert!(
        lost >= 10,
        "too few answers lost to show anything: {lost} of {sent}"
    );
    assert_eq!(duplicates, 0, "{per_backing:?}");
    assert_eq!(per_backing.len(), CREATES);
    for (n, m) in made.iter().enumerate() {
        assert_eq!(
            per_backing[&format!("bn-{n:03}")],
            std::slice::from_ref(&m.id),
            "bn-{n:03}"
        );
    }

    // Creates that die while EC2 carries them out: the instances exist, nobody owns them.
    proxy.fail_next("RunInstances", KILLED, Fault::Stall);
    for n in 0..KILLED {
        let req = create_request(&format!("bn-killed-{n}"), "s", "nats://10.0.0.1:4222", None);
        let mut child = std::process::Command::new(PROVIDER)
            .arg("--config")
            .arg(&config)
            .arg("create")
            .envs(slotpool_tests::Moto::aws_env())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(req.as_bytes())
            .unwrap();
        let backing = format!("bn-killed-{n}");
        slotpool_tests::wait_for(
            "the stalled create's instance",
            std::time::Duration::from_secs(30),
            || async {
                cloud
                    .live()
                    .await
                    .iter()
                    .any(|i| tag(i, "slotpool:backing-id").as_deref() == Some(backing.as_str()))
            },
        )
        .await;
        child.kill().unwrap();
        child.wait().unwrap();
    }

    // The launcher's side: it records what each create returned; later it releases a
    // fifth of them (their deletes lose answers too, and are retried).
    proxy.lose_answers("TerminateInstances", LOST_SHARE, 31);
    let (released, kept) = made.split_at(CREATES / 5);
    for c in released {
        let out = run_async(&config, "delete", delete_request(c)).await;
        assert!(out.status.success(), "{}", shown(&out));
    }
    let records: Vec<slotpool_protocol::model::BackingNode> = kept
        .iter()
        .enumerate()
        .map(|(n, c)| record(&format!("bn-{:03}", n + CREATES / 5), c))
        .collect();

    // One sweep, by the launcher's own rule, with no grace.
    let list = listed(&run_async(&config, "list", String::new()).await);
    assert_eq!(list.len(), kept.len() + KILLED);
    let listed_instances: Vec<_> = list.iter().map(listed_instance).collect();
    let refs: Vec<&_> = records.iter().collect();
    let leaks = slotpool_launcher::backing::leak::Sightings::default().sweep(
        &listed_instances,
        &refs,
        slotpool_protocol::time::now_ms(),
        std::time::Duration::ZERO,
    );
    assert_eq!(leaks.len(), KILLED, "{leaks:?}");
    for leak in &leaks {
        assert!(
            leak.backing_id
                .as_ref()
                .unwrap()
                .as_str()
                .starts_with("bn-killed-"),
            "{leak:?}"
        );
        let req = serde_json::to_string(&DeleteRequest {
            v: DeleteRequest::VERSION,
            id: leak.instance.id.clone(),
            host: leak.instance.host.clone(),
            data: leak.instance.data.clone(),
        })
        .unwrap();
        let out = run_async(&config, "delete", req).await;
        assert!(out.status.success(), "{}", shown(&out));
    }
    let live = cloud.live().await;
    let owned: std::collections::BTreeSet<&str> = kept.iter().map(|c| c.id.as_str()).collect();
    let leaked: Vec<_> = live
        .iter()
        .filter(|i| !owned.contains(i.instance_id().unwrap()))
        .map(|i| i.instance_id().unwrap().to_string())
        .collect();
    println!(
        "after one sweep: {} live instances, {} owned by a record, {} leaked ({} killed creates swept)",
        live.len(),
        owned.len(),
        leaked.len(),
        leaks.len()
    );
    assert!(leaked.is_empty(), "{leaked:?}");
    assert_eq!(live.len(), kept.len());
}

/// A backing record as the launcher keeps it for an instance create returned.
fn record(backing_id: &str, c: &Created) -> slotpool_protocol::model::BackingNode {
    serde_json::from_value(serde_json::json!({
        "v": 1, "id": backing_id, "provider": "aws", "pool": "main", "seat": 0,
        "label": "small", "backing_label": "vm", "slots": 2, "state": "ready",
        "instance": {"id": c.id, "host": c.host, "data": c.data},
        "secret_sha256": "", "created_at": 0, "updated_at": 0,
    }))
    .unwrap()
}

fn listed_instance(m: &ListedMachine) -> slotpool_launcher::provider::ListedInstance {
    slotpool_launcher::provider::ListedInstance {
        instance: slotpool_protocol::model::Instance {
            id: m.id.clone(),
            host: m.host.clone(),
            data: m.data.clone(),
        },
        backing_id: m
            .backing_id
            .as_deref()
            .map(|b| slotpool_protocol::BackingId::parse(b).unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_without_capacity_moves_on_and_none_anywhere_is_exit_75() {
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Ec2Proxy::start(upstream(&cloud)).await;
    let size = format!(
        "    subnets: [{}, {}]\n",
        cloud.subnets[0], cloud.subnets[1]
    );
    let config = write_config(
        dir.path(),
        "ec2.yaml",
        &proxy.url(),
        "it-cap",
        &cloud.image,
        &size,
        "",
    );

    proxy.fail_next("RunInstances", 1, Fault::insufficient_capacity());
    let made = created(
        &run_async(
            &config,
            "create",
            create_request("bn-a", "s", "nats://h:4222", None),
        )
        .await,
    );
    let runs = proxy.seen_of("RunInstances");
    assert_eq!(runs.len(), 2);
    let (first, second) = (
        runs[0].param("SubnetId").unwrap(),
        runs[1].param("SubnetId").unwrap(),
    );
    assert_ne!(first, second);
    assert_eq!(made.data["subnet"], second);
    assert_eq!(cloud.live().await.len(), 1);

    // Both zones full: the capacity exit, naming each refusal; nothing launched.
    proxy.fail_next("RunInstances", 2, Fault::insufficient_capacity());
    let out = run_async(
        &config,
        "create",
        create_request("bn-b", "s", "nats://h:4222", None),
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_CAPACITY), "{}", shown(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&cloud.subnets[0]) && err.contains(&cloud.subnets[1]),
        "{err}"
    );
    assert!(err.contains("InsufficientInstanceCapacity"), "{err}");

    // The account's quota: the capacity exit at once, no other zone asked.
    let before = proxy.seen_of("RunInstances").len();
    proxy.fail_next("RunInstances", 1, Fault::instance_limit());
    let out = run_async(
        &config,
        "create",
        create_request("bn-c", "s", "nats://h:4222", None),
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_CAPACITY), "{}", shown(&out));
    assert_eq!(proxy.seen_of("RunInstances").len(), before + 1);
    assert_eq!(cloud.live().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_is_ridden_out_and_spot_falls_back_to_on_demand() {
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Ec2Proxy::start(upstream(&cloud)).await;
    let spot = write_config(
        dir.path(),
        "spot.yaml",
        &proxy.url(),
        "it-spot",
        &cloud.image,
        "    market: spot-then-on-demand\n",
        "",
    );

    // Throttled three times on RunInstances and twice on the look-up before it.
    proxy.fail_next("RunInstances", 3, Fault::throttled());
    proxy.fail_next("DescribeInstances", 2, Fault::throttled());
    proxy.fail_next("RunInstances", 1, Fault::spot_limit());
    let made = created(
        &run_async(
            &spot,
            "create",
            create_request("bn-s", "s", "nats://h:4222", None),
        )
        .await,
    );
    let runs = proxy.seen_of("RunInstances");
    let markets: Vec<Option<&str>> = runs
        .iter()
        .map(|r| r.param("InstanceMarketOptions.MarketType"))
        .collect();
    // Three throttled spot requests, the spot refusal, then on-demand.
    assert_eq!(
        markets,
        [Some("spot"), Some("spot"), Some("spot"), Some("spot"), None],
        "{runs:?}"
    );
    assert_eq!(made.attributes["market"], "on-demand");
    let live = cloud.live().await;
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].instance_lifecycle(), None);

    // Spot given: a spot instance.
    let made = created(
        &run_async(
            &spot,
            "create",
            create_request("bn-t", "s", "nats://h:4222", None),
        )
        .await,
    );
    assert_eq!(made.attributes["market"], "spot");
    let i = cloud
        .live()
        .await
        .into_iter()
        .find(|i| i.instance_id() == Some(made.id.as_str()))
        .unwrap();
    assert_eq!(i.instance_lifecycle().map(|l| l.as_str()), Some("spot"));

    // Spot only: a spot refusal is the capacity exit.
    let spot_only = write_config(
        dir.path(),
        "spot-only.yaml",
        &proxy.url(),
        "it-spot",
        &cloud.image,
        "    market: spot\n",
        "",
    );
    proxy.fail_next("RunInstances", 1, Fault::spot_limit());
    let out = run_async(
        &spot_only,
        "create",
        create_request("bn-u", "s", "nats://h:4222", None),
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_CAPACITY), "{}", shown(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_bad_configuration_get_clear_errors() {
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "ec2.yaml",
        &cloud.moto.url(),
        "it-bad",
        &cloud.image,
        "",
        "",
    );
    let cases = [
        (
            "create",
            "{\"v\": 1}".to_string(),
            "contract version 1; this provider speaks version 2",
        ),
        (
            "create",
            "not json".to_string(),
            "reading the create request on stdin",
        ),
        (
            "create",
            create_request("bn-1", "s", "nats://h:4222", None).replace("\"vm\"", "\"huge\""),
            "no size for backing label \"huge\"",
        ),
        (
            "delete",
            format!(
                "{{\"v\": {}, \"id\": \"vol-1\", \"host\": \"h\"}}",
                DeleteRequest::VERSION
            ),
            "\"vol-1\" is not an EC2 instance id",
        ),
    ];
    for (op, input, want) in cases {
        let out = run_async(&config, op, input.clone()).await;
        assert_eq!(out.status.code(), Some(1), "{op} {input}: {}", shown(&out));
        assert!(out.stdout.is_empty(), "{}", shown(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(want),
            "{op} {input}: {}",
            shown(&out)
        );
    }
    let broken = dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        "installation: x\nregion: eu-west-1\nsizes:\n  vm: {image-id: ami-1}\n",
    )
    .unwrap();
    let out = run(&broken, "list", "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("broken.yaml: sizes.vm: missing field `instance-type`"),
        "{}",
        shown(&out)
    );
    assert!(cloud.instances().await.is_empty());
}

/// `slotpool provider check` finds nothing wrong with the EC2 provider, and leaves no
/// instance behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slotpool_provider_check_passes_on_the_ec2_provider() {
    let cloud = Cloud::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "ec2.yaml",
        &cloud.moto.url(),
        "it-check",
        &cloud.image,
        "",
        "",
    );
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(slotpool_tests::bin_path("slotpool"))
            .args([
                "provider",
                "check",
                "--backing-label",
                "vm",
                "--console",
                "--",
            ])
            .arg(PROVIDER)
            .arg("--config")
            .arg(&config)
            .envs(slotpool_tests::Moto::aws_env())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = shown(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ok    console: 10 lines of output"),
        "{text}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("9 checks, 0 failed"),
        "{text}"
    );
    assert!(
        cloud.live().await.is_empty(),
        "the check left instances behind"
    );
}
