use super::*;
use ed25519_dalek::{Signer, SigningKey};

const NOW_MS: i64 = 1_700_000_000_000;
const ISS: &str = DEFAULT_ISSUER;

fn signing_key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn bundle() -> TrustBundle {
    let mut b = TrustBundle::new(ISS);
    b.keys.insert("k1".into(), signing_key(1).verifying_key());
    b
}

fn b64(v: &Value) -> String {
    URL_SAFE_NO_PAD.encode(v.to_string())
}

fn sign(header: &Value, claims: &Value, key: &SigningKey) -> String {
    let input = format!("{}.{}", b64(header), b64(claims));
    let sig = key.sign(input.as_bytes());
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.to_bytes()))
}

fn claims(aud: &str, iat_s: i64, exp_s: i64) -> Value {
    json!({"iss": ISS, "aud": aud, "sub": "pool:p", "iat": iat_s, "exp": exp_s, "jti": "j1"})
}

fn good(claims: &Value) -> String {
    sign(
        &json!({"alg": "EdDSA", "kid": "k1", "typ": "JWT"}),
        claims,
        &signing_key(1),
    )
}

fn now_s() -> i64 {
    NOW_MS / 1000
}

fn verify(token: &str) -> Result<Claims, Error> {
    bundle().verify_at(token, &Expectation::kind(Kind::Supervisor, ISS), NOW_MS)
}

#[test]
fn a_good_token_verifies_and_decodes() {
    let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
    let c = verify(&token).unwrap();
    assert_eq!((c.sub.as_str(), c.aud.as_str()), ("pool:p", SUPERVISOR_AUDIENCE));
}

#[test]
fn expiry_has_leeway_of_the_clock_skew_and_no_more() {
    let skew_s = MAX_CLOCK_SKEW.as_secs() as i64;
    let exp = now_s() - skew_s + 1;
    assert!(verify(&good(&claims(SUPERVISOR_AUDIENCE, exp - 60, exp))).is_ok());
    let exp = now_s() - skew_s;
    assert!(matches!(
        verify(&good(&claims(SUPERVISOR_AUDIENCE, exp - 60, exp))),
        Err(Error::Expired)
    ));
    let iat = now_s() + skew_s + 1;
    assert!(matches!(
        verify(&good(&claims(SUPERVISOR_AUDIENCE, iat, iat + 60))),
        Err(Error::NotYetValid)
    ));
}

#[test]
fn algorithm_is_pinned_before_the_key_lookup() {
    let c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
    // An unknown kid with a wrong alg reports the algorithm: no lookup happened.
    for alg in ["none", "HS256", "ES256", "RS256", "eddsa", "EdDSA "] {
        let token = format!("{}.{}.", b64(&json!({"alg": alg, "kid": "nope"})), b64(&c));
        assert!(matches!(verify(&token), Err(Error::Algorithm(_))), "{alg}");
    }
    let token = format!("{}.{}.", b64(&json!({"kid": "k1"})), b64(&c));
    assert!(matches!(verify(&token), Err(Error::Algorithm(_))));
}

#[test]
fn kid_crit_signature_and_shape_are_checked() {
    let c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
    let key = signing_key(1);
    let no_kid = sign(&json!({"alg": "EdDSA"}), &c, &key);
    assert!(matches!(verify(&no_kid), Err(Error::MissingKid)));
    let unknown = sign(&json!({"alg": "EdDSA", "kid": "k9"}), &c, &key);
    assert!(matches!(verify(&unknown), Err(Error::UnknownKid(k)) if k == "k9"));
    let crit = sign(
        &json!({"alg": "EdDSA", "kid": "k1", "crit": ["b64"], "b64": false}),
        &c,
        &key,
    );
    assert!(matches!(verify(&crit), Err(Error::Critical)));
    let other_key = sign(&json!({"alg": "EdDSA", "kid": "k1"}), &c, &signing_key(2));
    assert!(matches!(verify(&other_key), Err(Error::Signature)));
    for bad in ["", "a.b", "a.b.c.d", "!!.e30.AA"] {
        assert!(matches!(verify(bad), Err(Error::Malformed(_))), "{bad}");
    }
    let huge = "a".repeat(MAX_TOKEN_BYTES + 1);
    assert!(matches!(verify(&huge), Err(Error::TooLarge { .. })));
}

#[test]
fn tampered_payload_is_refused() {
    let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
    let parts: Vec<&str> = token.split('.').collect();
    let forged = b64(&json!({"iss": ISS, "aud": SUPERVISOR_AUDIENCE, "sub": "pool:evil",
            "iat": now_s(), "exp": now_s() + 60, "jti": "j1"}));
    let tampered = format!("{}.{forged}.{}", parts[0], parts[2]);
    assert!(matches!(verify(&tampered), Err(Error::Signature)));
}

#[test]
fn audience_issuer_type_and_lifetime_are_checked() {
    let key = signing_key(1);
    let c = claims(INSTANCE_AUDIENCE, now_s(), now_s() + 60);
    assert!(matches!(verify(&good(&c)), Err(Error::Audience { .. })));
    let mut c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
    c["iss"] = json!("someone-else");
    assert!(matches!(verify(&good(&c)), Err(Error::Issuer { .. })));
    c["iss"] = json!(ISS);
    c["aud"] = json!([SUPERVISOR_AUDIENCE]);
    assert!(
        matches!(verify(&good(&c)), Err(Error::Audience { .. })),
        "arrays are never minted"
    );
    c["aud"] = json!(SUPERVISOR_AUDIENCE);
    let wrong_typ = sign(&json!({"alg": "EdDSA", "kid": "k1", "typ": GRANT_TYP}), &c, &key);
    assert!(matches!(verify(&wrong_typ), Err(Error::Type { .. })));
    let long = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 3601);
    assert!(matches!(verify(&good(&long)), Err(Error::Lifetime { .. })));
    let no_exp = json!({"iss": ISS, "aud": SUPERVISOR_AUDIENCE, "iat": now_s()});
    assert!(matches!(verify(&good(&no_exp)), Err(Error::Claims(_))));
}

#[test]
fn errors_never_quote_the_token() {
    let c = claims(SUPERVISOR_AUDIENCE, now_s() - 7200, now_s() - 3600);
    let token = good(&c);
    let shown = verify(&token).unwrap_err().to_string();
    for part in token.split('.') {
        assert!(!shown.contains(part), "{shown}");
    }
    let weird = format!("{}.e30.", b64(&json!({"alg": "x".repeat(100)})));
    assert!(verify(&weird).unwrap_err().to_string().contains("(unprintable)"));
}

#[test]
fn jwks_round_trips_and_refuses_bad_sets() {
    let mut b = bundle();
    b.keys.insert("k2".into(), signing_key(2).verifying_key());
    let parsed = TrustBundle::from_jwks(b.to_jwks().as_bytes()).unwrap();
    assert_eq!(parsed, b);

    let x = URL_SAFE_NO_PAD.encode(signing_key(1).verifying_key().as_bytes());
    let set = |keys: Value| json!({"issuer": ISS, "keys": keys}).to_string();
    let ok_key = json!({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "k1"});
    // Other key types are skipped, not fatal.
    let mixed = set(json!([ok_key, {"kty": "EC", "crv": "P-256", "kid": "e", "x": "AA", "y": "AA"}]));
    assert_eq!(TrustBundle::from_jwks(mixed.as_bytes()).unwrap().keys.len(), 1);
    let refused = [
        set(json!([ok_key, ok_key])),
        set(json!([{"kty": "OKP", "crv": "Ed25519", "x": x}])),
        set(json!([{"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "k1", "d": x}])),
        set(json!([{"kty": "OKP", "crv": "Ed25519", "x": "AAAA", "kid": "k1"}])),
        set(json!([])),
        json!({"keys": [ok_key]}).to_string(),
        "not json".into(),
        format!("{}{}", set(json!([ok_key])), " ".repeat(MAX_BUNDLE_BYTES)),
    ];
    for jwks in refused {
        assert!(
            TrustBundle::from_jwks(jwks.as_bytes()).is_err(),
            "{}",
            &jwks[..jwks.len().min(200)]
        );
    }
}

#[test]
fn claims_at_the_i64_edges_never_overflow_the_checks() {
    let max_s = i64::MAX / 1000;
    let cases = [
        // The reported token: `exp - iat` in milliseconds wraps to a negative lifetime.
        (-9_000_000_000_000_000, 9_000_000_000_000_000),
        (-max_s, max_s),
        (i64::MIN, i64::MAX),
        (i64::MIN, now_s() + 60),
        (now_s() - 60, i64::MAX),
        (-1, now_s() + 60),
        (now_s() - 60, -1),
        (now_s() + 60, now_s() - 60),
        (i64::MAX, i64::MIN),
    ];
    for (iat, exp) in cases {
        let refused = verify(&good(&claims(SUPERVISOR_AUDIENCE, iat, exp)));
        assert!(refused.is_err(), "iat {iat}, exp {exp}: {refused:?}");
    }
    let refused = verify(&good(&claims(
        SUPERVISOR_AUDIENCE,
        -9_000_000_000_000_000,
        9_000_000_000_000_000,
    )));
    assert!(matches!(refused, Err(Error::Lifetime { .. })), "{refused:?}");
    // The same edges against a verifier without a lifetime bound.
    let unbounded = Expectation::new(SUPERVISOR_AUDIENCE, ISS);
    for (iat, exp) in cases {
        let token = good(&claims(SUPERVISOR_AUDIENCE, iat, exp));
        let outcome = bundle().verify_at::<Claims>(&token, &unbounded, NOW_MS);
        let reasonable = (0..=now_s()).contains(&iat) && exp > now_s() && exp <= max_s;
        assert_eq!(outcome.is_ok(), reasonable, "iat {iat}, exp {exp}: {outcome:?}");
    }
    // And at the edges of the verifier's clock.
    for now in [i64::MIN, i64::MAX, -1] {
        let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
        let at = bundle().verify_at::<Claims>(&token, &Expectation::kind(Kind::Supervisor, ISS), now);
        assert!(at.is_err(), "now {now}: {at:?}");
    }
}

#[test]
fn kinds_bound_lifetimes_below_key_retention() {
    for kind in Kind::ALL {
        assert!(kind.max_lifetime() <= SUPERVISOR_TOKEN_LIFETIME, "{kind:?}");
    }
    assert_eq!(route_of(&instance_subject("team-a/web-0")), Some("team-a/web-0"));
    assert_eq!(route_of("member:m"), None);
    assert_eq!(member_of(&member_subject("supervisor-0")), Some("supervisor-0"));
    assert_eq!(member_of("instance:a/b"), None);
    assert_eq!(member_of("member:"), None);
}
