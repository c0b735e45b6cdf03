//! Text from elsewhere made safe to show on a terminal.
//!
//! A slot's tenant can make an agent log text it chooses (a user name, a path, an
//! `SSH_CONNECTION`). Written to a terminal as it is, an escape sequence in it could
//! recolour the screen, move the cursor over other lines, set the window title or worse;
//! a newline or carriage return could forge a log line. [`printable`] escapes all of them.

use std::borrow::Cow;
use std::fmt::Write;

/// `text` with every control character (C0, DEL, C1) and every bidirectional override
/// written as a visible escape (`\u{1b}`, `\n` as `\u{a}`), so it shows on one line, in
/// the order it was written, and a terminal acts on none of it.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(hidden) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A character a terminal acts on, or one that reorders the text around it.
fn hidden(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_kept_as_it_is() {
        assert!(matches!(
            printable("slot prepared user=sp1 ü"),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn escapes_newlines_and_bidi_overrides_are_made_visible() {
        assert_eq!(
            printable("a\x1b]0;owned\x07b\r\nc\u{9b}2J\u{202e}d\t"),
            "a\\u{1b}]0;owned\\u{7}b\\u{d}\\u{a}c\\u{9b}2J\\u{202e}d\\u{9}"
        );
    }
}
