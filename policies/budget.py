"""The budget helper every policy reuses: token/sequence limits and the loops that spend them
(decode the running set, admit from a queue, resume swapped requests, make room by
preemption). Policies differ in the order they pass requests in and the victims they pick, not
in these loops."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, TypeVar

from sim.request import Request, RequestStatus
from sim.step_builder import ReadOnly, StepBuilder

VictimPicker = Callable[[StepBuilder, Request], "Request | None"]
T = TypeVar("T")


class Budget:
    """Limits for one step. Spending is tracked by the StepBuilder itself, so preempting a
    request that was already scheduled gives its tokens back automatically."""

    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "step")

    def __init__(self, step: StepBuilder, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.step = step
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    @property
    def remaining_tokens(self) -> int:
        return self.max_num_batched_tokens - self.step.num_scheduled_tokens

    def seats_left(self) -> int:
        """How many more requests may hold GPU KV (the running set) under ``max_num_seqs``."""
        return self.max_num_seqs - len(self.step.running)

    def now(self) -> tuple[int, int]:
        """(``remaining_tokens``, ``seats_left()``) as they stand."""
        step = self.step
        return (self.max_num_batched_tokens - step.num_scheduled_tokens,
                self.max_num_seqs - step.num_running)


def chunk_size(pending: int, remaining: int, max_chunk: int | None = None) -> int:
    """The tokens a request with ``pending`` tokens gets from a step with ``remaining`` left:
    all of them, or as many as remain (and at most ``max_chunk``); 0 or less: the budget is
    spent. The rule of every loop that grants running requests their next tokens."""
    n = min(pending, remaining)
    return n if max_chunk is None or n <= 0 else min(n, max_chunk)


def grant_chunks(pendings: Iterable[int], remaining: int, max_chunk: int | None = None
                 ) -> tuple[list[int], int]:
    """``schedule_running``'s loop on counts where nobody is preempted, for the array core's
    ``chunk_plan``: the chunks running requests with ``pendings`` tokens left get in order
    (``chunk_size``; the list ends where the budget is spent) and the budget left after
    them."""
    chunks: list[int] = []
    for pending in pendings:
        n = chunk_size(pending, remaining, max_chunk)
        if n <= 0:
            break
        chunks.append(n)
        remaining -= n
    return chunks, remaining


def prefill_share(remaining: int, max_partial_prefills: int, num_wanting: int) -> int:
    """vLLM v0's prefill slot budget: the tokens left after the decodes, shared evenly by up
    to ``max_partial_prefills`` of the ``num_wanting`` prompts that want them (at least 1)."""
    return max(1, remaining // max(1, min(max_partial_prefills, num_wanting)))


def admission_rule(candidates: Iterable[T], pending_of: Callable[[T], int] | None,
                   remaining: int, seats: int, max_num_batched_tokens: int, *,
                   chunked: bool = False, strict_order: bool = True,
                   max_partial: int | None = None, max_chunk: int | None = None,
                   place: Callable[[T, int, int], bool] | None = None,
                   budget_now: Callable[[], tuple[int, int]] | None = None,
                   ) -> list[tuple[T, int]]:
    """Which candidates, in the given order, a step admits and with how many tokens: the token
    budget (``remaining``) and the free seats on plain numbers (a candidate's pending prefill
    tokens are ``pending_of(candidate)``, or the candidate itself), the KV part left to
    ``place(candidate, tokens, pending)``, which admits it (True) or not (False; None: every
    candidate the budget and seats allow is admitted). ``admit`` runs it over requests; the
    array core (sim/array_core.py) over prompt lengths, with its KV part on counts.

    Without chunking a candidate is admitted only with its whole pending prefill, unless that
    exceeds a whole step's budget (a recomputed request that grew that long: it re-prefills in
    budget-sized chunks); with chunking the last one admitted may get a partial chunk (at most
    ``max_chunk``). ``strict_order`` stops at the first candidate that does not fit (FCFS, no
    head-of-line bypass); otherwise later, smaller ones may go ahead. ``max_partial`` caps how
    many candidates end the step with their prefill unfinished. ``budget_now()``, if given,
    re-reads (remaining, seats) as each candidate comes up: a lazy candidate iterator may
    preempt someone to make room for it (``preempt_for``), freeing a seat."""
    out: list[tuple[T, int]] = []
    partial = 0
    for c in candidates:
        if budget_now is not None:
            remaining, seats = budget_now()
        if remaining <= 0 or seats <= 0:
            break
        pending = n = c if pending_of is None else pending_of(c)  # type: ignore[assignment]
        too_big = n > max_num_batched_tokens
        limit = remaining if max_chunk is None or not chunked else min(remaining, max_chunk)
        if n > limit:
            if not (chunked or too_big) or (max_partial is not None and partial >= max_partial):
                if strict_order:
                    break
                continue
            n = limit
        if place is not None and not place(c, n, pending):
            if strict_order:
                break
            continue
        out.append((c, n))
        remaining -= n
        seats -= 1
        if n < pending:
            partial += 1
    return out


def counted_room(room: tuple[int, int, int],
                 held_tokens: Callable[[Any], int] | None = None, *,
                 chunk_only: bool = False,
                 cached_blocks: Callable[[], int] | None = None,
                 ) -> Callable[[Any, int, int], bool]:
    """``admit``'s KV part on counts, for ``admission_rule``'s ``place`` in the array core
    (sim/array_core.py): ``room`` = (free blocks, watermark blocks, block size). A candidate
    holding nothing is admitted if the blocks of its whole pending prefill (or of
    ``held_tokens(candidate)`` tokens: a whole length that ``admit(reserve_full=True)``
    reserves; or, with ``chunk_only``, of this step's chunk: vLLM v1 holds nothing ahead)
    leave the watermark free (``KVBlockManager.can_allocate``), and takes them.
    ``cached_blocks()``: the blocks of the candidate's cache hit, read as it is placed
    (its pending prefill starts after them; they leave the free queue with it, as
    ``StepBuilder.blocks_needed`` counts them).
    (The core runs only where every request fits the pool alone above the watermark, so
    ``admit``'s fallback for one that never could does not arise.)"""
    free, watermark, block_size = room

    def place(candidate: Any, n: int, pending: int) -> bool:
        nonlocal free
        if held_tokens is not None:
            tokens = held_tokens(candidate)
        else:
            tokens = n if chunk_only else pending
        need = -(-tokens // block_size)
        if cached_blocks is not None:
            need += cached_blocks()
        if free - need < watermark:
            return False
        free -= need
        return True

    return place


def preempted_on_counts(needs: Sequence[int], held: Sequence[int], free: int) -> int:
    """``schedule_running``'s loop on counts, for the array core (sim/array_core.py), with a
    victim picker that takes the last request of the running order not yet granted
    (``latest_arrival_victim``; ``victim_from_end``). The running requests in that order,
    request r needing ``needs[r]`` new blocks for this step (0 for one that needs none or is
    not a row of this loop: the victims after it are taken first either way) and holding
    ``held[r]``, ``free`` blocks free. A request that finds too few preempts the last ones
    not yet granted, possibly itself, so those preempted are always the last. Returns how
    many."""
    end = len(needs)  # requests [end, len) are preempted
    r = 0
    while r < end:
        need = needs[r]
        while need > free and end > r:
            end -= 1  # the last not yet granted gives its blocks back
            free += held[end]
        if r < end:
            free -= need
        r += 1
    return len(needs) - end


def preempted_by_key_on_counts(needs: Sequence[int], held: Sequence[int], free: int,
                               keys: Sequence[Any]) -> tuple[list[int], int, int]:
    """``schedule_running``'s loop on counts, for the array core (sim/array_core.py), with a
    victim picker that takes the running request of the largest key, granted in this step
    or not (``lowest_priority_victim``: vLLM v1's priority scheduling), and a request that
    preempts itself ending the loop (``self_preemption_ends``). The running requests in
    grant order, request r needing ``needs[r]`` new blocks for this step and holding
    ``held[r]``, ``keys[r]`` its victim key (distinct); ``free`` blocks free. A victim
    already granted gives its new blocks back too. Returns the victims in the order
    preempted, how many leading requests the loop reached (those after them, not
    preempted, get nothing this step) and the fewest blocks free along the way."""
    n = len(needs)
    alive = [True] * n
    granted = [False] * n
    by_key = sorted(range(n), key=keys.__getitem__, reverse=True)
    top = 0  # by_key[top:] holds every request still alive
    victims: list[int] = []
    low = free
    for r in range(n):
        if not alive[r]:
            continue
        while needs[r] > free:
            while not alive[by_key[top]]:
                top += 1
            v = by_key[top]
            alive[v] = False
            victims.append(v)
            free += held[v] + (needs[v] if granted[v] else 0)
            if v == r:
                return victims, r, low
        free -= needs[r]
        granted[r] = True
        low = min(low, free)
    return victims, n, low


def latest_arrival_victim(step: StepBuilder, requester: Request) -> Request | None:
    """vLLM's default: the running request that arrived last and is not yet in this step.
    May return ``requester`` itself (it then preempts itself)."""
    for victim in reversed(step.running):
        if not step.is_scheduled(victim):
            return victim
    return None


def no_victim(step: StepBuilder, requester: Request) -> Request | None:
    """The picker of a policy whose requests hold their whole length from admission (static
    batching, TensorRT-LLM's guaranteed_no_evict): a next token that finds no block is a
    broken reservation, never a reason to preempt."""
    raise RuntimeError(f"request {requester.request_id} holds KV for its whole length, yet "
                       f"its next token found no block")


def victim_from_end(ordered: Sequence[Request]) -> VictimPicker:
    """A picker that takes the last request of ``ordered`` (most preemptible last) that is
    still running and not yet in this step. ``latest_arrival_victim`` is this over the
    arrival-ordered running set; priority and SJF pass the running set sorted by their key."""

    def pick(step: StepBuilder, requester: Request) -> Request | None:
        for victim in reversed(ordered):
            if victim.status is RequestStatus.RUNNING and not step.is_scheduled(victim):
                return victim
        return None

    return pick


def schedule_running(step: StepBuilder, budget: Budget,
                     pick_victim: VictimPicker = latest_arrival_victim,
                     order: Iterable[Request] | None = None,
                     max_chunk: int | None = None,
                     self_preemption_ends: bool = False) -> list[Request]:
    """Give every running request its next tokens (one for a decode; up to the budget, and
    up to ``max_chunk``, for a request mid-prefill), preempting victims when the pool runs
    dry. Returns those preempted. ``self_preemption_ends``: a request that preempts itself
    ends the loop, the requests after it getting nothing this step (vLLM v1: with a victim
    picker that may take any running request, some may still be running then; with one that
    takes the last not yet granted, none is).

    Iterates over a snapshot, since preemption removes requests from ``step.running``.
    """
    preempted: list[Request] = []
    order = step.running if order is None else order
    # The common case in one go: the whole decode run, one token each (sim/decode_run.py),
    # then any running request after it (a prompt mid-prefill, admitted last).
    if step.schedule_decode_run(order, budget.remaining_tokens):
        order = step.after_decode_run(order)
        if not order:
            return preempted
    for req in list(order):
        if req.status is not RequestStatus.RUNNING or step.is_scheduled(req):
            continue  # preempted earlier in this loop, or already granted
        n = chunk_size(req.num_pending_tokens, budget.remaining_tokens, max_chunk)
        if n <= 0:
            break
        while not step.schedule(req, n):
            victim = pick_victim(step, req)
            if victim is None:
                break
            step.preempt(victim)
            preempted.append(victim)
            if victim is req:
                if self_preemption_ends:
                    return preempted
                break
    return preempted


def admit(step: StepBuilder, budget: Budget, candidates: Iterable[Request], *,
          chunked: bool = False, strict_order: bool = True,
          max_partial: int | None = None, max_chunk: int | None = None,
          reserve_full: bool = False) -> list[Request]:
    """Admit waiting requests in the given order while tokens, seats and free blocks last.
    ``candidates``: ``step.waiting`` itself, a list, or a lazy iterator over the policy's own
    index, never a lazy view of ``step.waiting`` (admitting removes requests from it).

    Tokens, seats, chunks and order are ``admission_rule``'s (its options are the same);
    memory is decided here, request by request, as vLLM v0's ``can_allocate`` / ``allocate``,
    chunked or not: a request is admitted only if the blocks of its whole pending prefill fit
    above the watermark, and a request admitted with a partial chunk holds all of them from
    now on (``StepBuilder.reserve``), so its later chunks never need a block and can never
    run the pool dry halfway through. ``reserve_full`` admits a request only if the pool
    holds its whole length (prompt + maximum output; a prefill replica's: its prompt,
    ``StepBuilder.held_length``) and reserves it now (static batching);
    the watermark does not apply then, since a request that holds its whole length can never
    need another block.
    """
    if isinstance(candidates, ReadOnly):
        # A live queue shrinks as requests are admitted: iterate over a snapshot of the part
        # that can matter (strict FCFS never looks past the free seats).
        cap = budget.seats_left() if strict_order else len(candidates)
        candidates = list(islice(candidates, max(cap, 0)))

    def place(req: Request, n: int, pending: int) -> bool:
        if reserve_full:
            hold = step.held_length(req)
            fits = step.can_allocate(req, hold - req.num_computed_tokens)
        else:
            # The whole pending prefill, not this step's chunk (vLLM v0, Sarathi-Serve): a
            # request admitted on its first chunk's blocks would grow into a shortage and be
            # preempted mid-prefill, again and again.
            hold = pending if n < pending else 0  # beyond what it holds when scheduled
            need, wm = step.blocks_needed(req, pending), step.watermark_blocks
            fits = step.kv.can_allocate(need, wm)
            if not fits and need + wm > step.kv.num_gpu_blocks:
                # It could never fit above the watermark, even in an empty pool: a request
                # recomputed after it grew that long (vLLM v0 would drop it as ignored).
                # Waiting cannot help, so it is admitted as it always could be: this step's
                # blocks, without the watermark, taking the rest chunk by chunk.
                hold = 0
                fits = step.can_allocate(req, n)
        if not fits or not step.schedule(req, n):
            return False
        # Scheduling set what it holds already (its prefix-cache hit, if any).
        if hold and not reserve_full:
            hold += req.num_computed_tokens
        if hold and not step.reserve(req, hold):
            raise RuntimeError(f"request {req.request_id}: reservation failed after the check")
        return True

    # Pending tokens as the step sees them: less what the prefix cache holds.
    return [req for req, _ in admission_rule(
        candidates, step.pending_tokens, budget.remaining_tokens, budget.seats_left(),
        budget.max_num_batched_tokens, chunked=chunked, strict_order=strict_order,
        max_partial=max_partial, max_chunk=max_chunk, place=place,
        budget_now=budget.now)]


def resume_swapped(step: StepBuilder, budget: Budget, order: Iterable[Request] | None = None,
                   chunked: bool = False) -> list[Request]:
    """Swap requests back in (in ``order``, default: the order they were swapped out) and
    schedule their pending tokens this step, while seats, tokens and blocks last. A resumed
    request continues exactly where it stopped. With ``chunked`` a request mid-prefill may
    resume with a partial chunk. Returns the requests resumed."""
    resumed: list[Request] = []
    for req in list(step.swapped if order is None else order):
        n = req.num_pending_tokens
        # As in ``admit``: a request swapped out mid re-prefill may have more pending tokens
        # than a whole step holds; it resumes in chunks or it could never resume.
        if chunked or n > budget.max_num_batched_tokens:
            n = min(n, budget.remaining_tokens)
        if n <= 0 or budget.remaining_tokens < n or budget.seats_left() <= 0:
            break
        if not step.swap_in(req):
            break
        if not step.schedule(req, n):
            # swap_in checked room for the old blocks; a new block may still be missing.
            step.preempt(req)
            break
        resumed.append(req)
    return resumed


def preempt_for(step: StepBuilder, budget: Budget, req: Request,
                victims: Callable[[], Iterable[Request]]) -> list[Request]:
    """Preempt running requests so that waiting ``req`` can be admitted with its whole
    pending prefill: a free seat and enough blocks above the watermark. ``victims`` yields
    the requests the policy allows to be preempted for ``req``, most preemptible first (it is
    called only if ``req`` does not fit already). Preempts nobody unless the token budget
    already admits ``req`` and the victims offered free enough room; then preempts the
    fewest, in order. Returns those preempted."""
    n = step.pending_tokens(req)
    if n > budget.remaining_tokens:
        return []
    need = step.blocks_needed(req, n) + step.watermark_blocks - step.kv.num_free_blocks
    seats = 1 - budget.seats_left()
    if need <= 0 and seats <= 0:
        return []
    chosen: list[Request] = []
    for v in victims():
        if v is req or v.status is not RequestStatus.RUNNING or step.is_scheduled(v):
            continue
        chosen.append(v)
        need -= len(step.kv.block_table(v.request_id))
        seats -= 1
        if need <= 0 and seats <= 0:
            for victim in chosen:
                step.preempt(victim)
            return chosen
    return []
