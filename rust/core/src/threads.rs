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
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn tasks_run_exactly_once_across_steps() {
        for threads in [1, 2, 3] {
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
                    assert_eq!(
                        hits[step * 50 + i].load(Ordering::Relaxed),
                        want,
                        "t={threads}"
                    );
                }
            }
        }
    }

    #[test]
    fn barrier_orders_writes_between_steps() {
        let team = Team::new(Some(2));
        let cells: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
        let bad = AtomicUsize::new(0);
        team.run(|w| {
            for step in 1..200usize {
                for i in w.share(64) {
                    cells[i].store(step, Ordering::Relaxed);
                }
                w.sync();
                for c in &cells {
                    if c.load(Ordering::Relaxed) != step {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                }
                w.sync();
            }
        });
        assert_eq!(bad.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_panicking_member_releases_the_team_and_the_team_recovers() {
        let team = Team::new(Some(2));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            team.run(|w| {
                if w.id == 1 {
                    panic!("boom");
                }
                w.sync(); // would spin forever without poisoning
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
