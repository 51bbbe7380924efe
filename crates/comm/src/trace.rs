//! When things happen: one rank's timeline of spans on two lanes, the
//! compute thread's (compute, and the waits where the step needed a
//! collective's result) and the communication's (each collective, with its
//! bytes). Written as Chrome trace events (`fsdp_harness` writes the file),
//! which Perfetto and chrome://tracing open.
//!
//! A trace is a diagnostic beside training: it allocates its storage once,
//! when it starts, so that recording a span changes no heap number the
//! lessons measure; past its capacity it stops recording and counts what it
//! dropped. Only the compute thread records (a stream's spans are handed back
//! with the collective's result).
use std::time::Instant;

/// The lane a span is drawn in (its Chrome trace `tid`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The compute thread: forward, backward, the update — and, nested
    /// inside or between them, each wait for a collective.
    Compute = 1,
    /// Collectives: on the communication stream's thread, or the compute
    /// thread's own blocking calls (their wait on the compute lane covers them).
    Comm = 2,
}

/// One span, in microseconds since the trace's epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub lane: Lane,
    /// An index into [`Trace::labels`].
    pub label: u16,
    pub start_us: f64,
    pub dur_us: f64,
    /// Bytes this rank sent in the collective (0 for compute and waits).
    pub bytes: u64,
    /// The training step it belongs to.
    pub step: u32,
    /// A collective's number (from 1), on its communication span and on the
    /// compute thread's wait for it; 0 for compute.
    pub op: u32,
    /// A collective's: when the compute thread handed it over (its start,
    /// for a blocking call) — a collective may wait in the stream's queue.
    pub issued_us: f64,
}

/// Spans a trace holds at most (about 1.3 MB).
pub const CAPACITY: usize = 1 << 15;
const LABELS: usize = 1024;

/// One rank's spans, recording or not.
#[derive(Debug)]
pub struct Trace {
    on: bool,
    epoch: Instant,
    step: u32,
    ops: u32,
    pub spans: Vec<Span>,
    pub labels: Vec<String>,
    /// Spans not recorded because the trace was full.
    pub dropped: usize,
}

impl Default for Trace {
    fn default() -> Self {
        Self { on: false, epoch: Instant::now(), step: 0, ops: 0, spans: vec![], labels: vec![], dropped: 0 }
    }
}

impl Trace {
    /// Starts recording, with time zero now. Allocates all it will hold.
    pub fn start(&mut self) {
        self.spans = Vec::with_capacity(CAPACITY);
        self.labels = Vec::with_capacity(LABELS);
        self.epoch = Instant::now();
        self.on = true;
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Stops recording; what was recorded stays.
    pub fn stop(&mut self) {
        self.on = false;
    }

    /// Records again after [`Trace::stop`] (a trace that was started).
    pub fn resume(&mut self) {
        self.on = self.spans.capacity() > 0;
    }

    /// The step the next spans belong to.
    pub fn set_step(&mut self, step: u64) {
        self.step = step as u32;
    }

    /// Microseconds since the epoch.
    pub fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6
    }

    /// Records a span from `start` to `end`, labelled `label`.
    pub fn span(&mut self, lane: Lane, label: &str, start: Instant, end: Instant, bytes: u64) {
        self.span_of(lane, label, start, end, bytes, 0, start);
    }

    /// A span of collective `op`, handed over at `issued`.
    #[allow(clippy::too_many_arguments)]
    pub fn span_of(
        &mut self,
        lane: Lane,
        label: &str,
        start: Instant,
        end: Instant,
        bytes: u64,
        op: u32,
        issued: Instant,
    ) {
        if !self.on {
            return;
        }
        let Some(label) = self.intern(label) else { return };
        if self.spans.len() == self.spans.capacity() {
            self.dropped += 1;
            return;
        }
        let (start_us, end_us) = (self.us(start), self.us(end));
        let (step, issued_us) = (self.step, self.us(issued));
        self.spans.push(Span { lane, label, start_us, dur_us: end_us - start_us, bytes, step, op, issued_us });
    }

    /// A number for the next collective (spans of one collective share it).
    pub fn next_op(&mut self) -> u32 {
        self.ops += 1;
        self.ops
    }

    /// The index of `label`, added the first time it is seen (a step's
    /// labels repeat every step: after the first, nothing is added).
    fn intern(&mut self, label: &str) -> Option<u16> {
        if let Some(i) = self.labels.iter().position(|l| l == label) {
            return Some(i as u16);
        }
        if self.labels.len() == self.labels.capacity() {
            self.dropped += 1;
            return None;
        }
        self.labels.push(label.to_string());
        Some((self.labels.len() - 1) as u16)
    }

    pub fn label(&self, span: &Span) -> &str {
        &self.labels[span.label as usize]
    }

    /// Bytes the trace holds on the heap (its storage, allocated at start).
    pub fn heap_bytes(&self) -> usize {
        self.spans.capacity() * std::mem::size_of::<Span>()
            + self.labels.capacity() * std::mem::size_of::<String>()
            + self.labels.iter().map(String::capacity).sum::<usize>()
    }

    /// The spans as words, to gather on rank 0: labels as UTF-8 bytes, each
    /// span as eight words.
    pub fn to_words(&self) -> Vec<u64> {
        let mut w = vec![self.labels.len() as u64, self.spans.len() as u64, self.dropped as u64];
        for l in &self.labels {
            let b = l.as_bytes();
            w.push(b.len() as u64);
            w.extend(b.chunks(8).map(|c| {
                let mut x = [0u8; 8];
                x[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(x)
            }));
        }
        for s in &self.spans {
            w.extend([
                s.lane as u64,
                s.label as u64,
                s.start_us.to_bits(),
                s.dur_us.to_bits(),
                s.bytes,
                s.step as u64,
                s.op as u64,
                s.issued_us.to_bits(),
            ]);
        }
        w
    }

    /// The inverse of [`Trace::to_words`] (trailing padding ignored).
    pub fn from_words(w: &[u64]) -> Trace {
        let (nl, ns, dropped) = (w[0] as usize, w[1] as usize, w[2] as usize);
        let mut at = 3;
        let mut labels = Vec::with_capacity(nl);
        for _ in 0..nl {
            let len = w[at] as usize;
            at += 1;
            let words = len.div_ceil(8);
            let bytes: Vec<u8> = w[at..at + words].iter().flat_map(|x| x.to_le_bytes()).take(len).collect();
            labels.push(String::from_utf8_lossy(&bytes).into_owned());
            at += words;
        }
        let spans = (0..ns)
            .map(|i| {
                let s = &w[at + 8 * i..at + 8 * i + 8];
                Span {
                    lane: if s[0] == 2 { Lane::Comm } else { Lane::Compute },
                    label: s[1] as u16,
                    start_us: f64::from_bits(s[2]),
                    dur_us: f64::from_bits(s[3]),
                    bytes: s[4],
                    step: s[5] as u32,
                    op: s[6] as u32,
                    issued_us: f64::from_bits(s[7]),
                }
            })
            .collect();
        Trace { on: false, epoch: Instant::now(), step: 0, ops: 0, spans, labels, dropped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_on_and_round_trips_through_words() {
        let mut t = Trace::default();
        let now = Instant::now();
        t.span(Lane::Compute, "ignored", now, now, 0);
        assert!(t.spans.is_empty());
        t.start();
        let a = Instant::now();
        let b = a + std::time::Duration::from_micros(250);
        t.set_step(3);
        t.span(Lane::Compute, "forward h.0", a, b, 0);
        let op = t.next_op();
        t.span_of(Lane::Comm, "all_gather h.1 — ünïcode", a, b, 396_544, op, a);
        t.span(Lane::Compute, "forward h.0", b, b, 0);
        assert_eq!(t.labels.len(), 2, "a label is stored once");
        let heap = t.heap_bytes();
        let back = Trace::from_words(&[t.to_words(), vec![0; 5]].concat());
        assert_eq!(back.spans, t.spans);
        assert_eq!(back.labels, t.labels);
        assert_eq!(back.label(&back.spans[1]), "all_gather h.1 — ünïcode");
        assert!((back.spans[0].dur_us - 250.0).abs() < 1e-6 && back.spans[0].step == 3, "{:?}", back.spans[0]);
        assert_eq!(t.heap_bytes(), heap, "recording allocates nothing after a label is known");
    }
}
