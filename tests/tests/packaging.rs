//! The packages from `packaging/build.sh`: the .debs are installed on this machine with
//! dpkg, their binaries, configuration, units, users and directories checked, then
//! removed and purged; the .rpms are checked with rpm's query tools.
//!
//! This test changes the machine: it needs root (CI runs as root) and it installs and
//! purges the `slotpool`, `slotpool-agent` and `slotpool-provider-ec2` packages, whatever
//! was installed before. The installed EC2 provider is run against a moto server.
//! It fails, never skips, when it cannot. The packaging tools come from
//! `packaging/tools.sh` (scripts/test.sh runs it before the tests). The packages are
//! built from the binaries next to this test (`cargo build --workspace --bins`), so no
//! release build is needed.

use slotpool_tests::{bin_path, workspace_root};
use std::fs::{self, File};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[path = "packaging/systemd_units.rs"]
mod systemd_units;

const DEB_PACKAGES: [&str; 3] = ["slotpool", "slotpool-agent", "slotpool-provider-ec2"];
/// How long dpkg may wait for another dpkg or apt on the machine to let go of its lock.
const DPKG_LOCK_TIMEOUT: Duration = Duration::from_secs(300);
const UNIT_DIR: &str = "/usr/lib/systemd/system";
const MAN_DIR: &str = "/usr/share/man/man1";
/// Some of the manual pages `slotpool man` writes (one per command).
const MAN_PAGES: [&str; 3] = [
    "slotpool.1.gz",
    "slotpool-request.1.gz",
    "slotpool-config-validate.1.gz",
];
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[test]
fn deb_installs_runs_and_purges_cleanly_and_rpm_is_well_formed() {
    assert_eq!(
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() },
        0,
        "the packaging test installs packages with dpkg and must run as root"
    );
    let _lock = MachineLock::acquire();
    let tmp = tempfile::tempdir().unwrap();
    let packages = packages();

    check_rpms(packages);

    let _purge = PurgeOnDrop;
    purge();
    check_deb_lifecycle(packages, tmp.path());
}

/// The .deb and .rpm files of one build.
struct Packages {
    /// The directory holding them.
    dir: PathBuf,
    debs: Vec<PathBuf>,
    rpms: Vec<PathBuf>,
}

/// The packages of this test binary's one build (both tests use it), in the target
/// dir's scratch space.
fn packages() -> &'static Packages {
    static PACKAGES: OnceLock<Packages> = OnceLock::new();
    PACKAGES.get_or_init(|| build_packages(Path::new(env!("CARGO_TARGET_TMPDIR"))))
}

fn build_packages(dir: &Path) -> Packages {
    let out = dir.join("packages");
    let bin_dir = bin_path("slotpool").parent().unwrap().to_path_buf();
    bin_path("slotpool-agent");
    bin_path("slotpool-provider-ec2");
    let output = Command::new(workspace_root().join("packaging/build.sh"))
        .arg("--fast")
        .arg("--bin-dir")
        .arg(&bin_dir)
        .env("SLOTPOOL_PACKAGES_DIR", &out)
        .output()
        .expect("running packaging/build.sh");
    assert_ok("packaging/build.sh", &output);
    let mut files: Vec<PathBuf> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let with_ext = |ext: &str| -> Vec<PathBuf> {
        files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .cloned()
            .collect()
    };
    let packages = Packages {
        dir: out.clone(),
        debs: with_ext("deb"),
        rpms: with_ext("rpm"),
    };
    let names = |v: &[PathBuf]| -> Vec<String> {
        v.iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    let (debs, rpms) = (names(&packages.debs), names(&packages.rpms));
    assert_eq!(debs.len(), 3, "three .debs expected, got {debs:?}");
    assert_eq!(rpms.len(), 3, "three .rpms expected, got {rpms:?}");
    assert!(debs[0].starts_with(&format!("slotpool-agent_{VERSION}-")));
    assert!(debs[1].starts_with(&format!("slotpool-provider-ec2_{VERSION}-")));
    assert!(debs[2].starts_with(&format!("slotpool_{VERSION}-")));
    assert!(rpms[0].starts_with(&format!("slotpool-{VERSION}-")));
    assert!(rpms[1].starts_with(&format!("slotpool-agent-{VERSION}-")));
    assert!(rpms[2].starts_with(&format!("slotpool-provider-ec2-{VERSION}-")));
    packages
}

fn check_deb_lifecycle(packages: &Packages, tmp: &Path) {
    let mut install = vec!["-i".to_string()];
    install.extend(packages.debs.iter().map(|p| p.display().to_string()));
    let output = dpkg(&install);
    assert_ok("dpkg -i", &output);
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("warning"),
        "dpkg -i warned:\n{}",
        text(&output)
    );
    for name in DEB_PACKAGES {
        assert_eq!(package_status(name), "install ok installed", "{name}");
    }

    // The binaries run.
    for (bin, name) in [
        ("/usr/bin/slotpool", "slotpool"),
        ("/usr/bin/slotpool-agent", "slotpool-agent"),
        ("/usr/bin/slotpool-provider-ec2", "slotpool-provider-ec2"),
    ] {
        let out = run(bin, &["--version"]);
        assert_ok(bin, &out);
        assert_eq!(stdout(&out).trim(), format!("{name} {VERSION}"));
    }

    // The default launcher config is valid, also for the user the service runs as.
    let out = run(
        "/usr/bin/slotpool",
        &["config", "validate", "/etc/slotpool/pool.yaml"],
    );
    assert_ok("slotpool config validate", &out);
    assert!(
        stdout(&out).contains("/etc/slotpool/pool.yaml: ok"),
        "{}",
        text(&out)
    );
    let out = run(
        "runuser",
        &[
            "-u",
            "slotpool",
            "--",
            "/usr/bin/slotpool",
            "config",
            "validate",
            "/etc/slotpool/pool.yaml",
        ],
    );
    assert_ok("slotpool config validate as the slotpool user", &out);

    // Shell completions, the monitoring examples and manual pages.
    let mut docs = vec![
        "/usr/share/bash-completion/completions/slotpool".to_string(),
        "/usr/share/zsh/vendor-completions/_slotpool".to_string(),
        "/usr/share/fish/vendor_completions.d/slotpool.fish".to_string(),
        "/usr/share/slotpool/grafana/slotpool-dashboard.json".to_string(),
        "/usr/share/slotpool/prometheus/slotpool-alerts.yml".to_string(),
        "/usr/share/slotpool/gitlab-runner/lib.sh".to_string(),
    ];
    docs.extend(MAN_PAGES.iter().map(|page| format!("{MAN_DIR}/{page}")));
    for file in &docs {
        assert!(Path::new(file).is_file(), "{file} not installed");
    }
    let bash = fs::read_to_string(&docs[0]).unwrap();
    // The script asks the installed `slotpool` as the shell completes (live names).
    assert!(
        bash.contains("-F _clap_complete_slotpool slotpool"),
        "{bash}"
    );

    check_agent_env_file(tmp);
    check_ec2_provider(tmp);
    check_units(tmp);
    check_users_and_modes();

    let out = run("dpkg-query", &["-W", "-f=${Conffiles}", "slotpool"]);
    let conffiles = stdout(&out);
    for file in ["/etc/slotpool/pool.yaml", "/etc/slotpool/launcher.env"] {
        assert!(
            conffiles.contains(file),
            "{file} not a conffile:\n{conffiles}"
        );
    }
    let out = run(
        "dpkg-query",
        &["-W", "-f=${Conffiles}", "slotpool-provider-ec2"],
    );
    assert!(
        stdout(&out).contains("/etc/slotpool/ec2.yaml"),
        "ec2.yaml not a conffile:\n{}",
        text(&out)
    );

    // State the services would have made, which purge must remove too.
    fs::create_dir_all("/var/lib/slotpool/agent/slots/0").unwrap();
    fs::write("/var/lib/slotpool/agent/slots/0/file", "x").unwrap();
    fs::write("/var/lib/slotpool/launcher/file", "x").unwrap();
    fs::write("/etc/slotpool/agent.secret", "s3cret").unwrap();

    // Remove: binaries and units go, configuration stays.
    let output = dpkg(&["-r", "slotpool", "slotpool-agent", "slotpool-provider-ec2"]);
    assert_ok("dpkg -r", &output);
    for name in DEB_PACKAGES {
        assert_eq!(
            package_status(name),
            "deinstall ok config-files",
            "{name} after dpkg -r"
        );
    }
    for gone in [
        "/usr/bin/slotpool",
        "/usr/bin/slotpool-agent",
        "/usr/bin/slotpool-provider-ec2",
        "/usr/lib/systemd/system/slotpool.service",
        "/usr/lib/systemd/system/slotpool-agent.service",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after dpkg -r");
    }
    for gone in &docs {
        assert!(!Path::new(gone).exists(), "{gone} left after dpkg -r");
    }
    assert!(Path::new("/etc/slotpool/pool.yaml").exists());

    // Purge: nothing is left.
    let output = dpkg(&["-P", "slotpool", "slotpool-agent", "slotpool-provider-ec2"]);
    assert_ok("dpkg -P", &output);
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("warning"),
        "dpkg -P warned:\n{}",
        text(&output)
    );
    for name in DEB_PACKAGES {
        assert_eq!(package_status(name), "", "{name} still known to dpkg");
    }
    for gone in ["/etc/slotpool", "/var/lib/slotpool"] {
        assert!(!Path::new(gone).exists(), "{gone} left after dpkg -P");
    }
    assert!(getent("passwd", "slotpool").is_none(), "user slotpool left");
    assert!(getent("group", "slotpool").is_none(), "group slotpool left");
}

/// The agent accepts every flag agent.env gives it: run as the unit does (its
/// environment, its command line) it gets past flag parsing to the secret file.
fn check_agent_env_file(tmp: &Path) {
    let env = parse_env_file(&fs::read_to_string("/etc/slotpool/agent.env").unwrap());
    let missing_secret = tmp.join("no-such.secret");
    let mut cmd = Command::new("/usr/bin/slotpool-agent");
    cmd.env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("SLOTPOOL_BACKING_ID", "node-1")
        .arg("--secret-file")
        .arg(&missing_secret)
        .args(["--mount-namespace", "/proc/1/ns/mnt"]);
    let args = env
        .iter()
        .find(|(k, _)| k == "SLOTPOOL_AGENT_ARGS")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    cmd.args(args.split_whitespace());
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains(&format!("reading secret file {}", missing_secret.display())),
        "slotpool-agent with agent.env should stop at the missing secret file:\n{}",
        text(&out)
    );
}

/// The installed EC2 provider reads its installed example configuration, also as the
/// user the launcher runs as, and lists an EC2 server's instances (moto's, on loopback)
/// with it.
fn check_ec2_provider(tmp: &Path) {
    let bin = "/usr/bin/slotpool-provider-ec2";
    let config = "/etc/slotpool/ec2.yaml";
    let out = run(
        "runuser",
        &[
            "-u",
            "slotpool",
            "--",
            bin,
            "--config",
            config,
            "check-config",
        ],
    );
    assert_ok(
        "slotpool-provider-ec2 check-config as the slotpool user",
        &out,
    );
    assert!(
        stdout(&out).contains("/etc/slotpool/ec2.yaml: ok"),
        "{}",
        text(&out)
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let moto = runtime.block_on(slotpool_tests::Moto::start());
    let pointed = tmp.join("ec2.yaml");
    let example = fs::read_to_string(config).unwrap();
    fs::write(
        &pointed,
        format!("{example}\nendpoint-url: {}\n", moto.url()),
    )
    .unwrap();
    let out = Command::new(bin)
        .arg("--config")
        .arg(&pointed)
        .arg("list")
        .envs(slotpool_tests::Moto::aws_env())
        .output()
        .unwrap();
    assert_ok("slotpool-provider-ec2 list", &out);
    assert_eq!(stdout(&out).trim(), "[]", "{}", text(&out));
    drop(moto);
}

/// `KEY=value` lines, with optional double quotes around the value, as systemd reads them.
fn parse_env_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("KEY=value");
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v);
            (k.trim().to_string(), v.to_string())
        })
        .collect()
}

/// `systemd-analyze verify` accepts both installed units and rejects a broken copy, so a
/// clean result means something.
fn check_units(tmp: &Path) {
    for unit in ["slotpool.service", "slotpool-agent.service"] {
        let path = Path::new(UNIT_DIR).join(unit);
        let out = systemd_analyze_verify(&path);
        assert_ok(&format!("systemd-analyze verify {unit}"), &out);
        // verify exits 0 on bad directives too (it ignores them, as systemd would):
        // what it says about our units is the result.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("slotpool"),
            "systemd-analyze verify complained about {unit}:\n{stderr}"
        );

        let broken = tmp.join(unit);
        let text = fs::read_to_string(&path).unwrap();
        fs::write(
            &broken,
            text.replace("ProtectSystem=strict", "ProtectSystem=sometimes"),
        )
        .unwrap();
        let out = systemd_analyze_verify(&broken);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("{}:", broken.display())) && stderr.contains("sometimes"),
            "systemd-analyze verify missed a broken {unit}:\n{stderr}"
        );
    }
}

fn systemd_analyze_verify(unit: &Path) -> Output {
    Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(unit)
        .output()
        .expect("running systemd-analyze")
}

fn check_users_and_modes() {
    let user = getent("passwd", "slotpool").expect("user slotpool");
    let fields: Vec<&str> = user.split(':').collect();
    let uid: u32 = fields[2].parse().unwrap();
    assert!(uid < 1000, "slotpool is not a system user: {user}");
    assert_eq!(fields[5], "/var/lib/slotpool/launcher", "home: {user}");
    assert_eq!(fields[6], "/usr/sbin/nologin", "shell: {user}");
    let gid: u32 = getent("group", "slotpool")
        .expect("group slotpool")
        .split(':')
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();

    for (path, mode, owner) in [
        ("/etc/slotpool", 0o755, (0, 0)),
        ("/etc/slotpool/pool.yaml", 0o644, (0, 0)),
        ("/etc/slotpool/ec2.yaml", 0o644, (0, 0)),
        ("/etc/slotpool/launcher.env", 0o600, (0, 0)),
        ("/etc/slotpool/agent.env", 0o600, (0, 0)),
        ("/var/lib/slotpool", 0o755, (0, 0)),
        ("/var/lib/slotpool/launcher", 0o750, (uid, gid)),
        ("/var/lib/slotpool/local", 0o750, (uid, gid)),
        ("/var/lib/slotpool/agent", 0o755, (0, 0)),
        ("/usr/bin/slotpool", 0o755, (0, 0)),
        ("/usr/share/slotpool/gitlab-runner/run", 0o755, (0, 0)),
        ("/usr/bin/slotpool-agent", 0o755, (0, 0)),
        ("/usr/bin/slotpool-provider-ec2", 0o755, (0, 0)),
        ("/usr/lib/systemd/system/slotpool.service", 0o644, (0, 0)),
        (
            "/usr/lib/systemd/system/slotpool-agent.service",
            0o644,
            (0, 0),
        ),
    ] {
        let meta = fs::metadata(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(
            meta.permissions().mode() & 0o7777,
            mode,
            "{path}: mode {:o}",
            meta.permissions().mode() & 0o7777
        );
        assert_eq!((meta.uid(), meta.gid()), owner, "{path}: owner");
    }
}

fn check_rpms(packages: &Packages) {
    for (rpm, name, files, scripts) in [
        (
            &packages.rpms[0],
            "slotpool",
            &[
                ("-rw-------", "/etc/slotpool/launcher.env"),
                ("-rw-r--r--", "/etc/slotpool/pool.yaml"),
                ("-rwxr-xr-x", "/usr/bin/slotpool"),
                ("-rw-r--r--", "/usr/lib/systemd/system/slotpool.service"),
                (
                    "-rw-r--r--",
                    "/usr/share/bash-completion/completions/slotpool",
                ),
                ("-rw-r--r--", "/usr/share/doc/slotpool/README.md"),
                (
                    "-rw-r--r--",
                    "/usr/share/fish/vendor_completions.d/slotpool.fish",
                ),
                ("-rwxr-xr-x", "/usr/share/slotpool/gitlab-runner/cleanup"),
                ("-rwxr-xr-x", "/usr/share/slotpool/gitlab-runner/config"),
                ("-rw-r--r--", "/usr/share/slotpool/gitlab-runner/lib.sh"),
                ("-rwxr-xr-x", "/usr/share/slotpool/gitlab-runner/prepare"),
                ("-rwxr-xr-x", "/usr/share/slotpool/gitlab-runner/run"),
                (
                    "-rw-r--r--",
                    "/usr/share/slotpool/grafana/slotpool-dashboard.json",
                ),
                (
                    "-rw-r--r--",
                    "/usr/share/slotpool/prometheus/slotpool-alerts.yml",
                ),
                ("-rw-r--r--", "/usr/share/zsh/site-functions/_slotpool"),
            ][..],
            &[
                "useradd --system",
                "try-restart slotpool.service",
                "disable --now slotpool.service",
            ][..],
        ),
        (
            &packages.rpms[1],
            "slotpool-agent",
            &[
                ("-rw-------", "/etc/slotpool/agent.env"),
                ("-rw-r--r--", "/etc/ssh/sshd_config.d/slotpool-slots.conf"),
                ("-rwxr-xr-x", "/usr/bin/slotpool-agent"),
                (
                    "-rw-r--r--",
                    "/usr/lib/systemd/system/slotpool-agent.service",
                ),
            ][..],
            &[
                "try-restart slotpool-agent.service",
                "disable --now slotpool-agent.service",
                "nft delete table inet",
            ][..],
        ),
        (
            &packages.rpms[2],
            "slotpool-provider-ec2",
            &[
                ("-rw-r--r--", "/etc/slotpool/ec2.yaml"),
                ("-rwxr-xr-x", "/usr/bin/slotpool-provider-ec2"),
                (
                    "-rw-r--r--",
                    "/usr/share/doc/slotpool-provider-ec2/providers.md",
                ),
            ][..],
            &[][..],
        ),
    ] {
        let rpm = rpm.to_str().unwrap();
        let info = rpm_query(&["-qip", rpm]);
        for field in [
            format!("Name        : {name}"),
            format!("Version     : {VERSION}"),
            "License     : Apache-2.0".to_string(),
            format!("Architecture: {}", std::env::consts::ARCH),
        ] {
            assert!(info.contains(&field), "{rpm}: no `{field}` in\n{info}");
        }

        // Exactly these files, root's, with these modes.
        let listing = rpm_query(&["-qlvp", rpm]);
        let got: Vec<(String, String)> = listing
            .lines()
            .map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                assert_eq!((f[2], f[3]), ("root", "root"), "{rpm}: owner of {line}");
                (f[0].to_string(), f[f.len() - 1].to_string())
            })
            .collect();
        // The manual pages (one per command) are checked by name below.
        let (man, got): (Vec<_>, Vec<_>) = got
            .into_iter()
            .partition(|(_, path)| path.starts_with(MAN_DIR));
        let want: Vec<(String, String)> = files
            .iter()
            .map(|(mode, path)| (mode.to_string(), path.to_string()))
            .collect();
        assert_eq!(got, want, "{rpm}: files\n{listing}");
        if name == "slotpool" {
            for page in MAN_PAGES {
                let path = format!("{MAN_DIR}/{page}");
                assert!(
                    man.contains(&("-rw-r--r--".to_string(), path.clone())),
                    "{rpm}: no {path}\n{listing}"
                );
            }
        } else {
            assert!(man.is_empty(), "{rpm}: manual pages {man:?}");
        }

        let configs: Vec<String> = rpm_query(&["-qcp", rpm])
            .lines()
            .map(str::to_string)
            .collect();
        let want_configs: Vec<&str> = files
            .iter()
            .map(|(_, path)| *path)
            .filter(|p| p.starts_with("/etc/"))
            .collect();
        assert_eq!(configs, want_configs, "{rpm}: config files");

        let script_text = rpm_query(&["-qp", "--scripts", rpm]);
        for needle in scripts {
            assert!(
                script_text.contains(needle),
                "{rpm} scripts lack `{needle}`:\n{script_text}"
            );
        }
        let out = run("rpm", &["-K", rpm]);
        assert_ok(&format!("rpm -K {rpm}"), &out);
        assert!(stdout(&out).contains("digests OK"), "{}", text(&out));
    }
}

fn rpm_query(args: &[&str]) -> String {
    let out = run("rpm", args);
    assert_ok(&format!("rpm {}", args.join(" ")), &out);
    stdout(&out)
}

/// Runs dpkg, waiting while another dpkg or apt holds its lock (the machine may be
/// shared).
fn dpkg<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    let deadline = Instant::now() + DPKG_LOCK_TIMEOUT;
    loop {
        let out = Command::new("dpkg")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .expect("running dpkg");
        let locked = String::from_utf8_lossy(&out.stderr).contains("lock");
        if out.status.success() || !locked || Instant::now() >= deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `dpkg-query`'s status of a package, or "" when dpkg does not know it.
fn package_status(name: &str) -> String {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .unwrap();
    stdout(&out).trim().to_string()
}

fn purge() {
    let known: Vec<&str> = DEB_PACKAGES
        .into_iter()
        .filter(|p| !package_status(p).is_empty())
        .collect();
    if known.is_empty() {
        return;
    }
    let mut args = vec!["-P"];
    args.extend(known);
    let out = dpkg(&args);
    if !out.status.success() {
        eprintln!("dpkg -P failed:\n{}", text(&out));
    }
}

/// Purges the packages when the test ends, passed or not.
struct PurgeOnDrop;

impl Drop for PurgeOnDrop {
    fn drop(&mut self) {
        purge();
    }
}

/// One packaging test at a time on this machine, whichever checkout it runs from: they
/// install the same packages.
struct MachineLock(#[allow(dead_code)] File);

impl MachineLock {
    fn acquire() -> MachineLock {
        let file = File::create(std::env::temp_dir().join("slotpool-packaging-test.lock"))
            .expect("creating the packaging test lock file");
        // SAFETY: the descriptor is open (owned by `file`) for the whole call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
        MachineLock(file)
    }
}

fn getent(db: &str, key: &str) -> Option<String> {
    let out = Command::new("getent").args([db, key]).output().unwrap();
    out.status
        .success()
        .then(|| stdout(&out).trim().to_string())
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn text(out: &Output) -> String {
    format!(
        "status: {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_ok(what: &str, out: &Output) {
    assert!(out.status.success(), "{what} failed:\n{}", text(out));
}
