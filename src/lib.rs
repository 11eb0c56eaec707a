//! lily: an inference engine specialised for the Qwen3.5/3.6 hybrid (Gated DeltaNet + gated
//! attention) MoE family. The CPU backend here is the reference every GPU kernel is checked against.

pub mod config;
pub mod constrain;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod generate;
pub mod hub;
pub mod linear;
pub mod loader;
pub mod model;
pub mod progress;
pub mod safetensors;
pub mod sampling;
pub mod server;
pub mod shard;
pub mod state;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;
