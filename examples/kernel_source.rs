//! Prints the CUDA program text lily compiles (`lily::cuda::kernel_source()`: the params structs'
//! declarations and every kernel file, with the defines the env settings select, such as
//! `LILY_CUDA_GEMV_I8=0`), for tools that read the kernels outside NVRTC (scripts/emu.sh).
fn main() {
    print!("{}", lily::cuda::kernel_source());
}
