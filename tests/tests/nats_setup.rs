//! `slotpool nats-setup --cluster`: the configurations it writes make a working
//! JetStream cluster as they are, with the TLS and credentials it made beside them.

use slotpool_protocol::auth::Role;
use slotpool_protocol::connect::{Bus, NatsOptions};
use slotpool_tests::{bin_path, nats_server_binary, wait_for_some, ChildGuard};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// How long the servers may take to form the cluster, elect the buckets' leaders and
/// elect new ones after a kill.
const CLUSTER_FORMS: Duration = Duration::from_secs(60);

/// A first port `p` with `p`, `p + 1` and `p + 2` free on 127.0.0.1 now, none of them in
/// `taken` (another process could take one before the servers start; a server then fails
/// to start and says so in its log).
fn three_free_ports(taken: &[u16]) -> u16 {
    loop {
        let first = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
        let base = first.local_addr().unwrap().port();
        let fits = (0..3).all(|i| {
            base.checked_add(i).is_some_and(|p| !taken.contains(&p))
                && (i == 0 || TcpListener::bind(("127.0.0.1", base + i)).is_ok())
        });
        if fits {
            return base;
        }
    }
}

fn log_tails(dir: &Path) -> String {
    (1..=3)
        .map(|i| {
            let path = dir.join(format!("server-{i}.log"));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            format!("--- {} ---\n{tail}\n", path.display())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_setup_cluster_writes_three_servers_that_keep_slotpools_buckets_through_a_kill() {
    let tmp = tempfile::tempdir().unwrap();
    let install = tmp.path().join("nats");
    let client_port = three_free_ports(&[]);
    let cluster_port = three_free_ports(&[client_port, client_port + 1, client_port + 2]);
    let out = Command::new(bin_path("slotpool"))
        .args(["nats-setup", "--dir"])
        .arg(&install)
        .args(["--cluster", "3", "--client-port"])
        .arg(client_port.to_string())
        .arg("--cluster-port")
        .arg(cluster_port.to_string())
        .output()
        .expect("running slotpool nats-setup");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nats-setup --cluster 3: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let urls: Vec<String> = (0..3)
        .map(|i| format!("tls://127.0.0.1:{}", client_port + i))
        .collect();
    let url = urls.join(",");
    assert!(
        stdout.contains("kv-replicas: 3") && stdout.contains(&format!("--nats {url}")),
        "the next steps name neither kv-replicas nor every server's URL:\n{stdout}"
    );
    let mut servers: Vec<Option<ChildGuard>> = (1..=3)
        .map(|i| {
            let mut cmd = Command::new(nats_server_binary());
            cmd.arg("-c")
                .arg(install.join(format!("server-{i}.conf")))
                .arg("-l")
                .arg(tmp.path().join(format!("server-{i}.log")));
            Some(ChildGuard::spawn(format!("nats-server {i}"), cmd).expect("starting nats-server"))
        })
        .collect();

    let tls = install.join("tls");
    let opts = NatsOptions {
        url: url.clone(),
        name: "slotpool-test-launcher".into(),
        creds: Some(install.join("creds/launcher-launcher.creds")),
        tls_ca: Some(tls.join("ca.pem")),
        tls_cert: Some(tls.join("launcher-launcher-cert.pem")),
        tls_key: Some(tls.join("launcher-launcher-key.pem")),
        ..Default::default()
    };
    // The launcher creates slotpool's buckets with 3 replicas once the servers have
    // formed the cluster.
    let bus = wait_for_some(
        format!("slotpool's R3 buckets on the cluster at {url}"),
        CLUSTER_FORMS,
        || async { Bus::connect_replicated(&opts, 3).await.ok() },
    )
    .await;
    assert_eq!(bus.user().role, Role::Launcher);
    let placement = wait_for_some(
        "the events bucket to have a leader and 3 current copies",
        CLUSTER_FORMS,
        || async {
            let p = bus.events.placement().await.ok()??;
            (p.leader.is_some() && p.current.len() == 3).then_some(p)
        },
    )
    .await;
    let mut names = placement.current.clone();
    names.sort();
    assert_eq!(names, ["server-1", "server-2", "server-3"], "{placement:?}");

    let record = serde_json::json!({"written": "before the kill"});
    bus.events
        .put("nats-setup-cluster-test", &record, None)
        .await
        .unwrap_or_else(|err| {
            panic!(
                "writing to the events bucket: {err}\n{}",
                log_tails(tmp.path())
            )
        });

    // Kill the bucket's leader, as a crash would: the other two keep the bucket.
    let leader = placement.leader.expect("a leader");
    let index: usize = leader
        .strip_prefix("server-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a leader not of nats-setup's names: {leader}"));
    servers[index - 1].take().unwrap().kill();
    let read = wait_for_some(
        format!("the record after {leader} was killed"),
        CLUSTER_FORMS,
        || async {
            bus.events
                .get::<serde_json::Value>("nats-setup-cluster-test")
                .await
                .ok()
                .flatten()
        },
    )
    .await;
    assert_eq!(read.value, record, "{}", log_tails(tmp.path()));
    let after = wait_for_some(
        format!("a new leader of the events bucket after {leader} was killed"),
        CLUSTER_FORMS,
        || async {
            let p = bus.events.placement().await.ok()??;
            p.leader.filter(|l| *l != leader)
        },
    )
    .await;
    eprintln!("events bucket: leader {leader} killed, {after} leads now");
    drop(servers);
}

/// A cluster of 2 is refused, with why.
#[test]
fn nats_setup_refuses_a_cluster_of_two() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(bin_path("slotpool"))
        .args(["nats-setup", "--dir"])
        .arg(tmp.path().join("nats"))
        .args(["--cluster", "2"])
        .output()
        .expect("running slotpool nats-setup");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("at least 3") && stderr.contains("majority"),
        "{stderr}"
    );
    assert!(!tmp.path().join("nats").exists(), "it wrote files anyway");
}
