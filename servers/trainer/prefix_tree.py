"""Shared prefixes computed once: the rows of a micro-batch packed as tries (AReaL's tree
training, https://github.com/areal-project/AReaL/blob/main/docs/en/reference/tree_training.md).

The rows of one group (a GRPO group's completions of one prompt; an agent session's
conversations, whose turns extend each other) become one trie over their token ids: a token
shared by several rows at the same place of the same prefix is one node. Each trie is one row
of the packed batch, its nodes in insertion order (a parent before its children); a node's
position is its depth, and it attends to its ancestors and itself only, through a boolean 4-D
attention mask. Every row's tokens then see exactly the keys, values and positions they see
in the unshared forward, so log-probs agree up to the order of floating-point sums, and
autograd gives a shared node the sum of its descendants' gradients.

A node's logits predict the next token of every row through it: each row's log-prob of its
token ``t`` is read from the logits of the node of its token ``t - 1``
(:meth:`Forest.forward`), so a prompt's last node serves the first completion token of
every row of its group, once through the vocabulary projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_grpc.model import masked_logits

__all__ = ["Forest", "attention_weight", "exact_for", "pack_forest", "sharing"]


@dataclass
class Forest:
    """A micro-batch's rows packed as tries, one trie per packed row."""

    input_ids: torch.Tensor  # [T, W] each node's token (padding: the pad id)
    position_ids: torch.Tensor  # [T, W] each node's depth (padding: 0)
    attention_mask: torch.Tensor  # [T, 1, W, W] bool: a node sees its ancestors and itself
    node_of: torch.Tensor  # [B, S] flat index (trie * W + node) of each real token, -1 else
    nodes: int  # real nodes, all tries
    tokens: int  # real tokens of the rows, unshared

    def forward(self, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward(keep)`` as ``masked_token_logprobs`` takes it: the logits of the rows'
        positions ``keep`` [B, S] (row-major, [N, V]), each computed once per node."""

        def run(keep: torch.Tensor) -> torch.Tensor:
            rows, cols = keep.nonzero(as_tuple=True)
            nodes = self.node_of[rows, cols]
            unique, inverse = torch.unique(nodes, return_inverse=True)
            kept = torch.zeros(self.input_ids.numel(), dtype=torch.bool, device=keep.device)
            kept[unique] = True
            logits = masked_logits(
                model,
                self.input_ids,
                self.attention_mask,
                kept.view(self.input_ids.shape),
                position_ids=self.position_ids,
            )
            return logits[inverse]

        return run


def exact_for(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether a packed forward of ``model`` equals its unshared one, and why not."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return False, f"attention {attn!r} takes no custom 4-D mask"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False, "sliding-window layers would see past their window"
    return True, ""


def sharing(setting: str, model: torch.nn.Module) -> tuple[bool, str]:
    """Whether a trainer packs shared prefixes under a ``trainer.prefix_sharing`` ``setting``
    ("auto", "on", "off") for ``model``, and why; ValueError for "on" where it is not exact."""
    if setting == "off":
        return False, "as set"
    exact, why = exact_for(model)
    if setting == "on" and not exact:
        raise ValueError(f"trainer.prefix_sharing: on is not exact for this model ({why})")
    if not exact:
        return False, f"auto: {why}"
    return True, "as set" if setting == "on" else "auto: exact for this model"


def attention_weight(model: torch.nn.Module) -> float:
    """What one (query, key) pair of attention costs against one token through a layer's
    matrices, in multiply-adds, from the model's config (0 when it does not say).

    A token costs about 2 h^2 + 2 h kv + 3 h i per layer (the q and o projections, k and v,
    the gated MLP; h hidden, kv the k/v width, i the MLP width); a pair about 2 h (q.k over
    every head, then p.v).
    """
    config = getattr(model, "config", None)
    h = getattr(config, "hidden_size", 0) or 0
    i = getattr(config, "intermediate_size", 0) or 4 * h
    heads = getattr(config, "num_attention_heads", 0) or 1
    kv = h * (getattr(config, "num_key_value_heads", None) or heads) // heads
    per_token = 2 * h * h + 2 * h * kv + 3 * h * i
    return 2 * h / per_token if per_token else 0.0


def pack_forest(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    trie_of: torch.Tensor | None = None,
    pad_token_id: int = 0,
    pair_cost: float = 0.0,
) -> Forest | None:
    """The right-padded rows ``input_ids`` [B, S] packed as tries, rows of one ``trie_of``
    value [B] sharing one (all rows one trie when None).

    None when a row is not right-padded (its positions would not be its depths), or when
    the packed batch [T, W] would cost no less than the rows [B, S]: each padded slot costs
    one token through the layers plus ``pair_cost`` per key it attends over (W or S; the
    attention runs over the whole width, masked or not), so long rows that share little are
    cheaper apart.
    """
    lengths = attention_mask.sum(dim=1)
    width = input_ids.shape[1]
    steps = torch.arange(width, device=attention_mask.device)
    if not bool((attention_mask.bool() == (steps[None, :] < lengths[:, None])).all()):
        return None
    ids = input_ids.tolist()
    lens = lengths.tolist()
    keys = trie_of.tolist() if trie_of is not None else [0] * len(ids)
    order: dict[int, int] = {}
    tries: list[tuple[list[int], list[int]]] = []  # (tokens, parents) per trie
    children: list[dict[tuple[int, int], int]] = []
    local: list[list[int]] = []  # per row: node index within its trie, per token
    trie_index: list[int] = []
    for row, key in enumerate(keys):
        t = order.setdefault(int(key), len(tries))
        if t == len(tries):
            tries.append(([], []))
            children.append({})
        tokens, parents = tries[t]
        kids = children[t]
        parent = -1
        path = []
        for token in ids[row][: lens[row]]:
            node = kids.get((parent, token))
            if node is None:
                node = kids[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            path.append(node)
            parent = node
        local.append(path)
        trie_index.append(t)
    w = max((len(tok) for tok, _ in tries), default=0) or 1
    if len(tries) * w * (1 + pair_cost * w) >= len(ids) * width * (1 + pair_cost * width):
        return None
    device = input_ids.device
    packed = torch.full((len(tries), w), pad_token_id, dtype=input_ids.dtype)
    positions = torch.zeros(len(tries), w, dtype=torch.int64)
    mask = torch.zeros(len(tries), 1, w, w, dtype=torch.bool)
    for t, (tokens, parents) in enumerate(tries):
        n = len(tokens)
        packed[t, :n] = torch.tensor(tokens, dtype=input_ids.dtype)
        seen = mask[t, 0]
        seen[torch.arange(w), torch.arange(w)] = True  # padding sees itself (no empty row)
        # Parents come before their children: one pass in order gives every depth and
        # every ancestor set.
        depth = [0] * n
        for node, p in enumerate(parents):
            if p >= 0:
                depth[node] = depth[p] + 1
                seen[node] |= seen[p]
        positions[t, :n] = torch.tensor(depth, dtype=torch.int64)
    node_of = torch.full(tuple(input_ids.shape), -1, dtype=torch.int64)
    for row, path in enumerate(local):
        if path:
            node_of[row, : len(path)] = torch.tensor(path) + trie_index[row] * w
    return Forest(
        input_ids=packed.to(device),
        position_ids=positions.to(device),
        attention_mask=mask.to(device),
        node_of=node_of.to(device),
        nodes=sum(len(tok) for tok, _ in tries),
        tokens=int(sum(lens)),
    )
