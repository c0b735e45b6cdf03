//! The agent's bus guard closes the instance metadata service to slot users: on a cloud
//! instance it hands the user data (the agent's secret and bus credential) and the
//! instance role's credentials to any local process. Checked in a network namespace of
//! the test's own, where 169.254.169.254 is a loopback address with a listener: with the
//! agent's nftables table, root and a uid outside the slot range still connect, a slot
//! uid is refused; with the same table less its metadata rules, the slot uid connects.
//!
//! Needs root (a network namespace, nftables, another uid), as in CI.

use std::process::Command;

const SLOT_UID: u32 = 2_000_123;
const OTHER_UID: u32 = 1_500;

/// Runs the agent's guard script in a network namespace of its own and tries the metadata
/// address as root, as `OTHER_UID` and as `SLOT_UID`; returns what each got.
fn try_metadata(script: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let nft = dir.path().join("guard.nft");
    std::fs::write(&nft, script).unwrap();
    let shell = format!(
        r#"set -e
ip link set lo up
ip addr add 169.254.169.254/32 dev lo
python3 -m http.server --bind 169.254.169.254 80 >/dev/null 2>&1 &
listener=$!
trap 'kill $listener' EXIT
for i in $(seq 1 100); do
    if bash -c 'exec 3<>/dev/tcp/169.254.169.254/80' 2>/dev/null; then break; fi
    sleep 0.1
done
nft -f {nft}
try() {{ if setpriv --reuid=$1 --regid=$1 --clear-groups timeout 5 bash -c 'exec 3<>/dev/tcp/169.254.169.254/80' 2>/dev/null; then echo "$2 connected"; else echo "$2 refused"; fi; }}
try 0 root
try {OTHER_UID} other
try {SLOT_UID} slot
"#,
        nft = nft.display()
    );
    let out = Command::new("unshare")
        .args(["-n", "bash", "-c", &shell])
        .output()
        .expect("running unshare");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the namespace script failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn slot_users_cannot_reach_the_instance_metadata_service() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test needs root (a network namespace, nftables)"
    );
    let script = slotpool_agent::isolation::bus_guard::script(
        "slotpool_mdtest",
        2_000_000,
        2_999_999,
        &[4222],
    );
    let got = try_metadata(&script);
    assert_eq!(
        got, "root connected\nother connected\nslot refused\n",
        "with the agent's guard:\n{script}"
    );

    // The same table without its metadata rules: the slot uid gets through, so what
    // refused it above was those rules.
    let without: String = script
        .lines()
        .filter(|l| !l.contains("daddr"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(without, script);
    let got = try_metadata(&without);
    assert_eq!(got, "root connected\nother connected\nslot connected\n");
}
