//! The one summation order every reduction in the project uses.

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

#[cfg(test)]
mod tests {
    use super::*;

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
