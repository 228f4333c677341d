"""The run's items (:func:`load_items`), and a deterministic prompt loader whose position is
exact: one integer, the prompts handed out.

Epoch ``e`` visits every item once, in an order that depends only on ``(seed, e)``, so the
prompt at any position can be recomputed after a restart from the position alone (AReaL
saves the producer's read position of a torch dataloader, which in async mode runs ahead of
what was trained and skips buffered prompts on resume; here the coordinator re-queues those
itself, see :mod:`areal_grpc.coordinator.pool`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from areal_grpc.config import RunConfig
from areal_grpc.data import load_file
from areal_grpc.errors import FieldError
from areal_grpc.tasks import task_dataset

__all__ = ["Prompt", "PromptLoader", "load_items"]


@dataclass(frozen=True)
class Prompt:
    """One prompt handed out: its global position, epoch, index in the split, and the item."""

    seq: int
    epoch: int
    index: int
    item: dict[str, Any]


class PromptLoader:
    """Cycles over ``items`` forever, reshuffled per epoch when ``shuffle`` is set."""

    def __init__(
        self, items: Sequence[Mapping[str, Any]], shuffle: bool = True, seed: int = 0
    ) -> None:
        if not items:
            raise FieldError("data", "the train split has no items")
        self.items = [dict(i) for i in items]
        self.shuffle = shuffle
        self.seed = seed
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """Item indices in the order epoch ``epoch`` visits them."""
        if epoch != self._order_epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                # A string seed hashes the same in every process (unlike hash()).
                random.Random(f"areal-loader:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def at(self, seq: int) -> Prompt:
        """The prompt at global position ``seq`` (without moving the loader)."""
        epoch, offset = divmod(seq, len(self.items))
        index = self.order(epoch)[offset]
        return Prompt(seq=seq, epoch=epoch, index=index, item=self.items[index])

    def next(self) -> Prompt:
        """The next prompt; advances the position by one."""
        prompt = self.at(self.position)
        self.position += 1
        return prompt

    def state_dict(self) -> dict[str, int]:
        """The position (everything needed to continue exactly)."""
        return {"position": self.position, "size": len(self.items), "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores :meth:`state_dict`; the split and seed must be the ones saved."""
        if int(state.get("size", len(self.items))) != len(self.items):
            raise FieldError(
                "dataloader.size",
                f"checkpoint was taken on {state['size']} items, this split has {len(self.items)}",
            )
        if int(state.get("seed", self.seed)) != self.seed:
            raise FieldError(
                "dataloader.seed", f"checkpoint seed {state['seed']} differs from {self.seed}"
            )
        position = int(state["position"])
        if position < 0:
            raise FieldError("dataloader.position", f"must be >= 0, got {position}")
        self.position = position


def load_items(cfg: RunConfig, split: str) -> list[dict[str, Any]]:
    """The items of ``split`` ("train" / "eval"): a built-in task, or JSONL / Parquet files."""
    if cfg.data.path is None:
        return task_dataset(cfg.data.task, split, cfg.model.seed)
    if split == "eval" and cfg.data.eval_path is not None:
        items, key = load_file(cfg.data.eval_path, "data.eval_path"), "eval"
    else:
        items, key = load_file(cfg.data.path, "data.path"), "train"
    for i, item in enumerate(items):
        item.setdefault("task", cfg.data.task)
        item.setdefault("id", f"{cfg.data.task}-{key}-{i}")
    if cfg.data.eval_path is not None:
        return items
    # One file and no held-out one: its first 10% is held out for eval (none when the file
    # is too small to spare any; eval then reuses the first item).
    n_eval = len(items) // 10
    if split == "eval":
        return items[: max(1, n_eval)]
    return items[n_eval:]
