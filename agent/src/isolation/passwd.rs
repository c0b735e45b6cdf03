//! Slot users in the password database: their names, creating and deleting them,
//! giving them a new uid. Their processes are found and killed by [`super::procs`].
//!
//! **Names.** A slot's user is `<prefix><hash>s<slot>`: `<prefix>` is the agent's
//! `--user-prefix` (default `sp`), `<hash>` the first 8 hex digits of the SHA-256 of the
//! backing id. `<prefix><hash>` is the agent's *namespace*: two agents on one host (two
//! backing ids) never share a user name even with the same slot numbers, and a helper
//! that only knows its user name finds its agent's namespace by cutting `s<slot>` off.
//!
//! Users are created with `useradd` and deleted with `userdel` (shadow-utils keeps
//! `/etc/passwd`, `/etc/group` and `/etc/shadow` consistent and locked). Calls are
//! serialised in the process and retried while another process holds the password file
//! lock. A slot's user is kept from one tenancy to the next and only given a new uid and
//! gid ([`renumber`]): two lines rewritten under the same locks shadow-utils takes, so no
//! tool writing the files meanwhile is raced.

use super::IsolationError;
use crate::step_clock::StepClock;
use sha2::{Digest, Sha256};
use slotpool_protocol::model::SlotNames;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long `useradd`/`userdel` are retried while the password file is locked. One
/// try may itself wait up to 15 s (glibc's `lckpwdf`), so a count of tries is no bound.
const PASSWD_TOOL_WAIT: Duration = Duration::from_secs(45);
const PASSWD_LOCK_PAUSE: Duration = Duration::from_millis(100);
/// The lowest uid a slot user may have: the kill by uid ([`super::procs::kill_uid`]) never
/// targets system users.
pub const MIN_SLOT_UID: u32 = 1000;
/// Longest user name `useradd` accepts.
pub const MAX_USER_NAME: usize = 32;

/// useradd's exit status when the uid asked for is taken.
const USERADD_UID_IN_USE: i32 = 4;

/// Serialises this process's `useradd`/`userdel` calls.
static PASSWD: Mutex<()> = Mutex::new(());

/// The user-name namespace of an agent: `<prefix>` + 8 hex digits of SHA-256(backing id).
pub fn namespace(prefix: &str, backing_id: &str) -> String {
    let hash = hex::encode(Sha256::digest(backing_id.as_bytes()));
    format!("{prefix}{}", &hash[..8])
}

/// The user name of `slot` in `namespace`.
pub fn user_name(namespace: &str, slot: u32) -> String {
    format!("{namespace}s{slot}")
}

/// [`user_name`] as a [`SlotNames`] template.
pub fn user_name_template(namespace: &str) -> String {
    format!("{namespace}s{}", SlotNames::SLOT)
}

/// The namespace and slot of a user name made by [`user_name`].
pub fn split_user_name(name: &str) -> Option<(&str, u32)> {
    let at = name.rfind('s')?;
    let slot = name[at + 1..].parse().ok()?;
    (at > 0 && name[at + 1..].bytes().all(|b| b.is_ascii_digit())).then_some((&name[..at], slot))
}

/// Whether `prefix` makes valid user names: starts with a lowercase letter, then
/// lowercase letters, digits, `_` or `-`, at most 12 characters.
pub fn valid_prefix(prefix: &str) -> bool {
    let mut bytes = prefix.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && prefix.len() <= 12
}

/// A user as the password database knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserInfo {
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: PathBuf,
}

/// Looks a user up by name (`getpwnam_r`); `None` when there is no such user.
pub fn lookup(name: &str) -> Option<UserInfo> {
    let c_name = CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: pwd and buf are valid for the call; getpwnam_r writes only into them and
    // sets result to &pwd or null. The strings it points at live in buf, read before it
    // is dropped.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(
            c_name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        );
        if rc != 0 || result.is_null() {
            return None;
        }
        let text = |p: *const libc::c_char| {
            PathBuf::from(std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        Some(UserInfo {
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
            home: text(pwd.pw_dir),
            shell: text(pwd.pw_shell),
        })
    }
}

/// Looks a slot user up by name in `<etc>/passwd` itself; `None` when it has no line
/// there. Slot users live in that file, which the agent writes ([`add`], [`renumber`]):
/// reading it skips the name service's other modules, which look in several places per
/// call (nss-systemd walks its user record directories), five times per users-mode
/// cycle.
pub fn lookup_in(etc: &Path, name: &str) -> Option<UserInfo> {
    let text = std::fs::read_to_string(etc.join("passwd")).ok()?;
    parse_passwd_line(&text, name)
}

/// The entry of user `name` in passwd-file `text`.
fn parse_passwd_line(text: &str, name: &str) -> Option<UserInfo> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        let uid = fields.next()?.parse().ok()?;
        let gid = fields.next()?.parse().ok()?;
        let _comment = fields.next()?;
        let home = PathBuf::from(fields.next()?);
        let shell = PathBuf::from(fields.next()?);
        Some(UserInfo {
            uid,
            gid,
            home,
            shell,
        })
    })
}

/// The user name of `uid` (`getpwuid_r`).
pub fn name_of(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: as in `lookup`.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        );
        if rc != 0 || result.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(pwd.pw_name)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Runs a shadow-utils command, retrying while the password file is locked.
fn run_passwd_tool(tool: &str, args: &[&str], ok_codes: &[i32]) -> Result<(), IsolationError> {
    let _one_at_a_time = PASSWD.lock().unwrap_or_else(|e| e.into_inner());
    let path = PathBuf::from(tool);
    let deadline = Instant::now() + PASSWD_TOOL_WAIT;
    loop {
        let out = Command::new(tool)
            .args(args)
            .env("LC_ALL", "C")
            .output()
            .map_err(IsolationError::new("running", &path))?;
        let code = out.status.code().unwrap_or(-1);
        if out.status.success() || ok_codes.contains(&code) {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if passwd_locked(code, &stderr) && Instant::now() < deadline {
            std::thread::sleep(PASSWD_LOCK_PAUSE);
            continue;
        }
        // useradd's exit 4: the uid asked for is taken (by a user made meanwhile).
        let kind = if tool == "useradd" && code == USERADD_UID_IN_USE {
            std::io::ErrorKind::AlreadyExists
        } else {
            std::io::ErrorKind::Other
        };
        return Err(IsolationError::new("running", &path)(std::io::Error::new(
            kind,
            format!("{} exited with {code}: {stderr}", args.join(" ")),
        )));
    }
}

/// Whether a shadow-utils tool failed only because another process holds the password
/// or group file: `useradd` says so with exit 10, `userdel` with exit 1 and "cannot lock"
/// (another agent on the host, or an administrator's tool, is changing users).
fn passwd_locked(code: i32, stderr: &str) -> bool {
    code == 10 || (code == 1 && stderr.contains("cannot lock"))
}

/// Creates user `name` with uid `uid`, its own group, home `home` (not created here) and
/// `shell`. A uid already taken fails with [`std::io::ErrorKind::AlreadyExists`].
pub fn add(
    name: &str,
    uid: u32,
    home: &Path,
    shell: &str,
    comment: &str,
) -> Result<UserInfo, IsolationError> {
    let home_arg = home.display().to_string();
    let uid_arg = uid.to_string();
    run_passwd_tool(
        "useradd",
        &[
            "--uid",
            &uid_arg,
            // Slot uids are high: no sparse lastlog/faillog records for them.
            "--no-log-init",
            "--no-create-home",
            "--home-dir",
            &home_arg,
            "--shell",
            shell,
            "--user-group",
            // No password, but not locked: sshd without PAM refuses locked ("!") accounts
            // even for key logins.
            "--password",
            "*",
            "--comment",
            comment,
            name,
        ],
        &[],
    )?;
    let info = lookup(name).ok_or_else(|| {
        IsolationError::new("looking up", Path::new(name))(std::io::Error::other(
            "user not found right after useradd",
        ))
    })?;
    if info.uid != uid {
        return Err(IsolationError::new("checking uid of", Path::new(name))(
            std::io::Error::other(format!("uid {} instead of {uid}", info.uid)),
        ));
    }
    if info.uid < MIN_SLOT_UID {
        return Err(IsolationError::new("checking uid of", Path::new(name))(
            std::io::Error::other(format!("uid {} is below {MIN_SLOT_UID}", info.uid)),
        ));
    }
    Ok(info)
}

/// Deletes user `name` and its group; fine when there is no such user.
pub fn remove(name: &str) -> Result<(), IsolationError> {
    if lookup(name).is_none() {
        return Ok(());
    }
    // Exit 6: no such user (deleted meanwhile).
    run_passwd_tool("userdel", &[name], &[6])
}

/// Longest wait for the password database locks when renumbering a user.
const PASSWD_LOCK_WAIT: Duration = Duration::from_secs(15);
/// Pause between tries of a password database lock someone else holds.
const PASSWD_LOCK_RETRY: Duration = Duration::from_millis(2);

/// The locks shadow-utils takes before it writes `passwd` and `group`: a record lock on
/// `<etc>/.pwd.lock` (glibc's `lckpwdf`) and a `<file>.lock` link per file naming the
/// holder's pid. Released on drop.
struct PasswdLock {
    _pwd_lock: std::fs::File,
    links: Vec<PathBuf>,
}

impl Drop for PasswdLock {
    fn drop(&mut self) {
        for link in &self.links {
            let _ = std::fs::remove_file(link);
        }
    }
}

/// Writes `pid` to `path`, readable by root only (as shadow-utils makes its own).
fn write_lock_file(path: &Path, pid: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(pid.to_string().as_bytes())
}

/// Takes the password database locks for `files` of `etc`, waiting at most
/// [`PASSWD_LOCK_WAIT`] for other holders (useradd, another agent).
fn lock_passwd(etc: &Path, files: &[&str]) -> std::io::Result<PasswdLock> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let deadline = Instant::now() + PASSWD_LOCK_WAIT;
    let busy = |what: &Path| {
        std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!("{} is held by another process", what.display()),
        )
    };
    let pwd_lock_path = etc.join(".pwd.lock");
    let pwd_lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&pwd_lock_path)?;
    loop {
        // SAFETY: flock is plain data, for which all zeroes is a valid value.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = libc::F_WRLCK as _;
        lock.l_whence = libc::SEEK_SET as _;
        // SAFETY: the descriptor is open and `lock` valid for the call. An open file
        // description lock conflicts with lckpwdf's process lock as any fcntl lock does.
        let rc = unsafe { libc::fcntl(pwd_lock.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
        if rc == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
            return Err(err);
        }
        if Instant::now() >= deadline {
            return Err(busy(&pwd_lock_path));
        }
        std::thread::sleep(PASSWD_LOCK_RETRY);
    }
    let mut held = PasswdLock {
        _pwd_lock: pwd_lock,
        links: Vec::new(),
    };
    let pid = std::process::id();
    for file in files {
        let link = etc.join(format!("{file}.lock"));
        let mine = etc.join(format!("{file}.{pid}"));
        write_lock_file(&mine, pid)?;
        let linked = loop {
            match std::fs::hard_link(&mine, &link) {
                Ok(()) => break Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // A lock whose holder is gone is stale, as shadow-utils judges it.
                    let holder = std::fs::read(&link).ok().and_then(|t| lock_holder(&t));
                    let gone = holder
                        .and_then(rustix::process::Pid::from_raw)
                        .is_some_and(|p| {
                            rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH)
                        });
                    if gone {
                        let _ = std::fs::remove_file(&link);
                    } else if Instant::now() >= deadline {
                        break Err(busy(&link));
                    } else {
                        std::thread::sleep(PASSWD_LOCK_RETRY);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        let _ = std::fs::remove_file(&mine);
        linked?;
        held.links.push(link);
    }
    Ok(held)
}

/// The pid a `<file>.lock` names. shadow-utils writes it with a trailing NUL byte
/// (`strlen + 1` bytes), which a killed `useradd` leaves behind; we write it bare.
fn lock_holder(text: &[u8]) -> Option<i32> {
    let text = std::str::from_utf8(text).ok()?;
    text.trim_end_matches('\0').trim().parse().ok()
}

/// Replaces the files `<etc>/<file>` by their texts, keeping each one's mode and owner,
/// in the order given: each is written to `<file>+` and synced (all at once: the
/// syncs share the file system's journal commits, so they wait about as long as one),
/// and only once every one is on disk are they renamed over the files, one after the
/// other. A file that cannot be written leaves every file as it was.
fn replace_db_files(etc: &Path, files: &[(&str, &str)]) -> Result<(), (PathBuf, std::io::Error)> {
    use std::io::Write;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let stage = |file: &str, text: &str| -> std::io::Result<(PathBuf, std::fs::File)> {
        let meta = std::fs::metadata(etc.join(file))?;
        let new = etc.join(format!("{file}+"));
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(meta.mode() & 0o7777)
            .open(&new)?;
        out.write_all(text.as_bytes())?;
        std::os::unix::fs::fchown(&out, Some(meta.uid()), Some(meta.gid()))?;
        out.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        Ok((new, out))
    };
    let mut staged = Vec::with_capacity(files.len());
    let unstage = |staged: &[(PathBuf, std::fs::File)]| {
        for (new, _) in staged {
            let _ = std::fs::remove_file(new);
        }
    };
    for (file, text) in files {
        match stage(file, text) {
            Ok(done) => staged.push(done),
            Err(e) => {
                unstage(&staged);
                return Err((etc.join(file), e));
            }
        }
    }
    let synced: Vec<std::io::Result<()>> = std::thread::scope(|scope| {
        let syncs: Vec<_> = staged
            .iter()
            .map(|(_, out)| scope.spawn(move || out.sync_all()))
            .collect();
        syncs
            .into_iter()
            .map(|sync| {
                sync.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("panicked")))
            })
            .collect()
    });
    for ((file, _), result) in files.iter().zip(synced) {
        if let Err(e) = result {
            unstage(&staged);
            return Err((etc.join(file), e));
        }
    }
    for ((file, _), (new, _)) in files.iter().zip(&staged) {
        std::fs::rename(new, etc.join(file)).map_err(|e| (etc.join(file), e))?;
    }
    Ok(())
}

/// `text` with field `field` (0-based, `:`-separated) of the line of `name` set to
/// `value`; `None` when no line has that name.
fn with_field(text: &str, name: &str, field: usize, value: &str) -> Option<String> {
    let mut found = false;
    let mut out = String::with_capacity(text.len() + 8);
    for line in text.split_inclusive('\n') {
        let body = line.strip_suffix('\n').unwrap_or(line);
        if !found && body.split(':').next() == Some(name) {
            found = true;
            let mut fields: Vec<&str> = body.split(':').collect();
            if fields.len() <= field {
                return None;
            }
            fields[field] = value;
            out.push_str(&fields.join(":"));
            out.push_str(&line[body.len()..]);
        } else {
            out.push_str(line);
        }
    }
    found.then_some(out)
}

/// Whether some line of `text` other than `name`'s has `id` in field `field`.
fn id_taken(text: &str, name: &str, field: usize, id: u32) -> bool {
    let id = id.to_string();
    text.lines().any(|l| {
        let mut fields = l.split(':');
        fields.next() != Some(name) && fields.nth(field - 1) == Some(id.as_str())
    })
}

/// Gives the existing user `name` and its own group (of the same name) the uid and gid
/// `id`, by rewriting their lines of `<etc>/passwd` and `<etc>/group` under the locks
/// shadow-utils takes (see [`lock_passwd`]): a slot's next tenant gets a new uid without a
/// `userdel` and `useradd` (each a process and four synced files). Nothing else about the
/// user changes (`shadow` and `gshadow` are keyed by name). Fails with
/// [`std::io::ErrorKind::AlreadyExists`] when a user has uid `id` or a group gid `id`, and
/// [`std::io::ErrorKind::NotFound`] when the user or its group is missing; the caller then
/// deletes and adds the user instead.
///
/// Renumbers asked for while another is being written wait in one queue and go into the
/// next rewrite together: whoever takes the process's turn first writes every renumber
/// of the same `etc` queued by then, so eight slots released at once cost one rewrite
/// of each file, not eight one after the other.
pub fn renumber(etc: &Path, name: &str, id: u32) -> Result<(), IsolationError> {
    let fail = |kind: std::io::ErrorKind, why: String| {
        IsolationError::new("renumbering user", Path::new(name))(std::io::Error::new(kind, why))
    };
    if id < MIN_SLOT_UID {
        return Err(fail(
            std::io::ErrorKind::InvalidInput,
            format!("uid {id} is below {MIN_SLOT_UID}"),
        ));
    }
    let outcome = Arc::new(OnceLock::new());
    queued_renumbers().push(QueuedRenumber {
        etc: etc.to_path_buf(),
        name: name.to_string(),
        id,
        outcome: outcome.clone(),
    });
    let _one_at_a_time = PASSWD.lock().unwrap_or_else(|e| e.into_inner());
    if outcome.get().is_none() {
        // Not written by the turn before: this turn writes it, with every renumber of
        // `etc` queued meanwhile.
        let batch: Vec<QueuedRenumber> = {
            let mut queue = queued_renumbers();
            let (batch, rest) = std::mem::take(&mut *queue)
                .into_iter()
                .partition(|q| q.etc == etc);
            *queue = rest;
            batch
        };
        renumber_batch(etc, batch);
    }
    match outcome.get() {
        Some(Ok(())) => Ok(()),
        Some(Err((action, path, kind, why))) => Err(IsolationError::new(action, path)(
            std::io::Error::new(*kind, why.clone()),
        )),
        None => Err(fail(
            std::io::ErrorKind::Other,
            "the renumber was not written".into(),
        )),
    }
}

/// How a queued renumber ended; an error as (action, path, kind, message), for each
/// waiting caller to make its own [`IsolationError`] of.
type RenumberOutcome = Result<(), (&'static str, PathBuf, std::io::ErrorKind, String)>;

/// A renumber waiting for the next rewrite of `etc`.
struct QueuedRenumber {
    etc: PathBuf,
    name: String,
    id: u32,
    outcome: Arc<OnceLock<RenumberOutcome>>,
}

/// The renumbers waiting for the process's turn at the password database.
static QUEUED_RENUMBERS: Mutex<Vec<QueuedRenumber>> = Mutex::new(Vec::new());

fn queued_renumbers() -> std::sync::MutexGuard<'static, Vec<QueuedRenumber>> {
    QUEUED_RENUMBERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes the renumbers of `batch` (all of `etc`) in one rewrite of `group` and one of
/// `passwd`, under the password database locks, and gives each its outcome: a renumber
/// whose id is taken or whose user is missing fails alone; a lock or write failure
/// fails every renumber of the batch. Called with [`PASSWD`] held.
fn renumber_batch(etc: &Path, batch: Vec<QueuedRenumber>) {
    let mut clock = StepClock::start();
    let everyone = |batch: &[QueuedRenumber], outcome: RenumberOutcome| {
        for q in batch {
            let _ = q.outcome.set(outcome.clone());
        }
    };
    let as_outcome = |action: &'static str, path: &Path, e: std::io::Error| -> RenumberOutcome {
        Err((action, path.to_path_buf(), e.kind(), e.to_string()))
    };
    let _locked = match lock_passwd(etc, &["passwd", "group"]) {
        Ok(locked) => locked,
        Err(e) => {
            return everyone(
                &batch,
                as_outcome("locking the password database in", etc, e),
            )
        }
    };
    clock.lap("host_lock");
    let read = |file: &str| std::fs::read_to_string(etc.join(file));
    let (mut passwd, mut group) = match (read("passwd"), read("group")) {
        (Ok(p), Ok(g)) => (p, g),
        (Err(e), _) => return everyone(&batch, as_outcome("reading", &etc.join("passwd"), e)),
        (_, Err(e)) => return everyone(&batch, as_outcome("reading", &etc.join("group"), e)),
    };
    clock.lap("read");
    // Each renumber is checked against the files as the ones before it in the batch left
    // them, so two of one batch can never end up with the same id.
    let mut written = Vec::new();
    for q in batch {
        let refused = |kind: std::io::ErrorKind, why: &str| -> RenumberOutcome {
            Err((
                "renumbering user",
                PathBuf::from(&q.name),
                kind,
                why.to_string(),
            ))
        };
        if id_taken(&passwd, &q.name, 2, q.id) || id_taken(&group, &q.name, 2, q.id) {
            let why = format!("uid or gid {} is taken", q.id);
            let _ = q
                .outcome
                .set(refused(std::io::ErrorKind::AlreadyExists, &why));
            continue;
        }
        let id_text = q.id.to_string();
        let new_passwd = with_field(&passwd, &q.name, 2, &id_text)
            .and_then(|t| with_field(&t, &q.name, 3, &id_text));
        let new_group = with_field(&group, &q.name, 2, &id_text);
        let (Some(new_passwd), Some(new_group)) = (new_passwd, new_group) else {
            let _ = q.outcome.set(refused(
                std::io::ErrorKind::NotFound,
                "no such user and group",
            ));
            continue;
        };
        (passwd, group) = (new_passwd, new_group);
        written.push(q);
    }
    if written.is_empty() {
        return;
    }
    // The group first: a crash between the two renames leaves the users with their old
    // gids, which no group names (the next warm-up finds the uid changed and makes the
    // slot anew).
    if let Err((path, e)) = replace_db_files(etc, &[("group", &group), ("passwd", &passwd)]) {
        return everyone(&written, as_outcome("writing", &path, e));
    }
    clock.lap("group_passwd");
    #[cfg(test)]
    tests::note_rewrite(etc);
    everyone(&written, Ok(()));
    tracing::debug!(batch = written.len(), steps = %clock.steps(), "renumber timed");
}

/// Every user whose name starts with `prefix`, from `<etc>/passwd`.
pub fn users_with_prefix(etc: &Path, prefix: &str) -> Vec<String> {
    names_with_prefix(&etc.join("passwd"), prefix)
}

/// Every group whose name starts with `prefix`, from `<etc>/group`.
pub fn groups_with_prefix(etc: &Path, prefix: &str) -> Vec<String> {
    names_with_prefix(&etc.join("group"), prefix)
}

/// The names (first field) of the lines of `file` that start with `prefix`.
fn names_with_prefix(file: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_user_is_read_from_its_own_line() {
        let text = "root:x:0:0:root:/root:/bin/bash\n\
                    sp1a2b3c4ds10:*:2000042:2000042:slot 10, of bn:/w/slots/10:/bin/bash\n\
                    sp1a2b3c4ds1:*:2000007:2000008::/w/slots/1:/bin/sh\n";
        let one = parse_passwd_line(text, "sp1a2b3c4ds1").unwrap();
        assert_eq!((one.uid, one.gid), (2000007, 2000008));
        assert_eq!(one.home, PathBuf::from("/w/slots/1"));
        assert_eq!(one.shell, PathBuf::from("/bin/sh"));
        assert_eq!(
            parse_passwd_line(text, "sp1a2b3c4ds10").unwrap().uid,
            2000042
        );
        assert!(parse_passwd_line(text, "sp1a2b3c4ds").is_none());
        assert!(parse_passwd_line("sp:x:notanumber:1::/h:/s\n", "sp").is_none());
        // As getpwnam reads it, for this host's own users.
        let root = lookup("root").unwrap();
        let from_file = lookup_in(Path::new("/etc"), "root").unwrap();
        assert_eq!((from_file.uid, from_file.home), (root.uid, root.home));
    }

    /// An `etc` with these `passwd` and `group` files.
    fn etc_with(passwd: &str, group: &str) -> tempfile::TempDir {
        let etc = tempfile::tempdir().unwrap();
        std::fs::write(etc.path().join("passwd"), passwd).unwrap();
        std::fs::write(etc.path().join("group"), group).unwrap();
        etc
    }

    fn passwd_dir() -> tempfile::TempDir {
        etc_with(
            "root:x:0:0:root:/root:/bin/bash\nsp1s0:x:2000001:1001:slotpool slot 0 of bn-a:/w/slots/0:/bin/bash\nother:x:2000009:1002::/home/other:/bin/sh\n",
            "root:x:0:\nsp1s0:x:1001:\nother:x:1002:\n",
        )
    }

    #[test]
    fn renumber_rewrites_only_the_users_uid_and_gid() {
        let etc = passwd_dir();
        renumber(etc.path(), "sp1s0", 2000005).unwrap();
        let passwd = std::fs::read_to_string(etc.path().join("passwd")).unwrap();
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/bash\nsp1s0:x:2000005:2000005:slotpool slot 0 of bn-a:/w/slots/0:/bin/bash\nother:x:2000009:1002::/home/other:/bin/sh\n"
        );
        let group = std::fs::read_to_string(etc.path().join("group")).unwrap();
        assert_eq!(group, "root:x:0:\nsp1s0:x:2000005:\nother:x:1002:\n");
        // The locks are given back, and no temporary file stays.
        let mut left: Vec<String> = std::fs::read_dir(etc.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [".pwd.lock", "group", "passwd"]);
    }

    /// The `etc` dirs of every rewrite of the password database, in order.
    static REWRITES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    pub(super) fn note_rewrite(etc: &Path) {
        REWRITES.lock().unwrap().push(etc.to_path_buf());
    }

    #[test]
    fn renumbers_queued_meanwhile_go_into_one_rewrite() {
        let users: Vec<String> = (0..4).map(|s| format!("sp2s{s}")).collect();
        let mut passwd = String::from("root:x:0:0:root:/root:/bin/bash\n");
        let mut group = String::from("root:x:0:\n");
        for (i, user) in users.iter().enumerate() {
            passwd.push_str(&format!(
                "{user}:x:{}:{}::/w/{i}:/bin/bash\n",
                2000100 + i,
                1100 + i
            ));
            group.push_str(&format!("{user}:x:{}:\n", 1100 + i));
        }
        let etc = etc_with(&passwd, &group);
        let queued = |etc: &Path| queued_renumbers().iter().filter(|q| q.etc == etc).count();
        // While another renumber of the process is being written, four slots ask for theirs.
        let turn = PASSWD.lock().unwrap();
        let threads: Vec<_> = users
            .iter()
            .enumerate()
            .map(|(i, user)| {
                let (etc, user) = (etc.path().to_path_buf(), user.clone());
                std::thread::spawn(move || renumber(&etc, &user, 2000200 + i as u32))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while queued(etc.path()) < users.len() {
            assert!(Instant::now() < deadline, "the renumbers never queued");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(turn);
        for thread in threads {
            thread.join().unwrap().unwrap();
        }
        let passwd = std::fs::read_to_string(etc.path().join("passwd")).unwrap();
        let group = std::fs::read_to_string(etc.path().join("group")).unwrap();
        for (i, user) in users.iter().enumerate() {
            let id = 2000200 + i;
            assert!(
                passwd.contains(&format!("{user}:x:{id}:{id}::/w/{i}:")),
                "{passwd}"
            );
            assert!(group.contains(&format!("{user}:x:{id}:")), "{group}");
        }
        let rewrites = REWRITES
            .lock()
            .unwrap()
            .iter()
            .filter(|e| *e == etc.path())
            .count();
        assert_eq!(rewrites, 1, "four renumbers queued together, one rewrite");
    }

    #[test]
    fn a_batch_refuses_only_the_renumber_whose_id_is_taken() {
        let etc = etc_with(
            "sp1s0:x:2000001:1001::/w/0:/bin/bash\nsp1s1:x:2000002:1002::/w/1:/bin/bash\nsp1s2:x:2000003:1003::/w/2:/bin/bash\n",
            "sp1s0:x:1001:\nsp1s1:x:1002:\nsp1s2:x:1003:\n",
        );
        let queue = |name: &str, id: u32| QueuedRenumber {
            etc: etc.path().to_path_buf(),
            name: name.into(),
            id,
            outcome: Arc::new(OnceLock::new()),
        };
        // The second asks for the id the first gets in the same batch; the third's user is
        // missing.
        let batch = vec![
            queue("sp1s0", 2000010),
            queue("sp1s1", 2000010),
            queue("gone", 2000011),
        ];
        let outcomes: Vec<_> = batch.iter().map(|q| q.outcome.clone()).collect();
        let _turn = PASSWD.lock().unwrap();
        renumber_batch(etc.path(), batch);
        let kinds: Vec<_> = outcomes
            .iter()
            .map(|o| o.get().unwrap().as_ref().err().map(|e| e.2))
            .collect();
        assert_eq!(
            kinds,
            [
                None,
                Some(std::io::ErrorKind::AlreadyExists),
                Some(std::io::ErrorKind::NotFound)
            ]
        );
        assert_eq!(
            std::fs::read_to_string(etc.path().join("passwd")).unwrap(),
            "sp1s0:x:2000010:2000010::/w/0:/bin/bash\nsp1s1:x:2000002:1002::/w/1:/bin/bash\nsp1s2:x:2000003:1003::/w/2:/bin/bash\n"
        );
    }

    #[test]
    fn a_lock_left_by_a_killed_shadow_tool_is_taken_over_at_once() {
        let etc = passwd_dir();
        // A useradd killed while it held the lock leaves `passwd.lock` naming its pid,
        // NUL-terminated as shadow-utils writes it.
        let mut gone = Command::new("true").spawn().unwrap();
        let pid = gone.id();
        gone.wait().unwrap();
        std::fs::write(etc.path().join("passwd.lock"), format!("{pid}\0")).unwrap();
        let started = Instant::now();
        renumber(etc.path(), "sp1s0", 2000005).unwrap();
        assert!(
            started.elapsed() < PASSWD_LOCK_WAIT,
            "waited for a dead holder: {:?}",
            started.elapsed()
        );
        assert!(!etc.path().join("passwd.lock").exists());
        assert_eq!(lock_holder(b"1234\0"), Some(1234));
        assert_eq!(lock_holder(b"1234\n"), Some(1234));
        assert_eq!(lock_holder(b"12x4"), None);
    }

    /// Both files are on disk before either is replaced: a renumber that cannot write
    /// `passwd` leaves `group` as it was too, so no user is left with a gid its group
    /// does not have.
    #[test]
    fn a_renumber_that_cannot_write_passwd_changes_neither_file() {
        let etc = passwd_dir();
        let before = ["passwd", "group"].map(|f| std::fs::read(etc.path().join(f)).unwrap());
        // What the new passwd is written to cannot be a file.
        std::fs::create_dir(etc.path().join("passwd+")).unwrap();
        let err = renumber(etc.path(), "sp1s0", 2000005).unwrap_err();
        assert_eq!(err.path, etc.path().join("passwd"), "{err}");
        let after = ["passwd", "group"].map(|f| std::fs::read(etc.path().join(f)).unwrap());
        assert_eq!(
            after
                .each_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned()),
            before
                .each_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
        ); // The staged group is not left behind.
        assert!(!etc.path().join("group+").exists());
    }

    #[test]
    fn renumber_refuses_an_id_in_use_and_a_missing_user() {
        let etc = passwd_dir();
        let taken = renumber(etc.path(), "sp1s0", 2000009).unwrap_err();
        assert_eq!(taken.error.kind(), std::io::ErrorKind::AlreadyExists);
        let missing = renumber(etc.path(), "nobody", 2000010).unwrap_err();
        assert_eq!(missing.error.kind(), std::io::ErrorKind::NotFound);
        assert!(std::fs::read_to_string(etc.path().join("passwd"))
            .unwrap()
            .contains("sp1s0:x:2000001:1001:"));
    }

    #[test]
    fn names_are_namespaced_per_backing_node() {
        let a = namespace("sp", "bn-01jq3m2f7h8g9k0m1n2p3q4r5s");
        let b = namespace("sp", "bn-01jq3m2f7h8g9k0m1n2p3q4r5t");
        assert_eq!(a.len(), 10);
        assert_ne!(a, b);
        assert!(a.starts_with("sp"));
        let name = user_name(&a, 3);
        assert_eq!(split_user_name(&name), Some((a.as_str(), 3)));
        assert!(user_name(&namespace("abcdefghijkl", "x"), 1023).len() <= MAX_USER_NAME);
        assert_eq!(split_user_name("root"), None);
        assert_eq!(split_user_name("s1"), None);
        assert_eq!(split_user_name("sp12s"), None);
    }

    #[test]
    fn a_locked_password_file_is_retried_and_other_failures_are_not() {
        // As userdel and useradd print them when another process holds the lock.
        assert!(passwd_locked(
            1,
            "userdel: lock /etc/passwd.lock already used by PID 16811\n\
             userdel: cannot lock /etc/passwd; try again later."
        ));
        assert!(passwd_locked(
            10,
            "useradd: cannot lock /etc/group; try again later."
        ));
        assert!(!passwd_locked(6, "userdel: user 'x' does not exist"));
        assert!(!passwd_locked(1, "userdel: cannot open /etc/passwd"));
        assert!(!passwd_locked(9, "useradd: user 'x' already exists"));
    }

    #[test]
    fn the_user_name_template_names_the_slot_users() {
        let ns = namespace("sp", "bn-01jq3m2f7h8g9k0m1n2p3q4r5s");
        let names = SlotNames {
            workspace: String::new(),
            username: Some(user_name_template(&ns)),
        };
        for slot in [0, 7, 12] {
            assert_eq!(names.username_of(slot), Some(user_name(&ns, slot)));
        }
    }

    #[test]
    fn prefixes() {
        assert!(valid_prefix("sp"));
        assert!(valid_prefix("spt-x9_"));
        assert!(!valid_prefix(""));
        assert!(!valid_prefix("9sp"));
        assert!(!valid_prefix("Sp"));
        assert!(!valid_prefix("sp.x"));
        assert!(!valid_prefix("abcdefghijklm"));
    }

    #[test]
    fn passwd_and_group_listing_by_prefix() {
        let etc = etc_with(
            "root:x:0:0::/root:/bin/sh\nspab12s0:x:1001:1001::/w:/bin/bash\nspab12s1:x:1002:1002::/w:/bin/bash\n",
            "root:x:0:\nspab12s0:x:1001:\nspabg:x:1003:\n",
        );
        assert_eq!(
            users_with_prefix(etc.path(), "spab"),
            vec!["spab12s0", "spab12s1"]
        );
        assert_eq!(
            groups_with_prefix(etc.path(), "spab"),
            vec!["spab12s0", "spabg"]
        );
    }
}
