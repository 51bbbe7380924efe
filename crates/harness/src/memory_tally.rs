//! The memory tally: what a rank holds, by category, computed from shapes
//! alone ([`MemoryTally`], [`Moment`]), and the session's modelling of the
//! moments every lesson's step passes through (a micro-batch's backward,
//! block by block, its hand-offs, the data) — what the report prints beside
//! the heap the counting allocator measured.
use fsdp_gpt::Unit;
use fsdp_gpt::memory::{Footprint, ModelShapes};

use crate::session::Session;
use crate::table::{Table, mb, thousands};

/// When a rank holds a category of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// From step to step: model states, data, buffers kept for reuse.
    Kept,
    /// Only around the step's peak: activations, gathered units, gradients
    /// in flight, temporaries.
    AtPeak,
    /// Diagnostics the technique itself does not need (lesson 02's
    /// `--check` reference): measured with the rest, never in its total.
    Apart,
}

/// One category of memory a rank holds, computed from shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct TallyRow {
    pub category: String,
    pub elems: usize,
    pub bytes_per_elem: usize,
    pub note: String,
    pub residency: Residency,
}

impl TallyRow {
    pub fn bytes(&self) -> u64 {
        (self.elems * self.bytes_per_elem) as u64
    }
}

/// What a rank holds at one moment of the step, besides what it keeps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Moment {
    pub label: String,
    pub rows: Vec<TallyRow>,
}

impl Moment {
    pub fn new(label: impl Into<String>) -> Self {
        Self { label: label.into(), rows: vec![] }
    }

    pub fn add(&mut self, category: &str, elems: usize, bytes_per_elem: usize, note: &str) -> &mut Self {
        let row = TallyRow {
            category: category.into(),
            elems,
            bytes_per_elem,
            note: note.into(),
            residency: Residency::AtPeak,
        };
        self.rows.push(row);
        self
    }

    pub fn bytes(&self) -> u64 {
        self.rows.iter().map(TallyRow::bytes).sum()
    }
}

/// Bytes per rank by category, from shapes alone (no measurement): what
/// is kept from step to step, plus what is held at the step's busiest
/// moment — together the peak the counting allocator should measure —
/// and, apart, diagnostics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryTally {
    pub rows: Vec<TallyRow>,
    /// The moment of the step whose rows are in (see [`MemoryTally::peak`]).
    pub peak_at: String,
}

impl MemoryTally {
    pub fn new() -> Self {
        Self::default()
    }

    /// A category kept from step to step.
    pub fn add(&mut self, category: &str, elems: usize, bytes_per_elem: usize, note: &str) -> &mut Self {
        self.push(category, elems, bytes_per_elem, note, Residency::Kept)
    }

    /// A diagnostic, shown apart from the technique's own total.
    pub fn apart(&mut self, category: &str, elems: usize, bytes_per_elem: usize, note: &str) -> &mut Self {
        self.push(category, elems, bytes_per_elem, note, Residency::Apart)
    }

    fn push(
        &mut self,
        category: &str,
        elems: usize,
        bytes_per_elem: usize,
        note: &str,
        residency: Residency,
    ) -> &mut Self {
        self.rows.push(TallyRow { category: category.into(), elems, bytes_per_elem, note: note.into(), residency });
        self
    }

    /// Adds the busiest of `moments` (the most bytes; the first of equals):
    /// the step's peak, from shapes.
    pub fn peak(&mut self, moments: Vec<Moment>) -> &mut Self {
        let busiest = moments.into_iter().reduce(|a, b| if b.bytes() > a.bytes() { b } else { a });
        if let Some(m) = busiest {
            self.peak_at = m.label;
            self.rows.extend(m.rows);
        }
        self
    }

    fn sum(&self, pick: impl Fn(Residency) -> bool) -> u64 {
        self.rows.iter().filter(|r| pick(r.residency)).map(TallyRow::bytes).sum()
    }

    /// The technique's peak: kept plus the busiest moment's (diagnostics excluded).
    pub fn total_bytes(&self) -> u64 {
        self.sum(|h| h != Residency::Apart)
    }

    pub fn kept_bytes(&self) -> u64 {
        self.sum(|h| h == Residency::Kept)
    }

    pub fn apart_bytes(&self) -> u64 {
        self.sum(|h| h == Residency::Apart)
    }

    /// What the counting allocator should measure: the peak and the diagnostics.
    pub fn expected_peak_bytes(&self) -> u64 {
        self.total_bytes() + self.apart_bytes()
    }

    /// The tally as a table: kept, the peak moment, the total; diagnostics apart.
    pub fn table(&self) -> Table {
        let mut t = Table::new(["memory per rank (from shapes)", "elements", "bytes", "MB", "note"]);
        let total = |t: &mut Table, label: &str, bytes: u64| {
            t.row([label.to_string(), String::new(), thousands(bytes), mb(bytes), String::new()]);
        };
        let rows = |t: &mut Table, residency: Residency| {
            for r in self.rows.iter().filter(|r| r.residency == residency) {
                // Rows counted in bytes (mixed dtypes: a graph's tensors) have no element count.
                let elems = if r.bytes_per_elem == 1 { "—".to_string() } else { thousands(r.elems as u64) };
                t.row([r.category.clone(), elems, thousands(r.bytes()), mb(r.bytes()), r.note.clone()]);
            }
        };
        rows(&mut t, Residency::Kept);
        t.separator();
        total(&mut t, "kept from step to step", self.kept_bytes());
        if self.rows.iter().any(|r| r.residency == Residency::AtPeak) {
            t.separator();
            t.row([
                format!("at the peak: {}", self.peak_at),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
            rows(&mut t, Residency::AtPeak);
        }
        t.separator();
        total(&mut t, "peak", self.total_bytes());
        if self.apart_bytes() > 0 {
            t.separator();
            t.row(["diagnostics, apart".to_string(), String::new(), String::new(), String::new(), String::new()]);
            rows(&mut t, Residency::Apart);
            t.separator();
            total(&mut t, "peak with the diagnostics", self.expected_peak_bytes());
        }
        t
    }
}

impl Session<'_> {
    /// The shapes of this run's model in a compute dtype of `elem` bytes
    /// per element, for [`fsdp_gpt::memory`]'s accounting.
    pub fn shapes(&self, elem: usize) -> ModelShapes {
        ModelShapes { cfg: self.cfg, elem, probs: self.model.probs }
    }

    /// The moments of one micro-batch of [`fsdp_gpt::blockwise`]: the head,
    /// each block's backward and the hand-off of its gradients, the
    /// embedding's backward and the root's hand-off — what the mechanism
    /// holds at each, and what the lesson holds (`held(unit, handed, m)`:
    /// `FinalNorm` for the head; `handed` once the unit's gradients are
    /// being handed on). `label` names the micro-batch.
    pub fn blockwise_moments(
        &self,
        elem: usize,
        recompute: bool,
        label: &str,
        held: &mut dyn FnMut(Unit, bool, &mut Moment),
    ) -> Vec<Moment> {
        // `held` is asked what the lesson holds besides: at a hand-off the
        // unit's own gradients are counted here, not by the lesson.
        let (e, (b, t), c, v) = (elem, self.micro_batch_shape(), self.cfg.n_embd, self.cfg.vocab_size);
        let (btc, layers, dt) = (b * t * c, self.cfg.n_layer, if elem == 2 { "bf16" } else { "fp32" });
        let shapes = self.shapes(e);
        let block = shapes.block_taped((b, t));
        // What waits for the blocks before it: their inputs (recompute) or tapes.
        let waiting = |m: &mut Moment, blocks: usize| {
            match recompute {
                true => m.add(
                    &format!("saved block inputs ({dt})"),
                    blocks * btc,
                    e,
                    "(B, T, C) per block: each block is recomputed from its input",
                ),
                false => m.add(
                    "block tapes waiting for backward",
                    blocks * block.activations,
                    1,
                    "each block's activations, kept (its input among them)",
                ),
            };
        };
        let carried = |m: &mut Moment| {
            m.add(&format!("upstream gradient ({dt})"), btc, e, "dL/dx at the current block boundary")
                .add(&format!("lm_head part of wte grad ({dt})"), v * c, e, "until the embedding's backward")
                .add(&format!("ln_f grads ({dt})"), 2 * c, e, "until the root's gradient is complete");
        };
        let ids = |m: &mut Moment| {
            m.add("micro-batch token ids", 2 * b * t, 4, "inputs and targets (B, T)");
        };
        let mut moments = vec![];
        let mut m = Moment::new(format!("head forward+backward, {label}"));
        waiting(&mut m, layers);
        m.add(&format!("the head's input as a Var ({dt})"), btc, e, "a copy, so backward reaches it");
        ids(&mut m);
        pass_rows(&mut m, &shapes.head_and_loss((b, t)), "the head's graph");
        held(Unit::FinalNorm, false, &mut m);
        moments.push(m);
        for i in (0..layers).rev() {
            let what = if recompute { "recompute+backward" } else { "backward" };
            let mut m = Moment::new(format!("{what} of h.{i}, {label}"));
            waiting(&mut m, i);
            carried(&mut m);
            ids(&mut m);
            tape_rows(&mut m, &block);
            held(Unit::Block(i), false, &mut m);
            moments.push(m);
            // Its tape gone, its gradients are handed on.
            let mut m = Moment::new(format!("handing on h.{i}'s gradients, {label}"));
            waiting(&mut m, i);
            carried(&mut m);
            ids(&mut m);
            let n = self.table.unit_range(Unit::Block(i)).len();
            m.add(&format!("the block's gradients ({dt})"), n, e, "handed to the lesson");
            held(Unit::Block(i), true, &mut m);
            moments.push(m);
        }
        let mut m = Moment::new(format!("embedding backward, {label}"));
        carried(&mut m);
        ids(&mut m);
        embedding_rows(&mut m, &shapes.embedding_backward((b, t)), v * c * e);
        held(Unit::Embedding, false, &mut m);
        moments.push(m);
        let mut m = Moment::new(format!("handing on the root's gradients, {label}"));
        m.add(&format!("the root's gradients ({dt})"), v * c + self.cfg.block_size * c + 2 * c, e, "wte, wpe, ln_f")
            .add(&format!("upstream gradient ({dt})"), btc, e, "the rows' gradient is a view of it, until the hand-off")
            .add(&format!("lm_head part of wte grad ({dt})"), v * c, e, "the tied gradient was formed from it");
        ids(&mut m);
        held(Unit::Embedding, true, &mut m);
        moments.push(m);
        moments
    }

    /// The moments of one micro-batch of [`Session::forward_backward`]: its
    /// backward, block by block (the gradients collected so far waiting),
    /// with or without `recompute`, then the adding of its gradients
    /// to the sums (`add_label`). `held(adding, m)`: what the lesson holds
    /// besides, at the backward (`false`) or at the add (`true`).
    pub fn whole_model_moments(
        &self,
        elem: usize,
        recompute: bool,
        label: &str,
        add_label: &str,
        held: &mut dyn FnMut(bool, &mut Moment),
    ) -> Vec<Moment> {
        let dt = if elem == 2 { "bf16" } else { "fp32" };
        let mut moments = self.blockwise_moments(elem, recompute, label, &mut |unit, _handed, m| {
            held(false, m);
            m.add(&format!("gradients collected ({dt})"), self.grads_collected(unit), elem, "the blocks done so far");
        });
        let mut add = Moment::new(add_label);
        held(true, &mut add);
        self.gradient_add_tally(&mut add, elem);
        moments.push(add);
        moments
    }

    /// Gradient elements a collecting backward (`forward_backward`) holds
    /// when `unit`'s backward runs, block by block, last
    /// first: every block after it. (At a hand-off, [`Session::blockwise_moments`]
    /// counts the unit's own.)
    pub fn grads_collected(&self, unit: Unit) -> usize {
        let block = |i: usize| self.table.unit_range(Unit::Block(i)).len();
        match unit {
            Unit::FinalNorm => 0,
            Unit::Block(i) => (i + 1..self.cfg.n_layer).map(block).sum(),
            Unit::Embedding => (0..self.cfg.n_layer).map(block).sum(),
        }
    }

    /// What adding a micro-batch's gradients onto the sums holds besides
    /// them, after [`Session::forward_backward`]: every parameter's gradient
    /// (a bf16 one widened as it is added, no copy).
    pub fn gradient_add_tally(&self, m: &mut Moment, elem: usize) {
        m.add("the micro-batch's gradients", self.table.numel(), elem, "every parameter's, block by block");
    }

    /// The token ids the run holds, kept: the corpus and the sampler's copy.
    pub fn data_tally(&self, t: &mut MemoryTally) {
        t.add("training text as token ids", self.data_bytes() / 4, 4, "the corpus and the sampler's copy (u32)");
    }

    /// Bytes of [`Session::data_tally`].
    pub fn data_bytes(&self) -> usize {
        2 * self.corpus.tokens.len() * 4
    }
}

/// A pass's footprint as two rows: what its graph keeps from the forward,
/// and the most its backward holds on top (gradients, sums, temporaries).
pub fn pass_rows(m: &mut Moment, f: &Footprint, graph: &str) {
    m.add("activations the graph keeps", f.activations, 1, &format!("{graph}: every op's output, until backward ends"));
    backward_rows(m, f);
}

/// The embedding's backward ([`fsdp_gpt::model::Gpt::embedding_backward`],
/// no graph), then `wte`'s whole gradient formed from it (`tied` bytes, an
/// index_add): at the busiest of the two, the backward's scratch, or wpe's
/// gradient and the tied one.
pub fn embedding_rows(m: &mut Moment, f: &Footprint, tied: usize) {
    if f.backward_peak > f.grad_store + tied {
        m.add("the embedding's backward", f.backward_peak, 1, "wpe's gradient being made: the positions' sums");
    } else {
        m.add("wpe's gradient", f.grad_store, 1, "the positions' sums, zeros beyond").add(
            "wte's whole gradient",
            tied,
            1,
            "lm_head part + the rows, index-added",
        );
    }
}

/// A block on a tape ([`fsdp_gpt::model::BlockTape`]): what it keeps, and
/// what its backward holds on top.
pub fn tape_rows(m: &mut Moment, f: &Footprint) {
    m.add("activations the tape keeps", f.activations, 1, "the block's: every op's output, its input among them")
        .add("backward: parameter gradients", f.var_grads_at_peak, 1, "made by the tape's backward at its busiest")
        .add(
            "backward: other gradients, temporaries",
            f.backward_peak - f.var_grads_at_peak,
            1,
            "activations' gradients in flight (none added into zeros), the ops' scratch",
        );
}

/// The most a pass's backward holds on top of its activations.
fn backward_rows(m: &mut Moment, f: &Footprint) {
    m.add("backward: parameter gradients", f.var_grads_at_peak, 1, "in candle's GradStore at the backward's busiest")
        .add(
            "backward: other gradients, temporaries",
            f.backward_peak - f.var_grads_at_peak,
            1,
            "activations' gradients in flight, the ops' scratch",
        );
}
