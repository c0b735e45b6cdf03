//! The EC2 calls the provider makes, behind [`Ec2`] so that the operations
//! ([`crate::ops`]) are tested against a scripted fake; [`SdkEc2`] makes them with the
//! AWS SDK for Rust. The SDK's own retries are off: a `RunInstances` sent again after a
//! lost answer must first look for the instance the lost one made ([`crate::ops`]
//! decides when to ask again, for every call).

use crate::config::{Config, RootVolume};
use crate::decide::{CallError, LaunchToken};
use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::types::{
    BlockDeviceMapping, EbsBlockDevice, Filter, HttpTokensState, IamInstanceProfileSpecification,
    Instance, InstanceInterruptionBehavior, InstanceMarketOptionsRequest,
    InstanceMetadataEndpointState, InstanceMetadataOptionsRequest, InstanceStateName, InstanceType,
    MarketType, ResourceType, SpotInstanceType, SpotMarketOptions, Tag, TagSpecification,
    VolumeType,
};
use std::collections::BTreeMap;

pub const TAG_INSTALLATION: &str = "slotpool:installation";
pub const TAG_BACKING_ID: &str = "slotpool:backing-id";
pub const TAG_LAUNCH: &str = "slotpool:launch";
pub const TAG_PROVIDER: &str = "slotpool:provider";
pub const TAG_POOL: &str = "slotpool:pool";
pub const TAG_BACKING_LABEL: &str = "slotpool:backing-label";

/// An instance as the provider sees it.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Machine {
    pub id: String,
    pub state: MachineState,
    pub private_ip: Option<String>,
    pub private_dns: Option<String>,
    pub public_ip: Option<String>,
    pub public_dns: Option<String>,
    pub subnet: Option<String>,
    pub zone: Option<String>,
    pub instance_type: String,
    pub spot: bool,
    pub tags: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MachineState {
    #[default]
    Pending,
    Running,
    Stopping,
    Stopped,
    ShuttingDown,
    Terminated,
}

impl MachineState {
    /// Gone, or going: never handed out, never listed.
    pub fn ending(self) -> bool {
        matches!(self, MachineState::ShuttingDown | MachineState::Terminated)
    }

    pub fn name(self) -> &'static str {
        match self {
            MachineState::Pending => "pending",
            MachineState::Running => "running",
            MachineState::Stopping => "stopping",
            MachineState::Stopped => "stopped",
            MachineState::ShuttingDown => "shutting-down",
            MachineState::Terminated => "terminated",
        }
    }
}

/// One `RunInstances` request: one instance.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRequest {
    pub client_token: String,
    pub image_id: String,
    pub instance_type: String,
    pub subnet: Option<String>,
    pub security_groups: Vec<String>,
    pub iam_instance_profile: Option<String>,
    pub key_name: Option<String>,
    pub root_volume: Option<RootVolume>,
    pub spot: bool,
    /// On the instance and its volumes, from the start (`TagSpecifications`).
    pub tags: BTreeMap<String, String>,
    /// Base64, as EC2 takes it.
    pub user_data: String,
}

/// The EC2 calls of the provider.
#[async_trait::async_trait]
pub trait Ec2: Send + Sync {
    /// Every instance of this installation tagged with `launch`, whatever its state.
    async fn find_launch(&self, launch: &LaunchToken) -> Result<Vec<Machine>, CallError>;
    async fn run(&self, req: &RunRequest) -> Result<Machine, CallError>;
    /// The instance `id`, or `None` when EC2 does not know it.
    async fn describe(&self, id: &str) -> Result<Option<Machine>, CallError>;
    async fn terminate(&self, id: &str) -> Result<(), CallError>;
    /// Every instance of this installation that is not shutting down or terminated.
    async fn list(&self) -> Result<Vec<Machine>, CallError>;
    /// The instance's console output (decoded), when EC2 has any.
    async fn console_output(&self, id: &str) -> Result<Option<String>, CallError>;
}

/// [`Ec2`] through the AWS SDK for Rust.
pub struct SdkEc2 {
    client: aws_sdk_ec2::Client,
    installation: String,
}

impl SdkEc2 {
    /// A client for `config`'s region (and endpoint), with credentials from the SDK's
    /// default chain (environment, profile, web identity, container or instance role),
    /// HTTPS through rustls on ring, no retries of its own, and `api-timeout` per call.
    pub async fn new(config: &Config) -> SdkEc2 {
        use aws_config::retry::RetryConfig;
        use aws_config::timeout::TimeoutConfig;
        use aws_smithy_http_client::tls;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http)
            .region(aws_config::Region::new(config.region.clone()))
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(std::time::Duration::from_secs(5))
                    .operation_attempt_timeout(config.api_timeout)
                    .build(),
            );
        if let Some(url) = &config.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        let sdk = loader.load().await;
        SdkEc2 {
            client: aws_sdk_ec2::Client::new(&sdk),
            installation: config.installation.clone(),
        }
    }

    fn installation_filter(&self) -> Filter {
        Filter::builder()
            .name(format!("tag:{TAG_INSTALLATION}"))
            .values(&self.installation)
            .build()
    }

    async fn describe_all(&self, filters: Vec<Filter>) -> Result<Vec<Machine>, CallError> {
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let page = self
                .client
                .describe_instances()
                .set_filters(Some(filters.clone()))
                .set_next_token(next.take())
                .send()
                .await
                .map_err(call_error)?;
            for r in page.reservations() {
                out.extend(r.instances().iter().map(machine));
            }
            match page.next_token() {
                Some(t) if !t.is_empty() => next = Some(t.to_string()),
                _ => return Ok(out),
            }
        }
    }
}

#[async_trait::async_trait]
impl Ec2 for SdkEc2 {
    async fn find_launch(&self, launch: &LaunchToken) -> Result<Vec<Machine>, CallError> {
        self.describe_all(vec![
            self.installation_filter(),
            Filter::builder()
                .name(format!("tag:{TAG_LAUNCH}"))
                .values(launch.as_str())
                .build(),
        ])
        .await
    }

    async fn run(&self, req: &RunRequest) -> Result<Machine, CallError> {
        let tags: Vec<Tag> = req
            .tags
            .iter()
            .map(|(k, v)| Tag::builder().key(k).value(v).build())
            .collect();
        let spec = |kind: ResourceType| {
            TagSpecification::builder()
                .resource_type(kind)
                .set_tags(Some(tags.clone()))
                .build()
        };
        let mut call = self
            .client
            .run_instances()
            .client_token(&req.client_token)
            .image_id(&req.image_id)
            .instance_type(InstanceType::from(req.instance_type.as_str()))
            .min_count(1)
            .max_count(1)
            .set_subnet_id(req.subnet.clone())
            .set_key_name(req.key_name.clone())
            .user_data(&req.user_data)
            .tag_specifications(spec(ResourceType::Instance))
            .tag_specifications(spec(ResourceType::Volume))
            // IMDSv2 only, one hop: a container on the host cannot reach it.
            .metadata_options(
                InstanceMetadataOptionsRequest::builder()
                    .http_endpoint(InstanceMetadataEndpointState::Enabled)
                    .http_tokens(HttpTokensState::Required)
                    .http_put_response_hop_limit(1)
                    .build(),
            );
        if !req.security_groups.is_empty() {
            call = call.set_security_group_ids(Some(req.security_groups.clone()));
        }
        if let Some(profile) = &req.iam_instance_profile {
            let spec = if profile.starts_with("arn:") {
                IamInstanceProfileSpecification::builder().arn(profile)
            } else {
                IamInstanceProfileSpecification::builder().name(profile)
            };
            call = call.iam_instance_profile(spec.build());
        }
        if let Some(v) = &req.root_volume {
            call = call.block_device_mappings(
                BlockDeviceMapping::builder()
                    .device_name(&v.device)
                    .ebs(
                        EbsBlockDevice::builder()
                            .volume_size(v.size_gb)
                            .volume_type(VolumeType::from(v.volume_type.as_str()))
                            .set_iops(v.iops)
                            .set_throughput(v.throughput)
                            .encrypted(v.encrypted)
                            .delete_on_termination(true)
                            .build(),
                    )
                    .build(),
            );
        }
        if req.spot {
            call = call.instance_market_options(
                InstanceMarketOptionsRequest::builder()
                    .market_type(MarketType::Spot)
                    .spot_options(
                        SpotMarketOptions::builder()
                            .spot_instance_type(SpotInstanceType::OneTime)
                            .instance_interruption_behavior(InstanceInterruptionBehavior::Terminate)
                            .build(),
                    )
                    .build(),
            );
        }
        let out = call.send().await.map_err(call_error)?;
        out.instances()
            .first()
            .map(machine)
            .ok_or_else(|| CallError::NoAnswer("RunInstances answered without an instance".into()))
    }

    async fn describe(&self, id: &str) -> Result<Option<Machine>, CallError> {
        match self
            .client
            .describe_instances()
            .instance_ids(id)
            .send()
            .await
            .map_err(call_error)
        {
            Ok(out) => Ok(out
                .reservations()
                .iter()
                .flat_map(|r| r.instances())
                .map(machine)
                .next()),
            Err(CallError::Service { code, .. }) if code == "InvalidInstanceID.NotFound" => {
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    async fn terminate(&self, id: &str) -> Result<(), CallError> {
        self.client
            .terminate_instances()
            .instance_ids(id)
            .send()
            .await
            .map_err(call_error)?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Machine>, CallError> {
        self.describe_all(vec![
            self.installation_filter(),
            Filter::builder()
                .name("instance-state-name")
                .values("pending")
                .values("running")
                .values("stopping")
                .values("stopped")
                .build(),
        ])
        .await
    }

    async fn console_output(&self, id: &str) -> Result<Option<String>, CallError> {
        use base64::Engine;
        let out = self
            .client
            .get_console_output()
            .instance_id(id)
            .latest(true)
            .send()
            .await
            .map_err(call_error)?;
        Ok(out.output().map(|b64| {
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                // Some EC2 look-alikes answer in plain text.
                .unwrap_or_else(|_| b64.to_string())
        }))
    }
}

/// An SDK error in the terms of [`crate::decide`].
fn call_error<E, R>(err: SdkError<E, R>) -> CallError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match &err {
        SdkError::ServiceError(e) => CallError::Service {
            code: e.err().code().unwrap_or("Unknown").to_string(),
            message: e.err().message().unwrap_or_default().to_string(),
        },
        SdkError::ConstructionFailure(_) => CallError::NotSent(error_chain(&err)),
        SdkError::DispatchFailure(d) if d.is_user() => CallError::NotSent(error_chain(&err)),
        _ => CallError::NoAnswer(error_chain(&err)),
    }
}

/// An error and its sources, one line (the SDK's top-level messages say little).
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn machine(i: &Instance) -> Machine {
    let state = match i.state().and_then(|s| s.name()) {
        Some(InstanceStateName::Running) => MachineState::Running,
        Some(InstanceStateName::Stopping) => MachineState::Stopping,
        Some(InstanceStateName::Stopped) => MachineState::Stopped,
        Some(InstanceStateName::ShuttingDown) => MachineState::ShuttingDown,
        Some(InstanceStateName::Terminated) => MachineState::Terminated,
        _ => MachineState::Pending,
    };
    let some = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_string);
    Machine {
        id: i.instance_id().unwrap_or_default().to_string(),
        state,
        private_ip: some(i.private_ip_address()),
        private_dns: some(i.private_dns_name()),
        public_ip: some(i.public_ip_address()),
        public_dns: some(i.public_dns_name()),
        subnet: some(i.subnet_id()),
        zone: some(i.placement().and_then(|p| p.availability_zone())),
        instance_type: i
            .instance_type()
            .map(|t| t.as_str().to_string())
            .unwrap_or_default(),
        spot: i.instance_lifecycle().map(|l| l.as_str()) == Some("spot"),
        tags: i
            .tags()
            .iter()
            .filter_map(|t| {
                Some((
                    t.key()?.to_string(),
                    t.value().unwrap_or_default().to_string(),
                ))
            })
            .collect(),
    }
}
