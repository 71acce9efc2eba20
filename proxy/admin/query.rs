//! `/compare`: its query read (the arms by name, or the first split's), and the A/B or the
//! paired comparison it asks for.

use http::StatusCode;

use crate::compare::Comparison;
use crate::state::{Shared, Upstream};

/// The paired comparison of `a`'s requests with their copies on the mirror `b`, over the
/// compare window; `None` when `b` is no mirror of a route of `a`'s.
pub fn paired(
    shared: &Shared,
    a: usize,
    b: usize,
) -> Option<crate::compare::paired::PairedComparison> {
    let mirrors_a =
        shared.config.routes.iter().any(|r| {
            r.split.iter().any(|&(u, _)| u == a) && r.mirrors.iter().any(|m| m.upstream == b)
        });
    if !mirrors_a {
        return None;
    }
    let window = shared.config.compare_window;
    let since = shared
        .clock
        .now()
        .saturating_sub(u64::try_from(window.as_nanos()).unwrap_or(u64::MAX));
    let (a, b) = (&shared.upstreams[a], &shared.upstreams[b]);
    let pairs = b.shadow.pairs.of(&a.config.name, since);
    Some(crate::compare::paired::compare(
        &a.config.name,
        &b.config.name,
        &pairs,
        window.as_secs(),
    ))
}

/// The first mirror of the first route that has one, against the route's first arm.
pub fn default_paired(shared: &Shared) -> Option<crate::compare::paired::PairedComparison> {
    let (a, b) = shared.config.routes.iter().find_map(|r| {
        let m = r.mirrors.first()?;
        Some((r.split.first()?.0, m.upstream))
    })?;
    paired(shared, a, b)
}

/// What a client sent, quoted back in an error: at most 64 characters (a whole query of
/// kilobytes is not echoed).
pub(super) fn bounded(text: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 64;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]).into(),
        None => text.into(),
    }
}

/// The arms of a `/compare` query naming a primary and its mirror (either way round: the
/// primary as `a`), for the paired comparison.
pub(super) fn paired_query(shared: &Shared, query: Option<&str>) -> Option<(usize, usize)> {
    let (mut a, mut b) = (None, None);
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("a", v)) => a = shared.upstream(v).map(|(i, _)| i),
            Some(("b", v)) => b = shared.upstream(v).map(|(i, _)| i),
            _ => {}
        }
    }
    let (a, b) = (a?, b?);
    let mirrors = |p: usize, m: usize| {
        shared.config.routes.iter().any(|r| {
            r.split.iter().any(|&(u, _)| u == p) && r.mirrors.iter().any(|x| x.upstream == m)
        })
    };
    if mirrors(a, b) {
        Some((a, b))
    } else if mirrors(b, a) {
        Some((b, a))
    } else {
        None
    }
}

/// `/compare` for the query `a=NAME&b=NAME` (both optional: the first split's arms).
pub fn compare(shared: &Shared, query: Option<&str>) -> Result<Comparison, (StatusCode, String)> {
    let mut names = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("a", v)) => names.0 = Some(v.to_owned()),
            Some(("b", v)) => names.1 = Some(v.to_owned()),
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    format!(
                        "unknown query parameter `{}`: use a=NAME&b=NAME",
                        bounded(pair)
                    ),
                ))
            }
        }
    }
    let config = &shared.config;
    let index = |name: &str| {
        shared.upstream(name).map(|(i, _)| i).ok_or_else(|| {
            let name = bounded(name);
            (StatusCode::NOT_FOUND, format!("no upstream named `{name}`"))
        })
    };
    let default = config.default_pair();
    let a = match &names.0 {
        Some(n) => index(n)?,
        None => default.map(|d| d.0).ok_or((
            StatusCode::BAD_REQUEST,
            "no route splits traffic: name the arms, /compare?a=NAME&b=NAME".to_owned(),
        ))?,
    };
    let b = match &names.1 {
        Some(n) => index(n)?,
        None => default.map(|d| d.1).ok_or((
            StatusCode::BAD_REQUEST,
            "no route splits traffic: name the arms, /compare?a=NAME&b=NAME".to_owned(),
        ))?,
    };
    if a == b {
        let name = bounded(&shared.upstreams[a].config.name);
        return Err((
            StatusCode::BAD_REQUEST,
            format!("a and b are the same upstream (`{name}`): name two upstreams to compare"),
        ));
    }
    let now = shared.clock.now();
    let (a, b) = (&shared.upstreams[a], &shared.upstreams[b]);
    let price = |u: &Upstream| {
        u.config
            .economics
            .price
            .as_ref()
            .map(|p| crate::compare::ArmPrice {
                per_hour: p.per_hour,
                currency: p.currency.clone(),
                endpoints: u.pool.counts(now).healthy,
            })
    };
    Ok(crate::compare::compare(
        &a.config.name,
        &a.meter.samples(now),
        &b.config.name,
        &b.meter.samples(now),
        config.compare_window.as_secs(),
    )
    .priced(price(a).as_ref(), price(b).as_ref()))
}
