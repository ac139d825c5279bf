//! The region index every part of the world shares: a leaf, so the world and its fault
//! schedule both name regions without importing each other.

/// A region's index, `0..regions`.
pub type RegionIx = usize;
