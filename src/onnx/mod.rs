//! A trained model out to ONNX (`hearth export --format onnx`): the ResNet, VGG and DenseNet
//! families as an inference graph of standard operators (opset 13), for onnxruntime, TensorRT,
//! OpenVINO and the like.
//!
//! The graph takes `input`, `[batch, 3, H, W]` f32 with the batch a dynamic axis and the image
//! size fixed at export, and gives `logits`, `[batch, classes]`: what the model's `forward`
//! gives (no sigmoid or softmax; a multi-label model's probabilities are the logits' sigmoid).
//! Batch norm is the inference form (running statistics), dropout is gone. Weights are the
//! graph's initializers, named by torchvision's state_dict keys (`layer1.0.conv1.weight`).
//!
//! The model is written as protobuf by hand (`src/proto.rs`): ONNX's `ModelProto`,
//! `GraphProto`, `NodeProto`, `AttributeProto`, `TensorProto` and `ValueInfoProto`, the fields
//! of onnx.proto that a graph of this kind needs.

mod families;

use std::path::Path;

use burn::prelude::*;
use hearth_models::Classifier;

use crate::proto::Proto;
use crate::{HearthError, Result};

/// The operator set the graph is written for (onnxruntime 1.8 and later run it).
pub const OPSET: i64 = 13;
/// ONNX's IR version that goes with [`OPSET`].
const IR_VERSION: i64 = 7;
/// The graph's input and output names.
pub const INPUT: &str = "input";
pub const OUTPUT: &str = "logits";

/// What [`export_onnx`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnnxSummary {
    /// Operator nodes in the graph.
    pub nodes: usize,
    /// Weight tensors (initializers).
    pub initializers: usize,
    /// Bytes of the file.
    pub bytes: usize,
}

/// Writes `model` to `path` as an ONNX model whose input is `[batch, 3, size[0], size[1]]`
/// (height, width), the batch dynamic, with `metadata` as the model's metadata properties
/// (`hearth export` stores the class names and the preprocessing there). The file appears
/// whole or not at all. Errors name what cannot be exported (a padding ONNX has no form for,
/// a size too small for the network) or why the file could not be written.
pub fn export_onnx(
    model: &Classifier,
    size: [usize; 2],
    metadata: &[(String, String)],
    path: &Path,
) -> Result<OnnxSummary> {
    let bytes = encode(model, size, metadata)?;
    let summary = bytes.1;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let written = std::fs::write(&partial, &bytes.0).and_then(|()| std::fs::rename(&partial, path));
    if let Err(source) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(HearthError::Write {
            path: path.to_path_buf(),
            source,
        });
    }
    Ok(summary)
}

/// The model's ONNX bytes, and what they hold ([`export_onnx`] without the file).
pub fn encode(
    model: &Classifier,
    size: [usize; 2],
    metadata: &[(String, String)],
) -> Result<(Vec<u8>, OnnxSummary)> {
    let min = hearth_models::MIN_INPUT_SIZE;
    if size.iter().any(|&s| s < min) {
        return Err(export_error(format!(
            "an input of {}x{}: the networks take images of at least {min}x{min}",
            size[0], size[1]
        )));
    }
    let mut g = Graph::default();
    let x = INPUT.to_string();
    let logits = match model {
        Classifier::ResNet(m) => families::resnet(&mut g, m, x)?,
        Classifier::Vgg(m) => families::vgg(&mut g, m, x, size)?,
        Classifier::DenseNet(m) => families::densenet(&mut g, m, x)?,
    };
    let classes = model.num_classes();
    // The logits are the last node's output, which takes the graph's output name.
    match g.nodes.last_mut() {
        Some(last) if last.output == logits => last.output = OUTPUT.into(),
        _ => {
            return Err(export_error(
                "the logits are not the graph's last node".into(),
            ));
        }
    }
    let summary = OnnxSummary {
        nodes: g.nodes.len(),
        initializers: g.initializers.len(),
        bytes: 0,
    };
    let mut graph = Proto::default();
    for node in g.nodes {
        graph.message(1, node.encode());
    }
    graph.string(2, model.family());
    for init in g.initializers {
        graph.message(5, init);
    }
    let batch = Dim::Named("batch");
    graph.message(
        11,
        value_info(
            INPUT,
            &[
                batch,
                Dim::Fixed(3),
                Dim::Fixed(size[0]),
                Dim::Fixed(size[1]),
            ],
        ),
    );
    graph.message(12, value_info(OUTPUT, &[batch, Dim::Fixed(classes)]));
    let mut opset = Proto::default();
    opset.string(1, "").int(2, OPSET);
    let mut m = Proto::default();
    m.int(1, IR_VERSION)
        .string(2, "hearth")
        .string(3, env!("CARGO_PKG_VERSION"))
        .message(7, graph)
        .message(8, opset);
    for (key, value) in metadata {
        let mut entry = Proto::default();
        entry.string(1, key).string(2, value);
        m.message(14, entry);
    }
    let summary = OnnxSummary {
        bytes: m.0.len(),
        ..summary
    };
    Ok((m.0, summary))
}

fn export_error(reason: String) -> HearthError {
    HearthError::InvalidArgument(format!("ONNX export: {reason}"))
}

/// A dimension of a graph input or output.
#[derive(Clone, Copy)]
enum Dim {
    Fixed(usize),
    Named(&'static str),
}

/// `ValueInfoProto`: a float tensor's name and shape.
fn value_info(name: &str, dims: &[Dim]) -> Proto {
    let mut shape = Proto::default();
    for d in dims {
        let mut dim = Proto::default();
        match d {
            Dim::Fixed(n) => dim.int(1, *n as i64),
            Dim::Named(s) => dim.string(2, s),
        };
        shape.message(1, dim);
    }
    let mut tensor = Proto::default();
    tensor.int(1, FLOAT).message(2, shape);
    let mut ty = Proto::default();
    ty.message(1, tensor);
    let mut v = Proto::default();
    v.string(1, name).message(2, ty);
    v
}

/// TensorProto's data types.
const FLOAT: i64 = 1;
const INT64: i64 = 7;

/// An attribute of a node.
pub(crate) enum Attr {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
}

/// One operator node.
pub(crate) struct Node {
    op: &'static str,
    name: String,
    inputs: Vec<String>,
    output: String,
    attrs: Vec<(&'static str, Attr)>,
}

impl Node {
    fn encode(self) -> Proto {
        let mut n = Proto::default();
        for i in &self.inputs {
            n.string(1, i);
        }
        n.string(2, &self.output)
            .string(3, &self.name)
            .string(4, self.op);
        for (name, attr) in self.attrs {
            let mut a = Proto::default();
            a.string(1, name);
            match attr {
                Attr::Float(f) => a.float(2, f).int(20, 1),
                Attr::Int(i) => a.int(3, i).int(20, 2),
                Attr::Ints(v) => {
                    for i in v {
                        a.int(8, i);
                    }
                    a.int(20, 7)
                }
            };
            n.message(5, a);
        }
        n
    }
}

/// The graph being built: its nodes in order and its initializers.
#[derive(Default)]
pub(crate) struct Graph {
    nodes: Vec<Node>,
    initializers: Vec<Proto>,
    /// Node names given so far (a name given twice gets a number).
    names: std::collections::HashSet<String>,
}

impl Graph {
    /// Adds `op` on `inputs`, named `name` (its output is named the same); returns the output.
    pub(crate) fn node(
        &mut self,
        op: &'static str,
        name: &str,
        inputs: &[&str],
        attrs: Vec<(&'static str, Attr)>,
    ) -> String {
        let base = format!("{name}/{op}");
        let (mut name, mut n) = (base.clone(), 1);
        while !self.names.insert(name.clone()) {
            n += 1;
            name = format!("{base}:{n}");
        }
        self.nodes.push(Node {
            op,
            name: name.clone(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            output: name.clone(),
            attrs,
        });
        name
    }

    /// An f32 initializer `name` holding `tensor`.
    pub(crate) fn weight<const D: usize>(
        &mut self,
        name: &str,
        tensor: Tensor<D>,
    ) -> Result<String> {
        let dims = tensor.dims();
        let values = tensor
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| export_error(format!("reading {name}: {e:?}")))?;
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(name, &dims, FLOAT, &raw);
        Ok(name.to_string())
    }

    /// An int64 initializer (a shape for `Reshape`).
    pub(crate) fn ints(&mut self, name: &str, values: &[i64]) -> String {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(name, &[values.len()], INT64, &raw);
        name.to_string()
    }

    /// An f32 initializer from values.
    pub(crate) fn floats(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(name, dims, FLOAT, &raw);
        name.to_string()
    }

    fn initializer(&mut self, name: &str, dims: &[usize], dtype: i64, raw: &[u8]) {
        let mut t = Proto::default();
        for &d in dims {
            t.int(1, d as i64);
        }
        t.int(2, dtype).string(8, name).bytes(9, raw);
        self.initializers.push(t);
    }
}

#[cfg(test)]
mod tests;
