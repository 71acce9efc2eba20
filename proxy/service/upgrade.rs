//! Upgrades (WebSocket and the like: `Upgrade` named in `Connection`, no chunked body),
//! the one kind of request pingora-proxy carries, after the same head checks as every
//! other: routed (never capped), its head written for the upstream with the same `Host`,
//! request id and origin-form target as on the direct path, its response through the tap.

use async_trait::async_trait;
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE, HOST};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::modules::http::HttpModules;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};

use super::ctx::Ctx;
use super::record::{RequestId, REQUEST_ID_HEADER};
use super::TokenTap;

#[async_trait]
impl ProxyHttp for TokenTap {
    type CTX = Ctx;

    /// None: pingora's default adds a (disabled) compression module that still runs on
    /// every body fragment, and a transparent proxy never re-encodes.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    fn new_ctx(&self) -> Ctx {
        Ctx::new(self.live.load(), self.now())
    }

    /// An upgrade request (the only kind pingora-proxy carries): routed, never capped.
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.t0 = self.now();
        let req = session.req_header();
        ctx.request_id = RequestId::of(&req.headers);
        let upstreams = &ctx.shared.upstreams;
        let choice = ctx
            .shared
            .router
            .choose(
                &crate::routing::path::canonical(req.uri.path()),
                &req.headers,
                |u| upstreams[u].has_headroom(),
            )
            .ok_or_else(|| Error::explain(HTTPStatus(404), "no route matches"))?;
        ctx.choice = Some(choice);
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let choice = ctx
            .choice
            .ok_or_else(|| Error::explain(InternalError, "no upstream chosen"))?;
        let shared = std::sync::Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        if ctx.endpoint.is_none() {
            let held = upstream
                .pool
                .pick(self.now(), false, None, &[])
                .map_err(|_| Error::explain(HTTPStatus(503), "no healthy endpoint"))?;
            ctx.endpoint = Some(held);
        }
        let endpoint = ctx
            .endpoint
            .as_ref()
            .map(|h| std::sync::Arc::clone(&h.endpoint))
            .ok_or_else(|| Error::explain(InternalError, "no endpoint chosen"))?;
        if ctx.dialect.is_some() && ctx.stream.is_none() {
            self.begin_record(ctx, upstream, &endpoint, None, None);
        }
        Ok(Box::new((*endpoint.peer()).clone()))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(held) = &ctx.endpoint {
            let host = held.endpoint.at.host_header.clone();
            req.insert_header(HOST, host)?;
        }
        // An absolute-form target goes on in origin-form, as on the direct path: the
        // authority the client chose never reaches the upstream.
        if req.uri.authority().is_some() {
            let path = req.uri.path_and_query().map_or("/", |p| p.as_str());
            let origin = http::Uri::try_from(path).map_err(|e| {
                Error::because(InvalidHTTPHeader, "absolute-form request target", e)
            })?;
            req.set_uri(origin);
        }
        if ctx.request_id.is_ours() && ctx.shared.config.request_id_upstream {
            req.insert_header(REQUEST_ID_HEADER, ctx.request_id.as_str())?;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.on_response_header(resp, ctx)
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<std::time::Duration>> {
        let now = self.now();
        let payload = body.take().unwrap_or_default();
        // With the usage chunk being taken out, the client gets what the tap lets through.
        let stripping = ctx.strip_usage.is_some();
        let mut kept = bytes::BytesMut::new();
        self.fragment_one(ctx, now, &payload, end_of_stream, |b| {
            kept.extend_from_slice(b);
        });
        *body = match stripping {
            true => (!kept.is_empty()).then(|| kept.freeze()),
            false => (!payload.is_empty()).then_some(payload),
        };
        Ok(None)
    }

    async fn logging(&self, _session: &mut Session, e: Option<&pingora::Error>, ctx: &mut Ctx) {
        self.finish(ctx, e);
    }
}

// === impl TokenTap ===

impl TokenTap {
    /// Reads the response header on pingora's path: [`TokenTap::on_response`] with the
    /// fields tokentap adds.
    fn on_response_header(&self, resp: &mut ResponseHeader, ctx: &mut Ctx) -> Result<()> {
        let has_id = resp.headers.contains_key(REQUEST_ID_HEADER);
        for (name, value) in ctx.added_fields(has_id).into_iter().flatten() {
            resp.insert_header(name, value)?;
        }
        let first = |name| resp.headers.get(name).map(http::HeaderValue::as_bytes);
        self.on_response(
            ctx,
            resp.status,
            first(CONTENT_TYPE),
            first(CONTENT_ENCODING),
            false,
        );
        Ok(())
    }
}
