//! The user data a new instance boots with: a cloud-init `#cloud-config` document (its
//! body is JSON, which YAML reads as it is, so nothing needs quoting by hand) that writes
//! the agent's files and starts the packaged agent.
//!
//! - `/etc/slotpool/agent.secret` (0600): the agent's secret;
//! - `/etc/slotpool/agent.creds` (0600): its bus credential, when it has one;
//! - `/etc/slotpool/ec2-agent.env` (0600): backing id, NATS URL, credential path and
//!   arguments, read by a drop-in of `slotpool-agent.service`
//!   (`/etc/systemd/system/slotpool-agent.service.d/ec2.conf`), so the package's own
//!   `/etc/slotpool/agent.env` stays the package's;
//! - then the configured install commands, and `systemctl enable --now slotpool-agent`.
//!
//! Nothing turns IPv4 forwarding on: the agent does, for its slots' network namespaces,
//! together with a filter that forwards nothing else (docs/slot-network.md); a sysctl
//! setting made here would make the instance forward everything, without that filter.
//!
//! File contents travel base64-encoded (`encoding: b64`); the secret and the credential
//! are never on a command line. The instance metadata service hands user data to any
//! process on the machine that asks: the agent's bus guard closes it to slot users (see
//! docs/providers.md, "The agent's credential").

use base64::Engine;
use serde_json::json;

pub const SECRET_PATH: &str = "/etc/slotpool/agent.secret";
pub const CREDS_PATH: &str = "/etc/slotpool/agent.creds";
pub const ENV_PATH: &str = "/etc/slotpool/ec2-agent.env";
pub const DROP_IN_PATH: &str = "/etc/systemd/system/slotpool-agent.service.d/ec2.conf";
pub const AGENT_UNIT: &str = "slotpool-agent";

/// What the agent on a new instance is started with.
pub struct AgentBoot<'a> {
    pub backing_id: &'a str,
    pub secret: &'a str,
    pub nats_url: &'a str,
    pub nats_credentials: Option<&'a str>,
    /// `--slots` and the rest, one word each.
    pub args: Vec<String>,
    /// Shell commands run before the agent starts.
    pub install: &'a [String],
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum UserDataError {
    #[error("{what} contains a line break or a NUL byte")]
    Unsafe { what: &'static str },
    #[error("the user data is {len} bytes, EC2 takes at most {max}")]
    TooLong { len: usize, max: usize },
}

fn file(path: &str, content: &str) -> serde_json::Value {
    json!({
        "path": path,
        "owner": "root:root",
        "permissions": "0600",
        "encoding": "b64",
        "content": base64::engine::general_purpose::STANDARD.encode(content),
    })
}

/// The user data for `boot`, at most `max` bytes.
pub fn render(boot: &AgentBoot<'_>, max: usize) -> Result<String, UserDataError> {
    for (what, v) in [
        ("the backing id", boot.backing_id),
        ("the NATS URL", boot.nats_url),
    ] {
        if v.contains(['\n', '\r', '\0']) || v.contains(char::is_whitespace) {
            return Err(UserDataError::Unsafe { what });
        }
    }
    let mut env = format!(
        "# Written at boot by slotpool-provider-ec2.\nSLOTPOOL_BACKING_ID={}\nSLOTPOOL_NATS_URL={}\n",
        boot.backing_id, boot.nats_url
    );
    let mut files = vec![file(SECRET_PATH, &format!("{}\n", boot.secret))];
    if let Some(creds) = boot.nats_credentials {
        env.push_str(&format!("SLOTPOOL_NATS_CREDS={CREDS_PATH}\n"));
        files.push(file(CREDS_PATH, creds));
    }
    env.push_str(&format!(
        "SLOTPOOL_AGENT_ARGS=\"{}\"\n",
        boot.args.join(" ")
    ));
    files.push(file(ENV_PATH, &env));
    files.push(json!({
        "path": DROP_IN_PATH,
        "owner": "root:root",
        "permissions": "0644",
        "content": format!("[Service]\nEnvironmentFile={ENV_PATH}\n"),
    }));
    let mut runcmd: Vec<serde_json::Value> = Vec::new();
    runcmd.extend(boot.install.iter().map(|cmd| json!(["sh", "-c", cmd])));
    runcmd.push(json!(["systemctl", "daemon-reload"]));
    runcmd.push(json!(["systemctl", "enable", "--now", AGENT_UNIT]));
    let doc = json!({ "write_files": files, "runcmd": runcmd });
    let text = format!(
        "#cloud-config\n{}\n",
        serde_json::to_string_pretty(&doc).expect("serializable")
    );
    if text.len() > max {
        return Err(UserDataError::TooLong {
            len: text.len(),
            max,
        });
    }
    Ok(text)
}

/// A file of the user data, decoded: what a test (or an operator reading the user data
/// back with `aws ec2 describe-instance-attribute`) sees.
#[derive(Clone, Debug, PartialEq)]
pub struct WrittenFile {
    pub path: String,
    pub permissions: String,
    pub owner: String,
    pub content: String,
}

/// The files and commands of a user data [`render`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub files: Vec<WrittenFile>,
    pub commands: Vec<Vec<String>>,
}

/// Reads back user data [`render`] wrote.
pub fn parse(text: &str) -> Result<Parsed, String> {
    let body = text
        .strip_prefix("#cloud-config\n")
        .ok_or("user data does not start with #cloud-config")?;
    let doc: serde_json::Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let mut files = Vec::new();
    for f in doc["write_files"].as_array().ok_or("no write_files")? {
        let s = |k: &str| f[k].as_str().unwrap_or_default().to_string();
        let content = match f["encoding"].as_str() {
            Some("b64") => String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(s("content"))
                    .map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?,
            _ => s("content"),
        };
        files.push(WrittenFile {
            path: s("path"),
            permissions: s("permissions"),
            owner: s("owner"),
            content,
        });
    }
    let commands = doc["runcmd"]
        .as_array()
        .ok_or("no runcmd")?
        .iter()
        .map(|c| {
            c.as_array()
                .map(|a| {
                    a.iter()
                        .map(|w| w.as_str().unwrap_or_default().to_string())
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect();
    Ok(Parsed { files, commands })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot<'a>(creds: Option<&'a str>, install: &'a [String]) -> AgentBoot<'a> {
        AgentBoot {
            backing_id: "bn-1",
            secret: "s3cret-value",
            nats_url: "tls://10.0.0.1:4222",
            nats_credentials: creds,
            args: vec!["--slots".into(), "8".into()],
            install,
        }
    }

    #[test]
    fn the_agent_gets_its_files_0600_and_no_secret_on_a_command_line() {
        let install = vec!["apt-get install -y slotpool-agent".to_string()];
        let text = render(
            &boot(Some("-----BEGIN NATS USER JWT-----\nabc\n"), &install),
            16384,
        )
        .unwrap();
        assert!(
            !text.contains("s3cret-value"),
            "the secret is in plain sight:\n{text}"
        );
        let p = parse(&text).unwrap();
        let by_path = |path: &str| p.files.iter().find(|f| f.path == path).unwrap();
        assert_eq!(by_path(SECRET_PATH).content, "s3cret-value\n");
        assert_eq!(
            by_path(CREDS_PATH).content,
            "-----BEGIN NATS USER JWT-----\nabc\n"
        );
        for path in [SECRET_PATH, CREDS_PATH, ENV_PATH] {
            assert_eq!(by_path(path).permissions, "0600", "{path}");
            assert_eq!(by_path(path).owner, "root:root", "{path}");
        }
        let env = &by_path(ENV_PATH).content;
        assert!(env.contains("SLOTPOOL_BACKING_ID=bn-1\n"), "{env}");
        assert!(
            env.contains("SLOTPOOL_NATS_URL=tls://10.0.0.1:4222\n"),
            "{env}"
        );
        assert!(
            env.contains(&format!("SLOTPOOL_NATS_CREDS={CREDS_PATH}\n")),
            "{env}"
        );
        assert!(env.contains("SLOTPOOL_AGENT_ARGS=\"--slots 8\"\n"), "{env}");
        assert!(by_path(DROP_IN_PATH).content.contains(ENV_PATH));
        assert_eq!(
            p.commands[0],
            ["sh", "-c", "apt-get install -y slotpool-agent"]
        );
        assert_eq!(
            p.commands.last().unwrap(),
            &["systemctl", "enable", "--now", "slotpool-agent"]
        );
        for cmd in &p.commands {
            assert!(!cmd.join(" ").contains("s3cret"), "{cmd:?}");
        }
    }

    #[test]
    fn forwarding_is_left_to_the_agent() {
        let mut b = boot(None, &[]);
        b.args = vec![
            "--slots".into(),
            "8".into(),
            "--slot-netns".into(),
            "on".into(),
        ];
        let p = parse(&render(&b, 16384).unwrap()).unwrap();
        assert!(p.files.iter().all(|f| !f.path.starts_with("/etc/sysctl")));
        assert!(
            p.commands.iter().all(|c| c[0] != "sysctl"),
            "{:?}",
            p.commands
        );
    }

    #[test]
    fn without_a_credential_no_creds_file_is_named() {
        let text = render(&boot(None, &[]), 16384).unwrap();
        let p = parse(&text).unwrap();
        assert!(p.files.iter().all(|f| f.path != CREDS_PATH));
        assert!(!text.contains("SLOTPOOL_NATS_CREDS"));
    }

    #[test]
    fn odd_values_and_long_user_data_are_refused() {
        let mut b = boot(None, &[]);
        b.nats_url = "nats://h:1\nSLOTPOOL_AGENT_ARGS=--evil";
        assert_eq!(
            render(&b, 16384).unwrap_err(),
            UserDataError::Unsafe {
                what: "the NATS URL"
            }
        );
        let long = "x".repeat(20_000);
        let b = boot(Some(&long), &[]);
        assert!(matches!(
            render(&b, 16384),
            Err(UserDataError::TooLong { max: 16384, .. })
        ));
    }
}
