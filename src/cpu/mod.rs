//! The CPU backend: one plain fp32 implementation per op (the reference every GPU kernel is
//! checked against), and `kernels`, the inner loops (portable + AVX2/FMA, picked at run time;
//! the int8-activation products in `kernels/q8.rs` and `kernels/q4tile.rs`).

pub mod attention;
pub mod conv;
pub mod gdn;
pub mod kernels;
pub mod moe;
pub mod norm;
pub mod rope;
