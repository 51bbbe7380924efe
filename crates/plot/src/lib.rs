//! # fsdp-plot — what a run shows
//!
//! Infrastructure, not a lesson: the boxed text tables every report prints
//! and the SVG line charts it draws, written by hand so that the same input
//! gives the same bytes (the book's figures are regenerated and compared).
//!
//! | module | what it holds |
//! |---|---|
//! | [`table`] | boxed text tables, and how sizes and numbers are printed |
//! | [`plot`] | small SVG line charts |
//! | [`timeline`] | when things happened: lanes of bars on a time axis |

pub mod plot;
pub mod table;
pub mod timeline;
