"""How the head reads a candidate: its last token, the mean over its own tokens, or both (`RankerConfig.pooling`)."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS, span_means
from hllm.model.prompts import PromptBuilder, PromptConfig, collate
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.records import Candidate, Query, RerankRequest
from hllm.reranker import Reranker
from hllm.train.state_cache import states_key

from conftest import TINY


def build(pooling="last", layer=None, prior="none", kind="attention"):
    cfg = RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), state_layer=layer, pooling=pooling,
                       head=HeadConfig(kind=kind, positions=8, width=32, num_heads=2, prior=prior))
    return SinglePassRanker.build(cfg).eval()


@pytest.mark.parametrize("template", ["rankgpt", "compact", "rankgpt-query"])
def test_item_spans_cover_each_candidates_own_tokens(tiny_backbone, small_splits, template):
    _, tok = tiny_backbone
    req = small_splits["test"][0]
    enc = PromptBuilder(tok, PromptConfig(template=template, max_doc_tokens=5), 512).encode(req)
    assert len(enc.item_spans) == len(req.candidates)
    for (start, stop), pos, cand in zip(enc.item_spans, enc.item_positions, req.candidates):
        shown = tok(" " + cand.text, add_special_tokens=False)["input_ids"][:5]
        assert enc.input_ids[start:stop] == shown and stop <= pos + 1


def test_collate_shifts_spans_with_left_padding_and_pads_them_to_one_token(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    encs = [PromptBuilder(tok, PromptConfig(), 512).encode(s, with_answer=False) for s in small_splits["test"][:2]]
    encs[1] = copy.deepcopy(encs[1])
    encs[1].input_ids, encs[1].item_positions, encs[1].item_spans = (
        encs[1].input_ids[: encs[1].item_positions[2] + 1], encs[1].item_positions[:3], encs[1].item_spans[:3])
    for side in ("right", "left"):
        batch = collate(encs, tok.pad_token_id, side)
        for row, enc in enumerate(encs):
            offset = batch["input_ids"].shape[1] - len(enc.input_ids) if side == "left" else 0
            want = torch.tensor(enc.item_spans) + offset
            assert torch.equal(batch["item_spans"][row, : len(enc.item_spans)], want)
        assert batch["item_spans"][1, 3:].tolist() == [[0, 1]] * (batch["item_spans"].shape[1] - 3)


def test_span_means_average_exactly_the_span():
    h = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)  # (B, T, D)
    spans = torch.tensor([[[0, 2], [2, 5]], [[4, 5], [1, 4]]])  # (B, N, 2)
    got = span_means(h, spans)
    want = torch.stack([torch.stack([h[b, s:e].mean(0) for s, e in spans[b].tolist()]) for b in range(2)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("pooling", ["mean", "last+mean"])
def test_pooled_states_equal_the_full_prefill_read_by_hand(small_splits, pooling):
    full, cut = build(), build(pooling=pooling, layer=1)
    slates = [small_splits["test"][0], copy.deepcopy(small_splits["test"][1])]
    slates[1].candidates = slates[1].candidates[:5]  # padded in the batch
    batch = Reranker(cut).tensors([cut.prompts.encode(s, with_answer=False) for s in slates])
    with torch.no_grad():
        hidden = full.body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=True).hidden_states[1]  # (B, T, D) after layer 1, before the norm
        got = cut.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"])
    assert got.shape[-1] == TINY.hidden_size * len(POOLINGS[pooling])
    for row, slate in enumerate(slates):
        parts = {"last": hidden[row, batch["item_positions"][row]],
                 "mean": torch.stack([hidden[row, s:e].mean(0) for s, e in batch["item_spans"][row].tolist()])}
        want = torch.cat([full.body.norm(parts[p]) for p in POOLINGS[pooling]], -1)
        n = len(slate.candidates)
        torch.testing.assert_close(got[row, :n], want[:n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs item_spans"):
        cut.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"])


def test_last_pooling_is_the_items_only_path_and_last_plus_mean_starts_with_it(small_splits):
    last, both = build(layer=1), build(pooling="last+mean", layer=1)
    batch = Reranker(last).tensors([last.prompts.encode(small_splits["test"][0], with_answer=False)])
    with torch.no_grad():
        a = last.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"])
        b = both.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"])
    torch.testing.assert_close(b[..., : TINY.hidden_size], a, atol=1e-5, rtol=1e-5)


def test_a_mean_pooled_ranker_saves_loads_batches_and_keys_its_states(tmp_path, small_splits):
    ranker = build(pooling="last+mean", prior="logrank", kind="utility")
    with torch.no_grad():
        ranker.head.residual.readout.weight.normal_()  # a head that does not return the input order
    ranker.save(tmp_path / "r")
    again = Reranker.load(tmp_path / "r")
    assert again.model.cfg.pooling == "last+mean"
    slates = [small_splits["test"][0], copy.deepcopy(small_splits["test"][1])]
    slates[1].candidates = slates[1].candidates[:5]
    together = again.score_slates(slates)
    for slate, matrix, alone in zip(slates, together, [Reranker(ranker).score_slates([s])[0] for s in slates]):
        np.testing.assert_allclose(matrix, alone, atol=1e-5)
    assert states_key(ranker.cfg, slates) != states_key(build().cfg, slates)


def test_an_untrained_prior_head_keeps_the_input_order_under_every_pooling():
    docs = [f"document {i}" for i in range(12)]
    for pooling in POOLINGS:
        order = [d.index for d in Reranker(build(pooling=pooling, prior="rank")).rank("q", docs, first_stage_order=True)]
        assert order == list(range(12)), pooling


def test_an_unknown_pooling_is_refused_by_the_config():
    from hllm.config import from_dict
    with pytest.raises(ValueError, match="pooling"):
        from_dict(RankerConfig, {"pooling": "max"})


def test_a_documents_empty_text_reads_its_last_token(tiny_backbone):
    _, tok = tiny_backbone
    req = RerankRequest(Query("q", "red boots"), [Candidate("a", "red leather boots"), Candidate("b", "")])
    enc = PromptBuilder(tok, PromptConfig(), 512).encode(req, with_answer=False)
    start, stop = enc.item_spans[1]
    assert stop > start and stop <= enc.item_positions[1] + 1


def test_collate_refuses_a_prompt_without_its_item_spans(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    enc = PromptBuilder(tok, PromptConfig(), 512).encode(small_splits["test"][0], with_answer=False)
    with pytest.raises(ValueError, match="item spans"):
        collate([dataclasses.replace(enc, item_spans=[])], tok.pad_token_id)


@pytest.mark.parametrize("pooling", sorted(POOLINGS))
def test_one_prefill_reads_every_layer_of_a_sweep_as_rankers_cut_there_read_it(tmp_path, small_splits, pooling):
    from hllm.train.state_cache import cached_layer_states, cached_states, compute_states
    slates = small_splits["test"][:3]
    deep = build(pooling, layer=2)
    sweep = cached_layer_states(deep, slates, {1: tmp_path / "l1", 2: tmp_path / "l2"}, shard_slates=2)
    for layer in (1, 2):
        alone = compute_states(build(pooling, layer=layer), slates, batch_size=2)
        for got, want in zip(sweep[layer], alone):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # each folder is the cut ranker's own cache: read back there without a prefill, and refused for another layer
    assert all(torch.equal(a, b) for a, b in zip(cached_states(build(pooling, layer=1), slates, tmp_path / "l1", shard_slates=2), sweep[1]))
    from hllm.train.state_cache import StaleStates
    with pytest.raises(StaleStates):
        cached_states(build(pooling, layer=1), slates, tmp_path / "l2", shard_slates=2)
