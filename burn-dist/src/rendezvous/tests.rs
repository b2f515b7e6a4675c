//! Rendezvous: launcher variables, rank claims checked against certificates, tables.

use super::link::peer_certs;
use super::messages::{hello, parse_table, table};
use super::*;
use crate::DistError;
use crate::tls::SERVER_NAME;
use crate::tls::rank_name;
use crate::transport::quic::write_frame;
use crate::wire::{Header, Kind};
use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

fn info(vars: &[(&str, &str)]) -> Result<RankInfo> {
    let map: BTreeMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    RankInfo::from_lookup(&|k| map.get(k).cloned())
}

#[test]
fn every_launcher_s_variables_are_read() {
    let h = info(&[
        ("HEARTH_RANK", "2"),
        ("HEARTH_WORLD_SIZE", "4"),
        ("HEARTH_COORDINATOR", "10.0.0.1:5000"),
    ])
    .unwrap();
    assert_eq!(
        (h.rank, h.world, h.coordinator.as_str(), h.source),
        (2, 4, "10.0.0.1:5000", "HEARTH_*")
    );
    let t = info(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "host"),
        ("MASTER_PORT", "29500"),
        ("LOCAL_RANK", "1"),
    ])
    .unwrap();
    assert_eq!(
        (t.rank, t.world, t.coordinator.as_str(), t.local_rank),
        (1, 2, "host:29500", Some(1))
    );
    let s = info(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"),
        ("SLURM_LOCALID", "1"),
    ])
    .unwrap();
    assert_eq!(
        (s.rank, s.world, s.coordinator.as_str()),
        (3, 8, "gpu07:29400")
    );
    let s2 = info(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
        ("HEARTH_PORT", "7000"),
    ])
    .unwrap();
    assert_eq!(s2.coordinator, "10.1.2.3:7000");
    let o = info(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("HEARTH_COORDINATOR", "n0:1234"),
    ])
    .unwrap();
    assert_eq!((o.rank, o.source), (1, "Open MPI"));
    // HEARTH_* wins over torchrun's.
    let both = info(&[
        ("HEARTH_RANK", "0"),
        ("HEARTH_WORLD_SIZE", "1"),
        ("HEARTH_COORDINATOR", "a:1"),
        ("RANK", "5"),
        ("WORLD_SIZE", "9"),
        ("MASTER_ADDR", "b"),
        ("MASTER_PORT", "2"),
    ])
    .unwrap();
    assert_eq!(both.rank, 0);
}

#[test]
fn incomplete_or_wrong_variables_are_explained() {
    let e = |v: &[(&str, &str)]| info(v).unwrap_err().to_string();
    assert!(e(&[]).contains("HEARTH_RANK"));
    assert!(e(&[("HEARTH_RANK", "x"), ("HEARTH_WORLD_SIZE", "2")]).contains("HEARTH_RANK=\"x\""));
    assert!(
        e(&[
            ("HEARTH_RANK", "2"),
            ("HEARTH_WORLD_SIZE", "2"),
            ("HEARTH_COORDINATOR", "a:1")
        ])
        .contains("outside a world of 2")
    );
    assert!(e(&[("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_ADDR"));
    assert!(
        e(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .contains("HEARTH_COORDINATOR")
    );
}

#[test]
fn detect_is_none_without_variables_and_an_error_for_half_a_pair() {
    let d = |vars: &[(&str, &str)]| {
        let map: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankInfo::detect_lookup(&|k| map.get(k).cloned())
    };
    assert!(d(&[]).unwrap().is_none());
    assert!(d(&[("LOCAL_RANK", "0")]).unwrap().is_none());
    let e = d(&[("RANK", "1")]).unwrap_err().to_string();
    assert!(e.contains("RANK=\"1\"") && e.contains("WORLD_SIZE"), "{e}");
    let e = d(&[("OMPI_COMM_WORLD_SIZE", "4")]).unwrap_err().to_string();
    assert!(e.contains("OMPI_COMM_WORLD_RANK"), "{e}");
    let e = d(&[("RANK", "0"), ("WORLD_SIZE", "2")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("MASTER_ADDR"), "{e}");
    let ok = d(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!((ok.rank, ok.world), (1, 2));
}

/// A job of 3 on `membership(r)` forms while an impostor with `impostor`'s identity says it is
/// rank `claim` to the coordinator first: the coordinator closes the impostor's connection (the
/// reason, returned) and ranks 0, 1 and 2 form the job.
fn impostor_refused_and_job_forms(
    membership: impl Fn(usize) -> Membership + Send + Sync + 'static,
    impostor: Identity,
    claim: usize,
) -> String {
    use crate::transport::Transport;
    let membership = Arc::new(membership);
    // Bound before the coordinator's port is picked, so the system cannot hand it that port.
    let impostor = QuicNode::bind(
        "127.0.0.1:0".parse().unwrap(),
        &impostor,
        &QuicOptions::loopback(),
    )
    .unwrap();
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .unwrap();
    let rank = move |r: usize| RankInfo {
        rank: r,
        world: 3,
        local_rank: None,
        coordinator: format!("127.0.0.1:{port}"),
        source: "test",
    };
    let options = || RendezvousOptions {
        timeout: Duration::from_secs(30),
        quic: None,
        bind_ip: None,
        shm: Default::default(),
        profiles: Default::default(),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let start = |r: usize| {
        let (tx, m) = (tx.clone(), membership.clone());
        std::thread::spawn(move || {
            let _ = tx.send((r, connect(&rank(r), &m(r), &options()).map(|t| t.world())));
        });
    };
    start(0);
    let endpoint = impostor.endpoint.clone();
    let own_port = impostor.local_addr().unwrap().port();
    let coordinator: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let refused = impostor.rt.block_on(async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        let conn = loop {
            match endpoint.connect(coordinator, SERVER_NAME).unwrap().await {
                Ok(c) => break c,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("the impostor never reached the coordinator: {e}"),
            }
        };
        let h = hello(claim, own_port, 0);
        let _ = write_frame(&conn, Header::new(Kind::Hello, 0, 0, h.len()), h).await;
        tokio::time::timeout(Duration::from_secs(20), conn.closed()).await
    });
    let reason = refused.expect("the coordinator must close the impostor's connection");
    start(1);
    start(2);
    drop(tx);
    for _ in 0..3 {
        let (r, world) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a rank hung");
        assert_eq!(world.unwrap_or_else(|e| panic!("rank {r}: {e}")), 3);
    }
    reason.to_string()
}

#[test]
fn a_member_claiming_another_rank_is_refused_and_the_job_still_forms() {
    let secret = Membership::secret("370eaf93d9be60f04dbe4a25d3136d2c", "test-job").unwrap();
    // Rank 2's process (its certificate names rank 2) will say it is rank 1.
    let impostor = Identity::new(&secret, 2).unwrap();
    let reason = impostor_refused_and_job_forms(move |_| secret.clone(), impostor, 1);
    assert!(reason.contains("rank does not match"), "{reason}");
}

#[test]
fn a_secret_holder_claiming_a_rank_outside_the_world_is_refused_and_the_job_still_forms() {
    // Issue 55: a hello claiming rank >= world ended the whole rendezvous with an error.
    let secret = Membership::secret("370eaf93d9be60f04dbe4a25d3136d2c", "test-job").unwrap();
    let holder = Identity::new(&secret, 2).unwrap();
    let reason = impostor_refused_and_job_forms(move |_| secret.clone(), holder, 7);
    assert!(reason.contains("rank outside the world"), "{reason}");
}

/// A user's CA in `dir` (`ca.pem`) and, for each `(file, names)`, a certificate and key it
/// signs (`<file>.pem`, `<file>.key`).
fn user_ca(dir: &Path, leaves: &[(&str, Vec<String>)]) {
    let ca_key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = params.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    let issuer = rcgen::Issuer::new(params, ca_key);
    for (file, names) in leaves {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cert = CertificateParams::new(names.clone())
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
    }
}

#[test]
fn with_user_certificates_the_rank_and_the_job_name_come_from_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let job = SERVER_NAME.to_string();
    let mut leaves: Vec<(&str, Vec<String>)> = vec![
        ("rank0", vec![job.clone(), rank_name(0)]),
        ("rank1", vec![job.clone(), rank_name(1)]),
        ("rank2", vec![job.clone(), rank_name(2)]),
        ("unranked", vec![job.clone()]),
        (
            "other-job",
            vec!["other-job".into(), "rank-1.other-job".into()],
        ),
    ];
    leaves.push(("rank1-only", vec![rank_name(1)]));
    user_ca(dir.path(), &leaves);
    let files = |name: &str| Membership::Files {
        ca: dir.path().join("ca.pem"),
        cert: dir.path().join(format!("{name}.pem")),
        key: dir.path().join(format!("{name}.key")),
    };
    // A process's own certificate: a rank's works for that rank only; one naming no rank or
    // not the job is refused at start, saying what it names.
    assert!(Identity::new(&files("rank1"), 1).is_ok());
    let e = Identity::new(&files("rank1"), 2).err().unwrap().to_string();
    assert!(e.contains("rank 2, and it names rank 1"), "{e}");
    let e = Identity::new(&files("unranked"), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("names no rank"), "{e}");
    let e = Identity::new(&files("rank1-only"), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&format!("must name {SERVER_NAME}")), "{e}");
    // Over the network, from a client that skipped those checks (built by hand): a certificate
    // naming no rank and one for another job's name are refused by the server, and the job
    // forms. Each certificate is signed by the job's own CA, so only the name stops it.
    let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
    let ca = CertificateDer::from_pem_slice(&ca).unwrap();
    let by_hand = |name: &str| {
        let cert = std::fs::read(dir.path().join(format!("{name}.pem"))).unwrap();
        let key = std::fs::read(dir.path().join(format!("{name}.key"))).unwrap();
        Identity {
            ca: ca.clone(),
            chain: vec![CertificateDer::from_pem_slice(&cert).unwrap()],
            key: PrivateKeyDer::from_pem_slice(&key).unwrap(),
        }
    };
    let dirp = dir.path().to_path_buf();
    let membership = move |r: usize| Membership::Files {
        ca: dirp.join("ca.pem"),
        cert: dirp.join(format!("rank{r}.pem")),
        key: dirp.join(format!("rank{r}.key")),
    };
    let reason = impostor_refused_and_job_forms(membership.clone(), by_hand("unranked"), 1);
    assert!(reason.contains("rank does not match"), "{reason}");
    let reason = impostor_refused_and_job_forms(membership, by_hand("other-job"), 1);
    assert!(reason.contains("rank does not match"), "{reason}");
}

#[test]
fn slurm_node_lists_give_their_first_host() {
    assert_eq!(first_slurm_host("node1").as_deref(), Some("node1"));
    assert_eq!(first_slurm_host("node[03-05,9]").as_deref(), Some("node03"));
    assert_eq!(first_slurm_host("a[1,2],b[3-4]").as_deref(), Some("a1"));
    assert_eq!(first_slurm_host("x1,y2").as_deref(), Some("x1"));
    assert_eq!(first_slurm_host(""), None);
}

#[test]
fn hellos_tables_and_issues_decode_any_bytes_without_a_panic() {
    use crate::fuzz::{Rng, inputs};
    let addrs: BTreeMap<usize, SocketAddr> = [
        (0, "127.0.0.1:4000".parse().unwrap()),
        (1, "[::1]:4001".parse().unwrap()),
    ]
    .into();
    let seeds = vec![
        hello(3, 4000, 1),
        table(&addrs),
        super::messages::issue(
            &CertificateDer::from(vec![1u8; 40]),
            &CertificateDer::from(vec![2u8; 30]),
        ),
    ];
    let mut rng = Rng::new(11);
    for input in inputs(&seeds, 20_000, &mut rng) {
        let _ = super::messages::parse_hello(&input);
        let _ = parse_table(&input, 2);
        let _ = super::messages::parse_issue(&input);
    }
}

#[test]
fn tables_round_trip_and_reject_garbage() {
    let mut m = BTreeMap::new();
    m.insert(0, "127.0.0.1:5000".parse().unwrap());
    m.insert(1, "127.0.0.1:6000".parse().unwrap());
    assert_eq!(parse_table(&table(&m), 2).unwrap(), m);
    assert!(parse_table(&table(&m), 3).is_err());
    assert!(parse_table(&[1, 2, 3], 2).is_err());
}

/// What a server presenting `served` makes of a client presenting `client` (trusting the
/// server's CA): the rank the accepted client's certificate names, or why it was refused.
fn server_sees(served: &Identity, client: &Identity) -> std::result::Result<usize, String> {
    let options = QuicOptions::loopback();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = QuicNode::bind(any, served, &options).unwrap();
    let addr = server.local_addr().unwrap();
    let endpoint = server.endpoint.clone();
    let accepted = server.rt.spawn(async move {
        let incoming = tokio::time::timeout(Duration::from_secs(10), endpoint.accept())
            .await
            .map_err(|_| "no connection arrived".to_string())?
            .ok_or("the endpoint closed")?;
        let conn = tokio::time::timeout(Duration::from_secs(10), incoming)
            .await
            .map_err(|_| "the handshake stalled".to_string())?
            .map_err(|e| e.to_string())?;
        let cert = peer_certs(&conn)
            .and_then(|c| c.first().cloned())
            .ok_or("no client certificate")?;
        crate::tls::certificate_rank(&cert).ok_or_else(|| "a certificate naming no rank".into())
    });
    let dialer = QuicNode::bind(any, client, &options).unwrap();
    let config = dialer.client_as(client).unwrap();
    let endpoint = dialer.endpoint.clone();
    // The client may finish its side before the server refuses its certificate: the server's
    // verdict is the answer.
    let _conn = dialer.rt.block_on(async move {
        let connecting = endpoint.connect_with(config, addr, SERVER_NAME).unwrap();
        tokio::time::timeout(Duration::from_secs(10), connecting).await
    });
    server
        .rt
        .block_on(accepted)
        .expect("the accepting task panicked")
}

#[test]
fn with_a_secret_only_rank_zero_s_authority_makes_a_rank_certificate_that_members_accept() {
    let secret = Membership::secret("370eaf93d9be60f04dbe4a25d3136d2c", "test-job").unwrap();
    let authority = crate::tls::RankAuthority::new().unwrap();
    let ca = authority.ca().clone();
    // Members arrive with certificates made from the secret; rank 0 issues over their keys.
    let boot1 = Identity::new(&secret, 1).unwrap();
    let boot2 = Identity::new(&secret, 2).unwrap();
    let for1 = authority.issue(1, &boot1.chain[0]).unwrap();
    let for2 = authority.issue(2, &boot2.chain[0]).unwrap();
    let rank1 = boot1.issued(ca.clone(), for1, 1).unwrap();
    // A certificate issued for another process's key, or for another rank, is not taken.
    let e = boot1
        .issued(ca.clone(), for2.clone(), 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("another key"), "{e}");
    let e = boot2
        .issued(ca.clone(), for2.clone(), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("does not name rank 1"), "{e}");
    let rank2 = boot2.issued(ca.clone(), for2, 2).unwrap();

    // The real rank 2 is accepted by rank 1, named by its certificate.
    assert_eq!(server_sees(&rank1, &rank2), Ok(2));
    // A member holding the secret makes itself a certificate naming rank 2 and trusts the
    // authority's certificate (it is no secret): rank 1 refuses it in the handshake.
    let forged_from_secret = Identity::new(&secret, 2).unwrap();
    let forger = Identity {
        ca: ca.clone(),
        chain: forged_from_secret.chain.clone(),
        key: forged_from_secret.key.clone_key(),
    };
    let refused = server_sees(&rank1, &forger).expect_err("a forged rank certificate accepted");
    assert!(
        refused.contains("certificate") || refused.contains("UnknownIssuer"),
        "{refused}"
    );
}

/// A rendezvous watched by an [`Abort`] ends with the abort's error once it gives one, on the
/// coordinator and on a member alike, instead of waiting for a rank that will not come.
#[test]
fn a_watched_rendezvous_ends_with_the_aborts_error() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let secret = Membership::secret("370eaf93d9be60f04dbe4a25d3136d2c", "test-job").unwrap();
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .unwrap();
    let lost = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    // Ranks 0 and 1 of 3 come; rank 2 never does.
    for r in 0..2 {
        let (tx, secret, lost) = (tx.clone(), secret.clone(), lost.clone());
        std::thread::spawn(move || {
            let info = RankInfo {
                rank: r,
                world: 3,
                local_rank: None,
                coordinator: format!("127.0.0.1:{port}"),
                source: "test",
            };
            let options = RendezvousOptions {
                // Longer than the test waits below: a timeout is not what ends it.
                timeout: Duration::from_secs(90),
                quic: None,
                bind_ip: None,
                shm: Default::default(),
                profiles: Default::default(),
            };
            let abort: Abort = Arc::new(move || {
                lost.load(Ordering::SeqCst).then(|| DistError::PeerFailed {
                    rank: 2,
                    reason: "found dead elsewhere".into(),
                })
            });
            let formed = connect_epoch_watched(None, &info, &secret, &options, 1, Some(abort));
            let _ = tx.send((r, formed.map(|_| ()).map_err(|e| e.to_string())));
        });
    }
    drop(tx);
    // Both wait in the rendezvous (no answer yet), then the abort says rank 2 is lost.
    assert!(
        rx.recv_timeout(Duration::from_millis(1500)).is_err(),
        "nothing ends before the abort"
    );
    lost.store(true, Ordering::SeqCst);
    let mut ended = Vec::new();
    for _ in 0..2 {
        let (r, formed) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every rank ends soon after the abort");
        let e = formed.expect_err("no world forms without rank 2");
        // The coordinator ends on its abort; the member on its own, or on the coordinator's
        // leaving first (either way, not on its timeout).
        assert!(
            e == "rank 2 failed: found dead elsewhere"
                || (r == 1 && e.starts_with("rank 0 failed")),
            "rank {r}: {e}"
        );
        ended.push(r);
    }
    ended.sort();
    assert_eq!(ended, [0, 1]);
}
