//! NumPy `.npy` files of `f32` (and `f64`, converted) in C order: the `--input` and
//! `--logits-out` format of `hearth predict`. Parsing is strict and never panics on bad bytes.

use std::path::Path;

use crate::{HearthError, Result};

const MAGIC: &[u8] = b"\x93NUMPY";

/// A dense array: shape and row-major data.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

fn header_field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let pos = header.find(&format!("'{key}'"))?;
    let rest = &header[pos + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    Some(rest)
}

/// Parses `.npy` bytes; `path` is only used in errors.
pub fn parse(bytes: &[u8], path: &Path) -> Result<NpyArray> {
    let bad = |reason: &str| HearthError::Npy {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("missing the \\x93NUMPY magic"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(bad("truncated header"));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(bad(&format!("unsupported format version {v}"))),
    };
    let header = bytes
        .get(start..start.saturating_add(header_len))
        .ok_or_else(|| bad("truncated header"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("header is not text"))?;
    let descr = header_field(header, "descr").ok_or_else(|| bad("header has no 'descr'"))?;
    let elem = if descr.starts_with("'<f4'") || descr.starts_with("'float32'") {
        4
    } else if descr.starts_with("'<f8'") {
        8
    } else {
        return Err(bad(&format!(
            "dtype {} is not supported (little-endian float32 or float64 only)",
            descr.split(',').next().unwrap_or(descr)
        )));
    };
    let fortran = header_field(header, "fortran_order").ok_or_else(|| bad("no 'fortran_order'"))?;
    if fortran.starts_with("True") {
        return Err(bad(
            "Fortran-order arrays are not supported; save with C order",
        ));
    }
    let shape_text = header_field(header, "shape").ok_or_else(|| bad("no 'shape'"))?;
    let shape_text = shape_text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("malformed shape"))?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad("malformed shape")))
        .collect::<Result<Vec<_>>>()?;
    let count = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("shape overflows"))?;
    let body = &bytes[start + header_len..];
    if body.len() != count.saturating_mul(elem) {
        return Err(bad(&format!(
            "data has {} bytes, shape {:?} needs {}",
            body.len(),
            shape,
            count.saturating_mul(elem)
        )));
    }
    let data = if elem == 4 {
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    } else {
        body.chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect()
    };
    Ok(NpyArray { shape, data })
}

pub fn read(path: &Path) -> Result<NpyArray> {
    let bytes = std::fs::read(path).map_err(|source| HearthError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&bytes, path)
}

/// Serialises a C-order float32 array (format version 1.0).
pub fn to_bytes(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let dims = match shape.len() {
        1 => format!("{},", shape[0]),
        _ => shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({dims}), }}");
    // Pad so the data starts on a 64-byte boundary, newline-terminated.
    let unpadded = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Writes a float32 `.npy` atomically (temporary file, then rename).
pub fn write(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let tmp = path.with_extension("npy.tmp");
    let err = |source| HearthError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, to_bytes(shape, data)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let bytes = to_bytes(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        // The header is padded so the data starts on a 64-byte boundary.
        assert_eq!((bytes.len() - 6 * 4) % 64, 0);
        let a = parse(&bytes, Path::new("x.npy")).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.data[5], 6.5);
        let one = parse(&to_bytes(&[3], &[1.0, 2.0, 3.0]), Path::new("y")).unwrap();
        assert_eq!(one.shape, vec![3]);
    }

    #[test]
    fn bad_bytes_are_errors_not_panics() {
        let good = to_bytes(&[2, 2], &[1.0; 4]);
        for cut in 0..good.len() {
            assert!(
                parse(&good[..cut], Path::new("t.npy")).is_err(),
                "cut at {cut}"
            );
        }
        let mut wrong = good.clone();
        let at = wrong.windows(3).position(|w| w == b"<f4").unwrap();
        wrong[at..at + 3].copy_from_slice(b"<i8");
        let err = parse(&wrong, Path::new("t.npy")).unwrap_err().to_string();
        assert!(
            err.contains("t.npy") && err.contains("not supported"),
            "{err}"
        );
        assert!(parse(b"\x93NUMPY\x01\x00\xff\xff", Path::new("t")).is_err());
    }
}
