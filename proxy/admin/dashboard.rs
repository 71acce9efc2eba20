//! The dashboard at the admin `/`: one page and its scripts, embedded in the binary (no CDN;
//! it works offline). The page holds no figures: it reads `/stats/history` and `/events`
//! with the admin token when there is one, so its files are served without it.
//!
//! uPlot (MIT, its licence beside it in `assets/`) draws the charts.

use http::{Response, StatusCode};

/// (path, content type, body)
const FILES: &[(&str, &str, &str)] = &[
    (
        "/",
        "text/html; charset=utf-8",
        include_str!("assets/index.html"),
    ),
    (
        "/assets/dashboard.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/dashboard.js"),
    ),
    (
        "/assets/dashboard.css",
        "text/css; charset=utf-8",
        include_str!("assets/dashboard.css"),
    ),
    (
        "/assets/uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/uPlot.iife.min.js"),
    ),
    (
        "/assets/uPlot.min.css",
        "text/css; charset=utf-8",
        include_str!("assets/uPlot.min.css"),
    ),
    (
        "/assets/uPlot.LICENSE",
        "text/plain; charset=utf-8",
        include_str!("assets/uPlot.LICENSE"),
    ),
];

/// Scripts and styles from this listener only; data from it only; no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// Whether `path` is one of the dashboard's files.
pub fn is_static(path: &str) -> bool {
    FILES.iter().any(|(p, _, _)| *p == path)
}

/// The file at `path` (one of [`is_static`]'s).
pub fn serve(path: &str) -> Response<Vec<u8>> {
    let Some((_, content_type, body)) = FILES.iter().find(|(p, _, _)| *p == path) else {
        return super::json_error(StatusCode::NOT_FOUND, "no such file");
    };
    let mut resp = super::respond(StatusCode::OK, content_type, body.as_bytes().to_vec());
    let headers = resp.headers_mut();
    for (name, value) in [
        ("content-security-policy", CSP),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "no-referrer"),
        ("cache-control", "no-cache"),
    ] {
        if let Ok(v) = value.parse() {
            headers.insert(name, v);
        }
    }
    resp
}
