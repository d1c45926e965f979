"""What every framework's ``plan_ranks`` checks first: the ranks' places, whether each has a GPU, and whether
``--split`` and ``--memory`` can be honoured there. Imports no framework."""

from __future__ import annotations

from ..budget import check_rank_request
from ..layout import RankLayout, RankPlace


def checked_places(
    layout: RankLayout, split: int | None, memory_mib: int | None, refused: dict[bool, str]
) -> tuple[tuple[RankPlace, ...], bool]:
    """``layout``'s places and whether each has a GPU, or :class:`ValueError`: ``refused[on_gpu]`` (``{split}`` and
    the rank count ``{n}`` filled in) where the framework cannot split there, else ``check_rank_request``'s."""
    places = layout.places
    on_gpu = all(p.gpu for p in places)
    if split is not None and on_gpu in refused:
        raise ValueError(refused[on_gpu].format(split=split, n=len(places)))
    check_rank_request(split, memory_mib, [p.gpu for p in places])
    return places, on_gpu
