//! How a slot is set up and torn down on the machine, behind [`SlotIsolation`].
//!
//! An implementation only does the mechanics for one slot; who may hold a slot is decided
//! in [`crate::slots`]. [`WorkspaceOnly`] (isolation mode `none`) gives each slot a
//! private directory and nothing else; [`user_isolation::UserIsolation`] (mode `users`)
//! gives each slot its own Unix user and cgroup, built from the mechanisms beside it:
//!
//! - [`passwd`]: slot users' names, and creating, deleting and renumbering them in the
//!   password database; [`procs`]: their processes, IPC objects and SSH logins, found in
//!   `/proc`, and the kill by uid; [`uid_range`]: the never-reused uids they get;
//! - [`cgroup`]: the v2/v1 drivers of a slot's cgroup and its limits, and
//!   [`default_limits`], the limits of a slot whose label sets none;
//! - [`disk_quota`]: a workspace as a filesystem image of its own; [`mounts`]: the agent's
//!   mount namespace and the `/proc` that hides other users' processes;
//! - [`netns`]: a network namespace per slot; [`bus_guard`]: the nftables table that keeps
//!   slot users off the bus; [`nsfs`]: the namespace files that keep a slot's namespaces;
//! - [`wipe`]: removing a job-controlled tree without following a link; [`shared_dirs`]:
//!   a slot user's entries in the host's shared directories;
//! - [`enter`]: the placement socket and the `enter-slot` helper sshd runs for logins.
//!
//! On-disk layout of mode `none` under the work dir:
//!
//! ```text
//! <work-dir>/slots/<slot>/                 the slot's workspace (0700)
//! <work-dir>/slots/<slot>/.ssh/authorized_keys
//! <work-dir>/markers/<slot>                marker: the node holding the slot, or blank
//! ```
//!
//! The marker is a fixed-size record (the node id padded with spaces) rewritten in place,
//! so preparing and releasing a slot create no files of their own: the file is made once,
//! at the first warm-up. It names the node last on prepare and is blanked first on
//! release, so a slot whose prepare or release was interrupted names no node and counts as
//! free: its leftovers are wiped by the next prepare or release. Release empties the
//! workspace rather than removing it, and the warm-up keeps the directory.
//!
//! **Warm slots.** A free slot is *warmed* ahead of time ([`SlotIsolation::warm`]): the
//! slow, node-independent part of a prepare (with mode `none`: the empty workspace) is
//! done while nobody waits, so a prepare of a warm slot ([`SlotIsolation::prepare_warm`])
//! only adds the key and the marker. A warm slot is one whose empty workspace exists
//! and whose marker names no node; one with anything in it is cold and wiped before use.

pub mod bus_guard;
pub mod cgroup;
pub mod default_limits;
pub mod disk_quota;
pub mod enter;
pub mod mounts;
pub mod netns;
pub mod netns_blocks;
pub mod nsfs;
pub mod passwd;
pub mod private_tmp;
pub mod procs;
pub mod rtnl;
pub mod shared_dirs;
pub mod slot_dns;
pub mod start;
pub mod uid_range;
pub mod user_isolation;
pub mod wipe;

use slotpool_protocol::api::{SlotLimits, SlotOccupants};
use slotpool_protocol::model::SlotNames;
use slotpool_protocol::NodeId;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use wipe::{Budget, WipeError};

/// What a slot may use, as the isolation applies it: the wire's `SlotLimits`, converted
/// where a prepare command comes in (`commands.rs`), with the agent's defaults for what
/// the label leaves unset ([`default_limits`]). Kept in the state file of a slot of mode
/// `users`, in the same shape as the wire's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// CPU time in thousandths of a CPU (1500 = one and a half CPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u32>,
    /// Memory (RAM) in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Most processes and threads at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u32>,
    /// Size of the workspace's own file system in bytes (a disk quota).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

impl From<&SlotLimits> for Limits {
    fn from(l: &SlotLimits) -> Limits {
        Limits {
            cpu_millis: l.cpu_millis,
            memory_bytes: l.memory_bytes,
            pids: l.pids,
            disk_bytes: l.disk_bytes,
        }
    }
}

/// The directory, next to `slots/`, of the node markers of mode `none`.
const MARKERS_DIR: &str = "markers";
/// Size of a marker record: a node id (at most 128 bytes) padded with spaces, then a
/// newline.
const MARKER_LEN: usize = 256;
/// Where a workspace held its node marker before markers had a directory of their own;
/// recovery still reads it, so an upgraded agent keeps the slots prepared before.
const LEGACY_NODE_MARKER: &str = ".slotpool-node";
const WORKSPACE_MODE: u32 = 0o700;
const PRIVATE_FILE_MODE: u32 = 0o600;

/// A file-system step that failed, with the path it was working on.
#[derive(Debug, thiserror::Error)]
#[error("{action} {path}: {error}")]
pub struct IsolationError {
    pub action: &'static str,
    pub path: PathBuf,
    pub error: std::io::Error,
}

impl IsolationError {
    pub(crate) fn new(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |error| IsolationError {
            action,
            path,
            error,
        }
    }
}

/// A slot found on disk at start-up, prepared or warm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundSlot {
    pub slot: u32,
    /// The node holding the slot; `None` for a warm (free, ready) slot.
    pub node_id: Option<NodeId>,
}

impl FoundSlot {
    /// A slot prepared for `node_id`.
    pub fn prepared(slot: u32, node_id: NodeId) -> FoundSlot {
        FoundSlot {
            slot,
            node_id: Some(node_id),
        }
    }

    /// A free slot that is warm.
    pub fn warm(slot: u32) -> FoundSlot {
        FoundSlot {
            slot,
            node_id: None,
        }
    }
}

/// Sets up and tears down the environment of one slot. Calls block (file system,
/// processes); callers run them off the async runtime. Calls for the same slot are
/// never concurrent.
pub trait SlotIsolation: Send + Sync + 'static {
    /// The isolation mode, for logs and the heartbeat (`none`, `users`).
    fn name(&self) -> &'static str;

    /// The slot's workspace directory (whether or not it exists).
    fn workspace(&self, slot: u32) -> PathBuf;

    /// Every slot's workspace and user as templates: what [`SlotIsolation::workspace`]
    /// and [`SlotIsolation::username`] of a prepared slot say, for the heartbeat.
    fn slot_names(&self) -> SlotNames;

    /// Whether [`SlotIsolation::warm`] and [`SlotIsolation::prepare_warm`] are a few
    /// small file operations, quick enough to run on the agent's event loop: that saves
    /// two thread hand-offs each. (`destroy` may wipe a big workspace: never inline.)
    fn quick_setup(&self) -> bool {
        false
    }

    /// Makes the slot fresh for `node_id`, wiping anything a previous node left, and
    /// returns its workspace: the full (cold) path, wipe then warm then prepare.
    fn create(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<&str>,
        limits: &Limits,
    ) -> Result<PathBuf, IsolationError> {
        self.destroy(slot)?;
        self.warm(slot)?;
        self.prepare_warm(slot, node_id, ssh_public_key, limits)
    }

    /// Readies a free slot that was just verified clean (by [`SlotIsolation::destroy`])
    /// for a later [`SlotIsolation::prepare_warm`]: everything a prepare needs that does
    /// not depend on the node. Fails, leaving the slot for the full path, when something
    /// of a previous use of the slot is still there.
    fn warm(&self, slot: u32) -> Result<(), IsolationError>;

    /// [`SlotIsolation::warm`] right after a [`SlotIsolation::destroy`] of the slot that
    /// succeeded; an isolation whose destroy already leaves the slot warm checks only
    /// what that destroy may not have left behind.
    fn warm_after_destroy(&self, slot: u32) -> Result<(), IsolationError> {
        self.warm(slot)
    }

    /// Hands a warm slot to `node_id`: adds the key, applies `limits` and records the
    /// node, and returns the workspace. On failure the caller falls back to
    /// [`SlotIsolation::create`].
    fn prepare_warm(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<&str>,
        limits: &Limits,
    ) -> Result<PathBuf, IsolationError>;

    /// Removes everything of the slot's previous use and checks it is gone (mode `none`
    /// keeps the empty workspace directory). Succeeds when there was nothing to remove.
    fn destroy(&self, slot: u32) -> Result<(), IsolationError>;

    /// What a release does to the slot: as [`SlotIsolation::destroy`], but it may keep
    /// what the next warm-up makes again (users mode: the user, renumbered then).
    fn release(&self, slot: u32) -> Result<(), IsolationError> {
        self.destroy(slot)
    }

    /// The slots left prepared or warm by a previous run of the agent.
    fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError>;

    /// The Unix user of a prepared slot, when slots have their own users.
    fn username(&self, _slot: u32) -> Option<String> {
        None
    }

    /// Who is in the slot: its user's processes and SSH logins (none without a slot user).
    fn occupants(&self, _slot: u32) -> SlotOccupants {
        SlotOccupants::default()
    }

    /// Moves process `pid` of user `uid` into its slot's cgroup; returns the slot, or
    /// `None` when `uid` is no slot's user.
    fn place(&self, _uid: u32, _pid: i32) -> Result<Option<u32>, IsolationError> {
        Ok(None)
    }

    /// What a process of user `uid` needs to start inside its slot
    /// ([`start::SlotEntry`]); `None` when `uid` is no prepared slot's user. With
    /// `beside`, the process also joins that process's groups in the hierarchies its
    /// slot has none in ([`cgroup::procs_beside`]).
    fn slot_entry(
        &self,
        _uid: u32,
        _beside: Option<i32>,
    ) -> Result<Option<start::SlotEntry>, IsolationError> {
        Ok(None)
    }

    /// The namespaces a login of `slot` joins, in order (see [`crate::isolation::netns`]
    /// and [`crate::isolation::private_tmp`]); none when slots have none of their own.
    fn login_namespaces(
        &self,
        _slot: u32,
    ) -> Result<Vec<(start::NsKind, std::os::fd::OwnedFd)>, IsolationError> {
        Ok(Vec::new())
    }

    /// Moves every process of a slot user that is not in its slot's cgroup into it
    /// (the placement backstop); returns how many were moved.
    fn sweep(&self) -> usize {
        0
    }

    /// Kills every process of every slot (agent shutdown); workspaces stay.
    fn stop_all(&self) -> Result<(), IsolationError> {
        Ok(())
    }

    /// Removes slots `0..slots` entirely, as [`SlotIsolation::destroy`] does, and what
    /// the slots shared (agent shutdown with `--remove-slots-on-stop`): the problems met,
    /// every slot tried.
    fn remove_all(&self, slots: u32) -> Vec<IsolationError> {
        (0..slots)
            .filter_map(|slot| self.destroy(slot).err())
            .collect()
    }
}

/// Isolation by directory only: each slot gets `<work-dir>/slots/<slot>/`, mode 0700,
/// and a marker `<work-dir>/markers/<slot>`.
#[derive(Clone, Debug)]
pub struct WorkspaceOnly {
    slots_dir: PathBuf,
    markers_dir: PathBuf,
}

impl WorkspaceOnly {
    /// Uses (and creates) `<work_dir>/slots` and `<work_dir>/markers`.
    pub fn new(work_dir: &Path) -> Result<WorkspaceOnly, IsolationError> {
        let slots_dir = work_dir.join("slots");
        let markers_dir = work_dir.join(MARKERS_DIR);
        for dir in [&slots_dir, &markers_dir] {
            fs::create_dir_all(dir).map_err(IsolationError::new("creating", dir))?;
        }
        Ok(WorkspaceOnly {
            slots_dir,
            markers_dir,
        })
    }

    fn marker(&self, slot: u32) -> PathBuf {
        self.markers_dir.join(slot.to_string())
    }

    /// The node holding `slot` by its marker (by the marker in its workspace `dir`, for a
    /// slot an older agent prepared that has no marker file yet).
    fn holder(&self, slot: u32, dir: &Path) -> Result<Option<NodeId>, IsolationError> {
        let marker = self.marker(slot);
        match read_marker(&marker)? {
            None if !marker.exists() => read_marker(&dir.join(LEGACY_NODE_MARKER)),
            held => Ok(held),
        }
    }
}

impl SlotIsolation for WorkspaceOnly {
    fn name(&self) -> &'static str {
        "none"
    }

    fn workspace(&self, slot: u32) -> PathBuf {
        self.slots_dir.join(slot.to_string())
    }

    fn slot_names(&self) -> SlotNames {
        SlotNames {
            workspace: workspace_template(&self.slots_dir),
            username: None,
        }
    }

    fn quick_setup(&self) -> bool {
        true
    }

    fn warm(&self, slot: u32) -> Result<(), IsolationError> {
        let dir = self.workspace(slot);
        match fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => make_private_dir(&dir)?,
            Err(e) => return Err(IsolationError::new("checking", &dir)(e)),
            Ok(_) if is_empty_dir(&dir) => {
                fs::set_permissions(&dir, fs::Permissions::from_mode(WORKSPACE_MODE))
                    .map_err(IsolationError::new("setting mode 0700 on", &dir))?
            }
            Ok(_) => {
                return Err(IsolationError::new("warming", &dir)(std::io::Error::other(
                    "not an empty directory",
                )))
            }
        }
        write_marker(&self.marker(slot), None)
    }

    /// `destroy` blanked the marker and left the workspace empty with mode 0700: that
    /// is warm, unless there was no workspace directory to empty.
    fn warm_after_destroy(&self, slot: u32) -> Result<(), IsolationError> {
        if fs::symlink_metadata(self.workspace(slot)).is_ok_and(|m| m.is_dir()) {
            Ok(())
        } else {
            self.warm(slot)
        }
    }

    fn prepare_warm(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<&str>,
        _limits: &Limits,
    ) -> Result<PathBuf, IsolationError> {
        let dir = self.workspace(slot);
        if !fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return Err(IsolationError::new("preparing", &dir)(
                std::io::Error::other("the workspace is not a directory"),
            ));
        }
        if let Some(key) = ssh_public_key {
            let ssh_dir = dir.join(".ssh");
            remove_if_present(&ssh_dir)?;
            make_private_dir(&ssh_dir)?;
            write_file(
                &ssh_dir.join("authorized_keys"),
                &with_newline(key),
                PRIVATE_FILE_MODE,
            )?;
        }
        write_marker(&self.marker(slot), Some(node_id))?;
        Ok(dir)
    }

    fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
        write_marker(&self.marker(slot), None)?;
        empty_dir(&self.workspace(slot))
    }

    fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
        let entries = fs::read_dir(&self.slots_dir)
            .map_err(IsolationError::new("listing", &self.slots_dir))?;
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.map_err(IsolationError::new("listing", &self.slots_dir))?;
            let path = entry.path();
            let Some(slot) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                tracing::warn!(path = %path.display(), "ignoring unexpected entry in slots dir");
                continue;
            };
            match self.holder(slot, &path) {
                Ok(Some(node_id)) => found.push(FoundSlot::prepared(slot, node_id)),
                Ok(None) if is_empty_dir(&path) => found.push(FoundSlot::warm(slot)),
                Ok(None) => {
                    tracing::info!(
                        slot,
                        "slot has leftovers but no node marker; treating it as free and cold"
                    )
                }
                Err(err) => tracing::warn!(slot, %err, "treating slot as free"),
            }
        }
        found.sort_by_key(|f| f.slot);
        Ok(found)
    }
}

/// The [`SlotNames`] template of the workspaces `<slots_dir>/<slot>`.
pub fn workspace_template(slots_dir: &Path) -> String {
    slots_dir.join(SlotNames::SLOT).display().to_string()
}

/// The node id in a marker file; `None` when there is no marker or it is blank.
fn read_marker(path: &Path) -> Result<Option<NodeId>, IsolationError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(IsolationError::new("reading", path)(e)),
    };
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    NodeId::parse(text).map(Some).map_err(|err| {
        IsolationError::new("parsing", path)(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            err,
        ))
    })
}

/// Writes the marker record naming `node` (blank for `None`) over the start of the file
/// at `path`, creating it if needed: one fixed-size write, no truncation, no new file
/// once it exists.
fn write_marker(path: &Path, node: Option<&NodeId>) -> Result<(), IsolationError> {
    let mut record = [b' '; MARKER_LEN];
    record[MARKER_LEN - 1] = b'\n';
    if let Some(node) = node {
        let id = node.as_str().as_bytes();
        if id.len() >= MARKER_LEN {
            return Err(IsolationError::new("writing", path)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("node id {node} does not fit a {MARKER_LEN}-byte marker"),
            )));
        }
        record[..id.len()].copy_from_slice(id);
    }
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(PRIVATE_FILE_MODE)
        .open(path)
        .map_err(IsolationError::new("opening", path))?;
    file.write_all_at(&record, 0)
        .map_err(IsolationError::new("writing", path))
}

/// Removes everything in the directory `dir` and checks it is empty; removes `dir`
/// itself only when it is not a directory (a file or a symlink in its place). Fine when
/// there is nothing.
fn empty_dir(dir: &Path) -> Result<(), IsolationError> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(IsolationError::new("checking", dir)(e)),
        Ok(meta) if !meta.is_dir() => return remove_if_present(dir),
        Ok(_) => {}
    }
    // A job may have taken write access away from its workspace.
    fs::set_permissions(dir, fs::Permissions::from_mode(WORKSPACE_MODE))
        .map_err(IsolationError::new("setting mode 0700 on", dir))?;
    let entries = fs::read_dir(dir).map_err(IsolationError::new("listing", dir))?;
    let mut budget = Budget::for_release();
    for entry in entries {
        let entry = entry.map_err(IsolationError::new("listing", dir))?;
        wipe::remove_entry(dir, &entry.file_name(), &mut budget).map_err(wipe_error)?;
    }
    if is_empty_dir(dir) {
        Ok(())
    } else {
        Err(IsolationError::new("emptying", dir)(std::io::Error::other(
            "entries still present after removal",
        )))
    }
}

/// Whether `dir` is a directory (not a symlink) with nothing in it.
pub(crate) fn is_empty_dir(dir: &Path) -> bool {
    fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir())
        && fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
}

/// Removes a file, a symlink or a directory tree (without recursion, following nothing:
/// see [`crate::isolation::wipe`]) within a release's [`Budget`]; fine when there is nothing.
pub(crate) fn remove_if_present(path: &Path) -> Result<(), IsolationError> {
    wipe::remove_path(path, &mut Budget::for_release())
        .map(|_| ())
        .map_err(wipe_error)
}

/// A removal that stopped, as an isolation error naming the path it was removing.
pub(crate) fn wipe_error(err: WipeError) -> IsolationError {
    IsolationError {
        action: "wiping",
        path: err.path().to_path_buf(),
        error: std::io::Error::other(err),
    }
}

pub(crate) fn with_newline(s: &str) -> String {
    let mut s = s.trim_end().to_string();
    s.push('\n');
    s
}

/// Creates `dir` with mode 0700 and its missing parents with 0755 (both less the
/// umask). A recursive `DirBuilder` gives the parents the leaf's mode: the slots'
/// namespace directories, made under the agent's run directory before its placement
/// socket, would make that directory 0700 on a fresh boot and shut every slot user's
/// login out of the socket.
pub(crate) fn create_private_dir_all(dir: &Path) -> std::io::Result<()> {
    if let Some(parent) = dir.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Creates `dir` with mode 0700 (set explicitly, whatever the umask).
pub(crate) fn make_private_dir(dir: &Path) -> Result<(), IsolationError> {
    fs::DirBuilder::new()
        .mode(WORKSPACE_MODE)
        .create(dir)
        .map_err(IsolationError::new("creating", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(WORKSPACE_MODE))
        .map_err(IsolationError::new("setting mode 0700 on", dir))
}

/// Writes a new file with `mode`. Not synced to disk: these files (node markers, slot
/// state, keys) matter across agent restarts, which keep the page cache; a host crash
/// ends every job of the node anyway, and recovery treats an unreadable or torn file as
/// a free, cold slot and wipes it. An fsync here cost up to tens of milliseconds on the
/// hot path of every prepare.
pub(crate) fn write_file(path: &Path, contents: &str, mode: u32) -> Result<(), IsolationError> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(IsolationError::new("creating", path))?;
    file.write_all(contents.as_bytes())
        .map_err(IsolationError::new("writing", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_keep_the_wires_shape_in_the_state_file() {
        let wire = SlotLimits {
            cpu_millis: Some(1500),
            memory_bytes: Some(1 << 30),
            pids: Some(64),
            disk_bytes: Some(1 << 32),
        };
        for wire in [wire, SlotLimits::default()] {
            let limits = Limits::from(&wire);
            assert_eq!(
                serde_json::to_value(limits).unwrap(),
                serde_json::to_value(wire).unwrap()
            );
            let back: Limits = serde_json::from_value(serde_json::to_value(wire).unwrap()).unwrap();
            assert_eq!(back, limits, "a state file written before reads the same");
        }
    }
    use std::os::unix::fs::MetadataExt;

    fn node(s: &str) -> NodeId {
        NodeId::parse(s).unwrap()
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn inode(path: &Path) -> u64 {
        fs::symlink_metadata(path).unwrap().ino()
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn create_makes_a_private_workspace_with_key_and_marker() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        let ws = iso
            .create(
                3,
                &node("node-a"),
                Some("ssh-ed25519 AAAA me"),
                &Limits::default(),
            )
            .unwrap();
        assert_eq!(ws, work.path().join("slots/3"));
        assert_eq!(mode(&ws), 0o700);
        let keys = ws.join(".ssh/authorized_keys");
        assert_eq!(fs::read_to_string(&keys).unwrap(), "ssh-ed25519 AAAA me\n");
        assert_eq!(mode(&keys), 0o600);
        assert_eq!(mode(&ws.join(".ssh")), 0o700);
        assert_eq!(
            entries(&ws),
            [".ssh"],
            "the marker is outside the workspace"
        );
        let marker = work.path().join("markers/3");
        assert_eq!(mode(&marker), 0o600);
        assert_eq!(fs::metadata(&marker).unwrap().len(), MARKER_LEN as u64);
        assert_eq!(
            iso.recover().unwrap(),
            vec![FoundSlot::prepared(3, node("node-a"))]
        );
    }

    #[test]
    fn create_wipes_leftovers_and_destroy_is_idempotent() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        let ws = iso
            .create(
                0,
                &node("node-a"),
                Some("ssh-ed25519 K"),
                &Limits::default(),
            )
            .unwrap();
        fs::create_dir_all(ws.join("deep/er")).unwrap();
        fs::write(ws.join("deep/er/file"), "x").unwrap();
        fs::write(ws.join(".hidden"), "x").unwrap();
        let ws = iso
            .create(0, &node("node-b"), None, &Limits::default())
            .unwrap();
        assert!(entries(&ws).is_empty(), "{:?}", entries(&ws));
        iso.destroy(0).unwrap();
        assert!(is_empty_dir(&ws));
        assert_eq!(
            iso.recover().unwrap(),
            vec![FoundSlot::warm(0)],
            "a released slot names no node"
        );
        iso.destroy(0).unwrap();
        iso.destroy(7).unwrap();
    }

    #[test]
    fn release_and_prepare_reuse_the_workspace_and_the_marker_in_place() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        let limits = Limits::default();
        iso.create(
            1,
            &node("a-much-longer-node-id-than-the-next"),
            None,
            &limits,
        )
        .unwrap();
        let ws = iso.workspace(1);
        let marker = work.path().join("markers/1");
        let (ws_inode, marker_inode) = (inode(&ws), inode(&marker));
        for (n, id) in ["node-b", "node-c"].into_iter().enumerate() {
            fs::write(ws.join(format!("output-{n}")), "of the job").unwrap();
            iso.destroy(1).unwrap();
            iso.warm_after_destroy(1).unwrap();
            iso.prepare_warm(1, &node(id), None, &limits).unwrap();
            assert_eq!(
                iso.recover().unwrap(),
                vec![FoundSlot::prepared(1, node(id))],
                "a shorter id leaves nothing of the longer one"
            );
            assert!(entries(&ws).is_empty(), "{:?}", entries(&ws));
            assert_eq!(
                inode(&ws),
                ws_inode,
                "the workspace is kept, not made again"
            );
            assert_eq!(
                inode(&marker),
                marker_inode,
                "the marker is rewritten in place"
            );
            assert_eq!(fs::metadata(&marker).unwrap().len(), MARKER_LEN as u64);
        }
    }

    #[test]
    fn a_warm_up_after_a_destroy_makes_a_workspace_that_was_not_there() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        let limits = Limits::default();
        let ws = iso.workspace(2);
        // A job replaced its workspace with a file: destroy removes it, and the warm-up
        // must make the directory again.
        iso.create(2, &node("node-a"), None, &limits).unwrap();
        fs::remove_dir(&ws).unwrap();
        fs::write(&ws, "not a directory").unwrap();
        iso.destroy(2).unwrap();
        assert!(fs::symlink_metadata(&ws).is_err());
        iso.warm_after_destroy(2).unwrap();
        assert!(is_empty_dir(&ws));
        assert_eq!(
            fs::metadata(&ws).unwrap().permissions().mode() & 0o777,
            WORKSPACE_MODE
        );
        assert_eq!(iso.recover().unwrap(), vec![FoundSlot::warm(2)]);
        iso.prepare_warm(2, &node("node-b"), None, &limits).unwrap();
        assert_eq!(
            iso.recover().unwrap(),
            vec![FoundSlot::prepared(2, node("node-b"))]
        );
    }

    #[test]
    fn destroy_empties_what_a_job_did_to_its_workspace() {
        let work = tempfile::tempdir().unwrap();
        let outside = work.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "x").unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        let ws = iso
            .create(0, &node("node-a"), None, &Limits::default())
            .unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("link")).unwrap();
        fs::create_dir(ws.join("sub")).unwrap();
        fs::set_permissions(&ws, fs::Permissions::from_mode(0o500)).unwrap();
        iso.destroy(0).unwrap();
        assert!(is_empty_dir(&ws));
        assert!(
            outside.join("precious").exists(),
            "symlinks are not followed"
        );
        iso.warm(0).unwrap();
        assert_eq!(mode(&ws), 0o700);

        // A file in place of the workspace is removed; warm-up makes the directory.
        fs::remove_dir(&ws).unwrap();
        fs::write(&ws, "not a dir").unwrap();
        assert!(iso.warm(0).is_err());
        assert!(iso
            .prepare_warm(0, &node("node-b"), None, &Limits::default())
            .is_err());
        iso.destroy(0).unwrap();
        iso.warm(0).unwrap();
        assert!(is_empty_dir(&ws));
        assert_eq!(mode(&ws), 0o700);
    }

    #[test]
    fn a_warm_slot_is_an_empty_workspace_that_prepare_fills() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        iso.warm(2).unwrap();
        let ws = work.path().join("slots/2");
        assert_eq!(mode(&ws), 0o700);
        assert_eq!(iso.recover().unwrap(), vec![FoundSlot::warm(2)]);
        let got = iso
            .prepare_warm(
                2,
                &node("node-a"),
                Some("ssh-ed25519 K"),
                &Limits::default(),
            )
            .unwrap();
        assert_eq!(got, ws);
        assert_eq!(
            fs::read_to_string(ws.join(".ssh/authorized_keys")).unwrap(),
            "ssh-ed25519 K\n"
        );
        assert_eq!(
            iso.recover().unwrap(),
            vec![FoundSlot::prepared(2, node("node-a"))]
        );
        // Warming a slot with something in it fails rather than reuse what is there.
        assert!(iso.warm(2).is_err());
        // Something written into a free slot makes it cold again.
        iso.destroy(2).unwrap();
        iso.warm(2).unwrap();
        fs::write(ws.join("stray"), "x").unwrap();
        assert!(iso.recover().unwrap().is_empty());
        assert!(iso.warm(2).is_err());
        iso.destroy(2).unwrap();
        assert!(!ws.join("stray").exists(), "stray files are wiped");
    }

    #[test]
    fn recover_skips_unmarked_and_foreign_entries() {
        let work = tempfile::tempdir().unwrap();
        let iso = WorkspaceOnly::new(work.path()).unwrap();
        iso.create(1, &node("node-a"), None, &Limits::default())
            .unwrap();
        iso.create(5, &node("node-b"), None, &Limits::default())
            .unwrap();
        let slots = work.path().join("slots");
        let markers = work.path().join("markers");
        fs::create_dir(slots.join("2")).unwrap();
        fs::create_dir(slots.join("notaslot")).unwrap();
        // Leftovers without a marker: free and cold.
        fs::create_dir(slots.join("3")).unwrap();
        fs::write(slots.join("3/left"), "x").unwrap();
        // A marker that does not hold a node id, or is torn: treated as free and cold.
        fs::create_dir(slots.join("4")).unwrap();
        fs::write(markers.join("4"), "bad id!\n").unwrap();
        fs::create_dir(slots.join("6")).unwrap();
        fs::write(markers.join("6"), b"node-\0\0\0").unwrap();
        // A slot prepared by an agent that kept the marker in the workspace.
        fs::create_dir(slots.join("7")).unwrap();
        fs::write(slots.join("7").join(LEGACY_NODE_MARKER), "node-c\n").unwrap();
        let found = iso.recover().unwrap();
        assert_eq!(
            found,
            vec![
                FoundSlot::prepared(1, node("node-a")),
                FoundSlot::warm(2),
                FoundSlot::prepared(5, node("node-b")),
                FoundSlot::prepared(7, node("node-c")),
            ]
        );
        // Once released, the old marker goes with the rest of the workspace.
        iso.destroy(7).unwrap();
        assert_eq!(iso.recover().unwrap().last(), Some(&FoundSlot::warm(7)));
    }

    #[test]
    fn errors_name_the_path() {
        let work = tempfile::tempdir().unwrap();
        let file = work.path().join("plainfile");
        fs::write(&file, "").unwrap();
        let err = WorkspaceOnly::new(&file).unwrap_err().to_string();
        assert!(
            err.starts_with("creating ") && err.contains("plainfile/slots"),
            "{err}"
        );
    }
}
