//! Text from a peer, bounded before it is echoed in an answer, a log line or a record: the
//! helpers for every side, by bytes (the bounds are byte bounds) on a character boundary.
//! [`bounded`] marks a cut with [`ELLIPSIS`]; [`prefix`] and [`truncate`] cut silently (for
//! fields whose bound a contract states).

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

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
pub fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Cuts `text` in place to [`prefix`]`(text, max)`.
pub fn truncate(text: &mut String, max: usize) {
    let end = prefix(text, max).len();
    text.truncate(end);
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

    #[test]
    fn prefixes_cut_silently_on_a_character_boundary() {
        assert_eq!(prefix("héllo", 2), "h", "'é' is two bytes: not cut in half");
        assert_eq!(prefix("héllo", 3), "hé");
        assert_eq!(prefix("short", 16), "short");
        let mut text = "ééé".to_owned();
        truncate(&mut text, 5);
        assert_eq!(text, "éé");
        truncate(&mut text, 0);
        assert_eq!(text, "");
    }
}
