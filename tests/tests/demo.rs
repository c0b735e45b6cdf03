//! `slotpool demo` stops everything it started and removes its directory, however it is
//! stopped: Ctrl-C, SIGTERM, or its reader going away (`slotpool demo | head -3`); and
//! what one killed with SIGKILL left, the next demo removes.

use slotpool_tests::{bin_path, nats_server_binary, ChildGuard};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// From start to the first simulated job served: a nats-server, a launcher and an agent
/// come up on a busy 2-core machine.
const STARTED: Duration = Duration::from_secs(90);
/// From the stop to the demo's exit.
const STOPPED: Duration = Duration::from_secs(60);

enum Stop {
    Signal(libc::c_int),
    CloseStdout,
}

#[test]
fn the_demo_cleans_up_after_ctrl_c() {
    demo_cleans_up(Stop::Signal(libc::SIGINT));
}

#[test]
fn the_demo_cleans_up_after_sigterm() {
    demo_cleans_up(Stop::Signal(libc::SIGTERM));
}

#[test]
fn the_demo_cleans_up_when_its_stdout_is_closed() {
    demo_cleans_up(Stop::CloseStdout);
}

fn demo_cleans_up(stop: Stop) {
    let tmp = tempfile::tempdir().unwrap();
    let keep_reading = !matches!(stop, Stop::CloseStdout);
    let demo = RunningDemo::start(tmp.path(), "demo", keep_reading);
    match stop {
        Stop::Signal(signal) => demo.signal(signal),
        Stop::CloseStdout => {}
    }
    demo.stopped_cleanly();
}

/// `kill -9` leaves a demo no chance to stop anything: its nats-server and agents go on.
/// The next demo in the same temp directory finds them and removes them.
#[test]
fn the_next_demo_removes_what_a_killed_demo_left() {
    let tmp = tempfile::tempdir().unwrap();
    let mut killed = RunningDemo::start(tmp.path(), "first", true);
    killed.signal(libc::SIGKILL);
    killed.exited();
    assert!(
        !processes_naming(&killed.dir).is_empty(),
        "a demo killed with SIGKILL leaves its processes in {}",
        killed.dir.display()
    );

    let next = RunningDemo::start(tmp.path(), "second", true);
    let left = processes_naming(&killed.dir);
    assert!(
        left.is_empty(),
        "the next demo left the killed one's processes running: {left:#?}\nstderr:\n{}",
        next.stderr()
    );
    assert!(!killed.dir.exists(), "{} left behind", killed.dir.display());
    next.signal(libc::SIGTERM);
    let out = next.stopped_cleanly();
    assert!(
        out.iter()
            .any(|l| l.contains("removed what an earlier demo")
                && l.contains(&killed.process.id().to_string())),
        "the next demo says what it removed:\n{}",
        out.join("\n")
    );
}

/// A `slotpool demo --no-console` that has served its first simulated job.
struct RunningDemo {
    process: ChildGuard,
    dir: PathBuf,
    stderr_path: PathBuf,
    reader: Option<std::thread::JoinHandle<Vec<String>>>,
    /// Dropped after `process`: whatever the demo left, when a test fails half-way.
    _left: KillNaming,
}

impl RunningDemo {
    /// Starts a demo with `tmp` as its temp directory and waits for its first job served.
    /// Unless `keep_reading`, the reader of its stdout then stops and closes the pipe.
    fn start(tmp: &Path, name: &str, keep_reading: bool) -> RunningDemo {
        let stderr_path = tmp.join(format!("{name}.stderr"));
        let mut cmd = Command::new(bin_path("slotpool"));
        cmd.args(["demo", "--no-console", "--jobs", "2", "--hold-ms", "500"])
            .env("SLOTPOOL_NATS_SERVER", nats_server_binary())
            .env("TMPDIR", tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap());
        let mut process = ChildGuard::spawn(format!("slotpool demo ({name})"), cmd).unwrap();
        let dir = tmp.join(format!("slotpool-demo-{}", process.id()));

        // A reader of the demo's stdout: it reports the first job served, then keeps
        // reading (or, to close the pipe, stops and drops it).
        let stdout = process.child_mut().stdout.take().unwrap();
        let (served_tx, served) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut seen = Vec::new();
            for line in lines.by_ref() {
                let Ok(line) = line else { break };
                let got = line.starts_with("job ") && line.contains(" got ");
                seen.push(line);
                if got {
                    let _ = served_tx.send(());
                    break;
                }
            }
            if keep_reading {
                seen.extend(lines.map_while(Result::ok));
            }
            seen
        });
        let demo = RunningDemo {
            process,
            _left: KillNaming(dir.clone()),
            dir,
            stderr_path,
            reader: Some(reader),
        };
        if served.recv_timeout(STARTED).is_err() {
            panic!(
                "no simulated job was served within {STARTED:?}\nstderr:\n{}",
                demo.stderr()
            );
        }
        assert!(
            processes_naming(&demo.dir)
                .iter()
                .any(|(_, cmdline)| cmdline.contains("slotpool-agent")),
            "a local agent runs in {}",
            demo.dir.display()
        );
        demo
    }

    /// Signals the demo process only (not its process group: what it started must be
    /// stopped by the demo itself, or, after SIGKILL, not at all).
    fn signal(&self, signal: libc::c_int) {
        // SAFETY: a plain signal to our own unreaped child.
        unsafe {
            libc::kill(self.process.id() as libc::pid_t, signal);
        }
    }

    /// Waits up to [`STOPPED`] for the demo process to exit.
    fn exited(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + STOPPED;
        loop {
            if let Some(status) = self.process.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the demo did not stop within {STOPPED:?}\nstderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits for the demo to exit after its stop, and checks it succeeded and left nothing
    /// behind. Returns what it printed.
    fn stopped_cleanly(mut self) -> Vec<String> {
        let out = self.reader.take().expect("read once").join().unwrap();
        let status = self.exited();
        let context = format!("stdout:\n{}\nstderr:\n{}", out.join("\n"), self.stderr());
        assert!(status.success(), "the demo exited with {status}\n{context}");
        let left = processes_naming(&self.dir);
        assert!(left.is_empty(), "left running: {left:#?}\n{context}");
        assert!(
            !self.dir.exists(),
            "{} left behind\n{context}",
            self.dir.display()
        );
        out
    }
}

/// Kills whatever still names a demo's directory when the test ends, passed or not.
struct KillNaming(PathBuf);

impl Drop for KillNaming {
    fn drop(&mut self) {
        for (pid, _) in processes_naming(&self.0) {
            // SAFETY: plain kills of pids just read from /proc (this test's orphans).
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Processes whose command line names `dir`, with their command lines.
fn processes_naming(dir: &Path) -> Vec<(i32, String)> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let raw = std::fs::read(PathBuf::from(format!("/proc/{pid}/cmdline"))).ok()?;
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            cmdline.contains(&needle).then_some((pid, cmdline))
        })
        .collect()
}
