//! The test exec provider (`tests/fixtures/exec-provider.py`, a script speaking the exec
//! contract whose "machines" are agent processes on this host): its pool file, its test
//! switches, and the clean-up of whatever it started.

use crate::process::{bin_path, workspace_root};
use std::path::{Path, PathBuf};

/// A config whose only provider is the test exec script, keeping its machines in
/// `state`: pool `main` of at most two backing nodes, label `small` of two slots.
pub fn exec_config(state: &Path, retries: u32) -> String {
    exec_config_with(state, retries, "")
}

/// [`exec_config`] with `provider_keys` (YAML lines of the provider's own keys, such as
/// `max-creates-per-second: 1`) added to the provider.
pub fn exec_config_with(state: &Path, retries: u32, provider_keys: &str) -> String {
    let script = workspace_root().join("tests/fixtures/exec-provider.py");
    let agent = bin_path("slotpool-agent");
    let cmd = |op: &str| {
        format!(
            "[python3, {}, {op}, {}, {}]",
            script.display(),
            agent.display(),
            state.display()
        )
    };
    let provider_keys: String = provider_keys
        .lines()
        .map(|l| format!("    {l}\n"))
        .collect();
    format!(
        "providers:
  - name: cloud
    driver: exec
{provider_keys}    exec:
      create: {}
      delete: {}
      list: {}
    pools:
      - name: main
        max-servers: 2
        boot-timeout: 20
        launch-retries: {retries}
        labels:
          - {{name: small, backing-label: vm, max-parallel-jobs: 2, grace-time: 1}}
",
        cmd("create"),
        cmd("delete"),
        cmd("list")
    )
}

/// Creates the test switch file `name` in the exec script's state dir, holding
/// `content` (`slow-boot`: the seconds an agent waits before it starts).
pub fn switch_on(state: &Path, name: &str, content: &str) {
    std::fs::create_dir_all(state).unwrap();
    std::fs::write(state.join(name), content).unwrap();
}

/// Kills, when dropped, every process with an argument naming a path in or at `.0` (the
/// exec script's commands and its machines).
pub struct KillUnder(pub PathBuf);

impl Drop for KillUnder {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        let dir = self.0.as_os_str().as_bytes();
        let pids = slotpool_launcher::provider::local::processes_where(|args| {
            args.iter().any(|a| a.starts_with(dir))
        });
        for pid in pids {
            // SAFETY: kill(2) on a positive pid found just now; touches no memory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}
