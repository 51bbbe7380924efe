//! A memory timeline: the heap sampled at the events of one training step
//! (gather, compute, free, reduce …), so a lesson can *show* when memory is
//! held and when it is given back.
use serde::Serialize;

use crate::plot::{Chart, Series};

/// One event of a step: its label, the live heap right after it, and the
/// highest the heap went while it ran (its activations, its buffers).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryEvent {
    pub label: String,
    pub live_bytes: u64,
    pub peak_bytes: u64,
}

/// Samples the counting allocator at events; does nothing while off, so a
/// step can mark events on every step and only one step is recorded.
#[derive(Debug, Clone, Default)]
pub struct MemoryTimeline {
    recording: bool,
    pub events: Vec<MemoryEvent>,
}

impl MemoryTimeline {
    /// A timeline that records nothing.
    pub fn off() -> Self {
        Self::default()
    }

    /// Starts (or stops) recording. Starting opens a fresh peak window.
    pub fn record(&mut self, on: bool) {
        if on && !self.recording {
            crate::alloc::take_window_peak();
            self.recording = true;
            self.mark("start");
        }
        self.recording = on;
    }

    /// Records `label` as just done: the live heap now, the peak since the previous mark.
    pub fn mark(&mut self, label: impl Into<String>) {
        if self.recording {
            let peak = crate::alloc::take_window_peak() as u64;
            self.events.push(MemoryEvent {
                label: label.into(),
                live_bytes: crate::alloc::live_bytes() as u64,
                peak_bytes: peak,
            });
        }
    }

    /// The highest heap of the recorded step.
    pub fn peak_bytes(&self) -> u64 {
        self.events.iter().map(|e| e.peak_bytes).max().unwrap_or(0)
    }

    /// A chart of the step: the peak within each event (solid) and the
    /// live heap after it (dashed), in MB, one step of the staircase per
    /// event, each named under the axis; the heap axis starts at zero.
    pub fn chart(&self, title: &str, y_range: Option<(f64, f64)>) -> Chart {
        let mb = |b: u64| b as f64 / 1e6;
        // A staircase: event i spans [i, i + 1] on the x axis.
        let pts = |f: &dyn Fn(&MemoryEvent) -> u64| {
            self.events
                .iter()
                .enumerate()
                .flat_map(|(i, e)| [(i as f64, mb(f(e))), ((i + 1) as f64, mb(f(e)))])
                .collect()
        };
        Chart {
            title: title.into(),
            x_label: "the events of one step, in order".into(),
            y_label: "heap, MB".into(),
            series: vec![
                Series {
                    name: "peak during event".into(),
                    color: "#d62728",
                    points: pts(&|e| e.peak_bytes),
                    dashed: false,
                },
                Series {
                    name: "live after event".into(),
                    color: "#1f77b4",
                    points: pts(&|e| e.live_bytes),
                    dashed: true,
                },
            ],
            y_range,
            y_from_zero: true,
            x_names: self.events.iter().enumerate().map(|(i, e)| (i as f64 + 0.5, e.label.clone())).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_on_and_sees_an_allocation() {
        let mut t = MemoryTimeline::off();
        t.mark("ignored");
        assert!(t.events.is_empty());
        t.record(true);
        let buf = std::hint::black_box(vec![1u8; 8 << 20]); // 8 MiB held across the mark
        t.mark("allocated");
        drop(std::hint::black_box(buf));
        t.mark("freed");
        t.record(false);
        t.mark("ignored too");
        let labels: Vec<&str> = t.events.iter().map(|e| e.label.as_str()).collect();
        assert_eq!(labels, ["start", "allocated", "freed"]);
        let (start, held, freed) = (&t.events[0], &t.events[1], &t.events[2]);
        // The heap is the process's: tests on other threads allocate and free
        // a little meanwhile, hence 64 KiB of slack around the 8 MiB.
        let (big, slack) = (8u64 << 20, 64u64 << 10);
        assert!(
            held.live_bytes + slack >= start.live_bytes + big,
            "the buffer is live after its event: {:?}",
            t.events
        );
        assert!(freed.live_bytes + big <= held.live_bytes + slack, "and gone after the next: {:?}", t.events);
        assert!(freed.peak_bytes >= held.live_bytes, "the freeing event saw it at its peak");
        assert_eq!(t.chart("x", None).series[0].points.len(), 6, "two points per event: a staircase");
    }
}
