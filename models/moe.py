"""Mixture-of-experts decoder (Mixtral style) in Flax NNX: Llama blocks with a routed MLP.

Each block's MLP is :class:`MoEMLP`: a linear ``router`` scores ``n_experts`` SwiGLU experts per
token, each token goes to its ``top_k`` experts, and each expert processes at most ``capacity``
tokens per sequence. Routing uses GShard/Switch dense dispatch and combine tensors
(Lepikhin et al. 2020, section 2.2; Fedus et al. 2021): static shapes, one-hot and cumsum only,
differentiable through the gates. The experts are stored as single stacked parameters
``w_gate, w_up [n_experts, d_model, d_ff]`` and ``w_down [n_experts, d_ff, d_model]`` applied with
einsums over the expert axis, so expert parallelism is a sharding of that leading axis.

``moe_impl`` chooses how the experts are computed once routing has decided which (token, expert)
pairs are kept: ``"dense"`` (the dispatch/combine einsums above), ``"ragged"`` (the kept pairs
sorted by expert, one ``jax.lax.ragged_dot`` per expert matrix, a scatter-add combine: no
``[experts, capacity]`` padding) or ``"pallas"`` (the same with
:func:`shardplan.kernels.grouped_matmul`). Routing and the capacity rule are shared, so the three
drop the same tokens and give the same outputs.

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from shardplan_models.config import load_model_config
    >>> model = MoE(load_model_config("moe-tiny"), rngs=nnx.Rngs(0))
    >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
    >>> logits.shape, aux.shape
    ((2, 16, 256), ())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from shardplan_models.common import INIT_STD, residual_init, to_dtype
from shardplan_models.config import MOE_IMPLS, MoEConfig, expert_capacity
from shardplan_models.llama import Llama, llama_attention, rms_norm

from shardplan.errors import ConfigError, format_error
from shardplan.kernels.grouped_matmul import grouped_matmul

__all__ = [
    "MoE",
    "MoEBlock",
    "MoEMLP",
    "expert_capacity",
    "load_balancing_loss",
    "sorted_experts",
]


def load_balancing_loss(router_probs: jax.Array, expert_mask: jax.Array) -> jax.Array:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4-6).

    ``n_experts * sum_e f_e * P_e`` where ``f_e`` is the fraction of routing assignments that
    chose expert ``e`` (before capacity drops; with top-k, each token makes ``k`` assignments)
    and ``P_e`` is the mean router probability of expert ``e``. It is 1.0 when either is uniform
    and grows to ``n_experts`` as routing collapses onto one expert.

    Args:
      router_probs: softmax router outputs ``[..., n_experts]``.
      expert_mask: assignments ``[..., n_experts]`` (1 where the token chose that expert).

    Returns:
      A float32 scalar.

    Example:
      >>> probs = jnp.full((6, 3), 1 / 3)
      >>> mask = jax.nn.one_hot(jnp.array([0, 0, 0, 0, 1, 2]), 3)
      >>> float(load_balancing_loss(probs, mask))
      1.0
    """
    n_experts = router_probs.shape[-1]
    mask = expert_mask.reshape(-1, n_experts).astype(jnp.float32)  # [tokens, experts]
    fraction = mask.sum(axis=0) / mask.sum()  # [experts]
    mean_prob = router_probs.reshape(-1, n_experts).astype(jnp.float32).mean(axis=0)  # [experts]
    return n_experts * jnp.sum(fraction * mean_prob)


def sorted_experts(
    x: jax.Array,
    chosen: jax.Array,
    gates: jax.Array,
    kept: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    *,
    matmul: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """SwiGLU experts on the kept (token, expert) pairs sorted by expert, with a grouped matmul.

    Dispatch: the ``batch * seq * top_k`` pairs are stably sorted by expert, dropped pairs last
    (they fall past ``sum(group_sizes)`` and get zero rows from ``matmul``); each pair's token row
    is gathered. Combine: each expert output row, weighted by its gate, is scatter-added back to
    its token. The sort keys are integers, so gradients flow through the gather, the grouped
    matmuls, the gates and the scatter-add only.

    Args:
      x: tokens ``[batch, seq, d_model]`` in the compute dtype.
      chosen: expert of each choice ``[batch, seq, top_k]`` (int).
      gates: weight of each choice ``[batch, seq, top_k]`` (float32).
      kept: whether the choice got a slot within its expert's capacity ``[batch, seq, top_k]``.
      weights: ``(w_gate, w_up [experts, d_model, d_ff], w_down [experts, d_ff, d_model])``.
      matmul: ``jax.lax.ragged_dot`` or :func:`shardplan.kernels.grouped_matmul`.

    Returns:
      ``[batch, seq, d_model]`` in ``x``'s dtype.
    """
    w_gate, w_up, w_down = weights
    batch, seq, d_model = x.shape
    n_experts, top_k = w_gate.shape[0], chosen.shape[-1]
    expert = jnp.where(kept, chosen, n_experts).reshape(-1)  # [pairs]; n_experts = dropped
    order = jnp.argsort(expert, stable=True)  # [pairs]
    token = order // top_k  # [pairs]: the flat (batch * seq) token of each sorted pair
    group_sizes = jax.nn.one_hot(expert, n_experts, dtype=jnp.int32).sum(axis=0)  # [experts]
    x_sorted = x.reshape(batch * seq, d_model)[token]  # [pairs, d_model]
    hidden = jax.nn.silu(matmul(x_sorted, w_gate, group_sizes))  # [pairs, d_ff]
    hidden = hidden * matmul(x_sorted, w_up, group_sizes)  # [pairs, d_ff]
    out = matmul(hidden, w_down, group_sizes)  # [pairs, d_model]; dropped pairs give 0
    weight = jnp.where(kept, gates, 0.0).reshape(-1)[order].astype(x.dtype)  # [pairs]
    y = jnp.zeros((batch * seq, d_model), x.dtype).at[token].add(out * weight[:, None])
    return y.reshape(batch, seq, d_model)


class MoEMLP(nnx.Module):
    """A top-k routed mixture of SwiGLU experts with capacity; dense or sorted (``moe_impl``).

    Routing groups are sequences: each expert takes at most :func:`expert_capacity` ``(seq)``
    tokens of each batch row. Slots are filled by priority (all tokens' first choices, in
    sequence order, then their second choices, ...; GShard). A token whose slot is past the
    capacity is dropped by that expert; a token dropped by all its experts gets a zero output
    and passes through the block's residual only. With ``top_k > 1`` the kept experts' outputs
    are weighted by the top-k probabilities renormalised to sum to 1 (Mixtral); with
    ``top_k == 1`` by the raw router probability (Switch).

    Args:
      d_model: width of the input and output.
      d_ff: hidden width of each expert.
      n_experts: number of experts.
      top_k: experts per token.
      capacity_factor: slack of the expert capacity over an even split.
      n_layers: depth of the model, for the residual-scaled init of ``w_down``.
      dtype: compute dtype; the router always computes in float32.
      param_dtype: parameter dtype.
      moe_impl: ``"dense"``, ``"ragged"`` or ``"pallas"`` (see the module docstring).
      rngs: random streams for initialisation.

    Example:
      >>> mlp = MoEMLP(64, 128, n_experts=4, top_k=2, capacity_factor=1.25, rngs=nnx.Rngs(0))
      >>> y, aux = mlp(jnp.ones((2, 8, 64)))
      >>> y.shape
      (2, 8, 64)
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_experts: int,
        top_k: int,
        capacity_factor: float,
        n_layers: int = 1,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        moe_impl: str = "dense",
        rngs: nnx.Rngs,
    ) -> None:
        if moe_impl not in MOE_IMPLS:
            raise ConfigError(format_error(
                "MoEMLP.moe_impl is not a known expert computation.", where="MoEMLP(moe_impl=...)",
                value=moe_impl, remedy=f"use one of {', '.join(MOE_IMPLS)}"))
        self.moe_impl = moe_impl
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.dtype = dtype
        # Routing decisions are discrete and sensitive to rounding: keep them in float32.
        self.router = nnx.Linear(
            d_model,
            n_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )
        normal = nnx.initializers.normal(INIT_STD)
        self.w_gate = nnx.Param(normal(rngs.params(), (n_experts, d_model, d_ff), param_dtype))
        self.w_up = nnx.Param(normal(rngs.params(), (n_experts, d_model, d_ff), param_dtype))
        self.w_down = nnx.Param(
            residual_init(n_layers)(rngs.params(), (n_experts, d_ff, d_model), param_dtype)
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Routes ``x [batch, seq, d_model]``; returns ``(y [batch, seq, d_model], aux_loss)``."""
        batch, seq, _ = x.shape
        n_experts, top_k = self.n_experts, self.top_k
        capacity = expert_capacity(
            seq, n_experts=n_experts, top_k=top_k, capacity_factor=self.capacity_factor
        )
        x = x.astype(self.dtype)

        router_probs = jax.nn.softmax(self.router(x.astype(jnp.float32)))  # [b, s, experts]
        gates, chosen = jax.lax.top_k(router_probs, top_k)  # [b, s, k] each
        if top_k > 1:
            gates = gates / gates.sum(axis=-1, keepdims=True)  # [b, s, k]
        choice = jax.nn.one_hot(chosen, n_experts, dtype=jnp.int32)  # [b, s, k, experts]
        aux_loss = load_balancing_loss(router_probs, choice.sum(axis=2))

        # Slot of each (token, choice) in its expert: a running count over the group, all
        # first choices before any second choice.
        by_rank = choice.transpose(0, 2, 1, 3).reshape(batch, top_k * seq, n_experts)
        slot = jnp.cumsum(by_rank, axis=1) - 1  # [b, k * s, experts]
        slot = slot.reshape(batch, top_k, seq, n_experts).transpose(0, 2, 1, 3)  # [b,s,k,e]
        kept = (choice == 1) & (slot < capacity)  # [b, s, k, experts]
        w_gate = jnp.asarray(self.w_gate[...], self.dtype)  # [experts, d_model, d_ff]
        w_up = jnp.asarray(self.w_up[...], self.dtype)  # [experts, d_model, d_ff]
        w_down = jnp.asarray(self.w_down[...], self.dtype)  # [experts, d_ff, d_model]
        if self.moe_impl != "dense":
            matmul = jax.lax.ragged_dot if self.moe_impl == "ragged" else grouped_matmul
            y = sorted_experts(x, chosen, gates, kept.any(axis=3), (w_gate, w_up, w_down),
                               matmul=matmul)
            return y, aux_loss
        # The top-k experts of a token are distinct, so summing over k picks the one choice.
        token_slot = jnp.where(kept, slot, 0).sum(axis=2)  # [b, s, experts]
        token_kept = kept.any(axis=2)  # [b, s, experts]
        token_gate = jnp.where(kept, gates[..., None], 0.0).sum(axis=2)  # [b, s, experts]

        dispatch = jax.nn.one_hot(token_slot, capacity, dtype=self.dtype)  # [b, s, e, capacity]
        dispatch = dispatch * token_kept[..., None].astype(self.dtype)  # [b, s, e, capacity]
        combine = dispatch * token_gate[..., None].astype(self.dtype)  # [b, s, e, capacity]

        expert_in = jnp.einsum("bsec,bsd->becd", dispatch, x)  # [b, e, capacity, d_model]
        hidden = jax.nn.silu(jnp.einsum("becd,edf->becf", expert_in, w_gate))
        hidden = hidden * jnp.einsum("becd,edf->becf", expert_in, w_up)  # [b, e, capacity, d_ff]
        expert_out = jnp.einsum("becf,efd->becd", hidden, w_down)  # [b, e, capacity, d_model]
        y = jnp.einsum("bsec,becd->bsd", combine, expert_out)  # [batch, seq, d_model]
        return y, aux_loss


class MoEBlock(nnx.Module):
    """A Llama block whose MLP is :class:`MoEMLP`; returns the layer's load-balancing loss."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = rms_norm(config, rngs=rngs)
        self.attn = llama_attention(config, rngs=rngs)
        self.mlp_norm = rms_norm(config, rngs=rngs)
        self.mlp = MoEMLP(
            config.d_model,
            config.d_ff,
            n_experts=config.n_experts,
            top_k=config.top_k,
            capacity_factor=config.capacity_factor,
            n_layers=config.n_layers,
            dtype=to_dtype(config.dtype),
            param_dtype=to_dtype(config.param_dtype),
            moe_impl=config.moe_impl,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Maps ``[batch, seq, d_model]`` to itself; also returns the load-balancing loss."""
        x = x + self.attn(self.attn_norm(x), (cos, sin))  # [batch, seq, d_model]
        y, aux_loss = self.mlp(self.mlp_norm(x))  # [batch, seq, d_model], []
        return x + y, aux_loss


class MoE(Llama):
    """A Mixtral-style decoder: ``tokens -> (logits [batch, seq, vocab], aux_loss)``.

    The same embedding, norms, rotary attention and head as :class:`~shardplan_models.llama.Llama`, with
    :class:`MoEBlock` blocks. ``aux_loss`` is the mean of the layers' load-balancing losses (1.0
    for perfectly balanced routing); the training loss adds ``config.aux_loss_coef`` times it.
    """

    block_type: ClassVar[Callable[..., nnx.Module]] = MoEBlock

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        super().__init__(config, rngs=rngs)
