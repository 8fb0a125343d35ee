use super::*;
use crate::auth::KEY_LEN;
use proptest::prelude::*;

fn secret(b: u8) -> Secret {
    Secret::from_bytes([b; KEY_LEN])
}

/// An open pair of sessions: (initiator, acceptor).
fn pair() -> (Session, Session) {
    pair_with(1)
}

/// A pair whose sessions draw nonces `n` and `n + 1`.
fn pair_with(n: u8) -> (Session, Session) {
    let (pending, hello) = Pending::hello(secret(7), 1, [n; NONCE_LEN]);
    let (acc, welcome) = Session::accept(secret(7), 2, 5, &hello, [n + 1; NONCE_LEN], 8).unwrap();
    let (ini, w) = pending.welcomed(&welcome).unwrap();
    assert_eq!(w.credit, 8);
    assert_eq!((ini.peer, acc.peer, ini.epoch), (2, 1, 5));
    (ini, acc)
}

fn chunk() -> ChunkHeader {
    ChunkHeader {
        rank: 3,
        step: 40,
        epoch: 1,
        total: 10,
        offset: 4,
        capacity: 4096,
        layout_hash: 9,
        job_hash: 8,
        sealed_at_unix_ns: 7,
        checksum: 6,
    }
}

#[test]
fn a_chunk_goes_through_and_its_receipt_comes_back() {
    let (mut ini, mut acc) = pair();
    let data = [5u8; 6];
    let wire = ini.seal(Kind::Chunk, &[&chunk().encode(), &data]);
    let f = acc.open(&wire).unwrap();
    assert_eq!(f.kind, Kind::Chunk);
    let (h, d) = ChunkHeader::parse(f.payload).unwrap();
    assert_eq!((h, d), (chunk(), &data[..]));
    let back = acc.seal(Kind::Stored, &[&receipt(3, 40)]);
    let f = ini.open(&back).unwrap();
    assert_eq!(
        parse_receipt(f.kind, f.payload).unwrap(),
        Receipt {
            rank: 3,
            step: 40,
            dropped: None
        }
    );
    let back = acc.seal(
        Kind::Dropped,
        &[&dropped(3, 41, DropCode::NotHolder, "not mine")],
    );
    let f = ini.open(&back).unwrap();
    assert_eq!(
        parse_receipt(f.kind, f.payload).unwrap(),
        Receipt {
            rank: 3,
            step: 41,
            dropped: Some((DropCode::NotHolder, "not mine".into()))
        }
    );
}

#[test]
fn a_receipt_is_refused_without_its_code_with_an_unknown_one_or_of_another_kind() {
    let mut no_code = receipt(1, 2).to_vec();
    assert!(parse_receipt(Kind::Dropped, &no_code).is_err());
    no_code.push(9);
    let e = parse_receipt(Kind::Dropped, &no_code).unwrap_err();
    assert!(e.to_string().contains("unknown drop reason code 9"), "{e}");
    assert!(parse_receipt(Kind::Stored, &dropped(1, 2, DropCode::Failed, "")).is_err());
    assert!(parse_receipt(Kind::Credit, &receipt(1, 2)).is_err());
    assert!(parse_receipt(Kind::Dropped, &receipt(1, 2)[..15]).is_err());
}

#[test]
fn replayed_reflected_and_foreign_frames_are_refused_and_change_nothing() {
    let (mut ini, mut acc) = pair();
    let first = ini.seal(Kind::Credit, &[&1u32.to_le_bytes()]);
    acc.open(&first).unwrap();
    // Replayed on its own session.
    assert_eq!(acc.open(&first).unwrap_err().class(), Rejection::Replayed);
    // Reflected back to its sender.
    assert_eq!(ini.open(&first).unwrap_err().class(), Rejection::Forged);
    // Replayed into another session of the same job.
    let (_, mut acc2) = pair_with(3);
    assert_eq!(acc2.open(&first).unwrap_err().class(), Rejection::Forged);
    // Forged without the secret.
    let (_, hello) = Pending::hello(secret(9), 1, [3; NONCE_LEN]);
    assert!(matches!(
        Session::accept(secret(7), 2, 0, &hello, [4; NONCE_LEN], 1),
        Err(PeerError::BadTag { .. })
    ));
    // The session still takes the next genuine frame.
    let next = ini.seal(Kind::Credit, &[&2u32.to_le_bytes()]);
    assert_eq!(parse_credit(acc.open(&next).unwrap().payload).unwrap(), 2);
}

#[test]
fn a_session_frame_is_tagged_with_gmac_under_its_directions_key_and_number() {
    let (mut ini, mut acc) = pair();
    let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    let first = ini.seal(Kind::Credit, &[&1u32.to_le_bytes()]);
    let wire = ini.seal(Kind::Chunk, &[&chunk().encode()[..40], &big[..]]);
    let body = &wire[..wire.len() - TAG_LEN];
    // The key as the module's doc derives it, the tag by AES-256-GCM with
    // the frame as associated data and nothing to encrypt, nonce = seq 1.
    let k = secret(7).tag(KEY_DOMAIN, &[b"i2a", &[1; NONCE_LEN], &[2; NONCE_LEN]]);
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, k.as_bytes()).unwrap());
    let mut n = [0u8; 12];
    n[0] = 1;
    let tag = key
        .seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(body), &mut [])
        .unwrap();
    assert_eq!(&wire[wire.len() - TAG_LEN..], tag.as_ref());
    // The acceptor takes it after frame 0, and not in its place.
    assert!(matches!(
        acc.open(&wire),
        Err(PeerError::Replayed {
            seq: 1,
            expected: 0,
            ..
        })
    ));
    acc.open(&first).unwrap();
    assert!(acc.open(&wire).is_ok());
}

#[test]
fn a_heartbeat_round_trips() {
    for b in [
        Beat {
            stamp_ns: 5,
            follows: Some(2),
            echo_ns: Some(9),
            term: 3,
        },
        Beat {
            stamp_ns: 0,
            follows: None,
            echo_ns: None,
            term: 0,
        },
    ] {
        assert_eq!(Beat::parse(&b.encode()).unwrap(), b);
    }
    assert!(Beat::parse(&[0; 31]).is_err());
}

#[test]
fn a_welcome_to_another_hello_is_refused() {
    let (p1, _) = Pending::hello(secret(7), 1, [1; NONCE_LEN]);
    let (_, hello2) = Pending::hello(secret(7), 1, [6; NONCE_LEN]);
    let (_, welcome2) = Session::accept(secret(7), 2, 0, &hello2, [2; NONCE_LEN], 8).unwrap();
    assert!(p1.welcomed(&welcome2).is_err());
}

#[test]
fn chunk_layouts_that_lie_are_refused() {
    let mut h = chunk();
    h.offset = u64::MAX;
    let p = [&h.encode()[..], &[1u8; 3]].concat();
    assert!(ChunkHeader::parse(&p).is_err());
    let mut h = chunk();
    h.total = 5000;
    let p = [&h.encode()[..], &[1u8; 3]].concat();
    assert!(ChunkHeader::parse(&p).is_err());
    assert!(ChunkHeader::parse(&chunk().encode()).is_err(), "no data");
}

#[test]
fn a_state_map_frame_names_its_rank_and_bounds_its_size() {
    let (mut ini, mut acc) = pair();
    let wire = ini.seal(Kind::Map, &[&7u64.to_le_bytes(), b"{}"]);
    let f = acc.open(&wire).unwrap();
    assert_eq!(f.kind, Kind::Map);
    assert_eq!(parse_map(f.payload).unwrap(), (7, &b"{}"[..]));
    assert!(parse_map(&[1, 2, 3]).is_err(), "shorter than a rank");
    let big = vec![b' '; 8 + MAX_MAP + 1];
    let e = parse_map(&big).unwrap_err().to_string();
    assert!(e.contains("state map"), "{e}");
}

proptest! {
    #[test]
    fn every_bit_flip_is_refused(byte in 0usize..(HEADER_LEN + CHUNK_HEADER_LEN + 6 + TAG_LEN), bit in 0u8..8) {
        let (mut ini, mut acc) = pair();
        let mut wire = ini.seal(Kind::Chunk, &[&chunk().encode(), &[5u8; 6]]);
        wire[byte] ^= 1 << bit;
        prop_assert!(acc.open(&wire).is_err());
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let (mut ini, mut acc) = pair();
        let _ = decode(&bytes);
        let _ = acc.open(&bytes);
        let _ = ini.open(&bytes);
        let _ = ChunkHeader::parse(&bytes);
        let _ = parse_credit(&bytes);
        let _ = parse_map(&bytes);
        let _ = Beat::parse(&bytes);
        let _ = parse_receipt(Kind::Stored, &bytes);
        let _ = parse_receipt(Kind::Dropped, &bytes);
        let _ = Session::accept(secret(7), 2, 0, &bytes, [2; NONCE_LEN], 1);
        let (p, _) = Pending::hello(secret(7), 1, [1; NONCE_LEN]);
        let _ = p.welcomed(&bytes);
    }

    #[test]
    fn arbitrary_bytes_behind_a_valid_header_never_panic(kind in 0u8..10, body in proptest::collection::vec(any::<u8>(), 0..300)) {
        // A header that passes the first checks, so the later ones run.
        let mut wire = Vec::new();
        wire.extend_from_slice(&MAGIC);
        wire.extend_from_slice(&VERSION.0.to_le_bytes());
        wire.extend_from_slice(&VERSION.1.to_le_bytes());
        wire.push(kind);
        wire.extend_from_slice(&[0; 31]);
        wire.extend_from_slice(&(body.len() as u32).to_le_bytes());
        wire.extend_from_slice(&[0; 4]);
        wire.extend_from_slice(&body);
        wire.extend_from_slice(&[0; TAG_LEN]);
        let (_, mut acc) = pair();
        if let Ok(f) = decode(&wire) {
            let _ = ChunkHeader::parse(f.payload);
            let _ = parse_receipt(f.kind, f.payload);
            let _ = Beat::parse(f.payload);
        }
        prop_assert!(acc.open(&wire).is_err(), "an untagged frame is never accepted");
    }
}
