//! The Python examples of docs/protocol.md, run as written there but for `NATS_URL` and
//! `INSTALL`, against an installation made by `slotpool nats-setup` with its default TLS
//! (the server asks every client for a certificate), a `slotpool serve` given its TLS
//! files as options, and the agents its `local` provider starts (which get those files
//! from it). nats-py is the one docs/protocol.md tells readers to install, in a venv of
//! `scripts/nats-py.sh` (`SLOTPOOL_NATS_PY`, or the script is run here).
//!
//! Beside them, what the docs' error table says of another client's request and node is
//! what a launcher answers.

use slotpool_protocol::api::ErrorCode;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::{BusError, NatsOptions};
use slotpool_protocol::model::RequestState;
use slotpool_tests::{bin_path, config_yaml_with, label, spawn_serve, wait_for, AgentsGuard};
use slotpool_tests::{wait_served, workspace_root, ChildGuard};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long one example may run: two nodes from local agents that boot first.
const EXAMPLE_LIMIT: Duration = Duration::from_secs(120);

fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("SLOTPOOL_NATS_PY") {
        return PathBuf::from(path);
    }
    let out = Command::new(workspace_root().join("scripts/nats-py.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("running scripts/nats-py.sh");
    assert!(out.status.success(), "scripts/nats-py.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn protocol_md() -> String {
    std::fs::read_to_string(workspace_root().join("docs/protocol.md")).expect("docs/protocol.md")
}

/// The `python` blocks of the docs, each with the file name its note gives it.
fn examples(doc: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() != "```python" {
            continue;
        }
        let file = lines[i - 1]
            .trim()
            .strip_prefix("<!-- python:")
            .and_then(|s| s.strip_suffix("-->"))
            .unwrap_or_else(|| {
                panic!(
                    "docs/protocol.md:{}: a Python example needs a `<!-- python: FILE.py -->` note",
                    i + 1
                )
            })
            .trim()
            .to_string();
        let body: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.trim() != "```")
            .copied()
            .collect();
        out.push((file, body.join("\n") + "\n"));
    }
    out
}

/// The requirements in `text`'s first `pip install` line.
fn pip_requirements(text: &str) -> Vec<String> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("pip install"))
        .expect("a pip install line");
    let mut reqs: Vec<String> = line
        .split_whitespace()
        .skip(2)
        .map(|w| w.trim_matches(['\'', '"']).to_string())
        .collect();
    reqs.sort();
    reqs
}

#[test]
fn the_docs_install_the_nats_py_the_suite_runs() {
    let script = std::fs::read_to_string(workspace_root().join("scripts/nats-py.sh")).unwrap();
    let line = script
        .lines()
        .find(|l| l.starts_with("REQUIREMENTS=("))
        .expect("REQUIREMENTS in scripts/nats-py.sh");
    let mut pinned: Vec<String> = line["REQUIREMENTS=(".len()..line.len() - 1]
        .split_whitespace()
        .map(|w| w.trim_matches('"').to_string())
        .collect();
    pinned.sort();
    assert_eq!(pip_requirements(&protocol_md()), pinned);
    assert!(
        pinned.iter().any(|r| r.starts_with("nats-py[nkeys]")),
        "nats-py cannot log in with a .creds file without its nkeys extra"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `slotpool nats-setup` into `dir`, listening on `port`.
fn nats_setup(dir: &Path, port: u16) {
    let out = Command::new(bin_path("slotpool"))
        .args(["nats-setup", "--dir"])
        .arg(dir)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--launcher",
            "launcher",
            "--client",
            "ci",
            "--client",
            "other",
        ])
        .output()
        .expect("running slotpool nats-setup");
    assert!(
        out.status.success(),
        "nats-setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// NATS options of `role-name` in the installation at `dir`, with its certificate.
fn options(dir: &Path, port: u16, role: &str, name: &str) -> NatsOptions {
    NatsOptions {
        url: format!("tls://127.0.0.1:{port}"),
        creds: Some(dir.join(format!("creds/{role}-{name}.creds"))),
        tls_ca: Some(dir.join("tls/ca.pem")),
        tls_cert: Some(dir.join(format!("tls/{role}-{name}-cert.pem"))),
        tls_key: Some(dir.join(format!("tls/{role}-{name}-key.pem"))),
        name: format!("docs-test-{name}"),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_examples_run_against_a_default_installation() {
    let python = python();
    let tmp = tempfile::Builder::new()
        .prefix("slotpool-docs-py-")
        .tempdir()
        .unwrap();
    let install = tmp.path().join("nats");
    let port = free_port();
    nats_setup(&install, port);

    let server_log = std::fs::File::create(tmp.path().join("nats-server.log")).unwrap();
    let mut cmd = Command::new(slotpool_tests::nats_server_binary());
    cmd.arg("-c")
        .arg(install.join("nats-server.conf"))
        .stdin(Stdio::null())
        .stdout(server_log.try_clone().unwrap())
        .stderr(server_log);
    let _server = ChildGuard::spawn("nats-server", cmd).expect("starting nats-server");
    let launcher_opts = options(&install, port, "launcher", "launcher");
    wait_for(
        "the installation's nats-server",
        Duration::from_secs(30),
        || async {
            slotpool_protocol::connect::Bus::connect(&launcher_opts)
                .await
                .is_ok()
        },
    )
    .await;

    // Agents without isolation (no users to make), heartbeating fast.
    let work = tmp.path().join("agents");
    let _agents = AgentsGuard(work.clone());
    let config = tmp.path().join("pool.yaml");
    std::fs::write(
        &config,
        config_yaml_with(
            &work,
            2,
            5,
            &label("small", 2, 60, &[]),
            &[
                "--heartbeat-interval-ms",
                "300",
                "--heartbeat-ttl-secs",
                "2",
                "--isolation",
                "none",
                "--remove-slots-on-stop",
            ],
        ),
    )
    .unwrap();
    // The launcher's TLS files are options, not environment: its local agents must get
    // them from it.
    let mut serve = vec!["--nats".to_string(), launcher_opts.url.clone()];
    for (flag, file) in [
        ("--creds", &launcher_opts.creds),
        ("--tls-ca", &launcher_opts.tls_ca),
        ("--tls-cert", &launcher_opts.tls_cert),
        ("--tls-key", &launcher_opts.tls_key),
    ] {
        serve.push(flag.into());
        serve.push(file.as_ref().unwrap().display().to_string());
    }
    serve.extend([
        "serve".into(),
        "--agent-signing-key".into(),
        install.join("agent-signing.json").display().to_string(),
        "--config".into(),
        config.display().to_string(),
    ]);
    let launcher_log = tmp.path().join("launcher.log");
    let _launcher = spawn_serve("launcher", &serve, &launcher_log);
    let ci = Client::connect(&options(&install, port, "client", "ci"))
        .await
        .expect("connecting as client ci");
    wait_served(&ci).await;

    // The examples, as written but for where the installation is.
    let doc = protocol_md();
    let examples = examples(&doc);
    assert_eq!(examples.len(), 3, "docs/protocol.md's Python examples");
    let dir = tmp.path().join("py");
    std::fs::create_dir(&dir).unwrap();
    for (file, code) in &examples {
        let url_line = "NATS_URL = \"tls://nats.example:4222\"";
        let install_line = "INSTALL = \"/etc/slotpool/nats\"";
        let mut code = code.clone();
        if code.contains(url_line) {
            code = code
                .replace(url_line, &format!("NATS_URL = \"tls://127.0.0.1:{port}\""))
                .replace(
                    install_line,
                    &format!("INSTALL = {:?}", install.display().to_string()),
                );
        }
        std::fs::write(dir.join(file), code).unwrap();
    }
    for (file, _) in &examples {
        let mut cmd = tokio::process::Command::new(&python);
        cmd.arg(file)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(EXAMPLE_LIMIT, cmd.output())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{file} did not finish within {EXAMPLE_LIMIT:?}\n{}",
                    std::fs::read_to_string(&launcher_log).unwrap_or_default()
                )
            })
            .expect("running python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{file} failed:\n{stdout}\n{}\n--- launcher ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&launcher_log).unwrap_or_default()
        );
        eprintln!("{file}:\n{stdout}");
        if file == "slotpool_client.py" {
            assert!(stdout.contains("fulfilled -"), "{stdout}");
            assert!(stdout.contains("released ["), "{stdout}");
        } else if file == "exec_in_node.py" {
            // Its stdin back on stdout, and the command's own exit status.
            assert!(stdout.contains("hello\n"), "{stdout}");
            assert!(stdout.contains("exit {'code': 3}"), "{stdout}");
        } else {
            assert!(stdout.contains("kept alive:"), "{stdout}");
        }
    }

    // Another client's request and node: the launcher's answers are the error table's.
    let mut sub = submission(vec!["small".into()], "docs-test");
    sub.wait_ms = Some(8_000);
    let done = ci.submit_and_wait(&sub).await.expect("a node for ci");
    assert_eq!(done.state, RequestState::Fulfilled);
    let other = Client::connect(&options(&install, port, "client", "other"))
        .await
        .expect("connecting as client other");
    let code_of = |r: Result<_, BusError>| match r {
        Err(BusError::Api(e)) => e.code,
        other => panic!("expected an API error, got {:?}", other.map(|_| ())),
    };
    // The client library reads `not_found` as "no such request" (`None`).
    let status = match other.request(&done.id).await {
        Ok(None) => ErrorCode::NotFound,
        Ok(Some(r)) => panic!("another client read ci's request: {r:?}"),
        Err(e) => code_of(Err(e)),
    };
    let release = code_of(other.release(done.nodes.clone()).await.map(|_| ()));
    ci.release(done.nodes.clone())
        .await
        .expect("ci releases its node");
    let row = |code: ErrorCode| -> String {
        let name = serde_json::to_value(code).unwrap();
        let name = name.as_str().unwrap().to_string();
        doc.lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("docs/protocol.md has no row of error {name}"))
            .to_string()
    };
    assert!(
        row(status).contains("`status` of a request with no record or of another client's"),
        "a status of another client's request is answered {status:?}, which the docs' row does not say: {}",
        row(status)
    );
    assert!(
        row(release).contains("Release, cancel or keepalive of another client's request or node"),
        "a release of another client's node is answered {release:?}, which the docs' row does not say: {}",
        row(release)
    );
}
