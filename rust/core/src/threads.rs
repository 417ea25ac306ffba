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
