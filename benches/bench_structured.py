#!/usr/bin/env python3
"""Structured output (issue 22): what a JSON schema costs a batch, and how the constrained
decoding engines compare on our two vocabularies.

1. Engines: for SmolLM2's 49,152-token and Gemma 3's 262,144-token vocabularies,
   llguidance (kvserve's choice) and outlines-core (``pip install outlines-core``; a row says
   so when it is absent): the one-time vocabulary build, the compile time of a schema, and the
   time of a token mask while walking a valid instance token by token (llguidance fills a
   bitmask; outlines-core lists the allowed ids, which a bitmask would still have to be made
   of). xgrammar is not measured: its wheel requires torch.
2. Decode, per model: 16 sequences in one engine decoding at once, free vs under a JSON schema
   that makes each of them write 48 small integers (~100-150 tokens); in the free run each
   sequence generates (``ignore_eos``) exactly as many tokens as its constrained twin did, so
   both batches shrink alike as sequences end. Reported: generated tokens per second of wall
   time for both and their ratio (target ≥ 0.9x; the two runs alternate ``--rounds`` times and
   the median ratio is reported), the mask time per token on the helper thread, the part of it
   the engine thread waited for after a pass, the first request's compile time (the vocabulary
   build included) and a later schema's.

  python benches/bench_structured.py --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    add_idle_args,
    append_section,
    default_model,
    loadavg,
    machine_desc,
    this_command,
    utc_stamp,
    wait_for_idle,
)

from kvserve import Engine, Model
from kvserve.grammar import Grammars, constraint_from

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "loc": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "loc", "note"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Alice",
    "age": 42,
    "tags": ["a", "ccc"],
    "loc": {"lat": 1.5, "lon": -2.25},
    "note": None,
}
NUMBERS = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 48,
            "maxItems": 48,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "List some numbers as JSON."}]
# Gemma 3 270M: $KVSERVE_TEST_GEMMA, else where `kvserve pull gemma3-270m-q4_k_m` puts it.
GEMMA = os.environ.get(
    "KVSERVE_TEST_GEMMA", str(Path.home() / ".cache/kvserve/models/gemma-3-270m-q4_k_m.gguf")
)


def _vocab(model: Model) -> tuple[list[bytes], list[int]]:
    core = model.core
    tokens, special = [], []
    for i in range(core.n_vocab):
        plain = core.token_to_piece(i, False)
        if not plain and core.token_to_piece(i, True):
            special.append(i)
        tokens.append(plain)
    return tokens, special


def engines(path: str) -> list[str]:
    model = Model(path)
    name = f"{model.name or Path(path).stem} ({model.n_vocab:,} tokens)"
    rows = []
    g = Grammars(model)
    t0 = time.perf_counter()
    g.tokenizer()
    build = time.perf_counter() - t0
    c = constraint_from(json_schema=SCHEMA)
    assert c is not None
    t0 = time.perf_counter()
    m = g.matcher(c)
    compile_s = time.perf_counter() - t0
    import llguidance.numpy as lln

    ids = model.tokenize(json.dumps(INSTANCE), add_special=False)  # the layout we enforce
    bitmask = lln.allocate_token_bitmask(1, model.n_vocab)
    times = []
    for tok in [*ids, None]:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(m, bitmask)
        times.append(time.perf_counter() - t0)
        if tok is not None:
            assert m.consume_token(tok), m.get_error()
    assert m.is_accepting()
    rows.append(
        f"| {name} | llguidance | {build * 1e3:.0f} ms | {compile_s * 1e3:.1f} ms |"
        f" {statistics.mean(times) * 1e6:.0f} / {statistics.median(times) * 1e6:.0f} /"
        f" {max(times) * 1e6:.0f} µs |"
    )
    try:
        import outlines_core as oc
    except ImportError:
        rows.append(f"| {name} | outlines-core | not installed | | |")
        return rows
    tokens, special = _vocab(model)
    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    eos = model.eos
    for i, b in enumerate(tokens):
        if b and i != eos and i not in special:
            table.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos, table)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    compile_s = time.perf_counter() - t0
    guide = oc.Guide(index)
    times = []
    for tok in [*ids, None]:
        t0 = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - t0)
        if tok is not None:
            guide.advance(tok)
    rows.append(
        f"| {name} | outlines-core | {build * 1e3:.0f} ms | {compile_s * 1e3:.1f} ms |"
        f" {statistics.mean(times) * 1e6:.0f} / {statistics.median(times) * 1e6:.0f} /"
        f" {max(times) * 1e6:.0f} µs |"
    )
    return rows


async def _batch(engine: Engine, max_tokens: list[int], **opts: Any) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(engine.achat(ASK, max_tokens=m, seed=i, **opts) for i, m in enumerate(max_tokens))
    )
    return time.perf_counter() - t0, list(results)


def decode(path: str, n: int, threads: int | None, rounds: int) -> tuple[str, dict[str, float]]:
    out: dict[str, list[float]] = {"free": [], "json": [], "ratio": []}
    with Engine(path, parallel=n, ctx_size=1024, threads=threads) as engine:
        model = engine.model
        rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS}}
        # What the first constrained request of an engine pays when it is built (the
        # vocabulary, then its schema), and what a request with a new schema pays later.
        first = constraint_from(response_format=rf)
        assert first is not None
        t0 = time.perf_counter()
        engine._grammars.matcher(first)
        first_compile = time.perf_counter() - t0
        other = constraint_from(json_schema=SCHEMA)
        assert other is not None
        t0 = time.perf_counter()
        engine._grammars.matcher(other)
        later_compile = time.perf_counter() - t0
        masks0 = engine.stats()
        for _ in range(rounds):
            # Constrained: sampled (seeded per sequence), so the 16 outputs differ.
            dt, res = asyncio.run(_batch(engine, [400] * n, response_format=rf, temperature=0.8))
            for r in res:
                assert r.finish_reason == "stop", r.text
                assert len(json.loads(r.text)["values"]) == 48
            tokens = [len(r.tokens) for r in res]
            json_tps = sum(tokens) / dt
            # Each free sequence as long as its constrained twin: the batch shrinks alike.
            dt, res = asyncio.run(_batch(engine, tokens, ignore_eos=True, temperature=0.8))
            assert [len(r.tokens) for r in res] == tokens
            free_tps = sum(len(r.tokens) for r in res) / dt
            out["json"].append(json_tps)
            out["free"].append(free_tps)
            out["ratio"].append(json_tps / free_tps)
        st = engine.stats()
        masks = st["grammar_masks"] - masks0["grammar_masks"]
        mask_s = st["grammar_mask_seconds"] - masks0["grammar_mask_seconds"]
        wait_s = st["grammar_mask_wait_seconds"] - masks0["grammar_mask_wait_seconds"]
        name = f"{model.name or Path(path).stem} ({model.n_vocab:,})"
    row = (
        f"| {name} | {statistics.median(out['free']):.1f} | {statistics.median(out['json']):.1f}"
        f" | {statistics.median(out['ratio']):.2f} ({min(out['ratio']):.2f}-"
        f"{max(out['ratio']):.2f}) | {mask_s / masks * 1e6:.0f} µs | {wait_s / masks * 1e6:.0f} µs"
        f" | {first_compile * 1e3:.0f} ms | {later_compile * 1e3:.1f} ms |"
    )
    return row, {"ratio": statistics.median(out["ratio"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--gemma", default=GEMMA)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="append the tables to BENCHMARKS.md")
    add_idle_args(ap)
    args = ap.parse_args()
    busy = wait_for_idle(args.wait_idle, args.wait_max)
    paths = [args.model, args.gemma]
    eng = [
        "| vocabulary | engine | vocabulary build | schema compile | mask mean / p50 / max |",
        "|---|---|---:|---:|---:|",
    ]
    for p in paths:
        eng += engines(p)
    dec = [
        "| model (vocabulary) | free tok/s | JSON schema tok/s | ratio (min-max) |"
        " mask per token | waited per token | first compile | later compile |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in paths:
        row, _ = decode(p, args.n, args.threads, args.rounds)
        dec.append(row)
    head = (
        f"{utc_stamp()}, {machine_desc()}, load {loadavg()}, CPUs {busy:.0f}% busy before;"
        f" {args.n} sequences, {args.rounds} rounds (medians), threads"
        f" {args.threads or 'default'}"
    )
    table = head + "\n\n" + "\n".join(eng) + "\n\n" + "\n".join(dec) + "\n"
    print(table)
    if args.write:
        cmd = this_command("bench_structured.py", args.model)
        append_section(REPO_ROOT / "BENCHMARKS.md", "## Structured output (issue 22)", table, cmd)


if __name__ == "__main__":
    main()
