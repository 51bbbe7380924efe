//! The end-to-end tests, one binary (it builds in half the time of one
//! binary per file): the lessons as real MPI jobs, the checkpoints, bad
//! input, the book's includes, the same bits on another CPU, the setup probe.
//! See tests/README.md for what each module proves.
mod common;

mod accumulate;
mod alpha_beta;
mod bad_input;
mod book;
mod checkpoint;
mod clip;
mod cluster;
mod exercises;
mod hsdp;
mod lesson01;
mod lesson02;
mod lesson03;
mod lesson04;
mod machine;
mod memory;
mod overlap;
mod sample;
mod setup;
