//! `slotpool exec` and the execute channel under it, end to end: a real nats-server
//! with credentials (so the bus enforces every permission), a real launcher, real agents
//! with `--isolation users`, and the real `slotpool` binary as a CI job would run it.

use slotpool_protocol::auth::Role;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::model::Node;
use slotpool_tests::{bin_path, label, wait_for, wait_for_some, ChildGuard, IsolationEnv, Pool};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

async fn users_pool(env: &IsolationEnv) -> Pool {
    let args = env.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Pool::start_with(1, 5, &label("small", 2, 60, &[]), 1, &args).await
}

/// `slotpool <args>` as client `client`.
fn slotpool(pool: &Pool, client: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin_path("slotpool"));
    cmd.args(pool.nats.args_as(Role::Client, client)).args(args);
    cmd
}

/// Runs `slotpool exec` to the end with `stdin`: its status, stdout and stderr.
fn exec(pool: &Pool, client: &str, args: &[&str], stdin: &[u8]) -> (i32, Vec<u8>, Vec<u8>) {
    let mut child = slotpool(pool, client, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("slotpool exec");
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&stdin);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    (out.status.code().unwrap_or(-1), out.stdout, out.stderr)
}

async fn held_node(client: &Client) -> Node {
    let done = client
        .submit_and_wait(&submission(vec!["small".into()], "test"))
        .await
        .expect("a node");
    client.nodes(&done.nodes).await.unwrap().remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_runs_in_the_slot_as_its_user_and_passes_everything_through() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .unwrap();
    let node = held_node(&ci).await;
    let id = node.id.to_string();
    let user = node.login.username.clone().expect("a slot user");

    // Where and as whom it runs: the slot's user, in the slot's cgroup, in its workspace.
    let (code, out, err) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--",
            "sh",
            "-c",
            "id -un; cat /proc/self/cgroup; pwd",
        ],
        b"",
    );
    let out = String::from_utf8_lossy(&out);
    assert_eq!(
        code,
        0,
        "{out}\n{}\n{}",
        String::from_utf8_lossy(&err),
        pool.logs()
    );
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(user.as_str()), "{out}");
    assert!(
        out.contains(&env.cgroup_parent),
        "not in the slot's cgroup: {out}"
    );
    assert!(
        out.trim_end().ends_with(node.workspace.as_deref().unwrap()),
        "{out}"
    );

    // Exit statuses pass through; a signal is 128 + its number.
    for status in [0, 1, 3, 77, 200] {
        let (code, _, _) = exec(
            &pool,
            "ci",
            &[
                "exec",
                "--node",
                &id,
                "--",
                "sh",
                "-c",
                &format!("exit {status}"),
            ],
            b"",
        );
        assert_eq!(code, status, "exit {status}");
    }
    let (code, _, _) = exec(
        &pool,
        "ci",
        &["exec", "--node", &id, "--", "sh", "-c", "kill -9 $$"],
        b"",
    );
    assert_eq!(code, 137);

    // Binary-safe and separate: every byte value through stdin to stdout, and a
    // marker on stderr only; then a large output, counted.
    let all: Vec<u8> = (0..=255u8).cycle().take(256 * 1000).collect();
    let (code, out, err) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--",
            "sh",
            "-c",
            "cat; printf 'on-stderr\\377' >&2",
        ],
        &all,
    );
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&err));
    assert!(
        out == all,
        "stdout differs: {} bytes, expected {}",
        out.len(),
        all.len()
    );
    assert_eq!(err, b"on-stderr\xff");
    let (code, out, _) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--",
            "head",
            "-c",
            "50000000",
            "/dev/zero",
        ],
        b"",
    );
    assert_eq!((code, out.len()), (0, 50_000_000));
    assert!(out.iter().all(|&b| b == 0));

    // Environment and the shell-free argv: an argument with quotes and spaces stays one.
    let (code, out, _) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--env",
            "GREETING=a b",
            "--",
            "sh",
            "-c",
            "printf '%s|%s' \"$GREETING\" \"$1\"",
            "x",
            "it's one",
        ],
        b"",
    );
    assert_eq!(
        (code, String::from_utf8_lossy(&out).as_ref()),
        (0, "a b|it's one")
    );

    // Another client may not run in ci's node: refused by the launcher (204), and its
    // input to ci's sessions is not even deliverable (the bus refuses the subject).
    let (code, _, err) = exec(&pool, "other", &["exec", "--node", &id, "--", "true"], b"");
    let err = String::from_utf8_lossy(&err);
    assert_eq!(code, 204, "{err}");
    assert!(err.contains("belongs to another client"), "{err}");
    let other = Client::connect(&pool.nats.options_as(Role::Client, "other"))
        .await
        .unwrap();
    let forged =
        slotpool_protocol::layout::subjects::exec_input(ci.name(), &node.backing_id, "x", "signal");
    other
        .bus()
        .publish_raw(forged, bytes::Bytes::from_static(b"KILL"))
        .await
        .unwrap();
    let _ = other.bus().flush().await;
    // The refusal is logged by the server as a permissions violation for "other".
    wait_for(
        "the server refuses other's publish on ci's subject",
        LONG,
        || async {
            std::fs::read_to_string(pool.nats.dir().join("nats-server.log"))
                .unwrap_or_default()
                .contains("Publish Violation")
        },
    )
    .await;

    // The time limit kills the command (124), quickly.
    let started = std::time::Instant::now();
    let (code, _, _) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--timeout",
            "2s",
            "--",
            "sleep",
            "60",
        ],
        b"",
    );
    assert_eq!(code, 124);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );

    // A node that is not there, or not ready: distinct statuses.
    let (code, _, _) = exec(
        &pool,
        "ci",
        &["exec", "--node", "node-bn-nothere-s0", "--", "true"],
        b"",
    );
    assert_eq!(code, 204);
    ci.release(vec![node.id.clone()]).await.unwrap();
    let (code, _, err) = exec(&pool, "ci", &["exec", "--node", &id, "--", "true"], b"");
    assert!(
        code == 204 || code == 202,
        "{code}: {}",
        String::from_utf8_lossy(&err)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_a_label_requests_runs_and_releases() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let (code, out, err) = exec(
        &pool,
        "ci",
        &[
            "exec",
            "--label",
            "small",
            "--",
            "sh",
            "-c",
            "echo $SLOTPOOL_NODES; exit 5",
        ],
        b"",
    );
    assert_eq!(
        code,
        5,
        "{}\n{}",
        String::from_utf8_lossy(&err),
        pool.logs()
    );
    assert!(String::from_utf8_lossy(&out).starts_with("node-"));
    wait_for("the node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;

    // Ctrl-C: the command in the slot stops, the node is released, exit 130.
    let mut cmd = slotpool(
        &pool,
        "ci",
        &[
            "exec",
            "--label",
            "small",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 600",
        ],
    );
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut cli = ChildGuard::spawn("slotpool exec", cmd).unwrap();
    let mut stdout = cli.child_mut().stdout.take().unwrap();
    let mut first = [0u8; 8];
    tokio::task::spawn_blocking(move || stdout.read_exact(&mut first).map(|_| first))
        .await
        .unwrap()
        .expect("the command started");
    let users = env.users();
    let sleeping = || {
        Command::new("pgrep")
            .args(["-u", &users.join(","), "-x", "sleep"])
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    wait_for("the command runs as a slot user", LONG, || {
        let found = sleeping();
        async move { found }
    })
    .await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(cli.id() as i32).unwrap(),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = wait_for_some("slotpool exec ends", LONG, || {
        let status = cli.try_wait();
        async move { status }
    })
    .await;
    assert_eq!(status.code(), Some(130));
    wait_for("the node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;
    // Killed by the release; the agent that started it reaps it a moment later (until
    // then it is a zombie, which pgrep still lists). One that was never killed fails.
    wait_for(
        "the command to end with its node (else it outlived the interrupt)",
        Duration::from_secs(10),
        || {
            let found = sleeping();
            async move { !found }
        },
    )
    .await;
}

/// The agent's resident memory, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The pid of the agent of the pool's only backing node.
fn agent_pid(pool: &Pool) -> u32 {
    let dir = pool.work_dir().display().to_string();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("slotpool-agent") && cmdline.contains(&dir) {
            return pid;
        }
    }
    panic!("no agent under {dir}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_does_not_grow_the_agents_memory() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .unwrap();
    let node = held_node(&ci).await;
    let id = node.id.to_string();
    let agent = agent_pid(&pool);
    let before = rss_kib(agent);
    // 1 GiB of output, first read at a trickle for 8 s, then as fast as we can:
    // without flow control the agent would read it as fast as the command writes
    // and hold what the reader has not taken.
    const GIB: usize = 1 << 30;
    let mut cmd = slotpool(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--",
            "head",
            "-c",
            &GIB.to_string(),
            "/dev/zero",
        ],
    );
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut cli = ChildGuard::spawn("slotpool exec", cmd).unwrap();
    let mut stdout = cli.child_mut().stdout.take().unwrap();
    let mut peak = before;
    let mut read = 0usize;
    let started = std::time::Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    while started.elapsed() < Duration::from_secs(8) {
        let n = tokio::task::block_in_place(|| stdout.read(&mut buf)).unwrap();
        read += n;
        peak = peak.max(rss_kib(agent));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let slow_peak = peak;
    let slow_read = read;
    let fast = std::time::Instant::now();
    let mut reads = 0u64;
    loop {
        let n = tokio::task::block_in_place(|| stdout.read(&mut buf)).unwrap();
        if n == 0 {
            break;
        }
        read += n;
        reads += 1;
        if reads.is_multiple_of(256) {
            peak = peak.max(rss_kib(agent));
        }
    }
    let took = fast.elapsed();
    println!(
        "agent RSS before {before} KiB; peak {slow_peak} KiB while a slow reader took \
         {slow_read} bytes in 8 s; peak {peak} KiB after all {read} bytes \
         (the rest at {:.0} MB/s)",
        (read - slow_read) as f64 / took.as_secs_f64() / 1e6
    );
    assert_eq!(read, GIB, "the whole output arrived");
    assert!(
        peak < before + 48 * 1024,
        "the agent's RSS grew from {before} KiB to {peak} KiB streaming 1 GiB"
    );
    drop(stdout);
    drop(cli);
}

/// A node lost while a command runs in it, with its agent unable to say so (stopped):
/// `slotpool exec` hears it from the launchers as it happens and exits 202.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lost_under_a_running_command_ends_exec_at_once() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .unwrap();
    let node = held_node(&ci).await;
    let id = node.id.to_string();
    let mut cmd = slotpool(
        &pool,
        "ci",
        &[
            "exec",
            "--node",
            &id,
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 600",
        ],
    );
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut cli = ChildGuard::spawn("slotpool exec", cmd).unwrap();
    let mut stdout = cli.child_mut().stdout.take().unwrap();
    let mut first = [0u8; 8];
    tokio::task::spawn_blocking(move || stdout.read_exact(&mut first).map(|_| first))
        .await
        .unwrap()
        .expect("the command started");
    let agent = rustix::process::Pid::from_raw(agent_pid(&pool) as i32).unwrap();
    rustix::process::kill_process(agent, rustix::process::Signal::STOP).unwrap();
    let operator = Client::connect(&pool.nats.options_as(Role::Operator, "ops"))
        .await
        .unwrap();
    let released = std::time::Instant::now();
    let _ = operator
        .release_node(node.id.clone(), Some("taken away".into()))
        .await;
    let status = wait_for_some("slotpool exec ends", LONG, || {
        let status = cli.try_wait();
        async move { status }
    })
    .await;
    let took = released.elapsed();
    rustix::process::kill_process(agent, rustix::process::Signal::CONT).unwrap();
    println!("slotpool exec ended {took:?} after the node's release began (its agent stopped)");
    assert_eq!(status.code(), Some(202));
    // Followed, not polled: a check every 5 s from the start took 4.9 s here.
    assert!(
        took < Duration::from_secs(3),
        "the loss took {took:?} to reach slotpool exec"
    );
}

/// The p50 and p99 of `times`, in milliseconds.
fn p50_p99(times: &mut [Duration]) -> (f64, f64) {
    times.sort_unstable();
    let at = |q: f64| {
        let i = ((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1;
        times[i].as_secs_f64() * 1000.0
    };
    (at(0.50), at(0.99))
}

/// Figures, not assertions: one command's turnaround in a held node, `slotpool exec
/// --node N -- true` (a new process: connect to NATS, ask a launcher, run through the
/// agent) beside `ssh -p PORT USER@HOST true` through the shipped sshd drop-in (a new
/// process: handshake, key auth, `enter-slot`), alternated in one run; and a whole job,
/// `slotpool exec --label small -- true` (request, run, release). Run as root with
///
/// ```text
/// cargo build --workspace --bins
/// cargo test -p slotpool-tests --test exec -- --ignored --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run with --ignored --nocapture"]
async fn exec_beside_ssh_turnaround() {
    const ROUNDS: usize = 200;
    const PARALLEL: usize = 16;
    let env = IsolationEnv::new();
    let sshd = slotpool_tests::Sshd::start(&env).await;
    let key = slotpool_tests::ClientKey::new();
    let mut args = env.agent_args();
    args.extend([
        "--ssh-port".into(),
        sshd.port.to_string(),
        "--ssh-host-keys-dir".into(),
        sshd.dir.path().display().to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let pool = Pool::start_with(1, 5, &label("small", PARALLEL as u32, 60, &[]), 1, &args).await;
    let ci = Client::connect(&pool.nats.options_as(Role::Client, "ci"))
        .await
        .unwrap();
    let mut sub = submission(vec!["small".into()], "bench");
    sub.ssh_public_key = Some(key.public());
    let done = ci.submit_and_wait(&sub).await.expect("a node");
    let node = ci.nodes(&done.nodes).await.unwrap().remove(0);
    let id = node.id.to_string();
    let user = node.login.username.clone().unwrap();
    // Slot users pass through the test's temp dirs to reach their homes.
    slotpool_tests::set_mode(pool.dir(), 0o711);
    slotpool_tests::set_mode(&pool.work_dir(), 0o711);
    let run = |mut cmd: Command| {
        let started = std::time::Instant::now();
        let out = cmd.stdin(Stdio::null()).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        started.elapsed()
    };
    let (mut exec_times, mut ssh_times) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        exec_times.push(run(slotpool(
            &pool,
            "ci",
            &["exec", "--node", &id, "--", "true"],
        )));
        let mut ssh = key.command(sshd.port, &user);
        ssh.arg("true");
        ssh_times.push(run(ssh));
    }
    ci.release(vec![node.id.clone()]).await.unwrap();
    wait_for("the node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;
    let mut job_times = Vec::new();
    for _ in 0..ROUNDS {
        job_times.push(run(slotpool(
            &pool,
            "ci",
            &["exec", "--label", "small", "--", "true"],
        )));
    }
    // Jobs per second with PARALLEL of them at a time, each a whole exec --label.
    let started = std::time::Instant::now();
    let workers: Vec<_> = (0..PARALLEL)
        .map(|_| {
            let cmd = || slotpool(&pool, "ci", &["exec", "--label", "small", "--", "true"]);
            let cmds: Vec<Command> = (0..ROUNDS / PARALLEL * 2).map(|_| cmd()).collect();
            std::thread::spawn(move || {
                for mut c in cmds {
                    let out = c.stdin(Stdio::null()).output().unwrap();
                    assert!(out.status.success(), "{out:?}");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let parallel_jobs = PARALLEL * (ROUNDS / PARALLEL * 2);
    let jobs_per_sec = parallel_jobs as f64 / started.elapsed().as_secs_f64();
    let (exec, ssh, job) = (
        p50_p99(&mut exec_times),
        p50_p99(&mut ssh_times),
        p50_p99(&mut job_times),
    );
    println!(
        "{ROUNDS} rounds each, {} build:",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    println!(
        "  slotpool exec --node N -- true     p50 {:7.1} ms  p99 {:7.1} ms",
        exec.0, exec.1
    );
    println!(
        "  ssh USER@HOST true (sshd drop-in)  p50 {:7.1} ms  p99 {:7.1} ms",
        ssh.0, ssh.1
    );
    println!("  slotpool exec --label small -- true p50 {:7.1} ms  p99 {:7.1} ms (request, run, release)", job.0, job.1);
    println!("  exec/ssh p50 ratio {:.2}", exec.0 / ssh.0);
    println!(
        "  {parallel_jobs} jobs, {PARALLEL} at a time: {jobs_per_sec:.1} jobs/s \
         (slotpool exec --label small -- true)"
    );
}
