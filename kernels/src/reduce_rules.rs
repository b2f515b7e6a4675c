//! Burn's reductions by rule on cubecl devices: their autotune decisions written into cubecl's
//! cache before the first reduction runs, so a new GPU compiles one kernel per reduction
//! instead of compiling and timing every candidate.
//!
//! Why: Hearth's convolutions and products take kernels by rule ([`crate::select`]), but Burn's
//! own reductions (`sum_dim`, `mean_dim`, `max_dim`, `argmax`, the full `sum`) go through
//! burn-cubecl's autotune, which compiles each candidate (NVRTC on CUDA) and times it. On the
//! H200 of 2026-11-27 (the decisions `bundles/cuda-sm90.ccb.gz` holds) 19 such decisions timed
//! 97 candidates (16 `reduce_dim` keys with 4-5 each, 3 `sum` keys with 8 each): none came close
//! enough to the roofline to stop early, so 78 kernels were compiled only to lose.
//!
//! How: burn-cubecl's tuners read their decisions from cubecl's persistent cache when they
//! first open it. [`seed`] writes, for every key this build's anchors can produce, the index of
//! the candidate the rule picks, under the namespace the tuner reads
//! (`autotune/{cubecl}/{device}/{tuner}`) and the checksum of its candidate list; entries the
//! cache already holds (a real tune, a bundle's decision) are kept. A seeded entry carries no
//! timings, which is how [`forget`] tells it from a measured one when `--autotune full` asks
//! for the reductions to be timed again.
//!
//! The rule, from those H200 decisions (the median of the rule's pick against the winner's):
//! - `reduce_dim`: the `cube` routine (one cube per output) when at most 64 vectors are reduced
//!   (`vector_count` ≤ 64), the `plane` routine (one plane per output) otherwise. Of the 16
//!   keys, 8 picked the winner, 5 were within 4% of it, and 3 behind by 1.22x (an `argmax`:
//!   28 µs against 23), 1.46x (14 µs against 10) and 1.54x (contiguous, 1,024-long vectors, 512
//!   of them: 172 µs against 112); summed over the 16, 2.8% more time than the winners. Never
//!   `unit` with planes at hand: 56 ms where `cube` took 93 µs.
//! - `sum` (a whole tensor to one value): `sum_chained`, a chain of `reduce_dim`s, which runs
//!   on every device (`sum_one_shot` needs atomic adds of the element type). It won two of the
//!   three keys and lost the third by 43 µs (62 against 19).
//! - Devices without plane operations (`cube` and `plane` both use them; Mesa lavapipe, the
//!   `vulkan-cpu` of the tests): `unit_vectorized_parallel_reduce`, one unit per output with
//!   its loads vectorised along the outputs. Of the 12 `reduce_dim` keys autotune timed for
//!   ResNet-50 training on lavapipe (64x64, batch 2), it had the lowest median on 11 and was 2%
//!   behind `unit` on the last; `unit` itself was 2x behind on one.
//!
//! Not seeded: top-k (`accumulator_len` above 1), and fusion's fused reductions
//! (`burn_cubecl_fusion`), whose keys count the fused reads, writes and operations without a
//! bound: [`crate::fused_reduce`] launches those by rule instead.

use std::collections::HashSet;

use burn::backend::DispatchDevice;
use burn::prelude::Device;
use burn_cubecl::cubecl::config::autotune::AutotuneLevel;
use burn_cubecl::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use burn_cubecl::cubecl::features::Plane;
use burn_cubecl::cubecl::hash::StableHasher;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind, IntKind, UIntKind};
use burn_cubecl::cubecl::tune::{PersistentCacheKey, PersistentCacheValue};
use burn_cubecl::kernel::reduce::{ReduceDimAutotuneKey, SumAutotuneKey};
use burn_cubecl::{CubeAutotuneKey, CubeTuneId};
use cubecl_environment::persistence::{CacheOption, Namespace, Store, StoreOptions};
use cubek::reduce::components::instructions::ReduceOperationConfig;
use cubek::reduce::launch::tune_key::ReduceAutotuneKey;

/// burn-cubecl 0.22.1's `reduce_dim` candidates, in the order its tuner registers them: the
/// decision is an index into this list, and the checksum is of these names.
pub const REDUCE_DIM_CANDIDATES: [&str; 6] = [
    "unit_vectorized_parallel_reduce",
    "plane_vectorized_parallel_reduce",
    "cube_vectorized_parallel_reduce",
    "unit",
    "plane",
    "cube",
];

/// burn-cubecl 0.22.1's whole-tensor `sum` candidates, in registration order.
pub const SUM_CANDIDATES: [&str; 8] = [
    "sum_chained",
    "sum_one_shot",
    "sum_one_shot",
    "sum_one_shot",
    "sum_one_shot",
    "sum_one_shot",
    "sum_one_shot",
    "sum_one_shot",
];

/// The tuners' names as cubecl stores them (`module_path!()` and the tuner's name, `::` as `-`).
const REDUCE_DIM_TUNER: &str = "burn_cubecl-kernel-reduce-tune-reduce-dim";
const SUM_TUNER: &str = "burn_cubecl-kernel-reduce-tune-autotune-sum";

/// Largest number of vectors the `cube` routine is picked for (one cube per output).
pub const CUBE_MAX_VECTOR_COUNT: usize = 64;

/// The checksum cubecl stores with each decision: a hash of the candidates' names in order.
/// A decision under another checksum is one for another candidate list, and is re-tuned.
pub fn checksum(candidates: &[&str]) -> String {
    format!("{:x}", StableHasher::hash_one(&candidates.concat()))
}

/// The `reduce_dim` candidate the rule picks (an index into [`REDUCE_DIM_CANDIDATES`]) for a
/// reduction of `vector_count` vectors on a device with plane operations (`planes`) or
/// without.
pub fn reduce_dim_choice(vector_count: usize, planes: bool) -> usize {
    match planes {
        true if vector_count <= CUBE_MAX_VECTOR_COUNT => 5, // cube
        true => 4,                                          // plane
        false => 0,                                         // unit_vectorized_parallel_reduce
    }
}

/// The whole-tensor `sum` candidate the rule picks (an index into [`SUM_CANDIDATES`]).
pub const SUM_CHOICE: usize = 0;

/// What [`seed`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seeded {
    /// Decisions written.
    pub written: usize,
    /// Keys the cache already held a decision for (measured or seeded), left as they were.
    pub kept: usize,
}

/// Lengths to feed the anchored key constructors: together they reach every anchor a key of
/// the current autotune level can take, from 1 to 2^40.
fn lengths() -> Vec<usize> {
    let mut out = Vec::new();
    let mut x = 1.0f64;
    while x < (1u64 << 40) as f64 {
        out.push(x as usize);
        x = (x * 1.1).max(x + 1.0);
    }
    out
}

/// The element types a reduction's input may have on a cubecl device.
fn inputs() -> Vec<ElemType> {
    vec![
        ElemType::Float(FloatKind::F32),
        ElemType::Float(FloatKind::F16),
        ElemType::Float(FloatKind::BF16),
        ElemType::Float(FloatKind::F64),
        ElemType::Int(IntKind::I32),
        ElemType::Int(IntKind::I64),
        ElemType::UInt(UIntKind::U32),
        ElemType::UInt(UIntKind::U8),
    ]
}

/// Every (input, output, accumulator) element triple Burn's reductions produce here: values
/// keep the input type, indices (`argmax`) and flags (`any`, `all`) take an integer or bool.
fn element_triples() -> Vec<(ElemType, ElemType, ElemType)> {
    let indices = [
        ElemType::Int(IntKind::I32),
        ElemType::Int(IntKind::I64),
        ElemType::UInt(UIntKind::U32),
    ];
    let flags = [
        ElemType::Bool,
        ElemType::UInt(UIntKind::U8),
        ElemType::UInt(UIntKind::U32),
    ];
    let values = [
        ReduceOperationConfig::Sum,
        ReduceOperationConfig::Prod,
        ReduceOperationConfig::Mean,
        ReduceOperationConfig::Max,
        ReduceOperationConfig::Min,
        ReduceOperationConfig::MaxAbs,
    ];
    let mut set = Vec::new();
    let mut push = |t: (ElemType, ElemType, ElemType)| {
        if !set.contains(&t) {
            set.push(t);
        }
    };
    for input in inputs() {
        for config in values {
            let d = config.precision(input, None);
            push((d.input, d.output, d.accumulation));
        }
        for config in [ReduceOperationConfig::ArgMax, ReduceOperationConfig::ArgMin] {
            for out in indices {
                let d = config.precision(input, Some(out));
                push((d.input, d.output, d.accumulation));
            }
        }
        for config in [ReduceOperationConfig::Any, ReduceOperationConfig::All] {
            for out in flags {
                let d = config.precision(input, Some(out));
                push((d.input, d.output, d.accumulation));
            }
        }
    }
    set
}

/// Every `reduce_dim` key (one accumulator slot) the current anchors produce, with the rule's
/// pick for it.
pub fn reduce_dim_decisions(planes: bool) -> Vec<(ReduceDimAutotuneKey, usize)> {
    // The two lengths are anchored apart: one raw length for each anchor a dimension takes
    // (4 vector lengths, 6 counts at the default level) yields every key, without building
    // the keys of every pair of raw lengths.
    let f32 = ElemType::Float(FloatKind::F32);
    let representatives = |anchored: fn(&ReduceAutotuneKey) -> usize, size: bool| {
        let mut seen = HashSet::new();
        lengths()
            .into_iter()
            .filter(|&x| {
                let (s, c) = if size { (x, 1) } else { (1, x) };
                seen.insert(anchored(&ReduceAutotuneKey::new(f32, f32, f32, true, s, c)))
            })
            .collect::<Vec<_>>()
    };
    let sizes = representatives(|k| k.vector_size, true);
    let counts = representatives(|k| k.vector_count, false);
    let mut out = Vec::new();
    for (input, output, acc) in element_triples() {
        for contiguous in [true, false] {
            for &size in &sizes {
                for &count in &counts {
                    let reduce =
                        ReduceAutotuneKey::new(input, output, acc, contiguous, size, count);
                    let count = reduce.vector_count;
                    out.push((
                        ReduceDimAutotuneKey::new(1, reduce),
                        reduce_dim_choice(count, planes),
                    ));
                }
            }
        }
    }
    out
}

/// Every whole-tensor `sum` key the current anchors produce.
pub fn sum_keys() -> Vec<CubeAutotuneKey> {
    use burn::tensor::DType;
    let mut seen = HashSet::new();
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U8,
    ] {
        for length in lengths() {
            seen.insert(CubeAutotuneKey::Sum(SumAutotuneKey::new(dtype, length)));
        }
    }
    seen.into_iter().collect()
}

/// The cubecl device of `device` and the name its tuners store decisions under, or `None`
/// for a device that is not a cubecl device. Starts the device's client (what its first
/// tensor would do).
fn tune_id(device: &Device) -> Option<(String, bool)> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cube) => {
            let client = cube.client();
            let planes = client.properties().features.plane.contains(Plane::Ops);
            Some((CubeTuneId::new(&client, cube).to_string(), planes))
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

fn store<K>(tune_id: &str, tuner: &str) -> Store<PersistentCacheKey<K>, PersistentCacheValue>
where
    K: serde::Serialize + serde::de::DeserializeOwned + Eq + std::hash::Hash + Clone,
{
    Store::new(
        StoreOptions::new()
            .storage(Namespace::scoped("autotune", format!("{tune_id}/{tuner}")))
            .cache(CacheOption::Eager),
    )
}

fn write<K>(
    store: &mut Store<PersistentCacheKey<K>, PersistentCacheValue>,
    decisions: impl IntoIterator<Item = (K, usize)>,
    checksum: &str,
    seeded: &mut Seeded,
) where
    K: serde::Serialize + serde::de::DeserializeOwned + Eq + std::hash::Hash + Clone,
{
    for (key, fastest_index) in decisions {
        let key = PersistentCacheKey {
            key,
            checksum: checksum.to_string(),
        };
        if store.get(&key).is_some() {
            seeded.kept += 1;
            continue;
        }
        let value = PersistentCacheValue {
            fastest_index,
            results: Vec::new(),
            bounds: None,
            limit: None,
        };
        match store.insert(key, value) {
            Ok(()) => seeded.written += 1,
            // Another process wrote this key first: its decision stands.
            Err(_) => seeded.kept += 1,
        }
    }
}

/// Why [`seed`] wrote nothing, in words for the start of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotSeeded {
    /// Not a cubecl device.
    NotCubecl,
    /// cubecl's autotune cache is off (`CUBECL_AUTOTUNE_CACHE=0`): its tuners read no decision.
    CacheOff,
    /// `CUBECL_AUTOTUNE_LEVEL=full` anchors nothing: every shape is a key of its own.
    LevelFull,
}

impl std::fmt::Display for NotSeeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotSeeded::NotCubecl => "not a cubecl device",
            NotSeeded::CacheOff => {
                "cubecl's autotune cache is off (CUBECL_AUTOTUNE_CACHE=0), so its reductions tune"
            }
            NotSeeded::LevelFull => {
                "CUBECL_AUTOTUNE_LEVEL=full keys every shape apart, so its reductions tune"
            }
        })
    }
}

fn seedable(device: &Device) -> Result<(String, bool), NotSeeded> {
    let config = CubeClRuntimeConfig::get();
    if config.autotune.disable_cache {
        return Err(NotSeeded::CacheOff);
    }
    if matches!(config.autotune.level, AutotuneLevel::Full) {
        return Err(NotSeeded::LevelFull);
    }
    tune_id(device).ok_or(NotSeeded::NotCubecl)
}

/// Writes the rule's decision for every `reduce_dim` and whole-tensor `sum` key into cubecl's
/// cache for `device`, keeping any decision already there. Call it before the device's first
/// reduction: a tuner reads the cache once, when it first opens. Cheap after the first time
/// (the entries are read and found).
pub fn seed(device: &Device) -> Result<Seeded, NotSeeded> {
    let (id, planes) = seedable(device)?;
    let mut seeded = Seeded::default();
    let mut reduce = store::<ReduceDimAutotuneKey>(&id, REDUCE_DIM_TUNER);
    write(
        &mut reduce,
        reduce_dim_decisions(planes),
        &checksum(&REDUCE_DIM_CANDIDATES),
        &mut seeded,
    );
    let mut sum = store::<CubeAutotuneKey>(&id, SUM_TUNER);
    write(
        &mut sum,
        sum_keys().into_iter().map(|k| (k, SUM_CHOICE)),
        &checksum(&SUM_CANDIDATES),
        &mut seeded,
    );
    Ok(seeded)
}

/// Removes the decisions [`seed`] wrote for `device` (those without timings), so that
/// `--autotune full` times the reductions again; measured decisions stay. Returns how many
/// were removed.
pub fn forget(device: &Device) -> Result<usize, NotSeeded> {
    let (id, _) = seedable(device)?;
    fn purge<K>(mut store: Store<PersistentCacheKey<K>, PersistentCacheValue>) -> usize
    where
        K: serde::Serialize + serde::de::DeserializeOwned + Eq + std::hash::Hash + Clone,
    {
        let mut seeded = Vec::new();
        store.for_each(|k, v| {
            if v.results.is_empty() {
                seeded.push(k.clone());
            }
        });
        for key in &seeded {
            store.purge_key(key);
        }
        seeded.len()
    }
    Ok(purge(store::<ReduceDimAutotuneKey>(&id, REDUCE_DIM_TUNER))
        + purge(store::<CubeAutotuneKey>(&id, SUM_TUNER)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The candidate lists match burn-cubecl 0.22.1's: these checksums are the ones the H200's
    /// tuners stored (`bundles/cuda-sm90.ccb.gz`). A list out of step with Burn's would seed
    /// decisions no tuner accepts.
    #[test]
    fn candidate_lists_have_the_checksums_burns_tuners_store() {
        assert_eq!(
            checksum(&REDUCE_DIM_CANDIDATES),
            "2b424612e2c2afd9c046e0167e058384"
        );
        assert_eq!(
            checksum(&SUM_CANDIDATES),
            "38f0fa719fb6905caa95bf75e3d3ab3d"
        );
    }

    #[test]
    fn few_vectors_take_the_cube_routine_many_the_plane_routine_and_no_planes_a_unit() {
        let name = |count, planes| REDUCE_DIM_CANDIDATES[reduce_dim_choice(count, planes)];
        assert_eq!(name(1, true), "cube");
        assert_eq!(name(64, true), "cube");
        assert_eq!(name(512, true), "plane");
        assert_eq!(name(32768, true), "plane");
        // Without plane operations: one unit per output, whatever the count.
        assert_eq!(name(64, false), "unit_vectorized_parallel_reduce");
        assert_eq!(name(32768, false), "unit_vectorized_parallel_reduce");
        assert_eq!(SUM_CANDIDATES[SUM_CHOICE], "sum_chained");
    }

    /// Every anchor of the default level is reached: vectors of 16, 64, 256 and 1,024 (at
    /// most), 1 to 32,768 of them (powers of eight), each of the two layouts.
    #[test]
    fn the_keys_cover_every_anchor_of_the_default_level() {
        let decisions = reduce_dim_decisions(true);
        let triples = element_triples().len();
        assert_eq!(
            decisions.len(),
            triples * 2 * 4 * 6,
            "{triples} element triples"
        );
        let f32_triple = (
            ElemType::Float(FloatKind::F32),
            ElemType::Float(FloatKind::F32),
            ElemType::Float(FloatKind::F32),
        );
        assert!(element_triples().contains(&f32_triple));
        // A key the H200 tuned (`argmax` of f32 to i32) is among them.
        let argmax = ReduceDimAutotuneKey::new(
            1,
            ReduceAutotuneKey::new(
                ElemType::Float(FloatKind::F32),
                ElemType::Int(IntKind::I32),
                ElemType::Float(FloatKind::F32),
                true,
                16,
                64,
            ),
        );
        assert!(decisions.iter().any(|(k, i)| k == &argmax && *i == 5));
        assert!(sum_keys().len() >= 8 * 40);
    }
}
