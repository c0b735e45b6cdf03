//! Spawning processes that cannot outlive the test, and finding the workspace's binaries.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::time::Instant;

/// The workspace checkout the tests were built from.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives inside the workspace")
}

/// The path of workspace binary `name` (`slotpool`, `slotpool-agent`, ...) in the same
/// `target/<profile>` directory as the running test.
///
/// `env!("CARGO_BIN_EXE_<name>")` only sees binaries of this package, so tests find the
/// others here; they must be built first with `cargo build --workspace --bins`
/// (`scripts/test.sh` does that before `cargo test`). Panics when the binary is missing.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the running test executable");
    let mut dir = exe.parent().expect("test executable has a directory");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("deps has a parent");
    }
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} not found: build the workspace binaries first with `cargo build --workspace --bins` \
         (scripts/test.sh does this before running the tests)",
        path.display()
    );
    path
}

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` on a thread that lives as long as the test process.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process;
/// tokio worker and blocking threads come and go, so every child is forked from this one
/// long-lived thread instead.
fn spawn_from_stable_thread(cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("slotpool-test-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("starting the spawner thread");
        tx
    });
    let (tx, rx) = mpsc::channel();
    spawner
        .send((cmd, tx))
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("spawner thread is gone"))?
}

/// A child process in its own process group, killed with the whole group on drop.
///
/// The child also gets `PR_SET_PDEATHSIG = SIGKILL`, so it dies when the test process dies,
/// even by SIGKILL. (Its own children are covered by the group kill on drop only.)
pub struct ChildGuard {
    name: String,
    child: Child,
    status: Option<ExitStatus>,
}

impl ChildGuard {
    /// Spawns `cmd` as `name` (used in messages). Stdio is whatever `cmd` configured.
    pub fn spawn(name: impl Into<String>, mut cmd: Command) -> io::Result<ChildGuard> {
        let parent = std::process::id();
        cmd.process_group(0);
        // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let name = name.into();
        let child = spawn_from_stable_thread(cmd)
            .map_err(|err| io::Error::new(err.kind(), format!("spawning {name}: {err}")))?;
        Ok(ChildGuard {
            name,
            child,
            status: None,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id (also its process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The underlying child, e.g. to take its piped stdout.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// The exit status if the process has exited (reaping it), without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|err| panic!("waiting for {}: {err}", self.name));
        }
        self.status
    }

    /// Sends `signal` to the child's process group, unless the child was already reaped.
    pub fn signal(&mut self, signal: libc::c_int) {
        if self.status.is_none() {
            // SAFETY: plain syscall; the group id is our unreaped child's pid, so it
            // cannot have been reused.
            unsafe {
                libc::killpg(self.child.id() as libc::pid_t, signal);
            }
        }
    }

    /// SIGKILLs the process group and reaps the child.
    pub fn kill(&mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        self.reap()
    }

    /// SIGTERMs the process group and waits up to `grace` for the child to exit, then
    /// SIGKILLs it. Returns the exit status.
    pub async fn terminate(&mut self, grace: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(status) = self.try_wait() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        eprintln!(
            "{} did not exit within {grace:?} of SIGTERM: killing it",
            self.name
        );
        self.kill()
    }

    /// Waits for the child to exit on its own, up to `timeout`; `None` if it is still running.
    pub async fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn reap(&mut self) -> ExitStatus {
        if let Some(status) = self.status {
            return status;
        }
        let status = self
            .child
            .wait()
            .unwrap_or_else(|err| panic!("waiting for {}: {err}", self.name));
        self.status = Some(status);
        status
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
        if self.status.is_none() {
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: i32) -> bool {
        // SAFETY: signal 0 only checks existence.
        unsafe { libc::kill(pid, 0) == 0 }
    }

    #[tokio::test]
    async fn drop_kills_the_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild.pid");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("sleep 600 & echo $! > {}; wait", pidfile.display()));
        let guard = ChildGuard::spawn("sh", cmd).unwrap();
        let grandchild: i32 = crate::wait_for_some(
            "the grandchild's pid file",
            Duration::from_secs(10),
            || async {
                let text = std::fs::read_to_string(&pidfile).ok()?;
                text.trim().parse().ok()
            },
        )
        .await;
        assert!(alive(grandchild));
        drop(guard);
        // The grandchild is not ours to reap: it is gone once init reaps it.
        crate::wait_for("the grandchild to die", Duration::from_secs(10), || async {
            !alive(grandchild)
                || std::fs::read_to_string(format!("/proc/{grandchild}/stat"))
                    .map(|s| s.contains(") Z "))
                    .unwrap_or(true)
        })
        .await;
    }

    #[tokio::test]
    async fn terminate_reports_the_exit() {
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let mut guard = ChildGuard::spawn("sleep", cmd).unwrap();
        assert!(guard.try_wait().is_none());
        let status = guard.terminate(Duration::from_secs(10)).await;
        assert!(!status.success());
        assert!(guard.try_wait().is_some());
    }
}
