"""The paged Llama model against an independent dense implementation, checkpoints, swap and
recompute, sampling, and the executor's input checks (CPU, torch reference kernels)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from executors.real import RealExecutor, RealExecutorConfig  # noqa: E402
from executors.real.config import LlamaArgs, rope_inv_freq  # noqa: E402
from executors.real.weights import save_hf_checkpoint  # noqa: E402
from sim.errors import ConfigError  # noqa: E402
from sim.plan import ScheduledRequest, StepPlan  # noqa: E402
from sim.specs import load_model_spec  # noqa: E402
from tests.real_dense import DenseLlama  # noqa: E402
from tests.real_helpers import paged_logits, plan_step, tiny_executor  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-4)
# Every feature at once: Llama-3 rope scaling, GQA group 4, qkv bias, tied embeddings.
VARIANT = dict(num_heads=8, num_kv_heads=2, head_dim=16, attention_bias=True,
               tie_word_embeddings=True, rope_theta=500000.0, max_model_len=512,
               rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})


def spec(variant: bool):
    return load_model_spec("tiny", **(VARIANT if variant else {}))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("variant", [False, True], ids=["tiny", "scaled-rope-bias-tied-gqa4"])
def test_paged_logits_equal_dense_for_prefill_decode_and_chunked_prefill(variant):
    ex, kv = tiny_executor(spec=spec(variant), block_size=4)
    dense = DenseLlama(ex.args, ex.model.weights)
    a, b, c = ids(13, 1), ids(22, 2), ids(9, 3)
    # step 1: a whole prompt, the first chunk of b (ends mid-block), all of c
    got = paged_logits(ex, kv, [(0, a, 0, 13), (1, b, 0, 7), (2, c, 0, 9)])
    want = [dense.forward(0, a), dense.forward(1, b[:7]), dense.forward(2, c)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    # step 2: a decodes, b's second chunk attends to its cached first chunk, c decodes
    a.append(int(got[0][-1].argmax()))
    c.append(int(got[2][-1].argmax()))
    got = paged_logits(ex, kv, [(0, a, 13, 1), (1, b, 7, 15), (2, c, 9, 1)])
    want = [dense.forward(0, a[13:]), dense.forward(1, b[7:]), dense.forward(2, c[9:])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    # steps 3..: decode rows only, crossing block boundaries
    for _ in range(6):
        a.append(int(got[0][-1].argmax()))
        got = paged_logits(ex, kv, [(0, a, len(a) - 1, 1)])
        torch.testing.assert_close(got[0], dense.forward(0, a[-1:]), **TOL)


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones():
    args = LlamaArgs.from_spec(spec(True))
    plain = LlamaArgs.from_spec(dataclasses.replace(spec(True), rope_scaling=None))
    scaled, base = rope_inv_freq(args), rope_inv_freq(plain)
    assert scaled[0] == base[0]  # wavelength 2*pi < 64/4: untouched
    assert scaled[-1] == pytest.approx(base[-1] / 8)  # wavelength > 64: divided by factor
    assert (scaled <= base).all()


def test_checkpoint_in_hugging_face_layout_reproduces_the_logits(tmp_path):
    for variant in (False, True):
        src, kv = tiny_executor(spec=spec(variant), seed=3)
        folder = save_hf_checkpoint(src.model.weights, src.args, tmp_path / f"ckpt{variant}")
        assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
        loaded, kv2 = tiny_executor(spec=spec(variant), seed=99, checkpoint=str(folder))
        toks = ids(11, 5)
        want = paged_logits(src, kv, [(0, toks, 0, 11)])[0]
        got = paged_logits(loaded, kv2, [(0, toks, 0, 11)])[0]
        assert torch.equal(got, want)


def _edit_checkpoint(folder, fn):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(64)}),
     r"'model.norm.weight' has shape \(64,\), expected \(128,\)"),
    (lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.ones(1)}),
     "unexpected tensor 'model.layers.7.mlp.up_proj.weight'"),
])
def test_bad_checkpoint_tensors_are_named(tmp_path, edit, match):
    src, _ = tiny_executor()
    folder = save_hf_checkpoint(src.model.weights, src.args, tmp_path / "ckpt")
    _edit_checkpoint(folder, edit)
    with pytest.raises(ConfigError, match=match) as e:
        tiny_executor(checkpoint=str(folder))
    assert e.value.field == "executor.checkpoint"


def test_checkpoint_config_mismatch_and_missing_folder_are_refused(tmp_path):
    src, _ = tiny_executor()
    folder = save_hf_checkpoint(src.model.weights, src.args, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="num_hidden_layers = 2, but model.num_layers = 3"):
        tiny_executor(spec=load_model_spec("tiny", num_layers=3), checkpoint=str(folder))
    with pytest.raises(ConfigError, match="checkpoint folder not found"):
        tiny_executor(checkpoint=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        tiny_executor(checkpoint=str(tmp_path / "empty"))


def _gather_kv(ex, table: list[int], n: int) -> torch.Tensor:
    """[layers, 2, n, Hk, D]: the first n tokens' K and V through a block table."""
    idx = torch.tensor(table)
    return torch.stack([c[:, idx].flatten(1, 2)[:, :n] for c in ex.runner.gpu_cache])


def test_swap_round_trip_is_bit_exact_and_decoding_continues_identically():
    ex, kv = tiny_executor(block_size=4)
    ref, kv_ref = tiny_executor(block_size=4)
    prompt = ids(10, 7)
    for e in (ex, ref):
        e.add_request(0, prompt)
    prog, prog_ref = {}, {}
    plan_step(ex, kv, [(0, 10)], prog)
    plan_step(ref, kv_ref, [(0, 10)], prog_ref)
    for _ in range(3):
        plan_step(ex, kv, [(0, 1)], prog)
        plan_step(ref, kv_ref, [(0, 1)], prog_ref)
    n = prog[0]
    before = _gather_kv(ex, kv.block_table(0), n).clone()
    old_blocks = list(kv.block_table(0))
    out = kv.swap_out(0)
    ex.execute(StepPlan(swap_out=out, swaps=[("out", out)]))
    for c in ex.runner.gpu_cache:  # clobber every GPU block
        c.normal_()
    kv.allocate_slots(99, 4 * 4)  # someone else takes the first free blocks
    back = kv.swap_in(0)
    assert kv.block_table(0) != old_blocks  # the KV comes back into different blocks
    ex.execute(StepPlan(swap_in=back, swaps=[("in", back)]))
    assert torch.equal(_gather_kv(ex, kv.block_table(0), n), before)
    for _ in range(4):
        assert plan_step(ex, kv, [(0, 1)], prog) == plan_step(ref, kv_ref, [(0, 1)], prog_ref)


def test_swaps_follow_the_order_the_scheduler_made_them():
    """Swap in, then swap the same request out again into the CPU blocks it just left: the
    copies must run in that order, not outs first."""
    ex, kv = tiny_executor(num_gpu_blocks=8, num_cpu_blocks=3, block_size=4)
    ex.add_request(0, ids(9, 1))
    prog = {}
    plan_step(ex, kv, [(0, 9)], prog)
    first = _gather_kv(ex, kv.block_table(0), 9).clone()
    out1 = kv.swap_out(0)
    ex.execute(StepPlan(swap_out=out1, swaps=[("out", out1)]))
    inn = kv.swap_in(0)
    out2 = kv.swap_out(0)
    assert sorted(c for _, c in out2) == sorted(c for c, _ in inn)  # reuses the same CPU blocks
    ex.execute(StepPlan(swap_out=out2, swap_in=inn, swaps=[("in", inn), ("out", out2)]))
    back = kv.swap_in(0)
    ex.execute(StepPlan(swap_in=back, swaps=[("in", back)]))
    assert torch.equal(_gather_kv(ex, kv.block_table(0), 9), first)


def test_recomputed_kv_equals_the_original():
    ex, kv = tiny_executor(block_size=4)
    ex.add_request(0, ids(9, 4))
    prog = {}
    plan_step(ex, kv, [(0, 9)], prog)
    for _ in range(5):
        plan_step(ex, kv, [(0, 1)], prog)
    n = prog[0]
    original = _gather_kv(ex, kv.block_table(0), n).clone()
    kv.free(0)  # preempted by recompute: the KV is gone
    kv.allocate_slots(7, 8)  # the freed blocks go elsewhere first
    prog[0] = 0
    tokens = ex.runner.tokens[0]
    assert len(tokens) == 15  # prompt + 6 sampled ids
    nxt = plan_step(ex, kv, [(0, 14)], prog)  # re-prefill prompt + generated but the last
    torch.testing.assert_close(_gather_kv(ex, kv.block_table(0), n), original, **TOL)
    assert len(nxt) == 0  # one token is still pending, nothing sampled yet
    assert plan_step(ex, kv, [(0, 1)], prog)[0] == ex.runner.tokens[0][-1]


def test_sampling_is_seeded_per_request_and_top_p_narrows_to_greedy():
    def run(temperature, top_p, batch):
        ex, kv = tiny_executor(temperature=temperature, top_p=top_p, seed=11)
        prog, outs = {}, {rid: [] for rid in batch}
        for rid in batch:
            ex.add_request(rid, ids(6, rid))
        sampled = plan_step(ex, kv, [(rid, 6) for rid in batch], prog)
        for _ in range(5):
            for rid, t in zip(batch, sampled):
                outs[rid].append(t)
            sampled = plan_step(ex, kv, [(rid, 1) for rid in batch], prog)
        return outs

    hot_alone = run(1.5, 1.0, [3])
    hot_batched = run(1.5, 1.0, [1, 2, 3])
    assert hot_alone[3] == hot_batched[3]  # a request's draws do not depend on its batch
    assert run(1.5, 1.0, [1, 2, 3]) == hot_batched
    greedy = run(0.0, 1.0, [1, 2, 3])
    assert hot_batched != greedy
    assert run(1.5, 1e-6, [1, 2, 3]) == greedy  # top_p -> 0 keeps only the top token


def test_executor_refuses_bad_requests_and_plans():
    ex, kv = tiny_executor()
    with pytest.raises(ValueError, match="request 5 has no prompt token ids"):
        ex.add_request(5, None)
    with pytest.raises(ValueError, match="prompt token id 512 is outside the vocabulary"):
        ex.add_request(6, [1, 512])
    ex.add_request(1, [1, 2, 3])
    with pytest.raises(ValueError, match="request 1 was added twice"):
        ex.add_request(1, [1])
    kv.allocate_slots(1, 5)
    bad = StepPlan([ScheduledRequest(1, 0, 5, kv.block_table(1), True)])
    with pytest.raises(ValueError, match=r"request 1: plan row covers tokens \[0, 5\)"):
        ex.execute(bad)
    with pytest.raises(ValueError, match="request 4 is scheduled but was never added"):
        ex.execute(StepPlan([ScheduledRequest(4, 0, 1, [0], True)]))


@pytest.mark.parametrize("cfg,field", [
    (dict(dtype="fp64"), "executor.dtype"),
    (dict(kernels="cuda"), "executor.kernels"),
    (dict(top_p=0.0), "executor.top_p"),
    (dict(device="tpu"), "device"),
    (dict(device_memory_gib=0.0001), "executor.device_memory_gib"),
])
def test_bad_executor_options_name_the_field(cfg, field):
    with pytest.raises(ConfigError) as e:
        RealExecutor(load_model_spec("tiny"), RealExecutorConfig(**{"device": "cpu", **cfg}))
    assert e.value.field == field


def test_triton_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="Triton kernels need a CUDA device") as e:
        RealExecutor(load_model_spec("tiny"), RealExecutorConfig(device="cpu", kernels="triton"))
    assert e.value.field == "executor.kernels"
