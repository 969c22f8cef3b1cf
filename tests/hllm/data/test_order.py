"""Input order: named orders, a declared first-stage order the prior may read and an undeclared one it may not,
targets aligned with shuffled documents, `hllm rerank --input-order`, and the order recipe at tiny scale."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from hllm.config import load_config
from hllm.data.order import FIRST_STAGE, InputOrder, reorder
from hllm.data.readers import read_slates
from hllm.model.confidence import confidence
from hllm.model.heads import HeadConfig, build_head
from hllm.reranker import Reranker
from pipelines.cli import main as cli

from conftest import TINY
from builders import beir_folder as _beir


def test_orders_parse_and_permute_the_same_way_on_every_run():
    assert InputOrder.parse("first-stage") == FIRST_STAGE and FIRST_STAGE.declared
    s = InputOrder.parse("shuffled:3")
    assert (s.kind, s.seed, str(s), s.declared) == ("shuffled", 3, "shuffled:3", False)
    assert str(InputOrder.parse("shuffled")) == "shuffled:0" and InputOrder.parse("reversed").permutation(4, "q") == [3, 2, 1, 0]
    perm = s.permutation(30, "q1")
    assert sorted(perm) == list(range(30)) and perm == InputOrder.parse("shuffled:3").permutation(30, "q1")
    assert perm != s.permutation(30, "q2") and perm != InputOrder.parse("shuffled:4").permutation(30, "q1")
    for bad, match in [("sorted", "unknown input order"), ("reversed:1", "only shuffled takes a seed"), ("shuffled:x", "shuffled:x")]:
        with pytest.raises(ValueError, match=match):
            InputOrder.parse(bad)


def test_a_reordered_slate_keeps_each_grade_and_teacher_target_with_its_document(tmp_path):
    from hllm.teacher.external import external_rankings

    data = _beir(tmp_path / "a", queries=3, docs=10)
    slates = read_slates("beir", str(data), top_n=10)
    # a teacher's run that ranks each query's documents by their grade (then id): a target by document id
    lines = []
    for s in slates:
        ranked = sorted(zip(s.candidates, s.grades), key=lambda cg: (-cg[1], cg[0].docid))
        lines += [f"{s.slate_id} Q0 {c.docid} {r + 1} {10 - r} t" for r, (c, _) in enumerate(ranked)]
    (tmp_path / "teacher.trec").write_text("\n".join(lines) + "\n")
    for order in (InputOrder.parse("shuffled:1"), InputOrder.parse("reversed")):
        moved = [reorder(s, order) for s in slates]
        for s, m in zip(slates, moved):
            grade = dict(zip((c.docid for c in s.candidates), s.grades))
            assert [grade[c.docid] for c in m.candidates] == m.grades and m.qrels() == s.qrels()
            assert [c.docid for c in m.candidates] != [c.docid for c in s.candidates]
        before, _ = external_rankings("run", tmp_path / "teacher.trec", slates)
        after, _ = external_rankings("run", tmp_path / "teacher.trec", moved)
        for s, m, b, a in zip(slates, moved, before, after):  # the same documents, best first, whatever the order
            assert [m.candidates[i].docid for i in a.permutation] == [s.candidates[i].docid for i in b.permutation]


@pytest.mark.parametrize("kind,prior", [("utility", "logrank"), ("attention", "rank")])
def test_an_undeclared_order_gives_the_prior_nothing_to_read(kind, prior):
    """The head on the same item states, permuted: with no declared order its matrix rows move with the items (the
    ranking is the same documents' ranking); declared, the prior reads the positions and the ranking changes."""
    torch.manual_seed(0)
    head = build_head(16, HeadConfig(kind=kind, positions=6, width=16, num_heads=2, prior=prior)).eval()
    with torch.no_grad():
        head.residual.readout.weight.normal_(0, 1.0)
        head.log_beta.fill_(np.log(5.0))  # a strong prior: declared, the input order nearly decides
    x = torch.randn(1, 6, 16)
    mask = torch.ones(1, 6, dtype=torch.bool)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    off, on = torch.tensor([False]), torch.tensor([True])
    with torch.no_grad():
        free, free_moved = head(x, mask, off)[0], head(x[:, perm], mask, off)[0]
        declared, declared_moved = head(x, mask, on)[0], head(x[:, perm], mask, on)[0]
        assert torch.equal(head(x, mask, None), head(x, mask, on))  # None: every slate declared (training's default)
    if kind == "utility":  # no attention between items: exactly equivariant
        torch.testing.assert_close(free_moved, free[perm], rtol=1e-5, atol=1e-5)
    else:  # self-attention without positions: equivariant up to float summation order
        torch.testing.assert_close(free_moved, free[perm], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(declared_moved, declared[perm], atol=1e-3)
    assert not torch.allclose(declared, free, atol=1e-3)


def test_agreement_is_defined_only_for_a_declared_order():
    m = np.random.default_rng(0).normal(size=(6, 4))
    order = np.array([3, 1, 0, 2, 5, 4])
    assert confidence(m, order, k=3, first_stage_order=True).agreement == pytest.approx(2 / 3)  # 1 and 0 of the top 3
    undeclared = confidence(m, order, k=3, first_stage_order=False)
    assert undeclared.agreement is None and undeclared.value("agreement") is None and undeclared.margin >= 0


def test_reranker_declares_nothing_by_default_and_a_declared_order_reads_the_prior(tiny_backbone):
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker

    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=4, prior="logrank")))
    with torch.no_grad():
        ranker.head.residual.net.weight.normal_(0, 10.0)
        ranker.head.log_beta.fill_(np.log(50.0))  # declared: the first-stage order wins
    reranker = Reranker(ranker)
    docs = ["acme red boots", "blue shirt", "green canvas backpack", "nordic leather boots", "wool scarf"]
    assert [d.index for d in reranker.rank("red boots", docs, first_stage_order=True)] == list(range(len(docs)))
    free = reranker.rank_assessed(["red boots"], [docs])[0]
    assert [d.index for d in free.documents] != list(range(len(docs))) and free.confidence.agreement is None
    # the undeclared ranking is the utility's: the same as the head's own sort of its scores, whatever the prior
    with torch.no_grad():
        ranker.head.log_beta.fill_(np.log(1e-3))
    assert [d.index for d in reranker.rank("red boots", docs)] == [d.index for d in free.documents]


def test_a_set_is_read_in_one_canonical_order_whatever_order_it_arrives_in():
    from hllm.data.order import CANONICAL, canonical_order

    texts = ["red boots", "blue shirt", "red boots", "wool scarf", "green bag"]
    order = canonical_order(texts)
    assert sorted(order) == list(range(5)) and order.index(0) < order.index(2)  # identical texts: as given
    rng = np.random.default_rng(0)
    for _ in range(5):
        perm = rng.permutation(5)
        moved = [texts[i] for i in perm]
        assert [moved[i] for i in canonical_order(moved)] == [texts[i] for i in order]  # the same prompt order
    assert InputOrder.parse("canonical") == CANONICAL and not CANONICAL.declared
    with pytest.raises(ValueError, match="texts"):
        CANONICAL.permutation(5, "q")


@pytest.mark.parametrize("window", [None, 4])
def test_an_undeclared_list_gets_the_same_answer_in_any_arrival_order(tiny_backbone, window):
    """Undeclared, every arrival order of the same documents gives the same prompt (the canonical order), so the same
    ranking, scores, relevance and confidence, exactly — in one pass and in windows, even for a head whose scores tie
    (an untrained one). Declared, the order is read: the first stage's ranks move the answer."""
    from hllm.model.calibration import fit_calibrator
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker

    torch.manual_seed(0)
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=4, prior="logrank")))
    docs = ["acme red boots", "blue shirt", "green canvas backpack", "nordic leather boots", "wool scarf",
            "red boots on sale", "a boots catalogue", "socks", "boot polish"]
    rng = np.random.default_rng(1)
    perms = [np.arange(len(docs))] + [rng.permutation(len(docs)) for _ in range(4)]
    for trained in (False, True):
        if trained:
            with torch.no_grad():
                ranker.head.residual.net.weight.normal_(0, 10.0)
        reranker = Reranker(ranker, window=window)
        rng_c = np.random.default_rng(2)  # relevance too: a calibration fitted on random matrices
        reranker.calibrator = fit_calibrator([rng_c.normal(size=(6, 4)) for _ in range(8)], [list(range(6))] * 8,
                                             [[3, 0, 2, 0, 0, 1]] * 8, rel=2)
        answers = []
        for perm in perms:
            moved = [docs[i] for i in perm]
            (a,) = reranker.rank_assessed(["red boots"], [moved])
            answers.append(([moved[d.index] for d in a.documents], [(d.score, d.relevance) for d in a.documents],
                            a.confidence.as_dict()))
        assert all(x == answers[0] for x in answers[1:]), trained
    declared = [[docs[i] for i in perm][d.index] for perm in perms[:2]
                for d in Reranker(ranker, window=window).rank("red boots", [docs[i] for i in perm], first_stage_order=True)]
    assert declared[: len(docs)] != declared[len(docs):]


def test_hllm_rerank_hands_the_candidates_over_in_the_order_asked_and_maps_them_back(tmp_path, capsys, tiny_backbone):
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker

    data = _beir(tmp_path / "c", queries=3, docs=8)
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=4, prior="logrank")))
    with torch.no_grad():
        ranker.head.log_beta.fill_(np.log(50.0))  # the prior all but decides: a declared order is kept
    ranker.save(tmp_path / "m")
    slates = read_slates("beir", str(data), top_n=8)

    def run(*extra):
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}.trec"
        assert cli(["rerank", "--model", str(tmp_path / "m"), "--data", str(data), "--out", str(out), "--quiet", *extra]) == 0
        ranked: dict[str, list[str]] = {}
        for line in out.read_text().splitlines():
            ranked.setdefault(line.split()[0], []).append(line.split()[2])
        return ranked, capsys.readouterr().out

    declared, printed = run()
    assert all(declared[s.slate_id] == [c.docid for c in s.candidates] for s in slates)  # the first stage, kept
    assert "| reranked |" in printed
    shuffled, printed = run("--input-order", "shuffled:1")
    assert "| input order (shuffled:1) |" in printed and "| reranked (shuffled:1 input, undeclared) |" in printed
    for s in slates:  # every candidate once, ids mapped back from the shuffled positions
        assert sorted(shuffled[s.slate_id]) == sorted(c.docid for c in s.candidates)
    assert any(shuffled[s.slate_id] != declared[s.slate_id] for s in slates)
    undeclared, printed = run("--undeclared")
    assert "| reranked (first-stage input, undeclared) |" in printed
    # undeclared, the prior is off: the ranking is the utility's alone, as the library ranks the same list read as a set
    reranker = Reranker.load(tmp_path / "m")
    for s in slates:
        library = reranker.rank(s.query.text, [c.text for c in s.candidates])
        assert undeclared[s.slate_id] == [s.candidates[d.index].docid for d in library]
    with pytest.raises(ValueError, match="cannot be declared"):
        from hllm.job.collection import RerankSpec
        RerankSpec(model="m", input_order="reversed", declare_order=True)


def _teacher_run(data, path):
    slates = read_slates("beir", str(data), top_n=100)
    lines = []
    for s in slates:
        ranked = sorted(zip(s.candidates, s.grades), key=lambda cg: (-cg[1], cg[0].docid))
        lines += [f"{s.slate_id} Q0 {c.docid} {r + 1} {100 - r} t" for r, (c, _) in enumerate(ranked)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_order_recipe_measures_refits_and_reships_a_probe_at_tiny_scale(tmp_path, tiny_backbone):
    """A tiny shipped probe (from the real-text recipe) through the order recipe: states per (collection, order), every
    augmentation chosen by CV on the training collection, the headline lines, the student re-shipped whose served
    ranking of a shuffled list equals the recipe's ranking from cached states."""
    from hllm.recipes.order import OrderConfig, run
    from hllm.recipes.realtext import RealTextConfig, run as realtext

    a, b = _beir(tmp_path / "a", queries=9, docs=10), _beir(tmp_path / "b", queries=6, docs=10)
    base = ["ranker.state_layer=1", "ranker.adapt.mode=frozen", "ranker.prompt.max_doc_tokens=8", "ranker.head.positions=4",
            "ranker.head.kind=utility", "ranker.head.prior=logrank", "ranker.pooling=last+mean", "top_n=10"]
    rt = load_config(RealTextConfig, None, [*base, f"output_dir={tmp_path / 'rt'}", "variants=[{name: ridge, target: judgments, layer: 1}]", "cv_folds=2",
                                            "ranker.head.guard=distance", f"ship_on=[{a}]", f"ship_to={tmp_path / 'student'}"])
    rt.ranker.model = TINY
    realtext(rt)
    teacher = _teacher_run(a, tmp_path / "teacher.trec")
    shutil.copytree(tmp_path / "student", tmp_path / "distilled")
    recorded = tmp_path / "real_data.csv"  # the figures as recorded before, and a row the input-order rows must keep
    recorded.write_text("collection,queries,split,method,nDCG@10,MRR@10,teacher,tau_to_teacher,share_kept,share_kept_ci95\n"
                        f"{b.name},6,cross-year,student,0.5,0.5,,,,\n{a.name},9,teacher-folds,teacher,0.9,0.9,t,1.0,,\n")
    cfg = load_config(OrderConfig, None, [
        *base, f"output_dir={tmp_path / 'order'}", f"collections=[{a}, {b}]", "orders=[first-stage, shuffled:0, shuffled:1, canonical]",
        f"extra=[{b}@reversed]", f"train_on={a}", f"test_on={b}", "shuffles=[shuffled:0, shuffled:1]", "cv_folds=2", "folds=2",
        "bootstrap=50", "rel=2", f"report_to={tmp_path / 'order.md'}", f"recorded_in={recorded}",
        "augmentations={first-stage only: [first-stage], first-stage + shuffles: [first-stage, shuffled:0, shuffled:1]}",
        f"students=[{{name: probe, folder: {tmp_path / 'student'}, target: judgments, ridge_lambdas: [1.0, 100.0], "
        f"prior_scales: [0.5, 2.0], ship_on: [{a}, {b}], recorded: cross-year/student}}, {{name: distilled, folder: {tmp_path / 'distilled'}, "
        f"target: teacher, teacher_rankings: {teacher}, teacher_depth: 5, ridge_lambdas: [1.0, 100.0], "
        f"prior_scales: [0.5], ship_on: [{a}], calibrate: true, cascade_from: out-of-fold}}]"])
    cfg.ranker.model = TINY
    report = run(cfg)
    lines = (tmp_path / "order.md").read_text()
    for name in ("probe", "distilled"):
        assert re.search(rf"^shuffled input, {name}: \d\.\d{{4}} \| first stage \d\.\d{{4}} \| declared order \d\.\d{{4}}$", lines, re.M)
        assert re.search(rf"^order spread, {name}: \d\.\d{{4}}$", lines, re.M)
    probe, distilled = report["students"]
    assert probe["recorded"]["nDCG@10"] == 0.5 and distilled["recorded"] is None
    # the report: the goals against the recorded figure, each student's table by input order, the ablation, the bound
    goals = re.search(r"^\| probe \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| [^|]+ \|$", lines, re.M)
    assert goals and goals[7] == "0.4950" and goals[3] in ("yes", "**no**") and goals[4] == "0.0000" and goals[5] == "yes"
    for part in ("## probe", "## distilled", "| reversed |", "| first-stage only / declared |", "In-sample bound"):
        assert part in lines
    assert set(probe["variants"]) == {"first-stage only / text", "first-stage only / declared", "first-stage + shuffles / text"}
    cross = probe["variants"][probe["chosen"]]["cross_year"]
    assert {"reversed (the order itself)", "reversed, as served", "reversed, read as it arrived", "first-stage, declared",
            "first stage", "first-stage, as served"} <= set(cross)
    # as served, every arrival order is read in the canonical order: one answer, no spread; read as they arrived, not so
    served = cross["shuffled, as served (mean of the shuffles)"]
    assert served["spread"] == 0 and cross["reversed, as served"]["nDCG@10"] == served["nDCG@10"] == \
        cross["first-stage, as served"]["nDCG@10"]
    assert cross["first stage"]["queries"] == 6 and cross["first stage"]["ci95"][0] <= cross["first stage"]["nDCG@10"]
    # re-shipped: the card gives both figures, provenance says what made it and what it was made from
    shipped = Reranker.load(tmp_path / "student")
    figures = shipped.card.figures["input_order"]
    assert figures["shuffled_input_nDCG@10"] == served["nDCG@10"]
    assert figures["declared_order_nDCG@10"] == cross["first-stage, declared"]["nDCG@10"] and "declared" in shipped.card.input
    provenance = json.loads((tmp_path / "student" / "provenance.json").read_text())
    assert "hllm.recipes.order" in provenance["made_by"] and "hllm.recipes.realtext" in provenance["refined_from"]["made_by"]
    assert (tmp_path / "distilled" / "calibration.json").is_file() and "out of fold" in \
        Reranker.load(tmp_path / "distilled").cascade_thresholds.fitted_on["source"]
    # benchmarks/real_data.py takes the run's rows (split input-order) beside the rows already there
    import csv
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "benchmarks/real_data.py", "--input-order", cfg.output_dir, "--out", str(recorded)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with recorded.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["split"], r["input_order"]) for r in rows[:2]] == [("cross-year", "first-stage"), ("teacher-folds", "first-stage")]
    ordered = {(r["method"], r["input_order"], r["order_declared"]): float(r["nDCG@10"]) for r in rows if r["split"] == "input-order"}
    assert ordered[("probe", "shuffled (mean of 2)", "no")] == round(served["nDCG@10"], 4)
    assert ordered[("probe", "reversed", "no, read as it arrived")] == round(cross["reversed, read as it arrived"]["nDCG@10"], 4)
    assert ordered[("first_stage", "reversed", "")] == round(cross["reversed (the order itself)"]["nDCG@10"], 4)
    assert ("probe (first-stage only / declared)", "first-stage", "yes") in ordered
    assert "## Input order" in recorded.with_suffix(".md").read_text()
    # the served path (a prompt per request, no declared order) reads any shuffle of a list in its canonical order: it
    # ranks each shuffle as the recipe ranked the canonical order's cached states, document for document
    from hllm.data.order import CANONICAL
    from hllm.recipes.order import OrderedStates
    from hllm.train.head_fit import StateSlate, state_orders

    data = OrderedStates(cfg, shipped.model)
    canonical = data.items(str(b), CANONICAL)
    from_states = [[i.slate.candidates[j].docid for j in o] for i, o in zip(canonical, state_orders(
        shipped.model, [StateSlate(i.slate, i.states) for i in canonical], first_stage_order=False))]
    for order in ("shuffled:1", "reversed"):
        items = data.items(str(b), InputOrder.parse(order))
        served = shipped.rank_batch([i.slate.query.text for i in items], [[c.text for c in i.slate.candidates] for i in items])
        assert [[i.slate.candidates[d.index].docid for d in r] for i, r in zip(items, served)] == from_states


def test_augmented_training_examples_keep_the_teachers_ranking_with_its_documents(small_splits, tiny_backbone):
    from hllm.model.prompts import PromptBuilder, PromptConfig
    from hllm.records import RankedSlate, TeacherRanking
    from hllm.train.loop import LossConfig, student_batch, student_examples

    from hllm.records import ParseCounts

    builder = PromptBuilder(tiny_backbone[1], PromptConfig(template="compact"), 512)
    slates = small_splits["train"][:4]
    ranked = [RankedSlate(s, TeacherRanking(s.slate_id, [3, 0, 5, 1, 7, 2, 6, 4], "", ParseCounts())) for s in slates]
    examples, dropped = student_examples(builder, ranked, LossConfig(), ["first-stage", "shuffled:0", "reversed"])
    assert dropped == 0 and len(examples) == 3 * len(slates)
    for k, order in enumerate(["first-stage", "shuffled:0", "reversed"]):
        for r, e in zip(ranked, examples[k * len(slates):(k + 1) * len(slates)]):
            moved = reorder(r.slate, InputOrder.parse(order))
            # the teacher's best-first documents, read through the example's own order: the same ids
            assert [moved.candidates[i].docid for i in e.perm] == [r.slate.candidates[i].docid for i in r.ranking.permutation]
            assert e.grades == moved.grades and e.prompt.first_stage_order == (order == "first-stage")
    assert student_batch(examples, 0)["declared"].tolist() == [True] * 4 + [False] * 8
