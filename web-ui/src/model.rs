//! What the dashboard shows, computed from the node's snapshots: plain data, no DOM.

use node_core::mesh::{Health, MeshInfo, NodeStatus, Usage};

/// Where a row's holder computes, as a person reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU of a native node.
    Cpu,
    /// A GPU of a native node.
    Gpu,
    /// WebGPU in a browser.
    BrowserWebGpu,
    /// The CPU (wasm) of a browser.
    BrowserCpu,
}

impl DeviceKind {
    /// Classifies a heartbeat's device string.
    pub fn of(device: &str) -> Self {
        let d = device.to_ascii_lowercase();
        let browser = d.contains("browser");
        match (
            browser,
            d == "cpu" || d.is_empty() || d.contains("wasm cpu"),
        ) {
            (true, true) => Self::BrowserCpu,
            (true, false) => Self::BrowserWebGpu,
            (false, true) => Self::Cpu,
            (false, false) => Self::Gpu,
        }
    }

    /// A short label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Cpu => "CPU",
            Self::Gpu => "GPU",
            Self::BrowserWebGpu => "browser WebGPU",
            Self::BrowserCpu => "browser CPU",
        }
    }
}

/// One row of the code, as the table shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct RowView {
    /// The row.
    pub row: u32,
    /// Its holders (normally one), best first.
    pub holders: Vec<NodeStatus>,
    /// The best holder's health; Dead when nobody holds it.
    pub health: Health,
}

impl RowView {
    /// The holders' peer ids, shortened.
    pub fn holder_label(&self) -> String {
        if self.holders.is_empty() {
            return "nobody".into();
        }
        self.holders
            .iter()
            .map(|h| short_peer(&h.peer))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The best holder's device.
    pub fn device(&self) -> String {
        self.holders.first().map_or("—".into(), |h| {
            let kind = DeviceKind::of(&h.device);
            match kind {
                DeviceKind::Gpu | DeviceKind::BrowserWebGpu => {
                    format!("{} ({})", kind.label(), h.device)
                }
                _ => kind.label().into(),
            }
        })
    }

    /// How peers reach the best holder: public, direct after hole punching, relayed.
    pub fn reach(&self) -> String {
        self.holders
            .first()
            .map_or("—".into(), |h| match h.reach.as_str() {
                "" | "unknown" => "—".into(),
                r => r.into(),
            })
    }

    /// The round trip from the dashboard's node to each holder, best holder first, as that
    /// node measured it or estimates it from the network coordinates ("—" when not known).
    pub fn round_trips(&self) -> String {
        if self.holders.is_empty() {
            return "—".into();
        }
        self.holders
            .iter()
            .map(|h| match h.rtt_ms {
                Some(ms) if ms < 10.0 => format!("{ms:.1} ms"),
                Some(ms) => format!("{ms:.0} ms"),
                None => "—".into(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// How far each holder is behind the mesh version, in updates, best first ("—" with none):
    /// a replica still pulling an update shows beside one that has it.
    pub fn lags(&self) -> String {
        if self.holders.is_empty() {
            return "—".into();
        }
        self.holders
            .iter()
            .map(|h| h.lag.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The last verification result: the evidence if a leader caught a holder.
    pub fn verification(&self) -> String {
        match self.holders.iter().find_map(|h| h.caught.clone()) {
            Some(evidence) => format!("caught: {evidence}"),
            None if self.holders.is_empty() => "—".into(),
            None => "not caught".into(),
        }
    }
}

/// Every row `0..n` with its holders, rows nobody holds included.
pub fn rows(info: &MeshInfo) -> Vec<RowView> {
    // Rows of a grown code need not be 0..n; older nodes send no row list.
    let indices: Vec<u32> = if info.rows.is_empty() {
        (0..info.n).collect()
    } else {
        info.rows.iter().map(|r| r.row).collect()
    };
    indices
        .into_iter()
        .map(|row| {
            let mut holders: Vec<NodeStatus> = info
                .nodes
                .iter()
                .filter(|n| n.row == Some(row))
                .cloned()
                .collect();
            holders.sort_by_key(|h| (rank(h.health), h.lag));
            let health = holders.first().map_or(Health::Dead, |h| h.health);
            RowView {
                row,
                holders,
                health,
            }
        })
        .collect()
}

/// "Healthy", "Suspect" or "Dead".
pub fn health_label(h: Health) -> &'static str {
    match h {
        Health::Healthy => "Healthy",
        Health::Suspect => "Suspect",
        Health::Dead => "Dead",
    }
}

fn rank(h: Health) -> u8 {
    match h {
        Health::Healthy => 0,
        Health::Suspect => 1,
        Health::Dead => 2,
    }
}

/// `12D3KooW…` ids shortened to their last 8 characters.
pub fn short_peer(peer: &str) -> String {
    let start = peer.char_indices().rev().nth(7).map_or(0, |(i, _)| i);
    format!("…{}", &peer[start..])
}

/// Rates derived from two snapshots' counters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample {
    /// Seconds since the page opened.
    pub t: f64,
    /// Gossip bytes received per second.
    pub gossip_bytes_per_s: f64,
    /// Heartbeats received per second.
    pub heartbeats_per_s: f64,
    /// Healthy rows.
    pub healthy_rows: u32,
    /// Updates applied at the mesh version.
    pub updates: u64,
    /// Tokens generated per second on the mesh (prompt and completion) over the last
    /// [`RATE_WINDOW_S`] seconds.
    pub tokens_per_s: f64,
    /// Requests finished on the mesh, as leaders reported them.
    pub requests: u64,
    /// Mean latency of the latest requests reported, in milliseconds (0 before any).
    pub latency_ms: f64,
    /// Mean loss of the latest requests the mesh trained on (0 before any).
    pub loss: f64,
    /// The mesh's canary loss as of the latest updates the leaders' canary gates judged (0
    /// before any).
    pub canary_loss: f64,
    /// Share of the requests finished over the last [`RATE_WINDOW_S`] seconds that the mesh
    /// trained on (the last one seen while none finished).
    pub trained_share: f64,
    /// Updates the canary gates refused, in all.
    pub refused: u64,
}

/// Seconds the tokens/s rate is averaged over.
pub const RATE_WINDOW_S: f64 = 10.0;

/// A bounded history of samples, for the live numbers and the chart.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct History {
    samples: std::collections::VecDeque<Sample>,
    last: Option<(f64, u64, u64)>,
    /// The mesh's usage counters at each sample's time.
    usage: std::collections::VecDeque<(f64, Usage)>,
}

/// Samples the history keeps (a minute at two a second).
pub const HISTORY_LEN: usize = 120;

impl History {
    /// Adds a sample at `t` seconds from the snapshot's counters.
    pub fn push(&mut self, t: f64, gossip_bytes: u64, heartbeats: u64, info: Option<&MeshInfo>) {
        let (gossip_bytes_per_s, heartbeats_per_s) = match self.last {
            Some((t0, g0, h0)) if t > t0 => (
                gossip_bytes.saturating_sub(g0) as f64 / (t - t0),
                heartbeats.saturating_sub(h0) as f64 / (t - t0),
            ),
            _ => (0.0, 0.0),
        };
        self.last = Some((t, gossip_bytes, heartbeats));
        let usage = info.map_or_else(Usage::default, |i| i.usage);
        let previous = self.latest().unwrap_or_default();
        let (mut latency_ms, mut loss) = (previous.latency_ms, previous.loss);
        let mut canary_loss = previous.canary_loss;
        if let Some(&(_, before)) = self.usage.back() {
            // Counters only grow; a node that restarted or was forgotten shrinks them.
            let requests = usage.requests.saturating_sub(before.requests);
            if requests > 0 {
                latency_ms =
                    usage.latency_ms.saturating_sub(before.latency_ms) as f64 / requests as f64;
            }
            let trained = usage.trained.saturating_sub(before.trained);
            if trained > 0 {
                loss = usage.loss_micro.saturating_sub(before.loss_micro) as f64
                    / 1e6
                    / trained as f64;
            }
            let gated = usage.gated.saturating_sub(before.gated);
            if gated > 0 {
                canary_loss = usage.canary_micro.saturating_sub(before.canary_micro) as f64
                    / 1e6
                    / gated as f64;
            }
        }
        self.usage.push_back((t, usage));
        while self.usage.len() > 1 && t - self.usage[1].0 >= RATE_WINDOW_S {
            self.usage.pop_front();
        }
        let tokens_per_s = match self.usage.front() {
            Some(&(t0, u0)) if t > t0 => {
                let tokens = |u: &Usage| u.prompt_tokens + u.tokens;
                tokens(&usage).saturating_sub(tokens(&u0)) as f64 / (t - t0)
            }
            _ => 0.0,
        };
        let trained_share = match self.usage.front() {
            Some(&(_, u0)) if usage.requests > u0.requests => {
                usage.trained.saturating_sub(u0.trained) as f64
                    / (usage.requests - u0.requests) as f64
            }
            _ => previous.trained_share,
        };
        self.samples.push_back(Sample {
            t,
            gossip_bytes_per_s,
            heartbeats_per_s,
            healthy_rows: info.map_or(0, |i| i.healthy_rows),
            updates: info.map_or(0, |i| i.version_count),
            tokens_per_s,
            requests: usage.requests,
            latency_ms,
            loss,
            canary_loss,
            trained_share: trained_share.min(1.0),
            refused: usage.refused,
        });
        while self.samples.len() > HISTORY_LEN {
            self.samples.pop_front();
        }
    }

    /// The newest sample.
    pub fn latest(&self) -> Option<Sample> {
        self.samples.back().copied()
    }

    /// SVG polyline points of `f` over the history, scaled into `w × h` (0 at the bottom).
    pub fn polyline(&self, w: f64, h: f64, f: impl Fn(&Sample) -> f64) -> String {
        let max = self.samples.iter().map(&f).fold(0.0f64, f64::max).max(1e-9);
        let n = HISTORY_LEN.max(2) - 1;
        let skip = HISTORY_LEN - self.samples.len();
        self.samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let x = (i + skip) as f64 * w / n as f64;
                let y = h - f(s) / max * h;
                format!("{x:.1},{y:.1}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(peer: &str, row: Option<u32>, health: Health, device: &str) -> NodeStatus {
        NodeStatus {
            peer: peer.into(),
            row,
            health,
            version_count: 0,
            version_digest: String::new(),
            addrs: vec![],
            silent_for_s: 0.0,
            lag: 0,
            caught: None,
            device: device.into(),
            usage: Usage::default(),
            reach: "public".into(),
            trains: false,
            coord: Default::default(),
            rtt_ms: None,
        }
    }

    fn info(nodes: Vec<NodeStatus>) -> MeshInfo {
        MeshInfo {
            k: 2,
            n: 3,
            n_max: 3,
            rows: Vec::new(),
            health: Default::default(),
            model: String::new(),
            model_name: "m".into(),
            available: true,
            healthy_rows: 2,
            tolerates: 0,
            version_count: 3,
            version_digest: String::new(),
            nodes,
            dashboard: None,
            usage: Usage::default(),
        }
    }

    #[test]
    fn every_row_is_listed_with_its_best_holder() {
        let mut caught = node("12D3KooWcaught01", Some(1), Health::Dead, "cpu");
        caught.caught = Some("row 1 caught on Qkv(0)".into());
        let i = info(vec![
            node("12D3KooWaaaaaaaa", Some(0), Health::Healthy, "cpu"),
            caught,
            node(
                "12D3KooWbbbbbbbb",
                Some(1),
                Health::Healthy,
                "NVIDIA H200 (Vulkan)",
            ),
            node("12D3KooWwatching", None, Health::Healthy, "cpu"),
        ]);
        let rows = rows(&i);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].health, Health::Healthy);
        assert_eq!(rows[1].holders.len(), 2);
        assert_eq!(rows[1].holders[0].peer, "12D3KooWbbbbbbbb");
        assert_eq!(rows[1].device(), "GPU (NVIDIA H200 (Vulkan))");
        assert_eq!(rows[1].reach(), "public");
        assert_eq!(rows[2].reach(), "—");
        assert_eq!(rows[1].round_trips(), "—, —");
        let mut near = i.clone();
        near.nodes[2].rtt_ms = Some(42.4);
        near.nodes[1].rtt_ms = Some(0.3);
        assert_eq!(super::rows(&near)[1].round_trips(), "42 ms, 0.3 ms");
        assert_eq!(rows[2].round_trips(), "—");
        assert_eq!(rows[1].verification(), "caught: row 1 caught on Qkv(0)");
        assert_eq!(rows[2].health, Health::Dead);
        assert_eq!(rows[2].holder_label(), "nobody");
        assert_eq!(rows[0].verification(), "not caught");
    }

    #[test]
    fn a_grown_mesh_lists_the_rows_it_reports_with_every_holder() {
        let mut behind = node("12D3KooWreplica0", Some(0), Health::Healthy, "cpu");
        behind.lag = 2;
        let mut i = info(vec![
            behind,
            node("12D3KooWaaaaaaaa", Some(0), Health::Healthy, "cpu"),
            node(
                "12D3KooWnewrow07",
                Some(7),
                Health::Healthy,
                "browser wasm cpu",
            ),
        ]);
        i.rows = [0, 1, 2, 7].map(node_core::mesh::RowHolders::new).to_vec();
        let rows = rows(&i);
        assert_eq!(
            rows.iter().map(|r| r.row).collect::<Vec<_>>(),
            vec![0, 1, 2, 7]
        );
        assert_eq!(rows[0].holders.len(), 2);
        assert_eq!(rows[0].lags(), "0, 2", "each holder's lag, the best first");
        assert_eq!(rows[1].lags(), "—");
        assert_eq!(rows[3].device(), "browser CPU");
    }

    #[test]
    fn devices_are_classified() {
        assert_eq!(DeviceKind::of("cpu"), DeviceKind::Cpu);
        assert_eq!(
            DeviceKind::of("browser WebGPU: SwiftShader"),
            DeviceKind::BrowserWebGpu
        );
        assert_eq!(DeviceKind::of("browser wasm cpu"), DeviceKind::BrowserCpu);
        assert_eq!(DeviceKind::of("llvmpipe (Vulkan)"), DeviceKind::Gpu);
    }

    #[test]
    fn tokens_per_s_latency_and_loss_follow_the_reported_requests() {
        let mut h = History::default();
        let mut i = info(vec![]);
        h.push(0.0, 0, 0, Some(&i));
        assert_eq!(h.latest().unwrap_or_default().tokens_per_s, 0.0);
        // Two requests of 5 + 15 tokens reported by t = 4 s: 2 s and 1 s, one trained.
        let req = |ms, loss| Usage::of_request(5, 15, std::time::Duration::from_millis(ms), loss);
        i.usage.add(&req(2000, Some(2.5)));
        i.usage.add(&req(1000, None));
        h.push(4.0, 0, 0, Some(&i));
        let s = h.latest().unwrap_or_default();
        assert_eq!(s.tokens_per_s, 10.0);
        assert_eq!((s.requests, s.latency_ms, s.loss), (2, 1500.0, 2.5));
        // Nothing new: the rate decays over the window; latency and loss stay the last seen.
        h.push(12.0, 0, 0, Some(&i));
        let s = h.latest().unwrap_or_default();
        assert_eq!(s.tokens_per_s, 40.0 / 12.0);
        assert_eq!((s.latency_ms, s.loss), (1500.0, 2.5));
        h.push(30.0, 0, 0, Some(&i));
        assert_eq!(h.latest().unwrap_or_default().tokens_per_s, 0.0);
        assert_eq!(h.latest().unwrap_or_default().trained_share, 0.5);
        // A node forgotten shrinks the totals: no negative rates.
        h.push(31.0, 0, 0, Some(&info(vec![])));
        assert_eq!(h.latest().unwrap_or_default().tokens_per_s, 0.0);
    }

    #[test]
    fn the_canary_loss_and_the_trained_share_follow_the_leaders_reports() {
        let mut h = History::default();
        let mut i = info(vec![]);
        h.push(0.0, 0, 0, Some(&i));
        let s = h.latest().unwrap_or_default();
        assert_eq!((s.canary_loss, s.trained_share, s.refused), (0.0, 0.0, 0));
        // Two updates judged (canary 3.0 and 3.5 after them, the second refused); three
        // requests finished, two trained on.
        i.usage.add(&Usage::of_gate(3.0, false));
        i.usage.add(&Usage::of_gate(3.5, true));
        let req = |loss| Usage::of_request(5, 15, std::time::Duration::from_millis(100), loss);
        for loss in [Some(2.0), Some(2.0), None] {
            i.usage.add(&req(loss));
        }
        h.push(2.0, 0, 0, Some(&i));
        let s = h.latest().unwrap_or_default();
        assert_eq!(s.canary_loss, 3.25);
        assert!((s.trained_share - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.refused, 1);
        // Nothing new: both stay as last seen.
        h.push(3.0, 0, 0, Some(&i));
        let s = h.latest().unwrap_or_default();
        assert_eq!(s.canary_loss, 3.25);
        assert!((s.trained_share - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn history_rates_come_from_counter_deltas_and_stay_bounded() {
        let mut h = History::default();
        h.push(0.0, 0, 0, None);
        h.push(2.0, 1000, 10, None);
        let s = h.latest().unwrap_or_default();
        assert_eq!(s.gossip_bytes_per_s, 500.0);
        assert_eq!(s.heartbeats_per_s, 5.0);
        for i in 0..500 {
            h.push(3.0 + i as f64, 2000 + i, 20, None);
        }
        assert_eq!(
            h.polyline(100.0, 10.0, |s| s.gossip_bytes_per_s)
                .split(' ')
                .count(),
            HISTORY_LEN
        );
    }
}
