//! The row split's exchange of half steps between two devices: how a
//! device cuts big steps in halves of rows, and on a GPU the stream the
//! halves' outputs travel on and the events that order it with the
//! compute stream. `rows.rs` runs it.

use super::error::EngineError;
use crate::ggml::{Device, Event};

/// The row split over two devices cuts steps of at least `min_tokens`
/// tokens in two halves of rows, group by group: each device computes
/// the group's first half, then its second, while the first half's
/// outputs are exchanged; the second half's outputs are exchanged while
/// the next group's first half computes. On one device's compute stream:
/// G(A, i), G(B, i), add(A, i), G(A, i+1), add(B, i), G(B, i+1), ...
/// where each add waits for both sends of its half. A step whose groups
/// take 5 ms on each GPU spent about 0.45 ms after each in the exchange
/// and add (run 70's trace, 70B-shaped pp2048 on two H200s).
pub struct Halves {
    pub min_tokens: u32,
    /// The exchange's own stream and its events, on a GPU (elsewhere the
    /// exchange runs on the compute streams, in turn).
    pub streams: Option<ExchangeStreams>,
    /// Where a group's weights are dequantized once for both halves
    /// (`widen.rs`); None: each half's products dequantize again.
    pub widening: Option<super::buffers::Widening>,
}

pub struct ExchangeStreams {
    /// A backend of this device whose stream carries the sends.
    pub backend: crate::ggml::Backend,
    /// Per half, recorded on the compute stream after the half's graph.
    pub computed: [Event; 2],
    /// Per half, recorded on the exchange stream after the half's send.
    pub sent: [Event; 2],
}

impl Halves {
    /// The smallest step `device` cuts in halves under `row_halves`;
    /// None where it never does.
    pub(super) fn min_tokens(device: Device, row_halves: Option<u32>) -> Option<u32> {
        let gpu = !device.is_cpu() && !device.is_remote();
        match row_halves {
            Some(0) => None,
            Some(n) => Some(n),
            None if gpu => Some(512),
            None => None,
        }
    }

    /// How `device`, one of the row split's two, cuts steps (`row_halves`
    /// as `PagingOptions::row_halves`); None where it does not.
    pub(super) fn new(
        device: Device,
        row_halves: Option<u32>,
    ) -> Result<Option<Halves>, EngineError> {
        let gpu = !device.is_cpu() && !device.is_remote();
        let Some(min_tokens) = Self::min_tokens(device, row_halves) else {
            return Ok(None);
        };
        let streams = if gpu {
            let ev = || Event::new(device);
            Some(ExchangeStreams {
                backend: device.init_backend()?,
                computed: [ev()?, ev()?],
                sent: [ev()?, ev()?],
            })
        } else {
            None
        };
        Ok(Some(Halves {
            min_tokens,
            streams,
            widening: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_a_cpu_only_where_asked() {
        let cpu = crate::ggml::cpu_device().expect("the CPU backend loads");
        assert_eq!(Halves::min_tokens(cpu, None), None);
        assert_eq!(Halves::min_tokens(cpu, Some(0)), None);
        assert_eq!(Halves::min_tokens(cpu, Some(64)), Some(64));
        assert!(Halves::new(cpu, None).unwrap().is_none());
        let h = Halves::new(cpu, Some(64)).unwrap().expect("asked for");
        assert_eq!(h.min_tokens, 64);
        // no exchange stream off a GPU, and nothing widened until the
        // load plans it
        assert!(h.streams.is_none() && h.widening.is_none());
    }
}
