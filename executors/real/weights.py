"""Model weights: seeded random initialization, or a local Hugging Face checkpoint folder
(``config.json`` + ``*.safetensors`` with Llama tensor names). Nothing is downloaded.

Projections are stored fused the way the model runs them: ``qkv = [q_proj; k_proj; v_proj]``
and ``gate_up = [gate_proj; up_proj]`` (rows concatenated), each ``[out_features, in_features]``
as ``torch.nn.functional.linear`` expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executors.real.config import LlamaArgs
from sim.errors import ConfigError

FIELD = "executor.checkpoint"
# Tensors some exported checkpoints carry that the model recomputes: accepted and unused.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [Hq*D + 2*Hk*D, H]
    qkv_bias: torch.Tensor | None  # [Hq*D + 2*Hk*D] (Qwen2) or None
    o_proj: torch.Tensor  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2*I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for lw in self.layers:
            out += [lw.input_norm, lw.qkv, lw.o_proj, lw.post_norm, lw.gate_up, lw.down]
            if lw.qkv_bias is not None:
                out.append(lw.qkv_bias)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def random_weights(args: LlamaArgs, dtype: torch.dtype, device: torch.device | str,
                   seed: int) -> LlamaWeights:
    """Seeded random weights. Linear layers get std 1/sqrt(fan_in) so activations and logits
    keep unit scale (greedy outputs are then far from ties); norms get 1 + noise."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = args.hidden_size, args.intermediate_size

    def rand(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
        return (t * std + mean).to(dtype)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return rand(out_f, in_f, std=in_f**-0.5)

    qkv_out = args.q_size + 2 * args.kv_size
    layers = [
        LayerWeights(
            input_norm=rand(h, std=0.1, mean=1.0),
            qkv=linear(qkv_out, h),
            qkv_bias=rand(qkv_out, std=0.1) if args.attention_bias else None,
            o_proj=linear(h, args.q_size),
            post_norm=rand(h, std=0.1, mean=1.0),
            gate_up=linear(2 * inter, h),
            down=linear(h, inter),
        )
        for _ in range(args.num_layers)
    ]
    embed = rand(args.vocab_size, h)
    lm_head = embed if args.tie_word_embeddings else linear(args.vocab_size, h)
    return LlamaWeights(embed, layers, rand(h, std=0.1, mean=1.0), lm_head)


# The most recently built random weights and what they were built from. Validation builds a
# fresh executor for every run (``experiments/validate.py``: 10 to 30 per configuration), and
# random Llama-3-8B weights are 16 GB of device memory and ~1 s of initialization each; runs
# kept for their results would otherwise hold one copy each. Weights are never written after
# initialization (the model runs under ``torch.inference_mode``), so sharing them is exact.
_shared: tuple[tuple[Any, ...], LlamaWeights] | None = None


def shared_random_weights(args: LlamaArgs, dtype: torch.dtype, device: torch.device | str,
                          seed: int) -> LlamaWeights:
    """``random_weights``, reusing the last ones built when the arguments are the same (the
    same values: initialization is seeded)."""
    global _shared
    key = (repr(args), str(dtype), str(device), int(seed))
    if _shared is None or _shared[0] != key:
        _shared = None  # drop the old copy before building the new one (device memory)
        _shared = (key, random_weights(args, dtype, device, seed))
    return _shared[1]


def clear_shared_weights() -> None:
    """Forget the shared random weights (their memory goes once no executor uses them)."""
    global _shared
    _shared = None


# ---- Hugging Face layout ----------------------------------------------------------------------
def _hf_names(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint for ``args`` must hold, with its shape."""
    h, d, inter = args.hidden_size, args.head_dim, args.intermediate_size
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, h),
                                         "model.norm.weight": (h,)}
    if not args.tie_word_embeddings:
        names["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        names[p + "input_layernorm.weight"] = (h,)
        names[p + "post_attention_layernorm.weight"] = (h,)
        names[p + "self_attn.q_proj.weight"] = (args.num_heads * d, h)
        names[p + "self_attn.k_proj.weight"] = (args.num_kv_heads * d, h)
        names[p + "self_attn.v_proj.weight"] = (args.num_kv_heads * d, h)
        names[p + "self_attn.o_proj.weight"] = (h, args.num_heads * d)
        if args.attention_bias:
            names[p + "self_attn.q_proj.bias"] = (args.num_heads * d,)
            names[p + "self_attn.k_proj.bias"] = (args.num_kv_heads * d,)
            names[p + "self_attn.v_proj.bias"] = (args.num_kv_heads * d,)
        names[p + "mlp.gate_proj.weight"] = (inter, h)
        names[p + "mlp.up_proj.weight"] = (inter, h)
        names[p + "mlp.down_proj.weight"] = (h, inter)
    return names


def hf_config(args: LlamaArgs) -> dict:
    """The ``config.json`` of a checkpoint with these shapes."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_position,
        "rope_theta": args.rope_theta, "rms_norm_eps": args.rms_norm_eps,
        "attention_bias": args.attention_bias, "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if args.rope_scaling:
        cfg["rope_scaling"] = {**args.rope_scaling, "rope_type": "llama3"}
    return cfg


def _check_config(folder: Path, args: LlamaArgs) -> None:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(FIELD, f"{folder} has no config.json (a Hugging Face checkpoint "
                                 f"folder holds config.json and *.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(FIELD, f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    heads = cfg.get("num_attention_heads")
    expect = {
        "hidden_size": ("hidden_size", args.hidden_size),
        "num_hidden_layers": ("num_layers", args.num_layers),
        "num_attention_heads": ("num_heads", args.num_heads),
        "num_key_value_heads": ("num_kv_heads", args.num_kv_heads),
        "intermediate_size": ("intermediate_size", args.intermediate_size),
        "vocab_size": ("vocab_size", args.vocab_size),
        "rope_theta": ("rope_theta", args.rope_theta),
        "rms_norm_eps": ("rms_norm_eps", args.rms_norm_eps),
    }
    defaults = {"num_key_value_heads": heads, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    for key, (field, want) in expect.items():
        got = cfg.get(key, defaults.get(key))
        if got is None:
            raise ConfigError(FIELD, f"{path}: missing {key}")
        if float(got) != float(want):
            raise ConfigError(FIELD, f"{path}: {key} = {got}, but model.{field} = {want}; "
                                     f"pick the model config that matches the checkpoint")
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim != args.head_dim:
        raise ConfigError(FIELD, f"{path}: head_dim = {head_dim}, but model.head_dim = "
                                 f"{args.head_dim}")
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied != args.tie_word_embeddings:
        raise ConfigError(FIELD, f"{path}: tie_word_embeddings = {tied}, but "
                                 f"model.tie_word_embeddings = {args.tie_word_embeddings}")


def load_hf_checkpoint(folder: str | Path, args: LlamaArgs, dtype: torch.dtype,
                       device: torch.device | str) -> LlamaWeights:
    """Load and shape-check a local Hugging Face Llama checkpoint."""
    from safetensors import safe_open

    try:
        folder = Path(folder).expanduser()
        found = folder.is_dir()
    except (OSError, RuntimeError, ValueError):  # a name too long, ~user unknown, a NUL byte
        found = False
    if not found:
        raise ConfigError(FIELD, f"checkpoint folder not found: {folder}")
    _check_config(folder, args)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(FIELD, f"{folder} holds no *.safetensors files")
    want = _hf_names(args)
    got: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in want:
                    raise ConfigError(FIELD, f"{f.name}: unexpected tensor {name!r} (not part of "
                                             f"a {args.num_layers}-layer Llama model)")
                if name in got:
                    raise ConfigError(FIELD, f"{f.name}: tensor {name!r} appears twice")
                t = st.get_tensor(name)
                if tuple(t.shape) != want[name]:
                    raise ConfigError(FIELD, f"{f.name}: tensor {name!r} has shape "
                                             f"{tuple(t.shape)}, expected {want[name]}")
                got[name] = t
    missing = [n for n in want if n not in got]
    if missing:
        raise ConfigError(FIELD, f"{folder}: missing tensor {missing[0]!r} ({len(missing)} "
                                 f"missing in all; read {', '.join(f.name for f in files)})")

    def t(name: str) -> torch.Tensor:
        return got[name].to(device=device, dtype=dtype).contiguous()

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([got[n] for n in names]).to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            input_norm=t(p + "input_layernorm.weight"),
            qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=(cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                      if args.attention_bias else None),
            o_proj=t(a + "o_proj.weight"),
            post_norm=t(p + "post_attention_layernorm.weight"),
            gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=t(p + "mlp.down_proj.weight"),
        ))
    embed = t("model.embed_tokens.weight")
    lm_head = embed if args.tie_word_embeddings else t("lm_head.weight")
    return LlamaWeights(embed, layers, t("model.norm.weight"), lm_head)


def save_hf_checkpoint(weights: LlamaWeights, args: LlamaArgs, folder: str | Path) -> Path:
    """Write ``weights`` as a Hugging Face Llama checkpoint (unfused projections)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    q, kv = args.q_size, args.kv_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights.embed,
                                    "model.norm.weight": weights.norm}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = weights.lm_head
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = lw.input_norm
        out[p + "post_attention_layernorm.weight"] = lw.post_norm
        for name, part in zip(("q", "k", "v"), lw.qkv.split([q, kv, kv])):
            out[p + f"self_attn.{name}_proj.weight"] = part
        if lw.qkv_bias is not None:
            for name, part in zip(("q", "k", "v"), lw.qkv_bias.split([q, kv, kv])):
                out[p + f"self_attn.{name}_proj.bias"] = part
        out[p + "self_attn.o_proj.weight"] = lw.o_proj
        gate, up = lw.gate_up.chunk(2)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = lw.down
    save_file({k: v.detach().cpu().contiguous() for k, v in out.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(args), indent=2) + "\n")
    return folder
