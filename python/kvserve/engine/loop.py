"""The engine thread: takes what callers queued, runs steps (admit, batch, decode, sample,
deliver), and contains every failure.

Containment, one rule for everything the thread does: an error that belongs to one request
(accepting it, admitting it, mapping its prefix, forking its choices, dropping it, sampling or
delivering its token, its session's work) fails that request alone, with its message, and
releases its blocks; everyone else goes on. A failed batch decode (rolled back by the core) is
retried once; if it fails again the batch is split in halves, recursively, so that only the
requests whose rows fail are failed. An internal error that closes the context (a Rust panic
outside the forward pass) gets a new context on the same pool: every running request is
requeued and recomputed (prefix reuse helps), sessions keep their tokens and recompute their
K/V on next use; a request caught in two such losses fails. An error outside any request (a
bug in the bookkeeping) fails every request in flight and resets the engine's state; only if
that happens three steps in a row does the thread stop, and then every waiting and running
caller gets the error at once and :meth:`kvserve.Engine.health` reports it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._model import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateResult,
    KvCacheFull,
    token_logprob,
)
from ..grammar import GrammarError
from ..testing import Faults
from .constrain import Masks, allowed_ids
from .kv import KvManager
from .mailbox import deferred_wakes, flush_wakes
from .output import argmax_rows, deliver, pick
from .requests import DONE, RUNNING, WAITING, Call, EngineClosed, Request
from .scheduler import PlanEntry, Scheduler
from .session_manager import SessionManager
from .steplog import StepLog

if TYPE_CHECKING:
    from .._core import Logits
    from .._model import Model

__all__ = ["EngineLoop"]

log = logging.getLogger("kvserve.engine")

# Seconds of recent steps that ``decode_tok_s`` averages over.
RATE_WINDOW_S = 10.0
# Seconds of recent admissions that ``prefix_hit_rate_recent`` covers.
HIT_WINDOW_S = 60.0
# Prompt blocks whose computing time the loop remembers (prefix_wait_s): ~16 bytes of key and
# a float each, a few hundred KiB; a shared prefix computed so long ago that its blocks left
# this window was not waited for by a request starting now.
BLOCK_TIMES = 16384
# Consecutive steps failing outside any request after which the thread gives up.
_MAX_STEP_FAILURES = 3


class _Abort(Exception):
    """The context was lost while a batch was split: the step ends (already recovered)."""


class EngineLoop:
    """The engine thread and everything it owns (the KV manager, the scheduler, sessions,
    counters). Callers reach it only through :meth:`submit`, :meth:`cancel` and :meth:`call`."""

    def __init__(
        self,
        model: Model,
        kv: KvManager,
        sched: Scheduler,
        *,
        seq_limit: int,
        limit_name: str,
        kv_high_watermark: float,
        kv_low_watermark: float,
        session_ttl: float | None,
        max_sessions: int | None,
        step_log: StepLog | None = None,
    ) -> None:
        self.model = model
        self.step_log = step_log  # one line per computed batch (engine.steplog), or None
        self.kv = kv
        self.sched = sched
        self.seq_limit = seq_limit
        self.limit_name = limit_name
        self.sessions = SessionManager(
            self,
            kv_high_watermark=kv_high_watermark,
            kv_low_watermark=kv_low_watermark,
            session_ttl=session_ttl,
            max_sessions=max_sessions,
        )
        self.faults = Faults()
        self.cond = threading.Condition()
        self.closed = False
        self.fatal: str | None = None  # why the thread stopped, when it stopped unasked
        self._inbox: list[Request] = []  # submitted, not yet seen by the engine thread
        self._cancels: list[Request] = []
        self._calls: list[Call] = []
        self.n_waiting = 0  # sequences waiting (queued, in a session's FIFO, unforked choices)
        self.waiting_prio: dict[int, int] = {}
        # K/V blocks held per tenant (the scheduler's estimate) after the last iteration:
        # replaced whole, so any thread may read it.
        self.kv_by_tenant: dict[str | None, int] = {}
        # Counters (written by the engine thread, read by stats()).
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.session_cached_tokens = 0
        self.generated_tokens = 0
        self.computed_tokens = 0
        self.preemptions = 0
        self.failed_requests = 0
        self.cancelled_requests = 0
        self.decode_retries = 0
        self.recent: deque[tuple[float, int, float]] = deque()  # (end, tokens, seconds)
        self.recent_prompts: deque[tuple[float, int, int]] = deque()  # (time, prompt, cached)
        # When each recently computed prompt block (by content key) was computed: what a
        # request that reuses it waited for (start: prefix_wait_s). Oldest first, at most
        # BLOCK_TIMES entries.
        self.block_done_at: OrderedDict[int, float] = OrderedDict()
        self._is_eog = model.is_eog
        self._piece = model.token_to_piece
        self.pick = pick  # how a row becomes a token (replaceable: tests spy on it)
        self.masks = Masks(model.n_vocab)  # structured output's token masks (engine.constrain)
        self.thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.thread.start()

    # -- callers' side ---------------------------------------------------------------------------
    def submit(self, req: Request, arrival: Callable[[], int]) -> None:
        with self.cond:
            if self.closed:
                raise EngineClosed(self.fatal or "the engine is closed")
            if req.cancel_requested:
                # Cancelled before it got here (while its K/V was fetched): the engine
                # thread already failed it (_drop of a NEW request).
                req.staged = None
                return
            req.key = (-req.priority, arrival())
            for child in req.children:  # after it, in choice order
                child.key = (-child.priority, arrival())
            self._inbox.append(req)
            self.cond.notify()

    def cancel(self, *reqs: Request) -> None:
        """Asks the engine thread to drop ``reqs`` at its next step."""
        with self.cond:
            for req in reqs:
                if req.state != DONE and not req.cancel_requested:
                    req.cancel_requested = True
                    self._cancels.append(req)
            self.cond.notify()

    def call(self, call: Call) -> None:
        if threading.current_thread() is self.thread:
            call.run()  # a callback on the engine thread: queueing would wait for ourselves
            return
        with self.cond:
            if self.closed:
                raise EngineClosed(self.fatal or "the engine is closed")
            self._calls.append(call)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join()

    def waiting_by_priority(self) -> dict[int, int]:
        with self.cond:
            out = dict(self.waiting_prio)
            for r in self._inbox:
                out[r.priority] = out.get(r.priority, 0) + 1 + len(r.children)
        return out

    def inbox_size(self) -> int:
        """Sequences submitted and not yet seen by the engine thread (call holding ``cond``)."""
        return sum(1 + len(r.children) for r in self._inbox)

    def waiting_changed(self, req: Request, d: int) -> None:
        """``d`` more sequences of ``req``'s priority wait (call holding ``cond``)."""
        self.n_waiting += d
        n = self.waiting_prio.get(req.priority, 0) + d
        if n:
            self.waiting_prio[req.priority] = n
        else:
            self.waiting_prio.pop(req.priority, None)

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # The callers' loops are woken when the next decode releases the GIL, or before
            # this thread sleeps or runs anything else (mailbox.deferred_wakes): a loop woken
            # while this thread still holds the GIL would only wake to wait for it.
            with deferred_wakes():
                self._run_steps()
        except BaseException as e:
            if not self.closed:
                self.fatal = f"the engine thread stopped: {type(e).__name__}: {e}"
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: not ours to swallow
            log.exception("the engine thread stopped")
        finally:
            self._shutdown()

    def _run_steps(self) -> None:
        failures = 0
        while True:
            with self.cond:
                while not (
                    self.closed
                    or self._inbox
                    or self._cancels
                    or self._calls
                    or self.sched.running
                    or self.n_waiting
                ):
                    flush_wakes()  # nothing left undelivered while this thread sleeps
                    timeout = self.sessions.ttl_timeout()
                    if timeout is not None and timeout <= 0:
                        break
                    self.cond.wait(timeout)
                if self.closed:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
                for req in inbox:
                    req.state = WAITING
                    for child in req.children:
                        child.state = WAITING
                    self.waiting_changed(req, 1 + len(req.children))
            decoded = self.computed_tokens
            try:
                self._iteration(inbox, cancels, calls)
                failures = 0
            except Exception as e:  # outside any request: a bug in the bookkeeping
                failures += 1
                log.exception("engine step failed outside any request (%d in a row)", failures)
                if failures >= _MAX_STEP_FAILURES:
                    self.fatal = f"the engine thread stopped: {type(e).__name__}: {e}"
                    return
                self._reset(e)
            if self.computed_tokens == decoded:
                flush_wakes()  # no decode this step: nothing flushed what it delivered

    def _iteration(self, inbox: list[Request], cancels: list[Request], calls: list[Call]) -> None:
        if inbox or cancels or calls:
            flush_wakes()  # what the last step delivered goes out before any other work
        try:
            self.sessions.expire()
        except Exception:
            log.exception("expiring a session failed (it was dropped)")
            self._check_context(None)
        for req in inbox:
            self.contain(req, self.accept, req)
        for req in cancels:
            self.contain(req, self._drop, req)
        for call in calls:
            self.run_call(call)
        self._step()
        self.kv_by_tenant = {t: n for t, n in self.sched.kv_held(self).items() if n}

    def _shutdown(self) -> None:
        error = EngineClosed(self.fatal or "the engine was closed before the request finished")
        with self.cond:
            self.closed = True
            pending = self._inbox + self.sched.queue.drain() + list(self.sched.running.values())
            calls, self._calls = self._calls, []
            self._inbox = []
            self.n_waiting = 0
            self.waiting_prio.clear()
        for s in self.sessions.table.values():
            for item in s.pending:
                if isinstance(item, Call):
                    calls.append(item)
                elif isinstance(item, Request):
                    pending.append(item)
            if isinstance(s.busy, Request):
                pending.append(s.busy)
            s.pending.clear()
            s.busy = None
        for call in calls:
            if not call.future.done():
                call.future.set_exception(EngineClosed(self.fatal or "the engine is closed"))
        self.sched.running.clear()
        self.kv_by_tenant = {}
        for req in pending:
            req.staged = None
            for r in (req, *req.children):
                if r.state != DONE:
                    r.state = DONE
                    r.sink.fail(error)
        self.masks.close()
        if self.step_log is not None:
            self.step_log.close()
        self.kv.clear()

    def _reset(self, error: BaseException) -> None:
        """After an error outside any request: every request in flight fails with it, every
        sequence goes (a new context if the old one closed), sessions keep their tokens."""
        with self.cond:
            queued = self.sched.queue.drain()
        running = list(self.sched.running.values())
        self.sched.running.clear()
        for req in running:
            req.seq = -1  # its K/V goes with the context's sequences below
        if self.kv.closed():
            self.kv.reopen()
        else:
            self.kv.clear()
        self.sessions.forget_kv()
        self.kv_by_tenant = {}
        for req in running + queued:
            self._fail_quietly(req, error)
        for s in self.sessions.table.values():
            if isinstance(s.busy, Request) and s.busy.state == DONE:
                self.sessions.idle(s)

    def _fail_quietly(self, req: Request, error: BaseException) -> None:
        """Fails ``req`` (and its unforked choices) without touching the context."""
        req.staged = None
        for r in (req, *req.children):
            if r.state == WAITING:
                with self.cond:
                    self.waiting_changed(r, -1)
            if r.state != DONE:
                r.state = DONE
                r.seq = -1
                r.entry = 0
                self.failed_requests += 1
                r.sink.fail(error)
        req.children = []
        if req.turn is not None and req.turn.session is not None:
            req.turn.closing = False

    # -- containment -----------------------------------------------------------------------------
    def contain(self, req: Request, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` on behalf of ``req``; an error fails ``req`` alone (module docs)."""
        try:
            return fn(*args)
        except Exception as e:
            self._check_context(req)
            self.fail(req, e)
            return None

    def _check_context(self, culprit: Request | None) -> None:
        """After an error: if it closed the context, replace it (module docs); ``culprit``,
        the request whose work closed it, is not requeued (the caller fails it)."""
        if self.kv.closed():
            log.error("the context was closed by an internal error; replacing it")
            self._lost_context([culprit] if culprit is not None else [])

    def fail(self, req: Request, error: BaseException) -> None:
        """Fails ``req`` wherever it is (queued, in a session's FIFO, running), releasing what
        it holds; if releasing fails too, what it held is forgotten (a closed context is
        replaced)."""
        if req.state == DONE:
            if req.turn is not None and req.turn.closing:  # its result is out: drop its K/V
                req.turn.closing = False
                self._release_quietly(req)
                assert req.turn.session is not None
                req.turn.session.seq, req.turn.session.n_kv = -1, 0
                self.sessions.idle(req.turn.session)
            return
        if req.state == WAITING:
            with self.cond:
                self.sched.queue.remove(req)
                self.waiting_changed(req, -1)
        self.failed_requests += 1
        try:
            self.finish(req, error=error)
        except Exception:
            log.exception("releasing a failed request failed")
            self._release_quietly(req)
            if req.state != DONE:
                req.state = DONE
                req.sink.fail(error)
            turn = req.turn
            if turn is not None and turn.session is not None and turn.session.busy is req:
                turn.session.seq, turn.session.n_kv = -1, 0
                self.sessions.idle(turn.session)
            self._check_context(None)

    def _release_quietly(self, req: Request) -> None:
        if req.seq >= 0:
            self.sched.running.pop(req.seq, None)
            try:
                self.kv.remove(req.seq)
            except Exception:
                log.exception("removing sequence %d failed", req.seq)
            req.seq = -1

    def _lost_context(
        self, culprits: list[Request], suspects: tuple[Request, ...] | list[Request] = ()
    ) -> None:
        """The context was closed: a new one; running requests are requeued with their places
        and recomputed, sessions keep their tokens only. ``culprits`` (whose work alone closed
        it) are not requeued: the caller fails them. ``suspects`` (the requests of a batch that
        closed it) are marked: the next time each is decoded alone, and if that closes the
        context again it is the culprit (loop docs)."""
        running = list(self.sched.running.values())
        self.sched.running.clear()
        for req in running:
            req.seq = -1
        self.kv.reopen()
        self.sessions.forget_kv()
        now = time.monotonic()
        marked = {id(r) for r in suspects}
        for req in running:
            if any(req is c for c in culprits):
                continue
            turn = req.turn
            if req.state == DONE:  # a closing session turn: its result is out
                if turn is not None and turn.session is not None:
                    turn.closing = False
                    self.sessions.idle(turn.session)
                continue
            if id(req) in marked:
                req.faults += 1
            req.state = WAITING
            req.n_done = 0
            with self.cond:
                self.sched.queue.push(req, now)
                self.waiting_changed(req, 1)

    # -- requests on the engine thread -----------------------------------------------------------
    def accept(self, req: Request) -> None:
        """A new request (state waiting): into the waiting queue, or for a session request into
        its session's FIFO (it waits there while the session is busy)."""
        self.faults.check("accept", req)
        turn = req.turn
        if turn is None:
            self.sched.queue.push(req, time.monotonic())
            return
        s = self.sessions.table.get(turn.session_id)
        if s is None:
            s = self.sessions.new(turn.session_id)
        turn.session = s
        s.pending.append(req)
        if s.busy is None:
            self.sessions.next(s)

    def _drop(self, req: Request) -> None:
        """A cancelled request leaves: its sequence is removed (full blocks stay cached)."""
        self.faults.check("drop", req)
        if req.state != DONE:
            self.cancelled_requests += 1
        if req.state == WAITING:
            with self.cond:
                self.sched.queue.remove(req)
                self.waiting_changed(req, -1)
        if req.state != DONE:
            self.finish(req, error=asyncio.CancelledError())

    def run_call(self, call: Call) -> None:
        """A session operation: now, or queued behind the work on its session."""
        sid = call.session_id
        s = self.sessions.table.get(sid) if sid is not None else None
        if s is not None and (s.busy is not None or s.pending):
            s.pending.append(call)
        else:
            self.run_call_now(call)

    def run_call_now(self, call: Call) -> None:
        call.run()
        if call.future.done() and call.future.exception() is not None:
            self._check_context(None)

    def release(self, req: Request) -> None:
        """Removes ``req``'s sequence if it runs (also a finished session turn that is still
        computing its last token)."""
        if req.seq >= 0 and self.sched.running.get(req.seq) is req:
            seq, req.seq = req.seq, -1
            del self.sched.running[seq]
            self.kv.remove(seq)

    def finish(
        self, req: Request, reason: str = FINISH_LENGTH, error: BaseException | None = None
    ) -> None:
        req.staged = None
        turn = req.turn
        if req.state == DONE:  # a finished session turn still computing its last token
            if turn is not None and turn.closing:
                self.sessions.park(req)
            return
        if req.children:  # failed or cancelled before its prompt was computed
            self._unfork(req, error if error is not None else asyncio.CancelledError())
        try:
            if turn is not None and turn.session is not None and turn.session.busy is req:
                self.sessions.end_turn(req, error is None)
            else:
                self.release(req)
        finally:
            if error is not None:
                req.state = DONE
                req.sink.fail(error)
        if error is not None:
            return
        req.state = DONE
        tail = req.text.finish()
        if tail:
            req.pieces.append(tail)
            req.sink.piece(tail, req.unsent_logprobs())
        if req.text.stopped:
            reason = FINISH_STOP
        req.sink.done(
            GenerateResult(
                text="".join(req.pieces),
                tokens=req.ids[req.n_prompt :],
                finish_reason=reason,
                prompt_tokens=req.n_prompt,
                cached_tokens=max(req.cached_tokens, 0),
                logprobs=req.logprobs,
                session_cached_tokens=req.session_cached if req.cached_tokens >= 0 else 0,
                prompt_logprobs=req.prompt_logprobs,
                end_logprob=req.end_logprob,
                prefix_wait_s=req.prefix_wait_s,
            ),
            req.unsent_logprobs(),
        )

    def _unfork(self, req: Request, error: BaseException) -> None:
        """The choices still waiting to fork from ``req`` end with ``error``."""
        children, req.children = req.children, []
        for child in children:
            if child.state == WAITING:
                with self.cond:
                    self.waiting_changed(child, -1)
            if child.state != DONE:
                child.state = DONE
                child.sink.fail(error)

    def _fork(self, parent: Request, row: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """``parent``'s prompt is computed (``row``: the logits of its last token): each choice
        waiting for it gets a sequence that shares the prompt's K/V (``seq_cp``), picks its
        first token from ``row`` with its own sampler and runs on. Returns the tokens
        generated. A choice whose fork fails fails alone."""
        children, parent.children = parent.children, []
        generated = 0
        for child in children:
            if child.state != WAITING or child.cancel_requested:
                continue  # a cancelled one is dropped at the next step
            with self.cond:
                self.waiting_changed(child, -1)
            child.state = RUNNING
            generated += self.contain(child, self._fork_one, parent, child, row, allowed) or 0
        return generated

    def _fork_one(
        self, parent: Request, child: Request, row: np.ndarray, allowed: np.ndarray | None
    ) -> int:
        self.faults.check("fork", child)
        child.prompt_logprobs = parent.prompt_logprobs  # complete, and never changed again
        if child.max_tokens == 0:  # nothing to generate: no sequence of its own
            child.n_done, child.cached_tokens = parent.n_done, parent.cached_tokens
            self.finish(child)
            return 0
        child.seq = self.kv.alloc()
        try:
            self.kv.fork(parent.seq, child.seq)
        except BaseException:
            self.kv.remove(child.seq)
            child.seq = -1
            raise
        child.n_done = parent.n_done
        child.cached_tokens = parent.cached_tokens
        self.sched.running[child.seq] = child
        greedy = int(np.argmax(row)) if child.argmax_only else None
        if child.matcher is not None and allowed is not None:  # its matcher is where parent's was
            return self._deliver(child, self.pick(self.model, child, row, greedy, allowed))
        return self._deliver(child, self.pick(self.model, child, row, greedy))

    # -- the scheduler's resources ---------------------------------------------------------------
    def available(self) -> int:
        return self.kv.available()

    def total_blocks(self) -> int:
        return self.kv.pool_tokens // self.kv.block

    def session_blocks(self) -> Mapping[str | None, int]:
        return self.sessions.table.parked_blocks

    def resident_prefix(self, req: Request) -> int | None:
        return self.sessions.resident_prefix(req)

    def cached_estimate(self, req: Request) -> int | None:
        session = req.turn.session if req.turn is not None else None
        if session is not None:
            return self.sessions.resident_prefix(req)  # None when evicted: no fast lane
        limit = req.match_limit
        return self.kv.peek(req.context() if limit is None else req.context(0, limit), req.salt)

    def reclaim_idle(self, prefer: Sequence[str | None] = ()) -> bool:
        s = self.sessions.table.victim(prefer)
        if s is None:
            return False
        try:
            self.sessions.evict(s)
        except Exception:
            log.exception("evicting session %r failed", s.id)
            self._check_context(None)
        return True

    def start(self, req: Request) -> int | None:
        """Moves an admitted request (already out of the queue) to the running set: a sequence
        for it (the prefix cache mapped onto it, or its session's), its counters."""
        with self.cond:
            self.waiting_changed(req, -1)
        req.state = RUNNING  # from here a failure releases its sequence
        try:
            matched = self.contain(req, self._attach, req)
        finally:
            req.staged = None  # taken by the match (or not needed any more)
        if matched is None:
            return None
        if req.cached_tokens < 0:  # first admission (not a resume after preemption)
            req.cached_tokens = min(matched, req.n_prompt)
            req.session_cached = min(req.session_cached, req.cached_tokens)
            self.prompt_tokens += req.n_prompt
            self.cached_prompt_tokens += req.cached_tokens
            self.session_cached_tokens += req.session_cached
            now = time.monotonic()
            try:
                self._prefix_wait(req, now)
            except Exception:  # a report, not the request's work: it runs on without it
                log.exception("measuring the prefix wait of %s failed", req.key)
            self.recent_prompts.append((now, req.n_prompt, req.cached_tokens))
            while self.recent_prompts and now - self.recent_prompts[0][0] > HIT_WINDOW_S:
                self.recent_prompts.popleft()
        return int(matched)

    def _prefix_wait(self, req: Request, now: float) -> None:
        """``req`` just started: how long it waited for a cached prefix it reuses that another
        request computed after it was queued (``prefix_wait_s``: from its queueing to the
        computing of the last such block, at most until now), and, when it will compute whole
        prompt blocks itself, their content keys (``_note_blocks``). O(prompt blocks), once
        per request."""
        bs = self.kv.block
        whole = req.n_prompt // bs * bs
        if whole == 0 or not self.kv.prefix_cache:
            return
        keys: list[int] | None = None
        reused = req.cached_tokens // bs
        if reused and self.block_done_at and req.queued_at is not None:
            keys = list(self.kv.ctx.block_keys(req.context(0, whole), req.salt))
            done = self.block_done_at
            last = max((done.get(k, -1.0) for k in keys[:reused]), default=-1.0)
            if last > req.queued_at:
                req.prefix_wait_s = min(last, now) - req.queued_at
        if req.cached_tokens < whole:  # it computes prompt blocks others may wait for
            if keys is None:
                keys = list(self.kv.ctx.block_keys(req.context(0, whole), req.salt))
            req.block_keys = keys

    def _note_blocks(self, req: Request, start: int, k: int, now: float) -> None:
        """Notes when the prompt blocks that tokens ``start..start + k`` completed were
        computed (for the requests that will reuse them: ``_prefix_wait``)."""
        keys = req.block_keys
        assert keys is not None
        bs = self.kv.block
        done = self.block_done_at
        for b in range(start // bs, min((start + k) // bs, len(keys))):
            key = keys[b]
            done[key] = now
            done.move_to_end(key)
        while len(done) > BLOCK_TIMES:
            done.popitem(last=False)
        if (start + k) // bs >= len(keys):
            req.block_keys = None  # every whole prompt block is computed

    def _attach(self, req: Request) -> int:
        self.faults.check("admit", req)
        if req.turn is not None and req.turn.session is not None:
            if not req.turn.session.resident:
                self.faults.check("prefix_match", req)
            n = self.sessions.attach(req)
        else:
            req.seq = self.kv.alloc()
            self.sched.running[req.seq] = req  # a failure below releases it
            self.faults.check("prefix_match", req)
            limit = req.match_limit  # prompt logprobs: its rows are computed, not mapped
            ids = req.context() if limit is None else req.context(0, limit)
            n = self.kv.match(req.seq, ids, req.salt, req.staged)
        self.sched.running[req.seq] = req
        return n

    def preempt(self, req: Request) -> None:
        """Releases ``req``'s blocks (already off the running set); it waits again with its
        place and is recomputed later (a closing session turn just loses its K/V)."""
        turn = req.turn
        self.preemptions += 1
        seq, req.seq = req.seq, -1
        if turn is not None and turn.session is not None:
            turn.session.seq, turn.session.n_kv = -1, 0
        try:
            self.kv.remove(seq)
        finally:
            if turn is not None and turn.session is not None and turn.closing:
                turn.closing = False  # its result is out; the session just loses its K/V
                self.sessions.idle(turn.session)
            else:
                req.state = WAITING
                req.n_done = 0
                with self.cond:
                    self.sched.queue.push(req, time.monotonic())
                    self.waiting_changed(req, 1)

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> None:
        self.sched.admit(self, time.monotonic())
        t0 = time.monotonic()
        done = self._decode()
        if not done:
            return
        n_generated = 0
        for plan, logits in done:
            n_generated += self._consume(plan, logits)
        try:
            self.sessions.reclaim()
        except Exception:
            log.exception("reclaiming idle sessions failed")
            self._check_context(None)
        now = time.monotonic()
        self.recent.append((now, n_generated, now - t0))
        while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
            self.recent.popleft()

    def _decode(self) -> list[tuple[list[PlanEntry], Logits]]:
        """Plans and computes this step's batch: the computed parts and their logits (several
        parts when a failing batch was split, or when requests suspected of closing the
        context are decoded alone)."""
        while True:
            plan = self.sched.plan(time.monotonic())
            if not plan:
                return []
            if any(e[0].faults for e in plan):
                return self._decode_suspects(plan)
            try:
                return [(plan, self._forward(plan))]
            except KvCacheFull as e:
                # The core checks before computing anything (and changes nothing): make room,
                # then plan again. (Asking it first with ``blocks_short`` cost a second call on
                # every step, ~5% of a one-sequence step's Python work.)
                if not self._make_room(str(e)):
                    return []
            except Exception as e:
                return self._decode_failed(plan, e)

    def _make_room(self, why: str) -> bool:
        """The pool cannot hold the batch: evict an idle session, else preempt the victim;
        False when the one running request does not fit even alone (it failed)."""
        # Idle sessions go before any running request; tenants above their K/V share first.
        if self.sessions.evict_one(self.sched.kv_over(self)):
            return True
        if len(self.sched.running) <= 1:
            (req,) = self.sched.running.values()
            msg = (
                f"the request needs {req.n_tokens} tokens of K/V and does not fit the"
                f" KV pool even alone ({why})"
            )
            self.fail(req, KvCacheFull(msg))
            return False
        victim = self.sched.memory_victim(self)
        assert victim is not None
        self.sched.preempt(self, victim)
        return True

    def _decode_suspects(self, plan: list[PlanEntry]) -> list[tuple[list[PlanEntry], Logits]]:
        """A step holding requests of a batch that closed the context: each of them alone
        first (one that closes it again is the culprit and fails), then the rest together."""
        out: list[tuple[list[PlanEntry], Logits]] = []
        rest = [e for e in plan if not e[0].faults]
        for entry in (e for e in plan if e[0].faults):
            req = entry[0]
            try:
                out.append(([entry], self._forward([entry])))
            except KvCacheFull:
                continue  # planned again next step
            except Exception as e:
                if self.kv.closed():
                    log.error("request %s closed the context again; it fails", req.key)
                    self._lost_context([req])
                    self.fail(req, e)
                    return []  # everything else was requeued: nothing computed counts
                self.fail(req, e)
        if rest:
            try:
                out.append((rest, self._forward(rest)))
            except KvCacheFull:
                pass  # planned again next step
            except Exception as e:
                lost = self.kv.reopened
                done = self._decode_failed(rest, e)
                if self.kv.reopened != lost:
                    return []  # the context was lost meanwhile: everything was requeued
                out += done
        return out

    def _forward(self, plan: list[PlanEntry]) -> Logits:
        tokens, positions, seqs, flags = _batch(plan)
        if self.faults.armed:
            reqs = [e[0] for e in plan]
            if self.faults.hit("panic", reqs) is not None:
                self.kv.ctx._inject_panic()
            self.faults.check("decode", *reqs)
        # The constrained rows' token masks are computed while the pass runs.
        masking = self.masks.start([e[0] for e in plan if e[3] and e[0].matcher is not None])
        try:
            flush_wakes()  # the GIL is released next: the woken loops run during the pass
            start = time.monotonic()
            logits = self.kv.decode(tokens, positions, seqs, flags)
        finally:
            self.masks.finish(masking)  # always waited for: the matchers are not shared
        self.computed_tokens += len(tokens)
        if self.step_log is not None:
            self.step_log.write(start, time.monotonic() - start, plan)
        return logits

    def _decode_failed(
        self, plan: list[PlanEntry], error: Exception
    ) -> list[tuple[list[PlanEntry], Logits]]:
        """A batch failed (the core rolled it back): retry it once, then split it to find the
        requests whose rows fail (module docs)."""
        log.warning("a decode step failed (%s: %s); retrying it", type(error).__name__, error)
        self.decode_retries += 1
        if self.kv.closed():
            self._lost_context([], [e[0] for e in plan])
            return []
        try:
            return [(plan, self._forward(plan))]
        except KvCacheFull:
            return []  # the next step plans again (and preempts)
        except Exception as e:
            error = e
        try:
            return self._split(plan, error)
        except _Abort:
            return []

    def _split(
        self, plan: list[PlanEntry], error: Exception
    ) -> list[tuple[list[PlanEntry], Logits]]:
        if self.kv.closed():
            self._lost_context([], [e[0] for e in plan])
            raise _Abort
        if len(plan) == 1:
            self.fail(plan[0][0], error)
            return []
        mid = len(plan) // 2
        out: list[tuple[list[PlanEntry], Logits]] = []
        for part in (plan[:mid], plan[mid:]):
            try:
                out.append((part, self._forward(part)))
            except KvCacheFull:
                continue  # planned again next step
            except Exception as e:
                out += self._split(part, e)
        return out

    def _consume(self, plan: list[PlanEntry], logits: Logits) -> int:
        """A computed part of the batch: its requests advance, park or get their tokens.
        Returns the tokens generated."""
        self.sched.charge(plan)  # its prompt tokens, to their tenants' virtual times
        rows = _Rows(logits)
        wanting: list[Request] = []
        at: list[int] = []  # the row of each of them (after any prompt rows: _batch)
        i = 0
        now = 0.0
        for req, start, k, want in plan:
            req.n_done += k
            req.faults = 0  # decoded: no longer a suspect
            if req.block_keys is not None:  # computing prompt blocks others may reuse
                now = now or time.monotonic()
                try:
                    self._note_blocks(req, start, k, now)
                except Exception:  # as in start: the report is lost, not the request
                    log.exception("noting the blocks of %s failed", req.key)
                    req.block_keys = None
            if req.turn is not None and req.turn.closing:
                self.contain(req, self.sessions.park, req)
            echo = req.prompt_rows(start, k)
            if echo:
                if req.state == RUNNING and not req.cancel_requested:
                    self.contain(req, self._prompt_logprobs, req, echo, rows[i : i + len(echo)])
                i += len(echo)
            if want:
                wanting.append(req)
                at.append(i)
                i += 1
        greedy = argmax_rows(wanting, logits, at)
        n_generated = 0
        first = 0
        while first < len(wanting):
            # One try around the rows (not a call per row: this is the per-token hot path);
            # the row that raises fails alone and the loop goes on after it.
            i = first
            try:
                for i in range(first, len(wanting)):
                    req = wanting[i]
                    if req.cancel_requested or req.state != RUNNING:
                        continue  # dropped at the next step (or failed meanwhile)
                    n_generated += self._emit(req, rows, at[i], greedy.get(i))
                first = len(wanting)
            except Exception as e:
                self._check_context(wanting[i])
                self.fail(wanting[i], e)
                first = i + 1
        return n_generated

    def _prompt_logprobs(self, req: Request, positions: range, rows: np.ndarray) -> None:
        """Reduces the logits ``rows`` of prompt ``positions`` to the entries of the prompt
        tokens after them (each row to its token's log-probability and top alternatives, so
        no row outlives its step)."""
        entries = req.prompt_logprobs
        n = req.n_prompt_logprobs
        assert entries is not None and n is not None and positions.start == len(entries) - 1
        ids = req.ids
        for p, row in zip(positions, rows, strict=True):
            entries.append(token_logprob(self.model, row, ids[p + 1], n))

    def _emit(self, req: Request, rows: _Rows, at: int, greedy: int | None) -> int:
        """Picks ``req``'s token from its row ``at`` of ``rows`` (``greedy``: the row's argmax
        when it is a plain greedy row: then no numpy view of the row is made unless the
        request wants logprobs or has choices to fork) and delivers it."""
        if self.faults.armed:
            self.faults.check("sample", req)
        if req.max_tokens == 0:  # the prompt alone (its K/V, its logprobs): nothing to pick
            n = self._fork(req, rows[at]) if req.children else 0
            self.finish(req)
            return n
        if greedy is not None and req.n_logprobs is None and not req.children:
            # The common case: the row itself is not needed (unless a test spies on pick).
            if self.pick is pick:
                return self._deliver(req, greedy)
        row = rows[at]
        allowed = None
        if req.matcher is not None:
            if req.mask is None:
                raise GrammarError("the constraint's token mask could not be computed")
            allowed = allowed_ids(req.mask, len(row))
            if len(allowed) == 0:
                raise GrammarError("the constraint allows no token here")
            tok = self.pick(self.model, req, row, greedy, allowed)
        else:
            tok = self.pick(self.model, req, row, greedy)
        n = 0
        if req.children:  # before req may finish and release its sequence
            n += self._fork(req, row, allowed)
        return n + self._deliver(req, tok)

    def _deliver(self, req: Request, tok: int) -> int:
        """Hands ``tok`` to ``req`` and finishes it when it is done; returns 1 if the token
        counts as generated (counted in ``stats()`` before the request can see its result)."""
        if self.faults.armed:
            self.faults.check("deliver", req)
        # Counted before the text goes out, so stats() never shows less than a caller saw.
        eog = not req.ignore_eos and self._is_eog(tok)
        matcher = req.matcher
        if matcher is not None and not eog:
            req.mask = None
            if not matcher.consume_token(tok):
                raise GrammarError(f"the constraint refused token {tok}: {matcher.get_error()}")
        generated = not eog
        self.generated_tokens += generated
        try:
            reason = deliver(req, tok, eog, self._piece, self.seq_limit)
        except BaseException:
            self.generated_tokens -= generated
            raise
        if reason is None and matcher is not None and matcher.is_stopped():
            reason = FINISH_STOP  # the grammar is complete: nothing more may follow
        if reason == FINISH_CONTEXT and self._shift_context(req):
            reason = None
        if reason is not None:
            self.finish(req, reason)
        return int(generated)

    def _shift_context(self, req: Request) -> bool:
        """Context shift (llama.cpp's server arithmetic) for a sequence whose K/V fills the
        limit: after the first ``keep`` tokens, drop half of the rest and move the remainder
        down (keys are re-rotated lazily). False when shifting is off for ``req`` or cannot
        free anything. If the move needs blocks the pool lacks, ``req`` is preempted instead;
        it resumes by recomputing its shifted context."""
        if not req.context_shift:
            return False
        n_left = req.n_done - req.keep
        n_discard = min(n_left // 2, max(0, n_left - 1))
        if n_discard <= 0:
            return False
        ok = self.kv.shift(req.seq, req.keep, req.keep + n_discard)
        req.shift += n_discard
        req.n_done -= n_discard
        if not ok:
            self.sched.preempt(self, req)
        return True


class _Rows:
    """A step's logits as numpy rows, viewed (zero-copy) only when a row is asked for: a step
    of plain greedy rows reads them only through the core's ``Logits.argmax``."""

    __slots__ = ("logits", "view")

    def __init__(self, logits: Logits) -> None:
        self.logits = logits
        self.view: np.ndarray | None = None

    def __getitem__(self, i: int | slice) -> np.ndarray:
        if self.view is None:
            lg = self.logits
            self.view = np.frombuffer(memoryview(lg), dtype=np.float32).reshape(
                lg.n_rows, lg.n_vocab
            )
        return self.view[i]


def _batch(plan: list[PlanEntry]) -> tuple[list[int], list[int], list[int], list[bool]]:
    """A plan as ``decode``'s parallel lists: tokens, positions, sequence ids, logits flags."""
    tokens: list[int] = []
    positions: list[int] = []
    seqs: list[int] = []
    flags: list[bool] = []
    for req, start, k, want in plan:
        tokens += req.context(start, start + k)
        positions += range(start, start + k)
        seqs += [req.seq] * k
        echo = req.prompt_rows(start, k)  # rows for prompt logprobs, before the sampled one
        if echo:
            flags += [p in echo for p in range(start, start + k)]
            flags[-1] = flags[-1] or want  # never a prompt row when want: it is the last
        else:
            flags += [False] * (k - 1) + [want]
    return tokens, positions, seqs, flags
