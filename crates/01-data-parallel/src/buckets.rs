//! # DDP's gradient buckets (`--bucket-mb`)
//!
//! The step in `data_parallel.rs` waits for the whole backward, then
//! all-reduces the whole gradient: while the bytes move, nothing computes.
//! PyTorch's `DistributedDataParallel` instead groups the parameters into
//! buckets of about `bucket_cap_mb` (25 MB by default), in the order the
//! backward produces their gradients, and all-reduces each bucket as soon as
//! its last gradient exists — while the backward computes the rest.
//!
//! Here a bucket is whole units, in backward order: `h.L−1` first, the root
//! (`wte`, `wpe`, `ln_f`) last, since the tied `wte` is complete only at the
//! very end. Units join the current bucket until it holds at least
//! `--bucket-mb` of fp32 gradient (DDP's rule); the rest make the last.
//! Only my last micro-batch can start them: before it, a bucket's sum is not
//! complete (DDP skips the all-reduce of earlier micro-batches under
//! `no_sync`), so that micro-batch runs block by block ([`blockwise`]) and
//! hands each unit's gradient to its bucket as the unit's backward ends.
//!
//! Like DDP without `gradient_as_bucket_view`, each bucket has buffers of
//! its own, kept from step to step: the gradient is copied in, all-reduced on
//! the communication stream, and copied back. An all-reduce adds element by
//! element, each element as the same pairwise tree over the ranks (and the
//! sum groups), so cutting the vector into buckets changes no bit.
//!
//! [`DataParallel::bucketed_step`] is lesson 01's step with them, beside the
//! plain one in `data_parallel.rs`; lesson 02 has its own, beside its idea.
use std::cell::Cell;
use std::ops::Range;
use std::time::Instant;

use candle_core::Var;
use fsdp_comm::{MicroBatchSlot, MicroBatchSum, Pending, ShardLayout, World};
use fsdp_gpt::blockwise::{self, Milestone};
use fsdp_gpt::model::add_into;
use fsdp_gpt::{ParamTable, Precision, Unit};
use fsdp_harness::{MemoryTally, Moment, Session, Start};

use crate::data_parallel::{DataParallel, Reduce, accumulate_micro_batches, scale};

/// One bucket: which units, where their gradients sit in the flat vector,
/// and its buffers (here, or travelling with its all-reduce).
pub struct Bucket {
    /// Its units, in backward order.
    pub units: Vec<Unit>,
    /// Where its elements sit in the (padded) flat gradient, in order.
    pub pieces: Vec<Range<usize>>,
    /// Its gradient elements, and its length padded to a multiple of N.
    pub elems: usize,
    pub len: usize,
    /// The packed group sums the all-reduce sends (groups × `len`), then
    /// the sum over all ranks (its first `len`); and my 1/N of it.
    bufs: Option<(Vec<f32>, Vec<f32>)>,
    in_flight: Option<Pending<(Vec<f32>, Vec<f32>)>>,
}

impl Bucket {
    /// Its units, as `h.3-h.2` or `root`.
    pub fn name(&self) -> String {
        let name = |u: &Unit| match u {
            Unit::Block(i) => format!("h.{i}"),
            _ => "root".to_string(),
        };
        match self.units.as_slice() {
            [one] => name(one),
            [first, .., last] => format!("{}-{}", name(first), name(last)),
            [] => String::new(),
        }
    }
}

/// Every bucket of the model, in the order they are all-reduced.
pub struct Buckets {
    pub list: Vec<Bucket>,
    /// The flat vector's padded length, and the sum groups per rank.
    padded: usize,
    groups: usize,
    world: usize,
    /// The cap in bytes the buckets were cut at (doubled past the stream's slots).
    cap: usize,
}

impl Buckets {
    /// The buckets of `table`'s model for `world` ranks and `groups` sums per
    /// rank, each holding at least `cap` bytes of fp32 gradient (but the last).
    /// Every bucket is in flight at the end of the backward, so there are no
    /// more than the stream holds at once ([`fsdp_comm::stream::SLOTS`]): a
    /// cap that would cut more is doubled until it does not.
    pub fn new(table: &ParamTable, n_layer: usize, padded: usize, world: usize, groups: usize, cap: usize) -> Self {
        let mut cap = cap.max(1);
        while n_layer + 1 > fsdp_comm::stream::SLOTS
            && Self::count(table, n_layer, padded, cap) > fsdp_comm::stream::SLOTS
        {
            cap *= 2;
        }
        Self::cut(table, n_layer, padded, world, groups, cap)
    }

    /// How many buckets a cap of `cap` bytes cuts (as [`Buckets::cut`] cuts
    /// them, without making their buffers).
    fn count(table: &ParamTable, n_layer: usize, padded: usize, cap: usize) -> usize {
        let order = (0..n_layer).rev().map(Unit::Block).chain([Unit::Embedding]);
        let (mut buckets, mut open) = (0, 0);
        for (i, u) in order.enumerate() {
            open += unit_ranges(table, u, padded).iter().map(|r| 4 * r.len()).sum::<usize>();
            if open >= cap || i == n_layer {
                (buckets, open) = (buckets + 1, 0);
            }
        }
        buckets
    }

    fn cut(table: &ParamTable, n_layer: usize, padded: usize, world: usize, groups: usize, cap: usize) -> Self {
        let order: Vec<Unit> = (0..n_layer).rev().map(Unit::Block).chain([Unit::Embedding]).collect();
        let mut list: Vec<Bucket> = vec![];
        let mut open: Vec<Unit> = vec![];
        let ranges = |u: Unit| unit_ranges(table, u, padded);
        for (i, &u) in order.iter().enumerate() {
            open.push(u);
            let bytes: usize = open.iter().flat_map(|&u| ranges(u)).map(|r| 4 * r.len()).sum();
            if bytes >= cap || i + 1 == order.len() {
                let pieces: Vec<Range<usize>> = open.iter().flat_map(|&u| ranges(u)).collect();
                let elems = pieces.iter().map(|r| r.len()).sum::<usize>();
                let len = elems.div_ceil(world) * world;
                list.push(Bucket {
                    units: std::mem::take(&mut open),
                    pieces,
                    elems,
                    len,
                    bufs: Some((vec![0.0; groups * len], vec![0.0; len / world])),
                    in_flight: None,
                });
            }
        }
        Self { list, padded, groups, world, cap }
    }

    /// Elements of every bucket's buffers: (the packed sums, the shards).
    pub fn buffer_elems(&self) -> (usize, usize) {
        let sums = self.list.iter().map(|b| self.groups * b.len).sum();
        (sums, self.list.iter().map(|b| b.len / self.world).sum())
    }

    /// The largest bucket's padded length: one sum of it is what the
    /// all-to-all receives into per group (`Session::receive_buffer_len`).
    pub fn largest(&self) -> usize {
        self.list.iter().map(|b| b.len).max().unwrap_or(0)
    }

    /// Bytes one rank sends per step in the buckets' all-reduces: for each,
    /// my groups' shares of the reduce-scatter and my shard in the all-gather.
    pub fn bytes_per_step(&self) -> u64 {
        self.list.iter().map(|b| ((self.groups + 1) * (self.world - 1) * (b.len / self.world) * 4) as u64).sum()
    }

    /// Unit `u`'s gradient is final in `adding` (my last micro-batch): every
    /// bucket it completes is packed and handed to the communication stream.
    pub fn unit_done(&mut self, w: &World, u: Unit, slot: &MicroBatchSlot) {
        let (groups, world) = (self.groups, self.world);
        for (i, b) in self.list.iter_mut().enumerate().filter(|(_, b)| b.units.last() == Some(&u)) {
            let (mut buf, shard) = b.bufs.take().expect("a bucket is all-reduced once per step");
            pack(b, groups, world, &mut buf, |g, piece| slot.final_part(g, piece));
            let pending = w.all_reduce_async(buf, groups, shard);
            // The label is built only when a trace is being recorded.
            b.in_flight = Some(pending.label(w, || format!("all_reduce bucket {i} ({})", b.name())));
        }
    }

    /// A session's buckets for its model, world and sum groups, over the flat
    /// vector padded to `padded`, each of at least `cap` bytes.
    pub fn for_session(s: &Session, padded: usize, cap: usize) -> Self {
        Self::new(&s.table, s.cfg.n_layer, padded, s.world.size(), s.sum_groups.per_rank(), cap)
    }

    /// The all-to-all receive buffer for the largest bucket, on the stream's
    /// thread, where its reduce-scatters run.
    pub fn reserve_receive_buffer(&self, s: &Session) {
        s.reserve_receive_buffer(self.largest(), true);
    }

    /// Waits for every bucket's all-reduce and copies its sum back into
    /// `grads`' one padded flat vector: afterwards it holds the sum over all
    /// ranks, as the ordered all-reduce of the whole vector leaves it.
    pub fn all_reduced<'a>(&mut self, w: &World, grads: &'a mut MicroBatchSum) -> &'a mut [f32] {
        let sum = &mut grads.sums()[0];
        self.wait_all(w, sum);
        &mut sum[..]
    }

    fn wait_all(&mut self, w: &World, sum: &mut [f32]) {
        assert_eq!(sum.len(), self.padded, "the buckets cover the padded vector");
        for b in &mut self.list {
            let (buf, shard) = b.in_flight.take().expect("every bucket was handed over in the backward").wait(w);
            let mut at = 0;
            for r in &b.pieces {
                sum[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
                at += r.len();
            }
            b.bufs = Some((buf, shard));
        }
    }

    /// The buckets' rows in a rank's tally (lessons 01 and 02): their
    /// packed sums and shards, and the stream's receive buffer, sized for
    /// the largest bucket.
    pub fn tally_rows(&self, s: &Session, t: &mut MemoryTally) {
        let (sums, shards) = self.buffer_elems();
        let note = format!("{} buckets, the gradient copied in and back", self.list.len());
        t.add("DDP buckets (fp32)", sums, 4, &note).add(
            "bucket shards",
            shards,
            4,
            "each bucket's 1/N inside its all-reduce",
        );
        if let Some(len) = s.receive_buffer_len(self.largest()) {
            t.add("all-to-all receive buffer", len, 4, "on the stream, the largest bucket, kept");
        }
    }

    /// The moments of my last micro-batch, which runs block by block so that
    /// each unit's gradient can go into its bucket as the unit is done:
    /// `held` adds what the lesson holds throughout (its compute copy); a
    /// unit being handed on widens its largest gradient to fp32 (`elem` < 4).
    pub fn last_micro_batch_moments(
        &self,
        s: &Session,
        elem: usize,
        recompute: bool,
        held: &mut dyn FnMut(&mut Moment),
    ) -> Vec<Moment> {
        s.blockwise_moments(elem, recompute, "my last micro-batch", &mut |_, _, m| held(m))
    }

    /// Where unit `u`'s gradient sits in the padded flat vector (the root,
    /// as the block-by-block backward hands it on, includes `ln_f` and the padding).
    pub fn ranges(&self, table: &ParamTable, u: Unit) -> Vec<Range<usize>> {
        unit_ranges(table, u, self.padded)
    }
}

/// `--bucket-mb`'s cap in bytes (at least one: a bucket holds one unit
/// whatever the cap).
pub fn cap_bytes(mb: Option<f64>) -> Option<usize> {
    mb.map(|mb| (mb * 1e6).round().max(1.0) as usize)
}

/// The config table's line for `b`, made for `--bucket-mb mb`.
pub fn describe(b: &Buckets, mb: f64) -> String {
    let names: Vec<String> = b.list.iter().map(Bucket::name).collect();
    let raised = match cap_bytes(Some(mb)) {
        Some(asked) if b.cap > asked => {
            format!(" (raised from {mb} MB: the stream holds {} in flight)", fsdp_comm::stream::SLOTS)
        }
        _ => String::new(),
    };
    let cap = b.cap as f64 / 1e6;
    format!(
        "{} of ≥ {cap} MB{raised}, each all-reduced on the stream in the backward: {}",
        b.list.len(),
        names.join(", ")
    )
}

/// The report's `buckets`: each bucket's units and elements (padding left out).
pub fn buckets_json(b: &Buckets) -> serde_json::Value {
    b.list.iter().map(|b| serde_json::json!({"name": b.name(), "units": b.units.len(), "elements": b.elems})).collect()
}

/// Unit `u`'s ranges of the flat vector padded to `padded`.
fn unit_ranges(table: &ParamTable, u: Unit, padded: usize) -> Vec<Range<usize>> {
    match u {
        Unit::Block(_) => vec![table.unit_range(u)],
        _ => vec![table.unit_range(Unit::Embedding), table.unit_range(Unit::FinalNorm), table.numel()..padded],
    }
}

/// Lays out `b`'s part of my group sums (`part(g, piece)`) for its
/// all-reduce: with one group, the pieces back to back and zeros up to its
/// padded length; with G groups, per destination rank as the grouped
/// reduce-scatter sends them — [rank j][group g][rank j's shard of the bucket].
fn pack<'a>(b: &Bucket, groups: usize, world: usize, buf: &mut [f32], part: impl Fn(usize, Range<usize>) -> &'a [f32]) {
    let shard = b.len / world;
    let at = |g: usize, e: usize| ((e / shard) * groups + g) * shard + e % shard; // element e of group g
    for g in 0..groups {
        let mut e = 0;
        for r in &b.pieces {
            let values = part(g, r.clone());
            if groups == 1 {
                buf[e..e + values.len()].copy_from_slice(values);
            } else {
                values.iter().enumerate().for_each(|(k, &x)| buf[at(g, e + k)] = x);
            }
            e += values.len();
        }
        (b.elems..b.len).for_each(|e| buf[at(g, e)] = 0.0); // the bucket's padding
    }
}

// ANCHOR: backward_in_buckets
/// My last micro-batch `k`, block by block, each unit's gradient added to
/// `sums` as its backward ends and handed to its bucket, which goes to the
/// stream once complete. Returns the micro-batch's loss.
pub fn backward_in_buckets(
    s: &Session,
    vars: &[Var],
    step: u64,
    k: usize,
    recompute: bool,
    sums: &mut MicroBatchSum,
    buckets: &mut Buckets,
) -> anyhow::Result<f32> {
    let (w, table) = (s.world, &s.table);
    let batch = s.sampler.micro_batch(step, k)?;
    let mut next = sums.begin(); // my last micro-batch, added range by range
    let since = Cell::new(Instant::now()); // for the trace's compute spans
    let mark = |label: &dyn Fn() -> String| since.set(w.traced_since(since.get(), label));
    let loss = blockwise::forward_backward_marked(
        &s.model,
        table,
        vars,
        &batch,
        recompute,
        |m| match m {
            Milestone::ForwardDone => mark(&|| format!("forward, micro-batch {k}")),
            Milestone::HeadDone => mark(&|| "head forward+backward".into()),
        },
        |unit, grads| {
            for (i, g) in &grads {
                add_into(&mut next.gradient()[table.specs[*i].range()], g)?;
            }
            drop(grads);
            for r in buckets.ranges(table, unit) {
                next.done(r); // into the pairwise tree over my micro-batches: now final
            }
            mark(&|| match unit {
                Unit::Block(i) => format!("backward h.{i}"),
                _ => "embedding backward".into(),
            });
            buckets.unit_done(w, unit, &next);
            Ok(())
        },
    )?;
    next.finish();
    Ok(loss)
}
// ANCHOR_END: backward_in_buckets

impl DataParallel {
    /// `--bucket-mb`: the replica and its buckets of at least `cap` bytes.
    /// The buckets are cut first, the state after, and the grad shard is
    /// theirs (each bucket has its own); the stream must be started.
    pub fn with_buckets(
        s: &Session,
        start: Start,
        reduce: Reduce,
        precision: Precision,
        recompute: bool,
        cap: usize,
    ) -> anyhow::Result<(Self, Buckets)> {
        let layout = ShardLayout::new(s.table.numel(), s.world.size());
        let buckets = Buckets::for_session(s, layout.padded, cap);
        Ok((Self::build(s, start, reduce, precision, recompute, 0)?, buckets))
    }

    // ANCHOR: bucketed_step
    /// The step of `data_parallel.rs` with DDP's buckets: my last micro-batch
    /// goes apart, and its backward all-reduces bucket by bucket on the stream.
    pub fn bucketed_step(&mut self, s: &Session, step: u64, b: &mut Buckets) -> anyhow::Result<f32> {
        let (w, numel) = (s.world, s.table.numel());
        // 1. forward/backward on my micro-batches but the last, summed in order; then the last, in buckets
        let vars = s.model.vars_in(&s.table, &self.params, self.precision)?;
        self.grads.reset();
        let mine = s.my_micro_batches();
        let mut loss_sum = w.traced(
            || "forward+backward of my micro-batches".into(),
            || accumulate_micro_batches(s, &vars, step, mine.start..mine.end - 1, self.recompute, &mut self.grads),
        )?;
        loss_sum += backward_in_buckets(s, &vars, step, mine.end - 1, self.recompute, &mut self.grads, b)? as f64;
        drop(vars);

        // 2. all-reduce: handed to the stream in the backward; wait for every bucket, then the mean
        let grads = b.all_reduced(w, &mut self.grads);
        let (m, grads) = (s.sampler.micro_batches, &mut grads[..numel]);
        scale(grads, m);
        s.clip_whole(grads); // --grad-clip: every rank holds the whole gradient

        // 3. update: the same AdamW step on every rank
        w.traced(|| "AdamW update".into(), || self.opt.step(&mut self.params, grads));
        Ok((w.sum_f64(&[loss_sum])[0] / m as f64) as f32)
    }
    // ANCHOR_END: bucketed_step

    /// [`DataParallel::tally`] under `--bucket-mb`: the buckets' rows in place
    /// of the grad shard and its receive buffer; my last micro-batch hands
    /// each block's gradient on as its backward ends, the others are
    /// collected whole.
    pub fn bucketed_tally(&self, s: &Session, b: &Buckets) -> MemoryTally {
        let mut t = self.state_rows(s);
        b.tally_rows(s, &mut t);
        s.data_tally(&mut t);
        let mut moments = self.whole_moments(s, s.my_micro_batches().len() - 1);
        // Each unit's gradient added to the sum as the unit is handed on.
        moments.extend(
            b.last_micro_batch_moments(s, self.precision.bytes(), self.recompute, &mut |m| self.vars_row(s, m)),
        );
        t.peak(moments);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_gpt::GptConfig;

    fn table() -> ParamTable {
        ParamTable::new(&GptConfig { vocab_size: 11, block_size: 8, n_layer: 3, n_head: 2, n_embd: 16 })
    }

    /// Units join a bucket until it holds the cap; every element of the
    /// padded vector is in exactly one bucket; the root comes last.
    #[test]
    fn buckets_cover_the_vector_once_in_backward_order() {
        let t = table();
        let padded = t.numel().div_ceil(3) * 3;
        let block = 4 * t.unit_range(Unit::Block(0)).len();
        for (cap, names) in [
            (1, vec!["h.2", "h.1", "h.0", "root"]),
            (block + 1, vec!["h.2-h.1", "h.0-root"]),
            (usize::MAX, vec!["h.2-root"]),
        ] {
            let b = Buckets::new(&t, 3, padded, 3, 1, cap);
            assert_eq!(b.list.iter().map(Bucket::name).collect::<Vec<_>>(), names, "cap {cap}");
            assert_eq!(Buckets::count(&t, 3, padded, cap), names.len(), "cap {cap}: counted as cut");
            let mut seen = vec![0u8; padded];
            b.list.iter().flat_map(|b| b.pieces.iter().cloned().flatten()).for_each(|e| seen[e] += 1);
            assert!(seen.iter().all(|&n| n == 1), "cap {cap}: every element once");
            assert!(b.list.iter().all(|b| b.len % 3 == 0 && b.len - b.elems < 3));
        }
    }

    /// A model deeper than the stream's slots: a cap of one byte would cut a
    /// bucket per block, more than can be in flight, so it is doubled until
    /// at most `SLOTS` buckets remain, and the config line says so.
    #[test]
    fn more_blocks_than_slots_double_the_cap() {
        let n_layer = 2 * fsdp_comm::stream::SLOTS;
        let t = ParamTable::new(&GptConfig { vocab_size: 11, block_size: 8, n_layer, n_head: 2, n_embd: 16 });
        let b = Buckets::new(&t, n_layer, t.numel(), 1, 1, 1);
        assert!(
            b.list.len() <= fsdp_comm::stream::SLOTS && b.list.len() > fsdp_comm::stream::SLOTS / 2,
            "{}",
            b.list.len()
        );
        assert!(b.cap > 1);
        let line = describe(&b, 0.000001);
        assert!(
            line.starts_with(&format!("{} of ≥ ", b.list.len())) && line.contains("raised from 0.000001 MB"),
            "{line}"
        );
        // A cap that cuts few enough buckets is left as asked.
        let shallow = Buckets::new(&table(), 3, table().numel(), 1, 1, 1);
        assert_eq!((shallow.cap, shallow.list.len()), (1, 4));
        assert!(!describe(&shallow, 0.000001).contains("raised"));
    }

    /// The packing for G groups puts each group's share for rank j where the
    /// grouped reduce-scatter expects it, and zeros the padding.
    #[test]
    fn packing_per_destination_matches_the_grouped_reduce_scatter() {
        let t = table();
        let padded = t.numel().div_ceil(2) * 2;
        let b = Buckets::new(&t, 3, padded, 2, 2, usize::MAX);
        let bucket = &b.list[0];
        let values: Vec<Vec<f32>> = (0..2).map(|g| (0..padded).map(|e| (g * 100_000 + e) as f32).collect()).collect();
        let mut buf = vec![f32::NAN; 2 * bucket.len];
        pack(bucket, 2, 2, &mut buf, |g, r| &values[g][r]);
        // The bucket as one vector per group, then laid out as fsdp_comm packs group sums.
        let flat: Vec<Vec<f32>> = values
            .iter()
            .map(|v| {
                let mut f: Vec<f32> = bucket.pieces.iter().flat_map(|r| v[r.clone()].iter().copied()).collect();
                f.resize(bucket.len, 0.0);
                f
            })
            .collect();
        let shard = bucket.len / 2;
        let expected: Vec<f32> =
            (0..2).flat_map(|j| flat.iter().flat_map(move |f| f[j * shard..(j + 1) * shard].to_vec())).collect();
        assert_eq!(buf, expected);
    }
}
