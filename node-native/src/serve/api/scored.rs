//! Log-probabilities in OpenAI's shapes: a chat's `logprobs.content[]` items and a
//! completion's `{tokens, token_logprobs, top_logprobs, text_offset}`, each token named by its
//! bytes in the model's vocabulary.

use node_core::model::TokenLogprob;

use super::*;

/// What OpenAI writes for a log-probability too small for a float (JSON has no −∞).
const FLOOR: f32 = -9999.0;

/// Every token's bytes, read from the tokenizer's vocabulary once (byte-level BPE maps bytes
/// to characters; SentencePiece writes spaces as `▁` and bytes as `<0xAB>`).
#[derive(Debug)]
pub(super) struct TokenTable {
    bytes: Vec<Vec<u8>>,
    /// Which tokens are special (control tokens such as `<|im_end|>`): never text.
    special: Vec<bool>,
}

/// GPT-2's byte-level alphabet: the character each byte is written as in a vocabulary.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = b as char;
        let printable = matches!(c, '!'..='~' | '\u{A1}'..='\u{AC}' | '\u{AE}'..='\u{FF}');
        let shown = if printable {
            c
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
        map.insert(shown, b);
    }
    map
}

impl TokenTable {
    /// The table of `tokenizer`'s vocabulary.
    pub(super) fn new(tokenizer: &Tokenizer) -> Self {
        let inner = tokenizer.inner();
        let decoder = inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .map(|v| v.to_string())
            .unwrap_or_default();
        let byte_level = decoder.contains("\"ByteLevel\"");
        let chars = byte_level_chars();
        let added = inner.get_added_tokens_decoder();
        let special = (0..tokenizer.vocab_size() as u32)
            .map(|id| added.get(&id).is_some_and(|a| a.special))
            .collect();
        let bytes = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    return a.content.as_bytes().to_vec();
                }
                let Some(piece) = inner.id_to_token(id) else {
                    return Vec::new();
                };
                if byte_level {
                    let mapped: Option<Vec<u8>> =
                        piece.chars().map(|c| chars.get(&c).copied()).collect();
                    return mapped.unwrap_or_else(|| piece.into_bytes());
                }
                let hex = piece
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => vec![b],
                    None => piece.replace('\u{2581}', " ").into_bytes(),
                }
            })
            .collect();
        Self { bytes, special }
    }

    /// Every token's bytes as a grammar's trie takes them: a special token's after the marker
    /// that keeps it out of text.
    pub(super) fn trie_words(&self) -> Vec<Vec<u8>> {
        (self.bytes.iter().zip(&self.special))
            .map(|(b, &special)| match special {
                true => [&[llguidance::toktrie::TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat(),
                false => b.clone(),
            })
            .collect()
    }

    /// A token's bytes (none for an id outside the vocabulary).
    pub(super) fn bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// A token as text: its bytes where they are UTF-8, else OpenAI's `bytes:\xNN…` form.
    pub(super) fn text(&self, id: u32) -> String {
        let b = self.bytes(id);
        match std::str::from_utf8(b) {
            Ok(s) => s.to_string(),
            Err(_) => {
                let mut s = String::from("bytes:");
                for x in b {
                    s.push_str(&format!("\\x{x:02x}"));
                }
                s
            }
        }
    }
}

fn finite(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { FLOOR }
}

/// One token of a chat's `logprobs.content`: `{token, logprob, bytes, top_logprobs}`.
pub(super) fn chat_item(table: &TokenTable, t: &TokenLogprob) -> Value {
    let one = |id: u32, lp: f32| json!({"token": table.text(id), "logprob": finite(lp), "bytes": table.bytes(id)});
    let mut item = one(t.token, t.logprob);
    item["top_logprobs"] = t.top.iter().map(|&(id, lp)| one(id, lp)).collect();
    item
}

/// A chat choice's `logprobs` for these tokens.
pub(super) fn chat_logprobs(table: &TokenTable, scored: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = scored.iter().map(|t| chat_item(table, t)).collect();
    json!({"content": content, "refusal": null})
}

/// A completion choice's `logprobs` for the prompt's tokens (`prompt`: the first token, then
/// the scores of the rest; empty without an echo) and the generated ones, their text starting at
/// character `offset` of the choice's text.
pub(super) fn completion_logprobs(
    table: &TokenTable,
    prompt: Option<(u32, &[TokenLogprob])>,
    scored: &[TokenLogprob],
    offset: &mut usize,
) -> Value {
    let (mut tokens, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    let mut push = |id: u32, lp: Option<&TokenLogprob>, offset: &mut usize| {
        let text = table.text(id);
        offsets.push(*offset);
        *offset += String::from_utf8_lossy(table.bytes(id)).chars().count();
        tokens.push(text);
        logprobs.push(lp.map(|t| finite(t.logprob)));
        tops.push(lp.map(|t| {
            let mut top = serde_json::Map::new();
            for &(id, l) in &t.top {
                top.entry(table.text(id)).or_insert(json!(finite(l)));
            }
            Value::Object(top)
        }));
    };
    if let Some((first, rest)) = prompt {
        push(first, None, offset);
        for t in rest {
            push(t.token, Some(t), offset);
        }
    }
    for t in scored {
        push(t.token, Some(t), offset);
    }
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}
