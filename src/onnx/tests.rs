//! The graph's structure, read back from its bytes: names and shapes against the torchvision
//! export, every node's inputs defined before it, the dynamic batch. The values are checked in
//! onnxruntime against PyTorch's logits (`cli/tests/onnx.rs`).

use std::collections::{BTreeMap, BTreeSet};

use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_models::{BlockKind, DenseNetConfig, ModelConfig, ResNetConfig, VggConfig, VggLayer};

use super::*;
use crate::proto::{Field, Fields};

/// What the tests read back of a `ModelProto`.
#[derive(Default, Debug)]
struct Decoded {
    ir_version: u64,
    opset: u64,
    /// (op type, inputs, output) per node, in order.
    nodes: Vec<(String, Vec<String>, String)>,
    /// Initializer name → dims.
    initializers: BTreeMap<String, Vec<usize>>,
    inputs: Vec<(String, Vec<String>)>,
    outputs: Vec<(String, Vec<String>)>,
    metadata: Vec<(String, String)>,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A message's (number, bytes) fields and its (number, varint) fields.
type ByNumber<'a> = (Vec<(u64, &'a [u8])>, Vec<(u64, u64)>);

/// Every (number, bytes) and (number, varint) field of one message.
fn fields(b: &[u8]) -> ByNumber<'_> {
    let (mut bytes, mut ints) = (Vec::new(), Vec::new());
    let mut f = Fields::new(b);
    while let Some((n, field)) = f.next().unwrap() {
        match field {
            Field::Bytes(v) => bytes.push((n, v)),
            Field::Varint(v) => ints.push((n, v)),
            _ => {}
        }
    }
    (bytes, ints)
}

fn value_info(b: &[u8]) -> (String, Vec<String>) {
    let (bytes, _) = fields(b);
    let mut name = String::new();
    let mut dims = Vec::new();
    for (n, v) in bytes {
        match n {
            1 => name = text(v),
            2 => {
                let tensor = fields(v).0[0].1;
                let shape = fields(tensor)
                    .0
                    .into_iter()
                    .find(|(n, _)| *n == 2)
                    .unwrap()
                    .1;
                for (_, dim) in fields(shape).0 {
                    let (b, i) = fields(dim);
                    dims.push(match (b.first(), i.first()) {
                        (Some((2, p)), _) => text(p),
                        (_, Some((1, v))) => v.to_string(),
                        other => panic!("a dimension of neither kind: {other:?}"),
                    });
                }
            }
            _ => {}
        }
    }
    (name, dims)
}

fn decode(b: &[u8]) -> Decoded {
    let mut d = Decoded::default();
    let (bytes, ints) = fields(b);
    d.ir_version = ints.iter().find(|(n, _)| *n == 1).unwrap().1;
    for (n, v) in bytes {
        match n {
            8 => d.opset = fields(v).1.iter().find(|(n, _)| *n == 2).unwrap().1,
            14 => {
                let e = fields(v).0;
                d.metadata.push((text(e[0].1), text(e[1].1)));
            }
            7 => {
                for (n, v) in fields(v).0 {
                    match n {
                        1 => {
                            let (b, _) = fields(v);
                            let get =
                                |k| b.iter().filter(move |(n, _)| *n == k).map(|(_, v)| text(v));
                            let op = get(4).next().unwrap();
                            let out = get(2).next().unwrap();
                            d.nodes.push((op, get(1).collect(), out));
                        }
                        5 => {
                            let (b, i) = fields(v);
                            let name = text(b.iter().find(|(n, _)| *n == 8).unwrap().1);
                            let dims = i.iter().filter(|(n, _)| *n == 1).map(|(_, v)| *v as usize);
                            d.initializers.insert(name, dims.collect());
                        }
                        11 => d.inputs.push(value_info(v)),
                        12 => d.outputs.push(value_info(v)),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    d
}

fn configs() -> Vec<ModelConfig> {
    use VggLayer::{Conv, Pool};
    vec![
        ModelConfig::ResNet(
            ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 10)
                .with_stem_width(16)
                .with_stage_widths([16, 32, 64, 128]),
        ),
        ModelConfig::ResNet(
            ResNetConfig::new(BlockKind::Bottleneck, [2, 1, 1, 1], 7)
                .with_stem_width(16)
                .with_stage_widths([8, 16, 32, 64]),
        ),
        ModelConfig::DenseNet(DenseNetConfig::new(8, vec![2, 2, 2, 2], 16, 5)),
        ModelConfig::Vgg(
            VggConfig::new(vec![Conv(8), Pool, Conv(16), Pool, Conv(32), Pool], true, 6)
                .with_hidden(16),
        ),
    ]
}

#[test]
fn every_family_s_graph_has_torchvision_s_weights_and_a_dynamic_batch() {
    let device = Device::flex();
    let dir = tempfile::tempdir().unwrap();
    for config in configs() {
        let model = config.init(&device).unwrap();
        let family = model.family();
        let meta = vec![("class_names".to_string(), "[\"a\"]".to_string())];
        let (bytes, summary) = encode(&model, [32, 40], &meta).unwrap();
        assert_eq!(summary.bytes, bytes.len());
        let d = decode(&bytes);
        assert_eq!((d.ir_version, d.opset), (7, 13), "{family}");
        assert_eq!(d.metadata, meta, "{family}");
        assert_eq!(d.nodes.len(), summary.nodes, "{family}");
        assert_eq!(d.initializers.len(), summary.initializers, "{family}");

        // The weights are torchvision's state_dict, under its names and in its layouts (the
        // linear layers' [out, in] too), batch norm's counters aside.
        let st = dir.path().join(format!("{family}.safetensors"));
        hearth_models::export_torchvision(&model, &st).unwrap();
        let file = std::fs::read(&st).unwrap();
        let file = safetensors::SafeTensors::deserialize(&file).unwrap();
        let torchvision: BTreeMap<String, Vec<usize>> = file
            .tensors()
            .into_iter()
            .filter(|(k, _)| !k.ends_with("num_batches_tracked"))
            .map(|(k, v)| (k, v.shape().to_vec()))
            .collect();
        let weights: BTreeMap<String, Vec<usize>> = d
            .initializers
            .iter()
            .filter(|(k, _)| !k.starts_with("avgpool."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(weights, torchvision, "{family}: the graph's weights");

        // Topological: each node reads the input, a weight, or an earlier node's output.
        let mut defined: BTreeSet<String> = d.initializers.keys().cloned().collect();
        defined.insert(INPUT.into());
        for (op, inputs, out) in &d.nodes {
            for i in inputs {
                assert!(
                    defined.contains(i),
                    "{family}: {op} reads {i} before it exists"
                );
            }
            assert!(defined.insert(out.clone()), "{family}: {out} written twice");
        }
        let classes = model.num_classes().to_string();
        assert_eq!(d.nodes.last().unwrap().2, OUTPUT, "{family}");
        assert_eq!(
            d.inputs,
            [(
                INPUT.to_string(),
                vec!["batch".into(), "3".into(), "32".into(), "40".into()]
            )],
            "{family}"
        );
        assert_eq!(
            d.outputs,
            [(OUTPUT.to_string(), vec!["batch".into(), classes])],
            "{family}"
        );
        // One node per layer: a Conv per convolution weight, a BatchNormalization per norm.
        let count = |op: &str| d.nodes.iter().filter(|n| n.0 == op).count();
        let convs = torchvision.values().filter(|s| s.len() == 4).count();
        let norms = torchvision
            .keys()
            .filter(|k| k.ends_with("running_mean"))
            .count();
        let linears = torchvision.values().filter(|s| s.len() == 2).count();
        assert_eq!(count("Conv"), convs, "{family}");
        assert_eq!(count("BatchNormalization"), norms, "{family}");
        assert_eq!(count("Gemm"), linears, "{family}");
    }
}

#[test]
fn the_pooling_matrix_is_pytorch_s_adaptive_average_pool() {
    let device = Device::flex();
    for (hw, out) in [
        ([4, 4], [7, 7]),
        ([5, 3], [2, 2]),
        ([7, 7], [3, 3]),
        ([1, 1], [7, 7]),
    ] {
        let x = Tensor::<4>::random(
            [1, 2, hw[0], hw[1]],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let expected =
            burn::tensor::module::adaptive_avg_pool2d(x.clone(), out).reshape([2, out[0] * out[1]]);
        let m = Tensor::<2>::from_data(
            TensorData::new(
                families::adaptive_bins(hw, out),
                [hw[0] * hw[1], out[0] * out[1]],
            ),
            &device,
        );
        let got = x.reshape([2, hw[0] * hw[1]]).matmul(m);
        let diff = (got - expected).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-6, "{hw:?} to {out:?}: {diff}");
    }
}

#[test]
fn an_input_below_the_networks_minimum_is_refused_by_size() {
    let device = Device::flex();
    let model = configs()[0].init(&device).unwrap();
    let err = encode(&model, [16, 224], &[]).unwrap_err().to_string();
    assert!(
        err.contains("16x224") && err.contains("at least 32"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/model.onnx");
    let err = export_onnx(&model, [32, 32], &[], &missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.onnx"), "{err}");
}
