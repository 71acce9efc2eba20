//! Incremental NDJSON framing (Ollama's native API): one JSON value per line, LF or CRLF,
//! split at any byte. Same contract as [`crate::sse`]: bytes in, events out, no I/O, never
//! alters a byte, bounded (a line over the bound is skipped and counted).

use memchr::memchr;

use crate::sse::Event;

#[derive(Debug)]
pub struct NdjsonParser {
    line: Vec<u8>,
    overflow: bool,
    max_line_bytes: usize,
    oversized: u64,
}

impl NdjsonParser {
    pub fn new(max_line_bytes: usize) -> Self {
        NdjsonParser {
            line: Vec::new(),
            overflow: false,
            max_line_bytes,
            oversized: 0,
        }
    }

    /// Feeds one fragment; calls `on_event` with each complete non-blank line.
    pub fn push(&mut self, mut chunk: &[u8], mut on_event: impl FnMut(Event<'_>)) {
        while let Some(i) = memchr(b'\n', chunk) {
            let piece = &chunk[..i];
            if self.overflow {
                self.oversized += 1;
                self.overflow = false;
                self.line.clear();
            } else if self.line.is_empty() {
                // The same bound whether or not the line arrived in one piece.
                if piece.len() > self.max_line_bytes {
                    self.oversized += 1;
                } else {
                    emit(piece, &mut on_event);
                }
            } else {
                self.append(piece);
                if self.overflow {
                    self.oversized += 1;
                    self.overflow = false;
                } else {
                    emit(&self.line, &mut on_event);
                }
                self.line.clear();
            }
            chunk = &chunk[i + 1..];
        }
        self.append(chunk);
    }

    /// The stream ended: a last line without its newline is still a value (Ollama ends
    /// with one).
    pub fn finish(&mut self, mut on_event: impl FnMut(Event<'_>)) {
        if !self.overflow && !self.line.is_empty() {
            emit(&self.line, &mut on_event);
        }
        self.line.clear();
        self.overflow = false;
    }

    pub fn oversized_events(&self) -> u64 {
        self.oversized
    }

    fn append(&mut self, piece: &[u8]) {
        if self.overflow || piece.is_empty() {
            return;
        }
        if self.line.len() + piece.len() > self.max_line_bytes {
            self.overflow = true;
            self.line.clear();
        } else {
            self.line.extend_from_slice(piece);
        }
    }
}

fn emit(line: &[u8], on_event: &mut impl FnMut(Event<'_>)) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().any(|b| !b.is_ascii_whitespace()) {
        on_event(Event {
            name: b"",
            data: line,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_anywhere() {
        let input = b"{\"a\":1}\r\n\n{\"b\":\"\xC3\xA9\"}\n  \n{\"c\":3}";
        let want: Vec<Vec<u8>> = vec![
            b"{\"a\":1}".to_vec(),
            b"{\"b\":\"\xC3\xA9\"}".to_vec(),
            b"{\"c\":3}".to_vec(),
        ];
        for cut in 0..=input.len() {
            let mut p = NdjsonParser::new(1024);
            let mut got = Vec::new();
            p.push(&input[..cut], |e| got.push(e.data.to_vec()));
            p.push(&input[cut..], |e| got.push(e.data.to_vec()));
            p.finish(|e| got.push(e.data.to_vec()));
            assert_eq!(got, want, "cut at {cut}");
        }
    }

    #[test]
    fn long_lines_are_skipped() {
        let mut p = NdjsonParser::new(8);
        let mut got = Vec::new();
        for piece in [&b"{\"x\":\"0123456789\"}\n{\"y\""[..], b":1}\n"] {
            p.push(piece, |e| got.push(e.data.to_vec()));
        }
        assert_eq!(got, vec![b"{\"y\":1}".to_vec()]);
        assert_eq!(p.oversized_events(), 1);
    }
}
