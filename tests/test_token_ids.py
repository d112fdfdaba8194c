"""Prompt token ids from workloads (torch-free): seeded, shared prefixes give equal ids,
Mooncake hash ids give equal blocks, bad rows name file and line."""

from __future__ import annotations

import json

import pytest

from sim.errors import ConfigError
from sim.specs import load_model_spec
from workloads.base import make_workload

TINY = load_model_spec("tiny")


def synthetic(seed=0, **kw):
    cfg = {"name": "synthetic", "num_requests": 40, "qps": 5.0,
           "prompt_len": {"dist": "uniform", "min": 4, "max": 90},
           "output_len": {"dist": "fixed", "value": 3}, **kw}
    return list(make_workload(cfg, seed=seed, model=TINY))


def test_ids_are_off_by_default_and_leave_the_other_draws_unchanged():
    plain = synthetic()
    assert all(r.prompt_token_ids is None for r in plain)
    with_ids = synthetic(token_ids=True)
    assert [(r.arrival_time, r.prompt_len) for r in plain] == \
        [(r.arrival_time, r.prompt_len) for r in with_ids]
    for r in with_ids:
        assert len(r.prompt_token_ids) == r.prompt_len
        assert all(0 <= t < TINY.vocab_size for t in r.prompt_token_ids)


def test_ids_are_seeded_and_differ_between_requests():
    a, b = synthetic(token_ids=True), synthetic(token_ids=True)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    other = synthetic(seed=1, token_ids=True)
    assert a[0].prompt_token_ids != other[0].prompt_token_ids
    assert len({tuple(r.prompt_token_ids[:4]) for r in a}) == len(a)  # no shared prefixes


def test_the_executor_turns_ids_on():
    cfg = {"name": "synthetic", "num_requests": 3, "qps": 5.0,
           "prompt_len": {"dist": "fixed", "value": 5}, "output_len": {"dist": "fixed", "value": 2}}
    reqs = list(make_workload(cfg, seed=0, model=TINY, token_ids=True))
    assert all(len(r.prompt_token_ids) == 5 for r in reqs)
    with pytest.raises(ConfigError, match="vocabulary") as e:
        make_workload(cfg, seed=0, token_ids=True)
    assert e.value.field == "workload.token_ids"


def test_shared_prefixes_give_equal_ids_within_a_group():
    reqs = synthetic(token_ids=True, shared_prefix_len=16, num_prefix_groups=3)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt_token_ids[:min(4, r.prompt_len)]), []).append(r)
    assert len({k for k in groups if len(k) == 4}) == 3
    for members in groups.values():
        for r in members:
            n = min(16, r.prompt_len, members[0].prompt_len)
            assert r.prompt_token_ids[:n] == members[0].prompt_token_ids[:n]
    long = [r for r in reqs if r.prompt_len > 24]
    assert len({tuple(r.prompt_token_ids[16:24]) for r in long}) == len(long)  # own tokens
    with pytest.raises(ConfigError) as e:
        synthetic(token_ids=True, shared_prefix_len=4, num_prefix_groups=0)
    assert e.value.field == "workload.num_prefix_groups"


def _mooncake(tmp_path, rows):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_mooncake_hash_ids_give_shared_blocks_equal_ids(tmp_path):
    p = _mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    ])
    a, b, c = make_workload({"name": "trace", "path": str(p), "token_ids": True}, seed=0,
                            model=TINY)
    assert len(a.prompt_token_ids) == 700 and len(b.prompt_token_ids) == 1100
    assert a.prompt_token_ids == b.prompt_token_ids[:700]  # blocks 0 and 1 shared
    assert a.prompt_token_ids[:512] == c.prompt_token_ids[:512]  # block 0 shared
    assert a.prompt_token_ids[512:600] != c.prompt_token_ids[512:600]  # block 1 vs block 3
    plain = list(make_workload({"name": "trace", "path": str(p)}, seed=0, model=TINY))
    assert all(r.prompt_token_ids is None for r in plain)


def test_mooncake_rows_whose_hash_ids_do_not_cover_the_prompt_name_the_line(tmp_path):
    p = _mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]},
    ])
    with pytest.raises(ConfigError, match=r"t.jsonl:2: 2 hash_ids cannot cover input_length 1100"):
        make_workload({"name": "trace", "path": str(p)}, seed=0, model=TINY, token_ids=True)
    make_workload({"name": "trace", "path": str(p)}, seed=0, model=TINY)  # lengths only: fine


def test_azure_rows_get_seeded_ids(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,12,3\n1.5,30,4\n")
    cfg = {"name": "trace", "path": str(p), "token_ids": True}
    a = list(make_workload(cfg, seed=0, model=TINY))
    assert [len(r.prompt_token_ids) for r in a] == [12, 30]
    assert [r.prompt_token_ids for r in a] == \
        [r.prompt_token_ids for r in make_workload(cfg, seed=0, model=TINY)]
