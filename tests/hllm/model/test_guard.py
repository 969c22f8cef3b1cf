"""The domain guard: a slate whose states lie far from the training data keeps the first-stage order."""

import math

import numpy as np
import pytest
import torch

from hllm.model.heads import HeadConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.train.head_fit import (StateSlate, fit_guard, guard_distances, guard_trust, guard_statistics, ridge_utility,
                                 set_utility, state_orders)

from conftest import TINY


def guarded_ranker(positions: int = 8) -> SinglePassRanker:
    return SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=positions, prior="logrank", guard="distance", guard_rank=4))).eval()


def slates_like(splits, scale: torch.Tensor, shift: float = 0.0, seed: int = 0) -> list[StateSlate]:
    """Each slate's states: anisotropic Gaussian (sd `scale` per dimension) plus `shift`, the item's grade
    written into dimension 0 (so a probe learns to reorder)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in splits:
        x = torch.randn(len(s.candidates), scale.numel(), generator=g) * scale + shift
        x[:, 0] += 2 * torch.tensor([float(g or 0) for g in (s.grades or [0] * len(s.candidates))])
        out.append(StateSlate(s, x))
    return out


@pytest.fixture
def fitted(small_splits):
    ranker = guarded_ranker()
    scale = torch.linspace(0.2, 2.0, 32)
    train = slates_like(small_splits["train"], scale)
    set_utility(ranker, *ridge_utility(train, lam=1.0), 0.5)
    return ranker, scale, train, fit_guard(ranker, train, k=4)


def test_an_unfitted_guard_trusts_every_slate(small_splits):
    ranker = guarded_ranker()
    items = slates_like(small_splits["train"], torch.ones(32), shift=50.0)
    assert (guard_trust(ranker, items) == 1).all()
    set_utility(ranker, *ridge_utility(items, lam=1.0), 0.5)
    plain = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=8, prior="logrank"))).eval()
    plain.head.load_state_dict({k: v for k, v in ranker.head.state_dict().items() if not k.startswith("guard.")})
    assert state_orders(ranker, items) == state_orders(plain, items)


def test_thresholds_come_from_the_training_slates_held_out(fitted, small_splits):
    ranker, scale, train, record = fitted
    assert record["guard_low"] == record["guard_heldout_max"] > record["guard_heldout_median"] > 0
    assert record["guard_high"] == pytest.approx(2 * record["guard_low"] - record["guard_heldout_median"], rel=1e-5)
    # fitted on every training slate, each of them lies within the held-out maximum: all trusted
    assert (guard_distances(ranker, train) <= record["guard_low"]).all() and (guard_trust(ranker, train) == 1).all()
    # new slates from the same distribution: trusted (almost) always
    fresh = slates_like(small_splits["test"] + small_splits["val"], scale, seed=7)
    assert guard_trust(ranker, fresh).mean() > 0.9


def test_a_far_slate_keeps_the_first_stage_order_and_the_unguarded_head_would_not(fitted, small_splits):
    ranker, scale, train, _ = fitted
    far = slates_like(small_splits["test"], scale * 4, seed=3)  # the same data, spread four times wider
    assert (guard_trust(ranker, far) == 0).all()
    first_stage = [list(range(len(i.slate.candidates))) for i in far]
    assert state_orders(ranker, far) == first_stage
    guard = ranker.head.guard
    low = float(guard.low)
    with guard.suspended():
        assert state_orders(ranker, far) != first_stage
        assert math.isinf(float(guard.low))
    assert float(guard.low) == low  # restored


def test_partial_trust_scales_the_residual_between_the_thresholds(fitted, small_splits):
    ranker, scale, train, record = fitted
    guard = ranker.head.guard
    item = slates_like(small_splits["test"][:1], scale, seed=5)[0]
    d = float(guard_distances(ranker, [item])[0])
    guard.low.fill_(d / 2)
    guard.high.fill_(d * 3 / 2)  # d halfway between: trust 0.5
    assert guard_trust(ranker, [item])[0] == pytest.approx(0.5, abs=1e-5)
    x, mask = item.states[None], torch.ones(1, len(item.states), dtype=torch.bool)
    with torch.no_grad():
        half = ranker.score_states(x, mask)
        with guard.suspended():
            whole = ranker.score_states(x, mask)
        guard.low.fill_(0.0)
        guard.high.fill_(d / 2)
        prior_only = ranker.score_states(x, mask)  # trust 0
    torch.testing.assert_close(half - prior_only, 0.5 * (whole - prior_only), rtol=1e-4, atol=1e-5)


def test_the_guard_is_saved_and_loaded_with_the_head(fitted, small_splits, tmp_path):
    ranker, scale, train, _ = fitted
    ranker.save(tmp_path / "m")
    loaded = SinglePassRanker.load(tmp_path / "m")
    for name, value in ranker.head.guard.state_dict().items():
        torch.testing.assert_close(loaded.head.guard.state_dict()[name], value)
    items = slates_like(small_splits["test"], scale * 3, seed=1) + slates_like(small_splits["test"], scale, seed=2)
    assert state_orders(loaded, items) == state_orders(ranker, items)
    np.testing.assert_array_equal(guard_trust(loaded, items), guard_trust(ranker, items))


def test_the_statistics_are_the_training_states_principal_directions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 6, generator=g) * torch.tensor([5.0, 3.0, 1.0, 1.0, 1.0, 1.0]) + 2.0
    stats = guard_statistics([x[:2000], x[2000:]], rank=2)
    torch.testing.assert_close(stats["mean"], torch.full((6,), 2.0), atol=0.2, rtol=0)
    torch.testing.assert_close(stats["basis"].abs(), torch.eye(6)[:2], atol=0.05, rtol=0)  # the two widest axes
    torch.testing.assert_close(1 / stats["inv_var"], torch.tensor([25.0, 9.0]), rtol=0.1, atol=0)
    assert 1 / float(stats["inv_rest"]) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("kwargs,match", [({"guard": "distance"}, "needs a head.prior"),
                                          ({"guard": "distance", "prior": "rank", "guard_rank": 0}, "guard_rank")])
def test_bad_guard_configs_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeadConfig(**kwargs)


def test_fit_guard_needs_a_guarded_head(small_splits):
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=8, prior="logrank"))).eval()
    with pytest.raises(ValueError, match="no domain guard"):
        fit_guard(ranker, slates_like(small_splits["train"], torch.ones(32)), k=3)


def test_a_prompt_that_shows_less_of_each_passage_than_training_did_keeps_the_input_order(fitted, small_splits):
    from hllm.reranker import Reranker
    from hllm.train.head_fit import doc_budgets, guarded_orders

    ranker, scale, train, record = fitted
    guard = ranker.head.guard
    assert record["guard_min_doc_budget"] == min(doc_budgets(ranker, train)) == float(guard.min_doc_budget) > 2
    torch.manual_seed(0)
    with torch.no_grad():
        ranker.head.residual.net.weight.normal_(0, 10.0)  # a head with its own order on real states
        guard.low.fill_(math.inf)
        guard.high.fill_(math.inf)  # trust every distance: only the support decides
    reranker = Reranker(ranker)
    slate = small_splits["test"][0]
    query, docs = slate.query.text, [c.text for c in slate.candidates]
    ((full, trust_full), (cut, trust_cut)) = reranker.score_with_trust(
        [reranker.encode(query, docs, first_stage_order=True), reranker.encode(query, docs, max_doc_tokens=2, first_stage_order=True)])
    assert trust_full == 1.0 and trust_cut == 0.0
    assert reranker.decode(full).permutation.tolist() != list(range(len(docs)))
    assert reranker.decode(cut).permutation.tolist() == list(range(len(docs)))  # the prior alone: the input order
    # an undeclared order has no order to fall back to: the head's own ranking, the trust still says 0
    ((free_cut, trust_free),) = reranker.score_with_trust([reranker.encode(query, docs, max_doc_tokens=2)])
    assert trust_free == 0.0 and reranker.decode(free_cut).permutation.tolist() != list(range(len(docs)))
    # the recipe's orders over cached states follow the same rule
    item = slates_like([slate], scale)[0]
    assert guarded_orders(ranker, [item]) == state_orders(ranker, [item])  # its own prompt: within the support
    with torch.no_grad():
        guard.min_doc_budget.fill_(10_000)
    assert guarded_orders(ranker, [item]) == [list(range(len(docs)))]
    assert guard_trust(ranker, [item]).tolist() == [0.0]
