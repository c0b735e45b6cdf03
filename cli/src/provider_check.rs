//! `slotpool provider check -- CMD...`: drives a provider's create, list and delete (and
//! with `--console` its console) the way the launcher does (its own `exec` driver, with
//! `create`, `list`, `delete` or `console` appended to CMD, as in `exec: {create: [CMD...,
//! create], ...}`) and says what breaks the contract of docs/providers.md: a create that
//! is not exactly once, a machine listed without its backing id, a delete of a deleted
//! machine that fails, stray output, a wrong exit code, an unknown contract version
//! accepted.
//!
//! It creates real machines (one, or two when create is not idempotent) and deletes
//! every machine it made before it ends, also when a check fails.

use rand::Rng;
use slotpool_launcher::provider::exec::ExecProvider;
use slotpool_launcher::provider::{LaunchSpec, Provider, ProviderError};
use slotpool_protocol::model::Instance;
use slotpool_protocol::provider::CreateRequest;
use slotpool_protocol::BackingId;
use std::process::{ExitCode, Stdio};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The backing label of the machine to create (one the provider knows).
    #[arg(long)]
    pub backing_label: String,
    /// Slots of the machine (`slots` of the create request).
    #[arg(long, default_value_t = 1)]
    pub slots: u32,
    /// NATS URL given to the machine's agent (the check does not wait for the agent).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Seconds create may take (the pool's launch-timeout).
    #[arg(long, default_value_t = 300)]
    pub launch_timeout: u64,
    /// The provider has a console command too (`console` appended): check it on the
    /// machine the check makes.
    #[arg(long)]
    pub console: bool,
    /// The provider's command; `create`, `list` or `delete` is appended to it.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// What one check found (printed as it is found).
struct Finding {
    ok: bool,
}

#[derive(Default)]
struct Report(Vec<Finding>);

impl Report {
    fn ok(&mut self, check: &'static str, detail: impl Into<String>) {
        self.push(check, true, detail.into());
    }
    fn fail(&mut self, check: &'static str, detail: impl Into<String>) {
        self.push(check, false, detail.into());
    }
    fn push(&mut self, check: &'static str, ok: bool, detail: String) {
        let mark = if ok { "ok  " } else { "FAIL" };
        println!("{mark}  {check}: {}", detail.replace('\n', "\n      "));
        self.0.push(Finding { ok });
    }
    fn failed(&self) -> usize {
        self.0.iter().filter(|f| !f.ok).count()
    }
}

fn argv(command: &[String], op: &str) -> Vec<String> {
    let mut v = command.to_vec();
    v.push(op.to_string());
    v
}

fn new_backing_id() -> BackingId {
    BackingId::parse(&format!(
        "bn-check-{}",
        ulid::Ulid::new().to_string().to_lowercase()
    ))
    .expect("a valid backing id")
}

fn new_secret() -> String {
    let bytes: [u8; 24] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn run(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let mut provider = ExecProvider::new(
        "checked",
        argv(&args.command, "create"),
        argv(&args.command, "delete"),
        argv(&args.command, "list"),
    )?;
    if args.console {
        provider = provider.with_console(argv(&args.command, "console"))?;
    }
    let mut report = Report::default();
    let mut made: Vec<Instance> = Vec::new();
    let backing_id = new_backing_id();
    check(&args, &provider, &backing_id, &mut report, &mut made).await;
    // Whatever happened, delete what the check made (listed under its backing ids, or
    // returned by a create).
    let mut leftovers = made;
    if let Ok(listed) = provider.list().await {
        for l in listed {
            let ours = l.backing_id.as_ref() == Some(&backing_id);
            if ours && !leftovers.iter().any(|i| i.id == l.instance.id) {
                leftovers.push(l.instance);
            }
        }
    }
    for instance in leftovers {
        if let Err(err) = provider.delete(&instance).await {
            eprintln!(
                "slotpool provider check: could not delete machine {} it made: {err}",
                instance.id
            );
        }
    }
    let failed = report.failed();
    println!("{} checks, {} failed", report.0.len(), failed);
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn check(
    args: &CheckArgs,
    provider: &ExecProvider,
    backing_id: &BackingId,
    report: &mut Report,
    made: &mut Vec<Instance>,
) {
    match provider.list().await {
        Ok(listed) => report.ok("list", format!("{} machines", listed.len())),
        Err(err) => {
            report.fail("list", err.to_string());
            return;
        }
    }
    let spec = LaunchSpec {
        backing_id: backing_id.clone(),
        secret: new_secret(),
        provider: "check".into(),
        pool: "check".into(),
        backing_label: args.backing_label.clone(),
        slots: args.slots,
        nats_url: args.nats_url.clone(),
        credentials: None,
        timeout: Duration::from_secs(args.launch_timeout),
        create_queue: None,
    };
    let first = match provider.launch(&spec).await {
        Ok(l) => {
            report.ok(
                "create",
                format!("machine {} on {}", l.instance.id, l.instance.host),
            );
            made.push(l.instance.clone());
            l.instance
        }
        Err(err @ ProviderError::Capacity { .. }) => {
            report.fail(
                "create",
                format!("exit code 75, out of capacity: the rest cannot be checked ({err})"),
            );
            return;
        }
        Err(err) => {
            report.fail("create", err.to_string());
            return;
        }
    };
    match provider.launch(&spec).await {
        Ok(l) if l.instance.id == first.id => {
            report.ok("create again with the same request", "the same machine")
        }
        Ok(l) => {
            report.fail(
                "create again with the same request",
                format!(
                    "non-idempotent create: it made machine {} beside {} (a create run again after a lost answer must print the first machine)",
                    l.instance.id, first.id
                ),
            );
            made.push(l.instance);
        }
        Err(err) => report.fail("create again with the same request", err.to_string()),
    }
    match provider.list().await {
        Err(err) => report.fail("list after create", err.to_string()),
        Ok(listed) => match listed.iter().find(|l| l.instance.id == first.id) {
            Some(l) if l.backing_id.as_ref() == Some(backing_id) => report.ok(
                "list after create",
                format!("machine {} listed under backing id {backing_id}", first.id),
            ),
            Some(l) => report.fail(
                "list after create",
                match &l.backing_id {
                    None => format!(
                        "missing tag: machine {} is listed without its backing id (tag machines with the backing_id they were created for)",
                        first.id
                    ),
                    Some(other) => format!(
                        "machine {} is listed under backing id {other}, not {backing_id}",
                        first.id
                    ),
                },
            ),
            None => report.fail(
                "list after create",
                format!("list does not report machine {} that create made", first.id),
            ),
        },
    }
    if args.console {
        match provider.console(&first).await {
            Ok(output) => {
                let lines = output.as_deref().unwrap_or_default().lines().count();
                report.ok("console", format!("{lines} lines of output"))
            }
            Err(err) => report.fail("console", err.to_string()),
        }
    }
    match provider.delete(&first).await {
        Ok(()) => report.ok("delete", format!("machine {}", first.id)),
        Err(err) => {
            report.fail("delete", err.to_string());
            return;
        }
    }
    made.retain(|i| i.id != first.id);
    match provider.delete(&first).await {
        Ok(()) => report.ok("delete again", "a deleted machine counts as deleted"),
        Err(err) => report.fail(
            "delete again",
            format!("wrong exit code: delete must succeed for a machine already gone: {err}"),
        ),
    }
    match provider.list().await {
        Ok(listed) if listed.iter().any(|l| l.instance.id == first.id) => report.fail(
            "list after delete",
            format!("machine {} is still listed", first.id),
        ),
        Ok(_) => report.ok("list after delete", "the machine is gone"),
        Err(err) => report.fail("list after delete", err.to_string()),
    }
    version_refused(args, provider, report, made).await;
}

/// A create of a contract version the provider cannot know must fail and make nothing.
async fn version_refused(
    args: &CheckArgs,
    provider: &ExecProvider,
    report: &mut Report,
    made: &mut Vec<Instance>,
) {
    const CHECK: &str = "create of an unknown contract version";
    let backing_id = new_backing_id();
    let mut request = serde_json::to_value(CreateRequest {
        v: CreateRequest::VERSION,
        backing_id: backing_id.to_string(),
        secret: new_secret(),
        provider: "check".into(),
        pool: "check".into(),
        backing_label: args.backing_label.clone(),
        slots: args.slots,
        nats_url: args.nats_url.clone(),
        nats_credentials: None,
    })
    .expect("serializable");
    request["v"] = (CreateRequest::VERSION + 100).into();
    let status = match run_raw(
        &argv(&args.command, "create"),
        request.to_string().as_bytes(),
        Duration::from_secs(args.launch_timeout),
    )
    .await
    {
        Ok(status) => status,
        Err(err) => {
            report.fail(CHECK, err);
            return;
        }
    };
    let listed: Vec<Instance> = provider
        .list()
        .await
        .map(|l| {
            l.into_iter()
                .filter(|l| l.backing_id.as_ref() == Some(&backing_id))
                .map(|l| l.instance)
                .collect()
        })
        .unwrap_or_default();
    let made_any = !listed.is_empty();
    made.extend(listed);
    match (status.success(), made_any) {
        (false, false) => report.ok(CHECK, format!("refused ({status})")),
        (true, _) | (_, true) => report.fail(
            CHECK,
            format!(
                "version {} was accepted ({status}{}): a provider must refuse a version it does not speak",
                CreateRequest::VERSION + 100,
                if made_any { ", and it made a machine" } else { "" }
            ),
        ),
    }
}

/// Runs `argv` with `input` on stdin, its output discarded, killed at `timeout`.
async fn run_raw(
    argv: &[String],
    input: &[u8],
    timeout: Duration,
) -> Result<std::process::ExitStatus, String> {
    let mut child = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", argv[0]))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input).await;
    }
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => Ok(status),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no exit within {timeout:?}")),
    }
}
