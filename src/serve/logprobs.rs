//! OpenAI's `logprobs`, `top_logprobs` and `logit_bias` on the wire:
//! checked out of a request, and the `logprobs` object of an answer built.
//!
//! The numbers are those of the distribution each token was sampled from
//! ([`crate::sample::Sampler::sampled_logprob`]); the engine loop computes
//! them only for requests that asked. Two shapes:
//!
//! - chat (`logprobs: true`, `top_logprobs: 0..=20`):
//!   `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
//!   "logprob", "bytes"}, ...]}, ...]}`, exactly `top_logprobs`
//!   alternatives per token;
//! - completions (`logprobs: N`, `0..=20`; OpenAI's legacy API stops at 5):
//!   `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...],
//!   "text_offset"}`, the N most likely tokens plus the chosen one when it
//!   is not among them (OpenAI: "up to logprobs+1 elements").
//!
//! A token's `token` is its text with special tokens named
//! (`<|im_end|>`), bytes that are not UTF-8 on their own (half a
//! character) as U+FFFD; `bytes` are its exact bytes. Logprobs of `-inf`
//! (a masked token) are sent as -9999, as vLLM does: JSON has no infinity.

use super::request::{ApiError, Endpoint};
use crate::sample::logprobs::{TokenLogprob, MAX_TOP_LOGPROBS};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;

/// One generated token's entry, as the engine loop sends it.
#[derive(Clone, Debug, PartialEq)]
pub struct LogprobEntry {
    pub lp: TokenLogprob,
    /// Characters of the answer's text before this token's text.
    pub text_offset: usize,
}

/// A sequence's entries on their way out with its text (the engine loop
/// keeps one per request that asked). Which tokens get an entry, as OpenAI
/// and vLLM answer: one per generated token that is part of the returned
/// text. An end-of-generation token ends the answer without text and gets
/// none (it never comes here); tokens cut off with a stop string get none,
/// except one whose text begins before the stop string (its text is
/// partly returned). An entry goes out with the piece of text its token's
/// first byte goes out in; a token with no text of its own (a special
/// token under `ignore_eos`, the first bytes of a character split over
/// tokens) with the next text, or at the end when the answer ends for
/// another reason than a stop string.
#[derive(Debug, Default)]
pub struct EntryQueue {
    /// Alternatives per token.
    top: usize,
    /// Entries not yet sent, with the byte offset (in the generated text)
    /// where their token's text begins.
    pending: VecDeque<(usize, LogprobEntry)>,
    /// Bytes and characters of generated text so far (what the stop
    /// matcher was given), and bytes of it sent.
    bytes: usize,
    chars: usize,
    sent: usize,
}

impl EntryQueue {
    /// For a request asking for `top` alternatives per token.
    pub fn new(top: usize) -> EntryQueue {
        EntryQueue {
            top,
            ..Default::default()
        }
    }

    /// Alternatives per token.
    pub fn top(&self) -> usize {
        self.top
    }

    /// A token was generated whose text is `piece` (after UTF-8 assembly,
    /// before stop strings).
    pub fn push(&mut self, lp: TokenLogprob, piece: &str) {
        let e = LogprobEntry {
            lp,
            text_offset: self.chars,
        };
        self.pending.push_back((self.bytes, e));
        self.bytes += piece.len();
        self.chars += piece.chars().count();
    }

    /// `n` more bytes of text go out: the entries of the tokens whose text
    /// begins in them.
    pub fn sent(&mut self, n: usize) -> Vec<LogprobEntry> {
        self.sent += n;
        let mut out = Vec::new();
        while let Some(p) = self.pending.pop_front() {
            if p.0 >= self.sent {
                self.pending.push_front(p);
                break;
            }
            out.push(p.1);
        }
        out
    }

    /// A stop string matched: what is not sent lies in it, and is not
    /// returned.
    pub fn cut(&mut self) {
        self.pending.clear();
    }

    /// The answer ends for another reason (its held text is sent): every
    /// entry left.
    pub fn finish(&mut self) -> Vec<LogprobEntry> {
        self.pending.drain(..).map(|p| p.1).collect()
    }
}

/// How many alternatives each token reports, or None when the request did
/// not ask for logprobs. Chat: `logprobs` true/false and `top_logprobs`
/// (which needs `logprobs: true`, as OpenAI says); completions: `logprobs`
/// a count (false or null: off).
pub fn parse_request(endpoint: Endpoint, body: &Value) -> Result<Option<usize>, ApiError> {
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    let count = |k: &str, v: &Value| {
        v.as_u64()
            .filter(|&n| n <= MAX_TOP_LOGPROBS as u64)
            .map(|n| n as usize)
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "{k} must be an integer in 0..={MAX_TOP_LOGPROBS}, got {v}"
                ))
            })
    };
    match endpoint {
        Endpoint::Chat => {
            let on = match get("logprobs") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::bad(format!(
                        "logprobs must be true or false on /v1/chat/completions \
                         (top_logprobs: N asks for N alternatives), got {v}"
                    )))
                }
            };
            let top = match get("top_logprobs") {
                None => 0,
                Some(v) => count("top_logprobs", v)?,
            };
            if top > 0 && !on {
                return Err(ApiError::bad("top_logprobs needs logprobs: true"));
            }
            Ok(on.then_some(top))
        }
        Endpoint::Completion => match get("logprobs") {
            // false: off, as the refusal check lets it pass
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => count("logprobs", v).map(Some),
        },
    }
}

/// Largest bias OpenAI allows, either way.
const MAX_BIAS: f64 = 100.0;

/// `logit_bias`: an object of token ids (as strings, as OpenAI sends them)
/// to biases in [-100, 100]. Each key must be a token id of the model's
/// vocabulary (`0..n_vocab`), named once ("42" and "042" are one
/// token: refused). Sorted by id; zero biases dropped.
pub fn parse_logit_bias(v: Option<&Value>, n_vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::bad(
                "logit_bias must be an object of token ids to biases, as {\"42\": -100}",
            ))
        }
    };
    let mut out: Vec<(u32, f32, &str)> = Vec::with_capacity(obj.len());
    for (k, v) in obj {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < n_vocab)
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "logit_bias: the key {k:?} is not a token id of this model (0..{n_vocab})"
                ))
            })?;
        let b = v
            .as_f64()
            .filter(|b| (-MAX_BIAS..=MAX_BIAS).contains(b))
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "logit_bias: the bias of {k:?} must be a number in [-100, 100], got {v}"
                ))
            })?;
        out.push((id, b as f32, k));
    }
    out.sort_by_key(|e| e.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::bad(format!(
            "logit_bias: the keys {:?} and {:?} name the same token",
            w[0].2, w[1].2
        )));
    }
    Ok(out
        .into_iter()
        .filter(|e| e.1 != 0.0)
        .map(|e| (e.0, e.1))
        .collect())
}

/// A logprob as JSON: finite, -9999 for `-inf`.
fn num(lp: f32) -> f32 {
    lp.max(-9999.0)
}

/// The `logprobs` object of an answer (or a chunk) holding `entries`.
/// `piece` gives a token's bytes.
pub fn answer_json(
    endpoint: Endpoint,
    entries: &[LogprobEntry],
    piece: &dyn Fn(u32) -> Vec<u8>,
) -> Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match endpoint {
        Endpoint::Chat => {
            let one = |t: u32, lp: f32| {
                let b = piece(t);
                json!({"token": text(&b), "logprob": num(lp), "bytes": b})
            };
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = one(e.lp.token, e.lp.logprob);
                    v["top_logprobs"] = e.lp.top.iter().map(|&(t, l)| one(t, l)).collect();
                    v
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completion => {
            let mut tokens = Vec::with_capacity(entries.len());
            let mut logprobs = Vec::with_capacity(entries.len());
            let mut tops = Vec::with_capacity(entries.len());
            let mut offsets = Vec::with_capacity(entries.len());
            for e in entries {
                tokens.push(text(&piece(e.lp.token)));
                logprobs.push(num(e.lp.logprob));
                let mut top = Map::new();
                for &(t, l) in &e.lp.top {
                    top.insert(text(&piece(t)), json!(num(l)));
                }
                // the chosen token is always there (OpenAI: up to N + 1)
                if !e.lp.top.iter().any(|x| x.0 == e.lp.token) {
                    top.insert(text(&piece(e.lp.token)), json!(num(e.lp.logprob)));
                }
                tops.push(Value::Object(top));
                offsets.push(e.text_offset);
            }
            json!({
                "tokens": tokens,
                "token_logprobs": logprobs,
                "top_logprobs": tops,
                "text_offset": offsets,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn logprob_fields_parse_per_endpoint() {
        let chat = |s: &str| parse_request(Endpoint::Chat, &body(s));
        let cmpl = |s: &str| parse_request(Endpoint::Completion, &body(s));
        assert_eq!(chat("{}").unwrap(), None);
        assert_eq!(chat(r#"{"logprobs":false}"#).unwrap(), None);
        assert_eq!(
            chat(r#"{"logprobs":false,"top_logprobs":0}"#).unwrap(),
            None
        );
        assert_eq!(chat(r#"{"logprobs":true}"#).unwrap(), Some(0));
        assert_eq!(
            chat(r#"{"logprobs":true,"top_logprobs":20}"#).unwrap(),
            Some(20)
        );
        assert_eq!(
            chat(r#"{"logprobs":null,"top_logprobs":null}"#).unwrap(),
            None
        );
        for (b, says) in [
            (r#"{"logprobs":true,"top_logprobs":21}"#, "0..=20"),
            (r#"{"logprobs":true,"top_logprobs":-1}"#, "top_logprobs"),
            (r#"{"logprobs":true,"top_logprobs":2.5}"#, "top_logprobs"),
            (r#"{"top_logprobs":3}"#, "needs logprobs: true"),
            (r#"{"logprobs":false,"top_logprobs":3}"#, "needs logprobs"),
            (r#"{"logprobs":3}"#, "true or false"),
        ] {
            let e = chat(b).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{b}: {}", e.message);
        }
        assert_eq!(cmpl("{}").unwrap(), None);
        assert_eq!(cmpl(r#"{"logprobs":false}"#).unwrap(), None);
        assert_eq!(cmpl(r#"{"logprobs":0}"#).unwrap(), Some(0));
        assert_eq!(cmpl(r#"{"logprobs":5}"#).unwrap(), Some(5));
        assert_eq!(cmpl(r#"{"logprobs":20}"#).unwrap(), Some(20));
        for b in [
            r#"{"logprobs":21}"#,
            r#"{"logprobs":true}"#,
            r#"{"logprobs":"5"}"#,
        ] {
            let e = cmpl(b).unwrap_err();
            assert!(e.message.contains("logprobs must be"), "{b}: {}", e.message);
        }
    }

    #[test]
    fn logit_bias_keys_and_values_are_checked() {
        let p = |s: &str| parse_logit_bias(Some(&body(s)), 1000);
        assert_eq!(p("{}").unwrap(), vec![]);
        assert_eq!(parse_logit_bias(None, 1000).unwrap(), vec![]);
        assert_eq!(
            p(r#"{"42":-100,"7":5.5,"999":100,"3":0}"#).unwrap(),
            vec![(7, 5.5), (42, -100.0), (999, 100.0)]
        );
        // one token named twice
        let e = p(r#"{"42":1,"042":2}"#).unwrap_err();
        assert!(
            e.message.contains("\"042\"") && e.message.contains("same token"),
            "{}",
            e.message
        );
        for (b, names) in [
            (r#"{"1000":1}"#, "\"1000\""),
            (r#"{"-1":1}"#, "\"-1\""),
            (r#"{"abc":1}"#, "\"abc\""),
            (r#"{"":1}"#, "\"\""),
            (r#"{"4294967296":1}"#, "\"4294967296\""),
            (r#"{"5":101}"#, "\"5\""),
            (r#"{"5":-100.5}"#, "\"5\""),
            (r#"{"5":"1"}"#, "\"5\""),
            (r#"{"5":null}"#, "\"5\""),
        ] {
            let e = p(b).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains(names) && e.message.contains("logit_bias"),
                "{b}: {}",
                e.message
            );
        }
        assert!(parse_logit_bias(Some(&body("[1,2]")), 10).is_err());
    }

    /// Tokens through a stop matcher: an entry goes out with the text its
    /// token begins in, none for tokens inside a stop string, and tokens
    /// of no text of their own with the next text or at the end.
    #[test]
    fn entries_go_out_with_their_text() {
        use crate::serve::stop::StopMatcher;
        let lp = |token| TokenLogprob {
            token,
            logprob: -1.0,
            top: Vec::new(),
        };
        // (token, piece): token 3 has no text of its own
        let run = |stops: Vec<String>, pieces: &[(u32, &str)]| {
            let mut q = EntryQueue::new(0);
            let mut m = StopMatcher::new(stops);
            let mut out: Vec<(String, Vec<(u32, usize)>)> = Vec::new();
            let ids = |es: Vec<LogprobEntry>| -> Vec<(u32, usize)> {
                es.iter().map(|e| (e.lp.token, e.text_offset)).collect()
            };
            for &(t, p) in pieces {
                q.push(lp(t), p);
                let r = m.push(p);
                let es = ids(q.sent(r.text.len()));
                out.push((r.text, es));
                if r.stopped {
                    q.cut();
                    return out;
                }
            }
            let rest = m.flush();
            let es = ids(q.finish());
            out.push((rest, es));
            out
        };
        let pieces = [(1, "Hel"), (2, "lo"), (3, ""), (4, " wor"), (5, "ld")];
        let s = |x: &str| x.to_string();
        // no stop strings: each with its own text, 3 with 4's
        assert_eq!(
            run(vec![], &pieces),
            vec![
                (s("Hel"), vec![(1, 0)]),
                (s("lo"), vec![(2, 3)]),
                (s(""), vec![]),
                (s(" wor"), vec![(3, 5), (4, 5)]),
                (s("ld"), vec![(5, 9)]),
                (s(""), vec![]),
            ]
        );
        // "lo w" held back from token 2 on, then cut: 1 and 2 (whose text
        // "l" begins before the stop string "o w"), not 3 and 4
        assert_eq!(
            run(vec![s("o w")], &pieces),
            vec![
                (s("Hel"), vec![(1, 0)]),
                (s("l"), vec![(2, 3)]),
                (s(""), vec![]),
                (s(""), vec![]),
            ]
        );
        // a stop string that never comes: the held text and its entries
        // go out at the end, a trailing textless token too
        let pieces = [(1, "a"), (2, "b"), (3, "")];
        assert_eq!(
            run(vec![s("bc")], &pieces),
            vec![
                (s("a"), vec![(1, 0)]),
                (s(""), vec![]),
                (s(""), vec![]),
                (s("b"), vec![(2, 1), (3, 2)]),
            ]
        );
    }

    #[test]
    fn answers_have_openai_shapes() {
        let piece = |t: u32| match t {
            1 => b"Hi".to_vec(),
            2 => vec![0xe2, 0x80],
            _ => format!("<{t}>").into_bytes(),
        };
        let entries = vec![
            LogprobEntry {
                lp: TokenLogprob {
                    token: 1,
                    logprob: -0.5,
                    top: vec![(1, -0.5), (3, -1.5)],
                },
                text_offset: 0,
            },
            LogprobEntry {
                lp: TokenLogprob {
                    token: 2,
                    logprob: f32::NEG_INFINITY,
                    top: vec![(3, -0.25)],
                },
                text_offset: 2,
            },
        ];
        let c = answer_json(Endpoint::Chat, &entries, &piece);
        let c0 = &c["content"][0];
        assert_eq!(c0["token"], "Hi");
        assert_eq!(c0["logprob"], -0.5);
        assert_eq!(c0["bytes"], json!([72, 105]));
        assert_eq!(c0["top_logprobs"][1]["token"], "<3>");
        assert_eq!(c0["top_logprobs"][1]["logprob"], -1.5);
        assert_eq!(c0["top_logprobs"].as_array().unwrap().len(), 2);
        let c1 = &c["content"][1];
        assert_eq!(c1["bytes"], json!([0xe2, 0x80]));
        assert_eq!(c1["token"], "\u{fffd}");
        assert_eq!(c1["logprob"], -9999.0);
        let t = answer_json(Endpoint::Completion, &entries, &piece);
        assert_eq!(t["tokens"], json!(["Hi", "\u{fffd}"]));
        assert_eq!(t["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(t["text_offset"], json!([0, 2]));
        assert_eq!(t["top_logprobs"][0], json!({"Hi": -0.5, "<3>": -1.5}));
        // the chosen token joins its alternatives
        assert_eq!(
            t["top_logprobs"][1],
            json!({"<3>": -0.25, "\u{fffd}": -9999.0})
        );
        let empty = answer_json(Endpoint::Chat, &[], &piece);
        assert_eq!(empty, json!({"content": []}));
    }
}
