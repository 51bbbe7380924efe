use candle_core::{DType, Device, Tensor};
use fsdp_gpt::{
    GptConfig, ParamTable, Precision,
    model::{Gpt, loss},
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
struct C;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for C {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        let v = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(v, Relaxed);
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
}
#[global_allocator]
static G: C = C;
fn live() -> usize {
    LIVE.load(Relaxed)
}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let preset = args.get(1).map(|s| s.as_str()).unwrap_or("tiny");
    let b: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(8);
    let prec: Precision = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(Precision::Fp32);
    let cfg = GptConfig::preset(preset, 65).unwrap();
    let t = cfg.block_size;
    let table = ParamTable::new(&cfg);
    let gpt = Gpt::new(cfg);
    let flat = table.init_flat(1);
    let vars = gpt.vars_in(&table, &flat, prec).unwrap();
    let ps: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 65) as u32).collect();
    let idx = Tensor::from_vec(ids.clone(), (b, t), &Device::Cpu).unwrap();
    let tgt = Tensor::from_vec(ids.iter().map(|x| (x + 1) % 65).collect::<Vec<_>>(), (b, t), &Device::Cpu).unwrap();
    sim(preset, b, prec);
    for rep in 0..2 {
        let l0 = live();
        let mut x = gpt.embed(&ps[0], &ps[1], &idx).unwrap();
        let l1 = live();
        println!("embed {}", l1 - l0);
        for i in 0..cfg.n_layer {
            let a = live();
            x = gpt.block(&ps[2 + 12 * i..14 + 12 * i], &x).unwrap();
            println!("block {i} {}", live() - a);
        }
        let a = live();
        let n = ps.len();
        let logits = gpt.head(&ps[n - 2], &ps[n - 1], &ps[0], &x).unwrap();
        println!("head {}", live() - a);
        let a = live();
        let l = loss(&logits, &tgt).unwrap();
        println!("loss {}", live() - a);
        drop((x, logits));
        let fwd = live() - l0;
        println!("forward retained {fwd}");
        PEAK.store(live(), Relaxed);
        let before = live();
        let g = l.backward().unwrap();
        println!("backward peak above fwd {} ; after {}", PEAK.load(Relaxed) - before, live() - before);
        drop(l);
        println!("after drop loss: grads {}  (params {})", live() - l0, table.numel() * prec.bytes());
        drop(g);
        let _ = (rep, DType::F32);
    }
}
#[allow(dead_code)]
fn sim(preset: &str, b: usize, prec: Precision) {
    let cfg = GptConfig::preset(preset, 65).unwrap();
    let table = ParamTable::new(&cfg);
    let f = fsdp_gpt::memory::ModelShapes { cfg, elem: prec.bytes() }.whole_model(&table, (b, cfg.block_size));
    println!("SIM {f:?} peak-above-fwd {}", f.backward_peak);
}
