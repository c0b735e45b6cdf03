//! Attacks on the host and on slotpool's own daemons, made from real slot logins (a real
//! agent with `--isolation users`, a real sshd running the shipped drop-in), as a hostile
//! CI job would: flooding the agent's and the launcher's listeners. Each attack fails
//! with its protection on; where the protection is a flag, the same attack is run with
//! it off and must succeed, so the test cannot pass because the attack never worked.
//! What each run saw is printed (`--nocapture`).

use slotpool_tests::{
    label, login_env_with, set_mode, wait_for_some, ClientKey, IsolationEnv, Pool, SlotAgent, Sshd,
};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::Duration;

const SOON: Duration = Duration::from_secs(30);

/// A slot user's script: opens `N` TCP connections to `127.0.0.1:PORT` without
/// sending a byte, reports how many the kernel connected, refused or left pending, and
/// holds them open (for a minute, or until killed). Its own descriptor limit is raised as
/// far as it may go.
const FLOOD: &str = r#"
import resource, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = n + 64 if hard == resource.RLIM_INFINITY else min(hard, n + 64)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
held = []
for _ in range(n):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    except OSError as e:
        print("connect error", e, flush=True)
        break
    held.append(s)
time.sleep(2)
ok = refused = pending = 0
for s in held:
    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err == 111:
        refused += 1
    elif err:
        pending += 1
    else:
        try:
            s.getpeername()
            ok += 1
        except OSError:
            pending += 1
print(f"connected {ok} refused {refused} pending {pending}", flush=True)
time.sleep(60)
"#;

/// A flood running in a slot login; the ssh client (and with it the login) is killed on
/// drop.
struct Flood {
    ssh: Child,
    /// What the script reported: `connected N refused N pending N`.
    report: String,
}

impl Flood {
    /// Starts [`FLOOD`] as `user` against `port` with `n` connections; returns once it
    /// reported.
    fn start(sshd: &Sshd, key: &ClientKey, user: &str, port: u16, n: usize) -> Flood {
        let mut ssh = key
            .command(sshd.port, user)
            .arg(format!(
                "cat > flood.py <<'SCRIPT'\n{FLOOD}\nSCRIPT\nexec python3 flood.py {port} {n}"
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running ssh");
        let mut report = String::new();
        BufReader::new(ssh.stdout.take().expect("stdout"))
            .read_line(&mut report)
            .expect("reading the flood's report");
        if !report.starts_with("connected") {
            let _ = ssh.kill();
            let out = ssh.wait_with_output().expect("ssh ended");
            panic!(
                "the flood did not report: {report:?}\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                sshd.log()
            );
        }
        Flood {
            ssh,
            report: report.trim().to_string(),
        }
    }

    fn count(&self, what: &str) -> usize {
        self.report
            .split_whitespace()
            .skip_while(|w| *w != what)
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {what} in {:?}", self.report))
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        let _ = self.ssh.kill();
        let _ = self.ssh.wait();
    }
}

/// Where the agent serves its metrics, from its log.
async fn metrics_addr(agent: &SlotAgent) -> SocketAddr {
    wait_for_some(
        agent.with_log("the agent to say where it serves metrics"),
        SOON,
        || {
            let log = agent.log();
            async move {
                log.lines()
                    .find_map(|l| l.split("metrics listening on ").nth(1))
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|a| a.parse().ok())
            }
        },
    )
    .await
}

/// How many descriptors process `pid` has open.
fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Lowers the descriptor limit of a running process (as a smaller host or a stricter
/// unit would have it), so that a flood that is not bounded runs it out. Only the soft
/// limit: the logins the agent starts may still raise theirs up to its hard limit
/// (where the agent lacks `CAP_SYS_RESOURCE`, as under some containers, that is theirs
/// too).
fn limit_descriptors(pid: u32, max: u64) {
    let mut now = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads the limit into `now`, then sets the one given.
    unsafe {
        assert_eq!(
            libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut now),
            0
        );
        let lowered = libc::rlimit {
            rlim_cur: max,
            rlim_max: now.rlim_max,
        };
        assert_eq!(
            libc::prlimit(
                pid as i32,
                libc::RLIMIT_NOFILE,
                &lowered,
                std::ptr::null_mut()
            ),
            0,
            "prlimit"
        );
    }
}

/// A slot cannot connect to the agent's metrics port on any address the guard covers
/// (here, loopback): the bus guard rejects its connections, as it does the bus's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cannot_reach_the_agents_metrics_port() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(
        &env,
        1,
        &["--metrics", "127.0.0.1:0", "--slot-netns", "off"],
    )
    .await;
    let addr = metrics_addr(&agent).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let flood = Flood::start(&sshd, &key, &user, addr.port(), 50);
    println!(
        "slot to the agent's metrics port {addr}, guard on: {}",
        flood.report
    );
    assert_eq!(flood.count("refused"), 50, "{}", flood.report);
    // The host still reaches it.
    let (status, _) = slotpool_tests::metrics::get(addr, "/metrics", None).await;
    assert_eq!(status, 200);
}

/// With the guard off, a slot's 1,100 idle connections to the metrics port: the agent
/// keeps at most its limit open (closing the oldest idle ones), so its descriptors are
/// not used up: another slot still logs in, a scrape is answered, and the log says so
/// once instead of per connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_leaves_the_agent_serving() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(
        &env,
        2,
        &[
            "--metrics",
            "127.0.0.1:0",
            "--bus-guard",
            "off",
            "--slot-netns",
            "off",
        ],
    )
    .await;
    let addr = metrics_addr(&agent).await;
    limit_descriptors(agent.pid(), 1024);
    let (attacker, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (neighbour, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let log_before = agent.log().len();
    let flood = Flood::start(&sshd, &key, &attacker, addr.port(), 1100);
    println!(
        "slot to the agent's metrics port {addr}, guard off: {}",
        flood.report
    );
    assert_eq!(flood.count("refused"), 0, "{}", flood.report);
    // The kernel hands the agent the connections as fast as it takes them, and the
    // client retries those it dropped for a full backlog: look at the agent's
    // descriptors for a few seconds of it.
    let mut held = 0;
    for _ in 0..30 {
        held = held.max(open_descriptors(agent.pid()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("most agent descriptors open during the flood: {held}");
    assert!(held < 200, "the agent held {held} descriptors");
    let (ok, out, err) = key.ssh(sshd.port, &neighbour, "echo logged-in");
    assert!(
        ok && out.contains("logged-in"),
        "{out}{err}\n{}",
        agent.log()
    );
    let (status, _) = tokio::time::timeout(
        Duration::from_secs(10),
        slotpool_tests::metrics::get(addr, "/metrics", None),
    )
    .await
    .unwrap_or_else(|_| panic!("no scrape answered during the flood\n{}", agent.log()));
    assert_eq!(status, 200);
    let logged = &agent.log()[log_before..];
    let about = logged
        .lines()
        .filter(|l| l.contains("metrics") && !l.contains(" DEBUG "))
        .count();
    println!("agent log lines about metrics during the flood (debug aside): {about}");
    assert!(about <= 3, "{logged}");
    drop(flood);
    agent.release(0, "node-a").await.expect("release");
    agent.release(1, "node-b").await.expect("release");
}

/// A pool whose local agents isolate slots as users, logging in through `sshd`, with
/// `agent_extra` more agent arguments and `serve_extra` more launcher arguments.
async fn users_pool(
    env: &IsolationEnv,
    sshd: &Sshd,
    agent_extra: &[&str],
    serve_extra: &[&str],
) -> Pool {
    let mut agent_args = env.agent_args();
    agent_args.extend([
        "--ssh-port".into(),
        sshd.port.to_string(),
        "--ssh-host-keys-dir".into(),
        sshd.dir.path().display().to_string(),
    ]);
    agent_args.extend(agent_extra.iter().map(|a| a.to_string()));
    let agent_args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
    Pool::start_serving_with(1, 5, &label("iso", 2, 60, &[]), 1, &agent_args, serve_extra).await
}

/// The slot user of a node of a fresh request for `iso` carrying `key`.
async fn slot_user(pool: &Pool, key: &ClientKey) -> String {
    let request = pool
        .fulfilled(&pool.submit_with_key(&["iso"], &key.public()).await)
        .await;
    // Slot users pass through the test's temp dirs to reach their homes.
    set_mode(pool.dir(), 0o711);
    set_mode(&pool.work_dir(), 0o711);
    let node = pool.node(&request.nodes[0]).await;
    node.login.username.expect("a slot user")
}

/// A slot cannot connect to the launcher's `--http` port on the same host: its local
/// agent's guard rejects it (the local provider passes the port with `--guard-port`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cannot_reach_the_launchers_http_port() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let key = ClientKey::new();
    let pool = users_pool(
        &env,
        &sshd,
        &["--slot-netns", "off"],
        &["--http", "127.0.0.1:0"],
    )
    .await;
    let addr = pool.http_addr(0).await;
    let user = slot_user(&pool, &key).await;
    let flood = Flood::start(&sshd, &key, &user, addr.port(), 50);
    println!(
        "slot to the launcher's http port {addr}, guard on: {}",
        flood.report
    );
    assert_eq!(flood.count("refused"), 50, "{}", flood.report);
    let (status, _) = slotpool_tests::metrics::get(addr, "/readyz", None).await;
    assert_eq!(status, 200);
}

/// With the guard off, a slot's 1,100 idle connections to the launcher's `--http`: it
/// keeps at most `--http-max-connections` open, closing the oldest idle ones, so
/// `/readyz` is answered and its descriptors and log stay small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_leaves_the_launcher_serving() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let key = ClientKey::new();
    let pool = users_pool(
        &env,
        &sshd,
        &["--bus-guard", "off", "--slot-netns", "off"],
        &["--http", "127.0.0.1:0"],
    )
    .await;
    let addr = pool.http_addr(0).await;
    let launcher = pool.launcher_pid(0);
    limit_descriptors(launcher, 1024);
    let user = slot_user(&pool, &key).await;
    let log_before = pool.launcher_log(0).len();
    let flood = Flood::start(&sshd, &key, &user, addr.port(), 1100);
    println!(
        "slot to the launcher's http port {addr}, guard off: {}",
        flood.report
    );
    assert_eq!(flood.count("refused"), 0, "{}", flood.report);
    let mut held = 0;
    for _ in 0..30 {
        held = held.max(open_descriptors(launcher));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("most launcher descriptors open during the flood: {held}");
    assert!(held < 400, "the launcher held {held} descriptors");
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(10),
        slotpool_tests::metrics::get(addr, "/readyz", None),
    )
    .await
    .unwrap_or_else(|_| panic!("/readyz not answered during the flood\n{}", pool.logs()));
    assert_eq!(status, 200, "{body}");
    // The pool goes on serving requests meanwhile.
    let more = slot_user(&pool, &key).await;
    assert_ne!(more, user);
    let logged = pool.launcher_log(0)[log_before..].to_string();
    let about = logged
        .lines()
        .filter(|l| l.contains("http") && !l.contains(" DEBUG "))
        .count();
    println!("launcher log lines about http during the flood (debug aside): {about}");
    assert!(about <= 3, "{logged}");
}

/// A slot user's script: creates up to `N` empty files in `DIR` and prints how many it
/// made and why it stopped.
const FILE_FLOOD: &str = r#"
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
os.makedirs(d, exist_ok=True)
made, why = 0, "done"
for i in range(n):
    try:
        os.close(os.open(os.path.join(d, str(i)), os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as e:
        why = e.strerror
        break
    made += 1
print("made", made, "stopped:", why, flush=True)
"#;

/// Where `path` of the slots' host (the agent's mount namespace) is seen from here.
fn on_host(agent: &SlotAgent, path: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/proc/{}/root{path}", agent.pid()))
}

/// A slot's /tmp, /var/tmp and /dev/shm are its own: what a job leaves there never
/// reaches the host's, a flood of files there stops at the tmpfs's entry limit (far
/// below the release's wipe budget), and the release takes it all at once. With
/// `--slot-private-tmp off` the same files land in the host's /tmp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slots_tmp_is_its_own_and_leaves_with_it() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(
        &env,
        1,
        &["--slot-netns", "off", "--slot-private-tmp", "on"],
    )
    .await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let marker = format!("/tmp/slotpool-marker-{user}");
    let flood_dir = format!("/tmp/flood-{user}");
    let n = slotpool_agent::isolation::private_tmp::MAX_INODES + 1000;
    let script = format!(
        "cd && touch {marker} /var/tmp/m-{user} /dev/shm/m-{user} && stat -f -c %T /tmp /var/tmp /dev/shm \
         && pwd && python3 -c '{FILE_FLOOD}' {flood_dir} {n}"
    );
    let started = std::time::Instant::now();
    let (ok, out, err) = key.ssh(sshd.port, &user, &script);
    println!(
        "private /tmp on: {} in {:?}",
        out.trim().replace('\n', " | "),
        started.elapsed()
    );
    assert!(ok, "{out}{err}\n{}", agent.log());
    assert_eq!(
        out.lines().take(3).collect::<Vec<_>>(),
        ["tmpfs", "tmpfs", "tmpfs"],
        "{out}"
    );
    assert!(out.contains("No space left on device"), "{out}");
    let made: u64 = out
        .split_whitespace()
        .skip_while(|w| *w != "made")
        .nth(1)
        .and_then(|m| m.parse().ok())
        .expect("a count");
    assert!(
        made < slotpool_agent::isolation::private_tmp::MAX_INODES,
        "{out}"
    );
    assert!(
        !on_host(&agent, &marker).exists(),
        "the marker reached the host's /tmp"
    );
    assert!(!on_host(&agent, &flood_dir).exists());
    // A second login sees what the first left: it is the slot's /tmp, not the login's.
    let (ok, out, _) = key.ssh(sshd.port, &user, &format!("ls {marker}"));
    assert!(ok && out.contains(&marker), "{out}");
    let started = std::time::Instant::now();
    agent.release(0, "node-a").await.expect("release");
    println!(
        "release after {made} files in /tmp: {:?}",
        started.elapsed()
    );
    assert!(
        !agent.log().contains("could not be cleaned"),
        "the release left the slot dirty\n{}",
        agent.log()
    );
    drop(agent);

    // The same job with the protection off: its files are on the host.
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(
        &env,
        1,
        &["--slot-netns", "off", "--slot-private-tmp", "off"],
    )
    .await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let marker = format!("/tmp/slotpool-marker-{user}");
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user,
        &format!("touch {marker} && stat -f -c %T /tmp"),
    );
    println!("private /tmp off: {}", out.trim());
    assert!(ok, "{out}{err}");
    assert!(
        on_host(&agent, &marker).exists(),
        "with --slot-private-tmp off the file should be on the host"
    );
    agent.release(0, "node-a").await.expect("release");
}

/// A slot user's script: `make NAME` creates a POSIX message queue (mode 0666), `open
/// NAME` opens one for reading, `unlink NAME` removes it; prints `ok` or `errno N`.
const MQUEUE: &str = r#"
import ctypes, os, sys
rt = ctypes.CDLL("librt.so.1", use_errno=True)
what, name = sys.argv[1], sys.argv[2].encode()
if what == "make":
    r = rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o666, None)
elif what == "open":
    r = rt.mq_open(name, os.O_RDONLY)
else:
    r = rt.mq_unlink(name)
print("ok" if r >= 0 else "errno %d" % ctypes.get_errno())
"#;

/// Runs [`MQUEUE`] as `user` (or, without an sshd, as the test itself, root on the host).
fn mqueue(login: Option<(&Sshd, &ClientKey, &str)>, what: &str, name: &str) -> String {
    let out = match login {
        Some((sshd, key, user)) => {
            let (_, out, err) = key.ssh(
                sshd.port,
                user,
                &format!("python3 -c '{MQUEUE}' {what} {name}"),
            );
            format!("{out}{err}")
        }
        None => {
            let out = std::process::Command::new("python3")
                .args(["-c", MQUEUE, what, name])
                .output()
                .expect("running python3");
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    out.trim().to_string()
}

/// A POSIX message queue a job makes is the slot's own (each slot has an IPC namespace of
/// its own) and goes with the release: the next tenant of the slot does not find it.
/// With `--slot-private-tmp off` the queue is the host's and outlives the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_message_queue_does_not_outlive_its_slot() {
    let name = format!("/slotpool-test-{}", std::process::id());
    for (private, survives) in [("on", false), ("off", true)] {
        let env = IsolationEnv::new();
        let (sshd, key, agent) = login_env_with(&env, 1, &["--slot-private-tmp", private]).await;
        let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
        assert_eq!(mqueue(Some((&sshd, &key, &user)), "make", &name), "ok");
        // Another login of the same tenancy finds it.
        assert_eq!(mqueue(Some((&sshd, &key, &user)), "open", &name), "ok");
        agent.release(0, "node-a").await.expect("release");
        let (next, _) = agent.prepare_login(0, "node-b", &key.public()).await;
        let seen = mqueue(Some((&sshd, &key, &next)), "open", &name);
        println!("--slot-private-tmp {private}: the next tenant opening {name}: {seen}");
        // The queue of the run with the protection off is the host's: remove it.
        let _ = mqueue(None, "unlink", &name);
        if survives {
            assert_eq!(
                seen, "ok",
                "with --slot-private-tmp off the queue is the host's"
            );
        } else {
            assert_eq!(seen, "errno 2", "the next tenant found the queue");
        }
        agent.release(0, "node-b").await.expect("release");
    }
}
