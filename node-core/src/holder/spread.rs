//! Spreading a learning update through the holders instead of from its leader to each: the
//! leader signs the update's list of pieces and hands a notice of it to at most [`FANOUT`]
//! holders, each with its share of the others to pass on to; every holder pulls the pieces
//! from the holder that told it (or, that one failing, from the ones before it), checks each
//! against the signed list, passes the notice on at once and serves each piece as soon as it
//! has it. Written once for the native and the browser node over their [`Link`].
//!
//! Nothing a relaying peer does can change an update: a piece that does not hash to the signed
//! list is refused and its sender dropped, and the whole update is checked again (signature,
//! id, the mesh's rules) before it is applied. A holder the tree missed pulls the update when
//! it notices its version is behind ([`super::worth_catching_up`]).

use futures::future::Either;
use serde::{Deserialize, Serialize};

use super::{HolderError, Link, describe};
pub use crate::mesh::Notice;
use crate::mesh::{MeshRequest, MeshResponse};

/// Holders each holder (and the leader) passes a notice on to.
pub const FANOUT: usize = 3;

/// Bytes of a piece: the unit a holder checks and passes on as soon as it has it.
pub const PIECE_BYTES: u32 = 256 << 10;

/// Most peers a notice may name, whatever the mesh.
pub const MAX_NAMED: usize = 100_000;

/// Most peers a notice may name at a node whose view knows `live` live holders: each of them,
/// the sources a spread tree passes down, and room for holders the leader saw that this node
/// has not yet heard of.
pub fn named_bound(live: usize) -> usize {
    2 * live + 16
}

/// An update's pieces, as its leader signs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceList {
    /// The update's id (the hash of its payload).
    pub id: u64,
    /// Bytes of the signed update.
    pub total: u64,
    /// The hash of each [`PIECE_BYTES`] piece of the signed update, in order.
    pub digests: Vec<[u8; 32]>,
}

impl PieceList {
    /// The list of the signed update `sealed` with id `id`.
    pub fn of(id: u64, sealed: &[u8]) -> Self {
        Self {
            id,
            total: sealed.len() as u64,
            digests: sealed
                .chunks(PIECE_BYTES as usize)
                .map(|p| *blake3::hash(p).as_bytes())
                .collect(),
        }
    }

    /// Signs the list as the leader `signer`, with `header` (the update's own).
    pub fn seal(
        &self,
        signer: &crate::learn::Signer,
        header: crate::learn::Header,
    ) -> Result<Vec<u8>, HolderError> {
        let bytes = postcard::to_allocvec(self)
            .map_err(|e| HolderError::Download(format!("encoding a piece list: {e}")))?;
        Ok(crate::learn::seal(
            bytes,
            &signer.key,
            signer.cert.as_ref(),
            header,
        )?)
    }

    /// The signer and the list of signed bytes from the network, if the signature holds, the
    /// mesh admits the signer to write at `now_ms` (unix milliseconds) and the list is
    /// consistent with an update of at most `max_bytes` (the mesh's, [`super::Rules::max_sealed`]):
    /// what a stranger signs costs a holder no pull.
    pub fn open(
        bytes: &[u8],
        rules: &super::Rules,
        now_ms: u64,
    ) -> Result<(libp2p::PeerId, Self), HolderError> {
        let signed = crate::learn::open(bytes)?;
        let mesh = rules.mesh.as_ref().ok_or_else(|| {
            HolderError::Download("the mesh's manifest names no usable key".into())
        })?;
        signed
            .admitted(mesh, crate::learn::Power::Write, Some(now_ms / 1000))
            .map_err(|e| {
                super::Refused::count(
                    super::Refusal::Unadmitted,
                    format!("a notice's list signed by {}: {e}", signed.signer),
                )
            })?;
        let list: Self = postcard::from_bytes(&signed.payload)
            .map_err(|e| HolderError::Download(format!("not a piece list: {e}")))?;
        if list.total == 0 || list.total > rules.max_sealed {
            return Err(super::Refused::count(
                super::Refusal::Oversized,
                format!(
                    "a notice of {} bytes, over the {} an update of this mesh takes",
                    list.total, rules.max_sealed
                ),
            )
            .into());
        }
        if list.digests.len() as u64 != list.total.div_ceil(PIECE_BYTES as u64) {
            return Err(HolderError::Download(format!(
                "a piece list of {} digests for {} bytes",
                list.digests.len(),
                list.total
            )));
        }
        Ok((signed.signer, list))
    }

    /// Pieces in the update.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether the list has no piece (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// The first byte and the length of piece `i`.
    pub fn range(&self, i: usize) -> (u64, u32) {
        let start = i as u64 * PIECE_BYTES as u64;
        (
            start,
            (self.total.saturating_sub(start)).min(PIECE_BYTES as u64) as u32,
        )
    }

    /// Whether `bytes` is piece `i`.
    pub fn holds(&self, i: usize, bytes: &[u8]) -> bool {
        self.digests
            .get(i)
            .is_some_and(|d| bytes.len() as u32 == self.range(i).1 && blake3::hash(bytes) == *d)
    }

    /// The request for piece `i`.
    pub fn request(&self, i: usize) -> MeshRequest {
        let (offset, len) = self.range(i);
        MeshRequest::UpdateChunk {
            id: self.id,
            offset,
            len,
        }
    }
}

/// A notice checked: who signed its list, the list, and its peers parsed.
#[derive(Debug, Clone)]
pub struct Opened<P> {
    /// The list's signer.
    pub signer: libp2p::PeerId,
    /// The list.
    pub list: PieceList,
    /// The list's signed bytes, to pass on.
    pub list_bytes: Vec<u8>,
    /// Peers to pull from, nearest first.
    pub sources: Vec<P>,
    /// Holders to pass the notice on to.
    pub to: Vec<P>,
    /// The whole update, when it came with the notice.
    pub inline: Option<Vec<u8>>,
}

impl Notice {
    /// Checks a notice from the network: its list's signature, its signer's admission and
    /// its shape ([`PieceList::open`]), its peers (at most `max_named`: what the receiver's
    /// view of the live holders allows, [`named_bound`]), and the inline update's pieces.
    pub fn open<P: std::str::FromStr>(
        self,
        rules: &super::Rules,
        now_ms: u64,
        max_named: usize,
    ) -> Result<Opened<P>, HolderError> {
        let max_named = max_named.min(MAX_NAMED);
        if self.sources.len() + self.to.len() > max_named {
            let why = format!(
                "a notice naming {} peers, over the {max_named} this node knows to hold rows",
                self.sources.len() + self.to.len()
            );
            return Err(super::Refused::count(super::Refusal::Oversized, why).into());
        }
        let (signer, list) = PieceList::open(&self.list, rules, now_ms)?;
        if self.sources.is_empty() && self.inline.is_none() {
            return Err(HolderError::Download(
                "a notice with neither the update nor a peer to pull it from".into(),
            ));
        }
        let parse = |v: Vec<String>| -> Result<Vec<P>, HolderError> {
            v.iter()
                .map(|s| {
                    s.parse()
                        .map_err(|_| HolderError::Download(format!("not a peer id: {s:.60}")))
                })
                .collect()
        };
        if let Some(bytes) = &self.inline
            && (bytes.len() as u64 != list.total
                || (0..list.len()).any(|i| !list.holds(i, piece(&list, bytes, i))))
        {
            return Err(HolderError::Download(
                "the update in the notice does not match its signed piece list".into(),
            ));
        }
        Ok(Opened {
            signer,
            list,
            list_bytes: self.list,
            sources: parse(self.sources)?,
            to: parse(self.to)?,
            inline: self.inline,
        })
    }
}

/// Piece `i` of the whole update `bytes`.
fn piece<'a>(list: &PieceList, bytes: &'a [u8], i: usize) -> &'a [u8] {
    let (start, len) = list.range(i);
    &bytes[start as usize..start as usize + len as usize]
}

/// `to` dealt into at most `parts` shares, round robin: the first `parts` holders head the
/// shares, so the earlier a holder is in `to`, the sooner it hears.
pub fn deal<T: Clone>(to: &[T], parts: usize) -> Vec<Vec<T>> {
    let parts = parts.max(1).min(to.len());
    (0..parts)
        .map(|j| to.iter().skip(j).step_by(parts).cloned().collect())
        .collect()
}

/// What telling holders ([`tell`]) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Passed {
    /// Shares handed to a holder that took what was told.
    pub taken: usize,
    /// Holders that refused or could not be reached (their shares went to the next).
    pub failed: usize,
    /// Bytes of the update sent with the notices (none when the holders pull it).
    pub inline_bytes: u64,
}

/// Passes the notice of `list_bytes` on ([`tell`]): each holder told pulls from `sources`;
/// with `inline`, it gets the whole update with the notice.
pub async fn pass_on<L: Link>(
    link: &L,
    list_bytes: &[u8],
    sources: &[String],
    to: &[L::Peer],
    inline: Option<&[u8]>,
) -> Passed {
    let ask = |rest| {
        MeshRequest::Spread(Notice {
            list: list_bytes.to_vec(),
            sources: sources.to_vec(),
            to: rest,
            inline: inline.map(<[u8]>::to_vec),
        })
    };
    let bytes = inline.map_or(0, |b| b.len() as u64);
    tell(link, to, ask, bytes, "an update's notice").await
}

/// Passes a caught member's signed report on ([`tell`]) to the holders `to` names
/// (unreadable names are skipped).
pub async fn pass_report<L: Link>(link: &L, report: Vec<u8>, to: &[String]) -> Passed
where
    L::Peer: std::str::FromStr,
{
    let to: Vec<L::Peer> = to.iter().filter_map(|p| p.parse().ok()).collect();
    let ask = |rest| MeshRequest::Report {
        report: report.clone(),
        to: rest,
    };
    tell(link, &to, ask, 0, "a caught member's report").await
}

/// How long a holder told something ([`tell`]) has to answer, on top of its bytes at
/// [`crate::protocol::MIN_RATE`]: a holder answers once it has checked what it was told (it
/// passes it on after), so a hung holder holds up the rest of its share this long, not the
/// link's request timeout.
pub const NOTICE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Tells `to` something that spreads through them (`what`, for logs): `to` dealt into
/// [`FANOUT`] shares, each share's first holder asked `ask(the rest of its share)`, which it
/// passes on the same way; a holder that does not take it (an error, or no answer within
/// [`NOTICE_WAIT`] and its bytes) is skipped for the next in its share. `bytes` counts as sent
/// for each holder asked.
pub async fn tell<L: Link>(
    link: &L,
    to: &[L::Peer],
    ask: impl Fn(Vec<String>) -> MeshRequest,
    bytes: u64,
    what: &str,
) -> Passed {
    let wait = NOTICE_WAIT + crate::protocol::at_min_rate(bytes as usize);
    tell_within(link, to, ask, bytes, what, wait).await
}

/// [`tell`], each holder given `wait` to answer.
async fn tell_within<L: Link>(
    link: &L,
    to: &[L::Peer],
    ask: impl Fn(Vec<String>) -> MeshRequest,
    bytes: u64,
    what: &str,
    wait: std::time::Duration,
) -> Passed {
    let shares = deal(to, FANOUT);
    let ask = &ask;
    let tell = shares.iter().map(|share| async move {
        let mut passed = Passed::default();
        for (j, peer) in share.iter().enumerate() {
            let rest = share[j + 1..].iter().map(ToString::to_string).collect();
            passed.inline_bytes += bytes;
            let answer = std::pin::pin!(link.ask(peer, ask(rest)));
            let deadline = futures_timer::Delay::new(wait);
            match futures::future::select(answer, deadline).await {
                Either::Left((Ok(MeshResponse::Error(e)), _)) => {
                    tracing::warn!(%peer, "a holder did not take {what}: {e}")
                }
                Either::Left((Ok(_), _)) => {
                    passed.taken += 1;
                    return passed;
                }
                Either::Left((Err(e), _)) => {
                    tracing::warn!(%peer, "{what} did not reach a holder: {e}")
                }
                Either::Right(_) => tracing::warn!(
                    %peer,
                    "a holder did not answer {what} in {:.1} s: the next in its share is told",
                    wait.as_secs_f64()
                ),
            }
            passed.failed += 1;
        }
        passed
    });
    futures::future::join_all(tell)
        .await
        .into_iter()
        .fold(Passed::default(), |a, b| Passed {
            taken: a.taken + b.taken,
            failed: a.failed + b.failed,
            inline_bytes: a.inline_bytes + b.inline_bytes,
        })
}

/// Pieces a holder asks for at once while it pulls: the next piece is on its way while one
/// arrives, so a relay's pipeline does not stall a round trip a piece.
pub const PULL_WINDOW: usize = 2;

/// Pulls every piece of `list` from `sources`, [`PULL_WINDOW`] at a time, checking each
/// against the list; a source that fails or serves a bad piece is dropped for the next (for
/// every piece after it). `got(i, piece)` sees each piece in order as it is checked. Returns
/// the whole update and the sources dropped.
pub async fn pull<L: Link>(
    link: &L,
    list: &PieceList,
    sources: &[L::Peer],
    mut got: impl FnMut(usize, &[u8]),
) -> Result<(Vec<u8>, Vec<L::Peer>), HolderError> {
    use futures::StreamExt;
    let at = std::sync::atomic::AtomicUsize::new(0);
    let at = &at;
    let one = |i: usize| async move {
        let mut why = String::from("no peer to pull from");
        loop {
            let s = at.load(std::sync::atomic::Ordering::Relaxed);
            let Some(peer) = sources.get(s) else {
                return Err(HolderError::Download(format!(
                    "piece {i} of update {:016x}: {why}",
                    list.id
                )));
            };
            match link.ask(peer, list.request(i)).await {
                Ok(MeshResponse::Chunk { total, bytes, .. })
                    if total == list.total && list.holds(i, &bytes) =>
                {
                    return Ok(bytes);
                }
                Ok(MeshResponse::Chunk { .. }) => {
                    why = format!("{peer} served a piece that does not match the signed list");
                    tracing::warn!("dropping a peer as a source of updates: {why}");
                }
                Ok(other) => {
                    why = match other {
                        MeshResponse::Error(e) => format!("{peer}: {e}"),
                        other => format!("{peer} answered with a {}", describe(&other)),
                    };
                    tracing::debug!("pulling a piece: {why}");
                }
                Err(e) => why = e.to_string(),
            }
            // Drops the source unless a piece pulled beside this one already did.
            let _ = at.compare_exchange(
                s,
                s + 1,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    };
    let mut pieces = futures::stream::iter(0..list.len())
        .map(one)
        .buffered(PULL_WINDOW);
    let mut out = Vec::with_capacity(list.total as usize);
    let mut i = 0;
    while let Some(piece) = pieces.next().await {
        let piece = piece?;
        got(i, &piece);
        out.extend_from_slice(&piece);
        i += 1;
    }
    let dropped = at.load(std::sync::atomic::Ordering::Relaxed);
    Ok((out, sources[..dropped.min(sources.len())].to_vec()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    /// Peers in memory, each serving the pieces of its own copy of an update (maybe altered),
    /// and recording the notices it was given.
    struct Peers {
        copies: HashMap<u32, Vec<u8>>,
        refuse: Vec<u32>,
        /// Peers that never answer (a SIGSTOPped holder).
        hang: Vec<u32>,
        told: Mutex<Vec<(u32, Notice)>>,
        reported: Mutex<Vec<(u32, Vec<String>)>>,
        asked: Mutex<Vec<u32>>,
    }

    impl Link for Peers {
        type Peer = u32;

        async fn ask(&self, peer: &u32, request: MeshRequest) -> Result<MeshResponse, HolderError> {
            self.asked.lock().unwrap().push(*peer);
            if self.hang.contains(peer) {
                return futures::future::pending().await;
            }
            match request {
                MeshRequest::Spread(n) if self.refuse.contains(peer) => {
                    drop(n);
                    Err(HolderError::Link(format!("{peer} is gone")))
                }
                MeshRequest::Spread(n) => {
                    self.told.lock().unwrap().push((*peer, n));
                    Ok(MeshResponse::Spreading { id: 1 })
                }
                MeshRequest::Report { to, .. } => {
                    self.reported.lock().unwrap().push((*peer, to));
                    Ok(MeshResponse::Reported)
                }
                MeshRequest::UpdateChunk { offset, len, .. } => {
                    let Some(b) = self.copies.get(peer) else {
                        return Ok(MeshResponse::Error("not here".into()));
                    };
                    let end = (offset as usize + len as usize).min(b.len());
                    Ok(MeshResponse::Chunk {
                        total: b.len() as u64,
                        version: [0; 32],
                        bytes: b[offset as usize..end].to_vec(),
                    })
                }
                _ => Ok(MeshResponse::Error("unexpected".into())),
            }
        }

        async fn dial(&self, src: &crate::mesh::SourceRow) -> Result<u32, HolderError> {
            Err(HolderError::Link(format!("no dialing here ({})", src.peer)))
        }

        async fn blocking<R: Send + 'static>(
            &self,
            work: impl FnOnce() -> R + Send + 'static,
        ) -> R {
            work()
        }

        fn progress(&self, _: &str, _: u64, _: u64) {}
    }

    fn update() -> Vec<u8> {
        (0..PIECE_BYTES as usize * 2 + 1000)
            .map(|i| (i * 7 % 251) as u8)
            .collect()
    }

    fn peers(copies: &[(u32, Vec<u8>)], refuse: &[u32]) -> Peers {
        Peers {
            copies: copies.iter().cloned().collect(),
            refuse: refuse.to_vec(),
            hang: Vec::new(),
            told: Mutex::default(),
            reported: Mutex::default(),
            asked: Mutex::default(),
        }
    }

    /// A mesh's rules for lists of updates up to a MiB, its key, and a trainer it admits.
    fn admitted() -> (super::super::Rules, crate::learn::Signer) {
        let mesh = libp2p::identity::Keypair::generate_ed25519();
        let key = libp2p::identity::Keypair::generate_ed25519();
        let cert = crate::learn::Certificate::issue(
            &mesh,
            key.public().to_peer_id(),
            "trainer",
            1,
            u64::MAX,
            &[crate::learn::Power::Write],
        )
        .unwrap();
        let rules = super::super::Rules {
            cfg: crate::model::LlamaConfig::small(),
            learning: crate::learn::LearningConfig::default(),
            format: crate::coded::ShardFormat::F32,
            mesh: Some(crate::learn::MeshKey::of(&mesh)),
            canary: None,
            max_sealed: 1 << 20,
        };
        let signer = crate::learn::Signer {
            key,
            cert: Some(cert),
        };
        (rules, signer)
    }

    const NOW: u64 = 1_800_000_000_000;

    fn now() -> crate::learn::Header {
        crate::learn::Header {
            issued_ms: NOW,
            verdict: None,
        }
    }

    #[test]
    fn a_list_is_signed_and_any_change_to_it_is_refused() {
        let (rules, signer) = admitted();
        let u = update();
        let list = PieceList::of(9, &u);
        assert_eq!(list.len(), 3);
        assert_eq!(list.range(2), (2 * PIECE_BYTES as u64, 1000));
        let sealed = list.seal(&signer, now()).unwrap();
        let (by, back) = PieceList::open(&sealed, &rules, NOW).unwrap();
        assert_eq!((by, &back), (signer.key.public().to_peer_id(), &list));
        let mut bad = sealed.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(PieceList::open(&bad, &rules, NOW).is_err());
        let mut short = list.clone();
        short.digests.pop();
        let short = short.seal(&signer, now()).unwrap();
        assert!(PieceList::open(&short, &rules, NOW).is_err());
        // A stranger's list costs a holder nothing: refused before a piece is pulled.
        let stranger =
            crate::learn::Signer::unadmitted(libp2p::identity::Keypair::generate_ed25519());
        let theirs = list.seal(&stranger, now()).unwrap();
        let err = PieceList::open(&theirs, &rules, NOW).unwrap_err();
        assert!(err.to_string().contains("unadmitted"), "{err}");
        // A list of an update larger than the mesh's updates: refused before it is pulled.
        let mut huge = PieceList::of(9, &vec![0u8; (2 << 20) + 1]);
        huge.id = 10;
        let huge = huge.seal(&signer, now()).unwrap();
        let err = PieceList::open(&huge, &rules, NOW).unwrap_err();
        assert!(err.to_string().contains("oversized"), "{err}");
    }

    #[test]
    fn an_inline_update_must_match_its_list_and_a_notice_name_no_more_than_the_live_holders() {
        let (rules, signer) = admitted();
        let u = update();
        let list = PieceList::of(9, &u).seal(&signer, now()).unwrap();
        let notice = |inline: Vec<u8>| Notice {
            list: list.clone(),
            sources: Vec::new(),
            to: vec!["3".into()],
            inline: Some(inline),
        };
        let open = |n: Notice| n.open::<u32>(&rules, NOW, named_bound(4));
        let opened: Opened<u32> = open(notice(u.clone())).unwrap();
        assert_eq!(opened.to, [3]);
        let mut changed = u.clone();
        changed[PIECE_BYTES as usize + 5] ^= 1;
        assert!(open(notice(changed)).is_err());
        let mut many = notice(u.clone());
        many.to = (0..=named_bound(4)).map(|i| i.to_string()).collect();
        let err = open(many).unwrap_err();
        assert!(err.to_string().contains("this node knows"), "{err}");
        let mut n = notice(u);
        n.inline = None;
        assert!(open(n).is_err(), "nothing to pull from");
    }

    #[test]
    fn shares_are_dealt_round_robin_so_the_first_holders_hear_first() {
        let to: Vec<u32> = (0..8).collect();
        assert_eq!(
            deal(&to, 3),
            [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5]],
            "the first three head the shares"
        );
        assert_eq!(deal(&to[..2], 3), [vec![0], vec![1]]);
        assert!(deal::<u32>(&[], 3).is_empty());
    }

    #[test]
    fn a_notice_skips_a_holder_that_does_not_take_it() {
        let link = peers(&[], &[1]);
        let to: Vec<u32> = (0..7).collect();
        let passed = futures::executor::block_on(pass_on(&link, b"list", &["9".into()], &to, None));
        assert_eq!(
            passed,
            Passed {
                taken: 3,
                failed: 1,
                inline_bytes: 0
            }
        );
        assert_eq!(
            heads(link),
            one_skipped(),
            "holder 1 is gone: holder 4, next in its share, takes the rest of it"
        );
    }

    /// Each holder told and the rest of its share it was to pass on to, by holder.
    fn heads(link: Peers) -> Vec<(u32, Vec<String>)> {
        let mut told = link.told.into_inner().unwrap();
        told.sort_by_key(|t| t.0);
        told.into_iter().map(|(p, n)| (p, n.to)).collect()
    }

    /// [`heads`] of seven holders when holder 1 does not take what it is told.
    fn one_skipped() -> Vec<(u32, Vec<String>)> {
        vec![
            (0, vec!["3".to_string(), "6".into()]),
            (2, vec!["5".into()]),
            (4, Vec::new()),
        ]
    }

    #[test]
    fn a_holder_that_never_answers_holds_up_its_share_only_until_the_wait() {
        let link = Peers {
            hang: vec![1],
            ..peers(&[], &[])
        };
        let to: Vec<u32> = (0..7).collect();
        let ask = |rest| {
            MeshRequest::Spread(Notice {
                list: b"list".to_vec(),
                sources: Vec::new(),
                to: rest,
                inline: None,
            })
        };
        let wait = std::time::Duration::from_millis(200);
        let started = std::time::Instant::now();
        let passed = futures::executor::block_on(tell_within(&link, &to, ask, 0, "a test", wait));
        let took = started.elapsed();
        assert_eq!((passed.taken, passed.failed), (3, 1));
        assert_eq!(
            heads(link),
            one_skipped(),
            "holder 1 never answers: holder 4, next in its share, takes the rest of it"
        );
        // It returned at all: holder 1's answer never comes.
        assert!(
            took >= wait,
            "the share moved on after {took:?}, before the wait"
        );
    }

    #[test]
    fn a_report_is_passed_on_through_shares_and_unreadable_names_are_skipped() {
        let link = peers(&[], &[]);
        let to = ["4", "five", "6", "7", "8"].map(String::from);
        let passed = futures::executor::block_on(pass_report(&link, b"signed".to_vec(), &to));
        assert_eq!(passed.taken, 3);
        let mut reported = link.reported.into_inner().unwrap();
        reported.sort();
        assert_eq!(
            reported,
            [(4, vec!["8".to_string()]), (6, Vec::new()), (7, Vec::new())],
            "holder 4 passes it on to 8; \"five\" names no peer"
        );
    }

    #[test]
    fn a_source_serving_a_bad_piece_is_dropped_for_the_next() {
        let u = update();
        let list = PieceList::of(9, &u);
        let mut bad = u.clone();
        bad[PIECE_BYTES as usize + 1] ^= 0xff;
        let link = peers(&[(5, bad), (6, u.clone())], &[]);
        let mut seen = Vec::new();
        let (got, dropped) =
            futures::executor::block_on(pull(&link, &list, &[5, 6], |i, _| seen.push(i))).unwrap();
        assert_eq!(got, u);
        assert_eq!(dropped, [5]);
        assert_eq!(seen, [0, 1, 2]);
        let asked = link.asked.into_inner().unwrap();
        assert!(asked.contains(&6), "{asked:?}");
        assert!(
            asked.iter().filter(|&&p| p == 5).count() <= 3,
            "the bad source is asked no more after its bad piece: {asked:?}"
        );
        let link = peers(&[(5, u.clone())], &[]);
        let mut cut = u;
        cut.truncate(10);
        let lying = peers(&[(5, cut)], &[]);
        let e = futures::executor::block_on(pull(&lying, &list, &[5], |_, _| {})).unwrap_err();
        assert!(e.to_string().contains("piece 0"), "{e}");
        assert!(futures::executor::block_on(pull(&link, &list, &[5], |_, _| {})).is_ok());
    }
}
