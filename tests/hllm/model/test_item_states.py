"""The last decoder layer at the item positions only equals the full prefill there (LoRA merged or not)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hllm.model.heads import HeadConfig
from hllm.model.item_states import item_hidden_states, supports_items_only
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.reranker import Reranker

from conftest import TINY


def full_prefill_at(body, input_ids, attention_mask, positions):
    h = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return h.gather(1, positions[:, :, None].expand(-1, -1, h.shape[-1]))


def batch(vocab=200, b=3, t=40, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    lengths = torch.tensor([t, t - 7, t - 15])[:b]  # right padding
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    positions = torch.stack([torch.sort(torch.randperm(int(length), generator=g)[:n]).values for length in lengths])
    return ids, mask, positions


@pytest.mark.parametrize("model", [
    LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),  # grouped KV heads
    Qwen2ForCausalLM(Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)),  # q/k/v biases
])
def test_items_only_equals_the_full_prefill(model):
    body = model.eval().get_decoder()
    assert supports_items_only(body)
    ids, mask, positions = batch()
    with torch.no_grad():
        torch.testing.assert_close(item_hidden_states(body, ids, mask, positions),
                                   full_prefill_at(body, ids, mask, positions), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("merge", [False, True])
def test_ranker_scores_equal_the_unoptimised_path(tmp_path, small_splits, merge):
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=4, lora_alpha=8),
                                                 head=HeadConfig(positions=8, width=32, num_heads=2)))
    for p in ranker.backbone.parameters():  # non-zero LoRA weights, so unmerged and merged differ from the base
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ranker.save(tmp_path)
    reranker = Reranker.load(tmp_path, merge_lora=merge)
    prompts = [reranker.encode_slate(s) for s in small_splits["test"][:4]]
    tensors = reranker.tensors(prompts)
    with torch.no_grad():
        fast = reranker.model(**tensors)
        states = full_prefill_at(reranker.model.body, tensors["input_ids"], tensors["attention_mask"], tensors["item_positions"])
        slow = reranker.model.head(states, tensors["item_mask"])
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=0)


def test_gradients_flow_through_the_items_only_path(small_splits):
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                                 head=HeadConfig(positions=8, width=32, num_heads=2)))
    reranker = Reranker(ranker)
    tensors = reranker.tensors([reranker.encode_slate(s) for s in small_splits["train"][:2]])
    ranker.train()
    ranker(**tensors).sum().backward()
    last = ranker.body.layers[-1]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in last.named_parameters() if "lora_" in n)
