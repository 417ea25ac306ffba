//! Thread-count policy: `--threads` / `KVSERVE_THREADS`, default the number of physical cores.

/// Threads to use when the caller gives none: `KVSERVE_THREADS` if set and valid, else the
/// number of physical cores (logical CPUs halved when SMT siblings are detected).
pub fn default_threads() -> usize {
    if let Ok(v) = std::env::var("KVSERVE_THREADS") {
        if let Ok(n) = v.trim().parse::<usize>() {
            if n > 0 {
                return n;
            }
        }
    }
    physical_cores().max(1)
}

fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // Linux: count distinct (physical id, core id) pairs in /proc/cpuinfo.
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        let mut pairs = std::collections::HashSet::new();
        let (mut phys, mut core) = (None::<String>, None::<String>);
        for line in info.lines() {
            if let Some((k, v)) = line.split_once(':') {
                match k.trim() {
                    "physical id" => phys = Some(v.trim().to_string()),
                    "core id" => core = Some(v.trim().to_string()),
                    _ => {}
                }
            } else if line.trim().is_empty() {
                if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                    pairs.insert((p, c));
                }
            }
        }
        if !pairs.is_empty() && pairs.len() <= logical {
            return pairs.len();
        }
    }
    logical
}

/// Builds a rayon pool with `n` threads (or the default when `None`).
pub fn build_pool(n: Option<usize>) -> rayon::ThreadPool {
    let n = n.filter(|&n| n > 0).unwrap_or_else(default_threads);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("kvserve-{i}"))
        .build()
        .expect("building a rayon thread pool only fails if threads cannot be spawned")
}

/// A fixed team of worker threads that runs one closure on every member at once (SPMD), with a
/// spinning barrier and a shared task counter between the steps of that closure.
///
/// Why: a decode step of a small model is ~150 short parallel operations; forking and joining
/// rayon tasks for each costs more than the work (threads fall asleep between them). A team runs
/// the whole forward pass as one parallel region; each operation ends in a barrier that spins
/// (then yields), the way ggml's thread pool works.
///
/// Only one closure runs on a team at a time (a mutex serializes callers), so barriers of two
/// callers can never interleave.
pub struct Team {
    pool: rayon::ThreadPool,
    n: usize,
    barrier: SpinBarrier,
    counter: std::sync::atomic::AtomicUsize,
    lock: std::sync::Mutex<()>,
}

/// One member's view of a running team.
pub struct Worker<'a> {
    /// This member's index in `0..n`.
    pub id: usize,
    /// Team size.
    pub n: usize,
    team: &'a Team,
    /// Value of the shared counter at the start of the next `for_tasks` (the same on every
    /// member, see `for_tasks`).
    base: std::cell::Cell<usize>,
}

impl Team {
    pub fn new(threads: Option<usize>) -> Team {
        let pool = build_pool(threads);
        let n = pool.current_num_threads();
        Team {
            pool,
            n,
            barrier: SpinBarrier::new(n),
            counter: std::sync::atomic::AtomicUsize::new(0),
            lock: std::sync::Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.n
    }

    /// Runs `f` on every member at once and returns when all have finished. A panic in `f` is
    /// propagated to the caller (after the team is released).
    pub fn run<F>(&self, f: F)
    where
        F: Fn(&Worker<'_>) + Sync,
    {
        use std::sync::atomic::Ordering;
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // A previous run that panicked may have left the barrier half-filled.
        self.barrier.reset();
        let start = self.counter.load(Ordering::Relaxed);
        self.pool.broadcast(|ctx| {
            let w = Worker {
                id: ctx.index(),
                n: self.n,
                team: self,
                base: std::cell::Cell::new(start),
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&w)));
            if let Err(payload) = r {
                // Release members waiting at a barrier: they see the flag and unwind too.
                self.barrier.poisoned.store(true, Ordering::Release);
                std::panic::resume_unwind(payload);
            }
        });
    }
}

impl Worker<'_> {
    /// Waits until every member has reached this point.
    pub fn sync(&self) {
        self.team.barrier.wait();
    }

    /// Executes tasks `0..n_tasks`, each exactly once across the team, handed out dynamically
    /// (fast members take more), then waits for the whole team.
    ///
    /// Every member must call this with the same `n_tasks` in the same order. The shared
    /// counter is never reset: each member's last `fetch_add` overshoots exactly once, so after
    /// a call the counter has grown by `n_tasks + n` on every member's books.
    pub fn for_tasks(&self, n_tasks: usize, mut f: impl FnMut(usize)) {
        use std::sync::atomic::Ordering;
        let base = self.base.get();
        loop {
            let i = self
                .team
                .counter
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_sub(base);
            if i >= n_tasks {
                break;
            }
            f(i);
        }
        self.base.set(base.wrapping_add(n_tasks + self.n));
        self.sync();
    }

    /// This member's contiguous share of `0..len` (static split), for cheap element-wise work.
    pub fn share(&self, len: usize) -> std::ops::Range<usize> {
        let per = len.div_ceil(self.n);
        let start = (self.id * per).min(len);
        start..(start + per).min(len)
    }
}

/// A sense-reversing barrier that spins, then yields, so it stays cheap when every member is
/// running and harmless when the machine is oversubscribed.
struct SpinBarrier {
    n: usize,
    arrived: std::sync::atomic::AtomicUsize,
    generation: std::sync::atomic::AtomicUsize,
    /// Set when a member panicked: waiters give up instead of spinning forever.
    poisoned: std::sync::atomic::AtomicBool,
}

impl SpinBarrier {
    fn new(n: usize) -> SpinBarrier {
        SpinBarrier {
            n,
            arrived: std::sync::atomic::AtomicUsize::new(0),
            generation: std::sync::atomic::AtomicUsize::new(0),
            poisoned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Forgets a run that ended in a panic (called with no member running).
    fn reset(&self) {
        use std::sync::atomic::Ordering;
        self.arrived.store(0, Ordering::Relaxed);
        self.poisoned.store(false, Ordering::Relaxed);
    }

    fn wait(&self) {
        use std::sync::atomic::Ordering;
        if self.n == 1 {
            return;
        }
        let gen = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation
                .store(gen.wrapping_add(1), Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            if self.poisoned.load(Ordering::Acquire) {
                panic!("another member of the thread team panicked");
            }
            if spins < 20_000 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::SharedSlice;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// How long a dawdling member keeps its partners waiting in the tests below: long enough
    /// that a barrier which stops spinning (yields or sleeps) does so.
    const SPIN_LIMIT: Duration = Duration::from_micros(200);

    #[test]
    fn tasks_run_exactly_once_across_steps() {
        for threads in [1, 2, 3] {
            within(Duration::from_secs(120), move || {
                let team = Team::new(Some(threads));
                let hits: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
                for round in 0..5 {
                    team.run(|w| {
                        for step in 0..20 {
                            let n_tasks = (step * 37 + round) % 50;
                            w.for_tasks(n_tasks, |i| {
                                hits[step * 50 + i].fetch_add(1, Ordering::Relaxed);
                            });
                        }
                    });
                }
                for step in 0..20 {
                    for i in 0..50 {
                        let want: usize = (0..5).filter(|r| i < (step * 37 + r) % 50).count();
                        let got = hits[step * 50 + i].load(Ordering::Relaxed);
                        assert_eq!(got, want, "t={threads}");
                    }
                }
            });
        }
    }

    /// Runs `f` on its own thread and fails if it has not finished within `limit`: a barrier
    /// that loses a wake-up or miscounts arrivals hangs rather than returning a wrong answer.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        match rx.recv_timeout(limit) {
            Ok(Ok(v)) => v,
            Ok(Err(payload)) => std::panic::resume_unwind(payload),
            Err(_) => panic!("no result after {limit:?}: a team member never left a barrier"),
        }
    }

    /// Keeps the calling member busy for `d` without sleeping.
    fn busy_for(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn barrier_orders_plain_writes_between_steps() {
        // The forward pass shares plain (non-atomic) buffers: a step's writes, a barrier, then
        // reads by every member. So does this test. In each step one member dawdles before its
        // writes (spins a little, or sleeps past SPIN_LIMIT so that its partners park), so a
        // barrier that lets a member through before everyone has arrived makes it read a stale
        // cell. (A barrier with too weak memory orderings is caught on weakly ordered CPUs;
        // x86 keeps stores in order whatever the barrier says.)
        const CELLS: usize = 96;
        const STEPS: usize = 300;
        for threads in [2, 3] {
            let stale = within(Duration::from_secs(120), move || {
                let team = Team::new(Some(threads));
                let mut cells = vec![0usize; CELLS];
                let shared = SharedSlice::new(&mut cells);
                let stale = AtomicUsize::new(0);
                team.run(|w| {
                    for step in 1..=STEPS {
                        if w.id == step % w.n {
                            match step % 10 {
                                0 => std::thread::sleep(SPIN_LIMIT * 4),
                                k => busy_for(Duration::from_micros(3 * k as u64)),
                            }
                        }
                        // SAFETY: between the barriers each member writes only its own share
                        // and nobody reads.
                        unsafe { shared.slice_mut(w.share(CELLS)) }.fill(step);
                        w.sync();
                        // SAFETY: between these barriers nobody writes.
                        let all = unsafe { shared.all() };
                        let n = all.iter().filter(|&&c| c != step).count();
                        stale.fetch_add(n, Ordering::Relaxed);
                        w.sync();
                    }
                });
                stale.into_inner()
            });
            assert_eq!(
                stale, 0,
                "{threads} threads: cells read before they were written"
            );
        }
    }

    #[test]
    fn back_to_back_barriers_count_every_arrival() {
        // No work between barriers: a released member arrives at the next barrier while the
        // last arriver of this one may still be resetting the count, so a barrier that
        // publishes the new generation before resetting the count loses an arrival (and
        // hangs) or releases early.
        for (threads, steps) in [(2, 300_000), (3, 5_000)] {
            let early = within(Duration::from_secs(120), move || {
                let team = Team::new(Some(threads));
                let arrivals = AtomicUsize::new(0);
                let early = AtomicUsize::new(0);
                team.run(|w| {
                    for step in 0..steps {
                        arrivals.fetch_add(1, Ordering::Relaxed);
                        w.sync();
                        // Everyone has arrived for this step; some may be past it already.
                        if arrivals.load(Ordering::Relaxed) < (step + 1) * w.n {
                            early.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
                early.into_inner()
            });
            assert_eq!(
                early, 0,
                "{threads} threads: left a barrier before all arrived"
            );
        }
    }

    #[test]
    fn members_on_too_few_cores_never_lose_a_wake_up() {
        // More members than this machine has cores: members are preempted at barriers, so
        // waiters park, and every barrier must still release everyone (or the test times out)
        // and only after everyone has arrived.
        let threads = 2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
        const STEPS: usize = 2000;
        let early = within(Duration::from_secs(120), move || {
            let team = Team::new(Some(threads));
            let arrivals = AtomicUsize::new(0);
            let early = AtomicUsize::new(0);
            team.run(|w| {
                for step in 0..STEPS {
                    if w.id == step % w.n && step % 50 == 0 {
                        std::thread::sleep(SPIN_LIMIT * 2);
                    }
                    arrivals.fetch_add(1, Ordering::Relaxed);
                    w.sync();
                    if arrivals.load(Ordering::Relaxed) < (step + 1) * w.n {
                        early.fetch_add(1, Ordering::Relaxed);
                    }
                    w.sync();
                }
            });
            assert_eq!(arrivals.into_inner(), STEPS * threads);
            early.into_inner()
        });
        assert_eq!(early, 0, "members left a barrier before everyone arrived");
    }

    #[test]
    fn a_panicking_member_releases_the_team_and_the_team_recovers() {
        // Once with the partner still spinning, once with it parked.
        for delay in [Duration::ZERO, SPIN_LIMIT * 10] {
            within(Duration::from_secs(60), move || {
                let team = Team::new(Some(2));
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    team.run(|w| {
                        if w.id == 1 {
                            std::thread::sleep(delay);
                            panic!("boom");
                        }
                        w.sync(); // would wait forever without poisoning
                    })
                }));
                assert!(r.is_err());
                // The team still works afterwards.
                let hits = AtomicUsize::new(0);
                team.run(|w| {
                    w.for_tasks(10, |_| {
                        hits.fetch_add(1, Ordering::Relaxed);
                    });
                    w.sync();
                });
                assert_eq!(hits.load(Ordering::Relaxed), 10);
            });
        }
    }

    #[test]
    fn share_covers_range() {
        let team = Team::new(Some(3));
        let seen: Vec<AtomicUsize> = (0..10).map(|_| AtomicUsize::new(0)).collect();
        team.run(|w| {
            for i in w.share(10) {
                seen[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
    }
}
