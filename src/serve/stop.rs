//! Stop strings over streamed text, plain Rust.
//!
//! Generated text arrives in pieces. A piece is passed on only once no stop
//! string can begin inside it; text that could still turn into a stop
//! string is held back until the next piece decides. On a match the text
//! before the stop string is released and generation ends; the stop string
//! itself is never sent (OpenAI's semantics).

#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What to send after a piece of text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string matched: nothing more is generated.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        // the earliest match wins
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        // hold back the longest tail that begins some stop string
        let keep = self
            .stops
            .iter()
            .map(|s| longest_tail_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// The text held back when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Bytes of the longest suffix of `text` (at a char boundary) that is a
/// proper prefix of `stop`.
fn longest_tail_prefix(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.starts_with(&text[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn holds_back_what_may_become_a_stop_string() {
        let mut m = StopMatcher::new(vec!["\n\nUser:".into(), "END".into()]);
        assert_eq!(
            m.push("Hello"),
            Released {
                text: "Hello".into(),
                stopped: false
            }
        );
        assert_eq!(m.push(" wor\n").text, " wor");
        assert_eq!(m.push("\nUs").text, "");
        assert_eq!(
            m.push("a"),
            Released {
                text: "\n\nUsa".into(),
                stopped: false
            }
        );
        assert_eq!(m.push("xEN").text, "x");
        assert_eq!(
            m.push("Dtail"),
            Released {
                text: "".into(),
                stopped: true
            }
        );
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café").text, "caf");
        assert_eq!(m.flush(), "é");
    }

    proptest! {
        /// Whatever the split into pieces, the released text is the text
        /// up to the first stop string, or all of it.
        #[test]
        fn any_split_gives_the_same_text(
            text in "[ab\n]{0,40}",
            stop in "[ab\n]{1,4}",
            cuts in proptest::collection::vec(0usize..40, 0..8),
        ) {
            let want = match text.find(&stop) {
                Some(i) => (text[..i].to_string(), true),
                None => (text.clone(), false),
            };
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c < text.len()).collect();
            cuts.sort();
            cuts.dedup();
            let mut m = StopMatcher::new(vec![stop]);
            let mut got = String::new();
            let mut stopped = false;
            let mut last = 0;
            for c in cuts.into_iter().chain([text.len()]) {
                let r = m.push(&text[last..c]);
                got.push_str(&r.text);
                last = c;
                if r.stopped {
                    stopped = true;
                    break;
                }
            }
            if !stopped {
                got.push_str(&m.flush());
            }
            prop_assert_eq!((got, stopped), want);
        }
    }
}
