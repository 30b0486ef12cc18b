//! What each slot's sequence holds (`SeqCache`): its tokens, the logits at their end,
//! and marks — snapshots of the recurrent state at the first message start after the
//! first message (the end of a system message, which new conversations of the same
//! client share), at the last two message starts and at the prompt's end — so that a
//! later prompt can reuse the slot's state up to where it diverges, going back to a
//! mark on models whose recurrent state cannot be rewound.

use std::sync::Arc;

use crate::exec::SeqSnapshot;

/// What one slot's sequence holds.
#[derive(Debug, Default)]
pub(super) struct SeqCache {
    /// Tokens whose effect is in the sequence's state, in order.
    pub history: Vec<u32>,
    /// The logits at the end of `history`, when known, so a prompt equal to the
    /// history needs no evaluation.
    pub last_logits: Option<Vec<f32>>,
    /// When a request last used this slot (scheduler ticks): the least recently
    /// used free slot is the one given to a request that can reuse none.
    pub last_used: u64,
    /// A request is decoding here.
    pub busy: bool,
    /// Snapshots of the recurrent state at positions of `history` where a later
    /// prompt may diverge (message starts, prompt ends), oldest first: the slot
    /// can go back to any of them, its own K/V below being still in place.
    pub marks: Vec<Mark>,
}

/// The recurrent state after `pos` tokens of a slot's history.
#[derive(Debug, Clone)]
pub(super) struct Mark {
    pub pos: usize,
    pub snap: Arc<SeqSnapshot>,
    /// At a message start (not a prompt end).
    pub boundary: bool,
}

/// Marks a slot keeps (each holds one copy of the recurrent state). The earliest
/// is kept whatever comes after it (see `keep_mark`): it is where conversations
/// sharing a system message part.
pub(super) const MAX_MARKS: usize = 4;

/// How a slot serves a prompt: keep `keep` tokens of its history, going back to
/// mark `mark` first when one is named.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Reuse {
    pub keep: usize,
    pub mark: Option<usize>,
}

/// How much of `prompt` the slot `c` can serve from its state. `recurrent`: the
/// model has state that cannot be rewound (DeltaNet), so the slot keeps its whole
/// history or goes back to one of its marks.
pub(super) fn reusable(c: &SeqCache, prompt: &[u32], recurrent: bool) -> Reuse {
    let h = &c.history;
    if h.is_empty() {
        return Reuse::default();
    }
    if prompt.starts_with(h) && (h.len() < prompt.len() || c.last_logits.is_some()) {
        return Reuse {
            keep: h.len(),
            mark: None,
        };
    }
    // At least one prompt token is evaluated, to get logits.
    let common = h
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(prompt.len() - 1);
    if !recurrent {
        // Attention only: K/V past a position are never read.
        return Reuse {
            keep: common,
            mark: None,
        };
    }
    c.marks
        .iter()
        .enumerate()
        .filter(|(_, m)| m.pos <= common && m.pos > 0)
        .max_by_key(|(_, m)| m.pos)
        .map(|(i, m)| Reuse {
            keep: m.pos,
            mark: Some(i),
        })
        .unwrap_or_default()
}

/// How a chat template starts a message: its marker token (`<|im_start|>`) and, when
/// the role is one token, the token of the system role that follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageStart {
    pub token: u32,
    pub system: Option<u32>,
}

/// Where a request's prompt should leave marks: before the first message that is not
/// a system message (the end of the system prompt, which a new conversation of the
/// same client shares), before each of the last two message starts, and at its end.
/// Only models with recurrent state need them.
pub(super) fn mark_positions(prompt: &[u32], start: Option<MessageStart>) -> Vec<(usize, bool)> {
    let Some(start) = start else {
        return vec![(prompt.len(), false)];
    };
    let mut at: Vec<(usize, bool)> = prompt
        .iter()
        .enumerate()
        .filter(|&(i, &t)| t == start.token && i > 0)
        .map(|(i, _)| (i, true))
        .collect();
    let first = at
        .iter()
        .copied()
        .find(|&(i, _)| start.system.is_none() || prompt.get(i + 1) != start.system.as_ref());
    let n = at.len();
    at.drain(..n.saturating_sub(2));
    if let Some(f) = first.filter(|f| at.first() != Some(f)) {
        at.insert(0, f);
    }
    at.push((prompt.len(), false));
    at
}

/// The marks of `at` (from [`mark_positions`]) worth taking after `cached` prompt
/// tokens: each at least `gap` positions past the one before it (or past
/// `cached`), earlier ones first. A mark closer than that would save re-reading
/// fewer tokens than its snapshot costs on the executor.
pub(super) fn spaced_marks(
    at: Vec<(usize, bool)>,
    cached: usize,
    gap: usize,
) -> Vec<(usize, bool)> {
    let mut last = cached;
    at.into_iter()
        .filter(|&(p, _)| {
            let keep = p >= last + gap.max(1);
            if keep {
                last = p;
            }
            keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::spaced_marks;

    #[test]
    fn the_end_of_the_system_messages_is_marked_besides_the_last_two_starts() {
        use super::{mark_positions, MessageStart};
        let (b, sys, user) = (1, 2, 3);
        let start = Some(MessageStart {
            token: b,
            system: Some(sys),
        });
        // Two system messages, then four more messages.
        let p = [b, sys, 9, b, sys, 9, b, user, 9, b, 4, 9, b, user, 9, b, 4];
        assert_eq!(
            mark_positions(&p, start),
            vec![(6, true), (12, true), (15, true), (17, false)]
        );
        // Without the system role's token, the first message start after the first.
        let no_role = Some(MessageStart {
            token: b,
            system: None,
        });
        assert_eq!(mark_positions(&p, no_role)[0], (3, true));
        assert_eq!(mark_positions(&p, None), vec![(17, false)]);
    }

    #[test]
    fn marks_closer_than_the_gap_are_not_taken() {
        let at = vec![(31, true), (40, true), (42, false)];
        assert_eq!(spaced_marks(at.clone(), 0, 1), at);
        assert_eq!(spaced_marks(at.clone(), 0, 16), vec![(31, true)]);
        assert_eq!(
            spaced_marks(at.clone(), 0, 10),
            vec![(31, true), (42, false)]
        );
        // Counted from what the slot already holds.
        assert_eq!(spaced_marks(at.clone(), 20, 16), vec![(40, true)]);
        assert_eq!(spaced_marks(vec![(1, false)], 0, 32), vec![]);
    }
}
