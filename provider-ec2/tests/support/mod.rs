//! What the EC2 provider's tests share: a moto server per test, the provider's
//! configuration pointed at it (or at a proxy in front of it), the provider binary run
//! as the launcher runs it, and an SDK client that reads moto's state directly.

#![allow(dead_code)]

use aws_sdk_ec2::types::Instance;
use slotpool_protocol::provider::CreateRequest;
use slotpool_tests::Moto;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub const PROVIDER: &str = env!("CARGO_BIN_EXE_slotpool-provider-ec2");
pub const REGION: &str = "us-east-1";

/// A moto server, what it offers (an image, the default VPC's subnets) and a client
/// reading it directly (past any proxy).
pub struct Cloud {
    pub moto: Moto,
    pub ec2: aws_sdk_ec2::Client,
    pub image: String,
    pub subnets: Vec<String>,
}

impl Cloud {
    pub async fn start() -> Cloud {
        let moto = Moto::start().await;
        let ec2 = client(&moto.url());
        let images = ec2.describe_images().send().await.expect("DescribeImages");
        let image = images.images()[0].image_id().unwrap().to_string();
        let subnets = ec2
            .describe_subnets()
            .send()
            .await
            .expect("DescribeSubnets");
        let mut subnets: Vec<String> = subnets
            .subnets()
            .iter()
            .map(|s| s.subnet_id().unwrap().to_string())
            .collect();
        subnets.sort();
        Cloud {
            moto,
            ec2,
            image,
            subnets,
        }
    }

    /// Every instance moto has, in every state.
    pub async fn instances(&self) -> Vec<Instance> {
        let mut out = Vec::new();
        let mut next = None;
        loop {
            let page = self
                .ec2
                .describe_instances()
                .set_next_token(next)
                .send()
                .await
                .expect("DescribeInstances");
            out.extend(
                page.reservations()
                    .iter()
                    .flat_map(|r| r.instances().to_vec()),
            );
            match page.next_token() {
                Some(t) if !t.is_empty() => next = Some(t.to_string()),
                _ => return out,
            }
        }
    }

    /// Instances that are not shutting down or terminated.
    pub async fn live(&self) -> Vec<Instance> {
        self.instances()
            .await
            .into_iter()
            .filter(|i| {
                !matches!(
                    i.state().and_then(|s| s.name()).map(|n| n.as_str()),
                    Some("terminated" | "shutting-down")
                )
            })
            .collect()
    }

    /// The user data instance `id` boots with, decoded.
    pub async fn user_data(&self, id: &str) -> String {
        use base64::Engine;
        let out = self
            .ec2
            .describe_instance_attribute()
            .instance_id(id)
            .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
            .send()
            .await
            .expect("DescribeInstanceAttribute");
        let b64 = out.user_data().and_then(|u| u.value()).unwrap_or_default();
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap(),
        )
        .unwrap()
    }
}

/// An SDK client of the server at `url`, with moto's test keys.
pub fn client(url: &str) -> aws_sdk_ec2::Client {
    use aws_smithy_http_client::tls;
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let config = aws_sdk_ec2::Config::builder()
        .behavior_version(aws_sdk_ec2::config::BehaviorVersion::latest())
        .region(aws_sdk_ec2::config::Region::new(REGION))
        .endpoint_url(url)
        .credentials_provider(aws_sdk_ec2::config::Credentials::new(
            "testing", "testing", None, None, "tests",
        ))
        .http_client(http)
        .build();
    aws_sdk_ec2::Client::from_conf(config)
}

/// The value of tag `key` of `i`.
pub fn tag(i: &Instance, key: &str) -> Option<String> {
    i.tags()
        .iter()
        .find(|t| t.key() == Some(key))
        .and_then(|t| t.value().map(str::to_string))
}

/// A provider configuration file in `dir` for `endpoint`: one size `vm` with `size_extra`
/// (YAML keys of the size, indented by 4) and `top_extra` (top-level keys).
pub fn write_config(
    dir: &Path,
    name: &str,
    endpoint: &str,
    installation: &str,
    image: &str,
    size_extra: &str,
    top_extra: &str,
) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "installation: {installation}\nregion: {REGION}\nendpoint-url: {endpoint}\napi-timeout: 10\n{top_extra}sizes:\n  vm:\n    image-id: {image}\n    instance-type: t3.micro\n{size_extra}"
        ),
    )
    .unwrap();
    path
}

/// Runs the provider binary as the launcher's exec driver does: `op` with `input` on stdin.
pub fn run(config: &Path, op: &str, input: &str) -> Output {
    use std::io::Write;
    let mut cmd = Command::new(PROVIDER);
    cmd.arg("--config")
        .arg(config)
        .arg(op)
        .envs(Moto::aws_env())
        .env("SLOTPOOL_LOG", "info")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("starting the provider");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// [`run`] on a blocking thread.
pub async fn run_async(config: &Path, op: &'static str, input: String) -> Output {
    let config = config.to_path_buf();
    tokio::task::spawn_blocking(move || run(&config, op, &input))
        .await
        .unwrap()
}

/// What a failed run printed, for assertion messages.
pub fn shown(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A create request for `backing_id` with `secret`.
pub fn create_request(
    backing_id: &str,
    secret: &str,
    nats_url: &str,
    creds: Option<&str>,
) -> String {
    serde_json::to_string(&CreateRequest {
        v: CreateRequest::VERSION,
        backing_id: backing_id.into(),
        secret: secret.into(),
        provider: "aws".into(),
        pool: "main".into(),
        backing_label: "vm".into(),
        slots: 2,
        nats_url: nats_url.into(),
        nats_credentials: creds.map(str::to_string),
    })
    .unwrap()
}
