//! Shard layout as pure arithmetic (llm.c's `ShardInfo`): no MPI, unit-tested.
//!
//! A flat vector of `numel` elements is padded with zeros to `padded`, the
//! next multiple of the world size N, and cut into N equal shards. Equal
//! shards are what MPI's `all_gather`/`reduce_scatter` want; the padding is
//! at most N−1 elements and never touches a real parameter.

/// One rank's slice of the padded flat vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardInfo {
    pub offset: usize,
    pub len: usize,
}

impl ShardInfo {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// `v` grown to `len` with `fill`, its allocation exactly `len`: `Vec::resize`
/// alone may double the capacity (its amortized growth) — on the last rank,
/// whose shard holds the padding, up to a second shard's worth that no tally
/// counts.
pub fn grow_exact<T: Clone>(mut v: Vec<T>, len: usize, fill: T) -> Vec<T> {
    v.reserve_exact(len.saturating_sub(v.len()));
    v.resize(len, fill);
    v
}

/// How a flat vector of `numel` elements is split over `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    pub numel: usize,
    pub world: usize,
    /// `numel` rounded up to a multiple of `world`.
    pub padded: usize,
    /// Elements per shard, `padded / world`.
    pub shard_len: usize,
}

impl ShardLayout {
    pub fn new(numel: usize, world: usize) -> Self {
        assert!(world > 0, "a world has at least one rank");
        let shard_len = numel.div_ceil(world);
        Self { numel, world, padded: shard_len * world, shard_len }
    }

    /// Rank `rank`'s slice of the padded vector.
    pub fn shard(&self, rank: usize) -> ShardInfo {
        ShardInfo { offset: rank * self.shard_len, len: self.shard_len }
    }

    /// A shard's real values `v` with the padding's zeros after: `shard_len`
    /// long and allocated to exactly that, as the tallies count it
    /// ([`grow_exact`]).
    pub fn pad(&self, v: Vec<f32>) -> Vec<f32> {
        grow_exact(v, self.shard_len, 0.0)
    }

    /// How many of rank `rank`'s elements are real parameters (the rest is padding).
    pub fn real_len(&self, rank: usize) -> usize {
        let s = self.shard(rank);
        self.numel.saturating_sub(s.offset).min(s.len)
    }

    /// Padding elements in the whole vector.
    pub fn padding(&self) -> usize {
        self.padded - self.numel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_padded_vector_for_any_count_and_world() {
        for numel in [0, 1, 2, 7, 10, 809_856, 1_000_003] {
            for world in 1..=9 {
                let l = ShardLayout::new(numel, world);
                assert_eq!(l.padded % world, 0);
                assert!(l.padding() < world, "padding below one element per rank");
                let mut next = 0;
                let mut real = 0;
                for r in 0..world {
                    let s = l.shard(r);
                    assert_eq!(s.offset, next);
                    assert_eq!(s.len, l.shard_len);
                    next = s.range().end;
                    real += l.real_len(r);
                }
                assert_eq!(next, l.padded);
                assert_eq!(real, numel);
            }
        }
    }

    #[test]
    fn the_classic_toy_splits_evenly_in_two() {
        let l = ShardLayout::new(809_856, 2);
        assert_eq!((l.shard_len, l.padding()), (404_928, 0));
        let l = ShardLayout::new(809_856, 3);
        assert_eq!(l.shard(2), ShardInfo { offset: 539_904, len: 269_952 });
        assert_eq!(l.padding(), 0);
        let l = ShardLayout::new(809_856, 7);
        assert_eq!((l.shard_len, l.padding(), l.real_len(6)), (115_694, 2, 115_692));
    }
}
