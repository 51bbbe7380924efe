//! Hybrid sharding (HSDP): the units of [`crate::units`] sharded within
//! shard groups of S consecutive ranks and replicated across the N/S groups
//! — FSDP2's 2-D `DeviceMesh` with `(Replicate(), Shard(0))`, torchtitan's
//! `dp_replicate` × `dp_shard`. One node's ranks make a shard group, so the
//! all-gathers and reduce-scatters stay inside the node, and only each
//! gradient shard's all-reduce crosses between nodes.
//!
//! `main` splits the mesh once ([`unit_comms`], [`fsdp_comm::Mesh`]) and
//! hands every unit its shard group and its replica group
//! ([`UnitComms`]): a unit gathers and reduce-scatters in its shard group
//! and then all-reduces its gradient shard across its replica group
//! ([`all_reduce_shard`]). This file also checks the flag, names the layout,
//! and reports what each group sent beside its theory (the tally's rows for
//! HSDP's buffers are `tally.rs`'s).
use anyhow::anyhow;
use fsdp_comm::{Collective, Comm, CommOf, ShardLayout, Traffic, World};
use fsdp_harness::{Report, Session};

/// `--hsdp S`, checked on every rank together: refused in one line where it cannot run.
pub fn check(s: &Session, hsdp: Option<usize>) -> anyhow::Result<()> {
    let refused = hsdp.and_then(|size| refusal(s, size));
    fsdp_harness::lesson::agree(s.world, refused.map_or(Ok(()), Err))
}

/// `--hsdp S`: why these S cannot run, in one line (None: they can).
fn refusal(s: &Session, size: usize) -> Option<anyhow::Error> {
    let n = s.world.size();
    let list = |keep: &dyn Fn(usize) -> bool| (1..=n).filter(|&d| keep(d)).map(|d| d.to_string()).collect::<Vec<_>>();
    Some(if size == 0 || !n.is_multiple_of(size) {
        anyhow!(
            "--hsdp {size} does not cut {n} rank(s) into shard groups of equal size: pass one of {}",
            list(&|d| n.is_multiple_of(d)).join(", ")
        )
    } else if !s.sum_groups.hsdp_same_bits(size) {
        anyhow!(
            "--hsdp {size} on {n} ranks makes {} replica groups, whose sum is not lesson 01's pairwise tree (the number of replica groups must be a power of two): pass one of {}",
            n / size,
            list(&|d| s.sum_groups.hsdp_same_bits(d)).join(", ")
        )
    } else if s.args.trace.is_some() {
        anyhow!("--hsdp is not traced yet (the trace records the world's collectives): leave out --trace, or --hsdp")
    } else if s.reduce_dtype == fsdp_comm::ReduceDtype::Bf16 {
        anyhow!("--hsdp reduces across replica groups in fp32 only here: leave out --reduce-dtype bf16, or --hsdp")
    } else {
        return None;
    })
}

// ANCHOR: all_reduce_shard
/// HSDP's step across the replica groups: `shard` becomes the sum over the
/// R replicas of their `shard`s, ordered (a reduce-scatter of R parts, then
/// an all-gather). The all-reduce cuts it into R equal parts, so a shard
/// whose length R does not divide travels in a zero-padded copy; the
/// all-reduce's own part (1/R) is transient either way.
pub fn all_reduce_shard(replicas: &Comm, shard: &mut [f32]) {
    let r = replicas.size();
    let padded = shard.len().next_multiple_of(r);
    let mut part = vec![0.0; padded / r];
    if padded == shard.len() {
        return replicas.all_reduce(shard, &mut part);
    }
    let mut buf = Vec::with_capacity(padded);
    buf.extend_from_slice(shard);
    buf.resize(padded, 0.0);
    replicas.all_reduce(&mut buf, &mut part);
    shard.copy_from_slice(&buf[..shard.len()]);
}
// ANCHOR_END: all_reduce_shard

/// The communicators a unit is sharded over, handed to it once by `main` (FSDP2's
/// `mesh`): the world's, or under HSDP my shard group's and my replica group's ([`unit_comms`]).
#[derive(Clone, Copy)]
pub struct UnitComms<'w> {
    /// Where the unit's shards are: its all-gathers and reduce-scatters run here.
    pub shard: &'w Comm,
    /// HSDP: the ranks that hold my shard in the other shard groups; each
    /// reduce-scattered shard is summed across them.
    pub replica: Option<&'w Comm>,
    /// The communication stream's twin of `shard` (the stream runs over communicators of its own).
    pub stream: CommOf,
}

impl<'w> UnitComms<'w> {
    /// Sharded over the whole world (full sharding).
    pub fn world(w: &'w World) -> Self {
        Self { shard: w, replica: None, stream: CommOf::World }
    }
}

// ANCHOR: unit_comms
/// The communicators every unit is sharded over, built once, before the
/// first unit (every rank together: `MPI_Comm_split`, and the stream's own
/// split when it runs): the world's, or under `--hsdp S` the mesh's — my
/// shard group's, and my replica group's beside it (FSDP2's
/// `fully_shard(mesh=…)` with a 2-D mesh).
pub fn unit_comms(w: &World, hsdp: Option<usize>) -> UnitComms<'_> {
    match hsdp {
        None => UnitComms::world(w),
        Some(size) => {
            let mesh = w.mesh(size);
            UnitComms { shard: &mesh.shard, replica: Some(&mesh.replica), stream: CommOf::Shard }
        }
    }
}
// ANCHOR_END: unit_comms

/// The config table's "sharding" row.
pub fn describe(n: usize, hsdp: Option<usize>) -> String {
    match hsdp {
        None => format!("full shard: every unit over all {n} rank(s)"),
        Some(size) => format!(
            "HSDP: {} shard group(s) of {size} consecutive rank(s), each unit sharded inside one; {size} replica group(s) of {}, each shard's gradient all-reduced across one",
            n / size,
            n / size
        ),
    }
}

/// What training sent: the world's communicator and, under HSDP, the
/// shard and replica groups' — taken when training ends, before a final
/// gather that is not part of it.
pub struct TrainingTraffic {
    world: Traffic,
    mesh: Option<(Traffic, Traffic)>,
}

impl TrainingTraffic {
    pub fn now(w: &World) -> Self {
        Self { world: w.traffic(), mesh: w.mesh_if_split().map(|m| (m.shard.traffic(), m.replica.traffic())) }
    }
}

// ANCHOR: hsdp_traffic
/// Bytes one rank sends per step across its replica group: every unit's
/// gradient shard all-reduced once among the R replicas (an ordered
/// all-reduce: a reduce-scatter and an all-gather of 1/R of the shard —
/// padded to a multiple of R — each, so 2 (R − 1)/R of the shard's fp32 bytes).
pub fn all_reduce_bytes(units: &[ShardLayout], replicas: usize) -> u64 {
    units.iter().map(|l| (2 * (replicas - 1) * l.shard_len.div_ceil(replicas) * 4) as u64).sum()
}
// ANCHOR_END: hsdp_traffic

/// The traffic into `report`, with its theory: `gather` and `scatter` bytes
/// per step (computed from the units' layouts, which under HSDP span a
/// shard group), the replica all-reduce under HSDP, `--grad-clip`'s norm
/// over the ranks that share the model. Under HSDP a second table splits
/// the bytes by communicator.
pub fn report_traffic(
    report: &mut Report,
    s: &Session,
    units: &[ShardLayout],
    sent: TrainingTraffic,
    gather: u64,
    scatter: u64,
) {
    let (n, size) = (s.world.size(), units[0].world);
    let all_reduce = sent.mesh.is_some().then(|| all_reduce_bytes(units, n / size));
    let clip = s.clip_traffic_over(size);
    report
        .expect_traffic(Collective::AllGather, gather)
        .expect_traffic(Collective::ReduceScatter, scatter)
        .expect_traffic_if(Collective::AllReduce, all_reduce)
        .expect_traffic_if(Collective::GradNorm, clip);
    let Some((shard, replica)) = sent.mesh else {
        report.traffic(sent.world);
        return;
    };
    let mut in_group = vec![(Collective::AllGather, gather), (Collective::ReduceScatter, scatter)];
    in_group.extend(clip.map(|b| (Collective::GradNorm, b)));
    report
        .traffic(sent.world.plus(&shard).plus(&replica))
        .comm_traffic(format!("shard group ({size} ranks)"), shard, in_group)
        .comm_traffic(
            format!("replica group ({} ranks)", n / size),
            replica,
            all_reduce.map(|b| (Collective::AllReduce, b)).into_iter().collect(),
        );
}
