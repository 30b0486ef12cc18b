//! Images in: the Qwen3.5/3.6 vision encoder, read from an mmproj GGUF as llama.cpp's
//! converter writes it (`config`, `encoder`), and image preprocessing as the reference
//! processor does it (`preprocess`). The text model sees an image as `rows()` embedding
//! rows in place of its placeholder tokens, at multimodal rotary positions
//! ([`mrope_positions`]).

pub mod config;
pub mod encoder;
pub mod preprocess;

pub use config::VisionConfig;
pub use encoder::VisionModel;

/// An image made ready for the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedImage {
    /// The patches in the reference's order (merge blocks of `merge × merge` patches,
    /// row-major over the blocks), each `in_channels × temporal_patch × patch × patch`
    /// normalised values (channel, frame, y, x); `grid[0] * grid[1] * grid[2]` of them.
    pub pixels: Vec<f32>,
    /// (t, h, w) in patches.
    pub grid: [usize; 3],
    /// The size the image was resized to, in pixels (width, height).
    pub resized: (usize, usize),
    /// sha256 of the bytes the image was decoded from.
    pub sha256: [u8; 32],
}

impl PreparedImage {
    /// The image's (t, h, w) grid after the merger: one text-model row per cell.
    pub fn llm_grid(&self, merge: usize) -> [usize; 3] {
        [self.grid[0], self.grid[1] / merge, self.grid[2] / merge]
    }

    /// How many text-model rows (placeholder tokens) the image takes.
    pub fn rows(&self, merge: usize) -> usize {
        self.llm_grid(merge).iter().product()
    }
}

/// The encoder's output for one image: `rows` merged patches, each `width` values (the
/// text model's hidden size), row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageEmbeds {
    pub rows: usize,
    pub width: usize,
    pub data: Vec<f32>,
}

/// The (t, h, w) rotary positions of a prompt whose images take the rows `at..at + rows`
/// of each `(at, llm_grid)` in `images` (in order, not overlapping), for `n` tokens, and
/// the delta that positions after the prompt add to their index: text tokens count on
/// from the largest position so far; an image's rows sit at `start + (0, row, col)` and
/// advance the count by `max(h, w)` (transformers' `get_rope_index` for Qwen3.5).
pub fn mrope_positions(n: usize, images: &[(usize, [usize; 3])]) -> (Vec<[u32; 3]>, i64) {
    let mut out = Vec::with_capacity(n);
    let mut next = 0u32;
    let mut imgs = images.iter().peekable();
    let mut i = 0;
    while i < n {
        if let Some(&&(at, [t, h, w])) = imgs.peek() {
            if at == i {
                imgs.next();
                for f in 0..t {
                    for r in 0..h {
                        for c in 0..w {
                            out.push([next + f as u32, next + r as u32, next + c as u32]);
                        }
                    }
                }
                i += t * h * w;
                next += h.max(w) as u32;
                continue;
            }
        }
        out.push([next; 3]);
        next += 1;
        i += 1;
    }
    out.truncate(n);
    (out, next as i64 - n as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_match_the_reference_rope_index() {
        // transformers' get_rope_index for 10 text tokens, a 3×4 image, 20 more tokens
        // (the vision fixture's prompt and continuation).
        let (pos, delta) = mrope_positions(42, &[(10, [1, 3, 4])]);
        let col = |k: usize| pos.iter().map(|p| p[k]).collect::<Vec<_>>();
        let mut t: Vec<u32> = (0..10).collect();
        t.extend([10; 12]);
        t.extend(14..34);
        assert_eq!(col(0), t);
        let mut h: Vec<u32> = (0..10).collect();
        h.extend([10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12]);
        h.extend(14..34);
        assert_eq!(col(1), h);
        let mut w: Vec<u32> = (0..10).collect();
        w.extend([10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13]);
        w.extend(14..34);
        assert_eq!(col(2), w);
        assert_eq!(delta, -8);
        // Text only: every section at the index, no delta.
        let (pos, delta) = mrope_positions(5, &[]);
        assert_eq!(pos, (0..5).map(|i| [i; 3]).collect::<Vec<_>>());
        assert_eq!(delta, 0);
    }
}
