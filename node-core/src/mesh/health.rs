//! Health of a peer from the age of its last heartbeat: Healthy → Suspect → Dead.

use serde::{Deserialize, Serialize};
use web_time::Duration;

use super::MeshError;

/// What a node believes about a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Health {
    /// Heard from recently.
    Healthy,
    /// Missed a few heartbeats: not chosen for new groups.
    Suspect,
    /// Silent for long: its row is free to be re-created.
    Dead,
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Health::Healthy => "healthy",
            Health::Suspect => "suspect",
            Health::Dead => "dead",
        })
    }
}

/// Timing of heartbeats and of the health states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthConfig {
    /// How often a node announces itself.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is Suspect.
    pub suspect_after: Duration,
    /// Silence after which a peer is Dead.
    pub dead_after: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(1),
            suspect_after: Duration::from_secs(4),
            dead_after: Duration::from_secs(10),
        }
    }
}

impl HealthConfig {
    /// Checks `0 < heartbeat < suspect < dead`.
    pub fn validate(&self) -> Result<(), MeshError> {
        if self.heartbeat_interval.is_zero()
            || self.suspect_after <= self.heartbeat_interval
            || self.dead_after <= self.suspect_after
        {
            return Err(MeshError::Config(format!(
                "need 0 < heartbeat ({:?}) < suspect ({:?}) < dead ({:?})",
                self.heartbeat_interval, self.suspect_after, self.dead_after
            )));
        }
        Ok(())
    }

    /// The state of a peer last heard `silence` ago.
    pub fn health(&self, silence: Duration) -> Health {
        if silence >= self.dead_after {
            Health::Dead
        } else if silence >= self.suspect_after {
            Health::Suspect
        } else {
            Health::Healthy
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_silence() {
        let c = HealthConfig::default();
        c.validate().unwrap();
        assert_eq!(c.health(Duration::from_millis(500)), Health::Healthy);
        assert_eq!(c.health(Duration::from_secs(4)), Health::Suspect);
        assert_eq!(c.health(Duration::from_secs(11)), Health::Dead);
        let bad = HealthConfig {
            suspect_after: Duration::from_millis(500),
            ..c
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("heartbeat")
        );
    }
}
