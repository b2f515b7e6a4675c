//! The graph under construction and the protobuf messages of its parts (onnx.proto's
//! `NodeProto`, `AttributeProto`, `TensorProto`, `ValueInfoProto`).

use burn::prelude::*;

use crate::proto::Proto;
use crate::{HearthError, Result};

pub(super) fn export_error(reason: String) -> HearthError {
    HearthError::InvalidArgument(format!("ONNX export: {reason}"))
}

/// A dimension of a graph input or output.
#[derive(Clone, Copy)]
pub(super) enum Dim {
    Fixed(usize),
    Named(&'static str),
}

/// `ValueInfoProto`: a float tensor's name and shape.
pub(super) fn value_info(name: &str, dims: &[Dim]) -> Proto {
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
pub(super) enum Attr {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
}

/// One operator node.
pub(super) struct Node {
    op: &'static str,
    name: String,
    inputs: Vec<String>,
    pub(super) output: String,
    attrs: Vec<(&'static str, Attr)>,
}

impl Node {
    pub(super) fn encode(self) -> Proto {
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
pub(super) struct Graph {
    pub(super) nodes: Vec<Node>,
    pub(super) initializers: Vec<Proto>,
    /// Node names given so far (a name given twice gets a number).
    names: std::collections::HashSet<String>,
}

impl Graph {
    /// Adds `op` on `inputs`, named `name` (its output is named the same); returns the output.
    pub(super) fn node(
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
    pub(super) fn weight<const D: usize>(
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
    pub(super) fn ints(&mut self, name: &str, values: &[i64]) -> String {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(name, &[values.len()], INT64, &raw);
        name.to_string()
    }

    /// An f32 initializer from values.
    pub(super) fn floats(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
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
