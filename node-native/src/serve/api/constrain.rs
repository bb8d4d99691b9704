//! Constrained output (`response_format`): JSON mode and JSON schemas, compiled by llguidance
//! (the library llama.cpp's server uses) into a grammar over the model's tokens whose mask the
//! leader applies to each row of logits before sampling. A hostile schema's cost is bounded:
//! its size and nesting before it is compiled, the compiler's fuel and states while it is, and
//! each mask's work as the request runs; past a bound the request gets a 400.

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use node_core::model::TokenConstraint;

use super::*;
use crate::serve::engine::Constrain;

/// Most bytes of a `response_format`'s schema, as JSON.
pub(super) const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Deepest nesting of a schema's JSON (objects and lists within each other).
pub(super) const MAX_SCHEMA_DEPTH: usize = 64;
/// The compiler's bounds: llguidance's defaults cut to what a request of this API may cost
/// (each a few tens of milliseconds of a core, and tens of MiB, at most).
fn limits() -> ParserLimits {
    ParserLimits {
        max_items_in_row: 2000,
        initial_lexer_fuel: 1_000_000,
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        max_lexer_states: 50_000,
        max_grammar_size: 100_000,
        ..ParserLimits::default()
    }
}

/// The model's tokens as llguidance sees them: their bytes in a trie (special tokens marked so
/// no grammar writes them as text), and the tokenizer for text it must split.
struct MeshTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for MeshTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// Compiles `response_format`s for one model; built the first time one is asked for.
pub(super) struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// The compiler for `tokenizer`'s model, its tokens read from `table`.
    pub(super) fn new(tokenizer: Arc<Tokenizer>, table: &TokenTable) -> Result<Self, String> {
        let eos = tokenizer
            .token_id("<|im_end|>")
            .or_else(|| tokenizer.eos_ids().first().copied())
            .ok_or("the model has no end-of-text token")?;
        let words = table.trie_words();
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(MeshTokEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self { factory })
    }

    /// The constraint `response_format` asks for: none for text; a 400 for a format or a
    /// schema this mesh does not follow, or one past the bounds.
    pub(super) fn compile(&self, format: &Value) -> Result<Option<Constrain>, ApiError> {
        let Some(schema) = schema_of(format)? else {
            return Ok(None);
        };
        let grammar = TopLevelGrammar::from_json_schema(schema);
        let parser = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }));
        let matcher = Matcher::new(parser);
        // The first mask here, so a schema that cannot start (or costs past the bounds at
        // once) is the request's 400 rather than its failure later.
        let first = matcher.deep_clone().compute_mask().map(|_| ());
        if let Some(e) = matcher.get_error().or(first.err().map(|e| e.to_string())) {
            return Err(ApiError::bad(
                "response_format",
                format!("the JSON schema cannot be followed: {e}"),
            )
            .code("invalid_schema"));
        }
        let matcher = Arc::new(matcher);
        Ok(Some(Constrain(Arc::new(move || {
            Ok(Box::new(Grammar(matcher.deep_clone())) as Box<dyn TokenConstraint>)
        }))))
    }
}

/// The JSON schema a `response_format` asks the output to follow (`None`: plain text), checked
/// against the bounds and what this mesh supports; never ignored silently.
pub(super) fn schema_of(format: &Value) -> Result<Option<Value>, ApiError> {
    let bad = |why: String| {
        Err(ApiError::bad("response_format", why).code("unsupported_response_format"))
    };
    let Some(o) = format.as_object() else {
        return bad("`response_format` must be an object with a `type`".into());
    };
    let kind = o.get("type").and_then(Value::as_str);
    if let Some(t) = kind.filter(|t| !["text", "json_object", "json_schema"].contains(t)) {
        return bad(format!(
            "`response_format` type {t:?} is not supported (text, json_object, json_schema)"
        ));
    }
    let known = ["type", "json_schema", "schema"];
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return bad(format!("`response_format` has an unknown field `{k}`"));
    }
    let schema = match kind {
        Some("text") if o.len() == 1 => return Ok(None),
        // llama-server's form: JSON mode with a schema beside the type.
        Some("json_object") if o.get("json_schema").is_none() => match o.get("schema") {
            Some(s) => s.clone(),
            None => json!({"type": "object"}),
        },
        Some("json_schema") if o.get("schema").is_none() => {
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return bad("`json_schema` must be an object with a `schema`".into());
            };
            let known = ["name", "description", "schema", "strict"];
            if let Some(k) = js.keys().find(|k| !known.contains(&k.as_str())) {
                return bad(format!("`json_schema` has an unknown field `{k}`"));
            }
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return bad("`json_schema.strict` must be a boolean".into());
            }
            // Without a schema, any JSON value (as llama-server does).
            js.get("schema").cloned().unwrap_or_else(|| json!({}))
        }
        Some(t) => {
            return bad(format!(
                "a `response_format` of type {t:?} does not take the fields it was given"
            ));
        }
        None => return bad("`response_format` needs a `type`".into()),
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return bad("a JSON schema must be an object (or a boolean)".into());
    }
    let bytes = serde_json::to_vec(&schema).map_or(usize::MAX, |v| v.len());
    if bytes > MAX_SCHEMA_BYTES {
        return bad(format!(
            "the JSON schema is {bytes} bytes; at most {MAX_SCHEMA_BYTES} are taken"
        ));
    }
    if depth(&schema) > MAX_SCHEMA_DEPTH {
        return bad(format!(
            "the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        ));
    }
    if schema.get("x-guidance").is_some() {
        return bad("`x-guidance` in a schema is not taken".into());
    }
    // Compact JSON: no run of whitespace for a model to get lost in.
    let mut schema = schema;
    if let Some(o) = schema.as_object_mut() {
        o.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
    }
    Ok(Some(schema))
}

/// How deeply `v` nests (a scalar: 1), without recursing on untrusted depth.
fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// One sequence's place in its grammar.
struct Grammar(Matcher);

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl TokenConstraint for Grammar {
    fn mask(&mut self, row: &mut [f32]) -> Result<(), String> {
        let allowed = self
            .0
            .compute_mask_or_eos()
            .map_err(|e| format!("the output's constraint: {e}"))?;
        let n = allowed.len();
        for (i, l) in row.iter_mut().enumerate() {
            if i >= n || !allowed.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        if row.iter().all(|l| !l.is_finite()) {
            return Err("the output's constraint allows no token the model can give".into());
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<bool, String> {
        self.0
            .consume_token(token)
            .map_err(|e| format!("the output's constraint: {e}"))?;
        Ok(self.0.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    fn refused(format: Value) -> String {
        schema_of(&format).unwrap_err().body()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn response_formats_are_followed_or_refused_never_ignored() {
        assert_eq!(schema_of(&json!({"type": "text"})).unwrap(), None);
        let s = schema_of(&json!({"type": "json_object"})).unwrap().unwrap();
        assert_eq!(s["type"], "object");
        let s = schema_of(&json!({"type": "json_schema", "json_schema": {
            "name": "n", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}
        }}))
        .unwrap()
        .unwrap();
        assert_eq!(s["properties"]["a"]["type"], "integer");
        for (format, why) in [
            (json!({"type": "grammar"}), "not supported"),
            (
                json!({"type": "grammar", "grammar": "root ::= x"}),
                "not supported",
            ),
            (json!({"type": "json_schema"}), "must be an object"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}),
                "unknown field `extra`",
            ),
            (
                json!({"type": "json_object", "other": 1}),
                "unknown field `other`",
            ),
            (json!({"type": "text", "json_schema": {}}), "does not take"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "must be an object",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {"x-guidance": {}}}}),
                "x-guidance",
            ),
            (json!("json"), "must be an object"),
        ] {
            let got = refused(format.clone());
            assert!(got.contains(why), "{format}: {got}");
        }
    }

    #[test]
    fn a_hostile_schema_is_refused_by_its_size_or_depth_before_it_is_compiled() {
        let mut deep = json!({"type": "string"});
        for _ in 0..MAX_SCHEMA_DEPTH {
            deep = json!({"type": "array", "items": deep});
        }
        let got = refused(json!({"type": "json_schema", "json_schema": {"schema": deep}}));
        assert!(got.contains("nests deeper"), "{got}");
        let props: serde_json::Map<String, Value> = (0..4000)
            .map(|i| (format!("property_{i}"), json!({"type": "string"})))
            .collect();
        let big = json!({"type": "object", "properties": props});
        let got = refused(json!({"type": "json_schema", "json_schema": {"schema": big}}));
        assert!(got.contains("bytes; at most"), "{got}");
        // Depth is measured without recursing.
        let mut v = json!(1);
        for _ in 0..1000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(depth(&v), 1001);
    }
}

#[cfg(test)]
mod grammar_tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    /// The compiler for the tiny test model's tokenizer (byte-level BPE, 320 tokens).
    fn grammars() -> (Grammars, Arc<Tokenizer>) {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/testdata/tiny-llama-hf/tokenizer.json"
        );
        let tokenizer = Arc::new(Tokenizer::from_hf_json(&std::fs::read(path).unwrap()).unwrap());
        let table = TokenTable::new(&tokenizer);
        (Grammars::new(tokenizer.clone(), &table).unwrap(), tokenizer)
    }

    fn format(schema: Value) -> Value {
        json!({"type": "json_schema", "json_schema": {"name": "t", "strict": true, "schema": schema}})
    }

    #[test]
    fn any_logits_under_the_mask_give_json_that_follows_the_schema() {
        let (g, tokenizer) = grammars();
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": false,
        });
        let constrain = g.compile(&format(schema)).unwrap().unwrap();
        let eos = tokenizer.eos_ids().to_vec();
        for seed in 0..8u64 {
            let mut c = (constrain.0)().unwrap();
            let mut out = Vec::new();
            let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            for _ in 0..200 {
                // Random logits: whatever the model says, the mask keeps the output valid.
                let mut row: Vec<f32> = (0..tokenizer.vocab_size())
                    .map(|_| {
                        rng = rng
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (rng >> 40) as f32 / (1u64 << 24) as f32 * 8.0
                    })
                    .collect();
                c.mask(&mut row).unwrap();
                let t = node_core::model::argmax(&row);
                if eos.contains(&t) {
                    break;
                }
                out.push(t);
                if c.commit(t).unwrap() {
                    break;
                }
            }
            let text = tokenizer.decode(&out).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let name = v["name"].as_str().unwrap();
            assert!(name.chars().count() <= 6, "{text}");
            assert!((0..=150).contains(&v["age"].as_i64().unwrap()), "{text}");
            let tags = v["tags"].as_array().unwrap();
            assert!(
                tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"),
                "{text}"
            );
            assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        }
    }

    #[test]
    fn a_hostile_schema_within_the_size_bound_is_refused_or_costs_little_per_token() {
        let (g, tokenizer) = grammars();
        // Regex state blow-ups, huge repetitions and ranges, left recursion, counted nesting.
        for schema in [
            json!({"type": "string", "pattern": "(a|b)*a(a|b){60}c"}),
            json!({"type": "string", "pattern": "[a-z]{1,5000}[0-9]{1,5000}[a-z]{1,5000}"}),
            json!({"type": "string", "pattern": "(x{1,20}y{1,20}){1,20}z{30,40}(q|r|s){1,99}"}),
            json!({"type": "integer", "minimum": -1e300, "maximum": 1e300, "multipleOf": 7}),
            json!({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}),
            json!({"type": "string", "minLength": 100000}),
            json!({"type": "array", "minItems": 100000, "items": {"type": "integer"}}),
            json!({"type": "array", "minItems": 1000, "items": {"type": "array", "minItems": 1000}}),
        ] {
            let started = std::time::Instant::now();
            let compiled = g.compile(&format(schema.clone()));
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(2),
                "{schema}: compiled in {took:?}"
            );
            let c = match compiled {
                Ok(c) => c.unwrap(),
                Err(e) => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{schema}");
                    assert_eq!(e.code, Some("invalid_schema"), "{schema}");
                    continue;
                }
            };
            let mut c = (c.0)().unwrap();
            let mut worst = Duration::ZERO;
            for i in 0..300 {
                let mut row = vec![0.0f32; tokenizer.vocab_size()];
                let at = (i * 7) % row.len();
                row[at] = 1.0;
                let t0 = std::time::Instant::now();
                let masked = c.mask(&mut row);
                worst = worst.max(t0.elapsed());
                if masked.is_err() || c.commit(node_core::model::argmax(&row)) != Ok(false) {
                    break;
                }
            }
            assert!(
                worst < Duration::from_millis(250),
                "{schema}: a mask took {worst:?}"
            );
        }
    }
}
