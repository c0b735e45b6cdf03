//! A CI job's turnaround through `slotpool exec`, beside the SSH path, on the production
//! bus (credentials and TLS) with the production run's agents: each figure is a real
//! `slotpool` (or `ssh`) process timed from its start to its exit, as a CI system pays it.
//!
//! - `slotpool exec --label L -- true`: a whole job (connect, request a node, run the
//!   command through the agent, stream, release), one after another, and then with
//!   `parallel` at a time for jobs per second;
//! - in a node held meanwhile, `slotpool exec --node N -- true` alternated with
//!   `ssh -p PORT USER@127.0.0.1 true` through sshd with the shipped drop-in
//!   ([`slotpool_local_run::sshd`]: logins placed by `slotpool-agent enter-slot`), when
//!   the agents run in users mode (slot users to log in as).

use crate::stats::{Samples, Summary};
use anyhow::Context;
use serde::Serialize;
use slotpool_local_run::sshd::{ClientKey, SshdFiles, SSHD};
use slotpool_local_run::stop_child;
use slotpool_protocol::client::{submission, Client};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How long sshd may take to accept connections once started.
const SSHD_START_TIMEOUT: Duration = Duration::from_secs(20);
/// Rounds of each kind run first and not counted (caches, first connections).
const WARM_UP: usize = 2;

/// What to run and where.
pub struct Plan<'a> {
    /// The `slotpool` binary.
    pub slotpool: PathBuf,
    /// Its global options that reach the bus as the benchmark's client.
    pub bus_args: Vec<String>,
    pub label: &'a str,
    /// Jobs of each kind, one after another; as many again `parallel` at a time.
    pub rounds: usize,
    pub parallel: usize,
    /// The agents run in users mode: measure the SSH path too.
    pub ssh: bool,
    /// The agent binary, for the logins' `enter-slot` (the agents' default run dir).
    pub agent_binary: &'a Path,
    /// The run's directory, which holds the agents' work dirs (the slots' homes).
    pub run_dir: &'a Path,
    /// A directory of its own (sshd's files, the client key), under `run_dir`.
    pub dir: PathBuf,
}

/// The figures (`exec` in the JSON).
#[derive(Debug, Serialize)]
pub struct ExecFigures {
    pub label: String,
    pub rounds: usize,
    /// `slotpool exec --label L -- true`, submit to exit code: request, run, release.
    pub job: Summary,
    /// `slotpool exec --node N -- true` in a node held meanwhile.
    pub exec_in_held_node: Summary,
    /// `ssh USER@HOST true` into that node through the shipped sshd drop-in, alternated
    /// with the line above (users mode only).
    pub ssh: Option<Summary>,
    /// `exec_in_held_node` p50 over `ssh` p50.
    pub exec_over_ssh_p50: Option<f64>,
    /// Whole jobs run `parallel` at a time: how many, in how long.
    pub parallel: usize,
    pub parallel_jobs: usize,
    pub parallel_secs: f64,
    pub jobs_per_sec: f64,
}

/// A started sshd, stopped by [`Sshd::stop`] (and killed if dropped).
struct Sshd {
    files: SshdFiles,
    child: tokio::process::Child,
}

impl Sshd {
    async fn start(dir: &Path, agent_binary: &Path) -> anyhow::Result<Sshd> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if let Some(closed) = dir
            .ancestors()
            .skip(1)
            .find(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 == 0))
        {
            anyhow::bail!(
                "slot users cannot pass through {} to log in (their login runs an agent \
                 binary under {}, their homes are there): run the benchmark with a \
                 TMPDIR they may enter (o+x)",
                closed.display(),
                dir.display()
            );
        }
        // Slot users run the agent at login: a copy they may read and run, in a
        // directory they may enter, as /usr/bin would be.
        let agent = dir.join("slotpool-agent");
        std::fs::copy(agent_binary, &agent)
            .with_context(|| format!("copying {}", agent_binary.display()))?;
        for (path, mode) in [(dir, 0o755), (agent.as_path(), 0o755)] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .with_context(|| format!("chmod {mode:o} {}", path.display()))?;
        }
        // The agents' default user prefix and run dir, as the shipped drop-in has them.
        let files = SshdFiles::write(dir, "sp", &format!("{} enter-slot", agent.display()))?;
        let mut cmd = std::process::Command::new(SSHD);
        files.arguments(&mut cmd)?;
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        let child = cmd.spawn().context("starting sshd")?;
        let sshd = Sshd { files, child };
        let deadline = Instant::now() + SSHD_START_TIMEOUT;
        while tokio::net::TcpStream::connect(("127.0.0.1", sshd.files.port))
            .await
            .is_err()
        {
            anyhow::ensure!(
                Instant::now() < deadline,
                "sshd did not accept connections within {SSHD_START_TIMEOUT:?}; see {}",
                sshd.files.log().display()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(sshd)
    }

    async fn stop(mut self) {
        stop_child(&mut self.child).await;
    }
}

/// Runs `cmd` to its end: how long it took; an error with its output if it failed.
async fn timed(mut cmd: tokio::process::Command) -> anyhow::Result<Duration> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let out = cmd
        .output()
        .await
        .with_context(|| format!("running {cmd:?}"))?;
    let took = started.elapsed();
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(took)
}

impl Plan<'_> {
    /// `slotpool <bus options> exec <args> -- true`.
    fn exec(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.slotpool);
        cmd.args(&self.bus_args)
            .arg("exec")
            .args(args)
            .args(["--", "true"]);
        cmd
    }

    fn job(&self) -> tokio::process::Command {
        self.exec(&["--label", self.label])
    }
}

pub async fn measure(plan: &Plan<'_>, client: &Client) -> anyhow::Result<ExecFigures> {
    let sshd = if plan.ssh {
        use std::os::unix::fs::PermissionsExt;
        // sshd reads a slot's authorized_keys as the slot's user, who must pass through
        // the run's directory (private: it holds the installation's keys) to its home,
        // as through a backing node's work dir. 0711 lets them pass, not list.
        std::fs::set_permissions(plan.run_dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("chmod 711 {}", plan.run_dir.display()))?;
        Some(Sshd::start(&plan.dir.join("sshd"), plan.agent_binary).await?)
    } else {
        None
    };
    let figures = measure_with(plan, client, sshd.as_ref()).await;
    if let Some(sshd) = sshd {
        sshd.stop().await;
    }
    figures
}

async fn measure_with(
    plan: &Plan<'_>,
    client: &Client,
    sshd: Option<&Sshd>,
) -> anyhow::Result<ExecFigures> {
    // One node held for the alternated commands, with a key for the SSH path.
    let key_dir = plan.dir.join("ssh-key");
    std::fs::create_dir_all(&key_dir)?;
    let key = ClientKey::generate(&key_dir)?;
    let mut sub = submission(vec![plan.label.to_string()], "slotpool-bench exec");
    sub.ssh_public_key = Some(key.public()?);
    let held = client.submit_and_wait(&sub).await?;
    let node = client
        .nodes(&held.nodes)
        .await?
        .pop()
        .context("the held node's record")?;
    let id = node.id.to_string();
    let ssh = |user: &str, port: u16| {
        let mut cmd = tokio::process::Command::from(key.command(port, user));
        cmd.arg("true");
        cmd
    };
    let (mut in_node, mut over_ssh) = (Samples::default(), Samples::default());
    let alternated = async {
        let user = node.login.username.clone();
        for round in 0..WARM_UP + plan.rounds {
            let took = timed(plan.exec(&["--node", &id])).await?;
            if round >= WARM_UP {
                in_node.push(took);
            }
            if let (Some(sshd), Some(user)) = (sshd, &user) {
                let took = timed(ssh(user, sshd.files.port))
                    .await
                    .with_context(|| format!("sshd's log: {}", sshd.files.log().display()))?;
                if round >= WARM_UP {
                    over_ssh.push(took);
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    client.release(held.nodes.clone()).await?;
    alternated?;

    let mut jobs = Samples::default();
    for round in 0..WARM_UP + plan.rounds {
        let took = timed(plan.job()).await?;
        if round >= WARM_UP {
            jobs.push(took);
        }
    }

    // As many whole jobs again, `parallel` at a time.
    let parallel = plan.parallel.max(1);
    let per_worker = plan.rounds.div_ceil(parallel).max(1);
    let started = Instant::now();
    let workers: Vec<_> = (0..parallel)
        .map(|_| {
            let cmds: Vec<_> = (0..per_worker).map(|_| plan.job()).collect();
            tokio::spawn(async move {
                for cmd in cmds {
                    timed(cmd).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    let parallel_secs = started.elapsed().as_secs_f64();
    let parallel_jobs = parallel * per_worker;

    let ssh = sshd.map(|_| over_ssh.summary());
    let exec_in_held_node = in_node.summary();
    Ok(ExecFigures {
        label: plan.label.to_string(),
        rounds: plan.rounds,
        job: jobs.summary(),
        exec_over_ssh_p50: ssh.map(|s| exec_in_held_node.p50_ms / s.p50_ms),
        exec_in_held_node,
        ssh,
        parallel,
        parallel_jobs,
        parallel_secs,
        jobs_per_sec: parallel_jobs as f64 / parallel_secs,
    })
}

/// The printed lines.
pub fn print(e: &ExecFigures) {
    let line = |what: &str, s: &Summary| {
        println!(
            "  {what:<44} p50 {:8.1} ms  p99 {:8.1} ms  (n {})",
            s.p50_ms, s.p99_ms, s.count
        )
    };
    println!(
        "slotpool exec beside ssh (label {}, processes timed start to exit):",
        e.label
    );
    line(
        &format!("slotpool exec --label {} -- true", e.label),
        &e.job,
    );
    line("slotpool exec --node N -- true", &e.exec_in_held_node);
    match (&e.ssh, e.exec_over_ssh_p50) {
        (Some(ssh), Some(ratio)) => {
            line("ssh USER@HOST true (shipped sshd drop-in)", ssh);
            println!("  exec --node / ssh at p50: {ratio:.2}");
        }
        _ => println!("  ssh: not measured (agents not in users mode)"),
    }
    println!(
        "  {} jobs, {} at a time: {:.1} jobs/s ({:.1} s)",
        e.parallel_jobs, e.parallel, e.jobs_per_sec, e.parallel_secs
    );
}
