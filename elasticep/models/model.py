"""Our forward pass for the qwen3_moe / qwen2_moe / mixtral / deepseek_v2 / deepseek_v3
decoder families.

Weights are plain tensors in small dataclasses (no nn.Module) so that the loader can
fill exactly what a rank keeps; routed experts live in an
:class:`~elasticep.moe.local_executor.ExpertSlots` behind an executor. A layer's
attention is GQA (:class:`AttentionWeights`) or DeepSeek's MLA
(:class:`~elasticep.models.mla.MLAWeights`); everything else is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elasticep.models.config import MoEModelConfig
from elasticep.models.fused_norm_rope import (
    add_rms_norm,
    norm_rope,
    qkv_cache_ok,
    qkv_norm_rope_cache,
    rms_norm,
)
from elasticep.models.layers import AttentionMetadata, flash_prefill, paged_attention
from elasticep.models.linear import Fp8Weight, Weight, cat_rows, linear
from elasticep.models.mla import MLAWeights, mla_attention
from elasticep.models.moe_block import DenseMLPWeights, MoEBlockWeights, dense_mlp, moe_block
from elasticep.models.rope import rope_cos_sin
from elasticep.moe.executor import ExpertExecutor
from elasticep.moe.local_executor import ExpertSlots


@dataclass
class AttentionWeights:
    """q ``[Hq*D, H]``, k/v ``[Hkv*D, H]``, o ``[H, Hq*D]``; optional biases and qk-norms ``[D]``.

    The projections are plain tensors or block FP8 (:class:`~elasticep.models.linear.Fp8Weight`,
    an FP8 checkpoint's). After :meth:`fuse_qkv`, ``qkv`` ``[(Hq + 2*Hkv)*D, H]`` holds q,
    k and v (which become views of it), so the three projections are one GEMM: at decode
    each is a small matrix-vector product whose cost is its launch.
    """

    q: Weight
    k: Weight
    v: Weight
    o: Weight
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv: Weight | None = None
    qkv_bias: torch.Tensor | None = None

    def fuse_qkv(self) -> None:
        """Concatenate q, k, v (and their biases) into :attr:`qkv`; q, k, v become views.

        FP8 projections fuse when q's and k's rows end on a scale block (so the scale
        grids stack, true of every head_dim of 128), and all three are FP8; otherwise
        they stay three projections."""
        parts = [self.q, self.k, self.v]
        sizes = [w.shape[0] for w in parts]
        if all(isinstance(w, torch.Tensor) for w in parts):
            self.qkv = torch.cat(parts)
        elif all(isinstance(w, Fp8Weight) for w in parts):
            self.qkv = cat_rows(parts)
        if self.qkv is None:
            return
        self.q, self.k, self.v = self.qkv.split(sizes)
        if self.q_bias is not None:
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias, self.v_bias])
            self.q_bias, self.k_bias, self.v_bias = self.qkv_bias.split(sizes)


@dataclass
class DecoderLayerWeights:
    """One decoder layer: norms ``[H]``, attention, and either a MoE block or a dense MLP."""

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    attn: AttentionWeights | MLAWeights
    moe: MoEBlockWeights | None
    mlp: DenseMLPWeights | None


def kv_cache_shapes(c: MoEModelConfig) -> tuple[tuple[int, ...], ...]:
    """Per-token shape of each cache tensor of one layer, for the KV-cache allocator and
    its sizing (pure).

    GQA caches K and V ``(Hkv, D)`` each; MLA caches one latent row of
    ``kv_lora_rank + qk_rope_head_dim`` values.
    """
    if c.mla is not None:
        return ((c.mla.cache_width,),)
    return ((c.num_key_value_heads, c.head_dim), (c.num_key_value_heads, c.head_dim))


# identity equality and the default repr: a model is one object, and its weights are huge
@dataclass(eq=False, repr=False)
class MoECausalLM:
    """A loaded MoE causal LM; call :meth:`forward` with a flat batch of tokens.

    Attributes:
        config: parsed model config.
        embed: ``[V, H]``; final_norm ``[H]``; lm_head ``[V, H]`` (may alias ``embed``).
        layers: per decoder layer weights.
        experts: this rank's routed expert slots.
        executor: the expert executor the MoE blocks call (swap it for EP).
    """

    config: MoEModelConfig
    embed: torch.Tensor
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    experts: ExpertSlots
    executor: ExpertExecutor

    @property
    def dtype(self) -> torch.dtype:
        """The model's activation/weight dtype."""
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.device

    @property
    def graph_capturable(self) -> bool:
        """True when a decode forward reads no per-step host value, so a CUDA graph
        captured once replays it right. Dynamic RoPE sizes its tables from the host's
        context lengths, which a graph would freeze. MLA's absorbed decode sizes its
        grid from the captured bound on the context (``max_seq_len``), which holds for
        every replay, and masks by the device lengths; in fp32 (no kernel) its torch form
        would gather ``max_seq_len`` latents per sequence, so fp32 MLA stays eager."""
        return self.config.rope.rope_type != "dynamic" and (
            self.config.mla is None or self.dtype in (torch.bfloat16, torch.float16))

    def kv_cache_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shape of each cache tensor of one layer (:func:`kv_cache_shapes`)."""
        return kv_cache_shapes(self.config)

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c, w = self.config, self.layers[i].attn
        if isinstance(w, MLAWeights):
            scale = c.mla.qk_head_dim**-0.5 * c.rope.softmax_mscale
            cache = kv_cache[0] if kv_cache is not None else None
            return mla_attention(x, w, c.mla, cos, sin, cache, meta, scale, c.rms_norm_eps)
        t = x.shape[0]
        if w.qkv is not None:
            qkv = linear(x, w.qkv, w.qkv_bias)
            if (kv_cache is not None and meta.context_lens
                    and qkv_cache_ok(qkv, c.head_dim, cos, kv_cache[0])):
                # a flash step attends to this step's own keys: the kernel keeps k (and
                # v is a view of the projection), so none is read back from the cache
                hkv, d = c.num_key_value_heads, c.head_dim
                flash = flash_prefill(meta, qkv.is_cuda)
                k = qkv.new_empty(t, hkv, d) if flash else None
                q = qkv_norm_rope_cache(qkv, w.q_norm, w.k_norm, c.rms_norm_eps, cos, sin,
                                        c.num_attention_heads, hkv, d, kv_cache[0],
                                        kv_cache[1], meta.slot_mapping, k_out=k)
                v = qkv[:, (c.num_attention_heads + hkv) * d:].view(t, hkv, d) if flash else None
                o = paged_attention(q, k, v, kv_cache, meta, d**-0.5, written=True)
                return linear(o, w.o, w.o_bias)
            q, k, v = qkv.split([w.q.shape[0], w.k.shape[0], w.v.shape[0]], dim=-1)
        else:
            q, k, v = linear(x, w.q, w.q_bias), linear(x, w.k, w.k_bias), linear(x, w.v, w.v_bias)
        q = q.view(t, c.num_attention_heads, c.head_dim)
        k = k.view(t, c.num_key_value_heads, c.head_dim)
        v = v.view(t, c.num_key_value_heads, c.head_dim)
        q = norm_rope(q, w.q_norm, c.rms_norm_eps, cos, sin)
        k = norm_rope(k, w.k_norm, c.rms_norm_eps, cos, sin)
        o = paged_attention(q, k, v, kv_cache, meta, c.head_dim**-0.5)
        return linear(o, w.o, w.o_bias)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]] | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder on a flat batch.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 absolute positions.
            meta: per-sequence placement of the T tokens.
            kv_caches: per layer one tensor ``[num_slots, *shape]`` per entry of
                :meth:`kv_cache_shapes`; None = no cache (every sequence must then be a
                full prefill).
            logits_indices: ``[N]`` rows of the T tokens to project to logits; None = all.

        Returns:
            ``[N, V]`` float32 logits.
        """
        c = self.config
        h = self.embed[input_ids]
        seq_lens = None
        if c.rope.rope_type == "dynamic":  # the NTK base follows each sequence's length
            lens = [n for n, a, b in zip(meta.context_lens, meta.query_starts, meta.query_starts[1:],
                                         strict=False) for _ in range(b - a)]
            seq_lens = torch.tensor(lens, dtype=torch.long, device=positions.device)
        cos, sin = rope_cos_sin(c.rope, positions, c.rope_dim, h.dtype, seq_lens)
        mlp_out = None  # each residual add is fused into the norm that follows it
        for i, layer in enumerate(self.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            h, x = add_rms_norm(h, mlp_out, layer.input_norm, c.rms_norm_eps)
            attn_out = self._attention(i, x, cos, sin, cache, meta)
            h, x = add_rms_norm(h, attn_out, layer.post_attn_norm, c.rms_norm_eps)
            if layer.moe is not None:
                mlp_out = moe_block(i, x, layer.moe, self.executor, c.routing)
            else:
                mlp_out = dense_mlp(x, layer.mlp)
        if mlp_out is not None:
            h = h + mlp_out
        if logits_indices is not None:
            h = h[logits_indices]
        h = rms_norm(h, self.final_norm, c.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
