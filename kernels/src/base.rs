//! What every kernel module shares: the switches (`HEARTH_FAST_KERNELS`, the device kinds),
//! Flex tensors from raw values, the parallel loop over planes, and the GEMM call and output
//! pointer the convolutions share (`conv.rs`, `winograd.rs`).

use std::sync::OnceLock;

use burn::nn::PaddingConfig2d;
use burn::prelude::*;

use crate::select;

/// A contiguous Flex f32 tensor of `dims` holding `values` (the raw kernels' outputs).
pub(crate) fn f32_tensor(values: Vec<f32>, dims: Vec<usize>) -> burn_flex::FlexTensor {
    burn_flex::FlexTensor::new(
        burn::tensor::Bytes::from_elems(values),
        burn_flex::Layout::contiguous(burn::tensor::Shape::from(dims)),
        burn::tensor::DType::F32,
    )
}

/// `len` values written plane by plane in parallel (planes of `plane` values), without first
/// zeroing them: `fill(i, values)` writes plane `i`. A kernel's output written once skips a
/// pass over memory that `vec![0.0; len]` costs (a memset, or the kernel clearing fresh pages).
///
/// # Safety
/// `fill` must write every element of every plane it is given; `len` must be a multiple of
/// `plane` (or 0).
pub(crate) unsafe fn par_planes(
    len: usize,
    plane: usize,
    fill: impl Fn(usize, &mut [std::mem::MaybeUninit<f32>]) + Sync + Send,
) -> Vec<f32> {
    use rayon::prelude::*;
    let mut values = Vec::<f32>::with_capacity(len);
    if len > 0 {
        assert!(
            plane > 0 && len.is_multiple_of(plane),
            "{len} values in planes of {plane}"
        );
        values.spare_capacity_mut()[..len]
            .par_chunks_mut(plane)
            .enumerate()
            .for_each(|(i, p)| fill(i, p));
    }
    // SAFETY: the caller's `fill` wrote all `len` values (a panic in it never gets here).
    unsafe { values.set_len(len) };
    values
}

/// `len` values that `fill` writes through the pointer it is given, without first zeroing
/// them: a GEMM's or a transform's output that covers every value skips the pass over memory
/// `vec![0.0; len]` costs (a memset, or the kernel clearing fresh pages; together 1-2% of
/// DenseNet-121's training step).
///
/// # Safety
/// `fill` must write every one of the `len` values (through raw pointers or `MaybeUninit`,
/// never reading them first) before it returns.
pub(crate) unsafe fn written_by(len: usize, fill: impl FnOnce(Out)) -> Vec<f32> {
    let mut values = Vec::<f32>::with_capacity(len);
    fill(Out(values.as_mut_ptr()));
    // SAFETY: the caller's `fill` wrote all `len` values (a panic in it never gets here).
    unsafe { values.set_len(len) };
    values
}

/// The vector width the hand-written loops (batch norm, Winograd's transforms) are compiled
/// for, picked at run time: the crate itself is built for the baseline x86-64 (SSE2, 4 lanes).
/// Every width gives the same bits (no fused multiply-adds, the same order of additions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    /// AVX-512F (16 lanes); only with this crate's `avx512` feature, as gemm's kernels.
    Avx512,
    /// AVX2 (8 lanes).
    Avx2,
    /// The build's baseline.
    Base,
}

/// The widest [`Width`] this CPU and build allow, detected once.
pub(crate) fn vector_width() -> Width {
    #[cfg(test)]
    if let Some(w) = tests::forced() {
        return w;
    }
    static W: OnceLock<Width> = OnceLock::new();
    *W.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
                return Width::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Width::Avx2;
            }
        }
        Width::Base
    })
}

/// Runs `f` compiled for the vector width `w`: an `#[inline(always)]` closure is compiled
/// into the function picked here, so its loops use that width (the crate itself is built for
/// the baseline x86-64, SSE2).
#[inline(always)]
pub(crate) fn on_width<R>(w: Width, f: impl FnOnce() -> R) -> R {
    match w {
        // SAFETY: `vector_width` saw the CPU's features.
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { with_avx512(f) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { with_avx2(f) },
        _ => f(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Whether the fast paths are allowed (`HEARTH_FAST_KERNELS`, read once; anything but `0`,
/// `false` or `off` means yes).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HEARTH_FAST_KERNELS")
            .map(|v| !matches!(v.trim(), "0" | "false" | "off"))
            .unwrap_or(true)
    })
}

/// Whether 3x3 stride-1 convolutions run by Winograd's F(2x2, 3x3) (`crate::winograd`) on
/// the fast paths, their forward and their weight gradient (`HEARTH_WINOGRAD`, read once; `0`,
/// `false` or `off` keeps im2col's GEMM forward and the shifted or im2col weight gradient).
pub fn winograd_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HEARTH_WINOGRAD")
            .map(|v| !matches!(v.trim(), "0" | "false" | "off"))
            .unwrap_or(true)
    })
}

/// Makes the calling thread the first of the threads of rayon's global pool, as a program's
/// main thread before any parallel work; `false` where it does not (`HEARTH_JOIN_POOL=0`,
/// fewer than 2 threads, or the global pool was already built).
///
/// Why: every parallel kernel (ours, gemm's, Burn Flex's) forks onto the global pool and joins.
/// Called from a thread outside the pool, each op injects its job, wakes the workers and puts
/// the caller to sleep until they finish: a sleep and a wake-up per op, and between ops three
/// threads (the caller and two spinning workers) on two cores. From a thread of the pool, an
/// op's pieces go on its own queue and it works on them itself, the other threads stealing.
/// The pool keeps its size (`RAYON_NUM_THREADS`, else one per core), the calling thread now
/// one of them. Measured on 2 cores (AMD EPYC Zen 5): docs/benchmarks/cpu-models.md, "the main thread in the
/// pool".
///
/// The calling thread keeps its identity, so Burn's `RunningState` (batch norm's running
/// statistics, kept per thread and averaged over threads) sees the same thread as without it;
/// running the steps on the pool's other threads instead changed them. With one thread the
/// pool would have no thread of its own left for work that other threads hand it while this
/// one waits on them, so it is not done then.
pub fn join_global_pool() -> bool {
    let off =
        std::env::var("HEARTH_JOIN_POOL").is_ok_and(|v| matches!(v.trim(), "0" | "false" | "off"));
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1);
    if off || threads < 2 {
        return false;
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build_global()
        .is_ok()
}

/// Whether `device` computes on the CPU (the fast paths are measured there only).
pub fn is_cpu(device: &Device) -> bool {
    is_flex(device) || format!("{:?}", device.clone().inner()).starts_with("NdArray")
}

/// Whether `device` runs through cubecl (wgpu, Vulkan, CUDA) in a build with the `cube`
/// feature: where [`crate::Path::Selected`] applies.
pub fn is_cube(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether Hearth's convolutions and linear layers on `device` take the kernels [`select`]
/// picks by rule: a cubecl device, the fast paths allowed, and `--autotune full` not asked for.
pub fn selects_gpu_kernels(device: &Device, allowed: bool) -> bool {
    allowed && is_cube(device) && select::selection() == select::Selection::Rules
}

/// Whether `device` is Burn Flex (with or without autodiff): the backend [`crate::ext`] extends.
pub fn is_flex(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// The symmetric padding `[rows, columns]` of `padding`, if it is symmetric and explicit.
pub(crate) fn symmetric(padding: &PaddingConfig2d) -> Option<[usize; 2]> {
    match *padding {
        PaddingConfig2d::Valid => Some([0, 0]),
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            Some([top, left])
        }
        _ => None,
    }
}

/// A tensor's values as the little-endian bytes a file stores, copied once, where it is a
/// contiguous tensor on Flex (with or without autodiff); `None` elsewhere (the caller reads it
/// as Burn does, `into_data`).
///
/// Why: Flex's `into_data` on a tensor that a module still holds copies its values into a byte
/// vector and then again into a block aligned to 16 bytes (`Bytes::from_bytes_vec`), so
/// writing a checkpoint held its largest tensor three times: VGG-16's 392 MiB classifier weight
/// lifted rank 0's peak by 784 MiB where one copy needs 392.
pub fn file_bytes<const D: usize>(t: &Tensor<D>) -> Option<burn::tensor::Bytes> {
    let flex = t
        .clone()
        .inner()
        .try_into_primitive::<burn::backend::Flex>()
        .ok()?;
    let len = flex.layout().num_elements() * flex.dtype().size();
    let plain = flex.is_contiguous() && flex.layout().start_offset() == 0;
    let bytes = flex.bytes();
    if !plain || bytes.len() < len {
        return None;
    }
    Some(burn::tensor::Bytes::from_elems(bytes[..len].to_vec()))
}

/// `dst[m, n] = a[m, k] · b[k, n]` (all row-major with the given row strides) on gemm's own
/// threads (`Rayon(0)`) or on the calling thread (`None`: the caller's threads split the work).
///
/// # Safety
/// Each pointer must cover its matrix as the sizes and row strides describe.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_rows(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    a: *const f32,
    a_cs: usize,
    a_rs: usize,
    b: *const f32,
    b_rs: usize,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            a,
            a_cs as isize,
            a_rs as isize,
            b,
            1,
            b_rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// A pointer to an output that parallel products write through, each its own elements.
#[derive(Clone, Copy)]
pub(crate) struct Out(pub(crate) *mut f32);
// SAFETY: shared only between products that write disjoint elements (see the callers).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer `at` values in (a method, so closures capture the whole `Out`).
    pub(crate) fn at(self, at: usize) -> *mut f32 {
        self.0.wrapping_add(at)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::Width;

    /// 0: none forced; else 1 + the index in `ALL`.
    static FORCED: AtomicU8 = AtomicU8::new(0);
    static FORCING: Mutex<()> = Mutex::new(());
    const ALL: [Width; 3] = [Width::Base, Width::Avx2, Width::Avx512];

    pub(super) fn forced() -> Option<Width> {
        match FORCED.load(Ordering::SeqCst) {
            0 => None,
            i => Some(ALL[i as usize - 1]),
        }
    }

    /// `f()` under every width this CPU has (the baseline first), one test at a time. Tests
    /// running beside it may see the forced width too: every width gives the same bits.
    pub(crate) fn under_each_width<R>(mut f: impl FnMut() -> R) -> Vec<(Width, R)> {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                FORCED.store(0, Ordering::SeqCst);
            }
        }
        let _one = FORCING.lock().unwrap_or_else(|e| e.into_inner());
        let _reset = Reset;
        FORCED.store(0, Ordering::SeqCst);
        let widest = super::vector_width();
        let mut out = Vec::new();
        for (i, w) in ALL.into_iter().enumerate() {
            let has = match widest {
                Width::Avx512 => true,
                Width::Avx2 => w != Width::Avx512,
                Width::Base => w == Width::Base,
            };
            if has {
                FORCED.store(i as u8 + 1, Ordering::SeqCst);
                out.push((w, f()));
            }
        }
        out
    }
}
