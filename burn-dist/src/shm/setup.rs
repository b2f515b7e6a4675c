//! Finding the ranks of each host and giving them a segment (see the [module docs](super)).

use std::sync::Arc;
use std::time::Instant;

use super::options::ShmOptions;
use super::segment::{Segment, namespace_inode, remove_stale};
use crate::transport::Transport;
use crate::wire::{Kind, Reader, Writer};
use crate::{DistError, Result};

/// Tags of the negotiation's messages (kind [`Kind::Hello`], which only rendezvous uses).
const TAG_HOST: u64 = 0x5348_4d01;
const TAG_OFFER: u64 = 0x5348_4d02;
const TAG_ACK: u64 = 0x5348_4d03;
const TAG_VERDICT: u64 = 0x5348_4d04;
const TAG_GROUP: u64 = 0x5348_4d05;

/// What the negotiation settled for this rank.
pub struct Negotiated {
    /// For every job rank, the lowest rank of its shared-memory group (itself without one).
    pub leaders: Vec<usize>,
    /// This rank's segment, its local index and the group's job ranks.
    pub segment: Option<(Arc<Segment>, usize, Vec<usize>)>,
}

/// This host as the kernel knows it: the boot id (one per machine and boot) and the network
/// namespace (ranks in different namespaces are separate hosts, as containers are).
pub fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = namespace_inode("net")?;
    Some(format!("{}/net:{net}", boot.trim()))
}

/// Sends `payload` to every other rank and returns what each sent (this rank's own at its index).
fn all_to_all(
    t: &dyn Transport,
    tag: u64,
    payload: Vec<u8>,
    deadline: Instant,
) -> Result<Vec<Vec<u8>>> {
    let (me, world) = (t.rank(), t.world());
    for peer in (0..world).filter(|&p| p != me) {
        t.send(peer, Kind::Hello, tag, payload.clone())?;
    }
    (0..world)
        .map(|peer| {
            if peer == me {
                Ok(payload.clone())
            } else {
                t.recv(peer, Kind::Hello, tag, deadline)
            }
        })
        .collect()
}

fn offer(seg: &Segment) -> Vec<u8> {
    let [a, b] = seg.nonce();
    Writer::default()
        .u64(1)
        .string(&seg.name())
        .u64(a)
        .u64(b)
        .bytes
}

fn refusal(reason: &str) -> Vec<u8> {
    Writer::default().u64(0).string(reason).bytes
}

fn bad(from: usize, what: &str) -> DistError {
    DistError::Config(format!("rank {from} sent a malformed shared-memory {what}"))
}

/// Settles which ranks share memory, over `t` (the job's QUIC links, before any shared memory
/// is in use). Every rank of the job calls it once, at the same point.
pub fn negotiate(t: &dyn Transport, options: &ShmOptions, deadline: Instant) -> Result<Negotiated> {
    let me = t.rank();
    let host = match (options.enabled, host_identity()) {
        (true, Some(h)) => h,
        // Alone: a name no other rank sends.
        _ => format!("alone/{me}"),
    };
    let hosts = all_to_all(t, TAG_HOST, host.into_bytes(), deadline)?;
    let local: Vec<usize> = (0..hosts.len())
        .filter(|&r| hosts[r] == hosts[me])
        .collect();
    let li = local.iter().position(|&r| r == me).unwrap_or(0);
    let mut segment = None;
    if local.len() >= 2 {
        segment = if li == 0 {
            lead(t, &local, options, deadline)?
        } else {
            follow(t, &local, li, deadline)?
        };
    }
    let leader = if segment.is_some() { local[0] } else { me };
    let groups = all_to_all(
        t,
        TAG_GROUP,
        Writer::default().u64(leader as u64).bytes,
        deadline,
    )?;
    let leaders = groups
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let mut rd = Reader::new(b);
            match rd.u64() {
                Ok(l) if (l as usize) <= r => Ok(l as usize),
                _ => Err(bad(r, "group")),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Negotiated {
        leaders,
        segment: segment.map(|s| (Arc::new(s), li, local)),
    })
}

/// The host's lowest rank: creates the segment, offers it, removes the file once every rank has
/// mapped it, and tells them whether it is in use.
fn lead(
    t: &dyn Transport,
    local: &[usize],
    options: &ShmOptions,
    deadline: Instant,
) -> Result<Option<Segment>> {
    let stale = remove_stale();
    if stale > 0 {
        eprintln!("burn-dist: removed {stale} shared-memory segment(s) of dead jobs from /dev/shm");
    }
    let created = Segment::create(
        local.len(),
        options.ring_bytes,
        options.slot_bytes_for(local.len()),
    );
    let message = match &created {
        Ok(seg) => {
            seg.set_chain(options.chain_for(local.len()));
            seg.register(0);
            offer(seg)
        }
        Err(e) => refusal(&e.to_string()),
    };
    for &r in &local[1..] {
        t.send(r, Kind::Hello, TAG_OFFER, message.clone())?;
    }
    let mut problems = Vec::new();
    if let Err(e) = &created {
        problems.push(format!("rank {}: {e}", local[0]));
    }
    for &r in &local[1..] {
        let ack = t.recv(r, Kind::Hello, TAG_ACK, deadline)?;
        let mut rd = Reader::new(&ack);
        match rd.u64() {
            Ok(1) => {}
            Ok(0) => problems.push(format!(
                "rank {r}: {}",
                rd.string().map_err(|_| bad(r, "answer"))?
            )),
            _ => return Err(bad(r, "answer")),
        }
    }
    let seg = match created {
        Ok(seg) => {
            // Every rank has it mapped (or gave up): nobody else may open it from now on.
            if let Err(e) = seg.unlink() {
                problems.push(format!("rank {}: {e}", local[0]));
            }
            Some(seg)
        }
        Err(_) => None,
    };
    let verdict = u64::from(problems.is_empty());
    for &r in &local[1..] {
        t.send(
            r,
            Kind::Hello,
            TAG_VERDICT,
            Writer::default().u64(verdict).bytes,
        )?;
    }
    if !problems.is_empty() {
        eprintln!(
            "burn-dist: ranks {local:?} share a host but stay on QUIC: {}",
            problems.join("; ")
        );
        return Ok(None);
    }
    Ok(seg)
}

/// Another rank of the host: maps the offered segment and answers.
fn follow(
    t: &dyn Transport,
    local: &[usize],
    li: usize,
    deadline: Instant,
) -> Result<Option<Segment>> {
    let leader = local[0];
    let offered = t.recv(leader, Kind::Hello, TAG_OFFER, deadline)?;
    let mut rd = Reader::new(&offered);
    let attached = match rd.u64() {
        Ok(1) => {
            let name = rd.string().map_err(|_| bad(leader, "offer"))?;
            let nonce = [
                rd.u64().map_err(|_| bad(leader, "offer"))?,
                rd.u64().map_err(|_| bad(leader, "offer"))?,
            ];
            Some(Segment::attach(&name, nonce, local.len()))
        }
        Ok(0) => None,
        _ => return Err(bad(leader, "offer")),
    };
    let answer = match &attached {
        Some(Ok(seg)) => {
            seg.register(li);
            Writer::default().u64(1).bytes
        }
        Some(Err(e)) => refusal(&e.to_string()),
        None => refusal("no segment was offered"),
    };
    t.send(leader, Kind::Hello, TAG_ACK, answer)?;
    let verdict = t.recv(leader, Kind::Hello, TAG_VERDICT, deadline)?;
    let go = Reader::new(&verdict)
        .u64()
        .map_err(|_| bad(leader, "verdict"))?
        == 1;
    Ok(match attached {
        Some(Ok(seg)) if go => Some(seg),
        _ => None,
    })
}
