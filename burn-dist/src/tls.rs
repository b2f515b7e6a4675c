//! Job membership over TLS 1.3, mutual: every connection proves both ends belong to the job.
//!
//! Two ways to say who belongs:
//!
//! - **A job secret** (`HEARTH_JOB_SECRET`, or a file named by `HEARTH_JOB_SECRET_FILE`). Every
//!   rank derives the same Ed25519 CA key from it (HKDF-SHA256), hence the same CA certificate,
//!   and issues itself a certificate signed by that CA. A process with another secret has
//!   another CA: its handshake fails, so nothing it sends is ever read.
//! - **Files the user gives** (`HEARTH_TLS_CA`, `HEARTH_TLS_CERT`, `HEARTH_TLS_KEY`, PEM): a CA
//!   and this rank's certificate and key. Certificates must name [`SERVER_NAME`] as a DNS
//!   subject alternative name.
//!
//! Without either, setup fails with an error that says how to give one.
//!
//! **Ranks are bound to certificates.** A rank's certificate also names [`rank_name`]`(rank)`
//! (`rank-3.hearth-job`), and a peer's hello is accepted only when the rank it claims is the
//! rank its certificate names, so one rank cannot pose as another. Secret-derived certificates
//! always carry it and must match; a user's certificate is checked when it names a rank of the
//! job (give each rank its own certificate with that DNS name to bind them).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ED25519,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::{DistError, Result};

/// The name every rank's certificate carries and every client checks.
pub const SERVER_NAME: &str = "hearth-job";
/// ALPN protocol of burn-dist connections.
pub const ALPN: &[u8] = b"hearth-dist/1";
/// Shortest job secret accepted.
pub const MIN_SECRET_LEN: usize = 16;

/// A fresh random job secret (64 hex characters), for launchers that start every rank. An error
/// when the system's random generator fails: a predictable secret would admit anyone.
pub fn random_secret() -> Result<String> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| DistError::Tls("the system random generator failed; no job secret".into()))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The DNS name that binds a certificate to `rank`: `rank-<rank>.hearth-job`.
pub fn rank_name(rank: usize) -> String {
    format!("rank-{rank}.{SERVER_NAME}")
}

/// Whether `cert` names `rank` (a DNS subject alternative name [`rank_name`]`(rank)`).
pub fn names_rank(cert: &CertificateDer<'_>, rank: usize) -> bool {
    let Ok(name) = rustls::pki_types::ServerName::try_from(rank_name(rank)) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .map(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
        .unwrap_or(false)
}

/// Checks that the peer of a connection may be rank `claimed` of a job of `world`: its
/// certificate names that rank, or (a user's certificate, `strict` false) names no rank of the
/// job at all. The error says what the certificate names.
pub fn check_peer_rank(
    peer_certs: Option<&[CertificateDer<'static>]>,
    claimed: usize,
    world: usize,
    strict: bool,
) -> std::result::Result<(), String> {
    let Some(cert) = peer_certs.and_then(|c| c.first()) else {
        return Err(format!(
            "the peer claiming rank {claimed} presented no certificate"
        ));
    };
    if names_rank(cert, claimed) {
        return Ok(());
    }
    let named: Vec<usize> = (0..world).filter(|&r| names_rank(cert, r)).collect();
    if named.is_empty() && !strict {
        return Ok(());
    }
    Err(format!(
        "a peer claims rank {claimed} but its certificate names {}",
        if named.is_empty() {
            "no rank".to_string()
        } else {
            format!("rank {named:?}")
        }
    ))
}

/// Who belongs to the job.
#[derive(Clone)]
pub enum Membership {
    Secret(Vec<u8>),
    Files {
        ca: PathBuf,
        cert: PathBuf,
        key: PathBuf,
    },
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Membership::Secret(_) => write!(f, "Membership::Secret(..)"),
            Membership::Files { ca, cert, key } => f
                .debug_struct("Membership::Files")
                .field("ca", ca)
                .field("cert", cert)
                .field("key", key)
                .finish(),
        }
    }
}

impl Membership {
    pub fn secret(secret: impl AsRef<[u8]>) -> Result<Self> {
        let s = secret.as_ref();
        if s.len() < MIN_SECRET_LEN {
            return Err(DistError::Tls(format!(
                "the job secret is {} bytes; use at least {MIN_SECRET_LEN}",
                s.len()
            )));
        }
        Ok(Self::Secret(s.to_vec()))
    }

    /// From `HEARTH_JOB_SECRET`, `HEARTH_JOB_SECRET_FILE`, or `HEARTH_TLS_CA`/`_CERT`/`_KEY`.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        if let Some(s) = get("HEARTH_JOB_SECRET").filter(|s| !s.is_empty()) {
            return Self::secret(s);
        }
        if let Some(path) = get("HEARTH_JOB_SECRET_FILE").filter(|s| !s.is_empty()) {
            let s = std::fs::read(&path).map_err(|source| DistError::Io {
                context: format!("reading the job secret file {path}"),
                source,
            })?;
            let trimmed = s.trim_ascii();
            return Self::secret(trimmed);
        }
        match (
            get("HEARTH_TLS_CA"),
            get("HEARTH_TLS_CERT"),
            get("HEARTH_TLS_KEY"),
        ) {
            (Some(ca), Some(cert), Some(key)) => Ok(Self::Files {
                ca: ca.into(),
                cert: cert.into(),
                key: key.into(),
            }),
            (None, None, None) => Err(DistError::Tls(
                "no job credentials: set HEARTH_JOB_SECRET (or HEARTH_JOB_SECRET_FILE), or \
                 HEARTH_TLS_CA, HEARTH_TLS_CERT and HEARTH_TLS_KEY"
                    .into(),
            )),
            _ => Err(DistError::Tls(
                "HEARTH_TLS_CA, HEARTH_TLS_CERT and HEARTH_TLS_KEY must be set together".into(),
            )),
        }
    }
}

/// A rank's TLS material: the job CA, its certificate chain and key.
pub struct Identity {
    pub ca: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// Peers' certificates must name their rank (secret-derived certificates always do).
    pub strict_ranks: bool,
}

impl Identity {
    /// The identity of `rank`: with a job secret, a fresh key and a certificate naming the rank.
    pub fn new(m: &Membership, rank: usize) -> Result<Self> {
        match m {
            Membership::Secret(s) => from_secret(s, rank),
            Membership::Files { ca, cert, key } => from_files(ca, cert, key),
        }
    }
}

fn tls_err(what: &str) -> impl Fn(rcgen::Error) -> DistError + '_ {
    move |e| DistError::Tls(format!("{what}: {e}"))
}

/// The job CA's Ed25519 key from the secret: HKDF-SHA256 with a fixed salt and label.
fn ca_key(secret: &[u8]) -> Result<KeyPair> {
    let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"hearth burn-dist job CA v1");
    let prk = salt.extract(secret);
    let mut seed = [0u8; 32];
    prk.expand(&[b"ed25519 seed"], ring::hkdf::HKDF_SHA256)
        .and_then(|okm| okm.fill(&mut seed))
        .map_err(|_| DistError::Tls("deriving the job key".into()))?;
    // PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410).
    let mut pkcs8 = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    pkcs8.extend_from_slice(&seed);
    KeyPair::from_pkcs8_der_and_sign_algo(&PrivatePkcs8KeyDer::from(pkcs8), &PKCS_ED25519)
        .map_err(tls_err("the job key"))
}

fn ca_params() -> Result<CertificateParams> {
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(tls_err("CA parameters"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "Hearth job CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

fn from_secret(secret: &[u8], rank: usize) -> Result<Identity> {
    let ca_key = ca_key(secret)?;
    let ca_params = ca_params()?;
    // Deterministic: fixed parameters and an Ed25519 signature, so every rank builds the same CA.
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(tls_err("the job CA certificate"))?;
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate_for(&PKCS_ED25519).map_err(tls_err("a rank key"))?;
    let mut leaf = CertificateParams::new(vec![SERVER_NAME.to_string(), rank_name(rank)])
        .map_err(tls_err("rank certificate parameters"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("Hearth rank {rank}"));
    leaf.distinguished_name = dn;
    let cert = leaf
        .signed_by(&leaf_key, &issuer)
        .map_err(tls_err("the rank certificate"))?;
    Ok(Identity {
        ca: ca_cert.der().clone(),
        chain: vec![cert.der().clone()],
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        strict_ranks: true,
    })
}

fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<Identity> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| DistError::Io {
            context: format!("reading {}", p.display()),
            source,
        })
    };
    let certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>> {
        let bytes = read(p)?;
        let v: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| DistError::Tls(format!("{}: {e}", p.display())))?;
        if v.is_empty() {
            return Err(DistError::Tls(format!(
                "{}: no PEM certificate",
                p.display()
            )));
        }
        Ok(v)
    };
    let mut cas = certs(ca)?;
    let chain = certs(cert)?;
    let key_bytes = read(key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| DistError::Tls(format!("{}: {e}", key.display())))?;
    Ok(Identity {
        ca: cas.remove(0),
        chain,
        key,
        strict_ranks: false,
    })
}

/// ring's provider with AES-128-GCM first: the cheapest suite on CPUs with AES instructions,
/// which matters when every gradient byte is encrypted.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

fn roots(id: &Identity) -> Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(id.ca.clone())
        .map_err(|e| DistError::Tls(format!("the job CA certificate: {e}")))?;
    Ok(Arc::new(roots))
}

/// Server side: requires a client certificate from the job CA.
pub fn server_config(id: &Identity) -> Result<rustls::ServerConfig> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(id)?, provider())
            .build()
            .map_err(|e| DistError::Tls(format!("client verifier: {e}")))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| DistError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| DistError::Tls(format!("this rank's certificate: {e}")))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Client side: trusts only the job CA and presents this rank's certificate.
pub fn client_config(id: &Identity) -> Result<rustls::ClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| DistError::Tls(e.to_string()))?
        .with_root_certificates(roots(id)?)
        .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| DistError::Tls(format!("this rank's certificate: {e}")))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_secret_gives_one_ca_and_another_secret_another() {
        let m = Membership::secret("correct horse battery staple").unwrap();
        let a = Identity::new(&m, 0).unwrap();
        let b = Identity::new(&m, 1).unwrap();
        let c = Identity::new(
            &Membership::secret("another job's secret value").unwrap(),
            0,
        )
        .unwrap();
        assert_eq!(a.ca, b.ca, "ranks of one job must derive the same CA");
        assert_ne!(a.chain[0], b.chain[0], "each rank has its own key");
        assert_ne!(a.ca, c.ca);
        server_config(&a).unwrap();
        client_config(&a).unwrap();
    }

    #[test]
    fn certificates_name_their_rank_and_a_claim_of_another_rank_is_refused() {
        let m = Membership::secret("correct horse battery staple").unwrap();
        let two = Identity::new(&m, 2).unwrap();
        assert!(names_rank(&two.chain[0], 2));
        assert!(!names_rank(&two.chain[0], 1));
        assert!(check_peer_rank(Some(&two.chain), 2, 4, true).is_ok());
        let e = check_peer_rank(Some(&two.chain), 1, 4, true).unwrap_err();
        assert!(e.contains("claims rank 1") && e.contains("[2]"), "{e}");
        assert!(check_peer_rank(None, 1, 4, true).is_err());
        assert!(random_secret().unwrap().len() == 64);
    }

    #[test]
    fn missing_or_weak_credentials_are_explained() {
        let none = Membership::from_lookup(&|_| None).unwrap_err().to_string();
        assert!(none.contains("HEARTH_JOB_SECRET"), "{none}");
        let short = Membership::from_lookup(&|k| (k == "HEARTH_JOB_SECRET").then(|| "abc".into()))
            .unwrap_err()
            .to_string();
        assert!(short.contains("at least 16"), "{short}");
        let partial = Membership::from_lookup(&|k| (k == "HEARTH_TLS_CA").then(|| "ca.pem".into()))
            .unwrap_err()
            .to_string();
        assert!(partial.contains("together"), "{partial}");
        let missing = Identity::new(
            &Membership::Files {
                ca: "/nonexistent/ca.pem".into(),
                cert: "/nonexistent/c.pem".into(),
                key: "/nonexistent/k.pem".into(),
            },
            0,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
    }
}
