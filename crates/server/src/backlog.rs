//! A request's events on their way from the engine worker to its route: a channel
//! that never blocks the worker (one slow client must not stall the step every other
//! request decodes in), with a count of what was sent and not yet read, so that a
//! client that stops reading cannot make the server hold its output without bound.
//!
//! The worker's `JobSink` stops a request whose unread events pass the limit
//! ([`EventTx::over_limit`]) and sends it one final `Failed` event, which always
//! goes through: the client that reads again gets what was held and then the error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::worker::Event;

/// The bytes an event holds on the way (its text, or its size in memory), plus
/// the channel's own cost per event.
fn cost(ev: &Event) -> usize {
    const PER_EVENT: usize = 64;
    PER_EVENT
        + match ev {
            Event::Text(t) => t.len(),
            Event::Logprobs(..) => std::mem::size_of::<engine::TokenLogprobs>(),
            Event::Failed(e) => e.len(),
            Event::Done(_) => std::mem::size_of::<crate::worker::Finished>(),
        }
}

/// The route has gone: the event was dropped.
#[derive(Debug)]
pub struct Gone;

/// The worker's end of a request's events.
pub struct EventTx {
    tx: mpsc::UnboundedSender<Event>,
    unread: Arc<AtomicUsize>,
    limit: usize,
}

/// The route's end of a request's events.
pub struct EventRx {
    rx: mpsc::UnboundedReceiver<Event>,
    unread: Arc<AtomicUsize>,
}

/// A request's event channel; the worker stops the request once more than `limit`
/// bytes of its events wait unread.
pub fn channel(limit: usize) -> (EventTx, EventRx) {
    let (tx, rx) = mpsc::unbounded_channel();
    let unread = Arc::new(AtomicUsize::new(0));
    (
        EventTx {
            tx,
            unread: unread.clone(),
            limit,
        },
        EventRx { rx, unread },
    )
}

impl EventTx {
    /// Sends `ev` (never blocks); `Err` once the route has gone.
    pub fn send(&self, ev: Event) -> Result<(), Gone> {
        let n = cost(&ev);
        self.unread.fetch_add(n, Ordering::Relaxed);
        self.tx.send(ev).map_err(|_| {
            self.unread.fetch_sub(n, Ordering::Relaxed);
            Gone
        })
    }

    /// The route has gone (the client left).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Bytes sent and not yet read.
    pub fn unread(&self) -> usize {
        self.unread.load(Ordering::Relaxed)
    }

    /// More than the limit waits unread: the client is not reading.
    pub fn over_limit(&self) -> bool {
        self.unread() > self.limit
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl EventRx {
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await?;
        self.unread.fetch_sub(cost(&ev), Ordering::Relaxed);
        Some(ev)
    }

    /// `recv` for a thread outside the async runtime (tests).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        let ev = self.rx.blocking_recv()?;
        self.unread.fetch_sub(cost(&ev), Ordering::Relaxed);
        Some(ev)
    }

    pub fn try_recv(&mut self) -> Result<Event, mpsc::error::TryRecvError> {
        let ev = self.rx.try_recv()?;
        self.unread.fetch_sub(cost(&ev), Ordering::Relaxed);
        Ok(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unread_count_follows_sends_and_reads() {
        let (tx, mut rx) = channel(200);
        tx.send(Event::Text("abc".into())).expect("send");
        assert_eq!(tx.unread(), 67);
        assert!(!tx.over_limit());
        tx.send(Event::Text("x".repeat(100))).expect("send");
        assert!(tx.over_limit(), "{}", tx.unread());
        assert!(matches!(rx.try_recv(), Ok(Event::Text(t)) if t == "abc"));
        assert_eq!(tx.unread(), 164);
        assert!(!tx.over_limit());
        rx.try_recv().expect("second");
        assert_eq!(tx.unread(), 0);
        drop(rx);
        assert!(tx.is_closed());
        assert!(tx.send(Event::Text("gone".into())).is_err());
        assert_eq!(tx.unread(), 0);
    }
}
