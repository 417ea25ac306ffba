//! Thread-count policy: `--threads` / `KVSERVE_THREADS`, default the number of physical cores.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

/// A fixed team of worker threads that runs one closure on every member at once (SPMD); the
/// steps of that closure are sets of tasks (`Worker::for_tasks`) that members claim dynamically.
///
/// Why: a decode step of a small model is ~150 short parallel operations; forking and joining
/// rayon tasks for each costs more than the work (threads fall asleep between them). A team runs
/// the whole forward pass as one parallel region, the way ggml's thread pool works.
///
/// A step ends when all its *tasks* are done, not when all *members* have arrived: a member that
/// the OS has descheduled while holding no task holds nobody up. When it runs again it finds the
/// steps it missed finished and skips them. This matters on a small machine where an event loop
/// or another process takes a core now and then: the members left running go on with all the
/// work instead of waiting at every step for the one that lost its core (a member preempted in
/// the middle of a task still holds up the end of that step). A member that waits for a step
/// spins briefly, then yields.
///
/// A member preempted *inside* a task holds the step up until the OS runs it again (on 2 cores
/// beside a busy event loop: for the other thread's whole time slice, ~2 ms). Steps whose tasks
/// compute into member-private memory and publish only through a [`Commit`]
/// (`Worker::for_tasks_redoable`) do not wait for it: a member that has run out of tasks and
/// waited a while runs the straggler's task again itself, and whichever run finishes first
/// publishes its result (the runs compute the same values; the other is discarded).
///
/// Only one closure runs on a team at a time (a mutex serializes callers).
pub struct Team {
    pool: rayon::ThreadPool,
    n: usize,
    /// Set when a member panicked: waiting members give up instead of waiting forever.
    poisoned: AtomicBool,
    /// `(step << 32) | next task to hand out` of the step being handed out.
    claim: AtomicU64,
    /// `(step << 32) | tasks finished` of the step being worked on. Moves to the next step only
    /// once every task of this one has finished, so `step(done) > k` means step `k` is over.
    done: AtomicU64,
    /// Per task index, for redoable steps: the epoch (`run << 32 | step`) of the last step in
    /// which that task was committed. A run of task `i` of the step with epoch `e` wins its
    /// commit iff it raises `marks[i]` from below `e` (`fetch_max`): exactly one run per step.
    marks: Box<[AtomicU64]>,
    /// Number of the current run (the high half of the epochs); starts at 1, so that the
    /// zeroed marks are below every epoch.
    run_no: AtomicU64,
    /// One scratch buffer per member for redoable tasks' private results (see
    /// [`Worker::scratch`]); a member locks only its own, so the locks are never contended.
    scratch: Box<[Mutex<Vec<f32>>]>,
    /// Tasks published by a redo (a member's second run of a task another member held).
    redone: AtomicU64,
    lock: Mutex<()>,
}

/// One member's view of a running team.
pub struct Worker<'a> {
    /// This member's index in `0..n`.
    pub id: usize,
    /// Team size.
    pub n: usize,
    team: &'a Team,
    /// Number of `for_tasks` steps this member has entered in this run (the same sequence on
    /// every member, since every member calls `for_tasks` in the same order).
    step: Cell<u32>,
    /// Calls of [`Worker::next_call`] so far in this run.
    calls: Cell<usize>,
    /// What this member prefetches while it waits for a step (`Worker::prefetch_while_waiting`).
    idle: RefCell<IdlePrefetch>,
}

/// What a waiting member asks the CPU to load ahead: up to four byte ranges, read in order as
/// one sequence that the members split between them in interleaved blocks. Only addresses are
/// kept: a prefetch never faults, so a stale address is harmless.
#[derive(Default)]
struct IdlePrefetch {
    /// (address, length) of each range.
    parts: [(usize, usize); 4],
    n_parts: usize,
    /// Position in the concatenated ranges, and bytes this member may still prefetch.
    at: usize,
    left: usize,
}

/// Bytes a waiting member prefetches between two checks of the step it waits for.
const IDLE_CHUNK: usize = 4 * 64;

/// The blocks in which the members split a hint: member `id` of `n` takes every `n`-th.
const IDLE_STRIDE: usize = 4096;

impl IdlePrefetch {
    fn set(&mut self, parts: &[&[u8]], cap: usize) {
        let n_parts = parts.len().min(self.parts.len());
        for (slot, p) in self.parts.iter_mut().zip(parts) {
            *slot = (p.as_ptr() as usize, p.len());
        }
        self.n_parts = n_parts;
        self.at = 0;
        // Without a prefetch instruction there is nothing to do.
        self.left = if cfg!(target_arch = "x86_64") { cap } else { 0 };
    }

    /// The next range (address, length: at most `IDLE_CHUNK` bytes, inside one range and one
    /// of member `id`'s blocks) for member `id` of `n` to prefetch, or `None` when its share
    /// or its cap is used up.
    fn next_range(&mut self, id: usize, n: usize) -> Option<(usize, usize)> {
        if self.left == 0 {
            return None;
        }
        let mut at = self.at;
        let block = at / IDLE_STRIDE;
        if block % n != id {
            at = (block + (id + n - block % n) % n) * IDLE_STRIDE;
        }
        let block_end = (at / IDLE_STRIDE + 1) * IDLE_STRIDE;
        // Locate `at` in the ranges.
        let mut off = at;
        let mut part = 0;
        while part < self.n_parts && off >= self.parts[part].1 {
            off -= self.parts[part].1;
            part += 1;
        }
        if part == self.n_parts {
            self.left = 0;
            return None;
        }
        let (base, len) = self.parts[part];
        let take = IDLE_CHUNK.min(len - off).min(block_end - at).min(self.left);
        self.at = at + take;
        self.left -= take;
        Some((base.wrapping_add(off), take))
    }

    /// Prefetches the next chunk of member `id`'s share; false when there is none.
    fn step(&mut self, id: usize, n: usize) -> bool {
        let Some((addr, len)) = self.next_range(id, n) else {
            return false;
        };
        #[cfg(target_arch = "x86_64")]
        for o in (0..len).step_by(64) {
            // SAFETY: SSE is part of x86-64's baseline; a prefetch reads nothing
            // architecturally and never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    addr.wrapping_add(o) as *const i8,
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (addr, len);
        true
    }
}

/// The most tasks a redoable step may have; a step with more runs as a plain one (each task
/// once, no redos).
const MAX_REDOABLE_TASKS: usize = 1024;

/// How long a member that has run out of tasks waits for a step before it redoes a straggler's
/// task — at least this long, and at least twice its own mean task of the step (so that a
/// partner that is merely running a long task, rather than descheduled, is rarely duplicated).
const REDO_PATIENCE: Duration = Duration::from_micros(60);

/// Decides which run of a redoable task publishes its result (see
/// [`Worker::for_tasks_redoable`]).
pub struct Commit<'t> {
    /// `None`: the step is not redoable, this run is the only one and always wins.
    mark: Option<&'t AtomicU64>,
    epoch: u64,
    won: Cell<Option<bool>>,
}

impl Commit<'_> {
    /// Whether this run publishes the task's result: true for exactly one run of each task (the
    /// first to ask). Call it after computing the result privately and, if true, write the
    /// result to shared memory before returning. Asking again gives the same answer.
    pub fn win(&self) -> bool {
        if let Some(w) = self.won.get() {
            return w;
        }
        let w = match self.mark {
            None => true,
            // AcqRel: the winner's later writes are ordered after the decision; the losers
            // publish nothing.
            Some(m) => m.fetch_max(self.epoch, Ordering::AcqRel) < self.epoch,
        };
        self.won.set(Some(w));
        w
    }
}

const STEP_SHIFT: u32 = 32;
const LOW: u64 = (1 << STEP_SHIFT) - 1;

fn step_of(v: u64) -> u32 {
    (v >> STEP_SHIFT) as u32
}

impl Team {
    pub fn new(threads: Option<usize>) -> Team {
        let pool = build_pool(threads);
        let n = pool.current_num_threads();
        Team {
            pool,
            n,
            poisoned: AtomicBool::new(false),
            claim: AtomicU64::new(0),
            done: AtomicU64::new(0),
            marks: (0..MAX_REDOABLE_TASKS).map(|_| AtomicU64::new(0)).collect(),
            run_no: AtomicU64::new(0),
            scratch: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            redone: AtomicU64::new(0),
            lock: Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.n
    }

    /// How many tasks of redoable steps were published by a redo since the team was made (a
    /// member ran the task of a partner that was taking too long, and finished first).
    pub fn redone(&self) -> u64 {
        self.redone.load(Ordering::Relaxed)
    }

    /// Runs `f` on every member at once and returns when all have finished. A panic in `f` is
    /// propagated to the caller (after the team is released).
    pub fn run<F>(&self, f: F)
    where
        F: Fn(&Worker<'_>) + Sync,
    {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Forget a previous run that panicked. Step 0 is an empty step that is over.
        self.poisoned.store(false, Ordering::Relaxed);
        self.claim.store(0, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
        // A new run number keeps this run's epochs above every mark; after 2^32 - 1 runs the
        // marks start over from zero (no member is running: the lock is held).
        let run = self.run_no.load(Ordering::Relaxed) + 1;
        if run > u64::from(u32::MAX) {
            for m in self.marks.iter() {
                m.store(0, Ordering::Relaxed);
            }
            self.run_no.store(1, Ordering::Relaxed);
        } else {
            self.run_no.store(run, Ordering::Relaxed);
        }
        // (The broadcast below publishes these stores to the members.)
        self.pool.broadcast(|ctx| {
            let w = Worker {
                id: ctx.index(),
                n: self.n,
                team: self,
                step: Cell::new(0),
                calls: Cell::new(0),
                idle: RefCell::new(IdlePrefetch::default()),
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&w)));
            if let Err(payload) = r {
                // Release members waiting for a step: they see the flag and unwind too.
                self.poisoned.store(true, Ordering::Release);
                std::panic::resume_unwind(payload);
            }
        });
    }

    /// Whether step `k` (of `n_tasks` tasks) is over.
    fn step_over(&self, k: u32, n_tasks: usize) -> bool {
        let d = self.done.load(Ordering::Acquire);
        step_of(d) > k || (d & LOW) as usize >= n_tasks
    }

    /// Waits until step `k` is over: spins for a while, then yields its core between checks.
    /// (Sleeping instead — a condvar woken by whoever finishes the step, or parking after a
    /// long wait — measured slower both quiet and beside a busy thread: BENCHMARKS.md, "Decode
    /// beside a busy Python thread". What helps there is not waiting: redoable steps.)
    fn wait_done(&self, k: u32, n_tasks: usize, mut idle: impl FnMut() -> bool) {
        let mut spins = 0u32;
        while !self.step_over(k, n_tasks) {
            if self.poisoned.load(Ordering::Acquire) {
                panic!("another member of the thread team panicked");
            }
            if idle() {
                continue;
            }
            if spins < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// About 20–40 µs of spinning before a waiting member starts yielding.
const SPINS_BEFORE_YIELD: u32 = 20_000;

impl Worker<'_> {
    /// Numbers the calls of a routine that every member makes in the same order (0, 1, ... in
    /// each run): e.g. which of a pass's buffers a call uses.
    pub fn next_call(&self) -> usize {
        let c = self.calls.get();
        self.calls.set(c + 1);
        c
    }

    /// This member's scratch buffer (kept across runs), for private task results.
    pub fn scratch(&self) -> MutexGuard<'_, Vec<f32>> {
        // Only this member locks it; a poisoned lock only means an earlier run panicked.
        self.team.scratch[self.id]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Like [`Worker::for_tasks`], for tasks that may run more than once: `f(i, commit)`
    /// computes task `i` into memory private to this member (writing nothing shared), then, if
    /// `commit.win()`, publishes the result (writes its shared outputs). A member that has run
    /// out of tasks and has waited `REDO_PATIENCE` (or twice its own mean task of the step)
    /// for a task another member holds runs that task again; the first run to finish
    /// publishes, exactly once per task, and the step is over when every task is published. A
    /// member preempted inside a task thus holds nobody up.
    ///
    /// `f` may read shared data only if nothing writes it until the end of the run (a
    /// descheduled member may finish its run of a task after the step is over), and must call
    /// `commit.win()` exactly once per call (a call that never asks panics the run).
    pub fn for_tasks_redoable(&self, n_tasks: usize, mut f: impl FnMut(usize, &Commit<'_>)) {
        assert!(n_tasks as u64 <= LOW, "too many tasks in one step");
        let team = self.team;
        let k = self.step.get() + 1;
        self.step.set(k);
        let redoable = n_tasks <= MAX_REDOABLE_TASKS;
        let epoch = (team.run_no.load(Ordering::Relaxed) << STEP_SHIFT) | u64::from(k);
        let mut run = |i: usize, redo: bool| {
            let commit = Commit {
                mark: redoable.then(|| &team.marks[i]),
                epoch,
                won: Cell::new(None),
            };
            f(i, &commit);
            match commit.won.get() {
                // Counted at once (not per member at the end, as `for_tasks` does): a member
                // preempted after publishing must not hold the step up. Release: the published
                // result happens before anyone sees the step over.
                Some(true) => {
                    if redo {
                        team.redone.fetch_add(1, Ordering::Relaxed);
                    }
                    team.done.fetch_add(1, Ordering::AcqRel);
                }
                Some(false) => {}
                None => panic!("a redoable task returned without asking to commit"),
            }
        };
        let started = Instant::now();
        let ran = self.claim_tasks(k, n_tasks, |i| run(i, false)) as u32;
        if !redoable {
            team.wait_done(k, n_tasks, || self.idle_step());
            return;
        }
        // Wait for the tasks others hold; redo one whose holder is taking too long: longer
        // than the patience, or than twice this member's mean task of the step.
        let mut since = Instant::now();
        let patience = if ran > 0 {
            REDO_PATIENCE.max((since - started) * 2 / ran)
        } else {
            REDO_PATIENCE
        };
        let mut spins = 0u32;
        while !team.step_over(k, n_tasks) {
            if team.poisoned.load(Ordering::Acquire) {
                panic!("another member of the thread team panicked");
            }
            if spins.is_multiple_of(64) && since.elapsed() >= patience {
                // Acquire: pairs with the winner's fetch_max (a published task is skipped).
                let open = (0..n_tasks).find(|&i| team.marks[i].load(Ordering::Acquire) < epoch);
                if let Some(i) = open {
                    run(i, true);
                }
                since = Instant::now();
                spins = 0;
                continue;
            }
            if self.idle_step() {
                spins += 1;
                continue;
            }
            if spins < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            spins += 1;
        }
    }

    /// Claims tasks of step `k` (opening the step if this member is the first there) and runs
    /// each with `run` until every task is handed out; returns how many this member ran.
    fn claim_tasks(&self, k: u32, n_tasks: usize, mut run: impl FnMut(usize)) -> u64 {
        let team = self.team;
        let mut mine = 0u64;
        let mut c = team.claim.load(Ordering::Acquire);
        loop {
            let (step, next) = (step_of(c), (c & LOW) as usize);
            if step < k {
                self.open_step(k, c);
                c = team.claim.load(Ordering::Acquire);
                continue;
            }
            if step > k || next >= n_tasks {
                return mine; // step k is handed out (or over)
            }
            match team
                .claim
                .compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    run(next);
                    mine += 1;
                    c = team.claim.load(Ordering::Acquire);
                }
                Err(now) => c = now,
            }
        }
    }

    /// Opens step `k` after step `k - 1` is over (this member waited for it, or `k = 1`):
    /// first its completion count, then its task counter (`c`: the counter as last read).
    /// Others may race to do the same; each exchange succeeds once.
    fn open_step(&self, k: u32, c: u64) {
        let team = self.team;
        let d = team.done.load(Ordering::Acquire);
        if step_of(d) < k {
            let _ = team.done.compare_exchange(
                d,
                u64::from(k) << STEP_SHIFT,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        let _ = team.claim.compare_exchange(
            c,
            u64::from(k) << STEP_SHIFT,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Executes tasks `0..n_tasks`, each exactly once across the team, handed out dynamically
    /// (fast members take more), and returns once all of them are done — whoever ran them.
    ///
    /// Every member must call this with the same `n_tasks` in the same order. Whatever a step
    /// writes must be written inside its tasks: a member may reach a step after the team has
    /// finished it (it was descheduled), and then skips it. Reading what earlier steps wrote is
    /// safe anywhere after they returned.
    pub fn for_tasks(&self, n_tasks: usize, mut f: impl FnMut(usize)) {
        assert!(n_tasks as u64 <= LOW, "too many tasks in one step");
        let team = self.team;
        let k = self.step.get() + 1;
        self.step.set(k);
        let mine = self.claim_tasks(k, n_tasks, &mut f);
        if mine > 0 {
            // Release: this member's task writes happen before anyone sees the step over.
            let before = team.done.fetch_add(mine, Ordering::AcqRel);
            debug_assert_eq!(step_of(before), k);
        }
        team.wait_done(k, n_tasks, || self.idle_step());
    }

    /// Sets what this member prefetches while it waits for the next steps (replacing the
    /// previous hint): up to `cap` bytes of its share of `parts` (the first four), read in
    /// order (the members split the bytes between them in interleaved blocks). A hint changes
    /// no result: prefetches only move data into the caches. A decode step reads each weight
    /// once from memory; a member that would only spin at the end of a step loads the next
    /// matmul's weights instead.
    pub fn prefetch_while_waiting(&self, parts: &[&[u8]], cap: usize) {
        self.idle.borrow_mut().set(parts, cap);
    }

    fn idle_step(&self) -> bool {
        self.idle.borrow_mut().step(self.id, self.n)
    }

    /// Runs `f` once, on whichever member gets there first, and returns when it has run.
    pub fn single(&self, f: impl FnOnce()) {
        let mut f = Some(f);
        self.for_tasks(1, |_| (f.take().expect("one task"))());
    }

    /// Runs `f(i)` for every `i` in `0..len` across the team in contiguous chunks (a few per
    /// member, handed out dynamically), for cheap per-row work.
    pub fn for_rows(&self, len: usize, mut f: impl FnMut(usize)) {
        let chunk = len.div_ceil(4 * self.n).max(1);
        self.for_tasks(len.div_ceil(chunk), |c| {
            for i in c * chunk..((c + 1) * chunk).min(len) {
                f(i);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::SharedSlice;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// How long a dawdling member keeps its partners waiting in the tests below: long enough
    /// that a waiting member which stops spinning (yields) does so.
    const SPIN_LIMIT: Duration = Duration::from_micros(200);

    /// The members' shares of a hint cover its bytes once each, in order within a member, in
    /// chunks inside one range and one block; a cap bounds a member's share.
    #[test]
    fn idle_prefetch_shares_cover_the_hint_once() {
        let a = vec![0u8; 10_000];
        let b = vec![0u8; 5_123];
        let c = vec![0u8; 64];
        let parts: [&[u8]; 3] = [&a, &b, &c];
        for n in [1, 2, 3] {
            let mut seen: Vec<Vec<u32>> = parts.iter().map(|p| vec![0; p.len()]).collect();
            for id in 0..n {
                let mut h = IdlePrefetch::default();
                h.set(&parts, usize::MAX);
                let mut last = None;
                while let Some((addr, len)) = h.next_range(id, n) {
                    assert!(len > 0 && len <= IDLE_CHUNK);
                    let (pi, p) = parts
                        .iter()
                        .enumerate()
                        .find(|(_, p)| {
                            let base = p.as_ptr() as usize;
                            addr >= base && addr + len <= base + p.len()
                        })
                        .expect("a chunk lies inside one range");
                    let off = addr - p.as_ptr() as usize;
                    assert!(last.is_none_or(|l| (pi, off) > l), "in order");
                    last = Some((pi, off));
                    for s in &mut seen[pi][off..off + len] {
                        *s += 1;
                    }
                }
                assert!(h.next_range(id, n).is_none());
            }
            if cfg!(target_arch = "x86_64") {
                assert!(seen.iter().flatten().all(|&s| s == 1), "n = {n}");
            }
        }
        let mut h = IdlePrefetch::default();
        h.set(&parts, 1000);
        let mut total = 0;
        while let Some((_, len)) = h.next_range(0, 2) {
            total += len;
        }
        let want = if cfg!(target_arch = "x86_64") {
            1000
        } else {
            0
        };
        assert_eq!(total, want);
    }

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

    /// Runs `f` on its own thread and fails if it has not finished within `limit`: a step that
    /// never ends hangs rather than returning a wrong answer.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        match rx.recv_timeout(limit) {
            Ok(Ok(v)) => v,
            Ok(Err(payload)) => std::panic::resume_unwind(payload),
            Err(_) => panic!("no result after {limit:?}: a team step never ended"),
        }
    }

    #[test]
    fn members_on_too_few_cores_finish_every_step() {
        // More members than this machine has cores: members are preempted in and between
        // tasks, and every step must still run each task once and end (or the test times out).
        let threads = 2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
        const STEPS: usize = 2000;
        let hits = within(Duration::from_secs(120), move || {
            let team = Team::new(Some(threads));
            let hits = AtomicUsize::new(0);
            team.run(|w| {
                for step in 0..STEPS {
                    w.for_tasks(w.n, |i| {
                        if i == step % w.n && step % 50 == 0 {
                            std::thread::sleep(SPIN_LIMIT * 2);
                        }
                        hits.fetch_add(1, Ordering::Relaxed);
                    });
                }
            });
            hits.into_inner()
        });
        assert_eq!(hits, STEPS * threads);
    }

    #[test]
    fn a_member_panicking_outside_tasks_holds_nobody_up_and_the_team_recovers() {
        // Once with the others still in their steps, once after they finished theirs.
        for delay in [Duration::ZERO, SPIN_LIMIT * 10] {
            within(Duration::from_secs(60), move || {
                let team = Team::new(Some(2));
                let done = AtomicUsize::new(0);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    team.run(|w| {
                        if w.id == 1 {
                            std::thread::sleep(delay);
                            panic!("boom");
                        }
                        for _ in 0..3 {
                            w.for_tasks(4, |_| {
                                done.fetch_add(1, Ordering::Relaxed);
                            });
                        }
                    })
                }));
                assert!(r.is_err());
                assert_eq!(done.load(Ordering::Relaxed), 12);
                // The team still works afterwards.
                let hits = AtomicUsize::new(0);
                team.run(|w| {
                    w.for_tasks(10, |_| {
                        hits.fetch_add(1, Ordering::Relaxed);
                    });
                });
                assert_eq!(hits.load(Ordering::Relaxed), 10);
            });
        }
    }

    #[test]
    fn steps_order_task_writes_for_late_and_dawdling_members() {
        // Each step's tasks write cells; the next step's tasks read every cell (through any
        // member) and must see this step's values. One member dawdles now and then outside a
        // task (it then skips steps the others finish) or inside one (the step waits for it).
        const CELLS: usize = 64;
        const STEPS: usize = 400;
        for threads in [2, 3] {
            let stale = within(Duration::from_secs(120), move || {
                let team = Team::new(Some(threads));
                let mut cells = vec![0usize; CELLS];
                let shared = SharedSlice::new(&mut cells);
                let stale = AtomicUsize::new(0);
                team.run(|w| {
                    for step in 1..=STEPS {
                        if w.id == step % w.n && step % 7 == 0 {
                            std::thread::sleep(SPIN_LIMIT * 2);
                        }
                        w.for_tasks(CELLS, |i| {
                            if i == 0 && step % 11 == 0 {
                                std::thread::sleep(SPIN_LIMIT * 2);
                            }
                            // SAFETY: nobody writes the cells during a reading step.
                            let all = unsafe { shared.all() };
                            let want = if step == 1 { 0 } else { step - 1 };
                            if all[(i * 7) % CELLS] != want {
                                stale.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        w.for_tasks(CELLS, |i| {
                            // SAFETY: task i alone writes cell i in this step.
                            unsafe { shared.slice_mut(i..i + 1)[0] = step };
                        });
                    }
                });
                stale.into_inner()
            });
            assert_eq!(
                stale, 0,
                "{threads} threads: a step read cells before they were written"
            );
        }
    }

    #[test]
    fn a_descheduled_member_without_a_task_holds_nobody_up() {
        // Member 1 is away (sleeping, as if the OS had given its core to another thread) for
        // the whole run: member 0 must run every task of every step alone instead of waiting at
        // the first step's end, and member 1 then skips the finished steps.
        within(Duration::from_secs(60), || {
            let team = Team::new(Some(2));
            let by = [AtomicUsize::new(0), AtomicUsize::new(0)];
            let t0 = Instant::now();
            let member0_done = std::sync::Mutex::new(Duration::ZERO);
            team.run(|w| {
                if w.id == 1 {
                    std::thread::sleep(Duration::from_millis(400));
                }
                for _ in 0..50 {
                    w.for_tasks(8, |_| {
                        by[w.id].fetch_add(1, Ordering::Relaxed);
                    });
                }
                if w.id == 0 {
                    *member0_done.lock().unwrap() = t0.elapsed();
                }
            });
            assert_eq!(by[0].load(Ordering::Relaxed), 400);
            assert_eq!(by[1].load(Ordering::Relaxed), 0);
            let done = *member0_done.lock().unwrap();
            assert!(
                done < Duration::from_millis(300),
                "member 0 waited for member 1: {done:?}"
            );
        });
    }

    #[test]
    fn a_member_panicking_in_a_task_releases_the_waiting_members() {
        within(Duration::from_secs(60), || {
            let team = Team::new(Some(3));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                team.run(|w| {
                    w.for_tasks(3, |i| {
                        if i == 1 {
                            std::thread::sleep(SPIN_LIMIT * 5);
                            panic!("boom");
                        }
                    });
                })
            }));
            assert!(r.is_err());
            let hits = AtomicUsize::new(0);
            team.run(|w| {
                w.for_rows(37, |_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                });
                w.single(|| {
                    hits.fetch_add(100, Ordering::Relaxed);
                });
            });
            assert_eq!(hits.load(Ordering::Relaxed), 137);
        });
    }

    #[test]
    fn a_member_descheduled_inside_a_redoable_task_holds_nobody_up() {
        // The first run of task 0 of step 3 stalls for 1 s (as if its member had lost its
        // core mid-task): another member must redo it and go on through every later step long
        // before the stalled run ends, and every task's result is published exactly once, with
        // the right value, by whichever run finished first.
        for threads in [2, 3] {
            within(Duration::from_secs(60), move || {
                const STEPS: usize = 40;
                const TASKS: usize = 6;
                let team = Team::new(Some(threads));
                let mut cells = vec![0usize; STEPS * TASKS];
                let shared = SharedSlice::new(&mut cells);
                let wins: Vec<AtomicUsize> =
                    (0..STEPS * TASKS).map(|_| AtomicUsize::new(0)).collect();
                let stalled = AtomicBool::new(false);
                let first_done = std::sync::Mutex::new(None::<Duration>);
                let t0 = Instant::now();
                team.run(|w| {
                    for step in 0..STEPS {
                        w.for_tasks_redoable(TASKS, |i, commit| {
                            if step == 3 && i == 0 && !stalled.swap(true, Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(1000));
                            }
                            let value = step * 1000 + i; // the task's "private result"
                            if commit.win() {
                                wins[step * TASKS + i].fetch_add(1, Ordering::Relaxed);
                                // SAFETY: the winning run of (step, i) alone writes this cell.
                                unsafe {
                                    shared.slice_mut(step * TASKS + i..step * TASKS + i + 1)[0] =
                                        value
                                };
                            }
                        });
                    }
                    let mut first = first_done.lock().unwrap();
                    if first.is_none() {
                        *first = Some(t0.elapsed());
                    }
                });
                let first = first_done.lock().unwrap().unwrap();
                assert!(
                    // Generous (a loaded machine deschedules the others too), but well short of
                    // the stall.
                    first < Duration::from_millis(800),
                    "{threads} threads: the others waited for the stalled task: {first:?}"
                );
                assert!(team.redone() >= 1, "nobody redid the stalled task");
                for step in 0..STEPS {
                    for i in 0..TASKS {
                        let j = step * TASKS + i;
                        assert_eq!(wins[j].load(Ordering::Relaxed), 1, "step {step} task {i}");
                        assert_eq!(cells[j], step * 1000 + i, "step {step} task {i}");
                    }
                }
            });
        }
    }

    #[test]
    fn redone_tasks_publish_once_and_steps_order_their_writes() {
        // Tasks that now and then take longer than the redo patience get redone; each task must
        // still publish once, and the next step must see every published value (a member
        // reads all cells of the step before).
        for threads in [2, 3] {
            within(Duration::from_secs(120), move || {
                const STEPS: usize = 300;
                const TASKS: usize = 8;
                let team = Team::new(Some(threads));
                let mut cells = vec![0usize; TASKS];
                let shared = SharedSlice::new(&mut cells);
                let (runs, wins, stale) = (
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                );
                let slow: Vec<AtomicBool> =
                    (0..STEPS * TASKS).map(|_| AtomicBool::new(false)).collect();
                team.run(|w| {
                    for step in 1..=STEPS {
                        w.for_tasks(1, |_| {
                            // SAFETY: nobody writes the cells during this step.
                            let all = unsafe { shared.all() };
                            if all.iter().any(|&v| v != step - 1) {
                                stale.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        w.for_tasks_redoable(TASKS, |i, commit| {
                            runs.fetch_add(1, Ordering::Relaxed);
                            // The first run of every 23rd task dawdles (a redo need not).
                            let j = (step - 1) * TASKS + i;
                            if j.is_multiple_of(23) && !slow[j].swap(true, Ordering::Relaxed) {
                                std::thread::sleep(SPIN_LIMIT * 2);
                            }
                            if commit.win() {
                                wins.fetch_add(1, Ordering::Relaxed);
                                // SAFETY: the winning run of task i alone writes cell i.
                                unsafe { shared.slice_mut(i..i + 1)[0] = step };
                            }
                        });
                    }
                });
                assert_eq!(wins.load(Ordering::Relaxed), STEPS * TASKS);
                assert!(
                    runs.load(Ordering::Relaxed) > STEPS * TASKS && team.redone() > 0,
                    "{threads} threads: no task was redone, the test proves nothing"
                );
                assert_eq!(stale.load(Ordering::Relaxed), 0, "{threads} threads");
            });
        }
    }

    #[test]
    fn for_rows_and_single_cover_each_index_once() {
        for threads in [1, 2, 3] {
            let team = Team::new(Some(threads));
            for len in [0usize, 1, 5, 64, 1000] {
                let seen: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
                let singles = AtomicUsize::new(0);
                team.run(|w| {
                    w.for_rows(len, |i| {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    });
                    w.single(|| {
                        singles.fetch_add(1, Ordering::Relaxed);
                    });
                });
                assert!(
                    seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                    "len {len}"
                );
                assert_eq!(singles.load(Ordering::Relaxed), 1);
            }
        }
    }
}
