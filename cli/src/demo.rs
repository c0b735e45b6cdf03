//! `slotpool demo`: a whole pool on this machine. It starts a nats-server with JetStream and
//! authentication on in a temp dir (unless `--connect` is given), a launcher with the local provider, and a
//! small load generator. On a terminal it opens the operator console (`slotpool-console`,
//! built next to `slotpool`) and keeps its own log in a file meanwhile; otherwise, or with
//! `--no-console`, it prints what its jobs get on stdout. Quitting the console, Ctrl-C,
//! SIGTERM or stdout's reader going away stops everything it started, step by step; an
//! error or a panic kills what is left ([`Leftovers`]). Either way its directory goes.

use anyhow::{bail, Context};
use clap::Args;
use rustix::process::Signal;
use slotpool_config::Config;
use slotpool_launcher::agent_bus::AgentBus;
use slotpool_launcher::provider::local::{
    end_with_parent, AgentLifetime, LocalProvider, STOP_GRACE,
};
use slotpool_launcher::{run, LauncherDeps, LauncherError};
use slotpool_local_run::sshd::{SshdFiles, SSHD};
use slotpool_local_run::{find_nats_server, start_nats_server, stop_child};
use slotpool_protocol::auth::setup::{self, SetupPlan};
use slotpool_protocol::auth::{BusUser, Minter, Role};
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::{Bus, NatsOptions};
use slotpool_protocol::model::RequestState;
use std::io::IsTerminal;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// nats-server binary (>= 2.11) to start; default: $SLOTPOOL_NATS_SERVER, then
    /// `nats-server` on PATH, then `.tools/nats/bin/nats-server`.
    #[arg(long, env = "SLOTPOOL_NATS_SERVER")]
    pub nats_server: Option<PathBuf>,
    /// Use the NATS server given by --nats instead of starting one.
    #[arg(long)]
    pub connect: bool,
    /// Concurrent simulated CI jobs.
    #[arg(long, default_value_t = 6)]
    pub jobs: u32,
    /// How long each simulated job holds its node, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub hold_ms: u64,
    /// Stop by itself after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration: Option<u64>,
    /// Print the log instead of opening the console, even on a terminal.
    #[arg(long)]
    pub no_console: bool,
    /// With --connect: the installation's signing key, so the demo's local agents get
    /// credentials of their own (`slotpool nats-setup` writes it).
    #[arg(long, value_name = "FILE")]
    pub agent_signing_key: Option<PathBuf>,
    /// How the local agents isolate their slots: `users` (a Unix user, cgroup and
    /// workspace per slot, with an sshd of the demo's own to log in to them; root only)
    /// or `none` (a directory per slot, nothing to log in to). Default: `users` as root
    /// when sshd is installed, else `none`.
    #[arg(long, value_enum, value_name = "MODE")]
    pub isolation: Option<Isolation>,
    /// Panic once the first simulated job got its node: the test of the demo's panic path.
    #[arg(long, hide = true)]
    pub panic_after_first_job: bool,
}

/// The demo's slots (see [`DemoArgs::isolation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    Users,
    None,
}

/// The environment file a second terminal sources to reach the demo: in the temporary
/// directory, at a name that does not change, so the README can say it.
pub fn env_file() -> PathBuf {
    std::env::temp_dir().join("slotpool-demo.env")
}

const DEMO_CONFIG: &str = "\
launcher:
  lease-ttl: 5
providers:
  - name: local
    driver: local
    local:
      work-dir: WORK_DIR
      agent-args: AGENT_ARGS
    pools:
      - name: main
        max-servers: 3
        boot-timeout: 30
        labels:
          - name: small
            backing-label: demo-vm
            max-parallel-jobs: 4
            grace-time: 5
            node-attributes: {demo: true}
";

pub async fn run_demo(args: DemoArgs, nats: &super::NatsClientArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile_dir()?;
    // From here on, every way out (a return, an error, a panic, a second Ctrl-C) stops
    // what the demo started and removes its directory.
    let _leftovers = Leftovers::register(dir.clone());
    let shutdown = CancellationToken::new();
    // Ctrl-C and SIGTERM are caught from the start, so that one during start-up also
    // stops what was started so far.
    let mut interrupt = signal(SignalKind::interrupt()).context("catching Ctrl-C")?;
    let mut terminate = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            tokio::select! { _ = interrupt.recv() => {}, _ = terminate.recv() => {} }
            shutdown.cancel();
            if interrupt.recv().await.is_some() {
                log_line("slotpool demo: second interrupt: killing what is left and exiting now");
                clean_up_now();
                std::process::exit(i32::from(super::exit::INTERRUPTED));
            }
        }
    });
    let _ = STOP.set(shutdown.clone());
    let started = tokio::select! {
        started = start(&args, nats, &dir, &shutdown) => started?,
        _ = shutdown.cancelled() => {
            say("slotpool demo: stopped while starting");
            return Ok(ExitCode::from(super::exit::INTERRUPTED));
        }
    };
    let Started {
        launcher,
        load,
        server,
        config_path,
        console_args,
        agent_binary,
        sshd,
    } = started;

    let stop = async {
        match args.duration {
            Some(s) => {
                tokio::select! { _ = shutdown.cancelled() => {}, _ = tokio::time::sleep(Duration::from_secs(s)) => {} }
            }
            None => shutdown.cancelled().await,
        }
    };
    let console = super::sibling_binary("slotpool-console");
    if !args.no_console && std::io::stdout().is_terminal() && console.is_file() {
        let log = dir.join("demo.log");
        let quiet = StderrToFile::redirect(&log)
            .with_context(|| format!("redirecting the demo's log to {}", log.display()))?;
        LOG_TO_STDERR.store(true, Ordering::Relaxed);
        let mut cmd = Command::new(&console);
        cmd.args(&console_args)
            .arg("--config")
            .arg(&config_path)
            .stderr(quiet.original()?)
            .kill_on_drop(true);
        // A demo killed with SIGKILL takes the console with it: SIGTERM, on which the
        // console gives the terminal back. Forked here, on the main thread.
        let demo = std::process::id();
        // SAFETY: end_with_parent calls only async-signal-safe functions.
        unsafe {
            cmd.pre_exec(move || end_with_parent(demo, Signal::TERM));
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", console.display()))?;
        tokio::select! {
            _ = child.wait() => {}
            _ = stop => stop_child(&mut child).await,
        }
        drop(quiet);
        LOG_TO_STDERR.store(false, Ordering::Relaxed);
        say("slotpool demo: console closed");
    } else {
        stop.await;
    }
    shutdown.cancel();
    say("slotpool demo: stopping: the simulated jobs");
    let _ = load.await;
    say("slotpool demo: stopping: the launcher");
    let result = launcher.await.context("launcher task")?;
    // Local agents are "VMs" that outlive a launcher on purpose; the demo removes them.
    say(&format!(
        "slotpool demo: stopping: the local agents (up to {STOP_GRACE:?} each, then killed)"
    ));
    let local = LocalProvider::new("local", agent_binary, vec![], dir.join("agents"));
    if let Err(err) = local.delete_all().await {
        say(&format!(
            "slotpool demo: cannot stop every local agent: {err}"
        ));
    }
    if let Some(mut child) = sshd {
        say("slotpool demo: stopping: its sshd");
        stop_child(&mut child).await;
    }
    if let Some(mut child) = server {
        say("slotpool demo: stopping: nats-server");
        stop_child(&mut child).await;
    }
    drop(_leftovers);
    result?;
    say("slotpool demo: stopped; nothing left running");
    Ok(ExitCode::SUCCESS)
}

/// What [`start`] started.
struct Started {
    launcher: tokio::task::JoinHandle<Result<(), LauncherError>>,
    load: tokio::task::JoinHandle<()>,
    server: Option<tokio::process::Child>,
    config_path: PathBuf,
    console_args: Vec<String>,
    agent_binary: PathBuf,
    /// The sshd of the slots' logins (isolation `users`).
    sshd: Option<tokio::process::Child>,
}

/// Starts the demo's nats-server (unless `--connect`), its launcher and its jobs.
async fn start(
    args: &DemoArgs,
    nats: &super::NatsClientArgs,
    dir: &Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<Started> {
    let work_dir = dir.join("agents");
    let mut server = None;
    // The demo's own bus runs with authentication on, as a real one must: the launcher,
    // the load generator (a client) and the console (an operator) each log in with the
    // credentials of their role, and each local agent with its own.
    let mut you = None;
    let (url, launcher_opts, client_opts, console_args, minter) = if args.connect {
        let minter = match &args.agent_signing_key {
            Some(path) => Some(Minter::load(path).context("loading --agent-signing-key")?),
            None => None,
        };
        let mut console_args = vec!["--nats".to_string(), nats.bus.url.clone()];
        if let Some(creds) = &nats.bus.creds {
            console_args.extend(["--creds".to_string(), creds.display().to_string()]);
        }
        (
            nats.bus.url.clone(),
            nats.options("slotpool-demo"),
            nats.options("slotpool-demo-load"),
            console_args,
            minter,
        )
    } else {
        let binary = find_nats_server(args.nats_server.as_deref())?;
        let files = setup::write(&SetupPlan {
            dir: dir.join("auth"),
            users: vec![
                BusUser::new(Role::Launcher, "demo-launcher")?,
                BusUser::new(Role::Client, "demo-jobs")?,
                BusUser::new(Role::Operator, "demo-operator")?,
                // Whoever sources the demo's env file: an operator, who may ask for
                // nodes and see everything.
                BusUser::new(Role::Operator, "you")?,
            ],
            ..Default::default()
        })
        .context("writing the demo's NATS installation")?;
        let (child, url) = start_nats_server(&binary, dir, Some(&files.server_config)).await?;
        server = Some(child);
        let creds = |role, name| files.creds_of(role, name).map(Path::to_path_buf);
        let opts = |name: &str, creds: Option<PathBuf>| NatsOptions {
            url: url.clone(),
            name: name.into(),
            creds,
            ..Default::default()
        };
        let operator = creds(Role::Operator, "demo-operator").expect("written");
        you = creds(Role::Operator, "you");
        (
            url.clone(),
            opts("slotpool-demo", creds(Role::Launcher, "demo-launcher")),
            opts("slotpool-demo-load", creds(Role::Client, "demo-jobs")),
            vec![
                "--nats".to_string(),
                url.clone(),
                "--creds".to_string(),
                operator.display().to_string(),
            ],
            Some(Minter::load(&files.signing_key)?),
        )
    };
    say(&format!(
        "slotpool demo: NATS at {url} (authentication on), state in {}",
        dir.display()
    ));
    let agent_binary = super::sibling_agent_binary();
    if !agent_binary.is_file() {
        bail!("the demo needs the slotpool-agent binary next to slotpool ({}): build it with `cargo build --release --bins`", agent_binary.display());
    }
    let slots = SlotMode::choose(args.isolation, dir, &agent_binary).await?;
    let config_path = dir.join("demo.yaml");
    std::fs::write(
        &config_path,
        DEMO_CONFIG
            .replace("WORK_DIR", &work_dir.display().to_string())
            .replace("AGENT_ARGS", &serde_json::to_string(&slots.agent_args)?),
    )?;
    if !args.connect {
        let key = slots.login_key.as_deref();
        write_env_file(dir, &url, you.as_deref(), key)?;
    }
    let config = Config::load(&config_path)?;
    let bus = Bus::connect(&launcher_opts)
        .await
        .context("connecting to the demo NATS server")?;
    let jobs_bus = Bus::connect(&client_opts)
        .await
        .context("connecting the demo's jobs to NATS")?;
    let deps = LauncherDeps {
        agent_bus: AgentBus::new(url.clone(), minter, None),
        agent_binary: agent_binary.clone(),
        // Even a demo killed with SIGKILL leaves no agent running.
        local_agents: AgentLifetime::EndWithLauncher,
        http: None,
    };
    let launcher = tokio::spawn(run(config, bus.clone(), deps, shutdown.clone()));
    let client = Client::from_bus(jobs_bus);
    let load = tokio::spawn(load(
        client,
        Load {
            jobs: args.jobs,
            hold: Duration::from_millis(args.hold_ms),
            panic_after_first_job: args.panic_after_first_job,
        },
        shutdown.clone(),
    ));
    Ok(Started {
        launcher,
        load,
        server,
        config_path,
        console_args,
        agent_binary,
        sshd: slots.sshd,
    })
}

/// How the demo's slots are made, and the sshd that logs in to them.
struct SlotMode {
    /// The local agents' arguments.
    agent_args: Vec<String>,
    sshd: Option<tokio::process::Child>,
    /// The private key of the SSH key pair the env file names.
    login_key: Option<PathBuf>,
}

impl SlotMode {
    /// Users and an sshd as root with sshd installed (or when asked), else directories.
    async fn choose(
        asked: Option<Isolation>,
        dir: &Path,
        agent_binary: &Path,
    ) -> anyhow::Result<SlotMode> {
        let root = rustix::process::geteuid().is_root();
        let sshd_installed = Path::new(SSHD).is_file();
        let users = match asked {
            Some(Isolation::Users) if !root => {
                bail!("--isolation users makes a Unix user per slot: run the demo as root")
            }
            Some(Isolation::Users) if !sshd_installed => {
                bail!("--isolation users logs in through sshd: install openssh-server ({SSHD})")
            }
            Some(Isolation::Users) => true,
            Some(Isolation::None) => false,
            None => root && sshd_installed,
        };
        let mut agent_args: Vec<String> = ["--remove-slots-on-stop"].map(String::from).into();
        if !users {
            agent_args.extend(["--isolation", "none"].map(String::from));
            say(if root {
                "slotpool demo: slots are directories (--isolation none): nothing to log in to"
            } else {
                "slotpool demo: slots are directories: SSH logins into slots need root (a Unix user per slot)"
            });
            return Ok(SlotMode {
                agent_args,
                sshd: None,
                login_key: None,
            });
        }
        let (sshd, port, prefix) = start_sshd(dir, agent_binary).await?;
        let login_key = dir.join("you_ed25519");
        ssh_keygen(&login_key, "slotpool-demo").await?;
        let pid = std::process::id();
        agent_args.extend(
            [
                "--isolation",
                "users",
                "--user-prefix",
                &prefix,
                "--cgroup-parent",
                &format!("slotpool-demo-{pid}"),
                "--run-dir",
                &dir.join("run").display().to_string(),
                "--ssh-port",
                &port.to_string(),
                "--ssh-host-keys-dir",
                &dir.join("sshd").display().to_string(),
                // Hiding processes mounts /proc where logins live: the host's own here.
                "--hide-processes",
                "off",
            ]
            .map(String::from),
        );
        if !command_exists("nft") {
            // Keeping slot users off the bus needs nftables; the demo's bus wants
            // credentials anyway.
            agent_args.extend(["--bus-guard", "off"].map(String::from));
        }
        say(&format!(
            "slotpool demo: slots are Unix users ({prefix}…) with a cgroup and workspace each; its sshd listens on 127.0.0.1:{port}"
        ));
        Ok(SlotMode {
            agent_args,
            sshd: Some(sshd),
            login_key: Some(login_key),
        })
    }
}

/// The slot users' name prefix of this demo: its pid, so that the next demo can tell an
/// abandoned demo's users apart.
fn user_prefix(pid: u32) -> String {
    format!("sd{pid}")
}

fn command_exists(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(name).is_file()))
}

/// `ssh-keygen` of an ed25519 key pair without a passphrase at `path`.
async fn ssh_keygen(path: &Path, comment: &str) -> anyhow::Result<()> {
    let status = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path)
        .stdin(Stdio::null())
        .status()
        .await
        .context("running ssh-keygen (openssh-client)")?;
    if !status.success() {
        bail!("ssh-keygen -f {} failed: {status}", path.display());
    }
    Ok(())
}

/// Starts an sshd of the demo's own on a free loopback port, for the slot users only,
/// every login run through the agent as the shipped drop-in does; returns it, its port
/// and the slot users' prefix.
async fn start_sshd(
    dir: &Path,
    agent_binary: &Path,
) -> anyhow::Result<(tokio::process::Child, u16, String)> {
    use std::os::unix::fs::PermissionsExt;
    let prefix = user_prefix(std::process::id());
    let sshd_dir = dir.join("sshd");
    std::fs::create_dir_all(&sshd_dir)?;
    // Slot users run the agent at login and reach its placement sockets: a copy of the
    // agent they can run (the build's may be under a 0700 home), a run dir they reach.
    for d in [dir, &sshd_dir] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    let agent = sshd_dir.join("slotpool-agent");
    std::fs::copy(agent_binary, &agent)
        .with_context(|| format!("copying {}", agent_binary.display()))?;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755))?;
    let run = dir.join("run");
    std::fs::create_dir_all(&run)?;
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))?;
    // The shipped drop-in's logins, through this agent and run dir.
    let files = SshdFiles::write(
        &sshd_dir,
        &prefix,
        &format!("{} enter-slot --run-dir {}", agent.display(), run.display()),
    )?;
    let port = files.port;
    let mut cmd = std::process::Command::new(SSHD);
    files.arguments(&mut cmd)?;
    let mut cmd = Command::from(cmd);
    cmd.kill_on_drop(true);
    let demo = std::process::id();
    // SAFETY: end_with_parent calls only async-signal-safe functions.
    unsafe {
        cmd.pre_exec(move || end_with_parent(demo, Signal::KILL));
    }
    let mut child = cmd.spawn().context("starting sshd")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = child.try_wait()? {
            bail!(
                "sshd exited at start ({status}); its log: {}",
                files.log().display()
            );
        }
        if Instant::now() >= deadline {
            bail!("sshd did not listen on 127.0.0.1:{port} within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((child, port, prefix))
}

/// Writes [`env_file`]: the environment that points `slotpool` and any client at the
/// demo's bus, as the demo's own operator `you`, with the demo's binaries on PATH and
/// the SSH key its requests install. Prints it too.
fn write_env_file(
    dir: &Path,
    url: &str,
    creds: Option<&Path>,
    login_key: Option<&Path>,
) -> anyhow::Result<()> {
    let bin = std::env::current_exe()?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let mut text = format!(
        "# The slotpool demo in {dir} (pid {pid}): source this file to reach it.\n\
         export SLOTPOOL_NATS_URL={url}\n",
        dir = dir.display(),
        pid = std::process::id(),
    );
    if let Some(creds) = creds {
        text.push_str(&format!("export SLOTPOOL_NATS_CREDS={}\n", creds.display()));
    }
    if let Some(key) = login_key {
        text.push_str(&format!(
            "export SLOTPOOL_SSH_KEY={}.pub\nexport SLOTPOOL_DEMO_SSH_KEY={}\n",
            key.display(),
            key.display()
        ));
    }
    text.push_str(&format!("export PATH=\"{}:$PATH\"\n", bin.display()));
    let path = env_file();
    std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    say(&format!(
        "slotpool demo: in another terminal, `. {}` and then `slotpool request --label small --wait`; it holds:\n{}",
        path.display(),
        text.trim_end()
    ));
    Ok(())
}

/// Removes [`env_file`] if it is this demo's (it names `dir`).
fn remove_env_file(dir: &Path) {
    let path = env_file();
    let ours =
        std::fs::read_to_string(&path).is_ok_and(|t| t.contains(&format!("{}/", dir.display())));
    if ours {
        let _ = std::fs::remove_file(path);
    }
}

/// The first wait after a failed submit; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(8);

/// What the simulated jobs do.
struct Load {
    jobs: u32,
    hold: Duration,
    panic_after_first_job: bool,
}

/// Simulated CI jobs: each asks for a node, holds it a while, releases it, and again. A
/// job whose submit fails (the bus is down, no launcher answers) tries again after a
/// growing pause, so the load comes back with the bus.
async fn load(client: Client, how: Load, stop: CancellationToken) {
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    let Load {
        jobs,
        hold,
        panic_after_first_job,
    } = how;
    for job in 0..jobs {
        let (client, stop) = (client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            // Stagger the start so the pool grows visibly.
            if !pause(&stop, Duration::from_millis(700 * job as u64)).await {
                return;
            }
            let mut retry = RETRY_FIRST;
            while !stop.is_cancelled() {
                let started = Instant::now();
                let sub = submission(vec!["small".into()], format!("demo-job-{job}"));
                let submitted = tokio::select! { _ = stop.cancelled() => return, s = submit_when_served(&client, &sub) => s };
                let id = match submitted {
                    Ok(id) => {
                        retry = RETRY_FIRST;
                        id
                    }
                    Err(err) => {
                        say(&format!("job {job}: submit failed: {err}; trying again in {retry:?}"));
                        if !pause(&stop, retry).await {
                            return;
                        }
                        retry = (retry * 2).min(RETRY_MAX);
                        continue;
                    }
                };
                let done = tokio::select! { _ = stop.cancelled() => return, d = client.wait(&id, |_| {}) => d };
                match done {
                    Ok(r) if r.state == RequestState::Fulfilled => {
                        say(&format!("job {job}: got {} in {:.1} ms", r.nodes[0], started.elapsed().as_secs_f64() * 1000.0));
                        if panic_after_first_job {
                            panic!("slotpool demo: --panic-after-first-job");
                        }
                        pause(&stop, hold).await;
                        // On the way out the launcher releases what is left; no need to wait.
                        tokio::select! { _ = stop.cancelled() => return, _ = client.release(r.nodes) => {} }
                    }
                    Ok(r) => say(&format!("job {job}: request {id} {:?}: {}", r.state, r.status)),
                    Err(err) => {
                        say(&format!("job {job}: {err}; trying again in {retry:?}"));
                        if !pause(&stop, retry).await {
                            return;
                        }
                        retry = (retry * 2).min(RETRY_MAX);
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Waits `d`; false when the demo stops meanwhile.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! { _ = stop.cancelled() => false, _ = tokio::time::sleep(d) => true }
}

/// Submits, waiting (briefly) for the launcher's API to come up first.
async fn submit_when_served(
    client: &Client,
    sub: &slotpool_protocol::api::SubmitRequest,
) -> Result<slotpool_protocol::RequestId, slotpool_protocol::connect::BusError> {
    let mut tries = 0;
    loop {
        match client.submit(sub).await {
            Err(slotpool_protocol::connect::BusError::NoResponders { .. }) if tries < 100 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// While the console shows, the demo's lines go to its log (stderr, then a file).
static LOG_TO_STDERR: AtomicBool = AtomicBool::new(false);

/// One line of what the demo does: on stdout, or into its log while the console shows.
/// When the reader of stdout has gone (`slotpool demo | head -3`), the demo stops as it
/// does on Ctrl-C.
fn say(line: &str) {
    use std::io::Write;
    if LOG_TO_STDERR.load(Ordering::Relaxed) {
        log_line(line);
        return;
    }
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        if let Some(stop) = STOP.get() {
            stop.cancel();
        }
    }
}

/// A line on stderr, whether or not anyone still reads it (`eprintln!` would panic).
fn log_line(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The demo's stop, for [`say`].
static STOP: OnceLock<CancellationToken> = OnceLock::new();

/// What the demo leaves on the machine while it runs: its directory, and the processes
/// whose command line names it (nats-server, the local agents). Dropping it, a panic
/// anywhere, or a second Ctrl-C ([`clean_up_now`]) kills those processes and removes the
/// directory; the orderly stop before it only makes this find nothing.
struct Leftovers;

static LEFTOVERS: Mutex<Option<PathBuf>> = Mutex::new(None);

impl Leftovers {
    fn register(dir: PathBuf) -> Leftovers {
        *LEFTOVERS.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            clean_up_now();
            std::process::exit(101);
        }));
        Leftovers
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        clean_up_now();
    }
}

/// Kills every process whose command line names the demo's directory (each agent's
/// whole process group), then removes the directory. Safe to call more than once.
pub fn clean_up_now() {
    // Held until the directory is gone: a second caller (two threads panicking at once)
    // waits for the first to finish before it finds nothing to do and exits.
    let mut leftovers = LEFTOVERS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dir) = leftovers.take() else {
        return;
    };
    remove_env_file(&dir);
    let killed = remove_demo_dir(&dir);
    if killed > 0 {
        log_line(&format!(
            "slotpool demo: killed {killed} process(es) left in {}",
            dir.display()
        ));
    }
}

/// A demo killed with SIGKILL cannot stop what it started: its nats-server and local
/// agents go on, and its directory stays. The next demo (same temp directory) removes
/// both before it starts: every `slotpool-demo-<pid>` directory whose process is gone.
/// A directory whose pid has since been reused by another process is left alone.
fn clean_up_abandoned(temp: &Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("slotpool-demo-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        // Only a directory of this user's own: anyone can make `slotpool-demo-<pid>` in
        // a shared temp directory, to have a demo kill what its command lines name.
        let me_uid = rustix::process::geteuid().as_raw();
        let owned = entry.metadata().is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            m.is_dir() && m.uid() == me_uid
        });
        if !owned {
            continue;
        }
        let dir = entry.path();
        remove_env_file(&dir);
        let killed = remove_demo_dir(&dir);
        remove_slot_users(pid);
        say(&format!(
            "slotpool demo: removed what an earlier demo (pid {pid}, gone) left: {killed} process(es) and {}",
            dir.display()
        ));
    }
}

/// The slot users and cgroups an abandoned demo (pid `pid`, killed with SIGKILL: its
/// agents could not remove their slots) left: users named with its prefix and made by
/// an agent (their comment says `slotpool slot`), and its cgroup parent.
fn remove_slot_users(pid: u32) {
    let prefix = user_prefix(pid);
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() > 4
            && fields[0].starts_with(&prefix)
            && fields[4].starts_with("slotpool slot")
        {
            let _ = std::process::Command::new("pkill")
                .args(["-KILL", "-u", fields[0]])
                .status();
            let _ = std::process::Command::new("userdel")
                .args(["--remove", fields[0]])
                .stderr(Stdio::null())
                .status();
        }
    }
    if let Ok(mounts) = std::fs::read_dir("/sys/fs/cgroup") {
        let parent = format!("slotpool-demo-{pid}");
        for hierarchy in mounts.flatten() {
            let at = hierarchy.path().join(&parent);
            for slot in std::fs::read_dir(&at).into_iter().flatten().flatten() {
                let _ = std::fs::remove_dir(slot.path());
            }
            let _ = std::fs::remove_dir(&at);
        }
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(&parent));
    }
}

/// Kills the processes naming `dir` and removes it; returns how many were killed.
fn remove_demo_dir(dir: &Path) -> usize {
    let pids = processes_naming(dir);
    use rustix::process::{getpgid, kill_process, kill_process_group, Pid, Signal};
    for pid in pids.iter().filter_map(|&p| Pid::from_raw(p)) {
        // A local agent leads its own process group (it is started in a session of its
        // own): the whole group goes.
        if getpgid(Some(pid)) == Ok(pid) {
            let _ = kill_process_group(pid, Signal::KILL);
        }
        let _ = kill_process(pid, Signal::KILL);
    }
    let _ = std::fs::remove_dir_all(dir);
    pids.len()
}

/// Processes (not this one) whose command line mentions `dir`.
fn processes_naming(dir: &Path) -> Vec<i32> {
    let needle = dir.as_os_str().as_encoded_bytes();
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| names_dir(&c, needle))
        })
        .collect()
}

/// Whether a command line names the directory `needle` or a path below it: the name
/// ends there, so `/tmp/slotpool-demo-12` does not match `/tmp/slotpool-demo-123/…`.
fn names_dir(cmdline: &[u8], needle: &[u8]) -> bool {
    cmdline.windows(needle.len()).enumerate().any(|(at, w)| {
        w == needle && matches!(cmdline.get(at + needle.len()), None | Some(b'/' | 0))
    })
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    clean_up_abandoned(&std::env::temp_dir());
    let dir = std::env::temp_dir().join(format!("slotpool-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// While alive, this process's stderr (the demo's log) goes to a file, so it does not
/// scribble over the console; dropping it puts stderr back.
struct StderrToFile {
    saved: OwnedFd,
}

impl StderrToFile {
    fn redirect(path: &Path) -> std::io::Result<StderrToFile> {
        let file = std::fs::File::create(path)?;
        let saved = rustix::io::dup(std::io::stderr())?;
        rustix::stdio::dup2_stderr(&file)?;
        Ok(StderrToFile { saved })
    }

    /// The terminal's stderr, for a child that should still report there.
    fn original(&self) -> std::io::Result<Stdio> {
        Ok(Stdio::from(self.saved.try_clone()?))
    }
}

impl Drop for StderrToFile {
    fn drop(&mut self) {
        let _ = rustix::stdio::dup2_stderr(&self.saved);
    }
}

#[cfg(test)]
mod tests {
    use super::names_dir;

    #[test]
    fn a_command_line_names_the_directory_not_another_it_is_a_prefix_of() {
        let dir = b"/tmp/slotpool-demo-12";
        assert!(names_dir(
            b"nats-server\0-c\0/tmp/slotpool-demo-12/auth/server.conf\0",
            dir
        ));
        assert!(names_dir(
            b"agent\0--work-dir\0/tmp/slotpool-demo-12\0",
            dir
        ));
        assert!(names_dir(b"agent\0/tmp/slotpool-demo-12", dir));
        assert!(!names_dir(b"agent\0/tmp/slotpool-demo-123/agents\0", dir));
        assert!(!names_dir(b"agent\0/tmp/slotpool-demo-12x\0", dir));
    }
}
