//! Where a pool's endpoints are found while running: every A and AAAA record of a name
//! (asked of the system's resolver, or of `nameserver`), or the URLs of a file.

use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::{ResolveErrorKind, Resolver};

use crate::config::{Discover, EndpointAddr};

/// How often `d` looks again.
pub(super) fn every(d: &Discover) -> Duration {
    match d {
        Discover::Dns { every, .. } | Discover::File { every, .. } => *every,
    }
}

/// The endpoints `d` finds now, sorted; `Err` when it cannot tell (the name server did not
/// answer, the file cannot be read or has a bad line): the pool keeps those it has.
pub(super) async fn find(d: &Discover) -> Result<Vec<EndpointAddr>, String> {
    let mut found = match d {
        Discover::Dns {
            name,
            port,
            nameserver,
            ..
        } => resolve(name, *port, *nameserver).await?,
        Discover::File { path, .. } => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || read_file(&path))
                .await
                .map_err(|e| format!("reading the file: {e}"))??
        }
    };
    found.sort_by_key(|e| e.addr);
    found.dedup_by(|a, b| a.addr == b.addr);
    Ok(found)
}

/// Every address of `name` at `port`: none when the name has no records (a Service with
/// no ready pod), `Err` when the resolver could not tell.
async fn resolve(
    name: &str,
    port: u16,
    nameserver: Option<std::net::SocketAddr>,
) -> Result<Vec<EndpointAddr>, String> {
    let provider = TokioConnectionProvider::default();
    let mut builder = match nameserver {
        Some(at) => {
            let mut config = ResolverConfig::new();
            config.add_name_server(NameServerConfig::new(at, Protocol::Udp));
            config.add_name_server(NameServerConfig::new(at, Protocol::Tcp));
            Resolver::builder_with_config(config, provider)
        }
        None => Resolver::builder(provider)
            .map_err(|e| format!("reading the system's resolver config: {e}"))?,
    };
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    // Asked afresh each time: the records are the truth, whatever their TTL says.
    opts.cache_size = 0;
    opts.timeout = Duration::from_secs(2);
    opts.attempts = 2;
    let resolver = builder.build();
    match resolver.lookup_ip(name).await {
        Ok(ips) => Ok(ips
            .iter()
            .map(|ip| EndpointAddr::found(name, std::net::SocketAddr::new(ip, port)))
            .collect()),
        Err(e) if matches!(e.kind(), ResolveErrorKind::Proto(p) if p.is_no_records_found()) => {
            Ok(Vec::new())
        }
        Err(e) => Err(format!("resolving {name}: {e}")),
    }
}

/// The endpoints a file lists: one URL a line, blank lines and `#` comments skipped.
fn read_file(path: &std::path::Path) -> Result<Vec<EndpointAddr>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_file(text: &str) -> Result<Vec<EndpointAddr>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        out.push(EndpointAddr::parse(line).map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_of_endpoints() {
        let found = parse_file(
            "# the pool\nhttp://127.0.0.1:8001\n\n  http://127.0.0.1:8002  # b\nhttps://127.0.0.1:8443\n",
        )
        .unwrap();
        let urls: Vec<&str> = found.iter().map(|e| e.url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:8001",
                "http://127.0.0.1:8002",
                "https://127.0.0.1:8443"
            ]
        );
        assert!(found[2].tls);
        let bad = parse_file("http://127.0.0.1:8001\nftp://x:1\n").unwrap_err();
        assert!(bad.starts_with("line 2: "), "{bad}");
    }
}
