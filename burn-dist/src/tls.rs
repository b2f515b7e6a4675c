//! Job membership over TLS 1.3, mutual: every connection proves both ends belong to the job.
//!
//! Two ways to say who belongs:
//!
//! - **A job secret** (`HEARTH_JOB_SECRET`, or a file named by `HEARTH_JOB_SECRET_FILE`). Every
//!   rank derives the same Ed25519 CA key from it, hence the same CA certificate, and issues
//!   itself a certificate signed by that CA. A process with another secret has another CA: its
//!   handshake fails, so nothing it sends is ever read.
//!
//! **Offline guessing.** Anyone who reaches a rank's port sees a certificate signed by the CA,
//! enough to test guesses of the secret without talking to the job again. So the key comes
//! from the secret through PBKDF2-HMAC-SHA256 with [`KDF_ITERATIONS`] rounds (about a quarter
//! of a second per guess on one core; once per process, cached), salted with the job's id
//! ([`JOB_ID_VARS`]) so that no dictionary computed once serves against every Hearth job, and
//! a secret with less than [`MIN_SECRET_BITS`] bits of estimated entropy ([`secret_bits`]:
//! character classes, dictionary words, and zxcvbn's patterns) is refused with a message that
//! says how to make one ([`random_secret`], `hearth secret`). A secret of 128 random bits cannot be
//! guessed at any speed; the slow KDF is the margin for one that is less random than it looks.
//! A password-authenticated key exchange would remove the offline test altogether; it is not
//! built.
//! - **Files the user gives** (`HEARTH_TLS_CA`, `HEARTH_TLS_CERT`, `HEARTH_TLS_KEY`, PEM): a CA
//!   and this rank's certificate and key. Certificates must name [`SERVER_NAME`] as a DNS
//!   subject alternative name.
//!
//! Without either, setup fails with an error that says how to give one.
//!
//! **Ranks are bound to certificates.** A rank's certificate also names [`rank_name`]`(rank)`
//! (`rank-3.hearth-job`), and a peer's hello is accepted only when the rank it claims is the
//! rank its certificate names. With a user's CA each rank's certificate must name its own rank
//! (only the CA's holder can make one). With a secret, where every holder could make a
//! certificate for any rank, the certificates made from the secret only admit a process to the
//! rendezvous: rank 0's [`RankAuthority`], a fresh key per world that never leaves rank 0,
//! issues each member the certificate of its rank, and the members trust only it for each
//! other (see [`crate::rendezvous`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ED25519,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::secret::check_secret;
pub use crate::secret::{MIN_SECRET_BITS, MIN_SECRET_LEN, class_bits, random_secret, secret_bits};
use crate::{DistError, Result};

/// The name every rank's certificate carries and every client checks.
pub const SERVER_NAME: &str = "hearth-job";
/// ALPN protocol of burn-dist connections.
pub const ALPN: &[u8] = b"hearth-dist/1";
/// PBKDF2-HMAC-SHA256 rounds from the secret to the CA key (OWASP's 2023 figure).
pub const KDF_ITERATIONS: u32 = 600_000;

/// Where a job's id comes from, the first one set: it salts the key derivation, so every rank
/// of a job must see the same value and another job a different one. `hearth launch` sets
/// `HEARTH_JOB_ID`; Slurm and Open MPI name their jobs; a job started by hand shares its
/// coordinator's address.
pub const JOB_ID_VARS: [&str; 5] = [
    "HEARTH_JOB_ID",
    "SLURM_JOB_ID",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
    "HEARTH_COORDINATOR",
];

/// The DNS name that binds a certificate to `rank`: `rank-<rank>.hearth-job`.
pub fn rank_name(rank: usize) -> String {
    format!("rank-{rank}.{SERVER_NAME}")
}

/// Whether `cert` names `rank` (a DNS subject alternative name [`rank_name`]`(rank)`).
pub fn names_rank(cert: &CertificateDer<'_>, rank: usize) -> bool {
    names(cert, &rank_name(rank))
}

/// Whether `cert` names `name` (a DNS subject alternative name).
fn names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(name) = rustls::pki_types::ServerName::try_from(name.to_string()) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .map(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
        .unwrap_or(false)
}

/// Checks that the peer of a connection may be rank `claimed` of a job of `world`: its
/// certificate names the job ([`SERVER_NAME`], which a client checks of its server during the
/// handshake and a server checks of its client here) and that rank. The error says what the
/// certificate names.
pub fn check_peer_rank(
    peer_certs: Option<&[CertificateDer<'static>]>,
    claimed: usize,
    world: usize,
) -> std::result::Result<(), String> {
    let Some(cert) = peer_certs.and_then(|c| c.first()) else {
        return Err(format!(
            "the peer claiming rank {claimed} presented no certificate"
        ));
    };
    if !names(cert, SERVER_NAME) {
        return Err(format!(
            "the peer claiming rank {claimed} presented a certificate that does not name \
             {SERVER_NAME}"
        ));
    }
    if names_rank(cert, claimed) {
        return Ok(());
    }
    let named: Vec<usize> = (0..world).filter(|&r| names_rank(cert, r)).collect();
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
    /// A job secret and the job's id, which salts the key derivation ([`JOB_ID_VARS`]).
    Secret { secret: Vec<u8>, job: String },
    Files {
        ca: PathBuf,
        cert: PathBuf,
        key: PathBuf,
    },
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Membership::Secret { job, .. } => write!(f, "Membership::Secret(job {job:?}, ..)"),
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
    /// A job secret for the job `job` (any id every rank shares and no other job uses; it
    /// salts the key derivation), refused when the secret is short or easy to guess
    /// ([`secret_bits`]).
    pub fn secret(secret: impl AsRef<[u8]>, job: &str) -> Result<Self> {
        let s = secret.as_ref();
        check_secret(s)?;
        Ok(Self::Secret {
            secret: s.to_vec(),
            job: job.to_string(),
        })
    }

    /// From `HEARTH_JOB_SECRET`, `HEARTH_JOB_SECRET_FILE`, or `HEARTH_TLS_CA`/`_CERT`/`_KEY`,
    /// looked up through `get` ([`Membership::from_env`] gives it the environment).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let job = || {
            JOB_ID_VARS
                .iter()
                .find_map(|k| get(k).filter(|v| !v.is_empty()))
                .ok_or_else(|| {
                    DistError::Tls(format!(
                        "a job secret needs the job's id, which salts the key it derives: set \
                         HEARTH_JOB_ID to a value every rank of this job shares and no other \
                         job uses (read, the first one set: {})",
                        JOB_ID_VARS.join(", ")
                    ))
                })
        };
        if let Some(s) = get("HEARTH_JOB_SECRET").filter(|s| !s.is_empty()) {
            check_secret(s.as_bytes())?;
            return Self::secret(s, &job()?);
        }
        if let Some(path) = get("HEARTH_JOB_SECRET_FILE").filter(|s| !s.is_empty()) {
            let s = std::fs::read(&path).map_err(|source| DistError::Io {
                context: format!("reading the job secret file {path}"),
                source,
            })?;
            let trimmed = s.trim_ascii();
            check_secret(trimmed)?;
            return Self::secret(trimmed, &job()?);
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
    pub(crate) key: PrivateKeyDer<'static>,
}

impl Identity {
    /// The identity of `rank`: with a job secret, a fresh key and a certificate naming the rank.
    pub fn new(m: &Membership, rank: usize) -> Result<Self> {
        match m {
            Membership::Secret { secret, job } => from_secret(secret, job, rank),
            Membership::Files { ca, cert, key } => from_files(ca, cert, key, rank),
        }
    }
}

fn tls_err(what: &str) -> impl Fn(rcgen::Error) -> DistError + '_ {
    move |e| DistError::Tls(format!("{what}: {e}"))
}

/// The salt of job `job`'s key derivation.
fn job_salt(job: &str) -> Vec<u8> {
    let mut salt = b"hearth burn-dist job CA v3\0".to_vec();
    salt.extend_from_slice(job.as_bytes());
    salt
}

/// The 32-byte seed of the job CA's key: PBKDF2-HMAC-SHA256 of the secret, [`KDF_ITERATIONS`]
/// rounds salted with the job's id (every rank of the job finds the same key; another job,
/// another salt). Computed once per secret, job and process: a job re-forms its links many
/// times.
fn ca_seed(secret: &[u8], job: &str) -> [u8; 32] {
    type Seeds = Vec<([u8; 32], [u8; 32])>;
    static SEEDS: std::sync::Mutex<Seeds> = std::sync::Mutex::new(Vec::new());
    let salt = job_salt(job);
    let mut keyed = (secret.len() as u64).to_le_bytes().to_vec();
    keyed.extend_from_slice(secret);
    keyed.extend_from_slice(&salt);
    let mut id = [0u8; 32];
    id.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, &keyed).as_ref());
    let mut seeds = SEEDS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, seed)) = seeds.iter().find(|(k, _)| *k == id) {
        return *seed;
    }
    let mut seed = [0u8; 32];
    let rounds = std::num::NonZeroU32::new(KDF_ITERATIONS).unwrap_or(std::num::NonZeroU32::MIN);
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        rounds,
        &salt,
        secret,
        &mut seed,
    );
    seeds.push((id, seed));
    seed
}

/// The job CA's Ed25519 key from the secret ([`ca_seed`]).
fn ca_key(secret: &[u8], job: &str) -> Result<KeyPair> {
    let seed = ca_seed(secret, job);
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

/// A rank certificate's contents: the job's name and the rank's.
fn rank_params(rank: usize) -> Result<CertificateParams> {
    let mut leaf = CertificateParams::new(vec![SERVER_NAME.to_string(), rank_name(rank)])
        .map_err(tls_err("rank certificate parameters"))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("Hearth rank {rank}"));
    leaf.distinguished_name = dn;
    Ok(leaf)
}

fn from_secret(secret: &[u8], job: &str, rank: usize) -> Result<Identity> {
    let ca_key = ca_key(secret, job)?;
    let ca_params = ca_params()?;
    // Deterministic: fixed parameters and an Ed25519 signature, so every rank builds the same CA.
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(tls_err("the job CA certificate"))?;
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate_for(&PKCS_ED25519).map_err(tls_err("a rank key"))?;
    let cert = rank_params(rank)?
        .signed_by(&leaf_key, &issuer)
        .map_err(tls_err("the rank certificate"))?;
    Ok(Identity {
        ca: ca_cert.der().clone(),
        chain: vec![cert.der().clone()],
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
    })
}

/// The rank a certificate names ([`rank_name`]), if exactly one (checked with
/// [`names_rank`], not only read).
pub fn certificate_rank(cert: &CertificateDer<'_>) -> Option<usize> {
    let parsed = webpki::EndEntityCert::try_from(cert).ok()?;
    let suffix = format!(".{SERVER_NAME}");
    let named: Vec<usize> = parsed
        .valid_dns_names()
        .filter_map(|n| {
            n.strip_suffix(suffix.as_str())?
                .strip_prefix("rank-")?
                .parse()
                .ok()
        })
        .collect();
    match named.as_slice() {
        [r] if names_rank(cert, *r) => Some(*r),
        _ => None,
    }
}

/// A user's CA, certificate and key for `rank`: the certificate must name the job and this
/// rank (the rank comes from the certificate: the process's own rank number must agree).
fn from_files(ca: &Path, cert: &Path, key: &Path, rank: usize) -> Result<Identity> {
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
    let leaf = &chain[0];
    if !names(leaf, SERVER_NAME) {
        return Err(DistError::Tls(format!(
            "{}: the certificate must name {SERVER_NAME} (a DNS subject alternative name)",
            cert.display()
        )));
    }
    if !names_rank(leaf, rank) {
        let says = match certificate_rank(leaf) {
            Some(r) => format!("it names rank {r}"),
            None => "it names no rank".to_string(),
        };
        return Err(DistError::Tls(format!(
            "{}: this process is rank {rank}, and {says}: give each rank a certificate with \
             the DNS name {} (only the holder of the CA key can issue one, so no rank can pose \
             as another)",
            cert.display(),
            rank_name(rank)
        )));
    }
    let key_bytes = read(key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| DistError::Tls(format!("{}: {e}", key.display())))?;
    Ok(Identity {
        ca: cas.remove(0),
        chain,
        key,
    })
}

/// The authority that issues rank certificates in a job formed with a secret: a fresh Ed25519
/// key that rank 0 makes at each rendezvous and never sends anywhere, so no member can derive
/// it from the secret. Rank 0 issues each member a certificate for the rank it was admitted as,
/// over the public key the member proved it holds in its handshake; the members then trust
/// only this authority for each other, so a member cannot present another rank's certificate
/// (it would need that rank's private key, or this authority's).
pub struct RankAuthority {
    ca: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

/// An Ed25519 public key taken from a certificate, to issue another certificate over it.
struct Ed25519Public(Vec<u8>);

impl rcgen::PublicKeyData for Ed25519Public {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &PKCS_ED25519
    }
}

/// The SubjectPublicKeyInfo of an Ed25519 key: the algorithm's fixed prefix, then 32 bytes.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// The Ed25519 key `cert` is for (every burn-dist certificate made from a secret has one).
fn ed25519_key(cert: &CertificateDer<'_>) -> Result<Ed25519Public> {
    let parsed = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| DistError::Tls(format!("a certificate that does not parse: {e:?}")))?;
    let spki = parsed.subject_public_key_info();
    let spki = spki.as_ref();
    match spki.strip_prefix(&ED25519_SPKI_PREFIX[..]) {
        Some(key) if key.len() == 32 => Ok(Ed25519Public(key.to_vec())),
        _ => Err(DistError::Tls(
            "a certificate whose key is not Ed25519: rank certificates are issued only for              the keys burn-dist makes"
                .into(),
        )),
    }
}

impl RankAuthority {
    /// A new authority with a random key.
    pub fn new() -> Result<Self> {
        let key =
            KeyPair::generate_for(&PKCS_ED25519).map_err(tls_err("the rank authority key"))?;
        let mut params = ca_params()?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "Hearth rank authority");
        params.distinguished_name = dn;
        let ca = params
            .self_signed(&key)
            .map_err(tls_err("the rank authority certificate"))?;
        Ok(Self {
            ca: ca.der().clone(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The authority's certificate: the one root the members trust for each other.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    /// A certificate naming the job and `rank`, over the key of `presented` (the certificate
    /// the member authenticated with).
    pub fn issue(
        &self,
        rank: usize,
        presented: &CertificateDer<'_>,
    ) -> Result<CertificateDer<'static>> {
        let key = ed25519_key(presented)?;
        let cert = rank_params(rank)?
            .signed_by(&key, &self.issuer)
            .map_err(tls_err("issuing a rank certificate"))?;
        Ok(cert.der().clone())
    }
}

impl Identity {
    /// This identity's key with the certificate rank 0 issued (`cert`, from the authority
    /// `ca`): refused unless `cert` is for this identity's own key and names `rank`.
    pub fn issued(
        &self,
        ca: CertificateDer<'static>,
        cert: CertificateDer<'static>,
        rank: usize,
    ) -> Result<Identity> {
        let own = self
            .chain
            .first()
            .ok_or_else(|| DistError::Tls("an identity without a certificate".into()))?;
        if ed25519_key(own)?.0 != ed25519_key(&cert)?.0 {
            return Err(DistError::Tls(
                "the coordinator issued a certificate for another key".into(),
            ));
        }
        if !names_rank(&cert, rank) || !names(&cert, SERVER_NAME) {
            return Err(DistError::Tls(format!(
                "the coordinator issued a certificate that does not name rank {rank} of the job"
            )));
        }
        Ok(Identity {
            ca,
            chain: vec![cert],
            key: self.key.clone_key(),
        })
    }
}

impl Membership {
    /// Whether rank 0 issues the ranks' certificates at the rendezvous: with a secret, since
    /// any holder could make a certificate for any rank from it; a user's CA binds each rank
    /// in the certificate the user gave.
    pub fn rank_zero_issues(&self) -> bool {
        matches!(self, Membership::Secret { .. })
    }
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
mod tests;
