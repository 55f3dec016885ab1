"""Figures as data: what a plugin's :meth:`~harness.methods.roles.FigureMaker.figures` returns
for the engine to draw (panels of images with heat maps, grid lines and labelled arrows)
and the data kept beside them. Part of the plugin contract: importable from
:mod:`harness.methods.base` as well."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FIGURE_TUPLES", "Panel", "Link", "FigureData", "FigureSet"]

#: The tuples of test images a method may explain in a figure
#: (:meth:`~harness.methods.roles.FigureMaker.figures`): ``"pair"``: a query and its nearest
#: neighbour among the other test images; ``"triplet"``: an anchor, another image of its
#: class and one of another class.
FIGURE_TUPLES = ("pair", "triplet")


@dataclass(frozen=True)
class Panel:
    """One picture of a figure. ``image``: 3 x H x W in [0, 1]; ``heat``: an h x w map (any
    range) that the engine resizes to the image (bilinear), min-max scales to [0, 1] and
    overlays; None draws the image alone."""

    image: torch.Tensor
    heat: torch.Tensor | None = None
    title: str = ""


@dataclass(frozen=True)
class Link:
    """An arrow from a point of one panel to a point of another, with a label at its end
    (DIML Fig. 5's flows). A point is ``(row, column, x, y)``: the panel, then x and y as
    fractions of its width and height."""

    start: tuple[int, int, float, float]
    end: tuple[int, int, float, float]
    colour: str
    label: str = ""


@dataclass(frozen=True)
class FigureData:
    """A figure as data: ``panels`` (rows of :class:`Panel`), a ``title``, a ``grid`` of
    G x G cell lines drawn over every panel (0: none) and :class:`Link` arrows. The engine
    writes it to ``<tuple kind><suffix>.png`` (``pair.png``, ``pair_fig6.png``)."""

    panels: tuple[tuple[Panel, ...], ...]
    title: str = ""
    suffix: str = ""
    grid: int = 0
    links: tuple[Link, ...] = ()


@dataclass(frozen=True)
class FigureSet:
    """What :meth:`~harness.methods.roles.FigureMaker.figures` returns: its figures and the data worth keeping beside
    them, each written by the engine next to the figures and logged with the run:
    ``records`` ``{suffix: JSON-able dict}`` -> ``<kind><suffix>.json``; ``arrays``
    ``{suffix: {name: tensor}}`` -> ``<kind><suffix>.npz``."""

    figures: tuple[FigureData, ...]
    records: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    arrays: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
