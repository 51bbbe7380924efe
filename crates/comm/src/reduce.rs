//! The one summation order every gradient sum in the project uses: a fixed
//! pairwise tree over the step's micro-batches.
//!
//! Floating-point addition is not associative, so "the sum of the
//! micro-batch gradients" is only a number once its order is fixed. The order
//! here is a binary tree split at midpoints:
//!
//! ```text
//! sum(0..8) = sum(0..4) + sum(4..8) = ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))
//! ```
//!
//! A rank holding a contiguous share of the micro-batches sums its share as
//! that share's subtree; the ranks' sums are then added as the top of the
//! tree. When N is a power of two dividing M, every rank's share *is* a
//! subtree, so N ranks compute exactly the additions one rank does: the bits
//! do not depend on the world size, for the same bytes on the wire as any
//! other order (one sum per rank). MPI's own reductions pick their trees by
//! world size and message size; the native all-reduce stays available
//! ([`crate::World::all_reduce_native`]) for comparison.
use std::collections::HashSet;
use std::ops::Range;

/// `parts[0] ← parts[0] + parts[1] + …`, added as a pairwise tree split at
/// the midpoint: `sum(parts) = sum(left half) + sum(right half)`, each half
/// summed into its own first part. In place: no buffer beyond the parts.
pub fn sum_pairwise(parts: &mut [&mut [f32]]) {
    pairwise_tree(parts, add_assign);
}

/// The midpoint tree of [`sum_pairwise`], each sum formed by `add` (f32's,
/// or bf16's rounded one, on f32 values or on bf16 bits).
fn pairwise_tree<T>(parts: &mut [&mut [T]], add: fn(&mut [T], &[T])) {
    assert!(!parts.is_empty(), "sum_pairwise: nothing to sum");
    if parts.len() > 1 {
        let (left, right) = parts.split_at_mut(parts.len() / 2);
        pairwise_tree(left, add);
        pairwise_tree(right, add);
        add(left[0], right[0]);
    }
}

fn add_assign(out: &mut [f32], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "summands differ in length");
    out.iter_mut().zip(x).for_each(|(o, x)| *o += x);
}

// ANCHOR: reduce_dtype
/// The dtype gradients are reduced in: FSDP2's `MixedPrecisionPolicy.reduce_dtype`
/// (`--reduce-dtype`). Under `Bf16` every sum of the pairwise tree is rounded
/// to bf16 — each micro-batch's gradient as it arrives, each addition of two
/// partial sums, on a rank or across ranks — so the tree is computed the same
/// way whichever rank forms which of its sums (the bits still do not depend
/// on the world size), and the reduce-scatter sends 2-byte elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReduceDtype {
    /// fp32 sums (FSDP2's advice: `reduce_dtype=torch.float32`).
    #[default]
    F32,
    /// bf16 sums: half the reduce-scatter's bytes, each sum rounded.
    Bf16,
}

impl ReduceDtype {
    /// Bytes per element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            ReduceDtype::F32 => 4,
            ReduceDtype::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for ReduceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReduceDtype::F32 => "fp32",
            ReduceDtype::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for ReduceDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(ReduceDtype::F32),
            "bf16" => Ok(ReduceDtype::Bf16),
            _ => Err(format!("`{s}` is not a reduce dtype: choose fp32 or bf16")),
        }
    }
}

/// f32 → bf16 bits, rounded to nearest even, a NaN kept a (quiet) NaN: the
/// bits of `fsdp_gpt::precision::to_bf16` (and `half`'s), which this crate
/// does not depend on; a test of the workspace holds the two together.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { (b >> 16) | 0x0040 } else { rounded }) as u16
}

/// A bf16's bits as the f32 it is (exactly; no NaN is made here).
#[inline(always)]
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `x` rounded to bf16, as an f32.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    bf16_value(bf16_bits(x))
}

/// `out += x`, each sum rounded to bf16 (both already bf16 values).
fn add_assign_bf16(out: &mut [f32], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "summands differ in length");
    out.iter_mut().zip(x).for_each(|(o, &x)| *o = round_bf16(*o + x));
}

/// [`sum_pairwise`] of bf16 parts, in place on their bits: the same tree,
/// each sum rounded to bf16 — what the reduce-scatter does with the parts a
/// bf16 all-to-all delivered.
pub fn sum_pairwise_bf16(parts: &mut [&mut [u16]]) {
    pairwise_tree(parts, add_assign_bf16_bits);
}

/// `out += x` on bf16 bits, each sum rounded to bf16.
fn add_assign_bf16_bits(out: &mut [u16], x: &[u16]) {
    assert_eq!(out.len(), x.len(), "summands differ in length");
    out.iter_mut().zip(x).for_each(|(o, &x)| *o = bf16_bits(bf16_value(*o) + bf16_value(x)));
}
// ANCHOR_END: reduce_dtype

/// [`sum_pairwise`] in `dtype`: under bf16 on bf16 values held as f32, each
/// sum rounded — the bits [`sum_pairwise_bf16`] gives on their bits.
pub fn sum_pairwise_in(dtype: ReduceDtype, parts: &mut [&mut [f32]]) {
    match dtype {
        ReduceDtype::F32 => pairwise_tree(parts, add_assign),
        ReduceDtype::Bf16 => pairwise_tree(parts, add_assign_bf16),
    }
}

/// `max` that keeps a NaN: a broken run must not read as "0 divergence"
/// (`f32::max` drops a NaN, and so does a comparison-based max).
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
}

// ANCHOR: sum_groups
/// How a step's M micro-batch gradients are summed: in G groups of M/G
/// consecutive micro-batches, each group as a pairwise tree, the G group
/// sums then as a pairwise tree. Each rank holds G/N whole groups and sends
/// their sums. By default G = N (one sum per rank: the fewest bytes), which
/// gives every power-of-two N dividing M the same bits; `--sum-groups G`
/// gives every N dividing G the same bits, at G/N times the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumGroups {
    pub groups: usize,
    pub micro_batches: usize,
    pub world: usize,
}

impl SumGroups {
    /// Checks N | G | M; the error names the fix.
    pub fn new(groups: usize, micro_batches: usize, world: usize) -> Result<Self, String> {
        if groups == 0 || !micro_batches.is_multiple_of(groups) {
            return Err(format!(
                "--sum-groups {groups} must divide --micro-batches {micro_batches}: pass a divisor of {micro_batches}"
            ));
        }
        if !groups.is_multiple_of(world) {
            return Err(format!(
                "--sum-groups {groups} does not split among {world} ranks: pass a multiple of {world} that divides {micro_batches}"
            ));
        }
        Ok(Self { groups, micro_batches, world })
    }

    /// Group sums each rank holds (and sends in the reduce-scatter).
    pub fn per_rank(&self) -> usize {
        self.groups / self.world
    }

    /// Micro-batches per group.
    fn group_len(&self) -> usize {
        self.micro_batches / self.groups
    }

    /// Every sum the whole step forms, as the range of micro-batches it
    /// covers: two plans give the same bits exactly when these sets are equal.
    fn tree(&self) -> HashSet<Range<usize>> {
        let q = self.group_len();
        let mut nodes = HashSet::new();
        // The top of the tree, over whole groups …
        tree_nodes(0..self.groups, &mut |r| {
            nodes.insert(r.start * q..r.end * q);
        });
        // … and inside every group, over its micro-batches.
        for g in 0..self.groups {
            tree_nodes(g * q..(g + 1) * q, &mut |r| {
                nodes.insert(r);
            });
        }
        nodes
    }

    /// Whether `other` forms exactly the same sums (then the same bits).
    pub fn same_order(&self, other: &SumGroups) -> bool {
        self.tree() == other.tree()
    }

    // ANCHOR: hsdp_order
    /// Every sum HSDP forms with shard groups of `shard` consecutive ranks:
    /// each group's reduce-scatter adds its ranks' group sums (`shard` ×
    /// G/N of them, consecutive in global order) as one pairwise tree, then
    /// the all-reduce across the N/`shard` replicas adds those partial sums
    /// as a pairwise tree in group order. The same bits as the plain order
    /// exactly when the two sets of sums are equal ([`SumGroups::hsdp_same_bits`]).
    fn hsdp_tree(&self, shard: usize) -> HashSet<Range<usize>> {
        let (q, per_group) = (self.group_len(), shard * self.per_rank());
        let mut nodes = HashSet::new();
        let mut add = |r: Range<usize>, scale: usize| {
            nodes.insert(r.start * scale..r.end * scale);
        };
        tree_nodes(0..self.world / shard, &mut |r| add(r, per_group * q)); // across the replicas
        for g in 0..self.world / shard {
            tree_nodes(g * per_group..(g + 1) * per_group, &mut |r| add(r, q)); // inside shard group g
        }
        for g in 0..self.groups {
            tree_nodes(g * q..(g + 1) * q, &mut |r| add(r, 1)); // inside every group of micro-batches
        }
        nodes
    }

    /// Whether HSDP with shard groups of `shard` ranks adds the micro-batch
    /// gradients exactly as one process does (then its weights are lesson
    /// 01's, bit for bit). True exactly when the number of replicas
    /// N/`shard` is a power of two — every split of the top of the tree
    /// then falls between shard groups — or when `shard` · G/N is 1 (each
    /// replica's partial sum is one group sum).
    pub fn hsdp_same_bits(&self, shard: usize) -> bool {
        shard > 0 && self.world.is_multiple_of(shard) && self.hsdp_tree(shard) == self.tree()
    }
    // ANCHOR_END: hsdp_order

    /// The most buffers a [`MicroBatchSum`] holds at once: the group sums
    /// finished so far plus the partial sums on its stack.
    pub fn buffers(&self) -> usize {
        self.allocated_before(self.micro_batches / self.world)
    }

    /// The buffers a fresh [`MicroBatchSum`] has allocated before it adds my
    /// `k`-th micro-batch (0-based): the most it held at once so far (merged
    /// halves are kept for reuse, not freed).
    pub fn allocated_before(&self, k: usize) -> usize {
        let nodes = group_tree(self.group_len());
        let (mut most, mut stack, mut added) = (0, Vec::<(Range<usize>, ())>::new(), 0);
        for g in 0..self.per_rank() {
            for i in 0..self.group_len() {
                if added == k {
                    return most;
                }
                stack.push((i..i + 1, ()));
                most = most.max(g + stack.len());
                merge_siblings(&nodes, &mut stack, |_, _| {});
                added += 1;
            }
            stack.clear();
        }
        most
    }

    /// The buffers a sum fed whole micro-batches ([`MicroBatchSum::push`],
    /// which frees merged halves) holds after my first `k`: its finished
    /// group sums and the partial sums on its stack.
    pub fn held_after(&self, k: usize) -> usize {
        let nodes = group_tree(self.group_len());
        let (q, mut stack) = (self.group_len(), Vec::<(Range<usize>, ())>::new());
        for i in 0..k % q {
            stack.push((i..i + 1, ()));
            merge_siblings(&nodes, &mut stack, |_, _| {});
        }
        k / q + stack.len()
    }
}
// ANCHOR_END: sum_groups

/// Calls `f` on every node of the midpoint tree over `r` (leaves included).
fn tree_nodes(r: Range<usize>, f: &mut impl FnMut(Range<usize>)) {
    f(r.clone());
    if r.len() > 1 {
        let mid = r.start + r.len() / 2;
        tree_nodes(r.start..mid, f);
        tree_nodes(mid..r.end, f);
    }
}

fn group_tree(len: usize) -> HashSet<Range<usize>> {
    let mut nodes = HashSet::new();
    tree_nodes(0..len, &mut |r| {
        nodes.insert(r);
    });
    nodes
}

/// While the top two entries of `stack` are the two children of one tree
/// node, replaces them by that node, `merge(left, right)` forming its value.
fn merge_siblings<T>(
    nodes: &HashSet<Range<usize>>,
    stack: &mut Vec<(Range<usize>, T)>,
    mut merge: impl FnMut(&mut T, T),
) {
    while stack.len() >= 2 {
        let n = stack.len();
        let joined = stack[n - 2].0.start..stack[n - 1].0.end;
        if !nodes.contains(&joined) {
            break;
        }
        let (_, right) = stack.pop().expect("right half");
        let (range, left) = stack.last_mut().expect("left half");
        merge(left, right);
        *range = joined;
    }
}

// ANCHOR: micro_batch_sum
/// This rank's sum of its micro-batch gradients, formed in the fixed
/// pairwise order of [`SumGroups`] as the gradients arrive one by one.
///
/// A lesson sees one buffer per micro-batch: [`MicroBatchSum::add`] hands it
/// a zeroed vector to add the gradient onto. Behind it, finished subtrees are
/// merged as soon as both halves exist (a post-order walk of the tree), so at
/// most about log₂(M/N) + 1 partial sums are alive at once.
pub struct MicroBatchSum {
    plan: SumGroups,
    len: usize,
    /// Whether each sum is rounded to bf16 ([`ReduceDtype`]).
    dtype: ReduceDtype,
    nodes: HashSet<Range<usize>>,
    /// Partial sums not yet merged: the micro-batches each covers, and its values.
    stack: Vec<(Range<usize>, Vec<f32>)>,
    /// Finished group sums, one per group of mine, in order.
    sums: Vec<Vec<f32>>,
    /// Buffers to reuse: a sum kept from step to step (lessons 01, 02) allocates nothing after the first.
    spare: Vec<Vec<f32>>,
    added: usize,
    /// The ranges [`MicroBatchSlot::done`] has added, kept for the next micro-batch's.
    done: Vec<Range<usize>>,
}

impl MicroBatchSum {
    /// An empty sum of vectors of `len` elements, in the order of `plan`.
    pub fn new(plan: SumGroups, len: usize) -> Self {
        let nodes = group_tree(plan.group_len());
        Self {
            plan,
            len,
            dtype: ReduceDtype::F32,
            nodes,
            stack: vec![],
            sums: vec![],
            spare: vec![],
            added: 0,
            done: vec![],
        }
    }

    /// The same sum in `dtype`: under bf16 each micro-batch's gradient is
    /// rounded to bf16 as its ranges are done, and each addition of the tree.
    pub fn in_dtype(mut self, dtype: ReduceDtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// The dtype its sums are formed (and reduced across ranks) in.
    pub fn dtype(&self) -> ReduceDtype {
        self.dtype
    }

    /// The same sum with its buffers allocated now: as many as the tree
    /// ever holds at once ([`SumGroups::buffers`]). A sum kept from step to
    /// step (lessons 01, 02) then holds from its first step what it holds at
    /// every step, which is what their tallies count.
    pub fn preallocated(mut self) -> Self {
        self.spare = (0..self.plan.buffers()).map(|_| vec![0.0; self.len]).collect();
        self
    }

    /// Adds the next of my micro-batches (in order): `add` adds its gradient
    /// onto the zeroed buffer it is given.
    pub fn add<R>(&mut self, add: impl FnOnce(&mut [f32]) -> R) -> R {
        let mut next = self.begin();
        let r = add(next.gradient());
        next.done(0..next.len());
        next.finish();
        r
    }

    /// Starts adding the next of my micro-batches piece by piece (what
    /// DDP's buckets need: a range of the sum is final while the backward
    /// still computes the rest). Its gradient goes onto the zeroed
    /// [`MicroBatchSlot::gradient`]; each range, once complete, is passed to
    /// [`MicroBatchSlot::done`], which adds it into the tree at once — the additions
    /// [`MicroBatchSum::add`] makes for the whole vector, restricted to the
    /// range, so the bits are the same however the vector is cut.
    pub fn begin(&mut self) -> MicroBatchSlot<'_> {
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(self.len, 0.0);
        self.slot(buf)
    }

    /// The next micro-batch's slot, on `buf` as it is.
    fn slot(&mut self, buf: Vec<f32>) -> MicroBatchSlot<'_> {
        assert!(self.added < self.plan.micro_batches / self.plan.world, "more micro-batches than this rank holds");
        // Which partial sums the new leaf merges into: the top `merges` of the
        // stack, walked down as `merge_siblings` will join them in `finish`.
        let i = self.added % self.plan.group_len();
        let (mut joined, mut merges) = (i..i + 1, 0);
        for (r, _) in self.stack.iter().rev() {
            let up = r.start..joined.end;
            if r.end != joined.start || !self.nodes.contains(&up) {
                break;
            }
            (joined, merges) = (up, merges + 1);
        }
        let completes_group = merges == self.stack.len() && joined.len() == self.plan.group_len();
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        MicroBatchSlot { sum: self, buf, merges, completes_group, done }
    }

    /// The one micro-batch added so far, taken out whole: its gradient as
    /// the tree's leaf holds it (rounded to bf16 under bf16). What a step
    /// that walks micro-batch after micro-batch hands on to a sum held
    /// across them ([`MicroBatchSum::push`]).
    pub fn take_leaf(&mut self) -> Vec<f32> {
        assert_eq!(self.added, 1, "a leaf is a sum of exactly one micro-batch");
        self.added = 0;
        let leaf = self.sums.pop().or_else(|| self.stack.pop().map(|(_, b)| b));
        leaf.expect("the micro-batch's buffer")
    }

    /// Adds the next of my micro-batches given whole: `leaf`, its gradient
    /// as [`MicroBatchSum::take_leaf`] took it from a sum of the same plan
    /// and dtype (or every rank's shard of such leaves, side by side: the
    /// additions are element by element). The additions are those of
    /// [`MicroBatchSum::add`], so are the bits (a leaf is the zeroed buffer
    /// plus the gradient already, and bf16's rounding of it is exact). Every
    /// leaf brings its own buffer, so merged halves are freed, not kept:
    /// [`SumGroups::held_after`] says how many are held.
    pub fn push(&mut self, leaf: Vec<f32>) {
        assert_eq!(leaf.len(), self.len, "a leaf of the sum's length");
        let mut slot = self.slot(leaf);
        slot.done(0..slot.len());
        slot.finish();
        self.spare.clear();
    }

    /// My group sums, taken out (what a reduce-scatter on the stream carries
    /// away); the sum is left empty for the next step, its spare buffers kept.
    pub fn take_sums(&mut self) -> Vec<Vec<f32>> {
        assert_eq!(self.sums.len(), self.plan.per_rank(), "the sum is complete only after every micro-batch of mine");
        self.added = 0;
        std::mem::take(&mut self.sums)
    }

    /// My group sums, once all my micro-batches are added: what the
    /// reduce-scatter sends (one vector by default).
    pub fn sums(&mut self) -> &mut [Vec<f32>] {
        assert_eq!(self.sums.len(), self.plan.per_rank(), "the sum is complete only after every micro-batch of mine");
        &mut self.sums
    }

    /// Empties the sum for the next step, keeping its buffers.
    pub fn reset(&mut self) {
        self.spare.append(&mut self.sums);
        self.spare.extend(self.stack.drain(..).map(|(_, b)| b));
        self.added = 0;
    }
}
// ANCHOR_END: micro_batch_sum

/// One micro-batch being added to a [`MicroBatchSum`], range by range.
pub struct MicroBatchSlot<'a> {
    sum: &'a mut MicroBatchSum,
    /// The micro-batch's gradient: the tree's new leaf.
    buf: Vec<f32>,
    /// How many partial sums on the stack the leaf merges into (the top ones).
    merges: usize,
    /// Whether the merges finish a group (then its sum is final).
    completes_group: bool,
    /// The ranges added so far (checked to tile the vector in `finish`).
    done: Vec<Range<usize>>,
}

impl MicroBatchSlot<'_> {
    /// Elements of the vector.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Where the micro-batch's gradient goes (zeroed).
    pub fn gradient(&mut self) -> &mut [f32] {
        &mut self.buf
    }

    /// `r` of the gradient is complete: add it into the tree now (each
    /// merge `left += right`, on `r` only). Every element must be done once.
    pub fn done(&mut self, r: Range<usize>) {
        assert!(r.end <= self.buf.len(), "a range beyond the sum's {} elements", self.buf.len());
        assert!(self.done.iter().all(|d| d.end <= r.start || r.end <= d.start), "a range of the sum was added twice");
        self.done.push(r.clone());
        let add = match self.sum.dtype {
            ReduceDtype::F32 => add_assign,
            ReduceDtype::Bf16 => {
                self.buf[r.clone()].iter_mut().for_each(|g| *g = round_bf16(*g)); // the leaf, in bf16
                add_assign_bf16
            }
        };
        let stack = &mut self.sum.stack;
        let n = stack.len();
        if self.merges == 0 {
            return; // the leaf stays on the stack as it is
        }
        add(&mut stack[n - 1].1[r.clone()], &self.buf[r.clone()]);
        for t in (n - self.merges..n - 1).rev() {
            let (lower, upper) = stack.split_at_mut(t + 1);
            add(&mut lower[t].1[r.clone()], &upper[0].1[r.clone()]);
        }
    }

    /// The range `r` of my group sum `g` (0-based, in order), once final:
    /// an earlier group's, or — after [`MicroBatchSlot::done`] on `r` — the group
    /// this micro-batch completes.
    pub fn final_part(&self, g: usize, r: Range<usize>) -> &[f32] {
        let sums = &self.sum.sums;
        if g < sums.len() {
            return &sums[g][r];
        }
        assert!(g == sums.len() && self.completes_group, "group {g} is not complete yet");
        match self.merges {
            0 => &self.buf[r], // a group of one micro-batch: the leaf is its sum
            m => &self.sum.stack[self.sum.stack.len() - m].1[r],
        }
    }

    /// Ends the micro-batch: the tree's bookkeeping for the additions made.
    pub fn finish(self) {
        let covered: usize = self.done.iter().map(|r| r.len()).sum();
        assert_eq!(covered, self.buf.len(), "every element of the sum must be added, once");
        let MicroBatchSlot { sum, buf, done, .. } = self;
        sum.done = done;
        let i = sum.added % sum.plan.group_len();
        sum.stack.push((i..i + 1, buf));
        sum.added += 1;
        let spare = &mut sum.spare;
        merge_siblings(&sum.nodes, &mut sum.stack, |_, right| spare.push(right)); // added already, range by range
        if sum.stack.len() == 1 && sum.stack[0].0.len() == sum.plan.group_len() {
            let (_, group) = sum.stack.pop().expect("a finished group");
            sum.sums.push(group);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// M values whose sum depends on the order of the additions: their
    /// magnitudes span seven decades, so most partial sums round.
    fn values(m: usize) -> Vec<f32> {
        (0..m)
            .map(|i| {
                (1.0 + ((i * 7919) % 13) as f32 * 0.1)
                    * 10f32.powi((i % 7) as i32 - 3)
                    * if i % 2 == 0 { 1.0 } else { -0.7 }
            })
            .collect()
    }

    /// What N ranks compute for one element: each rank's groups through a
    /// MicroBatchSum, then the pairwise sum of every rank's group sums.
    fn as_ranks_would(values: &[f32], groups: usize, world: usize) -> f32 {
        let plan = SumGroups::new(groups, values.len(), world).unwrap();
        let per_rank = values.len() / world;
        let mut all_groups = vec![];
        for r in 0..world {
            let mut s = MicroBatchSum::new(plan, 1);
            for v in &values[r * per_rank..(r + 1) * per_rank] {
                s.add(|b| b[0] += v);
            }
            all_groups.extend(s.sums().iter().cloned());
        }
        sum_pairwise(&mut all_groups.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
        all_groups[0][0]
    }

    /// The tree written out by hand, recursively.
    fn tree_sum(v: &[f32]) -> f32 {
        if v.len() == 1 { 0.0 + v[0] } else { tree_sum(&v[..v.len() / 2]) + tree_sum(&v[v.len() / 2..]) }
    }

    #[test]
    fn one_rank_sums_the_midpoint_tree() {
        for m in [1, 2, 3, 5, 7, 12, 24] {
            let v = values(m);
            assert_eq!(as_ranks_would(&v, 1, 1).to_bits(), tree_sum(&v).to_bits(), "M = {m}");
        }
    }

    #[test]
    fn the_default_gives_every_power_of_two_world_the_same_bits() {
        let v = values(24);
        let one = as_ranks_would(&v, 1, 1).to_bits();
        for n in [2, 4, 8] {
            assert_eq!(as_ranks_would(&v, n, n).to_bits(), one, "N = {n}");
            assert!(SumGroups::new(n, 24, n).unwrap().same_order(&SumGroups::new(1, 24, 1).unwrap()));
        }
        // N = 3 splits 24 as 8 + 8 + 8, not at the midpoint: another order.
        assert!(!SumGroups::new(3, 24, 3).unwrap().same_order(&SumGroups::new(1, 24, 1).unwrap()));
        let per_world: Vec<u32> = [1, 3, 6, 12].iter().map(|&n| as_ranks_would(&v, n, n).to_bits()).collect();
        assert!(per_world.iter().any(|&b| b != per_world[0]), "these values do tell orders apart: {per_world:?}");
    }

    /// What N ranks compute under a bf16 reduction: each rank's micro-batches
    /// through a bf16 MicroBatchSum, the group sums across ranks by
    /// [`sum_pairwise_bf16`] on their bits (what the reduce-scatter does).
    fn as_ranks_would_bf16(values: &[f32], groups: usize, world: usize) -> f32 {
        let plan = SumGroups::new(groups, values.len(), world).unwrap();
        let per_rank = values.len() / world;
        let mut bits = vec![];
        for r in 0..world {
            let mut s = MicroBatchSum::new(plan, 1).in_dtype(ReduceDtype::Bf16);
            for v in &values[r * per_rank..(r + 1) * per_rank] {
                s.add(|b| b[0] += v);
            }
            bits.extend(s.sums().iter().map(|g| vec![bf16_bits(g[0])]));
        }
        sum_pairwise_bf16(&mut bits.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
        bf16_value(bits[0][0])
    }

    /// The tree written out by hand with bf16's rounding at every node, the leaves too.
    fn tree_sum_bf16(v: &[f32]) -> f32 {
        match v.len() {
            1 => round_bf16(v[0]),
            n => round_bf16(tree_sum_bf16(&v[..n / 2]) + tree_sum_bf16(&v[n / 2..])),
        }
    }

    /// A bf16 reduction rounds every sum of the one tree — each micro-batch
    /// on arrival, each addition on a rank or across ranks — so every
    /// power-of-two world size, and every --sum-groups grouping of it, gets
    /// the tree's bits; and they are not the fp32 reduction's.
    #[test]
    fn a_bf16_reduction_rounds_every_node_of_the_one_tree() {
        for m in [1, 2, 3, 7, 16, 24] {
            let v = values(m);
            let want = tree_sum_bf16(&v).to_bits();
            assert_eq!(as_ranks_would_bf16(&v, 1, 1).to_bits(), want, "M = {m}, one rank");
            for n in [2, 4, 8].into_iter().filter(|n| m % n == 0) {
                assert_eq!(as_ranks_would_bf16(&v, n, n).to_bits(), want, "M = {m}, {n} ranks");
            }
        }
        let v = values(24);
        assert_ne!(as_ranks_would_bf16(&v, 1, 1), as_ranks_would(&v, 1, 1), "bf16 sums round where fp32 ones do not");
        // A bf16 value's bits, and back: the rounding `half` does.
        for x in [1.0f32, 1.003_906_3, -3.3e-5, f32::MAX, 1e-40, f32::NAN] {
            let want = x.to_bits() >> 16;
            let got = bf16_bits(x) as u32;
            assert!(got == want || got == want + 1 || x.is_nan(), "{x}: {got:#x}");
        }
        assert_eq!(bf16_bits(1.003_906_3), 0x3F80, "a tie goes to the even one");
        assert_eq!(bf16_bits(f32::MAX), 0x7F80, "past bf16's largest: infinity");
    }

    #[test]
    fn hsdp_keeps_the_bits_when_the_replicas_are_a_power_of_two() {
        let plan = |g, m, n| SumGroups::new(g, m, n).unwrap();
        // 4 ranks in 2 groups of 2, 8 ranks in groups of 2 or 4: 2 or 4 replicas.
        assert!(plan(4, 8, 4).hsdp_same_bits(2));
        assert!(plan(8, 16, 8).hsdp_same_bits(2) && plan(8, 16, 8).hsdp_same_bits(4));
        // Several sums per rank (--sum-groups) change nothing about that.
        assert!(plan(8, 16, 4).hsdp_same_bits(2));
        // 3 replicas split the top of the tree inside a shard group: 6 ranks, S = 2.
        assert!(!plan(6, 12, 6).hsdp_same_bits(2));
        // … but 2 replicas of 3 keep it (the first split is between the groups).
        assert!(plan(6, 12, 6).hsdp_same_bits(3));
        // S = N (one group: plain FSDP) and S = 1 (plain replication) always do.
        assert!(plan(6, 12, 6).hsdp_same_bits(6) && plan(6, 12, 6).hsdp_same_bits(1));
        // S must divide N.
        assert!(!plan(6, 12, 6).hsdp_same_bits(4) && !plan(6, 12, 6).hsdp_same_bits(0));
    }

    #[test]
    fn fixed_groups_round_the_same_at_every_world_size_dividing_them() {
        let v = values(12);
        for n in [1, 2, 3, 4, 6, 12] {
            assert_eq!(as_ranks_would(&v, 12, n).to_bits(), as_ranks_would(&v, 12, 1).to_bits(), "world {n}");
        }
        assert_eq!(as_ranks_would(&v, 4, 2), as_ranks_would(&v, 4, 4));
        assert!(
            SumGroups::new(4, 12, 3).is_err() && SumGroups::new(5, 12, 1).is_err() && SumGroups::new(0, 12, 1).is_err()
        );
    }

    #[test]
    fn the_stack_stays_logarithmic_and_buffers_says_how_deep() {
        for (m, g, n, most) in [(1, 1, 1, 1), (2, 1, 1, 2), (4, 1, 1, 3), (24, 2, 2, 5), (24, 12, 1, 13), (8, 8, 8, 1)]
        {
            let plan = SumGroups::new(g, m, n).unwrap();
            assert_eq!(plan.buffers(), most, "M {m}, G {g}, N {n}");
            assert_eq!(plan.allocated_before(0), 0);
            let mut s = MicroBatchSum::new(plan, 3);
            for k in 0..m / n {
                let allocated = s.stack.len() + s.sums.len() + s.spare.len();
                assert_eq!(allocated, plan.allocated_before(k), "M {m}, G {g}, N {n}, before micro-batch {k}");
                s.add(|b| b[0] = 1.0);
                assert!(s.stack.len() + s.sums.len() <= most);
            }
            assert_eq!(s.sums().len(), g / n);
            s.reset();
            assert!(s.spare.len() <= most);
        }
    }

    #[test]
    fn pairwise_is_left_half_plus_right_half() {
        // (1e8 + 1) + (−1e8 + 0) … the tree fixes which additions round.
        let sum = |mut values: Vec<[f32; 1]>| {
            sum_pairwise(&mut values.iter_mut().map(|v| &mut v[..]).collect::<Vec<_>>());
            values[0][0]
        };
        assert_eq!(sum(vec![[1e8], [1.0], [-1e8], [0.0]]), (1e8f32 + 1.0) + (-1e8f32 + 0.0));
        assert_eq!(sum(vec![[1e8], [-1e8], [1.0]]), 1e8f32 + (-1e8f32 + 1.0));
        assert!(nan_max(0.0, f32::NAN).is_nan() && nan_max(f32::NAN, 1.0).is_nan() && nan_max(1.0, 2.0) == 2.0);
    }

    /// Adds `m` micro-batches of `len` values through `MicroBatchSum::add`,
    /// or (`pieces`) range by range, the ranges done back to front as a
    /// backward finishes the last layers first.
    fn summed(plan: SumGroups, m: usize, len: usize, pieces: Option<usize>) -> Vec<Vec<f32>> {
        let mut s = MicroBatchSum::new(plan, len);
        for k in 0..m {
            let grad = |e: usize| values(m * len)[k * len + e];
            match pieces {
                None => s.add(|b| b.iter_mut().enumerate().for_each(|(e, x)| *x += grad(e))),
                Some(p) => {
                    let mut a = s.begin();
                    a.gradient().iter_mut().enumerate().for_each(|(e, x)| *x += grad(e));
                    let cuts: Vec<usize> = (0..=p).map(|c| c * len / p).collect();
                    for w in cuts.windows(2).rev() {
                        a.done(w[0]..w[1]);
                    }
                    a.finish();
                }
            }
        }
        s.sums().to_vec()
    }

    #[test]
    fn range_by_range_gives_the_bits_of_the_whole_vector() {
        for (m, g, n) in [(8, 1, 1), (8, 2, 1), (12, 4, 2), (6, 3, 3), (5, 5, 1)] {
            let plan = SumGroups::new(g, m, n).unwrap();
            let whole = summed(plan, m / n, 7, None);
            for p in [1, 2, 3, 7] {
                let pieces = summed(plan, m / n, 7, Some(p));
                let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&pieces), bits(&whole), "M {m}, G {g}, N {n}, {p} pieces");
            }
        }
    }

    /// Micro-batch after micro-batch: each micro-batch's leaf taken from a
    /// sum of its own and pushed into one held across them gives the bits of
    /// adding them all to one sum, in fp32 and bf16, for any grouping; the
    /// held sum keeps only what `held_after` says.
    #[test]
    fn leaves_pushed_one_by_one_give_the_bits_of_one_sum() {
        for (m, g, n) in [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 2, 1), (12, 4, 2), (6, 3, 3), (24, 2, 2)] {
            let plan = SumGroups::new(g, m, n).unwrap();
            for dtype in [ReduceDtype::F32, ReduceDtype::Bf16] {
                let (len, mine) = (5, m / n);
                let grad = |k: usize, e: usize| values(mine * len)[k * len + e];
                let mut whole = MicroBatchSum::new(plan, len).in_dtype(dtype);
                let mut held = MicroBatchSum::new(plan, len).in_dtype(dtype);
                for k in 0..mine {
                    whole.add(|b| b.iter_mut().enumerate().for_each(|(e, x)| *x += grad(k, e)));
                    let mut one = MicroBatchSum::new(plan, len).in_dtype(dtype);
                    one.add(|b| b.iter_mut().enumerate().for_each(|(e, x)| *x += grad(k, e)));
                    held.push(one.take_leaf());
                    assert_eq!(held.stack.len() + held.sums.len() + held.spare.len(), plan.held_after(k + 1));
                }
                let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(held.sums()), bits(whole.sums()), "M {m}, G {g}, N {n}, {dtype}");
            }
            assert_eq!(plan.held_after(0), 0);
            assert!((0..=m / n).all(|k| plan.held_after(k) <= plan.buffers()));
        }
        let mut parts = [[1e8f32], [1.0], [-1e8], [0.0]];
        sum_pairwise_in(ReduceDtype::F32, &mut parts.iter_mut().map(|p| &mut p[..]).collect::<Vec<_>>());
        assert_eq!(parts[0][0], (1e8f32 + 1.0) + (-1e8f32 + 0.0));
    }

    #[test]
    #[should_panic(expected = "added twice")]
    fn a_range_done_twice_is_refused() {
        let mut s = MicroBatchSum::new(SumGroups::new(1, 2, 1).unwrap(), 4);
        s.add(|b| b.fill(1.0));
        let mut a = s.begin();
        a.done(0..3);
        a.done(2..4); // overlaps 2..3: its values would be added twice
    }

    #[test]
    #[should_panic(expected = "once")]
    fn a_range_left_out_is_refused() {
        let mut s = MicroBatchSum::new(SumGroups::new(1, 1, 1).unwrap(), 4);
        let mut a = s.begin();
        a.done(0..3);
        a.finish();
    }
}
