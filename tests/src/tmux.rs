//! [`Tmux`]: a terminal for the tests of programs that draw on one (the console, the
//! demo on a terminal), driven with key presses and read back as text.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long [`Tmux::wait_screen`] waits.
pub const SCREEN_WAIT: Duration = Duration::from_secs(20);

/// A tmux server of our own (its own socket) running one session; killed on drop with
/// everything in it.
pub struct Tmux {
    socket: String,
    /// The session's name (`tmux list-sessions` shows it while it runs).
    pub session: String,
}

impl Tmux {
    /// Runs `command` (through the shell) in a new session of `width`×`height`.
    pub fn start(command: &str, width: u16, height: u16) -> Tmux {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let tmux = Tmux {
            socket: format!("slotpool-test-{}-{n}", std::process::id()),
            session: format!("console-{n}"),
        };
        let status = tmux
            .cmd()
            .args(["new-session", "-d", "-s", &tmux.session])
            .args(["-x", &width.to_string(), "-y", &height.to_string()])
            .arg(command)
            .status()
            .expect("running tmux (scripts/test.sh installs it)");
        assert!(status.success(), "tmux new-session failed: {status}");
        tmux
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket, "-f", "/dev/null"]);
        c
    }

    /// Sends tmux key names (`D`, `Tab`, `Enter`, `5`...).
    pub fn keys(&self, keys: &[&str]) {
        let status = self
            .cmd()
            .args(["send-keys", "-t", &self.session])
            .args(keys)
            .status()
            .expect("tmux send-keys");
        assert!(status.success());
    }

    /// What the session's pane shows now.
    pub fn screen(&self) -> String {
        let out = self
            .cmd()
            .args(["capture-pane", "-p", "-t", &self.session])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// Waits until the screen satisfies `check`; panics with the screen otherwise.
    pub async fn wait_screen(&self, what: &str, check: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + SCREEN_WAIT;
        loop {
            let screen = self.screen();
            if check(&screen) {
                return screen;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for the screen to show {what}; screen:\n{screen}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        // The server is gone already when the console quit; that is fine.
        let _ = self
            .cmd()
            .arg("kill-server")
            .stderr(std::process::Stdio::null())
            .status();
        // tmux may leave its socket file behind.
        let dir = std::env::var("TMUX_TMPDIR").unwrap_or_else(|_| "/tmp".into());
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let _ = std::fs::remove_file(format!("{dir}/tmux-{uid}/{}", self.socket));
    }
}
