//! The provider's configuration file (YAML), validated once when it is read: every
//! refusal names the file, the key and what the key takes. `docs/providers.md` ("The EC2
//! provider") describes each key; `packaging/etc/ec2.yaml` is a complete example that
//! the tests load.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The longest an EC2 API call attempt may take by default.
pub const DEFAULT_API_TIMEOUT: Duration = Duration::from_secs(20);
/// How long `create` waits for a public address when `host` asks for one, by default.
pub const DEFAULT_ADDRESS_WAIT: Duration = Duration::from_secs(120);
/// The most user data EC2 takes (bytes, before base64).
pub const MAX_USER_DATA: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: PathBuf,
        key: String,
        message: String,
    },
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Tagged on every instance (`slotpool:installation`); `list` and so the leak sweep
    /// see only instances with this tag. One per provider entry of the launcher's config.
    pub installation: String,
    pub region: String,
    /// Another EC2 endpoint (a VPC endpoint, or a test server).
    pub endpoint_url: Option<String>,
    pub api_timeout: Duration,
    pub host: HostAddress,
    pub address_wait: Duration,
    pub agent: AgentSetup,
    /// By backing label.
    pub sizes: BTreeMap<String, Size>,
}

/// Which of an instance's addresses is the backing node's `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostAddress {
    PrivateIp,
    PrivateDns,
    PublicIp,
    PublicDns,
}

/// How the agent is set up on a new instance.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AgentSetup {
    /// Shell commands run (as root, in order) before the agent starts: e.g. installing
    /// the slotpool-agent package when the image does not have it.
    pub install: Vec<String>,
    /// Further `slotpool-agent` arguments for every size.
    pub args: Vec<String>,
}

/// How an instance is bought.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Market {
    OnDemand,
    Spot,
    /// Spot, and on-demand when no spot capacity is to be had.
    SpotThenOnDemand,
}

/// One kind of machine: what a backing label launches.
#[derive(Clone, Debug, PartialEq)]
pub struct Size {
    pub image_id: String,
    pub instance_type: String,
    /// Tried in turn (starting at one picked by the backing id, so that instances spread
    /// over the subnets' zones) when a zone has no capacity. Empty: the default VPC.
    pub subnets: Vec<String>,
    pub security_groups: Vec<String>,
    /// A name, or an ARN.
    pub iam_instance_profile: Option<String>,
    pub key_name: Option<String>,
    pub root_volume: Option<RootVolume>,
    pub tags: BTreeMap<String, String>,
    pub market: Market,
    pub agent_args: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RootVolume {
    /// The image's root device name (`/dev/xvda`, `/dev/sda1`).
    pub device: String,
    pub size_gb: i32,
    #[serde(default = "default_volume_type", rename = "type")]
    pub volume_type: String,
    #[serde(default)]
    pub iops: Option<i32>,
    #[serde(default)]
    pub throughput: Option<i32>,
    #[serde(default = "yes")]
    pub encrypted: bool,
}

fn default_volume_type() -> String {
    "gp3".into()
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct RawConfig {
    installation: String,
    region: String,
    #[serde(default)]
    endpoint_url: Option<String>,
    #[serde(default)]
    api_timeout: Option<u64>,
    #[serde(default)]
    host: Option<HostAddress>,
    #[serde(default)]
    address_wait: Option<u64>,
    #[serde(default)]
    agent: RawAgent,
    sizes: BTreeMap<String, RawSize>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct RawAgent {
    #[serde(default)]
    install: Vec<String>,
    #[serde(default)]
    args: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct RawSize {
    image_id: String,
    instance_type: String,
    #[serde(default)]
    subnets: Vec<String>,
    #[serde(default)]
    security_groups: Vec<String>,
    #[serde(default)]
    iam_instance_profile: Option<String>,
    #[serde(default)]
    key_name: Option<String>,
    #[serde(default)]
    root_volume: Option<RootVolume>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    #[serde(default)]
    market: Option<Market>,
    #[serde(default)]
    agent_args: Vec<String>,
}

/// The prefix of slotpool's own tags; a size's `tags` may not use it.
pub const TAG_PREFIX: &str = "slotpool:";

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
            path: path.to_path_buf(),
            err,
        })?;
        Config::parse(path, &text)
    }

    /// Validates `text`, the content of `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let mut at = None;
        let raw: Result<RawConfig, _> = serde_saphyr::with_deserializer_from_str(text, |de| {
            serde_path_to_error::deserialize(de).map_err(|err| {
                at = Some(err.path().to_string());
                err.into_inner()
            })
        });
        let raw = raw.map_err(|err| {
            let key = at
                .filter(|k| k != ".")
                .unwrap_or_else(|| "(document)".into());
            invalid(&key, parser_message(&err))
        })?;
        if !is_tag_value(&raw.installation) || raw.installation.is_empty() {
            return Err(invalid(
                "installation",
                format!(
                    "expected 1-128 characters of a-z A-Z 0-9 - _ . (a tag value naming this installation), got {:?}",
                    raw.installation
                ),
            ));
        }
        if raw.region.is_empty()
            || !raw
                .region
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(invalid(
                "region",
                format!(
                    "expected an AWS region (e.g. eu-west-1), got {:?}",
                    raw.region
                ),
            ));
        }
        if let Some(url) = &raw.endpoint_url {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                return Err(invalid(
                    "endpoint-url",
                    format!("expected an http:// or https:// URL, got {url:?}"),
                ));
            }
        }
        let seconds = |key: &str, v: Option<u64>, default: Duration| match v {
            None => Ok(default),
            Some(s) if (1..=3600).contains(&s) => Ok(Duration::from_secs(s)),
            Some(s) => Err(invalid(key, format!("expected 1-3600 seconds, got {s}"))),
        };
        let api_timeout = seconds("api-timeout", raw.api_timeout, DEFAULT_API_TIMEOUT)?;
        let address_wait = seconds("address-wait", raw.address_wait, DEFAULT_ADDRESS_WAIT)?;
        check_args("agent.args", &raw.agent.args).map_err(|m| invalid("agent.args", m))?;
        for (i, cmd) in raw.agent.install.iter().enumerate() {
            if cmd.trim().is_empty() {
                return Err(invalid(
                    &format!("agent.install[{i}]"),
                    "expected a shell command, got an empty one".into(),
                ));
            }
        }
        if raw.sizes.is_empty() {
            return Err(invalid(
                "sizes",
                "expected at least one size (a backing label of the launcher's pools)".into(),
            ));
        }
        let mut sizes = BTreeMap::new();
        for (label, s) in raw.sizes {
            let key = |k: &str| format!("sizes.{label}.{k}");
            for (k, v) in [
                ("image-id", &s.image_id),
                ("instance-type", &s.instance_type),
            ] {
                if v.trim().is_empty() {
                    return Err(invalid(
                        &key(k),
                        "expected a value, got an empty one".into(),
                    ));
                }
            }
            for (k, list) in [
                ("subnets", &s.subnets),
                ("security-groups", &s.security_groups),
            ] {
                if let Some(bad) = list.iter().find(|v| v.trim().is_empty()) {
                    return Err(invalid(&key(k), format!("expected ids, got {bad:?}")));
                }
            }
            for (k, v) in &s.tags {
                if k.starts_with(TAG_PREFIX) {
                    return Err(invalid(
                        &key("tags"),
                        format!("{k:?}: tags starting with {TAG_PREFIX:?} are slotpool's own"),
                    ));
                }
                if k.is_empty() || k.len() > 128 || v.len() > 256 {
                    return Err(invalid(
                        &key("tags"),
                        format!("{k:?}: keys are 1-128 characters, values at most 256"),
                    ));
                }
            }
            if let Some(v) = &s.root_volume {
                if !(1..=65536).contains(&v.size_gb) {
                    return Err(invalid(
                        &key("root-volume.size-gb"),
                        format!("expected 1-65536, got {}", v.size_gb),
                    ));
                }
                if !v.device.starts_with("/dev/") {
                    return Err(invalid(
                        &key("root-volume.device"),
                        format!(
                            "expected the image's root device (e.g. /dev/xvda), got {:?}",
                            v.device
                        ),
                    ));
                }
            }
            check_args(&key("agent-args"), &s.agent_args)
                .map_err(|m| invalid(&key("agent-args"), m))?;
            sizes.insert(
                label,
                Size {
                    image_id: s.image_id,
                    instance_type: s.instance_type,
                    subnets: s.subnets,
                    security_groups: s.security_groups,
                    iam_instance_profile: s.iam_instance_profile,
                    key_name: s.key_name,
                    root_volume: s.root_volume,
                    tags: s.tags,
                    market: s.market.unwrap_or(Market::OnDemand),
                    agent_args: s.agent_args,
                },
            );
        }
        Ok(Config {
            installation: raw.installation,
            region: raw.region,
            endpoint_url: raw.endpoint_url,
            api_timeout,
            host: raw.host.unwrap_or(HostAddress::PrivateIp),
            address_wait,
            agent: AgentSetup {
                install: raw.agent.install,
                args: raw.agent.args,
            },
            sizes,
        })
    }
}

/// The parser's message on one line, its place at the end: `unknown field `x` (line 3,
/// column 5)`.
fn parser_message(err: &serde_saphyr::Error) -> String {
    let first = err.to_string();
    let line = first.lines().next().unwrap_or_default().trim();
    let line = line.strip_prefix("error: ").unwrap_or(line);
    let message = line
        .strip_prefix("line ")
        .and_then(|rest| rest.split_once(": "))
        .map_or(line, |(_, m)| m);
    match err.location() {
        Some(l) => format!("{message} (line {}, column {})", l.line(), l.column()),
        None => message.to_string(),
    }
}

/// Tag values slotpool writes itself (installation, backing id): a conservative set.
fn is_tag_value(s: &str) -> bool {
    s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Agent arguments end up in a systemd environment file, split on blanks: one word each.
fn check_args(_key: &str, args: &[String]) -> Result<(), String> {
    match args.iter().find(|a| {
        a.is_empty()
            || a.chars()
                .any(|c| c.is_whitespace() || c.is_control() || "\"'\\$`".contains(c))
    }) {
        None => Ok(()),
        Some(bad) => Err(format!(
            "expected one word per argument (no blanks, quotes, backslashes or $), got {bad:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(Path::new("ec2.yaml"), text).map_err(|e| e.to_string())
    }

    const MINIMAL: &str = "installation: ci\nregion: eu-west-1\nsizes:\n  vm: {image-id: ami-1, instance-type: t3.micro}\n";

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.api_timeout, DEFAULT_API_TIMEOUT);
        assert_eq!(c.host, HostAddress::PrivateIp);
        let vm = &c.sizes["vm"];
        assert_eq!(vm.market, Market::OnDemand);
        assert!(vm.subnets.is_empty() && vm.root_volume.is_none());
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/etc/ec2.yaml");
        let c = Config::load(&path).unwrap();
        assert!(!c.sizes.is_empty());
    }

    #[test]
    fn refusals_name_the_key_and_what_it_takes() {
        let cases = [
            (
                MINIMAL.replace("region: eu-west-1", "region: Europe"),
                "ec2.yaml: region: expected an AWS region (e.g. eu-west-1), got \"Europe\"",
            ),
            (
                MINIMAL.replace("installation: ci", "installation: \"a b\""),
                "ec2.yaml: installation: expected 1-128 characters",
            ),
            (
                format!("{MINIMAL}    market: sometimes\n").replace(
                    "  vm: {image-id: ami-1, instance-type: t3.micro}\n",
                    "  vm:\n    image-id: ami-1\n    instance-type: t3.micro\n",
                ),
                "ec2.yaml: sizes.vm.market: unknown variant `sometimes`",
            ),
            (
                MINIMAL.replace("t3.micro}", "t3.micro, tags: {\"slotpool:x\": y}}"),
                "ec2.yaml: sizes.vm.tags: \"slotpool:x\": tags starting with",
            ),
            (
                MINIMAL.replace("t3.micro}", "t3.micro, agent-args: [\"--slots 4\"]}"),
                "ec2.yaml: sizes.vm.agent-args: expected one word per argument",
            ),
            (
                MINIMAL.replace("t3.micro}", "t3.micro, colour: red}"),
                "ec2.yaml: sizes.vm.colour: unknown field `colour`",
            ),
            (
                MINIMAL.replace("region: eu-west-1\n", "region: eu-west-1\napi-timeout: 0\n"),
                "ec2.yaml: api-timeout: expected 1-3600 seconds, got 0",
            ),
            (
                "installation: ci\nregion: eu-west-1\nsizes: {}\n".to_string(),
                "ec2.yaml: sizes: expected at least one size",
            ),
        ];
        for (text, want) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.starts_with(want), "{text}\n=> {err}\nwanted {want}");
        }
    }
}
