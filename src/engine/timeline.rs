//! A timeline of copies and computations per stream, for `strata bench`
//! and its Chrome-trace output.
//!
//! On a GPU each operation is bracketed by two events recorded on its
//! stream; one watcher thread per stream waits for them in order and notes
//! when each completed, which is when the operation started and ended on
//! the device (within the wake-up latency of the watcher). The streams run
//! undisturbed. On the CPU backend operations are synchronous and are timed
//! on the host directly.
//!
//! A watcher learns an event's time when it wakes: held up (by a CUDA
//! graph capture, which ggml does on a graph's second unchanged run, or on
//! a busy CPU), it times the operations it then catches up on as ending
//! together, a few microseconds long, and their time shows as a gap
//! before them (two H200s, runs 104 and 107; run 110's trace of a step
//! whose graphs were replayed has none). Read a shape's later steps.
//!
//! The engine's parts share one [`Recorder`]: an operation is recorded by
//! holding a [`Scope`] while it is enqueued, and nothing is recorded (or
//! formatted) while no timeline is on.

use crate::ggml::{Backend, Device, Event};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    Copy,
    Compute,
    /// Host-timed: a draft model proposing tokens (speculative decoding).
    Draft,
    /// Host-timed: layer groups the CPU computes (hybrid decode).
    Cpu,
    /// Host-timed: a step's own host work before its groups run (its
    /// inputs written), on a track of its own: it is not computation.
    Host,
}

/// One operation on one stream.
#[derive(Clone, Debug)]
pub struct Span {
    pub stream: Stream,
    /// The part of the model (its device, in layer order) the operation
    /// belongs to: 0 but for a model split across devices.
    pub device: usize,
    pub name: String,
    /// Seconds since the timeline started.
    pub start: f64,
    pub end: f64,
    pub bytes: u64,
}

struct Pending {
    name: String,
    bytes: u64,
    begin: Event,
    end: Event,
}

struct Watcher {
    tx: Sender<Pending>,
    handle: JoinHandle<()>,
}

pub struct Timeline {
    t0: Instant,
    part: usize,
    spans: Arc<Mutex<Vec<Span>>>,
    device: Option<Device>,
    watchers: Vec<(Stream, Watcher)>,
}

/// An operation begun and not yet ended.
enum Open {
    /// Timed on the host (CPU path): its start.
    Host(Stream, String, u64, f64),
    /// Timed on the device: its begin event.
    Device(Stream, String, u64, Event),
}

fn spawn(
    stream: Stream,
    part: usize,
    t0: Instant,
    spans: Arc<Mutex<Vec<Span>>>,
    rx: Receiver<Pending>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for p in rx {
            p.begin.synchronize();
            let start = t0.elapsed().as_secs_f64();
            p.end.synchronize();
            let end = t0.elapsed().as_secs_f64();
            if let Ok(mut s) = spans.lock() {
                s.push(Span {
                    stream,
                    device: part,
                    name: p.name,
                    start,
                    end,
                    bytes: p.bytes,
                });
            }
        }
    })
}

impl Timeline {
    /// A timeline for `device`; device events are used unless it is the CPU.
    pub fn new(device: Device) -> Timeline {
        Self::for_part(device, 0, Instant::now())
    }

    /// A timeline for part `part` of a model split across devices, its
    /// times counted from `t0` (the same for every part).
    pub fn for_part(device: Device, part: usize, t0: Instant) -> Timeline {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let mut watchers = Vec::new();
        let dev = (!device.is_cpu()).then_some(device);
        if dev.is_some() {
            for s in [Stream::Copy, Stream::Compute] {
                let (tx, rx) = channel();
                watchers.push((
                    s,
                    Watcher {
                        tx,
                        handle: spawn(s, part, t0, spans.clone(), rx),
                    },
                ));
            }
        }
        Timeline {
            t0,
            part,
            spans,
            device: dev,
            watchers,
        }
    }

    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Marks the start of an operation enqueued next on `backend`.
    fn begin(&self, stream: Stream, backend: &Backend, name: String, bytes: u64) -> Option<Open> {
        match self.device {
            Some(dev) => {
                let ev = Event::new(dev).ok()?;
                ev.record(backend);
                Some(Open::Device(stream, name, bytes, ev))
            }
            None => Some(Open::Host(stream, name, bytes, self.now())),
        }
    }

    /// Marks the end of `open`, enqueued last on `backend`.
    fn end(&self, open: Open, backend: &Backend) {
        match open {
            Open::Device(stream, name, bytes, begin) => {
                let Some(dev) = self.device else { return };
                let Ok(end) = Event::new(dev) else { return };
                end.record(backend);
                if let Some((_, w)) = self.watchers.iter().find(|(s, _)| *s == stream) {
                    let _ = w.tx.send(Pending {
                        name,
                        bytes,
                        begin,
                        end,
                    });
                }
            }
            Open::Host(stream, name, bytes, start) => {
                let end = self.now();
                if let Ok(mut s) = self.spans.lock() {
                    s.push(Span {
                        stream,
                        device: self.part,
                        name,
                        start,
                        end,
                        bytes,
                    });
                }
            }
        }
    }

    /// Records an operation timed on the host (a draft model's turn).
    pub fn host_span(&self, stream: Stream, name: &str, start: Instant, end: Instant) {
        let t = |i: Instant| i.saturating_duration_since(self.t0).as_secs_f64();
        if let Ok(mut s) = self.spans.lock() {
            s.push(Span {
                stream,
                device: self.part,
                name: name.to_string(),
                start: t(start),
                end: t(end),
                bytes: 0,
            });
        }
    }

    /// Waits for every pending operation and returns all spans, sorted by
    /// start time.
    pub fn finish(self) -> Vec<Span> {
        for (_, w) in self.watchers {
            drop(w.tx);
            let _ = w.handle.join();
        }
        let mut v = self.spans.lock().map(|s| s.clone()).unwrap_or_default();
        v.sort_by(|a, b| a.start.total_cmp(&b.start));
        v
    }
}

/// The timeline switch the engine's parts share (cloning shares it):
/// while a timeline is on, each [`Scope`] records one operation.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Option<Timeline>>>);

impl Recorder {
    /// Starts a timeline for `device`, replacing one that was on.
    pub fn start(&self, device: Device) {
        self.start_part(device, 0, Instant::now());
    }

    /// Starts a timeline for part `part` of a model split across devices,
    /// its times counted from `t0`.
    pub fn start_part(&self, device: Device, part: usize, t0: Instant) {
        if let Ok(mut t) = self.0.lock() {
            *t = Some(Timeline::for_part(device, part, t0));
        }
    }

    /// Stops the timeline and returns its spans (none if it was off). The
    /// operations recorded must have been enqueued; this waits for them.
    pub fn finish(&self) -> Vec<Span> {
        let t = self.0.lock().ok().and_then(|mut t| t.take());
        t.map(Timeline::finish).unwrap_or_default()
    }

    /// Records the operation enqueued on `backend` while the returned scope
    /// lives; `name` is only called while a timeline is on.
    pub fn scope<'a>(
        &'a self,
        stream: Stream,
        backend: &'a Backend,
        name: impl FnOnce() -> String,
        bytes: u64,
    ) -> Scope<'a> {
        let open = self.0.lock().ok().and_then(|t| {
            t.as_ref()
                .and_then(|t| t.begin(stream, backend, name(), bytes))
        });
        Scope {
            rec: self,
            backend,
            open,
        }
    }

    /// Records an operation timed on the host between `start` and `end`.
    pub fn host_span(
        &self,
        stream: Stream,
        name: impl FnOnce() -> String,
        start: Instant,
        end: Instant,
    ) {
        if let Ok(t) = self.0.lock() {
            if let Some(t) = t.as_ref() {
                t.host_span(stream, &name(), start, end);
            }
        }
    }
}

/// One operation being recorded; it ends when the scope is dropped.
pub struct Scope<'a> {
    rec: &'a Recorder,
    backend: &'a Backend,
    open: Option<Open>,
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        let Some(open) = self.open.take() else { return };
        if let Ok(t) = self.rec.0.lock() {
            if let Some(t) = t.as_ref() {
                t.end(open, self.backend);
            }
        }
    }
}

/// Busy time, idle gaps and overlap of one window of spans.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Overlap {
    pub copy_s: f64,
    pub compute_s: f64,
    /// Host CPU compute (hybrid decode).
    pub cpu_s: f64,
    /// Copy time that ran while the compute stream or the CPU was busy.
    pub overlapped_s: f64,
    pub bytes: u64,
}

impl Overlap {
    pub fn of(spans: &[Span]) -> Overlap {
        let mut o = Overlap::default();
        let comp: Vec<(f64, f64)> = spans
            .iter()
            .filter(|s| matches!(s.stream, Stream::Compute | Stream::Cpu))
            .map(|s| (s.start, s.end))
            .collect();
        for s in spans {
            let d = (s.end - s.start).max(0.0);
            match s.stream {
                Stream::Compute => o.compute_s += d,
                Stream::Draft | Stream::Host => {}
                Stream::Cpu => o.cpu_s += d,
                Stream::Copy => {
                    o.copy_s += d;
                    o.bytes += s.bytes;
                    o.overlapped_s += comp
                        .iter()
                        .map(|&(a, b)| (b.min(s.end) - a.max(s.start)).max(0.0))
                        .sum::<f64>();
                }
            }
        }
        o
    }
    /// Achieved copy bandwidth, bytes/s.
    pub fn copy_bw(&self) -> f64 {
        if self.copy_s > 0.0 {
            self.bytes as f64 / self.copy_s
        } else {
            0.0
        }
    }
}

/// Writes spans as a Chrome/Perfetto trace (JSON object format): four
/// tracks a device in process 1 (copy, compute, draft model, host CPU), a
/// step's host work in process 2 (a track a device).
pub fn write_chrome_trace(spans: &[Span], path: &std::path::Path) -> std::io::Result<()> {
    use serde_json::json;
    let n_dev = spans.iter().map(|s| s.device + 1).max().unwrap_or(1);
    let label = |d: usize, n: &str| {
        if n_dev > 1 {
            format!("device {d} {n}")
        } else {
            n.to_string()
        }
    };
    let thread = |pid: u32, tid: usize, name: String| json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}});
    let names = ["copy stream", "compute stream", "draft model", "host CPU"];
    let mut events = Vec::with_capacity(spans.len() + 5 * n_dev + 1);
    for d in 0..n_dev {
        for (k, n) in names.iter().enumerate() {
            events.push(thread(1, 4 * d + k + 1, label(d, n)));
        }
    }
    events.push(
        json!({"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "host: step inputs"}}),
    );
    for d in 0..n_dev {
        events.push(thread(2, d + 1, label(d, "step inputs")));
    }
    for s in spans {
        let (pid, tid) = match s.stream {
            Stream::Copy => (1, 4 * s.device + 1),
            Stream::Compute => (1, 4 * s.device + 2),
            Stream::Draft => (1, 4 * s.device + 3),
            Stream::Cpu => (1, 4 * s.device + 4),
            Stream::Host => (2, s.device + 1),
        };
        events.push(json!({
            "name": s.name,
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": s.start * 1e6,
            "dur": (s.end - s.start).max(0.0) * 1e6,
            "args": {"bytes": s.bytes},
        }));
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer(&mut f, &json!({ "traceEvents": events }))?;
    std::io::Write::flush(&mut f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(stream: Stream, start: f64, end: f64, bytes: u64) -> Span {
        Span {
            stream,
            device: 0,
            name: "x".into(),
            start,
            end,
            bytes,
        }
    }

    #[test]
    fn overlap_counts_copy_under_compute() {
        let spans = [
            span(Stream::Compute, 0.0, 1.0, 0),
            span(Stream::Copy, 0.5, 1.5, 100),
            span(Stream::Compute, 1.5, 2.0, 0),
        ];
        let o = Overlap::of(&spans);
        assert_eq!(o.copy_s, 1.0);
        assert_eq!(o.compute_s, 1.5);
        assert_eq!(o.overlapped_s, 0.5);
        assert_eq!(o.copy_bw(), 100.0);
    }

    /// A step's host work is neither computation nor overlap, and goes to
    /// process 2 of the trace, a track a device, leaving process 1's four
    /// tracks a device as they were.
    #[test]
    fn host_spans_have_their_own_process_in_the_trace() {
        let mut spans = vec![
            span(Stream::Host, 0.0, 0.01, 0),
            span(Stream::Copy, 0.0, 1.0, 100),
            span(Stream::Compute, 0.01, 0.5, 0),
        ];
        spans.push(Span {
            device: 1,
            ..span(Stream::Host, 0.0, 0.02, 0)
        });
        let o = Overlap::of(&spans);
        assert_eq!((o.cpu_s, o.compute_s), (0.0, 0.49));
        assert!((o.overlapped_s - 0.49).abs() < 1e-12);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        write_chrome_trace(&spans, &path).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        let at = |ph: &str, pid: u64, tid: u64| {
            ev.iter()
                .filter(|e| e["ph"] == ph && e["pid"] == pid && e["tid"] == tid)
                .count()
        };
        // 8 tracks of process 1, and one of process 2 for each device
        assert_eq!((1..=8).map(|t| at("M", 1, t)).sum::<usize>(), 8);
        assert_eq!((at("M", 2, 1), at("M", 2, 2)), (1, 1));
        assert_eq!((at("X", 2, 1), at("X", 2, 2)), (1, 1));
        assert_eq!((at("X", 1, 1), at("X", 1, 2)), (1, 1));
    }
}
