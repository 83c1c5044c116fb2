//! The largest size that fits, found by trying sizes: doubling until one fails, then bisecting
//! (every shape the tests build is monotone). Shared by the tests that compare a search's
//! answer with it.

/// The largest size for which `fits` holds, 0 where none does.
pub fn largest_that_fits(fits: impl Fn(usize) -> bool) -> usize {
    let (mut low, mut high) = (0usize, 1usize);
    while fits(high) {
        low = high;
        high *= 2;
    }
    while high - low > 1 {
        let middle = low + (high - low) / 2;
        if fits(middle) {
            low = middle;
        } else {
            high = middle;
        }
    }
    low
}
