//! Health figures for the heartbeat, read from `/proc` and `statvfs(3)`.
//!
//! Parsing is pure (tested on sample text); reading takes the proc root as a parameter.
//! A figure that cannot be read is reported as 0.
//!
//! A backing node is unhealthy ([`verdict`]) when its probe command has not passed yet
//! or failed its last run, or when available memory or disk (of the work dir's file
//! system) is below its threshold. The heartbeat then carries `healthy: false` and the
//! reason; launchers hand out no new slots on it until it is healthy again.

use slotpool_protocol::model::Health;
use std::path::{Path, PathBuf};

/// Why one health figure could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("reading {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot parse {path}: {what}")]
    Parse { path: PathBuf, what: &'static str },
    #[error("statvfs {path}: {error}")]
    Statvfs {
        path: PathBuf,
        error: std::io::Error,
    },
}

/// Total and available space of a file system, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskSpace {
    pub total_kb: u64,
    pub available_kb: u64,
}

/// Total and available memory, in KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    pub total_kb: u64,
    pub available_kb: u64,
}

/// The 1-minute load average from `/proc/loadavg` text.
pub fn parse_loadavg(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> Option<Memory> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    Some(Memory {
        total_kb: field("MemTotal")?,
        available_kb: field("MemAvailable")?,
    })
}

/// Whole seconds since boot from `/proc/uptime` text.
pub fn parse_uptime(text: &str) -> Option<u64> {
    let secs: f64 = text.split_whitespace().next()?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then_some(secs as u64)
}

fn read_parsed<T>(
    path: PathBuf,
    what: &'static str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<T, HealthError> {
    let text = std::fs::read_to_string(&path).map_err(|error| HealthError::Read {
        path: path.clone(),
        error,
    })?;
    parse(&text).ok_or(HealthError::Parse { path, what })
}

/// Space of the file system holding `path`.
pub fn disk_space(path: &Path) -> Result<DiskSpace, HealthError> {
    let statvfs_error = |error| HealthError::Statvfs {
        path: path.to_path_buf(),
        error,
    };
    let stat = rustix::fs::statvfs(path).map_err(|e| statvfs_error(e.into()))?;
    let block = stat.f_frsize;
    Ok(DiskSpace {
        total_kb: stat.f_blocks.saturating_mul(block) / 1024,
        available_kb: stat.f_bavail.saturating_mul(block) / 1024,
    })
}

/// Reads every figure. Figures that cannot be read are 0 and their errors are returned
/// beside the health, for the caller to log.
pub fn read_health(proc_root: &Path, work_dir: &Path) -> (Health, Vec<HealthError>) {
    let mut errors = Vec::new();
    let load1 = keep(
        &mut errors,
        read_parsed(proc_root.join("loadavg"), "no load average", parse_loadavg),
    );
    let memory = keep(
        &mut errors,
        read_parsed(
            proc_root.join("meminfo"),
            "no MemTotal or MemAvailable",
            parse_meminfo,
        ),
    )
    .unwrap_or_default();
    let uptime = keep(
        &mut errors,
        read_parsed(proc_root.join("uptime"), "no uptime", parse_uptime),
    );
    let disk = keep(&mut errors, disk_space(work_dir)).unwrap_or_default();
    let health = Health {
        load1: load1.unwrap_or(0.0),
        mem_total_kb: memory.total_kb,
        mem_available_kb: memory.available_kb,
        disk_total_kb: disk.total_kb,
        disk_available_kb: disk.available_kb,
        uptime_secs: uptime.unwrap_or(0),
        healthy: true,
        reason: None,
    };
    (health, errors)
}

/// Thresholds below which the node is unhealthy; 0 means no check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Thresholds {
    pub min_memory_available_kb: u64,
    pub min_disk_available_kb: u64,
}

/// The last outcome of the probe command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeStatus {
    /// No probe configured.
    None,
    /// Configured, not run to the end yet: the node is not healthy until it passes.
    Pending,
    Passed,
    /// The last run failed: why.
    Failed(String),
}

/// Why the node is unhealthy, or `None` when it is healthy.
pub fn verdict(health: &Health, thresholds: &Thresholds, probe: &ProbeStatus) -> Option<String> {
    match probe {
        ProbeStatus::Pending => return Some("health probe has not passed yet".into()),
        ProbeStatus::Failed(why) => return Some(format!("health probe failed: {why}")),
        ProbeStatus::None | ProbeStatus::Passed => {}
    }
    let min_mem = thresholds.min_memory_available_kb;
    if min_mem > 0 && health.mem_total_kb > 0 && health.mem_available_kb < min_mem {
        return Some(format!(
            "memory available {} MiB is below the threshold of {} MiB",
            health.mem_available_kb / 1024,
            min_mem / 1024
        ));
    }
    let min_disk = thresholds.min_disk_available_kb;
    if min_disk > 0 && health.disk_total_kb > 0 && health.disk_available_kb < min_disk {
        return Some(format!(
            "disk available {} MiB is below the threshold of {} MiB",
            health.disk_available_kb / 1024,
            min_disk / 1024
        ));
    }
    None
}

/// Runs `command` with `sh -c`; Ok when it exits 0 within `timeout`, else why not (the
/// exit status and the last line of its output).
pub async fn run_probe(command: &str, timeout: std::time::Duration) -> Result<(), String> {
    let child = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("cannot start /bin/sh: {err}"))?;
    let out = match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => return Err(format!("no answer within {timeout:?}")),
        Ok(Err(err)) => return Err(format!("waiting for it: {err}")),
        Ok(Ok(out)) => out,
    };
    if out.status.success() {
        return Ok(());
    }
    let text = [out.stderr, out.stdout].concat();
    let text = String::from_utf8_lossy(&text);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    let last: String = last.chars().take(200).collect();
    Err(match (out.status.code(), last.is_empty()) {
        (Some(code), true) => format!("exit status {code}"),
        (Some(code), false) => format!("exit status {code}: {last}"),
        (None, _) => format!("killed by a signal ({})", out.status),
    })
}

/// The value, or `None` with the error pushed onto `errors`.
fn keep<T>(errors: &mut Vec<HealthError>, result: Result<T, HealthError>) -> Option<T> {
    result.map_err(|err| errors.push(err)).ok()
}

/// This machine's host name (the node name `uname(2)` reports, as `gethostname(2)`
/// does), or `"unknown"`.
pub fn hostname() -> String {
    let name = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    if name.is_empty() {
        "unknown".to_string()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       16318412 kB\n\
        MemFree:          812345 kB\n\
        MemAvailable:    9876543 kB\n\
        Buffers:          123456 kB\n";

    #[test]
    fn parses_proc_samples() {
        assert_eq!(parse_loadavg("0.52 0.58 0.59 2/1234 56789\n"), Some(0.52));
        assert_eq!(
            parse_meminfo(MEMINFO),
            Some(Memory {
                total_kb: 16318412,
                available_kb: 9876543
            })
        );
        assert_eq!(parse_uptime("350735.47 234388.90\n"), Some(350735));
    }

    #[test]
    fn refuses_garbage() {
        assert_eq!(parse_loadavg(""), None);
        assert_eq!(parse_loadavg("abc 1 2"), None);
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
        // A field whose name merely starts with MemTotal is not MemTotal.
        assert_eq!(parse_meminfo("MemTotalX: 1 kB\nMemAvailable: 2 kB\n"), None);
        assert_eq!(parse_uptime("-5 0"), None);
        assert_eq!(parse_uptime("nan 0"), None);
    }

    #[test]
    fn reads_a_fake_proc_and_reports_what_is_missing() {
        let proc_dir = tempfile::tempdir().unwrap();
        std::fs::write(proc_dir.path().join("loadavg"), "1.25 0 0 1/1 1\n").unwrap();
        std::fs::write(proc_dir.path().join("meminfo"), MEMINFO).unwrap();
        let (health, errors) = read_health(proc_dir.path(), proc_dir.path());
        assert_eq!(health.load1, 1.25);
        assert_eq!(health.mem_available_kb, 9876543);
        assert_eq!(health.uptime_secs, 0);
        assert!(health.disk_total_kb > 0);
        assert!(health.healthy);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().contains("uptime"), "{}", errors[0]);
    }

    #[test]
    fn verdict_names_the_failing_check() {
        let health = Health {
            mem_total_kb: 1000 * 1024,
            mem_available_kb: 100 * 1024,
            disk_total_kb: 1000 * 1024,
            disk_available_kb: 500 * 1024,
            healthy: true,
            ..Default::default()
        };
        let none = Thresholds::default();
        assert_eq!(verdict(&health, &none, &ProbeStatus::None), None);
        assert_eq!(verdict(&health, &none, &ProbeStatus::Passed), None);
        assert!(verdict(&health, &none, &ProbeStatus::Pending)
            .unwrap()
            .contains("not passed yet"));
        assert_eq!(
            verdict(&health, &none, &ProbeStatus::Failed("exit status 1".into())).unwrap(),
            "health probe failed: exit status 1"
        );
        let mem = Thresholds {
            min_memory_available_kb: 200 * 1024,
            ..Default::default()
        };
        assert_eq!(
            verdict(&health, &mem, &ProbeStatus::None).unwrap(),
            "memory available 100 MiB is below the threshold of 200 MiB"
        );
        let disk = Thresholds {
            min_disk_available_kb: 600 * 1024,
            ..Default::default()
        };
        assert!(verdict(&health, &disk, &ProbeStatus::None)
            .unwrap()
            .starts_with("disk available 500 MiB"));
    }

    #[tokio::test]
    async fn probe_outcomes() {
        let t = std::time::Duration::from_secs(5);
        assert_eq!(run_probe("true", t).await, Ok(()));
        assert_eq!(
            run_probe("echo broken >&2; exit 3", t).await,
            Err("exit status 3: broken".into())
        );
        let slow = run_probe("sleep 5", std::time::Duration::from_millis(50)).await;
        assert!(slow.unwrap_err().contains("no answer"));
    }

    #[test]
    fn statvfs_error_names_the_path() {
        let err = disk_space(Path::new("/nonexistent/slotpool"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/slotpool"), "{err}");
    }
}
