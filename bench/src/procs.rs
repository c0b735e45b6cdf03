//! The processes the benchmark starts and what `/proc` says about them: resident memory
//! (`VmRSS` in `/proc/<pid>/status`) and CPU time (`utime + stime + cutime + cstime` in
//! `/proc/<pid>/stat`: its own and that of the children it waited for).

use anyhow::{bail, Context};
use serde::Serialize;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How long a launcher may take to stop after SIGTERM (it releases its leases first).
const LAUNCHER_STOP_GRACE: Duration = Duration::from_secs(60);

/// Resident memory in KiB.
pub fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// CPU time used so far (user + system) by the process and by the children it has
/// waited for: an agent's `ip`, `useradd` and `nft` runs and the namespace holders it
/// forks count as the agent's once it reaps them.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at field 3:
    // utime, stime, cutime, cstime are fields 14 to 17.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let mut ticks_used = 0u64;
    for field in 11..15 {
        ticks_used += fields.get(field)?.parse::<u64>().ok()?;
    }
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_secs_f64(ticks_used as f64 / ticks as f64))
}

/// Memory and CPU of a process over a window in which nothing is asked of it.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Usage {
    pub rss_mb: f64,
    /// Share of one core, in percent.
    pub cpu_percent: f64,
    pub window_secs: f64,
}

/// Watches `pid` for `window` and reports its memory at the end and its CPU use over it.
pub async fn usage_over(pid: u32, window: Duration) -> anyhow::Result<Usage> {
    let before = cpu_time(pid).context("reading the process's CPU time")?;
    let start = Instant::now();
    tokio::time::sleep(window).await;
    let after = cpu_time(pid).context("reading the process's CPU time")?;
    let wall = start.elapsed().as_secs_f64();
    let rss = rss_kb(pid).context("reading the process's memory")?;
    Ok(Usage {
        rss_mb: rss as f64 / 1024.0,
        cpu_percent: (after - before).as_secs_f64() / wall * 100.0,
        window_secs: wall,
    })
}

/// The processes of one role (the launcher, nats-server, the agents, the benchmark's
/// own clients) whose CPU time is counted together.
pub struct Role {
    pub name: &'static str,
    pub pids: Vec<u32>,
}

/// CPU time one role spent per allocation (and its release) during a load.
#[derive(Clone, Debug, Serialize)]
pub struct RoleCpu {
    pub role: &'static str,
    pub processes: usize,
    pub ms_per_allocation: f64,
    /// Share of one core over the load, in percent.
    pub cpu_percent: f64,
}

/// Counts the CPU time of several roles from its start: what an allocation costs in CPU
/// across every process involved, a figure a busy machine disturbs less than throughput.
pub struct CpuMeter {
    roles: Vec<(Role, Duration)>,
    start: Instant,
    machine: Option<MachineTicks>,
}

/// The machine's CPU time from `/proc/stat`, in ticks: all of it, and what the
/// hypervisor gave to others (steal) while this VM wanted to run.
#[derive(Clone, Copy)]
struct MachineTicks {
    total: u64,
    steal: u64,
}

impl MachineTicks {
    fn read() -> Option<MachineTicks> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
        let fields: Vec<u64> = cpu
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
        // already counted in user.
        Some(MachineTicks {
            total: fields.iter().take(8).sum(),
            steal: *fields.get(7)?,
        })
    }
}

impl CpuMeter {
    pub fn start(roles: Vec<Role>) -> CpuMeter {
        let roles = roles
            .into_iter()
            .map(|r| {
                let used = total_cpu_time(&r.pids);
                (r, used)
            })
            .collect();
        CpuMeter {
            roles,
            start: Instant::now(),
            machine: MachineTicks::read(),
        }
    }

    /// The share of the machine's CPU time the hypervisor took since the start (steal),
    /// in percent: a busy host shows here, not in this machine's load.
    pub fn stolen_percent(&self) -> Option<f64> {
        let (before, now) = (self.machine?, MachineTicks::read()?);
        let total = now.total.checked_sub(before.total).filter(|t| *t > 0)?;
        Some(now.steal.saturating_sub(before.steal) as f64 / total as f64 * 100.0)
    }

    /// Each role's CPU time since the start, per one of `allocations`.
    pub fn per_allocation(&self, allocations: usize) -> Vec<RoleCpu> {
        let wall = self.start.elapsed().as_secs_f64();
        self.roles
            .iter()
            .map(|(role, before)| {
                let used = total_cpu_time(&role.pids).saturating_sub(*before);
                RoleCpu {
                    role: role.name,
                    processes: role.pids.len(),
                    ms_per_allocation: used.as_secs_f64() * 1000.0 / allocations.max(1) as f64,
                    cpu_percent: used.as_secs_f64() / wall * 100.0,
                }
            })
            .collect()
    }
}

fn total_cpu_time(pids: &[u32]) -> Duration {
    pids.iter().filter_map(|&pid| cpu_time(pid)).sum()
}

/// The running processes of `binary` that have an argument inside `dir` (the agents the
/// local provider started for this benchmark, not any others on the machine).
pub fn pids_of(binary: &Path, dir: &Path) -> Vec<u32> {
    let (binary, dir) = (binary.as_os_str().as_bytes(), dir.as_os_str().as_bytes());
    let inside = |a: &&[u8]| a.starts_with(dir) && a.get(dir.len()) == Some(&b'/');
    slotpool_launcher::provider::local::processes_where(|args| {
        args.first() == Some(&binary) && args[1..].iter().any(inside)
    })
    .into_iter()
    .filter_map(|pid| u32::try_from(pid).ok())
    .collect()
}

/// `slotpool serve` arguments for the benchmark's own bus on loopback, without
/// authentication or TLS: slotpool's own path (`--secure-compare` measures them too).
pub const ANONYMOUS_BUS: &[&str] = &["--allow-anonymous-bus"];

/// A `slotpool serve` child process, killed on drop.
pub struct LauncherProcess {
    child: Child,
    pub pid: u32,
    pub log: PathBuf,
}

impl LauncherProcess {
    /// Starts this very binary as `slotpool --nats <nats_url> serve <args> --config
    /// <config>`: `args` say how it logs in ([`ANONYMOUS_BUS`], or credentials, TLS files
    /// and the agents' signing key).
    pub fn spawn<S: AsRef<OsStr>>(
        config: &Path,
        nats_url: &str,
        args: &[S],
        log: &Path,
    ) -> anyhow::Result<LauncherProcess> {
        let exe = slotpool_local_run::sibling_binary("slotpool");
        let log_file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(exe)
            .arg("--nats")
            .arg(nats_url)
            .arg("serve")
            .args(args)
            .arg("--config")
            .arg(config)
            .env("SLOTPOOL_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .context("starting slotpool serve")?;
        let pid = child.id().context("launcher pid")?;
        Ok(LauncherProcess {
            child,
            pid,
            log: log.to_path_buf(),
        })
    }

    /// Runs `work` unless the launcher exits first, which fails with its exit status (a
    /// launcher that refused its config would otherwise leave `work` waiting for an answer).
    pub async fn while_alive<T>(
        &mut self,
        work: impl std::future::Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        tokio::select! {
            done = work => done,
            status = self.child.wait() => bail!(
                "the launcher exited with {}; see {}",
                status?,
                self.log.display()
            ),
        }
    }

    /// Fails if the launcher has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "the launcher exited with {status}; see {}",
                self.log.display()
            );
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it does not stop in time.
    pub async fn stop(mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.pid as i32, libc::SIGTERM) };
        if tokio::time::timeout(LAUNCHER_STOP_GRACE, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }

    /// SIGKILL: a crash, leaving its leases behind.
    pub async fn crash(mut self) {
        let _ = self.child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_cpu_time_counts_the_children_it_waited_for() {
        let me = std::process::id();
        let before = cpu_time(me).unwrap();
        // A child that spins on the CPU for about half a second, then is waited for.
        let status = std::process::Command::new("sh")
            .args([
                "-c",
                "end=$(( $(date +%s%N) + 500000000 )); \
                 while [ $(date +%s%N) -lt $end ]; do :; done",
            ])
            .status()
            .unwrap();
        assert!(status.success());
        let counted = cpu_time(me).unwrap() - before;
        assert!(
            counted >= Duration::from_millis(100),
            "the child's CPU time is not counted: {counted:?}"
        );
    }
}
