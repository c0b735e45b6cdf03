//! `slotpool-provider-ec2`: slotpool's provider for Amazon EC2. It speaks the exec
//! contract (docs/providers.md): the launcher runs it as its `create`, `delete` and
//! `list` commands, one JSON document on stdin, one on stdout. It is a crate and a package
//! of its own so that slotpool's core build compiles no cloud SDK.
//!
//! - `config`: the provider's YAML file (sizes by backing label: image, instance type,
//!   subnets, security groups, IAM profile, root volume, tags, market);
//! - `decide`: the pure decisions (launch token, placements, what an EC2 error means,
//!   back-off);
//! - `user_data`: the cloud-init document that starts the packaged agent;
//! - `ec2`: the EC2 calls, behind a trait, made with the AWS SDK for Rust;
//! - `ops`: create (exactly once), delete (idempotent, only this installation's
//!   instances), list (by the installation's tag).

#![forbid(unsafe_code)]

pub mod config;
pub mod decide;
pub mod ec2;
pub mod ops;
pub mod user_data;

pub use config::Config;
pub use ops::Failure;
