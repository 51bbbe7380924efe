//! The shape model of `fsdp_gpt::memory` against a counting allocator around
//! the real model: what the forward keeps, the backward's peak on top of it
//! and what the GradStore holds afterwards, for every pass the lessons run.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use candle_core::{DType, Device, Tensor, Var};
use fsdp_gpt::kernels::Probs;
use fsdp_gpt::memory::{Footprint, ModelShapes, block_activations};
use fsdp_gpt::model::{Gpt, loss};
use fsdp_gpt::{GptConfig, ParamTable, Precision};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        PEAK.fetch_max(LIVE.fetch_add(l.size(), Relaxed) + l.size(), Relaxed);
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The tests share one counter: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn live() -> usize {
    LIVE.load(Relaxed)
}

/// Measures a pass: `forward` builds the graph (returns its scalar root);
/// the activations are what it left live, then the backward's peak above
/// that, then what the GradStore holds.
fn measure(forward: impl FnOnce() -> Tensor) -> Footprint {
    let before = live();
    let root = forward();
    let activations = live() - before;
    let at = live();
    PEAK.store(at, Relaxed);
    let grads = root.backward().unwrap();
    let backward_peak = PEAK.load(Relaxed) - at;
    let grad_store = live() - at;
    drop(grads);
    Footprint { activations, backward_peak, grad_store, var_grads: 0, var_grads_at_peak: 0 }
}

/// Runs a backward that needs no graph (`run`): the most it held at once
/// above the heap live before it, and what it left live; then drops that.
fn held_by<R>(run: impl FnOnce() -> R) -> (usize, usize) {
    let at = live();
    PEAK.store(at, Relaxed);
    let left = run();
    let held = (PEAK.load(Relaxed) - at, live() - at);
    drop(left);
    held
}

/// At least the model, and within 1% of it plus `slack` bytes: candle's
/// small allocations — each op's tensor, shape and strides (about 100 bytes,
/// some 200 ops per block), the GradStore's map — which the model leaves out
/// by design.
fn close(what: &str, measured: usize, model: usize, slack: usize) {
    let r = measured as f64 / model as f64;
    let ok = measured >= model && measured <= model + model / 100 + slack;
    assert!(ok, "{what}: measured {measured} B, model {model} B (ratio {r:.4})");
}

/// `blocks`: how many transformer blocks the pass runs (24 KiB of slack each).
fn check(what: &str, measured: Footprint, model: Footprint, blocks: usize) {
    let slack = (16 << 10) + blocks * (24 << 10);
    close(&format!("{what}: activations"), measured.activations, model.activations, slack);
    close(&format!("{what}: backward peak"), measured.backward_peak, model.backward_peak, slack);
    close(&format!("{what}: GradStore"), measured.grad_store, model.grad_store, slack);
}

fn randn(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f32, 0.5, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn ids(b: usize, t: usize, v: usize) -> Tensor {
    let x: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
    Tensor::from_vec(x, (b, t), &Device::Cpu).unwrap()
}

fn cases() -> Vec<(&'static str, usize, Precision, Probs)> {
    let mut cases = vec![];
    for probs in [Probs::Keep, Probs::Recompute] {
        cases.extend([("tiny", 4, Precision::Fp32, probs), ("tiny", 4, Precision::Bf16, probs)]);
        cases.push(("small", 2, Precision::Fp32, probs));
    }
    cases
}

#[test]
fn the_whole_model_pass_holds_what_the_shapes_say() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (preset, b, precision, probs) in cases() {
        let cfg = GptConfig::preset(preset, 65).unwrap();
        let (table, gpt) = (ParamTable::new(&cfg), Gpt::new(cfg).with_probs(probs));
        let vars = gpt.vars_in(&table, &table.init_flat(1), precision).unwrap();
        let ps: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        // The whole context, and half of it (wpe then enters through a narrow).
        for t in [cfg.block_size, cfg.block_size / 2] {
            let (idx, tgt) = (ids(b, t, 65), ids(b, t, 64));
            let measured = measure(|| loss(&gpt.forward(&table, &ps, &idx).unwrap(), &tgt).unwrap());
            let model = ModelShapes { cfg, elem: precision.bytes(), probs }.whole_model(&table, (b, t));
            check(&format!("{preset} {precision} {probs:?} whole model, T = {t}"), measured, model, cfg.n_layer);
            assert_eq!(model.var_grads, table.numel() * precision.bytes());
            // Nothing stays beyond the Vars' gradients: the causal mask, a
            // constant candle would give a (B, nh, T, T) gradient per block,
            // lives inside the fused attention.
            assert_eq!(model.grad_store, model.var_grads);
        }
    }
}

#[test]
fn a_unit_recomputed_from_its_input_holds_what_the_shapes_say() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (preset, b, precision, probs) in cases() {
        let cfg = GptConfig::preset(preset, 65).unwrap();
        let (gpt, t, dt) = (Gpt::new(cfg).with_probs(probs), cfg.block_size, precision.dtype());
        for blocks in [1, 2] {
            let p: Vec<Var> = (0..blocks)
                .flat_map(|_| ParamTable::block_shapes(cfg.n_embd))
                .map(|s| Var::from_tensor(&randn(&s, dt)).unwrap())
                .collect();
            let pt: Vec<Tensor> = p.iter().map(|v| v.as_tensor().clone()).collect();
            let x = Var::from_tensor(&randn(&[b, t, cfg.n_embd], dt)).unwrap();
            let g = randn(&[b, t, cfg.n_embd], dt);
            let measured = measure(|| {
                let mut y = x.as_tensor().clone();
                for k in 0..blocks {
                    y = gpt.block(&pt[k * 12..(k + 1) * 12], &y).unwrap();
                }
                (y * &g).unwrap().sum_all().unwrap()
            });
            let shapes = ModelShapes { cfg, elem: precision.bytes(), probs };
            let model = shapes.blocks_recomputed(blocks, (b, t));
            check(&format!("{preset} {precision} {probs:?} {blocks} block(s)"), measured, model, blocks);
            // What the graph keeps is the formula's, block by block, and the
            // product out · g (B, T, C) that the backward starts from.
            let (e, per_block) = (precision.bytes(), block_activations(&cfg, (b, t), probs));
            assert_eq!(shapes.block_graph(b, t), per_block * e, "{preset} {precision} {probs:?}");
            let formula = (blocks * per_block + b * t * cfg.n_embd) * e;
            close(
                &format!("{preset} {precision} {probs:?}: the formula"),
                measured.activations,
                formula,
                blocks * (24 << 10),
            );
        }
    }
}

#[test]
fn the_head_and_the_embedding_backward_hold_what_the_shapes_say() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (preset, b, precision, probs) in cases().into_iter().filter(|c| c.3 == Probs::Keep) {
        let cfg = GptConfig::preset(preset, 65).unwrap();
        let (gpt, t, c, dt) = (Gpt::new(cfg), cfg.block_size, cfg.n_embd, precision.dtype());
        let shapes = ModelShapes { cfg, elem: precision.bytes(), probs };
        let x = Var::from_tensor(&randn(&[b, t, c], dt)).unwrap();
        let (w, bias) = (Var::ones(c, dt, &Device::Cpu).unwrap(), Var::zeros(c, dt, &Device::Cpu).unwrap());
        let wte = Var::from_tensor(&randn(&[65, c], dt)).unwrap();
        let tgt = ids(b, t, 64);
        let measured = measure(|| {
            let logits = gpt.head(w.as_tensor(), bias.as_tensor(), wte.as_tensor(), x.as_tensor()).unwrap();
            loss(&logits, &tgt).unwrap()
        });
        check(&format!("{preset} {precision} head"), measured, shapes.head_and_loss((b, t)), 0);

        // The embedding's backward has no graph: the whole context, and half of it (wpe's rest zeros).
        for t in [t, t / 2] {
            let g = randn(&[b, t, c], dt);
            let (backward_peak, grad_store) = held_by(|| gpt.embedding_backward(&g).unwrap());
            let measured = Footprint { activations: 0, backward_peak, grad_store, var_grads: 0, var_grads_at_peak: 0 };
            check(
                &format!("{preset} {precision} embedding backward, T = {t}"),
                measured,
                shapes.embedding_backward((b, t)),
                0,
            );
        }
    }
}

/// A block on a tape ([`Gpt::block_taped`]) keeps what candle's graph of the
/// block keeps, and its backward, which hands each gradient straight on
/// (no GradStore), holds what the shapes say: less than candle's.
#[test]
fn a_block_on_a_tape_holds_what_the_shapes_say() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (preset, b, precision, probs) in cases() {
        let cfg = GptConfig::preset(preset, 65).unwrap();
        let (gpt, t, dt) = (Gpt::new(cfg).with_probs(probs), cfg.block_size, precision.dtype());
        let p: Vec<Tensor> = ParamTable::block_shapes(cfg.n_embd).iter().map(|s| randn(s, dt)).collect();
        let (x, g) = (randn(&[b, t, cfg.n_embd], dt), randn(&[b, t, cfg.n_embd], dt));
        let before = live();
        let (y, tape) = gpt.block_taped(&p, &x).unwrap();
        let activations = live() - before;
        let (backward_peak, grad_store) = held_by(|| tape.backward(&g).unwrap());
        drop((y, tape));
        let measured = Footprint { activations, backward_peak, grad_store, var_grads: 0, var_grads_at_peak: 0 };
        let shapes = ModelShapes { cfg, elem: precision.bytes(), probs };
        let model = shapes.block_taped((b, t));
        check(&format!("{preset} {precision} {probs:?} a block on a tape"), measured, model, 1);
        assert_eq!(model.activations, shapes.block_graph(b, t), "{preset} {precision} {probs:?}: candle's graph's");
        let candle = shapes.blocks_recomputed(1, (b, t));
        assert!(model.backward_peak < candle.backward_peak, "{preset} {precision} {probs:?}: below candle's");
    }
}
