//! `slotpool nats-setup`: what it writes for a NATS installation.

pub mod pki;
