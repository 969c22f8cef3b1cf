import copy
import numpy as np
import pytest
import torch

from hllm.model.backbones import load_backbone
from hllm.model.decoding import is_permutation
from hllm.model.heads import HeadConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.reranker import Reranker
from hllm.train.loop import LossConfig, TrainConfig, train_student

from conftest import TINY, graded_examples


def build(kind="attention", k=8, mode="lora"):
    cfg = RankerConfig(model=TINY, adapt=AdaptConfig(mode=mode, lora_r=4, lora_alpha=8),
                       head=HeadConfig(kind=kind, positions=k, width=32, num_heads=2))
    return SinglePassRanker.build(cfg).eval()


@pytest.mark.parametrize("kind,k", [("attention", 8), ("attention", 3), ("linear", 8), ("scalar", 8)])
def test_head_shape_under_padding(kind, k, small_splits):
    ranker = build(kind, k)
    reqs = copy.deepcopy(small_splits["test"][:3])  # the fixture is shared: change a copy
    reqs[1].candidates = reqs[1].candidates[:5]  # a shorter slate in the batch
    reranker = Reranker(ranker)
    logits = ranker(**reranker.tensors([reranker.encode_slate(r) for r in reqs]))
    assert logits.shape == (3, 8, 1 if kind == "scalar" else k)
    mats = reranker.score_slates(reqs)
    assert mats[1].shape == (5, min(5, logits.shape[2]))
    for req, mat in zip(reqs, mats):
        assert is_permutation(reranker.decode(mat).permutation, len(req.candidates))


def test_batched_equals_one_by_one(small_splits):
    ranker = build()
    reqs = copy.deepcopy(small_splits["test"][:4])
    reqs[2].candidates = reqs[2].candidates[:4]
    reranker = Reranker(ranker)
    together = reranker.score_slates(reqs)
    for req, mat in zip(reqs, together):
        np.testing.assert_allclose(reranker.score_slates([req])[0], mat, atol=1e-5)


def test_attention_head_computes_what_torch_encoder_layers_compute():
    """The fused head keeps `nn.TransformerEncoderLayer`'s parameter names and arithmetic (pre-norm,
    ReLU, 4x MLP, padded items never attended to): heads saved before it load and score the same."""
    from torch import nn
    from hllm.model.heads import AttentionHead

    torch.manual_seed(0)
    cfg = HeadConfig(positions=5, layers=2, width=32, num_heads=4)
    head = AttentionHead(24, cfg).eval()
    layer = nn.TransformerEncoderLayer(32, 4, 128, 0.0, batch_first=True, norm_first=True)
    reference = nn.ModuleDict({"norm": nn.LayerNorm(24), "proj": nn.Linear(24, 32),
                               "encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               "out": nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 5))}).eval()
    for p in reference.parameters():  # every weight non-trivial (biases included)
        p.data.normal_(0, 0.3)
    head.load_state_dict(reference.state_dict())  # strict: the same names and shapes
    items, mask = torch.randn(3, 7, 24), torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:], mask[2, 2:] = False, False
    with torch.inference_mode():
        ours = head(items, mask)
        x = reference["encoder"](reference["proj"](reference["norm"](items)), src_key_padding_mask=~mask)
        theirs = reference["out"](x)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    # unpadded slates at inference take torch's native encoder-layer kernel; with gradients, the op-by-op path
    full = torch.ones(3, 7, dtype=torch.bool)
    with torch.inference_mode():
        fused = head(items, full)
        theirs = reference["out"](reference["encoder"](reference["proj"](reference["norm"](items))))
    eager = head(items, full).detach()
    torch.testing.assert_close(fused, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["lora", "full", "frozen"])
def test_save_load_reproduces_scores_exactly(tmp_path, small_splits, mode):
    ranker = build(mode=mode)
    examples = graded_examples(ranker, small_splits["train"][:8])
    train_student(ranker, examples, TrainConfig(steps=2, batch_size=4, warmup_steps=1), LossConfig({"graded_ce": 1.0}))
    reqs = small_splits["test"][:3]
    before = Reranker(ranker).score_slates(reqs)
    ranker.save(tmp_path / "r")
    again = Reranker.load(tmp_path / "r", merge_lora=False).score_slates(reqs)
    for a, b in zip(before, again):
        np.testing.assert_array_equal(a, b)


def test_merged_lora_scores_like_the_adapter_and_refuses_to_save(tmp_path, small_splits):
    ranker = build(mode="lora")
    examples = graded_examples(ranker, small_splits["train"][:8])
    train_student(ranker, examples, TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1), LossConfig({"graded_ce": 1.0}))
    ranker.save(tmp_path / "r")
    reqs = small_splits["test"][:3]
    merged = SinglePassRanker.load(tmp_path / "r", merge_lora=True)
    assert not any("lora_" in n for n, _ in merged.backbone.named_parameters())
    for a, m in zip(Reranker(ranker).score_slates(reqs), Reranker(merged).score_slates(reqs)):
        np.testing.assert_allclose(m, a, atol=1e-4)
    base, _ = load_backbone(ranker.cfg.model)
    name = next(n for n, _ in base.named_parameters() if "q_proj" in n)
    assert not torch.equal(dict(merged.backbone.named_parameters())[name], dict(base.named_parameters())[name])  # merged in
    with pytest.raises(ValueError, match="merge_lora"):
        merged.save(tmp_path / "again")


def test_trainable_parameters_follow_the_adaptation():
    lora = build(mode="lora")
    names = [n for n, p in lora.backbone.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    frozen = build(mode="frozen")
    assert not any(p.requires_grad for p in frozen.backbone.parameters())
    assert all(p.requires_grad for p in frozen.head.parameters())


def test_training_lowers_the_loss(small_splits):
    ranker = build()
    examples = graded_examples(ranker, small_splits["train"])
    history = train_student(ranker, examples, TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=2),
                            LossConfig({"graded_ce": 1.0}))
    first, last = np.mean([h["loss"] for h in history[:5]]), np.mean([h["loss"] for h in history[-5:]])
    assert last < first * 0.9
