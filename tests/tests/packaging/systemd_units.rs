//! The agent's unit under a real systemd: a minimal Debian bookworm booted with
//! `systemd-nspawn --boot`, the .deb installed in it with dpkg, the agent configured
//! through the shipped `agent.env` (users mode, bus guard on) against this test's
//! nats-server, started with `systemctl` and driven over the bus as a launcher would.
//!
//! What it shows, with the unit's hardening in force:
//! - the unit starts (active, its heartbeat from the unit's main pid), with a read-only
//!   root in its mount namespace, and makes `/run/slotpool` (mode 0755, the placement
//!   socket in it); its bus guard table exists; every slot warms up (useradd, cgroups);
//! - `agent.env` is 0600, as installed and after editing;
//! - a slot is prepared, its cgroups are at `<mount>/slotpool/<user>` (where the unit's
//!   comments say, outside the unit's own cgroup), a job process run as the slot user is
//!   moved into them, and release kills it and removes what the job left in its
//!   workspace, `/tmp`, `/var/tmp`, `/dev/shm` and `/run/lock`, leaving the slot clean
//!   (not dirty); a login placed by `enter-slot` has the slot's own `/tmp`;
//! - `systemctl restart` kills the processes of a prepared slot (the agent does, at
//!   SIGTERM) and keeps the slot prepared; an agent killed with SIGKILL leaves them
//!   running (they are not in the unit's cgroup), systemd restarts it, the new agent
//!   keeps the slot and its release kills them;
//! - `systemctl stop` removes the runtime directory and the bus guard table.
//!
//! The root file system is made once with debootstrap (about a minute, from Debian's
//! mirror) and kept under `.tools/systemd-rootfs/<ROOTFS_KEY>`; every run boots it with
//! `--volatile=overlay`, so it is never changed. The container has a network of its own
//! (nspawn gives it `CAP_NET_ADMIN` only then, which the bus guard needs); the test relays
//! its port 4222 to the nats-server. It runs in cgroups of its own, created for it and
//! removed afterwards. It needs root, `systemd-nspawn` and `debootstrap` (scripts/test.sh
//! installs both) and fails, never skips, without them.
//!
//! Written for cgroup v1 and hybrid hosts (CI's): there the container gets the v1
//! controller hierarchies, rooted at its own cgroups. On a pure cgroup v2 host the
//! container's cgroup would need cpu, memory and pids delegated to it, which this test
//! does not set up; the agent would refuse to start there, and the test fail.

use super::packages;
use slotpool_protocol::api::{AgentCommand, SlotLimits, SlotPrepared};
use slotpool_protocol::auth::Role;
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::AgentHeartbeat;
use slotpool_protocol::{BackingId, NodeId};
use slotpool_tests::{wait_for, wait_for_some, workspace_root, NatsServer, AGENT_CALL_TIMEOUT};
use std::ffi::CString;
use std::fs;
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Names the cached root file system: change it when the debootstrap command changes.
const ROOTFS_KEY: &str = "bookworm-minbase-systemd-dbus-nftables-iproute2-1";
const DEBOOTSTRAP_INCLUDE: &str = "systemd,systemd-sysv,dbus,nftables,iproute2";
/// How long the container may take to boot to a running system.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the container gets to power off before it is killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// How long the agent may take from `systemctl start` to a heartbeat, or a slot to warm.
const AGENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Where the packages are mounted in the container.
const PACKAGES_IN_CONTAINER: &str = "/mnt/slotpool-packages";
/// The NATS port the shipped agent.env names, relayed to the test's nats-server.
const CONTAINER_NATS_PORT: u16 = 4222;
const UNIT: &str = "slotpool-agent.service";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_unit_runs_hardened_under_systemd_and_cleans_its_slots() {
    let started = Instant::now();
    assert_eq!(
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() },
        0,
        "booting a container with systemd-nspawn needs root"
    );
    let packages = packages();
    let rootfs = rootfs();
    let nats = NatsServer::start().await;
    let bus = nats.bus().await;
    let suffix = format!("{:08x}", rand::random::<u32>());
    let backing = BackingId::parse(&format!("bn-sd-{suffix}")).unwrap();

    let container = Container::boot(&rootfs, &packages.dir, &format!("slotpool-sd-{suffix}"));
    container.relay_to_host(CONTAINER_NATS_PORT, nats.port());

    let deb = packages
        .debs
        .iter()
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("slotpool-agent_")
        })
        .expect("the agent's .deb");
    let deb_inside = format!(
        "{PACKAGES_IN_CONTAINER}/{}",
        deb.file_name().unwrap().to_string_lossy()
    );
    container.ok(&["dpkg", "-i", &deb_inside]);
    assert_eq!(
        container.ok(&["stat", "-c", "%a %U", "/etc/slotpool/agent.env"]),
        "600 root"
    );

    // Configure as an operator would: backing id and credential in agent.env, the secret
    // in agent.secret, both root's and 0600.
    let etc = container.path("/etc/slotpool");
    write_private(
        &etc.join("agent.creds"),
        &fs::read(nats.creds(Role::Agent, backing.as_str())).unwrap(),
    );
    write_private(&etc.join("agent.secret"), b"systemd-test-secret");
    let env_path = etc.join("agent.env");
    let env = fs::read_to_string(&env_path).unwrap();
    let env = env
        .replace(
            "#SLOTPOOL_BACKING_ID=node-1",
            &format!("SLOTPOOL_BACKING_ID={backing}"),
        )
        .replace(
            "#SLOTPOOL_NATS_CREDS=/etc/slotpool/agent.creds",
            "SLOTPOOL_NATS_CREDS=/etc/slotpool/agent.creds",
        )
        .replace("--slots 4", "--slots 2");
    assert!(
        env.contains("SLOTPOOL_NATS_CREDS=/etc"),
        "agent.env changed:\n{env}"
    );
    fs::write(&env_path, env).unwrap();
    assert_eq!(
        container.ok(&["stat", "-c", "%a %U", "/etc/slotpool/agent.env"]),
        "600 root"
    );

    container.make_slot_cgroups_writable();
    // A host that does not forward (Debian's default): the agent turns forwarding on for
    // the slots' network namespaces, under the unit's read-only /proc/sys.
    container.ok(&["sh", "-c", "echo 0 >/proc/sys/net/ipv4/ip_forward"]);
    container.ok(&["systemctl", "enable", "--now", UNIT]);
    let main_pid = wait_for_heartbeat(&container, &bus, &backing).await;
    assert_eq!(container.run(&["systemctl", "is-active", UNIT]).0, "active");

    // The hardening is in force in the agent's mount namespace: the system is read-only,
    // what slot management writes is not.
    let pid = main_pid.to_string();
    let touch = |path: &str| {
        container.run(&[
            "nsenter",
            "-t",
            &pid,
            "-m",
            "--",
            "sh",
            "-c",
            &format!("touch {path} && rm {path}"),
        ])
    };
    for path in [
        "/usr/lib/slotpool-probe",
        "/var/lib/slotpool-probe",
        "/boot-probe",
        "/run/slotpool-probe",
    ] {
        let (_, out) = touch(path);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Read-only file system"),
            "{path} is writable for the agent:\n{}",
            text(&out)
        );
    }
    for path in [
        "/etc/slotpool-probe",
        "/run/slotpool/probe",
        "/var/lib/slotpool/probe",
        "/tmp/probe",
        "/var/tmp/probe",
        "/dev/shm/probe",
        "/run/lock/probe",
    ] {
        let (_, out) = touch(path);
        assert!(
            out.status.success(),
            "{path} is not writable for the agent:\n{}",
            text(&out)
        );
    }
    assert_eq!(
        container.ok(&["systemctl", "show", "-p", "ProtectSystem", "--value", UNIT]),
        "strict"
    );
    // Descriptors far above what its bounded listeners may hold.
    assert_eq!(
        container.ok(&["systemctl", "show", "-p", "LimitNOFILE", "--value", UNIT]),
        "65536"
    );
    assert_eq!(
        container.ok(&[
            "systemctl",
            "show",
            "-p",
            "RuntimeDirectory",
            "--value",
            UNIT
        ]),
        "slotpool"
    );

    // Its runtime directory, with the placement socket, and its bus guard table.
    assert_eq!(
        container.ok(&["stat", "-c", "%a %U", "/run/slotpool"]),
        "755 root"
    );
    let namespace = format!("sp{}", &sha256_hex(backing.as_str())[..8]);
    assert!(
        container
            .path(&format!("/run/slotpool/{namespace}.sock"))
            .exists(),
        "no placement socket {namespace}.sock in /run/slotpool"
    );
    let tables = container.ok(&["nft", "list", "tables"]);
    assert!(
        tables.contains(&format!("inet slotpool_{namespace}")),
        "no bus guard table:\n{tables}"
    );

    // Forwarding on, with the filter that forwards nothing but the slots' traffic.
    assert_eq!(
        container.ok(&["cat", "/proc/sys/net/ipv4/ip_forward"]),
        "1",
        "{}",
        container.journal()
    );
    let filter = container.ok(&["nft", "list", "table", "ip", "slotpool_forward"]);
    assert!(filter.contains("policy drop"), "{filter}");
    // The agent may write ip_forward. (Not a proof of the unit's `ReadWritePaths=` line:
    // under systemd-nspawn the agent's /proc/sys is writable whatever the unit says —
    // /proc/sys/kernel too, tried — so a container cannot show that
    // `ReadOnlyPaths=/proc/sys` would stop it on a host.)
    let write = |path: &str| {
        container.run(&[
            "nsenter",
            "-t",
            &pid,
            "-m",
            "--",
            "sh",
            "-c",
            &format!("cat {path} >{path}"),
        ])
    };
    let (_, out) = write("/proc/sys/net/ipv4/ip_forward");
    assert!(out.status.success(), "ip_forward: {}", text(&out));

    // Both slots warm up: users and cgroups made under the hardening.
    for slot in 0..2 {
        wait_for(format!("slot {slot} to be warm"), AGENT_TIMEOUT, || async {
            warm(&container, slot)
        })
        .await;
    }

    // Prepare slot 0; its cgroups are at <mount>/slotpool/<user>.
    let prepared = prepare(&bus, &backing, 0, "node-sd-0").await;
    let user = prepared.login.username.clone().expect("a slot user");
    let cgroups = slot_cgroups(&container, &user);
    let unit_cgroup = container.ok(&["systemctl", "show", "-p", "ControlGroup", "--value", UNIT]);
    assert_eq!(unit_cgroup, "/system.slice/slotpool-agent.service");
    for dir in &cgroups {
        assert!(
            container.path(dir).is_dir(),
            "slot cgroup {dir} missing\n{}",
            container.journal()
        );
        assert!(
            !dir.contains(&unit_cgroup),
            "{dir} is below the unit's cgroup"
        );
    }

    // A job: a process of the slot user, moved into the slot's cgroup, and files left in
    // the workspace and the shared directories.
    let job = container.start_job(&user, "job-0");
    wait_for("the job in its slot cgroup", AGENT_TIMEOUT, || async {
        container.cgroup_pids(&cgroups[0]).contains(&job)
    })
    .await;
    container.ok(&[
        "runuser",
        "-u",
        &user,
        "--",
        "sh",
        "-c",
        "echo x >\"$HOME/out\"; echo x >/tmp/sd-job; mkdir /var/tmp/sd-job; \
         echo x >/var/tmp/sd-job/f; echo x >/dev/shm/sd-job; echo x >/run/lock/sd-job",
    ]);
    let leftovers = [
        format!("{}/out", prepared.workspace),
        "/tmp/sd-job".to_string(),
        "/var/tmp/sd-job".to_string(),
        "/dev/shm/sd-job".to_string(),
        "/run/lock/sd-job".to_string(),
    ];
    for path in &leftovers {
        assert!(container.path(path).exists(), "{path} was not made");
    }
    // A login, placed as sshd's ForceCommand places it: its /tmp is the slot's own tmpfs
    // (the agent made the slot's mount namespace under the unit's hardening), and what it
    // writes there never reaches the host's /tmp.
    let login = container.ok(&[
        "runuser",
        "-u",
        &user,
        "--",
        "env",
        "SSH_ORIGINAL_COMMAND=stat -f -c %T /tmp && echo x >/tmp/sd-login && cat /tmp/sd-login",
        "/usr/bin/slotpool-agent",
        "enter-slot",
        "--run-dir",
        "/run/slotpool",
    ]);
    assert_eq!(
        login.lines().collect::<Vec<_>>(),
        ["tmpfs", "x"],
        "{}",
        container.journal()
    );
    assert!(
        !container.path("/tmp/sd-login").exists(),
        "a login's /tmp is the host's"
    );
    // The login is in the slot's network namespace, numbered from the agent's block of
    // the default range.
    let addr = container.ok(&[
        "runuser",
        "-u",
        &user,
        "--",
        "env",
        "SSH_ORIGINAL_COMMAND=ip -4 -o addr show dev eth0",
        "/usr/bin/slotpool-agent",
        "enter-slot",
        "--run-dir",
        "/run/slotpool",
    ]);
    assert!(
        addr.contains("inet 10.213."),
        "{addr}\n{}",
        container.journal()
    );

    release(&bus, &backing, 0, "node-sd-0").await;
    assert!(
        !container.alive(job),
        "the job's process survived the release"
    );
    for path in &leftovers {
        assert!(!container.path(path).exists(), "{path} left after release");
    }
    assert_eq!(container.dirty(0), None, "{}", container.journal());
    wait_for("slot 0 to be warm again", AGENT_TIMEOUT, || async {
        warm(&container, 0)
    })
    .await;

    // A restart kills the processes of a prepared slot and keeps the slot prepared (its
    // node is in the slots bucket, so the restarted agent keeps it).
    slotpool_tests::claim_slot(&bus, &backing, 1, "node-sd-1").await;
    let prepared = prepare(&bus, &backing, 1, "node-sd-1").await;
    let user = prepared.login.username.clone().expect("a slot user");
    let job = container.start_job(&user, "job-1");
    let cgroups = slot_cgroups(&container, &user);
    wait_for("the job in its slot cgroup", AGENT_TIMEOUT, || async {
        container.cgroup_pids(&cgroups[0]).contains(&job)
    })
    .await;
    container.ok(&["systemctl", "restart", UNIT]);
    let new_pid = wait_for_heartbeat(&container, &bus, &backing).await;
    assert_ne!(new_pid, main_pid, "the agent was not restarted");
    assert!(
        !container.alive(job),
        "the job's process survived the agent's restart"
    );
    let beat = heartbeat(&bus, &backing).await.expect("a heartbeat");
    assert_eq!(
        beat.slots.iter().map(|s| s.slot).collect::<Vec<_>>(),
        vec![1],
        "slot 1 not kept prepared across the restart\n{}",
        container.journal()
    );

    // An agent killed without its SIGTERM (a crash) does not take the slot's processes
    // with it: they are not in the unit's cgroup. systemd restarts it (Restart=on-failure)
    // and the new agent keeps the slot, processes included; release then kills them.
    let job = container.start_job(&user, "job-2");
    wait_for("the job in its slot cgroup", AGENT_TIMEOUT, || async {
        container.cgroup_pids(&cgroups[0]).contains(&job)
    })
    .await;
    container.ok(&["systemctl", "kill", "--signal=SIGKILL", UNIT]);
    let crashed_pid = new_pid;
    wait_for_some("the agent restarted by systemd", AGENT_TIMEOUT, || async {
        let pid = wait_for_heartbeat(&container, &bus, &backing).await;
        (pid != crashed_pid).then_some(pid)
    })
    .await;
    assert!(
        container.alive(job),
        "the job's process died with the agent\n{}",
        container.journal()
    );
    let beat = heartbeat(&bus, &backing).await.expect("a heartbeat");
    assert_eq!(
        beat.slots.iter().map(|s| s.slot).collect::<Vec<_>>(),
        vec![1],
        "slot 1 not kept prepared across the crash\n{}",
        container.journal()
    );
    release(&bus, &backing, 1, "node-sd-1").await;
    assert!(
        !container.alive(job),
        "the job's process survived the release"
    );
    assert_eq!(container.dirty(1), None, "{}", container.journal());

    // Stop: the runtime directory and the bus guard table go. The forward filter stays
    // with forwarding; the agent's table of its slots' networks stays for the next start,
    // which replaces it (the warm slots' namespaces went with the unit's mount namespace,
    // so it matches no interface meanwhile).
    container.ok(&["systemctl", "stop", UNIT]);
    assert_eq!(
        container.run(&["systemctl", "is-active", UNIT]).0,
        "inactive"
    );
    assert!(
        !container.path("/run/slotpool").exists(),
        "/run/slotpool left after stop"
    );
    let tables = container.ok(&["nft", "list", "tables"]);
    let slots_table = format!("table inet slotpool_{namespace}_slotnet");
    for table in tables.lines().filter(|t| t.contains("slotpool_")) {
        assert!(
            table == "table ip slotpool_forward" || table == slots_table,
            "{table} left after stop:\n{tables}"
        );
    }
    assert!(
        tables.contains("table ip slotpool_forward"),
        "the forward filter went before forwarding:\n{tables}"
    );

    // Nothing the hardening refused along the way.
    let journal = container.journal();
    for refused in [
        "Read-only file system",
        "Permission denied",
        "Operation not permitted",
    ] {
        assert!(
            !journal.contains(refused),
            "`{refused}` in the journal:\n{journal}"
        );
    }
    assert!(
        !journal.contains(" ERROR "),
        "errors in the journal:\n{journal}"
    );
    eprintln!("systemd units test took {:?}", started.elapsed());
}

fn sha256_hex(text: &str) -> String {
    let out = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes())?;
            child.wait_with_output()
        })
        .expect("running sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn write_private(path: &Path, contents: &[u8]) {
    use std::io::Write;
    let mut file = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    file.write_all(contents).unwrap();
}

async fn heartbeat(bus: &Bus, backing: &BackingId) -> Option<AgentHeartbeat> {
    bus.agents
        .get::<AgentHeartbeat>(backing.as_str())
        .await
        .ok()
        .flatten()
        .map(|beat| beat.value)
}

/// Waits for a heartbeat from the unit's main process; returns that pid.
async fn wait_for_heartbeat(container: &Container, bus: &Bus, backing: &BackingId) -> u32 {
    wait_for_some("the agent unit's heartbeat", AGENT_TIMEOUT, || async {
        let pid: u32 = container
            .run(&["systemctl", "show", "-p", "MainPID", "--value", UNIT])
            .0
            .parse()
            .ok()?;
        let beat = heartbeat(bus, backing).await?;
        (pid != 0 && beat.pid == pid && !beat.draining).then_some(pid)
    })
    .await
}

fn warm(container: &Container, slot: u32) -> bool {
    fs::read_to_string(container.path(&format!("/var/lib/slotpool/agent/state/{slot}.json")))
        .is_ok_and(|s| !s.contains("node_id"))
}

/// The slot's cgroup directories in the container: `<mount>/slotpool/<user>` in the
/// unified hierarchy when it has the controllers, else in each v1 hierarchy; the one
/// holding `cgroup.procs` to check first.
fn slot_cgroups(container: &Container, user: &str) -> Vec<String> {
    let v2 = fs::read_to_string(container.path("/sys/fs/cgroup/cgroup.controllers"))
        .is_ok_and(|c| c.contains("memory"));
    if v2 {
        vec![format!("/sys/fs/cgroup/slotpool/{user}")]
    } else {
        ["memory", "cpu", "pids", "freezer"]
            .iter()
            .map(|c| format!("/sys/fs/cgroup/{c}/slotpool/{user}"))
            .collect()
    }
}

async fn prepare(bus: &Bus, backing: &BackingId, slot: u32, node: &str) -> SlotPrepared {
    let command = AgentCommand::PrepareSlot {
        slot,
        node_id: NodeId::parse(node).unwrap(),
        ssh_public_key: None,
        limits: SlotLimits::default(),
    };
    bus.call(&subjects::agent(backing), &command, AGENT_CALL_TIMEOUT)
        .await
        .unwrap_or_else(|err| panic!("prepare_slot {slot}: {err}"))
}

/// Sends `release_slot`, again while the answer times out (it is idempotent).
async fn release(bus: &Bus, backing: &BackingId, slot: u32, node: &str) {
    let command = AgentCommand::ReleaseSlot {
        slot,
        node_id: NodeId::parse(node).unwrap(),
    };
    let deadline = Instant::now() + AGENT_CALL_TIMEOUT;
    loop {
        let result = bus
            .call::<_, serde_json::Value>(&subjects::agent(backing), &command, AGENT_CALL_TIMEOUT)
            .await;
        match result {
            Ok(_) => return,
            Err(BusError::Timeout { .. }) if Instant::now() < deadline => {}
            Err(err) => panic!("release_slot {slot}: {err}"),
        }
    }
}

/// The cached root file system, made with debootstrap when missing.
fn rootfs() -> PathBuf {
    let base = workspace_root().join(".tools/systemd-rootfs");
    let dir = base.join(ROOTFS_KEY);
    fs::create_dir_all(&base).unwrap();
    let lock = fs::File::create(base.join(".lock")).unwrap();
    // SAFETY: plain syscall on an open descriptor.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if dir.join("usr/lib/systemd/systemd").exists() {
        return dir;
    }
    for tool in ["debootstrap", "systemd-nspawn"] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success()),
            "{tool} is missing: apt-get install debootstrap systemd-container \
             (scripts/test.sh installs them)"
        );
    }
    let partial = base.join(format!("{ROOTFS_KEY}.partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&partial);
    eprintln!("making {} with debootstrap (about a minute)", dir.display());
    let out = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            &format!("--include={DEBOOTSTRAP_INCLUDE}"),
            "bookworm",
        ])
        .arg(&partial)
        .output()
        .expect("running debootstrap");
    if !out.status.success() {
        let _ = fs::remove_dir_all(&partial);
        panic!("debootstrap failed:\n{}", text(&out));
    }
    // Roots of other keys are stale: they take ~250 MB each.
    for entry in fs::read_dir(&base).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && !name.contains(".partial-") && name != ROOTFS_KEY {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    fs::rename(&partial, &dir).unwrap();
    dir
}

/// A booted container, powered off and its cgroups removed on drop.
struct Container {
    name: String,
    nspawn: Child,
    /// The container's PID 1, as the host sees it.
    leader: u32,
    log: PathBuf,
    /// Dropped after the container is powered off.
    _cgroups: OwnCgroups,
}

impl Container {
    fn boot(rootfs: &Path, packages: &Path, name: &str) -> Container {
        let log = std::env::temp_dir().join(format!("{name}.log"));
        let cgroups = own_cgroups(name);
        let procs: Vec<CString> = cgroups
            .0
            .iter()
            .map(|d| CString::new(d.join("cgroup.procs").to_str().unwrap()).unwrap())
            .collect();
        let mut cmd = Command::new("systemd-nspawn");
        cmd.args([
            "--quiet",
            "--register=no",
            "--keep-unit",
            "--volatile=overlay",
            "--console=passive",
            "--private-network",
            "--boot",
        ])
        .arg(format!("--machine={name}"))
        .arg("--directory")
        .arg(rootfs)
        .arg(format!(
            "--bind-ro={}:{PACKAGES_IN_CONTAINER}",
            packages.display()
        ))
        .stdin(Stdio::null());
        let log_file = fs::File::create(&log).unwrap();
        cmd.stdout(log_file.try_clone().unwrap()).stderr(log_file);
        // SAFETY: only async-signal-safe calls (prctl, open, write, close) between fork and
        // exec; the paths were made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                    return Err(io::Error::last_os_error());
                }
                for path in &procs {
                    let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                    if fd < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let nspawn = cmd.spawn().unwrap_or_else(|err| {
            let _ = fs::remove_file(&log);
            panic!(
                "starting systemd-nspawn: {err} (apt-get install systemd-container; \
                 scripts/test.sh installs it)"
            )
        });
        let mut container = Container {
            name: name.to_string(),
            leader: 0,
            nspawn,
            _cgroups: cgroups,
            log,
        };
        let deadline = Instant::now() + BOOT_TIMEOUT;
        container.leader = loop {
            if let Some(pid) = child_named(container.nspawn.id(), "systemd") {
                break pid;
            }
            if let Ok(Some(status)) = container.nspawn.try_wait() {
                panic!(
                    "systemd-nspawn exited ({status}):\n{}",
                    container.nspawn_log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no container init within {BOOT_TIMEOUT:?}:\n{}",
                container.nspawn_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        // systemctl answers once PID 1 listens; until then it fails at once.
        loop {
            let (state, out) = container.run(&["systemctl", "is-system-running"]);
            if state == "running" || state == "degraded" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the container did not boot within {BOOT_TIMEOUT:?}: {}\n{}",
                text(&out),
                container.nspawn_log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        container
    }

    /// `path` inside the container, as seen from the host.
    fn path(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{path}", self.leader))
    }

    /// Runs `args` in the container's namespaces; returns trimmed stdout and the output.
    fn run(&self, args: &[&str]) -> (String, Output) {
        let out = Command::new("nsenter")
            .args(["-t", &self.leader.to_string(), "-a", "--"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running nsenter");
        (String::from_utf8_lossy(&out.stdout).trim().to_string(), out)
    }

    /// [`Container::run`], which must succeed; returns trimmed stdout.
    fn ok(&self, args: &[&str]) -> String {
        let (stdout, out) = self.run(args);
        assert!(
            out.status.success(),
            "{} failed in the container:\n{}\n{}",
            args.join(" "),
            text(&out),
            self.journal()
        );
        stdout
    }

    /// systemd-nspawn hands a container on a cgroup v1 host its controller hierarchies
    /// read-only (only its own name=systemd tree is writable); a real host has them
    /// writable, and slot cgroups need cpu, memory, pids and freezer. They are rooted at
    /// the container's own cgroups (a cgroup namespace), so this reaches nothing else.
    fn make_slot_cgroups_writable(&self) {
        let mountinfo = fs::read_to_string(format!("/proc/{}/mountinfo", self.leader)).unwrap();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let point = left.split(' ').nth(4).unwrap_or_default();
            let mut right = right.split(' ');
            let (fs_type, options) = (right.next(), right.nth(1).unwrap_or_default());
            let wanted = options
                .split(',')
                .any(|o| ["cpu", "memory", "pids", "freezer"].contains(&o));
            if fs_type == Some("cgroup") && wanted {
                let out = Command::new("nsenter")
                    .args(["-t", &self.leader.to_string(), "-m", "--"])
                    .args(["mount", "-o", "remount,bind,rw", point])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "remounting {point}:\n{}", text(&out));
            }
        }
    }

    /// Starts `sleep` as `user` in a transient unit of the container's systemd (as a
    /// login would be in a session scope); returns its pid in the container.
    fn start_job(&self, user: &str, unit: &str) -> u32 {
        self.ok(&[
            "systemd-run",
            "--quiet",
            &format!("--unit={unit}"),
            &format!("--uid={user}"),
            "sleep",
            "3600",
        ]);
        self.ok(&["systemctl", "show", "-p", "MainPID", "--value", unit])
            .parse()
            .unwrap()
    }

    /// The pids (in the container) in the cgroup directory `dir`.
    fn cgroup_pids(&self, dir: &str) -> Vec<u32> {
        self.run(&["cat", &format!("{dir}/cgroup.procs")])
            .0
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Whether process `pid` (in the container) is running (and not a zombie).
    fn alive(&self, pid: u32) -> bool {
        fs::read_to_string(self.path(&format!("/proc/{pid}/stat"))).is_ok_and(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim()
                .starts_with('Z')
        })
    }

    fn dirty(&self, slot: u32) -> Option<String> {
        fs::read_to_string(self.path(&format!("/var/lib/slotpool/agent/dirty/{slot}"))).ok()
    }

    /// The agent unit's journal (for failure messages and the final check).
    fn journal(&self) -> String {
        let (_, out) = self.run(&["journalctl", "--no-pager", "-o", "cat", "-u", UNIT]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn nspawn_log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Accepts connections on 127.0.0.1:`port` in the container's network namespace and
    /// relays each to 127.0.0.1:`host_port` on the host, for as long as the test runs.
    fn relay_to_host(&self, port: u16, host_port: u16) {
        let netns = fs::File::open(format!("/proc/{}/ns/net", self.leader)).unwrap();
        // A socket stays in the namespace it was made in: make the listener on a thread
        // that joined the container's network namespace, then serve it from any thread.
        let listener = std::thread::spawn(move || {
            // SAFETY: setns on an open namespace descriptor, for this thread only.
            if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            TcpListener::bind(("127.0.0.1", port))
        })
        .join()
        .unwrap()
        .expect("listening in the container's network namespace");
        std::thread::spawn(move || {
            for inside in listener.incoming() {
                let Ok(inside) = inside else { return };
                let Ok(outside) = TcpStream::connect(("127.0.0.1", host_port)) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (inside.try_clone().unwrap(), outside.try_clone().unwrap()),
                    (outside, inside),
                ] {
                    std::thread::spawn(move || {
                        let _ = io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() && self.leader != 0 {
            eprintln!(
                "--- journal of {UNIT} in {} ---\n{}",
                self.name,
                self.journal()
            );
        }
        // SIGTERM makes nspawn power the container off.
        // SAFETY: plain syscall on our unreaped child.
        unsafe { libc::kill(self.nspawn.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        while matches!(self.nspawn.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if matches!(self.nspawn.try_wait(), Ok(None)) {
            eprintln!(
                "{}: not powered off within {SHUTDOWN_GRACE:?}, killing",
                self.name
            );
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
        }
        let _ = fs::remove_file(&self.log);
    }
}

/// The cgroups a container runs in, removed (with every group below) on drop.
struct OwnCgroups(Vec<PathBuf>);

impl Drop for OwnCgroups {
    fn drop(&mut self) {
        for dir in &self.0 {
            if let Err(err) = remove_cgroup_tree(dir) {
                eprintln!("cleanup: {err}");
            }
        }
    }
}

/// A new cgroup named `name` below this process's own in the unified hierarchy, the
/// name=systemd one and the v1 hierarchies of the controllers slots use (others, such as
/// cpuset, need setting up before a process may join).
fn own_cgroups(name: &str) -> OwnCgroups {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts: Vec<(String, PathBuf, Vec<String>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = PathBuf::from(left.split(' ').nth(4)?);
            let mut right = right.split(' ');
            let fs_type = right.next()?.to_string();
            let options = right.nth(1)?.split(',').map(str::to_string).collect();
            fs_type
                .starts_with("cgroup")
                .then_some((fs_type, point, options))
        })
        .collect();
    let mut dirs = OwnCgroups(Vec::new());
    for line in fs::read_to_string("/proc/self/cgroup").unwrap().lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let wanted = controllers.is_empty()
            || controllers
                .split(',')
                .any(|c| ["cpu", "memory", "pids", "freezer", "name=systemd"].contains(&c));
        if !wanted {
            continue;
        }
        let mount = mounts.iter().find(|(fs_type, _, options)| {
            if controllers.is_empty() {
                fs_type == "cgroup2"
            } else {
                fs_type == "cgroup"
                    && controllers
                        .split(',')
                        .all(|c| options.iter().any(|o| o == c))
            }
        });
        let Some((_, point, _)) = mount else { continue };
        let dir = point.join(path.trim_start_matches('/')).join(name);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating cgroup {}: {e}", dir.display()));
        dirs.0.push(dir);
    }
    dirs
}

/// Removes the cgroup directory `dir` and every group below it, deepest first, waiting
/// briefly for processes that are still exiting.
fn remove_cgroup_tree(dir: &Path) -> Result<(), String> {
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    loop {
        let mut all = Vec::new();
        collect_dirs(dir, &mut all);
        all.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        let mut last = None;
        for d in &all {
            if let Err(err) = fs::remove_dir(d) {
                if err.kind() != io::ErrorKind::NotFound {
                    last = Some(format!("removing cgroup {}: {err}", d.display()));
                }
            }
        }
        match last {
            None => return Ok(()),
            Some(err) if Instant::now() >= deadline => return Err(err),
            Some(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    if !dir.is_dir() {
        return;
    }
    out.push(dir.to_path_buf());
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_dirs(&entry.path(), out);
        }
    }
}

/// The pid of a child of `parent` whose command name is `comm`.
fn child_named(parent: u32, comm: &str) -> Option<u32> {
    fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let stat = fs::read_to_string(entry.path().join("stat")).ok()?;
        let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid: u32 = rest.split(' ').nth(1)?.parse().ok()?;
        (ppid == parent && name == comm).then_some(pid)
    })
}

fn text(out: &Output) -> String {
    format!(
        "status: {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
