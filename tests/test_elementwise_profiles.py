"""Element-wise kernels against Vidur's measured operators (../shared/profiles/vidur): the
sum of ``input_layernorm``, ``attn_rope``, ``post_attention_layernorm``, ``mlp_act`` and ``add``
per layer, against the cost model's ``elementwise`` term for the same tokens (docs/calibration.md,
"Element-wise kernels"). Skipped without the profiles."""

from __future__ import annotations

import numpy as np
import pytest

from executors.calibration import ShapeSpec
from executors.cost_model import CostModelConfig, RooflineCostModel
from experiments.check_profiles import _geometry, _read
from sim.specs import load_hardware_spec
from tests.helpers import SHARED

ROOT = SHARED / "profiles" / "vidur"
EW_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
FILES = (("Llama-2-7B", "compute/a100_Llama-2-7b-hf_mlp.csv", "a100_80gb"),
         ("Llama-2-7B", "compute/h100_Llama-2-7b-hf_mlp.csv", "h100_sxm"),
         ("Llama-3-8B", "compute/a100_Meta-Llama-3-8B_mlp.csv", "a100_80gb"),
         ("Llama-2-70B", "compute/a100_Llama-2-70b-hf_mlp.csv", "a100_80gb"),
         ("Llama-2-70B", "compute/h100_Llama-2-70b-hf_mlp.csv", "h100_sxm"))
pytestmark = pytest.mark.skipif(not ROOT.is_dir(), reason="../shared/profiles/vidur absent")


def elementwise_ratio(file: str, hardware: str, tp: int, efficiency: float = 1.0,
                      min_tokens: int = 256) -> float:
    """Median over the profile's shapes of ``min_tokens`` tokens and more (up to 4,096) of
    the cost model's element-wise seconds over the measured ones."""
    df = _read(ROOT / file)
    df = df[(df.num_tensor_parallel_workers == tp) & (df.num_tokens >= min_tokens)
            & (df.num_tokens <= 4096)]
    r = df.iloc[0]
    model = _geometry(file, int(r.n_embd), int(r.n_head), int(r.n_kv_head),
                      int(r.n_expanded_embd), int(r.vocab_size))
    measured = df[[f"time_stats.{op}.median" for op in EW_OPS]].sum(axis=1).groupby(
        df.num_tokens).median() * 1e-3
    cm = RooflineCostModel(model, load_hardware_spec(hardware), tp,
                           CostModelConfig(elementwise_efficiency=efficiency))
    model_s = np.array([cm.breakdown_shape(ShapeSpec(
        "prefill", num_prefill_seqs=1, prefill_chunk=int(n), num_sampled=0).shape()).elementwise
        for n in measured.index])
    return float(np.median(model_s / measured.to_numpy()))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label,file,hardware", FILES)
def test_elementwise_kernels_run_at_about_0_6_of_the_weights_rate(label, file, hardware, tp):
    full = elementwise_ratio(file, hardware, tp)
    assert 0.5 <= full <= 0.7, (label, hardware, tp, full)
    assert elementwise_ratio(file, hardware, tp, efficiency=0.6) == pytest.approx(1.0, abs=0.15)


def test_check_profiles_detail_lists_each_layer_beside_the_cost_model(capsys):
    """``check_profiles detail=true``: per profile and token count, one layer's measured
    linear and element-wise time beside the cost model's (spec defaults)."""
    from experiments.check_profiles import DETAIL_TOKENS, layer_detail, main

    lines = layer_detail(ROOT)
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == 5 * len(DETAIL_TOKENS)  # five *_mlp.csv profiles at TP 1
    h100_7b = {int(r[2]): r for r in rows if r[0] == "h100_Llama-2-7b-hf_mlp"}
    # Batch-1 projections: 156 us measured, 134.3 us priced (ratio 1.16); element-wise 19 us.
    assert h100_7b[1][3:6] == ["156.0", "134.3", "1.16"] and h100_7b[1][6] == "19.0"
    assert main(["detail=maybe"]) == 2
    assert "config error: detail: must be true or false" in capsys.readouterr().err
