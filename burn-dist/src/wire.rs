//! The frame every burn-dist message travels in.
//!
//! ```text
//! offset  size  field
//! 0       4     magic  b"HRTH"
//! 4       1     version (1)
//! 5       1     kind (Kind)
//! 6       2     reserved, zero
//! 8       4     membership epoch (u32, little-endian)
//! 12      8     sequence / tag (u64, little-endian): which operation and step
//! 20      8     payload length in bytes (u64, little-endian)
//! 28      len   payload: raw little-endian tensor bytes, or a small control message
//! ```
//!
//! [`Header::decode`] checks every field and returns an error, never panics, whatever the bytes
//! (the `fuzz/` target feeds it arbitrary input).

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"HRTH";
/// Wire version this build speaks.
pub const VERSION: u8 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 28;
/// Largest payload accepted (4 GiB): a length beyond it is treated as corruption.
pub const MAX_PAYLOAD: u64 = 4 << 30;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Rendezvous: a rank announcing itself to the coordinator.
    Hello = 1,
    /// Rendezvous: the coordinator's table of ranks and addresses.
    Table = 2,
    /// A collective's data (allreduce, broadcast, gathers).
    Collective = 3,
    /// Metric averaging (its own tag space, so it can run beside gradient traffic).
    Metric = 4,
    /// Barrier and other control traffic.
    Control = 5,
    /// Liveness.
    Heartbeat = 6,
    /// Conformance tests and user messages.
    User = 7,
    /// Pipeline parallelism: activations forward, activation gradients backward.
    Pipeline = 8,
    /// Parameter servers: workers' pushes and pulls, servers' answers.
    Ps = 9,
    /// Rendezvous with a secret: rank 0's certificate for a member's rank, and the member's
    /// answer that it now uses it.
    Issue = 10,
    /// The sharded optimizer of elastic training (its own tag space beside the step's control
    /// and metric traffic, with the run's `--compression`).
    Sharded = 11,
    /// ZeRO stage 3's gathers of parameters in an overlapped step, beside the gradient
    /// reductions on the exchange thread (which keep [`Kind::Collective`] and its arithmetic).
    Gather = 12,
}

impl Kind {
    /// Whether a frame of this kind goes out before the others that wait on its connection:
    /// ZeRO stage 3's parameter gathers in an overlapped step ([`Kind::Gather`]), which the
    /// step's compute waits on, while the gradient reductions beside them are needed only at
    /// the step's end.
    pub fn urgent(self) -> bool {
        self == Kind::Gather
    }

    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Table,
            3 => Kind::Collective,
            4 => Kind::Metric,
            5 => Kind::Control,
            6 => Kind::Heartbeat,
            7 => Kind::User,
            8 => Kind::Pipeline,
            9 => Kind::Ps,
            10 => Kind::Issue,
            11 => Kind::Sharded,
            12 => Kind::Gather,
            _ => return None,
        })
    }
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short(usize),
    #[error("bad magic {0:02x?} (not a Hearth frame)")]
    Magic([u8; 4]),
    #[error("wire version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("reserved header bytes are {0:#06x}, must be zero")]
    Reserved(u16),
    #[error("payload length {0} exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLong(u64),
    #[error("payload is {got} bytes, the header says {expected}")]
    Length { expected: u64, got: u64 },
    #[error("control message: {0}")]
    Control(String),
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub epoch: u32,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    pub fn new(kind: Kind, epoch: u32, seq: u64, len: usize) -> Self {
        Self {
            kind,
            epoch,
            seq,
            len: len as u64,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..12].copy_from_slice(&self.epoch.to_le_bytes());
        b[12..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..28].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes the first [`HEADER_LEN`] bytes of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Header, WireError> {
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return Err(WireError::Short(bytes.len()));
        };
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(WireError::Version(b[4]));
        }
        let kind = Kind::from_u8(b[5]).ok_or(WireError::Kind(b[5]))?;
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if reserved != 0 {
            return Err(WireError::Reserved(reserved));
        }
        let mut e = [0u8; 4];
        e.copy_from_slice(&b[8..12]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[12..20]);
        let mut l = [0u8; 8];
        l.copy_from_slice(&b[20..28]);
        let len = u64::from_le_bytes(l);
        if len > MAX_PAYLOAD {
            return Err(WireError::TooLong(len));
        }
        Ok(Header {
            kind,
            epoch: u32::from_le_bytes(e),
            seq: u64::from_le_bytes(s),
            len,
        })
    }
}

/// A whole frame: header then payload.
pub fn encode_frame(header: &Header, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(payload);
    out
}

/// Splits a complete frame into its header and payload, checking the length.
pub fn decode_frame(bytes: &[u8]) -> Result<(Header, &[u8]), WireError> {
    let header = Header::decode(bytes)?;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != header.len {
        return Err(WireError::Length {
            expected: header.len,
            got: payload.len() as u64,
        });
    }
    Ok((header, payload))
}

/// `f32`s as little-endian bytes.
pub fn f32_to_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Little-endian bytes as `f32`s; the length must be a multiple of 4 and equal `expect` values.
pub fn bytes_to_f32(b: &[u8], expect: usize) -> Result<Vec<f32>, WireError> {
    if b.len() != expect * 4 {
        return Err(WireError::Length {
            expected: (expect * 4) as u64,
            got: b.len() as u64,
        });
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A tiny reader for control messages (hand-encoded little-endian fields): every read checks
/// the remaining length.
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Self { b }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Control(format!(
                "needs {n} more bytes, {} left",
                self.b.len()
            )));
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    pub fn string(&mut self) -> Result<String, WireError> {
        let n = self.u64()?;
        if n > 4096 {
            return Err(WireError::Control(format!("string of {n} bytes")));
        }
        let s = self.take(n as usize)?;
        String::from_utf8(s.to_vec()).map_err(|_| WireError::Control("string is not UTF-8".into()))
    }
    /// A length-prefixed byte string of at most 64 KiB (a certificate).
    pub fn blob(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u64()?;
        if n > 64 << 10 {
            return Err(WireError::Control(format!("a blob of {n} bytes")));
        }
        self.take(n as usize)
    }
    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
    pub fn finish(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Control(format!(
                "{} trailing bytes",
                self.b.len()
            )))
        }
    }
}

/// Writer counterpart of [`Reader`].
#[derive(Default)]
pub struct Writer {
    pub bytes: Vec<u8>,
}

impl Writer {
    pub fn u64(mut self, v: u64) -> Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn string(self, s: &str) -> Self {
        self.blob(s.as_bytes())
    }
    pub fn blob(self, b: &[u8]) -> Self {
        let mut w = self.u64(b.len() as u64);
        w.bytes.extend_from_slice(b);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_round_trips() {
        let h = Header::new(Kind::Collective, 7, 0xDEAD_BEEF_0001, 12);
        let frame = encode_frame(&h, &[1; 12]);
        let (d, p) = decode_frame(&frame).unwrap();
        assert_eq!(d, h);
        assert_eq!(p, &[1; 12]);
    }

    #[test]
    fn every_malformation_is_named() {
        let good = Header::new(Kind::User, 1, 2, 0).encode();
        assert_eq!(Header::decode(&good[..10]), Err(WireError::Short(10)));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Header::decode(&b), Err(WireError::Magic(_))));
        let mut b = good;
        b[4] = 9;
        assert_eq!(Header::decode(&b), Err(WireError::Version(9)));
        let mut b = good;
        b[5] = 200;
        assert_eq!(Header::decode(&b), Err(WireError::Kind(200)));
        let mut b = good;
        b[6] = 1;
        assert_eq!(Header::decode(&b), Err(WireError::Reserved(1)));
        let mut b = good;
        b[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(Header::decode(&b), Err(WireError::TooLong(u64::MAX)));
        let h = Header::new(Kind::User, 1, 2, 8);
        let frame = encode_frame(&h, &[0; 5]);
        assert_eq!(
            decode_frame(&frame),
            Err(WireError::Length {
                expected: 8,
                got: 5
            })
        );
        assert!(bytes_to_f32(&[0; 7], 2).is_err());
    }

    #[test]
    fn every_kind_reads_back_from_its_byte() {
        let kinds: Vec<Kind> = (0..=255u8).filter_map(Kind::from_u8).collect();
        assert_eq!(kinds.len(), 12, "kinds 1 to 12, nothing else");
        for k in kinds {
            assert_eq!(Kind::from_u8(k as u8), Some(k));
        }
        assert_eq!(Kind::from_u8(12), Some(Kind::Gather));
        assert_eq!(Kind::from_u8(13), None);
    }

    #[test]
    fn random_bytes_never_panic_the_decoder() {
        // A deterministic stand-in for the cargo-fuzz target: many random and mutated inputs.
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let good = encode_frame(&Header::new(Kind::Metric, 3, 4, 4), &[1, 2, 3, 4]);
        for i in 0..20_000 {
            let len = (next() % 64) as usize;
            let mut bytes: Vec<u8> = if i % 2 == 0 {
                (0..len).map(|_| next() as u8).collect()
            } else {
                good.clone()
            };
            if i % 2 == 1 {
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
                bytes.truncate((next() as usize) % (bytes.len() + 1));
            }
            let _ = decode_frame(&bytes);
            let mut r = Reader::new(&bytes);
            let _ = r.string();
            let _ = r.u64();
        }
    }

    #[test]
    fn control_messages_round_trip_and_reject_truncation() {
        let w = Writer::default().u64(5).string("127.0.0.1:4000");
        let mut r = Reader::new(&w.bytes);
        assert_eq!(r.u64().unwrap(), 5);
        assert_eq!(r.string().unwrap(), "127.0.0.1:4000");
        r.finish().unwrap();
        let mut r = Reader::new(&w.bytes[..12]);
        r.u64().unwrap();
        assert!(r.string().is_err());
    }
}
