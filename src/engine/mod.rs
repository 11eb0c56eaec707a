//! The engine: many sequences on one backend. [`batch`] is the backend side (one forward pass
//! over several sequences' new tokens), [`picker`] how each sequence chooses its tokens,
//! [`kv`] the KV-cache page budget the scheduler admits sequences against.

pub mod batch;
pub mod kv;
pub mod metrics;
pub mod picker;
pub mod prefix_cache;
pub mod scheduler;
