//! Fusion's fused reductions by rule: the routine each fused reduction runs, chosen from its
//! shape instead of timing candidates.
//!
//! Burn's fusion (`burn_cubecl_fusion`) fuses the element-wise work around a reduction (batch
//! norm's `(x - mean)²` before its sum, the scaling after it) into one kernel, and times three
//! routines for every new key: `fused_cube`, `fused_plane` and an unfused fallback. Its
//! broadcasted reductions time two more. The keys count the fused reads, writes and
//! operations without a bound, so they cannot be written into the cache beforehand as
//! [`crate::reduce_rules`] does for `reduce_dim`. The H200 run of 2026-11-27 took 7 such
//! decisions in its bundle (5 fused, 2 broadcasted), each compiling every candidate.
//!
//! Instead, [`install`] replaces fusion's `Reduce` optimization, at the start of the process
//! and before the first tensor on a cubecl device, by [`RuleReduce`]: the same fuser (so the
//! same operations fuse), whose fused operation launches one routine by rule:
//!
//! - `cube` (one cube per output, no plane operations: fusion's choice for fuse-on-write) for
//!   at most [`CUBE_MAX_OUTPUTS`] outputs. On the H200's five keys (64 outputs each) it had
//!   the lowest median on four and was 14% behind on the fifth (fused `plane` 62 µs, `cube`
//!   71 µs): 474 µs against the tuned picks' 471 summed over the five;
//! - `plane` (one plane per output) beyond, where the device has plane operations, else `unit`
//!   (one unit per output): cubecl's own priorities for many outputs.
//!
//! A reduction the fused routine refuses (an error before any launch) runs as the unfused
//! fallback, Burn's own order (element-wise read kernel, Burn's `reduce_dim`, element-wise
//! write kernel), from then on for that optimization. Fusion's broadcasted reductions are
//! removed: their segments fuse as a reduction plus element-wise kernels instead, which is
//! what their fallback runs (on the H200: 34 µs against its fused routine's 255 µs on one key,
//! 227 against 173 on the other).
//!
//! The fused operation's private fields are read through its serialized state (the same CBOR
//! Burn writes for execution plans) into [`Plan`]. Should that ever fail (a Burn upgrade that
//! renames a field), the optimization runs Burn's own code, autotune included: slower to
//! start, never wrong.

use std::sync::atomic::{AtomicBool, Ordering};

use burn_cubecl::CubeDevice;
use burn_cubecl::cubecl::client::Client;
use burn_cubecl::cubecl::features::Plane;
use burn_cubecl::fusion::{
    CubeFuser, CubeOptimization, FusedOperation, OptimizationProvider, RegistryError, register,
    remove,
};
use burn_cubecl_fusion::engine::launch::FuseTraceLauncher;
use burn_cubecl_fusion::engine::trace::FuseTrace;
use burn_cubecl_fusion::optim::elemwise::ElemwiseRunner;
use burn_cubecl_fusion::optim::reduce::{
    FusedReduce, FusedReduceLaunch, ReduceFuser, ReduceOptimization, ReduceOptimizationState,
    ReduceSettings,
};
use burn_cubecl_fusion::optim::{reduce, reduce_broadcasted};
use burn_cubecl_fusion::{CubeFusionHandle, FallbackOperation};
use burn_fusion::stream::Context;
use burn_fusion::{FuserProperties, FuserStatus, OperationFuser};
use burn_ir::{OperationIr, TensorId};
use cubek::reduce::launch::RoutineStrategy;
use cubek::reduce::routines::BlueprintStrategy;
use cubek::reduce::routines::cube::CubeStrategy;
use cubek::reduce::routines::plane::PlaneStrategy;
use cubek::reduce::routines::unit::UnitStrategy;
use serde::Deserialize;

/// The most outputs (vectors reduced) for which a fused reduction takes the `cube` routine.
pub const CUBE_MAX_OUTPUTS: usize = 64;

/// The name of Hearth's fused-reduction optimization (serialized execution plans name it).
pub const NAME: &str = "HearthReduce";

/// The routine a fused reduction takes by rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routine {
    /// One cube per output, without plane operations.
    Cube,
    /// One plane per output.
    Plane,
    /// One unit per output.
    Unit,
}

impl Routine {
    /// The rule: `cube` for at most [`CUBE_MAX_OUTPUTS`] outputs, else `plane` where the device
    /// has plane operations (`planes`), else `unit`.
    pub fn for_outputs(outputs: usize, planes: bool) -> Self {
        match (outputs <= CUBE_MAX_OUTPUTS, planes) {
            (true, _) => Self::Cube,
            (false, true) => Self::Plane,
            (false, false) => Self::Unit,
        }
    }

    fn strategy(self) -> RoutineStrategy {
        // The same settings as fusion's candidates of these names.
        match self {
            Self::Cube => RoutineStrategy::Cube(BlueprintStrategy::Inferred(CubeStrategy {
                use_planes: false,
            })),
            Self::Plane => RoutineStrategy::Plane(BlueprintStrategy::Inferred(PlaneStrategy {
                independent: true,
            })),
            Self::Unit => RoutineStrategy::Unit(BlueprintStrategy::Inferred(UnitStrategy)),
        }
    }
}

/// The number of outputs a reduction of `shape` along `axis` has (cubek's `vector_count`).
pub fn outputs(shape: &[usize], axis: usize) -> usize {
    shape
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != axis)
        .map(|(_, n)| *n)
        .product()
}

/// What [`install`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Installed {
    /// Fused reductions go by rule from now on, in this process.
    Now,
    /// An earlier call installed them.
    Already,
}

/// Why [`install`] could not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotInstalled {
    /// A cubecl device ran tensors before: fusion's optimizations are fixed for the process.
    FusionRunning,
    /// Burn refused the change (the message).
    Refused(String),
}

impl std::fmt::Display for NotInstalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::FusionRunning => write!(
                f,
                "a GPU device ran tensors before this one started, so fusion's optimizations \
                 were already fixed for this process"
            ),
            Self::Refused(why) => write!(f, "{why}"),
        }
    }
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Replaces fusion's `Reduce` and `ReduceBroadcasted` optimizations by [`RuleReduce`], for
/// every cubecl device of the process. Call before the first tensor on any cubecl device.
pub fn install() -> Result<Installed, NotInstalled> {
    if INSTALLED.load(Ordering::Acquire) {
        return Ok(Installed::Already);
    }
    let refused = |e: RegistryError| match e {
        RegistryError::ServiceRunning => NotInstalled::FusionRunning,
        other => NotInstalled::Refused(other.to_string()),
    };
    register(RuleReduceProvider).map_err(refused)?;
    remove(reduce::NAME).map_err(refused)?;
    remove(reduce_broadcasted::NAME).map_err(refused)?;
    INSTALLED.store(true, Ordering::Release);
    Ok(Installed::Now)
}

/// Whether [`install`] took effect in this process.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

/// Builds [`RuleReduceFuser`]s.
struct RuleReduceProvider;

impl OptimizationProvider for RuleReduceProvider {
    type Operation = RuleReduce;

    fn fuser(&self, device: &CubeDevice) -> CubeFuser {
        CubeFuser::new(RuleReduceFuser {
            inner: ReduceFuser::new(device.clone(), ReduceSettings::Always),
            device: device.clone(),
        })
    }
}

/// Fusion's reduction fuser, finishing into [`RuleReduce`].
struct RuleReduceFuser {
    inner: ReduceFuser,
    device: CubeDevice,
}

impl OperationFuser<CubeOptimization> for RuleReduceFuser {
    fn fuse(&mut self, operation: &OperationIr) {
        self.inner.fuse(operation)
    }

    fn finish(&mut self) -> CubeOptimization {
        // `ReduceFuser` finishes into fusion's own optimization; its state is all there is.
        let state: ReduceOptimizationState = self.inner.finish().to_state().decode();
        CubeOptimization::new(RuleReduce::from_state(&self.device, state))
    }

    fn reset(&mut self) {
        self.inner.reset()
    }

    fn status(&self) -> FuserStatus {
        self.inner.status()
    }

    fn properties(&self) -> FuserProperties {
        self.inner.properties()
    }

    fn len(&self) -> usize {
        OperationFuser::len(&self.inner)
    }

    fn clone_dyn(&self) -> Box<dyn OperationFuser<CubeOptimization>> {
        Box::new(Self {
            inner: self.inner.clone(),
            device: self.device.clone(),
        })
    }
}

/// The fields of fusion's reduction state that running it needs (its serialized names).
#[derive(Deserialize)]
struct PlanState {
    trace: FuseTrace,
    trace_read_fallback: FuseTrace,
    trace_write_fallback: FuseTrace,
    reduce: FusedReduce,
    len_read: usize,
}

/// The part of [`FusedReduce`] read here, from the same state.
#[derive(Deserialize)]
struct ReduceFields {
    reduce: FusedReduceFields,
}

#[derive(Deserialize)]
struct FusedReduceFields {
    op: ReduceOp,
}

#[derive(Deserialize)]
struct ReduceOp {
    input: TensorRef,
    axis: usize,
}

#[derive(Deserialize)]
struct TensorRef {
    id: TensorId,
}

/// How one fused reduction runs by rule.
pub struct Plan {
    state: PlanState,
    input: TensorId,
    axis: usize,
    planes: bool,
    /// The fused routine refused this reduction once: the fallback runs from then on.
    refused: bool,
}

impl Plan {
    /// Reads `state` (fusion's, through its serialized form).
    fn read(state: &ReduceOptimizationState, planes: bool) -> Result<Self, String> {
        let mut bytes = Vec::new();
        ciborium::into_writer(state, &mut bytes).map_err(|e| e.to_string())?;
        let plan: PlanState = ciborium::from_reader(bytes.as_slice()).map_err(|e| e.to_string())?;
        let fields: ReduceFields =
            ciborium::from_reader(bytes.as_slice()).map_err(|e| e.to_string())?;
        Ok(Self {
            state: plan,
            input: fields.reduce.op.input.id,
            axis: fields.reduce.op.axis,
            planes,
            refused: false,
        })
    }

    /// The routine for the reduction's input in `context`, or `None` for an empty input (no
    /// fused kernel takes one).
    fn routine(&self, context: &Context<CubeFusionHandle>) -> Option<Routine> {
        let shape = &context.tensors.get(&self.input)?.shape;
        if shape.num_elements() == 0 {
            return None;
        }
        Some(Routine::for_outputs(
            outputs(shape.as_slice(), self.axis),
            self.planes,
        ))
    }

    fn run(
        &mut self,
        client: &Client,
        device: &CubeDevice,
        context: &mut Context<CubeFusionHandle>,
        fallback: &dyn Fn(usize) -> Box<dyn FallbackOperation>,
    ) {
        if !self.refused
            && let Some(routine) = self.routine(context)
        {
            let launch = FusedReduceLaunch::new(&self.state.reduce, routine.strategy());
            match FuseTraceLauncher::new(&self.state.trace, &launch).launch(client, device, context)
            {
                Ok(_) => return,
                Err(_) => self.refused = true,
            }
        }
        // Burn's fallback, in Burn's order: the fused reads, the reduction, the fused writes.
        FuseTraceLauncher::new(&self.state.trace_read_fallback, &ElemwiseRunner)
            .launch(client, device, context)
            .expect("fusion's element-wise kernel before a reduction failed to launch");
        fallback(self.state.len_read).run(context);
        FuseTraceLauncher::new(&self.state.trace_write_fallback, &ElemwiseRunner)
            .launch(client, device, context)
            .expect("fusion's element-wise kernel after a reduction failed to launch");
    }
}

/// Fusion's reduction with its routine chosen by rule (see the module's documentation).
pub struct RuleReduce {
    inner: ReduceOptimization,
    device: CubeDevice,
    /// The device's client, looked up once (not at every launch).
    client: Client,
    /// `None` when fusion's state could not be read: [`Self::inner`] runs, with autotune.
    plan: Option<Plan>,
}

impl RuleReduce {
    /// Whether this reduction runs by rule (else Burn's autotuned code).
    pub fn by_rule(&self) -> bool {
        self.plan.is_some()
    }
}

impl FusedOperation for RuleReduce {
    const NAME: &'static str = NAME;
    type State = ReduceOptimizationState;

    fn num_ops_fused(&self) -> usize {
        self.inner.num_ops_fused()
    }

    fn max_relative_shape_id(&self) -> Option<usize> {
        FusedOperation::max_relative_shape_id(&self.inner)
    }

    fn run(
        &mut self,
        context: &mut Context<CubeFusionHandle>,
        fallback: &dyn Fn(usize) -> Box<dyn FallbackOperation>,
    ) {
        match &mut self.plan {
            Some(plan) => plan.run(&self.client, &self.device, context, fallback),
            None => self.inner.execute(context, fallback),
        }
    }

    fn to_state(&self) -> Self::State {
        self.inner.to_state()
    }

    fn from_state(device: &CubeDevice, state: Self::State) -> Self {
        let client = device.client();
        let planes = client.properties().features.plane.contains(Plane::Ops);
        let plan = Plan::read(&state, planes).ok();
        Self {
            inner: ReduceOptimization::from_state(device, state),
            device: device.clone(),
            client,
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_outputs_take_cube_many_take_plane_or_unit_without_planes() {
        assert_eq!(Routine::for_outputs(1, true), Routine::Cube);
        assert_eq!(Routine::for_outputs(64, true), Routine::Cube);
        assert_eq!(Routine::for_outputs(64, false), Routine::Cube);
        assert_eq!(Routine::for_outputs(65, true), Routine::Plane);
        assert_eq!(Routine::for_outputs(65, false), Routine::Unit);
        assert_eq!(Routine::for_outputs(1 << 20, false), Routine::Unit);
    }

    #[test]
    fn outputs_are_the_product_of_the_other_axes() {
        assert_eq!(outputs(&[32, 64, 56, 56], 0), 64 * 56 * 56);
        assert_eq!(outputs(&[32, 64, 56, 56], 3), 32 * 64 * 56);
        assert_eq!(outputs(&[7], 0), 1);
    }
}
