//! What a job's output may do to the terminal that shows it: colour it, nothing more.
//!
//! A command in a node is someone else's code; its output reaches the terminal of
//! whoever runs `slotpool exec`. Escape sequences there can do more than colour text: set
//! the window title, write the clipboard (OSC 52), move the cursor to rewrite what was
//! shown, or make some terminals answer with bytes typed into the shell. When the
//! output goes to a terminal, [`TerminalText`] lets through text (UTF-8), tabs,
//! newlines, carriage returns and colour (SGR: `ESC [ digits ; … m`), and shows every
//! other control visibly instead: `^[` for ESC, `^X` for other C0 controls, `^?` for DEL,
//! `\u{9b}` for C1 controls, `\xHH` for bytes that are not UTF-8. Output to a pipe or a
//! file is never touched (`slotpool exec` is binary-safe there), nor with `--raw`.
//!
//! It works on a stream: a sequence or a character split across two chunks comes out
//! as if it had arrived whole.

/// The longest colour sequence let through; a longer one is shown, not obeyed.
const MAX_SGR: usize = 64;

/// A filter of one output stream (stdout or stderr) on its way to a terminal.
#[derive(Debug, Default)]
pub struct TerminalText {
    /// The unfinished sequence or character at the end of the last chunk.
    pending: Vec<u8>,
}

impl TerminalText {
    /// Filters `input` into `out`, keeping an unfinished tail for the next chunk.
    pub fn push(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(input);
        let used = scan(&buf, out, false);
        self.pending = buf[used..].to_vec();
    }

    /// Ends the stream: what is left unfinished is shown, not obeyed.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        let buf = std::mem::take(&mut self.pending);
        scan(&buf, out, true);
    }
}

/// `text` with every control shown (a message of slotpool's own that quotes a node's).
pub fn escape(text: &str) -> String {
    let mut filter = TerminalText::default();
    let mut out = Vec::new();
    filter.push(text.as_bytes(), &mut out);
    filter.finish(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Filters `buf` into `out`; returns how much of it was used (all of it when `last`).
fn scan(buf: &[u8], out: &mut Vec<u8>, last: bool) -> usize {
    let mut i = 0;
    while i < buf.len() {
        let b = buf[i];
        match b {
            b'\t' | b'\n' | b'\r' => {
                out.push(b);
                i += 1;
            }
            0x1b => match sgr_len(&buf[i..]) {
                Some(Some(n)) => {
                    out.extend_from_slice(&buf[i..i + n]);
                    i += n;
                }
                Some(None) if !last => return i,
                _ => {
                    out.extend_from_slice(b"^[");
                    i += 1;
                }
            },
            0x00..=0x1f => {
                out.extend_from_slice(&[b'^', b + 0x40]);
                i += 1;
            }
            0x7f => {
                out.extend_from_slice(b"^?");
                i += 1;
            }
            0x20..=0x7e => {
                out.push(b);
                i += 1;
            }
            _ => {
                let need = match b {
                    0xc2..=0xdf => 2,
                    0xe0..=0xef => 3,
                    0xf0..=0xf4 => 4,
                    _ => 0,
                };
                if need > 0 && buf.len() - i < need && !last {
                    // Unfinished unless what is there already cannot be UTF-8.
                    if std::str::from_utf8(&buf[i..])
                        .err()
                        .is_some_and(|e| e.error_len().is_none())
                    {
                        return i;
                    }
                }
                match (need > 0)
                    .then(|| buf.get(i..i + need))
                    .flatten()
                    .and_then(|s| std::str::from_utf8(s).ok())
                {
                    Some(s) => {
                        let c = s.chars().next().expect("one character");
                        if ('\u{80}'..='\u{9f}').contains(&c) {
                            out.extend_from_slice(format!("\\u{{{:x}}}", c as u32).as_bytes());
                        } else {
                            out.extend_from_slice(s.as_bytes());
                        }
                        i += need;
                    }
                    None => {
                        out.extend_from_slice(format!("\\x{b:02x}").as_bytes());
                        i += 1;
                    }
                }
            }
        }
    }
    i
}

/// At an ESC: `Some(Some(n))` when the next `n` bytes are a whole colour sequence,
/// `Some(None)` when they may still become one, `None` when they cannot.
fn sgr_len(at: &[u8]) -> Option<Option<usize>> {
    match at.get(1) {
        None => return Some(None),
        Some(b'[') => {}
        Some(_) => return None,
    }
    for (j, &c) in at.iter().enumerate().skip(2).take(MAX_SGR - 2) {
        match c {
            b'0'..=b'9' | b';' | b':' => {}
            b'm' => return Some(Some(j + 1)),
            _ => return None,
        }
    }
    (at.len() < MAX_SGR).then_some(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn whole(input: &[u8]) -> Vec<u8> {
        let mut f = TerminalText::default();
        let mut out = Vec::new();
        f.push(input, &mut out);
        f.finish(&mut out);
        out
    }

    #[test]
    fn colour_and_text_pass_other_controls_show() {
        assert_eq!(whole(b"\x1b[1;31mred\x1b[0m\n"), b"\x1b[1;31mred\x1b[0m\n");
        assert_eq!(
            whole("héllo ✓\tx\r\n".as_bytes()),
            "héllo ✓\tx\r\n".as_bytes()
        );
        // The clipboard (OSC 52), the title, the cursor, a bell, a DEL, C1's CSI.
        assert_eq!(
            whole(b"\x1b]52;c;ZXZpbA==\x07"),
            b"^[]52;c;ZXZpbA==^G".to_vec()
        );
        assert_eq!(whole(b"\x1b[2J\x1b[H"), b"^[[2J^[[H".to_vec());
        assert_eq!(whole(b"a\x08\x7fb\x00"), b"a^H^?b^@".to_vec());
        assert_eq!(whole("\u{9b}31m".as_bytes()), b"\\u{9b}31m".to_vec());
        assert_eq!(whole(b"\xff\xc3"), b"\\xff\\xc3".to_vec());
        assert_eq!(escape("bad\x1b]0;title\x07"), "bad^[]0;title^G");
    }

    /// Whether `out` is safe: UTF-8 with no control but tab, newline, carriage return
    /// and ESC opening a whole colour sequence.
    fn safe(out: &[u8]) -> Result<(), String> {
        let text = std::str::from_utf8(out).map_err(|e| e.to_string())?;
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == 0x1b {
                match sgr_len(&bytes[i..]) {
                    Some(Some(n)) => i += n,
                    _ => return Err(format!("a bare ESC at {i}")),
                }
                continue;
            }
            i += 1;
        }
        for c in text.chars() {
            if c.is_control() && !matches!(c, '\t' | '\n' | '\r' | '\x1b') {
                return Err(format!("control {c:?}"));
            }
        }
        Ok(())
    }

    /// Bytes a hostile job would write: escapes, controls, partial UTF-8, text.
    fn hostile() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"\x1b".to_vec()),
            Just(b"\x1b[".to_vec()),
            Just(b"\x1b[31m".to_vec()),
            Just(b"\x1b]52;c;".to_vec()),
            Just(b"m".to_vec()),
            Just(b";1".to_vec()),
            Just("✓".as_bytes().to_vec()),
            Just("\u{9b}".as_bytes().to_vec()),
            Just(b"\xe2\x9c".to_vec()),
            prop::collection::vec(any::<u8>(), 0..4),
            "[a-z \\t\\n]{0,8}".prop_map(String::into_bytes),
        ];
        prop::collection::vec(piece, 0..40).prop_map(|p| p.concat())
    }

    proptest! {
        #[test]
        fn whatever_the_job_writes_the_terminal_gets_only_text_and_colour(input in hostile()) {
            let out = whole(&input);
            prop_assert_eq!(safe(&out), Ok(()));
        }

        #[test]
        fn how_the_output_is_cut_changes_nothing(input in hostile(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6)) {
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(input.len() + 1)).collect();
            points.sort_unstable();
            let mut f = TerminalText::default();
            let mut out = Vec::new();
            let mut from = 0;
            for p in points {
                f.push(&input[from..p], &mut out);
                from = p;
            }
            f.push(&input[from..], &mut out);
            f.finish(&mut out);
            prop_assert_eq!(out, whole(&input));
        }

        #[test]
        fn text_without_controls_is_untouched(text in "[^\\p{Cc}]{0,64}") {
            prop_assert_eq!(whole(text.as_bytes()), text.as_bytes().to_vec());
        }
    }
}
