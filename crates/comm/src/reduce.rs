//! The one summation order every reduction in the project uses, and the
//! grouping of a step's micro-batch gradients before they are summed.

/// `out = contributions[0] + contributions[1] + … ` element by element,
/// added strictly left to right (rank order). Floating-point addition is not
/// associative; fixing the order is what makes results independent of which
/// collective (or which MPI algorithm) carried the data.
pub fn sum_in_rank_order<'a>(mut contributions: impl Iterator<Item = &'a [f32]>, out: &mut [f32]) {
    let first = contributions.next().expect("at least one contribution");
    out.copy_from_slice(first);
    for c in contributions {
        assert_eq!(c.len(), out.len(), "contributions differ in length");
        out.iter_mut().zip(c).for_each(|(o, x)| *o += x);
    }
}

// ANCHOR: sum_groups
/// `--sum-groups G`: a step's M micro-batch gradients are summed in G groups
/// of M/G consecutive micro-batches — each group left to right, then the
/// group sums left to right. Each rank holds G/N whole groups, so this order
/// is the same at every world size N that divides G; by default G = N (one
/// sum per rank, the fewest bytes), which fixes the rounding per N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumGroups {
    pub groups: usize,
    pub micro_batches: usize,
    pub world: usize,
}

impl SumGroups {
    /// Checks N | G | M; the error names the fix.
    pub fn new(groups: usize, micro_batches: usize, world: usize) -> Result<Self, String> {
        if groups == 0 || micro_batches % groups != 0 {
            return Err(format!("--sum-groups {groups} must divide --micro-batches {micro_batches}: pass a divisor of {micro_batches}"));
        }
        if groups % world != 0 {
            return Err(format!("--sum-groups {groups} does not split among {world} ranks: pass a multiple of {world} that divides {micro_batches}"));
        }
        Ok(Self { groups, micro_batches, world })
    }

    /// Group sums each rank holds (and sends in the reduce-scatter).
    pub fn per_rank(&self) -> usize {
        self.groups / self.world
    }

    /// Which of my group sums the `i`-th of my micro-batches is added to.
    pub fn local_group(&self, i: usize) -> usize {
        i / (self.micro_batches / self.groups)
    }
}
// ANCHOR_END: sum_groups

#[cfg(test)]
mod tests {
    use super::*;

    /// What N ranks compute for one element: my groups' sums, then the
    /// reduce-scatter's left-to-right sum over all ranks' groups.
    fn as_ranks_would(values: &[f32], groups: usize, world: usize) -> f32 {
        let plan = SumGroups::new(groups, values.len(), world).unwrap();
        let per_rank = values.len() / world;
        let mut all_groups = vec![];
        for r in 0..world {
            let mut sums = vec![vec![0f32]; plan.per_rank()];
            for (i, v) in values[r * per_rank..(r + 1) * per_rank].iter().enumerate() {
                sums[plan.local_group(i)][0] += v;
            }
            all_groups.extend(sums);
        }
        let mut out = [0f32];
        sum_in_rank_order(all_groups.iter().map(Vec::as_slice), &mut out);
        out[0]
    }

    #[test]
    fn a_fixed_grouping_rounds_the_same_at_every_world_size() {
        // Twelve values whose sum depends on the order of the additions.
        let values: Vec<f32> = (0..12).map(|i| 1.0 + (i as f32) * 1e-7 * if i % 2 == 0 { 1e7 } else { -3.3 }).collect();
        let at = |g, n| as_ranks_would(&values, g, n).to_bits();
        // One group per rank (the default): the bits depend on N …
        let per_world: Vec<u32> = [1, 2, 3, 4, 6, 12].iter().map(|&n| at(n, n)).collect();
        assert!(per_world.iter().any(|&b| b != per_world[0]), "{per_world:?}");
        // … twelve groups: the same bits at every N dividing 12.
        for n in [1, 2, 3, 4, 6, 12] {
            assert_eq!(at(12, n), at(12, 1), "world {n}");
        }
        assert_eq!(at(4, 2), at(4, 4));
        assert!(SumGroups::new(4, 12, 3).is_err() && SumGroups::new(5, 12, 1).is_err() && SumGroups::new(0, 12, 1).is_err());
    }

    #[test]
    fn order_is_left_to_right() {
        // (1e8 + 1) − 1e8 = 0 in f32 but 1e8 + (1 − 1e8) = 1... order matters, and is fixed.
        let a = [1e8f32];
        let b = [1f32];
        let c = [-1e8f32];
        let mut out = [0f32];
        sum_in_rank_order([&a[..], &b[..], &c[..]].into_iter(), &mut out);
        assert_eq!(out[0], 0.0);
        sum_in_rank_order([&b[..], &a[..], &c[..]].into_iter(), &mut out);
        assert_eq!(out[0], 0.0);
        sum_in_rank_order([&a[..], &c[..], &b[..]].into_iter(), &mut out);
        assert_eq!(out[0], 1.0);
    }
}
