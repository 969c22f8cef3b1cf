"""The public API: `from hllm import Reranker`; `Reranker.load(path).rank(query, docs)`."""

import numpy as np
import pytest
import torch

from hllm import RankedDocument, Reranker
from hllm.model.heads import HeadConfig
from hllm.model.prompts import PromptTooLong
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker

from conftest import TINY

DOCS = ["acme red leather boots", "zenith blue cotton shirt", "acme red wool boots", "kairo green canvas backpack"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                                 head=HeadConfig(positions=3, width=32, num_heads=2)))
    path = tmp_path_factory.mktemp("student")
    ranker.save(path)
    return path


def test_rank_returns_every_document_once_best_first(saved):
    reranker = Reranker.load(saved)
    ranked = reranker.rank("red boots", DOCS)
    assert all(isinstance(r, RankedDocument) for r in ranked)
    assert sorted(r.index for r in ranked) == list(range(len(DOCS)))
    scores = [r.score for r in ranked]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert [r.index for r in reranker.rank("red boots", DOCS, top_k=2)] == [r.index for r in ranked[:2]]


def test_the_path_is_encode_score_decode(saved):
    reranker = Reranker.load(saved)
    matrix = reranker.score_encoded([reranker.encode("red boots", DOCS)])[0]
    assert matrix.shape == (4, 3)  # K = 3 < N = 4: rectangular
    assert [r.index for r in reranker.rank("red boots", DOCS)] == reranker.decode(matrix).permutation.tolist()
    assert [r.index for r in reranker.rank("red boots", DOCS, decoder="sort")] == \
        reranker.decode(matrix, "sort").permutation.tolist()


def test_batch_form_equals_one_query_at_a_time(saved):
    reranker = Reranker.load(saved)
    queries, docs = ["red boots", "blue shirt", "backpack"], [DOCS, DOCS[:2], DOCS[1:]]
    together = reranker.rank_batch(queries, docs, batch_size=2)
    assert [[r.index for r in rs] for rs in together] == [[r.index for r in reranker.rank(q, d)] for q, d in zip(queries, docs)]
    with pytest.raises(ValueError, match="3 queries but 2 document lists"):
        reranker.rank_batch(queries, docs[:2])


def test_max_batch_tokens_bounds_each_forward_pass_not_the_scores(saved):
    from hllm.reranker import token_batches

    assert token_batches([100, 100, 100, 300, 50, 50], 300) == [[0, 1, 2], [3], [4, 5]]  # rows x the longest <= 300
    assert token_batches([500, 10], 300) == [[0], [1]] and token_batches([7, 7], None) == [[0, 1]]
    free, capped = Reranker.load(saved), Reranker.load(saved, max_batch_tokens=260)
    prompts = [free.encode(q, d) for q, d in (("red boots", DOCS), ("shirt", DOCS[:2]), ("pack", DOCS[1:]), ("x", DOCS))]
    assert all(100 < len(p.input_ids) < 130 for p in prompts)  # two fit in 260 padded tokens, three do not
    passes = []  # (rows, padded tokens) of each forward pass
    real = capped.tensors
    capped.tensors = lambda chunk: passes.append((len(chunk), len(chunk) * max(len(p.input_ids) for p in chunk))) or real(chunk)
    for a, b in zip(free.score_encoded(prompts), capped.score_encoded(prompts)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert [rows for rows, _ in passes] == [2, 2] and all(tokens <= 260 for _, tokens in passes)
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        Reranker.load(saved, max_batch_tokens=0)


def test_max_batch_tokens_auto_caps_a_cpu_pass_and_leaves_an_accelerator_free(saved):
    from hllm.reranker import CPU_MAX_BATCH_TOKENS, resolve_max_batch_tokens

    assert resolve_max_batch_tokens("auto", torch.device("cpu")) == CPU_MAX_BATCH_TOKENS
    assert resolve_max_batch_tokens("auto", torch.device("cuda")) is None  # batching is what pays there
    assert resolve_max_batch_tokens(None, torch.device("cpu")) is None and resolve_max_batch_tokens(300, torch.device("cuda")) == 300
    for bad in (0, -1, "lots", True):
        with pytest.raises(ValueError, match="max_batch_tokens"):
            resolve_max_batch_tokens(bad, torch.device("cpu"))
    reranker = Reranker.load(saved, device="cpu")
    assert reranker.max_batch_tokens == "auto"  # the default
    passes = []
    real = reranker.tensors
    reranker.tensors = lambda chunk: passes.append(len(chunk) * max(len(p.input_ids) for p in chunk)) or real(chunk)
    prompt = reranker.encode("red boots", DOCS)
    many = CPU_MAX_BATCH_TOKENS // len(prompt.input_ids) + 1  # one more prompt than a CPU pass holds
    reranker.score_encoded([prompt] * many)
    assert len(passes) == 2 and max(passes) <= CPU_MAX_BATCH_TOKENS


def test_merged_lora_ranks_like_the_adapter(saved):
    a = Reranker.load(saved, merge_lora=False).score_encoded
    b = Reranker.load(saved, merge_lora=True)
    prompt = b.encode("red boots", DOCS)
    np.testing.assert_allclose(a([prompt])[0], b.score_encoded([prompt])[0], atol=1e-4)


def test_bad_inputs_get_clear_errors(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="no trained student at"):
        Reranker.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no resolver for 'nope' URIs"):
        Reranker.load("nope:/x/y")
    with pytest.raises(ValueError, match="unknown decoder"):
        Reranker.load(saved, decoder="magic")
    reranker = Reranker.load(saved)
    with pytest.raises(ValueError, match="no documents"):
        reranker.rank("q", [])
    with pytest.raises(PromptTooLong):
        reranker.rank("q", ["word"] * 400)  # 400 documents cannot fit a 512-token context
