"""The one request state machine shared by every policy and executor.

There is no prefill/decode phase flag. A request has ``num_tokens`` (prompt plus the tokens
generated so far) and ``num_computed_tokens`` (tokens whose KV is in the cache). Each step grants
it some number of new tokens; when the computed tokens catch up with ``num_tokens`` the step
samples one more token. Prefill, chunked prefill, decode and recompute all follow from that rule.
"""

from __future__ import annotations

import enum
from array import array
from typing import Protocol


class SharedClock(Protocol):
    """What a request reads of a decode run it belongs to (``sim/decode_run.py``): how many
    steps the run took and when. The run advances every member at once by counting steps."""

    steps: int

    def time_at(self, step: int) -> float: ...

    def times_since(self, step: int) -> array: ...


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED`` means the request is done (as in vLLM v1)."""

    WAITING = 0  # arrived, never scheduled
    RUNNING = 1  # holds GPU KV blocks and is in the running set
    PREEMPTED = 2  # preempted by recompute: KV freed, back in the waiting queue
    SWAPPED = 3  # preempted by swap: KV lives in the CPU pool
    FINISHED = 4
    REJECTED = 5
    ABORTED = 6  # its client gave up before it finished (online mode); blocks freed

    @property
    def is_done(self) -> bool:
        return self >= RequestStatus.FINISHED


# Legal transitions. Kept explicit so that a policy bug surfaces as an error, not a wrong number.
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {RequestStatus.RUNNING, RequestStatus.REJECTED, RequestStatus.ABORTED}
    ),
    RequestStatus.RUNNING: frozenset(
        {RequestStatus.PREEMPTED, RequestStatus.SWAPPED, RequestStatus.FINISHED,
         RequestStatus.ABORTED}
    ),
    RequestStatus.PREEMPTED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.REJECTED, RequestStatus.ABORTED}
    ),
    RequestStatus.SWAPPED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.ABORTED}
    ),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.REJECTED: frozenset(),
    RequestStatus.ABORTED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


def full_length(req: Request) -> int:
    """Tokens that ever need a KV slot: prompt + maximum output - 1 (the last sampled token
    is never fed back)."""
    return req.prompt_len + req.max_output_len - 1


class Request:
    """One inference request. Timestamps are simulated seconds (``None`` until they happen)."""

    __slots__ = (
        "request_id",
        "arrival_time",
        "prompt_len",
        "max_output_len",
        "priority",
        "prompt_token_ids",
        "output_token_ids",
        "status",
        "_computed",
        "_outputs",
        "first_scheduled_time",
        "_first_token",
        "_last_token",
        "finish_time",
        "_times",
        "_run",
        "_joined",
        "num_preemptions",
        "num_swaps",
        "num_recomputes",
        "reject_reason",
        "replica_id",
        "extra",
        "prefix",
        "output_key",
        "num_cached_tokens",
        "_block_keys",
    )

    def __init__(
        self,
        request_id: int,
        arrival_time: float,
        prompt_len: int,
        max_output_len: int,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        prefix: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        if prompt_len < 1:
            raise ValueError(f"request {request_id}: prompt_len must be >= 1, got {prompt_len}")
        if max_output_len < 1:
            raise ValueError(
                f"request {request_id}: max_output_len must be >= 1, got {max_output_len}"
            )
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_len:
            raise ValueError(
                f"request {request_id}: {len(prompt_token_ids)} prompt token ids "
                f"for prompt_len {prompt_len}"
            )
        self.request_id = request_id
        self.arrival_time = float(arrival_time)
        self.prompt_len = prompt_len
        self.max_output_len = max_output_len
        self.priority = priority
        self.prompt_token_ids = prompt_token_ids
        # Filled only by an executor that really samples (the real executor).
        self.output_token_ids: list[int] | None = None
        self.status = RequestStatus.WAITING
        # While the request is a member of a DecodeRun (sim/decode_run.py) its token counters
        # are stored relative to the run's step count and its token times are the run's, so a
        # decode jump advances every member at once; the properties below read through.
        self._run: SharedClock | None = None
        self._joined = 0  # the run step up to which ``_times`` holds this request's tokens
        self._computed = 0
        self._outputs = 0
        self.first_scheduled_time: float | None = None
        self._first_token: float | None = None
        self._last_token: float | None = None
        self.finish_time: float | None = None
        # One C double per emitted token (not a Python object per token): ITL and TPOT source.
        self._times = array("d")
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputes = 0
        self.reject_reason: str | None = None
        self.replica_id: int | None = None
        # Free slot for policies' per-request annotations (e.g. a predicted length).
        self.extra: dict | None = None
        # The part of the prompt other requests may share, as (content key, tokens) spans
        # (sim/prefix_cache.py), and how many prompt tokens the prefix cache supplied when
        # the request was last admitted.
        if prefix is not None and sum(n for _, n in prefix) > prompt_len:
            raise ValueError(f"request {request_id}: prefix spans cover "
                             f"{sum(n for _, n in prefix)} tokens of a {prompt_len}-token prompt")
        self.prefix = prefix
        # The content key of its answer when a later request's prompt repeats it (a turn
        # of a conversation): its blocks are registered as that span when it finishes.
        self.output_key: int | None = None
        self.num_cached_tokens = 0
        self._block_keys: tuple[int, list[int]] | None = None  # (block size, shared hashes)

    # ---- counters (read through a decode run; see sim/decode_run.py) ----------------------
    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache."""
        run = self._run
        return self._computed if run is None else self._computed + run.steps

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        run = self._run
        self._computed = value if run is None else value - run.steps

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        run = self._run
        return self._outputs if run is None else self._outputs + run.steps

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        run = self._run
        self._outputs = value if run is None else value - run.steps

    @property
    def first_token_time(self) -> float | None:
        first = self._first_token
        if first is None and self._run is not None and self._run.steps > self._joined:
            return self._run.time_at(self._joined)
        return first

    @first_token_time.setter
    def first_token_time(self, value: float | None) -> None:
        self._sync_times()
        self._first_token = value

    @property
    def last_token_time(self) -> float | None:
        run = self._run
        if run is not None and run.steps > self._joined:
            return run.time_at(run.steps - 1)
        return self._last_token

    @last_token_time.setter
    def last_token_time(self, value: float | None) -> None:
        self._sync_times()
        self._last_token = value

    @property
    def token_times(self) -> array:
        """One C double per sampled token (the time of the step that sampled it)."""
        self._sync_times()
        return self._times

    def _sync_times(self) -> None:
        """Copy the token times of the run steps taken since the last sync into ``_times``."""
        run = self._run
        if run is not None and run.steps > self._joined:
            times = run.times_since(self._joined)
            if self._first_token is None:
                self._first_token = times[0]
            self._last_token = times[-1]
            self._times.extend(times)
            self._joined = run.steps

    # ---- derived quantities -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what ``num_computed_tokens`` catches up with."""
        return self.prompt_len + self.num_output_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens that must be computed before this request can sample again. (A decode
        run's step count is in both counters or in neither: the stored ones suffice.)"""
        return self.prompt_len + self._outputs - self._computed

    @property
    def remaining_output_tokens(self) -> int:
        return self.max_output_len - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def transition(self, new: RequestStatus) -> None:
        if new not in _ALLOWED[self.status]:
            raise InvalidTransition(
                f"request {self.request_id}: {self.status.name} -> {new.name} is not allowed"
            )
        self.status = new

    # ---- events applied by the replica ----------------------------------------------------
    def record_token(self, now: float, token_id: int | None = None) -> None:
        """One sampled token at simulated time ``now``."""
        if self._run is not None:
            self._sync_times()
        self.num_output_tokens += 1
        if self._first_token is None:
            self._first_token = now
        self._last_token = now
        self._times.append(now)
        if token_id is not None:
            if self.output_token_ids is None:
                self.output_token_ids = []
            self.output_token_ids.append(token_id)

    def reject(self, reason: str) -> None:
        self.transition(RequestStatus.REJECTED)
        self.reject_reason = reason

    # ---- latency metrics (vLLM benchmark_serving definitions) ---------------------------
    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (output tokens - 1); undefined for one-token outputs."""
        if self.num_output_tokens < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id}, {self.status.name}, prompt={self.prompt_len}, "
            f"out={self.num_output_tokens}/{self.max_output_len}, "
            f"computed={self.num_computed_tokens})"
        )
