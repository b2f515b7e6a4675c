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
mod graph;

use std::path::Path;

use hearth_models::Classifier;

use crate::Result;
use crate::proto::Proto;
use graph::{Dim, Graph, export_error, value_info};

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
    let (bytes, summary) = encode(model, size, metadata)?;
    crate::train::run_dir::write_atomic(path, &bytes)?;
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

#[cfg(test)]
mod tests;
