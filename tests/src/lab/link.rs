//! A site's link to the lab's internet: two TAP devices, one in each network namespace, and a
//! process that carries every frame between them after a one-way delay, at a rate, losing a
//! share of them. It works in user space because this kernel has no netem; every byte crosses
//! it (TCP, QUIC, WebRTC, ARP), not chosen messages.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

/// What a link does to each frame, in each direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// One-way delay added to every frame.
    pub delay: Duration,
    /// Bits per second leaving each end; 0 is unlimited.
    pub rate_bps: f64,
    /// Share of frames dropped (0 to 1).
    pub loss: f64,
    /// Most time a frame may wait for the rate before it is dropped (a router's buffer).
    pub queue: Duration,
}

/// `ioctl` that attaches a file to a TUN/TAP device (linux/if_tun.h).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// A TAP (Ethernet frames) device.
const IFF_TAP: libc::c_short = 0x0002;
/// Frames without the packet-information header.
const IFF_NO_PI: libc::c_short = 0x1000;

/// `struct ifreq` as TUNSETIFF reads it: a name and flags, padded to the union's size.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    pad: [u8; 22],
}

/// Enters the network namespace `ns` (named by `ip netns`) on this thread while `f` runs.
pub fn in_namespace<T>(ns: &str, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let home = File::open("/proc/thread-self/ns/net")?;
    let there = File::open(format!("/run/netns/{ns}"))
        .map_err(|e| io::Error::new(e.kind(), format!("namespace {ns}: {e}")))?;
    // SAFETY: setns on descriptors this function owns; it changes only this thread's namespace.
    if unsafe { libc::setns(there.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let out = f();
    // SAFETY: as above, back to the namespace the thread started in.
    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    out
}

/// Creates TAP device `name` in namespace `ns`; it lives while the returned file is open.
pub fn open_tap(ns: &str, name: &str) -> io::Result<File> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} must have 1 to 15 bytes"),
        ));
    }
    in_namespace(ns, || {
        let file = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI,
            pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is laid out as.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("TAP {name} in {ns}: {e}")));
        }
        Ok(file)
    })
}

impl Shape {
    /// The shape as a shape file holds it: `delay_ms rate_mbit loss_percent`.
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {}",
            self.delay.as_secs_f64() * 1e3,
            self.rate_bps / 1e6,
            self.loss * 100.0
        )
    }

    /// Reads a shape file's line; the queue is `queue`.
    pub fn from_line(line: &str, queue: Duration) -> io::Result<Self> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a shape is `delay_ms rate_mbit loss_percent`, not {line:?}"),
            )
        };
        let v: Vec<f64> = line
            .split_whitespace()
            .map(|w| w.parse::<f64>().map_err(|_| bad()))
            .collect::<io::Result<_>>()?;
        let &[delay_ms, rate_mbit, loss_percent] = v.as_slice() else {
            return Err(bad());
        };
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !(ok(delay_ms) && ok(rate_mbit) && ok(loss_percent) && loss_percent <= 100.0) {
            return Err(bad());
        }
        Ok(Self {
            delay: Duration::from_secs_f64(delay_ms / 1e3),
            rate_bps: rate_mbit * 1e6,
            loss: loss_percent / 100.0,
            queue,
        })
    }
}

/// The file a link reads its shape from while it runs, and the one it writes back once it
/// carries frames with that shape.
pub fn applied_path(shape_file: &Path) -> PathBuf {
    shape_file.with_extension("applied")
}

/// When each frame leaves one end: the rate's queue, the tail drop and the loss.
#[derive(Debug)]
pub struct Pacer {
    shape: Shape,
    /// When the link is free to send the next frame (`None`: before the first).
    free_at: Option<Instant>,
    rng: rand_chacha::ChaCha8Rng,
}

impl Pacer {
    /// A pacer with the loss drawn from `seed`.
    pub fn new(shape: Shape, seed: u64) -> Self {
        Self {
            shape,
            free_at: None,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// When a frame of `len` bytes that arrived `now` is delivered, or `None` if it is lost.
    pub fn admit(&mut self, len: usize, now: Instant) -> Option<Instant> {
        if self.shape.loss > 0.0 && self.rng.random::<f64>() < self.shape.loss {
            return None;
        }
        let start = self.free_at.map_or(now, |f| f.max(now));
        if start.duration_since(now) > self.shape.queue {
            return None; // the router's buffer is full
        }
        let send = if self.shape.rate_bps > 0.0 {
            Duration::from_secs_f64(len as f64 * 8.0 / self.shape.rate_bps)
        } else {
            Duration::ZERO
        };
        self.free_at = Some(start + send);
        Some(start + send + self.shape.delay)
    }
}

/// Carries frames from `from` to `to` shaped by `pacer` (with the shape `shape` holds at each
/// frame), until either end fails.
fn carry(
    mut from: File,
    mut to: File,
    mut pacer: Pacer,
    shape: Arc<Mutex<Shape>>,
) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || -> io::Result<()> {
        for (at, frame) in rx {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if let Err(e) = to.write_all(&frame) {
                // A frame the other end refuses (down for a moment) is lost, as on a wire.
                if e.raw_os_error() != Some(libc::EIO) {
                    return Err(e);
                }
            }
        }
        Ok(())
    });
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = from.read(&mut buf)?;
        pacer.shape = *shape.lock().map_err(|_| io::Error::other("a shape lock"))?;
        if let Some(at) = pacer.admit(n, Instant::now())
            && tx.send((at, buf[..n].to_vec())).is_err()
        {
            break;
        }
    }
    drop(tx);
    writer
        .join()
        .map_err(|_| io::Error::other("the link's writer panicked"))?
}

/// Keeps `shape` as `file` says (polled every 100 ms), writing each shape it takes to
/// [`applied_path`]; a file that cannot be read or parsed leaves the shape as it was.
fn follow(file: PathBuf, shape: Arc<Mutex<Shape>>) {
    let mut seen = String::new();
    loop {
        if let Ok(text) = std::fs::read_to_string(&file)
            && text != seen
        {
            let queue = shape.lock().map(|s| s.queue).unwrap_or(super::QUEUE);
            match Shape::from_line(text.trim(), queue) {
                Ok(new) => {
                    if let Ok(mut s) = shape.lock() {
                        *s = new;
                    }
                    if let Err(e) = std::fs::write(applied_path(&file), &text) {
                        eprintln!("lab link: {}: {e}", applied_path(&file).display());
                    }
                }
                Err(e) => eprintln!("lab link: {}: {e}", file.display()),
            }
            seen = text;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs a link between TAP `a` and TAP `b` (each a namespace and a name), shaped the same way
/// both ways, and reshaped as `shape_file` says while it runs, if given; calls `ready` once
/// both devices exist, then carries frames until killed.
pub fn run(
    a: (&str, &str),
    b: (&str, &str),
    shape: Shape,
    seed: u64,
    shape_file: Option<PathBuf>,
    ready: impl FnOnce(),
) -> io::Result<()> {
    let ta = open_tap(a.0, a.1)?;
    let tb = open_tap(b.0, b.1)?;
    let shared = Arc::new(Mutex::new(shape));
    if let Some(file) = shape_file {
        let s = Arc::clone(&shared);
        std::thread::spawn(move || follow(file, s));
    }
    ready();
    let (ta2, tb2) = (ta.try_clone()?, tb.try_clone()?);
    let s = Arc::clone(&shared);
    let back = std::thread::spawn(move || carry(tb2, ta2, Pacer::new(shape, seed ^ 0x5bd1), s));
    let fwd = carry(ta, tb, Pacer::new(shape, seed), shared);
    let back = back
        .join()
        .map_err(|_| io::Error::other("the link's reader panicked"))?;
    fwd.and(back)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rate_bps: f64, loss: f64) -> Shape {
        Shape {
            delay: Duration::from_millis(10),
            rate_bps,
            loss,
            queue: Duration::from_millis(100),
        }
    }

    #[test]
    fn frames_wait_the_delay_plus_their_time_on_the_wire() {
        let t0 = Instant::now();
        // 8 Mbit/s: a 1000-byte frame takes 1 ms on the wire.
        let mut p = Pacer::new(shape(8e6, 0.0), 1);
        assert_eq!(p.admit(1000, t0), Some(t0 + Duration::from_millis(11)));
        // The next one queues behind it.
        assert_eq!(p.admit(1000, t0), Some(t0 + Duration::from_millis(12)));
        // An unlimited link only delays.
        let mut free = Pacer::new(shape(0.0, 0.0), 1);
        assert_eq!(
            free.admit(1 << 16, t0),
            Some(t0 + Duration::from_millis(10))
        );
    }

    #[test]
    fn a_shape_reads_back_as_written_and_bad_lines_are_errors() -> io::Result<()> {
        let s = shape(20e6, 0.01);
        let back = Shape::from_line(&s.to_line(), s.queue)?;
        assert_eq!(back.delay, s.delay);
        assert!((back.rate_bps - s.rate_bps).abs() < 1e-3 && (back.loss - s.loss).abs() < 1e-9);
        for bad in [
            "",
            "10 20",
            "10 20 1 4",
            "ten 20 1",
            "-1 20 0",
            "10 20 101",
            "NaN 1 1",
        ] {
            assert!(Shape::from_line(bad, s.queue).is_err(), "{bad:?}");
        }
        Ok(())
    }

    #[test]
    fn a_full_buffer_drops_and_loss_drops_its_share() {
        let t0 = Instant::now();
        let mut p = Pacer::new(shape(8e6, 0.0), 1);
        // 1 ms a frame, 100 ms of buffer: the 102nd frame sent at once finds it full.
        let kept = (0..200).filter(|_| p.admit(1000, t0).is_some()).count();
        assert_eq!(kept, 101);
        let mut lossy = Pacer::new(shape(0.0, 0.1), 7);
        let kept = (0..10_000)
            .filter(|_| lossy.admit(100, t0).is_some())
            .count();
        assert!(
            (8_800..=9_200).contains(&kept),
            "{kept} of 10000 kept at 10 % loss"
        );
    }
}
