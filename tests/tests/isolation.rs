//! Per-slot isolation and backing node health, end to end and as root: real agents with
//! `--isolation users`, a real sshd on a loopback port, real logins.

use slotpool_agent::isolation::{passwd, procs};
use slotpool_protocol::api::{ErrorCode, SlotLimits};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::model::{AgentHeartbeat, Node, RequestState};
use slotpool_protocol::store::{Change, Versioned};
use slotpool_tests::{
    exists, label, login_env, login_env_with, login_of, next_within, set_mode,
    shipped_sshd_drop_in, uid_of, wait_for, wait_for_some, ClientKey, IsolationEnv, Pool,
    SlotAgent, Sshd, AGENT_ARGS,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// The workspace is gone or empty.
fn wiped(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none())
}

/// Shell commands a job runs to leave files behind in the shared temporary directories,
/// and System V IPC objects (shared memory, a semaphore set, a message queue).
const LEAVE_TRACES: &str =
    "for d in /tmp /var/tmp /dev/shm; do echo left > $d/$(id -un)-left; done; \
     ipcmk -M 4096 >/dev/null && ipcmk -S 1 >/dev/null && ipcmk -Q >/dev/null";

/// The files [`LEAVE_TRACES`] makes for `user`.
fn traces(user: &str) -> Vec<PathBuf> {
    ["/tmp", "/var/tmp", "/dev/shm"]
        .iter()
        .map(|d| Path::new(d).join(format!("{user}-left")))
        .collect()
}

async fn node(pool: &Pool, id: &slotpool_protocol::NodeId) -> Node {
    pool.nodes()
        .await
        .into_iter()
        .find(|n| &n.id == id)
        .unwrap_or_else(|| panic!("node {id} not found"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssh_logins_are_isolated_limited_and_cleaned_up_on_release() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let key = ClientKey::new();
    let mut agent_args = env.agent_args();
    agent_args.extend(sshd.agent_args());
    let labels = label(
        "iso",
        2,
        60,
        &[
            "limits: {cpu: 1, memory-mb: 256, pids: 20}",
            "host-key-checking: true",
        ],
    );
    let pool = Pool::start_with(1, 5, &labels, 1, &args(&agent_args)).await;
    let request = pool
        .fulfilled(&pool.submit_with_key(&["iso", "iso"], &key.public()).await)
        .await;
    // Slot users pass through the test's temp dirs to reach their homes.
    set_mode(pool.dir(), 0o711);
    set_mode(&pool.work_dir(), 0o711);
    let a = node(&pool, &request.nodes[0]).await;
    let b = node(&pool, &request.nodes[1]).await;
    let (user_a, user_b) = (
        a.login.username.clone().unwrap(),
        b.login.username.clone().unwrap(),
    );
    assert_ne!(user_a, user_b);
    assert!(user_a.starts_with(&env.user_prefix), "{user_a}");
    assert_eq!(a.login.port, Some(sshd.port));
    assert!(
        !a.login.host_keys.is_empty(),
        "node carries the host keys: {a:?}"
    );
    let ws_a = PathBuf::from(a.workspace.clone().unwrap());
    let ws_b = PathBuf::from(b.workspace.clone().unwrap());
    let info_a = passwd::lookup(&user_a).expect("slot user a exists");
    let info_b = passwd::lookup(&user_b).expect("slot user b exists");

    // The requester logs in with its key, as the slot's user, in the slot's home.
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_a,
        &format!("id -un; pwd; echo mine > file; {}", LEAVE_TRACES),
    );
    assert!(ok, "login as {user_a} failed: {err}\n{}", sshd.log());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec![user_a.as_str(), ws_a.to_str().unwrap()]
    );
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user_b,
        &format!("echo secret > secret; {}", LEAVE_TRACES),
    );
    assert!(ok, "login as {user_b} failed: {err}");
    // They are in the slot's own IPC namespace: its next login sees them, the host and
    // the other slots do not.
    let ipc_of_b = |out: &str| {
        let uid = info_b.uid.to_string();
        out.lines()
            .filter(|l| l.split_whitespace().any(|f| f == uid))
            .count()
    };
    let tables = "for t in shm sem msg; do cat /proc/sysvipc/$t; done";
    let (ok, out, err) = key.ssh(sshd.port, &user_b, tables);
    assert!(ok, "{err}");
    assert_eq!(ipc_of_b(&out), 3, "the job made its IPC objects:\n{out}");
    assert_eq!(
        procs::ipc_objects_of(Path::new("/proc"), info_b.uid),
        vec![],
        "the host sees the slot's IPC objects"
    );
    let (_, out, _) = key.ssh(sshd.port, &user_a, tables);
    assert_eq!(ipc_of_b(&out), 0, "slot a sees b's IPC objects:\n{out}");

    // A cannot read B's workspace.
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_a,
        &format!("cat {}/secret", ws_b.display()),
    );
    assert!(!ok && !out.contains("secret"), "a read b's file: {out}");
    assert!(err.contains("Permission denied"), "{err}");

    // Nor the agent's log (every slot's node, uid and logins), in the directory A passes
    // through to its home, nor that directory's listing.
    let agent_dir = pool.agent_dir(a.backing_id.as_str());
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_a,
        &format!("cat {dir}/agent.log; ls {dir}", dir = agent_dir.display()),
    );
    assert!(
        !ok && !out.contains(&user_b) && !out.contains("agent.log"),
        "a slot read the agent's log or directory: {out}"
    );
    assert_eq!(err.matches("Permission denied").count(), 2, "{err}");

    // A leaves a daemon behind that survives the logout...
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user_a,
        "setsid nohup sleep 1000 >/dev/null 2>&1 < /dev/null & echo started",
    );
    assert!(ok, "{err}");
    let cgroups = env.cgroups();
    let daemon = wait_for_some(
        "a's daemon in a's cgroup",
        Duration::from_secs(10),
        || async {
            let procs = procs::processes_of(Path::new("/proc"), info_a.uid);
            let inside = cgroups.procs(&user_a).unwrap_or_default();
            procs.into_iter().find(|p| {
                inside.contains(p)
                    && std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                        .is_ok_and(|c| c.starts_with("sleep\0"))
            })
        },
    )
    .await;
    assert!(alive(daemon), "the daemon survives the logout");

    // B cannot go over its pids limit (20).
    let (_, out, err) = key.ssh(
        sshd.port,
        &user_b,
        "sh -c 'for i in $(seq 1 40); do sleep 60 >/dev/null 2>&1 & done; echo tried' 2>&1",
    );
    let text = format!("{out}{err}");
    assert!(
        text.contains("fork") || text.contains("Resource temporarily unavailable"),
        "40 processes started under a pids limit of 20: {text}"
    );
    let in_b = cgroups.procs(&user_b).unwrap();
    assert!(in_b.len() <= 20, "{} processes in b's cgroup", in_b.len());

    // Release: everything of both slots is gone; then each slot is warmed again (its
    // user made anew, with an empty workspace and an empty cgroup).
    let released = pool.release_and_wait(&request.nodes).await;
    assert_eq!(released.released.len(), 2);
    assert!(!alive(daemon), "the setsid daemon is gone after release");
    for (user, info, ws) in [(&user_a, &info_a, &ws_a), (&user_b, &info_b, &ws_b)] {
        assert!(
            procs::processes_of(Path::new("/proc"), info.uid).is_empty(),
            "processes of {user} left"
        );
        assert!(wiped(ws), "workspace {} not empty", ws.display());
        for trace in traces(user) {
            assert!(!trace.exists(), "{} left", trace.display());
        }
        let ipc = procs::ipc_objects_of(Path::new("/proc"), info.uid);
        assert!(ipc.is_empty(), "IPC objects of {user} left: {ipc:?}");
        wait_for("the slot to be warm again", LONG, || async {
            passwd::lookup(user).is_some() && ws.is_dir()
        })
        .await;
        assert!(wiped(ws), "warm workspace {} not empty", ws.display());
        assert!(cgroups.procs(user).unwrap().is_empty());
    }

    // The next job on a slot sees a fresh user: an empty home (but for its key), nothing
    // the previous job left in the shared temporary directories, no process of it.
    let again = pool
        .fulfilled(&pool.submit_with_key(&["iso"], &key.public()).await)
        .await;
    let c = node(&pool, &again.nodes[0]).await;
    let user_c = c.login.username.clone().unwrap();
    assert!(user_c == user_a || user_c == user_b, "{user_c}");
    let uid_c = passwd::lookup(&user_c).unwrap().uid;
    assert!(procs::processes_of(Path::new("/proc"), uid_c).is_empty());
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_c,
        &format!(
            concat!(
                "ls -A; ls -d {} 2>/dev/null; ",
                "find /tmp /var/tmp /dev/shm -maxdepth 1 -user $(id -u) 2>/dev/null; ",
                "pgrep -u $(id -u) -x sleep; true"
            ),
            traces(&user_c)
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ),
    );
    assert!(ok, "login as {user_c} failed: {err}");
    assert_eq!(
        out.trim(),
        ".ssh",
        "the second job sees the first one's traces"
    );

    // SIGTERM: the agent reports draining and leaves no slot process behind.
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user_c,
        "setsid nohup sleep 1000 >/dev/null 2>&1 < /dev/null & echo started",
    );
    assert!(ok, "{err}");
    assert!(!procs::processes_of(Path::new("/proc"), uid_c).is_empty());
    let pid: i32 = std::fs::read_to_string(pool.agent_dir(c.backing_id.as_str()).join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Held open: the launcher may remove the agent's directory once it has gone.
    let mut agent_log =
        std::fs::File::open(pool.agent_dir(c.backing_id.as_str()).join("agent.log")).unwrap();
    let agents = pool.client.list_agents().await.unwrap();
    assert!(agents.iter().all(|h| !h.draining));
    // Watched from before the signal: once the launcher sees the agent drain it may
    // release the backing node, removing its heartbeat and its directory (log included).
    let heartbeats = &pool.client.bus().agents;
    let mut beats = Box::pin(heartbeats.watch_keys(c.backing_id.as_str()).await.unwrap());
    // SAFETY: signalling the agent the pool started, by its recorded pid.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    loop {
        match next_within(&mut beats, LONG, "a draining heartbeat")
            .await
            .unwrap()
        {
            Change::Put {
                key,
                revision,
                value,
            } => {
                let beat: Versioned<AgentHeartbeat> =
                    Change::decode(heartbeats.bucket(), &key, revision, &value).unwrap();
                if beat.value.draining {
                    break;
                }
            }
            Change::Removed { .. } => panic!("the heartbeat was removed before it said draining"),
            Change::Synced => {}
        }
    }
    wait_for("the agent to exit", Duration::from_secs(20), || async {
        !alive(pid)
    })
    .await;
    let left = procs::processes_of(Path::new("/proc"), uid_c);
    if !left.is_empty() {
        let mut log = String::new();
        std::io::Read::read_to_string(&mut agent_log, &mut log).unwrap();
        let what: Vec<String> = left.iter().map(|p| process_summary(*p)).collect();
        panic!("slot processes outlived the agent: {what:?}\nagent log:\n{log}",);
    }
}

/// State, parent and command line of `pid`, for a failure message.
fn process_summary(pid: i32) -> String {
    let proc_dir = Path::new("/proc").join(pid.to_string());
    let status = std::fs::read_to_string(proc_dir.join("status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or("?")
            .trim()
            .to_string()
    };
    let cmdline = std::fs::read(proc_dir.join("cmdline")).unwrap_or_default();
    format!(
        "pid {pid} state {} ppid {}: {}",
        field("State:"),
        field("PPid:"),
        String::from_utf8_lossy(&cmdline).replace('\0', " ")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_one_host_with_the_same_slot_numbers_do_not_collide() {
    let env = IsolationEnv::new();
    let labels = label("pair", 1, 60, &["limits: {pids: 50}"]);
    let pool = Pool::start_with(2, 5, &labels, 1, &args(&env.agent_args())).await;
    let request = pool.fulfilled(&pool.submit(&["pair", "pair"]).await).await;
    let a = node(&pool, &request.nodes[0]).await;
    let b = node(&pool, &request.nodes[1]).await;
    assert_ne!(a.backing_id, b.backing_id);
    assert_eq!((a.slot, b.slot), (0, 0), "both agents use slot 0");
    let (ua, ub) = (a.login.username.unwrap(), b.login.username.unwrap());
    assert_ne!(ua, ub);
    let (ia, ib) = (passwd::lookup(&ua).unwrap(), passwd::lookup(&ub).unwrap());
    assert_ne!(ia.uid, ib.uid);
    assert_ne!(a.workspace, b.workspace);
    let cgroups = env.cgroups();
    for u in [&ua, &ub] {
        for dir in cgroups.paths(u) {
            assert!(dir.is_dir(), "cgroup {} missing", dir.display());
        }
    }
    // Releasing one leaves the other alone.
    let ws_b = Path::new(b.workspace.as_deref().unwrap());
    std::fs::write(ws_b.join("output"), "b's").unwrap();
    std::fs::write(
        Path::new(a.workspace.as_deref().unwrap()).join("output"),
        "a's",
    )
    .unwrap();
    pool.release_and_wait(&request.nodes[..1]).await;
    assert!(wiped(Path::new(a.workspace.as_deref().unwrap())));
    assert_eq!(passwd::lookup(&ub).map(|i| i.uid), Some(ib.uid));
    assert!(ws_b.join("output").is_file());
    pool.release_and_wait(&request.nodes[1..]).await;
    assert!(wiped(ws_b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_probe_keeps_new_slots_away_until_it_recovers() {
    let flags = tempfile::tempdir().unwrap();
    let fail = flags.path().join("fail");
    let probe = format!("test ! -e {}", fail.display());
    let mut agent_args = AGENT_ARGS.to_vec();
    agent_args.extend([
        "--health-probe",
        &probe,
        "--health-probe-interval-ms",
        "200",
    ]);
    let pool = Pool::start_with(1, 5, &label("probed", 2, 60, &[]), 1, &agent_args).await;
    let first = pool.fulfilled(&pool.submit(&["probed"]).await).await;

    std::fs::write(&fail, "").unwrap();
    wait_for(
        "the agent to report unhealthy",
        Duration::from_secs(10),
        || async {
            pool.client.list_agents().await.unwrap().iter().any(|h| {
                !h.health.healthy
                    && h.health
                        .reason
                        .as_deref()
                        .is_some_and(|r| r.contains("health probe failed"))
            })
        },
    )
    .await;
    let second = pool.submit(&["probed"]).await;
    // A free slot exists, but the node is unhealthy: the request must keep waiting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waiting = pool.client.list_requests().await.unwrap();
    let waiting = waiting.iter().find(|r| r.id == second).unwrap();
    assert_eq!(waiting.state, RequestState::Requested, "{waiting:?}");
    assert_eq!(
        pool.nodes().await.len(),
        1,
        "no new slot on an unhealthy node"
    );

    std::fs::remove_file(&fail).unwrap();
    let second = pool.wait_final(&second, LONG).await;
    assert_eq!(second.state, RequestState::Fulfilled, "{second:?}");
    let n1 = node(&pool, &first.nodes[0]).await;
    let n2 = node(&pool, &second.nodes[0]).await;
    assert_eq!(
        n1.backing_id, n2.backing_id,
        "the recovered node is used again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_very_deep_tree_left_by_a_job_does_not_take_the_agent_down() {
    let env = IsolationEnv::new();
    let (sshd, key, mut agent) = login_env(&env, 2).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, ws) = login_of(&prepared);
    // 30,000 levels, each made relative to the last (no long path is ever built).
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user,
        "perl -e 'for (1..30000) { mkdir q(d) or die qq($!); chdir q(d) or die qq($!) } print qq(deep\\n)'",
    );
    assert!(ok && out.trim() == "deep", "{out}{err}\n{}", sshd.log());
    assert!(ws.join("d/d/d").is_dir());

    // Slot 0 is released while slot 1 is prepared and released.
    let other = async {
        agent.prepare(1, "node-b", None).await.unwrap();
        agent.release(1, "node-b").await.unwrap();
    };
    let (released, ()) = tokio::join!(agent.release(0, "node-a"), other);
    assert!(agent.alive(), "the agent died:\n{}", agent.log());
    match (released, agent.dirty(0)) {
        (Ok(()), None) => {
            assert!(wiped(&ws), "workspace {} not wiped", ws.display());
            assert!(!ws.join("d").exists());
        }
        (Err(err), Some(reason)) => {
            assert!(
                reason.contains("budget"),
                "dirty without a budget reason: {reason} ({err})"
            )
        }
        (result, dirty) => panic!("release said {result:?} but dirty is {dirty:?}"),
    }
    // Slot 1 still works after.
    agent.prepare(1, "node-c", None).await.unwrap();
    agent.release(1, "node-c").await.unwrap();
    assert!(agent.alive(), "the agent died:\n{}", agent.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_gets_a_new_uid_for_every_tenancy() {
    let env = IsolationEnv::new();
    let agent = SlotAgent::start(&env, 1, &[]).await;
    let (first, last) = env.uid_range.split_once('-').unwrap();
    let range = first.parse::<u32>().unwrap()..=last.parse::<u32>().unwrap();
    let mut uids = Vec::new();
    for node in ["node-a", "node-b", "node-c"] {
        wait_for("slot 0 to be warm", LONG, || async { agent.warm(0) }).await;
        let prepared = agent.prepare(0, node, None).await.unwrap();
        let (user, _) = login_of(&prepared);
        let uid = uid_of(&user).expect("the slot user exists");
        assert!(range.contains(&uid), "uid {uid} outside {range:?}");
        if !uids.is_empty() {
            // The user the release kept, given a new uid and gid in place (no userdel
            // and useradd on the way from one tenant to the next).
            let gid = passwd::lookup(&user).unwrap().gid;
            assert_eq!(gid, uid, "the kept user is renumbered, uid and gid alike");
        }
        uids.push(uid);
        agent.release(0, node).await.unwrap();
    }
    assert!(
        uids.windows(2).all(|w| w[0] < w[1]),
        "each tenancy has a new, higher uid: {uids:?}"
    );
}

/// A group made for a test with `groupadd`, deleted on drop (also when the test panics).
struct TestGroup(String);

impl TestGroup {
    fn add(name: String, gid: u32) -> TestGroup {
        let status = std::process::Command::new("groupadd")
            .args(["--gid", &gid.to_string(), &name])
            .status()
            .unwrap();
        assert!(status.success(), "groupadd {name} with gid {gid}: {status}");
        TestGroup(name)
    }
}

impl Drop for TestGroup {
    fn drop(&mut self) {
        let _ = std::process::Command::new("groupdel").arg(&self.0).status();
    }
}

/// Where `user`'s line is in /etc/passwd.
fn passwd_line(user: &str) -> usize {
    std::fs::read_to_string("/etc/passwd")
        .unwrap()
        .lines()
        .position(|l| l.split(':').next() == Some(user))
        .unwrap_or_else(|| panic!("{user} is not in /etc/passwd"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_user_whose_next_id_is_taken_is_renumbered_to_the_one_after() {
    let env = IsolationEnv::new();
    let agent = SlotAgent::start(&env, 2, &[]).await;
    for slot in 0..2 {
        wait_for("both slots to be warm", LONG, || async { agent.warm(slot) }).await;
    }
    let (user, _) = login_of(&agent.prepare(0, "node-a", None).await.unwrap());
    let (neighbour, _) = login_of(&agent.prepare(1, "node-n", None).await.unwrap());
    let first = uid_of(&user).unwrap();
    // The warm-ups made slot 0's user first, so its line comes before slot 1's.
    assert!(passwd_line(&user) < passwd_line(&neighbour));
    // The uid the next warm-up counts to is free, but a group has it as gid: the
    // renumber to it is refused.
    let next = (first + 1..)
        .find(|uid| passwd::name_of(*uid).is_none())
        .unwrap();
    let _group = TestGroup::add(format!("{}g", env.user_prefix), next);
    agent.release(0, "node-a").await.unwrap();
    wait_for("slot 0 to be warm again", LONG, || async { agent.warm(0) }).await;
    let (again, _) = login_of(&agent.prepare(0, "node-b", None).await.unwrap());
    assert_eq!(again, user);
    let uid = uid_of(&user).unwrap();
    assert!(
        uid > next,
        "uid {uid}: neither the freed {first} nor the taken {next}"
    );
    assert_eq!(passwd::lookup(&user).unwrap().gid, uid);
    // Renumbered in place to the id after, not deleted and made anew (which would have
    // put its line last, after slot 1's user).
    assert!(
        passwd_line(&user) < passwd_line(&neighbour),
        "slot 0's user was made anew:\n{}",
        agent.log()
    );
    agent.release(0, "node-b").await.unwrap();
    agent.release(1, "node-n").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_asked_to_remove_its_slots_on_stop_leaves_no_user_or_cgroup() {
    let env = IsolationEnv::new();
    let mut agent = SlotAgent::start(&env, 3, &["--remove-slots-on-stop".into()]).await;
    for slot in 0..3 {
        wait_for("every slot to be warm", LONG, || async { agent.warm(slot) }).await;
    }
    // One slot prepared, the others warm: the stop removes both kinds.
    let (user, _) = login_of(&agent.prepare(1, "node-a", None).await.unwrap());
    assert!(env.users().contains(&user));
    let groups: Vec<PathBuf> = (0..3)
        .flat_map(|slot| {
            env.cgroups()
                .paths(&format!("{}s{slot}", namespace(&env, &user)))
        })
        .collect();
    assert!(
        groups.iter().all(|g| g.is_dir()),
        "every slot has its cgroup"
    );

    agent.stop().await;

    assert_eq!(
        env.users(),
        Vec::<String>::new(),
        "slot users left in /etc/passwd"
    );
    let left: Vec<&PathBuf> = groups.iter().filter(|g| g.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    let parents: Vec<PathBuf> = env
        .parent_dirs()
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    assert!(parents.is_empty(), "cgroup parents left: {parents:?}");
    assert!(
        !agent.work_dir().join("state/1.json").exists(),
        "state left"
    );
}

/// The user-name namespace of a slot user (its name without `s<slot>`).
fn namespace(env: &IsolationEnv, user: &str) -> String {
    let (ns, _) = passwd::split_user_name(user).expect("a slot user name");
    assert!(ns.starts_with(&env.user_prefix));
    ns.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_job_leaves_in_shared_directories_survives_release() {
    // /run/lock is the host's in every slot; /dev/shm too when slots share the host's.
    left_in_shared_directories("on", &["/run/lock", "/run/lock"]).await;
    left_in_shared_directories("off", &["/run/lock", "/run/lock", "/dev/shm"]).await;
}

/// A job of an agent with `--slot-private-tmp private_tmp` leaves a file, a hard link and
/// a file in `dirs` (the host's); none survives the release.
async fn left_in_shared_directories(private_tmp: &str, dirs: &[&str]) {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 1, &["--slot-private-tmp", private_tmp]).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    let left: Vec<PathBuf> = dirs
        .iter()
        .zip(["lock", "link", "shm"])
        .map(|(d, what)| Path::new(d).join(format!("{user}-{what}")))
        .collect();
    let shm = left
        .get(2)
        .map_or_else(|| "/dev/null".to_string(), |p| p.display().to_string());
    // A hard link to a workspace file where protected_hardlinks allows it (own file),
    // else a plain file.
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user,
        &format!(
            "echo x > {lock} && echo y > job-file && (ln job-file {link} || echo y > {link}) && echo z > {shm}",
            lock = left[0].display(),
            link = left[1].display(),
        ),
    );
    assert!(ok, "{err}\n{}", sshd.log());
    for path in &left {
        assert!(exists(path), "{} not made", path.display());
    }
    let released = agent.release(0, "node-a").await;
    let dirty = agent.dirty(0);
    let survivors: Vec<_> = left.iter().filter(|p| exists(p)).collect();
    for path in &left {
        let _ = std::fs::remove_file(path);
    }
    assert!(
        released.is_ok() && dirty.is_none(),
        "release: {released:?}, dirty: {dirty:?}"
    );
    assert!(survivors.is_empty(), "left after release: {survivors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_a_forged_key_line() {
    let env = IsolationEnv::new();
    let agent = SlotAgent::start(&env, 1, &[]).await;
    let good = ClientKey::new().public();
    let attacker = ClientKey::new().public();
    for forged in [
        format!("{good}\r{attacker}"),
        format!("{good}\0{attacker}"),
        format!("command=\"/bin/sh\" {attacker}"),
        format!("{good}\n{attacker}"),
    ] {
        match agent.prepare(0, "node-a", Some(&forged)).await {
            Err(BusError::Api(err)) => {
                assert_eq!(err.code, ErrorCode::BadRequest, "{forged:?}: {err}");
                assert!(err.message.contains("ssh_public_key"), "{err}");
            }
            other => panic!("{forged:?} was not refused: {other:?}"),
        }
    }
    let keys = agent.work_dir().join("slots/0/.ssh/authorized_keys");
    assert!(!exists(&keys), "a key file was written");
    agent.prepare(0, "node-a", Some(&good)).await.unwrap();
    assert_eq!(std::fs::read_to_string(&keys).unwrap(), format!("{good}\n"));
    agent.release(0, "node-a").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_sshd_drop_in_is_what_the_tests_run_and_sshd_accepts_it() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let config = std::fs::read_to_string(sshd.config()).unwrap();
    let shipped = std::fs::read_to_string(shipped_sshd_drop_in()).unwrap();
    for line in shipped.lines().filter(|l| {
        let l = l.trim();
        !l.is_empty()
            && !l.starts_with('#')
            && !l.starts_with("Match")
            && !l.starts_with("ForceCommand")
    }) {
        assert!(
            config.contains(line),
            "{line:?} missing from the test sshd's config"
        );
    }
    let out = std::process::Command::new(slotpool_tests::SSHD)
        .arg("-t")
        .arg("-f")
        .arg(sshd.config())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sshd -t refuses the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forwarding_from_a_slot_login_is_refused() {
    use std::io::{Read, Write};
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env(&env, 1).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    // What a job would reach through the tunnel.
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    target.set_nonblocking(true).unwrap();
    let local = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = key.command(sshd.port, &user);
    cmd.arg("-N")
        .arg("-L")
        .arg(format!(
            "127.0.0.1:{local}:127.0.0.1:{}",
            target.local_addr().unwrap().port()
        ))
        .stderr(log.reopen().unwrap());
    let _ssh = slotpool_tests::ChildGuard::spawn("ssh -L", cmd).unwrap();
    let mut conn = wait_for_some(
        "ssh to listen on the forwarded port",
        Duration::from_secs(20),
        || async { std::net::TcpStream::connect(("127.0.0.1", local)).ok() },
    )
    .await;
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let _ = conn.write_all(b"hello through the tunnel\n");
    let mut buf = [0u8; 64];
    let read = conn.read(&mut buf);
    let stderr = std::fs::read_to_string(log.path()).unwrap_or_default();
    assert!(
        matches!(read, Ok(0))
            || read
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the forwarded connection stayed open ({read:?}): {stderr}"
    );
    assert!(
        target
            .accept()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "a connection reached the target through the tunnel: {stderr}"
    );
    agent.release(0, "node-a").await.unwrap();
}

/// From a slot's login the bus is out of reach: its port refuses the slot uid's
/// connections (the agent's nftables guard), and no credential can be read. With the
/// guard switched off the same connection goes through, so the refusal is the guard's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_login_cannot_reach_the_bus() {
    // Slots in the host's network namespace, where the uid-keyed guard is what keeps a
    // slot off the bus on 127.0.0.1 (a slot with a namespace of its own has a loopback
    // of its own; the guard on its veth is shown by
    // with_slot_netns_one_slot_cannot_reach_anothers_loopback).
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 1, &["--slot-netns", "off"]).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    let port = agent.nats.port();
    let connect = format!(
        "timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && head -c 4 <&3' && echo CONNECTED"
    );
    let (_, out, err) = key.ssh(sshd.port, &user, &connect);
    assert!(
        !out.contains("CONNECTED") && !out.contains("INFO"),
        "a slot user reached the bus: {out}{err}"
    );
    // The agent's own credential, and the launcher's, are unreadable from the slot.
    for creds in [
        agent
            .nats
            .creds(slotpool_protocol::auth::Role::Agent, agent.backing.as_str()),
        agent
            .nats
            .creds(slotpool_protocol::auth::Role::Launcher, "launcher"),
    ] {
        let (ok, out, _) = key.ssh(sshd.port, &user, &format!("cat {}", creds.display()));
        assert!(
            !ok && !out.contains("NKEY"),
            "a slot user read {}",
            creds.display()
        );
    }
    // Root (the agent) still reaches it.
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("root reaches the bus");
    agent.release(0, "node-a").await.unwrap();
    drop(agent);

    // The same login with the guard off reaches the port: what refused it was the guard.
    let env = IsolationEnv::new();
    let (sshd, key, agent) =
        login_env_with(&env, 1, &["--bus-guard", "off", "--slot-netns", "off"]).await;
    let prepared = agent
        .prepare(0, "node-b", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    let connect = connect.replace(&port.to_string(), &agent.nats.port().to_string());
    let (_, out, err) = key.ssh(sshd.port, &user, &connect);
    assert!(
        out.contains("CONNECTED"),
        "without the guard the port should answer: {out}{err}"
    );
    // Even then, what a job can send gets nowhere: it has no credential, and the bus
    // refuses anonymous logins (a read of every request, an operator's kill).
    // A copy anyone may run, as /usr/bin/slotpool would be (the build's may not be).
    let slotpool = sshd.dir.path().join("slotpool");
    std::fs::copy(slotpool_tests::bin_path("slotpool"), &slotpool).unwrap();
    set_mode(&slotpool, 0o755);
    let url = agent.nats.url();
    for attack in [
        format!("{} --nats {url} list requests", slotpool.display()),
        format!(
            "{} --nats {url} --act-as alice kill {} --yes",
            slotpool.display(),
            agent.backing
        ),
    ] {
        let (ok, out, err) = key.ssh(sshd.port, &user, &attack);
        assert!(!ok, "from a slot login `{attack}` succeeded: {out}");
        assert!(
            err.to_lowercase().contains("authorization"),
            "`{attack}` failed for another reason: {err}"
        );
    }
    agent.release(0, "node-b").await.unwrap();
}

/// The first of `file` in the slot's cgroup directories (v1 has one per hierarchy).
fn control(env: &IsolationEnv, user: &str, file: &str) -> Option<String> {
    env.cgroups()
        .paths(user)
        .iter()
        .find_map(|dir| std::fs::read_to_string(dir.join(file)).ok())
        .map(|s| s.trim().to_string())
}

/// The agent's heartbeat as it is now.
async fn heartbeat(agent: &SlotAgent) -> AgentHeartbeat {
    agent
        .bus
        .agents
        .get::<AgentHeartbeat>(agent.backing.as_str())
        .await
        .unwrap()
        .expect("a heartbeat")
        .value
}

/// A slot whose label sets no limits still gets a pids and a memory limit (the agent's
/// defaults): a fork loop from its login stops at the pids limit, while the agent and the
/// other slot go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_without_limits_gets_the_default_pids_and_memory_limits() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let key = ClientKey::new();
    let mut args = sshd.agent_args();
    args.extend([
        "--default-pids-max".into(),
        "30".into(),
        "--default-memory-max-mb".into(),
        "64".into(),
    ]);
    let agent = SlotAgent::start(&env, 2, &args).await;
    // SlotAgent::prepare sends no limits, as for a label without `limits`.
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    assert_eq!(control(&env, &user_a, "pids.max").as_deref(), Some("30"));
    let memory = control(&env, &user_a, "memory.max")
        .or_else(|| control(&env, &user_a, "memory.limit_in_bytes"));
    assert_eq!(
        memory.as_deref(),
        Some("67108864"),
        "memory limit of {user_a}"
    );
    // `tail` keeps a line without newline whole in memory: 200 MiB cannot fit in 64.
    let (_, out, err) = key.ssh(
        sshd.port,
        &user_a,
        "head -c 200M /dev/zero | tail >/dev/null; echo status=$?",
    );
    assert!(
        out.contains("status=137"),
        "a 200 MiB process under a default memory limit of 64 MiB: {out}{err}"
    );

    let (_, out, err) = key.ssh(
        sshd.port,
        &user_a,
        "timeout 20 sh -c 'for i in $(seq 1 60); do sleep 60 >/dev/null 2>&1 & done; echo tried' 2>&1",
    );
    let text = format!("{out}{err}");
    assert!(
        text.contains("fork") || text.contains("Resource temporarily unavailable"),
        "60 processes started under a default pids limit of 30: {text}"
    );
    let cgroups = env.cgroups();
    let in_a = cgroups.procs(&user_a).unwrap();
    assert!(in_a.len() <= 30, "{} processes in a's cgroup", in_a.len());

    // The agent and slot 1 are unaffected.
    let beat = heartbeat(&agent).await;
    assert!(beat.health.healthy, "{beat:?}");
    assert_eq!(
        beat.slots.iter().map(|s| s.slot).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_b,
        "for i in 1 2 3 4 5; do sleep 0.1 & done; wait; echo fine",
    );
    assert!(ok && out.trim() == "fine", "slot 1: {out}{err}");

    // The uid of this tenancy: the warm-up after the release gives the user the next one
    // (and runs a moment as it to make the slot's namespaces).
    let uid = uid_of(&user_a).expect("slot user a");
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
    assert!(procs::processes_of(Path::new("/proc"), uid).is_empty());
    assert!(cgroups.procs(&user_a).unwrap().is_empty());
}

/// A slot's cgroup is kept from one tenancy to the next: a tenancy with limits of its
/// own leaves none of them to the next, which gets the agent's defaults (as the warm slot
/// does), and one with the same limits again gets them too; the group follows each
/// tenancy's user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_cgroup_gets_each_tenancys_limits_and_group() {
    use std::os::unix::fs::MetadataExt;
    let env = IsolationEnv::new();
    let agent = SlotAgent::start(&env, 1, &["--default-pids-max".into(), "30".into()]).await;
    let user = |prepared: &slotpool_protocol::api::SlotPrepared| {
        prepared.login.username.clone().expect("a slot user")
    };
    let memory = |user: &str| {
        control(&env, user, "memory.max").or_else(|| control(&env, user, "memory.limit_in_bytes"))
    };
    let group_of = |user: &str| {
        let dirs = env.cgroups().paths(user);
        assert!(!dirs.is_empty(), "no cgroup of {user}");
        dirs.iter()
            .map(|d| std::fs::metadata(d).unwrap().gid())
            .collect::<Vec<_>>()
    };
    let own = SlotLimits {
        pids: Some(40),
        memory_bytes: Some(96 << 20),
        ..SlotLimits::default()
    };
    let mut gids = Vec::new();
    for (round, limits) in [own, SlotLimits::default(), own, own]
        .into_iter()
        .enumerate()
    {
        let node = format!("node-{round}");
        let prepared = agent
            .prepare_with(0, &node, None, limits)
            .await
            .unwrap_or_else(|err| panic!("round {round}: {err}\n{}", agent.log()));
        let user = user(&prepared);
        let want_pids = limits.pids.unwrap_or(30).to_string();
        assert_eq!(
            control(&env, &user, "pids.max").as_deref(),
            Some(want_pids.as_str()),
            "round {round}, limits {limits:?}"
        );
        let want_memory = limits.memory_bytes.map(|b| b.to_string());
        let got_memory = memory(&user);
        match &want_memory {
            Some(want) => assert_eq!(got_memory.as_ref(), Some(want), "round {round}"),
            // No limit: the largest value the kernel shows, never the last tenancy's.
            None => assert_ne!(
                got_memory,
                Some((96u64 << 20).to_string()),
                "round {round}: the last tenancy's memory limit was kept"
            ),
        }
        let gid = passwd::lookup(&user).expect("the slot user").gid;
        assert!(
            group_of(&user).iter().all(|g| *g == gid),
            "round {round}: cgroup groups {:?}, user's {gid}",
            group_of(&user)
        );
        gids.push(gid);
        agent.release(0, &node).await.unwrap();
        // The warm-up after the release gives the kept group the defaults a prepare
        // without limits applies (and then writes nothing).
        wait_for(
            format!("round {round}: the warm slot's group back to the default pids limit"),
            LONG,
            || async { control(&env, &user, "pids.max").as_deref() == Some("30") },
        )
        .await;
    }
    gids.dedup();
    assert_eq!(
        gids.len(),
        4,
        "each tenancy has a group of its own: {gids:?}"
    );
}

/// A slot's login cannot change its own cgroup: not its limits (which the agent writes
/// only when they change, trusting that nothing of a slot does), not its processes' list,
/// and it cannot make a group inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cannot_change_its_own_cgroup() {
    let env = IsolationEnv::new();
    let sshd = Sshd::start(&env).await;
    let key = ClientKey::new();
    let mut args = sshd.agent_args();
    args.extend(["--default-pids-max".into(), "77".into()]);
    let agent = SlotAgent::start(&env, 1, &args).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let dirs = env.cgroups().paths(&user);
    assert!(!dirs.is_empty(), "no cgroup of {user}");
    let mut script = String::new();
    for dir in &dirs {
        let d = dir.display();
        script.push_str(&format!(
            "for f in pids.max memory.max memory.limit_in_bytes cpu.max cpu.cfs_quota_us \
             cgroup.procs cgroup.subtree_control; do \
             [ -e {d}/$f ] && echo SEEN && (echo 1 > {d}/$f) 2>/dev/null && echo WROTE {d}/$f; \
             done; \
             mkdir {d}/child 2>/dev/null && echo MADE {d}/child; "
        ));
    }
    script.push_str("echo done");
    let (_, out, err) = key.ssh(sshd.port, &user, &script);
    assert!(out.contains("done"), "the login ran: {out}{err}");
    // The groups' files were there to try: cgroup.procs in every hierarchy, and limits.
    assert!(
        out.matches("SEEN").count() > dirs.len(),
        "the login saw too few of its groups' files: {out}{err}"
    );
    assert!(
        !out.contains("WROTE") && !out.contains("MADE"),
        "a slot changed its own cgroup: {out}{err}"
    );
    assert_eq!(control(&env, &user, "pids.max").as_deref(), Some("77"));
    agent.release(0, "node-a").await.unwrap();
}

/// A group of this test's own in the host's cgroup2 hierarchy, driven by the agent's v2
/// driver, and the processes the test started in it; on drop (a failed test too) the
/// group is killed through `cgroup.kill` and removed with its parent.
struct V2Group {
    /// What the agent builds for a v2 layout.
    driver: Box<dyn slotpool_agent::isolation::cgroup::CgroupDriver>,
    /// The same group through the concrete v2 driver, to pick the kill method.
    v2: slotpool_agent::isolation::cgroup::CgroupV2,
    parent: PathBuf,
    name: String,
    children: Vec<std::process::Child>,
}

impl V2Group {
    /// Creates `<cgroup2 mount>/slotpool-v2test-<unique>/slot`, found from
    /// `/proc/self/mountinfo` as `cgroup::detect` finds mounts. Panics when there is no
    /// cgroup2 mount: the test never skips.
    fn new() -> V2Group {
        use slotpool_agent::isolation::cgroup::{self, CgroupLayout};
        slotpool_tests::require_root();
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount = cgroup::parse_mountinfo(&text)
            .into_iter()
            .find(|m| m.fs_type == "cgroup2")
            .expect("a cgroup2 mount")
            .mount_point;
        let unique = format!(
            "slotpool-v2test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let parent = mount.join(&unique);
        let name = "slot".to_string();
        // `create` also enables and writes controllers, which this hierarchy may not
        // have; kill and remove need none, so the group is made by hand.
        std::fs::create_dir_all(parent.join(&name)).unwrap();
        V2Group {
            driver: cgroup::driver(
                &CgroupLayout::V2 {
                    mount: mount.clone(),
                },
                &unique,
            ),
            v2: cgroup::CgroupV2 {
                mount,
                parent: unique.clone(),
            },
            parent,
            name,
            children: Vec::new(),
        }
    }

    fn dir(&self) -> PathBuf {
        self.parent.join(&self.name)
    }
}

impl Drop for V2Group {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir().join("cgroup.kill"), "1");
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(self.dir())
            .is_err_and(|e| e.kind() != std::io::ErrorKind::NotFound)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir(&self.parent);
    }
}

/// The v2 kill path, for real: a `sleep` and a double-forked `setsid` daemon in a group of
/// the host's cgroup2 hierarchy are killed by the driver's `kill_all` (`cgroup.kill` on
/// this kernel), and the group is removed.
#[test]
fn the_v2_driver_kills_everything_in_a_real_cgroup2_group() {
    kill_in_a_real_v2_group(None);
}

/// The same with the freezer, the v2 path of kernels without `cgroup.kill`.
#[test]
fn the_v2_driver_kills_everything_in_a_real_cgroup2_group_by_freezing() {
    kill_in_a_real_v2_group(Some(slotpool_agent::isolation::cgroup::V2Kill::Freeze));
}

/// Starts the processes in a [`V2Group`], kills them with the driver's `kill_all` (or
/// `how`), checks none is left and removes the group.
fn kill_in_a_real_v2_group(how: Option<slotpool_agent::isolation::cgroup::V2Kill>) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut group = V2Group::new();
    let pidfile = tempfile::NamedTempFile::new().unwrap();
    let sleeper = Command::new("sleep").arg("1000").spawn().unwrap();
    group.driver.add(&group.name, sleeper.id() as i32).unwrap();
    // A shell placed in the group first, then told to start a daemon: setsid, fork,
    // and the middle process exits, so the daemon is nobody's child here.
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "read go; setsid sh -c 'sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > {}'; exec sleep 1000",
            pidfile.path().display()
        ))
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let shell_pid = shell.id() as i32;
    let mut go = shell.stdin.take().unwrap();
    group.children.extend([sleeper, shell]);
    group.driver.add(&group.name, shell_pid).unwrap();
    writeln!(go, "go").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let daemon: i32 = loop {
        if let Ok(pid) = std::fs::read_to_string(pidfile.path())
            .unwrap()
            .trim()
            .parse()
        {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let pids = [group.children[0].id() as i32, shell_pid, daemon];
    let inside = group.driver.procs(&group.name).unwrap();
    for pid in pids {
        assert!(alive(pid), "{pid} not running");
        assert!(inside.contains(&pid), "{pid} not in the group: {inside:?}");
    }

    match how {
        None => group.driver.kill_all(&group.name).unwrap(),
        Some(how) => group.v2.kill_all_by(&group.name, how).unwrap(),
    }
    for child in &mut group.children {
        child.wait().unwrap();
    }
    for pid in pids {
        assert!(!alive(pid), "{pid} survived the kill");
    }
    group.driver.remove(&group.name).unwrap();
    assert!(!group.dir().exists(), "the group is still there");
}

/// A restarted agent releases, by itself, a prepared slot whose node is gone from the
/// slots bucket (the launcher released it while the agent was down), and keeps the slot
/// whose node is still there. Its credential reads its own slot keys, no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_releases_the_slots_whose_node_is_gone() {
    let env = IsolationEnv::new();
    let mut agent = SlotAgent::start(&env, 2, &[]).await;
    let gone = agent.claim(0, "node-gone").await;
    agent.claim(1, "node-kept").await;
    let (user_0, ws_0) = login_of(&agent.prepare(0, "node-gone", None).await.unwrap());
    let (_, ws_1) = login_of(&agent.prepare(1, "node-kept", None).await.unwrap());
    std::fs::write(ws_0.join("job-output"), "left by the job").unwrap();
    std::fs::write(ws_1.join("job-output"), "still in use").unwrap();
    let uid_0 = uid_of(&user_0).unwrap();

    // The launcher releases node-gone while the agent is down: it deletes the key.
    let key_0 = slotpool_protocol::layout::slot_key(&agent.backing, 0);
    agent.bus.slots.delete(&key_0, gone).await.unwrap();
    agent.restart().await;

    let beat = heartbeat(&agent).await;
    assert_eq!(
        beat.slots.iter().map(|s| s.slot).collect::<Vec<_>>(),
        vec![1],
        "slot 0 still prepared after restart:\n{}",
        agent.log()
    );
    assert!(agent.dirty(0).is_none(), "{:?}", agent.dirty(0));
    wait_for("slot 0 to be warm again", LONG, || async { agent.warm(0) }).await;
    assert!(wiped(&ws_0), "slot 0's workspace was not wiped");
    let new_uid = uid_of(&user_0).expect("slot 0's user made anew");
    assert_ne!(new_uid, uid_0, "slot 0 was not released");
    assert_eq!(
        std::fs::read_to_string(ws_1.join("job-output")).unwrap(),
        "still in use"
    );
    assert!(!agent.warm(1), "slot 1 is no longer prepared");

    // The agent's credential reads its own slot keys, and no other backing node's.
    let as_agent = slotpool_protocol::connect::Bus::connect(
        &agent
            .nats
            .options_as(slotpool_protocol::auth::Role::Agent, agent.backing.as_str()),
    )
    .await
    .unwrap();
    let own = slotpool_protocol::layout::slot_key(&agent.backing, 1);
    let read = as_agent.slots.get::<Node>(&own).await.unwrap().unwrap();
    assert_eq!(read.value.id.as_str(), "node-kept");
    let other = slotpool_protocol::BackingId::parse("bn-other").unwrap();
    agent
        .bus
        .slots
        .create(
            &slotpool_protocol::layout::slot_key(&other, 0),
            &read.value,
            None,
        )
        .await
        .unwrap();
    let denied = as_agent
        .slots
        .get::<Node>(&slotpool_protocol::layout::slot_key(&other, 0))
        .await;
    assert!(
        denied.is_err(),
        "the agent read another backing node's key: {denied:?}"
    );

    agent.release(1, "node-kept").await.unwrap();
}

/// Two agents on one host, given the same `--slot-netns-range` (as every agent is given
/// the default), number their slots from blocks of their own: no two slots have the same
/// address.
#[tokio::test(flavor = "multi_thread")]
async fn agents_sharing_a_range_give_their_slots_different_addresses() {
    let range = netns_range();
    let mut seen = Vec::new();
    let mut keep = Vec::new();
    for node in ["node-a", "node-b"] {
        let env = IsolationEnv::new();
        let (sshd, key, agent) = login_env_with(&env, 2, &["--slot-netns-range", &range]).await;
        for slot in 0..2 {
            let (user, _) = agent
                .prepare_login(slot, &format!("{node}-{slot}"), &key.public())
                .await;
            let (ok, out, err) = key.ssh(sshd.port, &user, "ip -4 -o addr show dev eth0");
            assert!(ok, "login: {err}\n{}", agent.log());
            let addr = out
                .split_whitespace()
                .skip_while(|w| *w != "inet")
                .nth(1)
                .unwrap_or_default()
                .to_string();
            eprintln!("{node} slot {slot}: {addr}");
            assert!(
                !seen.contains(&addr),
                "two slots have {addr} (range {range}):\n{}",
                agent.log()
            );
            seen.push(addr);
        }
        keep.push((env, sshd, key, agent));
    }
}

/// A host whose resolv.conf names only a resolver on loopback (systemd-resolved's stub)
/// gives its slots, whose network namespaces cannot reach it, the upstream servers
/// instead, in a resolv.conf of their own.
#[tokio::test(flavor = "multi_thread")]
async fn with_slot_netns_a_loopback_resolver_gives_slots_the_upstream_servers() {
    let env = IsolationEnv::new();
    let files = tempfile::tempdir().unwrap();
    let host = files.path().join("resolv.conf");
    let upstream = files.path().join("upstream-resolv.conf");
    std::fs::write(&host, "nameserver 127.0.0.53\noptions edns0 trust-ad\n").unwrap();
    std::fs::write(
        &upstream,
        "nameserver 192.0.2.53\nnameserver ::1\nsearch slotpool.test\n",
    )
    .unwrap();
    let (sshd, key, agent) = login_env_with(
        &env,
        1,
        &[
            "--slot-netns-range",
            &netns_range(),
            "--resolv-conf",
            host.to_str().unwrap(),
            "--upstream-resolv-conf",
            upstream.to_str().unwrap(),
        ],
    )
    .await;
    let (user, _) = agent.prepare_login(0, "node-dns", &key.public()).await;
    let (ok, out, err) = key.ssh(sshd.port, &user, "cat /etc/resolv.conf");
    eprintln!("a slot's /etc/resolv.conf:\n{out}");
    assert!(ok, "login: {err}\n{}", agent.log());
    let servers: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("nameserver"))
        .collect();
    assert_eq!(servers, ["nameserver 192.0.2.53"], "{out}\n{}", agent.log());
    assert!(out.contains("search slotpool.test"), "{out}");
    // The host's own file is untouched.
    let host_file = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    assert!(!host_file.contains("192.0.2.53"), "{host_file}");
}

/// A login environment whose agent gives each of its `slots` a network namespace, in a
/// range of its own (returned, for checks of the slots' addresses).
async fn netns_env(env: &IsolationEnv, slots: u32) -> (Sshd, ClientKey, SlotAgent, String) {
    let range = netns_range();
    let (sshd, key, agent) = login_env_with(
        env,
        slots,
        &["--slot-netns", "on", "--slot-netns-range", &range],
    )
    .await;
    (sshd, key, agent, range)
}

/// A /24 of 10.0.0.0/8 picked at random: one test's `--slot-netns-range`.
fn netns_range() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    format!(
        "10.{}.{}.0/24",
        rng.random_range(100..250u8),
        rng.random_range(0..=255u8)
    )
}

/// The host's first global IPv4 address (not loopback).
fn host_address() -> std::net::Ipv4Addr {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("running ip");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next()?.parse().ok())
        .expect("the host has a global IPv4 address")
}

/// What the agent of `namespace` in `env` may have left of slot network namespaces: its
/// veths (`ip -o link`), its slots' table (`nft list tables`) and namespace mounts.
fn network_leftovers(env: &IsolationEnv, namespace: &str) -> Vec<String> {
    let veth = slotpool_agent::isolation::netns::veth_name(namespace, 0);
    let veth_prefix = &veth[..veth.len() - 1];
    let run = |cmd: &[&str]| {
        let out = std::process::Command::new(cmd[0])
            .args(&cmd[1..])
            .output()
            .expect("running ip/nft");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut left: Vec<String> = run(&["ip", "-o", "link"])
        .lines()
        .filter(|l| l.contains(veth_prefix))
        .chain(
            run(&["nft", "list", "tables"])
                .lines()
                .filter(|l| l.contains(&format!("slotpool_{namespace}_slotnet"))),
        )
        .map(str::to_string)
        .collect();
    let dir = env.run_dir.path().join("netns").join(namespace);
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        left.push(entry.path().display().to_string());
    }
    left
}

/// Slot `a` listens on 127.0.0.1:`port`; returns what slot `b` connecting there prints
/// (`CONNECTED` or `NOT-CONNECTED`, with bash's error).
fn loopback_probe(key: &ClientKey, ssh_port: u16, a: &str, b: &str, port: u16) -> String {
    let listen = format!(
        "setsid python3 -c 'import socket, time; s = socket.socket(); \
         s.bind((\"127.0.0.1\", {port})); s.listen(); time.sleep(300)' \
         </dev/null >/dev/null 2>&1 & \
         for i in $(seq 100); do \
         (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo LISTENING && exit 0; \
         sleep 0.1; done; echo NOT-LISTENING"
    );
    let (_, out, err) = key.ssh(ssh_port, a, &listen);
    assert!(
        out.contains("LISTENING") && !out.contains("NOT-"),
        "slot a's listener: {out}{err}"
    );
    let (out, err) = connect_from(key, ssh_port, b, "127.0.0.1", port);
    format!("{}{}", out.trim(), err.trim())
}

/// What `user`'s login prints connecting to `host:port`: `CONNECTED`, or bash's error
/// and `NOT-CONNECTED` (stdout, stderr).
fn connect_from(
    key: &ClientKey,
    ssh_port: u16,
    user: &str,
    host: &str,
    port: u16,
) -> (String, String) {
    let (_, out, err) = key.ssh(
        ssh_port,
        user,
        &format!(
            "timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>&1 \
             && echo CONNECTED || echo NOT-CONNECTED"
        ),
    );
    (out, err)
}

/// A port free on the host's loopback now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for one connection on `listener` and reads what it sends; `None` if none came.
fn accept_within(listener: &std::net::TcpListener, within: Duration) -> Option<String> {
    use std::io::Read;
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + within;
    loop {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let mut text = String::new();
                let _ = stream.read_to_string(&mut text);
                return Some(format!("{peer}: {}", text.trim()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() >= deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// With `--slot-netns on` a slot's loopback is its own: slot b cannot reach what slot a
/// serves on 127.0.0.1. The login still lands in the slot's cgroup, as the slot's uid; the
/// slot reaches the host's address through its veth but not the bus port there; release
/// leaves no veth or namespace mount of the tenancy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_slot_netns_one_slot_cannot_reach_anothers_loopback() {
    let env = IsolationEnv::new();
    let (sshd, key, agent, range) = netns_env(&env, 2).await;
    let namespace = passwd::namespace(&env.user_prefix, agent.backing.as_str());
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;

    let port = free_port();
    let probe = loopback_probe(&key, sshd.port, &user_a, &user_b, port);
    eprintln!("slot b to slot a's 127.0.0.1:{port} with --slot-netns on: {probe}");
    assert!(
        probe.contains("NOT-CONNECTED"),
        "slot b reached slot a's loopback: {probe}\n{}",
        agent.log()
    );

    // The login is the slot's uid, in the slot's cgroup, in a network namespace that is
    // not the host's, with the slot's address.
    let host_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    let (ok, out, err) = key.ssh(
        sshd.port,
        &user_a,
        "id -u; readlink /proc/self/ns/net; cat /proc/self/cgroup; ip -4 -o addr show dev eth0",
    );
    assert!(ok, "login: {err}\n{}", agent.log());
    let uid = uid_of(&user_a).unwrap();
    assert_eq!(out.lines().next(), Some(uid.to_string().as_str()), "{out}");
    assert_ne!(
        out.lines().nth(1),
        Some(host_net.to_str().unwrap()),
        "{out}"
    );
    assert!(
        out.lines().any(|l| l.ends_with(&format!("/{user_a}"))),
        "the login is not in the slot's cgroup: {out}"
    );
    let range_prefix = range.trim_end_matches("0/24");
    assert!(out.contains(&format!("inet {range_prefix}2/30")), "{out}");

    // Out through the host: a listener on the host's own address answers.
    let host = host_address();
    let listener = std::net::TcpListener::bind((host, 0)).unwrap();
    let egress_port = listener.local_addr().unwrap().port();
    let (_, out, err) = key.ssh(
        sshd.port,
        &user_a,
        &format!(
            "timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{egress_port} && echo from-slot >&3' \
             && echo SENT"
        ),
    );
    let got = accept_within(&listener, Duration::from_secs(10));
    eprintln!("egress to {host}:{egress_port}: {out}{err} -> {got:?}");
    assert!(out.contains("SENT"), "{out}{err}");
    assert!(
        got.as_deref().is_some_and(|g| g.ends_with("from-slot")),
        "{got:?}"
    );

    // The bus port stays closed on the host's address too (traffic from the namespace
    // does not pass the host's output hook, where the uid guard is): a listener there on
    // the bus's port number is not reached.
    let bus_port = agent.nats.port();
    let bus_listener = std::net::TcpListener::bind((host, bus_port)).unwrap();
    let (out, err) = connect_from(&key, sshd.port, &user_a, &host.to_string(), bus_port);
    eprintln!("slot to {host}:{bus_port} (the bus port): {out}{err}");
    assert!(out.contains("NOT-CONNECTED"), "{out}{err}");
    assert_eq!(
        accept_within(&bus_listener, Duration::from_millis(200)),
        None
    );

    // Release keeps the slot's namespace and veth for its next tenancy, with nothing of
    // the last one in it: slot a's listener went with its processes. One veth per slot,
    // never more, and the agent's one table of its slots.
    let veth_index = |slot: u32| {
        let veth = slotpool_agent::isolation::netns::veth_name(&namespace, slot);
        std::fs::read_to_string(format!("/sys/class/net/{veth}/ifindex"))
    };
    let before = veth_index(0).unwrap();
    let login_net = |user: &str| {
        let (ok, out, err) = key.ssh(sshd.port, user, "readlink /proc/self/ns/net");
        assert!(ok, "login: {err}\n{}", agent.log());
        out.trim().to_string()
    };
    let net_before = login_net(&user_a);
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
    assert_eq!(agent.dirty(1), None, "{}", agent.log());
    wait_for("slot 0 warm again", LONG, || async { agent.warm(0) }).await;
    wait_for("slot 1 warm again", LONG, || async { agent.warm(1) }).await;
    assert_eq!(veth_index(0).unwrap(), before, "slot 0 got a new veth");
    let (user_c, _) = agent.prepare_login(0, "node-c", &key.public()).await;
    assert_ne!(
        uid_of(&user_c),
        Some(uid),
        "the next tenancy has the uid just freed"
    );
    assert_eq!(login_net(&user_c), net_before, "slot 0 got a new namespace");
    let (out, err) = connect_from(&key, sshd.port, &user_c, "127.0.0.1", port);
    assert!(
        out.contains("NOT-CONNECTED"),
        "the last tenancy's listener is still there: {out}{err}"
    );
    agent.release(0, "node-c").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
    wait_for("slot 0 warm again", LONG, || async { agent.warm(0) }).await;
    let left = network_leftovers(&env, &namespace);
    assert_eq!(
        left.iter().filter(|l| l.contains("link")).count()
            + left.iter().filter(|l| l.contains("table")).count(),
        3,
        "{left:?}"
    );
    let run_dir = env.run_dir.path().to_path_buf();
    drop(agent);
    drop(env);
    // Nothing of the test is left on the host (the kernel deletes a namespace's veth
    // pair shortly after its last reference goes).
    wait_for("no veth or table of the test", LONG, || async {
        let veth = slotpool_agent::isolation::netns::veth_name(&namespace, 0);
        let links = std::process::Command::new("ip")
            .args(["-o", "link"])
            .output()
            .unwrap();
        let tables = std::process::Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap();
        !String::from_utf8_lossy(&links.stdout).contains(&veth[..veth.len() - 1])
            && !String::from_utf8_lossy(&tables.stdout).contains(&namespace)
    })
    .await;
    assert!(!run_dir.exists());
}

/// The same probe with `--slot-netns off` (the default): slots share the host's
/// network namespace, so slot b reaches what slot a serves on 127.0.0.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_slot_netns_one_slot_reaches_anothers_loopback() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 2, &["--slot-netns", "off"]).await;
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let port = free_port();
    let probe = loopback_probe(&key, sshd.port, &user_a, &user_b, port);
    eprintln!("slot b to slot a's 127.0.0.1:{port} with --slot-netns off: {probe}");
    assert!(
        probe.contains("CONNECTED") && !probe.contains("NOT-"),
        "{probe}"
    );
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
}

/// Slot `a` listens on 127.0.0.1:`port` and on an abstract Unix socket; returns what
/// slot `b` learns of them: whether its `/proc/net/tcp` and `/proc/net/unix` list them
/// (`TCP-LISTED`, `UNIX-LISTED`, else `…-HIDDEN`) and whether it connects to the
/// abstract socket (`ABSTRACT-CONNECTED`, else Python's error).
fn neighbour_sockets(key: &ClientKey, ssh_port: u16, a: &str, b: &str, port: u16) -> String {
    let name = format!("slotpool-probe-{port}");
    let listen = format!(
        "setsid python3 -c 'import socket, time\n\
         t = socket.socket(); t.bind((\"127.0.0.1\", {port})); t.listen()\n\
         u = socket.socket(socket.AF_UNIX); u.bind(\"\\0{name}\"); u.listen()\n\
         time.sleep(300)' </dev/null >/dev/null 2>&1 & \
         for i in $(seq 100); do \
         grep -q @{name} /proc/net/unix && echo LISTENING && exit 0; \
         sleep 0.1; done; echo NOT-LISTENING"
    );
    let (_, out, err) = key.ssh(ssh_port, a, &listen);
    assert!(
        out.contains("LISTENING") && !out.contains("NOT-"),
        "slot a's listeners: {out}{err}"
    );
    let probe = format!(
        "grep -q 0100007F:{port:04X} /proc/net/tcp && echo TCP-LISTED || echo TCP-HIDDEN; \
         grep -q @{name} /proc/net/unix && echo UNIX-LISTED || echo UNIX-HIDDEN; \
         python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); \
         s.connect(\"\\0{name}\"); print(\"ABSTRACT-CONNECTED\")' 2>&1 | tail -n 1"
    );
    let (_, out, err) = key.ssh(ssh_port, b, &probe);
    format!("{}{}", out.trim(), err.trim())
}

/// With `--slot-netns on` a slot sees nothing of its neighbour's sockets: not its
/// loopback listener in `/proc/net/tcp`, not its abstract Unix socket in
/// `/proc/net/unix`, and it cannot connect to that socket (abstract names are kept per
/// network namespace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_slot_netns_a_slot_sees_no_neighbours_sockets() {
    let env = IsolationEnv::new();
    let (sshd, key, agent, _) = netns_env(&env, 2).await;
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let port = free_port();
    let seen = neighbour_sockets(&key, sshd.port, &user_a, &user_b, port);
    eprintln!("slot b on slot a's sockets (port {port}) with --slot-netns on:\n{seen}");
    for hidden in ["TCP-HIDDEN", "UNIX-HIDDEN", "ConnectionRefusedError"] {
        assert!(seen.contains(hidden), "{hidden}: {seen}\n{}", agent.log());
    }
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
}

/// The same probe with `--slot-netns off` (the default): slot b lists slot a's
/// listener and abstract socket and connects to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_slot_netns_a_slot_sees_its_neighbours_sockets() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 2, &["--slot-netns", "off"]).await;
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let port = free_port();
    let seen = neighbour_sockets(&key, sshd.port, &user_a, &user_b, port);
    eprintln!("slot b on slot a's sockets (port {port}) with --slot-netns off:\n{seen}");
    for shown in ["TCP-LISTED", "UNIX-LISTED", "ABSTRACT-CONNECTED"] {
        assert!(seen.contains(shown), "{shown}: {seen}");
    }
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
}

/// A network namespace standing for the world beyond the host: a holder process in a
/// fresh network namespace, joined to the host by a veth pair with `host`/`outside` as
/// addresses. Killing the holder deletes the namespace and the pair with it.
struct Outside {
    holder: std::process::Child,
    veth: String,
    outside: std::net::Ipv4Addr,
}

impl Outside {
    fn new() -> Outside {
        use rand::Rng;
        let mut rng = rand::rng();
        let (b, c) = (rng.random_range(0..=255u8), rng.random_range(0..64u8) * 4);
        let host = format!("172.29.{b}.{}", c + 1);
        let outside: std::net::Ipv4Addr = format!("172.29.{b}.{}", c + 2).parse().unwrap();
        let veth = format!("spto{}", rng.random_range(0..1_000_000u32));
        let holder = std::process::Command::new("unshare")
            .args(["--net", "sleep", "600"])
            .spawn()
            .expect("unshare");
        let me = Outside {
            holder,
            veth,
            outside,
        };
        let pid = me.holder.id().to_string();
        let ns = format!("/proc/{pid}/ns/net");
        let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
        let runs = |args: &[&str]| {
            std::process::Command::new(args[0])
                .args(&args[1..])
                .status()
                .is_ok_and(|s| s.success())
        };
        // The holder has unshared once its namespace differs from ours.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(&ns).ok().as_ref() == Some(&host_ns) {
            assert!(
                std::time::Instant::now() < deadline,
                "unshare did not happen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let v = me.veth.clone();
        let in_ns = format!("--net={ns}");
        for step in [
            vec![
                "ip", "link", "add", &v, "type", "veth", "peer", "name", "eth0", "netns", &pid,
            ],
            vec!["ip", "addr", "add", &format!("{host}/30"), "dev", &v],
            vec!["ip", "link", "set", &v, "up"],
            vec!["nsenter", &in_ns, "ip", "link", "set", "lo", "up"],
            vec![
                "nsenter",
                &in_ns,
                "ip",
                "addr",
                "add",
                &format!("{outside}/30"),
                "dev",
                "eth0",
            ],
            vec!["nsenter", &in_ns, "ip", "link", "set", "eth0", "up"],
        ] {
            assert!(runs(&step), "{step:?} failed");
        }
        me
    }

    /// Runs a one-connection listener on `port` in the outside namespace; it prints the
    /// peer and what it read.
    fn listen(&self, port: u16) -> std::process::Child {
        let script = format!(
            "import socket; s = socket.socket(); \
             s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); \
             s.bind(('{}', {port})); s.listen(); print('listening', flush=True); \
             s.settimeout(20); c, peer = s.accept(); c.settimeout(5); \
             print(peer[0], c.recv(100).decode().strip(), flush=True)",
            self.outside
        );
        std::process::Command::new("nsenter")
            .arg(format!("--net=/proc/{}/ns/net", self.holder.id()))
            .args(["python3", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("listener")
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.veth])
            .status();
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// With `--slot-netns on` a slot reaches beyond the host: a connection to an address
/// only the host routes to is forwarded and masqueraded (the far end sees the host's
/// address, not the slot's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_slot_netns_a_slot_reaches_beyond_the_host_masqueraded() {
    use std::io::{BufRead, BufReader};
    let env = IsolationEnv::new();
    let (sshd, key, agent, _) = netns_env(&env, 1).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    let outside = Outside::new();
    let port = free_port();
    let mut listener = outside.listen(port);
    let mut lines = BufReader::new(listener.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "listening");
    let (_, out, err) = key.ssh(
        sshd.port,
        &user,
        &format!(
            "timeout 5 bash -c 'exec 3<>/dev/tcp/{}/{port} && echo from-slot >&3' && echo SENT",
            outside.outside
        ),
    );
    let seen = lines.next().and_then(Result::ok).unwrap_or_default();
    let _ = listener.kill();
    let _ = listener.wait();
    eprintln!(
        "slot to {}:{port}: {out}{err} -> far end saw: {seen}",
        outside.outside
    );
    assert!(out.contains("SENT"), "{out}{err}\n{}", agent.log());
    let host_end = outside.outside.octets();
    let expected = format!(
        "{}.{}.{}.{} from-slot",
        host_end[0],
        host_end[1],
        host_end[2],
        host_end[3] - 1
    );
    assert_eq!(seen, expected, "not masqueraded to the host's address");
    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
}

/// A slot's network is made once and kept: a second warm-up finds the same namespace
/// and veth and makes nothing; a removal deletes the veth and the namespace's file. A
/// namespace of the older kind (beside a user namespace file) is made anew.
#[test]
fn a_slots_network_is_kept_for_its_next_tenancy_and_goes_with_the_slot() {
    let slot = slotpool_tests::SlotNetworksForTest::new();
    let nets = &slot.nets;
    let sys = Path::new("/sys/class/net");
    let ifindex = |name: &str| std::fs::read_to_string(sys.join(name).join("ifindex")).ok();
    let ns_of = |file: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(file).map(|m| m.ino()).ok()
    };
    nets.create(0).unwrap();
    let n = nets.names(0).unwrap();
    let first = ifindex(&n.veth).expect("the veth is there");
    let first_ns = ns_of(&n.net_ns).expect("the namespace is bound");
    nets.create(0).unwrap();
    assert_eq!(
        ifindex(&n.veth),
        Some(first.clone()),
        "a new veth for a kept slot"
    );
    assert_eq!(
        ns_of(&n.net_ns),
        Some(first_ns),
        "a new namespace for a kept slot"
    );

    // An older agent's namespace had a user namespace beside it: made anew.
    std::fs::write(&n.user_ns, "").unwrap();
    nets.create(0).unwrap();
    assert_ne!(
        ifindex(&n.veth),
        Some(first),
        "the older namespace was kept"
    );
    assert!(!n.user_ns.exists(), "the older user namespace file is left");

    assert_eq!(nets.remove(0), Vec::<String>::new());
    assert_eq!(ifindex(&n.veth), None, "a removal leaves the veth");
    assert_eq!(nets.leftovers(0), Vec::<String>::new());
}

/// A warm-up's network (made over route-netlink) is what the `ip` commands it replaced
/// made: inside, `lo` and `eth0` up, the slot's /30 on `eth0`, the default route via the
/// host's end; on the host, the veth up with the host's address.
#[test]
fn a_slots_network_is_what_ip_shows_for_it() {
    let slot = slotpool_tests::SlotNetworksForTest::new();
    let nets = &slot.nets;
    nets.create(0).unwrap();
    let n = nets.names(0).unwrap();
    let ip = |netns: Option<&Path>, args: &str| {
        let mut cmd = match netns {
            Some(file) => {
                let mut c = std::process::Command::new("nsenter");
                c.arg(format!("--net={}", file.display())).arg("ip");
                c
            }
            None => std::process::Command::new("ip"),
        };
        let out = cmd.args(args.split(' ')).output().unwrap();
        assert!(out.status.success(), "ip {args}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let inside = Some(n.net_ns.as_path());
    let links = ip(inside, "-o link show up");
    assert!(links.contains(" lo: "), "{links}");
    assert!(links.contains(" eth0@"), "{links}");
    let addrs = ip(inside, "-o -4 addr show");
    assert!(addrs.contains("lo    inet 127.0.0.1/8"), "{addrs}");
    assert!(
        addrs.contains(&format!(
            "eth0    inet {}/30 scope global eth0",
            n.slot_addr
        )),
        "{addrs}"
    );
    let routes = ip(inside, "-4 route show");
    let default = format!("default via {} dev eth0", n.host_addr);
    assert!(routes.lines().any(|l| l.trim() == default), "{routes}");
    let host = ip(None, &format!("-o -4 addr show dev {}", n.veth));
    assert!(
        host.contains(&format!("inet {}/30 scope global {}", n.host_addr, n.veth)),
        "{host}"
    );
    let up = ip(None, &format!("-o link show dev {} up", n.veth));
    assert!(up.contains(&n.veth), "the host's end is not up: {up}");
    assert_eq!(nets.remove(0), Vec::<String>::new());
}

/// A release that cannot take a slot's namespaces away leaves the slot dirty, with the
/// reason. (The test stacks a second mount on the slot's `.mnt` file: the agent's
/// unmount takes the top one, and the slot's mount namespace is still bound beneath.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_namespaces_cannot_be_released_is_left_dirty() {
    let env = IsolationEnv::new();
    let (_sshd, key, agent) = login_env(&env, 1).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let mnt = env
        .run_dir
        .path()
        .join("mntns")
        .join(namespace(&env, &user))
        .join("0.mnt");
    rustix::mount::mount_bind("/proc/self/ns/net", &mnt).expect("stacking a mount");
    let err = agent.release(0, "node-a").await.unwrap_err().to_string();
    let dirty = agent.dirty(0).unwrap_or_default();
    eprintln!("release: {err}\ndirty marker: {dirty}");
    assert!(
        dirty.contains(&format!("namespace mount {}", mnt.display())),
        "{err}\n{dirty}"
    );
    let _ = rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::DETACH);
}

/// A slot whose namespace file no longer names the namespace the agent made for it (here
/// the host's is stacked on it) is not kept: the next tenancy gets a namespace made
/// anew, and no login lands in the host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_namespace_file_was_replaced_gets_a_new_one() {
    let env = IsolationEnv::new();
    let (sshd, key, agent, _) = netns_env(&env, 1).await;
    agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let namespace = passwd::namespace(&env.user_prefix, agent.backing.as_str());
    let net = env.run_dir.path().join(format!("netns/{namespace}/0.net"));
    rustix::mount::mount_bind("/proc/self/ns/net", &net).expect("stacking a mount");
    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
    let (user, _) = agent.prepare_login(0, "node-b", &key.public()).await;
    let (ok, out, err) = key.ssh(sshd.port, &user, "readlink /proc/self/ns/net");
    assert!(ok, "login: {err}\n{}", agent.log());
    let host_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    assert_ne!(out.trim(), host_net.to_str().unwrap(), "{}", agent.log());
    assert!(out.trim().starts_with("net:["), "{out}");
    agent.release(0, "node-b").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
}

/// A restarted agent keeps its slots' namespaces (the mounts outlive it): a login of a
/// slot prepared before the restart still lands in the slot's namespace, and a warm slot
/// stays warm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_netns_survive_an_agent_restart() {
    let env = IsolationEnv::new();
    let (sshd, key, mut agent, _) = netns_env(&env, 2).await;
    let prepared = agent
        .prepare(0, "node-a", Some(&key.public()))
        .await
        .unwrap();
    let (user, _) = login_of(&prepared);
    let login_ns = || {
        let (ok, out, err) = key.ssh(sshd.port, &user, "readlink /proc/self/ns/net");
        assert!(ok, "login: {err}\n{}", sshd.log());
        out.trim().to_string()
    };
    let before = login_ns();
    let host_net = std::fs::read_link("/proc/self/ns/net").unwrap();
    assert_ne!(before, host_net.to_str().unwrap());
    wait_for("slot 1 warm", LONG, || async { agent.warm(1) }).await;
    // The slots bucket holds the node, so the restarted agent keeps the slot prepared.
    agent.claim(0, "node-a").await;
    agent.restart().await;
    assert_eq!(login_ns(), before, "{}", agent.log());
    assert!(agent.warm(1), "{}", agent.log());
    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
}

/// At release a slot's processes get SIGTERM and `--slot-term-grace-ms` to exit before
/// they are killed: one that traps TERM records it, one that ignores TERM is gone anyway,
/// and the slot is proven clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_sends_sigterm_before_it_kills_a_slots_processes() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 1, &["--slot-term-grace-ms", "1000"]).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let uid = uid_of(&user).unwrap();
    // Root's file the slot user may write to: what the user owns goes at release. Not in
    // /tmp: the slot has a /tmp of its own, where the test would not see its writes.
    let marks = slotpool_tests::slot_visible_tempdir("slotpool-marks-");
    set_mode(marks.path(), 0o755);
    let mark = marks.path().join("term");
    std::fs::write(&mark, "").unwrap();
    set_mode(&mark, 0o666);
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user,
        &format!(
            concat!(
                "setsid sh -c 'trap \"echo got-term >> {mark}; exit 0\" TERM; echo trapping >> {mark}; ",
                "while :; do sleep 0.05; done' </dev/null >/dev/null 2>&1 & ",
                "setsid sh -c 'trap \"\" TERM; echo ignoring >> {mark}; while :; do sleep 0.05; done' ",
                "</dev/null >/dev/null 2>&1 & echo started"
            ),
            mark = mark.display()
        ),
    );
    assert!(ok, "{err}\n{}", sshd.log());
    let said = |what: &str| {
        std::fs::read_to_string(&mark)
            .unwrap()
            .lines()
            .any(|l| l == what)
    };
    wait_for("both slot processes to set their traps", LONG, || async {
        said("trapping") && said("ignoring")
    })
    .await;

    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "the release proved the slot clean");
    assert!(
        said("got-term"),
        "the trapping process was sent SIGTERM before it was killed: {:?}",
        std::fs::read_to_string(&mark).unwrap()
    );
    assert!(
        procs::processes_of(Path::new("/proc"), uid).is_empty(),
        "the process that ignores SIGTERM outlived the release"
    );
}

/// The v2 SIGTERM wait, for real: a group whose process exits on SIGTERM is empty long
/// before the grace (the wait sleeps on `cgroup.events`, it does not sleep the grace);
/// one that ignores SIGTERM is still populated after it, and the kill gets it.
#[test]
fn the_v2_driver_waits_for_a_group_to_empty_after_sigterm() {
    use std::process::Command;
    let mut group = V2Group::new();
    let trapper = Command::new("sh")
        .args(["-c", "trap 'exit 0' TERM; while :; do sleep 0.05; done"])
        .spawn()
        .unwrap();
    group.driver.add(&group.name, trapper.id() as i32).unwrap();
    group.children.push(trapper);
    let grace = Duration::from_secs(30);
    let started = std::time::Instant::now();
    assert!(group.driver.terminate(&group.name, grace).unwrap());
    let took = started.elapsed();
    eprintln!("a group whose process exits on SIGTERM emptied in {took:?}");
    assert!(took < grace, "waited the whole grace");
    assert!(group.driver.procs(&group.name).unwrap().is_empty());

    // It says when its trap is set: a SIGTERM that came before would end it.
    let ready = tempfile::tempdir().unwrap();
    let marker = ready.path().join("trapped");
    let ignorer = Command::new("sh")
        .args([
            "-c",
            "trap '' TERM; : > \"$1\"; while :; do sleep 0.05; done",
            "sh",
        ])
        .arg(&marker)
        .spawn()
        .unwrap();
    let pid = ignorer.id() as i32;
    group.driver.add(&group.name, pid).unwrap();
    group.children.push(ignorer);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !marker.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the process never set its trap"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!group
        .driver
        .terminate(&group.name, Duration::from_millis(300))
        .unwrap());
    assert!(alive(pid), "it ignores SIGTERM");
    group.driver.kill_all(&group.name).unwrap();
    for child in &mut group.children {
        child.wait().unwrap();
    }
    assert!(!alive(pid));
}

/// `slot_occupants` says who is in a slot: the slot user's processes and the SSH logins
/// still open (user, where from, since when); after release, nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_says_who_is_in_a_slot_and_after_release_nobody() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env(&env, 1).await;
    let nobody = agent.occupants(0).await;
    assert_eq!(nobody.processes, 0, "{nobody:?}");
    assert!(nobody.logins.is_empty(), "{nobody:?}");
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    // A login that stays open while the agent is asked.
    let mut login = key
        .command(sshd.port, &user)
        .arg("sleep 60")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("running ssh");
    let before = slotpool_protocol::time::now_ms();
    let seen = wait_for_some("the agent to report the open login", LONG, || async {
        let o = agent.occupants(0).await;
        (!o.logins.is_empty()).then_some(o)
    })
    .await;
    let _ = login.kill();
    let _ = login.wait();
    assert!(seen.processes >= 1, "{seen:?}");
    let l = &seen.logins[0];
    assert_eq!(l.user, user, "{seen:?}");
    assert!(l.from.starts_with("127.0.0.1:"), "{seen:?}");
    assert!(
        l.since <= slotpool_protocol::time::now_ms() && l.since + 60_000 > before,
        "{seen:?}"
    );

    agent.release(0, "node-a").await.unwrap();
    let after = agent.occupants(0).await;
    assert_eq!(after.processes, 0, "{after:?}");
    assert!(after.logins.is_empty(), "{after:?}");
}

/// On a host whose mounts are shared (systemd's default: what one mount namespace mounts
/// reaches its peers and slaves), the slots' private /tmp still works: the agent keeps
/// the files of the slots' mount namespaces on a private mount of their own, so binding
/// one cannot propagate into the very namespace it names (which the kernel refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_tmp_works_with_the_run_dir_on_a_shared_mount() {
    let env = IsolationEnv::new();
    let run_dir = env.run_dir.path().to_path_buf();
    let _unmount = slotpool_tests::UnmountOnDrop(run_dir.clone());
    for args in [
        vec![
            "--bind",
            run_dir.to_str().unwrap(),
            run_dir.to_str().unwrap(),
        ],
        vec!["--make-shared", run_dir.to_str().unwrap()],
    ] {
        let status = std::process::Command::new("mount")
            .args(&args)
            .status()
            .unwrap();
        assert!(status.success(), "mount {args:?}");
    }
    let (sshd, key, agent) = login_env_with(&env, 2, &["--slot-private-tmp", "on"]).await;
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        let prepared = agent.prepare(slot, node, Some(&key.public())).await;
        let prepared = prepared.unwrap_or_else(|e| panic!("{e:?}\n{}", agent.log()));
        let (user, _) = login_of(&prepared);
        let (ok, out, err) = key.ssh(sshd.port, &user, "stat -f -c %T /tmp");
        assert!(ok && out.trim() == "tmpfs", "{out}{err}\n{}", agent.log());
    }
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        agent.release(slot, node).await.unwrap();
        assert_eq!(agent.dirty(slot), None, "{}", agent.log());
    }
}

/// A slot's mount namespace holds no namespace file of another slot (nor of anything
/// else bound on the host): each is copied from one the agent cleaned of them at start,
/// so a slot neither keeps its neighbours' namespaces alive nor pays at every warm-up
/// for copying their files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slots_mounts_hold_no_namespace_file() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env_with(&env, 2, &["--slot-private-tmp", "on"]).await;
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        let prepared = agent.prepare(slot, node, Some(&key.public())).await;
        let prepared = prepared.unwrap_or_else(|e| panic!("{e:?}\n{}", agent.log()));
        let (user, _) = login_of(&prepared);
        let (ok, out, err) = key.ssh(
            sshd.port,
            &user,
            "stat -f -c %T /tmp; awk '$9 == \"nsfs\" { print $5 }' /proc/self/mountinfo",
        );
        assert!(ok, "{out}{err}\n{}", agent.log());
        assert_eq!(out.trim(), "tmpfs", "slot {slot}: {out}{err}");
    }
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        agent.release(slot, node).await.unwrap();
        assert_eq!(agent.dirty(slot), None, "{}", agent.log());
    }
}

/// A release unmounts a slot's namespace files and keeps them, empty, for the next
/// tenancy's namespaces, and blanks the slot's state file in place (no file is made and
/// removed per tenancy); the next prepare gets new namespaces on the same files, and an
/// agent removing its slots on stop leaves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_keeps_the_slots_files_for_the_next_tenancy() {
    use std::os::unix::fs::MetadataExt;
    let env = IsolationEnv::new();
    let mut agent = SlotAgent::start(&env, 1, &["--remove-slots-on-stop".into()]).await;
    let (user, _) = login_of(&agent.prepare(0, "node-a", None).await.unwrap());
    let dir = env
        .run_dir
        .path()
        .join("mntns")
        .join(namespace(&env, &user));
    let files = [dir.join("0.mnt"), dir.join("0.ipc")];
    // The namespace bound on a file (its inode on the namespace file system), if any.
    let bound = |files: &[PathBuf]| -> Vec<Option<u64>> {
        let dir_dev = std::fs::metadata(&dir).unwrap().dev();
        files
            .iter()
            .map(|f| {
                let meta = std::fs::metadata(f).unwrap();
                (meta.dev() != dir_dev).then_some(meta.ino())
            })
            .collect()
    };
    let first = bound(&files);
    assert!(first.iter().all(Option::is_some), "{first:?}");
    let inodes = |files: &[PathBuf]| -> Vec<u64> {
        files
            .iter()
            .map(|f| std::fs::symlink_metadata(f).unwrap().ino())
            .collect()
    };
    let state = agent.work_dir().join("state/0.json");
    let state_inode = std::fs::metadata(&state).unwrap().ino();
    let cgroup_dirs = env.cgroups().paths(&user);
    let cgroup_inodes = |dirs: &[PathBuf]| -> Vec<u64> {
        dirs.iter()
            .map(|d| std::fs::metadata(d).expect("the slot's cgroup").ino())
            .collect()
    };
    let first_cgroups = cgroup_inodes(&cgroup_dirs);
    // Held open, the first tenancy's namespaces keep their numbers: the kernel reuses a
    // freed namespace's number at once.
    let held: Vec<std::fs::File> = files
        .iter()
        .map(|f| std::fs::File::open(f).unwrap())
        .collect();
    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
    assert_eq!(bound(&files), [None, None], "unmounted at release");
    let kept = inodes(&files);
    for file in &files {
        let meta = std::fs::symlink_metadata(file).unwrap();
        assert!(meta.is_file() && meta.len() == 0, "{}", file.display());
    }
    wait_for("the slot to be warm again", LONG, || async {
        agent.warm(0)
    })
    .await;
    agent.prepare(0, "node-b", None).await.unwrap();
    let second = bound(&files);
    assert!(
        second.iter().all(Option::is_some) && second != first,
        "new namespaces: {first:?} then {second:?}"
    );
    drop(held);
    // The cgroup is kept, empty, and is the next user's.
    assert_eq!(cgroup_inodes(&cgroup_dirs), first_cgroups, "a new cgroup");
    let gid = passwd::lookup(&user).unwrap().gid;
    for dir in &cgroup_dirs {
        assert_eq!(
            std::fs::metadata(dir).unwrap().gid(),
            gid,
            "{}",
            dir.display()
        );
    }
    agent.release(0, "node-b").await.unwrap();
    assert_eq!(inodes(&files), kept, "the same files are kept");
    assert_eq!(
        std::fs::metadata(&state).unwrap().ino(),
        state_inode,
        "the state file is rewritten in place"
    );
    assert!(
        std::fs::read_to_string(&state).unwrap().trim().is_empty(),
        "a released slot's state is blank"
    );
    agent.stop().await;
    assert!(!dir.exists(), "{} left", dir.display());
}

/// A job cannot make `slotpool occupants` show a login that never existed: a process it
/// names `sshd…` whose child carries an `SSH_CONNECTION` of its choosing is no login,
/// while a real login beside it still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_fake_a_login_in_the_occupants() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env(&env, 1).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    // Kept under its parent (a process named sshd-fake) and orphaned (its parent then
    // init), both with the forged variable.
    let (ok, _, err) = key.ssh(
        sshd.port,
        &user,
        "cp /bin/bash sshd-fake && export SSH_CONNECTION='10.9.8.7 4444 10.0.0.1 22' && \
         (setsid ./sshd-fake -c 'sleep 600 & wait' </dev/null >/dev/null 2>&1 &) && \
         (setsid ./sshd-fake -c 'sleep 601 & exit' </dev/null >/dev/null 2>&1 &) && echo started",
    );
    assert!(ok, "{err}\n{}", sshd.log());
    let fakes = wait_for_some("the fake sessions to run", LONG, || async {
        let uid = uid_of(&user)?;
        let sleeps = procs::processes_of(Path::new("/proc"), uid)
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            })
            .count();
        (sleeps == 2).then_some(sleeps)
    })
    .await;
    let seen = agent.occupants(0).await;
    assert!(seen.processes as usize > fakes, "{seen:?}");
    assert!(seen.logins.is_empty(), "a job faked a login: {seen:?}");
    // A real login is still seen.
    let mut login = key
        .command(sshd.port, &user)
        .arg("sleep 60")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("running ssh");
    let seen = wait_for_some("the agent to report the open login", LONG, || async {
        let o = agent.occupants(0).await;
        (!o.logins.is_empty()).then_some(o)
    })
    .await;
    let _ = login.kill();
    let _ = login.wait();
    assert_eq!(seen.logins.len(), 1, "{seen:?}");
    assert!(seen.logins[0].from.starts_with("127.0.0.1:"), "{seen:?}");
    agent.release(0, "node-a").await.unwrap();
}

/// A login's shell is the agent's child, not its helper's: the helper passes the signals
/// it gets on, and ends as the shell ended (its exit code, or killed by its signal); a
/// helper that goes first hangs the shell up; a request that is not a helper's is
/// refused with the reason; and a login with a terminal has it as its own, in the
/// foreground.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_passes_signals_on_and_ends_as_its_shell_ended() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Command, Stdio};
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env(&env, 1).await;
    let (user, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let info = passwd::lookup(&user).expect("the slot user");
    let helper = sshd.dir.path().join("slotpool-agent");
    let login = |command: &str| {
        let mut c = Command::new(&helper);
        c.args(["enter-slot", "--run-dir"])
            .arg(env.run_dir.path())
            .uid(info.uid)
            .gid(info.gid)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("SSH_ORIGINAL_COMMAND", command)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };

    let out = login("exit 7").output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{out:?}\n{}", agent.log());
    let out = login("kill -USR1 $$").output().unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGUSR1), "{out:?}");

    // SIGTERM to the helper reaches the shell, which says so and exits 3.
    let mut child =
        login("trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.1; done")
            .spawn()
            .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(lines.next().unwrap().unwrap(), "got-term");
    assert_eq!(child.wait().unwrap().code(), Some(3));

    // The helper killed: its shell is hung up.
    let mut child = login("echo $$; exec sleep 300").spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let shell: i32 = lines.next().unwrap().unwrap().parse().unwrap();
    assert!(Path::new(&format!("/proc/{shell}")).exists());
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for("the shell hung up", LONG, || async {
        !Path::new(&format!("/proc/{shell}")).exists()
    })
    .await;

    // A request with no descriptors, and one from a uid that is no slot's user.
    let namespace = passwd::namespace(&env.user_prefix, agent.backing.as_str());
    let socket = env.run_dir.path().join(format!("{namespace}.sock"));
    let ask = |uid: u32, gid: u32, fds: &str| {
        let out = Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import socket; s = socket.socket(socket.AF_UNIX); s.connect({:?}); \
                 socket.send_fds(s, [b'{{}}\\n'], [{fds}]); print(s.recv(512).decode())",
                socket.display().to_string()
            ))
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let answer = ask(info.uid, info.gid, "");
    assert!(
        answer.starts_with("error: a login request comes with 3 descriptors"),
        "{answer}"
    );
    let answer = ask(65534, 65534, "0, 1, 2");
    assert!(answer.contains("not a slot user"), "{answer}");
    let answer = ask(info.uid, info.gid, "0, 1, 2, 0");
    assert!(answer.contains("more than 3 descriptors"), "{answer}");

    // With a terminal: the shell's own, and the shell in the foreground.
    let out = key
        .command(sshd.port, &user)
        .arg("-tt")
        .arg("tty; ps -o sid=,pgid=,tpgid= -p $$")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    assert!(
        lines.next().unwrap_or("").starts_with("/dev/pts/"),
        "{text}"
    );
    let ids: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
    assert!(
        ids.len() == 3 && ids[0] == ids[1] && ids[1] == ids[2],
        "{text}"
    );
    agent.release(0, "node-a").await.unwrap();
    assert_eq!(agent.dirty(0), None, "{}", agent.log());
}
