//! Keeps all but LLVM's NVPTX back end out of the CUDA `hearth` binary.
//!
//! cubecl-cuda 0.11.3 always links cubecl-llvm, whose CPU JIT (`cubecl_llvm::cpu`, never used
//! here: Hearth's CPU backend is Flex) calls `LLVM_InitializeNativeTarget`. That symbol lives
//! in one object with `LLVM_InitializeAll*` (tracel-llvm-bundler's `wrappers/target.c`), so
//! linking it pulled every target LLVM was built with (20 in the PyPI build: X86, AArch64,
//! AMDGPU, RISC-V, ...) into the binary: 217 MB stripped. Defining those ten symbols here, in
//! the binary's own objects, means the linker never extracts that object, and no target but
//! NVPTX (which cubecl's PTX compiler initialises by name) is referenced.
//!
//! What changes: the `LLVM_InitializeAll*` functions set up NVPTX alone, and the native-target
//! ones report failure (LLVM's convention: non-zero), so cubecl's CPU JIT, were anything to
//! start it, would stop with its own error instead of running. Only the `hearth` binary gets
//! this; tests and benches keep the wrappers.

use std::os::raw::c_int;

unsafe extern "C" {
    fn LLVMInitializeNVPTXTargetInfo();
    fn LLVMInitializeNVPTXTarget();
    fn LLVMInitializeNVPTXTargetMC();
    fn LLVMInitializeNVPTXAsmPrinter();
}

#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllTargetInfos() {
    // SAFETY: LLVM's own initialiser, idempotent, no arguments.
    unsafe { LLVMInitializeNVPTXTargetInfo() }
}

#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllTargets() {
    // SAFETY: as above.
    unsafe { LLVMInitializeNVPTXTarget() }
}

#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllTargetMCs() {
    // SAFETY: as above.
    unsafe { LLVMInitializeNVPTXTargetMC() }
}

#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllAsmPrinters() {
    // SAFETY: as above.
    unsafe { LLVMInitializeNVPTXAsmPrinter() }
}

/// NVPTX has no assembly parser.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllAsmParsers() {}

/// NVPTX has no disassembler.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeAllDisassemblers() {}

/// No native target in this binary: failure.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeNativeTarget() -> c_int {
    1
}

/// No native target in this binary: failure.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeNativeAsmParser() -> c_int {
    1
}

/// No native target in this binary: failure.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeNativeAsmPrinter() -> c_int {
    1
}

/// No native target in this binary: failure.
#[unsafe(no_mangle)]
pub extern "C" fn LLVM_InitializeNativeDisassembler() -> c_int {
    1
}
