//! Placeholder: see the crate README.

fn main() {}
