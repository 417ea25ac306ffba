"""KV events as :meth:`kvserve.Engine.kv_events` hands them out: the core's raw events
(``kvserve._core.Context.kv_events_drain``; rust/core/src/kv/events.rs) as dicts shaped like
vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (docs/CLUSTER.md gives the
mapping), with consecutive stores of one chain merged into one event as vLLM sends them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ROOT_KEY", "key_hex", "to_vllm"]

ROOT_KEY = 0  # the parent of an unsalted sequence's first block (no block has it)


def key_hex(key: int) -> str:
    """A 128-bit content key as 32 hex digits (the form the disk tier's file names use)."""
    return f"{key:032x}"


def to_vllm(
    raw: Sequence[tuple[Any, ...]], block_size: int, dropped: int = 0
) -> list[dict[str, Any]]:
    """``raw`` (in order) as vLLM-shaped dicts. A ``BlockStored`` whose parent is the last
    block of the previous ``BlockStored`` (same medium) extends it. ``dropped`` (events the
    core's bounded log lost; a snapshot follows) is put on the ``AllBlocksCleared`` event."""
    out: list[dict[str, Any]] = []
    for e in raw:
        kind = e[0]
        if kind == "BlockStored":
            _, key, parent, tokens, medium = e
            last = out[-1] if out else None
            if (
                last is not None
                and last["type"] == "BlockStored"
                and last["medium"] == medium
                and last["block_hashes"][-1] == key_hex(parent)
            ):
                last["block_hashes"].append(key_hex(key))
                last["token_ids"].extend(tokens)
                continue
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [key_hex(key)],
                    "parent_block_hash": None if parent == ROOT_KEY else key_hex(parent),
                    "token_ids": list(tokens),
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": medium,
                }
            )
        elif kind == "BlockRemoved":
            _, key, medium = e
            last = out[-1] if out else None
            if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
                last["block_hashes"].append(key_hex(key))
                continue
            out.append({"type": "BlockRemoved", "block_hashes": [key_hex(key)], "medium": medium})
        elif kind == "AllBlocksCleared":
            out.append({"type": "AllBlocksCleared", "dropped": dropped})
        else:  # pragma: no cover - the core has no other kind
            raise ValueError(f"unknown KV event {kind!r}")
    return out
