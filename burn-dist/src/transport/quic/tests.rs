//! An authenticated peer that breaks the protocol: huge length fields, frames that never
//! finish, more data than this rank consumes.

use super::stream::write_frame;
use super::*;
use crate::tls::{Identity, Membership, SERVER_NAME};
use crate::transport::Transport;

/// Rank 0's transport, and rank 1's raw connection to it.
fn pair(options: &QuicOptions) -> (QuicTransport, QuicNode, Connection) {
    let m = Membership::secret("5d1cbfa2d53e9a0d51747a0f1f197276", "test-job").unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let a = QuicNode::bind(any, &Identity::new(&m, 0).unwrap(), options).unwrap();
    let b = QuicNode::bind(any, &Identity::new(&m, 1).unwrap(), options).unwrap();
    let addr = a.local_addr().unwrap();
    let (ep_a, ep_b) = (a.endpoint.clone(), b.endpoint.clone());
    let (ca, cb) = b.rt.block_on(async move {
        let accept = tokio::spawn(async move { ep_a.accept().await?.await.ok() });
        let cb = ep_b.connect(addr, SERVER_NAME).unwrap().await.unwrap();
        (accept.await.unwrap().unwrap(), cb)
    });
    let t = QuicTransport::start(a, 0, 0, vec![None, Some(ca)], options);
    (t, b, cb)
}

fn options() -> QuicOptions {
    QuicOptions {
        frame_timeout: Duration::from_secs(1),
        ..QuicOptions::loopback()
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[test]
fn a_huge_length_field_cuts_the_peer_off_before_any_allocation() {
    let (t, b, cb) = pair(&options());
    let mut header = Header::new(Kind::Collective, 0, 7, 0);
    header.len = 3 << 30; // under the wire format's 4 GiB, over the 256 MiB default
    b.rt.block_on(write_frame(&cb, header, vec![0; 16])).ok();
    let e = t
        .recv(1, Kind::Collective, 7, soon())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1") && e.contains("over the limit"), "{e}");
    assert_eq!(t.inbox.held(), 0);
}

#[test]
fn a_frame_that_never_finishes_fails_the_peer_within_the_frame_timeout() {
    let (t, b, cb) = pair(&options());
    // A header announcing 1,000 bytes, 10 of them sent, the stream left open.
    let _stream = b.rt.block_on(async move {
        let mut s = cb.open_uni().await.unwrap();
        let header = Header::new(Kind::Collective, 0, 3, 1000);
        s.write_all(&header.encode()).await.unwrap();
        s.write_all(&[1; 10]).await.unwrap();
        s
    });
    let started = Instant::now();
    let e = t
        .recv(1, Kind::Collective, 3, soon())
        .unwrap_err()
        .to_string();
    assert!(e.contains("did not arrive whole"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(t.inbox.held(), 0, "the reservation is given back");
}

#[test]
fn a_full_inbox_pauses_reading_until_messages_are_taken() {
    let opts = QuicOptions {
        inbox_bytes: 1000,
        frame_timeout: Duration::from_secs(10),
        ..QuicOptions::loopback()
    };
    let (t, b, cb) = pair(&opts);
    for tag in 0..3u64 {
        let conn = cb.clone();
        b.rt.spawn(async move {
            let _ = write_frame(
                &conn,
                Header::new(Kind::Collective, 0, tag, 600),
                vec![tag as u8; 600],
            )
            .await;
        });
    }
    // Only one 600-byte frame fits in 1,000 bytes at a time: the others wait for room.
    std::thread::sleep(Duration::from_millis(300));
    assert!(t.inbox.held() <= 1000, "held {}", t.inbox.held());
    let mut got: Vec<u64> = Vec::new();
    let deadline = soon();
    while got.len() < 3 && Instant::now() < deadline {
        for tag in 0..3u64 {
            if got.contains(&tag) {
                continue;
            }
            if let Ok(p) = t.recv(
                1,
                Kind::Collective,
                tag,
                Instant::now() + Duration::from_millis(50),
            ) {
                assert_eq!(p, vec![tag as u8; 600]);
                got.push(tag);
            }
        }
    }
    assert_eq!(
        got.len(),
        3,
        "every frame arrives once there is room: {got:?}"
    );
    // Larger than the whole budget: refused as over the limit.
    let conn = cb.clone();
    b.rt.spawn(async move {
        let _ = write_frame(
            &conn,
            Header::new(Kind::Collective, 0, 9, 2000),
            vec![0; 2000],
        )
        .await;
    });
    let e = t
        .recv(1, Kind::Collective, 9, soon())
        .unwrap_err()
        .to_string();
    assert!(e.contains("over the limit"), "{e}");
}
