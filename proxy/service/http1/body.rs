//! Body framing: how a body ends ([`BodyFraming`], from its head), a chunked decoder
//! that finds the payload runs and the body's end in place (so a chunked body is forwarded
//! as it came), and the chunks tokentap frames itself.

use bytes::{BufMut, BytesMut};
use std::ops::Range;

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// No body (204, 304).
    Empty,
    /// `Content-Length`: this many bytes left.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Neither: the body ends when the upstream closes.
    UntilClose,
}

/// A malformed chunked body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BadChunk;

/// Decodes a chunked body incrementally, finding its payload and where it ends without
/// copying (RFC 9112 §7.1). Chunk extensions and trailer fields are skipped.
///
/// Responses are read as leniently as pingora's client reads them (a bare LF ends a line).
/// Requests are read [`strict`](Chunked::strict)ly: every line ends in CRLF and holds only
/// visible characters, spaces and tabs, so no front proxy can end a chunk line anywhere
/// else than tokentap does (a bare LF in an extension is the classic smuggling
/// differential).
#[derive(Debug, Default, Clone)]
pub(crate) struct Chunked {
    state: ChunkState,
    /// Bytes left in the current chunk, or the size being read.
    size: u64,
    digits: u8,
    strict: bool,
    /// Strict only: bytes of the current chunk line's extension, and of the trailer
    /// section, neither of which counts as payload against the body limit.
    overhead: u32,
}

/// The most bytes a strict decoder takes in one chunk line's extensions, and in the whole
/// trailer section: without a bound, a client could keep a request open for good by
/// sending extension or trailer bytes, which no body limit counts.
const MAX_CHUNK_OVERHEAD: u32 = 8 * 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    /// Whitespace after the size, before `;` (strict only).
    SizeWs,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    TrailerLine,
    /// The LF after a trailer line's CR (strict only).
    TrailerLf,
    FinalLf,
    Done,
}

/// A hex digit's value.
fn hex_value(b: u8) -> Option<u64> {
    let v = match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        b'A'..=b'F' => b - b'A' + 10,
        _ => return None,
    };
    Some(u64::from(v))
}

/// What a strict line may hold besides its CRLF: visible ASCII, SP, HTAB, obs-text.
fn line_byte(b: u8) -> bool {
    b == b'\t' || (b >= 0x20 && b != 0x7f)
}

impl Chunked {
    /// A decoder for a request body: no bare CR or LF, no control bytes in its lines.
    pub(crate) fn strict() -> Chunked {
        Chunked {
            strict: true,
            ..Chunked::default()
        }
    }

    /// Feeds `input`, calling `payload` with each run of payload bytes. Returns how many
    /// bytes of `input` belong to the body: all of them, unless the body ended inside it.
    pub(crate) fn feed(
        &mut self,
        input: &[u8],
        mut payload: impl FnMut(&[u8]),
    ) -> Result<usize, BadChunk> {
        self.feed_ranges(input, |run| payload(&input[run]))
    }

    /// As [`Self::feed`], giving each run of payload bytes as its range in `input`.
    pub(crate) fn feed_ranges(
        &mut self,
        input: &[u8],
        mut payload: impl FnMut(Range<usize>),
    ) -> Result<usize, BadChunk> {
        use ChunkState::*;
        let mut i = 0;
        while i < input.len() && self.state != Done {
            if self.state == Data {
                let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                payload(i..i + n);
                i += n;
                self.size -= n as u64;
                if self.size == 0 {
                    self.state = DataCr;
                }
                continue;
            }
            // The usual lines whole, a chunk's CRLF and a size line of digits and CRLF: the
            // same transitions as the byte-at-a-time match below, in a few steps.
            if self.state == DataCr && input[i..].starts_with(b"\r\n") {
                i += 2;
                self.state = Size;
                continue;
            }
            if self.state == Size {
                // The digits read and folded in one pass (past 15 the size is refused, and
                // a shift drops what overflows, without a panic).
                let mut size = self.size;
                let mut end = i;
                while let Some(v) = input.get(end).copied().and_then(hex_value) {
                    size = size << 4 | v;
                    end += 1;
                }
                let run = end - i;
                if usize::from(self.digits) + run > 15 {
                    return Err(BadChunk);
                }
                self.size = size;
                self.digits += run as u8;
                i = end;
                if self.digits > 0 && input[i..].starts_with(b"\r\n") {
                    i += 2;
                    self.digits = 0;
                    self.state = if self.size > 0 {
                        self.overhead = 0; // each chunk line has its own bound
                        Data
                    } else {
                        TrailerStart
                    };
                    continue;
                }
                if run > 0 {
                    continue;
                }
            }
            let b = input[i];
            i += 1;
            let strict = self.strict;
            self.state = match (self.state, b) {
                (Size, b) if b.is_ascii_hexdigit() => {
                    if self.digits >= 15 {
                        return Err(BadChunk);
                    }
                    self.digits += 1;
                    self.size = self.size << 4 | hex_value(b).unwrap_or(0);
                    Size
                }
                (Size | SizeWs, b' ' | b'\t') if strict && self.digits > 0 => SizeWs,
                (Size | SizeWs, b';') if self.digits > 0 => Extension,
                (Size, b' ' | b'\t') if self.digits > 0 => Extension,
                (Size, b'\r') if self.digits > 0 => SizeLf,
                (Size | Extension, b'\n') if strict => return Err(BadChunk),
                (Size, b'\n') | (SizeLf | Extension, b'\n') if self.digits > 0 => {
                    self.digits = 0;
                    if self.size > 0 {
                        self.overhead = 0; // each chunk line has its own bound
                    }
                    if self.size == 0 {
                        TrailerStart
                    } else {
                        Data
                    }
                }
                (Extension, b'\r') => SizeLf,
                (Extension, _) if !strict => Extension,
                (Extension, b) if line_byte(b) => {
                    self.count_overhead()?;
                    Extension
                }
                (DataCr, b'\r') => DataLf,
                (DataCr, b'\n') if !strict => Size,
                (DataLf, b'\n') => Size,
                (TrailerStart, b'\r') => FinalLf,
                (TrailerStart | FinalLf, b'\n') if !strict || self.state == FinalLf => Done,
                (TrailerLine, b'\r') if strict => TrailerLf,
                (TrailerLf, b'\n') => TrailerStart,
                (TrailerLine, b'\n') if !strict => TrailerStart,
                (TrailerStart | TrailerLine, _) if !strict => TrailerLine,
                (TrailerStart | TrailerLine, b) if line_byte(b) => {
                    self.count_overhead()?;
                    TrailerLine
                }
                _ => return Err(BadChunk),
            };
        }
        Ok(i)
    }

    fn count_overhead(&mut self) -> Result<(), BadChunk> {
        self.overhead += 1;
        if self.overhead > MAX_CHUNK_OVERHEAD {
            return Err(BadChunk);
        }
        Ok(())
    }

    /// Whether the last chunk and the trailer section were read.
    pub(crate) fn done(&self) -> bool {
        self.state == ChunkState::Done
    }
}

/// Appends `data` as one chunk.
pub(crate) fn put_chunk(out: &mut BytesMut, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    put_chunk_size(out, data.len());
    out.put_slice(data);
    out.put_slice(b"\r\n");
}

/// A chunk's size line, for `len` bytes of data to follow (and the chunk's `\r\n` after).
pub(crate) fn put_chunk_size(out: &mut BytesMut, len: usize) {
    let _ = std::fmt::Write::write_fmt(out, format_args!("{len:x}\r\n"));
}

/// The last chunk of a body tokentap frames itself.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] =
        b"5;ext=1\r\nhello\r\n18\r\ndata: {\"x\":1}\n\ndata: [DO\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT";

    #[test]
    fn chunked_bodies_decode_the_same_at_every_split() {
        for split in 0..=BODY.len() {
            let mut c = Chunked::default();
            let mut got = Vec::new();
            let a = c
                .feed(&BODY[..split], |p| got.extend_from_slice(p))
                .unwrap();
            assert_eq!(a, split.min(BODY.len() - 4), "split {split}");
            let b = c.feed(&BODY[a..], |p| got.extend_from_slice(p)).unwrap();
            assert!(c.done(), "split {split}");
            assert_eq!(a + b, BODY.len() - 4, "the body ends before NEXT");
            assert_eq!(got, b"hellodata: {\"x\":1}\n\ndata: [DO");
        }
    }

    /// Whole lines take the fast steps; one byte at a time, every byte goes through the
    /// match. Both must read every body alike, strict or not, malformed or not.
    #[test]
    fn whole_lines_decode_as_byte_at_a_time() {
        let bodies: [&[u8]; 13] = [
            BODY,
            b"A\r\n0123456789\r\nb\r\n0123456789a\r\n0\r\n\r\n",
            b"10\r\n0123456789abcdef\r\n1\r\nx\r\n0\r\n\r\n",
            b"a\r\n0123456789\r\n0\r\nT: 1\r\n\r\n",
            b"00000000000000f\r\n0123456789abcde\r\n0\r\n\r\n",
            b"000000000000000f\r\n0123456789abcde\r\n0\r\n\r\n",
            b"5 \r\nhello\r\n0\r\n\r\n",
            b"5;a=b\r\nhello\r\n0\r\n\r\n",
            b"5\nhello\n0\n\n",
            b"5\r\nhello\n5\r\nworld\r\n0\r\n\r\n",
            b"5\r\nhelloX\r\n",
            b"\r\n5\r\nhello\r\n",
            b"0\r\n\r\nrest",
        ];
        let run = |strict: bool, body: &[u8], step: usize| {
            let mut c = if strict {
                Chunked::strict()
            } else {
                Chunked::default()
            };
            let (mut payload, mut used) = (Vec::new(), 0);
            for part in body.chunks(step) {
                if c.done() {
                    break;
                }
                match c.feed(part, |p| payload.extend_from_slice(p)) {
                    Ok(n) => used += n,
                    Err(e) => return Err(e),
                }
            }
            Ok((payload, used, c.done()))
        };
        for body in bodies {
            for strict in [false, true] {
                let one = run(strict, body, 1);
                for step in [2, 3, 5, body.len().max(1)] {
                    assert_eq!(run(strict, body, step), one, "{body:?} strict {strict}");
                }
            }
        }
    }

    #[test]
    fn malformed_chunks_are_errors() {
        for bad in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"5\r\nhelloXX",
            b"fffffffffffffffff\r\n",
        ] {
            let mut c = Chunked::default();
            assert_eq!(c.feed(bad, |_| {}), Err(BadChunk), "{bad:?}");
        }
        // Hex digits in either case, whole or a byte at a time.
        let body = b"1A\r\nabcdefghijklmnopqrstuvwxyz\r\naB\r\n";
        for step in [1, body.len()] {
            let (mut c, mut got) = (Chunked::default(), Vec::new());
            for part in body.chunks(step) {
                c.feed(part, |p| got.extend_from_slice(p)).unwrap();
            }
            assert_eq!(got, b"abcdefghijklmnopqrstuvwxyz", "step {step}");
            assert_eq!(c.size, 0xab, "step {step}");
        }
        let mut c = Chunked::default();
        assert_eq!(
            c.feed(b"0\n\n", |_| {}),
            Ok(3),
            "bare LF line ends are read"
        );
        assert!(c.done());
    }
}
