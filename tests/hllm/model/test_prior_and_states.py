"""The first-stage prior, the cut backbone, cached item states and the head trained on them."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from hllm.model.decoding import DECODERS
from hllm.model.heads import HeadConfig, rank_prior
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.reranker import Reranker
from hllm.train.head_fit import StateSlate, fit_head, score_state_slates, state_orders, sub_slate
from hllm.train.loop import LossConfig, TrainConfig
from hllm.train.state_cache import StaleStates, cached_states, states_key

from conftest import TINY


def build(prior="rank", kind="attention", k=8, mode="frozen", layer=None):
    cfg = RankerConfig(model=TINY, adapt=AdaptConfig(mode=mode, lora_r=4, lora_alpha=8), state_layer=layer,
                       head=HeadConfig(kind=kind, positions=k, width=32, num_heads=2, prior=prior))
    return SinglePassRanker.build(cfg).eval()


@pytest.mark.parametrize("prior,kind,k", [("rank", "attention", 8), ("rank", "attention", 3), ("rank", "linear", 8),
                                          ("rank", "scalar", 8), ("logrank", "utility", 8), ("logrank", "utility", 3),
                                          ("logrank", "attention", 8)])
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_an_untrained_prior_head_returns_the_input_order_exactly(prior, kind, k, decoder, small_splits):
    reranker = Reranker(build(prior=prior, kind=kind, k=k), decoder=decoder)
    slates = copy.deepcopy(small_splits["test"][:4])
    slates[1].candidates = slates[1].candidates[:5]  # padded in the batch
    for slate, matrix in zip(slates, reranker.score_slates(slates)):
        assert reranker.decode(matrix).permutation.tolist() == list(range(len(slate.candidates)))
    long = [f"document {i}" for i in range(30)]  # N > K, and windows: still the input order
    assert [d.index for d in Reranker(build(prior=prior, kind=kind, k=k), window=8, stride=4).rank(
        "q", long, first_stage_order=True)] == list(range(30))


def test_the_rank_prior_has_the_input_order_as_its_unique_optimum():
    from itertools import permutations
    prior = rank_prior(5, 5).numpy()
    scores = {p: sum(prior[i, r] for r, i in enumerate(p)) for p in permutations(range(5))}
    best = max(scores, key=scores.get)
    assert best == (0, 1, 2, 3, 4) and sorted(scores.values())[-2] < scores[best]


def test_a_trained_prior_head_moves_off_the_input_order(small_splits):
    ranker = build()
    states = cached_items(ranker, small_splits["train"][:16])
    fit_head(ranker, states, [], TrainConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=2), LossConfig({"graded_ce": 1.0}), rel=2)
    orders = state_orders(ranker, states)
    assert any(o != list(range(len(o))) for o in orders)


def cached_items(ranker, slates, tmp=None):
    from hllm.train.state_cache import compute_states
    return [StateSlate(s, x) for s, x in zip(slates, compute_states(ranker, slates, batch_size=4))]


def test_cut_backbone_reads_the_states_after_that_layer(tiny_backbone, small_splits):
    full, cut = build(), build(layer=1)
    assert len(cut.body.layers) == 1 and len(full.body.layers) == TINY.layers
    slate = small_splits["test"][0]
    batch = Reranker(full).tensors([full.prompts.encode(slate, with_answer=False)])
    with torch.no_grad():
        hidden = full.body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=True).hidden_states[1]  # (1, T, D) after layer 1
        want = full.body.norm(hidden[0, batch["item_positions"][0]])
        got = cut.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="state_layer"):
        build(layer=TINY.layers + 1)


def test_cut_prior_ranker_saves_and_loads_to_the_same_scores(tmp_path, small_splits):
    ranker = build(layer=1)
    states = cached_items(ranker, small_splits["train"][:8])
    fit_head(ranker, states, [], TrainConfig(steps=5, batch_size=4, warmup_steps=1), LossConfig({"graded_ce": 1.0}), rel=2)
    ranker.save(tmp_path / "r")
    again = Reranker.load(tmp_path / "r")
    assert len(again.model.body.layers) == 1
    slates = small_splits["test"][:3]
    for a, b in zip(Reranker(ranker).score_slates(slates), again.score_slates(slates)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_cached_states_are_reused_under_the_same_key_and_refused_under_another(tmp_path, small_splits, monkeypatch):
    ranker = build()
    slates = small_splits["test"][:5]
    first = cached_states(ranker, slates, tmp_path / "s", shard_slates=2)
    assert len(list((tmp_path / "s").glob("shard-*.safetensors"))) == 3
    # scores from cached states = scores from the prompts (what serving computes)
    for a, b in zip(score_state_slates(ranker, [StateSlate(s, x) for s, x in zip(slates, first)]),
                    Reranker(ranker).score_slates(slates)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    calls = []
    monkeypatch.setattr(ranker, "item_states", lambda *a, **k: calls.append(1))
    again = cached_states(ranker, slates, tmp_path / "s", shard_slates=2)  # no prefill: all read back
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    other_prompt = dataclasses.replace(ranker.cfg, prompt=dataclasses.replace(ranker.cfg.prompt, max_doc_tokens=5))
    assert states_key(other_prompt, slates) != states_key(ranker.cfg, slates)
    ranker.cfg = other_prompt
    with pytest.raises(StaleStates, match="another model, prompt or slate list"):
        cached_states(ranker, slates, tmp_path / "s", shard_slates=2)
    with pytest.raises(StaleStates):  # other slates, same folder
        cached_states(build(), small_splits["test"][:4], tmp_path / "s", shard_slates=2)
    with pytest.raises(ValueError, match="frozen"):
        states_key(build(mode="lora").cfg, slates)


def test_an_interrupted_state_computation_resumes_at_the_missing_shard(tmp_path, small_splits):
    ranker = build()
    slates = small_splits["test"][:6]
    full = cached_states(ranker, slates, tmp_path / "s", shard_slates=2)
    (tmp_path / "s" / "shard-00001.safetensors").unlink()  # a crash before the second shard
    seen = []
    again = cached_states(ranker, slates, tmp_path / "s", shard_slates=2, progress=lambda d, t, s: seen.append((d, t)))
    assert seen == [(1, 1)] and all(torch.allclose(a, b) for a, b in zip(full, again))


def test_fit_head_keeps_the_best_validation_step(small_splits):
    ranker = build()
    train = cached_items(ranker, small_splits["train"][:16])
    val = cached_items(ranker, small_splits["val"][:4])
    out = fit_head(ranker, train, val, TrainConfig(steps=20, batch_size=4, lr=3e-3, warmup_steps=2, log_every=5),
                   LossConfig({"graded_ce": 1.0}), rel=2)
    assert out["best_val"] >= out["val_at_start"]
    rows = [r for r in out["history"] if "val_nDCG@10" in r]
    assert len(rows) == 4 and out["best_val"] == max([out["val_at_start"], *(r["val_nDCG@10"] for r in rows)])
    from hllm.eval.evaluation import quality
    assert quality([i.slate for i in val], state_orders(ranker, val), 2)["nDCG@10"] == pytest.approx(out["best_val"])


def test_sub_slates_keep_input_order_and_remap_the_teacher(small_splits):
    import random
    slate = small_splits["train"][0]
    item = StateSlate(slate, torch.arange(len(slate.candidates) * 2, dtype=torch.float32).view(-1, 2),
                      perm=list(reversed(range(len(slate.candidates)))))
    sub = sub_slate(item, 4, random.Random(0))
    ids = [c.docid for c in sub.slate.candidates]
    keep = [i for i, c in enumerate(slate.candidates) if c.docid in ids]
    assert len(ids) == 4 and keep == sorted(keep)
    assert torch.equal(sub.states, item.states[keep]) and sub.perm == [3, 2, 1, 0]
