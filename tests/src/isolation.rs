//! Fixtures for the isolation tests (run as root): unique user and cgroup names per test
//! with a guard that removes them, and a private sshd on a loopback port.

use crate::process::{bin_path, ChildGuard};
use slotpool_agent::isolation::cgroup::{self, CgroupLayout};
use slotpool_agent::isolation::{passwd, procs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

use slotpool_local_run::sshd;
pub use slotpool_local_run::sshd::SSHD;

/// A random lowercase tag, for names unique to one test.
fn tag(len: usize) -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// Where tests keep what a slot login must see (workspaces, programs it runs, files it
/// writes for the test to read): not under `/tmp`, `/var/tmp` or `/dev/shm`, which every
/// slot has its own of, but beside them, as a production agent's work dir is. Created
/// 0711 (slot users pass through it) when run as root; others use the temp dir.
pub const SLOT_VISIBLE_ROOT: &str = "/var/lib/slotpool-tests";

/// One slot's network namespaces made with the agent's own code, outside any agent: a
/// random agent namespace and a random /24 of 10.0.0.0/8, in a temp dir. Slot 0's
/// namespace, veth and table are removed on drop, also when the test panics.
pub struct SlotNetworksForTest {
    pub nets: slotpool_agent::isolation::netns::SlotNetworks,
    _run: TempDir,
}

impl SlotNetworksForTest {
    pub fn new() -> SlotNetworksForTest {
        use rand::Rng;
        use slotpool_agent::isolation::netns::{AddressRange, SlotNetworks};
        require_root();
        let run = tempfile::tempdir().unwrap();
        let namespace = format!("sptb{:08x}", rand::rng().random::<u32>());
        let range = AddressRange::parse(&format!(
            "10.{}.{}.0/24",
            rand::rng().random_range(100..250u8),
            rand::rng().random_range(0..=255u8)
        ))
        .unwrap();
        let nets = SlotNetworks::new(
            run.path().join("netns"),
            namespace,
            range,
            1,
            &run.path().join("blocks"),
            vec![4222],
        )
        .unwrap();
        SlotNetworksForTest { nets, _run: run }
    }
}

impl Default for SlotNetworksForTest {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SlotNetworksForTest {
    fn drop(&mut self) {
        let _ = self.nets.remove(0);
    }
}

/// A temp dir (removed on drop) a slot login can reach, under [`SLOT_VISIBLE_ROOT`].
pub fn slot_visible_tempdir(prefix: &str) -> TempDir {
    let mut builder = tempfile::Builder::new();
    builder.prefix(prefix);
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return builder.tempdir().expect("temp dir");
    }
    let root = Path::new(SLOT_VISIBLE_ROOT);
    std::fs::create_dir_all(root).unwrap_or_else(|e| panic!("creating {}: {e}", root.display()));
    set_mode(root, 0o711);
    builder
        .tempdir_in(root)
        .unwrap_or_else(|e| panic!("temp dir in {}: {e}", root.display()))
}

/// Panics unless the test runs as root: isolation tests never skip silently.
pub fn require_root() {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "isolation tests create users and cgroups and must run as root (CI does)"
    );
}

/// A user prefix, cgroup parent and run dir owned by one test. On drop (also when the
/// test panics) it kills every process of its users, deletes the users and the cgroups.
/// Declare it *before* the [`crate::Pool`] so the agents are gone first.
pub struct IsolationEnv {
    pub user_prefix: String,
    /// A `--slot-uid-range` of this test's own (1000 uids picked at random), so parallel
    /// tests do not hand out each other's uids.
    pub uid_range: String,
    pub cgroup_parent: String,
    pub run_dir: TempDir,
    layout: CgroupLayout,
    /// The private mount namespace the agent and sshd run in, for tests that let the
    /// agent mount where the host must not see it ([`IsolationEnv::with_private_mounts`]).
    pub mounts: Option<PrivateMounts>,
}

impl IsolationEnv {
    pub fn new() -> IsolationEnv {
        require_root();
        let run_dir = tempfile::Builder::new()
            .prefix("slotpool-run-")
            .tempdir()
            .expect("run dir");
        // Slot users must reach the placement socket.
        set_mode(run_dir.path(), 0o755);
        IsolationEnv {
            user_prefix: format!("spt{}", tag(5)),
            uid_range: {
                use rand::Rng;
                let first = 3_000_000 + rand::rng().random_range(0..50_000u32) * 1000;
                format!("{first}-{}", first + 999)
            },
            cgroup_parent: format!("slotpool-test-{}", tag(8)),
            run_dir,
            layout: cgroup::detect(Path::new("/proc")).expect("cgroup layout"),
            mounts: None,
        }
    }

    /// An environment whose agents and sshd run in a private mount namespace of their
    /// own: what the agent mounts there (a /proc hiding processes) never reaches the host.
    pub fn with_private_mounts() -> IsolationEnv {
        let mut env = IsolationEnv::new();
        env.mounts = Some(PrivateMounts::new());
        env
    }

    /// A command running `program` in this environment's mount namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_namespace(
            self.mounts.as_ref().map(|m| m.ns_file()).as_deref(),
            program,
        )
    }

    /// Agent arguments for user isolation with this environment's names.
    pub fn agent_args(&self) -> Vec<String> {
        let mut args = vec![
            "--heartbeat-interval-ms".into(),
            "300".into(),
            "--heartbeat-ttl-secs".into(),
            "2".into(),
            "--isolation".into(),
            "users".into(),
            "--user-prefix".into(),
            self.user_prefix.clone(),
            "--cgroup-parent".into(),
            self.cgroup_parent.clone(),
            "--slot-uid-range".into(),
            self.uid_range.clone(),
            "--run-dir".into(),
            self.run_dir.path().display().to_string(),
        ];
        // Hiding processes mounts /proc: only agents in a private mount namespace may
        // (with the default, on, or as the test says).
        if self.mounts.is_none() {
            args.extend(["--hide-processes".into(), "off".into()]);
        }
        args
    }

    /// The cgroup driver the agents use.
    pub fn cgroups(&self) -> Box<dyn cgroup::CgroupDriver> {
        cgroup::driver(&self.layout, &self.cgroup_parent)
    }

    /// The directories of the cgroup parent in every hierarchy.
    pub fn parent_dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = match &self.layout {
            CgroupLayout::V2 { mount } => vec![mount.join(&self.cgroup_parent)],
            CgroupLayout::V1 { mounts } => mounts
                .iter()
                .map(|(_, m)| m.join(&self.cgroup_parent))
                .collect(),
        };
        dirs.dedup();
        dirs
    }

    /// The users of this environment that exist now.
    pub fn users(&self) -> Vec<String> {
        passwd::users_with_prefix(Path::new("/etc"), &self.user_prefix)
    }
}

impl Default for IsolationEnv {
    fn default() -> Self {
        IsolationEnv::new()
    }
}

impl Drop for IsolationEnv {
    fn drop(&mut self) {
        let cgroups = self.cgroups();
        for name in self.users() {
            if let Some(info) = passwd::lookup(&name) {
                if let Err(err) = procs::kill_uid(Path::new("/proc"), info.uid, info.gid) {
                    eprintln!("cleanup: {err}");
                }
            }
            if let Err(err) = cgroups.kill_all(&name) {
                eprintln!("cleanup: {err}");
            }
            if let Err(err) = passwd::remove(&name) {
                eprintln!("cleanup: {err}");
            }
        }
        // Groups userdel left: it keeps a user's group whose gid is not the user's, as
        // an agent stopped between the two files of a renumber leaves them.
        for group in passwd::groups_with_prefix(Path::new("/etc"), &self.user_prefix) {
            let _ = Command::new("groupdel").arg(&group).status();
        }
        // Groups left by slots whose user is already gone.
        for parent in self.parent_dirs() {
            if let Ok(entries) = std::fs::read_dir(&parent) {
                for e in entries.flatten().filter(|e| e.path().is_dir()) {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let _ = cgroups.kill_all(&name);
                    let _ = cgroups.remove(&name);
                }
            }
            let _ = std::fs::remove_dir(&parent);
        }
        remove_bus_guards(&self.user_prefix);
        remove_slot_namespaces(&self.run_dir.path().join("netns"));
        remove_slot_namespaces(&self.run_dir.path().join("mntns"));
    }
}

/// Unmounts the slot namespaces agents left under `<run-dir>/netns` or `<run-dir>/mntns`
/// (an agent killed with SIGKILL leaves them): the last reference gone, the kernel
/// deletes each namespace, and its veth pair or tmpfs mounts with it.
fn remove_slot_namespaces(dir: &Path) {
    let Ok(agents) = std::fs::read_dir(dir) else {
        return;
    };
    for agent in agents.flatten() {
        for file in std::fs::read_dir(agent.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = rustix::mount::unmount(file.path(), rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_file(file.path());
        }
        // The agent makes its directory of mount namespaces a mount of its own.
        let _ = rustix::mount::unmount(agent.path(), rustix::mount::UnmountFlags::DETACH);
    }
}

/// Removes the agents' nftables bus guards (`slotpool_<namespace>`) of this test's
/// namespaces: an agent killed with SIGKILL leaves its table behind.
fn remove_bus_guards(user_prefix: &str) {
    let Ok(out) = Command::new("nft").args(["list", "tables"]).output() else {
        return;
    };
    let ours = format!("slotpool_{user_prefix}");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(table) = line
            .strip_prefix("table inet ")
            .filter(|t| t.starts_with(&ours))
        {
            let deleted = Command::new("nft")
                .args(["delete", "table", "inet", table])
                .status();
            if !deleted.is_ok_and(|s| s.success()) {
                eprintln!("cleanup: cannot delete nftables table {table}");
            }
        }
    }
}

pub use slotpool_agent::isolation::mounts::in_namespace;

/// A private mount namespace (`unshare -m --propagation private`) held open by a
/// sleeping process, killed on drop: once the agent and sshd in it are gone too, the
/// namespace and everything mounted in it are.
pub struct PrivateMounts {
    holder: ChildGuard,
}

impl PrivateMounts {
    pub fn new() -> PrivateMounts {
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sleep", "infinity"])
            .stdin(Stdio::null());
        let holder = ChildGuard::spawn("mount namespace holder", cmd).expect("running unshare");
        let mounts = PrivateMounts { holder };
        // unshare has made the namespace once the holder's differs from ours.
        let ours = std::fs::read_link("/proc/self/ns/mnt").expect("our mount namespace");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(mounts.ns_file()).ok().as_ref() == Some(&ours) {
            assert!(
                std::time::Instant::now() < deadline,
                "unshare made no mount namespace within 10 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        mounts
    }

    /// The namespace's file, for `nsenter --mount=`.
    pub fn ns_file(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/mnt", self.holder.id()))
    }

    /// The mounts of the namespace (`mountinfo` of its holder).
    pub fn mountinfo(&self) -> String {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.holder.id()))
            .expect("reading the namespace's mountinfo")
    }
}

impl Default for PrivateMounts {
    fn default() -> Self {
        PrivateMounts::new()
    }
}

/// Lazily unmounts whatever is mounted under `dir` in the test's namespace (deepest
/// first): the workspace images of an agent that died or a test that failed. Their loop
/// devices go with them (`mount -o loop` sets autoclear).
pub fn unmount_all_under(dir: &Path) {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = cgroup::parse_mountinfo(&text)
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        let ok = Command::new("umount")
            .arg("-l")
            .arg(&point)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("cleanup: cannot unmount {}", point.display());
        }
    }
}

/// Runs [`unmount_all_under`] on its directory when dropped: declared after the temp
/// dir of an agent and before the agent's process guard, it runs once the agent is dead
/// and before the dir is removed, also when the test fails.
pub struct UnmountOnDrop(pub PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        unmount_all_under(&self.0);
    }
}

pub fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
}

/// A private sshd on 127.0.0.1 with its own host key and config: logins run
/// `slotpool-agent enter-slot`, as on a real backing node. Killed on drop.
pub struct Sshd {
    pub port: u16,
    pub dir: TempDir,
    _child: ChildGuard,
}

impl Sshd {
    /// The agent's options that name this sshd: its port and its host keys.
    pub fn agent_args(&self) -> Vec<String> {
        vec![
            "--ssh-port".into(),
            self.port.to_string(),
            "--ssh-host-keys-dir".into(),
            self.dir.path().display().to_string(),
        ]
    }

    /// Starts sshd for the users of `env`; waits until it answers.
    pub async fn start(env: &IsolationEnv) -> Sshd {
        let dir = slot_visible_tempdir("slotpool-sshd-");
        // Slot users run the agent binary at login (ForceCommand). The build's target dir
        // may sit where they cannot reach it (a clone under a 0700 directory), so they run
        // a copy from this dir, opened to everyone as /usr/bin would be.
        let agent = dir.path().join("slotpool-agent");
        std::fs::copy(bin_path("slotpool-agent"), &agent).expect("copying slotpool-agent");
        set_mode(dir.path(), 0o755);
        set_mode(&agent, 0o755);
        let files = sshd::SshdFiles::write(
            dir.path(),
            &env.user_prefix,
            &format!(
                "{} enter-slot --run-dir {}",
                agent.display(),
                env.run_dir.path().display()
            ),
        )
        .unwrap_or_else(|e| panic!("{e} (scripts/test.sh installs openssh-server)"));
        let mut cmd = env.command(SSHD);
        files.arguments(&mut cmd).expect("sshd's log");
        let child = ChildGuard::spawn("sshd", cmd).expect("starting sshd");
        let port = files.port;
        crate::wait_for(
            "sshd to accept connections",
            Duration::from_secs(20),
            || async { std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() },
        )
        .await;
        Sshd {
            port,
            dir,
            _child: child,
        }
    }

    /// The sshd_config it runs with.
    pub fn config(&self) -> PathBuf {
        self.dir.path().join("sshd_config")
    }

    /// sshd's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sshd.log")).unwrap_or_default()
    }
}

/// The sshd drop-in slotpool ships for slot logins.
pub fn shipped_sshd_drop_in() -> PathBuf {
    crate::workspace_root().join("packaging/etc/sshd/slotpool-slots.conf")
}

/// The shipped drop-in's `Match` block for users starting with `prefix`, whose logins run
/// `command` instead of `/usr/bin/slotpool-agent enter-slot`: what is tested is what
/// ships.
pub fn slot_match_block(prefix: &str, command: &str) -> String {
    sshd::slot_match_block(prefix, command).unwrap_or_else(|e| panic!("{e}"))
}

/// A client key pair in a temp dir.
pub struct ClientKey {
    pub dir: TempDir,
    key: sshd::ClientKey,
}

impl ClientKey {
    pub fn new() -> ClientKey {
        let dir = tempfile::tempdir().expect("key dir");
        let key = sshd::ClientKey::generate(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        ClientKey { dir, key }
    }

    pub fn public(&self) -> String {
        self.key.public().unwrap_or_else(|e| panic!("{e}"))
    }

    /// `ssh` with this key to `user` on 127.0.0.1:`port`, non-interactive, trusting any
    /// host key; the caller adds what to do (a command, `-N -L …`).
    pub fn command(&self, port: u16, user: &str) -> Command {
        self.key.command(port, user)
    }

    /// Runs `command` as `user` over ssh; returns (success, stdout, stderr).
    pub fn ssh(&self, port: u16, user: &str, command: &str) -> (bool, String, String) {
        let out = self
            .command(port, user)
            .arg(command)
            .output()
            .expect("running ssh");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Default for ClientKey {
    fn default() -> Self {
        ClientKey::new()
    }
}
