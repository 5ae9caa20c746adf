"""The public NNX MoE layers of tests/public_moe/ (unmodified, see its SOURCES) in tiny decoders of our own:
token embedding, two layers of RMS norm + the public MoE layer + a residual, a head. 8 experts, top-2.

- `qwen3`: tunix's Qwen3 `MoELayer` (its CPU path: a loop over experts on masked per-expert copies of
  the tokens, stacked, combined by an einsum over E and K);
- `gemma4`: tunix's Gemma 4 `MoERagged` (rows sorted by expert through `ragged_dot`, gate and up fused in
  a 4-D stack [E, 2, H, D], a per-expert scale [E]);
- `gpt_oss`: bonsai's GPT-OSS `GptOssMLP` (every expert on every token: tokens broadcast over E,
  einsums with E as a batch dim, per-expert biases, gate/up interleaved as strided slices).

The Qwen3 file imports tunix packages its MoE layer does not use (weight-name mappings, a module list,
an environment switch) and `jaxtyping` for annotations; small stand-ins take their place here.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import jax
import jax.numpy as jnp
from flax import nnx

DIM, HIDDEN, EXPERTS, TOP_K, VOCAB, LAYERS = 16, 32, 8, 2, 64, 2


def _stand_ins() -> None:
    """Modules the Qwen3 file imports for things other than its MoE layer."""

    def module(name, **attrs):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            sys.modules[name] = m
        return sys.modules[name]

    try:
        import jaxtyping  # noqa: F401
    except ImportError:
        module("jaxtyping", Array=jax.Array, ArrayLike=jax.typing.ArrayLike)
    module("tunix", __path__=[])
    module("tunix.generate", __path__=[])
    module("tunix.generate.mappings", BackendMappingMixin=type("BackendMappingMixin", (), {}))
    module("tunix.utils", __path__=[])
    module("tunix.utils.compat", ModuleList=nnx.List)
    module("tunix.utils.env_utils", setup_sharding_environment=lambda: None)


def public_module(name: str):
    if name == "tunix_qwen3_model":
        _stand_ins()
    return importlib.import_module(f"public_moe.{name}")


def _qwen3(rngs):
    m = public_module("tunix_qwen3_model")
    config = m.ModelConfig(
        num_layers=LAYERS,
        vocab_size=VOCAB,
        embed_dim=DIM,
        hidden_dim=HIDDEN,
        num_heads=2,
        head_dim=8,
        num_kv_heads=2,
        rope_theta=10_000,
        norm_eps=1e-6,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    # tunix turns flax's eager sharding of annotated variables off for the whole process at import; here
    # only while its layer is made (its annotations name tunix's own mesh axes)
    import flax

    before = flax.config.flax_always_shard_variable
    flax.config.update("flax_always_shard_variable", False)
    try:
        return m.MoELayer(config, rngs=rngs)
    finally:
        flax.config.update("flax_always_shard_variable", before)


@dataclasses.dataclass
class _Gemma4Config:
    embed_dim: int = DIM
    expert_dim: int = HIDDEN
    num_experts: int = EXPERTS
    num_experts_per_tok: int = TOP_K
    param_dtype: object = jnp.float32
    dtype: object = jnp.float32
    shd_config: object = dataclasses.field(
        default_factory=lambda: types.SimpleNamespace(exp_weight_edf=None, exp_weight_efd=None)
    )


def _gemma4(rngs):
    m = public_module("tunix_gemma4_moe")
    block = m.MoERagged(_Gemma4Config(embed_dim=DIM, expert_dim=HIDDEN), rngs=rngs)
    # its per-expert scale starts at one; make it matter
    block.per_expert_scale.set_value(1.0 + 0.5 * jax.random.uniform(rngs.params(), (EXPERTS,)))
    return block


def _gpt_oss(rngs):
    m = public_module("bonsai_gpt_oss_modeling")
    config = m.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_attention_heads=2,
    )
    block = m.GptOssMLP(config, rngs=rngs)
    # its experts start at zero (weights are loaded from a checkpoint); give them values
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        param = getattr(block.experts, name)
        param.set_value(0.3 * jax.random.normal(rngs.params(), param.get_value().shape))
    return block


BLOCKS = {"qwen3": _qwen3, "gemma4": _gemma4, "gpt_oss": _gpt_oss}


class Layer(nnx.Module):
    def __init__(self, block, *, rngs):
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.moe = block

    def __call__(self, x):
        out = self.moe(self.norm(x))
        out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's block also returns its router scores
        return x + out


class MoEBlockDecoder(nnx.Module):
    """Embedding, `LAYERS` layers each holding a MoE block `make_block(rngs)` makes, a head; returns the logits."""

    def __init__(self, make_block, *, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.layers = nnx.List([Layer(make_block(rngs), rngs=rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def PublicMoEDecoder(kind: str, *, rngs) -> MoEBlockDecoder:
    return MoEBlockDecoder(BLOCKS[kind], rngs=rngs)
