//! The shapes of a stream's chunks. A server's chunks repeat a few shapes: the same keys
//! in the same order, the same values where the facts are read (the choice's index, its
//! finish reason, `usage`), and only the rest differing: the id, the model, the time, the
//! delta's text. A chunk the scan read is cut into its literal bytes and those values (its
//! *holes*); the next chunk of that shape is read by comparing bytes and skipping over
//! its holes, with no search for keys.
//!
//! A stream's chunks mostly differ in their text and little else (its id, model and time
//! repeat), so a shape also keeps the last chunk it read, and where its holes were: the
//! next chunk is compared with it in one pass, and read from the first hole where the two
//! part. What the holes before it held is what they held in the last chunk.
//!
//! Exact: a chunk that matches a shape is the scanned one with other strings or numbers
//! in the holes. The parser ignores a hole's value (its key is not one it reads) or, for a
//! token text, reads only whether it is empty, which the match reads too. Keys are
//! compared as bytes; a key with an escape (which could spell a key the parser reads) is
//! never made a shape.
//!
//! A whole non-streamed reply has shapes too ([`body_facts`], a cache of their own): its
//! id, time, message and every value the walk skips are holes, and so are its usage's
//! counts, read as the walk reads them (plain digits up to `MAX_COUNT`). Bodies part from
//! the last one early (their ids), so a body is mostly read run by run: a compare of each
//! literal run and a jump over each hole, not a walk over every key.

use std::cell::RefCell;

use super::body::count_at;
use super::bytes::{common_prefix, number_len, same_bytes};
use super::{string_end, Facts};

/// Keys whose values the parser or the scan reads: kept literal (but a token text).
const READ: [&[u8]; 19] = [
    b"choices",
    b"usage",
    b"error",
    b"delta",
    b"text",
    b"finish_reason",
    b"content",
    b"reasoning_content",
    b"reasoning",
    b"refusal",
    b"tool_calls",
    b"completion_tokens",
    b"prompt_tokens",
    b"cached_tokens",
    b"function",
    b"name",
    b"arguments",
    b"index",
    b"message",
];

/// The delta's strings that carry a token when not empty.
const DELTA_TEXT: [&[u8]; 4] = [b"content", b"reasoning_content", b"reasoning", b"refusal"];

/// Shapes kept per worker thread, the one last found twice in a row first.
const CACHED: usize = 4;

/// Misses in a row after which a chunk is made a shape only now and then (a server whose
/// every chunk differs in a literal would otherwise pay for a shape per chunk).
const LEARN_FREELY: u32 = 8;
const LEARN_EVERY: u32 = 64;

/// Nesting a shape may have.
const MAX_DEPTH: usize = 8;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Hole {
    /// A string the parser does not read.
    Str,
    /// A number the parser does not read.
    Num,
    /// A token text: a string, a token when not empty.
    Text,
    /// A body's usage count, read as the walk reads it.
    Count(Count),
    /// The end of the chunk.
    End,
}

/// Which of a body's usage counts a [`Hole::Count`] is.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Count {
    Completion,
    Prompt,
    Cached,
}

/// A chunk's (or a body's) literal bytes, cut at its holes.
#[derive(Debug)]
struct Shape {
    literal: Box<[u8]>,
    /// Each literal run's end in `literal`, and the hole after it.
    runs: Box<[(u32, Hole)]>,
    /// A whole body's shape (else a stream's chunk's): its tokens are counted, one a
    /// choice's text, not one at most.
    body: bool,
    /// The facts its literal bytes hold: a chunk's finish reason; every fact of the body
    /// it was learned from (its finish, error, whether it had usage only, a count held
    /// literal as `null`). A match's tokens, and its counts where they are holes, are read
    /// into them.
    fixed: Facts,
    /// Which of a body's counts are holes ([`Count`] as the index).
    count_holes: [bool; 3],
    /// The last chunk this shape read (empty when there is none, or it was long).
    last: Vec<u8>,
    /// Where each hole of `last` ended, and the tokens it and the holes before it carried.
    holes: Vec<Filled>,
    /// The counts' holes as they were last read ([`Count`] as the index): each is in a
    /// body once, and a read that fails leaves no `last`, so the next is read whole.
    counts: [u64; 3],
}

/// A hole as the last chunk filled it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Filled {
    end: u32,
    /// The tokens this hole and those before it carried: a read that starts past them
    /// takes their sum at once.
    tokens: u32,
}

/// The most holes, and literal bytes, a body's shape may have: a reply with a long list
/// (logprobs, many tool calls) is seldom alike the next, and its shape would keep ~24
/// bytes a hole on top of its literal bytes, per worker thread.
const BODY_HOLES: usize = 64;
const BODY_LITERAL: usize = 4096;

/// The longest chunk a shape keeps to compare the next with.
const MAX_LAST: usize = 1024;

struct Cache {
    shapes: Vec<Shape>,
    misses: u32,
    /// Where the last read that found a shape found it.
    hit: usize,
}

thread_local! {
    static CACHE: RefCell<Cache> = const {
        RefCell::new(Cache {
            shapes: Vec::new(),
            misses: 0,
            hit: 0,
        })
    };
    static BODIES: RefCell<Cache> = const {
        RefCell::new(Cache {
            shapes: Vec::new(),
            misses: 0,
            hit: 0,
        })
    };
}

/// The facts of chunk `data` (trimmed, an object): from a shape this thread has seen,
/// else from `scan`, whose chunk then becomes a shape.
pub fn facts(data: &[u8], scan: impl FnOnce(&[u8]) -> Option<Facts>) -> Option<Facts> {
    cached(&CACHE, false, data, scan)
}

/// The facts of a whole non-streamed reply `data` (without the spaces around it): from a
/// body's shape this thread has seen, else from `walk`, whose body then becomes a shape.
pub fn body_facts(data: &[u8], walk: impl FnOnce(&[u8]) -> Option<Facts>) -> Option<Facts> {
    cached(&BODIES, true, data, walk)
}

fn cached(
    cache: &'static std::thread::LocalKey<RefCell<Cache>>,
    body: bool,
    data: &[u8],
    scan: impl FnOnce(&[u8]) -> Option<Facts>,
) -> Option<Facts> {
    cache.with(|cache| {
        let Ok(mut c) = cache.try_borrow_mut() else {
            return scan(data);
        };
        for i in 0..c.shapes.len() {
            if let Some(f) = c.shapes[i].read(data) {
                // A shape comes first when it is found twice in a row: a stream's last
                // chunk (its finish reason, its usage) has a shape of its own, which would
                // otherwise be tried first on the next stream's every first chunk.
                c.hit = match (i, c.hit == i) {
                    (0, _) | (_, false) => i,
                    (_, true) => {
                        c.shapes.swap(0, i);
                        0
                    }
                };
                c.misses = 0;
                return Some(f);
            }
        }
        let facts = scan(data)?;
        c.misses = c.misses.saturating_add(1);
        if c.misses <= LEARN_FREELY || c.misses % LEARN_EVERY == 0 {
            if let Some(shape) = Shape::learn(data, facts, body) {
                if c.shapes.len() == CACHED {
                    c.shapes.pop();
                }
                c.shapes.insert(0, shape);
                c.hit = 0;
            }
        }
        Some(facts)
    })
}

// === impl Shape ===

impl Shape {
    /// The shape of `data`, whose facts the scan (or, for a `body`, the walk) found to be
    /// `facts`; `None` when it has nothing a shape can hold (spaces, escaped keys, deep
    /// nesting, a body's `delta`, a body too large to keep).
    fn learn(data: &[u8], facts: Facts, body: bool) -> Option<Shape> {
        let mut l = Learner {
            data,
            at: 0,
            holes: Vec::new(),
            body,
        };
        l.value(Place::Top, Role::Literal, 0)?;
        if l.at != data.len() || (body && l.holes.len() > BODY_HOLES) {
            return None;
        }
        let mut literal = Vec::with_capacity(data.len());
        let mut runs = Vec::with_capacity(l.holes.len() + 1);
        let mut from = 0;
        for (start, end, hole) in l.holes {
            literal.extend_from_slice(&data[from..start]);
            runs.push((u32::try_from(literal.len()).ok()?, hole));
            from = end;
        }
        literal.extend_from_slice(&data[from..]);
        runs.push((u32::try_from(literal.len()).ok()?, Hole::End));
        if body && literal.len() > BODY_LITERAL {
            return None;
        }
        let holes = vec![Filled::default(); runs.len()];
        let fixed = match body {
            true => facts,
            false => Facts {
                finished: facts.finished,
                ..Facts::default()
            },
        };
        let mut count_holes = [false; 3];
        for (_, hole) in &runs {
            if let Hole::Count(c) = hole {
                count_holes[*c as usize] = true;
            }
        }
        let mut shape = Shape {
            literal: literal.into(),
            runs: runs.into(),
            body,
            fixed,
            count_holes,
            last: Vec::new(),
            holes,
            counts: [0; 3],
        };
        // Everything the facts say must come from where the shape reads them.
        (shape.read(data) == Some(facts)).then_some(shape)
    }

    /// The facts of `data` if it has this shape; `data` becomes the last chunk read.
    fn read(&mut self, data: &[u8]) -> Option<Facts> {
        // The holes wholly inside the part `data` shares with the last chunk (a number's
        // end too, which the byte after it decides) hold what they held there.
        let same = common_prefix(data, &self.last);
        let skip = self
            .holes
            .iter()
            .take_while(|h| (h.end as usize) < same)
            .count()
            .min(self.runs.len() - 1);
        let facts = match self.one_hole(data, same, skip) {
            Some(facts) => Some(facts),
            None => {
                let (at, from, tokens) = match skip.checked_sub(1) {
                    Some(before) => (
                        self.holes[before].end as usize,
                        self.runs[before].0 as usize,
                        self.holes[before].tokens,
                    ),
                    None => (0, 0, 0),
                };
                self.read_from(data, skip, at, from, tokens)
            }
        };
        self.last.clear();
        if facts.is_some() && data.len() <= MAX_LAST {
            self.last.extend_from_slice(data);
        }
        facts
    }

    /// A stream's chunk that differs from the last in one hole alone (its text, or its time
    /// stamp), read from that hole: `same` bytes begin both alike, hole `i` is the first
    /// not wholly inside them, and the bytes after it are the last chunk's after it. Each
    /// later literal run and hole is then the last chunk's, shifted, and reads as it read
    /// there; only hole `i` is read. `None` where that does not hold (or for a body, whose
    /// counts are read hole by hole): the chunk is read run by run.
    fn one_hole(&mut self, data: &[u8], same: usize, i: usize) -> Option<Facts> {
        let hole = self.runs.get(i).map(|r| r.1)?;
        if self.body || self.last.is_empty() || matches!(hole, Hole::End | Hole::Count(_)) {
            return None;
        }
        let (before_end, before_tokens) = match i.checked_sub(1) {
            Some(b) => (self.holes[b].end as usize, self.holes[b].tokens),
            None => (0, 0),
        };
        let run_start = i.checked_sub(1).map_or(0, |b| self.runs[b].0 as usize);
        let start = before_end + (self.runs[i].0 as usize - run_start);
        let old_end = self.holes[i].end as usize;
        // Where the hole ends in `data`, the bytes after it being the last chunk's.
        let end = (old_end + data.len()).checked_sub(self.last.len())?;
        if same < start || end <= start || !same_bytes(&data[end..], &self.last[old_end..]) {
            return None;
        }
        let read_end = match hole {
            Hole::Num => start + number_len(&data[start..])?,
            Hole::Str | Hole::Text if data[start] == b'"' => string_end(data, start)?,
            _ => return None,
        };
        if read_end != end {
            return None;
        }
        // The tokens of the holes from `i` on change by what hole `i` now carries.
        let was = self.holes[i].tokens - before_tokens;
        let now = u32::from(hole == Hole::Text && end - start > 2);
        let holes = self.runs.len() - 1;
        for h in &mut self.holes[i..holes] {
            // Each moves as hole `i`'s end moved (`h.end ≥ old_end`).
            h.end = u32::try_from(h.end as usize + end - old_end).ok()?;
            h.tokens = h.tokens - was + now;
        }
        Some(self.facts(self.holes[holes - 1].tokens))
    }

    /// [`Shape::read`] from run `first` on, at `at` in `data` and `from` in the literal,
    /// with the `tokens` the holes before it carried; the holes' places (and counts) are
    /// kept as it goes.
    fn read_from(
        &mut self,
        data: &[u8],
        first: usize,
        mut at: usize,
        mut from: usize,
        mut tokens: u32,
    ) -> Option<Facts> {
        for (i, &(end, hole)) in self.runs.iter().enumerate().skip(first) {
            let run = &self.literal[from..end as usize];
            if !same_bytes(data.get(at..at + run.len())?, run) {
                return None;
            }
            at += run.len();
            from = end as usize;
            let start = at;
            match hole {
                Hole::End => return (at == data.len()).then(|| self.facts(tokens)),
                Hole::Num => at += number_len(&data[at..])?,
                Hole::Str | Hole::Text => {
                    if data.get(at) != Some(&b'"') {
                        return None;
                    }
                    at = string_end(data, at)?;
                }
                Hole::Count(c) => {
                    let (n, len) = count_at(&data[at..])?;
                    self.counts[c as usize] = n;
                    at += len;
                }
            }
            tokens += u32::from(hole == Hole::Text && at - start > 2);
            self.holes[i] = Filled {
                end: u32::try_from(at).ok()?,
                tokens,
            };
        }
        None
    }

    /// The facts of a match whose holes carried `tokens` (and its counts, in `counts`).
    fn facts(&self, tokens: u32) -> Facts {
        let mut facts = self.fixed;
        if !self.body {
            facts.tokens = u32::from(tokens > 0);
            return facts;
        }
        facts.tokens = tokens;
        let count = |c: Count, fixed| match self.count_holes[c as usize] {
            true => Some(self.counts[c as usize]),
            false => fixed,
        };
        facts.exact_total = count(Count::Completion, facts.exact_total);
        facts.input_tokens = count(Count::Prompt, facts.input_tokens);
        facts.cached_input_tokens = count(Count::Cached, facts.cached_input_tokens);
        facts
    }
}

/// Where an object is, for what its members mean.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Top,
    /// The `choices` array.
    Choices,
    Choice,
    Delta,
    /// A body's `usage` object.
    Usage,
    /// A body's `usage.prompt_tokens_details`.
    Details,
    Other,
}

/// What a value may become.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Literal,
    /// The value of a key the parser does not read (in a body, every value the walk does
    /// not read, an array's elements too).
    Free,
    Text,
    /// A body's usage count.
    Count(Count),
}

struct Learner<'a> {
    data: &'a [u8],
    at: usize,
    holes: Vec<(usize, usize, Hole)>,
    /// A whole body's shape: only what the walk reads is literal.
    body: bool,
}

impl Learner<'_> {
    fn value(&mut self, place: Place, role: Role, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match *self.data.get(self.at)? {
            b'{' => self.object(place, depth),
            b'[' => self.array(place, depth),
            b'"' => {
                let start = self.at;
                self.at = string_end(self.data, start)?;
                match role {
                    Role::Free => self.holes.push((start, self.at, Hole::Str)),
                    Role::Text => self.holes.push((start, self.at, Hole::Text)),
                    Role::Literal | Role::Count(_) => {}
                }
                Some(())
            }
            b'-' | b'0'..=b'9' => {
                let start = self.at;
                self.at += number_len(&self.data[start..])?;
                match role {
                    Role::Free => self.holes.push((start, self.at, Hole::Num)),
                    Role::Count(c) => self.holes.push((start, self.at, Hole::Count(c))),
                    Role::Literal | Role::Text => {}
                }
                Some(())
            }
            _ => {
                let word = [&b"null"[..], b"true", b"false"]
                    .into_iter()
                    .find(|w| self.data[self.at..].starts_with(w))?;
                self.at += word.len();
                Some(())
            }
        }
    }

    fn object(&mut self, place: Place, depth: usize) -> Option<()> {
        self.at += 1;
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            if self.data.get(self.at) != Some(&b'"') {
                return None;
            }
            let start = self.at;
            self.at = string_end(self.data, start)?;
            let key = &self.data[start + 1..self.at - 1];
            if key.contains(&b'\\') || !self.eat(b':') {
                return None;
            }
            let (child, role) = match self.body {
                true => body_member(place, key)?,
                false => chunk_member(place, key),
            };
            // A text that is not a string (null), or a count that is not a number, stays
            // literal.
            let role = match (role, self.data.get(self.at)) {
                (Role::Text, Some(b'"')) => Role::Text,
                (Role::Count(c), Some(b'0'..=b'9')) => Role::Count(c),
                (Role::Text | Role::Count(_), _) => Role::Literal,
                (r, _) => r,
            };
            self.value(child, role, depth + 1)?;
            if self.eat(b'}') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    fn array(&mut self, place: Place, depth: usize) -> Option<()> {
        self.at += 1;
        if self.eat(b']') {
            return Some(());
        }
        let element = if place == Place::Choices {
            Place::Choice
        } else {
            Place::Other
        };
        // In a body, an array the walk does not read holds free values too.
        let role = match self.body && place != Place::Choices {
            true => Role::Free,
            false => Role::Literal,
        };
        loop {
            // A choice is an object (the scan reads no other).
            if place == Place::Choices && self.data.get(self.at) != Some(&b'{') {
                return None;
            }
            self.value(element, role, depth + 1)?;
            if self.eat(b']') {
                return Some(());
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    fn eat(&mut self, b: u8) -> bool {
        let ate = self.data.get(self.at) == Some(&b);
        self.at += usize::from(ate);
        ate
    }
}

/// What a chunk's member `key` at `place` holds, and where its value is.
fn chunk_member(place: Place, key: &[u8]) -> (Place, Role) {
    match place {
        Place::Top if key == b"choices" => (Place::Choices, Role::Literal),
        Place::Choice if key == b"delta" => (Place::Delta, Role::Literal),
        Place::Choice if key == b"text" => (Place::Other, Role::Text),
        Place::Delta if DELTA_TEXT.contains(&key) => (Place::Other, Role::Text),
        _ if READ.contains(&key) => (Place::Other, Role::Literal),
        _ => (Place::Other, Role::Free),
    }
}

/// What a body's member `key` at `place` holds, as the walk reads it: its choices' texts
/// and finish reasons, its usage's counts and its error; everything else is free, nested
/// or not (a message, its content, its tool calls). `None` for a streamed `delta`, which
/// the walk leaves to the parser.
fn body_member(place: Place, key: &[u8]) -> Option<(Place, Role)> {
    Some(match (place, key) {
        (Place::Top, b"choices") => (Place::Choices, Role::Literal),
        (Place::Top, b"usage") => (Place::Usage, Role::Literal),
        (Place::Top, b"error") => (Place::Other, Role::Literal),
        (Place::Choice, b"text") => (Place::Other, Role::Text),
        (Place::Choice, b"finish_reason") => (Place::Other, Role::Literal),
        (Place::Choice, b"delta") => return None,
        (Place::Usage, b"completion_tokens") => (Place::Other, Role::Count(Count::Completion)),
        (Place::Usage, b"prompt_tokens") => (Place::Other, Role::Count(Count::Prompt)),
        (Place::Usage, b"prompt_tokens_details") => (Place::Details, Role::Literal),
        (Place::Details, b"cached_tokens") => (Place::Other, Role::Count(Count::Cached)),
        _ => (Place::Other, Role::Free),
    })
}

#[cfg(test)]
mod tests {
    use super::super::super::Chunk;
    use super::super::event_scanned;
    use super::*;

    const CHUNK: &str = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}],"t":17}"#;

    fn shape_of(chunk: &str) -> Shape {
        Shape::learn(
            chunk.as_bytes(),
            event_scanned(chunk.as_bytes()).unwrap(),
            false,
        )
        .unwrap()
    }

    #[test]
    fn a_stream_s_chunks_are_read_from_their_shape() {
        let mut shape = shape_of(CHUNK);
        assert_eq!(shape.runs.len(), 7, "{shape:?}"); // id, object, created, model, text, t, end
        let token = Some(Facts {
            tokens: 1,
            ..Facts::default()
        });
        let other = CHUNK
            .replace("chatcmpl-1", "chatcmpl-22")
            .replace("\"Hi\"", r#"" the \"end\": {}""#)
            .replace("17}", "-1.5e3}");
        assert_eq!(shape.read(other.as_bytes()), token);
        let empty = CHUNK.replace("\"Hi\"", "\"\"");
        assert_eq!(shape.read(empty.as_bytes()), Some(Facts::default()));
        // What the facts are read from is literal: another finish reason, index or usage is
        // another shape.
        for changed in [
            CHUNK.replace("\"finish_reason\":null", "\"finish_reason\":\"stop\""),
            CHUNK.replace("\"index\":0", "\"index\":1"),
            CHUNK.replace("\"t\":17", "\"usage\":{}"),
            CHUNK.replace("\"created\":1700000000", "\"created\":\"x\""),
            CHUNK.replace("\"Hi\"", "null"),
            CHUNK.replace("}],", "},{\"index\":1}],"),
        ] {
            assert_eq!(shape.read(changed.as_bytes()), None, "{changed}");
        }
        // An escaped key could spell one the parser reads: no shape.
        let escaped = CHUNK.replace("\"t\":", "\"\\u0074\":");
        assert!(Shape::learn(
            escaped.as_bytes(),
            event_scanned(escaped.as_bytes()).unwrap(),
            false
        )
        .is_none());
    }

    /// Chunks made from the seeds by rewriting their strings and numbers: wherever a
    /// seed's shape answers and the parser reads the chunk, both say the same.
    #[test]
    fn shapes_agree_with_the_parser_on_rewritten_values() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let seeds = [
            CHUNK,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"stop"}],"usage":null}"#,
            r#"{"id":"c","choices":[{"index":0,"text":"w","finish_reason":null,"stop_reason":null}],"created":3}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"r","role":"a"},"finish_reason":null}],"x":[1,"y",{"z":2.5}]}"#,
        ];
        let mut shapes: Vec<Shape> = seeds.iter().map(|s| shape_of(s)).collect();
        let pieces = [
            "",
            "x",
            "\\\"",
            "\\\\",
            "\"",
            ":",
            ",",
            "}",
            "]",
            " ",
            "\\u0041",
            "0",
            "-",
            ".",
            "e",
            "\"choices\":[",
            "\"finish_reason\":\"stop\"",
        ];
        let mut rng = StdRng::seed_from_u64(27);
        let (mut compared, mut hits) = (0, 0);
        for _ in 0..60_000 {
            let i = rng.gen_range(0..seeds.len());
            let c = rewritten(&mut rng, seeds[i], &pieces);
            // Read after the last chunk this shape read, as read afresh.
            let f = shapes[i].read(&c);
            assert_eq!(f, afresh(&shapes[i], &c), "{}", String::from_utf8_lossy(&c));
            let Some(f) = f else {
                continue;
            };
            hits += 1;
            if let Ok(chunk) = serde_json::from_slice::<Chunk>(&c) {
                compared += 1;
                assert_eq!(f, chunk.facts(), "{}", String::from_utf8_lossy(&c));
            }
            if let Some(scanned) = event_scanned(&c) {
                assert_eq!(f, scanned, "{}", String::from_utf8_lossy(&c));
            }
        }
        assert!(compared > 2_000 && hits >= compared, "{compared} {hits}");
    }

    /// `seed` with one or two of `pieces` put somewhere after a quote, a colon or a digit
    /// (inside or at the edge of a value), over up to two of its bytes.
    fn rewritten(rng: &mut rand::rngs::StdRng, seed: &str, pieces: &[&str]) -> Vec<u8> {
        use rand::Rng;
        let mut c = seed.as_bytes().to_vec();
        for _ in 0..rng.gen_range(1..3) {
            let marks: Vec<usize> = (0..c.len())
                .filter(|&j| matches!(c[j], b'"' | b':' | b'0'..=b'9'))
                .collect();
            let at = marks[rng.gen_range(0..marks.len())] + 1;
            let to = (at + rng.gen_range(0..3)).min(c.len());
            let p = pieces[rng.gen_range(0..pieces.len())];
            c.splice(at..to, p.bytes());
        }
        c
    }

    /// What `shape` reads of `data` with no last chunk to compare it with; where it reads
    /// it, the holes it found are `shape`'s (read from where `data` parts from its last
    /// chunk, or from one hole).
    fn afresh(shape: &Shape, data: &[u8]) -> Option<Facts> {
        let mut fresh = Shape {
            literal: shape.literal.clone(),
            runs: shape.runs.clone(),
            body: shape.body,
            fixed: shape.fixed,
            count_holes: shape.count_holes,
            last: Vec::new(),
            holes: vec![Filled::default(); shape.runs.len()],
            counts: [0; 3],
        };
        let facts = fresh.read(data);
        if facts.is_some() && !shape.last.is_empty() {
            let n = shape.runs.len() - 1;
            assert_eq!(shape.holes[..n], fresh.holes[..n], "holes after a read");
        }
        facts
    }

    /// A chunk read after another is read from where they part: a token's text, a number
    /// grown by a digit at the end of the shared part, a string that ends where the last
    /// one's did not, an empty text after a full one and back.
    #[test]
    fn a_chunk_is_read_from_where_it_parts_from_the_last() {
        let mut shape = shape_of(CHUNK);
        let token = |tokens| Facts {
            tokens,
            ..Facts::default()
        };
        let steps = [
            (CHUNK.to_owned(), Some(token(1))),
            (CHUNK.replace("\"Hi\"", "\"Hi there\""), Some(token(1))),
            (CHUNK.replace("\"Hi\"", "\"\""), Some(token(0))),
            (CHUNK.replace("\"Hi\"", "\"\""), Some(token(0))),
            (CHUNK.replace("\"t\":17", "\"t\":175"), Some(token(1))),
            (CHUNK.replace("\"t\":17", "\"t\":17.5"), Some(token(1))),
            (CHUNK.replace("\"t\":17", "\"t\":1"), Some(token(1))),
            (CHUNK.replace("\"t\":17", "\"t\":1x"), None),
            (
                CHUNK.replace("chatcmpl-1", "chatcmpl-1\\\""),
                Some(token(1)),
            ),
            (CHUNK.replace("\"m\"", "\"mm\""), Some(token(1))),
            (CHUNK.replace("\"Hi\"", "\"H\""), Some(token(1))),
            // One hole changed where the bytes after it are not the last chunk's, or
            // where it no longer reads as its kind.
            (
                CHUNK
                    .replace("\"Hi\"", "\"Ho\"")
                    .replace("\"t\":17", "\"t\":18"),
                Some(token(1)),
            ),
            (CHUNK.to_owned(), Some(token(1))),
            (
                CHUNK
                    .replace("\"Hi\"", "\"Ho\"")
                    .replace("null}]", "nill}]"),
                None,
            ),
            (CHUNK.replace("\"Hi\"", "\"H\\\"i\""), Some(token(1))),
            (CHUNK.replace("\"Hi\"", "\"H\"i\""), None),
            (CHUNK.replace("\"Hi\"", "5"), None),
            (CHUNK.replace("\"t\":17", "\"t\":1."), None),
            (CHUNK.replace("\"t\":17", "\"t\":\"17\""), None),
            (
                CHUNK.replace("\"finish_reason\":null", "\"finish_reason\":\"stop\""),
                None,
            ),
            (CHUNK.to_owned(), Some(token(1))),
            (CHUNK.replace("\"Hi\"", "\"\""), Some(token(0))),
            (
                CHUNK
                    .replace("\"Hi\"", "\"\"")
                    .replace("\"t\":17", "\"t\":18"),
                Some(token(0)),
            ),
            (CHUNK.replace("\"t\":17", "\"t\":18"), Some(token(1))),
            (CHUNK.to_owned() + " ", None),
            (CHUNK[..CHUNK.len() - 1].to_owned(), None),
            (CHUNK.to_owned(), Some(token(1))),
        ];
        for (chunk, want) in steps {
            assert_eq!(shape.read(chunk.as_bytes()), want, "{chunk}");
            assert_eq!(afresh(&shape, chunk.as_bytes()), want, "{chunk}");
        }
    }

    const BODY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1733000000,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there","refusal":null,"tool_calls":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}},"system_fingerprint":null}"#;

    fn walk(b: &str) -> Option<Facts> {
        super::super::body::body(b.as_bytes())
    }

    fn body_shape_of(b: &str) -> Shape {
        Shape::learn(b.as_bytes(), walk(b).unwrap(), true).unwrap()
    }

    /// A body's id, time, message and the counts of its usage are holes: another reply
    /// of the server is read from the shape, its counts as the walk reads them; what the
    /// walk reads literally (a finish reason, an error, a count's `null`) is the shape's.
    #[test]
    fn a_body_is_read_from_its_shape() {
        let mut shape = body_shape_of(BODY);
        let counts = |completion, prompt, cached| {
            Some(Facts {
                exact_total: Some(completion),
                input_tokens: Some(prompt),
                cached_input_tokens: Some(cached),
                finished: true,
                ..Facts::default()
            })
        };
        assert_eq!(shape.read(BODY.as_bytes()), counts(2, 12, 8));
        let other = BODY
            .replace("chatcmpl-1", "chatcmpl-987")
            .replace("1733000000", "1733000123")
            .replace(
                "Hello there",
                r#"A longer \"reply\", with {braces} and [brackets]"#,
            )
            .replace("\"prompt_tokens\":12", "\"prompt_tokens\":4096")
            .replace("\"completion_tokens\":2", "\"completion_tokens\":0")
            .replace("\"total_tokens\":14", "\"total_tokens\":4096.5")
            .replace("\"cached_tokens\":8", "\"cached_tokens\":4294967296");
        assert_eq!(shape.read(other.as_bytes()), counts(0, 4096, 1 << 32));
        assert_eq!(shape.read(other.as_bytes()), walk(&other));
        // Counts the walk does not read as counts, and changed literals, are not the shape.
        for changed in [
            BODY.replace("\"completion_tokens\":2", "\"completion_tokens\":02"),
            BODY.replace("\"completion_tokens\":2", "\"completion_tokens\":2.0"),
            BODY.replace("\"completion_tokens\":2", "\"completion_tokens\":2e1"),
            BODY.replace("\"completion_tokens\":2", "\"completion_tokens\":-2"),
            BODY.replace("\"completion_tokens\":2", "\"completion_tokens\":null"),
            BODY.replace("\"prompt_tokens\":12", "\"prompt_tokens\":4294967297"),
            BODY.replace("\"cached_tokens\":8", "\"cached_tokens\":12345678901"),
            // 2^64 + 1, which a fold of all its digits would wrap to 1.
            BODY.replace(
                "\"completion_tokens\":2",
                "\"completion_tokens\":18446744073709551617",
            ),
            BODY.replace("\"finish_reason\":\"stop\"", "\"finish_reason\":\"length\""),
            BODY.replace("\"finish_reason\":\"stop\"", "\"finish_reason\":null"),
            BODY.replace(
                "\"system_fingerprint\":null",
                "\"system_fingerprint\":\"fp\"",
            ),
            BODY.replace("\"tool_calls\":[]", "\"tool_calls\":[{}]"),
            BODY.replace("}],\"usage\"", "},{\"index\":1}],\"usage\""),
            BODY.to_owned() + " ",
        ] {
            assert_eq!(shape.read(changed.as_bytes()), None, "{changed}");
        }
        // A completion's texts: a token each when not empty.
        let completion = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length"},{"index":1,"text":"","finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":16,"total_tokens":19}}"#;
        let mut shape = body_shape_of(completion);
        for (a, b) in [("\"\"", "\"x\""), ("\" world\"", "\"\"")] {
            let other = completion.replace(a, b);
            assert_eq!(shape.read(other.as_bytes()), walk(&other), "{other}");
        }
        // A long list (logprobs) makes no shape: it is seldom alike the next.
        let entries = |n| {
            let e = r#"{"token":"x","logprob":-0.1,"bytes":[120],"top_logprobs":[]}"#;
            vec![e; n].join(",")
        };
        for (n, kept) in [(15, true), (40, false)] {
            let long = BODY.replace(
                "\"logprobs\":null",
                &format!("\"logprobs\":{{\"content\":[{}]}}", entries(n)),
            );
            let learned = Shape::learn(long.as_bytes(), walk(&long).unwrap(), true);
            assert_eq!(learned.is_some(), kept, "{n} entries");
        }
        // A streamed delta in a body is the parser's: never a body's shape.
        let delta = r#"{"choices":[{"index":0,"delta":{"content":"x"}}]}"#;
        let facts = serde_json::from_slice::<Chunk>(delta.as_bytes())
            .unwrap()
            .facts();
        assert!(Shape::learn(delta.as_bytes(), facts, true).is_none());
    }

    /// Bodies made from the seeds by rewriting their strings and numbers: each is read
    /// after the one before it and afresh alike, and wherever the shape answers, the walk
    /// says the same (and the parser, where it reads the body).
    #[test]
    fn body_shapes_agree_with_the_walk_on_rewritten_values() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let seeds = [
            BODY,
            r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length"},{"index":1,"text":"","finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":16,"total_tokens":19}}"#,
            r#"{"choices":[{"index":0,"message":{"tool_calls":[{"id":"t","function":{"name":"f","arguments":"{\"a\":[1,2]}"}}]},"finish_reason":"tool_calls"}],"usage":null}"#,
            r#"{"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":9,"prompt_tokens_details":null}}"#,
            r#"{"error":{"message":"boom","code":500},"choices":[{"text":null}],"usage":{"completion_tokens":null,"prompt_tokens":0}}"#,
        ];
        let mut shapes: Vec<Shape> = seeds.iter().map(|s| body_shape_of(s)).collect();
        let pieces = [
            "",
            "x",
            "\\\"",
            "\\\\",
            "\"",
            ":",
            ",",
            "}",
            "]",
            " ",
            "\\u0041",
            "0",
            "00",
            "-",
            ".",
            "e",
            "9999999999",
            "null",
            "\"delta\":{}",
            "\"text\":\"x\"",
        ];
        let mut rng = StdRng::seed_from_u64(61);
        let (mut compared, mut hits) = (0, 0);
        for _ in 0..60_000 {
            let i = rng.gen_range(0..seeds.len());
            let c = rewritten(&mut rng, seeds[i], &pieces);
            let f = shapes[i].read(&c);
            assert_eq!(f, afresh(&shapes[i], &c), "{}", String::from_utf8_lossy(&c));
            let Some(f) = f else {
                continue;
            };
            hits += 1;
            assert_eq!(
                Some(f),
                super::super::body::body(&c),
                "{}",
                String::from_utf8_lossy(&c)
            );
            if let Ok(chunk) = serde_json::from_slice::<Chunk>(&c) {
                compared += 1;
                assert_eq!(f, chunk.facts(), "{}", String::from_utf8_lossy(&c));
            }
        }
        assert!(compared > 2_000 && hits >= compared, "{compared} {hits}");
    }
}
