//! The CI recipes of docs/ci.md, run as the CI systems run them. The GitLab Runner
//! custom-executor driver in `packaging/gitlab-runner/`, as GitLab Runner runs it: each stage a process of its own with the runner's
//! environment plus the job's variables as `CUSTOM_ENV_*`, `BUILD_FAILURE_EXIT_CODE` and
//! `SYSTEM_FAILURE_EXIT_CODE`; the config stage's JSON read and its `job_env` handed to
//! the later stages; `run <script> <stage>` for each part of the job; cleanup at the end.
//! Against a real nats-server with credentials, a real launcher and real agents in users
//! mode, and the real `slotpool` binary on the PATH. And the job script the other
//! recipes (GitHub Actions, Jenkins, Zuul) call, taken from the page as written.

use serde_json::Value;
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::Client;
use slotpool_tests::{bin_path, label, wait_for, wait_for_some, IsolationEnv, Pool};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);
/// Distinct from every status `slotpool exec` has, so a test tells them apart.
const BUILD_FAILURE: i32 = 41;
const SYSTEM_FAILURE: i32 = 42;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn driver(stage: &str) -> PathBuf {
    repo().join("packaging/gitlab-runner").join(stage)
}

/// The PATH of a CI machine with `slotpool` installed.
fn path_with_slotpool() -> String {
    format!(
        "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        bin_path("slotpool").parent().unwrap().display()
    )
}

/// One job as GitLab Runner drives it: the environment every stage gets, and the
/// `job_env` the config stage returned.
struct Job {
    env: BTreeMap<String, String>,
    dir: tempfile::TempDir,
}

impl Job {
    fn new(pool: &Pool, client: &str, job_id: u32) -> Job {
        let dir = tempfile::Builder::new()
            .prefix("slotpool-gitlab-")
            .tempdir()
            .unwrap();
        let path = path_with_slotpool();
        let mut env = BTreeMap::new();
        for (k, v) in [
            ("PATH", path),
            ("TMPDIR", dir.path().display().to_string()),
            ("SLOTPOOL_NATS_URL", pool.nats.url()),
            (
                "SLOTPOOL_NATS_CREDS",
                pool.nats.creds(Role::Client, client).display().to_string(),
            ),
            ("BUILD_FAILURE_EXIT_CODE", BUILD_FAILURE.to_string()),
            ("SYSTEM_FAILURE_EXIT_CODE", SYSTEM_FAILURE.to_string()),
            ("CUSTOM_ENV_CI_JOB_ID", job_id.to_string()),
            ("CUSTOM_ENV_CI_RUNNER_ID", "12".into()),
            ("CUSTOM_ENV_CI_PROJECT_PATH", "group/project".into()),
        ] {
            env.insert(k.to_string(), v);
        }
        Job { env, dir }
    }

    fn stage(&self, stage: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(driver(stage));
        cmd.args(args)
            .env_clear()
            .envs(&self.env)
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        cmd
    }

    fn output(&self, stage: &str, args: &[&str]) -> Output {
        self.stage(stage, args).output().expect("running a stage")
    }

    /// The config stage: its JSON, whose job_env the later stages get.
    fn config(&mut self, label: &str) -> Value {
        let out = self.output("config", &[label]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "config: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let config: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "config printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        for (k, v) in config["job_env"].as_object().expect("job_env") {
            self.env
                .insert(k.clone(), v.as_str().expect("a string").to_string());
        }
        config
    }

    /// A script of the job, written on the runner's host as the runner does.
    fn script(&self, name: &str, body: &str) -> PathBuf {
        let path = self.dir.path().join(format!("script-{name}"));
        std::fs::write(
            &path,
            format!("#!/usr/bin/env bash\nset -eo pipefail\n{body}\n"),
        )
        .unwrap();
        path
    }

    fn run(&self, stage: &str, body: &str) -> Output {
        let script = self.script(stage, body);
        self.output("run", &[script.to_str().unwrap(), stage])
    }
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

async fn users_pool(env: &IsolationEnv) -> Pool {
    let args = env.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Pool::start_with(1, 5, &label("small", 2, 60, &[]), 1, &args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_its_stages_in_a_node_and_cleanup_releases_it() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let mut job = Job::new(&pool, "ci", 7001);

    let config = job.config("small");
    let nodes = pool.nodes().await;
    assert_eq!(nodes.len(), 1, "{config}");
    let node = &nodes[0];
    let workspace = node.workspace.clone().expect("a workspace");
    assert_eq!(config["hostname"], node.id.to_string());
    assert_eq!(config["builds_dir"], format!("{workspace}/builds"));
    assert_eq!(config["cache_dir"], format!("{workspace}/cache"));
    assert_eq!(config["builds_dir_is_shared"], false);
    assert_eq!(config["driver"]["name"], "slotpool");
    assert_eq!(job.env["SLOTPOOL_GITLAB_NODE"], node.id.to_string());
    let state = PathBuf::from(&job.env["SLOTPOOL_GITLAB_STATE"]);
    assert!(state.is_dir());

    let out = job.output("prepare", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // The parts of a job, as the runner sends them: each in the node, as the slot's
    // user, in the builds dir the config stage gave.
    let builds = format!("{workspace}/builds/group/project");
    let out = job.run("prepare_script", "echo preparing; id -un");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let user = node.login.username.clone().expect("a slot user");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("preparing\n{user}\n")
    );
    let out = job.run(
        "get_sources",
        &format!("mkdir -p {builds} && cd {builds} && echo 'int main' > main.c"),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // The script's stdin is empty: a command that reads it does not eat the script.
    let out = job.run(
        "step_script",
        &format!("cd {builds}\ncat\necho built >&2\nwc -c < main.c\necho done"),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "9\ndone\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "built\n");

    // A failing build is the job's failure, whatever its status (even one of
    // `slotpool exec`'s own), never the system's.
    // The script's own status goes to BUILD_EXIT_CODE_FILE when the runner asks.
    let code_file = job.dir.path().join("build-exit-code");
    job.env.insert(
        "BUILD_EXIT_CODE_FILE".into(),
        code_file.display().to_string(),
    );
    for status in [1, 3, 124, 202] {
        let out = job.run("build_script", &format!("echo failing\nexit {status}"));
        assert_eq!(out.status.code(), Some(BUILD_FAILURE), "{}", text(&out));
        assert_eq!(
            std::fs::read_to_string(&code_file).unwrap().trim(),
            status.to_string()
        );
    }
    job.env.remove("BUILD_EXIT_CODE_FILE");
    let out = job.run("after_script", "kill -9 $$");
    assert_eq!(out.status.code(), Some(BUILD_FAILURE), "{}", text(&out));

    // A command the job leaves running is ended by cleanup, with the node.
    let out = job.run(
        "step_script",
        "setsid sleep 600 >/dev/null 2>&1 < /dev/null &",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let keep_alive: i32 = std::fs::read_to_string(state.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let out = job.output("cleanup", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    wait_for("the keep-alive ended", LONG, || {
        let running = Path::new(&format!("/proc/{keep_alive}")).exists();
        async move { !running }
    })
    .await;
    wait_for("the node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;
    assert!(!state.exists(), "the state directory is left behind");
    let users = env.users();
    wait_for("nothing left running as the slot's user", LONG, || {
        let left = Command::new("pgrep")
            .args(["-u", &users.join(","), "-x", "sleep"])
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        async move { !left }
    })
    .await;

    // A second cleanup (the runner may run it after a failed one) changes nothing.
    let out = job.output("cleanup", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_a_system_failure() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let mut job = Job::new(&pool, "ci", 7002);
    job.config("small");
    let out = job.output("prepare", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let node = slotpool_protocol::NodeId::parse(&job.env["SLOTPOOL_GITLAB_NODE"]).unwrap();

    // The node is taken away while the build runs (an operator's release).
    let operator = Client::connect(&pool.nats.options_as(Role::Operator, "ops"))
        .await
        .unwrap();
    let script = job.script("step_script", "echo started\nsleep 600");
    let mut run = job.stage("run", &[script.to_str().unwrap(), "step_script"]);
    run.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut run = slotpool_tests::ChildGuard::spawn("run stage", run).unwrap();
    let stdout = run.child_mut().stdout.take().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(first, "started\n");
    operator
        .release_node(node, Some("taken away".into()))
        .await
        .expect("an operator's release");
    let status = wait_for_some("the run stage ends", LONG, || {
        let status = run.try_wait();
        async move { status }
    })
    .await;
    assert_eq!(status.code(), Some(SYSTEM_FAILURE));

    // A later stage of the job fails as the system's too; cleanup still succeeds.
    let out = job.run("after_script", "true");
    assert_eq!(out.status.code(), Some(SYSTEM_FAILURE), "{}", text(&out));
    let out = job.output("cleanup", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_in_time_is_a_system_failure_and_leaves_nothing() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let mut job = Job::new(&pool, "ci", 7003);
    let out = job.output("config", &["no-such-label"]);
    assert_eq!(out.status.code(), Some(SYSTEM_FAILURE), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no node of label no-such-label"),
        "{}",
        text(&out)
    );
    let left: Vec<_> = std::fs::read_dir(job.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // Without the config stage's job_env, the later stages fail as the system's.
    let out = job.output("prepare", &[]);
    assert_eq!(out.status.code(), Some(SYSTEM_FAILURE), "{}", text(&out));
    job.env.remove("SLOTPOOL_GITLAB_NODE");
    let out = job.run("step_script", "true");
    assert_eq!(out.status.code(), Some(SYSTEM_FAILURE), "{}", text(&out));
    let out = job.output("cleanup", &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// The code block of docs/ci.md under `<!-- script: NAME -->`.
fn docs_script(name: &str) -> String {
    let page = std::fs::read_to_string(repo().join("docs/ci.md")).unwrap();
    let marker = format!("<!-- script: {name} -->");
    let after = page
        .split_once(&marker)
        .unwrap_or_else(|| panic!("docs/ci.md has no {marker}"))
        .1;
    let body = after.split_once("```sh\n").expect("a sh block").1;
    body.split_once("```")
        .expect("the block's end")
        .0
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_script_of_the_docs_runs_the_checkout_and_retries_only_slotpools_failures() {
    let env = IsolationEnv::new();
    let pool = users_pool(&env).await;
    let tmp = tempfile::Builder::new()
        .prefix("slotpool-ci-")
        .tempdir()
        .unwrap();
    let checkout = tmp.path().join("checkout");
    std::fs::create_dir_all(checkout.join("ci")).unwrap();
    std::fs::create_dir_all(checkout.join(".git")).unwrap();
    std::fs::write(checkout.join(".git/config"), "not sent").unwrap();
    std::fs::write(checkout.join("input.txt"), "hello").unwrap();
    let script = checkout.join("ci-job.sh");
    std::fs::write(&script, docs_script("ci-job.sh")).unwrap();
    let test = checkout.join("ci/test.sh");
    std::fs::write(
        &test,
        "#!/bin/sh\n\
         echo \"tested $(cat input.txt) as $(id -un); git: $(ls .git 2>&1 | wc -l)\" > report.txt\n\
         echo running\n\
         exit 3\n",
    )
    .unwrap();
    for file in [&script, &test] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let job = |extra: &[(&str, &str)]| {
        let mut cmd = Command::new("./ci-job.sh");
        cmd.current_dir(&checkout)
            .env_clear()
            .env("PATH", path_with_slotpool())
            .env("TMPDIR", tmp.path())
            .env("SLOTPOOL_NATS_URL", pool.nats.url())
            .env("SLOTPOOL_NATS_CREDS", pool.nats.creds(Role::Client, "ci"))
            .envs(extra.iter().copied())
            .stdin(Stdio::null());
        cmd.output().expect("running ci-job.sh")
    };

    // The test's own failure: its status, its output, its report; tried once.
    let out = job(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "running\n");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("attempt"));
    let report = std::fs::read_to_string(checkout.join("report.txt")).unwrap();
    assert!(report.starts_with("tested hello as "), "{report}");
    assert!(
        report.ends_with("git: 1\n"),
        "the .git dir was sent: {report}"
    );
    wait_for("the node released", LONG, || async {
        pool.nodes().await.is_empty()
    })
    .await;

    // slotpool's failure (no node of that label): tried again, up to the attempts.
    let out = job(&[
        ("SLOTPOOL_LABEL", "no-such-label"),
        ("SLOTPOOL_ATTEMPTS", "2"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(201..=205)),
        "{}",
        text(&out)
    );
    assert_eq!(stderr.matches("attempt 2 of 2").count(), 1, "{stderr}");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n != "checkout")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
