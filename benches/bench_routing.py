#!/usr/bin/env python3
"""Routing across replicas (issue 21, last proof bullet): 20 conversations x 4 turns over 2
replicas; prompt-cache hit rates and recomputed prompt tokens for random routing against
prefix-affinity routing (``kvserve.cluster.Router``), each without and with the shared K/V
tier on Redis.

The replicas are two ``kvserve.Engine``\\ s in this process, each on its own
``kvserve.Model(path, threads=1)`` (separate K/V pools, prefix indexes and tiers: what two
processes have; one core each). Each pool holds ``--pool-frac`` (0.65) of the blocks of every
conversation's final history (the shared system prompt counted once; replies estimated at
``--reply-tokens``): one replica cannot hold all 20 conversations, but it can hold its half.

The workload: a system prompt of ~``--system-tokens`` (300) tokens shared by every
conversation, a first user message of ~``--user-tokens`` (200) tokens of its own, then
``--turns`` - 1 short follow-ups; each turn's request is the whole history (the earlier
replies appended as assistant messages) through ``Engine.achat`` (greedy,
``--reply-tokens`` tokens at most; no ``session_id``: the prefix cache alone carries a
conversation from turn to turn, as it does behind the ingress). The 80 requests go in
round-robin order (turn 1 of every conversation, then turn 2, ...) in waves of ``--wave`` (8)
sent at once; a wave starts when the previous one has finished (so a conversation's previous
turn is always done) and, with Redis, once both tiers have written what they queued (turns of
a real chat are seconds apart).

Routing of each request:

- *random*: one of the two replicas, drawn by a seeded ``random.Random``;
- *affinity*: ``Router.choose(keys)`` with the prompt's block keys computed by the ingress's
  own code (``kvserve.cluster.ingress.PromptKeys``: the chat template, the tokenizer and the
  core's ``block_keys`` under the request's salt), ``Router.started`` / ``finished`` around
  each request (the load the imbalance rule reads) and every replica's
  ``Engine.kv_events()`` applied after each wave (the ingress polls them every 0.1 s; a wave
  is dispatched at once, so polling within it would change nothing).

Reported per configuration: prompt tokens, cached prompt tokens (hit rate), tokens recomputed
(prompt tokens not cached), of the cached tokens those fetched from Redis, requests per
replica, blocks the pools evicted, the router's reasons, and the wall time. Greedy replies
must be identical in every configuration (checked: a cache hit, a Redis hit and a
recomputation give the same K/V).

``redis-server`` (Debian's package) is started here on a free loopback port, flushed before
each configuration that uses it, and killed at the end.

  python benches/bench_routing.py --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    REPO_ROOT,
    RedisServer,
    add_idle_args,
    append_section,
    default_model,
    loadavg,
    machine_desc,
    this_command,
    utc_stamp,
    wait_for_idle,
)

from kvserve import Engine, GenerateResult, Model
from kvserve.cluster import Router
from kvserve.cluster.ingress import PromptKeys
from kvserve.server.config import ServerConfig

BLOCK = 16
CHAT_PATH = "/v1/chat/completions"
REPLICAS = ("r0", "r1")
Message = dict[str, str]

SYSTEM_SENTENCES = [
    "You are the support assistant of a company that builds inference servers for language"
    " models on ordinary CPUs.",
    "Answer in plain English, briefly, and say so when you do not know.",
    "Never invent command-line flags, configuration keys or version numbers.",
    "When a user pastes notes, summarise them before you answer their question.",
    "Prefer concrete steps over general advice, and number the steps.",
    "If a request is about billing, tell the user to write to the billing team instead.",
    "Do not discuss other customers, their deployments or their data.",
    "Keep every answer under two hundred words unless the user asks for more.",
    "Use metric units, UTC times and ISO dates.",
    "When you quote a log line, quote it exactly as the user gave it.",
    "If the user seems frustrated, acknowledge it once and move on to the fix.",
    "Explain trade-offs between memory, latency and throughput when they matter.",
    "Our servers cache the keys and values of prompt prefixes in blocks of sixteen tokens.",
    "Replicas share nothing but an optional Redis store of those blocks.",
    "A request routed to a replica that holds its prefix skips most of its prefill.",
    "Suggest measuring before tuning, and name the metric to watch.",
    "Close each answer by asking whether the fix worked.",
]
TOPICS = ["latency", "memory", "throughput", "cache", "queue", "threads", "disk", "network",
          "timeouts", "tokens", "batching", "eviction", "startup", "logging", "alerts"]  # fmt: skip
WORDS = ["the", "server", "replica", "prompt", "slow", "after", "restart", "blocks", "evicted",
         "we", "saw", "requests", "waiting", "pool", "full", "p95", "grew", "every", "hour",
         "users", "chat", "long", "history", "config", "set", "to", "two", "cores", "and",
         "memory", "limit", "of", "eight", "gigabytes", "then", "errors", "appear", "in",
         "logs", "around", "noon", "when", "traffic", "peaks"]  # fmt: skip


def _grow(model: Model, start: str, parts: list[str], target: int) -> str:
    """``start`` followed by ``parts`` in turn (cycling) until it is ~``target`` tokens."""
    text = start
    i = 0
    while len(model.tokenize(text, add_special=False, parse_special=False)) < target:
        text += " " + parts[i % len(parts)]
        i += 1
    return text


@dataclass
class Workload:
    system: str
    first: list[str]  # each conversation's first user message
    follow: list[list[str]]  # each conversation's later user messages

    def messages(self, conv: int, turn: int, replies: dict[tuple[int, int], str]) -> list[Message]:
        """The whole history of conversation ``conv`` at turn ``turn`` (0-based)."""
        msgs: list[Message] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.first[conv]},
        ]
        for t in range(turn):
            msgs.append({"role": "assistant", "content": replies[(conv, t)]})
            msgs.append({"role": "user", "content": self.follow[conv][t]})
        return msgs


def make_workload(model: Model, args: argparse.Namespace) -> Workload:
    system = _grow(model, "", SYSTEM_SENTENCES, args.system_tokens).strip()
    rng = random.Random(args.seed)
    first, follow = [], []
    for c in range(args.conversations):
        topic = TOPICS[c % len(TOPICS)]
        notes = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) + "." for _ in range(60)
        ]
        first.append(
            _grow(model, f"Ticket {1000 + c} about {topic}. My notes:", notes, args.user_tokens)
            + f" What should I check first about the {topic}?"
        )
        follow.append(
            [
                f"Thanks. I tried that on ticket {1000 + c}; what is step {t + 2} for the {topic}?"
                for t in range(args.turns - 1)
            ]
        )
    return Workload(system, first, follow)


# -- one configuration ------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    replies: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    remote_hit_tokens: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    evicted: int = 0
    per_turn: list[tuple[int, int]] = field(default_factory=list)  # (prompt, cached) per turn
    wall_s: float = 0.0
    remote_errors: int = 0

    @property
    def recomputed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _settle(engines: dict[str, Engine]) -> None:
    """Wait until every shared tier has written what it queued."""
    deadline = time.monotonic() + 60
    while any(e.stats()["kv_remote_queued"] for e in engines.values()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)


async def run_config(
    args: argparse.Namespace,
    work: Workload,
    keys: PromptKeys,
    policy: str,
    remote: str | None,
    pool_bytes: int,
) -> Outcome:
    out = Outcome(f"{policy}, {'Redis' if remote else 'no Redis'}")
    engines = {
        name: Engine(
            Model(args.model, threads=1),  # a fresh instance: its own pool, at our size
            parallel=args.parallel,
            ctx_size=args.ctx_size,
            kv_memory=pool_bytes,
            kv_remote=remote,
        )
        for name in REPLICAS
    }
    rng = random.Random(args.seed)
    router = Router(REPLICAS, rng=random.Random(args.seed))
    for name, engine in engines.items():  # start recording; the first drain is a snapshot
        router.apply_events(name, engine.kv_events())
    order = [(c, t) for t in range(args.turns) for c in range(args.conversations)]
    replies: dict[tuple[int, int], str] = {}
    turn_tokens: dict[int, list[int]] = {t: [0, 0] for t in range(args.turns)}

    async def one(name: str, conv: int, turn: int, msgs: list[Message]) -> GenerateResult:
        try:
            return await engines[name].achat(msgs, args.reply_tokens, temperature=0.0)
        finally:
            router.finished(name)

    checked = False
    t0 = time.perf_counter()
    try:
        for w in range(0, len(order), args.wave):
            wave = order[w : w + args.wave]
            tasks = []
            for conv, turn in wave:
                msgs = work.messages(conv, turn, replies)
                if policy == "affinity":
                    ks = keys.keys(CHAT_PATH, {"messages": msgs}, None)
                    if not checked:  # the ingress's keys are the engine's keys
                        eng = engines[REPLICAS[0]]
                        assert ks == eng.block_keys(eng.model.tokenize_chat(msgs)), "keys differ"
                        checked = True
                    choice = router.choose(ks)
                    name = choice.replica
                    out.reasons[choice.reason] += 1
                else:
                    name = rng.choice(REPLICAS)
                router.started(name)
                out.requests[name] += 1
                tasks.append(one(name, conv, turn, msgs))
            results = await asyncio.gather(*tasks)
            for (conv, turn), res in zip(wave, results, strict=True):
                replies[(conv, turn)] = res.text
                out.replies[(conv, turn)] = list(res.tokens)
                out.prompt_tokens += res.prompt_tokens
                out.cached_tokens += res.cached_tokens
                turn_tokens[turn][0] += res.prompt_tokens
                turn_tokens[turn][1] += res.cached_tokens
            if remote:
                _settle(engines)
            for name, engine in engines.items():
                router.apply_events(name, engine.kv_events())
        out.wall_s = time.perf_counter() - t0
    finally:
        for engine in engines.values():
            engine.close()
    for engine in engines.values():
        st = engine.stats()
        out.remote_hit_tokens += int(st["kv_remote_hit_tokens"])
        out.remote_errors += int(st["kv_remote_errors"])
        out.evicted += int(st["kv_blocks_evicted"])
    out.per_turn = [(p, c) for p, c in turn_tokens.values()]
    return out


def pool_blocks(model: Model, work: Workload, args: argparse.Namespace) -> tuple[int, int]:
    """(blocks of every conversation's final history, the system prompt's blocks counted once;
    the pool's size in blocks: ``--pool-frac`` of that, unless ``--pool-blocks`` is given)."""
    fake = {(c, t): "x " * args.reply_tokens for c in range(args.conversations)
            for t in range(args.turns)}  # fmt: skip
    system = len(model.tokenize_chat(work.messages(0, 0, fake)[:1], add_generation_prompt=False))
    total = math.ceil(system / BLOCK)
    for c in range(args.conversations):
        n = len(model.tokenize_chat(work.messages(c, args.turns - 1, fake))) + args.reply_tokens
        total += math.ceil(n / BLOCK) - system // BLOCK
    want = args.pool_blocks or math.ceil(args.pool_frac * total)
    return total, want


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of each reply")
    ap.add_argument("--wave", type=int, default=8, help="requests sent at once (<= conversations)")
    ap.add_argument("--parallel", type=int, default=4, help="each replica's Engine parallel")
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument(
        "--pool-frac",
        type=float,
        default=0.65,
        help="each pool's share of the blocks of all conversations' histories",
    )
    ap.add_argument("--pool-blocks", type=int, default=0, help="each pool's blocks (overrides)")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--write", action="store_true", help="append the table to BENCHMARKS.md")
    add_idle_args(ap)
    args = ap.parse_args()
    if not 1 <= args.wave <= args.conversations:
        raise SystemExit("--wave must be between 1 and --conversations")
    args.model = args.model or default_model()
    if not args.model:
        raise SystemExit("no model: pass --model or run `python -m kvserve pull` first")

    keys = PromptKeys(ServerConfig(model=args.model))  # the ingress's own keying
    per_block = int(keys.ctx.stats()["bytes_per_block"])
    work = make_workload(keys.model, args)
    total_blocks, blocks = pool_blocks(keys.model, work, args)
    sys_tokens = len(keys.model.tokenize_chat(work.messages(0, 0, {})[:1], False))
    user_tokens = [
        len(keys.model.tokenize(m, add_special=False, parse_special=False)) for m in work.first
    ]
    print(
        f"system prompt {sys_tokens} tokens (templated), first user messages"
        f" {min(user_tokens)}-{max(user_tokens)} tokens; all final histories ~{total_blocks}"
        f" blocks; each pool {blocks} blocks ({blocks * per_block / 2**20:.0f} MiB)",
        flush=True,
    )

    busy = wait_for_idle(args.wait_idle, args.wait_max)
    load_before = f"{loadavg()}, CPUs {busy:.0f}% busy before"
    redis = RedisServer()
    outcomes: list[Outcome] = []
    try:
        for remote in (False, True):
            for policy in ("random", "affinity"):
                if remote:
                    redis.cmd("FLUSHALL")
                out = asyncio.run(
                    run_config(
                        args, work, keys, policy, redis.url if remote else None, blocks * per_block
                    )
                )
                outcomes.append(out)
                print(
                    f"{out.name}: prompt {out.prompt_tokens}, cached {out.cached_tokens}"
                    f" ({out.hit_rate:.1%}), recomputed {out.recomputed}, Redis hits"
                    f" {out.remote_hit_tokens}, requests {dict(out.requests)}, reasons"
                    f" {dict(out.reasons)}, evicted {out.evicted}, per turn {out.per_turn},"
                    f" {out.wall_s:.1f} s",
                    flush=True,
                )
    finally:
        redis.stop()

    ref = outcomes[0]
    for out in outcomes[1:]:
        diff = [k for k in ref.replies if ref.replies[k] != out.replies.get(k)]
        assert not diff, f"{out.name}: greedy replies differ from {ref.name} at {diff[:5]}"
    assert all(o.remote_errors == 0 for o in outcomes), "the shared tier reported errors"

    summary = [
        {
            "config": o.name,
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "hit_rate": round(o.hit_rate, 4),
            "recomputed_tokens": o.recomputed,
            "remote_hit_tokens": o.remote_hit_tokens,
            "requests": dict(o.requests),
            "reasons": dict(o.reasons),
            "blocks_evicted": o.evicted,
            "hit_rate_by_turn": [round(c / p, 3) if p else 0.0 for p, c in o.per_turn],
            "wall_s": round(o.wall_s, 1),
        }
        for o in outcomes
    ]
    print(json.dumps(summary, indent=1))

    def row(o: Outcome) -> str:
        reqs = " / ".join(str(o.requests[n]) for n in REPLICAS)
        turns = " / ".join(f"{c / p:.0%}" for p, c in o.per_turn)
        return (
            f"| {o.name} | {o.prompt_tokens} | {o.cached_tokens} ({o.hit_rate:.1%}) | {turns} |"
            f" {o.recomputed} | {o.remote_hit_tokens} | {reqs} | {o.evicted} | {o.wall_s:.0f} s |\n"
        )

    n_req = args.conversations * args.turns
    turn_names = " / ".join(str(t + 1) for t in range(args.turns))
    table = (
        f"{utc_stamp()}, {machine_desc()}, load {load_before}; SmolLM2-135M Q4_1 f16 K/V;"
        f" 2 replicas in one process, each an Engine on its own Model (threads 1, parallel"
        f" {args.parallel}, a pool of {blocks} blocks = {args.pool_frac:.0%} of the"
        f" ~{total_blocks} blocks of all {args.conversations} final histories);"
        f" {args.conversations} conversations x {args.turns} turns ({n_req} requests): a"
        f" {sys_tokens}-token system prompt shared by all, a first user message of"
        f" {min(user_tokens)}-{max(user_tokens)} tokens, short follow-ups, greedy replies of"
        f" at most {args.reply_tokens} tokens; round-robin turns in waves of {args.wave}"
        f" requests sent at once; seed {args.seed}; greedy replies identical in all four\n\n"
        f"| routing | prompt tokens | cached (hit rate) | hit rate turn {turn_names} |"
        " recomputed | from Redis | requests r0 / r1 | blocks evicted | wall |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "".join(row(o) for o in outcomes)
    )
    print(table)
    if args.write:
        cmd = this_command("bench_routing.py", args.model)
        append_section(
            Path(REPO_ROOT) / "BENCHMARKS.md",
            "## Routing across replicas (issue 21)",
            table,
            cmd,
            intro=(
                "Prompt-cache hits of 20 conversations x 4 turns over 2 replicas, routed at"
                " random or by prefix affinity (`kvserve.cluster.Router` fed by each"
                " replica's KV events, prompts keyed by the ingress's own code), without and"
                " with the shared K/V tier on Redis (`--kv-remote`). Token counts are what to"
                " compare; wall times are of a shared machine."
                f" Command: `{cmd}` (benches/bench_routing.py)."
            ),
        )


if __name__ == "__main__":
    main()
