//! Isolation mode `users`: every slot has its own Unix user, home/workspace (mode 0700)
//! and cgroup with the label's limits. Needs root.
//!
//! On-disk layout under the work dir (the work dir and `slots/` are 0711 so slot users
//! can reach their own home and nothing else):
//!
//! ```text
//! <work-dir>/slots/<slot>/                        workspace = home, owned by the slot user, 0700
//! <work-dir>/slots/<slot>/.ssh/authorized_keys    root-owned (the user cannot add keys)
//! <work-dir>/state/<slot>.json                    root-only: user, uid, limits and the node id
//!                                                 (none while warm); written last; a
//!                                                 fixed-size record rewritten in place,
//!                                                 blank once the slot is released
//! ```
//!
//! **Warm-up** ([`SlotIsolation::warm`], on a slot a release just verified clean, or one
//! wiped first) gives the user the release kept the next uid of the range
//! ([`crate::isolation::passwd::renumber`]) or creates it (`useradd`, name from
//! [`crate::isolation::passwd::user_name`]), makes the empty workspace and the cgroup (no limits),
//! and writes the state file without a node. Nobody can use a warm slot: the user has no
//! password and no key, so no login is possible, and no process of it can exist (release
//! killed them all before the user got its new uid).
//!
//! **Prepare** of a warm slot checks the user is still the one warmed (same uid), writes
//! the key, applies the label's limits to the existing cgroup and writes the state file
//! with the node last. The full path ([`SlotIsolation::create`], a cold slot) wipes any
//! leftovers (as release does), warms, then does the same.
//!
//! **Placement.** Every process of a slot must end up in the slot's cgroup:
//! - SSH logins go through `slotpool-agent enter-slot` (sshd `ForceCommand`; see
//!   [`crate::isolation::enter`]): the helper, running as the slot user, asks the agent over a Unix
//!   socket (the agent trusts only `SO_PEERCRED`), which moves it into the cgroup and
//!   starts the user's shell or command inside the slot ([`crate::isolation::start`]), so
//!   everything the login starts is in the cgroup from its first instruction.
//! - A sweep ([`SlotIsolation::sweep`], every [`crate::PLACEMENT_SWEEP_INTERVAL`]) moves
//!   any process owned by a slot user that is not in its cgroup (the sshd session process
//!   itself, logins that bypassed the helper) as a backstop.
//!
//! **Release** first sends SIGTERM to every process of the slot's cgroup and gives them
//! `--slot-term-grace-ms` to exit (returning as soon as the group is empty), then kills
//! by cgroup (freeze, SIGKILL all, thaw, until empty) *and* by uid
//! (`kill(-1)` as the user, until no process has the uid), so neither a process that left
//! the cgroup nor one that double-forked or called setsid survives. Then it empties the
//! cgroup (kept for the next tenancy, [`CgroupDriver::empty`]), removes the workspace
//! (with the key; see [`crate::isolation::wipe`]), what the uid owns in the
//! host's shared directories ([`crate::isolation::shared_dirs`]), its System V IPC objects, the
//! user's crontab, at jobs and mail, and **verifies** the slot is clean (no process or IPC
//! object of the uid, no process in the cgroup, no workspace, no crontab; the shared directories were
//! listed once no process of the uid was left, and any entry their removal could not
//! take is a problem) before reporting success. It keeps the user for the warm-up to renumber; a slot that
//! is not clean loses its user, and so does a slot removed for good
//! ([`SlotIsolation::destroy`]). Any removal that failed is an error too:
//! the slot becomes dirty with the reasons.
//!
//! **Disk quota.** A slot with a disk limit (its label's, or the agent's default) has a
//! file-system image of that size mounted as its workspace ([`crate::isolation::disk_quota`]); the
//! warm-up makes it at the default size, and a prepare asking for another size makes it
//! again (the workspace is empty then). Release unmounts and deletes it before the wipe.
//!
//! **uids.** Each warm-up makes the user with the next uid of the agent's range
//! ([`crate::isolation::uid_range`]), never the uid just freed, so nothing the old uid may still own
//! somewhere passes to the next tenant of the slot.

use super::passwd::{self, UserInfo};
use super::procs;
use super::Limits;
use crate::isolation::cgroup::CgroupDriver;
use crate::isolation::disk_quota::WorkspaceImages;
use crate::isolation::netns::{NetnsError, SlotNetworks};
use crate::isolation::private_tmp::{CopyOf, SlotMounts};
use crate::isolation::shared_dirs;
use crate::isolation::start::NsKind;
use crate::isolation::start::SlotEntry;
use crate::isolation::uid_range::UidAllocator;
use crate::isolation::wipe::Budget;
use crate::isolation::{
    is_empty_dir, make_private_dir, remove_if_present, with_newline, workspace_template,
    write_file, FoundSlot, IsolationError, SlotIsolation,
};
use crate::step_clock::StepClock;
use serde::{Deserialize, Serialize};
use slotpool_protocol::api::SlotOccupants;
use slotpool_protocol::model::SlotNames;
use slotpool_protocol::NodeId;
use std::collections::BTreeMap;
use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// Mode of the work dir and `slots/`: slot users may pass through, not list.
const TRAVERSE_MODE: u32 = 0o711;
/// How many uids a warm-up tries when `useradd` finds each one taken.
const UID_ATTEMPTS: u32 = 16;
/// Size of a slot's state file: a record rewritten in place (see
/// [`UserIsolation::write_state_record`]).
const STATE_LEN: usize = 1024;
/// Login shell of slot users.
pub const SLOT_SHELL: &str = "/bin/bash";

/// Directories holding a file named after each user (crontabs, mailboxes), removed on
/// release whoever owns them.
const PER_USER_FILE_DIRS: [&str; 4] = [
    "/var/spool/cron/crontabs",
    "/var/spool/cron",
    "/var/mail",
    "/var/spool/mail",
];

/// What the state file of a warm or prepared slot holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct SlotState {
    /// The node holding the slot; none while the slot is warm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node_id: Option<NodeId>,
    user: String,
    /// The uid the user had when the slot was warmed (absent in older files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uid: Option<u32>,
    #[serde(default)]
    limits: Limits,
    /// Size of the workspace's image; none when the workspace is a plain directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    disk_bytes: Option<u64>,
}

/// The user of a warm or prepared slot.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlotUser {
    user: String,
    uid: u32,
    gid: u32,
    /// Held by a node (logins placed, processes swept), not just warm.
    prepared: bool,
    /// Size of the workspace's image, if it has one.
    disk_bytes: Option<u64>,
}

/// Whether cleaning a slot keeps its user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeepUser {
    /// The user is deleted (a cold slot made anew, slots removed on stop).
    No,
    /// Kept for the slot's next tenancy when the slot is verified clean (release).
    IfClean,
}

/// One user and one cgroup per slot.
pub struct UserIsolation {
    slots_dir: PathBuf,
    state_dir: PathBuf,
    namespace: String,
    backing_id: String,
    cgroups: Box<dyn CgroupDriver>,
    uids: UidAllocator,
    proc_root: PathBuf,
    /// The release path's scans of `proc_root`, shared by concurrent releases.
    scans: procs::SharedScans,
    /// Where the password database is (`/etc`).
    etc: PathBuf,
    /// World-writable directories and spools, cleaned of the uid's entries at release
    /// (see [`crate::isolation::shared_dirs`]).
    shared_dirs: Vec<PathBuf>,
    per_user_file_dirs: Vec<PathBuf>,
    users: Mutex<BTreeMap<u32, SlotUser>>,
    /// The limits in the files of each slot's cgroup, as this agent last wrote them: a
    /// cgroup kept from the last tenancy whose limits are those wanted is not written
    /// again (its files are root's; nothing of a slot changes them). Forgotten when the
    /// cgroup goes or a write to it fails.
    cgroup_limits: Mutex<BTreeMap<u32, Limits>>,
    /// A network namespace per slot (`--slot-netns on`), see [`crate::isolation::netns`].
    network: Option<SlotNetworks>,
    /// A private `/tmp` per slot (`--slot-private-tmp on`), see
    /// [`crate::isolation::private_tmp`].
    private_tmp: Option<SlotMounts>,
    /// Quota'd workspaces (see [`crate::isolation::disk_quota`]); `None`: none can be made.
    images: Option<WorkspaceImages>,
    /// The disk limit warm slots are made with (the default limit).
    warm_disk_bytes: Option<u64>,
    /// The limits a warm slot's cgroup holds: those a prepare without limits of its
    /// label applies (the agent's defaults), so that it writes none.
    warm_limits: Limits,
    /// How long a slot's processes have to exit on SIGTERM at release before they are
    /// killed (`--slot-term-grace-ms`); zero: killed at once.
    term_grace: Duration,
}

/// The default of `--slot-term-grace-ms`.
pub const DEFAULT_TERM_GRACE: Duration = Duration::from_secs(2);

impl UserIsolation {
    /// Sets up `<work_dir>/slots` and `<work_dir>/state`. `namespace` prefixes user names.
    pub fn new(
        work_dir: &Path,
        namespace: String,
        backing_id: String,
        cgroups: Box<dyn CgroupDriver>,
        uids: UidAllocator,
        shared_dirs: Vec<PathBuf>,
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
            uids,
            proc_root: PathBuf::from("/proc"),
            scans: procs::SharedScans::new(PathBuf::from("/proc")),
            etc: PathBuf::from("/etc"),
            shared_dirs,
            per_user_file_dirs: PER_USER_FILE_DIRS.iter().map(PathBuf::from).collect(),
            users: Mutex::new(BTreeMap::new()),
            cgroup_limits: Mutex::new(BTreeMap::new()),
            network: None,
            private_tmp: None,
            images: None,
            warm_disk_bytes: None,
            warm_limits: Limits::default(),
            term_grace: DEFAULT_TERM_GRACE,
        })
    }

    /// How long a slot's processes get to exit on SIGTERM at release.
    pub fn with_term_grace(mut self, grace: Duration) -> UserIsolation {
        self.term_grace = grace;
        self
    }

    /// SIGTERM to every process of the slot's group, and a wait of at most the grace
    /// for them to exit; what is left, the kill that follows gets. Never fails: a
    /// problem here only means the kill comes sooner.
    fn terminate(&self, user: &str) {
        if self.term_grace.is_zero() {
            return;
        }
        match self.cgroups.terminate(user, self.term_grace) {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(user, grace = ?self.term_grace, "slot processes outlived SIGTERM; killing them")
            }
            Err(err) => {
                tracing::warn!(user, %err, "cannot stop the slot's processes with SIGTERM; killing them")
            }
        }
    }

    /// Gives every slot a network namespace of its own (made at warm-up, removed at
    /// release).
    pub fn with_network(mut self, network: SlotNetworks) -> UserIsolation {
        self.network = Some(network);
        self
    }

    /// Gives every slot a private `/tmp`, `/var/tmp` and `/dev/shm` (made at warm-up,
    /// gone at release).
    pub fn with_private_tmp(mut self, mounts: SlotMounts) -> UserIsolation {
        self.private_tmp = Some(mounts);
        self
    }

    fn private_tmp_error(
        &self,
        slot: u32,
        err: crate::isolation::private_tmp::PrivateTmpError,
    ) -> IsolationError {
        IsolationError::new("the private /tmp of slot", &self.workspace(slot))(
            std::io::Error::other(err.to_string()),
        )
    }

    fn network_error(&self, slot: u32, err: NetnsError) -> IsolationError {
        IsolationError::new("the network namespace of slot", &self.workspace(slot))(
            std::io::Error::other(err.to_string()),
        )
    }

    /// Gives slots with a disk limit an image of that size as workspace; warm slots get
    /// `default_bytes` (none: a plain directory).
    pub fn with_disk_quotas(
        mut self,
        images: WorkspaceImages,
        default_bytes: Option<u64>,
    ) -> UserIsolation {
        self.images = Some(images);
        self.warm_disk_bytes = default_bytes;
        self
    }

    /// Gives warm slots' cgroups `defaults` (the agent's default limits; the disk limit
    /// is [`UserIsolation::with_disk_quotas`]'s).
    pub fn with_warm_limits(mut self, defaults: Limits) -> UserIsolation {
        self.warm_limits = Limits {
            disk_bytes: None,
            ..defaults
        };
        self
    }

    /// The cgroup version in use (`v1` or `v2`).
    pub fn cgroup_version(&self) -> &'static str {
        self.cgroups.version()
    }

    fn user(&self, slot: u32) -> String {
        passwd::user_name(&self.namespace, slot)
    }

    fn state_file(&self, slot: u32) -> PathBuf {
        self.state_dir.join(format!("{slot}.json"))
    }

    fn users(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, SlotUser>> {
        self.users.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cgroup_limits(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Limits>> {
        self.cgroup_limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives the cgroup of `slot` (named `user`) the group `gid` and `limits`: made when
    /// this agent has not made it yet, else (kept from the slot's last tenancy) given
    /// the group again when `reown`, and only the limits that differ from those it holds.
    fn set_cgroup(
        &self,
        slot: u32,
        user: &str,
        gid: u32,
        limits: &Limits,
        reown: bool,
    ) -> Result<(), IsolationError> {
        let wanted = Limits {
            disk_bytes: None,
            ..*limits
        };
        let held = self.cgroup_limits().remove(&slot);
        let result = match held {
            Some(held) => {
                let kept = match reown {
                    true => self.cgroups.reown(user, gid),
                    false => Ok(()),
                };
                kept.and_then(|()| match held == wanted {
                    true => Ok(()),
                    false => self.cgroups.limit(user, &wanted),
                })
                // Gone meanwhile, say: made again.
                .or_else(|_| self.cgroups.create(user, gid, &wanted))
            }
            None => self.cgroups.create(user, gid, &wanted),
        };
        if result.is_ok() {
            self.cgroup_limits().insert(slot, wanted);
        }
        result
    }

    /// The users of prepared slots, by slot.
    fn prepared_users(&self) -> Vec<(u32, SlotUser)> {
        self.users()
            .iter()
            .filter(|(_, u)| u.prepared)
            .map(|(s, u)| (*s, u.clone()))
            .collect()
    }

    /// The files named after `user` in the per-user spools that exist.
    fn per_user_files(&self, user: &str) -> Vec<PathBuf> {
        self.per_user_file_dirs
            .iter()
            .map(|d| d.join(user))
            .filter(|f| fs::symlink_metadata(f).is_ok_and(|m| !m.is_dir()))
            .collect()
    }

    fn write_state(&self, slot: u32, state: &SlotState) -> Result<(), IsolationError> {
        let json = serde_json::to_string(state).expect("slot state serializes");
        self.write_state_record(slot, &json)
    }

    /// Rewrites the slot's state file in place as a [`STATE_LEN`]-byte record: `text`
    /// padded with spaces (blank: a released slot). One write of a file that stays,
    /// rather than a new file renamed over it at every warm-up and prepare: like any
    /// other file the agent writes (see [`write_file`]), a record torn by a host crash
    /// reads as unreadable, and the slot as free and cold.
    fn write_state_record(&self, slot: u32, text: &str) -> Result<(), IsolationError> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let file = self.state_file(slot);
        if text.len() >= STATE_LEN {
            return Err(IsolationError::new("writing", &file)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a slot state of {} bytes does not fit a {STATE_LEN}-byte record",
                    text.len()
                ),
            )));
        }
        let mut record = vec![b' '; STATE_LEN];
        record[..text.len()].copy_from_slice(text.as_bytes());
        record[STATE_LEN - 1] = b'\n';
        let open = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&file)
            .map_err(IsolationError::new("opening", &file))?;
        open.write_all_at(&record, 0)
            .map_err(IsolationError::new("writing", &file))?;
        // A longer file of an older agent: its tail goes.
        let len = open
            .metadata()
            .map_err(IsolationError::new("reading", &file))?
            .len();
        if len > STATE_LEN as u64 {
            open.set_len(STATE_LEN as u64)
                .map_err(IsolationError::new("truncating", &file))?;
        }
        Ok(())
    }

    /// The next uid of the range no user has (see [`crate::isolation::uid_range`]).
    fn next_uid(&self, user: &str) -> Result<u32, IsolationError> {
        self.uids
            .allocate(|uid| passwd::name_of(uid).is_some())
            .map_err(|e| {
                IsolationError::new("allocating a uid for", Path::new(user))(std::io::Error::other(
                    e,
                ))
            })
    }

    /// Creates the slot's user with the next uid of the range (see [`crate::isolation::uid_range`]).
    fn add_user(&self, user: &str, dir: &Path, comment: &str) -> Result<UserInfo, IsolationError> {
        let mut attempts = 0;
        loop {
            let uid = self.next_uid(user)?;
            match passwd::add(user, uid, dir, SLOT_SHELL, comment) {
                // Taken meanwhile (by another agent given an overlapping range): the next.
                Err(err)
                    if err.error.kind() == std::io::ErrorKind::AlreadyExists
                        && attempts < UID_ATTEMPTS =>
                {
                    tracing::warn!(user, uid, %err, "uid taken meanwhile; trying the next");
                    attempts += 1;
                }
                result => return result,
            }
        }
    }

    /// The slot's user with a uid no tenant of this slot had: the user a release kept,
    /// given the next uid of the range ([`passwd::renumber`]), or a new one when there is
    /// none or it cannot be renumbered.
    fn fresh_user(
        &self,
        user: &str,
        dir: &Path,
        slot: u32,
        clock: &mut StepClock,
    ) -> Result<UserInfo, IsolationError> {
        if let Some(kept) = passwd::lookup_in(&self.etc, user) {
            let mut attempts = 0;
            loop {
                let uid = self.next_uid(user)?;
                clock.lap("next_uid");
                let renumbered = passwd::renumber(&self.etc, user, uid);
                clock.lap("renumber");
                match renumbered {
                    Ok(()) => match passwd::lookup_in(&self.etc, user) {
                        Some(info) if info.uid == uid && info.home == dir => return Ok(info),
                        found => tracing::warn!(
                            user,
                            uid,
                            ?found,
                            "renumbered user reads back otherwise; making it anew"
                        ),
                    },
                    // The id was taken meanwhile (a group with that gid, a user made by
                    // another agent counting through the same range): the next one, as
                    // `add_user` does. Still a uid no tenant of the slot had.
                    Err(err)
                        if err.error.kind() == std::io::ErrorKind::AlreadyExists
                            && attempts < UID_ATTEMPTS =>
                    {
                        tracing::debug!(user, uid, %err, "id taken meanwhile; renumbering to the next");
                        attempts += 1;
                        continue;
                    }
                    Err(err) => {
                        tracing::warn!(user, uid, old_uid = kept.uid, %err, "cannot renumber the slot user; making it anew")
                    }
                }
                break;
            }
            passwd::remove(user)?;
        }
        let comment = format!("slotpool slot {slot} of {}", self.backing_id);
        let added = self.add_user(user, dir, &comment);
        clock.lap("useradd");
        added
    }

    /// Empty workspace owned by the user, 0700: a file system of `disk_bytes` of its
    /// own, or a plain directory.
    fn make_workspace(
        &self,
        slot: u32,
        dir: &Path,
        uid: u32,
        gid: u32,
        disk_bytes: Option<u64>,
    ) -> Result<(), IsolationError> {
        if let Some(bytes) = disk_bytes {
            let Some(images) = &self.images else {
                return Err(IsolationError::new("making a quota'd workspace", dir)(
                    std::io::Error::other("this agent makes no workspace images"),
                ));
            };
            return images.create(slot, bytes, dir, uid, gid);
        }
        make_private_dir(dir)?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .map_err(IsolationError::new("changing owner of", dir))
    }

    /// Removes the workspace image of `slot` (unmounting it), if any; the problems met.
    fn remove_image(&self, slot: u32, dir: &Path) -> Vec<String> {
        self.images
            .as_ref()
            .map(|images| images.remove(slot, dir))
            .unwrap_or_default()
    }

    /// Whether the workspace of `slot` has its image mounted.
    fn image_mounted(&self, dir: &Path) -> bool {
        self.images.as_ref().is_some_and(|i| i.mounted(dir))
    }

    /// The key as the only line of a root-owned `.ssh/authorized_keys` (replacing any).
    fn write_key(&self, dir: &Path, key: &str) -> Result<(), IsolationError> {
        let ssh_dir = dir.join(".ssh");
        remove_if_present(&ssh_dir)?;
        fs::create_dir(&ssh_dir).map_err(IsolationError::new("creating", &ssh_dir))?;
        fs::set_permissions(&ssh_dir, fs::Permissions::from_mode(0o755))
            .map_err(IsolationError::new("setting mode 0755 on", &ssh_dir))?;
        write_file(&ssh_dir.join("authorized_keys"), &with_newline(key), 0o644)
    }

    /// Whether a warm slot found on disk can be trusted: its user is the one warmed, its
    /// workspace empty and no process has its uid. `Err` says why not.
    fn check_warm(&self, slot: u32, state: &SlotState, info: &UserInfo) -> Result<(), String> {
        if state.uid.is_some_and(|uid| uid != info.uid) {
            return Err(format!("user {} has a new uid {}", state.user, info.uid));
        }
        let ws = self.workspace(slot);
        if state.disk_bytes.is_some() != self.image_mounted(&ws) {
            return Err(format!(
                "workspace image of {} bytes expected, mounted: {}",
                state.disk_bytes.unwrap_or(0),
                self.image_mounted(&ws)
            ));
        }
        if !is_empty_dir(&ws) {
            return Err(format!(
                "workspace {} is not an empty directory",
                ws.display()
            ));
        }
        let procs = procs::processes_of(&self.proc_root, info.uid);
        if !procs.is_empty() {
            return Err(format!("processes {procs:?} of uid {}", info.uid));
        }
        if let Some(net) = &self.network {
            if let Err(err) = net.open(slot) {
                return Err(format!("no network namespace: {err}"));
            }
        }
        Ok(())
    }

    /// Kills the slot's processes and removes everything of its use, then checks it is
    /// gone; the user too, unless `keep` says to keep it for the next tenancy (which
    /// gives it a new uid, see [`UserIsolation::fresh_user`]).
    fn clean(&self, slot: u32, keep: KeepUser) -> Result<(), IsolationError> {
        let mut clock = StepClock::start();
        let result = self.clean_timed(slot, keep, &mut clock);
        clock.log(slot, "release");
        result
    }

    /// [`UserIsolation::clean`], each step noted on `clock`.
    fn clean_timed(
        &self,
        slot: u32,
        keep: KeepUser,
        clock: &mut StepClock,
    ) -> Result<(), IsolationError> {
        let user = self.user(slot);
        let info = passwd::lookup_in(&self.etc, &user);
        clock.lap("lookup");
        self.terminate(&user);
        clock.lap("terminate");
        self.cgroups.kill_all(&user)?;
        clock.lap("kill_cgroup");
        if let Some(info) = &info {
            procs::kill_uid_shared(&self.scans, info.uid, info.gid)?;
        }
        clock.lap("kill_uid");
        // From here on no process of the slot exists: nothing can be re-created.
        self.users().remove(&slot);
        // A release keeps the slot's cgroup, emptied, for the next tenancy (its warm-up
        // gives it the next user's group and default limits).
        match keep {
            KeepUser::IfClean => self.cgroups.empty(&user)?,
            KeepUser::No => {
                self.cgroup_limits().remove(&slot);
                self.cgroups.remove(&user)?
            }
        }
        clock.lap("cgroup_remove");
        let ws = self.workspace(slot);
        // Whatever cannot be removed is a reason for the slot to be dirty; the user is
        // deleted then, so nobody logs in to what is left.
        let mut problems: Vec<String> = self.remove_image(slot, &ws);
        let mut budget = Budget::for_release();
        // A workspace image still mounted is not wiped through (the mount stays a reason).
        // The removal just read the mounts: without a problem, nothing is mounted there
        // now (it was not, or it was unmounted or detached), and the mounts are read again
        // only after one (each read is an `nsenter` with --mount-namespace).
        if problems.is_empty() || !self.image_mounted(&ws) {
            if let Err(err) = crate::isolation::wipe::remove_path(&ws, &mut budget) {
                problems.push(err.to_string());
            }
        }
        clock.lap("wipe");
        if let Some(mounts) = &self.private_tmp {
            problems.extend(match keep {
                KeepUser::IfClean => mounts.unmount(slot),
                KeepUser::No => mounts.remove(slot),
            });
            clock.lap("private_tmp");
        }
        // A slot's network namespace is kept for its next tenancy (nothing of a tenancy
        // outlives its processes there); it goes with the slot.
        if let (Some(net), KeepUser::No) = (&self.network, keep) {
            problems.extend(net.remove(slot));
            clock.lap("netns");
        }
        if let Some(info) = &info {
            for err in shared_dirs::remove_owned(&self.shared_dirs, info.uid, &mut budget) {
                problems.push(err.to_string());
            }
            clock.lap("shared_dirs");
            problems.extend(procs::remove_ipc_of(&self.proc_root, info.uid));
            clock.lap("ipc");
        }
        for file in self.per_user_files(&user) {
            if let Err(e) = fs::remove_file(&file) {
                problems.push(format!("removing {}: {e}", file.display()));
            }
        }
        clock.lap("spools");
        // A kept user has neither key nor password (the workspace is gone) and no
        // process: nobody can log in until a prepare after the warm-up. A slot that is
        // not clean loses its user, so nobody logs in to what is left.
        let user_kept = keep == KeepUser::IfClean && problems.is_empty();
        if !user_kept {
            passwd::remove(&user)?;
        }
        clock.lap("user_remove");
        let files_kept = keep == KeepUser::IfClean;
        if let Some(left) =
            self.leftovers(slot, info.as_ref().map(|i| i.uid), user_kept, files_kept)
        {
            problems.push(format!("still present: {left}"));
            if user_kept {
                passwd::remove(&user)?;
            }
        }
        clock.lap("check");
        if !problems.is_empty() {
            return Err(IsolationError::new("verifying slot is clean", &ws)(
                std::io::Error::other(problems.join("; ")),
            ));
        }
        let state = self.state_file(slot);
        if keep == KeepUser::IfClean && state.exists() {
            // Blank: the slot is free and cold until its warm-up writes it again.
            return self.write_state_record(slot, "");
        }
        match fs::remove_file(&state) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(IsolationError::new("removing", &state)(e)),
        }
        Ok(())
    }

    /// [`SlotIsolation::warm`], each step noted on `clock`.
    fn warm_timed(&self, slot: u32, clock: &mut StepClock) -> Result<(), IsolationError> {
        let user = self.user(slot);
        let dir = self.workspace(slot);
        let info = self.fresh_user(&user, &dir, slot, clock)?;
        let disk_bytes = self.warm_disk_bytes;
        self.make_workspace(slot, &dir, info.uid, info.gid, disk_bytes)?;
        clock.lap("workspace");
        self.set_cgroup(slot, &user, info.gid, &self.warm_limits, true)?;
        clock.lap("cgroup_create");
        if let Some(net) = &self.network {
            net.create_timed(slot, clock)
                .map_err(|e| self.network_error(slot, e))?;
        }
        if let Some(mounts) = &self.private_tmp {
            let copy_of = match disk_bytes {
                Some(_) => CopyOf::Logins,
                None => CopyOf::Clean,
            };
            mounts
                .create(slot, &dir, copy_of)
                .map_err(|e| self.private_tmp_error(slot, e))?;
            clock.lap("private_tmp");
        }
        self.write_state(
            slot,
            &SlotState {
                node_id: None,
                user: user.clone(),
                uid: Some(info.uid),
                limits: self.warm_limits,
                disk_bytes,
            },
        )?;
        self.users().insert(
            slot,
            SlotUser {
                user,
                uid: info.uid,
                gid: info.gid,
                prepared: false,
                disk_bytes,
            },
        );
        clock.lap("state");
        Ok(())
    }

    /// What is left of a slot after cleaning (but its user when `user_kept`), or `None`
    /// when it is clean. The uid's entries in the shared directories are not looked for
    /// again: their removal listed them after the uid's last process was gone, and
    /// reported every one it could not remove.
    /// `files_kept`: the slot's namespace files were only unmounted and its cgroup
    /// emptied, not removed.
    fn leftovers(
        &self,
        slot: u32,
        uid: Option<u32>,
        user_kept: bool,
        files_kept: bool,
    ) -> Option<String> {
        let user = self.user(slot);
        let mut left = Vec::new();
        if let Some(uid) = uid {
            let procs = self.scans.processes_of(uid);
            if !procs.is_empty() {
                left.push(format!("processes {procs:?} of uid {uid}"));
            }
            let ipc = procs::ipc_objects_of(&self.proc_root, uid);
            if !ipc.is_empty() {
                left.push(format!("System V IPC objects {ipc:?} of uid {uid}"));
            }
        }
        if files_kept {
            match self.cgroups.procs(&user) {
                Ok(procs) if procs.is_empty() => {}
                Ok(procs) => left.push(format!("processes {procs:?} in cgroup of {user}")),
                Err(err) => left.push(err.to_string()),
            }
        } else {
            for path in self.cgroups.paths(&user) {
                if path.exists() {
                    left.push(format!("cgroup {}", path.display()));
                }
            }
        }
        let ws = self.workspace(slot);
        if let Some(images) = &self.images {
            left.extend(images.leftovers(slot, &ws));
        }
        if fs::symlink_metadata(&ws).is_ok() {
            left.push(format!("workspace {}", ws.display()));
        }
        for file in self.per_user_files(&user) {
            left.push(format!("file {}", file.display()));
        }
        if let (Some(net), false) = (&self.network, files_kept) {
            left.extend(net.leftovers(slot));
        }
        if let Some(mounts) = &self.private_tmp {
            left.extend(mounts.leftovers(slot, files_kept));
        }
        if !user_kept && passwd::lookup_in(&self.etc, &user).is_some() {
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

    fn slot_names(&self) -> SlotNames {
        SlotNames {
            workspace: workspace_template(&self.slots_dir),
            username: Some(passwd::user_name_template(&self.namespace)),
        }
    }

    fn warm(&self, slot: u32) -> Result<(), IsolationError> {
        let mut clock = StepClock::start();
        let result = self.warm_timed(slot, &mut clock);
        clock.log(slot, "warm");
        result
    }

    fn prepare_warm(
        &self,
        slot: u32,
        node_id: &NodeId,
        ssh_public_key: Option<&str>,
        limits: &Limits,
    ) -> Result<PathBuf, IsolationError> {
        let mut clock = StepClock::start();
        let dir = self.workspace(slot);
        let not_warm = |why: String| {
            IsolationError::new("preparing warm slot", &dir)(std::io::Error::other(why))
        };
        let Some(warm) = self.users().get(&slot).cloned() else {
            return Err(not_warm("the slot is not warm".into()));
        };
        match passwd::lookup_in(&self.etc, &warm.user) {
            Some(info) if info.uid == warm.uid => {}
            Some(info) => {
                return Err(not_warm(format!(
                    "user {} changed uid to {}",
                    warm.user, info.uid
                )))
            }
            None => return Err(not_warm(format!("user {} is gone", warm.user))),
        }
        clock.lap("user");
        if limits.disk_bytes != warm.disk_bytes {
            // Another size than the warm-up made: the empty workspace is made again.
            let problems = self.remove_image(slot, &dir);
            if !problems.is_empty() {
                return Err(not_warm(problems.join("; ")));
            }
            remove_if_present(&dir)?;
            self.make_workspace(slot, &dir, warm.uid, warm.gid, limits.disk_bytes)?;
        }
        if let Some(key) = ssh_public_key {
            self.write_key(&dir, key)?;
        }
        clock.lap("key");
        self.set_cgroup(slot, &warm.user, warm.gid, limits, false)?;
        clock.lap("cgroup");
        self.write_state(
            slot,
            &SlotState {
                node_id: Some(node_id.clone()),
                user: warm.user.clone(),
                uid: Some(warm.uid),
                limits: *limits,
                disk_bytes: limits.disk_bytes,
            },
        )?;
        clock.lap("state");
        if let Some(u) = self.users().get_mut(&slot) {
            u.prepared = true;
            u.disk_bytes = limits.disk_bytes;
        }
        clock.log(slot, "prepare_warm");
        Ok(dir)
    }

    fn destroy(&self, slot: u32) -> Result<(), IsolationError> {
        self.clean(slot, KeepUser::No)
    }

    fn release(&self, slot: u32) -> Result<(), IsolationError> {
        self.clean(slot, KeepUser::IfClean)
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
                .and_then(|t| {
                    if t.trim().is_empty() {
                        Ok(None)
                    } else {
                        serde_json::from_str(&t)
                            .map(Some)
                            .map_err(|e| e.to_string())
                    }
                }) {
                // Blank: released, free and cold.
                Ok(None) => continue,
                Ok(Some(state)) => state,
                Err(err) => {
                    tracing::warn!(slot, path = %path.display(), %err, "unreadable slot state; treating the slot as free");
                    continue;
                }
            };
            let Some(info) = passwd::lookup(&state.user) else {
                tracing::warn!(
                    slot,
                    user = state.user,
                    "slot user is gone; treating the slot as free and cold"
                );
                continue;
            };
            if state.node_id.is_none() {
                if let Err(why) = self.check_warm(slot, &state, &info) {
                    tracing::warn!(slot, reason = why, "warm slot changed; treating it as cold");
                    continue;
                }
            }
            let ws = self.workspace(slot);
            if state.disk_bytes.is_some() && !self.image_mounted(&ws) {
                // After a reboot: the job's workspace is its image.
                let remounted = match &self.images {
                    Some(images) => images.remount(slot, &ws),
                    None => Err(IsolationError::new("mounting", &ws)(std::io::Error::other(
                        "this agent makes no workspace images",
                    ))),
                };
                if let Err(err) = remounted {
                    tracing::warn!(slot, %err, "cannot mount the slot's workspace image again; treating the slot as free and cold");
                    continue;
                }
            }
            // Re-apply the limits (the group may be gone after a reboot).
            self.set_cgroup(slot, &state.user, info.gid, &state.limits, true)?;
            // Likewise the network namespace of a prepared slot (a warm one without it
            // was made cold above).
            if let Some(net) = &self.network {
                if !net.exists(slot) {
                    if let Err(err) = net.create(slot) {
                        tracing::warn!(slot, %err, "cannot make the slot's network namespace again; its logins are refused");
                    }
                }
            }
            self.users().insert(
                slot,
                SlotUser {
                    user: state.user,
                    uid: info.uid,
                    gid: info.gid,
                    prepared: state.node_id.is_some(),
                    disk_bytes: state.disk_bytes,
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
        self.users()
            .get(&slot)
            .filter(|u| u.prepared)
            .map(|u| u.user.clone())
    }

    fn occupants(&self, slot: u32) -> SlotOccupants {
        let Some((user, uid)) = self.users().get(&slot).map(|u| (u.user.clone(), u.uid)) else {
            return SlotOccupants::default();
        };
        SlotOccupants {
            processes: procs::processes_of(&self.proc_root, uid).len() as u32,
            logins: procs::ssh_sessions(&self.proc_root, uid, &user),
        }
    }

    fn place(&self, uid: u32, pid: i32) -> Result<Option<u32>, IsolationError> {
        let Some((slot, user)) = self
            .users()
            .iter()
            .find(|(_, u)| u.prepared && u.uid == uid)
            .map(|(s, u)| (*s, u.user.clone()))
        else {
            return Ok(None);
        };
        self.cgroups.add(&user, pid)?;
        Ok(Some(slot))
    }

    fn slot_entry(
        &self,
        uid: u32,
        beside: Option<i32>,
    ) -> Result<Option<SlotEntry>, IsolationError> {
        let Some((slot, user)) = self
            .users()
            .iter()
            .find(|(_, u)| u.prepared && u.uid == uid)
            .map(|(s, u)| (*s, u.clone()))
        else {
            return Ok(None);
        };
        let slot_dirs = self.cgroups.paths(&user.user);
        let open = |file: &Path| fs::OpenOptions::new().write(true).open(file);
        // Best effort: a group the agent may not write to keeps no login out.
        let beside_procs = beside
            .map(|pid| crate::isolation::cgroup::procs_beside(pid, &slot_dirs))
            .unwrap_or_default()
            .iter()
            .filter_map(|file| open(file).ok().map(OwnedFd::from))
            .collect();
        let mut cgroup_procs = Vec::new();
        for file in slot_dirs.iter().map(|d| d.join("cgroup.procs")) {
            let opened = fs::OpenOptions::new()
                .write(true)
                .open(&file)
                .map_err(IsolationError::new("opening", &file))?;
            cgroup_procs.push(OwnedFd::from(opened));
        }
        let shell = passwd::lookup_in(&self.etc, &user.user)
            .map(|u| u.shell)
            .filter(|s| !s.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("/bin/sh"));
        Ok(Some(SlotEntry {
            slot,
            uid: user.uid,
            gid: user.gid,
            home: self.workspace(slot),
            shell,
            beside_procs,
            cgroup_procs,
            namespaces: self.login_namespaces(slot)?,
            user: user.user,
        }))
    }

    fn login_namespaces(&self, slot: u32) -> Result<Vec<(NsKind, OwnedFd)>, IsolationError> {
        let mut namespaces = Vec::new();
        if let Some(net) = &self.network {
            let netns = net.open(slot).map_err(|e| self.network_error(slot, e))?;
            namespaces.push((NsKind::Net, netns));
        }
        if let Some(mounts) = &self.private_tmp {
            let opened = mounts
                .open(slot)
                .map_err(|e| self.private_tmp_error(slot, e))?;
            namespaces.push((NsKind::Mnt, opened.mnt));
            namespaces.push((NsKind::Ipc, opened.ipc));
        }
        Ok(namespaces)
    }

    fn sweep(&self) -> usize {
        let prepared = self.prepared_users();
        if prepared.is_empty() {
            return 0;
        }
        let uids: Vec<u32> = prepared.iter().map(|(_, u)| u.uid).collect();
        // One scan of /proc for every slot; a slot's cgroup is read only when it has
        // processes.
        let procs = procs::processes_of_any(&self.proc_root, &uids);
        let mut moved = 0;
        for (slot, u) in prepared {
            let mut pids = procs.iter().filter(|(uid, _)| *uid == u.uid).peekable();
            if pids.peek().is_none() {
                continue;
            }
            let inside = self.cgroups.procs(&u.user).unwrap_or_default();
            for &(_, pid) in pids {
                if inside.contains(&pid) {
                    continue;
                }
                match self.cgroups.add(&u.user, pid) {
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

    fn remove_all(&self, slots: u32) -> Vec<IsolationError> {
        let problems: Vec<IsolationError> = (0..slots)
            .filter_map(|slot| self.destroy(slot).err())
            .collect();
        // The parent groups too, when no other agent's slots are in them.
        if problems.is_empty() {
            if let Some(mounts) = &self.private_tmp {
                for problem in mounts.close() {
                    tracing::warn!(%problem, "the slots' namespace directory stays");
                }
            }
            if let Some(net) = &self.network {
                if let Err(problem) = net.close() {
                    tracing::warn!(%problem, "the slots' nftables table stays");
                }
            }
            for parent in self
                .cgroups
                .paths(&self.user(0))
                .iter()
                .filter_map(|p| p.parent())
            {
                match fs::remove_dir(parent) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::debug!(parent = %parent.display(), %e, "cgroup parent stays")
                    }
                }
            }
        }
        problems
    }

    fn stop_all(&self) -> Result<(), IsolationError> {
        let all: Vec<SlotUser> = self.users().values().cloned().collect();
        let mut first_error = None;
        for u in all {
            let result = self
                .cgroups
                .kill_all(&u.user)
                .and_then(|()| procs::kill_uid(&self.proc_root, u.uid, u.gid));
            if let Err(err) = result {
                tracing::warn!(user = u.user, %err, "cannot stop slot processes");
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
