//! `session_state`: arbitrary bytes as a sequence state (`kv::state`), checked and written
//! into a context of each real model: SmolLM2 (one K/V group: format version 1) and Gemma 3
//! (a sliding-window and a global group: the version-2 container). Each model's context holds
//! a reference sequence 0 (a few decoded tokens) for the whole run.
//!
//! Properties, for every input and both models:
//! - `seq_state_check(data, tokens)` and `seq_state_write(1, data)` return `Ok` or `Err`,
//!   never panic; a state the check accepts is one the write accepts;
//! - a write that succeeds leaves a sequence that reads back, continues with a decode
//!   (sampled: every 16th such write) and is removed again;
//! - afterwards every group's table check and pool audit pass, sequence 1 is empty, the
//!   reference sequence reads back byte for byte, and (every 64th input) decoding its next
//!   token gives the logits it gave before the run, bit for bit.
//!
//! Model paths: `KVSERVE_TEST_MODEL` and `KVSERVE_TEST_GEMMA`, else the default cache paths.
#![no_main]

#[path = "alloc_limit.rs"]
mod alloc_limit;

#[global_allocator]
static ALLOC: alloc_limit::Limited = alloc_limit::Limited;

use std::sync::{Arc, Mutex};

use kvserve_core::kv::memory::Memory;
use kvserve_core::model::{Context, KvOptions, Model};
use kvserve_core::{Batch, Error};
use libfuzzer_sys::fuzz_target;

/// The prompt of the reference sequence and the token decoded after it.
const PROMPT: &str = "The capital of France is";
const NEXT: &str = " Paris";

struct Fixture {
    ctx: Context,
    tokens: Vec<u32>,
    state: Vec<u8>,
    next: u32,
    logits: Vec<f32>,
    cells: usize,
}

struct Runner {
    fixtures: Vec<Fixture>,
    inputs: u64,
    writes: u64,
}

fn fixture(var: &str, default: &str) -> Fixture {
    let path = std::env::var(var).unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        format!("{home}/.cache/kvserve/models/{default}")
    });
    let model = Arc::new(Model::load(&path, Some(1)).unwrap_or_else(|e| panic!("{path}: {e}")));
    let o = KvOptions {
        n_ctx: 256,
        ..KvOptions::default()
    };
    let mut ctx = Context::with_options(Arc::clone(&model), &o).expect("context");
    let tok = &model.tokenizer;
    let tokens = tok.encode(PROMPT, true, false);
    let next = tok.encode(NEXT, false, false)[0];
    ctx.decode(&Batch::prompt(&tokens, 0, 0)).expect("prompt");
    let state = ctx.seq_state_read(0).expect("state");
    let logits = next_logits(&mut ctx, &tokens, next).expect("decode");
    let cells = ctx.memory().n_cells();
    Fixture {
        ctx,
        tokens,
        state,
        next,
        logits,
        cells,
    }
}

/// Logits of `next` decoded after sequence 0's `tokens`; the token is removed again.
fn next_logits(ctx: &mut Context, tokens: &[u32], next: u32) -> Result<Vec<f32>, Error> {
    let n = tokens.len() as i32;
    let out = ctx.decode(&Batch::prompt(&[next], n, 0));
    ctx.memory_mut().seq_rm(0, n, -1)?;
    Ok(out?.data)
}

fn audit(ctx: &Context) {
    for g in ctx.memory().groups() {
        g.cache.table().check().expect("table check");
        g.cache.table().pool().audit().expect("pool audit");
    }
    if let Some(r) = ctx.memory().recurrent() {
        r.check().expect("recurrent check");
    }
}

static RUNNER: Mutex<Option<Runner>> = Mutex::new(None);

fn run(r: &mut Runner, data: &[u8]) {
    r.inputs += 1;
    for f in &mut r.fixtures {
        let checked = f.ctx.seq_state_check(data, &f.tokens);
        match f.ctx.seq_state_write(1, data) {
            Ok(n) => {
                assert!(
                    checked.is_err() || checked.as_ref().ok() == Some(&n),
                    "check said {checked:?}, write wrote {n} cells"
                );
                r.writes += 1;
                let back = f.ctx.seq_state_read(1).expect("a written state reads back");
                if data == f.state.as_slice() {
                    assert_eq!(back, f.state, "the reference state reads back as written");
                }
                let end = f.ctx.memory().seq_pos_max(1);
                if r.writes.is_multiple_of(16) && end >= 0 {
                    // Continues (or fails cleanly: a full pool, a window that cannot resume).
                    let _ = f.ctx.decode(&Batch::prompt(&[f.next], end + 1, 1));
                }
                f.ctx
                    .memory_mut()
                    .seq_rm(1, -1, -1)
                    .expect("remove sequence 1");
            }
            Err(e) => {
                let full = matches!(e, Error::KvCacheFull(_));
                assert!(
                    checked.is_err() || full,
                    "check accepted what write refused: {e}"
                );
                assert!(
                    matches!(e, Error::InvalidInput(_) | Error::KvCacheFull(_)),
                    "a bad state is InvalidInput: {e:?}"
                );
            }
        }
        audit(&f.ctx);
        assert_eq!(
            f.ctx.memory().seq_pos_max(1),
            -1,
            "sequence 1 is empty again"
        );
        assert_eq!(
            f.ctx.memory().n_cells(),
            f.cells,
            "cells back to the baseline"
        );
        let now = f.ctx.seq_state_read(0).expect("reference state");
        assert!(now == f.state, "the reference sequence changed");
        if r.inputs.is_multiple_of(64) {
            let logits = next_logits(&mut f.ctx, &f.tokens, f.next).expect("decode");
            assert!(
                logits == f.logits,
                "the reference sequence decodes differently"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut guard = RUNNER.lock().unwrap_or_else(|p| p.into_inner());
    let r = guard.get_or_insert_with(|| Runner {
        fixtures: vec![
            fixture("KVSERVE_TEST_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            fixture("KVSERVE_TEST_GEMMA", "gemma-3-270m-q4_k_m.gguf"),
        ],
        inputs: 0,
        writes: 0,
    });
    run(r, data);
});
