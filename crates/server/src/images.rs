//! Images in requests: where a client's image is read from (a base64 `data:` URL or an
//! Anthropic base64 source; the server makes no outbound requests), which vision encoder
//! the server loads (`--mmproj`, else one `mmproj*.gguf` beside the model), and how a
//! rendered prompt's `<|image_pad|>` placeholders become each image's rows
//! ([`expand`]).
//!
//! An image travels through the conversation as a content item
//! `{"type": "image", "image": K}` (K: its index in [`crate::prompt::Conversation::images`]),
//! which the Qwen3.5 template renders as `<|vision_start|><|image_pad|><|vision_end|>`.
//! Decoding and resizing happen in `gen::render_chat`, off the async runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use engine::PromptImage;
use model::vision::{PreparedImage, VisionConfig};
use serde_json::Value;

use crate::error::ApiError;

pub use model::vision::preprocess::{prepare, ImageError, ImageLimits};

/// The token each image's rows stand in for.
pub const IMAGE_PAD: &str = "<|image_pad|>";

/// An image a message carries, as sent.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInput {
    /// Where it was sent (`messages[2].content[1].image_url.url`), for errors.
    pub field: String,
    /// The image file's bytes, base64 (standard alphabet), not yet decoded.
    pub base64: Arc<str>,
}

/// The message for an `http(s)://` image URL.
fn no_fetch(field: &str) -> ApiError {
    ApiError::field(
        field,
        format!("{field}: this server makes no outbound requests, so it cannot fetch an image URL; send the image inline as a base64 data: URL (data:image/png;base64,...)"),
    )
}

/// An image URL as both OpenAI APIs send it: a `data:<type>;base64,<bytes>` URL.
pub fn from_url(url: &str, field: &str) -> Result<ImageInput, ApiError> {
    let head = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if head.starts_with("http://") || head.starts_with("https://") {
        return Err(no_fetch(field));
    }
    let not_data = || {
        ApiError::field(
            field,
            format!("{field} must be a base64 data: URL of the image (data:image/png;base64,...)"),
        )
    };
    let rest = url
        .get(..5)
        .filter(|h| h.eq_ignore_ascii_case("data:"))
        .map(|_| &url[5..])
        .ok_or_else(not_data)?;
    let (meta, data) = rest.split_once(',').ok_or_else(not_data)?;
    if !meta
        .rsplit(';')
        .next()
        .is_some_and(|m| m.eq_ignore_ascii_case("base64"))
    {
        return Err(ApiError::field(
            field,
            format!("{field}: the data: URL must carry the image base64-encoded (data:image/png;base64,...)"),
        ));
    }
    Ok(ImageInput {
        field: field.to_string(),
        base64: data.into(),
    })
}

/// An Anthropic image block's `source` (`field` names it):
/// `{"type": "base64", "media_type", "data"}`.
pub fn from_anthropic_source(source: Option<&Value>, field: &str) -> Result<ImageInput, ApiError> {
    let kind = source.and_then(|s| s["type"].as_str()).unwrap_or("");
    match kind {
        "base64" => match source.and_then(|s| s["data"].as_str()) {
            Some(data) => Ok(ImageInput {
                field: format!("{field}.data"),
                base64: data.into(),
            }),
            None => Err(ApiError::field(
                &format!("{field}.data"),
                format!("{field}.data must be the image's bytes, base64-encoded"),
            )),
        },
        "url" => Err(no_fetch(&format!("{field}.url"))),
        other => Err(ApiError::field(
            &format!("{field}.type"),
            format!("{field}.type must be \"base64\" (with media_type and data), got \"{other}\""),
        )),
    }
}

/// The image's bytes, or a 400 naming its field.
pub fn decode(img: &ImageInput) -> Result<Vec<u8>, ApiError> {
    // Clients wrap long base64 text; whitespace is not part of it.
    let compact: String;
    let text: &str = if img.base64.bytes().any(|b| b.is_ascii_whitespace()) {
        compact = img
            .base64
            .chars()
            .filter(|c| !c.is_ascii_whitespace())
            .collect();
        &compact
    } else {
        &img.base64
    };
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| {
            ApiError::field(
                &img.field,
                format!("{}: the image is not valid base64 ({e})", img.field),
            )
        })
}

/// The image ready for the encoder, or a 400 naming its field: one that fails to
/// decode, is too large or too small says so in [`ImageError`]'s words.
pub fn prepare_input(
    img: &ImageInput,
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> Result<PreparedImage, ApiError> {
    let bytes = decode(img)?;
    prepare(&bytes, cfg, limits)
        .map_err(|e| ApiError::field(&img.field, format!("{}: {e}", img.field)))
}

/// The 400 for an image sent to a server without a vision encoder.
pub fn no_encoder(field: &str) -> ApiError {
    ApiError::field(
        field,
        format!("{field}: this model has no vision encoder: start the server with --mmproj FILE"),
    )
}

/// `tokens` with each `pad` token replaced by `rows(merge)` copies of it, for `images`
/// in order, and where each image's rows start. The number of `pad` tokens must be the
/// number of images (else an error: an image is never placed at the wrong position).
pub fn expand(
    tokens: &[u32],
    pad: u32,
    images: Vec<Arc<PreparedImage>>,
    merge: usize,
) -> Result<(Vec<u32>, Vec<PromptImage>), String> {
    let found = tokens.iter().filter(|&&t| t == pad).count();
    if found != images.len() {
        return Err(format!(
            "the rendered prompt has {found} image placeholders for {} images",
            images.len()
        ));
    }
    let extra: usize = images.iter().map(|i| i.rows(merge).saturating_sub(1)).sum();
    let mut out = Vec::with_capacity(tokens.len() + extra);
    let mut placed = Vec::with_capacity(images.len());
    let mut next = images.into_iter();
    for &t in tokens {
        if t != pad {
            out.push(t);
            continue;
        }
        let image = next.next().expect("counted above");
        let at = out.len();
        out.extend(std::iter::repeat_n(pad, image.rows(merge)));
        placed.push(PromptImage { at, image });
    }
    Ok((out, placed))
}

/// The vision encoder to load for `model`: `explicit` (`--mmproj`) when given; else,
/// unless `off` (`--no-mmproj`), the one `mmproj*.gguf` in the model file's directory.
/// The second value is what to log about the choice (None: nothing to say).
pub fn choose_mmproj(
    model: &Path,
    explicit: Option<&Path>,
    off: bool,
) -> (Option<PathBuf>, Option<String>) {
    if let Some(p) = explicit {
        return (Some(p.to_path_buf()), None);
    }
    if off {
        return (None, None);
    }
    let dir = match model.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.is_file()
                        && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                            let n = n.to_ascii_lowercase();
                            n.starts_with("mmproj") && n.ends_with(".gguf")
                        })
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match found.len() {
        0 => (None, None),
        1 => {
            let p = found.pop().expect("one");
            let msg = format!(
                "vision encoder: {} (found beside the model; --mmproj FILE picks another, --no-mmproj none)",
                p.display()
            );
            (Some(p), Some(msg))
        }
        _ => {
            let names: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
            let msg = format!(
                "no vision encoder loaded: {} files beside the model could be one ({}); --mmproj FILE picks one",
                found.len(),
                names.join(", ")
            );
            (None, Some(msg))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_data_urls_only() {
        let img = from_url("data:image/png;base64,aGk=", "f").unwrap();
        assert_eq!(&*img.base64, "aGk=");
        assert_eq!(decode(&img).unwrap(), b"hi");
        let e = from_url(
            "https://example.com/cat.png",
            "messages[0].content[1].image_url.url",
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[1].image_url.url")
        );
        assert!(e.message.contains("no outbound requests"), "{}", e.message);
        assert!(e.message.contains("data:"), "{}", e.message);
        let e = from_url("data:image/png,rawbytes", "f").unwrap_err();
        assert!(e.message.contains("base64"), "{}", e.message);
        assert!(from_url("cat.png", "f").is_err());
        let bad = ImageInput {
            field: "x.data".into(),
            base64: "@@@".into(),
        };
        let e = decode(&bad).unwrap_err();
        assert!(
            e.message
                .starts_with("x.data: the image is not valid base64"),
            "{}",
            e.message
        );
        // Wrapped base64 is read.
        let wrapped = ImageInput {
            field: "f".into(),
            base64: "aG\nk=".into(),
        };
        assert_eq!(decode(&wrapped).unwrap(), b"hi");
    }

    fn image(h: usize, w: usize) -> Arc<PreparedImage> {
        Arc::new(PreparedImage {
            pixels: Vec::new(),
            grid: [1, h, w],
            resized: (w * 16, h * 16),
            sha256: [0; 32],
        })
    }

    #[test]
    fn placeholders_expand_to_each_images_rows_in_order() {
        let (toks, placed) =
            expand(&[1, 9, 2, 9, 3], 9, vec![image(2, 4), image(4, 6)], 2).unwrap();
        // 2 rows, then 6.
        assert_eq!(toks, [1, 9, 9, 2, 9, 9, 9, 9, 9, 9, 3]);
        assert_eq!(placed.len(), 2);
        assert_eq!((placed[0].at, placed[0].image.grid), (1, [1, 2, 4]));
        assert_eq!((placed[1].at, placed[1].image.grid), (4, [1, 4, 6]));
        // A count that differs is an error, never a misplaced image.
        assert!(expand(&[1, 9, 9], 9, vec![image(2, 2)], 2).is_err());
        assert!(expand(&[1, 2], 9, vec![image(2, 2)], 2).is_err());
    }

    #[test]
    fn an_mmproj_beside_the_model_is_found_when_alone() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"").unwrap();
        assert_eq!(choose_mmproj(&model, None, false), (None, None));
        let a = dir.path().join("mmproj-a.gguf");
        std::fs::write(&a, b"").unwrap();
        let (p, msg) = choose_mmproj(&model, None, false);
        assert_eq!(p.as_deref(), Some(a.as_path()));
        assert!(msg.unwrap().contains("--no-mmproj"));
        assert_eq!(choose_mmproj(&model, None, true), (None, None));
        let b = dir.path().join("mmproj-b.gguf");
        std::fs::write(&b, b"").unwrap();
        let (p, msg) = choose_mmproj(&model, None, false);
        assert_eq!(p, None);
        let msg = msg.unwrap();
        assert!(
            msg.contains("mmproj-a.gguf") && msg.contains("mmproj-b.gguf"),
            "{msg}"
        );
        assert!(msg.contains("--mmproj FILE picks one"), "{msg}");
        // An explicit file wins.
        let (p, msg) = choose_mmproj(&model, Some(&b), true);
        assert_eq!((p.as_deref(), msg), (Some(b.as_path()), None));
    }
}
