//! Which GPU kernel a convolution or matrix product takes on a cubecl device, chosen by rule
//! instead of by timing candidates.
//!
//! Why: Burn's `autotune` times every candidate kernel the first time it meets a shape, and
//! every candidate is compiled first (NVRTC on CUDA). ResNet-50's training step at batch 32
//! made 129 decisions of about 18 candidates each on a fresh H200, and after 750 s it had not
//! run its first step (`../shared/gpu/`). Here the kernel is a function of the operation, the
//! geometry and what the device can do (tensor-core instructions, TMA): no timing, no batch
//! size in the choice, so a last partial batch or another validation batch takes the same
//! kernels, and a new GPU compiles only the kernels it runs.
//!
//! The rules come from the decisions autotune took on an NVIDIA H200 (sm_90) for ResNet-50
//! (`shared/gpu/h200-resnet50-train-b32-minimal-*.jsonl`, 129 decisions):
//! - forward: the implicit GEMM with TMA loads and MMA tiles (`simple_tma_mma`) won 17 of 21
//!   convolution shapes; a 1x1 that reduces channels fourfold or more tied or lost to it as one
//!   matrix product (`conv_im2col_1x1`: 1526->611 and 3815->611); the 3-channel stem, whose rows
//!   are too short for TMA's 16-byte alignment, took the asynchronous copy (`simple_async_mma`);
//! - input gradient: a 1x1 with stride 1 as one matrix product (`dgrad_im2col_1x1`, 6 of 7); 3x3
//!   with stride 1 the synchronous implicit GEMM (`simple_sync_mma`/`cmma` within 10% of each
//!   other); strided ones (which the implicit GEMM refuses; Burn's own `dgrad_im2col` is
//!   private to burn-cubecl) as col2im (`col2im.rs`): Burn's fallback, a transposed
//!   convolution, took col2im on every one of its 10 decisions, 2-4.9x faster than direct;
//! - weight gradient: a 1x1 with stride 1 as one matrix product (`wgrad_im2col_1x1`, 6 of 6),
//!   anything else `simple_tma_mma` (4 of 5).
//!
//! One rule does not come from those decisions (autotune had not reached those shapes): a
//! weight gradient over at least [`PER_IMAGE_MIN_POSITIONS`] output positions per image runs as
//! one matrix product per image, summed ([`ConvKernel::PerImage`], `per_image.rs`). Every cubek
//! kernel walks the gradient's whole sum over images and positions inside each cube, and the
//! result of a weight gradient has few tiles: ResNet-50's first stage at batch 32 sums 100,352
//! terms per weight in a few dozen cubes. Cut by image it fills the GPU (split-K). Not yet
//! measured on a GPU (docs/benchmarks/gpu.md).
//!
//! Devices without TMA take the asynchronous-copy MMA kernels, devices with only cooperative
//! matrices (CMMA: Vulkan's `VK_KHR_cooperative_matrix`, AMD) the CMMA ones, and devices with
//! neither (Mesa lavapipe, older GPUs) Burn's direct kernels and the plain tiled matrix product.
//! Each choice is a list: a kernel whose setup declines the problem (alignment, shared memory)
//! hands it to the next, and the last is always one that runs everywhere.
//!
//! This module is plain data and rules, testable without a GPU; `cube.rs` launches the kernels.

use crate::weight_grad::ConvShape;

/// The three passes of a convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvOp {
    Forward,
    InputGrad,
    WeightGrad,
}

/// How an implicit-GEMM kernel reads its operands (cubek's `ConvAlgorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Loading {
    /// Synchronous loads through shared memory.
    Sync,
    /// Asynchronous copies (`cp.async`, sm_80 and later).
    Async,
    /// The Tensor Memory Accelerator (sm_90 and later).
    Tma,
}

/// Which tensor-core instruction an implicit-GEMM kernel's tiles use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tile {
    /// Cooperative matrices (`wmma`, Vulkan cooperative matrix).
    Cmma,
    /// Manual MMA (`mma.sync`, with its own data movement).
    Mma,
}

/// A kernel for one convolution pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvKernel {
    /// cubek's implicit GEMM (the convolution as a matrix product whose operands are gathered
    /// from the image on the fly).
    ImplicitGemm(Loading, Tile),
    /// A 1x1 convolution with stride 1 and no padding as one matrix product over the channels
    /// (the batched product of the weight and each image's `[C, H·W]` plane).
    Pointwise,
    /// A strided input gradient as `Wᵀ · dY` and each kernel offset's columns added into the
    /// image (col2im): `col2im.rs`. Input gradients only.
    Col2Im,
    /// The weight gradient as one matrix product per image (over the input's columns), the
    /// images' results summed: `per_image.rs`. Weight gradients only.
    PerImage,
    /// Burn's direct kernels (forward) and fallbacks (gradients): run on every device.
    Direct,
}

impl ConvKernel {
    /// A short name for logs and reports (cubek's names for the implicit GEMMs).
    pub fn label(self) -> &'static str {
        use Loading::*;
        use Tile::*;
        match self {
            ConvKernel::ImplicitGemm(Sync, Cmma) => "simple_sync_cmma",
            ConvKernel::ImplicitGemm(Sync, Mma) => "simple_sync_mma",
            ConvKernel::ImplicitGemm(Async, Cmma) => "simple_async_cmma",
            ConvKernel::ImplicitGemm(Async, Mma) => "simple_async_mma",
            ConvKernel::ImplicitGemm(Tma, Cmma) => "simple_tma_cmma",
            ConvKernel::ImplicitGemm(Tma, Mma) => "simple_tma_mma",
            ConvKernel::Pointwise => "pointwise_matmul",
            ConvKernel::Col2Im => "col2im",
            ConvKernel::PerImage => "per_image_products",
            ConvKernel::Direct => "direct",
        }
    }
}

/// What a device can run, as the rules need it (read from cubecl's `DeviceProperties`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Caps {
    /// Manual MMA instructions for this element type (NVIDIA sm_80 and later).
    pub mma: bool,
    /// Cooperative-matrix instructions for this element type.
    pub cmma: bool,
    /// Tensor Memory Accelerator loads.
    pub tma: bool,
    /// Asynchronous global-to-shared copies.
    pub copy_async: bool,
}

/// The output positions per image (`Ho·Wo`) from which a weight gradient runs as one product per
/// image ([`ConvKernel::PerImage`]): 28x28, ResNet-50's second stage at 224 pixels. There each
/// image's product is a sum of 784 terms per weight, about 25 of cubek's steps of 32, against
/// 784 steps for the whole batch of 32 in one kernel; below it the partial results to sum
/// (`N × Co × Ci·kh·kw`) weigh more against the products, and a batch's sum is short anyway
/// (ResNet-50's third stage: 196 steps at batch 32). A property of the layer, not of the batch.
pub const PER_IMAGE_MIN_POSITIONS: usize = 784;

/// Whether weight gradients may run as products per image ([`ConvKernel::PerImage`]): yes
/// unless `HEARTH_PER_IMAGE=0` (read once per process), which keeps each one in a single
/// kernel, to compare the two on a GPU (`scripts/gpu_check.sh`).
pub fn per_image_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("HEARTH_PER_IMAGE").map_or(true, |v| v.trim() != "0"))
}

/// Whether `s` is a 1x1 convolution with stride 1, no padding and no dilation: one matrix
/// product over the channels.
pub fn is_pointwise(s: &ConvShape) -> bool {
    s.kernel == [1, 1] && s.stride == [1, 1] && s.padding == [0, 0] && s.dilation == [1, 1]
}

/// The implicit GEMMs a device with `caps` runs, best first (by the H200's decisions: TMA, then
/// asynchronous copies, then synchronous loads; MMA before CMMA where both exist).
fn implicit_gemms(caps: Caps) -> Vec<ConvKernel> {
    let mut out = Vec::new();
    let tiles: &[Tile] = match (caps.mma, caps.cmma) {
        (true, true) => &[Tile::Mma, Tile::Cmma],
        (true, false) => &[Tile::Mma],
        (false, true) => &[Tile::Cmma],
        (false, false) => &[],
    };
    let mut loadings = Vec::new();
    if caps.tma {
        loadings.push(Loading::Tma);
    }
    if caps.copy_async {
        loadings.push(Loading::Async);
    }
    loadings.push(Loading::Sync);
    for &loading in &loadings {
        for &tile in tiles {
            out.push(ConvKernel::ImplicitGemm(loading, tile));
        }
    }
    out
}

/// The kernels to try for `op` on a convolution of shape `s` (one group) whose operands are
/// `elem_bytes` wide, on a device with `caps`, in order: the first whose setup accepts the
/// problem runs. The batch size never enters the choice. Never empty; ends with
/// [`ConvKernel::Direct`], which runs everywhere.
pub fn conv_kernels(op: ConvOp, s: &ConvShape, elem_bytes: usize, caps: Caps) -> Vec<ConvKernel> {
    let gemms = implicit_gemms(caps);
    let pointwise = is_pointwise(s);
    let [ci, co] = [s.input[1], s.out_channels];
    let mut out = Vec::new();
    match op {
        ConvOp::Forward => {
            // A 1x1 that reduces the channels fourfold or more: one matrix product tied or
            // beat the implicit GEMM on the H200 (1526->611, 3815->611).
            if pointwise && (gemms.is_empty() || ci >= 4 * co) {
                out.push(ConvKernel::Pointwise);
            }
            // Rows of fewer than 16 bytes (the 3-channel stem) are too short for TMA.
            let tma_rows = (ci * elem_bytes).is_multiple_of(16);
            out.extend(
                gemms.iter().copied().filter(|k| {
                    tma_rows || !matches!(k, ConvKernel::ImplicitGemm(Loading::Tma, _))
                }),
            );
            if pointwise {
                out.push(ConvKernel::Pointwise);
            }
        }
        ConvOp::InputGrad => {
            if pointwise {
                out.push(ConvKernel::Pointwise);
            }
            // cubek's implicit GEMM for the input gradient takes stride 1 only, and its TMA
            // variant is not implemented (burn-cubecl notes it always errors).
            if s.stride == [1, 1] {
                out.extend(gemms.iter().copied().filter(|k| {
                    matches!(
                        k,
                        ConvKernel::ImplicitGemm(Loading::Sync | Loading::Async, _)
                    )
                }));
            } else {
                out.push(ConvKernel::Col2Im);
            }
        }
        ConvOp::WeightGrad => {
            let positions = s.output().map_or(0, |[_, _, h, w]| h * w);
            if positions >= PER_IMAGE_MIN_POSITIONS && per_image_enabled() {
                out.push(ConvKernel::PerImage);
            }
            if pointwise {
                out.push(ConvKernel::Pointwise);
            }
            out.extend(gemms);
        }
    }
    out.push(ConvKernel::Direct);
    let mut seen = Vec::with_capacity(out.len());
    out.retain(|k| {
        let new = !seen.contains(k);
        seen.push(*k);
        new
    });
    out
}

/// How kernels are chosen on cubecl devices: by these rules (the default), or by Burn's
/// autotune, which times every candidate on each new shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Selection {
    /// By rule: nothing timed; only the kernels that run are compiled.
    #[default]
    Rules,
    /// Burn's autotune: each new shape's candidates compiled and timed (minutes on a new GPU),
    /// its decisions kept in cubecl's cache.
    Autotune,
}

impl Selection {
    /// The value's name, as `--autotune` and `HEARTH_AUTOTUNE` spell it.
    pub fn name(self) -> &'static str {
        match self {
            Selection::Rules => "off",
            Selection::Autotune => "full",
        }
    }

    /// Parses `off` (also `rules`, `0`) or `full` (also `on`, `1`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "off" | "rules" | "0" | "false" => Some(Selection::Rules),
            "full" | "on" | "1" | "true" => Some(Selection::Autotune),
            _ => None,
        }
    }
}

static SELECTION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Sets how this process chooses GPU kernels from now on (Hearth's convolutions and linear
/// layers; Burn's own modules always autotune).
pub fn set_selection(selection: Selection) {
    let v = match selection {
        Selection::Rules => 1,
        Selection::Autotune => 2,
    };
    SELECTION.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// How this process chooses GPU kernels: what [`set_selection`] set, else `HEARTH_AUTOTUNE`
/// (`off` or `full`), else [`Selection::Rules`]. An unreadable variable counts as unset here;
/// the command line refuses it by name before anything runs.
pub fn selection() -> Selection {
    match SELECTION.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Selection::Rules,
        2 => Selection::Autotune,
        _ => std::env::var("HEARTH_AUTOTUNE")
            .ok()
            .and_then(|v| Selection::parse(&v))
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(ci: usize, co: usize, k: usize, stride: usize, pad: usize, hw: usize) -> ConvShape {
        ConvShape {
            input: [32, ci, hw, hw],
            out_channels: co,
            kernel: [k, k],
            stride: [stride, stride],
            padding: [pad, pad],
            dilation: [1, 1],
        }
    }

    const H200: Caps = Caps {
        mma: true,
        cmma: true,
        tma: true,
        copy_async: true,
    };
    const LAVAPIPE: Caps = Caps {
        mma: false,
        cmma: false,
        tma: false,
        copy_async: false,
    };

    #[test]
    fn the_h200_choices_follow_its_autotune_decisions() {
        use ConvKernel::*;
        let tma_mma = ImplicitGemm(Loading::Tma, Tile::Mma);
        // ResNet-50's 3x3 and expanding 1x1: simple_tma_mma first.
        for s in [shape(64, 64, 3, 1, 1, 56), shape(64, 256, 1, 1, 0, 56)] {
            assert_eq!(
                conv_kernels(ConvOp::Forward, &s, 4, H200)[0],
                tma_mma,
                "{s:?}"
            );
        }
        // 1024->256 1x1: the matrix product first, the implicit GEMM next.
        let reduce = conv_kernels(ConvOp::Forward, &shape(1024, 256, 1, 1, 0, 14), 4, H200);
        assert_eq!(&reduce[..2], &[Pointwise, tma_mma]);
        // The stem (3 channels: 12-byte rows) skips TMA.
        let stem = conv_kernels(ConvOp::Forward, &shape(3, 64, 7, 2, 3, 224), 4, H200);
        assert_eq!(stem[0], ImplicitGemm(Loading::Async, Tile::Mma));
        assert!(
            !stem
                .iter()
                .any(|k| matches!(k, ImplicitGemm(Loading::Tma, _)))
        );
        // Gradients of a 1x1: one matrix product (the weight gradient's one per image first,
        // at 56x56).
        let p = shape(256, 64, 1, 1, 0, 56);
        assert_eq!(conv_kernels(ConvOp::InputGrad, &p, 4, H200)[0], Pointwise);
        assert_eq!(
            &conv_kernels(ConvOp::WeightGrad, &p, 4, H200)[..2],
            &[PerImage, Pointwise]
        );
        // A strided 3x3's input gradient: no implicit GEMM (stride 1 only), col2im, then
        // Burn's direct fallback.
        let strided = shape(128, 128, 3, 2, 1, 56);
        assert_eq!(
            conv_kernels(ConvOp::InputGrad, &strided, 4, H200),
            vec![Col2Im, Direct]
        );
        assert_eq!(
            conv_kernels(ConvOp::InputGrad, &strided, 4, LAVAPIPE),
            vec![Col2Im, Direct]
        );
        for op in [ConvOp::Forward, ConvOp::WeightGrad] {
            assert!(!conv_kernels(op, &strided, 4, H200).contains(&Col2Im));
        }
        assert_eq!(
            &conv_kernels(ConvOp::WeightGrad, &strided, 4, H200)[..2],
            &[PerImage, tma_mma]
        );
        // The input gradient never tries TMA (not implemented in cubek's dgrad).
        let k3 = conv_kernels(ConvOp::InputGrad, &shape(64, 64, 3, 1, 1, 56), 4, H200);
        assert_eq!(k3[0], ImplicitGemm(Loading::Async, Tile::Mma));
        assert!(
            !k3.iter()
                .any(|k| matches!(k, ImplicitGemm(Loading::Tma, _)))
        );
    }

    #[test]
    fn every_list_ends_with_the_kernel_that_runs_everywhere_and_repeats_nothing() {
        for caps in [
            H200,
            LAVAPIPE,
            Caps {
                cmma: true,
                ..LAVAPIPE
            },
        ] {
            for op in [ConvOp::Forward, ConvOp::InputGrad, ConvOp::WeightGrad] {
                for s in [
                    shape(3, 64, 7, 2, 3, 224),
                    shape(64, 64, 1, 1, 0, 56),
                    shape(256, 64, 1, 1, 0, 56),
                    shape(256, 512, 1, 2, 0, 56),
                    shape(512, 512, 3, 1, 1, 14),
                ] {
                    let list = conv_kernels(op, &s, 4, caps);
                    assert_eq!(list.last(), Some(&ConvKernel::Direct), "{op:?} {s:?}");
                    for (i, k) in list.iter().enumerate() {
                        assert!(!list[i + 1..].contains(k), "{k:?} twice in {list:?}");
                    }
                    // Nothing the device lacks.
                    for k in &list {
                        if let ConvKernel::ImplicitGemm(loading, tile) = k {
                            assert!(caps.mma || *tile != Tile::Mma, "{k:?} on {caps:?}");
                            assert!(caps.cmma || *tile != Tile::Cmma, "{k:?} on {caps:?}");
                            assert!(caps.tma || *loading != Loading::Tma, "{k:?} on {caps:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn without_tensor_cores_only_direct_kernels_and_the_plain_product() {
        let s = shape(64, 256, 1, 1, 0, 56);
        assert_eq!(
            conv_kernels(ConvOp::Forward, &s, 4, LAVAPIPE),
            vec![ConvKernel::Pointwise, ConvKernel::Direct]
        );
        let s3 = shape(64, 64, 3, 1, 1, 56);
        for op in [ConvOp::Forward, ConvOp::InputGrad] {
            assert_eq!(conv_kernels(op, &s3, 4, LAVAPIPE), vec![ConvKernel::Direct]);
        }
        assert_eq!(
            conv_kernels(ConvOp::WeightGrad, &s3, 4, LAVAPIPE),
            vec![ConvKernel::PerImage, ConvKernel::Direct]
        );
        let small = shape(64, 64, 3, 1, 1, 14);
        assert_eq!(
            conv_kernels(ConvOp::WeightGrad, &small, 4, LAVAPIPE),
            vec![ConvKernel::Direct]
        );
    }

    #[test]
    fn weight_gradients_over_28x28_positions_or_more_run_as_products_per_image() {
        let per_image = |op, s: &ConvShape| conv_kernels(op, s, 4, H200)[0] == ConvKernel::PerImage;
        // ResNet-50 at 224 pixels: the stem (112x112 out), stages 1 and 2 (56x56, 28x28,
        // including the stride-2 3x3 and shortcut that make 28x28), not stages 3 and 4.
        for s in [
            shape(3, 64, 7, 2, 3, 224),
            shape(64, 64, 3, 1, 1, 56),
            shape(64, 256, 1, 1, 0, 56),
            shape(128, 128, 3, 2, 1, 56),
            shape(256, 512, 1, 2, 0, 56),
            shape(128, 128, 3, 1, 1, 28),
        ] {
            assert!(per_image(ConvOp::WeightGrad, &s), "{s:?}");
            // Never for the other passes, whose sums run over channels and offsets only.
            assert!(!per_image(ConvOp::Forward, &s), "{s:?}");
            assert!(!per_image(ConvOp::InputGrad, &s), "{s:?}");
        }
        for s in [
            shape(256, 256, 3, 2, 1, 28),
            shape(256, 256, 3, 1, 1, 14),
            shape(512, 2048, 1, 1, 0, 7),
        ] {
            assert!(!per_image(ConvOp::WeightGrad, &s), "{s:?}");
        }
    }

    #[test]
    fn the_batch_size_never_changes_the_choice() {
        let caps_list = [H200, LAVAPIPE];
        for caps in caps_list {
            for op in [ConvOp::Forward, ConvOp::InputGrad, ConvOp::WeightGrad] {
                let mut a = shape(256, 64, 1, 1, 0, 56);
                let mut b = a;
                a.input[0] = 32;
                b.input[0] = 7;
                assert_eq!(conv_kernels(op, &a, 4, caps), conv_kernels(op, &b, 4, caps));
            }
        }
    }

    #[test]
    fn selection_names_round_trip() {
        for s in [Selection::Rules, Selection::Autotune] {
            assert_eq!(Selection::parse(s.name()), Some(s));
        }
        assert_eq!(Selection::parse("sometimes"), None);
        assert_eq!(Selection::default(), Selection::Rules);
    }
}
