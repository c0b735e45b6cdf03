//! The provider's decisions, pure and unit tested: the launch token that makes a create
//! idempotent, the agent's arguments, the order of placements a create tries, what an
//! EC2 error means for it, and how long to wait before asking again.

use crate::config::{Market, Size};
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Identifies one launch attempt of one backing node: the same backing id and secret (a
/// create run again after its answer was lost) give the same token, a relaunch (the same
/// backing id with a new secret) another. Tagged on the instance as `slotpool:launch`
/// and, with the placement's number, sent as EC2's `ClientToken`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchToken(String);

impl LaunchToken {
    /// 32 hex digits of SHA-256 over the backing id and the secret (the secret cannot be
    /// read back from it).
    pub fn new(backing_id: &str, secret: &str) -> LaunchToken {
        let mut h = Sha256::new();
        h.update(b"slotpool launch\0");
        h.update(backing_id.as_bytes());
        h.update(b"\0");
        h.update(secret.as_bytes());
        LaunchToken(hex::encode(&h.finalize()[..16]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `ClientToken` of placement `n`: each placement is another request to EC2
    /// (another subnet or market), and a token sent again with other parameters is
    /// refused (`IdempotentParameterMismatch`).
    pub fn client_token(&self, n: usize) -> String {
        format!("sp-{}-{n}", self.0)
    }
}

/// The instance metadata service, as an instance's own processes reach it.
pub const IMDS_URL: &str = "http://169.254.169.254";

/// The `slotpool-agent` arguments of an instance of `size` with `slots` slots: `--slots`,
/// then for a size that may run on spot (`spot`, `spot-then-on-demand`)
/// `--spot-notice-url` (the agent reports EC2's interruption notice; on an on-demand
/// instance the notice never comes), then the configured arguments, common ones first.
pub fn agent_args(slots: u32, common: &[String], size: &Size) -> Vec<String> {
    let mut args = vec!["--slots".to_string(), slots.to_string()];
    if size.market != Market::OnDemand {
        args.extend(["--spot-notice-url".to_string(), IMDS_URL.to_string()]);
    }
    args.extend(common.iter().cloned());
    args.extend(size.agent_args.iter().cloned());
    args
}

/// Where and how one try of a create asks for the instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub subnet: Option<String>,
    pub spot: bool,
}

/// The placements a create tries in order: each subnet, starting at one picked by the
/// backing id (so that a pool spreads over the subnets' zones), spot ones first for
/// `spot-then-on-demand`.
pub fn placements(size: &Size, backing_id: &str) -> Vec<Placement> {
    let subnets: Vec<Option<String>> = if size.subnets.is_empty() {
        vec![None]
    } else {
        let start = (fnv1a(backing_id) % size.subnets.len() as u64) as usize;
        (0..size.subnets.len())
            .map(|i| Some(size.subnets[(start + i) % size.subnets.len()].clone()))
            .collect()
    };
    let markets: &[bool] = match size.market {
        Market::OnDemand => &[false],
        Market::Spot => &[true],
        Market::SpotThenOnDemand => &[true, false],
    };
    markets
        .iter()
        .flat_map(|&spot| {
            subnets.iter().map(move |subnet| Placement {
                subnet: subnet.clone(),
                spot,
            })
        })
        .collect()
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

/// How an EC2 call ended, in the terms the decisions need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// EC2 answered with an error code.
    Service { code: String, message: String },
    /// No answer was read: the request may or may not have been carried out (a lost
    /// answer, a timeout, a connection that failed).
    NoAnswer(String),
    /// The request was never sent (it could not be built, no credentials).
    NotSent(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Service { code, message } => write!(f, "{code}: {message}"),
            CallError::NoAnswer(why) => write!(f, "no answer: {why}"),
            CallError::NotSent(why) => write!(f, "not sent: {why}"),
        }
    }
}

/// What an error of `RunInstances` means for a create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Ask again after a back-off; the instance may exist (look it up first).
    Again,
    /// This placement has no capacity: try the next one.
    NextPlacement,
    /// No spot capacity or quota anywhere: skip the remaining spot placements.
    NoSpot,
    /// Out of quota or capacity for the account: the contract's capacity exit.
    OutOfCapacity,
    /// A failure no retry mends (a wrong image id, missing permissions).
    Fatal,
}

/// Capacity refused in one zone (or subnet): another zone may have it.
const ZONE_CAPACITY: [&str; 6] = [
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientFreeAddressesInSubnet",
    // The instance type is not offered in this zone.
    "Unsupported",
];
/// The account's quota: no zone helps.
const QUOTA: [&str; 2] = ["InstanceLimitExceeded", "VcpuLimitExceeded"];
/// Spot refused for the region (quota, price): on-demand may still be had.
const SPOT_REGION: [&str; 3] = [
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "SpotInstanceRequestLimitExceeded",
];
/// EC2's throttling codes, and the server's own trouble: ask again.
const AGAIN: [&str; 9] = [
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "EC2ThrottledException",
    "InternalError",
    "InternalFailure",
    "ServiceUnavailable",
    "Unavailable",
    "RequestExpired",
];

/// What `err` from `RunInstances` in a spot (or on-demand) placement means.
pub fn judge_run(err: &CallError, spot: bool) -> Verdict {
    match err {
        CallError::NoAnswer(_) => Verdict::Again,
        CallError::NotSent(_) => Verdict::Fatal,
        CallError::Service { code, .. } => {
            let code = code.as_str();
            if AGAIN.contains(&code) {
                Verdict::Again
            } else if ZONE_CAPACITY.contains(&code) {
                Verdict::NextPlacement
            } else if spot && SPOT_REGION.contains(&code) {
                Verdict::NoSpot
            } else if QUOTA.contains(&code) {
                Verdict::OutOfCapacity
            } else {
                Verdict::Fatal
            }
        }
    }
}

/// Whether a read-only or idempotent call (describe, terminate) that failed with `err`
/// should be sent again.
pub fn worth_again(err: &CallError) -> bool {
    match err {
        CallError::NoAnswer(_) => true,
        CallError::NotSent(_) => false,
        CallError::Service { code, .. } => AGAIN.contains(&code.as_str()),
    }
}

/// Whether `err` is EC2 throttling (as opposed to an error of the server).
pub fn throttled(err: &CallError) -> bool {
    matches!(err, CallError::Service { code, .. } if AGAIN[..4].contains(&code.as_str()))
}

/// Calls sent again at most before a create or delete gives up.
pub const MAX_AGAIN: u32 = 8;
const BACKOFF_BASE: Duration = Duration::from_millis(200);
const BACKOFF_CAP: Duration = Duration::from_secs(10);

/// The pause before the `again`-th repeat (1-based) of a call: exponential from 200 ms,
/// at most 10 s, with full jitter (`jitter` in 0..1 scales it), so that many launchers
/// throttled at once do not come back together.
pub fn backoff(again: u32, jitter: f64) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << again.saturating_sub(1).min(16));
    let ceiling = exp.min(BACKOFF_CAP);
    // Never less than a tenth of the ceiling: an immediate repeat helps nobody.
    ceiling.mul_f64(0.1 + 0.9 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn size(subnets: &[&str], market: Market) -> Size {
        Size {
            image_id: "ami-1".into(),
            instance_type: "t3.micro".into(),
            subnets: subnets.iter().map(|s| s.to_string()).collect(),
            security_groups: vec![],
            iam_instance_profile: None,
            key_name: None,
            root_volume: None,
            tags: BTreeMap::new(),
            market,
            agent_args: vec![],
        }
    }

    fn service(code: &str) -> CallError {
        CallError::Service {
            code: code.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn an_agent_that_may_run_on_spot_watches_for_the_interruption_notice() {
        let common = vec!["--isolation".to_string(), "users".to_string()];
        let mut s = size(&[], Market::OnDemand);
        s.agent_args = vec!["--slot-netns".into(), "on".into()];
        assert_eq!(
            agent_args(4, &common, &s),
            ["--slots", "4", "--isolation", "users", "--slot-netns", "on"]
        );
        for market in [Market::Spot, Market::SpotThenOnDemand] {
            s.market = market;
            assert_eq!(
                agent_args(4, &common, &s),
                [
                    "--slots",
                    "4",
                    "--spot-notice-url",
                    "http://169.254.169.254",
                    "--isolation",
                    "users",
                    "--slot-netns",
                    "on"
                ],
                "{market:?}"
            );
        }
    }

    #[test]
    fn a_token_is_the_same_for_one_attempt_and_another_for_a_relaunch() {
        let a = LaunchToken::new("bn-1", "s1");
        assert_eq!(a, LaunchToken::new("bn-1", "s1"));
        assert_ne!(a, LaunchToken::new("bn-1", "s2"));
        assert_ne!(a, LaunchToken::new("bn-2", "s1"));
        assert_eq!(a.as_str().len(), 32);
        assert!(!a.as_str().contains("s1"));
        // EC2 takes client tokens of at most 64 ASCII characters.
        assert!(a.client_token(99).len() <= 64);
        assert_ne!(a.client_token(0), a.client_token(1));
    }

    #[test]
    fn placements_cover_every_subnet_once_per_market_spot_first() {
        let s = size(&["a", "b", "c"], Market::SpotThenOnDemand);
        let p = placements(&s, "bn-1");
        assert_eq!(p.len(), 6);
        assert!(p[..3].iter().all(|p| p.spot) && p[3..].iter().all(|p| !p.spot));
        let mut first: Vec<_> = p[..3].iter().map(|p| p.subnet.clone().unwrap()).collect();
        assert_eq!(
            p[..3].iter().map(|p| &p.subnet).collect::<Vec<_>>(),
            p[3..].iter().map(|p| &p.subnet).collect::<Vec<_>>()
        );
        first.sort();
        assert_eq!(first, ["a", "b", "c"]);
        assert_eq!(
            placements(&size(&[], Market::OnDemand), "bn-1"),
            vec![Placement {
                subnet: None,
                spot: false
            }]
        );
        assert!(placements(&size(&["a"], Market::Spot), "x")
            .iter()
            .all(|p| p.spot));
    }

    #[test]
    fn backing_ids_spread_over_the_subnets() {
        let s = size(&["a", "b", "c"], Market::OnDemand);
        let mut firsts = BTreeMap::new();
        for i in 0..300 {
            let p = placements(&s, &format!("bn-{i:04}"));
            *firsts.entry(p[0].subnet.clone().unwrap()).or_insert(0) += 1;
        }
        assert_eq!(firsts.len(), 3, "{firsts:?}");
        assert!(firsts.values().all(|&n| n > 60), "{firsts:?}");
    }

    #[test]
    fn run_errors_are_judged_by_code_and_market() {
        let cases = [
            (CallError::NoAnswer("reset".into()), false, Verdict::Again),
            (service("RequestLimitExceeded"), false, Verdict::Again),
            (service("InternalError"), true, Verdict::Again),
            (
                service("InsufficientInstanceCapacity"),
                true,
                Verdict::NextPlacement,
            ),
            (
                service("InsufficientInstanceCapacity"),
                false,
                Verdict::NextPlacement,
            ),
            (service("Unsupported"), false, Verdict::NextPlacement),
            (
                service("MaxSpotInstanceCountExceeded"),
                true,
                Verdict::NoSpot,
            ),
            (service("SpotMaxPriceTooLow"), true, Verdict::NoSpot),
            (
                service("InstanceLimitExceeded"),
                false,
                Verdict::OutOfCapacity,
            ),
            (service("VcpuLimitExceeded"), true, Verdict::OutOfCapacity),
            (service("InvalidAMIID.NotFound"), false, Verdict::Fatal),
            (service("UnauthorizedOperation"), false, Verdict::Fatal),
            (
                service("IdempotentParameterMismatch"),
                false,
                Verdict::Fatal,
            ),
            (
                CallError::NotSent("no credentials".into()),
                false,
                Verdict::Fatal,
            ),
        ];
        for (err, spot, want) in cases {
            assert_eq!(judge_run(&err, spot), want, "{err} spot={spot}");
        }
        assert!(throttled(&service("RequestLimitExceeded")));
        assert!(!throttled(&service("InternalError")));
        assert!(worth_again(&service("InternalError")));
        assert!(!worth_again(&service("InvalidInstanceID.Malformed")));
    }

    #[test]
    fn backoff_grows_to_its_cap_and_is_never_zero() {
        assert_eq!(backoff(1, 1.0), Duration::from_millis(200));
        assert_eq!(backoff(2, 1.0), Duration::from_millis(400));
        assert_eq!(backoff(30, 1.0), BACKOFF_CAP);
        assert_eq!(backoff(1, 0.0), Duration::from_millis(20));
        let total: Duration = (1..=MAX_AGAIN).map(|n| backoff(n, 1.0)).sum();
        assert!(total < Duration::from_secs(60), "{total:?}");
    }
}
