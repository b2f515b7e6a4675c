//! PyTorch's own checkpoint format, written: what `torch.save(state_dict, path)` produces and
//! `torch.load(path, weights_only=True)` reads back.
//!
//! The file is a zip archive (entries stored, not compressed) under one folder, `archive/`:
//! - `data.pkl`: a pickle (protocol 2) of a `collections.OrderedDict` from each key to
//!   `torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`, each
//!   storage a persistent id `('storage', torch.FloatStorage, '<n>', 'cpu', numel)`;
//! - `data/<n>`: each storage's bytes, little-endian, at a 64-byte boundary of the file as
//!   PyTorch aligns them (padding in the local header's extra field);
//! - `byteorder` (`little`) and `version` (`3`).
//!
//! Only the pickle opcodes and the globals `torch.load`'s weights-only unpickler allows are
//! used.

/// One tensor of a state dict: its key, element type, shape and little-endian bytes.
pub struct Entry<'a> {
    pub key: &'a str,
    pub dtype: Element,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// The element types a state dict of these networks holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    F32,
    I64,
}

impl Element {
    fn storage(self) -> &'static str {
        match self {
            Element::F32 => "FloatStorage",
            Element::I64 => "LongStorage",
        }
    }
    fn size(self) -> usize {
        match self {
            Element::F32 => 4,
            Element::I64 => 8,
        }
    }
}

/// The pickle of the state dict: an `OrderedDict` of rebuilt tensors, storage `n` for entry n.
fn pickle(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut p = Pickle(Vec::new());
    p.0.extend_from_slice(&[0x80, 2]); // PROTO 2
    p.global("collections", "OrderedDict");
    p.0.extend_from_slice(b")R"); // EMPTY_TUPLE, REDUCE: OrderedDict()
    p.0.push(b'('); // MARK
    for (n, e) in entries.iter().enumerate() {
        p.string(e.key);
        p.global("torch._utils", "_rebuild_tensor_v2");
        p.0.push(b'(');
        // The storage's persistent id.
        p.0.push(b'(');
        p.string("storage");
        p.global("torch", e.dtype.storage());
        p.string(&n.to_string());
        p.string("cpu");
        p.int(e.shape.iter().product::<usize>());
        p.0.extend_from_slice(b"tQ"); // TUPLE, BINPERSID
        p.int(0); // storage offset
        p.tuple(e.shape);
        let mut stride = vec![1; e.shape.len()];
        for i in (0..e.shape.len().saturating_sub(1)).rev() {
            stride[i] = stride[i + 1] * e.shape[i + 1];
        }
        p.tuple(&stride);
        p.0.push(0x89); // NEWFALSE: requires_grad
        p.global("collections", "OrderedDict");
        p.0.extend_from_slice(b")R"); // backward hooks: OrderedDict()
        p.0.extend_from_slice(b"tR"); // TUPLE, REDUCE: the tensor
    }
    p.0.extend_from_slice(b"u."); // SETITEMS, STOP
    p.0
}

struct Pickle(Vec<u8>);

impl Pickle {
    fn global(&mut self, module: &str, name: &str) {
        self.0.push(b'c');
        self.0.extend_from_slice(module.as_bytes());
        self.0.push(b'\n');
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(b'\n');
    }
    fn string(&mut self, s: &str) {
        self.0.push(b'X'); // BINUNICODE
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn int(&mut self, v: usize) {
        match u32::try_from(v) {
            Ok(v) if v < 0x8000_0000 => {
                self.0.push(b'J'); // BININT (signed 32-bit)
                self.0.extend_from_slice(&v.to_le_bytes());
            }
            _ => {
                // LONG1: little-endian two's complement, 8 bytes (always positive here).
                self.0.extend_from_slice(&[0x8a, 8]);
                self.0.extend_from_slice(&(v as u64).to_le_bytes());
            }
        }
    }
    fn tuple(&mut self, v: &[usize]) {
        self.0.push(b'(');
        for &x in v {
            self.int(x);
        }
        self.0.push(b't');
    }
}

/// A zip archive of stored entries, each entry's data starting at a multiple of 64 bytes.
#[derive(Default)]
struct Zip {
    out: Vec<u8>,
    central: Vec<u8>,
    count: u16,
}

impl Zip {
    fn add(&mut self, name: &str, data: &[u8]) -> Result<(), String> {
        let offset =
            u32::try_from(self.out.len()).map_err(|_| "over 4 GiB (zip64 is not written)")?;
        let size = u32::try_from(data.len()).map_err(|_| format!("{name}: over 4 GiB"))?;
        let crc = crc32fast::hash(data);
        // Local header (30 bytes) + name + an extra field padding the data to 64 bytes.
        let unpadded = self.out.len() + 30 + name.len() + 4;
        let pad = (64 - unpadded % 64) % 64;
        let mut h = Vec::with_capacity(30 + name.len() + 4 + pad);
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&[20, 0, 0, 0, 0, 0]); // version needed, flags, method (stored)
        h.extend_from_slice(&[0, 0, 0x21, 0]); // time 00:00, date 1980-01-01
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&((4 + pad) as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend_from_slice(&0x4246u16.to_le_bytes()); // "FB", PyTorch's padding field
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad, b'Z');
        self.out.extend_from_slice(&h);
        self.out.extend_from_slice(data);

        let c = &mut self.central;
        c.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        c.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0]); // made by, needed, flags, method
        c.extend_from_slice(&[0, 0, 0x21, 0]);
        c.extend_from_slice(&crc.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&(name.len() as u16).to_le_bytes());
        c.extend_from_slice(&[0; 12]); // extra, comment, disk, internal and external attributes
        c.extend_from_slice(&offset.to_le_bytes());
        c.extend_from_slice(name.as_bytes());
        self.count = self.count.checked_add(1).ok_or("over 65535 entries")?;
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<u8>, String> {
        let at = u32::try_from(self.out.len()).map_err(|_| "over 4 GiB (zip64 is not written)")?;
        let size = self.central.len() as u32;
        self.out.extend_from_slice(&self.central);
        self.out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        self.out.extend_from_slice(&[0; 4]); // this disk, the directory's disk
        self.out.extend_from_slice(&self.count.to_le_bytes());
        self.out.extend_from_slice(&self.count.to_le_bytes());
        self.out.extend_from_slice(&size.to_le_bytes());
        self.out.extend_from_slice(&at.to_le_bytes());
        self.out.extend_from_slice(&[0, 0]); // comment length
        Ok(self.out)
    }
}

/// The bytes of a `.pth` file holding `entries`; an error names an entry whose bytes do not
/// match its shape, or a file past the 4 GiB that zip without zip64 can hold.
pub fn encode(entries: &[Entry<'_>]) -> Result<Vec<u8>, String> {
    for e in entries {
        let want = e.shape.iter().product::<usize>() * e.dtype.size();
        if e.data.len() != want {
            return Err(format!(
                "{}: {} bytes for shape {:?} of {:?}",
                e.key,
                e.data.len(),
                e.shape,
                e.dtype
            ));
        }
    }
    let mut zip = Zip::default();
    zip.add("archive/data.pkl", &pickle(entries))?;
    zip.add("archive/byteorder", b"little")?;
    for (n, e) in entries.iter().enumerate() {
        zip.add(&format!("archive/data/{n}"), e.data)?;
    }
    zip.add("archive/version", b"3\n")?;
    zip.finish()
}
