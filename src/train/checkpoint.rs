//! The weights of an epoch (`run_dir/checkpoint/model-<epoch>.bpk`), written as Burn's own
//! `into_record().save` writes them but a tensor at a time: every mode's checkpoints, and ZeRO
//! stage 3's from a skeleton whose tensors are fed to the writer as they are gathered.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::{Bytes, DType, Shape};

use crate::{HearthError, Result};

/// `run_dir/checkpoint/model-<epoch>.bpk`.
pub fn model_checkpoint(run_dir: &Path, epoch: usize) -> PathBuf {
    run_dir
        .join("checkpoint")
        .join(format!("model-{epoch}.bpk"))
}

/// Writes `model`'s weights as `epoch`'s checkpoint (the custom loops: pipeline stages aside,
/// elastic and parameter-server runs).
pub fn save_epoch_weights<M: burn::module::Module>(
    run_dir: &Path,
    epoch: usize,
    model: M,
    gate: &super::gate::Gate,
) -> Result<()> {
    save_weights(run_dir, epoch, model, gate, None)
}

/// What a [`Fed`] hands each tensor's id and bytes to; it says whether the writer still takes
/// them.
pub type Handover<'a> = &'a mut dyn FnMut(u64, Bytes) -> bool;

/// A parameter's shape where a skeleton holds it empty.
pub type ShapeOf<'a> = &'a dyn Fn(&ParamId) -> Option<Shape>;

/// The values of the tensors a ZeRO stage 3 skeleton holds empty, fed to the checkpoint's
/// writer while it writes ([`save_epoch_weights_fed`]).
pub struct Fed<'a> {
    /// The shape of each tensor the skeleton holds empty (`None`: a tensor it holds whole).
    pub shape: ShapeOf<'a>,
    /// Hands every empty tensor's id and bytes, in the module's order, to the function it is
    /// given (which says whether the writer still takes them): a tensor's bytes whole, or in
    /// consecutive pieces (each with the tensor's id) that the writer writes as they come, so
    /// that it is never held whole. Its error is the write's.
    pub feed: &'a mut dyn FnMut(Handover<'_>) -> Result<()>,
}

/// [`save_epoch_weights`] of a ZeRO stage 3 skeleton: the tensors it holds empty written from
/// `fed` as the writer reaches them (gathered a unit at a time), so that the file is Burn's
/// of the whole model byte for byte while no more than a unit of it is held at once.
pub fn save_epoch_weights_fed<M: burn::module::Module>(
    run_dir: &Path,
    epoch: usize,
    skeleton: M,
    gate: &super::gate::Gate,
    fed: Fed<'_>,
) -> Result<()> {
    save_weights(run_dir, epoch, skeleton, gate, Some(fed))
}

fn save_weights<M: burn::module::Module>(
    run_dir: &Path,
    epoch: usize,
    model: M,
    gate: &super::gate::Gate,
    fed: Option<Fed<'_>>,
) -> Result<()> {
    let path = model_checkpoint(run_dir, epoch);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|source| HearthError::Write {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    let tmp = super::gate::Gate::temp_for(&path);
    if let Err(e) = save_streamed(&model, &tmp, fed) {
        let _ = std::fs::remove_file(&tmp);
        return Err(HearthError::Training(format!(
            "saving epoch {epoch}'s weights: {e}"
        )));
    }
    drop(model);
    gate.land(&tmp, &path)
}

/// `module`'s record written as Burn's `into_record().save(path)` writes it (the same burnpack
/// container: each parameter and buffer by its module path, with its parameter id, type and
/// shape, in visiting order), each tensor's values read only when the writer reaches it and
/// let go before the next: `into_record` copies every value first, so a checkpoint held the
/// model twice (rank 0's peak of a ZeRO run). Float tensors on the CPU are read by
/// [`hearth_kernels::file_bytes`], one copy where Burn's `into_data` makes two.
///
/// With `fed`, each tensor the module holds empty is written from the bytes `fed` hands over
/// (the writer on a thread of its own, taking them one at a time as it reaches them; a
/// tensor handed over in pieces is written a window at a time as they come).
fn save_streamed<M: burn::module::Module>(
    module: &M,
    path: &Path,
    fed: Option<Fed<'_>>,
) -> std::result::Result<(), String> {
    use burn::module::{ModuleVisitor, Param};
    use burn::prelude::{Bool, Int, Tensor};
    use burn::tensor::kind::Basic;

    type Inbox = Arc<Mutex<Receiver<(u64, Bytes)>>>;
    struct Deferred<'a> {
        path: Vec<String>,
        out: Vec<burn_pack::Tensor>,
        fed: Option<(ShapeOf<'a>, Inbox)>,
        failure: super::streamed::Failure,
    }
    /// The next bytes `inbox` receives, which must be parameter `id`'s.
    fn receive(inbox: &Inbox, id: u64) -> std::result::Result<Bytes, String> {
        match inbox.lock().map(|r| r.recv()) {
            Ok(Ok((got, bytes))) if got == id => Ok(bytes),
            Ok(Ok((got, _))) => Err(format!(
                "the gathered tensors came out of order: parameter {got} where {id} was due"
            )),
            _ => Err("the gathered values stopped coming".into()),
        }
    }
    impl Deferred<'_> {
        /// A tensor held empty: `shape`'s f32 values, the next bytes `inbox` receives (which
        /// must be this tensor's): all of them at once, or in pieces (a matrix gathered a
        /// piece of rows at a time), written as they come ([`super::streamed`]).
        fn push_fed(&mut self, id: u64, shape: Shape, inbox: Inbox) {
            let len = shape.num_elements() * DType::F32.size();
            let failure = self.failure.clone();
            let read = move || {
                let invalid = burn_pack::Error::ValidationError;
                // A tensor streamed before this one lacked pieces: stop here.
                if let Some(e) = failure.lock().ok().and_then(|f| f.clone()) {
                    return Err(invalid(e));
                }
                let first = receive(&inbox, id).map_err(invalid)?;
                if first.len() >= len {
                    // Whole (a longer one fails the writer's own length check).
                    return Ok(first);
                }
                let inbox = inbox.clone();
                let next = Box::new(move || receive(&inbox, id));
                Ok(super::streamed::streamed(len, first, next, failure.clone()))
            };
            self.out.push(burn_pack::Tensor::deferred(
                self.path.join("."),
                DType::F32,
                shape,
                Some(id),
                len,
                read,
            ));
        }
        /// `t`, its bytes read by `direct` where it can (else as Burn reads them).
        fn push<const D: usize, K: Basic + 'static>(
            &mut self,
            id: u64,
            t: Tensor<D, K>,
            direct: fn(&Tensor<D, K>) -> Option<burn::tensor::Bytes>,
        ) where
            Tensor<D, K>: Send + Sync,
        {
            let path = self.path.join(".");
            self.out
                .push(hearth_models::pack::deferred(path, id, t, direct));
        }
    }
    impl ModuleVisitor for Deferred<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some((shape_of, inbox)) = &self.fed
                && let Some(shape) = shape_of(&param.id)
            {
                let inbox = inbox.clone();
                return self.push_fed(param.id.val(), shape, inbox);
            }
            // Copied once on the CPU, where `into_data` copies a held tensor twice.
            let direct = hearth_kernels::file_bytes::<D>;
            self.push(param.id.val(), param.transform_for_save().val(), direct);
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            self.push(param.id.val(), param.transform_for_save().val(), |_| None);
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            self.push(param.id.val(), param.transform_for_save().val(), |_| None);
        }
    }
    let write = |out| {
        burn_pack::Writer::new(out)
            .write_to_file(path)
            .map_err(|e| e.to_string())
    };
    let Some(fed) = fed else {
        return write(hearth_models::pack::deferred_tensors(module));
    };
    // Handed over one at a time: the writer holds the tensor it writes, the feed the next.
    let (tx, rx) = sync_channel::<(u64, Bytes)>(0);
    let failure = super::streamed::Failure::default();
    let mut d = Deferred {
        path: Vec::new(),
        out: Vec::new(),
        fed: Some((fed.shape, Arc::new(Mutex::new(rx)))),
        failure: failure.clone(),
    };
    module.visit(&mut d);
    // The writer's tensors alone hold the receiver: a writer that stops drops it, so a send
    // fails instead of waiting for a reader that is gone.
    let Deferred {
        out, fed: inbox, ..
    } = d;
    drop(inbox);
    std::thread::scope(|s| {
        let writer = s.spawn(move || write(out));
        // A writer that stopped early dropped the receiver: the feed goes on without sending
        // (its gathers are collective), then the writer's error is the one reported.
        let fed = (fed.feed)(&mut |id, bytes| tx.send((id, bytes)).is_ok());
        drop(tx);
        let written = writer
            .join()
            .map_err(|_| "the checkpoint's writer panicked".to_string())?;
        fed.map_err(|e| e.to_string())?;
        // A tensor whose pieces fell short was written with zeros: the file is thrown away.
        if let Some(e) = failure.lock().ok().and_then(|f| f.clone()) {
            return Err(e);
        }
        written
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `f`'s result, on a thread of its own: a test failure after 60 s instead of a hang.
    fn bounded<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{what}: no result in 60 s (it failed or hangs): {e}"))
    }

    /// The streamed checkpoint is Burn's own file byte for byte (parameters with their ids,
    /// batch norm's running statistics, nested paths), on Flex with and without autodiff, and
    /// it loads back; so is a skeleton's whose empty tensors are fed (ZeRO stage 3), and a
    /// feed out of order or failing leaves no file and names why.
    #[test]
    fn a_streamed_checkpoint_is_burn_s_file_byte_for_byte() {
        use burn::module::Module;
        use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
        use burn::prelude::Tensor;
        #[derive(Module, Debug)]
        struct Inner {
            norm: BatchNorm,
        }
        #[derive(Module, Debug)]
        struct Net {
            fc: Linear,
            inner: Vec<Inner>,
        }
        // Flex's floats are read by `hearth_kernels::file_bytes` (with autodiff too).
        for device in [
            burn::prelude::Device::flex(),
            burn::prelude::Device::flex().autodiff(),
        ] {
            let net = Net {
                fc: LinearConfig::new(5, 3).init(&device),
                inner: vec![Inner {
                    norm: BatchNormConfig::new(3).init(&device),
                }],
            };
            let dir = tempfile::tempdir().unwrap();
            let (ours, burns) = (dir.path().join("ours.bpk"), dir.path().join("burns.bpk"));
            save_streamed(&net, &ours, None).unwrap();
            net.clone().into_record().save(&burns).unwrap();
            let (a, b) = (
                std::fs::read(&ours).unwrap(),
                std::fs::read(&burns).unwrap(),
            );
            assert!(a.len() > 100, "{} bytes", a.len());
            assert!(
                a == b,
                "the files differ ({} and {} bytes)",
                a.len(),
                b.len()
            );
            let record = burn::store::ModuleRecord::load(&ours).unwrap();
            let back = net.clone().load_record(record);
            assert_eq!(
                back.fc.weight.val().into_data(),
                net.fc.weight.val().into_data()
            );

            // ZeRO stage 3: a skeleton holding the weight and bias empty, their values fed in
            // the module's order as the writer reaches them, writes the same file.
            let (weight, bias) = (net.fc.weight.clone(), net.fc.bias.clone().unwrap());
            let ids = [weight.id, bias.id];
            let values = [
                weight.val().into_data().into_bytes(),
                bias.val().into_data().into_bytes(),
            ];
            let shapes = [weight.val().shape(), bias.val().shape()];
            let mut skeleton = net.clone();
            skeleton.fc.weight = weight.map(|t| Tensor::empty([0, 0], &t.device()));
            skeleton.fc.bias = Some(bias.map(|t| Tensor::empty([0], &t.device())));
            let shape = |id: &ParamId| ids.iter().position(|i| i == id).map(|k| shapes[k].clone());
            let fed_file = dir.path().join("fed.bpk");
            let order = [0, 1];
            let mut feed = |send: &mut dyn FnMut(u64, Bytes) -> bool| {
                for k in order {
                    assert!(send(ids[k].val(), values[k].clone()));
                }
                Ok(())
            };
            let fed = Fed {
                shape: &shape,
                feed: &mut feed,
            };
            save_streamed(&skeleton, &fed_file, Some(fed)).unwrap();
            assert!(
                std::fs::read(&fed_file).unwrap() == b,
                "the fed file differs"
            );

            // Fed out of order: refused by name, no file left (on a thread of its own: a
            // writer that stopped must not leave the feed waiting).
            let wrong = dir.path().join("wrong.bpk");
            let (sk, path, vals, dims) = (
                skeleton.clone(),
                wrong.clone(),
                values.clone(),
                shapes.clone(),
            );
            let e = bounded("a feed out of order", move || {
                let shape =
                    |id: &ParamId| ids.iter().position(|i| i == id).map(|k| dims[k].clone());
                let mut feed = |send: &mut dyn FnMut(u64, Bytes) -> bool| {
                    // The writer takes the bias where the weight was due, refuses it and
                    // stops taking more.
                    assert!(send(ids[1].val(), vals[1].clone()));
                    assert!(!send(ids[0].val(), vals[0].clone()));
                    Ok(())
                };
                let fed = Fed {
                    shape: &shape,
                    feed: &mut feed,
                };
                save_streamed(&sk, &path, Some(fed))
            })
            .unwrap_err();
            assert!(e.contains("came out of order"), "{e}");
            assert!(!wrong.exists());

            // A feed that fails (a peer gone mid-gather): its error, no file left.
            let failed = dir.path().join("failed.bpk");
            let mut feed = |send: &mut dyn FnMut(u64, Bytes) -> bool| {
                send(ids[0].val(), values[0].clone());
                Err(HearthError::Training("rank 1 is gone".into()))
            };
            let fed = Fed {
                shape: &shape,
                feed: &mut feed,
            };
            let e = save_streamed(&skeleton, &failed, Some(fed)).unwrap_err();
            assert!(e.contains("rank 1 is gone"), "{e}");
            assert!(!failed.exists());
        }
    }

    /// A tensor fed in pieces (a matrix ZeRO stage 3 gathers a piece of rows at a time) is
    /// written as Burn writes it whole, byte for byte: pieces of uneven lengths, across the
    /// writer's 8 MiB windows (the weight is 9 MB). Pieces that stop short, or another
    /// tensor's bytes among them, leave no file and say why.
    #[test]
    fn a_tensor_fed_in_pieces_is_written_as_burn_writes_it_whole() {
        use burn::module::Module;
        use burn::nn::{Linear, LinearConfig};
        use burn::prelude::Tensor;
        #[derive(Module, Debug)]
        struct Net {
            fc: Linear,
        }
        let device = burn::prelude::Device::flex();
        let net = Net {
            fc: LinearConfig::new(1500, 1500).init(&device),
        };
        let dir = tempfile::tempdir().unwrap();
        let burns = dir.path().join("burns.bpk");
        net.clone().into_record().save(&burns).unwrap();
        let want = std::fs::read(&burns).unwrap();
        let (weight, bias) = (net.fc.weight.clone(), net.fc.bias.clone().unwrap());
        let ids = [weight.id, bias.id];
        let shapes = [weight.val().shape(), bias.val().shape()];
        let w = weight.val().into_data().into_bytes();
        let b = bias.val().into_data().into_bytes();
        assert!(w.len() > 8 << 20, "{} bytes: more than one window", w.len());
        // Pieces of 333 rows (1,998,000 bytes) and the 168 left: windows end inside pieces.
        let pieces: Vec<Bytes> = w
            .chunks(333 * 1500 * 4)
            .map(|c| Bytes::from_bytes_vec(c.to_vec()))
            .collect();
        assert_eq!(pieces.len(), 5);
        let mut skeleton = net.clone();
        skeleton.fc.weight = weight.map(|t| Tensor::empty([0, 0], &t.device()));
        skeleton.fc.bias = Some(bias.map(|t| Tensor::empty([0], &t.device())));

        // What the feed sends, by index: 0-4 the weight's pieces, 5 the bias whole.
        let write = |name: &str, order: Vec<usize>| {
            let path = dir.path().join(name);
            let (sk, at, pieces, b, shapes) = (
                skeleton.clone(),
                path.clone(),
                pieces.clone(),
                b.clone(),
                shapes.clone(),
            );
            let written = bounded(name, move || {
                let shape =
                    |id: &ParamId| ids.iter().position(|i| i == id).map(|k| shapes[k].clone());
                let mut feed = |send: &mut dyn FnMut(u64, Bytes) -> bool| {
                    for &k in &order {
                        let _ = match k {
                            5 => send(ids[1].val(), b.clone()),
                            k => send(ids[0].val(), pieces[k].clone()),
                        };
                    }
                    Ok(())
                };
                let fed = Fed {
                    shape: &shape,
                    feed: &mut feed,
                };
                save_streamed(&sk, &at, Some(fed))
            });
            (written, path)
        };
        let (written, path) = write("pieces.bpk", vec![0, 1, 2, 3, 4, 5]);
        written.unwrap();
        assert!(std::fs::read(&path).unwrap() == want, "the file differs");

        let (written, path) = write("short.bpk", vec![0, 1, 2]);
        let e = written.unwrap_err();
        assert!(e.contains("stopped coming"), "{e}");
        assert!(!path.exists());

        let (written, path) = write("mixed.bpk", vec![0, 1, 5, 2, 3, 4]);
        let e = written.unwrap_err();
        assert!(e.contains("came out of order"), "{e}");
        assert!(!path.exists());
    }
}
