//! Shadow traffic (`route[].mirror`): a sampled share of a route's generation requests is
//! sent to another upstream as well, with the same method, path, headers (`set_headers`
//! replaced) and body, metered there like any request (its own TTFT, TPOT, curve, exact
//! counts), and its answer read and discarded. The client never sees a byte, header or
//! error of it, and the primary never waits on it: a copy runs in a task of its own, on
//! slots of its own (`max_in_flight`, over it skipped and counted), never in a queue, and
//! goes on after its primary's client leaves unless `cancel_with_client`. When both have
//! finished, the copy and its primary make a pair for `/compare`'s paired verdict.
//!
//! A mirror upstream with a cap of its own (`max_concurrency`, an SLO's adaptive cap, a
//! rollout's `to` that serves clients under its cap) counts its copies under it: a copy
//! takes a slot of the upstream's limiter and of an endpoint's, each free at once or not at
//! all, and one that finds none is not sent (skipped, `cap`). It never waits in the
//! upstream's queue, and takes no slot from a request waiting there.
//!
//! Only a request whose body was read whole (the 64 KiB read-ahead) is copied; a longer one
//! is counted as skipped.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use tokio::sync::watch;

use super::upstream::{upstream_id, upstream_request, usage_asked, UpBody, Wire};
use super::{ClientSide, Sent};
use crate::compare::paired::Meeting;
use crate::config::Mirror;
use crate::dialect::Dialect;
use crate::estimate::Estimate;
use crate::limit::fleet::Slot;
use crate::meter::Outcome;
use crate::pool::Unplaced;
use crate::rollout::Rollout;
use crate::routing::Choice;
use crate::service::ctx::Ctx;
use crate::service::failure;
use crate::service::http1::head::RequestHead;
use crate::service::pair::{side_of, Link};
use crate::service::record::{self, RequestId};
use crate::service::TokenTap;
use crate::state::{Shadow, Shared, Upstream};
use crate::tenant::Who;

/// A copy's slot on its mirror upstream, freed however the copy ends (as pingora-limits'
/// `Inflight` hands out a guard).
struct InFlight(Arc<Shadow>);

impl InFlight {
    /// A slot, if the mirror has fewer than `max` copies in flight (else none, counted).
    fn take(shadow: &Arc<Shadow>, max: u64) -> Option<InFlight> {
        let taken = shadow
            .in_flight
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1));
        if taken.is_err() {
            shadow.skipped_max_in_flight.fetch_add(1, Relaxed);
        }
        taken.ok().map(|_| InFlight(Arc::clone(shadow)))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// A slot under `upstream`'s own cap for a copy, if it has a cap: `Ok(None)` without one;
/// `Err` (counted) when no slot is free now. A copy never queues: it takes a slot only when
/// nobody waits for one ([`crate::limit::Limiter::try_acquire`]), and with `[cluster]` only
/// while the fleet has room as this replica last heard (the fleet's lease is not taken).
fn cap_slot(upstream: &Upstream) -> Result<Option<Slot>, ()> {
    if upstream.limiter.limit().is_none() {
        return Ok(None);
    }
    let fleet_full = upstream.fleet.as_ref().is_some_and(|f| !f.has_room());
    let permit = if fleet_full {
        None
    } else {
        upstream.limiter.try_acquire(&Who::default())
    };
    match permit {
        Some(permit) => Ok(Some(Slot::local(permit))),
        None => {
            upstream.shadow.skipped_cap.fetch_add(1, Relaxed);
            Err(())
        }
    }
}

/// The rollout whose shadow a copy to `choice.upstream` on `choice.route` is, if any.
fn rollout_of(shared: &Shared, choice: Choice) -> Option<&Arc<Rollout>> {
    let ro = shared.config.routes[choice.route].rollout.as_ref()?;
    if ro.to != choice.upstream {
        return None;
    }
    shared.rollouts.of(choice.route)
}

/// One copy to send.
struct Job {
    shared: Arc<Shared>,
    /// The route and the mirror upstream; the mirror's settings are the route's
    /// `mirrors[mirror]` in `shared`.
    choice: Choice,
    mirror: usize,
    head: RequestHead,
    body: Bytes,
    request_id: RequestId,
    dialect: Dialect,
    meeting: Arc<Meeting>,
    cancel: Option<watch::Receiver<bool>>,
    slot: InFlight,
    /// Its slot under the mirror upstream's own cap, when it has one.
    cap: Option<Slot>,
}

/// Whether `m` samples the request: its share of them, drawn at random or, with `sticky`,
/// from the key's hash (the same key always the same way).
fn sampled(m: &Mirror, percent: f64, req: &RequestHead) -> bool {
    if percent >= 100.0 {
        return true;
    }
    let point = match m.sticky.as_ref().and_then(|h| req.fields.get(h.as_str())) {
        // Salted with the mirror's upstream: a route sticky on the same header must not
        // send every mirrored key to one of its arms.
        Some(key) => {
            let mut salted = Vec::with_capacity(key.len() + 16);
            salted.extend_from_slice(&m.upstream.to_le_bytes());
            salted.extend_from_slice(key);
            crate::routing::unit_hash(&salted)
        }
        None => rand::random::<f64>(),
    };
    point * 100.0 < percent
}

/// Which of the route's mirrors copy a request routed to `choice` (bit `j`: mirror `j`; a
/// route's first 64), drawn once, before its body is read whole for them: a request that
/// no mirror samples is not held for one. A rollout's shadow copies `from`'s requests only,
/// as many as the rollout asks for now (none once `to` serves half or more).
pub(super) fn plan(shared: &Shared, choice: Choice, req: &RequestHead) -> u64 {
    let route = &shared.config.routes[choice.route];
    let mut plan = 0;
    for (j, m) in route.mirrors.iter().enumerate().take(64) {
        let percent = match route.rollout.as_ref().filter(|ro| ro.to == m.upstream) {
            Some(ro) => {
                let rollout = shared.rollouts.of(choice.route);
                let asked = rollout.map_or(0.0, |r| r.shadow_percent());
                if choice.upstream != ro.from || asked <= 0.0 {
                    continue;
                }
                m.percent.min(asked)
            }
            None => m.percent,
        };
        if sampled(m, percent, req) {
            plan |= 1 << j;
        }
    }
    plan
}

// === impl TokenTap ===

impl TokenTap {
    /// Sends a copy of a generation request to each of its route's mirrors that samples
    /// it (`plan`); what the request keeps of them goes in its context. `body`: the request's
    /// whole body, when it was read whole (else the copies are skipped and counted).
    pub(super) fn mirror(
        &self,
        ctx: &mut Ctx,
        choice: Choice,
        req: &RequestHead,
        body: Option<&Bytes>,
        plan: u64,
    ) {
        if plan == 0 {
            return;
        }
        let shared = Arc::clone(&ctx.shared);
        let Some(dialect) = ctx.dialect else { return };
        let route = &shared.config.routes[choice.route];
        let primary = &shared.upstreams[choice.upstream].config.name;
        let mut link = Link {
            meetings: Vec::new(),
            cancel: None,
        };
        for (j, m) in route.mirrors.iter().enumerate().take(64) {
            if plan & (1 << j) == 0 {
                continue;
            }
            let target = &shared.upstreams[m.upstream];
            let shadow = &target.shadow;
            let to = Choice {
                route: choice.route,
                upstream: m.upstream,
            };
            let rollout = rollout_of(&shared, to);
            let skipped = || {
                if let Some(r) = rollout {
                    r.copy(false);
                }
            };
            let Some(body) = body else {
                shadow.skipped_body_unread.fetch_add(1, Relaxed);
                skipped();
                continue;
            };
            let Some(slot) = InFlight::take(shadow, m.max_in_flight) else {
                skipped();
                continue;
            };
            let Ok(cap) = cap_slot(target) else {
                skipped();
                continue;
            };
            let meeting = Arc::new(Meeting::new(primary));
            let cancel = m.cancel_with_client.then(|| {
                link.cancel
                    .get_or_insert_with(|| watch::channel(false).0)
                    .subscribe()
            });
            let job = Job {
                shared: Arc::clone(&shared),
                choice: to,
                mirror: j,
                head: req.clone(),
                body: body.clone(),
                request_id: ctx.request_id.clone(),
                dialect,
                meeting: Arc::clone(&meeting),
                cancel,
                slot,
                cap,
            };
            let tap = TokenTap {
                live: Arc::clone(&self.live),
                transport: Arc::clone(&self.transport),
            };
            tokio::spawn(async move { tap.copy(job).await });
            link.meetings.push((meeting, Arc::clone(shadow)));
        }
        if !link.meetings.is_empty() {
            ctx.mirror = Some(Box::new(link));
        }
    }

    /// Sends one copy, meters its answer and discards it; makes its pair.
    async fn copy(self, job: Job) {
        let Job {
            shared,
            choice,
            mirror,
            mut head,
            body,
            request_id,
            dialect,
            meeting,
            cancel,
            slot,
            cap,
        } = job;
        let upstream = &shared.upstreams[choice.upstream];
        let name = upstream.config.name.clone();
        let rollout = rollout_of(&shared, choice);
        let mut ctx = Ctx::new(Arc::clone(&shared), self.now());
        ctx.dialect = Some(dialect);
        ctx.choice = Some(choice);
        ctx.request_id = request_id;
        ctx.tokenize = upstream.config.estimate == Estimate::Tokenizer;
        // Under a cap, an endpoint's slot as well, as a primary takes one: free now or the
        // copy is not sent.
        let capped = cap.is_some();
        ctx.permit = cap;
        let held = match upstream.pool.pick(self.now(), capped, None, &[]) {
            Ok(held) => held,
            Err(why) => {
                let count = match why {
                    Unplaced::Full => &slot.0.skipped_cap,
                    Unplaced::NoEndpoint => &slot.0.skipped_no_endpoint,
                };
                count.fetch_add(1, Relaxed);
                if let Some(r) = rollout {
                    r.copy(false);
                }
                return;
            }
        };
        if let Some(r) = rollout {
            r.copy(true);
        }
        let endpoint = Arc::clone(&held.endpoint);
        ctx.endpoint = Some(held);
        // Counted exactly where the mirror upstream asks for usage (its chunk is read with
        // the rest, and goes nowhere).
        let insertion = usage_asked(&ctx, upstream, &body);
        let body_len = Wire::body_len(&body, insertion);
        let operation = dialect.operation(&crate::routing::path::canonical(head.uri.path()));
        let mut wire = BytesMut::with_capacity(512);
        // `set_headers`: out of the copied head, and written with tokentap's own.
        let sets = &shared.config.routes[choice.route].mirrors[mirror].set_headers;
        for (name, _) in sets {
            head.fields.remove(name.as_str());
        }
        let extra: Vec<(&str, &[u8])> = sets
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
            .collect();
        upstream_request(
            head,
            &endpoint.at.host_header,
            upstream_id(&ctx),
            UpBody::Length(body_len),
            true,
            &extra,
            &mut wire,
        );
        let wire = Wire::new(wire, &body, insertion);
        self.begin_record(&mut ctx, upstream, &endpoint, Some(&body), Some(operation));
        drop(body);

        let exchange = self.copy_exchange(&mut ctx, choice, wire);
        let result = match cancel {
            Some(mut cut) => {
                let cut = async move {
                    // A primary that ended without its client leaving drops the sender:
                    // then the copy runs on.
                    while cut.changed().await.is_ok() {
                        if *cut.borrow() {
                            return;
                        }
                    }
                    std::future::pending::<()>().await;
                };
                tokio::select! {
                    r = exchange => r,
                    () = cut => Err(Error::explain(ConnectionClosed, "its primary's client left")
                        .into_down()),
                }
            }
            None => exchange.await,
        };
        let summary = ctx.stream.as_ref().map(|s| s.summary());
        if let Err(e) = &result {
            let f = failure::of(e, &name);
            record::log_failure(
                &self.live.throttle,
                &ctx.request_id,
                &name,
                ctx.endpoint_url(),
                &f,
            );
        }
        self.finish(&mut ctx, result.as_ref().err().map(|e| &**e));
        let ok = ctx.outcome == Some(Outcome::Ok);
        if let Some(s) = summary {
            if let Some(pair) = meeting.arrive(self.now(), true, side_of(&s, ok)) {
                slot.0.pairs.push(pair);
            }
        }
        drop(slot);
    }

    /// Connects, sends `wire`, reads the answer and discards it, metered: the primary's
    /// response path with no client.
    async fn copy_exchange(&self, ctx: &mut Ctx, choice: Choice, wire: Wire) -> Result<()> {
        let shared = Arc::clone(&ctx.shared);
        let upstream = &shared.upstreams[choice.upstream];
        let up = self.connect_and_write(upstream, ctx, wire).await?;
        let sent = Sent {
            up,
            watch: false,
            leftover: BytesMut::new(),
            client_side: ClientSide::NONE,
        };
        let mut open = self.receive(ctx, None, choice, sent).await?;
        let read_timeout = Some(upstream.config.read_timeout);
        let relayed = self.relay(None, ctx, &mut open, read_timeout).await;
        let body = relayed.as_ref().map(|_| ()).map_err(|e| &**e);
        self.body_ended(ctx, choice, open, body, self.now());
        relayed
    }
}
