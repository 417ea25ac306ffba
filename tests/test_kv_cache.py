"""The paged KV cache through the binding: llama.cpp's sequence operations, block sharing,
copy-on-write and the lazy K-shift, each checked against a fresh computation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvserve import _core

PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp, and"


@pytest.fixture(scope="module")
def core(model_path: Path) -> _core.Model:
    return _core.Model(model_path, threads=2)


@pytest.fixture
def own_core(model_path: Path) -> _core.Model:
    """A model of its own: its block pool (shared by all contexts of one model) holds only
    this test's blocks, so pool-wide counts can be asserted exactly."""
    return _core.Model(model_path, threads=2)


def _run(
    ctx: _core.Context, tokens: list[int], pos0: int, seq: int = 0, all_logits: bool = False
) -> np.ndarray:
    n = len(tokens)
    want = [True] * n if all_logits else [False] * (n - 1) + [True]
    out = ctx.decode(tokens, list(range(pos0, pos0 + n)), [seq] * n, want)
    return np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab).copy()


def _close(a: np.ndarray, b: np.ndarray, rel: float) -> None:
    scale = float(np.abs(b).max())
    diff = float(np.abs(a - b).max())
    assert diff <= rel * scale, f"max |diff| {diff:.4g} > {rel} x {scale:.4g}"


def test_seq_add_shift_decodes_as_if_computed_at_new_positions(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT, add_special=True)
    nxt = core.tokenize(" the", add_special=False)
    n, d = len(toks), 37
    shifted = core.new_context(256)
    _run(shifted, toks, 0)
    shifted.seq_add(0, 0, -1, d)  # every key is re-rotated lazily, before the next attention
    assert (shifted.seq_pos_min(0), shifted.seq_pos_max(0)) == (d, n - 1 + d)
    got = _run(shifted, nxt, n + d)

    def fresh(pos0: int) -> np.ndarray:
        ctx = core.new_context(256)
        _run(ctx, toks, pos0)
        return _run(ctx, nxt, n + pos0)

    want = fresh(d)
    # The tolerance is the model's own spread: the same prompt computed fresh 1-2 positions
    # further is the same math (RoPE is relative) but other roundings, and this model turns
    # them into ~2% of its largest logit (measured: 0.46-0.53 of 26; the shift 0.56, and 0.56
    # with f32 K/V too, so it is not the f16 re-encoding). A shift that rotated wrongly lands
    # far outside it (the stale keys below: ~0.63 of the scale).
    spread = max(float(np.abs(fresh(d + k) - want).max()) for k in (-2, -1, 1, 2))
    diff = float(np.abs(got - want).max())
    assert diff <= 1.5 * spread, f"max |diff| {diff:.4g} > 1.5 x spread {spread:.4g}"
    assert int(got.argmax()) == int(want.argmax())

    # Without the K-shift the keys would sit at the old positions: visibly different.
    stale = core.new_context(256)
    _run(stale, toks, 0)
    other = _run(stale, nxt, n + d)
    assert float(np.abs(other - want).max()) > 5 * float(np.abs(got - want).max())


def test_seq_cp_shares_blocks_and_copy_on_write_keeps_sequences_apart(
    own_core: _core.Model,
) -> None:
    core = own_core
    toks = core.tokenize(PROMPT, add_special=True)
    a, b = core.tokenize(" the", add_special=False), core.tokenize(" a", add_special=False)
    n = len(toks)
    ctx = core.new_context(256)
    _run(ctx, toks, 0)
    before = ctx.stats()
    ctx.seq_cp(0, 1)
    st = ctx.stats()
    assert st["tokens_stored"] == n  # shared, not copied
    assert st["blocks_referenced"] == before["blocks_referenced"]
    assert st["blocks_shared"] == st["blocks_referenced"]
    # One batch, two sequences, each continuing the shared prefix differently.
    out = ctx.decode([a[0], b[0]], [n, n], [0, 1], [True, True])
    got = np.frombuffer(out, dtype=np.float32).reshape(2, out.n_vocab)
    for row, tok in ((0, a), (1, b)):
        alone = core.new_context(256)
        _run(alone, toks, 0)
        _close(got[row], _run(alone, tok, n)[0], 1e-3)
    # Writing into the shared, partly filled tail block copied its cells first (copy-on-write).
    b_size = st["block_size"]
    assert ctx.stats()["tokens_stored"] == n + 2 + n % b_size


def test_seq_rm_tail_then_redecode_gives_the_same_logits(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT, add_special=True)
    n = len(toks)
    ctx = core.new_context(256)
    # Same batch shapes both times: kernels are chosen by batch size, and rounding differences
    # between them are amplified through the layers of this small model.
    _run(ctx, toks[: n - 3], 0)
    first = _run(ctx, toks[n - 3 :], n - 3)
    ctx.seq_rm(0, n - 3, -1)
    assert ctx.seq_pos_max(0) == n - 4
    again = _run(ctx, toks[n - 3 :], n - 3)
    _close(again, first, 1e-5)
    assert int(again.argmax()) == int(first.argmax())


def test_seq_keep_and_div_and_clear(core: _core.Model) -> None:
    toks = core.tokenize(PROMPT, add_special=True)
    n = len(toks)
    ctx = core.new_context(256)
    _run(ctx, toks, 0, seq=0)
    _run(ctx, toks[:5], 0, seq=1)
    ctx.seq_keep(1)
    assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == 4
    ctx.seq_div(1, 0, -1, 2)
    assert (ctx.seq_pos_min(1), ctx.seq_pos_max(1)) == (0, 2)
    ctx.clear()
    assert ctx.stats()["tokens_stored"] == 0 and ctx.seq_pos_max(1) == -1
    _run(ctx, toks, 0)  # still usable
    assert ctx.seq_pos_max(0) == n - 1


def test_shared_prefix_memory_bound(core: _core.Model) -> None:
    """N sequences sharing a P-token prefix with U unique tokens each use at most
    ceil(P/b) + N * (ceil(U/b) + 1) blocks (the issue's bound)."""
    toks = core.tokenize(PROMPT * 12, add_special=True)
    p_len, n_seq, u_len = 96, 4, 20
    prefix = toks[:p_len]
    ctx = core.new_context(p_len + n_seq * u_len + 64)
    _run(ctx, prefix, 0)
    for s in range(1, n_seq):
        ctx.seq_cp(0, s)
    for i in range(u_len):
        tokens = [toks[p_len + i]] * n_seq
        ctx.decode(tokens, [p_len + i] * n_seq, list(range(n_seq)), [False] * n_seq)
    st = ctx.stats()
    b = st["block_size"]
    bound = math.ceil(p_len / b) + n_seq * (math.ceil(u_len / b) + 1)
    assert st["blocks_held"] <= bound, (st, bound)
    assert st["tokens_stored"] == p_len + n_seq * u_len


def test_prefix_reuse_gives_the_same_logits_and_generation(own_core: _core.Model) -> None:
    core = own_core
    toks = core.tokenize(PROMPT * 8, add_special=True)[:100]
    assert len(toks) == 100
    ctx = core.new_context(512)
    b = ctx.stats()["block_size"]
    _run(ctx, toks, 0, seq=0)
    ctx.seq_rm(0)
    assert ctx.stats()["blocks_cached"] >= 100 // b  # full blocks stay cached, unreferenced
    n = ctx.match_prefix(1, toks)
    assert n > 0 and n % b == 0 and n <= 99
    st = ctx.stats()
    assert (st["prefix_lookups"], st["prefix_hit_tokens"]) == (1, n)
    assert st["tokens_stored"] == n and ctx.seq_pos_max(1) == n - 1
    got = _run(ctx, toks[n:], n, seq=1)

    # Fresh context, same batch shapes (kernels depend on the batch size): split at n.
    fresh = core.new_context(512)
    _run(fresh, toks[:n], 0)
    want = _run(fresh, toks[n:], n)
    _close(got, want, 1e-5)

    def generate(c: _core.Context, seq: int, first: np.ndarray) -> list[int]:
        out = [int(first.argmax())]
        for i in range(15):
            out.append(int(_run(c, [out[-1]], 100 + i, seq=seq).argmax()))
        return out

    reused = generate(ctx, 1, got)
    plain = core.new_context(512)
    whole = _run(plain, toks, 0)
    assert generate(plain, 0, whole) == reused

    # Not for a sequence that already has cells.
    with pytest.raises(ValueError):
        ctx.match_prefix(1, toks)


def test_results_do_not_depend_on_the_rest_of_the_batch(core: _core.Model) -> None:
    """Sequence 0 decoded alone vs. in mixed batches with another sequence's prefill chunks and
    decode steps: bit-identical logits, hence identical greedy tokens."""
    prompt = core.tokenize(PROMPT, add_special=True)
    other = core.tokenize("Once upon a time, in a village by the sea, there", add_special=True)
    n, steps = len(prompt), 6

    alone = core.new_context(512)
    rows = [_run(alone, prompt, 0)[0]]
    toks = [int(rows[-1].argmax())]
    for i in range(steps):
        rows.append(_run(alone, [toks[-1]], n + i)[0])
        toks.append(int(rows[-1].argmax()))

    mixed = core.new_context(512)
    # Prefill of seq 0 together with the first half of seq 1's prompt.
    half = len(other) // 2
    out = mixed.decode(
        prompt + other[:half],
        list(range(n)) + list(range(half)),
        [0] * n + [1] * half,
        [False] * (n - 1) + [True] + [False] * half,
    )
    got = [np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)[0].copy()]
    mtoks = [int(got[-1].argmax())]
    rest = other[half:]
    for i in range(steps):
        # Seq 0 decodes one token while seq 1 prefills the rest of its prompt, then decodes.
        extra = rest if i == 0 else [7 + i]
        extra_pos = list(range(half, len(other))) if i == 0 else [len(other) + i - 1]
        out = mixed.decode(
            [mtoks[-1]] + extra,
            [n + i] + extra_pos,
            [0] + [1] * len(extra),
            [True] + [False] * len(extra),
        )
        got.append(np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)[0].copy())
        mtoks.append(int(got[-1].argmax()))
    assert mtoks == toks
    for a, b in zip(got, rows, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_that_want_no_logits_change_no_bits(
    core: _core.Model, arch: str, request: pytest.FixtureRequest
) -> None:
    """The last layer computes only the rows that want logits (``model::llama::Outputs``): those
    rows get the bits of a pass in which every row wants logits, whichever others want them too,
    and a chunk that wants none still stores the last layer's K/V for the steps after it."""
    if arch == "gemma3":
        core = _core.Model(request.getfixturevalue("gemma_path"), threads=2)
    prompt = core.tokenize(PROMPT * 4, add_special=True)
    n = len(prompt)
    assert n >= 48, "long enough for the prompt kernels (wide activations)"
    every = _run(core.new_context(512), prompt, 0, all_logits=True)  # nothing to leave out

    for want in (
        [i == n - 1 for i in range(n)],
        [i % 5 == 0 or i == n - 1 for i in range(n)],
        [i >= n - 20 for i in range(n)],
    ):
        ctx = core.new_context(512)
        out = ctx.decode(prompt, list(range(n)), [0] * n, want)
        got = np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)
        np.testing.assert_array_equal(got, every[np.array(want)])

    ctx = core.new_context(512)
    half = n // 2
    out = ctx.decode(prompt[:half], list(range(half)), [0] * half, [False] * half)
    assert out.n_rows == 0
    np.testing.assert_array_equal(_run(ctx, prompt[half:], half, all_logits=True), every[half:])
    # A decode step after it reads the last layer's K/V of every row.
    step = _run(ctx, [int(every[-1].argmax())], n)
    again = core.new_context(512)
    _run(again, prompt, 0, all_logits=True)
    np.testing.assert_array_equal(step, _run(again, [int(every[-1].argmax())], n))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decoders_sharing_a_document_get_their_own_bits(
    core: _core.Model, arch: str, request: pytest.FixtureRequest
) -> None:
    """A decode step of users of one cached document (more sequences than the step splits by
    chunks, their tables sharing the document's blocks): each group of them reads the shared
    chunks once (``model::llama::CascadePlan``), and every sequence gets the bits of its step
    taken alone; with a sequence of another document and a prompt in the same batch."""
    if arch == "gemma3":
        core = _core.Model(request.getfixturevalue("gemma_path"), threads=2)
    doc = core.tokenize(PROMPT * 40, add_special=True)[:600]  # 2 chunks of 256 cells and more
    other = core.tokenize("A different document. " * 60, add_special=True)[:300]
    prompt = core.tokenize(PROMPT, add_special=True)
    users = 10
    tails = [
        core.tokenize(f" Question {u}:" + " why" * (u * 7), add_special=False) for u in range(users)
    ]

    def setup() -> _core.Context:
        ctx = core.new_context(4096, n_seq_max=users + 2, n_batch=1024)
        _run(ctx, doc, 0)
        for u in range(1, users):
            ctx.seq_cp(0, u)
        for u in range(users):  # each user's own cells after the document (copy on write)
            _run(ctx, tails[u], len(doc), seq=u)
        _run(ctx, other, 0, seq=users)
        return ctx

    nxt = [1000 + 17 * u for u in range(users + 1)]
    pos = [len(doc) + len(tails[u]) for u in range(users)] + [len(other)]
    alone = setup()
    want = [_run(alone, [nxt[s]], pos[s], seq=s)[0] for s in range(users + 1)]
    want_prompt = _run(alone, prompt, 0, seq=users + 1)[-1]

    ctx = setup()
    seqs = list(range(users + 1))
    toks = [nxt[s] for s in seqs] + prompt
    out = ctx.decode(
        toks,
        pos + list(range(len(prompt))),
        seqs + [users + 1] * len(prompt),
        [True] * len(seqs) + [False] * (len(prompt) - 1) + [True],
    )
    got = np.frombuffer(out, dtype=np.float32).reshape(out.n_rows, out.n_vocab)
    for s in seqs:
        np.testing.assert_array_equal(got[s], want[s], err_msg=f"sequence {s}")
    np.testing.assert_array_equal(got[-1], want_prompt)


def test_kv_types_and_sizing_by_bytes(core: _core.Model, model_path: Path) -> None:
    toks = core.tokenize(PROMPT * 3, add_special=True)
    logits = {}
    sizes = {}
    for ty in ("f32", "f16", "q8_0"):
        ctx = core.new_context(256, kv_type=ty)
        rows = _run(ctx, toks, 0, all_logits=True)
        logits[ty] = rows
        sizes[ty] = int(ctx.stats()["bytes_per_block"])
        assert ctx.stats()["kv_type"] == ty
    # q8_0 takes about half of f16's memory (34 bytes per 32 values vs 64).
    assert sizes["q8_0"] / sizes["f16"] == pytest.approx(34 / 64)
    assert sizes["f32"] == 2 * sizes["f16"]

    # Accuracy against f32 K/V, per prompt position, in top-5 logprobs of the f32 run. On this
    # small model rounding anywhere is amplified through the layers, so f16 itself moves them
    # (measured: mean 0.17-0.24 nats); q8_0 must stay within 1.5x of f16's error and keep the
    # argmax almost everywhere (measured: q8_0 about equal to f16, argmax agreement >= 0.97).
    def lsm(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    ref = lsm(logits["f32"])
    top = np.argsort(-ref, axis=1)[:, :5]
    err = {}
    for ty in ("f16", "q8_0"):
        lp = lsm(logits[ty])
        diff = np.abs(np.take_along_axis(lp, top, 1) - np.take_along_axis(ref, top, 1))
        err[ty] = float(diff.max(axis=1).mean())
    print(f"top-5 logprob error vs f32 K/V: f16 {err['f16']:.3f}, q8_0 {err['q8_0']:.3f} nats")
    assert err["f16"] < 0.5
    assert err["q8_0"] < 1.5 * err["f16"] + 0.02
    agree = np.mean(logits["q8_0"].argmax(axis=1) == logits["f32"].argmax(axis=1))
    assert agree >= 0.9, agree

    # Sizing by bytes: as many whole blocks as fit (a model of its own: the f16 memory of
    # `core` already exists and would be shared).
    core = _core.Model(model_path, threads=2)
    ctx = core.new_context(kv_memory=10 * sizes["f16"] + 5)
    st = ctx.stats()
    assert st["blocks_total"] == 10
    with pytest.raises(ValueError, match="holds no block"):
        core.new_context(kv_memory=sizes["f16"] - 1)
    with pytest.raises(ValueError, match="q4"):
        core.new_context(64, kv_type="q4")
    # 10 blocks of 16 tokens: 160 tokens fit, the 161st does not.
    _run(ctx, [5] * 100, 0)
    with pytest.raises(_core.KvCacheFull):
        _run(ctx, [1] * 61, 100)
    _run(ctx, [1] * 60, 100)
    assert ctx.stats()["tokens_stored"] == 160
