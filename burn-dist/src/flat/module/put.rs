//! Values put back into a Burn module's trainable tensors: the whole vector
//! ([`with_trainable_values`]), one part per tensor ([`with_trainable_parts`]), or a run of
//! tensors ([`with_trainable_range`]), and a run let go until its values come back
//! ([`release_trainable_range`]). The reading side is the parent module.

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::{DistError, Result};

/// `module` with trainable tensor `i` replaced by `parts[i]` (each consumed as its tensor is
/// made, so the new values never exist twice).
pub fn with_trainable_parts<M: Module>(module: M, parts: Vec<Vec<f32>>) -> Result<M> {
    let n = parts.len();
    let (m, count) = map_trainable(module, 0..n, parts, &Shapes::new())?;
    if count != n {
        let which = if n < count { "fewer" } else { "more" };
        return Err(parts_mismatch(format!(
            "{which} parts ({n}) than the module has trainable tensors ({count})"
        )));
    }
    Ok(m)
}

/// Trainable tensors' shapes, by index in the trainable order, kept while the tensors are out
/// of the module ([`release_trainable_range`]).
pub type Shapes = std::collections::BTreeMap<usize, Shape>;

/// `module` with trainable tensors `tensors` (indices in the trainable order) replaced by
/// `parts`, one each, the others left as they are: a sharded step puts each bucket's tensors
/// in place as its all-gather ends ([`crate::zero::ZeroOptimizer::step_with`]), so that a
/// module held nowhere else lets its old values go bucket by bucket. A tensor released before
/// ([`release_trainable_range`]) takes its shape from `released`.
pub fn with_trainable_range<M: Module>(
    module: M,
    tensors: std::ops::Range<usize>,
    parts: Vec<Vec<f32>>,
    released: &Shapes,
) -> Result<M> {
    let (m, count) = map_trainable(module, tensors.clone(), parts, released)?;
    if tensors.end > count {
        return Err(parts_mismatch(format!(
            "tensors {tensors:?} of a module of {count} trainable tensors"
        )));
    }
    Ok(m)
}

/// Counts a parameter met while mapping a module if it is trainable, and gives its index in
/// the trainable order and its shape when `want` holds it (a lazy parameter stays lazy).
fn wanted<const D: usize>(
    param: &Param<Tensor<D>>,
    index: &mut usize,
    want: &std::ops::Range<usize>,
) -> Option<(usize, Shape)> {
    let shape = super::lazy::trainable_shape(param)?;
    let i = *index;
    *index += 1;
    want.contains(&i).then_some((i, shape))
}

/// `param` holding `make(device)` in place of its value, which goes at once; a parameter Burn
/// has not initialised yet never makes its value.
fn replaced<const D: usize>(
    param: Param<Tensor<D>>,
    make: impl FnOnce(&Device) -> Tensor<D>,
) -> Param<Tensor<D>> {
    if param.is_initialized() {
        return param.map(|t| {
            let device = t.device();
            drop(t);
            make(&device)
        });
    }
    let (id, device) = (param.id, param.lazy_device());
    param.transform_for_load(make(&device), id)
}

/// `module` with trainable tensors `tensors` let go (empty tensors in their place, their shapes
/// added to `released`): a sharded step whose values for them are read already frees the old
/// values before the all-gather brings the new ones, so the two are never held at once and the
/// new ones take the memory the old ones had. [`with_trainable_range`] puts them back.
pub fn release_trainable_range<M: Module>(
    module: M,
    tensors: std::ops::Range<usize>,
    released: &mut Shapes,
) -> M {
    struct Release<'a> {
        want: std::ops::Range<usize>,
        index: usize,
        shapes: &'a mut Shapes,
    }
    impl ModuleMapper for Release<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((i, shape)) = wanted(&param, &mut self.index, &self.want) else {
                return param;
            };
            // A tensor released before keeps the shape it had then.
            self.shapes.entry(i).or_insert(shape);
            replaced(param, |device| {
                Tensor::<D>::empty([0; D], device).set_require_grad(true)
            })
        }
    }
    module.map(&mut Release {
        want: tensors,
        index: 0,
        shapes: released,
    })
}

/// `module` with trainable tensors `tensors` replaced by `parts` (as many), and its number of
/// trainable tensors.
fn map_trainable<M: Module>(
    module: M,
    tensors: std::ops::Range<usize>,
    parts: Vec<Vec<f32>>,
    released: &Shapes,
) -> Result<(M, usize)> {
    struct Parts<'a> {
        want: std::ops::Range<usize>,
        index: usize,
        parts: std::vec::IntoIter<Vec<f32>>,
        released: &'a Shapes,
        error: Option<String>,
    }
    impl ModuleMapper for Parts<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((i, shape)) = wanted(&param, &mut self.index, &self.want) else {
                return param;
            };
            let shape = self.released.get(&i).cloned().unwrap_or(shape);
            let Some(v) = self.parts.next() else {
                self.error
                    .get_or_insert("fewer parts than tensors to replace".into());
                return param;
            };
            if v.len() != shape.num_elements() {
                self.error.get_or_insert(format!(
                    "a part of {} values for a tensor of shape {shape:?}",
                    v.len()
                ));
                return param;
            }
            replaced(param, |device| {
                Tensor::<D>::from_data(TensorData::new(v, shape), device).set_require_grad(true)
            })
        }
    }
    if parts.len() != tensors.len() {
        return Err(parts_mismatch(format!(
            "{} parts for tensors {tensors:?}",
            parts.len()
        )));
    }
    let mut p = Parts {
        want: tensors,
        index: 0,
        parts: parts.into_iter(),
        released,
        error: None,
    };
    let m = module.map(&mut p);
    match p.error {
        Some(e) => Err(parts_mismatch(e)),
        None => Ok((m, p.index)),
    }
}

fn parts_mismatch(reason: String) -> DistError {
    DistError::Mismatch {
        op: "sharded optimizer values".into(),
        reason,
    }
}

struct Put<'a> {
    values: &'a [f32],
    at: usize,
    error: Option<String>,
}

impl ModuleMapper for Put<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (values, at, error) = (self.values, &mut self.at, &mut self.error);
        param.map(|t| {
            if !t.is_require_grad() {
                return t;
            }
            let shape = t.shape();
            let n = shape.num_elements();
            let Some(v) = values.get(*at..*at + n) else {
                error.get_or_insert(format!(
                    "{} values for a module with more trainable values",
                    values.len()
                ));
                return t;
            };
            *at += n;
            Tensor::<D>::from_data(TensorData::new(v.to_vec(), shape), &t.device())
                .set_require_grad(true)
        })
    }
}

/// `module` with its trainable values replaced by `values` (as from
/// [`super::trainable_values`]).
pub fn with_trainable_values<M: Module>(module: M, values: &[f32]) -> Result<M> {
    let mut p = Put {
        values,
        at: 0,
        error: None,
    };
    let m = module.map(&mut p);
    if p.error.is_none() && p.at != values.len() {
        p.error = Some(format!(
            "{} values for a module with {} trainable values",
            values.len(),
            p.at
        ));
    }
    match p.error {
        Some(e) => Err(DistError::Mismatch {
            op: "parameter-server values".into(),
            reason: e,
        }),
        None => Ok(m),
    }
}
