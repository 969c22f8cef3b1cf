import copy
import random

import pytest
import torch

from hllm.model.decoding import is_permutation
from hllm.model.prompts import PromptBuilder, PromptConfig
from hllm.teacher.generation import AnswerGrammar, ARTeacher, TeacherConfig
from hllm.train.loop import BootstrapConfig, TrainConfig, bootstrap_examples, bootstrap_teacher, gold_permutation, shuffled


def test_constrained_decoding_is_always_valid(tiny_backbone, small_splits):
    model, tok = tiny_backbone  # untrained: free decoding writes garbage
    reqs = copy.deepcopy(small_splits["test"])  # the fixture is shared: change a copy
    reqs[1].candidates = reqs[1].candidates[:5]
    reqs[1].grades = reqs[1].grades[:5]
    out = ARTeacher(model, tok, PromptConfig(), 512, TeacherConfig(constrained=True, batch_size=3)).rank(reqs)
    for req, r in zip(reqs, out):
        assert r.counts.ok == 1, r.raw_text
        assert is_permutation(r.permutation, len(req.candidates))
        assert r.output_tokens == 2 * len(req.candidates)  # N ids, N-1 separators, end of sequence
    free = ARTeacher(model, tok, PromptConfig(), 512, TeacherConfig(constrained=False)).rank(reqs[:2])
    assert all(r.counts.total == 1 for r in free)


def test_grammar_on_multi_token_ids():
    class CharTokenizer:  # ids are several tokens: "[", digits, "]"
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    g = AnswerGrammar(CharTokenizer(), 12)
    chars = lambda text: [ord(c) for c in text]  # noqa: E731
    assert g.allowed([]) == {ord("[")}
    assert g.allowed(chars("[1")) == set(chars("]012"))  # [1], [10], [11], [12]
    assert g.allowed(chars("[12]")) == {ord(" ")}  # the separator comes next
    assert g.allowed(chars("[12] > [1")) == set(chars("]01"))  # 12 is used up
    full = "[12] > " + " > ".join(f"[{i}]" for i in range(1, 12))
    assert g.allowed(chars(full)) == {0}  # all 12 out: end of sequence


def test_bootstrap_set_targets_accept_any_item_of_the_grade(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    req = small_splits["train"][0]
    (ex,) = bootstrap_examples(PromptBuilder(tok, PromptConfig(), 512), [req], "set")
    best = max(req.grades)
    first = {tok.convert_ids_to_tokens(t) for t in ex.accept[0]}
    assert first == {f"[{i + 1}]" for i, g in enumerate(req.grades) if g == best}
    assert tok.convert_ids_to_tokens(ex.accept[1]) == [">"]
    assert ex.accept[-1] == [tok.eos_token_id]


def test_bootstrap_ties_in_first_stage_order_are_one_exact_answer(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    builder = PromptBuilder(tok, PromptConfig(template="compact"), 512)
    reqs = small_splits["train"][:6]
    for seed in (0, 1):  # no randomness left in the answer
        examples = bootstrap_examples(builder, reqs, "exact", seed=seed, ties="first_stage")
        for ex, req in zip(examples, reqs):
            assert ex.answer_perm == sorted(range(len(req.grades)), key=lambda i: (-req.grades[i], i))
            assert all(len(a) == 1 for a in ex.accept)  # one right token at each answer position
    with pytest.raises(ValueError, match="ties=first_stage needs loss=exact"):
        BootstrapConfig(ties="first_stage")


def test_gold_permutation_ties():
    import random
    grades = [1, 3, 3, 0, 3]
    assert gold_permutation(grades) == [1, 2, 4, 0, 3]
    orders = {tuple(gold_permutation(grades, random.Random(s))[:3]) for s in range(20)}
    assert len(orders) > 1 and all(set(o) == {1, 2, 4} for o in orders)


def test_bootstrap_learns_the_answer_format(tiny_backbone, small_splits):
    model, tok = tiny_backbone
    builder = PromptBuilder(tok, PromptConfig(), 512)
    cfg = BootstrapConfig(train=TrainConfig(steps=60, batch_size=8, lr=1e-2, warmup_steps=5))
    _, history = bootstrap_teacher(model, builder, small_splits["train"], cfg)
    assert history[-1]["loss"] < 0.6 * history[0]["loss"]


def test_shuffled_bootstrap_slates_keep_each_passage_with_its_grade(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    builder = PromptBuilder(tok, PromptConfig(template="compact"), 512)
    reqs = small_splits["train"][:8]
    plain = bootstrap_examples(builder, reqs, "set", seed=1)
    mixed = bootstrap_examples(builder, reqs, "set", seed=1, shuffle_candidates=1.0)
    assert all(sorted(p.grades) == sorted(m.grades) for p, m in zip(plain, mixed))
    assert sum(p.grades != m.grades for p, m in zip(plain, mixed)) >= 6  # shown in another order
    for req in reqs:  # every passage keeps its own grade
        moved = shuffled(req, random.Random(0))
        assert {c.docid: g for c, g in zip(moved.candidates, moved.grades)} == \
            {c.docid: g for c, g in zip(req.candidates, req.grades)}


def test_lora_bootstrap_keeps_the_best_held_out_weights_and_merges(tiny_backbone, small_splits):
    from peft import PeftModel

    from hllm.model.ranker import AdaptConfig
    from hllm.train.loop import bootstrap_loss

    model, tok = tiny_backbone
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    builder = PromptBuilder(tok, PromptConfig(template="compact"), 512)
    val = small_splits["val"][:4]
    cfg = BootstrapConfig(train=TrainConfig(steps=12, batch_size=4, lr=3e-2, warmup_steps=1, log_every=3),
                          adapt=AdaptConfig(mode="lora", lora_r=4, lora_alpha=8, lora_targets=["q_proj", "v_proj"]))
    merged, history = bootstrap_teacher(model, builder, small_splits["train"], cfg, val=val)
    assert not isinstance(merged, PeftModel) and "lora" not in " ".join(n for n, _ in merged.named_parameters())
    rows = [r for r in history if "val_answer_nll" in r]
    assert [r["step"] for r in rows] == [3, 6, 9, 12]
    best = min(rows, key=lambda r: r["val_answer_nll"])
    assert history[-1]["kept_step"] == best["step"]
    with torch.no_grad():  # the returned weights are the kept step's, not the last step's
        again = bootstrap_loss(merged, bootstrap_examples(builder, val, "set"), tok.pad_token_id, "cpu")[0]
    assert float(again) == pytest.approx(best["val_answer_nll"], rel=1e-3)
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all(("q_proj" in n or "v_proj" in n) for n in changed)  # only where LoRA was


def test_window_plan_back_to_front():
    from hllm.model.windows import window_plan
    assert window_plan(20, 20, 10) == [(0, 20)]
    assert window_plan(30, 20, 10) == [(10, 30), (0, 20)]
    assert window_plan(100, 20, 10)[0] == (80, 100) and window_plan(100, 20, 10)[-1] == (0, 20)
    with pytest.raises(ValueError):
        window_plan(10, 4, 5)


def test_sliding_windows_bubble_the_best_to_the_top():
    from hllm.records import (
        Candidate,
        ParseCounts,
        Query,
        RerankRequest,
        TeacherRanking,
    )
    from hllm.model.windows import rank_with_windows

    def oracle(reqs):  # ranks by the number in the text: a perfect teacher for each window
        out = []
        for r in reqs:
            perm = sorted(range(len(r.candidates)), key=lambda i: -int(r.candidates[i].text))
            out.append(TeacherRanking(r.slate_id, perm, "", ParseCounts(total=1, ok=1)))
        return out

    values = [3, 17, 5, 29, 11, 2, 23, 7, 13, 19, 31, 1]
    req = RerankRequest(Query("q", "q"), [Candidate(str(i), str(v)) for i, v in enumerate(values)])
    (ranked,) = rank_with_windows(oracle, [req], window=4, stride=2)
    top = [values[i] for i in ranked.permutation[:2]]
    assert top == [31, 29]  # the window carries the best up from anywhere
    assert sorted(ranked.permutation) == list(range(12))
    assert ranked.windows[0] == [8, 9, 10, 11] and len(ranked.windows) == 5  # ends 12, 10, 8, 6, 4
    assert ranked.counts.ok == 1


def test_first_style_scores_read_identifier_logits(tiny_backbone, small_splits):
    from hllm.teacher.baselines import first_style_scores, identifier_first_tokens

    model, tok = tiny_backbone
    reqs = copy.deepcopy(small_splits["test"][:2])
    reqs[1].candidates = reqs[1].candidates[:5]
    builder = PromptBuilder(tok, PromptConfig(), 512)
    scores = first_style_scores(model, builder, reqs)
    assert [s.shape for s in scores] == [(8,), (5,)]
    ids = identifier_first_tokens(tok, 8)
    assert len(set(ids)) == 8  # single-token identifiers: one logit each
    logits = model(input_ids=torch.tensor([builder.encode(reqs[0]).input_ids])).logits[0, -1]
    assert torch.allclose(torch.tensor(scores[0]), logits[ids], atol=1e-4)
