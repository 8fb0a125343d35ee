//! What authentication costs, measured in the same run with and without the
//! job's secret:
//! - `store round trip`: one `set` and one `get` on an open connection to
//!   the rendezvous store over loopback (median over rounds of 5,000);
//! - `ring set-up`: four ranks (threads) building their TCP ring for a new
//!   epoch through the store, handshake included (median of 30 epochs).
//!
//! The two configurations are interleaved, and the table gives each median
//! and the ratio of authenticated to plain.

mod common;
use common::median;
use hatrain_shared::auth::{KEY_LEN, Secret};
use hatrain_shared::store::{StoreClient, StoreServer};
use hatrain_trainer::collective::Communicator;
use std::time::{Duration, Instant};

const TRIPS: usize = 5_000;
const ROUNDS: usize = 7;
const EPOCHS: u64 = 30;

fn round_trips(secret: Option<Secret>) -> f64 {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let mut c = StoreClient::connect(server.local_addr(), Duration::from_secs(5), secret).unwrap();
    let t = Instant::now();
    for i in 0..TRIPS {
        c.set("k", &i.to_string()).unwrap();
        c.get("k", Duration::ZERO).unwrap();
    }
    t.elapsed().as_secs_f64() / TRIPS as f64
}

fn ring_setups(secret: Option<Secret>) -> Vec<f64> {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let addr = server.local_addr();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            let secret = secret.clone();
            std::thread::spawn(move || {
                let mut store =
                    StoreClient::connect(addr, Duration::from_secs(5), secret.clone()).unwrap();
                (1..=EPOCHS)
                    .map(|epoch| {
                        let t = Instant::now();
                        let c = Communicator::connect(
                            &mut store,
                            rank,
                            4,
                            epoch,
                            Duration::from_secs(30),
                            secret.as_ref(),
                            &|| false,
                        )
                        .unwrap();
                        drop(c);
                        t.elapsed().as_secs_f64()
                    })
                    .collect::<Vec<f64>>()
            })
        })
        .collect();
    let per_rank: Vec<Vec<f64>> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    // An epoch's set-up is done when its slowest rank is.
    (0..EPOCHS as usize)
        .map(|e| per_rank.iter().map(|r| r[e]).fold(0.0, f64::max))
        .collect()
}

fn main() {
    let key = Secret::from_bytes([0x42; KEY_LEN]);
    let (mut plain, mut authed) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        plain.push(round_trips(None));
        authed.push(round_trips(Some(key.clone())));
    }
    let (rp, ra) = (median(plain), median(authed));
    let (mut plain, mut authed) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        plain.extend(ring_setups(None));
        authed.extend(ring_setups(Some(key.clone())));
    }
    let (sp, sa) = (median(plain), median(authed));
    println!("authentication cost, median (loopback, 2-core machine)");
    println!(
        "{:<22} {:>12} {:>14} {:>8}",
        "case", "plain", "authenticated", "ratio"
    );
    println!(
        "{:<22} {:>9.1} us {:>11.1} us {:>8.3}",
        "store round trip",
        rp * 1e6,
        ra * 1e6,
        ra / rp
    );
    println!(
        "{:<22} {:>9.2} ms {:>11.2} ms {:>8.3}",
        "ring set-up (4 ranks)",
        sp * 1e3,
        sa * 1e3,
        sa / sp
    );
}
