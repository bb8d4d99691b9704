//! Who may use a node's API, and how much each may teach the mesh: API keys, each with a name,
//! a learning budget, a request rate and whether it may teach at all; the anonymous user (no
//! key) with its own bucket, from this machine only once keys exist.
//!
//! The keys file (`--api-keys FILE`) is JSON:
//!
//! ```json
//! {"keys": [{"name": "alice", "key": "sk-alice", "learn_tokens": 32768, "learn_per_s": 64,
//!            "requests_per_minute": 120},
//!           {"name": "kiosk", "key": "sk-kiosk", "teach": false}],
//!  "anonymous": {"teach": true, "requests_per_minute": 30}}
//! ```
//!
//! `anonymous` may be `null` (every request needs a key). `--api-key KEY` is one key named
//! `default`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use node_core::learn::{BUDGET_REFILL_PER_S, BUDGET_TOKENS, Budget, Budgets};
use serde::Deserialize;

/// The anonymous user's name (its bucket and `/metrics` label).
pub const ANONYMOUS: &str = "anonymous";

/// Most keys a file may name.
const MAX_KEYS: usize = 10_000;

/// What one caller may do.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Caller {
    /// A name for people (and `/metrics`); the key itself is never shown.
    #[serde(default = "anonymous_name")]
    pub name: String,
    /// Whether its requests may train the mesh.
    #[serde(default = "yes")]
    pub teach: bool,
    /// Tokens it may have trained on at once.
    #[serde(default = "default_tokens")]
    pub learn_tokens: f64,
    /// Tokens its learning budget refills a second.
    #[serde(default = "default_refill")]
    pub learn_per_s: f64,
    /// Requests it may make a minute (`None`: as many as the queue takes).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
}

fn anonymous_name() -> String {
    ANONYMOUS.into()
}

fn yes() -> bool {
    true
}

fn default_tokens() -> f64 {
    BUDGET_TOKENS
}

fn default_refill() -> f64 {
    BUDGET_REFILL_PER_S
}

impl Caller {
    /// The anonymous user with the default budget and no rate.
    pub fn anonymous() -> Self {
        Self {
            name: ANONYMOUS.into(),
            teach: true,
            learn_tokens: BUDGET_TOKENS,
            learn_per_s: BUDGET_REFILL_PER_S,
            requests_per_minute: None,
        }
    }

    /// Its learning budget.
    pub fn budget(&self) -> Budget {
        Budget {
            capacity: self.learn_tokens,
            refill_per_s: self.learn_per_s,
        }
    }
}

/// A key in the file: the secret and what it may do.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    key: String,
    #[serde(flatten)]
    caller: Caller,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
    /// The user without a key (`null`: none).
    #[serde(default = "anonymous_default")]
    anonymous: Option<Caller>,
}

fn anonymous_default() -> Option<Caller> {
    Some(Caller::anonymous())
}

/// The callers a node's API knows.
#[derive(Debug, Clone)]
pub struct Keys {
    /// By secret.
    keys: HashMap<String, Caller>,
    /// The user without a key, if it may use the API (from this machine only, once keys exist).
    anonymous: Option<Caller>,
    /// Each caller's requests this minute.
    rates: Arc<Mutex<(Budgets, Instant)>>,
}

/// Why a caller may not make a request now.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// No key, or a wrong one.
    Unauthorized,
    /// Past its requests a minute: try again after this long.
    Rate(Duration),
}

impl Keys {
    /// No keys: everyone is the anonymous user.
    pub fn open() -> Self {
        Self::build(HashMap::new(), Some(Caller::anonymous()))
    }

    /// One key named `default` (`--api-key`); without it the API answers 401.
    pub fn single(key: &str) -> Self {
        let caller = Caller {
            name: "default".into(),
            ..Caller::anonymous()
        };
        Self::build(HashMap::from([(key.to_string(), caller)]), None)
    }

    /// The keys of a keys file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the API keys in {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("the API keys in {}", path.display()))
    }

    /// The keys of a keys file's text.
    pub fn parse(text: &str) -> Result<Self> {
        let file: KeysFile = serde_json::from_str(text)?;
        ensure!(
            file.keys.len() <= MAX_KEYS,
            "over {MAX_KEYS} keys in one file"
        );
        let mut keys = HashMap::new();
        let mut names = std::collections::HashSet::new();
        for KeyEntry { key, caller } in file.keys {
            ensure!(
                key.len() >= 8,
                "the key named {:?} is under 8 characters",
                caller.name
            );
            ensure!(
                caller.name != ANONYMOUS && names.insert(caller.name.clone()),
                "every key needs a name of its own (and not {ANONYMOUS:?}): {:?}",
                caller.name
            );
            check(&caller)?;
            if keys.insert(key, caller).is_some() {
                bail!("a key is listed twice");
            }
        }
        if let Some(a) = &file.anonymous {
            check(a)?;
        }
        let anonymous = file.anonymous.map(|a| Caller {
            name: ANONYMOUS.into(),
            ..a
        });
        Ok(Self::build(keys, anonymous))
    }

    fn build(keys: HashMap<String, Caller>, anonymous: Option<Caller>) -> Self {
        let mut rates = Budgets::default();
        for c in keys.values().chain(&anonymous) {
            if let Some(rpm) = c.requests_per_minute {
                let rpm = f64::from(rpm);
                rates.set(
                    &c.name,
                    Budget {
                        capacity: rpm,
                        refill_per_s: rpm / 60.0,
                    },
                );
            }
        }
        Self {
            keys,
            anonymous,
            rates: Arc::new(Mutex::new((rates, Instant::now()))),
        }
    }

    /// Every caller the API knows (each key's and the anonymous user's), for budgets and
    /// metrics.
    pub fn callers(&self) -> impl Iterator<Item = &Caller> {
        self.keys.values().chain(&self.anonymous)
    }

    /// The name of the caller `key` names (the anonymous user's without one), for metrics.
    pub fn name_of(&self, key: Option<&str>) -> String {
        match self.counted(key) {
            Some(k) => self
                .keys
                .get(k)
                .map_or("unknown", |c| c.name.as_str())
                .into(),
            None => ANONYMOUS.into(),
        }
    }

    /// The key a request sent, where the API has keys: without any, whatever a client sends
    /// (OpenAI's clients always send one) makes it the anonymous user.
    fn counted<'k>(&self, key: Option<&'k str>) -> Option<&'k str> {
        key.filter(|_| !self.keys.is_empty())
    }

    /// Whether the API asks for a key at all.
    pub fn any(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Who makes a request with `key` (if any) from `from`: a key's caller, or the anonymous
    /// user (from anywhere when there are no keys, whatever key it sends, as OpenAI's clients
    /// always send one; from this machine only once there are); counted against its requests
    /// a minute.
    pub fn caller(&self, key: Option<&str>, from: Option<IpAddr>) -> Result<&Caller, Refused> {
        let caller = match self.counted(key) {
            Some(k) => self.keys.get(k).ok_or(Refused::Unauthorized)?,
            None => {
                let local = from.is_some_and(|ip| ip.is_loopback());
                match &self.anonymous {
                    Some(a) if local || self.keys.is_empty() => a,
                    _ => return Err(Refused::Unauthorized),
                }
            }
        };
        if caller.requests_per_minute.is_some() {
            let mut r = self.rates.lock().unwrap_or_else(PoisonError::into_inner);
            let now = r.1.elapsed();
            if !r.0.take(&caller.name, 1, now) {
                let per_s = f64::from(caller.requests_per_minute.unwrap_or(1)) / 60.0;
                return Err(Refused::Rate(Duration::from_secs_f64(
                    1.0 / per_s.max(1e-3),
                )));
            }
        }
        Ok(caller)
    }
}

fn check(c: &Caller) -> Result<()> {
    ensure!(
        c.learn_tokens.is_finite() && c.learn_tokens >= 0.0,
        "{:?}: learn_tokens must be a number ≥ 0",
        c.name
    );
    ensure!(
        c.learn_per_s.is_finite() && c.learn_per_s >= 0.0,
        "{:?}: learn_per_s must be a number ≥ 0",
        c.name
    );
    ensure!(
        c.name.chars().count() <= 64 && !c.name.is_empty(),
        "a key's name is 1 to 64 characters: {:?}",
        c.name
    );
    ensure!(
        c.requests_per_minute != Some(0),
        "{:?}: requests_per_minute must be at least 1",
        c.name
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    const LOCAL: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    const AWAY: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9)));

    #[test]
    fn keys_name_their_callers_and_the_anonymous_user_stays_on_this_machine() {
        let keys = Keys::parse(
            r#"{"keys": [{"name": "alice", "key": "sk-alice-1", "requests_per_minute": 2},
                        {"name": "kiosk", "key": "sk-kiosk-1", "teach": false, "learn_tokens": 0}],
                "anonymous": {"learn_tokens": 100, "learn_per_s": 1}}"#,
        )
        .unwrap();
        assert!(keys.any());
        let alice = keys.caller(Some("sk-alice-1"), AWAY).unwrap();
        assert_eq!(alice.name, "alice");
        assert!(keys.caller(Some("sk-alice-1"), AWAY).is_ok());
        assert!(
            matches!(keys.caller(Some("sk-alice-1"), AWAY), Err(Refused::Rate(_))),
            "two a minute"
        );
        assert!(!keys.caller(Some("sk-kiosk-1"), AWAY).unwrap().teach);
        assert_eq!(
            keys.caller(Some("sk-nobody"), LOCAL),
            Err(Refused::Unauthorized)
        );
        let anon = keys.caller(None, LOCAL).unwrap();
        assert_eq!((anon.name.as_str(), anon.learn_tokens), (ANONYMOUS, 100.0));
        assert_eq!(keys.caller(None, AWAY), Err(Refused::Unauthorized));
        // Without keys everyone is anonymous, whatever key a client sends (the openai client
        // always sends one: README's `api_key="unused"`); with one key, no one is.
        assert_eq!(Keys::open().caller(None, AWAY).unwrap().name, ANONYMOUS);
        let open = Keys::open();
        assert_eq!(open.caller(Some("unused"), AWAY).unwrap().name, ANONYMOUS);
        let single = Keys::single("sk-one-key");
        assert_eq!(single.caller(None, LOCAL), Err(Refused::Unauthorized));
        assert_eq!(
            single.caller(Some("sk-one-key"), AWAY).unwrap().name,
            "default"
        );
    }

    #[test]
    fn a_bad_keys_file_says_what_is_wrong() {
        for (text, says) in [
            (r#"{"keys": [{"name": "a", "key": "short"}]}"#, "under 8"),
            (
                r#"{"keys": [{"name": "a", "key": "sk-aaaaaaa"}, {"name": "a", "key": "sk-bbbbbbb"}]}"#,
                "a name of its own",
            ),
            (
                r#"{"keys": [{"name": "a", "key": "sk-aaaaaaa", "learn_tokens": -1}]}"#,
                "≥ 0",
            ),
            (r#"{"keys": [{"nam": "a"}]}"#, "missing field `key`"),
            (
                r#"{"keys": [{"name": "a", "key": "sk-aaaaaaa", "tokens": 5}]}"#,
                "unknown field `tokens`",
            ),
        ] {
            let e = format!("{:#}", Keys::parse(text).unwrap_err());
            assert!(e.contains(says), "{text}: {e}");
        }
        let no_anon = Keys::parse(r#"{"keys": [], "anonymous": null}"#).unwrap();
        assert_eq!(no_anon.caller(None, LOCAL), Err(Refused::Unauthorized));
    }
}
