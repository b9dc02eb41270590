//! Acceptance traces: what a real target and drafter accepted, round by
//! round, recorded on one model and replayed on another.
//!
//! A synthetic model has random weights, so its own acceptance means
//! nothing; a real pair's does. `strata bench --spec-record FILE` writes,
//! per round, the shape of the drafts (each node's parent; a chain is a
//! tree of one child per node) and the nodes the target accepted.
//! `--spec-replay FILE` runs rounds of those shapes on another model: the
//! draft model grows a tree of the recorded shape for real
//! ([`super::DraftModel::draft_shaped`]), the target verifies it in one
//! step, the sampler draws from every row it would, the rejected nodes are
//! rolled back; only the decision of which nodes are accepted follows the
//! recording. Its tokens per second are measured end to end at the real
//! pair's acceptance.

use super::tree::DraftTree;

/// The format tag of a trace file.
pub const TRACE_FORMAT: &str = "strata-spec-trace-1";

/// One recorded round.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRound {
    /// What the prompt was ("code", "chat").
    pub cat: String,
    /// Each node's parent (-1: a child of the root), parents first.
    pub parents: Vec<i32>,
    /// The accepted nodes, root to leaf.
    pub path: Vec<u32>,
}

impl TraceRound {
    /// The round of `tree` that accepted `path`.
    pub fn of(cat: &str, tree: &DraftTree, path: &[usize]) -> TraceRound {
        TraceRound {
            cat: cat.to_string(),
            parents: tree
                .nodes
                .iter()
                .map(|n| n.parent.map_or(-1, |p| p as i32))
                .collect(),
            path: path.iter().map(|&i| i as u32).collect(),
        }
    }
    /// The parents as indices (None: the root's child).
    pub fn parent_indices(&self) -> Vec<Option<usize>> {
        self.parents
            .iter()
            .map(|&p| usize::try_from(p).ok())
            .collect()
    }
    /// Whether every node has at most one child.
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i as i32 - 1)
    }

    fn check(&self) -> Result<(), String> {
        for (i, &p) in self.parents.iter().enumerate() {
            if p < -1 || p >= i as i32 {
                return Err(format!("node {i} has parent {p}, not an earlier node"));
            }
        }
        let mut at = -1i32;
        for &n in &self.path {
            match self.parents.get(n as usize) {
                Some(&p) if p == at => at = n as i32,
                _ => return Err(format!("accepted node {n} is not a child of {at}")),
            }
        }
        Ok(())
    }
}

/// A recorded run: the pair that made it, and its rounds in order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AcceptTrace {
    pub format: String,
    /// The target and the drafter, in words.
    pub pair: String,
    pub rounds: Vec<TraceRound>,
}

impl AcceptTrace {
    pub fn new(pair: &str) -> AcceptTrace {
        AcceptTrace {
            format: TRACE_FORMAT.to_string(),
            pair: pair.to_string(),
            rounds: Vec::new(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain JSON")
    }

    /// Reads [`AcceptTrace::to_json`]'s form, refusing anything else with
    /// the reason: another format, a node whose parent does not come
    /// before it, an accepted path that is not a path of its tree.
    pub fn from_json(text: &str) -> Result<AcceptTrace, String> {
        let t: AcceptTrace = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if t.format != TRACE_FORMAT {
            return Err(format!("format '{}', not '{TRACE_FORMAT}'", t.format));
        }
        if t.rounds.is_empty() {
            return Err("no rounds".to_string());
        }
        for (i, r) in t.rounds.iter().enumerate() {
            r.check().map_err(|e| format!("round {i}: {e}"))?;
        }
        Ok(t)
    }

    /// Accepted tokens per target step (the accepted drafts plus the
    /// target's own token), over the rounds of category `cat` (all: None).
    pub fn tokens_per_step(&self, cat: Option<&str>) -> f64 {
        let r: Vec<&TraceRound> = self
            .rounds
            .iter()
            .filter(|r| cat.is_none_or(|c| r.cat == c))
            .collect();
        1.0 + r.iter().map(|r| r.path.len()).sum::<usize>() as f64 / r.len().max(1) as f64
    }
}

/// Rounds of a trace handed out in order, from the start again when they
/// run out; only the rounds of one category where asked.
#[derive(Clone, Debug)]
pub struct Replay {
    rounds: Vec<TraceRound>,
    /// The order rounds are handed out in (indices into `rounds`).
    order: Vec<usize>,
    at: usize,
}

impl Replay {
    /// The rounds of `trace` of category `cat` (all: None); None if there
    /// are none.
    pub fn new(trace: &AcceptTrace, cat: Option<&str>) -> Option<Replay> {
        let rounds: Vec<TraceRound> = trace
            .rounds
            .iter()
            .filter(|r| cat.is_none_or(|c| r.cat == c))
            .cloned()
            .collect();
        let order = (0..rounds.len()).collect();
        (!rounds.is_empty()).then_some(Replay {
            rounds,
            order,
            at: 0,
        })
    }

    /// [`Replay::new`], for a run of about `tokens` tokens: rounds spread
    /// evenly over the whole trace (every s-th round, then the ones after
    /// those, ...), so a run shorter than the recording sees its mix of
    /// easy and hard passages, not only its first prompts.
    pub fn spread(trace: &AcceptTrace, cat: Option<&str>, tokens: usize) -> Option<Replay> {
        let mut r = Replay::new(trace, cat)?;
        let n = r.rounds.len();
        let per = 1.0 + r.rounds.iter().map(|x| x.path.len()).sum::<usize>() as f64 / n as f64;
        let used = ((tokens as f64 / per).ceil() as usize).max(1);
        let stride = (n / used).max(1);
        r.order = (0..stride)
            .flat_map(|off| (off..n).step_by(stride))
            .collect();
        Some(r)
    }

    pub fn next_round(&mut self) -> TraceRound {
        let r = self.rounds[self.order[self.at % self.order.len()]].clone();
        self.at += 1;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> DraftTree {
        let mut t = DraftTree::default();
        let a = t.add(None, 5, 0.0);
        t.add(None, 6, 0.0);
        t.add(a, 7, 0.0);
        t
    }

    #[test]
    fn traces_round_trip_and_bad_ones_are_refused() {
        let mut tr = AcceptTrace::new("target + draft");
        tr.rounds.push(TraceRound::of("code", &tree(), &[0, 2]));
        tr.rounds
            .push(TraceRound::of("chat", &DraftTree::chain(&[1, 2, 3]), &[]));
        let back = AcceptTrace::from_json(&tr.to_json()).unwrap();
        assert_eq!(back, tr);
        assert_eq!(back.rounds[0].parents, vec![-1, -1, 0]);
        assert!(back.rounds[1].is_chain() && !back.rounds[0].is_chain());
        assert!((tr.tokens_per_step(Some("code")) - 3.0).abs() < 1e-12);
        assert!((tr.tokens_per_step(None) - 2.0).abs() < 1e-12);
        let bad = |f: &dyn Fn(&mut AcceptTrace)| {
            let mut t = tr.clone();
            f(&mut t);
            AcceptTrace::from_json(&t.to_json()).unwrap_err()
        };
        assert!(bad(&|t| t.format = "x".into()).contains("format"));
        assert!(bad(&|t| t.rounds.clear()).contains("no rounds"));
        assert!(bad(&|t| t.rounds[0].parents[0] = 0).contains("round 0: node 0"));
        // node 1 is a child of the root, not of node 0
        assert!(bad(&|t| t.rounds[0].path = vec![0, 1]).contains("accepted node 1"));
        assert!(bad(&|t| t.rounds[0].path = vec![9]).contains("accepted node 9"));
        assert!(AcceptTrace::from_json("{").is_err());
    }

    #[test]
    fn replay_cycles_through_a_category() {
        let mut tr = AcceptTrace::new("p");
        for (c, n) in [("code", 1usize), ("chat", 2), ("code", 3)] {
            tr.rounds
                .push(TraceRound::of(c, &DraftTree::chain(&vec![0; n]), &[]));
        }
        let mut r = Replay::new(&tr, Some("code")).unwrap();
        let lens: Vec<usize> = (0..4).map(|_| r.next_round().parents.len()).collect();
        assert_eq!(lens, vec![1, 3, 1, 3]);
        assert!(Replay::new(&tr, Some("prose")).is_none());
    }

    #[test]
    fn a_short_replay_spreads_over_the_trace() {
        let mut tr = AcceptTrace::new("p");
        // 10 rounds of a 1-node chain, each accepting its node: 2 tokens a
        // round; 6 tokens use 3 rounds, every third
        for n in 1..=10 {
            tr.rounds
                .push(TraceRound::of("code", &DraftTree::chain(&vec![0; n]), &[0]));
        }
        let mut r = Replay::spread(&tr, None, 6).unwrap();
        let lens: Vec<usize> = (0..10).map(|_| r.next_round().parents.len()).collect();
        assert_eq!(lens, vec![1, 4, 7, 10, 2, 5, 8, 3, 6, 9]);
        // a run as long as the recording takes the rounds in order
        let mut r = Replay::spread(&tr, None, 20).unwrap();
        assert_eq!(r.next_round().parents.len(), 1);
        assert_eq!(r.next_round().parents.len(), 2);
    }
}
