//! The operations of the exec contract on EC2, over any [`Ec2`]: create, delete, list and
//! console.
//!
//! **create is exactly once.** Each launch attempt has its own [`LaunchToken`] (backing
//! id and secret: a relaunch gets a new secret, so a new token). Before every
//! `RunInstances` the create looks for an instance of this installation tagged with the
//! token, and sends `RunInstances` again only when there is none; each placement sends
//! its own `ClientToken`, so EC2 itself also answers a repeated request with the instance
//! it made (the lookup covers what the token does not: EC2's describe calls lag behind a
//! create by seconds, the token's idempotency does not span placements, and EC2
//! look-alikes ignore it). Every instance carries its tags from the start
//! (`TagSpecifications`), so `list` and the launcher's leak sweep find it even when no
//! create ever reported it.
//!
//! **Capacity.** A zone without capacity moves on to the next placement; spot refused for
//! the region moves on to on-demand (`spot-then-on-demand`); when no placement is left,
//! or the account's quota is reached, create exits with the contract's capacity code.
//! Throttling and EC2's own errors are asked again after a back-off, up to
//! [`decide::MAX_AGAIN`] times, then count as capacity too (ask again later).

use crate::config::{Config, HostAddress};
use crate::decide::{self, CallError, LaunchToken, Verdict};
use crate::ec2::{self, Ec2, Machine, MachineState, RunRequest};
use crate::user_data::{self, AgentBoot};
use base64::Engine;
use slotpool_protocol::provider::{
    ConsoleOutput, ConsoleRequest, CreateRequest, Created, DeleteRequest, ListedMachine,
};
use std::time::Duration;

/// How a contract operation failed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Failure {
    /// Out of quota or capacity (the contract's capacity exit, 75).
    #[error("out of capacity: {0}")]
    Capacity(String),
    #[error("{0}")]
    Failed(String),
}

/// How often `create` looks for the public address `host` asks for.
const ADDRESS_POLL: Duration = Duration::from_secs(2);

/// Sleeps the back-off before the `again`-th repeat of a call.
async fn pause(again: u32) {
    tokio::time::sleep(decide::backoff(again, rand::random::<f64>())).await;
}

/// Runs `call` until it succeeds, fails for good, or was asked [`decide::MAX_AGAIN`]
/// times; `what` names it in errors.
async fn with_retries<T, F, Fut>(what: &str, mut call: F) -> Result<T, Failure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CallError>>,
{
    let mut again = 0;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(err) if decide::worth_again(&err) && again < decide::MAX_AGAIN => {
                again += 1;
                tracing::info!(%err, again, "{what}: asking again");
                pause(again).await;
            }
            Err(err) if decide::worth_again(&err) => {
                return Err(Failure::Capacity(format!(
                    "{what}: EC2 did not answer after {} tries: {err}",
                    again + 1
                )))
            }
            Err(err) => return Err(Failure::Failed(format!("{what}: {err}"))),
        }
    }
}

/// Creates the instance `req` asks for, or finds the one an earlier try of the same
/// launch attempt made.
pub async fn create(
    api: &dyn Ec2,
    config: &Config,
    req: &CreateRequest,
) -> Result<Created, Failure> {
    let size = config.sizes.get(&req.backing_label).ok_or_else(|| {
        Failure::Failed(format!(
            "no size for backing label {:?} in the provider's configuration (it has {})",
            req.backing_label,
            config.sizes.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    if req.backing_id.is_empty() || req.secret.is_empty() {
        return Err(Failure::Failed(
            "backing_id and secret must not be empty".into(),
        ));
    }
    let launch = LaunchToken::new(&req.backing_id, &req.secret);
    let args = decide::agent_args(req.slots, &config.agent.args, size);
    let text = user_data::render(
        &AgentBoot {
            backing_id: &req.backing_id,
            secret: &req.secret,
            nats_url: &req.nats_url,
            nats_credentials: req.nats_credentials.as_deref(),
            args,
            install: &config.agent.install,
        },
        crate::config::MAX_USER_DATA,
    )
    .map_err(|e| Failure::Failed(e.to_string()))?;
    let user_data = base64::engine::general_purpose::STANDARD.encode(text);
    let mut tags = size.tags.clone();
    tags.entry("Name".into())
        .or_insert_with(|| format!("slotpool {}", req.backing_id));
    for (k, v) in [
        (ec2::TAG_INSTALLATION, config.installation.as_str()),
        (ec2::TAG_BACKING_ID, req.backing_id.as_str()),
        (ec2::TAG_LAUNCH, launch.as_str()),
        (ec2::TAG_PROVIDER, req.provider.as_str()),
        (ec2::TAG_POOL, req.pool.as_str()),
        (ec2::TAG_BACKING_LABEL, req.backing_label.as_str()),
    ] {
        tags.insert(k.to_string(), v.to_string());
    }

    let placements = decide::placements(size, &req.backing_id);
    let mut refused: Vec<String> = Vec::new();
    let mut skip_spot = false;
    for (n, placement) in placements.iter().enumerate() {
        if placement.spot && skip_spot {
            continue;
        }
        let run = RunRequest {
            client_token: launch.client_token(n),
            image_id: size.image_id.clone(),
            instance_type: size.instance_type.clone(),
            subnet: placement.subnet.clone(),
            security_groups: size.security_groups.clone(),
            iam_instance_profile: size.iam_instance_profile.clone(),
            key_name: size.key_name.clone(),
            root_volume: size.root_volume.clone(),
            spot: placement.spot,
            tags: tags.clone(),
            user_data: user_data.clone(),
        };
        let mut again = 0;
        loop {
            // An earlier try of this launch attempt (an answer lost) may have made it.
            let found = with_retries("looking up the launch", || api.find_launch(&launch)).await?;
            if let Some(m) = found.iter().find(|m| !m.state.ending()) {
                tracing::info!(instance = %m.id, "the launch made its instance already");
                return created(api, config, m.clone()).await;
            }
            if let Some(m) = found.first() {
                return Err(Failure::Failed(format!(
                    "instance {} of this launch is {} already{}",
                    m.id,
                    m.state.name(),
                    console_tail(api, &m.id).await
                )));
            }
            let where_ = describe_placement(placement);
            match api.run(&run).await {
                Ok(m) => {
                    tracing::info!(instance = %m.id, placement = %where_, "launched");
                    return created(api, config, m).await;
                }
                Err(err) => match decide::judge_run(&err, placement.spot) {
                    Verdict::Again if again < decide::MAX_AGAIN => {
                        again += 1;
                        tracing::info!(%err, again, placement = %where_, "RunInstances: asking again");
                        pause(again).await;
                    }
                    Verdict::Again => {
                        return Err(Failure::Capacity(format!(
                            "RunInstances {where_}: EC2 did not answer after {} tries: {err}",
                            again + 1
                        )))
                    }
                    Verdict::NextPlacement => {
                        tracing::info!(%err, placement = %where_, "no capacity there; trying the next placement");
                        refused.push(format!("{where_}: {err}"));
                        break;
                    }
                    Verdict::NoSpot => {
                        tracing::info!(%err, "no spot capacity; skipping to on-demand, if configured");
                        refused.push(format!("{where_}: {err}"));
                        skip_spot = true;
                        break;
                    }
                    Verdict::OutOfCapacity => {
                        refused.push(format!("{where_}: {err}"));
                        return Err(Failure::Capacity(refused.join("; ")));
                    }
                    Verdict::Fatal => {
                        return Err(Failure::Failed(format!("RunInstances {where_}: {err}")))
                    }
                },
            }
        }
    }
    Err(Failure::Capacity(refused.join("; ")))
}

fn describe_placement(p: &decide::Placement) -> String {
    format!(
        "{} in {}",
        if p.spot { "spot" } else { "on-demand" },
        p.subnet.as_deref().unwrap_or("the default subnet")
    )
}

/// The contract's answer for `m`, once its `host` address is known.
async fn created(api: &dyn Ec2, config: &Config, mut m: Machine) -> Result<Created, Failure> {
    let deadline = tokio::time::Instant::now() + config.address_wait;
    let host = loop {
        if let Some(host) = address(&m, config.host) {
            break host;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Failure::Failed(format!(
                "instance {} has no {:?} address after {:?} (it stays for the leak sweep, or the launcher's next try)",
                m.id, config.host, config.address_wait
            )));
        }
        tokio::time::sleep(ADDRESS_POLL).await;
        if let Some(again) = with_retries("describing the instance", || api.describe(&m.id)).await?
        {
            m = again;
        }
    };
    let mut attributes = slotpool_protocol::model::Attributes::new();
    attributes.insert("instance-type".into(), m.instance_type.clone().into());
    attributes.insert("market".into(), market(&m).into());
    if let Some(zone) = &m.zone {
        attributes.insert("availability-zone".into(), zone.clone().into());
    }
    Ok(Created {
        id: m.id.clone(),
        host,
        data: machine_data(&m),
        attributes,
    })
}

fn market(m: &Machine) -> &'static str {
    if m.spot {
        "spot"
    } else {
        "on-demand"
    }
}

fn machine_data(m: &Machine) -> serde_json::Value {
    serde_json::json!({
        "zone": m.zone,
        "subnet": m.subnet,
        "instance_type": m.instance_type,
        "market": market(m),
    })
}

fn address(m: &Machine, which: HostAddress) -> Option<String> {
    match which {
        HostAddress::PrivateIp => m.private_ip.clone(),
        HostAddress::PrivateDns => m.private_dns.clone(),
        HostAddress::PublicIp => m.public_ip.clone(),
        HostAddress::PublicDns => m.public_dns.clone(),
    }
}

/// The last lines of the instance's console, for an error message (empty when there
/// is none).
async fn console_tail(api: &dyn Ec2, id: &str) -> String {
    match api.console_output(id).await {
        Ok(Some(text)) if !text.trim().is_empty() => {
            let lines: Vec<&str> = text.lines().collect();
            format!(
                "; its console ends:\n{}",
                lines[lines.len().saturating_sub(CONSOLE_LINES)..].join("\n")
            )
        }
        _ => String::new(),
    }
}

/// Lines of console output quoted.
pub const CONSOLE_LINES: usize = 20;

/// Terminates the instance `req` names; an instance EC2 no longer knows, or that is
/// terminated already, is deleted. An instance without this installation's tag is never
/// terminated: a record that names another's instance is an error, not an order.
pub async fn delete(api: &dyn Ec2, config: &Config, req: &DeleteRequest) -> Result<(), Failure> {
    if !req.id.starts_with("i-") {
        return Err(Failure::Failed(format!(
            "{:?} is not an EC2 instance id",
            req.id
        )));
    }
    let Some(m) = with_retries("describing the instance", || api.describe(&req.id)).await? else {
        tracing::info!(instance = %req.id, "already gone");
        return Ok(());
    };
    let tagged = m.tags.get(ec2::TAG_INSTALLATION);
    if tagged != Some(&config.installation) {
        return Err(Failure::Failed(format!(
            "instance {} is not one of installation {:?} (its {} tag is {:?}): not terminating it",
            m.id,
            config.installation,
            ec2::TAG_INSTALLATION,
            tagged
        )));
    }
    if m.state == MachineState::Terminated {
        return Ok(());
    }
    match with_retries("TerminateInstances", || api.terminate(&req.id)).await {
        Err(Failure::Failed(msg)) if msg.contains("InvalidInstanceID.NotFound") => Ok(()),
        other => other,
    }
}

/// The console output of the instance `req` names (`GetConsoleOutput`, its latest):
/// empty when EC2 has none yet or no longer knows the instance. Like delete, it reads
/// only this installation's instances.
pub async fn console(
    api: &dyn Ec2,
    config: &Config,
    req: &ConsoleRequest,
) -> Result<ConsoleOutput, Failure> {
    if !req.id.starts_with("i-") {
        return Err(Failure::Failed(format!(
            "{:?} is not an EC2 instance id",
            req.id
        )));
    }
    let Some(m) = with_retries("describing the instance", || api.describe(&req.id)).await? else {
        return Ok(ConsoleOutput {
            output: String::new(),
        });
    };
    let tagged = m.tags.get(ec2::TAG_INSTALLATION);
    if tagged != Some(&config.installation) {
        return Err(Failure::Failed(format!(
            "instance {} is not one of installation {:?} (its {} tag is {:?}): not reading its console",
            m.id,
            config.installation,
            ec2::TAG_INSTALLATION,
            tagged
        )));
    }
    let output = with_retries("GetConsoleOutput", || api.console_output(&req.id)).await?;
    Ok(ConsoleOutput {
        output: output.unwrap_or_default(),
    })
}

/// Every instance of this installation that is not shutting down or terminated.
pub async fn list(api: &dyn Ec2) -> Result<Vec<ListedMachine>, Failure> {
    let machines = with_retries("DescribeInstances", || api.list()).await?;
    Ok(machines
        .into_iter()
        .filter(|m| !m.state.ending())
        .map(|m| ListedMachine {
            host: m
                .private_ip
                .clone()
                .or_else(|| m.private_dns.clone())
                .unwrap_or_default(),
            data: machine_data(&m),
            backing_id: m.tags.get(ec2::TAG_BACKING_ID).cloned(),
            id: m.id,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AgentSetup, Market, Size};
    use std::collections::{BTreeMap, VecDeque};
    use std::sync::Mutex;

    /// A scripted EC2: answers `run` from a queue of outcomes (an outcome `Lost` applies
    /// the request and loses the answer), keeps the instances it made.
    #[derive(Default)]
    struct Fake {
        script: Mutex<VecDeque<Outcome>>,
        machines: Mutex<Vec<Machine>>,
        runs: Mutex<Vec<RunRequest>>,
        lookups: Mutex<u32>,
    }

    #[derive(Clone, Copy)]
    enum Outcome {
        Ok,
        Lost,
        Code(&'static str),
    }

    impl Fake {
        fn scripted(outcomes: &[Outcome]) -> Fake {
            Fake {
                script: Mutex::new(outcomes.iter().cloned().collect()),
                ..Fake::default()
            }
        }
        fn make(&self, req: &RunRequest) -> Machine {
            let mut ms = self.machines.lock().unwrap();
            let m = Machine {
                id: format!("i-{:04}", ms.len()),
                private_ip: Some(format!("10.0.0.{}", ms.len() + 1)),
                subnet: req.subnet.clone(),
                zone: Some("eu-west-1a".into()),
                instance_type: req.instance_type.clone(),
                spot: req.spot,
                tags: req.tags.clone(),
                ..Machine::default()
            };
            ms.push(m.clone());
            m
        }
    }

    fn service(code: &str) -> CallError {
        CallError::Service {
            code: code.into(),
            message: "(scripted)".into(),
        }
    }

    #[async_trait::async_trait]
    impl Ec2 for Fake {
        async fn find_launch(&self, launch: &LaunchToken) -> Result<Vec<Machine>, CallError> {
            *self.lookups.lock().unwrap() += 1;
            Ok(self
                .machines
                .lock()
                .unwrap()
                .iter()
                .filter(|m| {
                    m.tags.get(ec2::TAG_LAUNCH).map(String::as_str) == Some(launch.as_str())
                })
                .cloned()
                .collect())
        }
        async fn run(&self, req: &RunRequest) -> Result<Machine, CallError> {
            self.runs.lock().unwrap().push(req.clone());
            let next = self
                .script
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Outcome::Ok);
            match next {
                Outcome::Ok => Ok(self.make(req)),
                Outcome::Lost => {
                    self.make(req);
                    Err(CallError::NoAnswer("connection reset".into()))
                }
                Outcome::Code(code) => Err(service(code)),
            }
        }
        async fn describe(&self, id: &str) -> Result<Option<Machine>, CallError> {
            Ok(self
                .machines
                .lock()
                .unwrap()
                .iter()
                .find(|m| m.id == id)
                .cloned())
        }
        async fn terminate(&self, id: &str) -> Result<(), CallError> {
            for m in self
                .machines
                .lock()
                .unwrap()
                .iter_mut()
                .filter(|m| m.id == id)
            {
                m.state = MachineState::Terminated;
            }
            Ok(())
        }
        async fn list(&self) -> Result<Vec<Machine>, CallError> {
            Ok(self.machines.lock().unwrap().clone())
        }
        async fn console_output(&self, _id: &str) -> Result<Option<String>, CallError> {
            Ok(Some("kernel panic\n".into()))
        }
    }

    fn config(market: Market, subnets: &[&str]) -> Config {
        Config {
            installation: "ci".into(),
            region: "eu-west-1".into(),
            endpoint_url: None,
            api_timeout: Duration::from_secs(20),
            host: HostAddress::PrivateIp,
            address_wait: Duration::from_secs(10),
            agent: AgentSetup::default(),
            sizes: BTreeMap::from([(
                "vm".to_string(),
                Size {
                    image_id: "ami-1".into(),
                    instance_type: "t3.micro".into(),
                    subnets: subnets.iter().map(|s| s.to_string()).collect(),
                    security_groups: vec!["sg-1".into()],
                    iam_instance_profile: None,
                    key_name: None,
                    root_volume: None,
                    tags: BTreeMap::from([("team".to_string(), "ci".to_string())]),
                    market,
                    agent_args: vec![],
                },
            )]),
        }
    }

    fn request(secret: &str) -> CreateRequest {
        CreateRequest {
            v: 2,
            backing_id: "bn-1".into(),
            secret: secret.into(),
            provider: "aws".into(),
            pool: "main".into(),
            backing_label: "vm".into(),
            slots: 4,
            nats_url: "nats://10.0.0.1:4222".into(),
            nats_credentials: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_answer_is_found_by_its_tag_and_never_launched_twice() {
        let fake = Fake::scripted(&[Outcome::Lost, Outcome::Lost]);
        let c = config(Market::OnDemand, &[]);
        let made = create(&fake, &c, &request("s")).await.unwrap();
        assert_eq!(fake.machines.lock().unwrap().len(), 1);
        assert_eq!(fake.runs.lock().unwrap().len(), 1);
        assert_eq!(made.id, "i-0000");
        assert_eq!(made.host, "10.0.0.1");
        // Run again with the same input (the launcher's command retried): the same one.
        let again = create(&fake, &c, &request("s")).await.unwrap();
        assert_eq!(again, made);
        assert_eq!(fake.machines.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_relaunch_with_a_new_secret_makes_a_new_instance_with_a_new_token() {
        let fake = Fake::default();
        let c = config(Market::OnDemand, &[]);
        let a = create(&fake, &c, &request("one")).await.unwrap();
        let b = create(&fake, &c, &request("two")).await.unwrap();
        assert_ne!(a.id, b.id);
        let runs = fake.runs.lock().unwrap();
        assert_ne!(runs[0].client_token, runs[1].client_token);
        assert_eq!(runs[0].tags[ec2::TAG_BACKING_ID], "bn-1");
        assert_eq!(runs[0].tags[ec2::TAG_INSTALLATION], "ci");
        assert_eq!(runs[0].tags["team"], "ci");
        assert_eq!(runs[0].tags["Name"], "slotpool bn-1");
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_is_asked_again_with_growing_pauses() {
        let fake = Fake::scripted(&[
            Outcome::Code("RequestLimitExceeded"),
            Outcome::Code("RequestLimitExceeded"),
        ]);
        let started = tokio::time::Instant::now();
        create(&fake, &config(Market::OnDemand, &[]), &request("s"))
            .await
            .unwrap();
        assert_eq!(fake.runs.lock().unwrap().len(), 3);
        assert!(
            started.elapsed() >= Duration::from_millis(20 + 40),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn endless_throttling_is_a_capacity_failure_after_the_retries() {
        let fake = Fake::scripted(&[Outcome::Code("RequestLimitExceeded"); 20]);
        let err = create(&fake, &config(Market::OnDemand, &[]), &request("s"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Failure::Capacity(m) if m.contains("did not answer after 9 tries")),
            "{err}"
        );
        assert_eq!(fake.runs.lock().unwrap().len(), 9);
        assert!(fake.machines.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_zone_without_capacity_moves_on_to_the_next_subnet() {
        let fake = Fake::scripted(&[Outcome::Code("InsufficientInstanceCapacity")]);
        let made = create(
            &fake,
            &config(Market::OnDemand, &["subnet-a", "subnet-b"]),
            &request("s"),
        )
        .await
        .unwrap();
        let runs = fake.runs.lock().unwrap();
        assert_eq!(runs.len(), 2);
        assert_ne!(runs[0].subnet, runs[1].subnet);
        assert_ne!(runs[0].client_token, runs[1].client_token);
        assert_eq!(made.data["subnet"], runs[1].subnet.clone().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn no_capacity_anywhere_is_the_capacity_exit_naming_each_refusal() {
        let fake = Fake::scripted(&[Outcome::Code("InsufficientInstanceCapacity"); 2]);
        let err = create(
            &fake,
            &config(Market::OnDemand, &["subnet-a", "subnet-b"]),
            &request("s"),
        )
        .await
        .unwrap_err();
        let Failure::Capacity(msg) = &err else {
            panic!("{err:?}")
        };
        assert!(
            msg.contains("subnet-a") && msg.contains("subnet-b"),
            "{msg}"
        );
        let quota = Fake::scripted(&[Outcome::Code("InstanceLimitExceeded")]);
        let err = create(
            &quota,
            &config(Market::OnDemand, &["a", "b"]),
            &request("s"),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Failure::Capacity(_)));
        assert_eq!(
            quota.runs.lock().unwrap().len(),
            1,
            "a quota is not a zone's: no second subnet"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn spot_falls_back_to_on_demand_when_configured() {
        let fake = Fake::scripted(&[
            Outcome::Code("InsufficientInstanceCapacity"),
            Outcome::Code("MaxSpotInstanceCountExceeded"),
        ]);
        let made = create(
            &fake,
            &config(Market::SpotThenOnDemand, &["a", "b", "c"]),
            &request("s"),
        )
        .await
        .unwrap();
        let spots: Vec<bool> = fake.runs.lock().unwrap().iter().map(|r| r.spot).collect();
        // Spot in one zone, spot in the next (spot quota: no further spot), then on-demand.
        assert_eq!(spots, [true, true, false]);
        assert_eq!(made.attributes["market"], "on-demand");

        let spot_only = Fake::scripted(&[Outcome::Code("MaxSpotInstanceCountExceeded")]);
        let err = create(
            &spot_only,
            &config(Market::Spot, &["a", "b"]),
            &request("s"),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Failure::Capacity(_)), "{err:?}");
        assert_eq!(spot_only.runs.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fatal_error_fails_at_once_and_an_unknown_label_names_the_known_ones() {
        let fake = Fake::scripted(&[Outcome::Code("InvalidAMIID.NotFound")]);
        let err = create(&fake, &config(Market::OnDemand, &[]), &request("s"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Failure::Failed(m) if m.contains("InvalidAMIID.NotFound")),
            "{err}"
        );
        let mut req = request("s");
        req.backing_label = "huge".into();
        let err = create(&fake, &config(Market::OnDemand, &[]), &req)
            .await
            .unwrap_err();
        assert_eq!(
            err,
            Failure::Failed(
                "no size for backing label \"huge\" in the provider's configuration (it has vm)"
                    .into()
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_launch_whose_instance_died_fails_with_its_console() {
        let fake = Fake::default();
        let c = config(Market::OnDemand, &[]);
        let made = create(&fake, &c, &request("s")).await.unwrap();
        fake.terminate(&made.id).await.unwrap();
        let err = create(&fake, &c, &request("s")).await.unwrap_err();
        assert!(
            matches!(&err, Failure::Failed(m) if m.contains("is terminated already") && m.contains("kernel panic")),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn delete_is_idempotent_and_refuses_instances_of_others() {
        let fake = Fake::default();
        let c = config(Market::OnDemand, &[]);
        let made = create(&fake, &c, &request("s")).await.unwrap();
        let del = DeleteRequest {
            v: 2,
            id: made.id.clone(),
            host: made.host.clone(),
            data: made.data.clone(),
        };
        delete(&fake, &c, &del).await.unwrap();
        delete(&fake, &c, &del).await.unwrap();
        assert!(list(&fake).await.unwrap().is_empty());
        let gone = DeleteRequest {
            id: "i-404".into(),
            ..del.clone()
        };
        delete(&fake, &c, &gone).await.unwrap();

        let mut other = c.clone();
        other.installation = "other".into();
        let theirs = create(&fake, &other, &request("t")).await.unwrap();
        let err = delete(
            &fake,
            &c,
            &DeleteRequest {
                id: theirs.id.clone(),
                ..del
            },
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, Failure::Failed(m) if m.contains("is not one of installation \"ci\"")),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn console_reads_this_installations_instances_only() {
        let fake = Fake::default();
        let c = config(Market::OnDemand, &[]);
        let made = create(&fake, &c, &request("s")).await.unwrap();
        let req = ConsoleRequest {
            v: ConsoleRequest::VERSION,
            id: made.id.clone(),
            host: made.host.clone(),
            data: made.data.clone(),
        };
        assert_eq!(
            console(&fake, &c, &req).await.unwrap().output,
            "kernel panic\n"
        );
        let gone = ConsoleRequest {
            id: "i-404".into(),
            ..req.clone()
        };
        assert_eq!(
            console(&fake, &c, &gone).await.unwrap().output,
            "",
            "an instance EC2 no longer knows has no console"
        );
        let not_ec2 = ConsoleRequest {
            id: "vol-1".into(),
            ..req.clone()
        };
        assert!(console(&fake, &c, &not_ec2).await.is_err());
        let mut other = c.clone();
        other.installation = "other".into();
        let theirs = create(&fake, &other, &request("t")).await.unwrap();
        let err = console(
            &fake,
            &c,
            &ConsoleRequest {
                id: theirs.id,
                ..req
            },
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, Failure::Failed(m) if m.contains("not reading its console")),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn list_names_each_live_instance_with_its_backing_id() {
        let fake = Fake::default();
        let c = config(Market::OnDemand, &[]);
        let a = create(&fake, &c, &request("one")).await.unwrap();
        let b = create(&fake, &c, &request("two")).await.unwrap();
        fake.terminate(&a.id).await.unwrap();
        let listed = list(&fake).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].id, b.id);
        assert_eq!(listed[0].backing_id.as_deref(), Some("bn-1"));
        assert_eq!(listed[0].host, b.host);
    }
}
