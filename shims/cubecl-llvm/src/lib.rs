//! Hearth's stand-in for cubecl-llvm 0.11.3: the types cubecl-cuda names, and no LLVM.
//!
//! cubecl-cuda 0.11.3 always depends on cubecl-llvm, whose PTX compiler (pliron lowered through
//! LLVM) is one of the two it can run. Hearth's `cuda` feature runs the other one, NVRTC on
//! CUDA C++ (cubecl-cuda's `cpp` feature), so LLVM was linked and never called: 46 MB of the
//! stripped `hearth` binary, LLVM's static libraries to install before building
//! (`tracel-llvm-bundler` downloads them) and a C++ build step. The workspace's
//! `[patch.crates-io]` puts this crate in its place.
//!
//! What cubecl-cuda uses, and what this crate gives it:
//! - [`nvptx::ptx_version::PtxVersion`]: the newest PTX ISA version a driver loads. cubecl-cuda
//!   reads it for every device, and keys the LLVM backend's kernel cache with it; the table
//!   below is NVIDIA's (each CUDA release's PTX ISA version).
//! - [`shared::lowered_features::restrict_features`]: narrows a device's features to what
//!   LLVM's backend lowers. cubecl-cuda calls it only when that backend compiles, which never
//!   happens here; it leaves the features as they are.
//! - [`PlironCompiler`] and its options and artifacts: the LLVM backend itself. Its
//!   [`Compiler::compile`] refuses every kernel, naming why, so a build that selects it
//!   (cubecl-cuda without its `cpp` feature) fails at its first kernel with that message
//!   instead of running anything.
//!
//! This is not a copy of cubecl-llvm: nothing here compiles a kernel.

use cubecl_core::ir::nvidia::SmArch;
use cubecl_core::prelude::KernelDefinition;
use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::{CompilationError, Compiler};
use cubecl_runtime::kernel::BufferIOAttr;

/// PTX ISA versions.
pub mod nvptx {
    /// The PTX ISA version a CUDA driver loads.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, as major * 10 + minor (`87` is PTX 8.7).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest PTX ISA version a driver of this CUDA version (as
            /// `cuDriverGetVersion` gives it: 12080 is CUDA 12.8) loads, or `None` for a driver
            /// older than CUDA 10.
            pub fn for_driver(driver: i32) -> Option<Self> {
                DRIVER_PTX
                    .iter()
                    .find(|(first, _)| driver >= *first)
                    .map(|&(_, ptx)| Self(ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }

        /// The first driver of each CUDA release and its PTX ISA version, newest first (NVIDIA's
        /// PTX ISA release notes). CUDA 12.6 brought no new version (12.5's 8.5 stays).
        const DRIVER_PTX: &[(i32, u32)] = &[
            (13030, 93),
            (13020, 92),
            (13010, 91),
            (13000, 90),
            (12090, 88),
            (12080, 87),
            (12050, 85),
            (12040, 84),
            (12030, 83),
            (12020, 82),
            (12010, 81),
            (12000, 80),
            (11080, 78),
            (11070, 77),
            (11060, 76),
            (11050, 75),
            (11040, 74),
            (11030, 73),
            (11020, 72),
            (11010, 71),
            (11000, 70),
            (10020, 65),
            (10010, 64),
            (10000, 63),
        ];

        #[cfg(test)]
        mod tests {
            use super::PtxVersion;

            #[test]
            fn a_driver_gets_the_newest_version_it_loads() {
                assert_eq!(PtxVersion::for_driver(13000), Some(PtxVersion(90)));
                assert_eq!(PtxVersion::for_driver(12060), Some(PtxVersion(85)));
                assert_eq!(PtxVersion::for_driver(12079), Some(PtxVersion(85)));
                assert_eq!(PtxVersion::for_driver(99999), Some(PtxVersion(93)));
                assert_eq!(PtxVersion::for_driver(9020), None);
                assert_eq!(PtxVersion(87).to_string(), "ptx87");
            }
        }
    }
}

/// What the LLVM backend would lower.
pub mod shared {
    /// Device features the LLVM backend can honour.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// The LLVM backend's GPU targets.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA PTX.
            Nvptx,
        }

        /// Would narrow `props` to what LLVM's backend lowers for `target`. cubecl-cuda calls it
        /// only when that backend is the one compiling, and in this build it compiles nothing
        /// ([`crate::PlironCompiler`] refuses every kernel), so the features stay as they are.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// The LLVM backend's targets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// NVIDIA PTX, the only one cubecl-cuda asks for.
    #[default]
    Nvptx,
}

/// The LLVM backend's compiler: refuses every kernel in this build.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The target it would compile for.
    pub target: LlvmTarget,
}

/// The LLVM backend's options, as cubecl-cuda fills them in.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// An AMD GPU's architecture (never one here).
    pub arch: Option<cubecl_core::ir::amd::GfxArch>,
    /// The NVIDIA GPU's architecture.
    pub sm_arch: Option<SmArch>,
    /// The PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Whether scalars go in the kernel's parameter block.
    pub grid_constants: bool,
}

/// A PTX module the LLVM backend would have made. Never made in this build.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// The IR, for logs and cache keys.
    pub ir: String,
    /// Shared memory a launch reserves, in bytes.
    pub shared_memory_size: usize,
    /// What the kernel does with each buffer, in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What the LLVM backend would have made.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// A PTX module.
    NvptxCode(NvptxModule),
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
        }
    }
}

/// Why [`PlironCompiler`] refuses: the message every kernel fails with.
pub const NOT_LINKED: &str = "cubecl's LLVM backend is not linked into this build: Hearth's \
     `cuda` feature compiles kernels with NVRTC (cubecl-cuda's `cpp` feature), and the workspace \
     replaces cubecl-llvm with shims/cubecl-llvm, which compiles nothing";

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: NOT_LINKED.to_string(),
            backtrace: BackTrace::capture(),
        })
    }

    fn buffer_io(repr: &Self::Representation) -> Option<Vec<BufferIOAttr>> {
        match repr {
            PlironArtifact::NvptxCode(module) => Some(module.io.clone()),
        }
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}
