//! Frames on QUIC streams: one frame per unidirectional stream, the header first, a length
//! checked against the limit before anything is allocated, payloads kept in quinn's buffers.

use std::time::{Duration, Instant};

use quinn::{Connection, RecvStream};

use super::options::QuicOptions;
use crate::transport::{Inbox, Payload};
use crate::wire::{HEADER_LEN, Header, Kind};

/// Reads one whole frame from a stream: header, then exactly `len` payload bytes, refusing a
/// length over `max_len` before allocating anything.
pub(crate) async fn read_frame(
    stream: &mut RecvStream,
    max_len: usize,
) -> std::result::Result<(Header, Vec<u8>), String> {
    let header = read_header(stream, max_len).await?;
    let payload = read_pieces(stream, header.len as usize).await?;
    Ok((header, payload.into_vec()))
}

async fn read_header(
    stream: &mut RecvStream,
    max_len: usize,
) -> std::result::Result<Header, String> {
    let mut head = [0u8; HEADER_LEN];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| format!("reading a frame header: {e}"))?;
    let header = Header::decode(&head).map_err(|e| format!("malformed frame: {e}"))?;
    if header.len as usize > max_len {
        return Err(format!(
            "a frame announces {} payload bytes, over the limit of {max_len} \
             (HEARTH_MAX_FRAME_MB)",
            header.len
        ));
    }
    Ok(header)
}

/// Reads exactly `len` payload bytes as the pieces quinn hands over, without copying them.
pub(crate) async fn read_pieces(
    stream: &mut RecvStream,
    len: usize,
) -> std::result::Result<Payload, String> {
    let mut pieces = Vec::new();
    let mut got = 0;
    while got < len {
        match stream.read_chunk(len - got, true).await {
            Ok(Some(chunk)) => {
                got += chunk.bytes.len();
                pieces.push(chunk.bytes);
            }
            Ok(None) => {
                return Err(format!(
                    "the stream ended after {got} of {len} payload bytes"
                ));
            }
            Err(e) => return Err(format!("reading a {len}-byte payload: {e}")),
        }
    }
    Ok(Payload::Pieces(pieces))
}

/// Reads one frame into `inbox`: header (within `timeout`), room for its payload in the inbox's
/// budget (waiting at most `timeout`), then the payload (within `timeout`).
pub(crate) async fn receive_frame(
    stream: &mut RecvStream,
    inbox: &Inbox,
    options: &QuicOptions,
) -> std::result::Result<(Header, Payload), String> {
    let timeout = options.frame_timeout;
    let max_len = options.max_frame_bytes.min(inbox.budget());
    let header = tokio::time::timeout(timeout, read_header(stream, max_len))
        .await
        .map_err(|_| format!("a frame header did not arrive within {timeout:?}"))??;
    let len = header.len as usize;
    let waited = Instant::now();
    while !inbox.try_reserve(len) {
        if waited.elapsed() >= timeout {
            return Err(format!(
                "no room for a {len}-byte frame for {timeout:?}: {} of {} inbox bytes hold \
                 messages this rank has not taken (HEARTH_INBOX_MB)",
                inbox.held(),
                inbox.budget()
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    match tokio::time::timeout(timeout, read_pieces(stream, len)).await {
        Ok(Ok(payload)) => Ok((header, payload)),
        Ok(Err(e)) => {
            inbox.release(len);
            Err(e)
        }
        Err(_) => {
            inbox.release(len);
            Err(format!(
                "a {len}-byte frame did not arrive whole within {timeout:?}"
            ))
        }
    }
}

/// Writes one frame on a new unidirectional stream.
pub(crate) async fn write_frame(
    conn: &Connection,
    header: Header,
    payload: Vec<u8>,
) -> std::result::Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    if header.kind.urgent() {
        // Sent before the connection's other streams whenever both wait (quinn's scheduler).
        s.set_priority(1).map_err(|e| e.to_string())?;
    }
    // Handed to quinn without copying.
    let mut chunks = [
        bytes::Bytes::copy_from_slice(&header.encode()),
        bytes::Bytes::from(payload),
    ];
    s.write_all_chunks(&mut chunks)
        .await
        .map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())?;
    // Until the peer has acknowledged every byte: a rank that finishes and closes its
    // connections must not discard messages still in flight (closing drops unsent data).
    s.stopped().await.map_err(|e| e.to_string())?;
    Ok(())
}

/// The next frame `conn` opens a stream for, which must be of `kind` (a rendezvous or elastic
/// control message: small, at most 1 MiB).
pub(crate) async fn recv_control(
    conn: &Connection,
    kind: Kind,
) -> std::result::Result<Vec<u8>, String> {
    let mut s = conn.accept_uni().await.map_err(|e| e.to_string())?;
    // Control messages (hello, table) are small.
    let (h, payload) = read_frame(&mut s, 1 << 20).await?;
    if h.kind != kind {
        return Err(format!("expected a {kind:?} frame, got {:?}", h.kind));
    }
    Ok(payload)
}
