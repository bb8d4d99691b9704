//! The model's tokenizer: byte-level BPE or SentencePiece from GGUF metadata, or a Hugging Face
//! `tokenizer.json`, plus the ChatML chat template.

use tokenizers::SplitDelimiterBehavior;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper};

use super::{ModelError, SamplingDefaults};
use crate::gguf::{GgufFile, MetaValue};

/// Llama 3's pre-tokenizer split (llama.cpp's "llama-bpe"): digits in threes.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer split (llama.cpp's "qwen2"): digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token type of control tokens (`<|im_start|>` and friends).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of ordinary pieces (not bytes, control or unknown tokens).
const TOKEN_TYPE_NORMAL: i32 = 1;

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Text ↔ token ids for one model.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos: Vec<u32>,
    default_system: Option<String>,
    /// The sampling a request gets for what it does not set.
    sampling: SamplingDefaults,
    /// Tokens, special ones included: `tokenizers` counts them by building the whole
    /// vocabulary's map (49,152 strings for SmolLM2), so once, not in every request.
    vocab: usize,
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    fn new(inner: tokenizers::Tokenizer, eos: Vec<u32>, default_system: Option<String>) -> Self {
        let vocab = inner.get_vocab_size(true);
        Self {
            inner,
            eos,
            default_system,
            sampling: SamplingDefaults::default(),
            vocab,
        }
    }

    /// The same tokenizer with `sampling` as the model's recommended sampling.
    pub fn with_sampling(mut self, sampling: SamplingDefaults) -> Self {
        self.sampling = sampling;
        self
    }

    /// The sampling the model's publisher recommends (its file's, or llama.cpp's defaults).
    pub fn sampling(&self) -> SamplingDefaults {
        self.sampling
    }

    /// Builds the tokenizer stored in a GGUF file (`gpt2` byte-level BPE, or `llama`
    /// SentencePiece).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let model = file.get_str("tokenizer.ggml.model")?;
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let types = file.get_i32_array("tokenizer.ggml.token_type").ok();
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let mut inner = match model {
            "gpt2" => byte_level_bpe(file, vocab)?,
            "llama" => sentencepiece(file, vocab, &tokens, types.as_deref())?,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "tokenizer model {other:?} (supported: gpt2, byte-level BPE; llama, SentencePiece)"
                )));
            }
        };
        let specials: Vec<AddedToken> = match &types {
            Some(types) => tokens
                .iter()
                .zip(types)
                .filter(|(_, ty)| **ty == TOKEN_TYPE_CONTROL)
                .map(|(t, _)| AddedToken::from(t.to_string(), true))
                .collect(),
            None => Vec::new(),
        };
        inner.add_special_tokens(&specials);
        let mut eos = Vec::new();
        if let Ok(id) = file.get_u32("tokenizer.ggml.eos_token_id") {
            eos.push(id);
        }
        if let Some(id) = inner.token_to_id("<|im_end|>") {
            eos.push(id);
        }
        eos.sort_unstable();
        eos.dedup();
        let default_system = file
            .get_str("tokenizer.chat_template")
            .ok()
            .and_then(default_system_prompt);
        let sampling = SamplingDefaults::from_gguf(file)?;
        Ok(Self::new(inner, eos, default_system).with_sampling(sampling))
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_hf_json(bytes: &[u8]) -> Result<Self, ModelError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        let eos = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        Ok(Self::new(inner, eos, None))
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// Ids that end a completion.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Number of tokens, special ones included.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A stream that turns generated ids into text as it becomes complete.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// The prompt text for a chat in ChatML, ending with the assistant's turn opened.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        let has_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (has_system, &self.default_system) {
            out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
        }
        for m in messages {
            out.push_str(&format!(
                "<|im_start|>{}\n{}<|im_end|>\n",
                m.role, m.content
            ));
        }
        out.push_str("<|im_start|>assistant\n");
        out
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Everything needed to rebuild this tokenizer elsewhere (it travels in the model manifest).
    pub fn to_data(&self) -> Result<TokenizerData, ModelError> {
        Ok(TokenizerData {
            json: self.inner.to_string(false).map_err(tok_err)?,
            eos: self.eos.clone(),
            default_system: self.default_system.clone(),
            sampling: self.sampling,
        })
    }

    /// Rebuilds a tokenizer from [`Tokenizer::to_data`]'s output.
    pub fn from_data(data: &TokenizerData) -> Result<Self, ModelError> {
        let inner = tokenizers::Tokenizer::from_bytes(data.json.as_bytes()).map_err(tok_err)?;
        Ok(
            Self::new(inner, data.eos.clone(), data.default_system.clone())
                .with_sampling(data.sampling.checked("the manifest")?),
        )
    }
}

/// The `gpt2` tokenizer of a GGUF file over its `vocab`: byte-level BPE with its merges and
/// pre-tokenizer.
fn byte_level_bpe(file: &GgufFile, vocab: Vocab) -> Result<tokenizers::Tokenizer, ModelError> {
    let merges = file.get_str_array("tokenizer.ggml.merges")?;
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(format!("malformed merge {m:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let byte_level = ByteLevel::new(false, true, true);
    // After a regex split, byte-level mapping alone (its own GPT-2 regex off).
    let split_then_bytes = |pattern: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into())
    };
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        // SmolLM's pre-tokenizer: single digits, then GPT-2 byte-level splitting.
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
        "llama-bpe" | "llama3" | "smaug-bpe" | "dbrx" => split_then_bytes(LLAMA3_SPLIT)?,
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT)?,
        "default" | "gpt2" | "gpt-2" => byte_level.into(),
        other => {
            return Err(ModelError::Unsupported(format!(
                "tokenizer pre-tokenizer {other:?} (supported: default, gpt2, smollm, starcoder, refact, llama-bpe, qwen2)"
            )));
        }
    };
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// SentencePiece's word boundary, which stands for a space.
const SPM_SPACE: &str = "\u{2581}";

/// The `llama` tokenizer of a GGUF file (Llama 1 and 2, Mistral 7B), as llama.cpp runs it:
/// a space before the text (unless `add_space_prefix` is false) and every space as `▁`, then
/// the adjacent pair whose joined piece scores highest merged first, and a character no piece
/// holds as its bytes' `<0xNN>` tokens. That is BPE whose merges are every split of every
/// piece into two pieces, ranked by the joined piece's score. `vocab` maps the file's
/// `tokens` to their ids; `types` are their GGUF types, where the file has them.
fn sentencepiece(
    file: &GgufFile,
    vocab: Vocab,
    tokens: &[&str],
    types: Option<&[i32]>,
) -> Result<tokenizers::Tokenizer, ModelError> {
    let scores = file.get_f32_array("tokenizer.ggml.scores")?;
    if scores.len() != tokens.len() {
        return Err(tok_err(format!(
            "{} token scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let normal = |i: usize| types.is_none_or(|t| t.get(i) == Some(&TOKEN_TYPE_NORMAL));
    let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if !normal(i) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            let parts_are_pieces = [left, right]
                .iter()
                .all(|p| vocab.get(*p).is_some_and(|&id| normal(id as usize)));
            if parts_are_pieces {
                ranked.push((scores[i], i as u32, left.to_string(), right.to_string()));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = ranked.into_iter().map(|(_, _, l, r)| (l, r)).collect();
    let unk = file
        .get_u32("tokenizer.ggml.unknown_token_id")
        .ok()
        .and_then(|id| tokens.get(id as usize))
        .map_or("<unk>", |t| *t);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk.to_string())
        .byte_fallback(true)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space_prefix = !matches!(
        file.get("tokenizer.ggml.add_space_prefix"),
        Some(MetaValue::Bool(false))
    );
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if space_prefix {
        normalizers.push(Prepend::new(SPM_SPACE.to_string()).into());
    }
    normalizers.push(Replace::new(" ", SPM_SPACE).map_err(tok_err)?.into());
    inner.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPM_SPACE, " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

/// A tokenizer in a portable form: the `tokenizers` JSON plus what the chat template adds and
/// the sampling the model's publisher recommends.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenizerData {
    /// `tokenizer.json` text.
    pub json: String,
    /// Ids that end a completion.
    pub eos: Vec<u32>,
    /// System prompt inserted when a chat has none.
    pub default_system: Option<String>,
    /// The sampling a request gets for what it does not set.
    pub sampling: SamplingDefaults,
}

/// The system prompt a ChatML template inserts when the chat has none.
fn default_system_prompt(template: &str) -> Option<String> {
    let marker = "<|im_start|>system\n";
    let start = template.find(marker)? + marker.len();
    let rest = &template[start..];
    let end = rest.find("<|im_end|>")?;
    let text = &rest[..end];
    // Only a literal string, not template code.
    (!text.contains("{{") && !text.contains("{%") && !text.contains('\'')).then(|| text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_system_prompt_is_read_from_the_template() {
        let t = "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}";
        assert_eq!(default_system_prompt(t).as_deref(), Some("You are SmolLM"));
        assert_eq!(
            default_system_prompt("{{'<|im_start|>system\n' + x + '<|im_end|>'}}"),
            None
        );
    }
}

/// Generated text, token by token: each id may complete some text, held back while it ends
/// in an incomplete UTF-8 sequence.
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream<'_> {
    /// Adds a generated id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids).ok()?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.emitted {
            return None;
        }
        let new = text.get(self.emitted..)?.to_string();
        self.emitted = text.len();
        Some(new)
    }
}
