"""The K/V disk tier (issue 21, L2): full blocks the prefix cache keys are written to
``kv_disk``; a prompt whose blocks the RAM pool evicted reads them back instead of computing
them, also after a restart; an entry that is not intact is a miss, never a wrong answer.

Oracles: the same request's greedy output from an engine on a separate model instance without
the tier; and a simple model of what the tier must hold: every whole block of every prompt
computed, so a repeated prompt's whole blocks (all but its last token) come back, RAM having
evicted them. The entry files are read with an independent parser of the documented format
(docs/KV_SEMANTICS.md, "Disk tier")."""

from __future__ import annotations

import gc
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import Engine, Model
from kvserve._model import prompt_ids
from kvserve.server.metrics import Metrics

sys.path.insert(0, str(Path(__file__).parent))

import lfm2_reference as lref  # noqa: E402

BLOCK = 16
FIXED = 72  # magic, version, block size, model id, key, parent, payload length


def _prompt(model: Model, k: int, n_tokens: int = 1000) -> str:
    """A prompt of about ``n_tokens`` tokens whose first block differs from every other k's."""
    words = [f"Document {k}:"] + [f"item{(i * (k + 3) + k) % 997}" for i in range(n_tokens)]
    text = ""
    for w in words:
        longer = f"{text} {w}" if text else w
        if len(prompt_ids(model, longer)) > n_tokens:
            break
        text = longer
    return text


def _per_block(model_path: Path) -> int:
    return int(Model(model_path, threads=1).new_context(16).stats()["bytes_per_block"])


def _engine(model_path: Path, per_block: int, **kw: Any) -> Engine:
    """An engine on a fresh model instance (its pool sized by kv_memory: 128 blocks, about two
    of the prompts), one sequence at a time."""
    model = Model(model_path, threads=2)
    return Engine(model, parallel=1, ctx_size=1100, kv_memory=128 * per_block, **kw)


def _written(engine: Engine) -> dict[str, Any]:
    """The engine's stats once the disk tier wrote everything queued."""
    deadline = time.monotonic() + 60
    while (st := engine.stats())["kv_disk_queued"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st["kv_disk_queued"] == 0, "the disk tier's writer did not catch up"
    return st


def _gone() -> None:
    """After ``engine.close(); del engine``: the model goes, and with it the tier (it lives as
    long as the model's K/V memory and holds the directory's lock), as in a restart."""
    gc.collect()


def _entries(disk: Path, pattern: str = "*/*.kvb") -> dict[int, tuple[int, list[int], Path]]:
    """Every entry file under ``disk`` (``pattern``: of every model id's directory): key ->
    (parent key, tokens, path), read from the headers."""
    out = {}
    for f in disk.glob(pattern):
        head = f.read_bytes()[: FIXED + 4 * BLOCK]
        magic, version, bs = struct.unpack_from("<8sII", head)
        assert (magic, version, bs) == (b"KVSDISK\0", 1, BLOCK)
        lo, hi = struct.unpack_from("<QQ", head, 32)
        plo, phi = struct.unpack_from("<QQ", head, 48)
        key, parent = lo | hi << 64, plo | phi << 64
        assert f.name == f"{key:032x}.kvb"
        tokens = list(struct.unpack_from(f"<{BLOCK}I", head, FIXED))
        out[key] = (parent, tokens, f)
    return out


def _chain(disk: Path, ids: list[int], pattern: str = "*/*.kvb") -> list[Path]:
    """The entry files of ``ids``'s whole blocks, in order (by parent keys and tokens)."""
    entries = _entries(disk, pattern)
    by_parent = {(parent, tuple(t)): (key, f) for key, (parent, t, f) in entries.items()}
    files, parent = [], 0
    for i in range(len(ids) // BLOCK):
        key, f = by_parent[(parent, tuple(ids[i * BLOCK : (i + 1) * BLOCK]))]
        files.append(f)
        parent = key
    return files


def _metric(engine: Engine, name: str) -> float:
    text = Metrics(engine.stats, engine.waiting_by_priority).render().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} is not exported")


def test_evicted_prompts_come_back_from_disk(model_path: Path, tmp_path: Path) -> None:
    per_block = _per_block(model_path)
    model = Model(model_path, threads=1)
    prompts = [_prompt(model, k) for k in range(4)]
    ids = prompt_ids(model, prompts[0])
    assert 990 <= len(ids) <= 1000
    usable = (len(ids) - 1) // BLOCK * BLOCK  # what a prefix match can map
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with _engine(model_path, per_block) as oracle:
        want = oracle.generate(prompts[0], **greedy).tokens
        assert oracle.stats()["kv_disk_enabled"] == 0
    disk = tmp_path / "kv"
    engine = _engine(model_path, per_block, kv_disk=disk, kv_disk_size="1GiB")
    first = engine.generate(prompts[0], **greedy)
    assert (first.tokens, first.cached_tokens) == (want, 0)
    # Three more prompts than the pool's two: the first one's blocks leave RAM.
    for p in prompts[1:]:
        assert engine.generate(p, max_tokens=1).cached_tokens == 0
    st = _written(engine)
    assert st["kv_disk_enabled"] == 1
    assert st["kv_disk_writes_dropped"] == 0
    n_blocks = [len(prompt_ids(model, p)) // BLOCK for p in prompts]
    assert st["kv_disk_entries"] >= sum(n_blocks)
    assert len(_chain(disk, ids)) == n_blocks[0]
    assert st["kv_blocks_evicted"] >= n_blocks[0]
    again = engine.generate(prompts[0], **greedy)
    st2 = engine.stats()
    assert again.cached_tokens == usable
    assert st2["kv_disk_hit_tokens"] - st["kv_disk_hit_tokens"] == usable, "all from disk"
    assert st2["kv_disk_hit_blocks"] - st["kv_disk_hit_blocks"] == usable // BLOCK
    assert again.tokens == want
    assert st2["kv_disk_read_seconds"] > 0
    assert 0 < st2["kv_disk_read_latency_s"] < 0.5
    assert st2["kv_disk_bytes_read"] > usable // BLOCK * per_block
    assert _metric(engine, "kvserve_kv_disk_hit_tokens_total") == st2["kv_disk_hit_tokens"]
    assert _metric(engine, "kvserve_kv_disk_entries") == st2["kv_disk_entries"]
    held = _written(engine)["kv_disk_entries"]
    engine.close()
    del engine
    _gone()

    # A restart on the same directory: the tier finds its entries; still a disk hit.
    engine = _engine(model_path, per_block, kv_disk=disk, kv_disk_size="1GiB")
    st = engine.stats()
    assert st["kv_disk_loaded"] == st["kv_disk_entries"] == held
    r = engine.generate(prompts[0], **greedy)
    assert (r.cached_tokens, r.tokens) == (usable, want)
    assert engine.stats()["kv_disk_hit_tokens"] == usable
    engine.close()
    del engine
    _gone()

    # A flipped byte in the payload of the prompt's block 10: a miss there, the entry
    # removed, the blocks before it still from disk, the rest computed, the output right.
    chain = _chain(disk, ids)
    original = chain[10].read_bytes()
    damaged = bytearray(original)
    damaged[FIXED + 4 * BLOCK + 1000] ^= 0x01
    chain[10].write_bytes(bytes(damaged))
    engine = _engine(model_path, per_block, kv_disk=disk, kv_disk_size="1GiB")
    r = engine.generate(prompts[0], **greedy)
    st = _written(engine)
    assert (r.cached_tokens, r.tokens) == (10 * BLOCK, want)
    assert (st["kv_disk_hit_blocks"], st["kv_disk_removed"]) == (10, 1)
    assert st["kv_disk_misses"] == 1
    # The recomputed block was written through again: the same bytes as the first time.
    assert chain[10].read_bytes() == original
    engine.close()
    del engine
    _gone()


def test_a_full_tier_keeps_its_size(model_path: Path, tmp_path: Path) -> None:
    """With room for 40 entries, the tier keeps the 40 most recently used blocks: the
    prompt computed last comes back whole; the one before it only as far as the tier
    kept it, and its output is still the right one."""
    per_block = _per_block(model_path)
    model = Model(model_path, threads=1)
    prompts = [_prompt(model, k, 400) for k in (7, 8)]
    greedy = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    with _engine(model_path, per_block) as oracle:
        want = [oracle.generate(p, **greedy).tokens for p in prompts]
    entry = FIXED + 4 * BLOCK + per_block + 16
    disk = tmp_path / "kv"
    engine = _engine(model_path, per_block, kv_disk=disk, kv_disk_size=40 * entry)
    for p in prompts:
        engine.generate(p, **greedy)
    st = _written(engine)
    assert st["kv_disk_entries"] == 40 and st["kv_disk_bytes"] == 40 * entry
    n = [len(prompt_ids(model, p)) for p in prompts]
    written = sum((k + greedy["max_tokens"] - 1) // BLOCK for k in n)
    assert st["kv_disk_evicted"] == written - 40
    engine.close()
    del engine
    _gone()
    engine = _engine(model_path, per_block, kv_disk=disk, kv_disk_size=40 * entry)
    # The second prompt's blocks are the newest: all on disk.
    r = engine.generate(prompts[1], **greedy)
    assert (r.cached_tokens, r.tokens) == ((n[1] - 1) // BLOCK * BLOCK, want[1])
    # The first prompt lost its oldest (leading) blocks: nothing of it maps; right output.
    r = engine.generate(prompts[0], **greedy)
    assert (r.cached_tokens, r.tokens) == (0, want[0])
    engine.close()
    del engine
    _gone()


def test_gemma_prompts_past_the_window_come_back_from_disk(
    gemma_path: Path, tmp_path: Path
) -> None:
    """Gemma 3 (a window group of 512 positions beside the full group): each group writes its
    blocks to its own tier under the directory; a prompt longer than the window whose blocks
    RAM evicted in both groups maps from disk (the full group its whole prefix, the window
    group only the window before the resume point), and its greedy output is the output of an
    engine without the tier on another model instance."""
    model = Model(gemma_path, threads=1)
    prompts = [_prompt(model, k, 600) for k in range(3)]
    ids = prompt_ids(model, prompts[0])
    assert 590 <= len(ids) <= 600
    usable = (len(ids) - 1) // BLOCK * BLOCK
    # The blocks a token at `usable` sees: positions usable - 511 .. usable - 1.
    window_blocks = usable // BLOCK - (usable + 1 - 512) // BLOCK
    per_block = sum(g["bytes_per_block"] for g in model.new_context(16).stats()["groups"])
    # 60 blocks per group: one prompt's 38 and the window of a running one, not three prompts.
    kw: dict[str, Any] = {
        "parallel": 1, "ctx_size": 700, "batch_tokens": 128, "kv_memory": 60 * per_block,
    }  # fmt: skip
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Engine(Model(gemma_path, threads=2), **kw) as oracle:
        want = oracle.generate(prompts[0], **greedy).tokens
    disk = tmp_path / "kv"
    engine = Engine(Model(gemma_path, threads=2), kv_disk=disk, kv_disk_size="1GiB", **kw)
    first = engine.generate(prompts[0], **greedy)
    assert (first.tokens, first.cached_tokens) == (want, 0)
    for p in prompts[1:]:
        assert engine.generate(p, max_tokens=1).cached_tokens == 0
    st = _written(engine)
    assert st["kv_disk_enabled"] == 1 and st["kv_disk_writes_dropped"] == 0
    groups = engine._loop.kv.ctx.stats()["groups"]
    assert sorted(g["kind"] for g in groups) == ["full", "window"]
    subdirs = [d for d in disk.iterdir() if d.is_dir()]
    assert len(subdirs) == 2, "a directory per group (its model id)"
    n_blocks = len(ids) // BLOCK
    for g in groups:
        assert g["blocks_total"] == 60
        assert g["disk_entries"] >= 3 * n_blocks, g
        assert g["blocks_evicted"] >= n_blocks, g
    for d in subdirs:
        assert len(_chain(d, ids, "*.kvb")) == n_blocks, "each group holds the prompt's chain"
    again = engine.generate(prompts[0], **greedy)
    assert again.cached_tokens == usable
    assert again.tokens == want
    after = {g["kind"]: g for g in engine._loop.kv.ctx.stats()["groups"]}
    before = {g["kind"]: g for g in groups}
    read = {k: after[k]["disk_hit_blocks"] - before[k]["disk_hit_blocks"] for k in after}
    assert read == {"full": usable // BLOCK, "window": window_blocks}, "all from disk"
    assert engine.stats()["kv_disk_hit_blocks"] - st["kv_disk_hit_blocks"] == sum(read.values())
    engine.close()
    del engine
    _gone()


def test_lfm2_prompts_come_back_from_disk_with_their_state(tmp_path: Path) -> None:
    """A hybrid model (a tiny LFM2: short-conv layers and an attention layer): the K/V blocks
    and the recurrent group's state checkpoints go to the disk tier; a prompt RAM evicted
    resumes from disk at its last block boundary (K/V and the checkpoint read back), with the
    logits and greedy output of the same model without the tier (another instance)."""
    path = tmp_path / "lfm2.gguf"
    lref.write_model(path, lref.VARIANTS["cca-f32"])
    ids = list(range(40, 40 + 70))
    usable = (len(ids) - 1) // BLOCK * BLOCK
    assert usable == 64
    per_block = Model(path, threads=1).new_context(16).stats()["bytes_per_block"]
    # 16 blocks: a prompt (4 K/V blocks, 4 checkpoints, its tail and state), not three.
    kw: dict[str, Any] = {"parallel": 1, "ctx_size": 256, "kv_memory": 16 * per_block}
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Engine(Model(path, threads=2), **kw) as oracle:
        want = oracle.generate(ids, **greedy).tokens
    disk = tmp_path / "kv"
    engine = Engine(Model(path, threads=2), kv_disk=disk, kv_disk_size="64MiB", **kw)
    first = engine.generate(ids, **greedy)
    assert (first.tokens, first.cached_tokens) == (want, 0)
    for k in range(3):
        other = [200 + k] + list(range(60 + k, 60 + k + 69))
        assert engine.generate(other, max_tokens=1).cached_tokens == 0
    st = _written(engine)
    assert st["kv_disk_enabled"] == 1 and st["kv_disk_writes_dropped"] == 0
    groups = engine._loop.kv.ctx.stats()["groups"]
    assert [g["kind"] for g in groups if g["kind"] != "recurrent"] == ["full"]
    full = next(g for g in groups if g["kind"] == "full")
    # Each prompt's 4 K/V blocks and 4 checkpoints (and the generated tokens' blocks).
    assert full["disk_entries"] >= 4 * 8, full
    assert st["kv_disk_entries"] == full["disk_entries"]
    assert full["blocks_evicted"] >= 16, "RAM forgot the first prompt"
    again = engine.generate(ids, **greedy)
    assert (again.tokens, again.cached_tokens) == (want, usable)
    read = engine.stats()["kv_disk_hit_blocks"] - st["kv_disk_hit_blocks"]
    assert read == usable // BLOCK + 1, "4 K/V blocks and the one checkpoint used"
    engine.close()
    del engine
    _gone()

    # The same at the context level, logits compared: a context of a model with the tier
    # (after a restart: all from disk) resumes at 64 and decodes the rest.
    m = Model(path, threads=2)
    ctx = m.core.new_context(256)
    ctx.set_kv_disk(str(disk), 64 << 20)
    assert ctx.match_prefix(0, ids) == usable
    assert ctx.stats()["disk_hit_blocks"] == usable // BLOCK + 1
    rest = ids[usable:]
    n = len(rest)
    out = ctx.decode(rest, list(range(usable, len(ids))), [0] * n, [True] * n)
    got = np.frombuffer(out, dtype=np.float32).reshape(n, out.n_vocab)
    plain = Model(path, threads=2).core.new_context(256)
    out = plain.decode(ids, list(range(len(ids))), [0] * len(ids), [True] * len(ids))
    ref = np.frombuffer(out, dtype=np.float32).reshape(len(ids), out.n_vocab)[usable:]
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
    ctx.audit()


def test_bad_settings(model_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="kv disk tier"):
        Engine(Model(model_path, threads=1), parallel=1, kv_disk=blocker / "kv")
    with pytest.raises(ValueError, match="holds no block"):
        Engine(Model(model_path, threads=1), parallel=1, kv_disk=tmp_path, kv_disk_size=1000)
    with pytest.raises(ValueError, match="kv_disk_size"):
        Engine(Model(model_path, threads=1), parallel=1, kv_disk=tmp_path, kv_disk_size="big")
