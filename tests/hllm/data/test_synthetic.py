from hllm.data.synthetic import Item, ProductQuery, SyntheticConfig, generate, grade
from hllm.records import record_to_dict


def test_deterministic_from_seed():
    cfg = SyntheticConfig(catalogue_size=300, slate_size=10, train_slates=5, val_slates=2, test_slates=3)
    a, _ = generate(cfg)
    b, _ = generate(cfg)
    assert [record_to_dict(s) for s in a["train"]] == [record_to_dict(s) for s in b["train"]]
    c, _ = generate(SyntheticConfig(**{**cfg.__dict__, "seed": 1}))
    assert [s.query.text for s in c["train"]] != [s.query.text for s in a["train"]]


def test_grades():
    q = ProductQuery("q", "boots", "booties", {"colour": "red", "brand": "acme"})
    item = Item("p", "boots", "acme", "red", "wool")
    assert grade(q, item) == 3
    assert grade(q, Item("p", "boots", "acme", "blue", "wool")) == 2
    assert grade(q, Item("p", "boots", "zenith", "blue", "wool")) == 1
    assert grade(q, Item("p", "sofa", "acme", "red", "wool", pairs_with="boots")) == 0
    assert "booties" in q.text and "boots" not in q.text  # the synonym a lexical retriever misses


def test_slates_have_relevant_candidates_and_sizes():
    cfg = SyntheticConfig(catalogue_size=400, slate_size=12, train_slates=20, val_slates=5, test_slates=5)
    splits, stats = generate(cfg)
    assert {k: len(v) for k, v in splits.items()} == {"train": 20, "val": 5, "test": 5}
    for s in splits["train"]:
        assert len(s.candidates) == 12 and max(s.grades) >= 2
        scores = [c.score for c in s.candidates]
        assert scores == sorted(scores, reverse=True)  # first-stage (BM25) order
    assert sum(stats.grade_counts) == 30 * 12
