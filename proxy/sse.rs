//! Incremental Server-Sent Events framing: bytes in, events out, no I/O.
//!
//! The parser follows the WHATWG event-stream grammar: LF, CRLF and lone CR all end a line
//! (a CR that ends one fragment and an LF that starts the next are one line end), a leading
//! UTF-8 BOM is skipped, `:` lines are comments, `data:` lines accumulate (joined by `\n`),
//! `event:` names the event, and a blank line dispatches it. Events may be split at any byte,
//! including inside UTF-8 sequences and inside JSON; the parser never looks inside `data`.
//!
//! It only observes: the caller forwards the fragment unchanged whatever happens here. Memory
//! is bounded by `max_event_bytes`: an event over the bound is skipped (and counted in
//! [`SseParser::oversized_events`]), never buffered whole. After the first few events the
//! buffers have reached their working size and `push` does not allocate.

use memchr::memchr;

const BOM: &[u8; 3] = b"\xEF\xBB\xBF";

/// One dispatched event. `name` is empty when the event had no `event:` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event<'a> {
    pub name: &'a [u8],
    pub data: &'a [u8],
}

/// The framing state of one response stream.
#[derive(Debug)]
pub struct SseParser {
    /// A line that began in an earlier fragment and has not ended yet.
    line: Vec<u8>,
    /// The current event's data lines, joined by `\n`.
    data: Vec<u8>,
    /// The current event's `event:` name.
    name: Vec<u8>,
    /// Whether the current event has had at least one `data` line.
    has_data: bool,
    /// The previous fragment ended in CR: an LF at the start of the next one is part of it.
    skip_lf: bool,
    /// How many bytes of a leading BOM have been matched; `None` once past the stream start.
    bom_matched: Option<u8>,
    /// The pending line went over `max_event_bytes`.
    line_overflow: bool,
    /// ... and it is a `data` line (any other field, or a comment, is simply ignored).
    line_overflow_data: bool,
    /// The current event went over `max_event_bytes`: its remaining lines are ignored.
    overflow: bool,
    max_event_bytes: usize,
    oversized: u64,
}

// === impl SseParser ===

impl SseParser {
    /// A parser that skips (for metering) any event or line longer than `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Self {
        SseParser {
            line: Vec::new(),
            data: Vec::new(),
            name: Vec::new(),
            has_data: false,
            skip_lf: false,
            bom_matched: Some(0),
            line_overflow: false,
            line_overflow_data: false,
            overflow: false,
            max_event_bytes,
            oversized: 0,
        }
    }

    /// Feeds one fragment; calls `on_event` for every event it completes.
    pub fn push(&mut self, mut chunk: &[u8], mut on_event: impl FnMut(Event<'_>)) {
        if let Some(matched) = self.bom_matched {
            let mut m = matched as usize;
            while m < BOM.len() && !chunk.is_empty() {
                if chunk[0] != BOM[m] {
                    // Not a BOM after all: what looked like one is ordinary line content.
                    self.bom_matched = None;
                    self.feed(&BOM[..m], &mut on_event);
                    break;
                }
                m += 1;
                chunk = &chunk[1..];
            }
            if self.bom_matched.is_some() {
                if m == BOM.len() {
                    self.bom_matched = None;
                } else {
                    self.bom_matched = Some(m as u8);
                    return;
                }
            }
        }
        self.feed(chunk, &mut on_event);
    }

    /// Whether the stream stopped inside an event: the spec discards such a tail, and a
    /// caller may take it as a sign that the stream was cut short.
    pub fn has_partial_event(&self) -> bool {
        !self.line.is_empty()
            || self.line_overflow
            || self.has_data
            || self.overflow
            || !self.name.is_empty()
    }

    /// Events skipped because they exceeded the size bound.
    pub fn oversized_events(&self) -> u64 {
        self.oversized
    }

    fn feed(&mut self, mut buf: &[u8], on_event: &mut impl FnMut(Event<'_>)) {
        if self.skip_lf && !buf.is_empty() {
            self.skip_lf = false;
            if buf[0] == b'\n' {
                buf = &buf[1..];
            }
        }
        while let Some(i) = next_line_end(buf) {
            let between_events =
                self.line.is_empty() && !self.line_overflow && !self.has_data && !self.overflow;
            if between_events {
                if let Some((data, len)) = whole_data_event(buf, i, self.max_event_bytes) {
                    // Dispatched from the fragment itself, not copied first.
                    on_event(Event {
                        name: &self.name,
                        data,
                    });
                    self.name.clear();
                    buf = &buf[len..];
                    continue;
                }
            }
            if !self.line.is_empty() {
                self.append_line(&buf[..i]);
            }
            if self.line_overflow {
                // A line too long to keep: a data line takes its event down with it; a
                // comment or another field is ignored, as if it had arrived whole.
                self.line_overflow = false;
                self.overflow |= self.line_overflow_data;
            } else if self.line.is_empty() {
                self.line_end(&buf[..i], on_event);
            } else {
                let line = std::mem::take(&mut self.line);
                self.line_end(&line, on_event);
                self.line = line;
                self.line.clear();
            }
            let mut next = i + 1;
            if buf[i] == b'\r' {
                match buf.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.skip_lf = true,
                }
            }
            buf = &buf[next..];
        }
        self.append_line(buf);
    }

    fn append_line(&mut self, piece: &[u8]) {
        if self.line_overflow || piece.is_empty() {
            return;
        }
        // Room for the field name too: a `data: ` line whose value is within the bound is
        // kept, whether or not it arrived in one piece.
        let bound = self.max_event_bytes.saturating_add(b"data: ".len());
        if self.line.len() + piece.len() > bound {
            let mut head = [0u8; 5];
            let have = self.line.len().min(5);
            head[..have].copy_from_slice(&self.line[..have]);
            let more = (5 - have).min(piece.len());
            head[have..have + more].copy_from_slice(&piece[..more]);
            let head = &head[..have + more];
            self.line_overflow_data = head == b"data:" || (head.len() == 4 && head == b"data");
            self.line_overflow = true;
            self.line.clear();
        } else {
            self.line.extend_from_slice(piece);
        }
    }

    fn line_end(&mut self, line: &[u8], on_event: &mut impl FnMut(Event<'_>)) {
        if line.is_empty() {
            self.dispatch(on_event);
            return;
        }
        if self.overflow || line[0] == b':' {
            return;
        }
        let (field, value) = match memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &line[line.len()..]),
        };
        match field {
            b"data" => {
                let extra = value.len() + usize::from(self.has_data);
                if self.data.len() + extra > self.max_event_bytes {
                    self.overflow = true;
                    return;
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            // A line past the bound is ignored, as it is when it arrives in pieces.
            b"event" if line.len() <= self.max_event_bytes.saturating_add(b"data: ".len()) => {
                self.name.clear();
                self.name.extend_from_slice(value);
            }
            _ => {} // id, retry and unknown fields carry nothing we meter
        }
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(Event<'_>)) {
        if self.overflow {
            self.oversized += 1;
        } else if self.has_data {
            on_event(Event {
                name: &self.name,
                data: &self.data,
            });
        }
        self.reset_event();
    }

    fn reset_event(&mut self) {
        self.data.clear();
        self.name.clear();
        self.has_data = false;
        self.overflow = false;
    }
}

/// Where the first line of `buf` ends (its LF or CR). On x86-64 with AVX2, memchr's
/// searcher is made once rather than on each call: its setup and dispatch were ~60 of the
/// ~175 instructions an event's data line cost to search.
fn next_line_end(buf: &[u8]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        use memchr::arch::x86_64::avx2::memchr::Two;
        static SEARCH: std::sync::LazyLock<Option<Two>> =
            std::sync::LazyLock::new(|| Two::new(b'\n', b'\r'));
        if let Some(two) = SEARCH.as_ref() {
            return two.find(buf);
        }
    }
    memchr::memchr2(b'\n', b'\r', buf)
}

/// The usual event, whole: a `data` line ending at `i` and, right after it, the blank line
/// that dispatches it, both ended alike by LF or CRLF. Its data (unless over `max`) and the
/// bytes the two lines take.
fn whole_data_event(buf: &[u8], i: usize, max: usize) -> Option<(&[u8], usize)> {
    let value = buf[..i].strip_prefix(b"data:")?;
    let value = value.strip_prefix(b" ").unwrap_or(value);
    let ends = &buf[i..];
    let ends_len = if ends.starts_with(b"\n\n") {
        2
    } else if ends.starts_with(b"\r\n\r\n") {
        4
    } else {
        return None;
    };
    (value.len() <= max).then_some((value, i + ends_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole-input parser written straight from the spec, to compare against.
    fn reference(input: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let input = input.strip_prefix(BOM).unwrap_or(input);
        let mut lines = Vec::new();
        let mut cur = Vec::new();
        let mut i = 0;
        let mut ended = false;
        while i < input.len() {
            match input[i] {
                b'\r' => {
                    lines.push(std::mem::take(&mut cur));
                    if input.get(i + 1) == Some(&b'\n') {
                        i += 1;
                    }
                    ended = true;
                }
                b'\n' => {
                    lines.push(std::mem::take(&mut cur));
                    ended = true;
                }
                b => {
                    cur.push(b);
                    ended = false;
                }
            }
            i += 1;
        }
        let _ = ended; // an unterminated last line is never processed
        let mut out = Vec::new();
        let (mut data, mut name, mut has) = (Vec::new(), Vec::new(), false);
        for line in lines {
            if line.is_empty() {
                if has {
                    out.push((name.clone(), data.clone()));
                }
                data.clear();
                name.clear();
                has = false;
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (f, v) = match line.iter().position(|&b| b == b':') {
                Some(p) => {
                    let v = &line[p + 1..];
                    (
                        line[..p].to_vec(),
                        v.strip_prefix(b" ").unwrap_or(v).to_vec(),
                    )
                }
                None => (line.clone(), Vec::new()),
            };
            if f == b"data" {
                if has {
                    data.push(b'\n');
                }
                data.extend_from_slice(&v);
                has = true;
            } else if f == b"event" {
                name = v;
            }
        }
        out
    }

    fn parse_in_pieces(pieces: &[&[u8]]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        for piece in pieces {
            p.push(piece, |e| out.push((e.name.to_vec(), e.data.to_vec())));
        }
        out
    }

    const FIXTURES: &[&[u8]] = &[
        b"data: {\"choices\":[{\"delta\":{\"content\":\"h\xC3\xA9llo\"}}]}\n\ndata: [DONE]\n\n",
        b"\xEF\xBB\xBFdata: a\r\n\r\ndata: b\r\rdata:c\n\n",
        b": keep-alive\n\nevent: message_start\ndata: {\"x\":1}\n\n: ping\r\nevent: ping\ndata: {}\n\n",
        b"data: line one\ndata: line two\ndata\ndata:\n\nid: 7\nretry: 100\ndata: x\n\n",
        b"event: only-name\n\ndata: tail-without-blank-line\n",
        b"data: \xF0\x9F\x98\x80 emoji\r\n\r\nfield-without-colon\ndata:  two spaces\n\n",
        b"\xEF\xBBdata: not a bom\n\n",
        b"data: a\n\r\ndata: b\r\n\ndata:c\n\nevent: e\ndata: d\n\ndata: f\n\ndata\n\ndatax: y\n\n",
    ];

    #[test]
    fn matches_reference_split_at_every_offset() {
        for fixture in FIXTURES {
            let want = reference(fixture);
            assert_eq!(parse_in_pieces(&[fixture]), want, "unsplit {:?}", fixture);
            for cut in 0..=fixture.len() {
                let (a, b) = fixture.split_at(cut);
                assert_eq!(parse_in_pieces(&[a, b]), want, "cut at {cut}");
                for cut2 in cut..=fixture.len() {
                    let (b1, b2) = b.split_at(cut2 - cut);
                    assert_eq!(parse_in_pieces(&[a, b1, b2]), want, "cuts {cut},{cut2}");
                }
            }
            let bytes: Vec<&[u8]> = fixture.chunks(1).collect();
            assert_eq!(parse_in_pieces(&bytes), want, "byte at a time");
        }
    }

    #[test]
    fn reference_sees_what_the_spec_says() {
        let ev = reference(FIXTURES[1]);
        assert_eq!(
            ev,
            vec![
                (vec![], b"a".to_vec()),
                (vec![], b"b".to_vec()),
                (vec![], b"c".to_vec())
            ]
        );
        let ev = reference(FIXTURES[3]);
        assert_eq!(ev[0].1, b"line one\nline two\n\n".to_vec());
        // Half a BOM is not a BOM: it stays part of the field name, which is then unknown.
        assert!(reference(FIXTURES[6]).is_empty());
    }

    #[test]
    fn cr_at_fragment_end_then_lf_is_one_line_end() {
        // Were the LF a second line end, it would dispatch an empty line early.
        let got = parse_in_pieces(&[b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]);
        assert_eq!(got, vec![(vec![], b"a\nb".to_vec())]);
    }

    /// Parses `pieces` with a 16-byte bound: the events' data, and the parser.
    fn bounded16<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> (Vec<Vec<u8>>, SseParser) {
        let mut p = SseParser::new(16);
        let mut got = Vec::new();
        for piece in pieces {
            p.push(piece, |e| got.push(e.data.to_vec()));
        }
        (got, p)
    }

    #[test]
    fn oversized_events_are_skipped_and_counted() {
        let input: &[u8] = b"data: small\n\ndata: this one is far too long for the bound\n\ndata: x\ndata: and this overflows in its second line\n\ndata: ok\n\n";
        let (got, p) = bounded16(input.chunks(5));
        assert_eq!(got, vec![b"small".to_vec(), b"ok".to_vec()]);
        assert_eq!(p.oversized_events(), 2);
        assert!(!p.has_partial_event());
        // Whole, each event arrives in one piece with the blank line after it.
        let (got, p) = bounded16([input]);
        assert_eq!(got, vec![b"small".to_vec(), b"ok".to_vec()]);
        assert_eq!(p.oversized_events(), 2);
    }

    #[test]
    fn an_event_name_past_the_bound_is_ignored_whole_or_split() {
        // Found by the `sse` fuzz target: whole, the name was cut to the bound; split, ignored.
        let input: &[u8] = b"event: a\nevent: 0123456789abcdefXYZ\ndata: x\n\n";
        for cut in 0..=input.len() {
            let mut p = SseParser::new(16);
            let mut names = Vec::new();
            for piece in [&input[..cut], &input[cut..]] {
                p.push(piece, |e| names.push(e.name.to_vec()));
            }
            assert_eq!(names, vec![b"a".to_vec()], "cut at {cut}");
        }
    }

    #[test]
    fn the_bound_is_the_same_for_a_whole_event_and_a_split_one() {
        let input = b"data: 0123456789abcdef\n\ndata: 0123456789abcdefg\n\n"; // 16, 17 bytes
        for cut in [input.len(), 3, 30] {
            let (got, p) = bounded16([&input[..cut], &input[cut..]]);
            assert_eq!(got, vec![b"0123456789abcdef".to_vec()], "cut at {cut}");
            assert_eq!(p.oversized_events(), 1, "cut at {cut}");
        }
    }

    #[test]
    fn a_long_comment_or_name_is_ignored_however_it_is_split() {
        let input = b": a comment far longer than the bound of this parser\nevent: a-name-longer-than-sixteen\ndata: kept\n\n";
        for cut in 0..input.len() {
            let (got, p) = bounded16([&input[..cut], &input[cut..]]);
            assert_eq!(got, vec![b"kept".to_vec()], "cut at {cut}");
            assert_eq!(p.oversized_events(), 0, "cut at {cut}");
        }
    }

    #[test]
    fn partial_event_at_end_is_reported() {
        let mut p = SseParser::new(1024);
        p.push(b"data: {\"cut", |_| panic!("no event yet"));
        assert!(p.has_partial_event());
    }
}
