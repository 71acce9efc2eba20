//! Byte-level reading for the shapes: how many bytes two chunks begin with alike, whether
//! two runs are the same bytes, and how long a JSON number is.

/// Whether `a` and `b` (of one length) are the same bytes: a literal run is mostly a few
/// bytes (`,"t":`, `}`), compared in a word or two rather than by a call to `bcmp`.
pub(super) fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    let word = |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().unwrap_or([0; 8]));
    let half = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().unwrap_or([0; 4]));
    match n {
        // The first and the last eight (or four) bytes, which overlap in between.
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        4..=7 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        _ => a == b,
    }
}

/// How many bytes `a` and `b` begin with alike: 32 at a time while they agree, then
/// eight at a time in a register to find where they part.
pub(super) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while let (Some(x), Some(y)) = (
        a.get(i..n).and_then(|s| s.first_chunk::<32>()),
        b.get(i..n).and_then(|s| s.first_chunk::<32>()),
    ) {
        if x != y {
            break;
        }
        i += 32;
    }
    while let (Some(x), Some(y)) = (
        a.get(i..n).and_then(|s| s.first_chunk::<8>()),
        b.get(i..n).and_then(|s| s.first_chunk::<8>()),
    ) {
        let differ = u64::from_le_bytes(*x) ^ u64::from_le_bytes(*y);
        if differ != 0 {
            return i + differ.trailing_zeros() as usize / 8;
        }
        i += 8;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// The length of the JSON number `data` starts with (RFC 8259 §6), `None` if it does not
/// start with one.
pub(super) fn number_len(data: &[u8]) -> Option<usize> {
    let digits = |from: usize| {
        data[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let mut i = usize::from(data.first() == Some(&b'-'));
    match data.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i += digits(i),
        _ => return None,
    }
    if data.get(i) == Some(&b'.') {
        let n = digits(i + 1);
        if n == 0 {
            return None;
        }
        i += 1 + n;
    }
    if matches!(data.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(data.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let n = digits(i);
        if n == 0 {
            return None;
        }
        i += n;
    }
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `same_bytes` is `==` at every length to 40 with any one byte changed.
    #[test]
    fn same_bytes_is_equality() {
        for len in 0..=40 {
            let a: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37)).collect();
            assert!(same_bytes(&a, &a.clone()), "{len}");
            for at in 0..len {
                for bit in 0..8 {
                    let mut b = a.clone();
                    b[at] ^= 1 << bit;
                    assert!(!same_bytes(&a, &b), "{len} {at} {bit}");
                }
            }
        }
    }

    #[test]
    fn common_prefixes() {
        let a = b"0123456789abcdefghij";
        for n in 0..=a.len() {
            for at in 0..n {
                let mut b = a[..n].to_vec();
                b[at] = b'#';
                assert_eq!(common_prefix(&a[..], &b), at);
                assert_eq!(common_prefix(&b, &a[..]), at);
            }
            assert_eq!(common_prefix(&a[..], &a[..n]), n);
        }
    }

    #[test]
    fn numbers_are_json_numbers() {
        for (s, n) in [
            ("0,", Some(1)),
            ("-12.5e+3}", Some(8)),
            ("01", Some(1)),
            ("1.}", None),
            ("-", None),
            ("1e", None),
            ("x", None),
        ] {
            assert_eq!(number_len(s.as_bytes()), n, "{s}");
        }
    }
}
