"""Each role's conformance checks, run once per registered plugin that has the role (CPU,
the conformance suite's small real backbone): shapes, dtypes and determinism of what the
role's members return, as the engine uses them. Then: the roles' table on
docs/writing-a-plugin.md is the one rendered from the protocols, and a plugin written with
one class's hooks keeps working through the adapter, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.components.losses import LOSSES
from harness.config.protocol_files import load_protocol
from harness.engine.run.embedding import make_pair_scorer, make_reranker
from harness.engine.run.model import create_criterion
from harness.methods import (
    METHODS,
    ROLES,
    Explainer,
    FigureMaker,
    HeadOutput,
    HostReader,
    IdReranker,
    LossShaper,
    Method,
    PairExplainer,
    PairScorer,
    ProcessBound,
    Reranker,
    TrainsAsAnother,
    Tunable,
    list_methods,
)
from harness.methods.figures import FIGURE_TUPLES, FigureSet
from harness.methods.role_docs import BEGIN, END, role_table, with_role_table
from harness.methods.roles import gathered_rerank, loss_copies, loss_dim, role_members
from tests.methods.test_conformance import BATCH, EMB, IMAGE, build, images

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "writing-a-plugin.md"


def declares(cls: type, role: type) -> bool:
    """Whether ``cls`` has ``role``: it subclasses it, or has every member on the class."""
    return role in cls.__mro__ or all(hasattr(cls, m) for m in role_members(role))


def having(role: type) -> list[str]:
    """Every registered method whose class has ``role``."""
    return [n for n in list_methods() if declares(METHODS.get(n).cls, role)]


def test_every_role_is_taken_by_some_plugin_and_each_plugin_declares_its_roles():
    assert all(having(role) for role in ROLES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in list_methods():  # a registered plugin is never adapted
            assert all(
                role in METHODS.get(name).cls.__mro__
                for role in ROLES
                if declares(METHODS.get(name).cls, role)
            ), name


# ---------------------------------------------------------------------- training roles


@pytest.mark.parametrize("name", having(LossShaper))
def test_loss_shaper(name):
    model = build(name)
    head = model.head
    assert isinstance(head, LossShaper)
    assert loss_copies(head) >= 1 and 1 <= loss_dim(head) <= 4 * EMB
    supported = head.supported_losses
    assert supported is None or (supported and set(supported) <= set(LOSSES.list()))
    loss = "proxy_anchor" if supported is None or "proxy_anchor" in supported else supported[0]
    module = create_criterion(head, loss, num_classes=4)
    copies = list(module) if isinstance(module, nn.ModuleList) else [module]
    assert len(copies) == loss_copies(head)
    groups = head.loss_optimizer_groups(module, _optimizer_spec())
    again = head.loss_optimizer_groups(module, _optimizer_spec())
    ids = [id(p) for g in groups for p in g["params"]]
    assert ids == [id(p) for g in again for p in g["params"]] and len(ids) == len(set(ids))
    assert all(isinstance(g["lr"], float) and g["lr"] > 0 for g in groups)
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    assert trained <= set(ids) and not set(ids) & {id(p) for p in model.backbone.parameters()}


def _optimizer_spec():
    return load_protocol("roth2020").optimizer


@pytest.mark.parametrize("name", having(HostReader))
def test_host_reader(name):
    head = build(name).head
    assert isinstance(head, HostReader)
    reason = head.step_host_reads()
    assert isinstance(reason, str) and reason == build(name, seed=1).head.step_host_reads()


@pytest.mark.parametrize("name", having(ProcessBound))
def test_process_bound(name):
    entry = METHODS.get(name)
    assert issubclass(entry.cls, ProcessBound)
    reason = entry.cls.cross_process_refusal(entry.options())
    assert isinstance(reason, str) and reason == entry.cls.cross_process_refusal(entry.options())


@pytest.mark.parametrize("name", having(TrainsAsAnother))
def test_trains_as_another(name):
    entry = METHODS.get(name)
    assert issubclass(entry.cls, TrainsAsAnother)
    declared = entry.cls.trains_as(entry.options())
    if declared is not None:
        base, options = declared
        assert base in METHODS and base != name
        assert set(options) <= set(METHODS.get(base).options())


@pytest.mark.parametrize("name", having(Tunable))
def test_tunable(name):
    """The space names only the method's own options, the same seed suggests the same
    values, and the method builds and embeds with them."""
    entry = METHODS.get(name)
    assert issubclass(entry.cls, Tunable)

    def suggested() -> dict:
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
        return entry.cls.search_space(trial, embedding_size=EMB)

    params = suggested()
    assert set(params) <= set(entry.options()) and params == suggested()
    with torch.no_grad():
        out = build(name, **params).eval()(images())
    torch.testing.assert_close(out.embedding.norm(dim=-1), torch.ones(BATCH), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- evaluation roles


def _fields(name: str, **options):
    model = build(name, **options).eval()
    with torch.no_grad():
        out = model(images(1))
    return model.head, {f: out.field(f) for f in model.head.rerank_fields}


def _candidates(k: int = 3) -> np.ndarray:
    return np.stack([np.roll(np.arange(BATCH), -s)[:k] for s in range(1, BATCH + 1)])


@pytest.mark.parametrize("name", having(Reranker))
def test_reranker(name):
    """Q x K float32 scores, finite, the same on a second call, and permuted with the
    candidates."""
    head, fields = _fields(name, **_reranking(name))
    assert isinstance(head, Reranker) and head.rerank_fields and head.rerank_k >= 0
    rerank = make_reranker(head, fields, queries_per_call=3)
    cands = _candidates()
    scores = rerank(np.arange(BATCH), cands)
    assert scores.shape == (BATCH, 3) and scores.dtype == np.float32 and np.isfinite(scores).all()
    np.testing.assert_array_equal(scores, rerank(np.arange(BATCH), cands))
    flipped = rerank(np.arange(BATCH), np.ascontiguousarray(cands[:, ::-1]))
    np.testing.assert_allclose(flipped, scores[:, ::-1], rtol=1e-5, atol=1e-5)


def _reranking(name: str) -> dict:
    """Options under which the method re-ranks (AVSL ranks exhaustively by default)."""
    return {"rank": "rerank", "rerank_k": 3} if "rank" in METHODS.get(name).options() else {}


@pytest.mark.parametrize("name", having(IdReranker))
def test_id_reranker(name):
    """Its own scores from ids are those of its similarity on the gathered candidates."""
    head, fields = _fields(name)
    assert isinstance(head, IdReranker) and isinstance(head, Reranker)
    ids, cands = np.arange(BATCH), _candidates()
    with torch.no_grad():
        own = head.rerank_by_ids(fields, fields, ids, cands)
        gathered = gathered_rerank(head, fields, fields, ids, cands)
    assert own.shape == (BATCH, 3) and own.dtype.is_floating_point
    torch.testing.assert_close(own.float(), gathered.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", having(PairScorer))
def test_pair_scorer(name):
    """Q x G scores of every pair, finite, the same when the gallery comes in two chunks."""
    head, fields = _fields(name, **({"rank": "exhaustive"} if name.startswith("avsl") else {}))
    assert isinstance(head, PairScorer) and head.exhaustive_pairs
    score = make_pair_scorer(head, fields)
    full = score(np.arange(BATCH), np.arange(BATCH))
    assert full.shape == (BATCH, BATCH) and full.dtype == torch.float32
    assert torch.isfinite(full).all()
    halves = torch.cat([score(np.arange(BATCH), g) for g in np.split(np.arange(BATCH), 2)], 1)
    torch.testing.assert_close(halves, full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- explanation roles


@pytest.mark.parametrize("name", having(Explainer))
def test_explainer(name):
    model = build(name).eval()
    head = model.head
    assert isinstance(head, Explainer)
    x = torch.rand(BATCH, 3, *IMAGE)
    with torch.no_grad():
        out = model(x)
        maps, again = head.explain(x, out), head.explain(x, out)
    if maps is None:
        return
    assert maps.dim() == 4 and maps.shape[0] == BATCH and maps.shape[2:] == IMAGE
    assert maps.dtype.is_floating_point and torch.isfinite(maps).all()
    assert maps.min() >= 0 and maps.max() <= 1
    torch.testing.assert_close(maps, again, rtol=0, atol=0)


@pytest.mark.parametrize("name", having(PairExplainer))
def test_pair_explainer(name):
    model = build(name).eval()
    head = model.head
    assert isinstance(head, PairExplainer)
    with torch.no_grad():
        q, g = model(images(2)[:3]), model(images(3)[:3])
        same = torch.tensor([True, False, True])
        maps, again = head.pair_maps(q, g, same), head.pair_maps(q, g, same)
    assert (maps is not None) == head.explains_pairs
    if maps is None or again is None:
        return
    for m, m2 in zip(maps, again, strict=True):
        assert m.dim() == 3 and m.shape[0] == 3 and m.dtype.is_floating_point
        assert torch.isfinite(m).all() and (m >= 0).all()
        torch.testing.assert_close(m, m2, rtol=0, atol=0)


@pytest.mark.parametrize("name", having(FigureMaker))
def test_figure_maker(name):
    model = build(name).eval()
    head = model.head
    assert isinstance(head, FigureMaker)
    assert head.figure_tuples and set(head.figure_tuples) <= set(FIGURE_TUPLES)
    sizes = {"pair": 2, "triplet": 3}
    for kind in head.figure_tuples:
        pictures = list(torch.rand(sizes[kind], 3, *IMAGE, generator=torch.Generator()))
        with torch.no_grad():
            out = model(torch.stack(pictures))
            figures = head.figures(kind, pictures, [out.select(i) for i in range(len(pictures))])
        assert figures is None or (isinstance(figures, FigureSet) and figures.figures)


# ---------------------------------------------------------------------- the roles' table


def test_the_roles_table_on_the_plugin_page_is_rendered_from_the_protocols():
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(BEGIN) == page.count(END) == 1
    assert with_role_table(page) == page, (
        "docs/writing-a-plugin.md's roles table is stale: nox -s docs"
    )
    table = role_table()
    for role in ROLES:
        assert f"| `{role.__name__}` |" in table
        for member in role_members(role):
            assert f"`{member}" in table, (role.__name__, member)


def test_the_table_check_can_fail():
    page = PAGE.read_text(encoding="utf-8")
    stale = page.replace("| `Reranker` | `rerank_fields` |", "| `Reranker` | `fields` |")
    assert stale != page and with_role_table(stale) != stale


# ---------------------------------------------------------------------- the adapter


def test_a_head_written_with_one_class_hooks_is_adapted_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"Declare them instead.*Reranker, PairExplainer"):

        class OneClassHead(Method):
            """Re-ranking and pair maps written on ``Method`` itself."""

            rerank_fields = ("embedding",)

            def __init__(self, *, channels, embedding_size):
                super().__init__(channels=channels, embedding_size=embedding_size)
                self.project = nn.Linear(self.in_channels, embedding_size)
                self.rerank_k = 2

            def embed(self, maps):
                pooled = maps[-1].mean(dim=(2, 3))
                return HeadOutput(embedding=F.normalize(self.project(pooled), dim=-1))

            def rerank_similarity(self, query, candidates):
                return (query["embedding"][:, None] * candidates["embedding"]).sum(-1)

            def pair_maps(self, query, gallery, same):
                return None

    head = OneClassHead(channels={"s32": 8}, embedding_size=4)
    assert isinstance(head, Reranker) and isinstance(head, PairExplainer)
    assert head.explains_pairs and head.rerank_k == 2  # the role's default fills explains_pairs
    assert not isinstance(head, PairScorer) and not isinstance(head, Explainer)
    fields = {"embedding": F.normalize(torch.randn(5, 4), dim=-1)}
    scores = make_reranker(head, fields)(np.arange(5), np.array([[1, 2]] * 5))
    expected = (fields["embedding"][:, None] * fields["embedding"][[1, 2]][None]).sum(-1)
    np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-6)


def test_a_head_that_declares_its_roles_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)

        class Declared(Method, Reranker):
            def embed(self, maps):
                raise NotImplementedError

    assert isinstance(Declared(channels={"s32": 8}, embedding_size=4), Reranker)
