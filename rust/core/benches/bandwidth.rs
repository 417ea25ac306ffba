//! Read bandwidth of this host: `threads` threads each sum their share of one buffer of
//! `bytes` bytes, over and over; the figure is bytes read per second, the best of `reps` timed
//! passes (after one warm-up pass that pages the buffer in). A decode step must read every
//! weight (and, at depth, the sequence's K/V) once, so `bytes / bandwidth` of the step's bytes is
//! the step's floor and its inverse the ceiling in tokens/s: the roofline of
//! `benches/bench_roofline.py`, which runs this with the model's sizes.
//!
//! ```text
//! cargo bench -p kvserve-core --bench bandwidth -- [--threads N] [--reps N] [--json] BYTES...
//! ```
//!
//! BYTES accept K/M/G suffixes (powers of 1000) and MiB/GiB (powers of 1024). With `--json`
//! each size prints one line: {"bytes": .., "threads": .., "gb_s": .., "median_gb_s": ..,
//! "samples_gb_s": [..]} (`gb_s` the best pass: on a shared host the others lost their cores
//! for part of the pass).
//!
//! The loop sums 64-bit words into 8 independent accumulators, so it is limited by the memory
//! system, not by an add chain; the sum is printed-through with `black_box` so that nothing is
//! elided. The threads start each pass together (a barrier) and the pass ends when the last one
//! is done, as a decode step does.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

fn parse_bytes(s: &str) -> Result<usize, String> {
    let (num, mult) = [
        ("GiB", 1usize << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("G", 1_000_000_000),
        ("M", 1_000_000),
        ("K", 1_000),
    ]
    .iter()
    .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
    .unwrap_or((s, 1));
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected e.g. 94M, 512MiB or 1000000"))?;
    if v.is_nan() || v <= 0.0 {
        return Err(format!("bad size {s:?}: must be > 0"));
    }
    Ok((v * mult as f64) as usize)
}

fn sum_words(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*w);
        }
    }
    let mut s = tail.iter().fold(0u64, |s, w| s.wrapping_add(*w));
    for a in acc {
        s = s.wrapping_add(a);
    }
    s
}

/// Seconds for each of `reps` passes of `threads` threads over `buf` (after one warm-up pass).
/// The calling thread is one of them (and times the pass), so that exactly `threads` threads
/// compete for the cores.
fn measure(buf: &[u64], threads: usize, reps: usize) -> Vec<f64> {
    let share = buf.len().div_ceil(threads);
    let part = |t: usize| &buf[(t * share).min(buf.len())..((t + 1) * share).min(buf.len())];
    let start = Barrier::new(threads);
    let end = Barrier::new(threads);
    std::thread::scope(|s| {
        for t in 1..threads {
            let (start, end, part) = (&start, &end, part(t));
            s.spawn(move || {
                for _ in 0..=reps {
                    start.wait();
                    black_box(sum_words(black_box(part)));
                    end.wait();
                }
            });
        }
        let mut times = Vec::with_capacity(reps);
        for r in 0..=reps {
            start.wait();
            let t0 = Instant::now();
            black_box(sum_words(black_box(part(0))));
            end.wait();
            if r > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times
    })
}

fn main() {
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut reps, mut json, mut sizes) = (20usize, false, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" | "--reps" => {
                let v: usize = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|v| *v > 0)
                    .unwrap_or_else(|| panic!("{a} needs a positive integer"));
                if a == "--threads" {
                    threads = v;
                } else {
                    reps = v;
                }
            }
            "--json" => json = true,
            "--bench" => {} // cargo bench passes it to harness = false targets
            _ => sizes.push(parse_bytes(&a).unwrap_or_else(|e| panic!("{e}"))),
        }
    }
    if sizes.is_empty() {
        sizes = vec![100_000_000, 200_000_000];
    }
    for bytes in sizes {
        // Distinct values so that no page is shared (a zeroed buffer can map one page).
        let buf: Vec<u64> = (0..bytes.div_ceil(8) as u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let times = measure(&buf, threads, reps);
        let bytes_read = (buf.len() * 8) as f64;
        let samples: Vec<f64> = times.iter().map(|t| bytes_read / t / 1e9).collect();
        let best = samples.iter().cloned().fold(0.0, f64::max);
        let mut sorted = samples.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let median = sorted[sorted.len() / 2];
        if json {
            let list: Vec<String> = samples.iter().map(|g| format!("{g:.2}")).collect();
            println!(
                "{{\"bytes\": {}, \"threads\": {threads}, \"gb_s\": {best:.2}, \
                 \"median_gb_s\": {median:.2}, \"samples_gb_s\": [{}]}}",
                buf.len() * 8,
                list.join(", ")
            );
        } else {
            println!(
                "{:>8.1} MB, {threads} threads: best {best:.1} GB/s, median {median:.1} GB/s",
                bytes_read / 1e6,
            );
        }
    }
}
