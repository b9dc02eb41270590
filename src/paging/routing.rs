//! Which experts a mixture's router picks, counted per layer, and what a
//! set of hot experts kept on the GPU would have caught. Plain Rust.
//!
//! The counts are what placing experts one by one needs to know (issue
//! 31): routing in real models is skewed, so the most picked experts of
//! each layer take more than their share of a step's reads. The hit rate
//! of a hot set is the share of the routed picks (each a read of one
//! expert's weights for one token) that landed in it.

/// Picks per (layer, expert).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterCounts {
    n_expert: usize,
    n_used: usize,
    /// Layer-major: `counts[layer * n_expert + expert]`.
    counts: Vec<u64>,
    /// Tokens routed per layer.
    tokens: Vec<u64>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RoutingError {
    #[error("layer {layer} out of range ({n_layer} layers)")]
    Layer { layer: usize, n_layer: usize },
    #[error("the router of layer {layer} picked expert {id}, out of range ({n_expert} experts)")]
    Expert {
        layer: usize,
        id: i32,
        n_expert: usize,
    },
    #[error("{n} expert ids are not whole tokens of {n_used}")]
    Ragged { n: usize, n_used: usize },
    #[error("router counts: {0}")]
    Shape(String),
}

/// The `format` of persisted router counts.
pub const COUNTS_FORMAT: &str = "strata-router-counts-1";

impl RouterCounts {
    pub fn new(n_layer: usize, n_expert: usize, n_used: usize) -> RouterCounts {
        RouterCounts {
            n_expert,
            n_used: n_used.max(1),
            counts: vec![0; n_layer * n_expert],
            tokens: vec![0; n_layer],
        }
    }

    pub fn n_layer(&self) -> usize {
        self.tokens.len()
    }

    /// The router of `layer` picked `ids` (`n_used` per token, token-major,
    /// as ggml's top-k writes them). Nothing is counted if any id is bad.
    pub fn add(&mut self, layer: usize, ids: &[i32]) -> Result<(), RoutingError> {
        let n_layer = self.n_layer();
        if layer >= n_layer {
            return Err(RoutingError::Layer { layer, n_layer });
        }
        if !ids.len().is_multiple_of(self.n_used) {
            return Err(RoutingError::Ragged {
                n: ids.len(),
                n_used: self.n_used,
            });
        }
        if let Some(&id) = ids
            .iter()
            .find(|&&id| id < 0 || id as usize >= self.n_expert)
        {
            return Err(RoutingError::Expert {
                layer,
                id,
                n_expert: self.n_expert,
            });
        }
        let row = &mut self.counts[layer * self.n_expert..(layer + 1) * self.n_expert];
        for &id in ids {
            row[id as usize] += 1;
        }
        self.tokens[layer] += (ids.len() / self.n_used) as u64;
        Ok(())
    }

    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    /// Picks counted in `layer`.
    pub fn layer_picks(&self, layer: usize) -> u64 {
        self.row(layer).iter().sum()
    }

    /// Adds `other`'s counts (the same shape) to these.
    pub fn merge(&mut self, other: &RouterCounts) -> Result<(), RoutingError> {
        if other.n_expert != self.n_expert || other.n_layer() != self.n_layer() {
            return Err(RoutingError::Shape(format!(
                "{} layers of {} experts, these {} of {}",
                other.n_layer(),
                other.n_expert,
                self.n_layer(),
                self.n_expert
            )));
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        for (a, b) in self.tokens.iter_mut().zip(&other.tokens) {
            *a += b;
        }
        Ok(())
    }

    /// The counts as JSON, the form persisted beside a model.
    pub fn to_json(&self) -> String {
        let rows: Vec<&[u64]> = (0..self.n_layer()).map(|l| self.row(l)).collect();
        serde_json::json!({
            "format": COUNTS_FORMAT,
            "n_expert": self.n_expert,
            "n_used": self.n_used,
            "tokens": self.tokens,
            "counts": rows,
        })
        .to_string()
    }

    /// Reads [`RouterCounts::to_json`]'s form, refusing anything
    /// inconsistent (a file written for another model, or damaged).
    pub fn from_json(text: &str) -> Result<RouterCounts, RoutingError> {
        #[derive(serde::Deserialize)]
        struct Form {
            format: String,
            n_expert: usize,
            n_used: usize,
            tokens: Vec<u64>,
            counts: Vec<Vec<u64>>,
        }
        let f: Form = serde_json::from_str(text).map_err(|e| RoutingError::Shape(e.to_string()))?;
        if f.format != COUNTS_FORMAT {
            return Err(RoutingError::Shape(format!(
                "format '{}', not '{COUNTS_FORMAT}'",
                f.format
            )));
        }
        if f.n_expert == 0 || f.n_used == 0 || f.n_used > f.n_expert {
            return Err(RoutingError::Shape(format!(
                "{} of {} experts a token",
                f.n_used, f.n_expert
            )));
        }
        if f.tokens.len() != f.counts.len() || f.counts.iter().any(|r| r.len() != f.n_expert) {
            return Err(RoutingError::Shape(
                "a layer's counts are not one per expert".into(),
            ));
        }
        let mut c = RouterCounts::new(f.counts.len(), f.n_expert, f.n_used);
        c.counts = f.counts.concat();
        c.tokens = f.tokens;
        Ok(c)
    }

    /// Picks of `expert` in `layer`.
    pub fn count(&self, layer: usize, expert: usize) -> u64 {
        self.row(layer)[expert]
    }

    /// Picks counted, over every layer.
    pub fn picks(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn row(&self, layer: usize) -> &[u64] {
        &self.counts[layer * self.n_expert..(layer + 1) * self.n_expert]
    }

    /// The `k` most picked experts of `layer`, most picked first (ties: the
    /// lower index).
    pub fn hot(&self, layer: usize, k: usize) -> Vec<u32> {
        let row = self.row(layer);
        let mut idx: Vec<u32> = (0..self.n_expert as u32).collect();
        idx.sort_by(|&a, &b| row[b as usize].cmp(&row[a as usize]).then(a.cmp(&b)));
        idx.truncate(k.min(self.n_expert));
        idx
    }

    /// The share of all picks that went to the `k` most picked experts of
    /// their layer: the hit rate a hot set of `k` experts per layer, chosen
    /// from these counts, would have had on the steps counted (an upper
    /// bound for a set chosen before them).
    pub fn hit_rate(&self, k: usize) -> f64 {
        let total = self.picks();
        if total == 0 {
            return 0.0;
        }
        let hits: u64 = (0..self.n_layer())
            .map(|l| {
                let row = self.row(l);
                self.hot(l, k).iter().map(|&e| row[e as usize]).sum::<u64>()
            })
            .sum();
        hits as f64 / total as f64
    }

    /// What uniform routing would give a hot set of `k` experts: k / n.
    pub fn uniform_rate(&self, k: usize) -> f64 {
        k.min(self.n_expert) as f64 / self.n_expert.max(1) as f64
    }
}

impl std::fmt::Display for RouterCounts {
    /// The hit rates of hot sets of 1x, 2x and 4x the experts a token uses,
    /// and a quarter and a half of them, against uniform routing's.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tokens: u64 = self.tokens.iter().max().copied().unwrap_or(0);
        write!(
            f,
            "experts: {} picks over {} layers ({} tokens a layer at most); hit rate of the k most picked experts per layer (uniform routing's in brackets):",
            self.picks(),
            self.n_layer(),
            tokens
        )?;
        let mut ks = vec![
            self.n_used,
            2 * self.n_used,
            4 * self.n_used,
            self.n_expert / 4,
            self.n_expert / 2,
        ];
        ks.retain(|&k| k > 0 && k < self.n_expert);
        ks.sort_unstable();
        ks.dedup();
        for k in ks {
            write!(
                f,
                " k={k} {:.1}% ({:.1}%)",
                100.0 * self.hit_rate(k),
                100.0 * self.uniform_rate(k)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_hot_sets_and_hit_rates() {
        let mut c = RouterCounts::new(2, 4, 2);
        // layer 0: expert 3 in every token, 1 in two of three
        c.add(0, &[3, 1, 1, 3, 3, 0]).unwrap();
        c.add(1, &[2, 0]).unwrap();
        assert_eq!(c.picks(), 8);
        assert_eq!(c.hot(0, 2), vec![3, 1]);
        // ties go to the lower index
        assert_eq!(c.hot(1, 1), vec![0]);
        // k = 1: 3 picks of layer 0 and 1 of layer 1, of 8
        assert!((c.hit_rate(1) - 4.0 / 8.0).abs() < 1e-12);
        assert!((c.hit_rate(4) - 1.0).abs() < 1e-12);
        assert_eq!(c.uniform_rate(1), 0.25);
        let s = c.to_string();
        assert!(s.contains("8 picks over 2 layers"), "{s}");
    }

    #[test]
    fn counts_survive_json_and_bad_files_are_refused() {
        let mut c = RouterCounts::new(2, 4, 2);
        c.add(0, &[3, 1, 1, 3]).unwrap();
        c.add(1, &[2, 0]).unwrap();
        let back = RouterCounts::from_json(&c.to_json()).unwrap();
        assert_eq!(back, c);
        let mut twice = back.clone();
        twice.merge(&c).unwrap();
        assert_eq!(twice.count(0, 3), 4);
        assert_eq!(twice.layer_picks(1), 4);
        assert!(twice.merge(&RouterCounts::new(3, 4, 2)).is_err());
        for bad in [
            "",
            "{}",
            r#"{"format":"other","n_expert":4,"n_used":2,"tokens":[0],"counts":[[0,0,0,0]]}"#,
            r#"{"format":"strata-router-counts-1","n_expert":4,"n_used":2,"tokens":[0],"counts":[[0,0,0]]}"#,
            r#"{"format":"strata-router-counts-1","n_expert":4,"n_used":5,"tokens":[0],"counts":[[0,0,0,0]]}"#,
            r#"{"format":"strata-router-counts-1","n_expert":4,"n_used":2,"tokens":[],"counts":[[0,0,0,0]]}"#,
        ] {
            assert!(RouterCounts::from_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_ids_are_refused_and_count_nothing() {
        let mut c = RouterCounts::new(1, 4, 2);
        assert_eq!(
            c.add(0, &[0, 4]),
            Err(RoutingError::Expert {
                layer: 0,
                id: 4,
                n_expert: 4
            })
        );
        assert!(matches!(
            c.add(0, &[0, -1]),
            Err(RoutingError::Expert { .. })
        ));
        assert!(matches!(c.add(0, &[0]), Err(RoutingError::Ragged { .. })));
        assert!(matches!(c.add(1, &[0, 1]), Err(RoutingError::Layer { .. })));
        assert_eq!(c.picks(), 0);
    }

    proptest! {
        /// The hit rate grows with the hot set, from at least uniform's
        /// share (the most picked are never picked less than average) to 1.
        #[test]
        fn hit_rates_grow_from_uniform_to_one(
            n_expert in 1usize..64,
            n_used in 1usize..8,
            picks in proptest::collection::vec((0usize..3, 0usize..64), 1..300),
        ) {
            let n_used = n_used.min(n_expert);
            let mut c = RouterCounts::new(3, n_expert, n_used);
            for chunk in picks.chunks(n_used) {
                if chunk.len() == n_used {
                    let ids: Vec<i32> = chunk.iter().map(|&(_, e)| (e % n_expert) as i32).collect();
                    c.add(chunk[0].0, &ids).unwrap();
                }
            }
            let mut last = 0.0;
            for k in 0..=n_expert {
                let r = c.hit_rate(k);
                prop_assert!(r + 1e-12 >= last);
                if c.picks() > 0 {
                    prop_assert!(r + 1e-9 >= c.uniform_rate(k));
                }
                last = r;
            }
            if c.picks() > 0 {
                prop_assert!((c.hit_rate(n_expert) - 1.0).abs() < 1e-12);
            }
        }
    }
}
