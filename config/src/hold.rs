//! Whether the configured pools could ever hold a node set at once.
//!
//! A node set is handed out whole, so each of its labels needs enough backing nodes at
//! the same time, and labels served by one pool share that pool's `max-servers` seats.
//! Checking each label on its own accepts sets no pool can ever hold together (20 of a
//! label that fills every seat, and one more of another label of the same pool): such a
//! set would wait for ever. [`Config::hold_at_once`] is the one check, asked at submit.
//!
//! The question: are there seat counts `x[pool][label] ≥ 0` with, for every pool,
//! `Σ x[pool][·] ≤ max-servers`, and for every label, `Σ x[·][label] × slots ≥ count`
//! (`slots`: the label's largest size in that pool)? It is answered exactly by a
//! search over the labels in turn, each taking seats pool by pool, cheapest first;
//! sets have few labels and labels few pools, and the search stops after
//! [`SEARCH_BUDGET`] steps, answering yes (a set it cannot refute is accepted).

use crate::Config;
use std::collections::BTreeMap;

/// Steps the search takes at most before it accepts a set.
pub const SEARCH_BUDGET: u32 = 100_000;

/// A node set the pools can never hold at once, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("this node set cannot be held at once: {why}")]
pub struct CannotHold {
    pub why: String,
}

/// One label of the set: where it may take seats.
struct Want<'a> {
    label: &'a str,
    count: u64,
    /// (pool index, slots a seat holds) of each pool serving it, most slots first.
    pools: Vec<(usize, u64)>,
}

impl Config {
    /// Whether the pools could hold `set` (label → nodes) at once; labels no pool
    /// serves are not this check's concern.
    pub fn hold_at_once(&self, set: &BTreeMap<&str, u64>) -> Result<(), CannotHold> {
        let mut pools: Vec<(String, u64)> = Vec::new();
        let mut wants: Vec<Want<'_>> = Vec::new();
        for (&label, &count) in set {
            let mut served = Vec::new();
            for site in self.sites(label) {
                let key = format!("{}/{}", site.provider.name, site.pool.name);
                let index = match pools.iter().position(|(k, _)| *k == key) {
                    Some(i) => i,
                    None => {
                        pools.push((key, u64::from(site.pool.max_servers)));
                        pools.len() - 1
                    }
                };
                served.push((index, u64::from(site.label.largest().slots)));
            }
            if served.is_empty() {
                continue;
            }
            served.sort_by_key(|s| std::cmp::Reverse(s.1));
            wants.push(Want {
                label,
                count,
                pools: served,
            });
        }
        let mut free: Vec<u64> = pools.iter().map(|(_, max)| *max).collect();
        let mut budget = SEARCH_BUDGET;
        if fits(&wants, &mut free, &mut budget) {
            return Ok(());
        }
        Err(CannotHold {
            why: explain(&wants, &pools),
        })
    }
}

/// Whether `wants` fit into the `free` seats of each pool (searching at most
/// `budget` steps, then answering yes).
fn fits(wants: &[Want<'_>], free: &mut [u64], budget: &mut u32) -> bool {
    let Some((first, rest)) = wants.split_first() else {
        return true;
    };
    place(first, 0, first.count, rest, free, budget)
}

/// Places the `left` nodes of `want` into its pools from the `at`th on, then the rest.
fn place(
    want: &Want<'_>,
    at: usize,
    left: u64,
    rest: &[Want<'_>],
    free: &mut [u64],
    budget: &mut u32,
) -> bool {
    if *budget == 0 {
        return true;
    }
    *budget -= 1;
    if left == 0 {
        return fits(rest, free, budget);
    }
    let Some(&(pool, slots)) = want.pools.get(at) else {
        return false;
    };
    // The seats this pool could give the label, most first; fewer leave room to others.
    let most = free[pool].min(left.div_ceil(slots));
    for seats in (0..=most).rev() {
        free[pool] -= seats;
        let placed = place(
            want,
            at + 1,
            left.saturating_sub(seats * slots),
            rest,
            free,
            budget,
        );
        free[pool] += seats;
        if placed {
            return true;
        }
    }
    false
}

/// Why `wants` cannot be held: each label's fewest seats, against the seats of the pools
/// that serve them.
fn explain(wants: &[Want<'_>], pools: &[(String, u64)]) -> String {
    let labels: Vec<String> = wants
        .iter()
        .map(|w| {
            let (_, slots) = w.pools[0];
            format!(
                "{} x {} needs at least {} backing node(s) of {} slots",
                w.count,
                w.label,
                w.count.div_ceil(slots),
                slots
            )
        })
        .collect();
    let mut used: Vec<usize> = wants
        .iter()
        .flat_map(|w| w.pools.iter().map(|(p, _)| *p))
        .collect();
    used.sort_unstable();
    used.dedup();
    let seats: Vec<String> = used
        .iter()
        .map(|p| format!("{} has max-servers {}", pools[*p].0, pools[*p].1))
        .collect();
    format!(
        "{}; the pools serving them share their seats ({})",
        labels.join(", "),
        seats.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Pools as (name, max-servers, labels as (name, slots)).
    type Shape<'a> = &'a [(&'a str, u32, &'a [(&'a str, u32)])];

    fn config(pools: Shape<'_>) -> Config {
        let mut yaml = String::from("providers:\n  - name: p\n    driver: local\n    pools:\n");
        for (name, max, labels) in pools {
            yaml.push_str(&format!(
                "      - name: {name}\n        max-servers: {max}\n        labels:\n"
            ));
            for (label, slots) in labels.iter() {
                yaml.push_str(&format!(
                    "          - name: {label}\n            backing-label: {label}-{name}\n            max-parallel-jobs: {slots}\n"
                ));
            }
        }
        Config::parse(Path::new("t.yaml"), &yaml).unwrap()
    }

    fn set<'a>(items: &[(&'a str, u64)]) -> BTreeMap<&'a str, u64> {
        items.iter().copied().collect()
    }

    #[test]
    fn labels_sharing_a_pools_seats_are_counted_together() {
        let c = config(&[("main", 3, &[("small", 8), ("large", 1)])]);
        assert!(c.hold_at_once(&set(&[("small", 24)])).is_ok());
        assert!(c.hold_at_once(&set(&[("small", 16), ("large", 1)])).is_ok());
        let err = c
            .hold_at_once(&set(&[("small", 20), ("large", 1)]))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "this node set cannot be held at once: 1 x large needs at least 1 backing \
             node(s) of 1 slots, 20 x small needs at least 3 backing node(s) of 8 slots; \
             the pools serving them share their seats (p/main has max-servers 3)"
        );
    }

    #[test]
    fn a_label_may_spread_over_its_pools() {
        let c = config(&[
            ("a", 2, &[("small", 4), ("large", 1)]),
            ("b", 1, &[("small", 2)]),
        ]);
        // small: 8 in pool a (2 seats) would leave no seat for large; 6 = 4 in a + 2 in b.
        assert!(c.hold_at_once(&set(&[("small", 6), ("large", 1)])).is_ok());
        assert!(c.hold_at_once(&set(&[("small", 7), ("large", 1)])).is_err());
    }

    #[test]
    fn labels_no_pool_serves_are_left_to_the_label_check() {
        let c = config(&[("main", 1, &[("small", 1)])]);
        assert!(c.hold_at_once(&set(&[("nope", 5), ("small", 1)])).is_ok());
    }

    /// The search against every seat split, on small fleets.
    #[test]
    fn the_search_agrees_with_trying_every_split() {
        let shapes: [Shape<'_>; 3] = [
            &[
                ("a", 3, &[("x", 2), ("y", 3)]),
                ("b", 2, &[("y", 1), ("z", 2)]),
            ],
            &[("a", 2, &[("x", 3), ("y", 1), ("z", 2)])],
            &[("a", 1, &[("x", 1)]), ("b", 2, &[("x", 2), ("y", 2)])],
        ];
        for shape in shapes {
            let c = config(shape);
            for x in 0..=6u64 {
                for y in 0..=6u64 {
                    for z in 0..=4u64 {
                        let s = set(&[("x", x), ("y", y), ("z", z)]);
                        // Only served labels: the others are the label check's.
                        let served = |l: &str| {
                            shape
                                .iter()
                                .any(|(_, _, ls)| ls.iter().any(|(x, _)| *x == l))
                        };
                        let wanted: BTreeMap<&str, u64> = s
                            .iter()
                            .filter(|(l, n)| **n > 0 && served(l))
                            .map(|(l, n)| (*l, *n))
                            .collect();
                        assert_eq!(
                            c.hold_at_once(&wanted).is_ok(),
                            brute_force(shape, &wanted),
                            "{shape:?} {wanted:?}"
                        );
                    }
                }
            }
        }
    }

    /// Every split of every pool's seats among its labels.
    fn brute_force(shape: Shape<'_>, set: &BTreeMap<&str, u64>) -> bool {
        fn go(
            shape: Shape<'_>,
            got: &mut BTreeMap<String, u64>,
            set: &BTreeMap<&str, u64>,
        ) -> bool {
            let Some(((_, max, labels), rest)) = shape.split_first() else {
                return set
                    .iter()
                    .all(|(l, n)| got.get(*l).copied().unwrap_or(0) >= *n);
            };
            splits(*max, labels.len()).into_iter().any(|split| {
                for (i, (l, slots)) in labels.iter().enumerate() {
                    *got.entry(l.to_string()).or_default() += split[i] * u64::from(*slots);
                }
                let ok = go(rest, got, set);
                for (i, (l, slots)) in labels.iter().enumerate() {
                    *got.get_mut(*l).unwrap() -= split[i] * u64::from(*slots);
                }
                ok
            })
        }
        go(shape, &mut BTreeMap::new(), set)
    }

    /// Every way of giving at most `max` seats to `n` labels.
    fn splits(max: u32, n: usize) -> Vec<Vec<u64>> {
        if n == 0 {
            return vec![vec![]];
        }
        let mut out = Vec::new();
        for first in 0..=u64::from(max) {
            for mut rest in splits(max - first as u32, n - 1) {
                rest.insert(0, first);
                out.push(rest);
            }
        }
        out
    }
}
