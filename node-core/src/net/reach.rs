//! Whether peers can reach this node, and how it is connected to each peer: what AutoNAT found
//! out about its addresses, the relay circuits it listens on, and which connections are
//! direct, direct after hole punching (DCUtR) or relayed.

use std::collections::{BTreeSet, HashMap};

use libp2p::core::ConnectedPoint;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

pub use crate::mesh::Reach;

/// How this node is connected to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Path {
    /// Through a relay.
    Relayed,
    /// Directly, dialed by one side.
    Direct,
    /// Directly, made by hole punching from a relayed connection.
    Punched,
}

/// Whether an address goes through a relay.
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

/// The addresses a node announces of `addrs`: a relay lists all of its addresses in a
/// reservation, loopback ones too, and a circuit through a relay's loopback address sends a
/// peer to its own machine; such circuits are left out where a circuit through another address
/// is there (on one machine they are the only ones, and right).
pub fn announced(addrs: &[Multiaddr]) -> Vec<Multiaddr> {
    let local_circuit = |a: &Multiaddr| relay_of(a).is_some_and(|r| is_private(&r));
    let far = addrs.iter().any(|a| is_relayed(a) && !local_circuit(a));
    addrs
        .iter()
        .filter(|a| !(far && local_circuit(a)))
        .cloned()
        .collect()
}

/// Of `addrs` a peer announces, those to dial it at:
/// - its loopback addresses only where it has no other: a dial takes the first connection
///   made, and a loopback one reaches whoever listens on that port of the dialer's machine
///   (the dialer itself, on the same port) and fails the whole dial on the wrong peer id;
/// - each relay's first circuit only: a circuit through a relay this node is connected to goes
///   over that connection whatever the relay's address, and a relay takes only a few circuit
///   requests at once from a peer (libp2p-relay: 10), which one dial at every address of a
///   relay would fill.
pub fn to_dial(addrs: Vec<Multiaddr>) -> Vec<Multiaddr> {
    let elsewhere = addrs.iter().any(|a| !is_loopback(a));
    let mut relays = std::collections::HashSet::new();
    addrs
        .into_iter()
        .filter(|a| !(elsewhere && is_loopback(a)))
        .filter(|a| {
            let relay = relay_of(a).and_then(|r| match r.iter().last() {
                Some(Protocol::P2p(peer)) => Some(peer),
                _ => None,
            });
            relay.is_none_or(|peer| relays.insert(peer))
        })
        .collect()
}

/// The relay's own address in a relay circuit (what comes before `/p2p-circuit`, naming the
/// relay's peer id), or `None` for an address that is not a circuit through a named relay.
pub fn relay_of(addr: &Multiaddr) -> Option<Multiaddr> {
    let relay: Multiaddr = addr
        .iter()
        .take_while(|p| *p != Protocol::P2pCircuit)
        .collect();
    let named = matches!(relay.iter().last(), Some(Protocol::P2p(_)));
    (is_relayed(addr) && named).then_some(relay)
}

/// The first IP address an address names (`None` for a name or a bare peer).
pub fn ip_of(addr: &Multiaddr) -> Option<std::net::IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(ip.into()),
        Protocol::Ip6(ip) => Some(ip.into()),
        _ => None,
    })
}

/// Whether a member is on another machine, by the addresses it announces (`addrs`) and this
/// machine's own interface addresses (`own`): it is not where it names no IP address but
/// loopback ones (names say nothing), or where one it names is this machine's. A node listening
/// on every interface announces its loopback address too, so one loopback address says nothing.
pub fn off_this_machine(addrs: &[Multiaddr], own: &[std::net::IpAddr]) -> bool {
    let ips: Vec<std::net::IpAddr> = addrs.iter().filter_map(ip_of).collect();
    let mut elsewhere = ips.iter().filter(|ip| !ip.is_loopback()).peekable();
    elsewhere.peek().is_some() && elsewhere.all(|ip| !own.contains(ip))
}

/// Whether an address is on this machine only.
pub fn is_loopback(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_loopback(),
        Protocol::Ip6(ip) => ip.is_loopback(),
        _ => false,
    })
}

/// Whether an address is on a private network (RFC 1918, shared 100.64/10, link-local, IPv6
/// unique-local) or this machine: dialable on its own network at most.
pub fn is_private(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => {
            let o = ip.octets();
            ip.is_private()
                || ip.is_loopback()
                || ip.is_link_local()
                || ip.is_unspecified()
                || (o[0] == 100 && (64..128).contains(&o[1]))
        }
        Protocol::Ip6(ip) => {
            let s = ip.segments()[0];
            ip.is_loopback()
                || ip.is_unspecified()
                || (s & 0xfe00) == 0xfc00
                || (s & 0xffc0) == 0xfe80
        }
        _ => false,
    })
}

/// What a node knows of its reachability and its connections.
#[derive(Debug, Default)]
pub struct Reachability {
    /// Addresses AutoNAT confirmed (or given as external).
    confirmed: BTreeSet<Multiaddr>,
    /// Relay circuits it listens on.
    circuits: BTreeSet<Multiaddr>,
    /// Addresses AutoNAT found peers could not dial.
    refuted: BTreeSet<Multiaddr>,
    /// Open connections: peer and path.
    conns: HashMap<ConnectionId, (PeerId, Path)>,
    /// Connections hole punching reported before the swarm reported them open.
    punched_early: BTreeSet<ConnectionId>,
    /// Public peers this node dialed (its bootstrap first): the relays it may reserve a slot
    /// on when peers cannot dial it.
    relays: Vec<Multiaddr>,
}

impl Reachability {
    /// Whether peers dial it: AutoNAT confirmed a public address, or a private one (its own
    /// network) while no public address of it was found undialable.
    fn public(&self) -> bool {
        let lan = |a: &&Multiaddr| is_private(a) && !is_loopback(a);
        self.confirmed.iter().any(|a| !is_private(a))
            || (self.confirmed.iter().any(|a| lan(&a)) && self.refuted.iter().all(is_private))
    }

    /// What it reports about itself.
    pub fn reach(&self) -> Reach {
        if self.public() {
            Reach::Public
        } else if self.conns.values().any(|(_, p)| *p == Path::Punched) {
            Reach::Punched
        } else if !self.circuits.is_empty() {
            Reach::Relayed
        } else if !self.refuted.is_empty() {
            Reach::Private
        } else {
            Reach::Unknown
        }
    }

    /// Whether it should reserve a slot on a relay: it is not public, AutoNAT found an
    /// address of it that peers cannot dial, and it has no circuit yet.
    pub fn needs_relay(&self) -> bool {
        !self.public() && !self.refuted.is_empty() && self.circuits.is_empty()
    }

    /// The addresses peers may reach it at: confirmed ones and relay circuits.
    pub fn addrs(&self) -> impl Iterator<Item = &Multiaddr> {
        self.confirmed.iter().chain(&self.circuits)
    }

    /// The relays it may reserve a slot on, in the order it dialed them.
    pub fn relays(&self) -> &[Multiaddr] {
        &self.relays
    }

    /// A dial of `addr` reached `peer`: a public address is a relay it may use.
    pub fn dialed(&mut self, addr: &Multiaddr, peer: PeerId) {
        if is_relayed(addr) || is_private(addr) {
            return;
        }
        let addr = addr.clone().with_p2p(peer).unwrap_or_else(|a| a);
        if !self.relays.contains(&addr) {
            self.relays.push(addr);
        }
    }

    /// The best path to `peer` over its open connections.
    #[cfg(test)]
    fn path(&self, peer: &PeerId) -> Option<Path> {
        self.conns
            .values()
            .filter(|(p, _)| p == peer)
            .map(|(_, path)| *path)
            .max()
    }

    /// Every open connection's peer and path.
    pub fn connections(&self) -> Vec<(PeerId, Path)> {
        let mut out: Vec<_> = self.conns.values().copied().collect();
        out.sort_by_key(|(p, path)| (p.to_bytes(), *path));
        out
    }

    /// An address became external (AutoNAT, given, or a relay circuit the relay accepted).
    pub fn confirmed(&mut self, addr: Multiaddr) {
        if is_relayed(&addr) {
            self.circuits.insert(addr);
            return;
        }
        self.refuted.remove(&addr);
        self.confirmed.insert(addr);
    }

    /// An external address expired.
    pub fn expired(&mut self, addr: &Multiaddr) {
        self.confirmed.remove(addr);
        self.circuits.remove(addr);
    }

    /// AutoNAT found that peers cannot dial `addr`.
    pub fn refuted(&mut self, addr: Multiaddr) {
        if !self.confirmed.contains(&addr) {
            self.refuted.insert(addr);
        }
    }

    /// The swarm listens on `addr` (a relay circuit counts as a way to reach it).
    pub fn listening(&mut self, addr: Multiaddr) {
        if is_relayed(&addr) {
            self.circuits.insert(addr);
        }
    }

    /// The swarm stopped listening on `addr`.
    pub fn listen_expired(&mut self, addr: &Multiaddr) {
        self.circuits.remove(addr);
    }

    /// A connection opened.
    pub fn connected(&mut self, id: ConnectionId, peer: PeerId, endpoint: &ConnectedPoint) {
        let path = if endpoint.is_relayed() {
            Path::Relayed
        } else if self.punched_early.remove(&id) {
            Path::Punched
        } else {
            Path::Direct
        };
        self.conns.insert(id, (peer, path));
    }

    /// Hole punching made connection `id` (a direct one) from a relayed one.
    pub fn punched(&mut self, id: ConnectionId) {
        match self.conns.get_mut(&id) {
            Some((_, path)) => *path = Path::Punched,
            None => {
                self.punched_early.insert(id);
            }
        }
    }

    /// A connection closed.
    pub fn closed(&mut self, id: ConnectionId) {
        self.conns.remove(&id);
        self.punched_early.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_circuit_names_its_relay() {
        let relay =
            "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
        let circuit = addr(&format!(
            "{relay}/p2p-circuit/p2p/12D3KooWQaUQ7bBGTVRCcZbvcfRPHcKobku7EmoERWQQwXVogwLo"
        ));
        assert_eq!(relay_of(&circuit), Some(addr(relay)));
        assert_eq!(relay_of(&addr(relay)), None, "not a circuit");
        let anonymous = addr("/ip4/127.0.0.1/tcp/4001/p2p-circuit");
        assert_eq!(
            relay_of(&anonymous),
            None,
            "a circuit through no named relay"
        );
    }

    #[test]
    fn circuits_through_a_relays_loopback_address_are_announced_only_alone() {
        let relay = "p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit";
        let local = addr(&format!("/ip4/127.0.0.1/tcp/4001/{relay}"));
        let lan = addr(&format!("/ip4/192.168.1.2/tcp/4001/{relay}"));
        let public = addr(&format!("/ip4/198.19.1.2/tcp/4001/{relay}"));
        let own = addr("/ip4/127.0.0.1/udp/4001/quic-v1");
        assert_eq!(
            announced(&[local.clone(), lan.clone(), public.clone(), own.clone()]),
            [public, own.clone()],
            "the relay's own loopback and private addresses are left out"
        );
        assert_eq!(
            announced(&[local.clone(), own.clone()]),
            [local, own],
            "on one machine the loopback circuit is the way"
        );
    }

    #[test]
    fn a_peer_is_dialed_through_each_relay_once_and_at_loopback_only_when_nowhere_else() {
        let (a, b) = (
            "p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
            "p2p/12D3KooWQaUQ7bBGTVRCcZbvcfRPHcKobku7EmoERWQQwXVogwLo/p2p-circuit",
        );
        let a_tcp = addr(&format!("/ip4/198.19.1.2/tcp/4001/{a}"));
        let a_quic = addr(&format!("/ip4/198.19.1.2/udp/4001/quic-v1/{a}"));
        let b_tcp = addr(&format!("/ip4/198.19.1.3/tcp/4001/{b}"));
        let direct = addr("/ip4/192.168.2.2/udp/4001/quic-v1");
        let local = addr("/ip4/127.0.0.1/udp/4001/quic-v1");
        let all = vec![
            local.clone(),
            a_tcp.clone(),
            a_quic,
            direct.clone(),
            b_tcp.clone(),
        ];
        assert_eq!(to_dial(all), [a_tcp, direct, b_tcp]);
        assert_eq!(
            to_dial(vec![local.clone()]),
            [local],
            "a peer on this machine only"
        );
    }

    #[test]
    fn a_refuted_node_wants_a_relay_then_reports_relayed_then_punched() {
        let mut r = Reachability::default();
        assert_eq!(r.reach(), Reach::Unknown);
        assert!(!r.needs_relay());
        r.refuted(addr("/ip4/198.18.2.2/udp/4001/quic-v1"));
        assert_eq!(r.reach(), Reach::Private);
        assert!(r.needs_relay());
        let circuit = addr(
            "/ip4/10.101.0.2/udp/1/quic-v1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
        );
        // The relay client reports an accepted circuit as an external address.
        r.confirmed(circuit.clone());
        r.listening(circuit.clone());
        assert!(!r.needs_relay());
        assert_eq!(r.reach(), Reach::Relayed);
        assert_eq!(r.addrs().collect::<Vec<_>>(), vec![&circuit]);
        let peer = PeerId::random();
        let relayed = ConnectedPoint::Listener {
            local_addr: circuit.clone(),
            send_back_addr: addr("/p2p-circuit"),
        };
        let direct = ConnectedPoint::Dialer {
            address: addr("/ip4/10.101.0.3/udp/4001/quic-v1"),
            role_override: libp2p::core::Endpoint::Listener,
            port_use: libp2p::core::transport::PortUse::Reuse,
        };
        let (a, b) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        );
        r.connected(a, peer, &relayed);
        assert_eq!(r.path(&peer), Some(Path::Relayed));
        r.connected(b, peer, &direct);
        r.punched(b);
        assert_eq!(r.path(&peer), Some(Path::Punched));
        assert_eq!(r.reach(), Reach::Punched);
        r.closed(b);
        assert_eq!(r.reach(), Reach::Relayed);
        r.confirmed(addr("/ip4/198.18.2.2/udp/4001/quic-v1"));
        assert_eq!(r.reach(), Reach::Public);
    }

    #[test]
    fn an_address_only_its_own_network_dials_does_not_make_it_public() {
        let mut r = Reachability::default();
        r.confirmed(addr("/ip4/192.168.3.3/udp/4001/quic-v1"));
        assert_eq!(r.reach(), Reach::Public, "a LAN mesh");
        r.refuted(addr("/ip4/198.18.3.2/udp/4001/quic-v1"));
        assert_eq!(r.reach(), Reach::Private, "behind NAT to the internet");
        assert!(r.needs_relay());
        r.confirmed(addr("/ip4/198.18.3.2/udp/4001/quic-v1"));
        assert_eq!(r.reach(), Reach::Public);
    }

    #[test]
    fn loopback_addresses_do_not_make_a_node_public() {
        let mut r = Reachability::default();
        r.confirmed(addr("/ip4/127.0.0.1/tcp/4001"));
        assert_eq!(r.reach(), Reach::Unknown);
        r.refuted(addr("/ip4/198.18.2.2/tcp/4001"));
        assert!(r.needs_relay());
    }

    #[test]
    fn a_member_is_far_where_no_address_it_announces_is_this_machines() {
        let at = |s: &str| s.parse::<Multiaddr>().unwrap();
        let own: Vec<std::net::IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        assert!(off_this_machine(&[at("/ip4/10.0.0.2/tcp/4001")], &own));
        assert!(!off_this_machine(&[at("/ip4/127.0.0.1/tcp/4001")], &own));
        // Listening on every interface announces loopback too: another machine all the same.
        let lab = [at("/ip4/10.0.0.2/tcp/4001"), at("/ip6/::1/tcp/4001")];
        assert!(off_this_machine(&lab, &own));
        // A node of this machine listening on every interface.
        let here = [at("/ip4/10.0.0.1/tcp/4002"), at("/ip4/127.0.0.1/tcp/4002")];
        assert!(!off_this_machine(&here, &own));
        // A circuit through a relay on this machine (a browser beside its node), or far away.
        let relay = "p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit";
        assert!(!off_this_machine(
            &[at(&format!("/ip4/127.0.0.1/tcp/4001/{relay}"))],
            &own
        ));
        assert!(off_this_machine(
            &[at(&format!("/ip4/198.19.1.2/udp/1/quic-v1/{relay}"))],
            &own
        ));
        // A name or nothing at all says nothing.
        assert!(!off_this_machine(&[at("/dns4/example.org/tcp/4001")], &own));
        assert!(
            !off_this_machine(&[], &own),
            "nothing known of a member says nothing"
        );
    }
}
