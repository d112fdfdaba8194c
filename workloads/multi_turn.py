"""Multi-turn conversations, in a closed loop.

Sessions start as a Poisson process. Each session has a number of turns; the prompt of turn k
is the system prompt, then every earlier turn's user message and answer, then turn k's own
user message, so a turn resends the whole history. Turn k + 1 is sent a think time after turn
k's answer finished (closed loop: a slow answer delays the rest of the conversation), not at
a time fixed in advance.

Everything is drawn up front from the seed (turn counts, message and answer lengths, think
times), so a run is reproducible and only the arrival times of later turns depend on the
simulation. The prefix cache sees each prompt as spans (``Request.prefix``): the system
prompt (one of ``num_system_prompts``, shared across sessions), then the user messages and
answers of the session, keyed per turn, so a turn's prompt shares everything but its last
message with the next turn's. A turn's answer is ``Request.output_key``'s span: the engine
registers its blocks when the turn finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from sim.config_types import MAX_TIME_S, as_float, as_int
from sim.errors import ConfigError, require
from sim.request import Request
from workloads.base import WORKLOADS, Workload
from workloads.distributions import LengthDistribution

# Content keys: system prompt g is key g; the user message and the answer of the turn with
# request id r are _TURN + 2r and _TURN + 2r + 1.
_TURN = 1 << 40
MAX_TURNS = 10**8  # turns one workload may draw (four arrays of this many numbers)


class MultiTurnWorkload(Workload):
    closed_loop = True

    def __init__(self, num_sessions: int, qps: float, turns: LengthDistribution,
                 user_len: LengthDistribution, output_len: LengthDistribution,
                 think_time_s: float, system_prompt_len: int, num_system_prompts: int,
                 max_prompt_len: int, seed: int) -> None:
        require(num_sessions >= 1, "workload.num_sessions", f"must be >= 1, got {num_sessions}")
        require(qps > 0, "workload.qps", f"must be > 0, got {qps}")
        require(think_time_s >= 0, "workload.think_time_s", f"must be >= 0, got {think_time_s}")
        require(system_prompt_len >= 0, "workload.system_prompt_len",
                f"must be >= 0, got {system_prompt_len}")
        require(num_system_prompts >= 1, "workload.num_system_prompts",
                f"must be >= 1, got {num_system_prompts}")
        # Every turn's lengths and think time are drawn up front: bound their arrays.
        require(num_sessions * turns.max <= MAX_TURNS, "workload.num_sessions",
                f"{num_sessions} sessions of up to {turns.max} turns (workload.turns.max) "
                f"could draw more than {MAX_TURNS} turns")
        # The last session starts about num_sessions / qps seconds in; its turns follow.
        starts, thinking = num_sessions / qps, turns.max * think_time_s
        span = starts + thinking
        require(span <= MAX_TIME_S, "workload.qps" if starts >= thinking else
                "workload.think_time_s", (
                    f"{num_sessions} sessions at {qps} per second of up to {turns.max} turns "
                    f"{think_time_s} s apart span about {span:.3g} s, beyond {MAX_TIME_S:g} s "
                    f"of simulated time (float times there cannot carry microsecond "
                    f"latencies)"))
        # Every first turn fits, so every session sends at least one request.
        require(system_prompt_len + user_len.max <= max_prompt_len, "workload.max_prompt_len",
                f"{max_prompt_len} is below a first turn's longest prompt (system_prompt_len "
                f"{system_prompt_len} + user_len.max {user_len.max})")
        rng = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6)]
        self.starts = np.cumsum(rng[0].exponential(1.0 / qps, num_sessions))
        self.starts -= self.starts[0]
        self.turns = turns.sample(rng[1], num_sessions)
        total = int(self.turns.sum())
        self.user_lens = user_len.sample(rng[2], total)
        self.output_lens = output_len.sample(rng[3], total)
        self.think = rng[4].exponential(think_time_s, total) if think_time_s else np.zeros(total)
        self.system = rng[5].integers(num_system_prompts, size=num_sessions)
        self.system_prompt_len = system_prompt_len
        self.cap = max_prompt_len
        # Request ids: session by session, turn by turn.
        self.first_id = np.concatenate([[0], np.cumsum(self.turns)[:-1]]).astype(np.int64)
        self._session_of = np.repeat(np.arange(num_sessions), self.turns)
        self._n = total

    @property
    def num_requests(self) -> int:
        return self._n

    @property
    def max_prompt_len(self) -> int:
        return self.cap

    def __iter__(self) -> Iterator[Request]:
        for s in range(len(self.starts)):  # each session's first turn, at its start
            req = self._turn(int(self.first_id[s]), float(self.starts[s]))
            assert req is not None  # first turns fit max_prompt_len (checked above)
            yield req

    def follow_up(self, req: Request) -> Request | None:
        if req.finish_time is None or req.reject_reason is not None:
            return None  # a rejected turn ends its conversation
        rid = int(req.request_id)
        s = int(self._session_of[rid])
        if rid + 1 >= self.first_id[s] + self.turns[s]:
            return None
        return self._turn(rid + 1, req.finish_time + float(self.think[rid]))

    def _turn(self, rid: int, at: float) -> Request | None:
        s = int(self._session_of[rid])
        spans: list[tuple[int, int]] = []
        if self.system_prompt_len:
            spans.append((int(self.system[s]), self.system_prompt_len))
        for j in range(int(self.first_id[s]), rid):
            spans.append((_TURN + 2 * j, int(self.user_lens[j])))
            spans.append((_TURN + 2 * j + 1, int(self.output_lens[j])))
        spans.append((_TURN + 2 * rid, int(self.user_lens[rid])))
        prompt = sum(n for _, n in spans)
        if prompt > self.cap:  # the conversation outgrew the context: it ends here
            return None
        req = Request(rid, at, prompt, int(self.output_lens[rid]), prefix=tuple(spans))
        req.output_key = _TURN + 2 * rid + 1
        return req

    def describe(self) -> str:
        return (f"multi-turn: {len(self.starts)} sessions, {self._n} turns at most, "
                f"{self.system_prompt_len}-token system prompts")


@WORKLOADS.register("multi_turn")
def build_multi_turn(cfg: dict[str, Any], seed: int, **_: Any) -> MultiTurnWorkload:
    known = {"num_sessions", "qps", "turns", "user_len", "output_len", "think_time_s",
             "system_prompt_len", "num_system_prompts", "max_prompt_len"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"workload.{unknown[0]}", "unknown option for a multi_turn workload; "
                          f"known: {', '.join(sorted(known))}")
    for f in ("num_sessions", "qps", "turns", "user_len", "output_len"):
        if cfg.get(f) is None:
            raise ConfigError(f"workload.{f}", "required for a multi_turn workload")
    return MultiTurnWorkload(
        num_sessions=as_int(cfg["num_sessions"], "workload.num_sessions"),
        qps=as_float(cfg["qps"], "workload.qps"),
        turns=LengthDistribution.from_dict("workload.turns", cfg["turns"]),
        user_len=LengthDistribution.from_dict("workload.user_len", cfg["user_len"]),
        output_len=LengthDistribution.from_dict("workload.output_len", cfg["output_len"]),
        think_time_s=as_float(cfg.get("think_time_s", 0.0), "workload.think_time_s"),
        system_prompt_len=as_int(cfg.get("system_prompt_len", 0), "workload.system_prompt_len"),
        num_system_prompts=as_int(cfg.get("num_system_prompts", 1),
                                  "workload.num_system_prompts"),
        max_prompt_len=as_int(cfg.get("max_prompt_len", 8192), "workload.max_prompt_len"),
        seed=seed)
