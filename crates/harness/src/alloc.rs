//! A counting global allocator: every heap byte this process holds —
//! candle's CPU tensors, our flat buffers, MPI's Rust-side buffers — passes
//! through it, so "measured" in a report means measured.
//! (Memory that MPI's C library allocates with `malloc` is not seen.)
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

pub struct CountingAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The peak since the last [`take_window_peak`]: what a memory timeline samples.
static WINDOW_PEAK: AtomicUsize = AtomicUsize::new(0);
/// `--mem-budget`: the live heap this rank may hold; the first allocation
/// that would cross it is recorded as an out-of-memory event.
static BUDGET: AtomicUsize = AtomicUsize::new(usize::MAX);
static OVERRUN: AtomicBool = AtomicBool::new(false);
/// The overrun happened before training began (while the lesson built its state).
static OVERRUN_BEFORE_TRAINING: AtomicBool = AtomicBool::new(false);
static OVERRUN_NEEDED: AtomicUsize = AtomicUsize::new(0);
static OVERRUN_LIVE: AtomicUsize = AtomicUsize::new(0);
/// Allocations made on a communication stream's thread since training began.
static STREAM_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
            grow(new_size);
        }
        p
    }
}

fn grow(n: usize) {
    if fsdp_comm::progress::on_stream_thread() {
        STREAM_ALLOCATIONS.fetch_add(1, Relaxed);
    }
    let live = LIVE.fetch_add(n, Relaxed) + n;
    if live > BUDGET.load(Relaxed) && !OVERRUN.swap(true, Relaxed) {
        OVERRUN_NEEDED.store(n, Relaxed);
        OVERRUN_LIVE.store(live - n, Relaxed);
    }
    PEAK.fetch_max(live, Relaxed);
    WINDOW_PEAK.fetch_max(live, Relaxed);
}

/// Bytes allocated and not yet freed.
pub fn live_bytes() -> usize {
    LIVE.load(Relaxed)
}

/// The highest `live_bytes` since the start or the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Relaxed)
}

/// Starts a new peak measurement from the current live bytes.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Relaxed), Relaxed);
}

/// The highest `live_bytes` since the previous call (or the start), and a
/// new window from now. Independent of [`peak_bytes`]: a timeline can sample
/// events while the run's overall peak keeps counting.
pub fn take_window_peak() -> usize {
    let live = LIVE.load(Relaxed);
    WINDOW_PEAK.swap(live, Relaxed).max(live)
}

/// Runs `f` as host-side work: its allocations neither count against the
/// budget nor raise the measured peak. For writing a checkpoint: on a GPU
/// the shards are copied to host memory and serialised there, outside the
/// device memory the budget and the peak stand for. (Whatever `f` still
/// holds when it returns is counted from then on, as usual.)
pub fn host_side<R>(f: impl FnOnce() -> R) -> R {
    let (budget, peak) = (BUDGET.swap(usize::MAX, Relaxed), PEAK.load(Relaxed));
    let r = f();
    PEAK.store(peak.max(LIVE.load(Relaxed)), Relaxed);
    BUDGET.store(budget, Relaxed);
    r
}

/// The first allocation that crossed the budget: what it asked for, and
/// what was live before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overrun {
    pub needed: usize,
    pub live: usize,
    pub budget: usize,
    /// It happened before the first step, while the training state was built.
    pub before_training: bool,
}

/// Sets (or, with `None`, lifts) the per-rank heap budget and clears any
/// overrun — or records one at once when more than the budget is live already.
pub fn set_budget(bytes: Option<usize>) {
    let (budget, live) = (bytes.unwrap_or(usize::MAX), LIVE.load(Relaxed));
    OVERRUN_BEFORE_TRAINING.store(false, Relaxed);
    OVERRUN_NEEDED.store(0, Relaxed);
    OVERRUN_LIVE.store(live, Relaxed);
    OVERRUN.store(live > budget, Relaxed);
    BUDGET.store(budget, Relaxed);
}

/// Training begins ([`crate::Run::start`]): an overrun so far happened
/// while the lesson built its state, and is reported as such.
pub fn training_begins() {
    OVERRUN_BEFORE_TRAINING.store(OVERRUN.load(Relaxed), Relaxed);
    STREAM_ALLOCATIONS.store(0, Relaxed);
}

/// Allocations the communication stream's thread made since training
/// began: none, when its buffers are reserved up front and every buffer a
/// collective uses travels with it (allocated and freed by the compute thread).
pub fn stream_allocations() -> usize {
    STREAM_ALLOCATIONS.load(Relaxed)
}

/// The first allocation beyond the budget since it was set, if any.
pub fn overrun() -> Option<Overrun> {
    OVERRUN.load(Relaxed).then(|| Overrun {
        needed: OVERRUN_NEEDED.load(Relaxed),
        live: OVERRUN_LIVE.load(Relaxed),
        budget: BUDGET.load(Relaxed),
        before_training: OVERRUN_BEFORE_TRAINING.load(Relaxed),
    })
}

/// Asks glibc's malloc to keep freed memory for reuse. By default it returns
/// every block above 128 KiB to the kernel at once (`munmap`), so each fresh
/// candle tensor of that size costs page faults and zero-filled pages: a
/// third of a step's time, measured on the tiny preset. Keeping blocks up to
/// 32 MiB in the heap (and trimming only beyond 512 MiB free) takes lesson 01
/// from 11,457 to 16,774 tokens/s at 2 ranks with the same peak RSS.
/// Changes no value computed; a no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only tunes malloc's parameters; called once at start.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 512 << 20);
        }
    }
}

/// The process's peak resident set size (VmHWM), in bytes, where Linux tells it.
pub fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
