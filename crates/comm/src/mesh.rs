//! HSDP's mesh: the world split into shard groups and replica groups, once.
use crate::comm::Comm;

// ANCHOR: mesh
/// HSDP's two-dimensional mesh (FSDP2's `DeviceMesh` of shape
/// (replicate, shard), torchtitan's `dp_replicate` × `dp_shard`): N ranks in
/// N/S **shard groups** of S consecutive ranks (one node's, when a node runs
/// S ranks), which shard the model among themselves, and S **replica
/// groups**, one per shard index across the shard groups, which hold the
/// same shard and sum its gradient. The world's rank r is rank r mod S of
/// shard group r / S, and rank r / S of replica group r mod S.
pub struct Mesh {
    /// My shard group: all-gathers and reduce-scatters stay inside it.
    pub shard: Comm,
    /// My replica group: the ranks holding my shard in the other shard groups.
    pub replica: Comm,
}

impl Mesh {
    pub(crate) fn split(world: &Comm, shard: usize) -> Self {
        assert!(shard > 0 && world.size().is_multiple_of(shard), "S = {shard} must divide N = {}", world.size());
        let r = world.rank();
        Self { shard: world.split(r / shard, r), replica: world.split(r % shard, r) }
    }
}
// ANCHOR_END: mesh
