"""Gemma 4 (text): Gemma 3's decoder with layers of two shapes, shared keys and a second embedding.

What differs from Gemma 3 (models/gemma3.py):
- norms scale by w, not 1 + w; values are normalised too (without a weight), q and k per
  head, and the scores are not scaled (the softmax scale is 1);
- sliding layers and full layers have their own attention geometry: head_dim 256 against
  `global_head_dim` 512, and on the large models fewer KV heads for the full layers, whose
  values are their keys' projection (`attention_k_eq_v`: no v_proj; the values skip the
  key's norm weight and its rotation);
- the full layers' RoPE is "proportional": a quarter of the head's channel pairs turn, at
  the frequencies of the whole head (layers/rope_scaling.py);
- the last `num_kv_shared_layers` layers (E2B, E4B) compute only queries and attend over
  the keys of the last earlier layer of their kind: they store nothing (kvcache/layout.py
  gives them their source's place in the pool), and their MLP may be twice as wide. Since
  nothing they compute is stored, a prefill runs them on each request's last token alone
  (`last_rows_only`): nothing else of theirs reaches the logits;
- a per-layer embedding (PLE, E2B and E4B): a second table gives every token a small vector
  per layer, mixed with a projection of the token's embedding; after its MLP each layer
  adds a gated projection of its vector to the residual stream;
- the 26B-A4B runs 128 routed experts beside every layer's dense MLP, each branch with
  its own norms;
- every layer's output is multiplied by a learned scalar.

`Gemma4ForConditionalGeneration` checkpoints hold the text model under
`model.language_model.` beside vision and audio towers, which the loader skips (and logs).
"""

from __future__ import annotations

import re
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import eager_on_graph, get_global_ctx
from minisgl.distributed import Split, all_reduce, get_tp_info, rank_heads
from minisgl.env import ENV
from minisgl.layers.embedding import VocabEmbedding
from minisgl.layers.fused_moe import use_fused_moe
from minisgl.layers.linear import Linear
from minisgl.layers.moe import Experts
from minisgl.layers.rotary import get_rope
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig, MoEConfig
from minisgl.models.families import FULL, kv_pool_layers, kv_shape, kv_source, layer_rope
from minisgl.models.gemma3 import Gemma3MLP, GemmaRMSNorm, SoftCappedLMHead

if TYPE_CHECKING:
    from minisgl.layers.kernel_plan import KernelPlan

_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|k_norm|v_norm)\.")


class Gemma4RMSNorm(GemmaRMSNorm):
    """x / rms(x) * w in fp32, rounded after: Gemma 3's norm with the weight as stored."""

    def after_load(self) -> None:
        pass


class UnscaledRMSNorm(Gemma4RMSNorm):
    """x / rms(x) in fp32, no weight: Gemma 4's value norm and its router's input. Its
    weight is ones, not loaded: times 1.0 is exact, and the norm's kernel is Gemma's."""

    def __init__(self, size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", torch.ones(size), persistent=False)
        self.eps = eps


class Gemma4AttentionLayer(nn.Module):
    """Normalise and rotate one layer's q, k and v, store k and v, attend: what
    layers/attention.AttentionLayer does, with Gemma 4's value norm and a layer that has
    queries alone (a KV-shared one). Not an AttentionLayer: the kernel plan's fused paths
    know neither."""

    def __init__(self, config: ModelConfig, layer_id: int, shared: bool) -> None:
        super().__init__()
        c = config
        kv_heads, self.head_dim = kv_shape(c, layer_id)
        self.num_heads, self.num_kv_heads = rank_heads(c.num_heads, kv_heads)  # this rank's
        self.layer_id = kv_pool_layers(c)[layer_id]  # its keys in the pool (or its source's)
        device = torch.empty(0).device  # where the model is being built
        rope = layer_rope(c, layer_id)
        self.rotary = get_rope(self.head_dim, c.rope_theta, c.max_position_embeddings, device, rope)
        self.q_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
        if not shared:
            self.k_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
            self.v_norm = UnscaledRMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None):
        """q [tokens, heads * head_dim]; k and v [tokens, kv_heads * head_dim], or None for
        a KV-shared layer. Returns [tokens, heads * head_dim]."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        positions = get_global_ctx().batch.positions
        q = q.reshape(-1, heads, dim)
        if k is not None and v is not None:  # K=V layers pass the same tensor twice
            k, v = k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)
        q, k, v = self.prepare(positions, q, k, v)
        return self.attend(q, k, v).reshape(-1, heads * dim)

    def prepare(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None):  # fmt: skip
        """Every head normalised, q and k turned by position ([tokens, heads, head_dim]
        each); a KV-shared layer's queries alone."""
        q = self.q_norm(q)
        if k is None or v is None:
            return self.rotary(positions, q, q[:, :0])[0], None, None
        q, k = self.rotary(positions, q, self.k_norm(k))
        return q, k, self.v_norm(v)

    def install_kernels(self, plan: KernelPlan) -> None:
        """`prepare` in one kernel a tensor (kernels/gemma4_rope.py) where fused kernels
        run and MINISGL_GEMMA4_ROPE=triton asks for it; the torch code above elsewhere."""
        self.prepare = MethodType(Gemma4AttentionLayer.prepare, self)
        table = self.rotary.cos_sin  # turns every pair (Gemma 4's RoPEs do): none passes
        asked = plan.fused and ENV.GEMMA4_ROPE.value == "triton"
        if not asked or table.size(-1) != self.head_dim:
            return
        try:  # triton may be missing
            from minisgl.kernels.gemma4_rope import norm_rope
        except ImportError:
            return

        def fused(positions, q, k, v):
            q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, table, positions)
            if k is None or v is None:
                return q, None, None
            k = norm_rope(k, self.k_norm.weight, self.k_norm.eps, table, positions)
            return q, k, norm_rope(v, self.v_norm.weight, self.v_norm.eps)

        self.prepare = fused

    @eager_on_graph  # prefill attention plans on the host: it runs between graph segments
    def attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        ctx = get_global_ctx()
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)


class Gemma4Attention(nn.Module):
    """The projections of one layer's geometry: q, k and v merged; a K=V layer's q and k
    apart (its values are its keys' projection); a KV-shared layer's q alone (its keys are
    its source layer's, already in the pool)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c, g = config, config.gemma4
        assert g is not None
        kv_heads, head_dim = kv_shape(c, layer_id)
        self.shared = kv_source(c, layer_id) != layer_id
        self.k_eq_v = g.k_eq_v and c.layer_types[layer_id] == FULL and not self.shared
        q_size, kv_size = c.num_heads * head_dim, kv_heads * head_dim
        if self.shared or self.k_eq_v:  # names the loader does not merge (checkpoint_name)
            self.query_proj = Linear(c.hidden_size, q_size, split=Split.even(0, q_size))
            if self.k_eq_v:  # with fewer KV heads than ranks, each rank keeps them all
                slices = (min(kv_heads, get_tp_info().size),)
                self.key_proj = Linear(c.hidden_size, kv_size, split=Split(0, (kv_size,), slices))
        else:
            split = Split.qkv(c.num_heads, kv_heads, head_dim)
            self.qkv_proj = Linear(c.hidden_size, q_size + 2 * kv_size, split=split)
        self.attn = Gemma4AttentionLayer(c, layer_id, self.shared)
        self.o_proj = Linear(q_size, c.hidden_size, split=Split.even(1, q_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared:
            return self.o_proj(self.attn(self.query_proj(x), None, None))
        if self.k_eq_v:
            k = self.key_proj(x)
            return self.o_proj(self.attn(self.query_proj(x), k, k))
        a = self.attn
        sizes = [a.num_heads * a.head_dim] + [a.num_kv_heads * a.head_dim] * 2
        return self.o_proj(self.attn(*self.qkv_proj(x).split(sizes, dim=-1)))


class Gemma4Router(nn.Module):
    """Top-k experts per token from the normalised, scaled residual stream; the weights
    renormalised, then scaled per expert."""

    def __init__(self, hidden_size: int, moe: MoEConfig, eps: float) -> None:
        super().__init__()
        self.norm = UnscaledRMSNorm(hidden_size, eps)
        self.proj = Linear(hidden_size, moe.num_experts)
        self.scale = nn.Parameter(torch.empty(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts))
        self.top_k, self.root = moe.top_k, hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [tokens, top_k]."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        weights, experts = torch.topk(torch.softmax(scores, -1, dtype=torch.float), self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class GeluExperts(Experts):
    """The stacked experts of layers/moe.py with Gemma's GELU-tanh between gate and up."""

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if use_fused_moe(x):  # the fused kernel's two grouped GEMMs (kernels/moe.py)
            from minisgl.kernels.moe import group_by_expert, grouped_gemm

            tokens, top_k = experts.shape
            num_experts, pairs = self.gate_up_proj.size(0), experts.numel()
            groups = group_by_expert(experts, num_experts, 16 if pairs <= 16 * num_experts else 64)
            h = grouped_gemm(x.contiguous(), self.gate_up_proj, groups, pairs, None, 64, 64)
            h, w = gelu_and_mul(h), weights.flatten().contiguous()
            y = grouped_gemm(h, self.down_proj, groups, pairs, w, 64, 64)
            return y.view(tokens, top_k, -1).sum(1)  # each token's top_k outputs added
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():  # the reference: a loop over chosen experts
            token, slot = torch.where(experts == expert)
            h = gelu_and_mul(F.linear(x[token], self.gate_up_proj[expert]))
            h = F.linear(h, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, h)
        return out


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c, g = config, config.gemma4
        assert g is not None
        self.self_attn = Gemma4Attention(c, layer_id)
        wide = 2 if g.double_wide_mlp and self.self_attn.shared else 1
        self.mlp = Gemma3MLP(c.hidden_size, wide * c.intermediate_size)
        norm = (c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = Gemma4RMSNorm(*norm)
        self.post_attention_layernorm = Gemma4RMSNorm(*norm)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(*norm)
        self.post_feedforward_layernorm = Gemma4RMSNorm(*norm)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.has_moe = c.moe is not None
        if c.moe is not None:  # routed experts beside the dense MLP, each with its norms
            self.router = Gemma4Router(c.hidden_size, c.moe, c.rms_norm_eps)
            self.experts = GeluExperts(c.moe.num_experts, c.hidden_size, c.moe.intermediate_size)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(*norm)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(*norm)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(*norm)
        if g.per_layer_dim:  # the per-layer embedding's gate and projection back
            self.per_layer_input_gate = Linear(c.hidden_size, g.per_layer_dim)
            self.per_layer_projection = Linear(g.per_layer_dim, c.hidden_size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(*norm)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after this layer; `per_layer`: the layer's PLE vectors."""
        h = self.self_attn(self.input_layernorm(x))
        x, h = self.norm_add(
            h, x, self.post_attention_layernorm, then=self.pre_feedforward_layernorm
        )
        h = self.mlp(h)
        if self.has_moe:
            weights, experts = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), experts, weights.to(x.dtype))
            routed = all_reduce(routed)  # each rank held a slice of every expert
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        last = self.layer_scalar if per_layer is None else None  # the layer's end
        x, _ = self.norm_add(h, x, self.post_feedforward_layernorm, scale=last)
        if per_layer is not None:
            h = self.per_layer_projection(self.mlp.act(self.per_layer_input_gate(x), per_layer))
            x, _ = self.norm_add(h, x, self.post_per_layer_input_norm, scale=self.layer_scalar)
        return x

    def norm_add(
        self, y: torch.Tensor, x: torch.Tensor, norm: Gemma4RMSNorm,
        scale: torch.Tensor | None = None, then: Gemma4RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """x + norm(y), times `scale` if given; and `then`'s norm of that, if given."""
        x = x + norm(y)
        if scale is not None:
            x = x * scale
        return x, then(x) if then is not None else None

    def install_kernels(self, plan: KernelPlan) -> None:
        """Where fused kernels run, `norm_add` is one Triton kernel (kernels/gemma_norm.py)
        instead of three to five torch ones; elsewhere, the torch code above."""
        self.norm_add = MethodType(Gemma4DecoderLayer.norm_add, self)
        if not plan.fused:
            return
        try:  # triton may be missing
            from minisgl.kernels.gemma_norm import gemma_norm_add
        except ImportError:
            return

        def fused(y, x, norm, scale=None, then=None):
            nw = then.weight if then is not None else None
            return gemma_norm_add(y, x, norm.weight, norm.eps, scale, nw)

        self.norm_add = fused


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, g = config, config.gemma4
        assert g is not None
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        self.embed_scale = c.hidden_size**0.5
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.first_shared = c.num_layers - g.kv_shared_layers if g.kv_shared_layers else -1
        self.per_layer_dim = g.per_layer_dim
        if g.per_layer_dim:  # one table of num_layers vectors per token, and a projection
            width = c.num_layers * g.per_layer_dim
            self.embed_tokens_per_layer = VocabEmbedding(g.per_layer_vocab, width)
            self.per_layer_model_projection = Linear(c.hidden_size, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.per_layer_dim, c.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_dim else None
        for i, layer in enumerate(self.layers):
            if i == self.first_shared and (rows := last_rows_only(get_global_ctx())) is not None:
                x = x[rows]  # from here on each request's last token alone
                per_layer = per_layer[rows] if per_layer is not None else None
            x = layer(x, per_layer[:, i] if per_layer is not None else None)
        return self.norm(x)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, per_layer_dim]: the token's own vectors (scaled by sqrt(dim))
        and a normalised projection of its embedding, averaged in norm (times 1/sqrt(2))."""
        shape = (x.size(0), len(self.layers), self.per_layer_dim)
        own = self.embed_tokens_per_layer(input_ids)
        own = own * torch.tensor(self.per_layer_dim**0.5, dtype=x.dtype)
        mixed = self.per_layer_model_projection(x) * x.size(-1) ** -0.5
        mixed = self.per_layer_projection_norm(mixed.view(shape))
        return (mixed + own.view(shape)) * 2**-0.5


class Gemma4ForCausalLM(BaseLLMModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = Gemma4Model(config)
        cap = config.final_logit_softcapping
        self.lm_head = SoftCappedLMHead(config.vocab_size, config.hidden_size, cap)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self) -> torch.Tensor:
        batch = get_global_ctx().batch  # the KV-shared layers may narrow its views: put back
        views = batch.positions, batch.attn_metadata, getattr(batch, "window_metadata", None)
        try:
            return self.lm_head(self.model(batch.input_ids))
        finally:
            batch.positions, batch.attn_metadata = views[:2]
            if views[2] is not None:
                batch.window_metadata = views[2]  # type: ignore[attr-defined]

    def checkpoint_name(self, name: str) -> str | None:
        """Our name of a checkpoint tensor (models/families.text_model_name asks): a K=V or
        KV-shared layer keeps q_proj (and k_proj) apart, under names the loader does not
        merge into qkv_proj; a KV-shared layer loads no k/v projection or norm (None)."""
        m = _ATTN.match(name)
        if m is None:
            return name
        attn: Gemma4Attention = self.model.layers[int(m[1])].self_attn
        if attn.shared and m[2] != "q_proj":
            return None
        if attn.shared or attn.k_eq_v:
            name = name.replace(".q_proj.", ".query_proj.").replace(".k_proj.", ".key_proj.")
        return name


def last_rows_only(ctx: Any) -> torch.Tensor | None:
    """Where a prefill's remaining layers (the KV-shared ones) need only each request's last
    token: its row in the batch's tokens, with the batch's positions and attention metadata
    narrowed to those rows (a decode over the K/V its earlier layers stored); None where
    every row must go on. The logits are the last tokens' anyway, and a KV-shared layer
    stores nothing a later token reads. Not where prompt log-probabilities want every row,
    nor inside a graph (its capture is of every row; a replay reads no Python), nor for a
    padded batch's empty requests, nor where a backend has no decode view (FlashInfer)."""
    batch = ctx.batch
    if not batch.is_prefill or batch.logit_rows is not None or batch.graphed:
        return None
    if ctx.breakable is not None or (
        batch.input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        return None
    lens = [r.extend_len for r in batch.padded_reqs]
    if min(lens) < 1 or max(lens) == 1:  # an empty filler; or one token each already
        return None
    md, wmd = batch.attn_metadata, getattr(batch, "window_metadata", None)
    narrow, wnarrow = md.last_rows(), wmd.last_rows() if wmd is not None else None
    if narrow is None or (wmd is not None and wnarrow is None):
        return None
    rows = md.get_last_indices()
    batch.positions, batch.attn_metadata = batch.positions[rows], narrow
    if wnarrow is not None:
        batch.window_metadata = wnarrow
    return rows


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text model of a Gemma 4 checkpoint; its vision and audio towers are not loaded."""
