//! The simulator's HTTP face: OpenAI's `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, plus `GET /sim/stats`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::engine::{Emit, Engine, Job};
use super::format::{Api, Writer};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Accepts connections until the task is aborted.
pub async fn serve(listener: TcpListener, engine: Arc<Engine>) {
    // Its connections are its own: when this task is aborted (a simulator killed), they
    // close with it, as a process's would.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let engine = Arc::clone(&engine);
        connections.spawn(async move {
            let svc = service_fn(move |req| handle(Arc::clone(&engine), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// A response body: either whole, or events as the engine produces them.
pub enum SimBody {
    Full(Option<Bytes>),
    Stream(mpsc::UnboundedReceiver<Bytes>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<SimBody> {
    let mut r = Response::new(SimBody::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// `GET /metrics` in vLLM's names: requests running (prefilling or decoding) and waiting,
/// and the batch's share of `--max-batch` as its KV-cache use.
fn metrics(engine: &Engine) -> Response<SimBody> {
    let s = engine.stats();
    let running = s.prefilling + s.decoding;
    let kv = engine
        .args
        .max_batch
        .map_or(0.0, |m| running as f64 / m.max(1) as f64);
    let model = engine.args.model.replace(['\\', '"', '\n'], "_");
    let text = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"{model}\"}} {running}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"{model}\"}} {}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{model_name=\"{model}\"}} {kv}\n",
        s.waiting
    );
    let mut resp = Response::new(SimBody::Full(Some(Bytes::from(text))));
    if let Ok(v) = "text/plain; version=0.0.4".parse() {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    resp
}

fn error(status: StatusCode, message: &str) -> Response<SimBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "invalid_request_error", "code": null}}),
    )
}

async fn handle(
    engine: Arc<Engine>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let resp = match (method.as_str(), path.as_str()) {
        ("GET", "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": engine.args.model, "object": "model", "owned_by": "tokentap-sim"}]}),
        ),
        ("GET", "/sim/stats") => json_response(StatusCode::OK, &json!(engine.stats())),
        ("GET", "/metrics") => metrics(&engine),
        // As vLLM's: 200 and an empty body while it serves.
        ("GET", "/health") => json_response(StatusCode::OK, &json!({})),
        ("POST", "/sim/peak/reset") => {
            engine.reset_peak();
            json_response(StatusCode::OK, &json!(engine.stats()))
        }
        ("POST", "/sim/curve") => set_curve(&engine, req).await,
        ("POST", "/sim/fail") => set_fail(&engine, req).await,
        ("POST", p) => match Api::route(engine.args.dialect, p) {
            Some(api) => generate(engine, req, api).await,
            None => error(
                StatusCode::NOT_FOUND,
                &format!(
                    "no route for POST {p} (this simulator speaks {:?})",
                    engine.args.dialect
                ),
            ),
        },
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no route for {method} {path}"),
        ),
    };
    Ok(resp)
}

async fn set_curve(engine: &Engine, req: Request<Incoming>) -> Response<SimBody> {
    let Ok(body) = req.into_body().collect().await else {
        return error(StatusCode::BAD_REQUEST, "could not read the request body");
    };
    match String::from_utf8_lossy(&body.to_bytes())
        .trim()
        .parse::<super::Curve>()
    {
        Ok(curve) => {
            let shown = curve.to_string();
            engine.set_curve(curve);
            json_response(StatusCode::OK, &json!({"tpot_curve": shown}))
        }
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

/// `POST /sim/fail` with a percent (`0` to stop): that share of generation requests is
/// answered 500 from now on.
async fn set_fail(engine: &Engine, req: Request<Incoming>) -> Response<SimBody> {
    let Ok(body) = req.into_body().collect().await else {
        return error(StatusCode::BAD_REQUEST, "could not read the request body");
    };
    match String::from_utf8_lossy(&body.to_bytes())
        .trim()
        .parse::<f64>()
    {
        Ok(pct) if (0.0..=100.0).contains(&pct) => {
            engine.set_fail(pct);
            json_response(StatusCode::OK, &json!({"fail_pct": pct}))
        }
        _ => error(StatusCode::BAD_REQUEST, "the body is a percent, 0 to 100"),
    }
}

async fn generate(engine: Arc<Engine>, req: Request<Incoming>, api: Api) -> Response<SimBody> {
    let shadow = req.headers().contains_key("x-tokentap-shadow");
    if engine.arrived(shadow) {
        return json_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": {"message": "the simulator fails this request (POST /sim/fail)", "type": "server_error", "code": null}}),
        );
    }
    let Ok(body) = req.into_body().collect().await else {
        return error(StatusCode::BAD_REQUEST, "could not read the request body");
    };
    let body = body.to_bytes();
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "the request body is not valid JSON",
        );
    };
    let args = &engine.args;
    let asked = api.asked(&v);
    let max_tokens = asked.max_tokens.unwrap_or(args.max_tokens).max(1);
    let prompt_tokens = (body.len() as u64 / 4).max(1);
    let cached = engine
        .cached(&super::cache::prompt_text(&v))
        .map(|c| c.min(prompt_tokens));
    let (tx, mut rx) = mpsc::unbounded_channel();
    if !engine.submit(Job {
        max_tokens,
        prompt_tokens,
        cached_tokens: cached.unwrap_or(0),
        out: tx,
    }) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the simulator is shutting down",
        );
    }
    let id = format!("sim-{}", NEXT_ID.fetch_add(1, Relaxed));
    let mut w = Writer::new(
        api,
        id,
        args.model.clone(),
        prompt_tokens,
        args.usage,
        &asked,
    );
    w.cached_tokens = cached;
    if !asked.stream {
        let mut produced = 0;
        while let Some(Emit { tokens, last }) = rx.recv().await {
            produced += tokens;
            if last {
                break;
            }
        }
        return json_response(StatusCode::OK, &w.whole(produced));
    }

    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let content_type = w.content_type();
    let start = w.start();
    if !start.is_empty() {
        let _ = out_tx.send(Bytes::from(start));
    }
    tokio::spawn(async move {
        let mut produced = 0;
        while let Some(Emit { tokens, last }) = rx.recv().await {
            produced += tokens;
            let mut out = w.tokens(tokens, produced, last);
            if last {
                out += &w.end(produced);
            }
            // One write per decode step, so each step is one fragment on the wire.
            if out_tx.send(Bytes::from(out)).is_err() {
                return; // client gone: dropping `rx` tells the engine
            }
            if last {
                return;
            }
        }
    });
    let mut r = Response::new(SimBody::Stream(out_rx));
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    h.insert(
        hyper::header::CACHE_CONTROL,
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    r
}
