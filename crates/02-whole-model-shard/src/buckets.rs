//! DDP's buckets for lesson 02's all-reduce (`--bucket-mb`, lesson 01's
//! [`step01_data_parallel::buckets`]): my last micro-batch runs block by
//! block, and each bucket of its gradient is all-reduced on the
//! communication stream as soon as it is complete, while the backward goes
//! on. The same bits as the step in `whole_model_shard.rs`.
use fsdp_harness::{MemoryTally, MemoryTimeline, Session, exercise};
use step01_data_parallel::{Buckets, backward_in_buckets};

use crate::whole_model_shard::{MyShard, WholeModelShard};

impl WholeModelShard {
    /// My shard with its buffers and the buckets of at least `cap` bytes,
    /// whose shards and stream receive buffer replace the all-reduce's (the
    /// stream must be started).
    pub fn with_buckets(s: &Session, shard: MyShard, recompute: bool, cap: usize) -> (Self, Buckets) {
        let buckets = Buckets::for_session(s, shard.layout().padded, cap);
        buckets.reserve_receive_buffer(s);
        (Self::assemble(s, shard, recompute, 0), buckets) // the buckets have shards of their own
    }

    // ANCHOR: bucketed_step
    /// The step of `whole_model_shard.rs` with DDP's buckets: my last
    /// micro-batch's backward hands each bucket to the stream as it completes.
    pub fn bucketed_step(
        &mut self,
        s: &Session,
        step: u64,
        tl: &mut MemoryTimeline,
        b: &mut Buckets,
    ) -> anyhow::Result<f32> {
        let (w, numel) = (s.world, self.layout.numel);

        // 1. all-gather: every rank's shard → the full weight vector
        w.all_gather(&self.master, &mut self.gathered);
        let vars = s.model.vars_from_flat(&s.table, &self.gathered[..numel])?;
        let all: Vec<usize> = (0..vars.len()).collect();
        tl.mark("all-gather the whole model");

        // 2. forward/backward on my micro-batches, the last in buckets
        self.grads.reset();
        let mut loss_sum = 0.0;
        let mine = s.my_micro_batches();
        for k in mine.clone() {
            if k + 1 == mine.end {
                loss_sum += backward_in_buckets(s, &vars, step, k, self.recompute, &mut self.grads, b)? as f64;
            } else {
                let (loss, grads) = w.traced(
                    || format!("forward+backward, micro-batch {k}"),
                    || s.forward_backward(&vars, step, k, self.recompute),
                )?;
                self.grads.add(|sum| grads.add_to(&all, &vars, &mut sum[..numel]))?;
                loss_sum += loss as f64;
            }
            tl.mark(format!("forward+backward, micro-batch {k}"));
        }
        drop(vars); // the full copy is not needed again this step
        tl.mark("drop the full copy");

        // 3. all-reduce: handed to the stream in the backward; wait for every bucket, then the mean
        let grads = b.all_reduced(w, &mut self.grads);
        let inv = 1.0 / s.sampler.micro_batches as f32;
        grads.iter_mut().for_each(|g| *g *= inv);
        s.clip_whole(&mut grads[..numel]); // --grad-clip: the all-reduce left the whole gradient here
        tl.mark("all-reduce the gradient");

        // 4. update: AdamW on my shard only (exercise 2.1)
        w.traced(
            || "AdamW update".into(),
            || exercise!(2, 1, update_my_shard(&mut self.opt, &mut self.master, grads, self.layout, w.rank())),
        );
        tl.mark("AdamW on my shard");
        Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
    }
    // ANCHOR_END: bucketed_step

    /// [`WholeModelShard::tally`] under `--bucket-mb`: the buckets' rows in
    /// place of the grad shard and its receive buffer; my last micro-batch
    /// hands each block's gradient on as its backward ends, the others are
    /// collected whole.
    pub fn bucketed_tally(&self, s: &Session, b: &Buckets) -> MemoryTally {
        let mut t = self.state_rows(s);
        b.tally_rows(s, &mut t);
        s.data_tally(&mut t);
        let mut moments = self.whole_moments(s, s.my_micro_batches().len() - 1);
        moments.extend(b.last_micro_batch_moments(s, 4, self.recompute, &mut |m| self.vars_row(m)));
        t.peak(moments);
        t
    }
}
