//! lily: an inference engine specialised for the Qwen3.5/3.6 hybrid (Gated DeltaNet + gated
//! attention) MoE family. The CPU backend here is the reference every GPU kernel is checked against.

pub mod config;
pub mod cpu;
pub mod kernels;
pub mod linear;
pub mod model;
pub mod progress;
pub mod safetensors;
pub mod state;
pub mod weights;
pub mod generate;
pub mod loader;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;
