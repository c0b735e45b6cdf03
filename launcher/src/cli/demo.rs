//! `slotpool demo`: a whole pool on this machine. It starts a nats-server with JetStream and
//! authentication on in a temp dir (unless `--connect` is given), a launcher with the local provider, and a
//! small load generator. On a terminal it opens the operator console (`slotpool-console`,
//! built next to `slotpool`) and keeps its own log in a file meanwhile; otherwise, or with
//! `--no-console`, it prints what happens. Ctrl-C (or quitting the console) stops
//! everything it started.

use anyhow::{bail, Context};
use clap::Args;
use slotpool_launcher::agent_bus::AgentBus;
use slotpool_launcher::config::Config;
use slotpool_launcher::local_run::{find_nats_server, start_nats_server, stop_child};
use slotpool_launcher::provider::local::LocalProvider;
use slotpool_launcher::{run, LauncherDeps};
use slotpool_protocol::auth::setup::{self, SetupPlan};
use slotpool_protocol::auth::{BusUser, Minter, Role};
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::connect::{Bus, NatsOptions};
use slotpool_protocol::model::RequestState;
use std::io::IsTerminal;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::process::Command;
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
}

const DEMO_CONFIG: &str = "\
launcher:
  lease-ttl: 5
providers:
  - name: local
    driver: local
    local:
      work-dir: WORK_DIR
      agent-args: [--isolation, none]
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

pub async fn run_demo(args: DemoArgs, nats: &super::NatsArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile_dir()?;
    let work_dir = dir.join("agents");
    let mut server = None;
    // The demo's own bus runs with authentication on, as a real one must: the launcher,
    // the load generator (a client) and the console (an operator) each log in with the
    // credentials of their role, and each local agent with its own.
    let (url, launcher_opts, client_opts, console_args, minter) = if args.connect {
        let minter = match &args.agent_signing_key {
            Some(path) => Some(Minter::load(path).context("loading --agent-signing-key")?),
            None => None,
        };
        let mut console_args = vec!["--nats".to_string(), nats.url.clone()];
        if let Some(creds) = &nats.creds {
            console_args.extend(["--creds".to_string(), creds.display().to_string()]);
        }
        (
            nats.url.clone(),
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
            ],
            ..Default::default()
        })
        .context("writing the demo's NATS installation")?;
        let (child, url) = start_nats_server(&binary, &dir, Some(&files.server_config)).await?;
        server = Some(child);
        let creds = |role, name| files.creds_of(role, name).map(Path::to_path_buf);
        let opts = |name: &str, creds: Option<PathBuf>| NatsOptions {
            url: url.clone(),
            name: name.into(),
            creds,
            ..Default::default()
        };
        let operator = creds(Role::Operator, "demo-operator").expect("written");
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
    eprintln!(
        "slotpool demo: NATS at {url} (authentication on), state in {}",
        dir.display()
    );
    let config_path = dir.join("demo.yaml");
    std::fs::write(
        &config_path,
        DEMO_CONFIG.replace("WORK_DIR", &work_dir.display().to_string()),
    )?;
    let config = Config::load(&config_path)?;
    let bus = Bus::connect(&launcher_opts)
        .await
        .context("connecting to the demo NATS server")?;
    let jobs_bus = Bus::connect(&client_opts)
        .await
        .context("connecting the demo's jobs to NATS")?;
    let shutdown = CancellationToken::new();
    let agent_binary = super::sibling_agent_binary();
    if !agent_binary.is_file() {
        bail!("the demo needs the slotpool-agent binary next to slotpool ({}): build it with `cargo build --release --bins`", agent_binary.display());
    }
    let deps = LauncherDeps {
        agent_bus: AgentBus::new(url.clone(), minter),
        agent_binary: agent_binary.clone(),
    };
    let launcher = tokio::spawn(run(config, bus.clone(), deps, shutdown.clone()));
    let client = Client::from_bus(jobs_bus);
    let load = tokio::spawn(load(
        client,
        args.jobs,
        Duration::from_millis(args.hold_ms),
        shutdown.clone(),
    ));

    let stop = async {
        match args.duration {
            Some(s) => {
                tokio::select! { _ = super::stop_signal() => {}, _ = tokio::time::sleep(Duration::from_secs(s)) => {} }
            }
            None => super::stop_signal().await,
        }
    };
    let console = super::sibling_binary("slotpool-console");
    if !args.no_console && std::io::stdout().is_terminal() && console.is_file() {
        let log = dir.join("demo.log");
        let quiet = StderrToFile::redirect(&log)
            .with_context(|| format!("redirecting the demo's log to {}", log.display()))?;
        let mut child = Command::new(&console)
            .args(&console_args)
            .arg("--config")
            .arg(&config_path)
            .stderr(quiet.original()?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", console.display()))?;
        tokio::select! {
            _ = child.wait() => {}
            _ = stop => stop_child(&mut child).await,
        }
        drop(quiet);
        eprintln!("slotpool demo: console closed");
    } else {
        stop.await;
    }
    eprintln!("slotpool demo: stopping");
    shutdown.cancel();
    let _ = load.await;
    let result = launcher.await.context("launcher task")?;
    // Local agents are "VMs" that outlive a launcher on purpose; the demo removes them.
    let local = LocalProvider::new("local", agent_binary, vec![], work_dir);
    if let Err(err) = local.delete_all().await {
        eprintln!("slotpool demo: cannot stop every local agent: {err}");
    }
    if let Some(mut child) = server {
        stop_child(&mut child).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    eprintln!("slotpool demo: stopped; nothing left running");
    Ok(ExitCode::SUCCESS)
}

/// Simulated CI jobs: each asks for a node, holds it a while, releases it, and again.
async fn load(client: Client, jobs: u32, hold: Duration, stop: CancellationToken) {
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    for job in 0..jobs {
        let (client, stop) = (client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            // Stagger the start so the pool grows visibly.
            tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(Duration::from_millis(700 * job as u64)) => {} }
            while !stop.is_cancelled() {
                let started = Instant::now();
                let sub = submission(vec!["small".into()], format!("demo-job-{job}"));
                let id = match submit_when_served(&client, &sub).await {
                    Ok(id) => id,
                    Err(err) => {
                        eprintln!("job {job}: submit failed: {err}");
                        return;
                    }
                };
                let done = tokio::select! { _ = stop.cancelled() => return, d = client.wait(&id, |_| {}) => d };
                match done {
                    Ok(r) if r.state == RequestState::Fulfilled => {
                        eprintln!("job {job}: got {} in {:.1} ms", r.nodes[0], started.elapsed().as_secs_f64() * 1000.0);
                        tokio::select! { _ = stop.cancelled() => {}, _ = tokio::time::sleep(hold) => {} }
                        let _ = client.release(r.nodes).await;
                    }
                    Ok(r) => eprintln!("job {job}: request {id} {:?}: {}", r.state, r.status),
                    Err(err) => eprintln!("job {job}: {err}"),
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
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

fn tempfile_dir() -> anyhow::Result<PathBuf> {
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
        use std::os::fd::AsRawFd;
        let file = std::fs::File::create(path)?;
        // SAFETY: dup of our own stderr; the new descriptor is owned by `saved` at once.
        let saved = unsafe { libc::dup(2) };
        if saved < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `saved` is a fresh descriptor nobody else owns.
        let saved = unsafe { OwnedFd::from_raw_fd(saved) };
        // SAFETY: replaces fd 2 with a copy of the open file.
        if unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(StderrToFile { saved })
    }

    /// The terminal's stderr, for a child that should still report there.
    fn original(&self) -> std::io::Result<Stdio> {
        Ok(Stdio::from(self.saved.try_clone()?))
    }
}

impl Drop for StderrToFile {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: puts the saved descriptor back on fd 2.
        unsafe { libc::dup2(self.saved.as_raw_fd(), 2) };
    }
}
