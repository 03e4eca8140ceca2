//! Text from a peer, bounded before it is echoed in an answer, a log line or a record: one
//! helper for every side, by bytes (the bounds are byte bounds) on a character boundary.

/// Marks text that was cut.
pub const ELLIPSIS: &str = "…";

/// `text`, at most `max` bytes: cut on a character boundary and ended with [`ELLIPSIS`]
/// (within the bound) when it was longer.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max.saturating_sub(ELLIPSIS.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + ELLIPSIS.len());
    out.push_str(&text[..end]);
    if max >= ELLIPSIS.len() {
        out.push_str(ELLIPSIS);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_by_bytes_on_a_character_boundary() {
        assert_eq!(bounded("short", 16), "short");
        let long = "é".repeat(100); // 200 bytes
        let cut = bounded(&long, 10);
        assert!(cut.len() <= 10 && cut.ends_with(ELLIPSIS), "{cut:?}");
        assert_eq!(cut, "ééé…", "three whole characters (6 bytes) and the marker (3)");
        assert_eq!(bounded("abcdef", 2), "", "no room for the marker");
        assert!(bounded(&"x".repeat(2 << 20), 1024).len() <= 1024);
    }
}
