"""``--load-format dummy``: weights drawn from a seed instead of read from safetensors.

vLLM's ``--load-format dummy`` lets anyone run a real model shape from its
``config.json`` alone (no weights, no download). :class:`DummyWeightReader` has the
read interface of :class:`~elasticep.models.checkpoint.CheckpointReader`, so the loader,
the orphan reload and a relaunched rank use it unchanged.

Each tensor is drawn from a generator seeded by ``(seed, tensor name)``. The name holds
the layer and the *logical* expert (``model.layers.3.mlp.experts.17.up_proj.weight``),
never a slot or a rank, so EP1, EP2, a relaunched rank and a scaled-in rank hold
bit-identical experts on the same device type. Values are drawn on the target device
(no host copy of a 60 GB model) in float32 and cast to the requested dtype.

Scales follow the HF initialisation (``normal(0, initializer_range)`` for matrices,
ones for RMSNorm weights), except the token embedding, which is ``normal(0, 1)`` as
``torch.nn.Embedding`` initialises it: with 0.02 the layers' outputs swamp the token's
own vector and a random model collapses to repeating one token whatever the prompt,
which would make equal outputs of two runs a weak check. A router drawn that way already spreads tokens over many
experts: its logits have a standard deviation of about
``initializer_range * sqrt(hidden_size)`` (0.9 for Qwen3-30B-A3B), close to a trained
router's, so a batch touches most experts as it would in production.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from elasticep.models.config import SUPPORTED_FAMILIES, MoEModelConfig, unsupported

DEFAULT_STD = 0.02


def tensor_seed(seed: int, name: str) -> int:
    """63-bit generator seed for tensor ``name`` under the deployment's ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _expert_names(cfg: MoEModelConfig) -> tuple[str, str, str, str]:
    """(moe prefix format, gate, up, down) names of the per-expert layout of ``cfg``'s family."""
    if cfg.model_type == "mixtral":
        return "model.layers.{i}.block_sparse_moe", "w1", "w3", "w2"
    return "model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"


def _attention_names(cfg: MoEModelConfig, a: str) -> set[str]:
    """Tensor names of one attention block under prefix ``a`` (GQA, or DeepSeek's MLA)."""
    if cfg.mla is not None:
        names = {f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_a_layernorm.weight",
                 f"{a}.kv_b_proj.weight", f"{a}.o_proj.weight"}
        if cfg.mla.q_lora_rank is None:
            return names | {f"{a}.q_proj.weight"}
        return names | {f"{a}.q_a_proj.weight", f"{a}.q_a_layernorm.weight", f"{a}.q_b_proj.weight"}
    names = {f"{a}.{x}_proj.weight" for x in "qkvo"}
    if cfg.qkv_bias:
        names |= {f"{a}.{x}_proj.bias" for x in "qkv"}
    if cfg.o_bias:
        names.add(f"{a}.o_proj.bias")
    if cfg.qk_norm:
        names |= {f"{a}.q_norm.weight", f"{a}.k_norm.weight"}
    return names


def dummy_tensor_names(cfg: MoEModelConfig) -> set[str]:
    """Every tensor name a checkpoint of ``cfg`` holds, in the per-expert HF layout.

    Raises:
        ValueError: a family this generator does not describe.
    """
    if cfg.model_type not in SUPPORTED_FAMILIES:
        raise unsupported(f"--load-format dummy does not know the tensors of {cfg.model_type!r}")
    moe_fmt, gate, up, down = _expert_names(cfg)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        names |= _attention_names(cfg, a)
        if not cfg.moe_layers[i]:
            names |= {f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
            continue
        moe = moe_fmt.format(i=i)
        names.add(f"{moe}.gate.weight")
        if cfg.routing.topk_method == "noaux_tc":
            names.add(f"{moe}.gate.e_score_correction_bias")
        for e in range(cfg.num_experts):
            names |= {f"{moe}.experts.{e}.{n}.weight" for n in (gate, up, down)}
        if cfg.mla is not None:  # DeepSeek: n_shared_experts fused, no gate
            names |= {f"{p}.mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")}
        elif cfg.shared_expert_intermediate_size > 0:
            names |= {f"{p}.mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
            names.add(f"{p}.mlp.shared_expert_gate.weight")
    return names


class DummyWeightReader:
    """Name -> tensor access with the :class:`CheckpointReader` interface, values from a seed.

    Args:
        model_dir: the directory of ``config.json`` (named in errors only).
        config: the parsed config; it decides which names exist.
        seed: the deployment's weight seed; every rank must use the same one.
        std: standard deviation of matrix and bias entries (the config's
            ``initializer_range`` when the caller passes it).

    Raises:
        ValueError: from :meth:`get`, an unknown name or a shape the config does not give.
    """

    def __init__(self, model_dir: str | Path, config: MoEModelConfig, seed: int = 0,
                 std: float = DEFAULT_STD) -> None:
        self.model_dir = Path(model_dir)
        self.seed = seed
        self.std = std
        self._names = dummy_tensor_names(config)

    def __enter__(self) -> DummyWeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release; kept for the reader interface."""

    def has(self, key: str) -> bool:
        """True when a checkpoint of this config would hold ``key``."""
        return key in self._names

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
        """Draw ``key`` as a ``shape`` tensor of ``dtype`` on ``device``.

        Norm weights are ones; every other tensor is ``normal(0, std)``.
        """
        if key not in self._names:
            raise unsupported(f"missing tensor {key!r} in dummy weights for {self.model_dir}")
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        gen = torch.Generator(device=device).manual_seed(tensor_seed(self.seed, key))
        out = torch.empty(shape, dtype=torch.float32, device=device)
        out.normal_(0.0, 1.0 if key == "model.embed_tokens.weight" else self.std, generator=gen)
        return out.to(dtype)

    def get_row(self, key: str, row: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """Not used: the dummy layout is per expert, never the fused stack."""
        raise unsupported(f"dummy weights have no fused tensor {key!r}")

    def get_optional(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor | None:
        """Like :meth:`get`, but None when the config has no such tensor."""
        return self.get(key, shape, dtype, device) if self.has(key) else None
