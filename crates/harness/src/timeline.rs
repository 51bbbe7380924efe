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

    pub fn is_recording(&self) -> bool {
        self.recording
    }

    /// Records `label` as just done: the live heap now, the peak since the previous mark.
    pub fn mark(&mut self, label: impl Into<String>) {
        if self.recording {
            let peak = crate::alloc::take_window_peak() as u64;
            self.events.push(MemoryEvent { label: label.into(), live_bytes: crate::alloc::live_bytes() as u64, peak_bytes: peak });
        }
    }

    /// The highest heap of the recorded step.
    pub fn peak_bytes(&self) -> u64 {
        self.events.iter().map(|e| e.peak_bytes).max().unwrap_or(0)
    }

    /// A chart of the step: the peak within each event (solid) and the
    /// live heap after it (dashed), in MB, against the event number.
    pub fn chart(&self, title: &str, y_range: Option<(f64, f64)>) -> Chart {
        let mb = |b: u64| b as f64 / 1e6;
        let pts = |f: &dyn Fn(&MemoryEvent) -> u64| self.events.iter().enumerate().map(|(i, e)| (i as f64, mb(f(e)))).collect();
        Chart {
            title: title.into(),
            x_label: "event of one step (gather, compute, free, reduce …)".into(),
            y_label: "heap, MB".into(),
            series: vec![
                Series { name: "peak during event".into(), color: "#d62728", points: pts(&|e| e.peak_bytes), dashed: false },
                Series { name: "live after event".into(), color: "#1f77b4", points: pts(&|e| e.live_bytes), dashed: true },
            ],
            y_range,
        }
    }
}
