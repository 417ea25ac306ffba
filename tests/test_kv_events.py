"""KV events (rust/core/src/kv/events.rs; ``Engine.kv_events``, python/kvserve/engine/events.py).

Oracles: the core's own key function through ``Engine.block_keys`` (and
``Context.block_keys``) for the keys a prompt's blocks get; the tokenizer for the token ids
an event carries; a mirror that applies every event, compared with a fresh snapshot
(``resync``) of what the pool holds, for stores and evictions in a small pool; vLLM's field
names for the shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvserve import Engine, Model
from kvserve._model import prompt_ids
from kvserve.engine.tenancy import salt_for

BS = 16
VLLM_STORED = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"}


def _apply(mirror: dict[str, str | None], events: list[dict[str, Any]]) -> None:
    for e in events:
        if e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            for h in e["block_hashes"]:
                assert h not in mirror, "stored twice without a removal"
                mirror[h] = parent
                parent = h
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                assert mirror.pop(h, "gone") != "gone", "removed but never stored"
        else:
            assert e["type"] == "AllBlocksCleared"
            mirror.clear()


def test_a_prompt_stores_its_blocks_under_the_keys_the_core_computes(model_path: Path) -> None:
    with Engine(model_path, threads=1, parallel=2, ctx_size=512) as eng:
        assert eng.kv_events() == [{"type": "AllBlocksCleared", "dropped": 0}], "empty pool"
        prompt = "The lighthouse keeper counted the ships that passed each night. " * 6
        ids = prompt_ids(eng.model, prompt)
        eng.generate(prompt, max_tokens=2)
        events = eng.kv_events()
        assert [e["type"] for e in events] == ["BlockStored"], "one chain, one event"
        e = events[0]
        assert VLLM_STORED <= set(e)
        keys = [f"{k:032x}" for k in eng.block_keys(ids)]
        n = len(ids) // BS
        assert len(keys) == n >= 3
        assert e["block_hashes"][:n] == keys, "the prompt's whole blocks, in order"
        assert e["token_ids"][: n * BS] == ids[: n * BS]
        assert len(e["token_ids"]) == BS * len(e["block_hashes"])
        assert (e["parent_block_hash"], e["block_size"], e["medium"]) == (None, BS, "CPU")
        # The same prompt again maps the cached blocks: nothing new is stored.
        eng.generate(prompt, max_tokens=1)
        assert all(h not in keys for ev in eng.kv_events() for h in ev.get("block_hashes", []))
        # A salted request's chain starts at its salt's root: other keys, a parent that is no
        # block of the pool, and the keys Engine.block_keys gives under that salt.
        eng.generate(prompt, max_tokens=1, cache_salt="x")
        (s,) = eng.kv_events()
        salted = [f"{k:032x}" for k in eng.block_keys(ids, salt_for(None, "x", True))]
        assert s["block_hashes"][:n] == salted
        assert not set(salted) & set(keys)
        assert s["parent_block_hash"] is not None and s["parent_block_hash"] not in keys


def test_evictions_are_removed_events_and_a_mirror_stays_exact(model_path: Path) -> None:
    oracle = Model.load(model_path, threads=1)
    per_block = int(oracle.new_context(16).stats()["bytes_per_block"])
    small = Model.load(model_path, threads=1)  # a fresh model: the pool is made at our size
    with Engine(small, parallel=1, ctx_size=128, kv_memory=8 * per_block) as eng:
        mirror: dict[str, str | None] = {}
        _apply(mirror, eng.kv_events())
        removed = 0
        for i in range(6):
            eng.generate(f"Story {i}: the keeper and the ship. " * 5, max_tokens=2)
            events = eng.kv_events()
            removed += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
            _apply(mirror, events)
        assert removed > 0, "the small pool evicted cached blocks"
        assert eng.stats()["kv_blocks_evicted"] >= removed
        truth: dict[str, str | None] = {}
        snapshot = eng.kv_events(resync=True)
        assert snapshot[0] == {"type": "AllBlocksCleared", "dropped": 0}
        _apply(truth, snapshot)
        assert set(mirror) == set(truth)
        assert 0 < len(truth) <= 8


def test_a_full_log_drops_events_and_the_next_drain_is_a_snapshot(model_path: Path) -> None:
    with Engine(model_path, threads=1, parallel=1, ctx_size=512) as eng:
        eng.kv_events(capacity=2)
        prompt = "A long and winding road leads to the lighthouse on the hill. " * 4
        eng.generate(prompt, max_tokens=1)
        events = eng.kv_events(capacity=2)
        assert events[0]["type"] == "AllBlocksCleared"
        assert events[0]["dropped"] >= 3, "more stores than the log holds"
        held = [h for e in events[1:] for h in e["block_hashes"]]
        keys = [f"{k:032x}" for k in eng.block_keys(prompt_ids(eng.model, prompt))]
        assert set(keys) <= set(held)
        with pytest.raises(ValueError, match="capacity"):
            eng.kv_events(capacity=0)
