//! What a hostile job in one slot can do to, or learn about, its neighbours, tried from
//! real slot logins (a real agent with `--isolation users`, a real sshd): filling the
//! disk, and reading the command lines of the neighbours' processes. Each attack runs
//! with the protection on (it must fail) and off (it must succeed, so the test cannot
//! pass because the attack never worked); the outputs are printed (`--nocapture`).
//!
//! Hermetic: the disk tests mount only under their agent's temp work dir (unmounted by
//! the agent's guard if a test fails); the process tests run the agent and sshd in a
//! private mount namespace, so the /proc they mount never reaches the host.

use slotpool_protocol::api::SlotLimits;
use slotpool_tests::{
    bin_path, login_env, login_env_with, login_of, wait_for, ClientKey, IsolationEnv, NatsServer,
    SlotAgent, Sshd,
};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const SOON: Duration = Duration::from_secs(20);

/// The quota the disk tests give each slot, in MiB.
const QUOTA_MB: u64 = 64;

/// What the slot login of `user` prints for `command` (stdout and stderr), asserting ssh
/// itself worked.
fn run_in_slot(sshd: &Sshd, key: &ClientKey, user: &str, command: &str) -> String {
    let (_, out, err) = key.ssh(sshd.port, user, command);
    assert!(
        !err.contains("Permission denied") && !err.contains("Connection"),
        "ssh as {user} failed: {err}\n{}",
        sshd.log()
    );
    format!("{out}{err}")
}

/// Mounts under `dir` in the test's (the host's) namespace.
fn mounts_under(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    slotpool_agent::isolation::cgroup::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| m.mount_point.display().to_string())
        .collect()
}

/// Loop devices whose backing file lies under `dir`.
fn loops_under(dir: &Path) -> Vec<String> {
    let out = Command::new("losetup").arg("-a").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&*dir.to_string_lossy()))
        .map(str::to_string)
        .collect()
}

/// Slot 0 tries to take far more disk than its quota; slot 1 then writes in its own
/// workspace. Returns what slot 0 saw.
async fn fill_the_disk(quota: bool) -> String {
    let env = IsolationEnv::new();
    let quota_arg = QUOTA_MB.to_string();
    let extra: &[&str] = if quota {
        &["--slot-disk-quota-mb", &quota_arg]
    } else {
        &[]
    };
    let (sshd, key, agent) = login_env_with(&env, 2, extra).await;
    let (user_a, ws_a) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, ws_b) = agent.prepare_login(1, "node-b", &key.public()).await;
    let attack = run_in_slot(
        &sshd,
        &key,
        &user_a,
        "cd && fallocate -l 1G big; echo \"fallocate exit $?\"; \
         dd if=/dev/zero of=fill bs=1M count=200 2>&1 | tail -n 2; \
         df -m . | tail -n 1",
    );
    println!(
        "--- slot A ({user_a}), disk quota {}:\n{attack}",
        if quota { "on" } else { "off" }
    );
    let neighbour = run_in_slot(
        &sshd,
        &key,
        &user_b,
        "cd && dd if=/dev/zero of=mine bs=1M count=10 2>/dev/null && echo neighbour-wrote",
    );
    println!("--- slot B ({user_b}):\n{neighbour}");
    assert!(neighbour.contains("neighbour-wrote"), "{neighbour}");
    if quota {
        assert_eq!(
            mounts_under(&agent.work_dir()).len(),
            2,
            "each prepared slot has its image mounted"
        );
    }
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        let released = agent.release(slot, node).await;
        assert!(
            released.is_ok() && agent.dirty(slot).is_none(),
            "release of slot {slot}: {released:?}, dirty: {:?}\n{}",
            agent.dirty(slot),
            agent.log()
        );
    }
    // Released and warmed again: the old images are gone, no loop device holds them.
    wait_for(agent.with_log("both slots warm again"), SOON, || async {
        agent.warm(0) && agent.warm(1)
    })
    .await;
    assert!(!ws_a.join("big").exists() && !ws_b.join("mine").exists());
    let images = agent.work_dir().join("images");
    let deleted: Vec<String> = loops_under(&images)
        .into_iter()
        .filter(|l| l.contains("(deleted)"))
        .collect();
    assert!(
        deleted.is_empty(),
        "loop devices of released images: {deleted:?}"
    );
    attack
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_write_past_its_disk_quota_and_its_neighbour_still_can() {
    let attack = fill_the_disk(true).await;
    assert!(attack.contains("fallocate exit 1"), "{attack}");
    assert!(attack.contains("No space left on device"), "{attack}");
    assert!(
        attack.contains("/dev/loop"),
        "the workspace is no image: {attack}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_disk_quota_a_job_takes_what_it_likes() {
    let attack = fill_the_disk(false).await;
    assert!(attack.contains("fallocate exit 0"), "{attack}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_labels_disk_limit_overrides_the_default_and_release_removes_the_image() {
    let env = IsolationEnv::new();
    let (_sshd, key, agent) = login_env_with(&env, 2, &["--slot-disk-quota-mb", "64"]).await;
    wait_for(agent.with_log("slot 0 warm"), SOON, || async {
        agent.warm(0)
    })
    .await;
    let size_mb = |ws: &Path| {
        let out = Command::new("df")
            .args(["-B1M", "--output=size"])
            .arg(ws)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse::<u64>().ok())
            .unwrap()
    };
    let limits = SlotLimits {
        disk_bytes: Some(32 << 20),
        ..SlotLimits::default()
    };
    let (_, ws0) = login_of(
        &agent
            .prepare_with(0, "node-a", Some(&key.public()), limits)
            .await
            .unwrap(),
    );
    let (_, ws1) = login_of(&agent.prepare(1, "node-b", None).await.unwrap());
    let (small, default) = (size_mb(&ws0), size_mb(&ws1));
    assert!((24..=32).contains(&small), "label's 32 MiB: {small}");
    assert!((48..=64).contains(&default), "default 64 MiB: {default}");
    let image = agent.work_dir().join("images/0.img");
    assert!(image.exists());
    agent.release(0, "node-a").await.unwrap();
    agent.release(1, "node-b").await.unwrap();
    assert!(agent.dirty(0).is_none() && agent.dirty(1).is_none());
    // The warm-up after release made a fresh image at the default size.
    wait_for(agent.with_log("slot 0 warm again"), SOON, || async {
        agent.warm(0)
    })
    .await;
    assert!((48..=64).contains(&size_mb(&ws0)));
}

/// The host's `/proc` mounts, which no test may change.
fn host_proc() -> Vec<String> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.contains(" /proc "))
        .map(str::to_string)
        .collect()
}

/// Slot A starts a process with a secret in its argv; returns what slot B and slot A
/// see of the processes, with `--hide-processes` `on` or `off`; `nsenter`: the agent
/// mounts through `--mount-namespace` (as under the shipped unit).
async fn neighbour_processes(hide: &str, nsenter: bool) -> (String, String, String) {
    let host_before = host_proc();
    let env = IsolationEnv::with_private_mounts();
    let ns = env.mounts.as_ref().unwrap().ns_file().display().to_string();
    let mut extra = vec!["--hide-processes", hide];
    if nsenter {
        extra.extend(["--mount-namespace", &ns]);
    }
    let (sshd, key, agent) = login_env_with(&env, 2, &extra).await;
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let secret = format!("slot-secret-{}", std::process::id());
    run_in_slot(
        &sshd,
        &key,
        &user_a,
        &format!("nohup sh -c 'sleep 600; true' {secret} >/dev/null 2>&1 </dev/null &"),
    );
    // The test (root, on the host's /proc) waits for it.
    wait_for("slot A's process", SOON, || async {
        std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&secret))
        })
    })
    .await;
    let look = "ps -eo user:20,pid,args; \
                for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done";
    let seen_by_b = run_in_slot(&sshd, &key, &user_b, look);
    let seen_by_a = run_in_slot(&sshd, &key, &user_a, look);
    let ns_proc: String = env
        .mounts
        .as_ref()
        .unwrap()
        .mountinfo()
        .lines()
        .filter(|l| l.contains(" /proc "))
        .collect::<Vec<_>>()
        .join("\n");
    println!("--- --hide-processes {hide}: slot B ({user_b}) sees:\n{seen_by_b}");
    println!("--- /proc in the test's mount namespace:\n{ns_proc}");
    assert!(
        seen_by_a.contains(&secret),
        "slot A does not see its own process:\n{seen_by_a}"
    );
    assert!(
        seen_by_b.contains(&user_b),
        "slot B sees not even itself:\n{seen_by_b}"
    );
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        agent.release(slot, node).await.unwrap();
    }
    drop(agent);
    drop(sshd);
    drop(env);
    assert_eq!(host_proc(), host_before, "the host's /proc changed");
    (seen_by_b, ns_proc, secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cannot_see_its_neighbours_processes() {
    for nsenter in [false, true] {
        let (seen_by_b, ns_proc, secret) = neighbour_processes("on", nsenter).await;
        assert!(
            !seen_by_b.contains(&secret),
            "slot B sees slot A's argv:\n{seen_by_b}"
        );
        assert!(ns_proc.contains("hidepid=invisible"), "{ns_proc}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_hidden_processes_a_slot_reads_its_neighbours_argv() {
    let (seen_by_b, ns_proc, secret) = neighbour_processes("off", false).await;
    assert!(
        seen_by_b.contains(&secret),
        "slot B should see slot A's argv with --hide-processes off:\n{seen_by_b}"
    );
    assert!(!ns_proc.contains("hidepid"), "{ns_proc}");
}

/// A restarted agent finds /proc already hiding processes and mounts no second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_does_not_stack_another_proc() {
    let env = IsolationEnv::with_private_mounts();
    let mut agent = SlotAgent::start(&env, 1, &["--hide-processes".into(), "on".into()]).await;
    agent.restart().await;
    let mounts = env.mounts.as_ref().unwrap().mountinfo();
    let procs = mounts.lines().filter(|l| l.contains(" /proc ")).count();
    assert_eq!(
        procs, 2,
        "the namespace's /proc and one hiding one:\n{mounts}"
    );
}

/// Whether `dir` is a mount point in the test's (the host's) namespace.
fn mounted(dir: &Path) -> bool {
    mounts_under(dir).iter().any(|m| Path::new(m) == dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_image_is_detached_at_release_and_its_loop_device_goes_with_its_last_user() {
    let env = IsolationEnv::new();
    let agent = SlotAgent::start(&env, 1, &["--slot-disk-quota-mb".into(), "32".into()]).await;
    let (_, ws) = login_of(&agent.prepare(0, "node-a", None).await.unwrap());
    assert!(mounted(&ws));
    // Something outside the slot (root, so release does not kill it) holds the image.
    let mut holder = Command::new("sleep")
        .arg("600")
        .current_dir(&ws)
        .spawn()
        .unwrap();
    let released = agent.release(0, "node-a").await;
    let images = agent.work_dir().join("images");
    let held = loops_under(&images);
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(
        released.is_ok() && agent.dirty(0).is_none(),
        "{released:?} {:?}\n{}",
        agent.dirty(0),
        agent.log()
    );
    assert!(
        held.iter().any(|l| l.contains("(deleted)")),
        "the busy image stays attached while held: {held:?}"
    );
    wait_for("the released image's loop device to go", SOON, || async {
        loops_under(&images)
            .iter()
            .all(|l| !l.contains("(deleted)"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_slots_image_is_mounted_again_after_a_reboot() {
    let env = IsolationEnv::new();
    let mut agent = SlotAgent::start(&env, 1, &["--slot-disk-quota-mb".into(), "32".into()]).await;
    agent.claim(0, "node-a").await;
    let (_, ws) = login_of(&agent.prepare(0, "node-a", None).await.unwrap());
    std::fs::write(ws.join("job-file"), "kept").unwrap();
    // A reboot: the mount is gone, the image stays.
    let umount = Command::new("umount").arg(&ws).status().unwrap();
    assert!(umount.success());
    assert!(!ws.join("job-file").exists());
    agent.restart().await;
    assert!(mounted(&ws), "{}", agent.log());
    assert_eq!(
        std::fs::read_to_string(ws.join("job-file")).unwrap(),
        "kept"
    );
    agent.release(0, "node-a").await.unwrap();
    assert!(agent.dirty(0).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_asked_for_quotas_it_cannot_make_says_why_and_stops() {
    let env = IsolationEnv::new();
    let nats = NatsServer::start().await;
    let work = tempfile::tempdir().unwrap();
    // No losetup or mkfs.ext4 to be found: as on a host without them.
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin_path("slotpool-agent"))
            .args(nats.args_as(slotpool_protocol::auth::Role::Agent, "bn-iso"))
            .args(["--backing-id", "bn-iso", "--slots", "1", "--work-dir"])
            .arg(work.path())
            .args(env.agent_args())
            .args(["--slot-disk-quota-mb", "64"])
            .env("PATH", "/nonexistent")
            .env("SLOTPOOL_AGENT_SECRET", "test")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stderr}");
    assert!(!out.status.success());
    assert!(
        stderr
            .contains("--slot-disk-quota-mb: per-slot disk quotas need loop devices and mkfs.ext4"),
        "{stderr}"
    );
}

/// The files of `user`'s cgroup that say what it runs and uses: its `cgroup.procs` in
/// every hierarchy and its memory usage (`memory.current` in v2,
/// `memory.usage_in_bytes` in v1), as paths, with the hierarchy's file for the limit.
fn cgroup_files(env: &IsolationEnv, user: &str) -> (Vec<String>, String, String) {
    let dirs = env.cgroups().paths(user);
    let procs = dirs
        .iter()
        .map(|d| d.join("cgroup.procs").display().to_string())
        .collect();
    let find = |files: [&str; 2]| {
        dirs.iter()
            .flat_map(|d| files.map(|f| d.join(f)))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("none of {files:?} under {dirs:?}"))
            .display()
            .to_string()
    };
    (
        procs,
        find(["memory.current", "memory.usage_in_bytes"]),
        find(["memory.max", "memory.limit_in_bytes"]),
    )
}

/// Slot A tries to learn what slot B runs and uses from B's cgroup (its pids, its memory
/// usage), the parent's total usage, and to list the slots' cgroup parent; it still
/// reads its own limit, at the path its `/proc/self/cgroup` names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cannot_read_its_neighbours_cgroup() {
    let env = IsolationEnv::new();
    let (sshd, key, agent) = login_env(&env, 2).await;
    let (user_a, _) = agent.prepare_login(0, "node-a", &key.public()).await;
    let (user_b, _) = agent.prepare_login(1, "node-b", &key.public()).await;
    let started = run_in_slot(
        &sshd,
        &key,
        &user_b,
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo started",
    );
    assert!(started.contains("started"), "{started}");
    let (procs_b, usage_b, _) = cgroup_files(&env, &user_b);
    let (_, _, limit_a) = cgroup_files(&env, &user_a);
    let parents: Vec<String> = env
        .parent_dirs()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    // The parent's own usage: the total of every slot below it.
    let usage_parent = {
        let usage = Path::new(&usage_b);
        let parent = usage.parent().and_then(Path::parent).unwrap();
        parent
            .join(usage.file_name().unwrap())
            .display()
            .to_string()
    };
    let mut attack = String::new();
    for file in procs_b.iter().chain([&usage_b, &usage_parent]) {
        attack.push_str(&format!(
            "echo \"== {file}\"; cat {file} 2>&1 && echo NEIGHBOUR-READ; "
        ));
    }
    for parent in &parents {
        attack.push_str(&format!(
            "echo \"== {parent}\"; ls {parent} 2>&1 && echo LISTED; "
        ));
    }
    attack.push_str(&format!(
        "echo \"== own\"; grep -c /{user_a} /proc/self/cgroup; cat {limit_a} && echo OWN-LIMIT-READ"
    ));
    let seen = run_in_slot(&sshd, &key, &user_a, &attack);
    println!("--- slot A ({user_a}) reading slot B's ({user_b}) cgroup:\n{seen}");
    assert!(
        !seen.contains("NEIGHBOUR-READ"),
        "slot A read slot B's cgroup:\n{seen}"
    );
    assert!(
        !seen.contains("LISTED"),
        "slot A listed the parent:\n{seen}"
    );
    assert_eq!(
        seen.matches("Permission denied").count(),
        procs_b.len() + 2 + parents.len(),
        "{seen}"
    );
    assert!(
        seen.contains("OWN-LIMIT-READ"),
        "slot A lost its own limit:\n{seen}"
    );
    // Root (the agent's sweep, the test) still reads B's group: it has the sleep.
    let pids = env.cgroups().procs(&user_b).unwrap();
    assert!(!pids.is_empty(), "slot B's cgroup is empty");
    for (slot, node) in [(0, "node-a"), (1, "node-b")] {
        agent.release(slot, node).await.unwrap();
        assert_eq!(agent.dirty(slot), None, "{}", agent.log());
    }
}
