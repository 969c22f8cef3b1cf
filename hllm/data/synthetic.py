"""The embedded default data set: product search over a generated catalogue.

Deterministic from a seed; nothing is downloaded. Each item has a category, brand, colour and
material; its title reads like a shop listing ("kairo grey denim shirt pairs with boots"). A query
names a category (sometimes through a synonym, which a lexical retriever cannot match) and one
to three of the other attributes. Graded relevance:

    0  wrong category (however many words it shares: the distractors)
    1  right category, fewer than half of the named attributes
    2  right category, at least half of them
    3  right category, all of them

First stage: BM25 (`rank_bm25`) over titles, top N, in BM25 order — the order a reranker gets.
Judgments are pooled over the slate (every candidate is judged), so a perfect reranker scores
nDCG = 1; slates with no candidate of grade >= 2 are redrawn (counted in `SyntheticStats`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from rank_bm25 import BM25Okapi

from hllm.records import Candidate, Query, RerankRequest

CATEGORIES = {
    "sneakers": ["trainers", "kicks"], "boots": ["booties"], "jacket": ["coat"],
    "shirt": ["blouse"], "jeans": ["denims"], "backpack": ["rucksack"], "watch": ["timepiece"],
    "lamp": ["light"], "mug": ["cup"], "headphones": ["earphones"], "sofa": ["couch"],
    "scarf": ["shawl"],
}
BRANDS = ["acme", "zenith", "nordic", "urbano", "kairo", "lumen", "vista", "orion",
          "pioneer", "sable", "tundra", "harbor"]
COLOURS = ["red", "blue", "green", "black", "white", "grey", "yellow", "brown", "pink", "orange"]
MATERIALS = ["leather", "cotton", "wool", "canvas", "steel", "ceramic", "denim", "linen"]
ATTRIBUTES = ("brand", "colour", "material")
VOCABULARY = sorted({*CATEGORIES, *(s for syn in CATEGORIES.values() for s in syn), *BRANDS, *COLOURS,
                     *MATERIALS, "by", "pairs", "with"})


@dataclass
class SyntheticConfig:
    """The embedded default data set (sizes are slates per split)."""

    seed: int = 0  # generator seed: the same seed, the same catalogue and slates
    catalogue_size: int = 3000  # products in the catalogue
    slate_size: int = 20  # N, candidates per slate
    train_slates: int = 3000  # slates (one query each) in the train split
    val_slates: int = 200  # ... in the validation split
    test_slates: int = 300  # ... in the test split
    synonym_rate: float = 0.35  # share of queries naming the category by a synonym
    pairs_with_rate: float = 0.5  # share of titles naming another category ("pairs with boots")
    min_attributes: int = 1  # attributes a query names (of brand, colour, material), min..max
    max_attributes: int = 3  # (see min_attributes)
    shards: int = 1  # each split drawn in this many shards, each from its own seed (parallel tasks on Ray); 1: one stream

    def __post_init__(self) -> None:
        if self.slate_size < 2:
            raise ValueError("data.slate_size must be >= 2")
        if self.catalogue_size < 4 * self.slate_size:
            raise ValueError("data.catalogue_size must be >= 4 * data.slate_size")
        if self.shards < 1:
            raise ValueError("data.synthetic.shards must be >= 1")
        if not 1 <= self.min_attributes <= self.max_attributes <= len(ATTRIBUTES):
            raise ValueError(f"need 1 <= data.min_attributes <= data.max_attributes <= {len(ATTRIBUTES)}")


@dataclass
class Item:
    docid: str
    category: str
    brand: str
    colour: str
    material: str
    pairs_with: str | None = None  # another category named in the title: a lexical distractor

    @property
    def title(self) -> str:
        extra = f" pairs with {self.pairs_with}" if self.pairs_with else ""
        return f"{self.brand} {self.colour} {self.material} {self.category}{extra}"


@dataclass
class ProductQuery:
    qid: str
    category: str
    category_word: str  # the category or a synonym
    wanted: dict[str, str]  # attribute -> value

    @property
    def text(self) -> str:
        words = [self.wanted[a] for a in ("colour", "material") if a in self.wanted]
        words.append(self.category_word)
        if "brand" in self.wanted:
            words += ["by", self.wanted["brand"]]
        return " ".join(words)


@dataclass
class SyntheticStats:
    redrawn_no_relevant: int = 0
    grade_counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])


def grade(query: ProductQuery, item: Item) -> int:
    if item.category != query.category:
        return 0
    matched = sum(getattr(item, a) == v for a, v in query.wanted.items())
    if matched == len(query.wanted):
        return 3
    return 2 if 2 * matched >= len(query.wanted) else 1


def make_catalogue(cfg: SyntheticConfig, rng: random.Random) -> list[Item]:
    cats = sorted(CATEGORIES)
    items = []
    for i in range(cfg.catalogue_size):
        cat = rng.choice(cats)
        other = rng.choice([c for c in cats if c != cat]) if rng.random() < cfg.pairs_with_rate else None
        items.append(Item(f"p{i:05d}", cat, rng.choice(BRANDS), rng.choice(COLOURS), rng.choice(MATERIALS), other))
    return items


def _draw_query(qid: str, catalogue: list[Item], cfg: SyntheticConfig, rng: random.Random) -> ProductQuery:
    target = rng.choice(catalogue)  # queries describe something that exists
    n_attr = rng.randint(cfg.min_attributes, cfg.max_attributes)
    wanted = {a: getattr(target, a) for a in rng.sample(ATTRIBUTES, n_attr)}
    word = target.category
    if rng.random() < cfg.synonym_rate:
        word = rng.choice(CATEGORIES[target.category])
    return ProductQuery(qid, target.category, word, wanted)


def generate_split(name: str, n_slates: int, catalogue: list[Item], bm25: BM25Okapi, cfg: SyntheticConfig,
                   rng: random.Random, stats: SyntheticStats) -> list[RerankRequest]:
    slates = []
    while len(slates) < n_slates:
        query = _draw_query(f"{name}-{len(slates):05d}", catalogue, cfg, rng)
        scores = bm25.get_scores(query.text.split())
        top = sorted(range(len(catalogue)), key=lambda i: (-scores[i], i))[: cfg.slate_size]
        grades = [grade(query, catalogue[i]) for i in top]
        if max(grades) < 2:
            stats.redrawn_no_relevant += 1
            continue
        for g in grades:
            stats.grade_counts[g] += 1
        cands = [Candidate(catalogue[i].docid, catalogue[i].title, float(scores[i])) for i in top]
        slates.append(RerankRequest(Query(query.qid, query.text), cands, grades))
    return slates


def _catalogue(cfg: SyntheticConfig) -> tuple[list[Item], BM25Okapi, random.Random]:
    rng = random.Random(cfg.seed)
    catalogue = make_catalogue(cfg, rng)
    return catalogue, BM25Okapi([item.title.split() for item in catalogue]), rng


def split_sizes(cfg: SyntheticConfig) -> dict[str, int]:
    return {"train": cfg.train_slates, "val": cfg.val_slates, "test": cfg.test_slates}


def generate(cfg: SyntheticConfig) -> tuple[dict[str, list[RerankRequest]], SyntheticStats]:
    """-> ({"train": [...], "val": [...], "test": [...]}, stats). Same seed (and shard count), same slates.
    One shard: one random stream through the three splits; more: every (split, shard) of
    `generate_shard`, concatenated — the slates that the Ray data stage's parallel tasks write."""
    if cfg.shards > 1:
        stats = SyntheticStats()
        splits = {name: [s for shard in range(cfg.shards) for s in generate_shard(cfg, name, shard, stats)]
                  for name in split_sizes(cfg)}
        return splits, stats
    catalogue, bm25, rng = _catalogue(cfg)
    stats = SyntheticStats()
    splits = {name: generate_split(name, n, catalogue, bm25, cfg, rng, stats) for name, n in split_sizes(cfg).items()}
    return splits, stats


def generate_shard(cfg: SyntheticConfig, split: str, shard: int, stats: SyntheticStats | None = None) -> list[RerankRequest]:
    """Shard `shard` of `cfg.shards` of one split: its share of the split's slates, drawn from a seed of its
    own (`seed/split/shard`) over the one catalogue, so any worker makes the same shard."""
    catalogue, bm25, _ = _catalogue(cfg)
    base, extra = divmod(split_sizes(cfg)[split], cfg.shards)
    rng = random.Random(f"{cfg.seed}/{split}/{shard}")
    return generate_split(f"{split}-{shard:04d}", base + (shard < extra), catalogue, bm25, cfg, rng,
                          stats if stats is not None else SyntheticStats())
