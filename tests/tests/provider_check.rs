//! `slotpool provider check` against the example script provider of examples/providers/
//! (it passes) and against a provider with one flaw at a time (each is named).

use slotpool_tests::{bin_path, workspace_root};
use std::process::{Command, Output};

fn check(provider: &[String]) -> Output {
    check_with(&[], provider)
}

fn check_with(options: &[&str], provider: &[String]) -> Output {
    Command::new(bin_path("slotpool"))
        .args(["provider", "check", "--backing-label", "vm"])
        .args(options)
        // No agent ever reaches this: the check does not wait for agents.
        .args(["--nats-url", "nats://127.0.0.1:9"])
        .args(["--launch-timeout", "60", "--"])
        .args(provider)
        .output()
        .expect("running slotpool provider check")
}

fn shown(out: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_example_script_provider_keeps_the_contract() {
    let state = tempfile::tempdir().unwrap();
    let provider = vec![
        "python3".to_string(),
        workspace_root()
            .join("examples/providers/local-agents.py")
            .display()
            .to_string(),
        bin_path("slotpool-agent").display().to_string(),
        state.path().display().to_string(),
    ];
    let out = check(&provider);
    let text = shown(&out);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("FAIL"), "{text}");
    for passed in [
        "ok    create: machine m-",
        "ok    create again with the same request: the same machine",
        "ok    list after create: machine m-",
        "ok    delete again: a deleted machine counts as deleted",
        "ok    create of an unknown contract version: refused",
        "8 checks, 0 failed",
    ] {
        assert!(text.contains(passed), "no {passed:?} in\n{text}");
    }
    // Everything it made is gone: no machine record, no agent left running.
    let left: Vec<_> = std::fs::read_dir(state.path())
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path().join("machine.json");
            p.exists().then_some(p)
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn each_flaw_of_a_provider_is_named() {
    let script = workspace_root().join("tests/fixtures/flawed-provider.py");
    let run = |flaw: &str| {
        let state = tempfile::tempdir().unwrap();
        let out = check_with(
            &["--console"],
            &[
                "python3".into(),
                script.display().to_string(),
                flaw.into(),
                state.path().display().to_string(),
            ],
        );
        let left = std::fs::read_dir(state.path()).unwrap().count();
        (out, left)
    };
    let (out, left) = run("none");
    let text = shown(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ok    console: 2 lines of output"), "{text}");
    assert!(text.contains("9 checks, 0 failed"), "{text}");
    assert_eq!(left, 0, "the check left machines behind");
    for (flaw, named) in [
        (
            "not-idempotent",
            "FAIL  create again with the same request: non-idempotent create",
        ),
        ("no-backing-id", "FAIL  list after create: missing tag"),
        ("delete-gone-fails", "FAIL  delete again: wrong exit code"),
        ("stray-output", "FAIL  create: checked: `python3"),
        (
            "any-version",
            "FAIL  create of an unknown contract version: version 102 was accepted",
        ),
        ("console-text", "FAIL  console: checked: `python3"),
    ] {
        let (out, left) = run(flaw);
        let text = shown(&out);
        assert_eq!(out.status.code(), Some(1), "{flaw}: {text}");
        assert!(text.contains(named), "{flaw}: no {named:?} in\n{text}");
        if flaw != "delete-gone-fails" {
            assert_eq!(left, 0, "{flaw}: the check left machines behind\n{text}");
        }
    }
}
