"""Where a teacher keeps relevance, and whether its answer reads it: probes of a finished job's teacher.

    python benchmarks/teacher_probe.py [--run-dir runs/default] [--probe-slates 1000] [--attention-slates 100]

Needs `config.json` in `--run-dir` and the teacher it names (the bootstrapped weights under `teacher/model`,
or the configured model). Three measurements, on the job's own splits:

1. Per-layer linear probes: ridge regression from the hidden state at each candidate's last token (the one the
   single-pass head reads) to its grade, fit on train slates, scored on the test split by the nDCG@10 of the
   ranking it gives — how early in the network relevance can be read out.
2. The grade the teacher's own LM head reads at each candidate's last token (the digit tokens "0".."3", as the
   embedded bootstrap's auxiliary trains it): accuracy, and which confusions the errors are.
3. Attention of the position that writes the first identifier, per layer and head: the share on the
   candidates' identifier tokens and on their last tokens — where the answer looks.

Unjudged candidates count as grade 0. Prints Markdown, writes `reports/teacher_probe.md` (or `--output`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from bench import write_report

from hllm.config import from_dict
from hllm.data.splits import load_splits
from hllm.eval.evaluation import first_stage_order, quality
from hllm.model.backbones import load_backbone
from hllm.model.prompts import PromptBuilder, collate
from hllm.job.ablations import scores_to_perm
from hllm.job.config import JobConfig
from hllm.job.stages import teacher_model
from hllm.train.loop import grade_token_ids


def grades_of(slate) -> list[int]:
    return [int(g or 0) for g in (slate.grades or [0] * len(slate.candidates))]


@torch.no_grad()
def item_states(model, builder: PromptBuilder, slates, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """-> states (L+1, I, H) at every candidate's last token after each layer (0: embeddings), and their
    LM-head logits (I, V) from the last layer; I = all candidates of `slates`, in order."""
    states, logits = [], []
    for start in range(0, len(slates), batch):
        encs = [builder.encode(s, with_answer=True) for s in slates[start: start + batch]]
        b = collate(encs, builder.tokenizer.pad_token_id, padding_side="right")  # positions stay as encoded
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        rows, cols = b["item_mask"].nonzero(as_tuple=True)  # every real candidate, slate by slate
        cols = b["item_positions"][rows, cols]
        states.append(torch.stack([h[rows, cols].float() for h in out.hidden_states]))  # (L+1, i, H)
        logits.append(out.logits[rows, cols].float())  # (i, V)
    return torch.cat(states, dim=1), torch.cat(logits)


def probe_rankings(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, sizes: list[int],
                   ridge: float = 1.0) -> list[list[int]]:
    """Ridge regression from standardised states (I, H) to grades (I,), with a bias; test items ranked by the
    fit, slate by slate. The ridge keeps the fit determined where the states have more dimensions than there are
    train candidates (a real LM on a few judged queries)."""
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    z = lambda x: ((x - mean) / std).double()  # noqa: E731
    a, y = z(train_x), train_y.double() - train_y.double().mean()
    w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=a.dtype), a.T @ y)  # (H,)
    scores = (z(test_x) @ w).split(sizes)
    return [scores_to_perm(s.numpy()) for s in scores]


@torch.no_grad()
def first_id_attention(model, builder: PromptBuilder, slates) -> tuple[torch.Tensor, torch.Tensor]:
    """-> mean attention share (L, heads) of the position that writes the first identifier on the
    identifier tokens, and on the candidates' last tokens."""
    model.config._attn_implementation = "eager"  # the fused kernels do not return attention weights
    on_ids = on_items = None
    for s in slates:
        enc = builder.encode(s, with_answer=True)
        id_pos, start = [], 0
        for k, last in enumerate(enc.item_positions, start=1):  # each identifier lies between the previous item and this one's end
            tokens = builder.id_tokens(k)
            span = next(p for p in range(start, last + 1) if enc.input_ids[p: p + len(tokens)] == tokens)
            id_pos += range(span, span + len(tokens))
            start = last + 1
        out = model(input_ids=torch.tensor([enc.input_ids]), output_attentions=True)
        w = torch.stack([a[0, :, -1].float() for a in out.attentions])  # (L, heads, T) from the last prompt token
        ids_share, items_share = w[:, :, id_pos].sum(-1), w[:, :, enc.item_positions].sum(-1)
        on_ids = ids_share if on_ids is None else on_ids + ids_share
        on_items = items_share if on_items is None else on_items + items_share
    return on_ids / len(slates), on_items / len(slates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/default")
    parser.add_argument("--probe-slates", type=int, default=1000, help="train slates the probes are fit on")
    parser.add_argument("--attention-slates", type=int, default=100, help="test slates whose attention is read")
    parser.add_argument("--ridge", type=float, default=1.0, help="the probes' L2 penalty (on standardised states)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="reports/teacher_probe.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    cfg = from_dict(JobConfig, {k: v for k, v in json.loads((run / "config.json").read_text()).items()
                                if k in JobConfig.__dataclass_fields__})
    splits = load_splits(cfg.data)
    train, test = splits["train"][: args.probe_slates], splits["test"]
    model_cfg = teacher_model(cfg)
    model, tokenizer = load_backbone(model_cfg)
    model.eval()
    builder = PromptBuilder(tokenizer, cfg.prompt, model_cfg.context_length)

    train_x, _ = item_states(model, builder, train)
    test_x, test_logits = item_states(model, builder, test)
    train_y = torch.tensor([g for s in train for g in grades_of(s)], dtype=torch.float)
    sizes = [len(s.candidates) for s in test]
    rel = cfg.eval.binary_rel
    where = model_cfg.path or model_cfg.preset
    if Path(where).is_absolute() and Path(where).is_relative_to(Path.cwd()):
        where = str(Path(where).relative_to(Path.cwd()))
    lines = [f"Teacher `{where}`, prompt `{cfg.prompt.template}`; probes fit on "
             f"{len(train)} train slates (ridge {args.ridge}), scored on {len(test)} test slates (nDCG@10, graded gains).", "",
             f"First stage on the same test slates: {quality(test, first_stage_order(test), rel)['nDCG@10']:.4f}", "",
             "| state read | probe nDCG@10 |", "| --- | ---: |"]
    for layer in range(train_x.shape[0]):
        perms = probe_rankings(train_x[layer], train_y, test_x[layer], sizes, args.ridge)
        name = "embeddings" if layer == 0 else f"after layer {layer}"
        lines.append(f"| {name} | {quality(test, perms, rel)['nDCG@10']:.4f} |")
        print(lines[-1], flush=True)

    try:
        digits = grade_token_ids(tokenizer, max(max(grades_of(s)) for s in test))
    except ValueError:  # multi-token digits: no grade readout through the LM head
        digits = None
    if digits:
        gold = [g for s in test for g in grades_of(s)]
        read = test_logits[:, digits].argmax(-1).tolist()
        confusions = Counter((g, p) for g, p in zip(gold, read) if g != p)
        wrong = sum(confusions.values())
        expected = (test_logits[:, digits].softmax(-1) * torch.arange(len(digits))).sum(-1).split(sizes)
        by_grade = [scores_to_perm(e.numpy()) for e in expected]
        lines += ["", f"Grade read by the teacher's LM head at each candidate's last token: accuracy "
                  f"{1 - wrong / len(gold):.3f} over {len(gold)} candidates; ranking by its expected grade: nDCG@10 "
                  f"{quality(test, by_grade, rel)['nDCG@10']:.4f}. Errors (gold → read): "
                  + (", ".join(f"{g}→{p}: {n}" for (g, p), n in confusions.most_common(8)) or "none") + "."]

    slates = test[: args.attention_slates]
    on_ids, on_items = first_id_attention(model, builder, slates)
    lines += ["", f"Attention of the position that writes the first identifier, mean share over {len(slates)} test "
              "slates: on the identifier tokens / on the candidates' last tokens, per head.", "",
              "| layer | " + " | ".join(f"head {h}" for h in range(on_ids.shape[1])) + " |",
              "| ---: |" + " ---: |" * on_ids.shape[1]]
    for layer in range(on_ids.shape[0]):
        lines.append(f"| {layer + 1} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(on_ids[layer], on_items[layer])) + " |")
    write_report("teacher_probe", "Where the teacher keeps relevance, and where its answer looks", "\n".join(lines),
                 args.output)


if __name__ == "__main__":
    main()
