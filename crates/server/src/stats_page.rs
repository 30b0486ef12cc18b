//! The stats page at `/`: one self-contained HTML document (style and script
//! inlined from `assets/`, no build step) that polls `/stats.json` twice a
//! second and shows live decode and prompt speed, context use, the slot pool
//! and every live request, the queue,
//! totals, the engine's device (name and the memory it holds), the GPU panel
//! (nvidia-smi) and the request log.
//!
//! The page itself holds no data, so it can be served without the API key;
//! the numbers come from `/stats.json`, which needs it. A key given as
//! `/?key=KEY` is kept in the tab's `sessionStorage`, removed from the address
//! bar, and sent as `Authorization: Bearer KEY`; without one, a 401 from
//! `/stats.json` makes the page ask for it.

use std::sync::OnceLock;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

const HTML: &str = include_str!("../assets/stats.html");
const CSS: &str = include_str!("../assets/stats.css");
const JS: &str = include_str!("../assets/stats.js");

/// The page with its style and script inlined (built once).
pub fn page() -> &'static str {
    static PAGE: OnceLock<String> = OnceLock::new();
    PAGE.get_or_init(|| {
        HTML.replace("/*@STYLE@*/", CSS)
            .replace("/*@SCRIPT@*/", JS)
            .replace("@VERSION@", env!("CARGO_PKG_VERSION"))
    })
}

pub async fn index() -> Response {
    let mut res = page().into_response();
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Everything the page needs is inline or same-origin.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
        ),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    res
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_is_assembled() {
        let p = super::page();
        assert!(p.starts_with("<!doctype html>"));
        assert!(!p.contains("/*@STYLE@*/"));
        assert!(!p.contains("/*@SCRIPT@*/"));
        assert!(!p.contains("@VERSION@"));
        assert!(p.contains("/stats.json"));
        for id in [
            "decode-tps",
            "prompt-tps",
            "ctx-used",
            "slots",
            "slots-busy",
            "slots-total",
            "queue-depth",
            "tokens-total",
            "device",
            "gpu",
            "log",
        ] {
            assert!(p.contains(&format!("id=\"{id}\"")), "missing #{id}");
        }
    }
}
