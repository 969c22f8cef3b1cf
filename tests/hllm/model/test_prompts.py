import pytest

from hllm.model.prompts import PromptBuilder, PromptConfig, PromptTooLong, collate
from hllm.records import Candidate, Query, RerankRequest


def test_item_positions_point_at_the_last_token_of_each_candidate(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    req = small_splits["test"][0]
    enc = PromptBuilder(tok, PromptConfig(), 512).encode(req)
    for i, (pos, cand) in enumerate(zip(enc.item_positions, req.candidates), start=1):
        doc_ids = tok(" " + cand.text, add_special_tokens=False)["input_ids"]
        assert enc.input_ids[pos] == doc_ids[-1]
        assert enc.input_ids[pos - len(doc_ids) + 1: pos + 1] == doc_ids
        assert enc.input_ids[pos - len(doc_ids)] == tok.convert_tokens_to_ids(f"[{i}]")


def test_compact_template_closes_each_candidate_with_its_identifier(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    req = small_splits["test"][0]
    enc = PromptBuilder(tok, PromptConfig(template="compact"), 512).encode(req)
    previous = -1
    for i, (pos, cand) in enumerate(zip(enc.item_positions, req.candidates), start=1):
        doc_ids = tok(" " + cand.text, add_special_tokens=False)["input_ids"]
        assert enc.input_ids[pos] == tok.convert_tokens_to_ids(f"[{i}]")  # the last token is the identifier
        assert enc.input_ids[pos - len(doc_ids): pos] == doc_ids  # right after its text
        assert pos - len(doc_ids) > previous  # after the previous candidate
        previous = pos


def test_budget_fits_the_context_and_reports_truncation(tiny_backbone):
    _, tok = tiny_backbone
    long_doc = " ".join(["red leather boots"] * 80)
    req = RerankRequest(Query("q", "red boots"), [Candidate(str(i), long_doc) for i in range(20)])
    builder = PromptBuilder(tok, PromptConfig(max_doc_tokens=500), 512)
    enc = builder.encode(req, with_answer=True)
    assert len(enc.input_ids) + 41 <= 512  # room for the 20-id answer and end of sequence
    assert enc.doc_tokens_truncated == 20
    with pytest.raises(PromptTooLong, match="do not fit a context of 64 tokens"):
        PromptBuilder(tok, PromptConfig(), 64).encode(req)


def test_left_padding_shifts_item_positions(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    builder = PromptBuilder(tok, PromptConfig(), 512)
    short = RerankRequest(Query("q", "mug"), small_splits["test"][0].candidates[:3])
    encs = [builder.encode(short), builder.encode(small_splits["test"][1])]
    for side in ("left", "right"):
        batch = collate(encs, tok.pad_token_id, side)
        for row, enc in enumerate(encs):
            for j, pos in enumerate(enc.item_positions):
                assert batch["input_ids"][row, batch["item_positions"][row, j]] == enc.input_ids[pos]
        assert batch["item_mask"].sum(1).tolist() == [3, len(small_splits["test"][1].candidates)]


def test_chat_template_frames_the_user_turn(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, pad_token="<pad>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant :{% endif %}")
    enc = PromptBuilder(tok, PromptConfig(), 512).encode(small_splits["test"][0])
    text = tok.decode(enc.input_ids)
    assert text.startswith("<s> system :") and text.rstrip().endswith("<s> assistant :")
    assert "i will provide you with 8 passages" in text


def test_rankgpt_query_restates_the_query_after_each_passage_and_reads_there(tiny_backbone, small_splits):
    _, tok = tiny_backbone
    req = small_splits["test"][0]
    enc = PromptBuilder(tok, PromptConfig(template="rankgpt-query"), 512).encode(req)
    restated = tok(f" Query: {req.query.text}", add_special_tokens=False)["input_ids"]
    plain = PromptBuilder(tok, PromptConfig(template="rankgpt"), 512).encode(req)
    for i, (pos, cand) in enumerate(zip(enc.item_positions, req.candidates), start=1):
        assert enc.input_ids[pos + 1 - len(restated): pos + 1] == restated  # the item's last token ends the query
    assert len(enc.input_ids) == len(plain.input_ids) + len(req.candidates) * len(restated)
    long_doc = " ".join(["red leather boots"] * 80)
    crowded = RerankRequest(Query("q", "red boots"), [Candidate(str(i), long_doc) for i in range(20)])
    fitted = PromptBuilder(tok, PromptConfig(template="rankgpt-query", max_doc_tokens=500), 512).encode(crowded, with_answer=True)
    assert len(fitted.input_ids) + 41 <= 512  # the restated queries come out of the passages' budget
