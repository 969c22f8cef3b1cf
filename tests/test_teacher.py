import pytest
import torch

from hllm.decoding import is_permutation
from hllm.prompts import PromptBuilder, PromptConfig
from hllm.teacher import AnswerGrammar, ARTeacher, TeacherConfig
from hllm.training import BootstrapConfig, TrainConfig, bootstrap_examples, bootstrap_teacher, gold_permutation


def test_constrained_decoding_is_always_valid(tiny_backbone, small_splits):
    model, tok = tiny_backbone  # untrained: free decoding writes garbage
    reqs = small_splits["test"]
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
    perm = gold_permutation(req.grades)
    first = {tok.convert_ids_to_tokens(t) for t in ex.accept[0]}
    assert first == {f"[{i + 1}]" for i in perm if req.grades[i] == req.grades[perm[0]]}
    assert tok.convert_ids_to_tokens(ex.accept[1]) == [">"]
    assert ex.accept[-1] == [tok.eos_token_id]


def test_bootstrap_learns_the_answer_format(tiny_backbone, small_splits):
    model, tok = tiny_backbone
    builder = PromptBuilder(tok, PromptConfig(), 512)
    cfg = BootstrapConfig(train=TrainConfig(steps=60, batch_size=8, lr=1e-2, warmup_steps=5))
    history = bootstrap_teacher(model, builder, small_splits["train"], cfg)
    assert history[-1]["loss"] < 0.6 * history[0]["loss"]
