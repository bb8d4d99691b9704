//! What every node keeps besides its shard: the model's shape, the leader's small weights, the
//! tokenizer and the code. A leader needs nothing else to run a request on the mesh.

use serde::{Deserialize, Serialize};

use crate::code::Generator;
use crate::coded::ShardFormat;
use crate::model::{LeaderWeights, LlamaConfig, ModelError, TokenizerData};

/// The replicated, small part of a coded model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelManifest {
    /// A name for people (the model file's name).
    pub name: String,
    /// The model's shape.
    pub cfg: LlamaConfig,
    /// Norm gains the leader applies itself.
    pub leader: LeaderWeights,
    /// The tokenizer.
    pub tokenizer: TokenizerData,
    /// The code every shard was encoded with.
    pub generator: Generator,
    /// How shard values are stored.
    pub format: ShardFormat,
    /// Whether and how requests train the model.
    pub learning: LearningConfig,
}

/// The mesh's learning settings (fixed at genesis, part of the model's identity).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LearningConfig {
    /// Every request also trains the model.
    pub enabled: bool,
    /// SGD learning rate.
    pub lr: f32,
    /// Gradients are clipped to this norm.
    pub clip: f32,
}

impl Default for LearningConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            lr: 1e-4,
            clip: 1.0,
        }
    }
}

impl LearningConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ModelError> {
        if !(self.lr.is_finite() && self.lr >= 0.0 && self.lr <= 1.0)
            || !(self.clip.is_finite() && self.clip > 0.0)
        {
            return Err(ModelError::Config(format!(
                "learning rate {} must be in [0, 1] and clip {} positive",
                self.lr, self.clip
            )));
        }
        Ok(())
    }
}

impl ModelManifest {
    /// Serialized form (postcard).
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        postcard::to_allocvec(self).map_err(|e| ModelError::Config(format!("manifest: {e}")))
    }

    /// Parses and checks a manifest from untrusted bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ModelError> {
        let m: Self = postcard::from_bytes(bytes)
            .map_err(|e| ModelError::Config(format!("manifest: {e}")))?;
        m.cfg.validate()?;
        m.learning.validate()?;
        let layers = m.cfg.layers;
        if m.leader.attn_norm.len() != layers
            || m.leader.ffn_norm.len() != layers
            || m.leader.final_norm.len() != m.cfg.hidden
            || m.leader
                .attn_norm
                .iter()
                .chain(&m.leader.ffn_norm)
                .any(|v| v.len() != m.cfg.hidden)
        {
            return Err(ModelError::Config(
                "manifest: norm gains do not match the model's shape".into(),
            ));
        }
        Ok(m)
    }

    /// Identity of the coded model: a hash of the manifest.
    pub fn digest(&self) -> Result<[u8; 32], ModelError> {
        Ok(*blake3::hash(&self.to_bytes()?).as_bytes())
    }
}
