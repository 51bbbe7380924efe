//! What a forward/backward pass holds, from shapes alone.
//!
//! candle keeps every tensor the forward computes alive until the backward
//! is done: each op records its inputs (`Arc`s) so that the backward can
//! read them. Then the backward allocates the gradient of every node it
//! passes, adds into sums and makes temporaries. How many bytes that is
//! follows from the shapes and from what candle's ops do — which this
//! module mirrors, op by op, without running any of them:
//!
//! - [`Graph`] records the ops of our model (the same calls as
//!   [`crate::model`], with shapes instead of values): which allocate a new
//!   buffer (a matmul, an add) and which are views (reshape of a
//!   contiguous tensor, transpose, narrow, broadcast).
//! - [`Graph::backward`] replays candle 0.11's `Tensor::backward` on it:
//!   the same topological order, and for every op the buffers its gradient
//!   rule allocates and frees, in order. The result is the highest number
//!   of bytes the backward holds on top of the forward's.
//! - [`Graph::backward_taped`] replays a block's tape
//!   ([`crate::model::BlockTape`]) the same way, but for the one rule the
//!   tape changes: a tensor's first gradient is held as it is, not added
//!   into zeros (the GradStore's `0 + g`).
//!
//! The tests hold both numbers against a counting allocator around the real
//! model. A lesson adds them to its own buffers to predict its peak heap.
use std::collections::HashMap;

use crate::config::GptConfig;
use crate::kernels::Probs;
use crate::params::{PARAMS_PER_BLOCK, ParamTable};

/// Gradient rules need to know which op made a node.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Leaf,
    Binary(usize, usize, Bin),
    Unary(usize, Un),
    Affine(usize),
    Sum(usize),
    Max(usize),
    Broadcast(usize),
    Reshape(usize),
    Transpose(usize),
    /// `(arg, dim, start, len)`
    Narrow(usize, usize, usize, usize),
    Copy(usize),
    IndexSelect(usize),
    Gather(usize),
    MatMul(usize, usize),
    ToDType(usize),
    /// [`crate::kernels::layer_norm`]: `(x, w, b)`.
    LayerNorm(usize, usize, usize),
    /// [`crate::kernels::linear`]: `(x, w, b)`.
    Linear(usize, usize, usize),
    /// [`crate::kernels::linear_gelu`], [`crate::kernels::linear_attention`]:
    /// `(x, w, b, h, then)`, `h` the layer's output, which the op keeps.
    LinearThen(usize, usize, usize, usize, Then),
}

/// The op a [`Op::LinearThen`] runs on the layer's output.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Then {
    Gelu,
    /// `(P, nh)`: P the probabilities the attention keeps, none under [`Probs::Recompute`].
    Attention(Option<usize>, usize),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Bin {
    Add,
    Sub,
    Mul,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Un {
    Exp,
    Log,
}

#[derive(Debug, Clone)]
struct Node {
    shape: Vec<usize>,
    /// Bytes per element (4 for f32, 2 for bf16).
    elem: usize,
    /// Which buffer holds the values (views share their source's).
    storage: usize,
    contiguous: bool,
    /// `None` when candle records no op (no input tracks a gradient).
    op: Option<Op>,
    var: bool,
    /// Made before the pass (a `Var`, an input): not the pass's to count.
    given: bool,
}

impl Node {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn bytes(&self) -> usize {
        self.numel() * self.elem
    }
    fn tracked(&self) -> bool {
        self.var || self.op.is_some()
    }
}

/// A tensor of a [`Graph`]: an index into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct T(usize);

/// The ops of one forward pass, as shapes. Build it with the methods that
/// mirror candle's (each says whether it allocates), then ask it what the
/// forward keeps and what the backward needs.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    nodes: Vec<Node>,
    /// Bytes of each buffer.
    storages: Vec<usize>,
}

/// What one forward/backward pass holds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    /// Buffers the graph keeps alive from the forward until the backward is
    /// done (the activations), the `Var`s' own buffers excluded.
    pub activations: usize,
    /// The most the backward holds at once on top of the activations:
    /// gradients in flight, the sums growing in the GradStore, temporaries.
    pub backward_peak: usize,
    /// What the GradStore still holds when backward returns: the `Var`s'
    /// gradients ([`Footprint::var_grads`]), the gradients of a pass's
    /// inputs made `Var`s among them.
    pub grad_store: usize,
    pub var_grads: usize,
    /// Of [`Footprint::backward_peak`], the `Var`s' gradients in the
    /// GradStore at that moment (model states, the rest is working set).
    pub var_grads_at_peak: usize,
}

impl Graph {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&mut self, shape: Vec<usize>, elem: usize, storage: Option<usize>, contiguous: bool, op: Op) -> T {
        let inputs = op.inputs();
        let tracked = inputs.iter().any(|&i| self.nodes[i].tracked());
        let storage = storage.unwrap_or_else(|| {
            self.storages.push(shape.iter().product::<usize>() * elem);
            self.storages.len() - 1
        });
        let op = match op {
            Op::Leaf => None,
            op => tracked.then_some(op),
        };
        self.nodes.push(Node { shape, elem, storage, contiguous, op, var: false, given: false });
        T(self.nodes.len() - 1)
    }

    fn n(&self, t: T) -> &Node {
        &self.nodes[t.0]
    }

    pub fn shape(&self, t: T) -> &[usize] {
        &self.n(t).shape
    }

    /// A `Var` (a parameter): its gradient is what backward is for.
    pub fn var(&mut self, shape: &[usize], elem: usize) -> T {
        let t = self.input(shape, elem);
        self.nodes[t.0].var = true;
        t
    }

    /// A tensor that exists before the pass and tracks nothing (an upstream
    /// gradient): the pass reads it, it is counted elsewhere.
    pub fn input(&mut self, shape: &[usize], elem: usize) -> T {
        let t = self.push(shape.to_vec(), elem, None, true, Op::Leaf);
        self.nodes[t.0].given = true;
        t
    }

    /// A tensor the pass makes that tracks nothing.
    pub fn constant(&mut self, shape: &[usize], elem: usize) -> T {
        self.push(shape.to_vec(), elem, None, true, Op::Leaf)
    }

    fn alloc(&mut self, shape: Vec<usize>, elem: usize, op: Op) -> T {
        self.push(shape, elem, None, true, op)
    }

    fn view(&mut self, of: T, shape: Vec<usize>, contiguous: bool, op: Op) -> T {
        let (elem, storage) = (self.n(of).elem, self.n(of).storage);
        self.push(shape, elem, Some(storage), contiguous, op)
    }

    fn binary(&mut self, a: T, b: T, op: Bin) -> T {
        assert_eq!(self.n(a).shape, self.n(b).shape, "same-shape binary op");
        self.alloc(self.n(a).shape.clone(), self.n(a).elem, Op::Binary(a.0, b.0, op))
    }

    pub fn add(&mut self, a: T, b: T) -> T {
        self.binary(a, b, Bin::Add)
    }

    pub fn mul(&mut self, a: T, b: T) -> T {
        self.binary(a, b, Bin::Mul)
    }

    /// `broadcast_as`: a view, and a node of its own.
    pub fn broadcast_as(&mut self, a: T, shape: &[usize]) -> T {
        self.view(a, shape.to_vec(), false, Op::Broadcast(a.0))
    }

    /// `broadcast_{add,sub,mul,div}`: each side that needs it is broadcast first.
    fn broadcast_binary(&mut self, a: T, b: T, op: Bin) -> T {
        let (sa, sb) = (self.n(a).shape.clone(), self.n(b).shape.clone());
        let rank = sa.len().max(sb.len());
        let dim = |s: &[usize], i: usize| if i + s.len() < rank { 1 } else { s[i + s.len() - rank] };
        let shape: Vec<usize> = (0..rank).map(|i| dim(&sa, i).max(dim(&sb, i))).collect();
        let a = if sa != shape { self.broadcast_as(a, &shape) } else { a };
        let b = if sb != shape { self.broadcast_as(b, &shape) } else { b };
        self.binary(a, b, op)
    }

    pub fn broadcast_add(&mut self, a: T, b: T) -> T {
        self.broadcast_binary(a, b, Bin::Add)
    }
    pub fn broadcast_sub(&mut self, a: T, b: T) -> T {
        self.broadcast_binary(a, b, Bin::Sub)
    }
    pub fn broadcast_mul(&mut self, a: T, b: T) -> T {
        self.broadcast_binary(a, b, Bin::Mul)
    }
    fn unary(&mut self, a: T, op: Un) -> T {
        self.alloc(self.n(a).shape.clone(), self.n(a).elem, Op::Unary(a.0, op))
    }

    /// `x * s`, `x + s`, `x / s` with a scalar `s`.
    pub fn affine(&mut self, a: T) -> T {
        self.alloc(self.n(a).shape.clone(), self.n(a).elem, Op::Affine(a.0))
    }

    fn keepdim(&self, a: T, dim: usize) -> Vec<usize> {
        let mut s = self.n(a).shape.clone();
        s[dim] = 1;
        s
    }

    pub fn sum_keepdim(&mut self, a: T, dim: usize) -> T {
        let s = self.keepdim(a, dim);
        self.alloc(s, self.n(a).elem, Op::Sum(a.0))
    }

    pub fn max_keepdim(&mut self, a: T, dim: usize) -> T {
        let s = self.keepdim(a, dim);
        self.alloc(s, self.n(a).elem, Op::Max(a.0))
    }

    /// `sum_all`: one sum over every dimension, then a reshape to a scalar.
    pub fn sum_all(&mut self, a: T) -> T {
        let ones = vec![1; self.n(a).shape.len()];
        let s = self.alloc(ones, self.n(a).elem, Op::Sum(a.0));
        self.reshape(s, &[])
    }

    /// A view when the input is contiguous, a copy otherwise.
    pub fn reshape(&mut self, a: T, shape: &[usize]) -> T {
        match self.n(a).contiguous {
            true => self.view(a, shape.to_vec(), true, Op::Reshape(a.0)),
            false => self.alloc(shape.to_vec(), self.n(a).elem, Op::Reshape(a.0)),
        }
    }

    /// Swaps two dimensions: always a view.
    pub fn transpose(&mut self, a: T, d1: usize, d2: usize) -> T {
        let mut s = self.n(a).shape.clone();
        s.swap(d1, d2);
        let contiguous = self.n(a).shape[d1] == 1 || self.n(a).shape[d2] == 1;
        self.view(a, s, contiguous && self.n(a).contiguous, Op::Transpose(a.0))
    }

    /// `t()`: the last two dimensions swapped.
    pub fn t(&mut self, a: T) -> T {
        let r = self.n(a).shape.len();
        self.transpose(a, r - 2, r - 1)
    }

    pub fn contiguous(&mut self, a: T) -> T {
        match self.n(a).contiguous {
            true => a,
            false => self.alloc(self.n(a).shape.clone(), self.n(a).elem, Op::Copy(a.0)),
        }
    }

    /// A view; the whole dimension is the tensor itself.
    pub fn narrow(&mut self, a: T, dim: usize, start: usize, len: usize) -> T {
        let shape = self.n(a).shape.clone();
        if start == 0 && len == shape[dim] {
            return a;
        }
        let mut s = shape.clone();
        s[dim] = len;
        // A narrow of the first dimension (or after only ones) stays contiguous.
        let contiguous = self.n(a).contiguous && shape[..dim].iter().all(|&d| d == 1);
        self.view(a, s, contiguous, Op::Narrow(a.0, dim, start, len))
    }

    /// `embedding`: one row of `table` per id.
    pub fn index_select(&mut self, table: T, ids: usize) -> T {
        let c = self.n(table).shape[1];
        self.alloc(vec![ids, c], self.n(table).elem, Op::IndexSelect(table.0))
    }

    /// `gather` along the last dimension, one element per row.
    pub fn gather_one(&mut self, a: T) -> T {
        let rows = self.n(a).shape[0];
        self.alloc(vec![rows, 1], self.n(a).elem, Op::Gather(a.0))
    }

    /// [`crate::kernels::matmul`]: its output (its packed panels, freed
    /// before it returns, matter only in the backward, where they can be the peak).
    pub fn matmul(&mut self, a: T, b: T) -> T {
        let (sa, sb) = (&self.n(a).shape, &self.n(b).shape);
        let mut s = sa[..sa.len() - 1].to_vec();
        s.push(sb[sb.len() - 1]);
        let elem = self.n(a).elem;
        self.alloc(s, elem, Op::MatMul(a.0, b.0))
    }

    pub fn to_dtype(&mut self, a: T, elem: usize) -> T {
        match self.n(a).elem == elem {
            true => a,
            false => self.alloc(self.n(a).shape.clone(), elem, Op::ToDType(a.0)),
        }
    }

    pub fn exp(&mut self, a: T) -> T {
        self.unary(a, Un::Exp)
    }
    pub fn log(&mut self, a: T) -> T {
        self.unary(a, Un::Log)
    }
    /// [`crate::kernels::linear`]: (…, in) → (…, out).
    pub fn linear(&mut self, x: T, w: T, b: T) -> T {
        self.alloc(self.linear_shape(x, w), self.n(x).elem, Op::Linear(x.0, w.0, b.0))
    }
    fn linear_shape(&self, x: T, w: T) -> Vec<usize> {
        let mut shape = self.n(x).shape.clone();
        *shape.last_mut().expect("x has a last dimension") = self.n(w).shape[0];
        shape
    }
    /// [`crate::kernels::linear_gelu`]: (…, in) → (…, out), keeping the layer's output besides.
    pub fn linear_gelu(&mut self, x: T, w: T, b: T) -> T {
        let shape = self.linear_shape(x, w);
        let h = self.constant(&shape, self.n(x).elem);
        self.alloc(shape, self.n(x).elem, Op::LinearThen(x.0, w.0, b.0, h.0, Then::Gelu))
    }
    /// [`crate::kernels::linear_attention`]: (B, T, C) → (B, T, C), keeping
    /// the layer's output qkv (B, T, 3C) and, by `policy`, the probabilities
    /// (B, nh, T, T).
    pub fn linear_attention(&mut self, x: T, w: T, bias: T, n_head: usize, policy: Probs) -> T {
        let (shape, elem) = (self.linear_shape(x, w), self.n(x).elem);
        let qkv = self.constant(&shape, elem);
        let (b, t, c3) = dims3(&shape);
        let probs = (policy == Probs::Keep).then(|| self.constant(&[b, n_head, t, t], elem).0);
        self.alloc(vec![b, t, c3 / 3], elem, Op::LinearThen(x.0, w.0, bias.0, qkv.0, Then::Attention(probs, n_head)))
    }
    pub fn layer_norm(&mut self, x: T, w: T, b: T) -> T {
        self.alloc(self.n(x).shape.clone(), self.n(x).elem, Op::LayerNorm(x.0, w.0, b.0))
    }

    /// Buffers reachable from `root` through recorded ops, excluding those
    /// of the `Var`s and inputs: what the graph keeps alive.
    pub fn activations(&self, root: T) -> usize {
        let mut seen = vec![false; self.nodes.len()];
        let mut stores = vec![false; self.storages.len()];
        let mut stack = vec![root.0];
        let given: Vec<usize> = self.nodes.iter().filter(|n| n.given).map(|n| n.storage).collect();
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            stores[self.nodes[i].storage] = true;
            if let Some(op) = self.nodes[i].op {
                stack.extend(op.inputs());
            }
        }
        (0..self.storages.len()).filter(|&s| stores[s] && !given.contains(&s)).map(|s| self.storages[s]).sum()
    }

    /// candle's `Tensor::sorted_nodes`: depth first from `root`, a node after
    /// its inputs, then reversed; only nodes that lead to a `Var`.
    fn sorted(&self, root: T) -> Vec<usize> {
        fn walk(g: &Graph, i: usize, nodes: &mut Vec<usize>, seen: &mut HashMap<usize, bool>) -> bool {
            if let Some(&tg) = seen.get(&i) {
                return tg;
            }
            let n = &g.nodes[i];
            let mut track = false;
            if n.var {
                track = true;
            } else if let Some(op) = n.op {
                for a in op.inputs() {
                    track |= walk(g, a, nodes, seen);
                }
            }
            seen.insert(i, track);
            if track {
                nodes.push(i);
            }
            track
        }
        let mut nodes = vec![];
        walk(self, root.0, &mut nodes, &mut HashMap::new());
        nodes.reverse();
        nodes
    }

    /// Replays candle's backward from `root` (a scalar): the activations the
    /// graph holds, the most the backward adds on top, what it leaves behind.
    pub fn backward(&self, root: T) -> Footprint {
        self.replay(root, false)
    }

    /// Replays a tape's backward ([`crate::model::BlockTape`]) from `root`,
    /// whose gradient comes from outside (not counted): candle's order and
    /// rules, but each tensor's first gradient is held as it is, not added
    /// into zeros (the GradStore's `0 + g`).
    pub fn backward_taped(&self, root: T) -> Footprint {
        self.replay(root, true)
    }

    fn replay(&self, root: T, taped: bool) -> Footprint {
        let mut b = Backward {
            g: self,
            grads: HashMap::new(),
            made: vec![],
            buffers: vec![],
            live: 0,
            peak: 0,
            var_at_peak: 0,
            taped,
        };
        // ones_like(loss), or the upstream gradient the tape is handed
        let seed = b.make(if taped { 0 } else { self.nodes[root.0].bytes() }, &[]);
        b.grads.insert(root.0, seed);
        for i in self.sorted(root) {
            let node = &self.nodes[i];
            if node.var {
                continue;
            }
            let held = b.grads.remove(&i).expect("every tracked node receives a gradient");
            // candle detaches it, but the shadowed original (and the ops that
            // made it) lives on until the end of the loop's iteration
            let g = b.detach(held);
            if let Some(op) = node.op {
                b.rule(i, op, g);
            }
            b.drop_(g);
            b.drop_(held);
        }
        let var_grads = b.grads.iter().filter(|(i, _)| self.nodes[**i].var).map(|(i, _)| self.nodes[*i].bytes()).sum();
        Footprint {
            activations: self.activations(root),
            backward_peak: b.peak,
            grad_store: b.live,
            var_grads,
            var_grads_at_peak: b.var_at_peak,
        }
    }
}

impl Op {
    fn inputs(self) -> Vec<usize> {
        match self {
            Op::Leaf => vec![],
            Op::Binary(a, b, _) | Op::MatMul(a, b) => vec![a, b],
            Op::LayerNorm(x, w, b) | Op::Linear(x, w, b) => vec![x, w, b],
            Op::LinearThen(x, w, b, h, Then::Gelu | Then::Attention(None, _)) => vec![x, w, b, h],
            Op::LinearThen(x, w, b, h, Then::Attention(Some(p), _)) => vec![x, w, b, h, p],
            Op::Unary(a, _)
            | Op::Affine(a)
            | Op::Sum(a)
            | Op::Max(a)
            | Op::Broadcast(a)
            | Op::Reshape(a)
            | Op::Transpose(a)
            | Op::Narrow(a, ..)
            | Op::Copy(a)
            | Op::IndexSelect(a)
            | Op::Gather(a)
            | Op::ToDType(a) => vec![a],
        }
    }
}

/// Bytes our matmul allocates while it runs besides its output: the packed
/// panels of `a` and `b` ([`panels`]), and under bf16 the f32 products before rounding.
fn matmul_transient(m: usize, k: usize, n: usize, out_elems: usize, elem: usize) -> usize {
    let panels = panels(m, k, n, elem);
    match elem {
        4 => panels,
        _ => panels.max(2 * out_elems) + 4 * out_elems, // f32 products, then rounded into the output
    }
}

/// The packed panels of `a` and `b` for an `m` × `k` × `n` product of
/// operands of `elem` bytes: f32 values, 4 bytes per element, where the
/// tiles are f32's (f32 operands, and bf16 ones widened where the CPU
/// emulates bf16's products); bf16 pairs, 4 bytes per two, where VDPBF16PS
/// multiplies them ([`crate::kernels::Bf16Dot`]).
fn panels(m: usize, k: usize, n: usize, elem: usize) -> usize {
    const MR: usize = 6;
    const NR: usize = 16;
    let k = match (elem, crate::kernels::Bf16Dot::in_use()) {
        (2, crate::kernels::Bf16Dot::Native) => k.div_ceil(2),
        _ => k,
    };
    4 * (m.div_ceil(MR) * MR * k + n.div_ceil(NR) * NR * k)
}

/// Where a gradient rule's operand comes from: a forward tensor (alive for
/// the whole backward) or a tensor the backward made.
#[derive(Debug, Clone, Copy)]
enum Src {
    Fwd(usize),
    New(usize),
}

/// A tensor made during the backward: its buffer, and — when one of its
/// inputs tracks a gradient, so candle records the op — the inputs it keeps alive.
#[derive(Debug)]
struct Made {
    storage: usize,
    tracked: bool,
    inputs: Vec<usize>,
    refs: usize,
}

/// The state of a replayed backward: the GradStore (node → tensor), every
/// tensor made so far with its reference count, and the bytes live.
struct Backward<'g> {
    g: &'g Graph,
    grads: HashMap<usize, usize>,
    made: Vec<Made>,
    /// (bytes, references) of each buffer the backward allocated.
    buffers: Vec<(usize, usize)>,
    live: usize,
    peak: usize,
    /// The `Var`s' gradients in the store when `peak` was reached.
    var_at_peak: usize,
    /// A tape's backward: a first gradient is held as it is (no `0 + g`).
    taped: bool,
}

impl Backward<'_> {
    fn size(&self, i: usize) -> usize {
        self.g.nodes[i].bytes()
    }

    fn tracks(&self, s: Src) -> bool {
        match s {
            Src::Fwd(i) => self.g.nodes[i].tracked(),
            Src::New(t) => self.made[t].tracked,
        }
    }

    /// A new tensor of `bytes` computed from `inputs` (held once, by the caller).
    fn make(&mut self, bytes: usize, inputs: &[Src]) -> usize {
        self.live += bytes;
        self.note_peak();
        self.buffers.push((bytes, 1));
        self.with_storage(self.buffers.len() - 1, inputs)
    }

    fn with_storage(&mut self, storage: usize, inputs: &[Src]) -> usize {
        let tracked = inputs.iter().any(|&s| self.tracks(s));
        let mut kept = vec![];
        if tracked {
            for s in inputs {
                if let Src::New(t) = *s {
                    self.made[t].refs += 1;
                    kept.push(t);
                }
            }
        }
        self.made.push(Made { storage, tracked, inputs: kept, refs: 1 });
        self.made.len() - 1
    }

    /// `detach`: the same buffer, no op.
    fn detach(&mut self, t: usize) -> usize {
        let storage = self.made[t].storage;
        self.buffers[storage].1 += 1;
        self.with_storage(storage, &[])
    }

    /// Bytes allocated and freed inside one op (the matmul's panels).
    fn transient(&mut self, bytes: usize) {
        self.live += bytes;
        self.note_peak();
        self.live -= bytes;
    }

    fn note_peak(&mut self) {
        if self.live > self.peak {
            self.peak = self.live;
            self.var_at_peak = self.grads.keys().filter(|&&i| self.g.nodes[i].var).map(|&i| self.size(i)).sum();
        }
    }

    fn drop_(&mut self, t: usize) {
        let mut stack = vec![t];
        while let Some(t) = stack.pop() {
            self.made[t].refs -= 1;
            if self.made[t].refs > 0 {
                continue;
            }
            let st = self.made[t].storage;
            self.buffers[st].1 -= 1;
            if self.buffers[st].1 == 0 {
                self.live -= self.buffers[st].0;
            }
            stack.extend(std::mem::take(&mut self.made[t].inputs));
        }
    }

    /// `grads.or_insert(arg)`: zeros of `arg`'s shape the first time.
    fn or_insert(&mut self, i: usize) {
        if !self.grads.contains_key(&i) {
            let z = self.make(self.size(i), &[]);
            self.grads.insert(i, z);
        }
    }

    /// `*sum = sum.add(&t)`: a new sum; the old one is kept only by the new
    /// one's op, if `t` tracks.
    fn add_into(&mut self, i: usize, t: Src) {
        let old = self.grads[&i];
        let new = self.make(self.size(i), &[Src::New(old), t]);
        self.grads.insert(i, new);
        self.drop_(old);
    }

    /// `or_insert` then `add`: the common accumulate. On a tape, a first
    /// gradient is held as it is, and only a second one makes a sum.
    fn acc(&mut self, i: usize, t: Src) {
        match (self.taped, t) {
            (true, Src::New(t)) if !self.grads.contains_key(&i) => {
                self.made[t].refs += 1;
                self.grads.insert(i, t);
            }
            _ => {
                self.or_insert(i);
                self.add_into(i, t);
            }
        }
    }

    /// Each of an op's gradients `made` added onto its argument's sum, in
    /// order, then dropped (the sum keeps what it needs).
    fn acc_each(&mut self, args: [usize; 3], made: [usize; 3]) {
        for (arg, t) in args.into_iter().zip(made) {
            self.acc(arg, Src::New(t));
            self.drop_(t);
        }
    }

    /// A matmul run in the backward: its transient, then its output.
    fn matmul(&mut self, (m, k, n): (usize, usize, usize), batch: usize, elem: usize, inputs: &[Src]) -> usize {
        let out = batch * m * n;
        self.transient(matmul_transient(m, k, n, out, elem));
        self.make(out * elem, inputs)
    }

    /// [`crate::kernels::linear`]'s backward up to its gradients `[dx, dw, db]`, made (not yet
    /// added). `dh`, a gradient the layer took ([`Op::LinearThen`]'s), goes once the three are made.
    fn linear_grads(&mut self, x: usize, w: usize, dh: Option<usize>) -> [usize; 3] {
        // dx = g·w and dw = gᵀ·x as f32 products, read from the operands as
        // they are (bf16 widened as it is packed); db the rows' sum. Under
        // bf16 each is rounded into a new tensor at once, its f32 gone.
        let (n_out, n_in) = (self.g.nodes[w].shape[0], self.g.nodes[w].shape[1]);
        let (rows, elem) = (self.g.nodes[x].numel() / n_in, self.g.nodes[x].elem);
        let f32s = [rows * n_in * 4, n_out * n_in * 4, n_out * 4]; // dx, dw, db in f32
        let panels = [panels(rows, n_out, n_in, elem), panels(n_out, rows, n_in, elem), 0];
        let mut made = [0; 3];
        for k in 0..3 {
            // each product allocates its result, then packs its panels
            made[k] = match elem {
                4 => {
                    let t = self.make(f32s[k], &[]);
                    self.transient(panels[k]);
                    t
                }
                _ => {
                    self.live += f32s[k];
                    self.transient(panels[k]);
                    let t = self.make(f32s[k] / 2, &[]); // rounded into bf16; its f32 goes
                    self.live -= f32s[k];
                    t
                }
            };
        }
        dh.into_iter().for_each(|t| self.drop_(t));
        made
    }

    /// [`crate::kernels::attention`]'s backward up to dqkv (P kept, or none:
    /// recomputed), made (not yet added).
    fn attention_grad(&mut self, qkv: usize, kept: Option<usize>, nh: usize) -> usize {
        let (b, t, c3) = dims3(&self.g.nodes[qkv].shape);
        if self.g.nodes[qkv].elem == 2 {
            return self.attention_grad_bf16(qkv, kept.is_some(), nh);
        }
        // dP (becoming dS), dq, dk, dv computed in f32, each product with its panels; then dqkv.
        let (c, hs) = (c3 / 3, c3 / 3 / nh);
        let (np4, btc4) = (4 * b * nh * t * t, 4 * b * t * c);
        // Not kept: P first, as the forward made it (S, then P), held to the end.
        let recomputed = if kept.is_none() { np4 } else { 0 };
        if kept.is_none() {
            self.transient(np4 + panels(t, hs, t, 4).max(np4));
            self.live += recomputed;
        }
        let panels = |m: usize, k: usize, n: usize| panels(m, k, n, 4);
        let stages = [
            np4 + panels(t, hs, t),            // dP = dy·vᵀ
            np4 + btc4 + panels(t, t, hs),     // dq = dS·k
            np4 + 2 * btc4 + panels(t, t, hs), // dk = dSᵀ·q
            3 * btc4 + panels(t, t, hs),       // dv = Pᵀ·dy
        ];
        self.transient(stages.into_iter().max().unwrap_or(0));
        self.live += 3 * btc4; // dq, dk, dv live while dqkv, the output, is filled
        let out = self.make(self.size(qkv), &[]);
        self.live -= 3 * btc4 + recomputed;
        out
    }

    /// The bf16 attention backward, as `kernels::attention` runs it: the
    /// products read their bf16 operands as they are; dP in f32, dS made
    /// from it a block of rows at a time (scratch: `SOFTMAX_ROWS` rows, three
    /// f32 blocks) and kept in bf16; dqkv allocated, then dq, dk and dv
    /// each made in f32 and rounded into it. Not `kept`: P first, as the
    /// forward makes it (S in f32, P rounded into bf16 a block at a time), to the end.
    fn attention_grad_bf16(&mut self, qkv: usize, kept: bool, nh: usize) -> usize {
        const SOFTMAX_ROWS: usize = 4; // kernels::softmax::ROWS
        let (b, t, c3) = dims3(&self.g.nodes[qkv].shape);
        let (c, hs) = (c3 / 3, c3 / 3 / nh);
        let (np2, np4, btc4, block4) = (2 * b * nh * t * t, 4 * b * nh * t * t, 4 * b * t * c, 4 * SOFTMAX_ROWS * t);
        let panels = |m: usize, k: usize, n: usize| panels(m, k, n, 2);
        let recomputed = if kept { 0 } else { np2 };
        if !kept {
            self.transient(np4 + panels(t, hs, t).max(2 * block4 + np2)); // S, then P made beside it
            self.live += recomputed;
        }
        self.transient(np4 + panels(t, hs, t).max(3 * block4 + np2)); // dP, then dS made beside it
        self.live += np2; // dS
        let out = self.make(self.size(qkv), &[]); // dqkv, filled below
        self.transient(btc4 + panels(t, t, hs)); // dq = dS·k, then dk = dSᵀ·q, each rounded in
        self.live -= np2;
        self.transient(btc4 + panels(t, t, hs)); // dv = Pᵀ·dy
        self.live -= recomputed;
        out
    }

    /// The gradient rule of `op` at node `i` (candle 0.11's `backward`),
    /// with `g` the node's gradient (detached).
    fn rule(&mut self, i: usize, op: Op, g: usize) {
        let s = self.size(i); // the node's (and its gradient's) bytes
        let (gs, node) = (Src::New(g), Src::Fwd(i));
        match op {
            Op::Leaf => {}
            Op::Binary(l, r, Bin::Add | Bin::Sub) => {
                self.acc(l, gs);
                self.acc(r, gs);
            }
            Op::Binary(l, r, Bin::Mul) => {
                let t1 = self.make(s, &[gs, Src::Fwd(r)]);
                self.acc(l, Src::New(t1));
                let t2 = self.make(s, &[gs, Src::Fwd(l)]);
                self.acc(r, Src::New(t2));
                self.drop_(t1);
                self.drop_(t2);
            }
            Op::Unary(a, Un::Exp | Un::Log) => {
                self.or_insert(a);
                let t = self.make(s, &[gs, node]); // grad * node, grad / arg
                self.add_into(a, Src::New(t));
                self.drop_(t);
            }
            Op::Affine(a) => {
                let t = self.make(s, &[gs]);
                self.acc(a, Src::New(t));
                self.drop_(t);
            }
            Op::Sum(a) | Op::Reshape(a) | Op::Transpose(a) | Op::Copy(a) => self.acc(a, gs), // views of grad
            Op::Max(a) => {
                let n = self.g.nodes[a].numel();
                let sa = self.size(a);
                let eq = self.make(n, &[node, Src::Fwd(a)]); // node.eq(arg): one byte per element
                let f = self.make(sa, &[Src::New(eq)]); // to_dtype
                let t = self.make(sa, &[Src::New(f), gs]); // · grad
                self.drop_(eq);
                self.drop_(f);
                self.acc(a, Src::New(t));
                self.drop_(t);
            }
            Op::Broadcast(a) => {
                let t = self.make(self.size(a), &[gs]); // grad summed over the broadcast dims
                self.acc(a, Src::New(t));
                self.drop_(t);
            }
            Op::Narrow(a, dim, _start, len) => {
                let arg = &self.g.nodes[a];
                let (bytes, per) = (arg.bytes(), arg.bytes() / arg.shape[dim]);
                let pads = self.make(per * (arg.shape[dim] - len), &[]); // zeros around `start..start + len`
                let cat = self.make(bytes, &[]);
                self.drop_(pads); // dropped with the match arm that made the cat
                self.acc(a, Src::New(cat));
                self.drop_(cat);
            }
            Op::IndexSelect(a) | Op::Gather(a) => self.acc(a, gs), // index_add / scatter_add onto the sum
            Op::MatMul(a, b) => {
                let (na, nb) = (&self.g.nodes[a], &self.g.nodes[b]);
                let (ra, rb) = (na.shape.len(), nb.shape.len());
                let (m, k, n) = (na.shape[ra - 2], na.shape[ra - 1], nb.shape[rb - 1]);
                let batch: usize = na.shape[..ra - 2].iter().product();
                let elem = na.elem;
                let ga = self.matmul((m, n, k), batch, elem, &[gs, Src::Fwd(b)]); // grad @ bᵀ
                let gb = self.matmul((k, m, n), batch, elem, &[Src::Fwd(a), gs]); // aᵀ @ grad
                self.acc(a, Src::New(ga));
                self.drop_(ga);
                self.acc(b, Src::New(gb));
                self.drop_(gb);
            }
            Op::ToDType(a) => {
                self.or_insert(a);
                let t = self.make(self.size(a), &[gs]); // grad.to_dtype(arg's)
                self.add_into(a, Src::New(t));
                self.drop_(t);
            }
            Op::Linear(x, w, bias) => {
                let made = self.linear_grads(x, w, None);
                self.acc_each([x, w, bias], made);
            }
            Op::LinearThen(x, w, bias, h, then) => {
                // dh from the op after the layer, handed to the layer's backward as it is (no sum),
                // which frees it (see `linear_grads`) before candle adds dx, dw and db.
                let dh = match then {
                    Then::Gelu => self.make(self.size(h), &[]), // g · gelu'(h), one pass
                    Then::Attention(kept, nh) => self.attention_grad(h, kept, nh),
                };
                let made = self.linear_grads(x, w, Some(dh));
                self.acc_each([x, w, bias], made);
            }
            Op::LayerNorm(x, w, b) => {
                // dx, dw, db made at once, then added in order. Besides: a row
                // of x̂ (f32: 4·C bytes); under bf16 the widened w, four f32
                // rows, dw and db in f32 (7 · 4·C), and their rounding.
                let made = [self.make(s, &[]), self.make(self.size(w), &[]), self.make(self.size(b), &[])];
                let row = 4 * self.g.nodes[w].numel();
                self.transient(if self.g.nodes[x].elem == 2 { 7 * row + 2 * self.size(w) } else { row });
                self.acc_each([x, w, b], made);
            }
        }
    }
}

// ANCHOR: block_activations
/// What one block's graph keeps for its backward, in elements of the compute
/// dtype, from its input (not counted: the block before made it) to its
/// output: one (B, T, ·) buffer per step below — `c_attn` and `c_fc` are
/// each fused with the op after it into one op, which keeps the layer's
/// output — and attention's probabilities.
///
/// ```text
/// ln_1  c_attn  heads  c_proj  x + a  ln_2  c_fc  GELU  c_proj  x + m
///   C  +  3C  +   C  +   C   +   C  +   C  + 4C  + 4C  +   C   +   C   = 18·C per token
/// P (B, nh, T, T): nh·T per token, unless recomputed in the backward
/// ```
pub fn block_activations(cfg: &GptConfig, (b, t): (usize, usize), probs: Probs) -> usize {
    let per_token = 18 * cfg.n_embd; // the table above
    let p = match probs {
        Probs::Keep => cfg.n_head * t, // one row of P per head
        Probs::Recompute => 0,
    };
    b * t * (per_token + p)
}
// ANCHOR_END: block_activations

/// The model's ops on shapes: the same calls as [`crate::model::Gpt`].
#[derive(Debug, Clone, Copy)]
pub struct ModelShapes {
    pub cfg: GptConfig,
    /// Bytes per element of the compute copy: 4 (fp32) or 2 (bf16).
    pub elem: usize,
    /// Whether attention keeps its probabilities ([`crate::model::Gpt::probs`]).
    pub probs: Probs,
}

impl ModelShapes {
    /// The parameter `Var`s of `table`, as graph leaves.
    pub fn vars(&self, g: &mut Graph, table: &ParamTable) -> Vec<T> {
        table.specs.iter().map(|s| g.var(&s.shape, self.elem)).collect()
    }

    fn layer_norm(&self, g: &mut Graph, x: T, w: T, b: T) -> T {
        g.layer_norm(x, w, b)
    }

    fn linear(&self, g: &mut Graph, x: T, w: T, b: T) -> T {
        g.linear(x, w, b)
    }

    /// Token + position embedding: ids (B, T) → (B, T, C).
    pub fn embed(&self, g: &mut Graph, wte: T, wpe: T, (b, t): (usize, usize)) -> T {
        let tok = g.index_select(wte, b * t);
        let tok = g.reshape(tok, &[b, t, self.cfg.n_embd]);
        let pos = g.narrow(wpe, 0, 0, t);
        g.broadcast_add(tok, pos)
    }

    /// One block, `p` its 12 parameters: (B, T, C) → (B, T, C).
    pub fn block(&self, g: &mut Graph, p: &[T], x: T) -> T {
        assert_eq!(p.len(), PARAMS_PER_BLOCK);
        let h = self.layer_norm(g, x, p[0], p[1]);
        let a = self.attention(g, &p[2..6], h);
        let x = g.add(x, a);
        let h = self.layer_norm(g, x, p[6], p[7]);
        let h = g.linear_gelu(h, p[8], p[9]);
        let h = self.linear(g, h, p[10], p[11]);
        g.add(x, h)
    }

    fn attention(&self, g: &mut Graph, p: &[T], x: T) -> T {
        let y = g.linear_attention(x, p[0], p[1], self.cfg.n_head, self.probs);
        self.linear(g, y, p[2], p[3])
    }

    /// Final LayerNorm and the tied head: (B, T, C) → logits (B, T, V).
    pub fn head(&self, g: &mut Graph, ln_w: T, ln_b: T, wte: T, x: T) -> T {
        let x = self.layer_norm(g, x, ln_w, ln_b);
        let (b, t, c) = dims3(g.shape(x));
        let x2 = g.reshape(x, &[b * t, c]);
        let wt = g.t(wte);
        let y = g.matmul(x2, wt);
        g.reshape(y, &[b, t, self.cfg.vocab_size])
    }

    /// Mean cross-entropy, widened to f32 first: logits (B, T, V) → scalar.
    pub fn loss(&self, g: &mut Graph, logits: T) -> T {
        let logits = g.to_dtype(logits, 4);
        let (b, t, v) = dims3(g.shape(logits));
        let x = g.reshape(logits, &[b * t, v]);
        // candle_nn::ops::log_softmax(x, 1), then nll
        let max = g.max_keepdim(x, 1);
        let diff = g.broadcast_sub(x, max);
        let e = g.exp(diff);
        let se = g.sum_keepdim(e, 1);
        let lse = g.log(se);
        let ls = g.broadcast_sub(diff, lse);
        let picked = g.gather_one(ls);
        let s = g.sum_all(picked);
        g.affine(s)
    }

    /// The whole forward and loss on one (B, T) micro-batch, and candle's
    /// backward of that one graph. No lesson runs it any more (each block is
    /// taped, [`ModelShapes::block_taped`]); the tests hold the replay to
    /// candle through every rule the model's ops take here.
    pub fn whole_model(&self, table: &ParamTable, (b, t): (usize, usize)) -> Footprint {
        let mut g = Graph::new();
        let p = self.vars(&mut g, table);
        let mut x = self.embed(&mut g, p[0], p[1], (b, t));
        for l in 0..self.cfg.n_layer {
            let first = 2 + l * PARAMS_PER_BLOCK;
            x = self.block(&mut g, &p[first..first + PARAMS_PER_BLOCK], x);
        }
        let n = p.len();
        let logits = self.head(&mut g, p[n - 2], p[n - 1], p[0], x);
        let loss = self.loss(&mut g, logits);
        g.backward(loss)
    }

    /// What one block's forward graph holds from its input (a `Var`) to its
    /// output, before any backward: a block waiting for its backward.
    pub fn block_graph(&self, b: usize, t: usize) -> usize {
        let mut g = Graph::new();
        let c = self.cfg.n_embd;
        let x = g.var(&[b, t, c], self.elem);
        let p: Vec<T> = ParamTable::block_shapes(c).iter().map(|s| g.var(s, self.elem)).collect();
        let y = self.block(&mut g, &p, x);
        g.activations(y)
    }

    /// One block run on a tape ([`crate::model::Gpt::block_taped`]) from an
    /// input the block before made, and its backward from an upstream
    /// gradient likewise made elsewhere: what the tape keeps (the block's
    /// graph, its output among it), what its backward holds on top, and the
    /// gradients it returns (the input's and the parameters').
    pub fn block_taped(&self, (b, t): (usize, usize)) -> Footprint {
        let mut g = Graph::new();
        let c = self.cfg.n_embd;
        let x = g.var(&[b, t, c], self.elem);
        let p: Vec<T> = ParamTable::block_shapes(c).iter().map(|s| g.var(s, self.elem)).collect();
        let y = self.block(&mut g, &p, x);
        g.backward_taped(y)
    }

    /// `blocks` blocks recomputed from a saved input made a `Var`, and the
    /// backward of `sum(out · g)`: lesson 03's backward entry of a unit.
    pub fn blocks_recomputed(&self, blocks: usize, (b, t): (usize, usize)) -> Footprint {
        let mut g = Graph::new();
        let c = self.cfg.n_embd;
        let mut x = g.var(&[b, t, c], self.elem);
        for _ in 0..blocks {
            let p: Vec<T> = ParamTable::block_shapes(c).iter().map(|s| g.var(s, self.elem)).collect();
            x = self.block(&mut g, &p, x);
        }
        let up = g.input(&[b, t, c], self.elem); // the upstream gradient
        let prod = g.mul(x, up);
        let root = g.sum_all(prod);
        g.backward(root)
    }

    /// The final norm, the tied head and the loss from the last block's
    /// output made a `Var`, and their backward: lesson 03's head entry.
    pub fn head_and_loss(&self, (b, t): (usize, usize)) -> Footprint {
        let mut g = Graph::new();
        let c = self.cfg.n_embd;
        let x = g.var(&[b, t, c], self.elem);
        let (w, bias) = (g.var(&[c], self.elem), g.var(&[c], self.elem));
        let wte = g.var(&[self.cfg.vocab_size, c], self.elem);
        let logits = self.head(&mut g, w, bias, wte, x);
        let loss = self.loss(&mut g, logits);
        g.backward(loss)
    }

    /// The embedding's backward, [`crate::model::Gpt::embedding_backward`]
    /// (no graph; its weights are not needed): the rows' gradient is a view
    /// of the upstream one; wpe's is the T positions' sums (T, C), then —
    /// when T is short of the context — those and the zeros beyond,
    /// concatenated into a new (block_size, C), which it returns.
    pub fn embedding_backward(&self, (_b, t): (usize, usize)) -> Footprint {
        let (c, bs, e) = (self.cfg.n_embd, self.cfg.block_size, self.elem);
        let wpe = bs * c * e;
        // Short of the context: the sums (T, C) and the zeros (block_size − T, C), a wpe's worth, beside the cat.
        let peak = if t < bs { 2 * wpe } else { wpe };
        Footprint { activations: 0, backward_peak: peak, grad_store: wpe, var_grads: wpe, var_grads_at_peak: 0 }
    }
}

fn dims3(s: &[usize]) -> (usize, usize, usize) {
    assert_eq!(s.len(), 3, "a (B, T, C) tensor");
    (s[0], s[1], s[2])
}
