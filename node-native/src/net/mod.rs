//! The libp2p network: the swarm and its client ([`swarm`]), requests to peers ([`rpc`]),
//! and the reachability probe ([`probe`]).

pub mod probe;
pub mod rpc;
pub mod swarm;

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use node_core::net::reach::ip_of;

/// This machine's interface addresses (none where they cannot be read: every member with an
/// address off loopback then counts as far).
pub fn this_machine() -> Vec<std::net::IpAddr> {
    match if_addrs::get_if_addrs() {
        Ok(ifs) => ifs.into_iter().map(|i| i.ip()).collect(),
        Err(e) => {
            tracing::debug!("reading this machine's addresses: {e}");
            Vec::new()
        }
    }
}

/// Whether the swarm reported an address for every one `listen` asks for: one per address of
/// this machine (`ips`) of its family for an unspecified IP (`0.0.0.0`, `::`), else one.
/// Each interface's address of a listener comes on its own, so fewer than that are a race.
pub fn every_listener_reported(
    listen: &[Multiaddr],
    addrs: &[Multiaddr],
    ips: &[std::net::IpAddr],
) -> bool {
    listen.iter().all(|spec| {
        let form = shape(spec);
        let reported =
            |ip: Option<std::net::IpAddr>| addrs.iter().any(|a| ip_of(a) == ip && shape(a) == form);
        match ip_of(spec) {
            None => addrs.iter().any(|a| shape(a) == form),
            Some(ip) if ip.is_unspecified() => (ips.iter())
                .filter(|i| i.is_ipv4() == ip.is_ipv4())
                .all(|i| reported(Some(*i))),
            Some(ip) => reported(Some(ip)),
        }
    })
}

/// An address's transports without their values (`tcp`, `udp`, `quic-v1`, `ws`…), leaving out
/// its IP, its certificate hashes and its peer.
fn shape(a: &Multiaddr) -> Vec<&'static str> {
    a.iter()
        .filter(|p| {
            !matches!(
                p,
                Protocol::Ip4(_) | Protocol::Ip6(_) | Protocol::Certhash(_) | Protocol::P2p(_)
            )
        })
        .map(|p| p.tag())
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    /// The lab's "no /quic-v1/ address at 198.19.4.2": a node printed its addresses once it
    /// had as many as it listens on, before QUIC's second interface was reported.
    #[test]
    fn a_wildcard_listener_is_reported_once_every_interface_has_its_address() {
        let a = |s: &str| -> Multiaddr { s.parse().unwrap() };
        let listen = [
            a("/ip4/0.0.0.0/tcp/0"),
            a("/ip4/0.0.0.0/udp/0/quic-v1"),
            a("/ip4/0.0.0.0/tcp/0/ws"),
        ];
        let ips: Vec<std::net::IpAddr> =
            vec!["127.0.0.1".parse().unwrap(), "198.19.4.2".parse().unwrap()];
        let mut addrs = vec![
            a("/ip4/127.0.0.1/tcp/33633"),
            a("/ip4/198.19.4.2/tcp/33633"),
            a("/ip4/127.0.0.1/udp/50014/quic-v1"),
            a("/ip4/127.0.0.1/tcp/43517/ws"),
            a("/ip4/198.19.4.2/tcp/43517/ws"),
        ];
        assert!(
            !every_listener_reported(&listen, &addrs, &ips),
            "QUIC at 198.19.4.2 is missing"
        );
        addrs.push(a("/ip4/198.19.4.2/udp/50014/quic-v1"));
        assert!(every_listener_reported(&listen, &addrs, &ips));
        // A listener on one address needs only it; an IPv6 machine address is not an IPv4 one.
        let one = [a("/ip4/127.0.0.1/udp/0/quic-v1")];
        let with_v6 = [ips.clone(), vec!["::1".parse().unwrap()]].concat();
        assert!(every_listener_reported(&one, &addrs[2..3], &with_v6));
        assert!(every_listener_reported(&listen, &addrs, &with_v6));
        // TCP is not WebSocket.
        assert!(!every_listener_reported(&listen[2..], &addrs[..2], &ips));
    }
}
