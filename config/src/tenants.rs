//! Tenants: the teams that share one pool, each a set of client identities (the bus user
//! names their CI systems log in with), with a weight, guaranteed slots and limits.
//!
//! The keys and what the launcher does with them: docs/configuration.md, `tenants[]`.
//!
//! Clients no tenant names belong to the tenant [`DEFAULT_TENANT`] (weight 1, no
//! guarantee, no limit), which may itself be configured, without `clients`. With no
//! `tenants` section every client is in it, and the queue is what it was: priority,
//! then age. How the launcher shares slots among tenants is in
//! `launcher/src/world/queue.rs`.

use crate::raw::RawTenant;
use crate::validate::Validator;
use crate::ConfigError;
use serde_saphyr::Spanned;
use slotpool_protocol::UserName;
use std::collections::{BTreeMap, HashMap};

/// The tenant of every client no tenant names.
pub const DEFAULT_TENANT: &str = "default";
/// The largest `weight`.
pub const MAX_WEIGHT: u32 = 1_000;
/// The largest `max-submits-per-second`.
pub const MAX_SUBMIT_RATE: f64 = 10_000.0;

/// One tenant, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub name: String,
    /// Its clients (empty for [`DEFAULT_TENANT`], which has every client no other names).
    pub clients: Vec<UserName>,
    /// Its share of contended slots against the others' weights (1 to [`MAX_WEIGHT`]).
    pub weight: u32,
    /// Slots of each label it gets before fair share counts (while it has that few).
    pub guaranteed: BTreeMap<String, u32>,
    /// Slots of any label it gets before fair share counts, while it holds fewer of
    /// all labels together (0: none).
    pub guaranteed_slots: u32,
    /// Slots it may hold at once, of every label together; its requests beyond wait.
    pub max_slots: Option<u32>,
    /// Open requests it may have; a submit beyond is refused.
    pub max_waiting: Option<u32>,
    /// Submits a second it may make, counted over the last second across launchers; a
    /// submit beyond is refused.
    pub max_submits_per_second: Option<f64>,
}

impl Tenant {
    fn default_one() -> Tenant {
        Tenant {
            name: DEFAULT_TENANT.into(),
            clients: Vec::new(),
            weight: 1,
            guaranteed: BTreeMap::new(),
            guaranteed_slots: 0,
            max_slots: None,
            max_waiting: None,
            max_submits_per_second: None,
        }
    }

    /// Slots of `label` guaranteed to it.
    pub fn guaranteed(&self, label: &str) -> u32 {
        self.guaranteed.get(label).copied().unwrap_or(0)
    }
}

/// Every tenant, by index (the default one last), and whose each client is.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenants {
    list: Vec<Tenant>,
    by_client: HashMap<UserName, usize>,
}

impl Default for Tenants {
    fn default() -> Self {
        Tenants {
            list: vec![Tenant::default_one()],
            by_client: HashMap::new(),
        }
    }
}

impl Tenants {
    /// The index of the tenant of `client` (requests and nodes carry their client).
    pub fn of(&self, client: Option<&UserName>) -> usize {
        client
            .and_then(|c| self.by_client.get(c))
            .copied()
            .unwrap_or(self.list.len() - 1)
    }

    pub fn get(&self, index: usize) -> &Tenant {
        &self.list[index]
    }

    /// The tenant named `name`.
    pub fn named(&self, name: &str) -> Option<usize> {
        self.list.iter().position(|t| t.name == name)
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Never: there is always the default tenant.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.list.iter()
    }

    /// Whether there is one tenant: the queue is then plain priority, then age.
    pub fn is_single(&self) -> bool {
        self.list.len() == 1
    }

    /// Each tenant's weighted share of `slots` (the ready backing nodes' slots), by
    /// index, given each one's `(held, open)`: slots its nodes hold and its open
    /// requests. Only the tenants holding or waiting share (the others' share is 0,
    /// and lent to them): `slots × weight / the active tenants' weights`, rounded down.
    /// The figure the launcher's metrics and the console show beside what each holds.
    pub fn shares(&self, slots: u64, loads: &[(u32, u32)]) -> Vec<u64> {
        let active = |i: usize| loads.get(i).is_some_and(|(held, open)| held + open > 0);
        let weights: u64 = (0..self.list.len())
            .filter(|i| active(*i))
            .map(|i| u64::from(self.list[i].weight))
            .sum();
        (0..self.list.len())
            .map(|i| {
                if active(i) && weights > 0 {
                    slots * u64::from(self.list[i].weight) / weights
                } else {
                    0
                }
            })
            .collect()
    }
}

/// Validates the `tenants` section against the labels the pools serve (`label_slots`:
/// the most slots of each label the pools hold at once).
pub(crate) fn validate(
    v: &Validator<'_>,
    raw: Vec<Spanned<RawTenant>>,
    label_slots: &BTreeMap<String, u64>,
) -> Result<Tenants, ConfigError> {
    let mut list: Vec<Tenant> = Vec::new();
    let mut default: Option<Tenant> = None;
    let mut by_client: HashMap<UserName, usize> = HashMap::new();
    let mut guaranteed_sum: BTreeMap<String, u64> = BTreeMap::new();
    let mut guaranteed_total: u64 = 0;
    for t in raw {
        let t = t.value;
        let name = v.name("tenant", &t.name)?;
        if list.iter().any(|o| o.name == name) || (name == DEFAULT_TENANT && default.is_some()) {
            return Err(v.at(&t.name, format!("tenant {name:?} is defined twice")));
        }
        let is_default = name == DEFAULT_TENANT;
        if is_default && !t.clients.is_empty() {
            return Err(v.at(
                &t.clients[0],
                format!(
                    "tenant {DEFAULT_TENANT:?} has every client no other tenant names: give it no `clients`"
                ),
            ));
        }
        if !is_default && t.clients.is_empty() {
            return Err(v.at(
                &t.name,
                format!("tenant {name:?} has no `clients`: name the bus users of its CI systems"),
            ));
        }
        let index = list.len();
        let mut clients = Vec::new();
        for c in &t.clients {
            let user = UserName::parse(&c.value).map_err(|e| v.at(c, e.to_string()))?;
            if let Some(other) = by_client.insert(user.clone(), index) {
                return Err(v.at(
                    c,
                    format!(
                        "client {:?} is in tenant {:?} already: a client belongs to one tenant",
                        c.value, list[other].name
                    ),
                ));
            }
            clients.push(user);
        }
        let weight = match &t.weight {
            Some(w) if w.value == 0 || w.value > MAX_WEIGHT => {
                return Err(v.at(
                    w,
                    format!("weight must be 1 to {MAX_WEIGHT}, got {}", w.value),
                ))
            }
            Some(w) => w.value,
            None => 1,
        };
        let mut guaranteed = BTreeMap::new();
        for (label, slots) in &t.guaranteed {
            let Some(most) = label_slots.get(label) else {
                let served: Vec<&str> = label_slots.keys().map(String::as_str).collect();
                return Err(v.at(
                    slots,
                    format!(
                        "tenant {name:?} is guaranteed slots of {label:?}, which no pool serves; \
                         the pools serve: {}",
                        served.join(", ")
                    ),
                ));
            };
            let sum = guaranteed_sum.entry(label.clone()).or_default();
            *sum += u64::from(slots.value);
            if *sum > *most {
                return Err(v.at(
                    slots,
                    format!(
                        "the tenants are guaranteed {sum} slots of {label:?} together, but the \
                         pools serving it hold at most {most}"
                    ),
                ));
            }
            guaranteed.insert(label.clone(), slots.value);
        }
        let positive = |value: &Option<Spanned<u32>>, key: &str| match value {
            Some(s) if s.value == 0 => Err(v.at(
                s,
                format!("{key} must be at least 1 (leave it out for no limit)"),
            )),
            Some(s) => Ok(Some(s.value)),
            None => Ok(None),
        };
        let max_slots = positive(&t.max_slots, "max-slots")?;
        let guaranteed_slots = positive(&t.guaranteed_slots, "guaranteed-slots")?.unwrap_or(0);
        if let Some(slots) = &t.guaranteed_slots {
            guaranteed_total += u64::from(slots.value);
            let most: u64 = label_slots.values().sum();
            if guaranteed_total > most {
                return Err(v.at(
                    slots,
                    format!(
                        "the tenants are guaranteed {guaranteed_total} slots together \
                         (guaranteed-slots), but the pools hold at most {most}"
                    ),
                ));
            }
        }
        let max_waiting = positive(&t.max_waiting, "max-waiting")?;
        let max_submits_per_second = match &t.max_submits_per_second {
            Some(r) if !(r.value > 0.0 && r.value <= MAX_SUBMIT_RATE) => {
                return Err(v.at(
                    r,
                    format!(
                    "max-submits-per-second must be above 0 and at most {MAX_SUBMIT_RATE}, got {}",
                    r.value
                ),
                ))
            }
            Some(r) => Some(r.value),
            None => None,
        };
        let tenant = Tenant {
            name,
            clients,
            weight,
            guaranteed,
            guaranteed_slots,
            max_slots,
            max_waiting,
            max_submits_per_second,
        };
        if is_default {
            default = Some(tenant);
        } else {
            list.push(tenant);
        }
    }
    list.push(default.unwrap_or_else(Tenant::default_one));
    Ok(Tenants { list, by_client })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use std::path::Path;

    const POOLS: &str = "providers:\n  - name: p\n    driver: local\n    pools:\n      - name: main\n        max-servers: 2\n        labels:\n          - {name: small, backing-label: vm, max-parallel-jobs: 4}\n";

    fn parse(tenants: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("t.yaml"), &format!("{POOLS}{tenants}"))
    }

    fn user(name: &str) -> UserName {
        UserName::parse(name).unwrap()
    }

    #[test]
    fn clients_find_their_tenant_and_the_rest_are_the_default_one() {
        let c = parse(
            "tenants:\n  - {name: web, clients: [ci-web, ci-web2], weight: 3, guaranteed: {small: 2}, max-slots: 5}\n  - {name: default, max-waiting: 10}\n",
        )
        .unwrap();
        let t = &c.tenants;
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(t.of(Some(&user("ci-web2")))).name, "web");
        assert_eq!(t.get(t.of(Some(&user("ci-web2")))).guaranteed("small"), 2);
        let d = t.get(t.of(Some(&user("someone"))));
        assert_eq!((d.name.as_str(), d.max_waiting), (DEFAULT_TENANT, Some(10)));
        assert_eq!(t.of(None), t.named(DEFAULT_TENANT).unwrap());
        assert!(parse("").unwrap().tenants.is_single());
    }

    #[test]
    fn guaranteed_slots_count_every_label_and_fit_the_pools() {
        let c = parse("tenants:\n  - {name: a, clients: [x], guaranteed-slots: 3}\n").unwrap();
        assert_eq!(c.tenants.get(0).guaranteed_slots, 3);
        assert_eq!(c.tenants.get(1).guaranteed_slots, 0);
        let err = parse(
            "tenants:\n  - {name: a, clients: [x], guaranteed-slots: 5}\n  - {name: b, clients: [y], guaranteed-slots: 4}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(
                "guaranteed 9 slots together (guaranteed-slots), but the pools hold at most 8"
            ),
            "{err}"
        );
    }

    #[test]
    fn shares_split_the_slots_by_weight_among_the_active() {
        let c = parse(
            "tenants:\n  - {name: a, clients: [ci-a], weight: 3}\n  - {name: b, clients: [ci-b]}\n",
        )
        .unwrap();
        let t = &c.tenants;
        // a, b, default: every one active.
        assert_eq!(t.shares(10, &[(1, 0), (0, 2), (1, 1)]), vec![6, 2, 2]);
        // Only b holds or waits: it may use every slot.
        assert_eq!(t.shares(10, &[(0, 0), (0, 1), (0, 0)]), vec![0, 10, 0]);
        assert_eq!(t.shares(10, &[]), vec![0, 0, 0]);
    }

    #[test]
    fn a_tenant_section_that_cannot_hold_is_refused_where_it_is_wrong() {
        let err = |t: &str| parse(t).unwrap_err().to_string();
        assert_eq!(
            err("tenants:\n  - {name: a, clients: [x]}\n  - {name: b, clients: [x]}\n"),
            "t.yaml:11:25: client \"x\" is in tenant \"a\" already: a client belongs to one tenant"
        );
        assert!(err("tenants:\n  - {name: a}\n").contains("tenant \"a\" has no `clients`"));
        assert!(
            err("tenants:\n  - {name: default, clients: [x]}\n").contains("give it no `clients`")
        );
        assert!(err("tenants:\n  - {name: a, clients: [x], weight: 0}\n")
            .contains("weight must be 1 to 1000, got 0"));
        assert!(
            err("tenants:\n  - {name: a, clients: [x], guaranteed: {big: 1}}\n").contains(
                "guaranteed slots of \"big\", which no pool serves; the pools serve: small"
            )
        );
        assert!(err(
            "tenants:\n  - {name: a, clients: [x], guaranteed: {small: 5}}\n  - {name: b, clients: [y], guaranteed: {small: 4}}\n"
        )
        .contains("guaranteed 9 slots of \"small\" together, but the pools serving it hold at most 8"));
        assert!(err("tenants:\n  - {name: a, clients: [x], max-slots: 0}\n")
            .contains("max-slots must be at least 1"));
        assert!(
            err("tenants:\n  - {name: a, clients: [x], max-submits-per-second: 0}\n")
                .contains("max-submits-per-second must be above 0")
        );
        assert!(
            err("tenants:\n  - {name: a, clients: [x]}\n  - {name: a, clients: [y]}\n")
                .contains("tenant \"a\" is defined twice")
        );
        assert!(err("tenants:\n  - {name: a, clients: [\"x.y\"]}\n").contains("invalid UserName"));
    }
}
