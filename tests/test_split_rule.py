"""Decode attention's split-KV rules: FlashAttention's heuristic (``flash``) and ``fill``."""

import json
from dataclasses import replace

import numpy as np
import pytest

from executors.calibration import ShapeSpec, calibrate, load_profile, save_profile
from executors.cost_model import CostModelConfig, RooflineCostModel, build_cost_model
from executors.step_terms import StepDecomposer, busiest_sm_blocks, flash_num_splits
from sim.errors import ConfigError
from sim.plan import ScheduledRequest, StepPlan
from sim.specs import ModelSpec, load_hardware_spec, load_model_spec

# Per-GPU geometry of Vidur's A100 attention profile: Llama-2-70B at TP 2 (4 KV heads).
L70 = ModelSpec(name="70B-layer", num_layers=1, hidden_size=8192, num_heads=64, num_kv_heads=8,
                head_dim=128, intermediate_size=28672, vocab_size=32000, max_model_len=4096)


def _flash(kv_len: int | None = 4096, model: ModelSpec = L70, tp: int = 2) -> StepDecomposer:
    return StepDecomposer(model, tp, 16, 108, 2, split_rule="flash", split_kv_len=kv_len)


def test_flash_heuristic_split_counts():
    # 4 KV heads per GPU, 108 SMs, 4096-token tables (32 tiles of 128 keys).
    assert [flash_num_splits(4 * b, 108, 32) for b in range(1, 22)] == [
        16, 11, 7, 6, 5, 4, 7, 3, 3, 5, 2, 2, 2, 5, 5, 3, 3, 3, 4, 4, 5]
    assert flash_num_splits(88, 108, 32) == 1  # 88 >= 0.8 x 108: no split
    assert flash_num_splits(84, 108, 32) == 5
    assert flash_num_splits(4, 108, 1) == 1  # one KV tile: nothing to split
    assert flash_num_splits(4, 108, 3) == 3  # bounded by the tiles
    # 64 tiles: 11 and 12 splits both give 6 tiles per split, so 12 is not eligible.
    assert flash_num_splits(1, 200, 64) == 64


def test_21_sequences_split_and_22_do_not_at_32_tokens():
    dec = _flash()
    g21 = dec.decode_wave_geometry(21, 33)
    g22 = dec.decode_wave_geometry(22, 33)
    assert (g21.splits, g22.splits) == (5, 1)
    # 33 keys are one tile: split 0 reads it, the other four splits exit at once.
    assert (g21.ctas, g21.cta_tiles, g21.full, g21.rem) == (84, 1, 0, 84)
    assert (g22.ctas, g22.cta_tiles, g22.full, g22.rem) == (88, 0, 0, 88)
    d21 = dec.drivers(ShapeSpec("decode", num_decode_seqs=21, decode_context=32).shape())
    d22 = dec.drivers(ShapeSpec("decode", num_decode_seqs=22, decode_context=32).shape())
    kv_bytes = 2 * 128 * 2  # K and V of one head, per key
    assert d21.decode_kernels == 2 and d22.decode_kernels == 1  # the combine kernel
    # The streaming bounds read the exact 33 keys; the tile chain prices the whole tile.
    assert d21.decode_cta_bytes == d22.decode_cta_bytes == kv_bytes * 33
    # 84 units x 5 splits in launch order: blocks past the first 216 take the slots empty
    # splits free, so two working blocks meet on one SM (blocks / SMs says one).
    assert dec.decode_wave_geometry(21, 33).tail_sm == 2 and d22.decode_chain_tiles == 1.0
    assert d21.decode_chain_tiles == 2.0
    waves = StepDecomposer(L70, 2, 16, 108, 2, split_rule="flash", split_kv_len=4096,
                           decode_placement="waves")  # the geometry of older profiles
    d21 = waves.drivers(ShapeSpec("decode", num_decode_seqs=21, decode_context=32).shape())
    assert d21.decode_cta_bytes == kv_bytes * 128  # one whole tile


def test_flash_split_pieces_read_whole_tiles_of_the_longest_context():
    dec = _flash()
    # 8 sequences (32 units): 3 splits of ceil(32 / 3) = 11 tiles; 1025 keys are 9 tiles,
    # all in split 0; 4033 keys are 32 tiles: 11 + 11 + 10.
    g = dec.decode_wave_geometry(8, 1025)
    assert (g.splits, g.ctas, g.cta_tiles) == (3, 32, 9)
    g = dec.decode_wave_geometry(8, 4033)
    assert (g.splits, g.ctas, g.cta_tiles) == (3, 96, 11)
    # Tables as wide as the context (kv_len None): 1025 keys in 65 blocks = 1040 -> 9 tiles.
    eager = _flash(None)
    g = eager.decode_wave_geometry(8, 1025)
    assert (g.splits, g.cta_tiles) == (flash_num_splits(32, 108, 9), 3)
    assert eager.decode_geometry_key(8, 1025) == (9, 9)
    assert eager.decode_geometry_key(22, 1025) is None  # no split at 88 units


def test_launch_order_placement_of_split_blocks():
    # 13 sequences (52 units) in 2 splits: 104 blocks, one wave, working blocks 0, 2, ..., 102
    # on distinct SMs. 14 (56 units) in 5 splits: 280 blocks; past the first 216 they take the
    # slots that empty splits free, and a split 0 lands next to another: 2 per SM (the
    # profile: at 512 cached tokens 13 sequences take 24 us, 14 take 35).
    assert busiest_sm_blocks(52, 2, 1, 108, 2) == 1
    assert busiest_sm_blocks(56, 5, 1, 108, 2) == 2
    assert busiest_sm_blocks(4, 16, 16, 108, 2) == 1  # 64 working blocks, one per SM
    dec = _flash()
    g = dec.decode_wave_geometry(14, 513)
    assert (g.splits, g.full, g.rem, g.tail_sm) == (5, 0, 56, 2)
    # A tail after full waves runs one block per SM (55 sequences: 220 blocks, 216 + 4).
    g = dec.decode_wave_geometry(55, 1000)
    assert (g.full, g.rem, g.tail_sm) == (1, 4, 1)
    g = dec.decode_wave_geometry(82, 1000)  # 328 blocks: 216 + 112, still one per SM
    assert (g.full, g.rem, g.tail_sm) == (1, 112, 1)
    waves = StepDecomposer(L70, 2, 16, 108, 2, split_rule="flash", split_kv_len=4096,
                           decode_placement="waves")
    assert waves.decode_wave_geometry(82, 1000).tail_sm == 2
    with pytest.raises(ConfigError, match="executor.attention_decode_placement"):
        CostModelConfig(attention_decode_placement="grid")


def test_fill_rule_is_the_generic_rule():
    dec = StepDecomposer(L70, 2, 16, 108, 2, split_rule="fill")
    g = dec.decode_wave_geometry(21, 33)
    assert (g.splits, g.ctas) == (216 // 84, 84 * 2)
    assert dec.decode_cta_keys(g, 33) == 33 / 2  # an exact share, no tiles


def test_split_partials_and_tile_chain_drivers():
    """16 sequences x 4 KV heads = 64 units, split 3 ways over a 4096-token table: 192
    partials per layer; at 300 cached tokens (301 keys, 3 tiles, all in split 0) the 64
    working blocks are every third of 192 launched round-robin over 108 SMs, so blocks 0 and
    108 (split 0 of units 0 and 36) share SM 0: 2 x 3 tiles along it. 55 sequences
    (220 blocks, no split) at 1000 tokens: one full wave (2 blocks per SM) and a 4-block tail
    (1 per SM) of 8-tile blocks: 3 x 8 tiles along the busiest SM."""
    dec = _flash()
    d = dec.drivers(ShapeSpec("decode", num_decode_seqs=16, decode_context=300).shape())
    assert (d.decode_partials, d.decode_chain_tiles) == (16 * 4 * 3, 2 * 3.0)
    d = dec.drivers(ShapeSpec("decode", num_decode_seqs=55, decode_context=1000).shape())
    assert (d.decode_partials, d.decode_chain_tiles) == (0.0, 3 * 8.0)
    fill = StepDecomposer(L70, 2, 16, 108, 2, split_rule="fill")  # no tiles: no tile chain
    d = fill.drivers(ShapeSpec("decode", num_decode_seqs=16, decode_context=300).shape())
    assert d.decode_chain_tiles == 0.0 and d.decode_partials == 16 * 4 * (216 // 64)


@pytest.mark.parametrize("kv_len", [None, 4096])
@pytest.mark.parametrize("nd,ctx0", [(1, 120), (5, 250), (10, 380), (21, 1020), (40, 120)])
def test_decode_jump_equals_per_step_pricing_across_tile_boundaries(kv_len, nd, ctx0):
    cfg = CostModelConfig(attention_split_rule="flash", attention_split_kv_len=kv_len)
    for model, hw, tp in ((load_model_spec("llama3_8b"), "a100_80gb", 1), (L70, "a100_80gb", 2)):
        cm = RooflineCostModel(model, load_hardware_spec(hw), tp, cfg)
        # Price the split partials and the per-tile latency too (the roofline leaves them 0).
        cm.coefficients = replace(cm.roofline, s_per_split_partial=2e-8, s_per_kv_tile=1e-6)
        ctx = [ctx0 + 3 * i for i in range(nd)]
        plan = StepPlan([ScheduledRequest(i, c, 1, [], True) for i, c in enumerate(ctx)])
        got = cm.decode_durations(plan, 300)  # crosses at least two 128-key tile boundaries
        splits = set()
        for j in range(300):
            step = StepPlan([ScheduledRequest(i, c + j, 1, [], True) for i, c in enumerate(ctx)])
            want = cm.breakdown(step).total
            assert got[j] == pytest.approx(want, rel=1e-13), (j, got[j], want)
            assert cm.execute(step).duration == want
            splits.add(cm.decomposer.decode_wave_geometry(nd, max(ctx) + j + 1).splits)
        if kv_len is None and model is L70 and nd == 1:
            assert len(splits) > 1  # the split count changed inside the jump


def test_mixed_step_jump_across_a_split_change():
    cfg = CostModelConfig(attention_split_rule="flash")
    cm = RooflineCostModel(load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb"), 1, cfg)
    rows = [ScheduledRequest(0, 0, 40, [], False)]  # a prefill chunk next to the decodes
    rows += [ScheduledRequest(1 + i, 200 + i, 1, [], True) for i in range(3)]
    got = cm.decode_durations(StepPlan(rows), 200)
    for j in (0, 54, 55, 56, 183, 199):
        step = [rows[0]] + [ScheduledRequest(1 + i, 200 + i + j, 1, [], True) for i in range(3)]
        assert got[j] == pytest.approx(cm.breakdown(StepPlan(step)).total, rel=1e-13)


def test_split_rule_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="executor.attention_split_rule"):
        CostModelConfig(attention_split_rule="flashinfer")
    with pytest.raises(ConfigError, match="executor.attention_split_kv_len"):
        CostModelConfig(attention_split_kv_len=0)


@pytest.mark.slow
def test_profiles_record_the_split_rule_and_old_ones_load_as_fill(tmp_path):
    model = load_model_spec("tiny")
    rows = []
    for b in (1, 2, 4, 8):
        for c in (32, 200, 700):
            spec = ShapeSpec("decode", num_decode_seqs=b, decode_context=c)
            rows.append({**spec.as_row(), "median_s": 1e-4 * (1 + b * c / 500), "device": "x"})
    prof = calibrate(rows, model, num_sms=108, split_rule="flash", split_kv_len=1024)
    assert prof.fit["attention_split_rule"] == "flash"
    path = save_profile(prof, tmp_path / "p.json")
    cm = build_cost_model(model, load_hardware_spec("a100_80gb"), 1, {"profile": str(path)})
    assert (cm.decomposer.split_rule, cm.decomposer.split_kv_len) == ("flash", 1024)
    assert cm.decomposer.decode_placement == "launch" == prof.fit["attention_decode_placement"]
    # A flash profile saved before launch-order placement loads with the old geometry and
    # prices as it was fitted.
    data = json.loads(path.read_text())
    del data["fit"]["attention_decode_placement"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    cm = build_cost_model(model, load_hardware_spec("a100_80gb"), 1, {"profile": str(older)})
    assert cm.decomposer.decode_placement == "waves"
    ref = StepDecomposer(model, 1, 16, 108, 2, split_rule="flash", split_kv_len=1024,
                         decode_placement="waves")
    shape = ShapeSpec("decode", num_decode_seqs=82, decode_context=700).shape()
    assert cm.breakdown_shape(shape).total == prof.coefficients.breakdown(ref.drivers(shape)).total
    # A profile saved before the rule existed: fitted with the generic rule, loads with it.
    data = json.loads(path.read_text())
    for k in ("attention_split_rule", "attention_split_kv_len"):
        del data["fit"][k]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_profile(old).fit.get("attention_split_rule") is None
    cm = build_cost_model(model, load_hardware_spec("a100_80gb"), 1,
                          {"profile": str(old), "attention_split_rule": "flash"})
    assert (cm.decomposer.split_rule, cm.decomposer.split_kv_len) == ("fill", None)
    with pytest.raises(ConfigError, match="split_rule"):
        calibrate(rows, model, num_sms=108, split_rule="nope")


@pytest.mark.parametrize("rule", ["flash", "fill"])
def test_batch1_decode_stays_near_the_weight_read_floor(rule):
    """The batch-1 decode floor (tests/test_memory_and_cost_model.py, 512 tokens) under either rule."""
    m, hw = load_model_spec("llama3_8b"), load_hardware_spec("a100_80gb")
    cm = RooflineCostModel(m, hw, 1, CostModelConfig(attention_split_rule=rule))
    floor = m.weight_bytes() / (hw.memory_bandwidth_gbps * 1e9)
    for ctx in (128, 512, 1000):
        t = cm.execute(StepPlan([ScheduledRequest(0, ctx, 1, [], True)])).duration
        assert floor < t < 1.15 * floor, (ctx, t / floor)


def test_profiles_without_the_partial_and_tile_coefficients_load_at_zero(tmp_path):
    """Profiles saved before s_per_split_partial / s_per_kv_tile existed price as before."""
    old = tmp_path / "old.yaml"
    old.write_text("model: m\ndevice: d\ntensor_parallel: 1\n"
                   "coefficients: {s_per_seq: 1.0e-6, s_per_attn_kernel: 5.0e-6}\n")
    c = load_profile(old).coefficients
    assert (c.s_per_split_partial, c.s_per_kv_tile, c.s_per_attn_kernel) == (0.0, 0.0, 5e-6)
