//! `slotpool demo` stops everything it started and removes its directory, however it is
//! stopped: Ctrl-C, SIGTERM, its reader going away (`slotpool demo | head -3`) or a panic;
//! what it started dies with it when it is killed with SIGKILL, and the directory that
//! one leaves, the next demo removes. Its simulated jobs go on after a bus outage.

use slotpool_tests::{bin_path, nats_server_binary, workspace_root, ChildGuard, Tmux};
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
/// From a demo's death to the end of what it started (the console stops on SIGTERM).
const DEATH: Duration = Duration::from_secs(10);
/// Simulated jobs each demo runs.
const JOBS: u32 = 2;
/// How long the demo's nats-server stays down in the outage test (the outage the demo's
/// jobs once did not survive).
const OUTAGE: Duration = Duration::from_secs(10);
/// From the bus's return to a simulated job served again: a job waits up to 8 s between
/// tries, and a request in flight may wait out the API's timeout.
const RECOVERED: Duration = Duration::from_secs(60);

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
    let demo = RunningDemo::start(tmp.path(), "demo", keep_reading, &[]);
    demo.assert_an_agent_runs();
    match stop {
        Stop::Signal(signal) => demo.signal(signal),
        Stop::CloseStdout => {}
    }
    demo.stopped_cleanly();
}

/// A panic anywhere in the demo (here in a simulated job's task) still stops what it
/// started and removes its directory; the demo exits with 101.
#[test]
fn the_demo_cleans_up_after_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = RunningDemo::start(tmp.path(), "demo", true, &["--panic-after-first-job"]);
    let (status, _, context) = demo.stopped();
    assert_eq!(status.code(), Some(101), "{context}");
    assert!(context.contains("--panic-after-first-job"), "{context}");
}

/// `kill -9` leaves a demo no chance to stop anything, yet what it started dies with it:
/// the kernel kills its nats-server and local agents (`PR_SET_PDEATHSIG`). Its directory
/// stays, with whatever else still names it (here a stray process, as an older demo's
/// agent would be); the next demo in the same temp directory removes both.
#[test]
fn a_killed_demos_processes_die_with_it_and_the_next_demo_removes_what_is_left() {
    let tmp = tempfile::tempdir().unwrap();
    let mut killed = RunningDemo::start(tmp.path(), "first", true, &[]);
    killed.assert_an_agent_runs();
    killed.signal(libc::SIGKILL);
    killed.exited();
    let left = left_after_the_death_signals(&killed.dir);
    assert!(
        left.is_empty(),
        "left running after the demo was killed with SIGKILL: {left:#?}"
    );
    assert!(killed.dir.exists(), "the killed demo removed its directory");

    let stray_path = killed.dir.join("agents").join("stray");
    let mut stray = Command::new("sh");
    stray
        .args(["-c", "sleep 600; :"])
        .arg(&stray_path)
        .stdin(Stdio::null());
    let _stray = ChildGuard::spawn("a stray process naming the demo's directory", stray).unwrap();
    assert!(!processes_naming(&killed.dir).is_empty());

    let next = RunningDemo::start(tmp.path(), "second", true, &[]);
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

/// On a terminal the demo shows the console; a demo killed with SIGKILL takes it along,
/// with SIGTERM, on which the console gives the terminal back (here a shell's, which
/// goes on after the demo, so the terminal stays open and sends no SIGHUP).
#[test]
fn a_killed_demos_console_ends_and_gives_the_terminal_back() {
    let tmp = tempfile::tempdir().unwrap();
    let command = format!(
        "env TMPDIR={} SLOTPOOL_NATS_SERVER={} NO_COLOR=1 {} demo --jobs {JOBS} --hold-ms 500 \
         --isolation none; sleep 600",
        tmp.path().display(),
        nats_server_binary().display(),
        bin_path("slotpool").display(),
    );
    let terminal = Tmux::start(&command, 120, 40);
    let on_screen = |what: &str, check: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + STARTED;
        loop {
            let screen = terminal.screen();
            if check(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "the terminal did not show {what}:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The console, showing a ready backing node.
    on_screen("the console with a ready node", &|s| {
        s.contains("1 Pools") && s.contains("ready")
    });
    let demo: u32 = std::fs::read_dir(tmp.path())
        .unwrap()
        .find_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("slotpool-demo-")?
                .parse()
                .ok()
        })
        .expect("the demo's directory");
    let dir = tmp.path().join(format!("slotpool-demo-{demo}"));
    let _left = KillNaming(dir.clone());
    assert!(
        processes_naming(&dir)
            .iter()
            .any(|(_, cmdline)| cmdline.contains("slotpool-console")),
        "the console runs, naming {}",
        dir.display()
    );

    // SAFETY: a plain signal to the demo, whose pid its directory names.
    assert_eq!(unsafe { libc::kill(demo as libc::pid_t, libc::SIGKILL) }, 0);
    let left = left_after_the_death_signals(&dir);
    assert!(
        left.is_empty(),
        "left running after the demo was killed with SIGKILL: {left:#?}\n{}",
        terminal.screen()
    );
    // The terminal's own screen again, with what the demo said before the console.
    on_screen("the terminal's screen from before the console", &|s| {
        s.contains("slotpool demo: NATS at") && !s.contains("1 Pools")
    });
}

/// The README's second terminal, as it is written there: source the env file the demo
/// wrote, ask for a node, list the nodes, log in to the node over SSH, give it back, and
/// run a command in a node in one go.
/// As root the demo's slots are Unix users with an sshd of its own; when it stops, its
/// slot users and its env file are gone.
#[test]
fn the_readmes_second_terminal_gets_a_node_and_logs_in_to_it() {
    slotpool_tests::require_root();
    let tmp = tempfile::tempdir().unwrap();
    let demo = RunningDemo::start(tmp.path(), "demo", true, &["--isolation", "users"]);
    let env_file = tmp.path().join("slotpool-demo.env");
    assert!(
        env_file.is_file(),
        "the demo wrote no {}",
        env_file.display()
    );
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let block: Vec<String> = readme
        .split("```sh\n")
        .find(|b| b.starts_with(". /tmp/slotpool-demo.env"))
        .expect("the README's second terminal")
        .split("```")
        .next()
        .unwrap()
        .lines()
        .map(|l| {
            l.split("  #")
                .next()
                .unwrap()
                .trim()
                .replace("/tmp/", &format!("{}/", tmp.path().display()))
        })
        .collect();
    let run = |script: &str| {
        let out = Command::new("bash")
            .args(["-euc", script])
            .env_remove("SLOTPOOL_NATS_URL")
            .env_remove("SLOTPOOL_NATS_CREDS")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "`{script}` failed:\n{text}");
        text
    };
    // The binaries come from the env file's PATH: the demo's own.
    let asked = run(&format!("{}\n{}", block[0], block[1]));
    let login = asked
        .lines()
        .find_map(|l| l.split_once(": ssh -p "))
        .unwrap_or_else(|| panic!("`{}` printed no login:\n{asked}", block[1]));
    let node = login.0.to_string();
    let (port, user_host) = login.1.split_once(' ').unwrap();
    let user = user_host.split('@').next().unwrap();
    let listed = run(&format!("{}\n{}", block[0], block[2]));
    assert!(
        listed.contains(&node),
        "`{}` does not show {node}:\n{listed}",
        block[2]
    );
    let ssh = block[3]
        .replace("<port>", port)
        .replace("<user>", user)
        .replace(
            "ssh ",
            "ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null ",
        );
    run(&format!("{}\n{ssh}", block[0]));
    let whoami = run(&format!(
        "{}\n{}",
        block[0],
        ssh.replace(" hostname", " id -un")
    ));
    assert!(
        whoami.lines().any(|l| l.trim() == user),
        "logged in as someone else:\n{whoami}"
    );
    run(&format!(
        "{}\n{}",
        block[0],
        block[4].replace("<node>", &node)
    ));
    let ran = run(&format!("{}\n{}", block[0], block[5]));
    assert!(
        ran.contains("Linux"),
        "`{}` did not print the node's uname:\n{ran}",
        block[5]
    );
    demo.signal(libc::SIGTERM);
    demo.stopped_cleanly();
    assert!(!env_file.exists(), "the env file outlived the demo");
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    assert!(
        !passwd.lines().any(|l| l.starts_with(user)),
        "the slot user {user} outlived the demo"
    );
}

/// The demo's nats-server killed and, after [`OUTAGE`], started again on the same port
/// and store: each simulated job, which fails meanwhile, gets nodes again.
#[test]
fn the_demos_jobs_go_on_after_a_bus_outage() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = RunningDemo::start(tmp.path(), "demo", true, &[]);
    let (pid, args) = processes_naming(&demo.dir)
        .into_iter()
        .find(|(_, cmdline)| cmdline.contains("nats-server"))
        .map(|(pid, _)| (pid, command_line(pid)))
        .expect("the demo's nats-server");
    let ports = demo
        .dir
        .join("ports")
        .join(format!("nats-server_{pid}.ports"));
    let ports = std::fs::read_to_string(&ports).expect("the server's ports file");
    let port = ports
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .expect("the server's port")
        .to_string();

    // SAFETY: a plain signal to the demo's server, a pid just read from /proc.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let down = Instant::now();
    demo.wait_line("a job saying it failed", down + STOPPED, |l| {
        l.starts_with("job ") && l.contains("trying again")
    });
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));

    // The same command line, on the port it had picked.
    let mut again = Command::new(&args[0]);
    let mut rest = args[1..].to_vec();
    let at = rest
        .iter()
        .position(|a| a == "-p")
        .expect("-p in the command line");
    rest[at + 1] = port.clone();
    again
        .args(&rest)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _server = ChildGuard::spawn("the demo's nats-server, again", again).unwrap();
    // Every job, and not only one that happened to be waiting out the outage elsewhere.
    let back = Instant::now();
    for job in 0..JOBS {
        let served = format!("job {job}: got ");
        let line = demo.wait_line(&served, back + RECOVERED, |l| l.starts_with(&served));
        eprintln!(
            "bus back on port {port}; {:?} later: {line}",
            back.elapsed()
        );
    }
    demo.signal(libc::SIGTERM);
    demo.stopped_cleanly();
}

/// What still names `dir` once the kernel's death signals, sent as a demo died, had
/// [`DEATH`] to take effect: nothing, unless a process was spared.
fn left_after_the_death_signals(dir: &Path) -> Vec<(i32, String)> {
    let deadline = Instant::now() + DEATH;
    while !processes_naming(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    processes_naming(dir)
}

/// The arguments of process `pid`.
fn command_line(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// A `slotpool demo --no-console` that has served its first simulated job.
struct RunningDemo {
    process: ChildGuard,
    dir: PathBuf,
    stderr_path: PathBuf,
    reader: Option<std::thread::JoinHandle<Vec<String>>>,
    /// Every line of stdout, as it comes.
    lines: mpsc::Receiver<String>,
    /// Dropped after `process`: whatever the demo left, when a test fails half-way.
    _left: KillNaming,
}

impl RunningDemo {
    /// Starts a demo with `tmp` as its temp directory and `more` arguments, and waits for
    /// its first job served. Unless `keep_reading`, the reader of its stdout then stops and
    /// closes the pipe.
    fn start(tmp: &Path, name: &str, keep_reading: bool, more: &[&str]) -> RunningDemo {
        let stderr_path = tmp.join(format!("{name}.stderr"));
        let mut cmd = Command::new(bin_path("slotpool"));
        cmd.args(["demo", "--no-console", "--hold-ms", "500", "--jobs"])
            .arg(JOBS.to_string())
            .args(more);
        // Slots as directories unless the test asks for users: a Unix user per slot is
        // for the test of logins.
        if !more.contains(&"--isolation") {
            cmd.args(["--isolation", "none"]);
        }
        cmd.env("SLOTPOOL_NATS_SERVER", nats_server_binary())
            .env("TMPDIR", tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap());
        let mut process = ChildGuard::spawn(format!("slotpool demo ({name})"), cmd).unwrap();
        let dir = tmp.join(format!("slotpool-demo-{}", process.id()));

        // A reader of the demo's stdout: it passes on every line, and after the first
        // job served keeps reading (or, to close the pipe, stops and drops it).
        let stdout = process.child_mut().stdout.take().unwrap();
        let (line_tx, lines) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let got = line.starts_with("job ") && line.contains(" got ");
                let _ = line_tx.send(line.clone());
                seen.push(line);
                if got && !keep_reading {
                    break;
                }
            }
            seen
        });
        let demo = RunningDemo {
            process,
            _left: KillNaming(dir.clone()),
            dir,
            stderr_path,
            reader: Some(reader),
            lines,
        };
        demo.wait_line("a simulated job served", Instant::now() + STARTED, |l| {
            l.starts_with("job ") && l.contains(" got ")
        });
        demo
    }

    /// Waits until the demo prints a line that `wanted` takes, and returns it.
    fn wait_line(&self, what: &str, deadline: Instant, wanted: impl Fn(&str) -> bool) -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if wanted(&line) => return line,
                Ok(_) => {}
                Err(_) => panic!(
                    "the demo printed no line of {what} in time\nstderr:\n{}",
                    self.stderr()
                ),
            }
        }
    }

    fn assert_an_agent_runs(&self) {
        assert!(
            processes_naming(&self.dir)
                .iter()
                .any(|(_, cmdline)| cmdline.contains("slotpool-agent")),
            "a local agent runs in {}",
            self.dir.display()
        );
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
    fn stopped_cleanly(self) -> Vec<String> {
        let (status, out, context) = self.stopped();
        assert!(status.success(), "the demo exited with {status}\n{context}");
        out
    }

    /// Waits for the demo to exit and checks it left nothing behind. Returns how it
    /// exited, what it printed, and that with its stderr (for messages).
    fn stopped(mut self) -> (std::process::ExitStatus, Vec<String>, String) {
        let out = self.reader.take().expect("read once").join().unwrap();
        let status = self.exited();
        let context = format!("stdout:\n{}\nstderr:\n{}", out.join("\n"), self.stderr());
        let left = processes_naming(&self.dir);
        assert!(left.is_empty(), "left running: {left:#?}\n{context}");
        assert!(
            !self.dir.exists(),
            "{} left behind\n{context}",
            self.dir.display()
        );
        (status, out, context)
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
