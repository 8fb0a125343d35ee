//! `Store`'s slot reads and fills: the two-thread read of a large slot,
//! and a fill that meets a corrupt snapshot.

use super::super::{Geometry, Store, store_path};
use super::PARALLEL_READ;

/// A standby's fill reads each snapshot of the replica once and checks
/// it on the way: a corrupt one is left unsealed, the others are
/// copied, and with none good the fill fails naming the mismatch.
#[test]
fn a_fill_copies_the_good_snapshots_and_leaves_a_corrupt_one_unsealed() {
    let d = tempfile::tempdir().unwrap();
    let src = Store::create(&d.path().join("r.shm"), 3, Geometry::new(3, 5000), 7, 9).unwrap();
    let dst = Store::create(&d.path().join("d.shm"), 3, src.geometry(), 7, 9).unwrap();
    for step in [4u64, 5] {
        let slot = src.writable_slot().unwrap();
        src.write_slot(slot, 3, step, 0, &[&vec![step as u8; 5000]], &mut |_, _| {
            true
        })
        .unwrap();
    }
    let newest = src.sealed()[0];
    src.corrupt_slot_byte(newest.slot, 4321);
    let info = dst.fill_from(&src).unwrap();
    assert_eq!(info.step, 4, "the good one");
    assert_eq!(
        dst.verified_steps().0,
        vec![4],
        "the corrupt one not sealed"
    );
    let lone = Store::create(&d.path().join("l.shm"), 3, src.geometry(), 7, 9).unwrap();
    let slot = lone.writable_slot().unwrap();
    lone.write_slot(slot, 3, 6, 0, &[&vec![6u8; 5000]], &mut |_, _| true)
        .unwrap();
    lone.corrupt_slot_byte(slot, 17);
    let empty = Store::create(&d.path().join("e.shm"), 3, src.geometry(), 7, 9).unwrap();
    let e = empty.fill_from(&lone).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
    assert!(empty.sealed().is_empty());
}

/// A slot past [`PARALLEL_READ`] is read by two threads: the copy is
/// the slot's bytes, split over the buffers as asked, and one flipped
/// byte anywhere is refused.
#[test]
fn a_large_slot_is_copied_whole_and_a_flipped_byte_refused() {
    let len = PARALLEL_READ + 4099;
    let d = tempfile::tempdir().unwrap();
    let s = Store::create(&store_path(d.path(), 0), 0, Geometry::new(2, len), 1, 1).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    s.write_slot(0, 0, 9, 0, &[&data], &mut |_, _| true)
        .unwrap();
    let (mut a, mut b) = (vec![0u8; 12345], vec![0u8; len - 12345]);
    let info = s.read_slot(0, &mut [&mut a, &mut b]).unwrap();
    assert_eq!(info.step, 9);
    assert!(a == data[..12345] && b == data[12345..]);
    s.corrupt_slot_byte(0, len - 5);
    let e = s
        .read_slot(0, &mut [&mut a, &mut b])
        .unwrap_err()
        .to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
}
