"""The one typed model card: every shipped card reads into it and writes back the same JSON; a student saved without a
card gets one from its config."""

import json

import pytest

from hllm.model.card import CARD_FILE, ModelCard, PromptCard, read_model_card, write_model_card
from hllm.uris import NAMED_MODELS


@pytest.mark.parametrize("name", sorted(NAMED_MODELS))
def test_every_shipped_card_reads_typed_and_writes_back_the_same_json(name, tmp_path):
    saved = json.loads((NAMED_MODELS[name] / CARD_FILE).read_text())
    card = read_model_card(NAMED_MODELS[name])
    assert isinstance(card.prompt, PromptCard) and card.positions == saved["positions"] and card.base_model == saved["base_model"]
    assert card.vocabulary == saved.get("vocabulary") and card.figures["input_order"]["shuffled_input_nDCG@10"] > 0  # re-made by hllm order
    write_model_card(tmp_path, card)
    assert json.loads((tmp_path / CARD_FILE).read_text()) == saved


def test_a_card_keeps_its_typed_fields_and_its_figures_apart(tmp_path):
    card = ModelCard(base_model="tiny", positions=6, prompt=PromptCard("rankgpt", 32, 512), training_data={"slates": 3},
                     figures={"steps": 3, "val_loss": None})
    assert card.to_json() == {"base_model": "tiny", "positions": 6, "training_data": {"slates": 3},
                              "prompt": {"template": "rankgpt", "max_doc_tokens": 32, "context_length": 512},
                              "steps": 3, "val_loss": None}
    assert ModelCard.from_json(card.to_json()) == card
    with pytest.raises(TypeError):  # a card without what every card has is not a card
        ModelCard.from_json({"prompt": card.to_json()["prompt"], "positions": 6})
