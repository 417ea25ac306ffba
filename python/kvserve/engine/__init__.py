"""kvserve.Engine: one model shared by many callers through continuous batching.

One engine thread owns one decoding context over the model's shared K/V memory and runs
*steps*; callers (sync calls from any thread, async calls from any task) only queue requests
and receive results. The thread sleeps on a condition while there is nothing to do.

One step:
1. take new requests and cancellations queued since the last step (cancelled sequences are
   removed with ``seq_rm``; their full blocks stay cached for prefix reuse);
2. admit waiting requests, highest ``priority`` first and FCFS within a priority (a request
   that has waited ``priority_aging_s`` goes before all that have not) within a tenant, and
   between tenants (``tenant=``; none is one tenant too) the next from the tenant with the
   fewest running sequences per ``weight`` (its :class:`TenantPolicy`), while fewer than
   ``parallel`` run and the pool has room for the prompt (plus a block to grow) beside what
   the running sequences still need; when no slot or room is left, a waiting request of
   higher priority than a running one of its tenant *preempts* the lowest-priority running
   request of its tenant (it resumes later with its place, its streamed text unchanged), and
   a tenant below its weighted share of the slots (or, for memory, within its K/V share)
   preempts one of a tenant above its own, so a light tenant gets a slot within a step
   however much another has queued (:mod:`kvserve.engine.scheduler`, "Tenants"). An
   admitted request first maps the longest cached prefix of its tokens (``match_prefix``), so
   only the rest is computed.
   A request whose prompt starts with whole blocks that a running request is prefilling right
   now waits (keeping its place, taking no slot) until they are computed and cached, instead
   of computing them again; it counts as a *waiter* of that request. While the step's prompt
   budget is taken, a request of the head's rank that the plan would compute within it (at
   most a few blocks of prompt left, the rest cached: a shared document, a session's next
   turn; or less work left than the running prompts) is admitted out of turn if memory and a
   slot (leaving one for the head) allow;
3. build ONE batch: one token for every sequence that is generating, then chunks of the
   prompts still being prefilled up to ``batch_tokens`` tokens in all (chunked prefill: a long
   prompt never stalls the running streams for more than one chunk), the budget shared
   between tenants by weighted fair queuing over prompt tokens and each tenant's part going
   to its short remainders first, then the aged, then highest priority and within a priority
   the least work left per user served (tokens left / (1 + waiters): a shared document's
   users all start early; ``prompt_order="fcfs"``: earliest first); a step that brings a
   short remainder to its first token leaves the longer prompts out, at most every other
   step (a short step: that first token comes a long step sooner);
4. ``decode`` it (the GIL is released). The core first checks that the pool can hold the
   batch in every layer group; if not it raises ``KvCacheFull`` having computed and changed
   nothing, and the loop evicts idle sessions, then preempts the lowest-priority,
   latest-arrived sequence (of tenants above their K/V share first, for both), and plans
   again. A preempted sequence is
   released and goes back to the waiting queue with its place; it is later resumed by
   recomputing its prompt and generated tokens, with prefix reuse. Only a request that cannot
   fit when it runs alone fails
   (``KvCacheFull``). Any other failure is contained (:mod:`kvserve.engine.loop`): retried
   once, then the batch is split so that only the failing requests fail;
5. sample every row at once (greedy rows without logit bias or penalties by the core's argmax
   scan of each row, ``Logits.argmax``, with no numpy view of the logits; the others with
   each request's own sampler: bias and penalties over its tokens, then argmax or its own
   seeded generator, so a seeded request gives the same tokens whatever else is in the
   batch), deliver the text (and the token's logprobs when asked), check
   end-of-generation, stop strings (incrementally: work per token bounded by the new text),
   max_tokens and ``ctx_size``, and retire finished sequences. What async callers get goes
   through their loop's mailbox (:mod:`kvserve.engine.mailbox`): one wake-up per loop and
   step, sent when the next decode releases the GIL (or before the thread sleeps).

Prompt logprobs (the ``prompt_logprobs`` option; ``echo`` with ``logprobs`` on the server's
``/v1/completions``) are computed in the request's own prefill: its batch rows ask the core for
the logits of every prompt position whose entry is still missing (the others only that of the
last token, as always), and each step reduces those rows to the entries (the next token's
log-softmax and the top alternatives) before the next one, so no row outlives its step; such a
request's prompt goes in chunks of at most ``PROMPT_LOGITS_BYTES`` (64 MiB) of logits. Its
rows must be computed, so it maps no cached prefix at admission (after a preemption, only the
positions whose entries it already has), and it does not fetch from the shared tier; its own
blocks are cached for others as usual. Measured on SmolLM2 (49k vocabulary), a 105-token
prompt computed with all its rows costs about a third more than without (the output layer
and the reduction).

The package: :mod:`.api` (this front end), :mod:`.scheduler` (pure policy), :mod:`.kv` (the
only caller of the context), :mod:`.session_manager`, :mod:`.output`, :mod:`.loop` (the
thread and containment); docs/ARCHITECTURE.md has the map.

Per-step cost: O(R + T + A x R) Python work plus the argmax/sampling over R rows of
``n_vocab`` logits, where R is the number of running sequences (at most ``parallel``), T the
batch's tokens (at most ``batch_tokens`` plus R) and A <= 3 x ``parallel`` the requests the
admission looks at (each O(log W + D) out of W waiting requests of D distinct priorities); a
step whose prompt budget is full also peeks at the cached prefix of the first 2 x parallel
waiting requests (the fast lane: O(min(W, 2P) x prompt blocks) hash lookups, walking the
queue without touching the rest). Tenants add O(R + N log N) for N tenants with work (their
slots, a heap of the waiting ones, the prompt budget's water-filling). Nothing scans all
requests: a cancelled waiting request is removed in O(1) (its queue entry is skipped later), a
session is found in O(1), and only a preemption scans the R running sequences for its victim.

Generation follows :meth:`kvserve.Model.generate` exactly (same tokenization, stop rules,
``finish_reason`` and text assembly), so a greedy request gives the tokens that model's own
generation gives for the same prompt.

Sessions (``session_id=``; the bookkeeping lives in :mod:`kvserve.sessions`):
- A session is a named conversation: its tokens (every prompt and output so far) and, while it
  is *resident*, a sequence of the context that holds their K/V between requests (a *parked*
  sequence: sequence ids are not limited to ``parallel``; at most ``parallel`` sequences run).
  A request on a session continues it: its prompt is tokenized without BOS and appended to the
  session's tokens, and the request starts from the parked sequence, so only the new tokens are
  computed (``cached_tokens`` counts the rest). A finished turn (``stop``/``length``) decodes
  its last output token too before it parks (one more row in the next step, no logits), so the
  next turn computes only its own tokens. A turn that fails or is cancelled leaves the session
  as it was. An unknown id starts a new session (the prompt as usual, with BOS).
- One request at a time per session: a second request on a busy session waits until the
  first has finished (FIFO per session; the waiting time counts as ``waiting``), and so do
  ``save_session``/``drop_session`` called on a busy session.
- Reclaim: after every step, when the pool's usage (referenced blocks / total) is above
  ``kv_high_watermark``, idle resident sessions are *evicted* — lowest priority (of their last
  request) first, least recently used first within a priority — until usage is at most
  ``kv_low_watermark``. When the pool is short for running requests (admission or a decode),
  idle sessions are evicted first, then the K/V of sessions whose next request is still
  waiting, and only then is a running request preempted. Evicting releases the sequence (its
  full blocks stay in the prefix index as cached blocks) and keeps the tokens: the session's
  next turn recomputes its K/V, mapping what is still cached (``session_misses`` counts such
  turns). A session idle for ``session_ttl`` seconds is dropped (tokens too); with
  ``max_sessions`` set, creating or loading one more drops the least recently used idle
  session (an error if every session is busy).
- ``save_session`` writes a session (tokens, random generator state, and the K/V of its cells
  as stored; with sliding-window layers, what each layer group holds) to a checksummed file
  atomically; ``load_session`` restores it without recomputation. Session operations run on
  the engine thread between steps.
"""

from __future__ import annotations

from ..sessions import SessionFileError, SessionInfo
from .api import Engine
from .requests import Delta, EngineClosed, parse_size
from .session_manager import TooManySessions
from .tenancy import TenantPolicy

__all__ = [
    "Delta",
    "Engine",
    "EngineClosed",
    "SessionFileError",
    "SessionInfo",
    "TenantPolicy",
    "TooManySessions",
    "parse_size",
]
