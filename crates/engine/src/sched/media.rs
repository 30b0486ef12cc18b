//! A request's images. At submission each image's placeholder tokens become ids that
//! name the image's bytes (as seen by this encoder) and the row, so a slot's history
//! and the prompt cache, which match prompts by their tokens, share a prefix only where
//! the images are the same; the rows' embeddings come from the encoder when a step
//! first feeds one of them (a prefix kept from a slot or the prompt cache needs none),
//! and every position gets its multimodal rotary position.

use std::sync::Arc;

use model::vision::encoder::VisionModel;
use model::vision::{mrope_positions, ImageEmbeds, PreparedImage};
use sha2::{Digest, Sha256};

use crate::api::GenerateRequest;
use crate::error::EngineError;

/// Prompt ids from here up name an image row, never a vocabulary entry.
pub const IMAGE_ID_BASE: u32 = 0x8000_0000;

/// The encoder a scheduler hands images to, and what names its output.
pub struct Vision {
    pub model: VisionModel,
    /// sha256 of the encoder's weights: an image's ids depend on it.
    pub identity: [u8; 32],
    /// The encoder's copy on a GPU, which encodes the images it has room for.
    #[cfg(feature = "cuda")]
    pub gpu: Option<crate::cuda::vision::GpuEncoder>,
}

impl Vision {
    pub fn new(model: VisionModel) -> Vision {
        let identity = model.identity();
        Vision {
            model,
            identity,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// The merged embedding of `img`: on the GPU when the encoder has a copy there
    /// with room for the image, else on the CPU. Which one depends only on the
    /// image's size, so an image always gets the same bits. Logs where and how long.
    pub fn encode(&self, img: &PreparedImage) -> Result<ImageEmbeds, EngineError> {
        let n = img.grid.iter().product::<usize>();
        let (w, h) = img.resized;
        let t = std::time::Instant::now();
        let (out, place) = match self.encode_on_gpu(img, n) {
            Some(out) => (out, "GPU"),
            None => {
                let out = self.model.encode(img);
                (out.map_err(|e| EngineError::Image(e.to_string())), "CPU")
            }
        };
        if out.is_ok() {
            tracing::info!(
                "image {w}×{h} ({n} patches) encoded on the {place} in {:.2} s",
                t.elapsed().as_secs_f64()
            );
        }
        out
    }

    /// The GPU's encoding of `img` (`n` patches); None where the encoder has no copy
    /// on the GPU or no room there for the image.
    #[cfg(feature = "cuda")]
    fn encode_on_gpu(
        &self,
        img: &PreparedImage,
        n: usize,
    ) -> Option<Result<ImageEmbeds, EngineError>> {
        let g = self.gpu.as_ref()?;
        if n > g.max_patches() {
            tracing::info!(
                "an image of {n} patches is encoded on the CPU: the GPU encoder's scratch holds {} (--vision-gpu-patches)",
                g.max_patches()
            );
            return None;
        }
        Some(g.encode(&self.model, img))
    }

    #[cfg(not(feature = "cuda"))]
    fn encode_on_gpu(
        &self,
        _img: &PreparedImage,
        _n: usize,
    ) -> Option<Result<ImageEmbeds, EngineError>> {
        None
    }
}

/// Checks `req`'s images against its prompt and the engine, and writes each image's
/// ids over its placeholders.
pub(super) fn mark_images(
    req: &mut GenerateRequest,
    vision: Option<&Vision>,
) -> Result<(), EngineError> {
    if req.images.is_empty() {
        return Ok(());
    }
    let Some(vision) = vision else {
        return Err(EngineError::Image(
            "this engine has no vision encoder: load one with --mmproj FILE".into(),
        ));
    };
    let merge = vision.model.config().merge;
    let mut end = 0;
    for (k, im) in req.images.iter().enumerate() {
        let rows = im.image.rows(merge);
        if im.at < end || im.at + rows > req.prompt.len() || rows == 0 {
            return Err(EngineError::Image(format!(
                "image {k} takes prompt positions {}..{} (prompt of {} tokens, the previous image ends at {end})",
                im.at,
                im.at + rows,
                req.prompt.len()
            )));
        }
        end = im.at + rows;
    }
    for im in &req.images {
        let rows = im.image.rows(merge);
        let mut h = Sha256::new();
        h.update(vision.identity);
        h.update(im.image.sha256);
        for g in im.image.grid {
            h.update((g as u64).to_le_bytes());
        }
        let d = h.finalize();
        let key = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        for (r, t) in req.prompt[im.at..im.at + rows].iter_mut().enumerate() {
            *t = IMAGE_ID_BASE | (key.wrapping_add(r as u32) & !IMAGE_ID_BASE);
        }
    }
    Ok(())
}

/// One image of a running request.
struct Image {
    at: usize,
    rows: usize,
    image: Arc<model::vision::PreparedImage>,
    embeds: Embeds,
}

/// An image's rows: not needed yet, being encoded on a thread of their own, or there.
enum Embeds {
    Later,
    Encoding(std::thread::JoinHandle<Result<ImageEmbeds, EngineError>>),
    Ready(Arc<ImageEmbeds>),
}

/// A running request's images and rotary positions.
pub(super) struct RequestMedia {
    vision: Arc<Vision>,
    images: Vec<Image>,
    /// The prompt's positions.
    rope: Vec<[u32; 3]>,
    /// What a position past the prompt adds to its index.
    delta: i64,
}

/// What one executor entry feeds besides its tokens: image rows (entry row, image,
/// row of the image) and every row's rotary position.
pub(super) struct EntryMedia {
    pub embeds: Vec<(usize, Arc<ImageEmbeds>, usize)>,
    pub rope: Vec<[u32; 3]>,
}

impl RequestMedia {
    /// The media of `req` (None: a text request, whose steps feed plain tokens), whose
    /// first `kept` positions are in its slot's state already: the images past them
    /// start encoding on threads of their own, beside the other requests' steps.
    pub fn new(
        req: &GenerateRequest,
        vision: Option<&Arc<Vision>>,
        kept: usize,
    ) -> Option<RequestMedia> {
        let vision = vision.filter(|_| !req.images.is_empty())?;
        let merge = vision.model.config().merge;
        let images: Vec<Image> = req
            .images
            .iter()
            .map(|im| {
                let rows = im.image.rows(merge);
                let embeds = if im.at + rows <= kept {
                    Embeds::Later
                } else {
                    let (v, img) = (vision.clone(), im.image.clone());
                    Embeds::Encoding(std::thread::spawn(move || v.encode(&img)))
                };
                Image {
                    at: im.at,
                    rows,
                    image: im.image.clone(),
                    embeds,
                }
            })
            .collect();
        let grids: Vec<(usize, [usize; 3])> = images
            .iter()
            .map(|im| (im.at, im.image.llm_grid(merge)))
            .collect();
        let (rope, delta) = mrope_positions(req.prompt.len(), &grids);
        Some(RequestMedia {
            vision: vision.clone(),
            images,
            rope,
            delta,
        })
    }

    /// Whether the images the entry feeding positions `pos0..pos0 + n` reaches are
    /// encoded (a step that has other work leaves a prompt piece whose images are not
    /// for later, rather than wait).
    pub fn ready(&self, pos0: usize, n: usize) -> bool {
        self.reached(pos0, n).all(|im| match &im.embeds {
            Embeds::Encoding(job) => job.is_finished(),
            Embeds::Later | Embeds::Ready(_) => true,
        })
    }

    fn reached(&self, pos0: usize, n: usize) -> impl Iterator<Item = &Image> {
        self.images
            .iter()
            .filter(move |im| im.at < pos0 + n && pos0 < im.at + im.rows)
    }

    /// The media of the entry feeding positions `pos0..pos0 + n`: the rows of the
    /// images it reaches (waiting for their encoding, or encoding them here when a
    /// kept prefix was expected to hold them) and every position's rotary position.
    pub fn entry(&mut self, pos0: usize, n: usize) -> Result<EntryMedia, EngineError> {
        let mut embeds = Vec::new();
        for im in &mut self.images {
            let (lo, hi) = (im.at.max(pos0), (im.at + im.rows).min(pos0 + n));
            if lo >= hi {
                continue;
            }
            let e = match std::mem::replace(&mut im.embeds, Embeds::Later) {
                Embeds::Ready(e) => e,
                Embeds::Encoding(job) => {
                    let r = job
                        .join()
                        .map_err(|_| EngineError::Image("the encoder's thread panicked".into()))?;
                    Arc::new(r?)
                }
                Embeds::Later => Arc::new(self.vision.encode(&im.image)?),
            };
            im.embeds = Embeds::Ready(e.clone());
            for p in lo..hi {
                embeds.push((p - pos0, e.clone(), p - im.at));
            }
        }
        let rope = (pos0..pos0 + n)
            .map(|p| match self.rope.get(p) {
                Some(&r) => r,
                None => [(p as i64 + self.delta) as u32; 3],
            })
            .collect();
        Ok(EntryMedia { embeds, rope })
    }
}
