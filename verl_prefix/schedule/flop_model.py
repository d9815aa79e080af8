"""The FLOP model of dense vs reuse: what the benches print beside every measured ratio and what the engine
logs per mini-batch as ``prefix/flops_saved_ratio``.

Counts the three costs that matter: linear layers (per token), attention score/value products (per
query-key pair) and the LM head (per token that gets logits). The naive token ratio
G(P+S)/(P+G*S) overstates the gain because the LM head and suffix-to-prefix attention do not shrink.

Sliding-window layers count the pairs their window keeps (query ``q`` sees ``min(q + 1, W)`` keys), in dense
and in reuse alike (a suffix query sees the prefix's last ``W - 1`` positions at most): the work a windowed
kernel does. A dense run whose kernel takes the window as an explicit mask computes every causal pair instead.

Recurrent (linear-attention) layers (Qwen3.5's gated delta-net) have no query-key pairs: per token they cost
their projections, the depthwise causal conv (``2 kernel`` per channel) and the state update and read, about
``8 d_k d_v`` per value head (decay, ``S^T k``, the rank-1 write, ``S^T q``): linear in the sequence length,
in dense and in reuse alike (reuse runs the prefix's once and starts each suffix from its state).

Under ``prefix_reuse.tree`` each trie node runs once, attending to its ancestors, and each row's tail runs
against its path (``tree_flops``, ``trie_spans``). ``batch_flops`` prices one mini-batch the way the engine ran
it. Forward FLOPs throughout: backward is about twice forward on both sides, so one ratio holds for an update
and for a forward-only pass. A vision encoder's work is the benches' (``verl_prefix.tools.flops``), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verl_prefix.schedule.grouping import BatchPlan, RowLayout
from verl_prefix.schedule.tree.trie import TrieNode


@dataclass(frozen=True)
class ModelShape:
    """The decoder dimensions the FLOP model prices a token and a query-key pair by."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # mixture of experts: layers routed through experts_per_token experts of expert_intermediate each
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # the window of each sliding-window layer (the other layers attend to every earlier key)
    windows: tuple[int, ...] = ()
    # recurrent (linear-attention) layers: no attention pairs; their per-token cost replaces q/k/v/o
    recurrent_layers: int = 0
    recurrent_per_token: float = 0.0  # forward FLOPs per token of one recurrent layer's mixer

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """The decoder's shape; a vision-language config's text config (its encoder: ``vision_encoder_flops``)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        layers = config.num_hidden_layers
        experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
        moe_layers = 0
        if experts:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense_only = set(getattr(config, "mlp_only_layers", None) or [])
            moe_layers = sum(1 for i in range(layers) if (i + 1) % step == 0 and i not in dense_only)
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            moe_layers=moe_layers,
            experts=experts,
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
            expert_intermediate=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size),
            windows=config_windows(config),
            recurrent_layers=len(recurrent_layer_indices(config)),
            recurrent_per_token=delta_net_per_token(config),
        )

    @property
    def linear_per_token(self) -> float:
        """Forward FLOPs of every decoder linear layer for one token (2 per multiply-add); an MoE layer
        counts its router and the experts the token is routed to."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        dense_mlp = 3 * self.hidden * self.intermediate
        moe_mlp = self.hidden * self.experts + 3 * self.hidden * self.expert_intermediate * self.experts_per_token
        dense_layers = self.layers - self.moe_layers
        attention_layers = self.layers - self.recurrent_layers
        mixers = 2.0 * attention_layers * (q_o + k_v) + self.recurrent_layers * self.recurrent_per_token
        return mixers + 2.0 * (dense_layers * dense_mlp + self.moe_layers * moe_mlp)

    @property
    def attention_per_pair(self) -> float:
        """Forward FLOPs of QK^T and AV for one (query, key) pair over all attention layers and heads."""
        return 4.0 * (self.layers - self.recurrent_layers) * self.heads * self.head_dim

    @property
    def attention_per_layer_pair(self) -> float:
        """Forward FLOPs of QK^T and AV for one (query, key) pair of one layer, all heads."""
        return 4.0 * self.heads * self.head_dim

    def attention_flops(self, queries_from: int, queries_to: int) -> float:
        """Attention FLOPs of queries at positions ``[queries_from, queries_to)`` of one causal sequence, each
        over every key its layer keeps (all earlier keys, or its window's), summed over layers."""
        full = self.layers - len(self.windows) - self.recurrent_layers
        pairs = full * (_causal_pairs(queries_to) - _causal_pairs(queries_from))
        pairs += sum(_window_pairs(queries_to, w) - _window_pairs(queries_from, w) for w in self.windows)
        return pairs * self.attention_per_layer_pair

    @property
    def head_per_token(self) -> float:
        return 2.0 * self.hidden * self.vocab


def config_windows(config: object) -> tuple[int, ...]:
    """The window of each sliding-window layer of an HF config: ``layer_types`` where the config has them
    (Gemma, GPT-OSS, Qwen2 with ``use_sliding_window``), else every layer (Mistral-style ``sliding_window``)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return ()
    types = getattr(config, "layer_types", None)
    if types is None:
        return (int(window),) * config.num_hidden_layers
    return tuple(int(window) for t in types if t == "sliding_attention")


def recurrent_layer_indices(config: object) -> list[int]:
    """The layers ``layer_types`` marks ``linear_attention`` (Qwen3.5 / Qwen3-Next gated delta-nets)."""
    types = getattr(config, "layer_types", None) or []
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def delta_net_per_token(config: object) -> float:
    """Forward FLOPs per token of one gated delta-net mixer: its projections (q/k/v/z, beta/a, out), the
    depthwise conv over q/k/v and the recurrence (``8 d_k d_v`` per value head); 0 without such layers."""
    if not recurrent_layer_indices(config):
        return 0.0
    hidden = config.hidden_size
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_heads, d_k, d_v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    value_dim = value_heads * d_v
    projections = 2.0 * hidden * (2 * key_dim + 2 * value_dim + 2 * value_heads) + 2.0 * value_dim * hidden
    conv = 2.0 * config.linear_conv_kernel_dim * (2 * key_dim + value_dim)
    return projections + conv + 8.0 * value_heads * d_k * d_v


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def _window_pairs(n: int, window: int) -> int:
    """Pairs the first ``n`` queries of a causal sequence keep under a ``window``: ``sum min(q + 1, W)``."""
    if n <= window:
        return _causal_pairs(n)
    return _causal_pairs(window) + (n - window) * window


def sequence_flops(shape: ModelShape, tokens: int) -> float:
    """Forward FLOPs of one sequence run whole, logits over every position (as verl computes them)."""
    return tokens * (shape.linear_per_token + shape.head_per_token) + shape.attention_flops(0, tokens)


def dense_flops(shape: ModelShape, prompt_len: int, response_lens: list[int]) -> float:
    """Forward FLOPs of the stock engine for one group (logits over every position, as verl computes)."""
    return sum(sequence_flops(shape, prompt_len + s) for s in response_lens)


def reuse_flops(shape: ModelShape, prompt_len: int, response_lens: list[int]) -> float:
    """Forward FLOPs of phases A and B for one group: the prefix once, each suffix against it."""
    prefix = prompt_len - 1
    total = prefix * shape.linear_per_token + shape.attention_flops(0, prefix)
    for s in response_lens:
        total += s * (shape.linear_per_token + shape.head_per_token)
        total += shape.attention_flops(prefix, prefix + s)  # each suffix query over the prefix and itself
    return total


def tree_flops(
    shape: ModelShape, nodes: Sequence[tuple[int, int]], tails: Sequence[tuple[int, int]], node_head_tokens: int
) -> float:
    """Forward FLOPs of a trie: each node's positions ``[start, end)`` once (linear layers, attention to the
    path before them), ``node_head_tokens`` node positions through the LM head (loss on shared tokens), and
    each row's tail ``[start, end)`` with its LM head."""
    total = sum((end - start) * shape.linear_per_token + shape.attention_flops(start, end) for start, end in nodes)
    total += node_head_tokens * shape.head_per_token
    for start, end in tails:
        total += (end - start) * (shape.linear_per_token + shape.head_per_token) + shape.attention_flops(start, end)
    return total


@dataclass(frozen=True)
class TrieSpans:
    """What a trie computes, as positions: its nodes' spans, each row's tail (positions it runs in phase B)
    and the node positions that run the LM head."""

    nodes: list[tuple[int, int]]
    tails: list[tuple[int, int]]
    node_head_tokens: int


def trie_spans(roots: Sequence[TrieNode]) -> TrieSpans:
    """The spans of the trie under ``roots``, lockstep fillers left out (zero-loss work of no row)."""
    nodes = [node for root in roots for node, _ in root.walk() if not node.filler]
    tails = [(n.end, span.length - 1) for n in nodes for span in n.hanging.values() if span.length - 1 > n.end]
    head = sum(n.end - n.logits_from for n in nodes if n.logits_from is not None)
    return TrieSpans([(n.start, n.end) for n in nodes], tails, head)


@dataclass(frozen=True)
class BatchFlops:
    """Forward FLOPs of one mini-batch: what the stock engine computes, and what the schedule computed."""

    dense: float
    schedule: float

    @property
    def saved_ratio(self) -> float:
        """Dense over schedule: 1 where everything ran dense."""
        return self.dense / self.schedule if self.schedule > 0 else 1.0


def batch_flops(
    shape: ModelShape,
    layout: RowLayout,
    plan: BatchPlan,
    roots: Sequence[TrieNode] | None = None,
    routed_last_token: bool = False,
) -> BatchFlops:
    """The mini-batch's FLOPs dense and as scheduled: each reuse group's prefix once and its suffixes against it
    (or, with ``roots``, the trie's nodes once and each row's tail), rows that fell back dense on both sides.
    ``routed_last_token``: each suffix also runs its last response token (the MoE aux loss on). Lockstep
    fillers are not the batch's work and are left out."""
    dense = schedule = 0.0
    for group in plan.groups:
        responses = [layout.response_lens[i] for i in group.rows]
        dense += dense_flops(shape, group.prompt_len, responses)
        if roots is None:
            schedule += reuse_flops(shape, group.prompt_len, responses)
        if routed_last_token:  # one more query per suffix, past its last log-prob position
            first = group.prefix_len
            schedule += sum(shape.linear_per_token + shape.attention_flops(first + s, first + s + 1) for s in responses)
    if roots is not None:
        spans = trie_spans(roots)
        schedule += tree_flops(shape, spans.nodes, spans.tails, spans.node_head_tokens)
    for i in plan.all_dense_rows:
        row = sequence_flops(shape, layout.prompt_lens[i] + layout.response_lens[i])
        dense += row
        schedule += row
    return BatchFlops(dense, schedule)


def flop_metrics(flops: BatchFlops, seconds: float) -> dict[str, float]:
    """The mini-batch's ``prefix/flops_*`` metrics and the dense time they imply: ``seconds`` (the schedule's
    measured time) times the saving, an estimate from the FLOP model, not a measurement. Totals go out beside
    the ratio so that their means over ranks and mini-batches (verl's reduction) still divide to the step's."""
    ratio = flops.saved_ratio
    return {
        "prefix/flops_dense": flops.dense,
        "prefix/flops_schedule": flops.schedule,
        "prefix/flops_saved_ratio": ratio,
        "prefix/est_dense_time_s": seconds * ratio,
    }
