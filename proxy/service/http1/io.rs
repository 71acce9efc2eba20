//! Reads and writes on the direct path's connections, through the worker thread's scratch
//! buffer: every read lands there and is handed on from there, so an open stream waiting
//! for its next token holds no read buffer of its own. Also the client watched while a
//! request waits (it may leave, or send its next request), and the errors of either side.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use pingora::prelude::*;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::conn::Io;

/// The worker thread's read buffer: every read lands here and is forwarded from here, so an
/// open stream waiting for its next token holds no read buffer of its own.
const SCRATCH: usize = 32 * 1024;

thread_local! {
    static SCRATCH_BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH].into_boxed_slice());
}

/// Reads what `io` has into the thread's scratch buffer and hands it to `f` (an empty slice
/// at end of stream). `f` must not read from a connection itself.
pub(crate) fn poll_read_with<R>(
    io: &mut Io,
    cx: &mut Context<'_>,
    f: impl FnOnce(&[u8], &mut Context<'_>) -> R,
) -> Poll<io::Result<R>> {
    poll_read_capped(io, cx, SCRATCH, f)
}

/// As [`poll_read_with`], reading at most `cap` bytes (at least one).
fn poll_read_capped<R>(
    io: &mut Io,
    cx: &mut Context<'_>,
    cap: usize,
    f: impl FnOnce(&[u8], &mut Context<'_>) -> R,
) -> Poll<io::Result<R>> {
    SCRATCH_BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        let cap = cap.clamp(1, buf.len());
        let mut read = ReadBuf::new(&mut buf[..cap]);
        ready!(Pin::new(io).poll_read(cx, &mut read))?;
        Poll::Ready(Ok(f(read.filled(), cx)))
    })
}

/// Reads what `io` has next onto `buf`; 0 at end of stream.
pub(crate) async fn read_more(io: &mut Io, buf: &mut BytesMut) -> io::Result<usize> {
    poll_fn(|cx| {
        poll_read_with(io, cx, |data, _| {
            buf.extend_from_slice(data);
            data.len()
        })
    })
    .await
}

/// Reads what `io` has next onto `buf`, but no more than brings it one byte past `limit`
/// (enough to tell it overflowed; the rest stays unread); 0 at end of stream.
pub(crate) async fn read_more_upto(
    io: &mut Io,
    buf: &mut BytesMut,
    limit: usize,
) -> io::Result<usize> {
    let room = limit.saturating_add(1).saturating_sub(buf.len());
    poll_fn(|cx| {
        poll_read_capped(io, cx, room, |data, _| {
            buf.extend_from_slice(data);
            data.len()
        })
    })
    .await
}

/// Reads and drops what `io` has next, with no buffer of its own; 0 at end of stream.
pub(crate) async fn discard(io: &mut Io) -> io::Result<usize> {
    poll_fn(|cx| poll_read_with(io, cx, |data, _| data.len())).await
}

/// Writes `bytes` to the client now when nothing is queued before them, queueing what it
/// does not take; the bytes written now.
pub(crate) fn forward(
    bytes: &[u8],
    out: &mut BytesMut,
    client: Option<(&mut Io, &mut Context<'_>)>,
) -> u64 {
    let mut written = 0;
    if let (true, Some((client, cx))) = (out.is_empty(), client) {
        while written < bytes.len() {
            match Pin::new(&mut *client).poll_write(cx, &bytes[written..]) {
                Poll::Ready(Ok(n)) if n > 0 => written += n,
                // Errors surface on the next write, from `out`.
                _ => break,
            }
        }
    }
    out.extend_from_slice(&bytes[written..]);
    written as u64
}

/// Runs `work` while watching the client: a client that goes away ends it with a downstream
/// error; bytes it sends (a pipelined next request) are kept in `leftover`, and the
/// watching stops. The work comes pinned by the caller, as [`in_time`]'s task, so that it
/// is kept once.
pub(crate) async fn watching<T, F: Future<Output = Result<T>> + ?Sized>(
    client: &mut Io,
    watch: &mut bool,
    leftover: &mut BytesMut,
    mut work: Pin<&mut F>,
) -> Result<T> {
    poll_fn(|cx| {
        if let Poll::Ready(done) = work.as_mut().poll(cx) {
            return Poll::Ready(done);
        }
        match poll_client_gone(client, cx, watch, leftover) {
            Some(gone) => Poll::Ready(Err(gone)),
            None => Poll::Pending,
        }
    })
    .await
}

/// While `watch`ing: the error to end with if the client closed or failed. Bytes it sent (a
/// pipelined next request) are kept in `leftover`, and the watching stops.
pub(crate) fn poll_client_gone(
    client: &mut Io,
    cx: &mut Context<'_>,
    watch: &mut bool,
    leftover: &mut BytesMut,
) -> Option<Box<Error>> {
    if !*watch {
        return None;
    }
    let seen = poll_read_with(client, cx, |data, _| {
        leftover.extend_from_slice(data);
        !data.is_empty()
    });
    match seen {
        Poll::Ready(Ok(true)) => {
            *watch = false;
            None
        }
        Poll::Ready(Ok(false)) | Poll::Ready(Err(_)) => {
            Some(down(ConnectionClosed, "client went away"))
        }
        Poll::Pending => None,
    }
}

pub(crate) fn down(kind: ErrorType, what: &'static str) -> Box<Error> {
    Error::explain(kind, what).into_down()
}

pub(crate) fn down_io(kind: ErrorType, e: io::Error) -> Box<Error> {
    Error::because(kind, "client connection", e).into_down()
}

pub(crate) fn up_err(kind: ErrorType, what: &'static str) -> Box<Error> {
    Error::explain(kind, what).into_up()
}

pub(crate) fn up_io(kind: ErrorType, e: io::Error) -> Box<Error> {
    Error::because(kind, "upstream connection", e).into_up()
}

/// Writes `bytes` whole to the client and flushes, within `limit`.
pub(crate) async fn write_within(client: &mut Io, bytes: &[u8], limit: Duration) -> io::Result<()> {
    let write = std::pin::pin!(async {
        client.write_all(bytes).await?;
        client.flush().await
    });
    in_time(limit, write)
        .await
        .unwrap_or_else(|| Err(io::ErrorKind::TimedOut.into()))
}

/// `task`'s output if it ends within `limit`, else `None`. Its timer is made only if it
/// does not end when first polled: most of a request's writes go at once, and a timer is a
/// clock read and the timer's own work a request (its limit starts a poll later).
///
/// The task comes pinned where it is made: an async fn keeps its arguments for its whole
/// life, so a task moved in and pinned here would be kept twice.
pub(crate) async fn in_time<F: Future + ?Sized>(
    limit: Duration,
    mut task: Pin<&mut F>,
) -> Option<F::Output> {
    let at_once = poll_fn(|cx| Poll::Ready(task.as_mut().poll(cx))).await;
    match at_once {
        Poll::Ready(out) => Some(out),
        Poll::Pending => tokio::time::timeout(limit, task).await.ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;

    #[tokio::test(start_paused = true)]
    async fn a_task_in_time_is_its_output_and_a_late_one_none() {
        let limit = Duration::from_secs(5);
        assert_eq!(in_time(limit, pin!(async { 1 })).await, Some(1));
        // Pending once, then done well within the limit.
        let soon = async {
            tokio::task::yield_now().await;
            2
        };
        assert_eq!(in_time(limit, pin!(soon)).await, Some(2));
        let late = tokio::time::sleep(limit + Duration::from_millis(1));
        let started = tokio::time::Instant::now();
        assert_eq!(in_time(limit, pin!(late)).await, None);
        assert_eq!(started.elapsed(), limit);
        let just = tokio::time::sleep(limit - Duration::from_millis(1));
        assert_eq!(in_time(limit, pin!(just)).await, Some(()));
    }
}
