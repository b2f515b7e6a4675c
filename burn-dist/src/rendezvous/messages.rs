//! The rendezvous's own messages: a rank's hello (rank, listening port, lane) and rank 0's
//! table of every rank's address, each one frame on its own stream, never trusted to be
//! well formed.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use rustls::pki_types::CertificateDer;

use crate::wire::{Reader, Writer};
use crate::{DistError, Result};

/// A rank announcing itself on one of its connections (`lane` 0 first; more with
/// `QuicOptions::lanes`).
pub(super) fn hello(rank: usize, port: u16, lane: usize) -> Vec<u8> {
    Writer::default()
        .u64(rank as u64)
        .u64(port as u64)
        .u64(lane as u64)
        .bytes
}

/// (rank, port, lane) of a hello.
pub(super) fn parse_hello(b: &[u8]) -> Option<(usize, u16, usize)> {
    let mut r = Reader::new(b);
    let rank = r.u64().ok()? as usize;
    let port = u16::try_from(r.u64().ok()?).ok()?;
    let lane = r.u64().ok()? as usize;
    Some((rank, port, lane))
}

pub(super) fn table(addrs: &BTreeMap<usize, SocketAddr>) -> Vec<u8> {
    let mut w = Writer::default().u64(addrs.len() as u64);
    for (r, a) in addrs {
        w = w.u64(*r as u64).string(&a.to_string());
    }
    w.bytes
}

pub(super) fn parse_table(b: &[u8], world: usize) -> Result<BTreeMap<usize, SocketAddr>> {
    let mut r = Reader::new(b);
    let n = r.u64()? as usize;
    if n != world {
        return Err(DistError::Config(format!(
            "the coordinator's table has {n} ranks, this rank expects {world}"
        )));
    }
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let rank = r.u64()? as usize;
        let addr: SocketAddr = r.string()?.parse().map_err(|_| {
            DistError::Wire(crate::wire::WireError::Control(
                "bad address in table".into(),
            ))
        })?;
        out.insert(rank, addr);
    }
    r.finish()?;
    Ok(out)
}

/// Rank 0's certificate for a member: the rank authority's certificate, then the member's.
pub(super) fn issue(ca: &CertificateDer<'_>, cert: &CertificateDer<'_>) -> Vec<u8> {
    Writer::default()
        .blob(ca.as_ref())
        .blob(cert.as_ref())
        .bytes
}

/// (authority, certificate) of an [`issue`] message.
pub(super) fn parse_issue(b: &[u8]) -> Result<(CertificateDer<'static>, CertificateDer<'static>)> {
    let mut r = Reader::new(b);
    let ca = CertificateDer::from(r.blob()?.to_vec());
    let cert = CertificateDer::from(r.blob()?.to_vec());
    r.finish()?;
    Ok((ca, cert))
}
