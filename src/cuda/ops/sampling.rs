//! Choosing the next token on the device: argmax over rows, and the device-resident greedy and
//! sampling loops' launches (kernels/sampling.cu).

use super::super::params::{ArgmaxIoParams, ArgmaxParams, In, Out, SampDrawParams, SampPassParams, SampRadixParams};
use super::super::Gpu;
use anyhow::{bail, Result};

impl Gpu {
    /// Index of the largest of n values into out (i32).
    pub fn argmax(&self, x: u64, n: usize, out: u64) -> Result<()> {
        self.argmax_rows(x, n, out, 1)
    }

    /// The argmax of each of `rows` rows of `x: [rows, n]` into `out: [rows]` (i32), one block per row.
    pub fn argmax_rows(&self, x: u64, n: usize, out: u64, rows: usize) -> Result<()> {
        let a = ArgmaxParams { x: In::new(x), n: n as i32, out: Out::new(out) };
        self.launch_params("argmax", (rows as u32, 1, 1), 1024, 0, &a)
    }

    /// Argmax fed back into the step's input slot: `io = [token, pos, count]` gets the argmax as
    /// its token, `pos + 1`, and `ring[count]` the token, `count + 1`. `ws` is
    /// [`SAMPLE_WS_BYTES`] of zeroed workspace (kernels/sampling.cu).
    pub fn argmax_io(&self, x: u64, n: usize, io: u64, ring: u64, ws: u64) -> Result<()> {
        let g = sample_blocks(n)?;
        let a = ArgmaxIoParams { x: In::new(x), n: n as i32, io: Out::new(io), ring: Out::new(ring), ws: Out::new(ws) };
        self.launch_params("argmax_io", (g, 1, 1), 512, 0, &a)
    }

    /// Like [`Gpu::argmax_io`] with the token drawn by temperature / top-k / min-p / top-p
    /// sampling; `sp` holds [`sampling_params_bytes`]. Nine launches over the row: max, the
    /// top-k radix select, Z_k, the top-p radix select, the draw (kernels/sampling.cu).
    pub fn sample_io(&self, x: u64, n: usize, io: u64, ring: u64, sp: u64, ws: u64) -> Result<()> {
        let g = (sample_blocks(n)?, 1, 1);
        let (x, n, sp, ws) = (In::new(x), n as i32, In::new(sp), Out::new(ws));
        let pass_params = SampPassParams { x, n, sp, ws };
        self.launch_params("samp_max", g, 512, 0, &pass_params)?;
        for sel in 0..2 {
            if sel == 1 {
                self.launch_params("samp_zsum", g, 512, 0, &pass_params)?;
            }
            for pass in 0..3 {
                self.launch_params("samp_radix", g, 512, 0, &SampRadixParams { x, n, sp, ws, sel, pass })?;
            }
        }
        let a = SampDrawParams { x, n, io: Out::new(io), ring: Out::new(ring), sp, ws };
        self.launch_params("samp_draw", g, 512, 0, &a)
    }
}

/// Bytes of the workspace [`Gpu::argmax_io`] and [`Gpu::sample_io`] share between their passes
/// (`struct SampWs`, 18,480 bytes, rounded up); allocate it zeroed.
pub const SAMPLE_WS_BYTES: usize = 32768;

/// Blocks over which the device loops spread a row of n logits (kernels/sampling.cu: at most 128,
/// each owning at least 2,048 ids).
fn sample_blocks(n: usize) -> Result<u32> {
    if n == 0 || n > i32::MAX as usize {
        bail!("device token choice over {n} logits");
    }
    Ok(n.div_ceil(2048).clamp(1, 128) as u32)
}

/// The 24 bytes `sample_io` reads: `[T, top_p, min_p]` f32, `top_k` i32, the seed as two u32.
/// Rejects what the host sampler would reject, and greedy (T = 0: use `argmax_io`).
pub fn sampling_params_bytes(p: &crate::sampling::SamplingParams, seed: u64) -> Result<[u8; 24]> {
    p.validate()?;
    if p.temperature <= 0.0 {
        bail!("device sampling needs a temperature > 0 (greedy uses argmax_io)");
    }
    let top_k = i32::try_from(p.top_k).unwrap_or(i32::MAX);
    let mut b = [0u8; 24];
    b[0..4].copy_from_slice(&p.temperature.to_le_bytes());
    b[4..8].copy_from_slice(&p.top_p.to_le_bytes());
    b[8..12].copy_from_slice(&p.min_p.to_le_bytes());
    b[12..16].copy_from_slice(&top_k.to_le_bytes());
    b[16..20].copy_from_slice(&(seed as u32).to_le_bytes());
    b[20..24].copy_from_slice(&((seed >> 32) as u32).to_le_bytes());
    Ok(b)
}
