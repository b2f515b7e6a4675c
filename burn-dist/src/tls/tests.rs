use super::*;

const SECRET: &str = "1f0e2d3c4b5a69788796a5b4c3d2e1f0";

#[test]
fn one_secret_gives_one_ca_and_another_secret_another() {
    let m = Membership::secret(SECRET, "job-1").unwrap();
    let a = Identity::new(&m, 0).unwrap();
    let b = Identity::new(&m, 1).unwrap();
    let c = Identity::new(
        &Membership::secret("e1d2c3b4a5968778695a4b3c2d1e0f9a", "job-1").unwrap(),
        0,
    )
    .unwrap();
    assert_eq!(a.ca, b.ca, "ranks of one job must derive the same CA");
    assert_ne!(a.chain[0], b.chain[0], "each rank has its own key");
    assert_ne!(a.ca, c.ca);
    // The same secret in another job: another salt, another CA.
    let other_job = Identity::new(&Membership::secret(SECRET, "job-2").unwrap(), 0).unwrap();
    assert_ne!(a.ca, other_job.ca);
    server_config(&a).unwrap();
    client_config(&a).unwrap();
}

#[test]
fn certificates_name_their_rank_and_a_claim_of_another_rank_is_refused() {
    let m = Membership::secret(SECRET, "job-1").unwrap();
    let two = Identity::new(&m, 2).unwrap();
    assert!(names_rank(&two.chain[0], 2));
    assert!(!names_rank(&two.chain[0], 1));
    assert!(check_peer_rank(Some(&two.chain), 2, 4).is_ok());
    let e = check_peer_rank(Some(&two.chain), 1, 4).unwrap_err();
    assert!(e.contains("claims rank 1") && e.contains("[2]"), "{e}");
    assert!(check_peer_rank(None, 1, 4).is_err());
    assert!(random_secret().unwrap().len() == 64);
}

#[test]
fn guessable_secrets_are_refused_and_random_ones_pass() {
    for weak in [
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "0123456789012345678901234567",
        "abababababababababababababababab",
        "passwordpasswordpassword",
        "deadbeefdeadbeefdeadbeefdeadbeef",
        "1234567890123456",
        // Issue 55: each passed the bound of character classes alone.
        "correct horse battery staple",
        "Password1Password1Password1!",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab",
        "parameter server test secret, long enough",
        "Tr0ub4dor&3Tr0ub4dor&3Tr0ub4dor&3",
        "qwertyuiopasdfghjklzxcvbnm1234567890",
    ] {
        let e = Membership::secret(weak, "job").unwrap_err().to_string();
        assert!(
            e.contains("too easy to guess") && e.contains("hearth secret"),
            "{weak}: {e}"
        );
    }
    for strong in [
        random_secret().unwrap(),
        random_secret().unwrap()[..32].to_string(),
    ] {
        assert!(secret_bits(strong.as_bytes()) >= 128.0, "{strong}");
        Membership::secret(&strong, "job").unwrap();
    }
    // Random secrets that begin and end alike (one in 16 did, and was refused) keep
    // their length's bits; a true repeat counts once.
    let ends_alike = "23cf9c10c801e82b17c35fea78f616e2";
    assert_eq!(secret_bits(ends_alike.as_bytes()), 128.0);
    assert!(secret_bits(b"0f73b9f0d113e3c50f73b9f0d113e3c5") <= 64.0);
    assert!(
        secret_bits(b"abcabcab") <= 12.0,
        "3 hex characters, repeated"
    );
    // A passphrase of enough words passes: 11 Diceware words are 142 bits.
    let words = "ankle bishop cobalt dwarf ember fjord gravel hatch iris jolly kiln";
    assert!(
        secret_bits(words.as_bytes()) >= 128.0,
        "{}",
        secret_bits(words.as_bytes())
    );
    // The derivation is the slow one, salted by the job, and the same on every call.
    let m = SECRET.as_bytes();
    assert_eq!(ca_seed(m, "job-1"), ca_seed(m, "job-1"));
    assert_ne!(ca_seed(m, "job-1"), ca_seed(m, "job-2"));
    let mut fast = [0u8; 32];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        std::num::NonZeroU32::new(1).unwrap(),
        &job_salt("job-1"),
        m,
        &mut fast,
    );
    assert_ne!(ca_seed(m, "job-1"), fast, "more than one round");
}

#[test]
fn missing_or_weak_credentials_are_explained() {
    let none = Membership::from_lookup(&|_| None).unwrap_err().to_string();
    assert!(none.contains("HEARTH_JOB_SECRET"), "{none}");
    let short = Membership::from_lookup(&|k| (k == "HEARTH_JOB_SECRET").then(|| "abc".into()))
        .unwrap_err()
        .to_string();
    assert!(short.contains("at least 16"), "{short}");
    // A good secret without any job id: the error names the variable to set.
    let no_job = Membership::from_lookup(&|k| (k == "HEARTH_JOB_SECRET").then(|| SECRET.into()))
        .unwrap_err()
        .to_string();
    assert!(no_job.contains("HEARTH_JOB_ID"), "{no_job}");
    // The first job id set salts: the launcher's over the coordinator's address.
    let vars = |k: &str| match k {
        "HEARTH_JOB_SECRET" => Some(SECRET.to_string()),
        "SLURM_JOB_ID" => Some("4242".to_string()),
        "HEARTH_COORDINATOR" => Some("10.0.0.1:29400".to_string()),
        _ => None,
    };
    match Membership::from_lookup(&vars).unwrap() {
        Membership::Secret { job, .. } => assert_eq!(job, "4242"),
        m => panic!("{m:?}"),
    }
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
