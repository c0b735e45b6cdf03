//! `slotpool`: the launcher daemon and the command-line client.

use clap::FromArgMatches;
use slotpool_cli::{self as cli, Cli};

/// mimalloc instead of glibc's malloc: under load the launcher allocates and frees many
/// short-lived buffers (messages, records, task states), and glibc's malloc and free
/// were about a fifth of its CPU (docs/benchmarks.md, item 13).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // `COMPLETE=<shell> slotpool -- …`: the shell asks for completions (live names from
    // the bus); answers and exits.
    clap_complete::CompleteEnv::with_factory(cli::command).complete();
    let args = match cli::command().try_get_matches() {
        Ok(matches) => Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit()),
        Err(e) => e.exit(),
    };
    if !matches!(args.command, cli::Command::Demo(_)) {
        // Like every Unix tool: `slotpool list requests | head` ends quietly when `head`
        // has read enough, instead of panicking on the closed pipe (Rust ignores SIGPIPE
        // by default). The demo keeps ignoring it: it must stop its agents first.
        // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    cli::init_tracing(&args);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        builder.worker_threads(usize::from(n));
    }
    let runtime = builder.enable_all().build().expect("tokio runtime");
    match runtime.block_on(cli::dispatch(args)) {
        Ok(code) => code,
        Err(err) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "error: {err:#}");
            std::process::ExitCode::from(1)
        }
    }
}
