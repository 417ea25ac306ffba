"""Fair share between tenants on the real model (python/kvserve/engine/scheduler.py, "Tenants").

The policy itself is tested without a model in tests/test_scheduler.py; here the engine runs it:
a tenant that floods the queue does not hold back another tenant's one request, and the
preemptions that makes do not change what any request generates. The oracle is plain
sequential generation (``Model.generate`` on a separate ``Model`` of the same file, one request
at a time, nothing else running).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kvserve import Engine, Model
from kvserve.engine import TenantPolicy

PARALLEL = 4
FLOOD_TOKENS = 24
LIGHT_TOKENS = 8


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


@pytest.fixture(scope="module")
def served(model_path: Path) -> Model:
    return Model.load(model_path, threads=2)


async def until(cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_a_flooding_tenant_does_not_hold_back_another_tenants_request(
    served: Model, oracle: Model
) -> None:
    """Tenant a queues 3 x parallel requests and they fill every slot; tenant b then sends one.
    b's request takes a slot from a at once (a preemption) and finishes before a's first wave
    of requests does (first come, first served it would wait for all twelve: b finished
    after 8 of a's at least). Every request, the preempted one included, generates exactly
    what it generates alone. Meanwhile the engine reports the K/V blocks each tenant holds,
    and none once all is done."""
    flood = [f"Flood {i}: three facts about rivers and the sea are" for i in range(3 * PARALLEL)]
    light = "Light: name two colours of the sky"
    tenants = {"a": TenantPolicy(), "b": TenantPolicy()}
    with Engine(served, parallel=PARALLEL, ctx_size=256, batch_tokens=64, tenants=tenants) as eng:
        finished: list[str] = []
        texts: dict[str, str] = {}
        held: list[dict[str | None, int]] = []

        async def run(name: str, prompt: str, n: int, tenant: str) -> None:
            r = await eng.agenerate(prompt, max_tokens=n, ignore_eos=True, tenant=tenant)
            texts[name] = r.text
            finished.append(name)

        async def main() -> None:
            tasks = [
                asyncio.ensure_future(run(f"a{i}", p, FLOOD_TOKENS, "a"))
                for i, p in enumerate(flood)
            ]
            # a's first wave is generating; the rest of its requests wait.
            await until(lambda: eng.stats()["generated_tokens"] >= 2 * PARALLEL)
            assert eng.stats()["running"] == PARALLEL
            held.append(eng.kv_blocks_by_tenant())
            tasks.append(asyncio.ensure_future(run("b", light, LIGHT_TOKENS, "b")))
            await until(lambda: "b" in finished)
            await asyncio.gather(*tasks)
            # As of the engine thread's last step (the results come out within it).
            await until(lambda: eng.kv_blocks_by_tenant() == {"a": 0, "b": 0})

        asyncio.run(main())
        st = eng.stats()
    assert st["preemptions"] >= 1
    assert held[0]["a"] > 0 and held[0]["b"] == 0
    before_b = finished[: finished.index("b")]
    assert len(before_b) < PARALLEL, finished  # not even a's first wave was done
    want = {f"a{i}": oracle.generate(p, FLOOD_TOKENS, ignore_eos=True) for i, p in enumerate(flood)}
    want["b"] = oracle.generate(light, LIGHT_TOKENS, ignore_eos=True)
    assert texts == {name: r.text for name, r in want.items()}
