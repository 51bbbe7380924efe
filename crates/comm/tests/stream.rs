//! The communication stream in a world of one process (an MPI singleton:
//! `cargo test` starts no `mpirun`). MPI initialises once per process, so
//! one test walks through everything in order; the collectives between
//! ranks are tested by the lessons' end-to-end tests under `mpirun`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use fsdp_comm::stream::SLOTS;
use fsdp_comm::{Collective, MicroBatchSum, SumGroups, World};

#[test]
fn the_stream_in_a_world_of_one() {
    let w = World::init().expect("MPI initialises");
    assert!(w.stream().is_none(), "no stream before start_stream");
    w.start_stream().expect("this Open MPI is built with MPI_THREAD_MULTIPLE");

    // Handed over in order, waited for in reverse: each wait gives its own result.
    let pending: Vec<_> = (0..8).map(|i| w.all_gather_async(vec![i as f32; 3], vec![0.0; 3])).collect();
    for (i, p) in pending.into_iter().enumerate().rev() {
        assert_eq!(p.wait(&w), vec![i as f32; 3]);
    }
    assert_eq!(w.traffic().get(Collective::AllGather).calls, 8, "each wait records its collective");

    // Every slot in flight at once, then each slot reused many times over.
    let pending: Vec<_> = (0..SLOTS).map(|i| w.all_gather_async(vec![i as u16], vec![0])).collect();
    let got: Vec<u16> = pending.into_iter().flat_map(|p| p.wait(&w)).collect();
    assert_eq!(got, (0..SLOTS as u16).collect::<Vec<_>>());
    for i in 0..3 * SLOTS {
        assert_eq!(w.all_gather_async(vec![i as u16], vec![0]).wait(&w), vec![i as u16]);
    }

    // Dropped without a wait (a step unwinding): the drop waits, the slot is freed.
    for i in 0..2 * SLOTS {
        drop(w.all_gather_async(vec![i as f32; 1000], vec![0.0; 1000]));
    }
    assert_eq!(w.all_gather_async(vec![7.0f32], vec![0.0]).wait(&w), vec![7.0]);

    // Four group sums reduce-scattered on the stream: the pairwise tree's sum,
    // (g0 + g1) + (g2 + g3), whose bits the grouping decides — in fp32 it is
    // 0 here, where adding left to right gives 1 (1e8 + 1 rounds to 1e8).
    let plan = SumGroups::new(4, 4, 1).expect("four groups of one micro-batch");
    let mut sums = MicroBatchSum::new(plan, 2);
    for g in [[1e8, 0.5], [1.0, 0.25], [-1e8, 0.125], [1.0, 0.0625]] {
        sums.add(|b| b.copy_from_slice(&g));
    }
    let tree = (1e8f32 + 1.0) + (-1e8f32 + 1.0);
    assert_eq!((tree, ((1e8f32 + 1.0) + -1e8f32) + 1.0), (0.0, 1.0), "the example tells the orders apart");
    assert_eq!(w.reduce_scatter_sum_async(&mut sums, vec![0.0; 2]).wait(&w), vec![tree, 0.9375]);

    // A panic in the rank sum (an exercise's stub) on the stream's thread is
    // raised where the compute thread waits, and the stream serves on.
    w.set_rank_sum(|_| panic!("the rank sum is a stub"));
    for g in 0..4 {
        sums.add(|b| b.fill(g as f32));
    }
    let pending = w.reduce_scatter_sum_async(&mut sums, vec![0.0; 2]);
    let raised = catch_unwind(AssertUnwindSafe(|| pending.wait(&w))).expect_err("the wait raises the stream's panic");
    assert_eq!(raised.downcast_ref::<&str>(), Some(&"the rank sum is a stub"));
    w.set_rank_sum(fsdp_comm::sum_pairwise);
    assert_eq!(w.all_gather_async(vec![3u16, 4], vec![0, 0]).wait(&w), vec![3, 4]);
}
