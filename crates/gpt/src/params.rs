//! The parameter table: every parameter's nanoGPT name, shape and place in
//! the one flat `f32` vector that the lessons gather, reduce and shard.
//!
//! The order is nanoGPT's `named_parameters()` order (the tied `lm_head.weight`
//! is `transformer.wte.weight` and appears once):
//!
//! ```text
//! transformer.wte.weight            (vocab, C)    token embedding, also the lm_head
//! transformer.wpe.weight            (T, C)        position embedding
//! transformer.h.{i}.ln_1.weight     (C)           ┐
//! transformer.h.{i}.ln_1.bias       (C)           │
//! transformer.h.{i}.attn.c_attn.weight (3C, C)    │ block i, for i in 0..n_layer;
//! transformer.h.{i}.attn.c_attn.bias   (3C)       │ linear weights are (out, in)
//! transformer.h.{i}.attn.c_proj.weight (C, C)     │ like torch's nn.Linear
//! transformer.h.{i}.attn.c_proj.bias   (C)        │
//! transformer.h.{i}.ln_2.weight     (C)           │
//! transformer.h.{i}.ln_2.bias       (C)           │
//! transformer.h.{i}.mlp.c_fc.weight (4C, C)       │
//! transformer.h.{i}.mlp.c_fc.bias   (4C)          │
//! transformer.h.{i}.mlp.c_proj.weight (C, 4C)     │
//! transformer.h.{i}.mlp.c_proj.bias (C)           ┘
//! transformer.ln_f.weight           (C)
//! transformer.ln_f.bias             (C)
//! ```
use std::ops::Range;

use crate::config::GptConfig;
use crate::rng::SplitMix64;

/// How a parameter starts (nanoGPT's `_init_weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal(0, std): embeddings and linear weights.
    Normal(f64),
    Zeros,
    Ones,
}

/// One parameter tensor: its name, shape, initialisation and flat offset.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// Where the tensor starts in the flat vector.
    pub offset: usize,
}

impl ParamSpec {
    /// nanoGPT's weight-decay rule: tensors of 2 or more dimensions (matmul
    /// weights, embeddings) decay; biases and LayerNorm gains do not.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// A group of consecutive parameters that runs as one piece of the forward
/// pass: the unit lesson 03 gathers, computes and frees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// `wte`, `wpe`: token + position embedding (and, tied, the lm_head).
    Embedding,
    /// `transformer.h.{i}`: one transformer block.
    Block(usize),
    /// `ln_f`: the final LayerNorm.
    FinalNorm,
}

/// Parameters per block, in order (see the module docs).
pub const PARAMS_PER_BLOCK: usize = 12;

/// A block's parameters, in order (nanoGPT's names after `transformer.h.{i}.`).
const BLOCK_PARAMS: [&str; PARAMS_PER_BLOCK] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

/// The parameter table of one model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamTable {
    pub specs: Vec<ParamSpec>,
    n_layer: usize,
}

impl ParamTable {
    pub fn new(cfg: &GptConfig) -> Self {
        let c = cfg.n_embd;
        let std = 0.02;
        // GPT-2's scaled init of the projections that write into the residual stream.
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let mut list: Vec<(String, Vec<usize>, Init)> = vec![
            ("transformer.wte.weight".into(), vec![cfg.vocab_size, c], Init::Normal(std)),
            ("transformer.wpe.weight".into(), vec![cfg.block_size, c], Init::Normal(std)),
        ];
        for i in 0..cfg.n_layer {
            let inits = [
                Init::Ones,
                Init::Zeros,
                Init::Normal(std),
                Init::Zeros,
                Init::Normal(proj_std),
                Init::Zeros,
                Init::Ones,
                Init::Zeros,
                Init::Normal(std),
                Init::Zeros,
                Init::Normal(proj_std),
                Init::Zeros,
            ];
            let names = BLOCK_PARAMS.iter().map(|s| format!("transformer.h.{i}.{s}"));
            list.extend(names.zip(Self::block_shapes(c)).zip(inits).map(|((n, s), i)| (n, s, i)));
        }
        list.push(("transformer.ln_f.weight".into(), vec![c], Init::Ones));
        list.push(("transformer.ln_f.bias".into(), vec![c], Init::Zeros));

        let mut offset = 0;
        let specs = list
            .into_iter()
            .map(|(name, shape, init)| {
                let spec = ParamSpec { name, shape, init, offset };
                offset += spec.numel();
                spec
            })
            .collect();
        Self { specs, n_layer: cfg.n_layer }
    }

    /// The shapes of a block's parameters for width `c`, in order.
    pub fn block_shapes(c: usize) -> [Vec<usize>; PARAMS_PER_BLOCK] {
        [
            vec![c],
            vec![c],
            vec![3 * c, c],
            vec![3 * c],
            vec![c, c],
            vec![c],
            vec![c],
            vec![c],
            vec![4 * c, c],
            vec![4 * c],
            vec![c, 4 * c],
            vec![c],
        ]
    }

    /// Total number of parameters (the flat vector's length, before any padding).
    pub fn numel(&self) -> usize {
        self.specs.last().map_or(0, |s| s.offset + s.numel())
    }

    /// The units in forward order: embedding, blocks 0..n_layer, final norm.
    pub fn units(&self) -> Vec<Unit> {
        let mut u = vec![Unit::Embedding];
        u.extend((0..self.n_layer).map(Unit::Block));
        u.push(Unit::FinalNorm);
        u
    }

    /// Which entries of `specs` belong to a unit (always consecutive).
    pub fn unit_params(&self, unit: Unit) -> Range<usize> {
        match unit {
            Unit::Embedding => 0..2,
            Unit::Block(i) => 2 + i * PARAMS_PER_BLOCK..2 + (i + 1) * PARAMS_PER_BLOCK,
            Unit::FinalNorm => 2 + self.n_layer * PARAMS_PER_BLOCK..self.specs.len(),
        }
    }

    /// Where a unit's parameters sit in the flat vector (always contiguous).
    pub fn unit_range(&self, unit: Unit) -> Range<usize> {
        let p = self.unit_params(unit);
        self.specs[p.start].offset..self.specs[p.end - 1].range().end
    }

    /// The initial flat parameter vector, a pure function of the seed: every
    /// rank computes the same bits without talking to any other.
    /// Each tensor draws from its own stream `(seed, index)`, so adding a layer
    /// does not change the others' initial values.
    pub fn init_flat(&self, seed: u64) -> Vec<f32> {
        self.init_ranges(seed, std::slice::from_ref(&(0..self.numel())))
    }

    /// The initial values at the flat positions `ranges`, concatenated:
    /// exactly those of [`ParamTable::init_flat`], computed without the rest
    /// (a stream's value j is its outputs 2j and 2j + 1, reached by a jump),
    /// so that an FSDP rank creates only its shard.
    pub fn init_ranges(&self, seed: u64, ranges: &[Range<usize>]) -> Vec<f32> {
        let mut flat = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum());
        for r in ranges {
            for (i, spec) in self.specs.iter().enumerate() {
                let (lo, hi) = (r.start.max(spec.offset), r.end.min(spec.offset + spec.numel()));
                if lo >= hi {
                    continue;
                }
                match spec.init {
                    Init::Zeros => flat.resize(flat.len() + hi - lo, 0.0),
                    Init::Ones => flat.resize(flat.len() + hi - lo, 1.0),
                    Init::Normal(std) => {
                        let mut rng = SplitMix64::for_stream(seed, i as u64);
                        rng.skip(2 * (lo - spec.offset) as u64);
                        flat.extend((lo..hi).map(|_| (rng.normal() * std) as f32));
                    }
                }
            }
        }
        flat
    }
}

/// A 64-bit digest of `f32` bit patterns (FNV-1a over the little-endian bytes):
/// equal digests of two weight vectors mean, for our purposes, equal bits.
pub fn digest_f32(values: &[f32]) -> u64 {
    fnv1a(values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
}

/// FNV-1a, 64 bits: a fast digest for "the same bytes?" (not a checksum
/// against tampering; checkpoints use SHA-256 for that).
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

// ANCHOR: no_decay
/// nanoGPT's weight-decay rule, elementwise: of the positions `window` of a
/// flat vector in which tensor `i` of `table` lies at `at` (for each `(i,
/// at)` of `layout`), the ranges AdamW must not decay, relative to the
/// window's start. A shard cuts through tensors, so this is per element.
pub fn no_decay(
    table: &ParamTable,
    layout: impl IntoIterator<Item = (usize, Range<usize>)>,
    window: Range<usize>,
) -> Vec<Range<usize>> {
    layout
        .into_iter()
        .filter(|(i, _)| !table.specs[*i].decays())
        .filter_map(|(_, at)| {
            let (a, b) = (at.start.max(window.start), at.end.min(window.end));
            (a < b).then(|| a - window.start..b - window.start)
        })
        .collect()
}
// ANCHOR_END: no_decay

impl ParamTable {
    /// [`no_decay`] for a window of the model's own flat vector (lessons 01, 02).
    pub fn no_decay_in(&self, window: Range<usize>) -> Vec<Range<usize>> {
        no_decay(self, self.specs.iter().enumerate().map(|(i, s)| (i, s.range())), window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(preset: &str) -> usize {
        ParamTable::new(&GptConfig::preset(preset, 65).unwrap()).numel()
    }

    #[test]
    fn preset_sizes_match_the_docs() {
        // 809,856 is also what PyTorch's nanoGPT reports for this shape.
        assert_eq!(count("tiny"), 809_856);
        assert_eq!(count("small"), 10_721_664);
        assert_eq!(count("gpt2"), 85_892_352);
    }

    #[test]
    fn units_tile_the_flat_vector_in_order() {
        let t = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let mut next = 0;
        for u in t.units() {
            let r = t.unit_range(u);
            assert_eq!(r.start, next, "{u:?}");
            next = r.end;
        }
        assert_eq!(next, t.numel());
        assert_eq!(t.unit_range(Unit::Block(0)).len(), 198_272);
        assert_eq!(t.specs[t.unit_params(Unit::Block(3)).start].name, "transformer.h.3.ln_1.weight");
        assert_eq!(t.specs.last().unwrap().name, "transformer.ln_f.bias");
    }

    #[test]
    fn any_ranges_of_the_init_equal_the_whole_init() {
        let t = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let all = t.init_flat(9);
        let n = t.numel();
        let ranges = [3..9, 8_000..8_400, 100..100, n - 5..n, 0..1];
        let want: Vec<f32> = ranges.iter().flat_map(|r| all[r.clone()].to_vec()).collect();
        assert_eq!(t.init_ranges(9, &ranges), want);
    }

    #[test]
    fn init_is_a_pure_function_of_the_seed() {
        let t = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let a = t.init_flat(1);
        assert_eq!(digest_f32(&a), digest_f32(&t.init_flat(1)));
        assert_ne!(digest_f32(&a), digest_f32(&t.init_flat(2)));
        // LayerNorm gains start at one, biases at zero, weights near N(0, 0.02).
        let ln1 = &t.specs[2];
        assert!(a[ln1.range()].iter().all(|&x| x == 1.0));
        let wte = &a[t.specs[0].range()];
        let std = (wte.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / wte.len() as f64).sqrt();
        assert!((std - 0.02).abs() < 0.001, "{std}");
    }

    /// The decay rule on windows: the whole tiny model leaves its 1-D tensors
    /// (biases, LayerNorm gains) undecayed, wte and wpe decayed; a window
    /// cutting through tensors gets the pieces, relative to its start.
    #[test]
    fn no_decay_follows_the_tensors_dimensions() {
        let t = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let all = t.no_decay_in(0..t.numel());
        let one_d: usize = t.specs.iter().filter(|s| s.shape.len() == 1).map(|s| s.numel()).sum();
        assert_eq!(all.iter().map(|r| r.len()).sum::<usize>(), one_d);
        assert!(t.specs[0].decays() && t.specs[1].decays(), "wte and wpe decay (nanoGPT)");
        let ln1 = &t.specs[2]; // h.0.ln_1.weight, 1-D
        assert!(!ln1.decays());
        let w = ln1.offset + 5..ln1.offset + 200;
        assert_eq!(t.no_decay_in(w.clone())[0], 0..ln1.numel() - 5, "the piece of ln_1.weight in the window");
        let pieces: usize = t.no_decay_in(w.clone()).iter().map(|r| r.len()).sum();
        let want = (w.clone()).filter(|&i| t.specs.iter().any(|s| !s.decays() && s.range().contains(&i))).count();
        assert_eq!(pieces, want);
    }
}
