//! Time and outcome as the meter takes them: [`Nanos`] since the [`Clock`]'s origin (a
//! monotonic clock, or a frozen one in tests), and how a request ended ([`Outcome`]).

use std::time::Instant;

/// Nanoseconds since a [`Clock`]'s origin.
pub type Nanos = u64;

/// A monotonic clock whose readings are [`Nanos`] since it was made.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
    /// In tests, a clock that always reads this.
    #[cfg(test)]
    frozen: Option<Nanos>,
}

// === impl Clock ===

impl Clock {
    pub fn new() -> Self {
        Clock {
            origin: Instant::now(),
            #[cfg(test)]
            frozen: None,
        }
    }

    /// A clock that always reads `at`: what a meter reads for itself (its start, the
    /// curve's window) does not depend on when a test ran.
    #[cfg(test)]
    pub fn frozen(at: Nanos) -> Self {
        Clock {
            frozen: Some(at),
            ..Clock::new()
        }
    }

    pub fn now(&self) -> Nanos {
        #[cfg(test)]
        if let Some(at) = self.frozen {
            return at;
        }
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant a reading `at` of this clock stands for.
    pub fn instant(&self, at: Nanos) -> Instant {
        self.origin + std::time::Duration::from_nanos(at)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// How a request ended; the `status` label of `tokentap_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A complete response (2xx/3xx; a stream that reached its terminal event).
    Ok,
    /// The upstream answered 4xx: the request was refused, the backend did its job.
    ClientError,
    /// The upstream answered 5xx.
    ServerError,
    /// The client went away before the response ended.
    Aborted,
    /// The upstream could not be reached, or failed (reset, timeout) mid-response.
    UpstreamError,
    /// A stream that ended without its terminal event (finish reason or `[DONE]`).
    Truncated,
    /// The stream reported an error in-band (`{"error":…}` event).
    StreamError,
    /// tokentap itself failed the request (not the backend's fault).
    ProxyError,
}

// === impl Outcome ===

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Ok,
        Outcome::ClientError,
        Outcome::ServerError,
        Outcome::Aborted,
        Outcome::UpstreamError,
        Outcome::Truncated,
        Outcome::StreamError,
        Outcome::ProxyError,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ClientError => "4xx",
            Outcome::ServerError => "5xx",
            Outcome::Aborted => "aborted",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Truncated => "truncated",
            Outcome::StreamError => "stream_error",
            Outcome::ProxyError => "proxy_error",
        }
    }

    /// Errors are the backend's failures; a refused request or a client that left is not one.
    pub fn is_error(self) -> bool {
        matches!(
            self,
            Outcome::ServerError
                | Outcome::UpstreamError
                | Outcome::Truncated
                | Outcome::StreamError
        )
    }

    /// The outcome of a response that arrived whole with this HTTP status.
    pub fn from_status(status: u16) -> Outcome {
        match status {
            500.. => Outcome::ServerError,
            400..=499 => Outcome::ClientError,
            _ => Outcome::Ok,
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}
