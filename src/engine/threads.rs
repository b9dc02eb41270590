//! How many CPU threads a step computes with when the machine is shared.
//! Plain Rust.
//!
//! ggml's thread pool meets at a barrier after every operation, and strata
//! runs one graph per layer group, so when another process takes a core
//! the pool waits, at every meeting, for the thread the scheduler took off
//! it: on the 2-core development machine with one core busy, two threads
//! decoded at 7.65 tokens/s where one decoded at 13.36 (BENCHMARKS.md, "CPU
//! decode beside a busy process"). The tuner starts with every thread the
//! user allowed and now and then tries one step of the ladder below or
//! above for a few steps, moving when the trial is clearly faster. Trials
//! that lose come ever more rarely (at most one step in 64 once settled),
//! and a step that is much slower than usual, as when a neighbour starts,
//! brings the next trial forward.
//!
//! Steps are compared with steps of the same size only (their time depends
//! on it), as the ratio of a trial step's time to the median of the
//! current count's recent steps of that size.

use std::collections::{HashMap, VecDeque};

/// Steps between trials at first and after a move.
const PERIOD_MIN: u32 = 32;
/// Steps between trials once every trial has lost for a while.
const PERIOD_MAX: u32 = 1024;
/// Comparable steps a trial needs before it is judged.
const TRIAL_SAMPLES: usize = 3;
/// A trial is given up after this many steps without enough comparable
/// ones (the step sizes kept changing).
const TRIAL_STEPS_MAX: u32 = 12;
/// Trial over current step time (median) below which the tuner moves.
const MOVE_BELOW: f64 = 0.92;
/// Steps of the current count kept per step size.
const HISTORY: usize = 16;
/// A step this much slower than its size's median counts towards an early
/// trial; this many in a row bring it forward.
const SLOW: f64 = 1.3;
const SLOW_RUN: u32 = 4;
/// Only steps of at most this many tokens are compared (decode-sized:
/// larger steps come rarely and vary in size).
pub const MAX_TOKENS: usize = 64;

/// The thread counts tried: the most allowed, one fewer, then halving down
/// to one (16: 16, 15, 8, 4, 2, 1), so a core taken by a neighbour costs a
/// single step down the ladder.
pub fn ladder(max: usize) -> Vec<usize> {
    let max = max.max(1);
    let mut l = vec![max];
    if max > 2 {
        l.push(max - 1);
    }
    let mut t = max / 2;
    while t >= 1 {
        if t < *l.last().expect("not empty") {
            l.push(t);
        }
        t /= 2;
    }
    l
}

#[derive(Clone, Debug)]
enum State {
    Settled {
        until_trial: u32,
    },
    Trial {
        at: usize,
        samples: Vec<f64>,
        steps: u32,
    },
}

/// Chooses the thread count step by step from the times of the steps.
#[derive(Clone, Debug)]
pub struct ThreadTuner {
    ladder: Vec<usize>,
    /// Index into `ladder` of the count in use outside trials.
    cur: usize,
    /// Recent step times of the current count, per step size.
    history: HashMap<usize, VecDeque<f64>>,
    state: State,
    period: u32,
    /// The next trial goes up the ladder (more threads) when true.
    up_next: bool,
    slow_run: u32,
    /// The pools' polling level (a move makes a new pool).
    pub poll: u32,
    /// Moves made, for reports and tests.
    pub moves: u32,
    /// Trials judged.
    pub trials: u32,
}

impl ThreadTuner {
    pub fn new(max: usize) -> ThreadTuner {
        ThreadTuner {
            poll: 50,
            ladder: ladder(max),
            cur: 0,
            history: HashMap::new(),
            state: State::Settled {
                until_trial: PERIOD_MIN,
            },
            period: PERIOD_MIN,
            up_next: false,
            slow_run: 0,
            moves: 0,
            trials: 0,
        }
    }

    /// Threads for the next step.
    pub fn threads(&self) -> usize {
        match &self.state {
            State::Trial { at, .. } => self.ladder[*at],
            State::Settled { .. } => self.ladder[self.cur],
        }
    }

    /// The count in use outside trials.
    pub fn settled(&self) -> usize {
        self.ladder[self.cur]
    }

    fn median_of(&self, n: usize) -> Option<f64> {
        let h = self.history.get(&n)?;
        if h.len() < TRIAL_SAMPLES {
            return None;
        }
        let mut v: Vec<f64> = h.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    fn remember(&mut self, n: usize, secs: f64) {
        let h = self.history.entry(n).or_default();
        h.push_back(secs);
        if h.len() > HISTORY {
            h.pop_front();
        }
    }

    /// A trial's neighbour on the ladder, alternating down and up where
    /// both exist.
    fn next_trial(&mut self) -> Option<usize> {
        let down = (self.cur + 1 < self.ladder.len()).then_some(self.cur + 1);
        let up = self.cur.checked_sub(1);
        let pick = match (down, up) {
            (Some(d), Some(u)) => Some(if self.up_next { u } else { d }),
            (d, u) => d.or(u),
        };
        self.up_next = !self.up_next;
        pick
    }

    /// A step of `n_tokens` took `secs` with `self.threads()` threads.
    /// Returns the count for the next step where it changes.
    pub fn observe(&mut self, n_tokens: usize, secs: f64) -> Option<usize> {
        let before = self.threads();
        if n_tokens == 0 || n_tokens > MAX_TOKENS || !(secs.is_finite() && secs > 0.0) {
            return None;
        }
        let median = self.median_of(n_tokens);
        match &mut self.state {
            State::Settled { until_trial } => {
                *until_trial = until_trial.saturating_sub(1);
                // a neighbour may have started: look sooner
                if median.is_some_and(|m| secs > SLOW * m) {
                    self.slow_run += 1;
                    if self.slow_run >= SLOW_RUN {
                        // judge the trial against the new times only
                        *until_trial = (*until_trial).min(TRIAL_SAMPLES as u32 + 1);
                        self.period = PERIOD_MIN;
                        self.slow_run = 0;
                        self.history.clear();
                    }
                } else {
                    self.slow_run = 0;
                }
                let due = *until_trial == 0;
                self.remember(n_tokens, secs);
                if due {
                    match self.next_trial() {
                        Some(at) => {
                            self.state = State::Trial {
                                at,
                                samples: Vec::new(),
                                steps: 0,
                            }
                        }
                        None => {
                            self.state = State::Settled {
                                until_trial: PERIOD_MAX,
                            }
                        }
                    }
                }
            }
            State::Trial { at, samples, steps } => {
                *steps += 1;
                if let Some(m) = median {
                    samples.push(secs / m);
                }
                let (at, done, gave_up) = (
                    *at,
                    samples.len() >= TRIAL_SAMPLES,
                    *steps >= TRIAL_STEPS_MAX,
                );
                if done {
                    let mut r = samples.clone();
                    r.sort_by(f64::total_cmp);
                    let ratio = r[r.len() / 2];
                    self.trials += 1;
                    if ratio < MOVE_BELOW {
                        // keep going the way that paid
                        self.up_next = at < self.cur;
                        self.cur = at;
                        self.moves += 1;
                        self.history.clear();
                        self.period = PERIOD_MIN;
                    } else {
                        self.period = (self.period * 2).min(PERIOD_MAX);
                    }
                    self.state = State::Settled {
                        until_trial: self.period,
                    };
                } else if gave_up {
                    self.state = State::Settled {
                        until_trial: self.period,
                    };
                }
            }
        }
        let after = self.threads();
        (after != before).then_some(after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ladders() {
        assert_eq!(ladder(1), vec![1]);
        assert_eq!(ladder(2), vec![2, 1]);
        assert_eq!(ladder(4), vec![4, 3, 2, 1]);
        assert_eq!(ladder(16), vec![16, 15, 8, 4, 2, 1]);
        assert_eq!(ladder(6), vec![6, 5, 3, 1]);
    }

    /// Runs `steps` one-token steps on a machine where `t` threads take
    /// `cost(t)` seconds a step; the counts used, step by step.
    fn run(t: &mut ThreadTuner, steps: usize, cost: impl Fn(usize) -> f64) -> Vec<usize> {
        (0..steps)
            .map(|_| {
                let n = t.threads();
                t.observe(1, cost(n));
                n
            })
            .collect()
    }

    #[test]
    fn a_busy_core_moves_it_down_and_an_idle_machine_keeps_every_thread() {
        // the development machine with one core busy: 2 threads 0.131 s a
        // token, 1 thread 0.075
        let busy = |n: usize| if n == 2 { 0.131 } else { 0.075 };
        let mut t = ThreadTuner::new(2);
        let used = run(&mut t, 200, busy);
        assert_eq!(t.settled(), 1);
        // it moved at its first trial, then stays down but for rare trials
        assert!(used[..40].contains(&1));
        let twos = used[100..].iter().filter(|&&n| n == 2).count();
        assert!(twos <= 6, "{twos} two-thread steps of 100 after settling");
        // idle: 2 threads twice as fast; trials of one thread are rare
        let idle = |n: usize| 0.1 / n as f64;
        let mut t = ThreadTuner::new(2);
        let used = run(&mut t, 2000, idle);
        assert_eq!(t.settled(), 2);
        let ones = used.iter().filter(|&&n| n == 1).count();
        assert!(ones <= 30, "{ones} one-thread steps of 2000");
        assert_eq!(t.moves, 0);
    }

    #[test]
    fn a_neighbour_leaving_brings_the_threads_back() {
        let mut t = ThreadTuner::new(2);
        run(&mut t, 300, |n| if n == 2 { 0.131 } else { 0.075 });
        assert_eq!(t.settled(), 1);
        // the other core frees: two threads are faster again
        run(&mut t, 400, |n| 0.1 / n as f64);
        assert_eq!(t.settled(), 2);
    }

    #[test]
    fn a_neighbour_arriving_is_noticed_soon() {
        let mut t = ThreadTuner::new(2);
        // settled long enough for trials to be rare
        run(&mut t, 3000, |n| 0.1 / n as f64);
        assert_eq!(t.settled(), 2);
        // from now on 2 threads are slow: within a few dozen steps, 1
        let used = run(&mut t, 60, |n| if n == 2 { 0.4 } else { 0.1 });
        assert_eq!(t.settled(), 1, "{used:?}");
    }

    #[test]
    fn steps_of_other_sizes_are_not_compared() {
        let mut t = ThreadTuner::new(2);
        // one-token steps with 2 threads, then trials see only 7-token
        // steps: nothing to compare, nothing moves
        run(&mut t, PERIOD_MIN as usize, |_| 0.1);
        let seven = |t: &mut ThreadTuner| {
            let n = t.threads();
            t.observe(7, if n == 1 { 0.01 } else { 1.0 });
            n
        };
        let trial: Vec<usize> = (0..TRIAL_STEPS_MAX).map(|_| seven(&mut t)).collect();
        // the whole trial ran on one thread and was given up, unjudged
        assert!(trial.iter().all(|&n| n == 1), "{trial:?}");
        assert_eq!((t.moves, t.trials, t.threads()), (0, 0, 2));
        // back at 2 threads the 7-token steps build their own history,
        // and the next trial, judged on it, moves
        for _ in 0..PERIOD_MIN + TRIAL_SAMPLES as u32 {
            seven(&mut t);
        }
        assert_eq!((t.moves, t.settled()), (1, 1));
        // big steps are ignored altogether
        assert_eq!(t.observe(MAX_TOKENS + 1, 5.0), None);
    }

    proptest! {
        /// Whatever the times, the count stays on the ladder, and a trial
        /// or a move only ever goes one rung.
        #[test]
        fn counts_stay_on_the_ladder(
            max in 1usize..64,
            times in proptest::collection::vec((1usize..80, 0.0f64..1.0), 1..400),
        ) {
            let mut t = ThreadTuner::new(max);
            let l = ladder(max);
            for (n, s) in times {
                let before = t.settled();
                let now = t.threads();
                prop_assert!(l.contains(&now));
                t.observe(n, s);
                let i = |x: usize| l.iter().position(|&y| y == x).unwrap() as i64;
                prop_assert!((i(t.threads()) - i(before)).abs() <= 1);
                prop_assert!((i(t.settled()) - i(before)).abs() <= 1);
            }
        }
    }
}
