//! Isolation mode `users`: every slot has its own Unix user, home/workspace (mode 0700)
//! and cgroup with the label's limits. Needs root.
//!
//! On-disk layout under the work dir (the work dir and `slots/` are 0711 so slot users
//! can reach their own home and nothing else):
//!
//! ```text
//! <work-dir>/slots/<slot>/                        workspace = home, owned by the slot user, 0700
//! <work-dir>/slots/<slot>/.ssh/authorized_keys    root-owned (the user cannot add keys)
//! <work-dir>/state/<slot>.json                    root-only: node id, user, limits; written last
//! ```
//!
//! **Prepare** wipes any leftovers (as release does), creates the user (`useradd`,
//! name from [`crate::users::user_name`]), the workspace, the key and the cgroup, and
//! writes the state file last.
//!
//! **Placement.** Every process of a slot must end up in the slot's cgroup:
//! - SSH logins go through `slotpool-agent enter-slot` (sshd `ForceCommand`; see
//!   [`crate::enter`]): the helper, running as the slot user, asks the agent over a Unix
//!   socket to move it into the cgroup (the agent trusts only `SO_PEERCRED`), then execs
//!   the user's shell or command, so everything the login starts inherits the cgroup.
//! - A sweep ([`SlotIsolation::sweep`], every [`crate::PLACEMENT_SWEEP_INTERVAL`]) moves
//!   any process owned by a slot user that is not in its cgroup (the sshd session process
//!   itself, logins that bypassed the helper) as a backstop.
//!
//! **Release** kills by cgroup (freeze, SIGKILL all, thaw, until empty) *and* by uid
//! (`kill(-1)` as the user, until no process has the uid), so neither a process that left
//! the cgroup nor one that double-forked or called setsid survives. Then it removes the
//! cgroup, the workspace (with the key), what the uid owns in `/tmp`, `/var/tmp` and
//! `/dev/shm`, and the user, and **verifies** the slot is clean (no process with the uid,
//! no cgroup, no workspace, no user) before reporting success.

use crate::cgroup::CgroupDriver;
use crate::isolation::{
    make_private_dir, with_newline, write_file, FoundSlot, IsolationError, SlotIsolation,
};
use crate::users::{self, UserInfo};
use serde::{Deserialize, Serialize};
use slotpool_protocol::api::SlotLimits;
use slotpool_protocol::NodeId;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Mode of the work dir and `slots/`: slot users may pass through, not list.
const TRAVERSE_MODE: u32 = 0o711;
/// Login shell of slot users.
pub const SLOT_SHELL: &str = "/bin/bash";

/// What the state file of a prepared slot holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct SlotState {
    node_id: NodeId,
    user: String,
    #[serde(default)]
    limits: SlotLimits,
}

/// A prepared slot's user.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Active {
    user: String,
    uid: u32,
}

/// One user and one cgroup per slot.
pub struct UserIsolation {
    slots_dir: PathBuf,
    state_dir: PathBuf,
    namespace: String,
    backing_id: String,
    cgroups: Box<dyn CgroupDriver>,
    proc_root: PathBuf,
    tmp_dirs: Vec<PathBuf>,
    active: Mutex<BTreeMap<u32, Active>>,
}

impl UserIsolation {
    /// Sets up `<work_dir>/slots` and `<work_dir>/state`. `namespace` prefixes user names.
    pub fn new(
        work_dir: &Path,
        namespace: String,
        backing_id: String,
        cgroups: Box<dyn CgroupDriver>,
    ) -> Result<UserIsolation, IsolationError> {
        let slots_dir = work_dir.join("slots");
        let state_dir = work_dir.join("state");
        for dir in [&slots_dir, &state_dir] {
            fs::create_dir_all(dir).map_err(IsolationError::new("creating", dir))?;
        }
        for dir in [work_dir, &slots_dir] {
            fs::set_permissions(dir, fs::Permissions::from_mode(TRAVERSE_MODE))
                .map_err(IsolationError::new("setting mode 0711 on", dir))?;
        }
        fs::set_permissions(&state_dir, fs::Permissions::from_mode(0o700))
            .map_err(IsolationError::new("setting mode 0700 on", &state_dir))?;
        Ok(UserIsolation {
            slots_dir,
            state_dir,
            namespace,
            backing_id,
            cgroups,
            proc_root: PathBuf::from("/proc"),
            tmp_dirs: ["/tmp", "/var/tmp", "/dev/shm"]
                .iter()
                .map(PathBuf::from)
                .collect(),
            active: Mutex::new(BTreeMap::new()),
        })
    }

    /// The cgroup version in use (`v1` or `v2`).
    pub fn cgroup_version(&self) -> &'static str {
        self.cgroups.version()
    }

    fn user(&self, slot: u32) -> String {
        users::user_name(&self.namespace, slot)
    }

    fn state_file(&self, slot: u32) -> PathBuf {
        self.state_dir.join(format!("{slot}.json"))
    }

    fn active(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Active>> {
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn write_state(&self, slot: u32, state: &SlotState) -> Result<(), IsolationError> {
        let file = self.state_file(slot);
        let tmp = file.with_extension("json.tmp");
        let _ = fs::remove_file(&tmp);
        let json = serde_json::to_string(state).expect("slot state serializes");
        write_file(&tmp, &with_newline(&json), 0o600)?;
        fs::rename(&tmp, &file).map_err(IsolationError::new("renaming", &tmp))
    }

    /// Workspace owned by the user, 0700; the key root-owned in `.ssh`.
    fn make_workspace(
        &self,
        dir: &Path,
        info: &UserInfo,
        ssh_public_key: Option<&str>,
    ) -> Result<(), IsolationError> {
        make_private_dir(dir)?;
        if let Some(key) = ssh_public_key {
            let ssh_dir = dir.join(".ssh");
            fs::create_dir(&ssh_dir).map_err(IsolationError::new("creating", &ssh_dir))?;
            fs::set_permissions(&ssh_dir, fs::Permissions::from_mode(0o755))
                .map_err(IsolationError::new("setting mode 0755 on", &ssh_dir))?;
            write_file(&ssh_dir.join("authorized_keys"), &with_newline(key), 0o644)?;
        }
        std::os::unix::fs::chown(dir, Some(info.uid), Some(info.gid))
            .map_err(IsolationError::new("changing owner of", dir))
    }

    /// What is left of a slot after cleaning, or `None` when it is clean.
    fn leftovers(&self, slot: u32, uid: Option<u32>) -> Option<String> {
        let user = self.user(slot);
        let mut left = Vec::new();
        if let Some(uid) = uid {
            let procs = users::processes_of(&self.proc_root, uid);
            if !procs.is_empty() {
                left.push(format!("processes {procs:?} of uid {uid}"));
            }
        }
        for path in self.cgroups.paths(&user) {
            if path.exists() {
                left.push(format!("cgroup {}", path.display()));
            }
        }
        let ws = self.workspace(slot);
        if fs::symlink_metadata(&ws).is_ok() {
            left.push(format!("workspace {}", ws.display()));
        }
        if users::lookup(&user).is_some() {
            left.push(format!("user {user}"));
        }
        (!left.is_empty()).then(|| left.join(", "))
    }
}

impl SlotIsolation for UserIsolation {
    fn name(&self) -> &'static str {
        "users"
    }

    fn workspace(&self, slot: u32) -> PathBuf {
        self.slots_dir.join(slot.to_string())
    }

    fn create(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<&str>,
        limits: &SlotLimits,
    ) -> Result<PathBuf, IsolationError> {
        self.destroy(slot)?;
        let user = self.user(slot);
        let dir = self.workspace(slot);
        let comment = format!("slotpool slot {slot} of {}", self.backing_id);
        let info = users::add(&user, &dir, SLOT_SHELL, &comment)?;
        self.make_workspace(&dir, &info, ssh_public_key)?;
        self.cgroups.create(&user, limits)?;
        self.write_state(
            slot,
            &SlotState {
                node_id: node_id.clone(),
                user: user.clone(),
                limits: *limits,
            },
        )?;
        self.active().insert(
            slot,
            Active {
                user,
                uid: info.uid,
            },
        );
        Ok(dir)
    }

    fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
        let user = self.user(slot);
        let info = users::lookup(&user);
        self.cgroups.kill_all(&user)?;
        if let Some(info) = &info {
            users::kill_uid(&self.proc_root, info.uid, info.gid)?;
        }
        self.cgroups.remove(&user)?;
        let ws = self.workspace(slot);
        match fs::remove_dir_all(&ws) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(IsolationError::new("removing", &ws)(e)),
        }
        if let Some(info) = &info {
            let dirs: Vec<&Path> = self.tmp_dirs.iter().map(PathBuf::as_path).collect();
            for err in users::remove_owned_in(&dirs, info.uid) {
                tracing::warn!(slot, %err, "cannot remove a file the slot user left");
            }
        }
        users::remove(&user)?;
        if let Some(left) = self.leftovers(slot, info.as_ref().map(|i| i.uid)) {
            return Err(IsolationError::new("verifying slot is clean", &ws)(
                std::io::Error::other(format!("still present: {left}")),
            ));
        }
        let state = self.state_file(slot);
        match fs::remove_file(&state) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(IsolationError::new("removing", &state)(e)),
        }
        self.active().remove(&slot);
        Ok(())
    }

    fn recover(&self) -> Result<Vec<FoundSlot>, IsolationError> {
        let entries = fs::read_dir(&self.state_dir)
            .map_err(IsolationError::new("listing", &self.state_dir))?;
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(slot) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let state: SlotState = match fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
            {
                Ok(state) => state,
                Err(err) => {
                    tracing::warn!(slot, path = %path.display(), %err, "unreadable slot state; treating the slot as free");
                    continue;
                }
            };
            let Some(info) = users::lookup(&state.user) else {
                tracing::warn!(
                    slot,
                    user = state.user,
                    "slot user is gone; treating the slot as free"
                );
                continue;
            };
            // Re-apply the limits (the group may be gone after a reboot).
            self.cgroups.create(&state.user, &state.limits)?;
            self.active().insert(
                slot,
                Active {
                    user: state.user,
                    uid: info.uid,
                },
            );
            found.push(FoundSlot {
                slot,
                node_id: state.node_id,
            });
        }
        found.sort_by_key(|f| f.slot);
        Ok(found)
    }

    fn username(&self, slot: u32) -> Option<String> {
        self.active().get(&slot).map(|a| a.user.clone())
    }

    fn place(&self, uid: u32, pid: i32) -> Result<Option<u32>, IsolationError> {
        let Some((slot, user)) = self
            .active()
            .iter()
            .find(|(_, a)| a.uid == uid)
            .map(|(s, a)| (*s, a.user.clone()))
        else {
            return Ok(None);
        };
        self.cgroups.add(&user, pid)?;
        Ok(Some(slot))
    }

    fn sweep(&self) -> usize {
        let active: Vec<(u32, Active)> =
            self.active().iter().map(|(s, a)| (*s, a.clone())).collect();
        let mut moved = 0;
        for (slot, a) in active {
            let inside = self.cgroups.procs(&a.user).unwrap_or_default();
            for pid in users::processes_of(&self.proc_root, a.uid) {
                if inside.contains(&pid) {
                    continue;
                }
                match self.cgroups.add(&a.user, pid) {
                    Ok(()) => {
                        moved += 1;
                        tracing::debug!(slot, pid, "moved a slot process into its cgroup");
                    }
                    // It may have exited meanwhile.
                    Err(err) => tracing::debug!(slot, pid, %err, "cannot move process"),
                }
            }
        }
        moved
    }

    fn stop_all(&self) -> Result<(), IsolationError> {
        let active: Vec<Active> = self.active().values().cloned().collect();
        let mut first_error = None;
        for a in active {
            let result = self.cgroups.kill_all(&a.user).and_then(|()| {
                let gid = users::lookup(&a.user).map_or(a.uid, |i| i.gid);
                users::kill_uid(&self.proc_root, a.uid, gid)
            });
            if let Err(err) = result {
                tracing::warn!(user = a.user, %err, "cannot stop slot processes");
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
