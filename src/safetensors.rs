//! Memory-mapped safetensors reading (with every header field checked) and a small writer.
//!
//! Format: `u64` little-endian header length N, N bytes of JSON
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the data.
//! A truncated or corrupt file is an error naming the file and the problem, never a panic.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    U32,
    I32,
    Other(&'static str, usize),
}

impl Dtype {
    fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "F64" => Dtype::Other("F64", 8),
            "I64" => Dtype::Other("I64", 8),
            "U64" => Dtype::Other("U64", 8),
            "I16" => Dtype::Other("I16", 2),
            "U16" => Dtype::Other("U16", 2),
            "I8" => Dtype::Other("I8", 1),
            "U8" => Dtype::Other("U8", 1),
            "BOOL" => Dtype::Other("BOOL", 1),
            "F8_E4M3" => Dtype::Other("F8_E4M3", 1),
            "F8_E5M2" => Dtype::Other("F8_E5M2", 1),
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::U32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::Other(_, s) => s,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::Other(n, _) => n,
        }
    }
}

/// A shared, immutable byte range: a slice of a memory map or of an owned buffer.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes { owner: Arc::new(v), start: 0, len }
    }
    pub fn from_f32(v: &[f32]) -> Bytes {
        Bytes::from_vec(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Sub-range `[offset, offset+len)` of this range (panics only on a programming error).
    pub fn slice(&self, offset: usize, len: usize) -> Bytes {
        assert!(offset + len <= self.len, "Bytes::slice out of range");
        Bytes { owner: self.owner.clone(), start: self.start + offset, len }
    }
}

/// One tensor of a file: dtype, shape and its bytes.
#[derive(Clone)]
pub struct TensorData {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl TensorData {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Converts a float tensor of any supported dtype to f32 (for small tensors: norms, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes.as_slice();
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            d => bail!("expected a floating-point tensor, found dtype {}", d.name()),
        })
    }
    pub fn to_i32(&self) -> Result<Vec<i32>> {
        let b = self.bytes.as_slice();
        Ok(match self.dtype {
            Dtype::I32 | Dtype::U32 => {
                b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Dtype::Other("I64", _) => {
                b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i32).collect()
            }
            d => bail!("expected an integer tensor, found dtype {}", d.name()),
        })
    }
}

#[inline]
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// Round-to-nearest-even f32 -> bf16 (NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: normalise
            let mut e = 127 - 15 + 1;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (31, 0) => sign | 0x7f80_0000,
        (31, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// One parsed safetensors file.
pub struct SafeFile {
    pub path: PathBuf,
    pub tensors: BTreeMap<String, TensorData>,
}

const MAX_HEADER: u64 = 256 << 20;

impl SafeFile {
    pub fn open(path: &Path) -> Result<SafeFile> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the map is read-only; a checkpoint modified while lily runs is outside our contract.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
        let bytes = Bytes { len: map.len(), owner: Arc::new(map), start: 0 };
        Self::parse(path, bytes)
    }

    pub fn parse(path: &Path, bytes: Bytes) -> Result<SafeFile> {
        let what = path.display();
        let all = bytes.as_slice();
        if all.len() < 8 {
            bail!("{what}: not a safetensors file (only {} bytes, truncated?)", all.len());
        }
        let n = u64::from_le_bytes(all[..8].try_into().unwrap());
        if n > MAX_HEADER || 8 + n > all.len() as u64 {
            bail!("{what}: corrupt or truncated safetensors header (header length {n}, file length {})", all.len());
        }
        let n = n as usize;
        let header: Value = serde_json::from_slice(&all[8..8 + n])
            .with_context(|| format!("{what}: safetensors header is not valid JSON (corrupt file?)"))?;
        let header = header.as_object().with_context(|| format!("{what}: safetensors header is not a JSON object"))?;
        let data_len = all.len() - 8 - n;
        let mut tensors = BTreeMap::new();
        let mut ranges: Vec<(usize, usize, &str)> = Vec::new();
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let t = parse_entry(info, data_len).with_context(|| format!("{what}: tensor `{name}`"))?;
            let (dtype, shape, begin, end) = t;
            tensors.insert(name.clone(), TensorData { dtype, shape, bytes: bytes.slice(8 + n + begin, end - begin) });
            ranges.push((begin, end, name.as_str()));
        }
        // Byte ranges may not overlap (the format says so; two tensors sharing bytes is a
        // corrupt or crafted file).
        ranges.retain(|r| r.1 > r.0);
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                bail!(
                    "{what}: tensors `{}` [{}, {}) and `{}` [{}, {}) overlap (corrupt file?)",
                    w[0].2,
                    w[0].0,
                    w[0].1,
                    w[1].2,
                    w[1].0,
                    w[1].1
                );
            }
        }
        Ok(SafeFile { path: path.to_path_buf(), tensors })
    }
}

fn parse_entry(info: &Value, data_len: usize) -> Result<(Dtype, Vec<usize>, usize, usize)> {
    let dtype_s = info.get("dtype").and_then(Value::as_str).context("missing `dtype`")?;
    let dtype = Dtype::parse(dtype_s).with_context(|| format!("unknown dtype {dtype_s:?}"))?;
    let shape: Vec<usize> = info
        .get("shape")
        .and_then(Value::as_array)
        .context("missing `shape`")?
        .iter()
        .map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok()).context("shape entries must be integers"))
        .collect::<Result<_>>()?;
    let offs = info.get("data_offsets").and_then(Value::as_array).context("missing `data_offsets`")?;
    if offs.len() != 2 {
        bail!("`data_offsets` must hold two integers");
    }
    let off = |v: &Value| v.as_u64().and_then(|x| usize::try_from(x).ok()).context("bad data_offsets");
    let (begin, end) = (off(&offs[0])?, off(&offs[1])?);
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).context("shape overflows")?;
    let want = numel.checked_mul(dtype.size()).context("shape overflows")?;
    if end < begin || end - begin != want {
        bail!(
            "data_offsets [{begin}, {end}) hold {} bytes but shape {shape:?} of {dtype_s} needs {want}",
            end.saturating_sub(begin)
        );
    }
    if end > data_len {
        bail!("data ends at byte {end} but the file holds only {data_len} data bytes (truncated file?)");
    }
    Ok((dtype, shape, begin, end))
}

/// Writes tensors `(name, dtype, shape, little-endian bytes)` as one safetensors file.
pub fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, &[u8])]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        let numel: usize = shape.iter().product();
        if numel * dtype.size() != data.len() {
            bail!("writing `{name}`: {} bytes do not match shape {shape:?}", data.len());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while (8 + h.len()) % 8 != 0 {
        h.push(b' ');
    }
    let mut out =
        std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
    use std::io::Write;
    out.write_all(&(h.len() as u64).to_le_bytes())?;
    out.write_all(&h)?;
    for (_, _, _, data) in tensors {
        out.write_all(data)?;
    }
    out.flush()?;
    Ok(())
}
