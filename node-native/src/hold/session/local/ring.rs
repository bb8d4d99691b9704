//! A polling local session's frames through memory both processes map: a ring each way, so a
//! frame that comes while the other side polls costs no system call on either side. The Unix
//! socket stays as the doorbell: a side about to sleep says so in the shared memory, and the
//! other writes a byte on the socket once it has put bytes in (or taken them out) for it.
//!
//! The leader makes the memory (a sealed memfd that cannot shrink, so the member cannot make
//! the leader's reads fault, nor the leader the member's) and hands it over on the socket. Each
//! side keeps its own positions: the shared copies are only published, and what the other side
//! publishes is checked against the ring's size before a byte is copied. A dishonest side can
//! write garbage into its own frames or stop, as it could on a socket, and no more.

use std::io::{self, IoSlice, IoSliceMut};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// Bytes of each way's ring: an LM head's answer (98 KB for SmolLM2 at k = 2) fits whole;
/// larger frames (a long prompt's) stream through it.
pub const RING_BYTES: usize = 256 << 10;

/// A way's positions and flags, each on a cache line of its own.
const LINE: usize = 128;

/// The page before the rings that holds both ways' positions and flags.
const HEADER: usize = 4096;

/// Bytes of a session's shared memory.
pub const BYTES: usize = HEADER + 2 * RING_BYTES;

/// Where a way's fields lie in its part of the header.
const WRITTEN: usize = 0;
const READ: usize = LINE;
const READER_ASLEEP: usize = 2 * LINE;
const WRITER_ASLEEP: usize = 3 * LINE;

/// Most descriptors one message on a Unix socket carries (Linux's `SCM_MAX_FD`): room for all
/// of them, so none is received past the buffer and left open.
const MAX_FDS: usize = 253;

/// The two ways of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Leader to member.
    Ask = 0,
    /// Member to leader.
    Answer = 1,
}

/// A session's shared memory, mapped into this process.
#[derive(Debug)]
struct Mapping {
    at: NonNull<u8>,
}

// SAFETY: the mapping is plain memory, shared between threads as between processes; every
// access goes through atomics (positions and flags) or through the ring protocol, which gives
// each byte to one side at a time.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `fd`'s first [`BYTES`] for reading and writing.
    fn new(fd: &OwnedFd) -> io::Result<Self> {
        let len = NonZeroUsize::new(BYTES).ok_or(io::ErrorKind::InvalidInput)?;
        let flags = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        // SAFETY: a new shared mapping at an address the kernel picks, of a file both sides
        // checked (or made) to be BYTES long and unable to shrink, so no access faults.
        let at = unsafe { mmap(None, len, flags, MapFlags::MAP_SHARED, fd, 0) }?;
        Ok(Self { at: at.cast() })
    }

    /// The 8-byte field at `field` of `way`'s header.
    fn u64_at(&self, way: Way, field: usize) -> &AtomicU64 {
        let offset = way as usize * 4 * LINE + field;
        // SAFETY: within the header page of a live, page-aligned mapping, 8-aligned (LINE is);
        // the other process touches it only as an atomic (or, dishonest, changes its value).
        unsafe { AtomicU64::from_ptr(self.at.as_ptr().add(offset).cast()) }
    }

    /// The 4-byte flag at `field` of `way`'s header.
    fn u32_at(&self, way: Way, field: usize) -> &AtomicU32 {
        let offset = way as usize * 4 * LINE + field;
        // SAFETY: as in `u64_at`.
        unsafe { AtomicU32::from_ptr(self.at.as_ptr().add(offset).cast()) }
    }

    /// The first byte of `way`'s ring.
    fn ring(&self, way: Way) -> *mut u8 {
        // SAFETY: HEADER + 2 * RING_BYTES = BYTES, the mapping's length.
        unsafe { self.at.as_ptr().add(HEADER + way as usize * RING_BYTES) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which nothing uses past this drop (every end holds
        // an `Arc` of it).
        if let Err(e) = unsafe { munmap(self.at.cast(), BYTES) } {
            tracing::warn!("unmapping a session's shared memory: {e}");
        }
    }
}

/// One side's end of one way: it reads or writes that way's ring, keeping its own position.
#[derive(Debug)]
pub struct End {
    map: Arc<Mapping>,
    way: Way,
    /// Bytes this side has read (a reader) or written (a writer) this way, ever.
    pos: u64,
}

/// What a side does with its end of a way: reads into a buffer, or writes one out.
#[derive(Debug)]
pub enum Move<'a> {
    /// Reads into this.
    Take(&'a mut [u8]),
    /// Writes this.
    Put(&'a [u8]),
}

impl Move<'_> {
    /// Whether there is nothing to move.
    pub fn is_empty(&self) -> bool {
        match self {
            Move::Take(buf) => buf.is_empty(),
            Move::Put(buf) => buf.is_empty(),
        }
    }
}

impl End {
    /// Bytes between a writer's and a reader's position, checked to fit the ring.
    fn span(behind: u64, ahead: u64) -> io::Result<usize> {
        let span = ahead.wrapping_sub(behind);
        usize::try_from(span)
            .ok()
            .filter(|&s| s <= RING_BYTES)
            .ok_or_else(|| {
                refused();
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the other side's position in the session's shared memory is {span} bytes \
                         from this side's, more than the ring's {RING_BYTES}"
                    ),
                )
            })
    }

    /// Bytes waiting for this reader.
    fn waiting(&self) -> io::Result<usize> {
        Self::span(self.pos, self.map.u64_at(self.way, WRITTEN).load(SeqCst))
    }

    /// Bytes this writer may put in before the reader takes some out.
    fn room(&self) -> io::Result<usize> {
        let read = self.map.u64_at(self.way, READ).load(SeqCst);
        Ok(RING_BYTES - Self::span(read, self.pos)?)
    }

    /// Bytes `m` may move now: what waits for a reader, the room a writer has.
    fn ready(&self, m: &Move) -> io::Result<usize> {
        Ok(match m {
            Move::Take(buf) => self.waiting()?.min(buf.len()),
            Move::Put(buf) => self.room()?.min(buf.len()),
        })
    }

    /// Moves what it can of `m` (0: nothing waits, or no room); and whether the other side
    /// sleeps for what this did, to be rung.
    pub fn advance(&mut self, m: &mut Move) -> io::Result<(usize, bool)> {
        let n = self.ready(m)?;
        if n == 0 {
            return Ok((0, false));
        }
        let at = self.offset();
        let first = n.min(RING_BYTES - at);
        let ring = self.map.ring(self.way);
        // SAFETY: `n` ≤ the bytes the writer published as written and the reader has not
        // published as read (a reader's), or the room the reader published as read (a
        // writer's), checked against the ring's size: the other side does not touch them
        // until this side publishes its new position. `at + first` ≤ RING_BYTES and
        // `n - first` < RING_BYTES; `buf` holds at least `n`.
        let (field, other) = unsafe {
            use std::ptr::copy_nonoverlapping as copy;
            match m {
                Move::Take(buf) => {
                    copy(ring.add(at), buf.as_mut_ptr(), first);
                    copy(ring, buf.as_mut_ptr().add(first), n - first);
                    (READ, WRITER_ASLEEP)
                }
                Move::Put(buf) => {
                    copy(buf.as_ptr(), ring.add(at), first);
                    copy(buf.as_ptr().add(first), ring, n - first);
                    (WRITTEN, READER_ASLEEP)
                }
            }
        };
        self.pos = self.pos.wrapping_add(n as u64);
        self.map.u64_at(self.way, field).store(self.pos, SeqCst);
        Ok((n, self.woke(other)))
    }

    /// This side is about to sleep until rung, for `m`: false (and awake again) when what it
    /// waits for came meanwhile. It says it sleeps, then looks again: the other side either
    /// sees that after its change, and rings, or made its change before this look.
    pub fn sleep_for(&self, m: &Move) -> io::Result<bool> {
        let flag = match m {
            Move::Take(_) => READER_ASLEEP,
            Move::Put(_) => WRITER_ASLEEP,
        };
        let asleep = self.map.u32_at(self.way, flag);
        asleep.store(1, SeqCst);
        let still = self.ready(m).map(|n| n == 0);
        if !matches!(still, Ok(true)) {
            asleep.store(0, SeqCst);
        }
        still
    }

    /// Whether the other side slept on `flag` (now woken: the caller rings).
    fn woke(&self, flag: usize) -> bool {
        self.map.u32_at(self.way, flag).swap(0, SeqCst) != 0
    }

    fn offset(&self) -> usize {
        // The remainder is below RING_BYTES, a usize.
        (self.pos % RING_BYTES as u64) as usize
    }
}

/// Counts a refusal of what the other side handed over or wrote ([`super::MEMORY_REFUSED`]).
fn refused() {
    super::MEMORY_REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// One side's ends of a session's shared memory.
#[derive(Debug)]
pub struct Ends {
    /// What this side reads.
    pub read: End,
    /// What this side writes.
    pub write: End,
}

impl Ends {
    /// The leader's ends (it writes asks, reads answers) of `map`, or the member's.
    fn of(map: Mapping, leader: bool) -> Self {
        let map = Arc::new(map);
        let (read, write) = if leader {
            (Way::Answer, Way::Ask)
        } else {
            (Way::Ask, Way::Answer)
        };
        let end = |way| End {
            map: map.clone(),
            way,
            pos: 0,
        };
        Self {
            read: end(read),
            write: end(write),
        }
    }
}

/// Makes a session's shared memory: the leader's ends, and the descriptor to hand the member.
pub fn create() -> io::Result<(Ends, OwnedFd)> {
    let flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
    let fd = memfd_create(c"codedmesh-session", flags)?;
    let file = std::fs::File::from(fd);
    file.set_len(BYTES as u64)?;
    let fd = OwnedFd::from(file);
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))?;
    Ok((Ends::of(Mapping::new(&fd)?, true), fd))
}

/// The leader's word on a session whose member offered shared memory: one byte, 1 with the
/// memory's descriptor, or 0 to keep the session's frames on the socket.
pub fn hand_over(stream: &impl AsRawFd, memory: Option<&OwnedFd>) -> io::Result<()> {
    let byte = [u8::from(memory.is_some())];
    let fds: Vec<RawFd> = memory.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    let iov = [IoSlice::new(&byte)];
    let sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent != 1 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    Ok(())
}

/// The member's side of [`hand_over`] (the socket blocking, with a timeout): its ends of the
/// leader's memory, checked to be sealed against shrinking and of the size a session's is; or
/// none, to keep the frames on the socket.
pub fn take_over(stream: &UnixStream) -> io::Result<Option<Ends>> {
    let mut byte = [0u8; 1];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (bytes, fds) = {
        let mut iov = [IoSliceMut::new(&mut byte)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                // SAFETY: descriptors the kernel just installed in this process for this
                // message, owned by nothing else: each is closed when dropped.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        (msg.bytes, fds)
    };
    let malformed = |why: &str| {
        refused();
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the leader's shared memory: {why}"),
        )
    };
    match (bytes, byte[0], fds.as_slice()) {
        (0, _, _) => Err(io::ErrorKind::UnexpectedEof.into()),
        (1, 0, []) => Ok(None),
        (1, 1, [fd]) => {
            let seals = SealFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GET_SEALS)?);
            if !seals.contains(SealFlag::F_SEAL_SHRINK) {
                return Err(malformed("it may shrink under this process"));
            }
            let len = std::fs::File::from(fd.try_clone()?).metadata()?.len();
            if len != BYTES as u64 {
                return Err(malformed(&format!("{len} bytes, not {BYTES}")));
            }
            Ok(Some(Ends::of(Mapping::new(fd)?, false)))
        }
        (_, b, fds) => Err(malformed(&format!(
            "the byte {b} with {} descriptors",
            fds.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    fn take(end: &mut End, buf: &mut [u8]) -> (usize, bool) {
        end.advance(&mut Move::Take(buf)).unwrap()
    }

    fn put(end: &mut End, buf: &[u8]) -> (usize, bool) {
        end.advance(&mut Move::Put(buf)).unwrap()
    }

    /// Refusals counted so far in this process.
    fn counted() -> u64 {
        super::super::MEMORY_REFUSED.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A leader's and a member's ends of one memory, in this process.
    fn pair() -> (Ends, Ends) {
        let (leader, fd) = create().unwrap();
        (leader, Ends::of(Mapping::new(&fd).unwrap(), false))
    }

    #[test]
    fn bytes_go_through_both_rings_in_order_across_their_ends() {
        let (mut leader, mut member) = pair();
        let mut sent = Vec::new();
        let mut got = Vec::new();
        let mut buf = vec![0u8; RING_BYTES];
        // Pieces of sizes that do not divide the ring, so positions wrap mid-piece.
        for i in 0..200u32 {
            let piece: Vec<u8> = (0..(i * 7919) % 90_001).map(|j| (j ^ i) as u8).collect();
            let mut rest = piece.as_slice();
            while !rest.is_empty() {
                let (n, _) = put(&mut leader.write, rest);
                rest = &rest[n..];
                let (m, _) = take(&mut member.read, &mut buf);
                got.extend_from_slice(&buf[..m]);
                // Echo it back the other way.
                let (e, _) = put(&mut member.write, &buf[..m]);
                assert_eq!(e, m, "the answer ring had room for what the ask ring held");
                let (back, _) = take(&mut leader.read, &mut buf);
                assert_eq!(back, m);
            }
            sent.extend_from_slice(&piece);
        }
        assert!(got == sent, "the bytes read differ from those written");
        assert_eq!(take(&mut leader.read, &mut buf).0, 0);
    }

    #[test]
    fn a_full_ring_takes_nothing_more_and_a_sleeper_is_rung_once() {
        let (mut leader, mut member) = pair();
        let big = vec![7u8; RING_BYTES + 10];
        assert_eq!(put(&mut leader.write, &big).0, RING_BYTES);
        assert_eq!(put(&mut leader.write, &big).0, 0);
        // The writer sleeps for room; the reader's take rings it, once.
        assert!(leader.write.sleep_for(&Move::Put(&[0])).unwrap());
        let mut buf = vec![0u8; 100];
        assert_eq!(take(&mut member.read, &mut buf), (100, true));
        assert_eq!(take(&mut member.read, &mut buf), (100, false));
        // A reader about to sleep while bytes wait stays awake.
        assert!(!member.read.sleep_for(&Move::Take(&mut [0])).unwrap());
        let mut all = vec![0u8; RING_BYTES];
        assert_eq!(take(&mut member.read, &mut all).0, RING_BYTES - 200);
        assert!(member.read.sleep_for(&Move::Take(&mut [0])).unwrap());
        assert_eq!(put(&mut leader.write, &[1, 2, 3]), (3, true));
        assert_eq!(put(&mut leader.write, &[4]), (1, false));
    }

    /// A dishonest member that publishes a position out of the ring's bounds: the leader's
    /// reads and writes fail with a clear error, and copy nothing.
    #[test]
    fn a_position_out_of_bounds_is_refused_before_anything_is_copied() {
        let before = counted();
        let (mut leader, member) = pair();
        let map = &member.write.map;
        map.u64_at(Way::Answer, WRITTEN).store(u64::MAX / 3, SeqCst);
        let mut buf = vec![0u8; 64];
        let e = leader.read.advance(&mut Move::Take(&mut buf)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("shared memory"), "{e}");
        map.u64_at(Way::Ask, READ).store(5, SeqCst);
        let e = leader.write.advance(&mut Move::Put(&buf)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(buf.iter().all(|&b| b == 0));
        // Other tests refuse too, at once: at least these two are counted.
        assert!(counted() >= before + 2, "the refusals were not counted");
    }

    /// A dishonest leader's hand-over: memory that may shrink (a fault on every read past its
    /// end), memory of another size, a second descriptor, a byte that means nothing. Each is
    /// refused with a clear error, and the descriptors it carried are closed.
    #[test]
    fn the_member_refuses_memory_that_may_shrink_or_is_another_size() {
        let before = counted();
        // A name of this test's own: other tests open descriptors meanwhile.
        let name = format!("codedmesh-refused-{:016x}", rand_webrtc::random::<u64>());
        let open = || {
            let fds = std::fs::read_dir("/proc/self/fd").unwrap().flatten();
            let named = fds.filter_map(|fd| std::fs::read_link(fd.path()).ok());
            named
                .filter(|to| to.to_string_lossy().contains(&name))
                .count()
        };
        let memfd = |len: u64, seal: bool| {
            let flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
            let fd = memfd_create(name.as_str(), flags).unwrap();
            let file = std::fs::File::from(fd);
            file.set_len(len).unwrap();
            let fd = OwnedFd::from(file);
            if seal {
                fcntl(&fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).unwrap();
            }
            fd
        };
        let send = |byte: u8, fds: &[RawFd]| {
            let (a, b) = UnixStream::pair().unwrap();
            let cmsgs = [ControlMessage::ScmRights(fds)];
            let cmsgs = if fds.is_empty() { &[][..] } else { &cmsgs[..] };
            let byte = [byte];
            let iov = [IoSlice::new(&byte)];
            sendmsg::<()>(a.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
            take_over(&b)
        };
        let unsealed = memfd(BYTES as u64, false);
        let e = send(1, &[unsealed.as_raw_fd()]).unwrap_err();
        assert!(e.to_string().contains("shrink"), "{e}");
        let small = memfd(4096, true);
        let e = send(1, &[small.as_raw_fd()]).unwrap_err();
        assert!(e.to_string().contains("4096 bytes"), "{e}");
        let good = memfd(BYTES as u64, true);
        let two = [good.as_raw_fd(), good.as_raw_fd()];
        let e = send(1, &two).unwrap_err();
        assert!(e.to_string().contains("2 descriptors"), "{e}");
        let e = send(9, &[]).unwrap_err();
        assert!(e.to_string().contains("byte 9"), "{e}");
        assert!(counted() >= before + 4, "the refusals were not counted");
        assert!(send(0, &[]).unwrap().is_none());
        assert!(send(1, &[good.as_raw_fd()]).unwrap().is_some());
        drop((unsealed, small, good));
        assert_eq!(open(), 0, "a descriptor received was left open");
    }
}
