//! How guessable a job secret is, and how to make one that is not: the estimate
//! ([`secret_bits`]: the least of the character classes' bound, a passphrase's words and
//! zxcvbn's patterns), the refusal below [`MIN_SECRET_BITS`], and [`random_secret`]. The job
//! CA's key is derived from the secret in [`crate::tls`]; anyone who reaches a rank's port can
//! test guesses of it offline, hence the bar.

use crate::{DistError, Result};

/// Shortest job secret accepted.
pub const MIN_SECRET_LEN: usize = 16;
/// Least estimated entropy of a job secret, bits ([`secret_bits`]).
pub const MIN_SECRET_BITS: f64 = 128.0;
/// An estimate of a secret's entropy in bits, the least of three:
/// - its character classes ([`class_bits`]): its length times the bits of the smallest
///   alphabet that spells it, a repeated pattern counted once;
/// - as a phrase: a secret of several words (letters between spaces or punctuation) counts each
///   word as one pick from a 7,776-word list (12.9 bits, Diceware's), whatever its length;
/// - zxcvbn's estimate of the guesses an attacker with dictionaries, keyboard runs, sequences,
///   dates and repeats needs (used where it is below 2^63, where the crate saturates).
///
/// "correct horse battery staple" is 4 words (52 bits) and "Password1Password1Password1!" a
/// repeat of a dictionary word (about 15 bits): both are refused; 32 random hex characters
/// keep their 128 bits.
pub fn secret_bits(secret: &[u8]) -> f64 {
    class_bits(secret)
        .min(phrase_bits(secret))
        .min(pattern_bits(secret))
}

/// Bits of one word of a passphrase: a pick from Diceware's 7,776 words.
const WORD_BITS: f64 = 12.925;

/// A secret of two or more tokens split at spaces and punctuation, where words (a lower-case
/// run, possibly capitalised, of at most 12 letters) count [`WORD_BITS`] each and other tokens
/// their [`class_bits`]; infinite for a secret of one token.
fn phrase_bits(secret: &[u8]) -> f64 {
    let tokens: Vec<&[u8]> = secret
        .split(|b| b.is_ascii_whitespace() || b.is_ascii_punctuation())
        .filter(|t| !t.is_empty())
        .collect();
    if tokens.len() < 2 {
        return f64::INFINITY;
    }
    let word = |t: &[u8]| {
        t.len() <= 12 && t.iter().skip(1).all(u8::is_ascii_lowercase) && t[0].is_ascii_alphabetic()
    };
    tokens
        .iter()
        .map(|t| {
            if word(t) {
                WORD_BITS.min(class_bits(t))
            } else {
                class_bits(t)
            }
        })
        .sum()
}

/// log2 of zxcvbn's guesses; infinite where it saturates (about 2^63 and more) or the secret
/// is not UTF-8.
fn pattern_bits(secret: &[u8]) -> f64 {
    let Ok(text) = std::str::from_utf8(secret) else {
        return f64::INFINITY;
    };
    // zxcvbn's matching grows faster than linearly; a secret longer than this has bits enough
    // in its first part or is refused for it.
    let text: String = text.chars().take(100).collect();
    let log10 = zxcvbn::zxcvbn(&text, &[]).guesses_log10();
    if log10 >= 19.0 {
        f64::INFINITY
    } else {
        log10 * std::f64::consts::LOG2_10
    }
}

/// A generous bound: the secret's length times the bits of the smallest alphabet of character
/// classes that spells it (digits 10, hex 16, lower or upper case 26 each, anything else 33);
/// a repeated pattern counts what it repeats once.
pub fn class_bits(secret: &[u8]) -> f64 {
    let has = |f: fn(&u8) -> bool| secret.iter().any(f);
    let (digit, lower, upper) = (
        has(u8::is_ascii_digit),
        has(u8::is_ascii_lowercase),
        has(u8::is_ascii_uppercase),
    );
    let other = has(|b| !b.is_ascii_alphanumeric());
    let hex = secret.iter().all(u8::is_ascii_hexdigit);
    let alphabet: f64 = if hex && !(lower && upper) {
        if lower || upper { 16.0 } else { 10.0 }
    } else {
        f64::from(u8::from(digit)) * 10.0
            + f64::from(u8::from(lower)) * 26.0
            + f64::from(u8::from(upper)) * 26.0
            + f64::from(u8::from(other)) * 33.0
    };
    // A pattern of p characters repeated (twice or more: p at most half the length) adds
    // nothing after its first p. A secret that merely ends as it began is no repeat: a random
    // one does that once in 16 (hex), and must not lose a character's bits for it.
    let period = (1..=secret.len() / 2)
        .find(|&p| secret.iter().enumerate().all(|(i, b)| *b == secret[i % p]))
        .unwrap_or(secret.len());
    period as f64 * alphabet.max(1.0).log2()
}

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

/// An error when the job secret `s` is short or easy to guess ([`secret_bits`]).
pub(crate) fn check_secret(s: &[u8]) -> Result<()> {
    let make = "make one with `hearth secret` (or `openssl rand -hex 32`)";
    if s.len() < MIN_SECRET_LEN {
        return Err(DistError::Tls(format!(
            "the job secret is {} bytes; use at least {MIN_SECRET_LEN}: {make}",
            s.len()
        )));
    }
    let bits = secret_bits(s);
    if bits < MIN_SECRET_BITS {
        return Err(DistError::Tls(format!(
            "the job secret is too easy to guess (about {bits:.0} bits; at least \
             {MIN_SECRET_BITS:.0} needed): anyone who reaches a rank's port can test guesses \
             of it offline; {make}"
        )));
    }
    Ok(())
}
