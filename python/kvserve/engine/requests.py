"""The front end's data: requests as the engine thread sees them, where their output goes
(sinks), work handed to the engine thread (:class:`Call`), and size strings."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._model import GenerateResult
from ..sampling import Sampler, TokenLogprob
from ..textstream import TextStream
from .mailbox import mailbox_for

if TYPE_CHECKING:
    import numpy as np

    from .._core import KvStaged
    from ..sessions import Turn

__all__ = [
    "DONE",
    "NEW",
    "RUNNING",
    "WAITING",
    "Call",
    "ChoiceSink",
    "Delta",
    "End",
    "EngineClosed",
    "FutureSink",
    "LoopSink",
    "Request",
    "Sink",
    "common_prefix",
    "parse_size",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(size: int | str, name: str = "kv_memory") -> int:
    """Bytes from an int or a size string: ``"2GiB"``, ``"512MiB"``, ``"1.5G"`` (binary units;
    ``"KB"``, ``"MB"``, ``"GB"``, ``"TB"`` are decimal), ``"1000000"``. ``name``: the argument
    a ``ValueError`` names."""
    if isinstance(size, bool):
        raise ValueError(f"{name} must be bytes or a size string such as '2GiB', got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {size}")
        return size
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if m is None:
        raise ValueError(f"{name} must be bytes or a size string such as '2GiB', got {size!r}")
    number, unit, binary, b = m.groups()
    decimal = unit != "" and b != "" and binary == ""
    value = int(float(number) * (1000 if decimal else 1024) ** _SIZE_POWER[unit.lower()])
    if value <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {size!r}")
    return value


NEW, WAITING, RUNNING, DONE = range(4)


class EngineClosed(RuntimeError):
    """The engine is closed (``Engine.close``, or its thread stopped on repeated internal
    errors: the message says why) and takes no more work; what was in flight fails with it."""


class Sink:
    """Where a request's output goes; the engine thread calls these (never blocking).
    ``logprobs`` (None when not asked): the entries of the tokens delivered since the previous
    call, so the entries of all calls join to the result's ``logprobs``."""

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        pass  # a piece of text (whole characters, never empty)

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        raise NotImplementedError


class FutureSink(Sink):
    """A sync caller waits on a ``concurrent.futures.Future``."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[GenerateResult] = concurrent.futures.Future()

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _resolve(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()  # a cancelled request: nothing to report (and nothing logged)
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class End:
    """The last item of a stream's queue: the request's error (None when it finished) and its
    result."""

    def __init__(self, error: BaseException | None, result: GenerateResult | None = None) -> None:
        self.error = error
        self.result = result


class LoopSink(Sink):
    """An async caller: everything is handed to its event loop through the loop's
    :class:`~kvserve.engine.mailbox.Mailbox` (one wake-up per step for all of the loop's
    requests), either the result to an asyncio future or the pieces and the end to a stream's
    queue. Made on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.box = mailbox_for(loop)
        self.result: asyncio.Future[GenerateResult] = loop.create_future()
        self.queue: asyncio.Queue[str | End] | None = asyncio.Queue() if stream else None

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        self.box.post(fn, *args)  # dropped if the loop is closed: nobody is listening

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, text)

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, End(None, result))
        else:
            self._call(_resolve, self.result, result, None)

    def fail(self, error: BaseException) -> None:
        if self.queue is not None:
            self._call(self.queue.put_nowait, End(error))
        else:
            self._call(_resolve, self.result, None, error)


@dataclass(frozen=True)
class Delta:
    """One step of one choice's output, as :meth:`Engine.choices` streams it.

    ``index``: the choice (0 to n - 1). ``text``: the new text (whole characters; empty only
    in a choice's last delta). ``logprobs`` (None when not asked): the entries of the tokens
    delivered since the choice's previous delta (a token whose text is held back, such as the
    start of a possible stop string, comes with the text it becomes part of, or in the last
    delta), so a choice's entries join to its result's ``logprobs``. ``result``: set in the
    choice's last delta (finish reason, tokens, token counts), None before.
    ``prompt_logprobs``: in the choice's first delta, when the request asked for them (as
    :attr:`GenerateResult.prompt_logprobs`), None in the others."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    result: GenerateResult | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class ChoiceSink(Sink):
    """One choice of :meth:`Engine.choices`: its deltas go to the stream's shared queue (the
    error of a failed choice as an ``End``) through the event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[Delta | End],
        index: int,
        req: Request | None = None,
    ) -> None:
        self.loop = loop
        self.box = mailbox_for(loop)
        self.queue = queue
        self.index = index
        # The request whose prompt logprobs its first delta carries (None: nothing to carry).
        self.req = req if req is not None and req.n_prompt_logprobs is not None else None

    def _prompt(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs for the delta being sent: the first one only."""
        req, self.req = self.req, None
        return None if req is None else req.prompt_logprobs

    def _put(self, item: Delta | End) -> None:
        self.box.post(self.queue.put_nowait, item)  # dropped if the loop is closed

    def piece(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        self._put(Delta(self.index, text, logprobs, None, self._prompt()))

    def done(self, result: GenerateResult, logprobs: list[TokenLogprob] | None) -> None:
        self._put(Delta(self.index, "", logprobs, result, self._prompt()))

    def fail(self, error: BaseException) -> None:
        self._put(End(error))


class Request:
    """One generation as the engine thread sees it."""

    def __init__(
        self,
        ids: list[int],
        max_tokens: int,
        sampler: Sampler,
        stops: list[str],
        ignore_eos: bool,
        priority: int,
        logprobs: int | None = None,
        tenant: str | None = None,
        salt: bytes = b"",
        prompt_logprobs: int | None = None,
    ) -> None:
        self.ids = ids  # prompt, then the generated tokens (the penalties' history)
        self.n_prompt = len(ids)
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.stops = stops
        self.ignore_eos = ignore_eos
        self.priority = priority
        self.tenant = tenant  # who it is for (None: the engine's own namespace)
        # The salt of its K/V blocks' content keys (b"": unsalted; see tenancy.salt_for).
        self.salt = salt
        self.key: tuple[int, int] = (-priority, 0)  # set on submission: (-priority, arrival)
        self.sink: Sink = FutureSink()
        self.state = NEW
        self.cancel_requested = False
        self.entry = 0  # its live entry in the waiting queue (0: not queued)
        self.queued_at: float | None = None  # time.monotonic() of its first queueing (aging)
        self.faults = 0  # failed or lost decodes it took part in (containment)
        self.protected = False  # admitted by aging: never preempted for priority
        self.seq = -1  # sequence id in the context while running
        self.n_done = 0  # ids[:n_done] have their K/V in the context
        # Blocks fetched from the shared K/V tier for its prompt before it was queued, taken
        # by its prefix match at admission (then None).
        self.staged: KvStaged | None = None
        self.cached_tokens = -1  # prompt tokens reused at first admission (-1: not yet)
        # Seconds from its queueing until the last block of the cached prefix it reused was
        # computed by another request (EngineLoop.start: 0.0 when that prefix was cached
        # before it came), and the content keys of its prompt's whole blocks while it
        # computes some of them (EngineLoop._note_blocks; None otherwise).
        self.prefix_wait_s = 0.0
        self.block_keys: list[int] | None = None
        self.session_cached = 0  # of those, held by its resident session (the rest: prefix index)
        self.text = TextStream(stops)
        self.pieces: list[str] = []
        # Context shift: the sequence holds ids[:keep] + ids[keep + shift:] at positions 0, 1,
        # ...; n_done and the plan's indices count in that view (see context()).
        self.context_shift = False
        self.keep = 0
        self.shift = 0
        # logprobs: alternatives per token (None: not asked); one entry per delivered token,
        # appended as each is delivered (``pending_logprob``: the entry of the token just picked).
        self.n_logprobs = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.pending_logprob: TokenLogprob | None = None
        self.logprobs_sent = 0  # entries already handed to the sink
        self.end_logprob: TokenLogprob | None = None  # the ending EOG token's entry
        # prompt_logprobs: alternatives per prompt token (None: not asked); the entries so far,
        # one per prompt token from the first (None), each appended when the row before its
        # token is computed (prompt_rows).
        self.n_prompt_logprobs = prompt_logprobs
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if prompt_logprobs is None else [None]
        )
        self.turn: Turn | None = None  # the session part (session requests only)
        # n > 1 (Engine.choices): the other choices, forked from this request's sequence
        # (seq_cp) when its prompt is computed; emptied then. They wait with it until then.
        self.children: list[Request] = []
        # Structured output: the request's llguidance matcher (None: free text) and the token
        # bitmask of its next row, computed during the step's pass (engine.constrain).
        self.matcher: Any = None
        self.mask: np.ndarray | None = None

    @property
    def n_generated(self) -> int:
        return len(self.ids) - self.n_prompt

    @property
    def n_tokens(self) -> int:
        """Tokens of the sequence's context (prompt and output less what shifts dropped)."""
        return len(self.ids) - self.shift

    def context(self, a: int = 0, b: int | None = None) -> list[int]:
        """Tokens ``[a, b)`` of the context (``b`` None: to its end); token ``i`` sits at
        position ``i``. Without a shift this is ``ids[a:b]`` (no copy for the whole)."""
        ids, keep, shift = self.ids, self.keep, self.shift
        if b is None:
            b = len(ids) - shift
        if shift == 0:
            return ids if (a, b) == (0, len(ids)) else ids[a:b]
        if b <= keep:
            return ids[a:b]
        if a >= keep:
            return ids[a + shift : b + shift]
        return ids[a:keep] + ids[keep + shift : b + shift]

    def prompt_rows(self, start: int, k: int) -> range:
        """The positions among ``[start, start + k)`` whose logits rows give prompt logprobs
        still missing (row ``p`` gives prompt token ``p + 1``'s entry); empty when none are
        asked or all are in."""
        entries = self.prompt_logprobs
        if entries is None:
            return range(0)
        return range(max(start, len(entries) - 1), min(start + k, self.n_prompt - 1))

    @property
    def match_limit(self) -> int | None:
        """The most leading tokens a prefix match may map for it (None: no limit): a request
        that still needs prompt rows computes them, so only those already reduced (before a
        preemption) may come from the cache."""
        entries = self.prompt_logprobs
        if entries is None or len(entries) >= self.n_prompt:
            return None
        return len(entries) - 1

    def unsent_logprobs(self) -> list[TokenLogprob] | None:
        """The logprob entries not yet handed to the sink (None when not asked); marks them
        sent."""
        if self.logprobs is None:
            return None
        new = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        return new

    @property
    def argmax_only(self) -> bool:
        """Greedy without bias, penalties or constraint: the token is the argmax of the raw
        logits."""
        return self.matcher is None and self.sampler.params.is_plain_greedy


class Call:
    """Work a caller hands to the engine thread (session operations); ``session_id``: run it
    when that session is idle (FIFO behind its requests)."""

    def __init__(self, fn: Callable[[], Any], session_id: str | None) -> None:
        self.fn = fn
        self.session_id = session_id
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(self) -> None:
        if self.future.done():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # handed to the caller
            self.future.set_exception(e)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
