//! Driver `exec`: backing nodes are created, deleted and listed by commands you provide
//! (a wrapper around `openstack`, `aws` or `gcloud`, or a provider such as
//! `slotpool-provider-ec2`), each run with one JSON document on stdin and one on stdout.
//!
//! ```yaml
//! driver: exec
//! exec:
//!   create: [/usr/local/bin/pool-vm, create]
//!   delete: [/usr/local/bin/pool-vm, delete]
//!   list:   [/usr/local/bin/pool-vm, list]
//!   console: [/usr/local/bin/pool-vm, console]   # optional
//! ```
//!
//! The contract (messages, exit codes, time limits, versions) is described once, in
//! docs/providers.md; its messages are `slotpool_protocol::provider`'s types. This module
//! runs the commands: no shell, a process group of its own killed whole at the time
//! limit, stdout and stderr read to the end, the last [`STDERR_LINES`] lines of stderr
//! quoted in errors.

use super::{LaunchSpec, Launched, ListedInstance, Provider, ProviderError};
use rustix::process::{kill_process_group, Pid, Signal};
use slotpool_protocol::model::Instance;
use slotpool_protocol::provider::{
    ConsoleOutput, ConsoleRequest, CreateRequest, Created, DeleteRequest, ListedMachine,
};
use slotpool_protocol::BackingId;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long delete and list commands may run.
pub const DELETE_LIST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a console command may run: the launcher waits for it before it relaunches
/// or fails a node whose agent did not come up.
pub const CONSOLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The most a command may print on stdout (a list of many machines, a console output);
/// more is a failure.
pub const MAX_STDOUT: u64 = 16 * 1024 * 1024;
pub use slotpool_protocol::provider::EXIT_CAPACITY;
/// Lines of stderr quoted in an error.
const STDERR_LINES: usize = 20;
/// Characters of unparsable stdout quoted in an error.
const STDOUT_QUOTE: usize = 200;

/// Runs the configured commands.
#[derive(Debug)]
pub struct ExecProvider {
    name: String,
    create: Vec<String>,
    delete: Vec<String>,
    list: Vec<String>,
    console: Option<Vec<String>>,
}

impl ExecProvider {
    /// Each command is an argv (program first); none may be empty.
    pub fn new(
        name: &str,
        create: Vec<String>,
        delete: Vec<String>,
        list: Vec<String>,
    ) -> Result<ExecProvider, ProviderError> {
        for (what, argv) in [("create", &create), ("delete", &delete), ("list", &list)] {
            if argv.first().is_none_or(|p| p.is_empty()) {
                return Err(ProviderError::Failed {
                    provider: name.to_string(),
                    message: format!("the {what} command is empty"),
                });
            }
        }
        Ok(ExecProvider {
            name: name.to_string(),
            create,
            delete,
            list,
            console: None,
        })
    }

    /// With a `console` command (an argv; an empty one is an error).
    pub fn with_console(mut self, console: Vec<String>) -> Result<ExecProvider, ProviderError> {
        if console.first().is_none_or(|p| p.is_empty()) {
            return Err(self.failed("the console command is empty".into()));
        }
        self.console = Some(console);
        Ok(self)
    }

    fn failed(&self, message: String) -> ProviderError {
        ProviderError::Failed {
            provider: self.name.clone(),
            message,
        }
    }

    /// Runs `argv` with `input` on stdin and returns its stdout, mapping exit codes,
    /// timeouts and spawn errors to provider errors.
    async fn run(
        &self,
        argv: &[String],
        input: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, ProviderError> {
        let command = display_argv(argv);
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|err| self.failed(format!("starting `{command}`: {err}")))?;
        // Kills the whole group if this future is dropped or times out.
        let mut group = GroupGuard(child.id().and_then(|p| i32::try_from(p).ok()));
        let mut stdin = child.stdin.take().expect("piped");
        let mut stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");

        let io = async {
            let write = async {
                // A command that does not read its stdin is fine (broken pipe).
                let _ = stdin.write_all(input).await;
                drop(stdin);
                Ok(())
            };
            let mut out = Vec::new();
            let mut err = Vec::new();
            let read_out = async {
                (&mut stdout)
                    .take(MAX_STDOUT + 1)
                    .read_to_end(&mut out)
                    .await?;
                if out.len() as u64 > MAX_STDOUT {
                    // Stops the other reads: the command is killed with its group.
                    return Err(std::io::Error::other(format!(
                        "it printed more than {MAX_STDOUT} bytes on stdout"
                    )));
                }
                Ok(())
            };
            let read_err = async { stderr.read_to_end(&mut err).await.map(|_| ()) };
            tokio::try_join!(write, read_out, read_err)?;
            let status = child.wait().await?;
            Ok::<_, std::io::Error>((status, out, err))
        };
        let started = tokio::time::Instant::now();
        let (status, out, err) = match tokio::time::timeout(timeout, io).await {
            Ok(Ok(done)) => done,
            Ok(Err(err)) => {
                return Err(self.failed(format!("running `{command}`: {err}")));
            }
            Err(_) => {
                tracing::warn!(provider = %self.name, command, ?timeout, "provider command timed out, killing it");
                group.kill();
                return Err(ProviderError::Timeout {
                    provider: self.name.clone(),
                    timeout,
                });
            }
        };
        group.disarm();
        tracing::debug!(provider = %self.name, command, %status, elapsed = ?started.elapsed(), "provider command finished");
        if status.success() {
            return Ok(out);
        }
        let message = format!("`{command}` {}: {}", describe(status), stderr_tail(&err));
        if status.code() == Some(EXIT_CAPACITY) {
            Err(ProviderError::Capacity {
                provider: self.name.clone(),
                message,
            })
        } else {
            Err(self.failed(message))
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        argv: &[String],
        out: &[u8],
    ) -> Result<T, ProviderError> {
        serde_json::from_slice(out).map_err(|err| {
            let text = String::from_utf8_lossy(out);
            let quote: String = text.trim().chars().take(STDOUT_QUOTE).collect();
            self.failed(format!(
                "`{}` printed unexpected output: {err}; output begins {quote:?}",
                display_argv(argv)
            ))
        })
    }
}

#[async_trait::async_trait]
impl Provider for ExecProvider {
    fn name(&self) -> &str {
        &self.name
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
        let input = serde_json::to_vec(&CreateRequest {
            v: CreateRequest::VERSION,
            backing_id: spec.backing_id.to_string(),
            secret: spec.secret.clone(),
            provider: spec.provider.clone(),
            pool: spec.pool.clone(),
            backing_label: spec.backing_label.clone(),
            slots: spec.slots,
            nats_url: spec.nats_url.clone(),
            nats_credentials: spec.credentials.as_ref().map(|c| c.text().to_string()),
        })
        .expect("serializable");
        let out = self.run(&self.create, &input, spec.timeout).await?;
        let created: Created = self.parse(&self.create, &out)?;
        if created.id.is_empty() || created.host.is_empty() {
            return Err(self.failed(format!(
                "`{}` printed an empty \"id\" or \"host\"",
                display_argv(&self.create)
            )));
        }
        Ok(Launched {
            instance: Instance {
                id: created.id,
                host: created.host,
                data: created.data,
            },
            attributes: created.attributes,
        })
    }

    async fn delete(&self, instance: &Instance) -> Result<(), ProviderError> {
        let input = serde_json::to_vec(&DeleteRequest {
            v: DeleteRequest::VERSION,
            id: instance.id.clone(),
            host: instance.host.clone(),
            data: instance.data.clone(),
        })
        .expect("serializable");
        self.run(&self.delete, &input, DELETE_LIST_TIMEOUT).await?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
        let out = self.run(&self.list, b"", DELETE_LIST_TIMEOUT).await?;
        let items: Vec<ListedMachine> = self.parse(&self.list, &out)?;
        items
            .into_iter()
            .map(|item| {
                let backing_id = match item.backing_id.as_deref() {
                    None | Some("") => None,
                    Some(id) => Some(BackingId::parse(id).map_err(|err| {
                        self.failed(format!(
                            "`{}` listed instance {:?} with {err}",
                            display_argv(&self.list),
                            item.id
                        ))
                    })?),
                };
                Ok(ListedInstance {
                    instance: Instance {
                        id: item.id,
                        host: item.host,
                        data: item.data,
                    },
                    backing_id,
                })
            })
            .collect()
    }

    async fn console(&self, instance: &Instance) -> Result<Option<String>, ProviderError> {
        let Some(console) = &self.console else {
            return Ok(None);
        };
        let input = serde_json::to_vec(&ConsoleRequest {
            v: ConsoleRequest::VERSION,
            id: instance.id.clone(),
            host: instance.host.clone(),
            data: instance.data.clone(),
        })
        .expect("serializable");
        let out = self.run(console, &input, CONSOLE_TIMEOUT).await?;
        let printed: ConsoleOutput = self.parse(console, &out)?;
        Ok(Some(printed.output))
    }
}

/// SIGKILLs a command's process group when dropped, unless disarmed.
struct GroupGuard(Option<i32>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take().filter(|p| *p > 1).and_then(Pid::from_raw) {
            let _ = kill_process_group(pgid, Signal::KILL);
        }
    }

    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

fn display_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => format!("failed ({status})"),
    }
}

/// The last [`STDERR_LINES`] non-blank lines of `stderr`, one per line.
fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        return "(no stderr)".to_string();
    }
    lines[lines.len().saturating_sub(STDERR_LINES)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A shell script, run as `/bin/sh <script>`: executing a file just written can fail
    /// with ETXTBSY while another test thread forks.
    fn script(dir: &Path, name: &str, body: &str) -> Vec<String> {
        let path = dir.join(name);
        std::fs::write(&path, format!("{body}\n")).unwrap();
        vec!["/bin/sh".into(), path.display().to_string()]
    }

    fn provider(mut create: Vec<String>, delete: Vec<String>, list: Vec<String>) -> ExecProvider {
        create.push("--flag".into());
        ExecProvider::new("cloud", create, delete, list).unwrap()
    }

    fn spec(timeout: Duration) -> LaunchSpec {
        LaunchSpec {
            backing_id: BackingId::parse("bn-abc").unwrap(),
            secret: "top-secret".into(),
            provider: "cloud".into(),
            pool: "main".into(),
            backing_label: "large-node".into(),
            slots: 8,
            nats_url: "nats://10.0.0.1:4222".into(),
            credentials: Some(slotpool_protocol::auth::Credentials::from_text(
                "CREDS".into(),
            )),
            timeout,
            create_queue: None,
        }
    }

    const ECHO_CREATE: &str = r#"python3 -c '
import json, sys
req = json.load(sys.stdin)
assert sys.argv[1:] == ["--flag"], sys.argv
print(json.dumps({"id": "i-" + req["backing_id"], "host": "10.0.0.7",
  "data": {"req": req}, "attributes": {"cpu": req["slots"] * 2}}))
' "$@""#;

    #[tokio::test]
    async fn create_gets_the_spec_and_returns_the_instance() {
        let dir = tempfile::tempdir().unwrap();
        let p = provider(
            script(dir.path(), "create", ECHO_CREATE),
            script(dir.path(), "delete", "cat > \"$0.in\""),
            script(dir.path(), "list", "echo '[]'"),
        );
        let launched = p.launch(&spec(Duration::from_secs(10))).await.unwrap();
        assert_eq!(launched.instance.id, "i-bn-abc");
        assert_eq!(launched.instance.host, "10.0.0.7");
        assert_eq!(
            launched.instance.data["req"],
            serde_json::json!({"v": 2, "backing_id": "bn-abc", "secret": "top-secret",
                "provider": "cloud", "pool": "main", "backing_label": "large-node",
                "slots": 8, "nats_url": "nats://10.0.0.1:4222", "nats_credentials": "CREDS"})
        );
        assert_eq!(launched.attributes["cpu"], serde_json::json!(16));

        p.delete(&launched.instance).await.unwrap();
        let sent: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("delete.in")).unwrap()).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"v": 2, "id": "i-bn-abc", "host": "10.0.0.7",
                "data": launched.instance.data})
        );
    }

    #[tokio::test]
    async fn console_sends_the_machine_at_version_3_and_reads_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let p = provider(
            script(dir.path(), "create", ECHO_CREATE),
            script(dir.path(), "delete", "true"),
            script(dir.path(), "list", "echo '[]'"),
        );
        let launched = p.launch(&spec(Duration::from_secs(10))).await.unwrap();
        assert_eq!(
            p.console(&launched.instance).await.unwrap(),
            None,
            "no console command: nothing to say"
        );
        let p = p
            .with_console(script(
                dir.path(),
                "console",
                "cat > \"$0.in\"\ncat <<'X'\n{\"output\": \"Booting\\r\\nPanic\\u001b[0m\\n\"}\nX",
            ))
            .unwrap();
        assert_eq!(
            p.console(&launched.instance).await.unwrap().as_deref(),
            Some("Booting\r\nPanic\u{1b}[0m\n")
        );
        let sent: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("console.in")).unwrap()).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"v": 3, "id": "i-bn-abc", "host": "10.0.0.7",
                "data": launched.instance.data})
        );
        let stray = provider(
            script(dir.path(), "create2", ECHO_CREATE),
            script(dir.path(), "delete2", "true"),
            script(dir.path(), "list2", "echo '[]'"),
        )
        .with_console(script(dir.path(), "console2", "echo 'kernel panic'"))
        .unwrap();
        let err = stray
            .console(&launched.instance)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("printed unexpected output"), "{err}");
        assert!(
            ExecProvider::new("c", vec!["c".into()], vec!["d".into()], vec!["l".into()])
                .unwrap()
                .with_console(vec![])
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_command_printing_without_end_is_stopped_at_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let p = provider(
            script(dir.path(), "create", ECHO_CREATE),
            script(dir.path(), "delete", "true"),
            script(dir.path(), "list", "yes '[]'"),
        );
        let err = p.list().await.unwrap_err().to_string();
        assert!(err.contains("printed more than 16777216 bytes"), "{err}");
    }

    #[tokio::test]
    async fn a_failing_command_reports_status_and_stderr_tail() {
        let dir = tempfile::tempdir().unwrap();
        let fail = script(
            dir.path(),
            "fail",
            "cat >/dev/null\nfor i in $(seq 1 30); do echo \"line $i\" >&2; done\necho 'quota? no: broken' >&2\nexit 3",
        );
        let p = provider(fail.clone(), fail.clone(), fail);
        let err = p.launch(&spec(Duration::from_secs(10))).await.unwrap_err();
        let ProviderError::Failed { provider, message } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(provider, "cloud");
        assert!(
            message.contains("fail --flag` exited with code 3:"),
            "{message}"
        );
        assert!(message.ends_with("line 30\nquota? no: broken"), "{message}");
        assert!(message.contains("line 12\n"), "{message}");
        assert!(!message.contains("line 11\n"), "{message}");
        assert!(matches!(
            p.delete(&Instance {
                id: "x".into(),
                host: "h".into(),
                data: serde_json::Value::Null
            })
            .await,
            Err(ProviderError::Failed { .. })
        ));
    }

    #[tokio::test]
    async fn exit_75_means_out_of_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let full = script(dir.path(), "full", "echo 'quota exceeded' >&2\nexit 75");
        let p = provider(full.clone(), full.clone(), full);
        let err = p.launch(&spec(Duration::from_secs(10))).await.unwrap_err();
        let ProviderError::Capacity { message, .. } = &err else {
            panic!("{err:?}")
        };
        assert!(
            message.ends_with("exited with code 75: quota exceeded"),
            "{message}"
        );
        assert!(
            err.to_string().starts_with("cloud: out of capacity: "),
            "{err}"
        );
    }

    #[tokio::test]
    async fn bad_json_names_the_problem_and_quotes_the_output() {
        let dir = tempfile::tempdir().unwrap();
        let p = provider(
            script(
                dir.path(),
                "create",
                "echo 'creating...'; echo '{\"id\": \"i-1\"}'",
            ),
            script(dir.path(), "delete", "true"),
            script(
                dir.path(),
                "list",
                "echo '{\"id\": \"i-1\", \"host\": \"h\"}'",
            ),
        );
        let err = p.launch(&spec(Duration::from_secs(10))).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("printed unexpected output: expected value"),
            "{msg}"
        );
        assert!(msg.contains("output begins \"creating...\\n{"), "{msg}");

        let missing_host = provider(
            script(dir.path(), "create2", "echo '{\"id\": \"i-1\"}'"),
            script(dir.path(), "delete2", "true"),
            script(dir.path(), "list2", "true"),
        );
        let msg = missing_host
            .launch(&spec(Duration::from_secs(10)))
            .await
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing field `host`"), "{msg}");

        let msg = p.list().await.unwrap_err().to_string();
        assert!(
            msg.contains("invalid type: map, expected a sequence"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_slow_command_is_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("child.pid");
        // The script's own child must die too (the whole process group is killed).
        let slow = script(
            dir.path(),
            "slow",
            &format!("sleep 30 &\necho $! > {}\nwait", marker.display()),
        );
        let p = provider(slow.clone(), slow.clone(), slow);
        let started = std::time::Instant::now();
        let err = p.launch(&spec(Duration::from_secs(1))).await.unwrap_err();
        assert!(
            matches!(err, ProviderError::Timeout { timeout, .. } if timeout == Duration::from_secs(1)),
            "{err:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let pid: i32 = std::fs::read_to_string(&marker)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .next();
            if matches!(state, None | Some("Z") | Some("X")) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "sleep {pid} survived");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn list_parses_instances_and_backing_ids() {
        let dir = tempfile::tempdir().unwrap();
        let list = script(
            dir.path(),
            "list",
            r#"cat <<'EOF'
[{"id": "i-1", "host": "10.0.0.1", "data": {"az": "a"}, "backing_id": "bn-one"},
 {"id": "i-2", "host": "10.0.0.2", "extra": true}]
EOF"#,
        );
        let p = provider(list.clone(), list.clone(), list);
        let listed = p.list().await.unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[0].instance.id, "i-1");
        assert_eq!(listed[0].instance.data, serde_json::json!({"az": "a"}));
        assert_eq!(listed[0].backing_id.as_ref().unwrap().as_str(), "bn-one");
        assert_eq!(listed[1].instance.host, "10.0.0.2");
        assert!(listed[1].instance.data.is_null());
        assert_eq!(listed[1].backing_id, None);

        let bad = script(
            dir.path(),
            "bad",
            r#"echo '[{"id": "i-1", "host": "h", "backing_id": "a.b"}]'"#,
        );
        let p = provider(bad.clone(), bad.clone(), bad);
        let msg = p.list().await.unwrap_err().to_string();
        assert!(msg.contains("listed instance \"i-1\" with"), "{msg}");
    }

    #[test]
    fn empty_commands_are_rejected() {
        let err = ExecProvider::new("cloud", vec!["c".into()], vec![], vec!["l".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(err, "cloud: the delete command is empty");
    }

    #[tokio::test]
    async fn a_missing_command_is_an_error_naming_it() {
        let p = ExecProvider::new(
            "cloud",
            vec!["/nonexistent/create".into()],
            vec!["d".into()],
            vec!["l".into()],
        )
        .unwrap();
        let msg = p
            .launch(&spec(Duration::from_secs(1)))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("cloud: starting `/nonexistent/create`: "),
            "{msg}"
        );
    }
}
