//! Each family's inference graph, layer by layer as its `forward` computes it, with
//! torchvision's names for the weights.

use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
use burn::nn::{BatchNorm, Linear, PaddingConfig2d};
use hearth_models::resnet::ResidualBlock;
use hearth_models::{DenseNet, ResNet, Vgg};

use super::graph::{Attr, Graph, export_error};
use crate::Result;

fn ints(v: &[usize]) -> Attr {
    Attr::Ints(v.iter().map(|&x| x as i64).collect())
}

/// ONNX's `pads` (top, left, bottom, right) of a layer's padding.
fn pads(padding: &PaddingConfig2d, layer: &str) -> Result<[usize; 4]> {
    match *padding {
        PaddingConfig2d::Valid => Ok([0; 4]),
        PaddingConfig2d::Explicit(top, left, bottom, right) => Ok([top, left, bottom, right]),
        PaddingConfig2d::Same => Err(export_error(format!(
            "{layer} has 'same' padding, which depends on the input size; only explicit \
             padding is exported"
        ))),
    }
}

/// An output side of a window of `kernel` (`dilation`) with `stride` over `side` padded by
/// `pad` in all; `None` where the window does not fit.
fn out_side(
    side: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
    ceil: bool,
) -> Option<usize> {
    let span = dilation * (kernel - 1) + 1;
    let room = (side + pad).checked_sub(span)?;
    let steps = if ceil {
        room.div_ceil(stride)
    } else {
        room / stride
    };
    Some(steps + 1)
}

/// The image size after a window layer, or an error naming the layer.
fn after(hw: [usize; 2], window: Window, layer: &str) -> Result<[usize; 2]> {
    let mut out = [0; 2];
    for a in 0..2 {
        let pad = window.pads[a] + window.pads[a + 2];
        out[a] = out_side(
            hw[a],
            window.kernel[a],
            window.stride[a],
            pad,
            window.dilation[a],
            window.ceil,
        )
        .ok_or_else(|| {
            export_error(format!(
                "the image is {}x{} at {layer}, too small for its {}x{} window; export with a \
                 larger input size",
                hw[0], hw[1], window.kernel[0], window.kernel[1]
            ))
        })?;
    }
    Ok(out)
}

#[derive(Clone, Copy)]
struct Window {
    kernel: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    pads: [usize; 4],
    ceil: bool,
}

fn conv_window(c: &Conv2d, name: &str) -> Result<Window> {
    Ok(Window {
        kernel: c.kernel_size,
        stride: c.stride,
        dilation: c.dilation,
        pads: pads(&c.padding, name)?,
        ceil: false,
    })
}

fn conv(g: &mut Graph, x: &str, name: &str, c: &Conv2d) -> Result<String> {
    let w = conv_window(c, name)?;
    let weight = g.weight(&format!("{name}.weight"), c.weight.val())?;
    let mut inputs = vec![x.to_string(), weight];
    if let Some(b) = &c.bias {
        inputs.push(g.weight(&format!("{name}.bias"), b.val())?);
    }
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let attrs = vec![
        ("kernel_shape", ints(&w.kernel)),
        ("strides", ints(&w.stride)),
        ("pads", ints(&w.pads)),
        ("dilations", ints(&w.dilation)),
        ("group", Attr::Int(c.groups as i64)),
    ];
    Ok(g.node("Conv", name, &inputs, attrs))
}

fn batch_norm(g: &mut Graph, x: &str, name: &str, bn: &BatchNorm) -> Result<String> {
    let scale = g.weight(&format!("{name}.weight"), bn.gamma.val())?;
    let bias = g.weight(&format!("{name}.bias"), bn.beta.val())?;
    let mean = g.weight(&format!("{name}.running_mean"), bn.running_mean.value())?;
    let var = g.weight(&format!("{name}.running_var"), bn.running_var.value())?;
    let attrs = vec![("epsilon", Attr::Float(bn.epsilon as f32))];
    Ok(g.node(
        "BatchNormalization",
        name,
        &[x, &scale, &bias, &mean, &var],
        attrs,
    ))
}

fn relu(g: &mut Graph, x: &str, name: &str) -> String {
    g.node("Relu", name, &[x], Vec::new())
}

fn max_pool_window(p: &MaxPool2d, name: &str) -> Result<Window> {
    Ok(Window {
        kernel: p.kernel_size,
        stride: p.stride,
        dilation: p.dilation,
        pads: pads(&p.padding, name)?,
        ceil: p.ceil_mode,
    })
}

fn max_pool(g: &mut Graph, x: &str, name: &str, p: &MaxPool2d) -> Result<String> {
    let w = max_pool_window(p, name)?;
    let attrs = vec![
        ("kernel_shape", ints(&w.kernel)),
        ("strides", ints(&w.stride)),
        ("pads", ints(&w.pads)),
        ("dilations", ints(&w.dilation)),
        ("ceil_mode", Attr::Int(i64::from(w.ceil))),
    ];
    Ok(g.node("MaxPool", name, &[x], attrs))
}

fn avg_pool(g: &mut Graph, x: &str, name: &str, p: &AvgPool2d) -> Result<String> {
    let attrs = vec![
        ("kernel_shape", ints(&p.kernel_size)),
        ("strides", ints(&p.stride)),
        ("pads", ints(&pads(&p.padding, name)?)),
        (
            "count_include_pad",
            Attr::Int(i64::from(p.count_include_pad)),
        ),
        ("ceil_mode", Attr::Int(i64::from(p.ceil_mode))),
    ];
    Ok(g.node("AveragePool", name, &[x], attrs))
}

/// `x · Wᵀ + b` with W in torchvision's `[out, in]` layout (Burn keeps `[in, out]`).
fn linear(g: &mut Graph, x: &str, name: &str, l: &Linear) -> Result<String> {
    let weight = g.weight(&format!("{name}.weight"), l.weight.val().transpose())?;
    let mut inputs = vec![x.to_string(), weight];
    if let Some(b) = &l.bias {
        inputs.push(g.weight(&format!("{name}.bias"), b.val())?);
    }
    let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    Ok(g.node("Gemm", name, &inputs, vec![("transB", Attr::Int(1))]))
}

/// Adaptive average pooling to `pool.output_size`, then flattening to `[batch, features]`.
/// To 1x1 it is `GlobalAveragePool`; to other sizes (VGG's 7x7) it needs the image size `hw`
/// at that point, and is one matrix product with PyTorch's bins (`floor(i·H/O)` to
/// `ceil((i+1)·H/O)`), which covers the sizes ONNX's `AveragePool` cannot (a 4x4 map to 7x7).
fn pool_and_flatten(
    g: &mut Graph,
    x: &str,
    name: &str,
    pool: &AdaptiveAvgPool2d,
    hw: Option<[usize; 2]>,
) -> Result<String> {
    let out = pool.output_size;
    if out == [1, 1] {
        let pooled = g.node("GlobalAveragePool", name, &[x], Vec::new());
        return Ok(g.node("Flatten", name, &[&pooled], vec![("axis", Attr::Int(1))]));
    }
    let hw = hw.ok_or_else(|| {
        export_error(format!(
            "{name} pools to {}x{}, which needs the image size at that point",
            out[0], out[1]
        ))
    })?;
    if hw == out {
        return Ok(g.node("Flatten", name, &[x], vec![("axis", Attr::Int(1))]));
    }
    let (cells, bins) = (hw[0] * hw[1], out[0] * out[1]);
    let m = adaptive_bins(hw, out);
    let matrix = g.floats(&format!("{name}.bins"), &[cells, bins], &m);
    let planes = g.ints(&format!("{name}.planes"), &[0, -1, cells as i64]);
    let flat = g.ints(&format!("{name}.flat"), &[0, -1]);
    let x = g.node(
        "Reshape",
        &format!("{name}.planes"),
        &[x, &planes],
        Vec::new(),
    );
    let x = g.node("MatMul", name, &[&x, &matrix], Vec::new());
    Ok(g.node("Reshape", &format!("{name}.flat"), &[&x, &flat], Vec::new()))
}

/// The `[H·W, Oh·Ow]` matrix of adaptive average pooling from `hw` to `out`: column (i, j)
/// averages PyTorch's bin (i, j), rows `floor(i·H/Oh)` to `ceil((i+1)·H/Oh)` and the same for
/// columns.
pub(super) fn adaptive_bins(hw: [usize; 2], out: [usize; 2]) -> Vec<f32> {
    let bins = out[0] * out[1];
    let mut m = vec![0.0f32; hw[0] * hw[1] * bins];
    for (i, j) in (0..out[0]).flat_map(|i| (0..out[1]).map(move |j| (i, j))) {
        let rows = i * hw[0] / out[0]..((i + 1) * hw[0]).div_ceil(out[0]);
        let cols = j * hw[1] / out[1]..((j + 1) * hw[1]).div_ceil(out[1]);
        let share = 1.0 / (rows.len() * cols.len()) as f32;
        for r in rows {
            for c in cols.clone() {
                m[(r * hw[1] + c) * bins + i * out[1] + j] = share;
            }
        }
    }
    m
}

fn residual_block(g: &mut Graph, x: &str, name: &str, b: &ResidualBlock) -> Result<String> {
    let identity = match &b.downsample {
        Some(ds) => {
            let y = conv(g, x, &format!("{name}.downsample.0"), &ds.conv)?;
            batch_norm(g, &y, &format!("{name}.downsample.1"), &ds.bn)?
        }
        None => x.to_string(),
    };
    let y = conv(g, x, &format!("{name}.conv1"), &b.conv1)?;
    let y = batch_norm(g, &y, &format!("{name}.bn1"), &b.bn1)?;
    let y = relu(g, &y, &format!("{name}.relu1"));
    let y = conv(g, &y, &format!("{name}.conv2"), &b.conv2)?;
    let mut y = batch_norm(g, &y, &format!("{name}.bn2"), &b.bn2)?;
    if let (Some(conv3), Some(bn3)) = (&b.conv3, &b.bn3) {
        y = relu(g, &y, &format!("{name}.relu2"));
        y = conv(g, &y, &format!("{name}.conv3"), conv3)?;
        y = batch_norm(g, &y, &format!("{name}.bn3"), bn3)?;
    }
    let sum = g.node("Add", name, &[&y, &identity], Vec::new());
    Ok(relu(g, &sum, &format!("{name}.relu")))
}

/// ResNet (`ResNet::forward`): stem, the four stages of residual blocks, pool, `fc`.
pub(super) fn resnet(g: &mut Graph, m: &ResNet, x: String) -> Result<String> {
    let y = conv(g, &x, "conv1", &m.conv1)?;
    let y = batch_norm(g, &y, "bn1", &m.bn1)?;
    let y = relu(g, &y, "relu");
    let mut y = max_pool(g, &y, "maxpool", &m.maxpool)?;
    let stages = [&m.layer1, &m.layer2, &m.layer3, &m.layer4];
    for (s, blocks) in stages.iter().enumerate() {
        for (i, block) in blocks.iter().enumerate() {
            y = residual_block(g, &y, &format!("layer{}.{i}", s + 1), block)?;
        }
    }
    let y = pool_and_flatten(g, &y, "avgpool", &m.avgpool, None)?;
    linear(g, &y, "fc", &m.fc)
}

/// VGG (`Vgg::forward`): the convolutions with their pools under torchvision's
/// `nn.Sequential` indices, the adaptive pool, the three linear layers.
pub(super) fn vgg(g: &mut Graph, m: &Vgg, x: String, size: [usize; 2]) -> Result<String> {
    let mut hw = size;
    let mut index = usize::from(m.leading_pool);
    let pool = max_pool_window(&m.maxpool, "features.pool")?;
    let mut y = x;
    if m.leading_pool {
        hw = after(hw, pool, "features.0")?;
        y = max_pool(g, &y, "features.0", &m.maxpool)?;
    }
    for (layer, &pooled) in m.features.iter().zip(&m.pool_after) {
        let name = format!("features.{index}");
        hw = after(hw, conv_window(&layer.conv, &name)?, &name)?;
        y = conv(g, &y, &name, &layer.conv)?;
        index += 1;
        if let Some(bn) = &layer.bn {
            y = batch_norm(g, &y, &format!("features.{index}"), bn)?;
            index += 1;
        }
        y = relu(g, &y, &format!("features.{index}"));
        index += 1;
        if pooled {
            let name = format!("features.{index}");
            hw = after(hw, pool, &name)?;
            y = max_pool(g, &y, &name, &m.maxpool)?;
            index += 1;
        }
    }
    let y = pool_and_flatten(g, &y, "avgpool", &m.avgpool, Some(hw))?;
    let c = &m.classifier;
    let y = linear(g, &y, "classifier.0", &c.fc1)?;
    let y = relu(g, &y, "classifier.1");
    let y = linear(g, &y, "classifier.3", &c.fc2)?;
    let y = relu(g, &y, "classifier.4");
    linear(g, &y, "classifier.6", &c.fc3)
}

/// `norm`, ReLU, `conv` (a dense layer's halves and a transition's start).
fn norm_relu_conv(
    g: &mut Graph,
    x: &str,
    names: [&str; 2],
    bn: &BatchNorm,
    c: &Conv2d,
) -> Result<String> {
    let y = batch_norm(g, x, names[0], bn)?;
    let y = relu(g, &y, names[0]);
    conv(g, &y, names[1], c)
}

/// DenseNet (`DenseNet::forward`): stem, dense blocks (each layer's input the concatenation
/// of all before it) with their transitions, `norm5`, ReLU, pool, `classifier`.
pub(super) fn densenet(g: &mut Graph, m: &DenseNet, x: String) -> Result<String> {
    let f = &m.features;
    let y = conv(g, &x, "features.conv0", &f.conv0)?;
    let y = batch_norm(g, &y, "features.norm0", &f.norm0)?;
    let y = relu(g, &y, "features.relu0");
    let mut y = max_pool(g, &y, "features.pool0", &f.pool0)?;
    for (i, block) in f.blocks.iter().enumerate() {
        let block_name = format!("features.denseblock{}", i + 1);
        let mut features = vec![y.clone()];
        for (j, layer) in block.layers.iter().enumerate() {
            let name = format!("{block_name}.denselayer{}", j + 1);
            let input = concat(g, &features, &name);
            let n = |part: &str| format!("{name}.{part}");
            let h = norm_relu_conv(
                g,
                &input,
                [&n("norm1"), &n("conv1")],
                &layer.norm1,
                &layer.conv1,
            )?;
            let h = norm_relu_conv(
                g,
                &h,
                [&n("norm2"), &n("conv2")],
                &layer.norm2,
                &layer.conv2,
            )?;
            features.push(h);
        }
        y = concat(g, &features, &block_name);
        if let Some(t) = f.transitions.get(i) {
            let name = format!("features.transition{}", i + 1);
            let n = |part: &str| format!("{name}.{part}");
            let h = norm_relu_conv(g, &y, [&n("norm"), &n("conv")], &t.norm, &t.conv)?;
            y = avg_pool(g, &h, &n("pool"), &t.pool)?;
        }
    }
    let y = batch_norm(g, &y, "features.norm5", &f.norm5)?;
    let y = relu(g, &y, "features.relu5");
    let y = pool_and_flatten(g, &y, "avgpool", &m.avgpool, None)?;
    linear(g, &y, "classifier", &m.classifier)
}

/// The channels of `parts` side by side (the one part itself when alone).
fn concat(g: &mut Graph, parts: &[String], name: &str) -> String {
    if let [one] = parts {
        return one.clone();
    }
    let inputs: Vec<&str> = parts.iter().map(String::as_str).collect();
    g.node("Concat", name, &inputs, vec![("axis", Attr::Int(1))])
}
