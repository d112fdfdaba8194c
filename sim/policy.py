"""The policy interface the engine drives: one decision method over a read-only view of a
replica. It lives in ``sim/`` because the replica calls it; the policies themselves live in
``policies/`` and register there (``policies.base.POLICIES``).

A policy only decides. It reads ``step.waiting``, ``step.running``, ``step.swapped`` and
``step.kv`` (read-only views; ``step.kv`` is a ``KVView``, not the manager) and acts through
``step.schedule / reserve / preempt / swap_in`` (see ``sim/step_builder.py``), then returns
``step.build()``. It never changes request state directly.

Optional hooks: ``on_arrival(req)`` is called by the replica once per accepted request,
after it joined the waiting queue (a policy keeps its own ordered index there, e.g. a heap, so
it never sorts the whole queue per step); ``on_handoff`` / ``on_transferred`` when a request
leaves a prefill replica / joins a decode replica (disaggregation); ``seed`` is the run's
seed, for policies that draw random numbers (one ``numpy.random.Generator`` per policy,
derived from it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from sim.config_types import typed_fields
from sim.errors import ConfigError, require, require_known_fields
from sim.plan import StepPlan
from sim.request import Request
from sim.step_builder import PreemptionMode, StepBuilder


@dataclass(frozen=True)
class PolicyConfig:
    """Limits every policy shares (vLLM's names). Policies subclass this for their own knobs."""

    name: str = "fcfs"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    kv_watermark: float = 0.01  # fraction of blocks kept free when admitting (vLLM v0)
    # Rules of an engine's scheduler that a setting cannot change, each stated (when set) by
    # why, as the error says it: the setting that would break it is refused, not ignored.
    #: Its scheduler always chunks prefills (``enable_chunked_prefill`` must be true).
    always_chunks: ClassVar[str | None] = None
    #: It preempts by recompute only (``preemption_mode`` must be recompute).
    recompute_only: ClassVar[str | None] = None
    #: It admits without a watermark of free blocks (``kv_watermark`` must be 0).
    no_watermark: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if self.always_chunks is not None:
            require(self.enable_chunked_prefill, "policy.enable_chunked_prefill",
                    f"{self.always_chunks}: must be true for the {self.name} policy")
        if self.recompute_only is not None:
            require(self.preemption_mode == "recompute", "policy.preemption_mode",
                    f"{self.recompute_only}: must be recompute, got {self.preemption_mode!r}")
        if self.no_watermark is not None:
            require(self.kv_watermark == 0.0, "policy.kv_watermark",
                    f"{self.no_watermark}: must be 0, got {self.kv_watermark}")
        require(self.max_num_seqs >= 1, "policy.max_num_seqs",
                f"must be >= 1, got {self.max_num_seqs}")
        require(self.max_num_batched_tokens >= 1, "policy.max_num_batched_tokens",
                f"must be >= 1, got {self.max_num_batched_tokens}")
        modes = [m.value for m in PreemptionMode]
        require(self.preemption_mode in modes, "policy.preemption_mode",
                f"must be one of {modes}, got {self.preemption_mode!r}")
        require(0 <= self.kv_watermark < 1, "policy.kv_watermark",
                f"must be in [0, 1), got {self.kv_watermark}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyConfig:
        require_known_fields(data, cls, "policy", f"option for policy {data.get('name')!r}")
        return cls(**typed_fields(cls, data, "policy"))


class Policy(ABC):
    """Base class. Subclasses set ``config_class`` and register with
    ``@POLICIES.register`` (``policies/base.py``)."""

    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig
    #: Whether its engine caches prefixes by default (``kv.enable_prefix_caching: null``).
    prefix_caching_default: ClassVar[bool] = False
    #: Whether its engine runs the host's work (scheduling, input preparation, output
    #: processing) while the GPU runs a step, by default (``executor.host_overlap: null``):
    #: vLLM v1's asynchronous scheduling and SGLang's overlap scheduler do; vLLM v0 without
    #: asynchronous output processing does not.
    host_overlap_default: ClassVar[bool] = False

    @classmethod
    def engine_defaults(cls, hardware: Any) -> dict[str, Any]:
        """Values for the limits its config leaves null, on this hardware (a
        ``sim.specs.HardwareSpec``): engines whose defaults depend on the GPU."""
        return {}
    # The two fast-path flags below are read from a class's own body only: a subclass that
    # overrides hooks must restate them (after tests/test_fast_forward.py and, for the array
    # core, tests/test_array_core.py pass for it), or its runs take the per-step loop, which
    # is exact for any policy (``__init_subclass__`` resets them).
    #: The policy's one statement about its decisions (sim/fast_forward.py): a decode-only
    #: step (every row computes its one pending token; nothing admitted, preempted or swapped)
    #: is planned again, one more token each, until a request arrives or finishes, the KV pool
    #: cannot hold the next step's blocks, or ``next_decision_time`` comes; and while nothing
    #: waits or is swapped out, a finish changes it only by the finished request leaving
    #: (nobody can take its seat or blocks). The order of its rows is arrival order, or
    #: ``decode_run_key`` as far as ``decode_order_steps`` keeps it. On a pipelined replica
    #: the step is a micro-batch of every running request not in flight, planned again when
    #: they are free again (sim/cluster/pipeline.py). The replica may then take many such
    #: steps without asking, through finishes, and tells the policy how many it took
    #: without asking at its next plan (``StepBuilder.repeated_steps``: state that moves
    #: with every planned step catches up there). Policies state it after the fast-vs-exact
    #: tests pass for them.
    supports_decode_jumps: ClassVar[bool] = False
    #: True if every request this policy runs holds KV for its whole length (prompt + maximum
    #: output) from admission on: a decode replica then reserves that much for a transfer, and
    #: the array core counts whole lengths (passing them to ``chunk_plan`` as ``lengths``
    #: where the pool can bind).
    reserves_full_length: ClassVar[bool] = False
    #: True if the policy implements chunked prefill's step structure (decodes first, then
    #: prefill chunks in the same step), which ``policy.enable_chunked_prefill=true`` asks for.
    implements_chunked_prefill: ClassVar[bool] = False
    #: Under chunked prefill: True if a request admitted with a partial chunk holds its whole
    #: prompt's blocks from admission on (vLLM v0, ``StepBuilder.reserve``); False if it holds
    #: the blocks of the tokens computed so far only, taking more chunk by chunk (vLLM v1).
    #: The array core counts a prompt's blocks by it.
    holds_whole_prompt: ClassVar[bool] = True
    #: True if the policy also decides without a StepBuilder, so that a fast run may use
    #: the array core (sim/array_core.py) instead of the replica loop: chunked prefill's
    #: ``chunk_plan`` (or ``prefill_plan`` for prefill batches apart from decode batches,
    #: SGLang's) and FCFS's ``head_admissions`` on plain numbers
    #: (the core keeps the queue in arrival order), or ``indexed_admissions`` for a policy
    #: that keeps its own waiting order (the core hands it each arrival as a ``Request``
    #: through ``on_arrival``, and finishes the requests that leave in the same step in
    #: ``decode_run_key`` order). On a pool that can bind the rule gets ``room`` and admits
    #: only what fits; a policy that also states its decode-step preemptions on counts
    #: (``decode_preemptions``; with ``prefill_plan``, ``decode_retractions``) is preempted
    #: there as it would be, and one that does not runs there until a running request finds
    #: no block (then the replica loop takes the run from the start: sim/array_inputs.py
    #: ``runs_guarded``).
    #: Policies opt in after the array-core-vs-exact tests.
    array_core: ClassVar[bool] = False
    #: Under chunked prefill: True if every step grants each decoding request not in flight
    #: its token before any prompt chunk, whatever the running order (vLLM v0: the decodes
    #: first, then the prompts mid-prefill, then admissions). With pipeline stages the
    #: array core then plans its micro-batches on plain numbers (sim/array_pipeline.py):
    #: ``chunk_plan`` gets the prompts in flight that stay mid-prefill once their chunk
    #: lands (``in_flight_partials``, where there are any). Not for a policy whose running
    #: order may put a chunk before a decode (vLLM v1: a prompt admitted before a request
    #: that now decodes). A property where a setting decides it (TensorRT-LLM's: only
    #: without chunked prefill, where no prompt is ever left mid-prefill).
    grants_decodes_first: ClassVar[bool] = False
    #: Under chunked prefill: True if every step grants the running requests not in flight
    #: in arrival order, each its pending tokens up to what the budget has left, before it
    #: admits anyone (vLLM v1, TensorRT-LLM). With pipeline stages the array core then plans
    #: its micro-batches on plain numbers while that is every decode first (no prompt
    #: mid-prefill not in flight arrived before a request that decodes), and gives the run
    #: up where it is not (``waiting_by_priority`` says where else that can happen).
    grants_in_arrival_order: ClassVar[bool] = False

    FAST_PATH_FLAGS: ClassVar[tuple[str, ...]] = ("supports_decode_jumps", "array_core",
                                                  "grants_decodes_first",
                                                  "grants_in_arrival_order")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for flag in Policy.FAST_PATH_FLAGS:
            if flag not in cls.__dict__:  # what the parent certified, its hooks may break
                setattr(cls, flag, False)
        # The array core asks the policy without a StepBuilder, by its step structure.
        rules = (("chunk_plan", "prefill_plan") if cls.implements_chunked_prefill
                 else ("head_admissions", "indexed_admissions"))
        if cls.array_core and not any(callable(getattr(cls, r, None)) for r in rules):
            raise TypeError(f"{cls.__name__}: array_core = True needs a "
                            f"{' or '.join(rules)} method (sim/array_core.py)")

    def __init__(self, config: PolicyConfig, seed: int = 0) -> None:
        # vLLM v0's flag switches the whole scheduler to decode-first chunking; a policy with
        # prefill-only steps that merely cut prompts into chunks would stall every decode
        # behind a queue of half-done prompts, so the flag is refused rather than half-done.
        if config.enable_chunked_prefill and not self.implements_chunked_prefill:
            raise ConfigError("policy.enable_chunked_prefill", (
                f"policy {config.name!r} does not implement chunked prefill (decodes first, "
                f"then prompt chunks in the same step); use policy=chunked_prefill"))
        self.config = config
        self.seed = seed

    def array_core_refusal(self) -> str | None:
        """Why this instance's settings keep a run off the array core though its class states
        ``array_core`` (a setting its rules on plain numbers do not cover), or None."""
        return None

    def waiting_by_priority(self) -> bool:
        """Under chunked prefill: whether the waiting queue is in (priority, arrival time,
        request id) order (vLLM's priority scheduling) rather than arrival order. The array
        core then keeps its queue in that order, runs the policy only while its
        arrival-order grants (``grants_in_arrival_order``) are those of every decode first,
        and, on a pool that can bind, only where the policy names its victims on counts
        (``decode_victims``, vLLM v1's). Default: no."""
        return False

    def next_decision_time(self, now: float) -> float:
        """The earliest simulated time after ``now`` at which this policy could plan a
        different step although nothing arrived, finished or changed in the KV pool: a
        deadline of its own (SJF's aging). Decode jumps stop at the first step that ends at
        or after it, as at an arrival. Default: none (infinity)."""
        return math.inf

    def decode_run_key(self) -> Callable[[Request], Any] | None:
        """The key of the order in which this policy gives the running requests their decode
        tokens, when that is not arrival order (None): a fast-mode replica keeps its decode
        run (``sim/decode_run.py``) in this order, so the run can be granted as one block
        when the policy passes ``schedule_running`` a ``list`` of every running request in
        that order (anything else goes row by row: the same results, slower)."""
        return None

    def decode_order_steps(self, running: Sequence[Request], limit: int,
                           last_steps: Sequence[int] | np.ndarray | None = None) -> int:
        """How many decode-only steps, counting the one being planned, give ``running`` (its
        rows, in the order this policy gives them tokens) their tokens in that same order if
        nothing else happens; at most ``limit``. ``last_steps``: the step in which each of
        them samples its last token and leaves (None: none leaves before ``limit``). A
        decode jump allocates every step's new KV blocks, and finishes the members of a step,
        in its first step's row order, so it stops where the order would change. Default:
        the order does not depend on the requests' progress (arrival or priority order), so
        ``limit``."""
        return limit

    def may_preempt_to_admit(self, priorities: Sequence[int]) -> bool:
        """Whether admitting a waiting request could preempt a running one to take its seat
        or blocks (a preemptive ordering), on a workload whose requests have these
        ``priorities``. The array core, which preempts only when a decode step's blocks do
        not fit, runs only where it cannot. Default: no."""
        return False

    def on_arrival(self, req: Request) -> None:
        """A request was accepted and appended to the waiting queue (called by the replica's
        ``add_request``, never for rejected requests). Default: nothing."""

    def on_handoff(self, req: Request) -> None:
        """Prefill side: ``req`` sampled its first token and left this replica for a decode
        replica (it may become PREEMPTED there: it must leave this policy's indexes)."""

    def on_abort(self, req: Request) -> None:
        """``req`` left this replica unfinished: its client gave up (online mode). It must
        leave this policy's indexes, as a request handed off does (the default)."""
        self.on_handoff(req)

    def on_transferred(self, req: Request) -> None:
        """Decode side: ``req`` arrived with its KV and joined the running set (RUNNING, its
        first token already sampled): its arrival to this replica. Default: nothing."""

    @abstractmethod
    def schedule(self, step: StepBuilder) -> StepPlan:
        """Decide the next step and return ``step.build()``."""
