//! TensorBoard event files: every run's `metrics.csv` columns as scalars per epoch, and its
//! `hparams.json` for TensorBoard's HParams dashboard, in one file TensorBoard reads
//! (`tensorboard --logdir runs/`).
//!
//! The format is TensorFlow's record file: each record is its length (u64, little-endian), a
//! masked CRC32C of those 8 bytes, the bytes of one `Event` protocol buffer and their masked
//! CRC32C. The few messages needed (`Event`, `Summary`, `SummaryMetadata`, the HParams
//! plugin's `SessionStartInfo`) are encoded here by hand: a protobuf crate and TensorBoard's
//! `.proto` files would be a build step for five messages. [`read`] decodes what [`encode`]
//! writes (scalars and wall times), so a rewrite keeps each epoch's first wall time.

use std::collections::BTreeMap;

use crate::proto::{Field, Fields, Proto};
use crate::{HearthError, Result};

/// The file's name inside the run directory (TensorBoard reads any file whose name holds
/// `tfevents`).
pub const FILE_NAME: &str = "events.out.tfevents.hearth";

/// The file of the scalars logged every N optimizer steps (`--log-every`), beside
/// [`FILE_NAME`]: appended to as the run goes. Its name sorts after the epochs' file, and
/// TensorBoard polls the last file of a run's folder for new records, so the step curves
/// grow live.
pub const STEPS_FILE_NAME: &str = "events.out.tfevents.hearth.steps";

/// TensorBoard's HParams plugin tag for a run's hyperparameters.
const HPARAMS_TAG: &str = "_hparams_/session_start_info";

/// One decoded event: its wall time, step and scalars (tag, value).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub scalars: Vec<(String, f32)>,
    /// The tags of the event's values that are not scalars (the hyperparameters' tag).
    pub other_tags: Vec<String>,
}

/// TensorFlow's masked CRC32C of a record's parts.
fn masked_crc(b: &[u8]) -> u32 {
    let crc = crc32c::crc32c(b);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn record(out: &mut Vec<u8>, event: &Proto) {
    let len = (event.0.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&event.0);
    out.extend_from_slice(&masked_crc(&event.0).to_le_bytes());
}

/// The head of an event file: its version record, at `wall_time`.
pub fn file_head(wall_time: f64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut version = Proto::default();
    version.double(1, wall_time).bytes(3, b"brain.Event:2");
    record(&mut out, &version);
    out
}

/// One record of `e`'s scalars at its step and wall time (its other tags are not written).
pub fn scalar_record(e: &Event) -> Vec<u8> {
    let values = e
        .scalars
        .iter()
        .map(|(tag, v)| scalar_value(tag, *v))
        .collect();
    let mut out = Vec::new();
    record(&mut out, &event(e.wall_time, e.step, values));
    out
}

/// A `Summary.Value` of one scalar.
fn scalar_value(tag: &str, v: f32) -> Proto {
    let mut p = Proto::default();
    p.bytes(1, tag.as_bytes()).float(2, v);
    p
}

/// An `Event` with `wall_time`, `step` and a summary of `values` (each a `Summary.Value`).
fn event(wall_time: f64, step: i64, values: Vec<Proto>) -> Proto {
    let mut summary = Proto::default();
    for v in values {
        summary.message(1, v);
    }
    let mut e = Proto::default();
    e.double(1, wall_time)
        .uint(2, step as u64)
        .message(5, summary);
    e
}

/// A `google.protobuf.Value` of a hyperparameter: numbers, booleans and strings as such,
/// anything else (lists) as its JSON text.
fn hparam_value(v: &serde_json::Value) -> Option<Proto> {
    let mut p = Proto::default();
    match v {
        serde_json::Value::Null => return None,
        serde_json::Value::Bool(b) => {
            p.uint(4, u64::from(*b));
        }
        serde_json::Value::Number(n) => {
            p.double(2, n.as_f64()?);
        }
        serde_json::Value::String(s) => {
            p.bytes(3, s.as_bytes());
        }
        other => {
            p.bytes(3, other.to_string().as_bytes());
        }
    }
    Some(p)
}

/// `hparams.json`'s values under dotted names (`ps.mode`), nested objects flattened.
fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let name = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&name, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// The HParams plugin's summary value of `hparams` (a run's `hparams.json`).
fn hparams_summary(hparams: &serde_json::Value, start: f64) -> Proto {
    let mut flat = BTreeMap::new();
    flatten("", hparams, &mut flat);
    let mut info = Proto::default();
    for (name, v) in &flat {
        if let Some(value) = hparam_value(v) {
            let mut entry = Proto::default();
            entry.bytes(1, name.as_bytes()).message(2, value);
            info.message(1, entry);
        }
    }
    info.double(5, start);
    // HParamsPluginData { version: 0, session_start_info }
    let mut data = Proto::default();
    data.message(3, info);
    let mut plugin = Proto::default();
    plugin.bytes(1, b"hparams").message(2, data);
    let mut metadata = Proto::default();
    metadata.message(1, plugin);
    // The plugin's null tensor: float, shape [0].
    let mut shape = Proto::default();
    shape.message(2, Proto::default());
    let mut tensor = Proto::default();
    tensor.uint(1, 1).message(2, shape);
    let mut value = Proto::default();
    value
        .bytes(1, HPARAMS_TAG.as_bytes())
        .message(8, tensor)
        .message(9, metadata);
    value
}

/// The event file of `rows` (epoch -> column -> value; each finite value a scalar at its
/// epoch) and, where given, `hparams`. `wall_times` gives each epoch's wall time (seconds since
/// the Unix epoch); an epoch without one takes `now`.
pub fn encode(
    rows: &BTreeMap<usize, BTreeMap<String, f64>>,
    hparams: Option<&serde_json::Value>,
    wall_times: &BTreeMap<i64, f64>,
    now: f64,
) -> Vec<u8> {
    let time = |step: i64| wall_times.get(&step).copied().unwrap_or(now);
    let start = rows.keys().next().map_or(now, |&e| time(e as i64)).min(now);
    let mut out = file_head(start);
    if let Some(h) = hparams {
        record(&mut out, &event(start, 0, vec![hparams_summary(h, start)]));
    }
    for (&epoch, row) in rows {
        let values = row
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, &v)| scalar_value(tag, v as f32))
            .collect();
        let step = epoch as i64;
        record(&mut out, &event(time(step), step, values));
    }
    out
}

fn decode_event(b: &[u8]) -> std::result::Result<Event, String> {
    let mut e = Event {
        wall_time: 0.0,
        step: 0,
        scalars: Vec::new(),
        other_tags: Vec::new(),
    };
    let mut f = Fields::new(b);
    while let Some((n, field)) = f.next()? {
        match (n, field) {
            (1, Field::Fixed64(x)) => e.wall_time = f64::from_le_bytes(x),
            (2, Field::Varint(x)) => e.step = x as i64,
            (5, Field::Bytes(summary)) => {
                let mut s = Fields::new(summary);
                while let Some((n, field)) = s.next()? {
                    let (1, Field::Bytes(value)) = (n, field) else {
                        continue;
                    };
                    let (mut tag, mut scalar) = (String::new(), None);
                    let mut v = Fields::new(value);
                    while let Some((n, field)) = v.next()? {
                        match (n, field) {
                            (1, Field::Bytes(t)) => tag = String::from_utf8_lossy(t).into_owned(),
                            (2, Field::Fixed32(x)) => scalar = Some(f32::from_le_bytes(x)),
                            _ => {}
                        }
                    }
                    match scalar {
                        Some(x) => e.scalars.push((tag, x)),
                        None => e.other_tags.push(tag),
                    }
                }
            }
            _ => {}
        }
    }
    Ok(e)
}

/// The events of an event file (`path` names it in errors): a record cut short, or one whose
/// checksum does not match, is an error.
pub fn read(bytes: &[u8], path: &std::path::Path) -> Result<Vec<Event>> {
    let bad = |at: usize, why: String| {
        HearthError::Checkpoint(format!(
            "{}: the TensorBoard record at byte {at} {why}",
            path.display()
        ))
    };
    let u32_at = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut events = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let head = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad(at, "is cut short".into()))?;
        if masked_crc(&head[..8]) != u32_at(&head[8..]) {
            return Err(bad(at, "has a damaged length".into()));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&head[..8]);
        let n = usize::try_from(u64::from_le_bytes(len))
            .ok()
            .filter(|&n| n <= bytes.len())
            .ok_or_else(|| bad(at, "claims more bytes than the file has".into()))?;
        let end = at
            .checked_add(12 + n + 4)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| bad(at, "is cut short".into()))?;
        let data = &bytes[at + 12..at + 12 + n];
        if masked_crc(data) != u32_at(&bytes[at + 12 + n..end]) {
            return Err(bad(at, "fails its checksum".into()));
        }
        events.push(decode_event(data).map_err(|e| bad(at, e))?);
        at = end;
    }
    Ok(events)
}

/// Writes `dir`'s event file from `rows` and `dir/hparams.json` through `write` (a run's
/// fenced write), keeping the wall time each epoch had in the file before.
pub fn write_run(
    dir: &std::path::Path,
    rows: &BTreeMap<usize, BTreeMap<String, f64>>,
    write: impl FnOnce(&std::path::Path, &[u8]) -> Result<()>,
) -> Result<()> {
    let path = dir.join(FILE_NAME);
    // Earlier wall times; an unreadable file is written anew (it is derived from metrics.csv).
    let wall_times: BTreeMap<i64, f64> = std::fs::read(&path)
        .ok()
        .and_then(|b| read(&b, &path).ok())
        .map(|events| {
            events
                .into_iter()
                .filter(|e| !e.scalars.is_empty())
                .map(|e| (e.step, e.wall_time))
                .collect()
        })
        .unwrap_or_default();
    let hparams = std::fs::read(dir.join("hparams.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    write(&path, &encode(rows, hparams.as_ref(), &wall_times, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> BTreeMap<usize, BTreeMap<String, f64>> {
        (1..=3)
            .map(|e| {
                let row = [
                    ("train_loss".to_string(), 1.0 / e as f64),
                    ("val_accuracy".to_string(), 10.0 * e as f64),
                    ("val_auroc".to_string(), f64::NAN),
                ];
                (e, row.into_iter().collect())
            })
            .collect()
    }

    #[test]
    fn scalars_and_wall_times_round_trip_and_damage_is_named() {
        let h = serde_json::json!({"lr": 0.1, "model": "resnet18", "ps": {"mode": "adag"}});
        let times = [(1i64, 100.0), (2, 200.0)].into_iter().collect();
        let b = encode(&rows(), Some(&h), &times, 300.0);
        let path = std::path::Path::new("run/events");
        let events = read(&b, path).unwrap();
        // The version, the hyperparameters, one event per epoch.
        assert_eq!(events.len(), 5, "{events:?}");
        assert_eq!(events[1].other_tags, [HPARAMS_TAG]);
        let epoch2 = &events[3];
        assert_eq!((epoch2.step, epoch2.wall_time), (2, 200.0));
        assert_eq!(
            epoch2.scalars,
            [("train_loss".into(), 0.5), ("val_accuracy".into(), 20.0)],
            "NaN is left out"
        );
        assert_eq!(events[4].wall_time, 300.0, "a new epoch takes now");
        // The standard masked CRC32C of TensorFlow's records (of an empty string: 0xa282ead8
        // plus nothing rotated).
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        for cut in [3, 20, b.len() - 1] {
            assert!(read(&b[..cut], path).is_err(), "cut at {cut}");
        }
        let mut flipped = b.clone();
        flipped[20] ^= 1;
        let e = read(&flipped, path).unwrap_err().to_string();
        assert!(e.contains("run/events") && e.contains("checksum"), "{e}");
    }
}
