"""The shape of a tree of drafts as `SpecConfig` spells it (`draft:d:tree`, `draft:tree=0,1,00`):
each node a path of the draft head's ranks, the default tree of a depth, and their checks. The
tree's drafting and verification are `eejax.decode.tree`."""

from __future__ import annotations

from eejax.errors import EejaxError

MAX_TREE_NODES = 15  # drafts in a tree: its verify pass scores them and the row's last token
MAX_TREE_RANK = 8  # a tree's branches take at most the draft head's 8 likeliest tokens


def default_tree(depth: int) -> tuple[tuple[int, ...], ...]:
    """`draft:D:tree`: the chain of the head's likeliest tokens to depth D, plus the 2nd likeliest
    first draft, the 2nd likeliest after the likeliest, and the likeliest after the 2nd (7 drafts
    at D = 4: the 7 nodes of depth <= 4 most often on the model's path, by the shipped SmolLM2
    head's teacher-forced ranks on the held-out rows)."""
    chain = tuple((0,) * j for j in range(1, depth + 1))
    return tuple(sorted(chain + ((1,),) + (((0, 1), (1, 0)) if depth >= 2 else ())))


def check_tree(tree) -> tuple[tuple[int, ...], ...]:
    """A tree of drafts as its nodes' rank paths (the path (0, 1): the head's 2nd likeliest token
    after its likeliest first draft), in lexicographic order (each node after its ancestors, the
    likeliest chain first, where a chain's drafts would sit); an EejaxError naming what is wrong."""
    try:
        paths = [tuple(p) for p in tree]
    except TypeError:
        raise EejaxError(f"a draft tree is a list of rank paths such as (0,), (1,), (0, 0), got {tree!r}") from None
    if not paths or len(paths) > MAX_TREE_NODES:
        raise EejaxError(f"a draft tree has 1 to {MAX_TREE_NODES} nodes, got {len(paths)}")
    for p in paths:
        if not p or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < MAX_TREE_RANK for r in p):
            raise EejaxError(f"draft tree node {p!r}: a path of ranks 0..{MAX_TREE_RANK - 1}, at least one")
    if len(set(paths)) != len(paths):
        raise EejaxError(f"draft tree nodes repeat: {sorted(p for p in set(paths) if paths.count(p) > 1)}")
    missing = sorted({p[:-1] for p in paths if len(p) > 1} - set(paths))
    if missing:
        raise EejaxError(f"draft tree nodes {missing} are missing: every node's parent is a node")
    return tuple(sorted(paths))
