//! A module's gradients exchanged in fusion buckets: taken out of `GradientsParams` in the
//! module's parameter order, packed on their device, reduced bucket by bucket and put back.
//! Below both [`crate::ddp`] (the exchange after the backward) and [`crate::overlap`] (what a
//! step did not hand over).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::bucket::BucketPlan;
use crate::collective::{Communicator, ReduceOp};
use crate::{DistError, Result};

/// One gradient taken out of `GradientsParams`: its parameter, its shape, and its values
/// flattened on the device that computed them (no copy to the host yet).
struct Taken {
    id: burn::module::ParamId,
    dims: Vec<usize>,
    flat: Tensor<1>,
}

struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    taken: Vec<Taken>,
}

impl ModuleVisitor for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            let dims = g.dims().to_vec();
            let n: usize = dims.iter().product();
            self.taken.push(Taken {
                id: param.id,
                dims,
                flat: g.reshape([n]),
            });
        }
    }
}

struct PutGrads<'a> {
    grads: &'a mut GradientsParams,
    values: std::iter::Peekable<std::vec::IntoIter<Taken>>,
}

impl ModuleVisitor for PutGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        // Same order as TakeGrads: the next entry belongs to this parameter if the ids match.
        if let Some(t) = self.values.next_if(|t| t.id == param.id) {
            let g: Tensor<D> = t.flat.reshape(Shape::from(t.dims));
            self.grads.register::<D>(t.id, g);
        }
    }
}

/// `grads` flattened in module order, each value scaled by `scale` if given, reduced with `op`
/// bucket by bucket, and put back.
///
/// Each bucket is packed on the gradients' own device (the concatenation and the scaling run
/// there) and crosses to the host as one buffer: on a GPU, one read per bucket instead of one
/// per tensor. The reduced bucket goes back to the device as one buffer and is split there.
pub(crate) fn reduce_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    comm: &Communicator,
    bucket_bytes: usize,
    scale: Option<f32>,
    op: ReduceOp,
    compression: crate::Compression,
) -> Result<()> {
    if comm.world() == 1 {
        return Ok(());
    }
    let mut take = TakeGrads {
        grads,
        taken: Vec::new(),
    };
    module.visit(&mut take);
    let mut taken = take.taken;
    let sizes: Vec<usize> = taken.iter().map(|t| t.dims.iter().product()).collect();
    let plan = BucketPlan::new(&sizes, bucket_bytes);
    for range in &plan.buckets {
        let bucket = &mut taken[range.clone()];
        let device = bucket[0].flat.device();
        let parts: Vec<Tensor<1>> = bucket
            .iter()
            .map(|t| t.flat.clone().to_device(&device))
            .collect();
        let mut packed = Tensor::cat(parts, 0);
        if let Some(w) = scale {
            packed = packed.mul_scalar(w);
        }
        let mut host = packed
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| DistError::Mismatch {
                op: "gradient bucket read".into(),
                reason: format!("{e:?}"),
            })?;
        let len = host.len();
        let want: usize = sizes[range.clone()].iter().sum();
        if len != want {
            return Err(DistError::Mismatch {
                op: "gradient bucket read".into(),
                reason: format!("{len} values read for a bucket of {want}"),
            });
        }
        comm.allreduce_with(&mut host, op, compression)?;
        let reduced = Tensor::<1>::from_data(TensorData::new(host, [len]), &device);
        let pieces = if bucket.len() == 1 {
            vec![reduced]
        } else {
            reduced.split_with_sizes(sizes[range.clone()].to_vec(), 0)
        };
        for (t, piece) in bucket.iter_mut().zip(pieces) {
            t.flat = piece;
        }
    }
    let mut put = PutGrads {
        grads,
        values: taken.into_iter().peekable(),
    };
    module.visit(&mut put);
    Ok(())
}
