//! The CPU reference backend: one plain fp32 implementation per op.

pub mod attention;
pub mod conv;
pub mod gdn;
pub mod moe;
pub mod norm;
pub mod rope;
