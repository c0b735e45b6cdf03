//! `slotpool demo` stops everything it started and removes its directory, however it is
//! stopped: Ctrl-C, SIGTERM, or its reader going away (`slotpool demo | head -3`).

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
    let stderr_path = tmp.path().join("demo.stderr");
    let mut cmd = Command::new(bin_path("slotpool"));
    cmd.args(["demo", "--no-console", "--jobs", "2", "--hold-ms", "500"])
        .env("SLOTPOOL_NATS_SERVER", nats_server_binary())
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    let mut demo = ChildGuard::spawn("slotpool demo", cmd).unwrap();
    let dir = tmp.path().join(format!("slotpool-demo-{}", demo.id()));
    let stderr = || std::fs::read_to_string(&stderr_path).unwrap_or_default();

    // A reader of the demo's stdout: it reports the first job served, then keeps reading
    // (or, to close the pipe, stops and drops it).
    let stdout = demo.child_mut().stdout.take().unwrap();
    let keep_reading = !matches!(stop, Stop::CloseStdout);
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
    if served.recv_timeout(STARTED).is_err() {
        panic!(
            "no simulated job was served within {STARTED:?}\nstderr:\n{}",
            stderr()
        );
    }
    assert!(
        processes_naming(&dir)
            .iter()
            .any(|(_, cmdline)| cmdline.contains("slotpool-agent")),
        "a local agent runs in {}",
        dir.display()
    );

    match stop {
        // SAFETY: a plain signal to our own unreaped child.
        Stop::Signal(signal) => unsafe {
            libc::kill(demo.id() as libc::pid_t, signal);
        },
        Stop::CloseStdout => {}
    }
    let out = reader.join().unwrap();
    let deadline = Instant::now() + STOPPED;
    let status = loop {
        if let Some(status) = demo.try_wait() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the demo did not stop within {STOPPED:?}\nstdout:\n{}\nstderr:\n{}",
            out.join("\n"),
            stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let context = format!("stdout:\n{}\nstderr:\n{}", out.join("\n"), stderr());
    assert!(status.success(), "the demo exited with {status}\n{context}");
    let left = processes_naming(&dir);
    assert!(left.is_empty(), "left running: {left:#?}\n{context}");
    assert!(!dir.exists(), "{} left behind\n{context}", dir.display());
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
