//! What the console knows of the launcher's configuration: the timers of each label and
//! the size of each pool. The launcher keeps these in its YAML file, not in KV, so they
//! are known only when the console is given that file (`--config`); without it the
//! console shows how long a node has been idle instead of when it will be released.

use slotpool_config::tenants::Tenants;
use slotpool_config::timing::IdleRules;
use slotpool_config::warm::{Arrivals, WarmRule};
use slotpool_config::{Config, Warm};
use std::collections::BTreeMap;

/// The timers of one label in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LabelRules {
    /// Grace-time, min-retention-time and max-age, as the launcher takes them.
    pub idle: IdleRules,
    /// Free slots the launcher keeps ready for the label (`min-ready`, summed over the
    /// pools serving it); 0: none.
    pub min_ready: u32,
    /// The label's `warm-window`, with the most slots the pools serving it hold.
    pub warm: Option<(Warm, u32)>,
}

impl LabelRules {
    /// How many free slots the launcher keeps ready, as it decides it.
    pub fn ready(&self) -> WarmRule {
        WarmRule {
            min_ready: self.min_ready,
            warm: self.warm,
        }
    }
}

type Site = (String, String, String);

/// Label timers and pool sizes by provider, pool and label.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rules {
    labels: BTreeMap<Site, LabelRules>,
    pools: BTreeMap<(String, String), u32>,
    /// The teams sharing the pool (`tenants[]`): the Pools view shows each one.
    tenants: Tenants,
    /// The launchers' `stall-after`, when the config is known.
    stall_after: Option<std::time::Duration>,
}

impl Rules {
    /// Nothing known (no `--config`).
    pub fn unknown() -> Rules {
        Rules::default()
    }

    pub fn from_config(config: &Config) -> Rules {
        let mut rules = Rules {
            tenants: config.tenants.clone(),
            stall_after: Some(config.stall_after),
            ..Rules::default()
        };
        for provider in &config.providers {
            for pool in &provider.pools {
                rules
                    .pools
                    .insert((provider.name.clone(), pool.name.clone()), pool.max_servers);
                for label in &pool.labels {
                    rules.insert(
                        &provider.name,
                        &pool.name,
                        &label.name,
                        LabelRules {
                            idle: label.idle_rules(),
                            min_ready: config.min_ready(&label.name),
                            warm: config.warm(&label.name),
                        },
                    );
                }
            }
        }
        rules
    }

    /// Adds one label's timers (for tests and callers without a config file).
    pub fn insert(&mut self, provider: &str, pool: &str, label: &str, rules: LabelRules) {
        self.labels.insert(
            (provider.to_string(), pool.to_string(), label.to_string()),
            rules,
        );
    }

    /// Sets a pool's max-servers.
    pub fn set_max_servers(&mut self, provider: &str, pool: &str, max: u32) {
        self.pools
            .insert((provider.to_string(), pool.to_string()), max);
    }

    /// The teams sharing the pool; [`Tenants::is_single`] without a `tenants` section.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Sets the teams (for tests and callers without a config file).
    pub fn set_tenants(&mut self, tenants: Tenants) {
        self.tenants = tenants;
    }

    /// How long a launcher may go without finishing a pass before it counts as stalled:
    /// the `stall-after` its `/readyz` holds it to (the default without `--config`).
    pub fn stall_after(&self) -> std::time::Duration {
        self.stall_after
            .unwrap_or(slotpool_config::DEFAULT_STALL_AFTER)
    }

    pub fn is_known(&self) -> bool {
        !self.labels.is_empty()
    }

    pub fn label(&self, provider: &str, pool: &str, label: &str) -> Option<LabelRules> {
        self.labels
            .get(&(provider.to_string(), pool.to_string(), label.to_string()))
            .copied()
    }

    pub fn max_servers(&self, provider: &str, pool: &str) -> Option<u32> {
        self.pools
            .get(&(provider.to_string(), pool.to_string()))
            .copied()
    }

    /// Every configured (provider, pool, label).
    pub fn sites(&self) -> impl Iterator<Item = &Site> {
        self.labels.keys()
    }

    /// An empty log of the arrivals the labels with a `warm-window` count.
    pub fn arrivals(&self) -> Arrivals {
        Arrivals::counting(
            self.labels
                .iter()
                .filter_map(|((_, _, label), r)| Some((label.clone(), r.warm?.0.window))),
        )
    }
}
