//! What every node keeps besides its shard: the model's shape, the leader's small weights, the
//! tokenizer and the code. A leader needs nothing else to run a request on the mesh.

use serde::{Deserialize, Serialize};

use crate::code::Generator;
use crate::coded::ShardFormat;
use crate::learn::LearningConfig;
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
    /// Residual per unit of condition number above which answers disagree with the code
    /// (honest f32 noise measured at genesis, times a margin).
    pub verify_noise: f64,
    /// The mesh's public key, made at genesis (libp2p's protobuf form): only peers it admits
    /// by certificate write the model ([`crate::learn::Certificate`]).
    #[serde(with = "serde_bytes")]
    pub mesh_key: Vec<u8>,
    /// The canary text's loss on the model at genesis (nats per token): every trainer's gate
    /// counts the mesh's drift from it, and holders refuse an update whose trainer's verdict
    /// is missing or past the bounds. `None`: the mesh runs no gate.
    pub canary_loss: Option<f64>,
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
        m.tokenizer.sampling.checked("manifest")?;
        if !(m.verify_noise.is_finite() && m.verify_noise > 0.0 && m.verify_noise < 1.0) {
            return Err(ModelError::Config(format!(
                "manifest: verification noise {} is not in (0, 1)",
                m.verify_noise
            )));
        }
        crate::learn::MeshKey::from_bytes(&m.mesh_key)
            .map_err(|e| ModelError::Config(format!("manifest: {e}")))?;
        if m.canary_loss.is_some_and(|l| !(l.is_finite() && l > 0.0)) {
            return Err(ModelError::Config(format!(
                "manifest: canary loss {:?} is not a positive number",
                m.canary_loss
            )));
        }
        if !m.leader.fits(&m.cfg) {
            return Err(ModelError::Config(
                "manifest: norm gains do not match the model's shape".into(),
            ));
        }
        Ok(m)
    }

    /// The mesh's key, which admits who may write the model.
    pub fn mesh_key(&self) -> Result<crate::learn::MeshKey, crate::learn::AdmitError> {
        crate::learn::MeshKey::from_bytes(&self.mesh_key)
    }

    /// Identity of the coded model: a hash of the manifest.
    pub fn digest(&self) -> Result<[u8; 32], ModelError> {
        Ok(*blake3::hash(&self.to_bytes()?).as_bytes())
    }
}
