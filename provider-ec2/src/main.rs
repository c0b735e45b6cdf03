//! The `slotpool-provider-ec2` binary: parses its arguments, reads the contract's JSON
//! from stdin, runs the operation and prints its answer; exit code 75 means out of
//! capacity (docs/providers.md).

use anyhow::Context;
use clap::{Parser, Subcommand};
use slotpool_protocol::provider::{ConsoleRequest, CreateRequest, DeleteRequest, EXIT_CAPACITY};
use slotpool_provider_ec2::{ec2::SdkEc2, ops, Config, Failure};
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

/// The most stdin a command reads (a create request with its credential is a few KiB).
const MAX_INPUT: u64 = 1024 * 1024;

/// slotpool's provider for Amazon EC2, run by the launcher as an exec provider's create,
/// delete, list and console commands (see docs/providers.md).
#[derive(Parser)]
#[command(name = "slotpool-provider-ec2", version)]
struct Args {
    /// The provider's configuration (YAML).
    #[arg(
        long,
        env = "SLOTPOOL_EC2_CONFIG",
        default_value = "/etc/slotpool/ec2.yaml"
    )]
    config: PathBuf,
    /// Log filter (stderr); the launcher quotes stderr's last lines in its errors.
    #[arg(long, env = "SLOTPOOL_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    op: Op,
}

#[derive(Subcommand)]
enum Op {
    /// Launch the instance the create request on stdin asks for; print it.
    Create,
    /// Terminate the instance the delete request on stdin names.
    Delete,
    /// Print the installation's instances as a JSON array.
    List,
    /// Print the console output of the instance the console request on stdin names.
    Console,
    /// Check the configuration file and exit.
    CheckConfig,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&args.log))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let capacity = matches!(err.downcast_ref::<Failure>(), Some(Failure::Capacity(_)));
            eprintln!("slotpool-provider-ec2: error: {err:#}");
            if capacity {
                ExitCode::from(EXIT_CAPACITY as u8)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut input = Vec::new();
    std::io::stdin()
        .take(MAX_INPUT + 1)
        .read_to_end(&mut input)
        .context("reading stdin")?;
    anyhow::ensure!(
        input.len() as u64 <= MAX_INPUT,
        "stdin holds more than {MAX_INPUT} bytes"
    );
    Ok(input)
}

/// Reads a request of contract version `speaks` (what the contract's newest version
/// sends for it) from `input`; another version is refused.
fn parse<T: serde::de::DeserializeOwned>(
    input: &[u8],
    what: &str,
    speaks: u32,
) -> anyhow::Result<T> {
    let v: serde_json::Value = serde_json::from_slice(input)
        .with_context(|| format!("reading the {what} request on stdin"))?;
    let version = v.get("v").and_then(|v| v.as_u64()).unwrap_or(0);
    anyhow::ensure!(
        version == u64::from(speaks),
        "the {what} request is contract version {version}; this provider speaks version {speaks}"
    );
    serde_json::from_value(v).with_context(|| format!("reading the {what} request on stdin"))
}

fn run(args: &Args) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    if let Op::CheckConfig = args.op {
        println!(
            "{}: ok ({} sizes)",
            args.config.display(),
            config.sizes.len()
        );
        return Ok(());
    }
    let input = read_stdin()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let api = SdkEc2::new(&config).await;
        let out = match args.op {
            Op::Create => {
                let req: CreateRequest = parse(&input, "create", CreateRequest::VERSION)?;
                serde_json::to_string(&ops::create(&api, &config, &req).await?)?
            }
            Op::Delete => {
                let req: DeleteRequest = parse(&input, "delete", DeleteRequest::VERSION)?;
                ops::delete(&api, &config, &req).await?;
                "{}".to_string()
            }
            Op::Console => {
                let req: ConsoleRequest = parse(&input, "console", ConsoleRequest::VERSION)?;
                serde_json::to_string(&ops::console(&api, &config, &req).await?)?
            }
            Op::List => serde_json::to_string(&ops::list(&api).await?)?,
            Op::CheckConfig => unreachable!("handled above"),
        };
        println!("{out}");
        Ok(())
    })
}
