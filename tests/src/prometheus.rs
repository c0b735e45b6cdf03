//! A real Prometheus server (Debian's `prometheus` package) scraping given targets: its
//! own temp dir and TSDB, an ephemeral port, a short scrape interval, killed on drop.

use crate::metrics::get;
use crate::process::ChildGuard;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

/// Where the `prometheus` and `promtool` binaries are (`apt-get install prometheus`;
/// `scripts/test.sh` installs it when missing).
pub const PROMETHEUS: &str = "/usr/bin/prometheus";
pub const PROMTOOL: &str = "/usr/bin/promtool";

/// How long Prometheus may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Prometheus {
    // Declared before `dir`: the process dies before its directory goes.
    _child: ChildGuard,
    dir: TempDir,
    addr: SocketAddr,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`/metrics`) every second, with `token` as
    /// its bearer token.
    pub async fn start(targets: &[SocketAddr], token: Option<&str>) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).is_file(),
            "{PROMETHEUS} not found: install Debian's prometheus package (scripts/test.sh does)"
        );
        let dir = tempfile::Builder::new()
            .prefix("slotpool-prometheus-")
            .tempdir()
            .expect("temp dir");
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let authorization = token
            .map(|t| format!("    authorization:\n      credentials: '{t}'\n"))
            .unwrap_or_default();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: slotpool\n{authorization}    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).expect("writing its config");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("its log");
        let mut cmd = Command::new(PROMETHEUS);
        cmd.arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg("--web.listen-address=127.0.0.1:0")
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
        let child = ChildGuard::spawn("prometheus", cmd).expect("starting prometheus");
        let pid = child.id();
        // Port 0: the kernel picks the port, read back from the process's listening socket.
        let port = crate::wait_for_some("prometheus to listen", START_TIMEOUT, || async move {
            listening_port(pid)
        })
        .await;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let prometheus = Prometheus {
            _child: child,
            dir,
            addr,
        };
        crate::wait_for("prometheus to be ready", START_TIMEOUT, || async {
            get(addr, "/-/ready", None).await.0 == 200
        })
        .await;
        prometheus
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The result vector of the instant PromQL query `promql`, as (labels, value).
    pub async fn query(&self, promql: &str) -> Vec<(serde_json::Value, f64)> {
        let path = format!("/api/v1/query?query={}", encode(promql));
        let (status, body) = get(self.addr, &path, None).await;
        assert_eq!(status, 200, "{promql}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(answer["status"], "success", "{promql}: {body}");
        answer["data"]["result"]
            .as_array()
            .expect("a vector")
            .iter()
            .map(|r| {
                let value = r["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .expect("a sample value");
                (r["metric"].clone(), value)
            })
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- prometheus log\n{}", self.log());
        }
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The port of a loopback TCP socket process `pid` listens on, if it has one yet.
fn listening_port(pid: u32) -> Option<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().to_string();
            let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(inode.to_string())
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // local_address, st (0A: LISTEN), inode
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        if *state != "0A" || !inodes.iter().any(|i| i == inode) {
            return None;
        }
        let port = local.split(':').nth(1)?;
        u16::from_str_radix(port, 16).ok()
    })
}
