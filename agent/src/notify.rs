//! systemd's notify protocol (sd_notify(3)), through the `sd-notify` crate:
//! READY once the agent serves, a one-line STATUS, WATCHDOG keep-alives at
//! half of `WATCHDOG_USEC`, STOPPING. Without `NOTIFY_SOCKET` (not started
//! by systemd) each call does nothing.

use sd_notify::NotifyState;
use std::time::Duration;
use tokio::time::{Interval, MissedTickBehavior};

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!("cannot notify systemd: {e}");
    }
}

/// The agent is up: its socket takes connections.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A one-line summary for `systemctl status`.
pub fn status(line: &str) {
    send(&[NotifyState::Status(line)]);
}

/// The agent is stopping.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// The keep-alive timer when systemd watches this process (twice per
/// `WATCHDOG_USEC`, as sd_watchdog_enabled(3) advises), else `None`.
pub fn watchdog_interval() -> Option<Interval> {
    let period = sd_notify::watchdog_enabled()?;
    let half = (period / 2).max(Duration::from_millis(10));
    tracing::info!(every = ?half, "systemd watchdog on: keep-alives from the serve loop");
    let mut i = tokio::time::interval(half);
    i.set_missed_tick_behavior(MissedTickBehavior::Delay);
    Some(i)
}

/// Waits for the next keep-alive and sends it; never returns without a
/// watchdog.
pub async fn keepalive(watchdog: &mut Option<Interval>) {
    match watchdog {
        Some(i) => {
            i.tick().await;
            send(&[NotifyState::Watchdog]);
        }
        None => std::future::pending().await,
    }
}
