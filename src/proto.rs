//! The protocol-buffer wire format, by hand, for the few messages Hearth writes: TensorBoard's
//! events ([`crate::tensorboard`]) and ONNX models ([`crate::onnx`]). A protobuf crate with
//! the projects' `.proto` files would be a build step for a dozen messages.

/// A minimal protobuf writer: fields in the order given.
#[derive(Default)]
pub(crate) struct Proto(pub(crate) Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }
    pub(crate) fn uint(&mut self, field: u32, v: u64) -> &mut Self {
        self.key(field, 0);
        self.varint(v);
        self
    }
    /// An `int64` (a negative one takes ten bytes, as protobuf encodes it).
    pub(crate) fn int(&mut self, field: u32, v: i64) -> &mut Self {
        self.uint(field, v as u64)
    }
    pub(crate) fn double(&mut self, field: u32, v: f64) -> &mut Self {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn float(&mut self, field: u32, v: f32) -> &mut Self {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Self {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn string(&mut self, field: u32, s: &str) -> &mut Self {
        self.bytes(field, s.as_bytes())
    }
    pub(crate) fn message(&mut self, field: u32, m: Proto) -> &mut Self {
        self.bytes(field, &m.0)
    }
}

/// A protobuf reader over one message's bytes.
pub(crate) struct Fields<'a> {
    b: &'a [u8],
}

/// One field's value, by wire type.
pub(crate) enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

impl<'a> Fields<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Self { b }
    }
    fn varint(&mut self) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self.b.split_first().ok_or("a varint ends early")?;
            self.b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!("a field of {n} bytes, {} left", self.b.len()));
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    /// The next field number and value, `None` at the end.
    #[allow(clippy::should_implement_trait)]
    pub(crate) fn next(&mut self) -> std::result::Result<Option<(u64, Field<'a>)>, String> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => Field::Fixed64(self.take(8)?.try_into().map_err(|_| "fixed64")?),
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| "a length too large")?;
                Field::Bytes(self.take(n)?)
            }
            5 => Field::Fixed32(self.take(4)?.try_into().map_err(|_| "fixed32")?),
            w => return Err(format!("wire type {w}")),
        };
        Ok(Some((key >> 3, field)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_writer_writes_the_reader_reads() {
        let mut inner = Proto::default();
        inner.string(1, "conv");
        let mut m = Proto::default();
        m.uint(1, 300)
            .int(2, -2)
            .double(3, 1.5)
            .float(4, -0.25)
            .message(5, inner);
        let mut f = Fields::new(&m.0);
        let mut seen = Vec::new();
        while let Some((n, field)) = f.next().unwrap() {
            let v = match field {
                Field::Varint(v) => format!("{}", v as i64),
                Field::Fixed64(b) => format!("{}", f64::from_le_bytes(b)),
                Field::Fixed32(b) => format!("{}", f32::from_le_bytes(b)),
                Field::Bytes(b) => format!("{} bytes", b.len()),
            };
            seen.push(format!("{n}={v}"));
        }
        assert_eq!(seen, ["1=300", "2=-2", "3=1.5", "4=-0.25", "5=6 bytes"]);
        // Cut anywhere, a message is an error, not a panic.
        for cut in 0..m.0.len() {
            let mut f = Fields::new(&m.0[..cut]);
            let mut result = Ok(None);
            for _ in 0..10 {
                result = f.next();
                if !matches!(result, Ok(Some(_))) {
                    break;
                }
            }
            assert!(
                !matches!(result, Ok(Some(_))),
                "cut at {cut}: still reading"
            );
        }
    }
}
