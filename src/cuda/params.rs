//! Kernel parameter structs, defined once for both sides of a launch.
//!
//! Each struct below is a `#[repr(C)]` Rust struct and, through [`c_decls`] (prepended to the
//! kernel source before NVRTC compiles it), the same C struct: field names and order come from
//! one definition and each field's C type from its Rust type ([`CField`]), so a launch and its
//! kernel cannot disagree about argument order, count or width. A kernel takes its struct by
//! value (`extern "C" __global__ void rms_norm(RmsNormParams p)`) and [`super::Gpu::launch_params`]
//! passes it as the launch's one argument.
//!
//! Field types: `i32` (int), `u32` (unsigned), `i64` (long long), `f32` (float), and device
//! pointers [`In<T>`] (`const T*`) and [`Out<T>`] (`T*`) over those element types. Both languages
//! lay such a struct out the same way (natural alignment, no reordering).

use std::marker::PhantomData;

/// A Rust field type and the C type it is declared as in the kernels' copy of the struct.
pub trait CField {
    fn c_type() -> String;
}

impl CField for i32 {
    fn c_type() -> String {
        "int".into()
    }
}
impl CField for u32 {
    fn c_type() -> String {
        "unsigned".into()
    }
}
impl CField for i64 {
    fn c_type() -> String {
        "long long".into()
    }
}
impl CField for f32 {
    fn c_type() -> String {
        "float".into()
    }
}

/// A device address the kernel reads `T`s at (`const T*`; 0 is null).
#[repr(transparent)]
pub struct In<T>(pub u64, PhantomData<T>);
/// A device address the kernel writes (or reads and writes) `T`s at (`T*`; 0 is null).
#[repr(transparent)]
pub struct Out<T>(pub u64, PhantomData<T>);

impl<T> In<T> {
    pub fn new(ptr: u64) -> In<T> {
        In(ptr, PhantomData)
    }
}
impl<T> Out<T> {
    pub fn new(ptr: u64) -> Out<T> {
        Out(ptr, PhantomData)
    }
}
impl<T> Clone for In<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for In<T> {}
impl<T> Clone for Out<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Out<T> {}
impl<T: CField> CField for In<T> {
    fn c_type() -> String {
        format!("const {}*", T::c_type())
    }
}
impl<T: CField> CField for Out<T> {
    fn c_type() -> String {
        format!("{}*", T::c_type())
    }
}

/// A struct that is passed to a kernel as its one argument.
///
/// # Safety
/// The type must be `#[repr(C)]` with only [`CField`] fields, declared through `kernel_params!`
/// (which also declares it to the kernels).
pub unsafe trait KernelParams: Copy {}

macro_rules! kernel_params {
    ($( $(#[$m:meta])* $name:ident [$($k:literal),+] { $( $(#[$fm:meta])* $f:ident : $t:ty ),* $(,)? } )*) => {
        $(
            $(#[$m])*
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub struct $name { $( $(#[$fm])* pub $f: $t ),* }
            // SAFETY: repr(C), CField fields only, declared to the kernels by c_decls.
            unsafe impl KernelParams for $name {}
        )*
        /// The C declarations of every params struct, for the kernel source.
        pub fn c_decls() -> String {
            let mut s = String::from("// ---- kernel params (src/cuda/params.rs) ----\n");
            $(
                s.push_str(concat!("struct ", stringify!($name), " {"));
                $( s.push_str(&format!(" {} {};", <$t as CField>::c_type(), stringify!($f))); )*
                s.push_str(" };\n");
            )*
            s
        }
        /// Each kernel that takes a params struct, with the struct's size in bytes (the one
        /// `.param` its PTX entry must declare: tests/cuda_compile.rs checks).
        pub fn kernels() -> Vec<(&'static str, usize)> {
            vec![$( $( ($k, std::mem::size_of::<$name>()) ),+ ),*]
        }
    };
}

kernel_params! {
    /// `rms_norm`: y[r, :] = x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w, rows of `d` (y may be x).
    RmsNormParams ["rms_norm"] { x: In<f32>, w: In<f32>, y: Out<f32>, d: i32, eps: f32 }
    /// `silu_mul`: h[i] = silu(g[i]) · u[i] for i < n.
    SiluMulParams ["silu_mul"] { g: In<f32>, u: In<f32>, h: Out<f32>, n: i32 }
    /// `silu_mul_pairs`: h[k, i] = silu(gu[2k, i]) · gu[2k+1, i] for i < n, k < pairs.
    SiluMulPairsParams ["silu_mul_pairs"] { gu: In<f32>, h: Out<f32>, n: i32, pairs: i32 }
    /// `add_inplace`: x[i] += y[i] for i < n.
    AddParams ["add_inplace"] { x: Out<f32>, y: In<f32>, n: i32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C side sees the Rust fields in order with the C type of each Rust type.
    #[test]
    fn c_decls_declare_each_struct_in_field_order() {
        let d = c_decls();
        assert!(
            d.contains("struct RmsNormParams { const float* x; const float* w; float* y; int d; float eps; };"),
            "{d}"
        );
        assert!(d.contains("struct SiluMulPairsParams { const float* gu; float* h; int n; int pairs; };"), "{d}");
    }

    /// Rust lays the structs out as C does: pointers 8 bytes, then 4-byte fields.
    #[test]
    fn layouts_are_the_c_layouts() {
        assert_eq!(std::mem::size_of::<RmsNormParams>(), 8 * 3 + 4 + 4);
        assert_eq!(std::mem::offset_of!(RmsNormParams, d), 24);
        assert_eq!(std::mem::size_of::<SiluMulPairsParams>(), 8 * 2 + 4 + 4);
    }
}
