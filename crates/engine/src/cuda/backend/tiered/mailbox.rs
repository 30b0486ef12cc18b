//! The routing of a tiered layer's step on its way to the host. A decode step's
//! segment ends with a kernel (`publish_words`) that writes the routes, the guess
//! and the experts' input to a mapped pinned mailbox and sets its flag word last;
//! the host spins on that word and sees the routing as it lands, instead of after a
//! synchronisation. A prompt's step downloads its routing into the inbox.

use super::{pinned_at_least, Tiered};
use crate::cuda::trace::DevPoint;
use crate::cuda::weights::cuda_err;
use cuda::{Gpu, PinnedBuf, PUBLISH_HEAD_WORDS as HEAD};
use model::ExecError;
use std::cell::RefCell;

/// Where a step's routing reaches the host.
pub(super) struct Mailbox {
    /// Where a decode step's kernel writes its routing and expert input for the
    /// host (mapped pinned memory: word 0 the flag, the words from [`HEAD`] on);
    /// allocated before any capture, since the kernel that writes it is captured in
    /// the step's graph segment.
    buf: PinnedBuf,
    /// A routing was published and not read (a step failed between): the kernel
    /// may still set the flag, so the next token waits for the device first.
    pub unread: bool,
    /// A prompt step's routing on its way to the host (pinned).
    inbox: Option<PinnedBuf>,
}

impl Mailbox {
    /// Room for the most words a step publishes: two rows of routes (its own and the
    /// guess) of at most 32 ranks, and the expert input (`n_embd` values).
    pub fn new(gpu: &Gpu, n_embd: usize) -> Result<Mailbox, ExecError> {
        let buf = gpu
            .alloc_pinned(4 * (HEAD + 2 * 32 + n_embd))
            .map_err(cuda_err("pinned mailbox for the routing"))?;
        Ok(Mailbox {
            buf,
            unread: false,
            inbox: None,
        })
    }

    /// Clears the flag: the routing is read, or left by a failed step.
    pub fn clear(&mut self) {
        self.buf.store_word(0, 0);
        self.unread = false;
    }
}

/// A decode step's routing as read back: its routes, the next layer's guessed
/// experts, and the experts' input.
pub(crate) struct StepRoutes {
    pub routes: Vec<u32>,
    pub guesses: Vec<u32>,
    pub x: Vec<f32>,
}

/// A step's routing from its words: `n_routes` ids, `n_guess` ids, then the input.
fn parse_routes(words: &[u8], n_routes: usize, n_guess: usize) -> StepRoutes {
    let word = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let ids = |b: &[u8]| -> Vec<u32> {
        b.chunks_exact(4)
            .map(|c| i32::from_ne_bytes(word(c)) as u32)
            .collect()
    };
    let (r, rest) = words.split_at(4 * n_routes);
    let (g, xb) = rest.split_at(4 * n_guess);
    StepRoutes {
        routes: ids(r),
        guesses: ids(g),
        x: xb
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(word(c)))
            .collect(),
    }
}

impl Tiered {
    /// Queues the kernel that writes a decode step's routing (`n_ids` ids at `ids`:
    /// the step's routes, then the guess) and its expert input (`n_x` floats at `x`)
    /// to the mailbox, for [`Self::read_published`]. Part of the step's graph segment.
    pub fn publish_routes(
        &self,
        gpu: &Gpu,
        ids: u64,
        n_ids: usize,
        x: u64,
        n_x: usize,
    ) -> Result<(), ExecError> {
        let mut mailbox = self.mailbox.borrow_mut();
        if 4 * (HEAD + n_ids + n_x) > mailbox.buf.len() {
            return Err(ExecError::new(
                "publish routes",
                format!(
                    "{n_ids} ids and {n_x} values do not fit the {}-byte mailbox",
                    mailbox.buf.len()
                ),
            ));
        }
        mailbox.unread = true;
        gpu.publish_words(ids, n_ids, x, n_x, mailbox.buf.dev_ptr())
            .map_err(cuda_err("publish_words"))
    }

    /// Waits for the routing a step's kernel published ([`Self::publish_routes`]):
    /// `n_routes` routes, `n_guess` guessed ids and `n_x` input values. The device
    /// has then run everything before that kernel, as after a download's
    /// synchronisation.
    pub fn read_published(
        &self,
        gpu: &Gpu,
        layer: usize,
        n_routes: usize,
        n_guess: usize,
        n_x: usize,
    ) -> Result<StepRoutes, ExecError> {
        let mut mailbox = self.mailbox.borrow_mut();
        gpu.wait_word(&mailbox.buf, 0, "publishing the routing")
            .map_err(cuda_err("read routes"))?;
        if let Some(t) = &self.trace {
            // The routing is on the host as the step's segment ends.
            t.borrow_mut().dev(gpu, layer, DevPoint::Routed)?;
        }
        let words = &mailbox.buf.as_slice()[4 * HEAD..4 * (HEAD + n_routes + n_guess + n_x)];
        let routes = parse_routes(words, n_routes, n_guess);
        mailbox.clear();
        Ok(routes)
    }

    /// Waits for the device's routing of a prompt's step: the `n_routes` expert ids
    /// at `ids` and the `n_guess` ids of the next layer's guess after them (a
    /// download; decode steps publish theirs, [`Self::publish_routes`]).
    pub fn read_routes(
        &self,
        gpu: &Gpu,
        layer: usize,
        ids: u64,
        n_routes: usize,
        n_guess: usize,
    ) -> Result<StepRoutes, ExecError> {
        let bytes = 4 * (n_routes + n_guess);
        let mut mailbox = self.mailbox.borrow_mut();
        let buf = pinned_at_least(
            gpu,
            &mut mailbox.inbox,
            bytes,
            "pinned buffer for the routing",
        )?;
        let srcs = [(ids, bytes)];
        let mut trace = self.trace.as_ref().map(RefCell::borrow_mut);
        let stamp = trace
            .as_mut()
            .and_then(|t| t.stamp(layer, DevPoint::Routed));
        gpu.download_pinned(&srcs, buf, stamp)
            .map_err(cuda_err("download routes"))?;
        drop(trace);
        Ok(parse_routes(&buf.as_slice()[..bytes], n_routes, n_guess))
    }
}
