"""How many tokens a forward computes when sequences that share prefixes share them
(``trainer.prefix_sharing``): the nodes of the trie of their tokens."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["prefix_nodes"]


def prefix_nodes(sequences: Sequence[Sequence[int]]) -> int:
    """The nodes of the trie of ``sequences`` (each distinct prefix once).

    In sorted order each sequence adds what it does not share with the one before it: the
    longest prefix it shares with any other sequence is shared with a sorted neighbour.
    """
    total, previous = 0, ()
    for seq in sorted(tuple(s) for s in sequences):
        common = 0
        for a, b in zip(previous, seq, strict=False):
            if a != b:
                break
            common += 1
        total += len(seq) - common
        previous = seq
    return total
