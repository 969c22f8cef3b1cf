"""Single-process training: the student's loss step and the teacher bootstrap, without Ray.

One loop (`train_loop`) serves every path: the student in one process (`train_student`, a torch
AdamW), the student on Ray Train workers (the same loop, stepping a DeepSpeed engine passed in by
`pipelines/train_student.py`), and the teacher bootstrap.

Teacher bootstrap: no pretrained ranker can be downloaded for the embedded default, so the tiny
causal LM is fine-tuned to *write* the gold ranking `[3] > [1] > ...</s>` after the prompt. With
`bootstrap_loss: set`, the loss at each identifier accepts any not-yet-written item of the grade
the ideal ranking has there (ties in grade are not an order to learn); separators and the end
token keep plain cross-entropy. From then on it is used exactly like a real teacher.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from hllm.data.order import FIRST_STAGE, InputOrder, permuted, reorder
from hllm.model.prompts import EncodedPrompt, PromptBuilder, collate
from hllm.model.ranker import AdaptConfig, adapt_backbone
from hllm.records import RankedSlate, RerankRequest
from hllm.teacher.parsing import format_ranking
from hllm.train.losses import LOSSES, NEG, listnet_kl, mixed_loss


@dataclass
class TrainConfig:
    """An optimisation run (student or teacher bootstrap)."""

    steps: int = 300  # optimiser steps
    batch_size: int = 16  # slates per step (over all workers)
    lr: float = 1e-3  # peak learning rate (AdamW), cosine decay after warm-up
    head_lr: float | None = None  # default: lr
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 20  # linear warm-up steps
    grad_clip: float = 1.0  # max gradient norm
    seed: int = 0  # data order and initialisation
    log_every: int = 25  # steps between train/held-out loss logs
    time_budget_s: float | None = None  # stop early (and say so) once exceeded
    # bf16 autocast of the forward pass. None (auto): on CUDA, and on CPUs with native bf16 (AMX /
    # AVX512-BF16); elsewhere emulated bf16 runs ~70x slower than fp32, so it stays off
    autocast_bf16: bool | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("train.steps and train.batch_size must be >= 1")


@dataclass
class LossConfig:
    """Which losses, with weights. Teacher terms need teacher rankings, graded terms need grades."""

    terms: dict[str, float] = field(default_factory=lambda: {"position_ce": 1.0})  # loss name -> weight (hllm.train.losses.LOSSES)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.terms) - set(LOSSES))
        if unknown:
            raise ValueError(f"loss.terms: unknown loss {unknown}; known: {sorted(LOSSES)}")
        if not any(w > 0 for w in self.terms.values()):
            raise ValueError("loss.terms: at least one weight must be > 0")

    @property
    def needs_teacher(self) -> bool:
        return any(LOSSES[n].target == "perm" and w for n, w in self.terms.items())


def use_bf16(setting: bool | None, device_type: str) -> bool:
    """Resolves `autocast_bf16` for a device (None: where bf16 is native)."""
    if setting is not None:
        return setting
    if device_type == "cuda":
        return True
    return device_type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10%."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


# ---- the one training loop ----------------------------------------------------------------------
class Optimizer(Protocol):
    """What `train_loop` steps: backward of a loss, one optimiser step (clip, update, schedule)."""

    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...
    @property
    def lr(self) -> float: ...


def make_optimizer(groups: list[tuple[list[torch.nn.Parameter], float]], cfg: TrainConfig):
    """-> (torch AdamW over the trainable parameters of each (params, lr) group, its schedule)."""
    params = [{"params": [p for p in ps if p.requires_grad], "lr": lr} for ps, lr in groups]
    opt = torch.optim.AdamW([g for g in params if g["params"]], weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))


class TorchOptimizer:
    """AdamW + warm-up/cosine schedule + gradient clipping, in one process (the default)."""

    def __init__(self, groups: list[tuple[list[torch.nn.Parameter], float]], cfg: TrainConfig):
        self.opt, self.sched = make_optimizer(groups, cfg)
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.clip = cfg.grad_clip

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]


def train_loop(loss_fn: Callable[[list], tuple[torch.Tensor, dict]], chunks: Iterator[list], optimizer: Optimizer,
               cfg: TrainConfig, device_type: str, *, start_step: int = 0,
               validate: Callable[[], dict[str, float]] | None = None,
               log: Callable[[int, dict], None] | None = None,
               on_step: Callable[[dict, bool], None] | None = None,
               agree: Callable[[bool], bool] = lambda stop: stop) -> list[dict]:
    """The one training loop: chunk -> loss (bf16 autocast if asked) -> backward -> step.

    Every `cfg.log_every` steps and at the end, `validate()` adds held-out metrics to the row and
    `log` sees it. `on_step(row, last)` runs after every step (checkpoints, tracking). Past
    `cfg.time_budget_s` the loop stops early and says so; `agree` turns one process's wish to stop
    into every worker's decision (an all-reduce under data parallelism). -> history rows."""
    history: list[dict] = []
    bf16 = use_bf16(cfg.autocast_bf16, device_type)
    t0 = time.perf_counter()
    for step in range(start_step, cfg.steps):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            loss, parts = loss_fn(next(chunks))
        optimizer.backward(loss)
        optimizer.step()
        row = {"step": step + 1, "loss": float(loss.detach()), "lr": optimizer.lr,
               "elapsed_s": time.perf_counter() - t0, **parts}
        stop = agree(bool(cfg.time_budget_s and row["elapsed_s"] > cfg.time_budget_s))
        last = stop or step + 1 == cfg.steps
        if stop and step + 1 < cfg.steps:
            row["stopped_early"] = True
        if (step + 1) % cfg.log_every == 0 or last:
            if validate:
                row.update(validate())
            if log:
                log(step + 1, row)
        history.append(row)
        if on_step:
            on_step(row, last)
        if last:
            break
    return history


def batches(examples: list, batch_size: int, seed: int) -> Iterator[list]:
    """Endless shuffled batches, reshuffled each epoch (fewer examples than `batch_size`: all of them)."""
    if not examples:
        raise ValueError("no training examples to batch")
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, max(len(order) - batch_size + 1, 1), batch_size):
            yield [examples[i] for i in order[start: start + batch_size]]


# ---- student ----------------------------------------------------------------------------------
@dataclass
class StudentExample:
    prompt: EncodedPrompt
    perm: list[int] | None  # teacher permutation, 0-based
    grades: list[int] | None


def student_examples(builder: PromptBuilder, ranked: Sequence[RankedSlate], loss_cfg: LossConfig,
                     orders: Sequence[str] = ("first-stage",)) -> tuple[list[StudentExample], int]:
    """Slates with their teacher rankings -> (examples, dropped). The one filter: when a loss term
    needs the teacher's permutation, slates without one (unparseable, not repaired) are dropped.

    Permutation augmentation: each slate becomes one example per order of `orders` (`hllm.data.order`): its
    candidates, grades and the teacher's permutation moved together (the target is the same documents' ranking);
    an order other than the first stage's is not declared (the head's prior does not read it)."""
    keep = [r for r in ranked if r.ranking.permutation is not None or not loss_cfg.needs_teacher]
    out = []
    for name in orders:
        order = InputOrder.parse(name)
        for r in keep:
            slate, perm = reorder(r.slate, order), r.ranking.permutation
            if perm is not None and order != FIRST_STAGE:
                moved = order.permutation(len(r.slate.candidates), r.slate.slate_id,
                                          [c.shown for c in r.slate.candidates])  # new position -> old
                new_of = {old: new for new, old in enumerate(moved)}
                perm = [new_of[i] for i in perm]
            prompt = dataclasses.replace(builder.encode(slate, with_answer=False), first_stage_order=order.declared)
            out.append(StudentExample(prompt, perm, slate.grades))
    return out, len(ranked) - len(keep)


def student_batch(examples: list[StudentExample], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """-> prompt tensors + perm (B, N) and grades (B, N), both padded with -1, on `device`."""
    batch = collate([e.prompt for e in examples], pad_id)
    batch["perm"], batch["grades"] = padded_targets([e.perm for e in examples], [e.grades for e in examples],
                                                    batch["item_mask"].shape[1])
    batch["declared"] = torch.tensor([e.prompt.first_stage_order for e in examples])  # (B,) may the prior read the order
    return {k: v.to(device) for k, v in batch.items()}


def padded_targets(perms: Sequence[list[int] | None], grades: Sequence[Sequence[int | None] | None], n: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slate its teacher permutation and grades -> perm (B, N) and grades (B, N), padded with -1
    (an absent permutation, an absent or unjudged grade: -1 too, which the losses leave out)."""
    perm = torch.full((len(perms), n), -1, dtype=torch.long)
    graded = torch.full((len(perms), n), -1, dtype=torch.long)
    for row, (p, g) in enumerate(zip(perms, grades)):
        if p is not None:
            perm[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        if g is not None:
            graded[row, : len(g)] = torch.tensor([-1 if x is None else x for x in g], dtype=torch.long)
    return perm, graded


def student_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss_cfg: LossConfig):
    """-> (loss, {term: value}). `model` is a SinglePassRanker (or a DeepSpeed engine around one)."""
    logits = model(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_mask"], batch["item_spans"],
                   declared=batch.get("declared"))
    return mixed_loss(logits, batch["item_mask"], loss_cfg.terms, perm=batch["perm"], grades=batch["grades"])


def param_groups(ranker, cfg: TrainConfig) -> list[tuple[list[torch.nn.Parameter], float]]:
    """The student's optimiser groups: the backbone (LoRA or all of it) at `lr`, the head at `head_lr`."""
    return [(list(ranker.backbone.parameters()), cfg.lr), (list(ranker.head.parameters()), cfg.head_lr or cfg.lr)]


@torch.no_grad()
def validation_loss(ranker, examples: list[StudentExample], loss_cfg: LossConfig, batch_size: int = 32) -> dict[str, float]:
    """Mean student loss over held-out examples (no gradient); {} when there are none."""
    if not examples:
        return {}
    was_training = ranker.training
    ranker.eval()
    total = 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        loss, _ = student_loss(ranker, student_batch(chunk, ranker.tokenizer.pad_token_id, ranker.device), loss_cfg)
        total += float(loss) * len(chunk)
    ranker.train(was_training)
    return {"val_loss": total / len(examples)}


def train_student(ranker, examples: list[StudentExample], cfg: TrainConfig, loss_cfg: LossConfig,
                  val: list[StudentExample] | None = None, log: Callable[[int, dict], None] | None = None) -> list[dict]:
    """In one process, with a torch AdamW. -> history rows (with `val_loss` where `val` is given)."""
    torch.manual_seed(cfg.seed)
    ranker.train()
    pad = ranker.tokenizer.pad_token_id
    history = train_loop(lambda chunk: student_loss(ranker, student_batch(chunk, pad, ranker.device), loss_cfg),
                         batches(examples, cfg.batch_size, cfg.seed), TorchOptimizer(param_groups(ranker, cfg), cfg),
                         cfg, ranker.device.type, validate=(lambda: validation_loss(ranker, val, loss_cfg)) if val else None,
                         log=log)
    ranker.eval()
    return history


# ---- teacher bootstrap -------------------------------------------------------------------------
@dataclass
class BootstrapConfig:
    """Fine-tuning the tiny causal LM into a listwise teacher on gold permutations."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=600, batch_size=32, lr=3e-3, warmup_steps=30))
    loss: Literal["set", "exact"] = "set"  # answer loss: set (any order of tied grades is right) or exact
    # curriculum by multi-tasking: also predict each candidate's grade ("0".."3") at its last
    # token through the LM head, so relevance is learned alongside (not after) the format
    grade_weight: float = 1.0
    # and each candidate's own identifier at its last token (restricted to identifier tokens):
    # the copy the answer needs ("the best item is ... [7]") then starts from the right state
    id_weight: float = 1.0
    # FIRST-style listwise term: at every identifier position, the logits of the identifiers not
    # yet written should follow the grades (ListNet KL), so 2 > 0 is learned, not only "3 is right"
    listwise_weight: float = 1.0
    # what is trained: every weight (the tiny model from scratch), or LoRA adapters on a
    # pretrained LM with few train queries (merged into the weights afterwards)
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(mode="full"))
    # share of train slates shown with their candidates in a random order instead of the first
    # stage's (RankVicuna's shuffled-input augmentation): in first-stage order the cheapest
    # answer is "[1] > [2] > ...", and a model that learns that position prior never learns to
    # read relevance out of the passages
    shuffle_candidates: float = 0.0
    # the grade an unjudged candidate is trained as (0: non-relevant, as trec_eval scores it);
    # None: every candidate must be judged (the embedded data always is)
    unjudged_grade: int | None = None
    # with held-out slates: their answer loss every `train.log_every` steps, and the weights of the
    # best one are kept (early stopping without stopping: the schedule still runs to the end)
    keep_best: bool = True
    # the order the gold answer gives candidates of equal grade: random (with `loss: set`, any order
    # of tied grades is right, so the teacher's own order among them is arbitrary), or first_stage
    # (their input order: a stable sort by grade, one deterministic answer a student can learn;
    # needs `loss: exact`, under which that order is what is trained)
    ties: Literal["random", "first_stage"] = "random"

    def __post_init__(self) -> None:
        if self.ties == "first_stage" and self.loss != "exact":
            raise ValueError("teacher.bootstrap_cfg.ties=first_stage needs loss=exact (loss=set accepts any order of ties)")


def gold_permutation(grades: list[int | None], rng: random.Random | None = None) -> list[int]:
    """By grade, best first; equal grades keep input order, or a random order when `rng` is given."""
    tie = [rng.random() for _ in grades] if rng else list(range(len(grades)))
    return sorted(range(len(grades)), key=lambda i: (-(grades[i] or 0), tie[i]))


@dataclass
class BootstrapExample:
    input_ids: list[int]  # prompt + answer + eos
    answer_start: int  # index of the first answer token
    accept: list[list[int]]  # per answer token: the token ids that count as right
    item_positions: list[int]  # last token of each candidate
    grades: list[int]
    answer_perm: list[int]  # the gold order the answer was written in


def shuffled(request: RerankRequest, rng: random.Random) -> RerankRequest:
    """The same slate with its candidates (and their grades) in a random order."""
    order = list(range(len(request.candidates)))
    rng.shuffle(order)
    return permuted(request, order)


def bootstrap_examples(builder: PromptBuilder, requests: list[RerankRequest], loss: str = "set",
                       seed: int = 0, shuffle_candidates: float = 0.0, unjudged_grade: int | None = None,
                       ties: str = "random") -> list[BootstrapExample]:
    """Gold answers with ties in grade in a random order (`ties`), or in their input order. A
    `shuffle_candidates` share of the slates is shown in a random candidate order."""
    tok = builder.tokenizer
    rng = random.Random(seed)
    out = []
    for req in requests:
        if req.grades is not None and unjudged_grade is not None:
            req = dataclasses.replace(req, grades=[unjudged_grade if g is None else g for g in req.grades])
        if req.grades is None or any(g is None for g in req.grades):
            raise ValueError(f"slate {req.slate_id!r}: the teacher bootstrap needs a grade for every candidate "
                             f"(or teacher.bootstrap_cfg.unjudged_grade to train unjudged ones as that grade)")
        if shuffle_candidates and rng.random() < shuffle_candidates:
            req = shuffled(req, rng)
        perm = gold_permutation(req.grades, rng if ties == "random" else None)
        answer = tok(format_ranking(perm), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        accept = [[t] for t in answer]
        if loss == "set":
            id_tok = {i: tok(f"[{i + 1}]", add_special_tokens=False)["input_ids"] for i in range(len(perm))}
            if any(len(v) != 1 for v in id_tok.values()) or len(answer) != 2 * len(perm):
                raise ValueError("bootstrap loss 'set' needs single-token identifiers and separators; use 'exact'")
            for rank, item in enumerate(perm):
                wanted = req.grades[item]
                accept[2 * rank] = [id_tok[j][0] for j in perm[rank:] if req.grades[j] == wanted]
        enc = builder.encode(req, with_answer=True)
        out.append(BootstrapExample(enc.input_ids + answer, len(enc.input_ids), accept, enc.item_positions,
                                    [int(g) for g in req.grades], perm))
    return out


def grade_token_ids(tokenizer, max_grade: int = 3) -> list[int]:
    ids = [tokenizer(str(g), add_special_tokens=False)["input_ids"] for g in range(max_grade + 1)]
    if any(len(i) != 1 for i in ids):
        raise ValueError("the grade auxiliary loss needs single-token digits; set grade_weight=0")
    return [i[0] for i in ids]


def id_token_ids(tokenizer, n: int) -> list[int]:
    ids = [tokenizer(f"[{i}]", add_special_tokens=False)["input_ids"] for i in range(1, n + 1)]
    if any(len(i) != 1 for i in ids):
        raise ValueError("the identifier auxiliary loss needs single-token identifiers; set id_weight=0")
    return [i[0] for i in ids]


def bootstrap_loss(model, chunk: list[BootstrapExample], pad_id: int, device, grade_tokens: list[int] | None = None,
                   grade_weight: float = 0.0, id_tokens: list[int] | None = None, id_weight: float = 0.0,
                   listwise_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """-log sum_{accepted tokens} p(token), averaged over answer tokens; prompt tokens carry no loss.

    With `grade_weight`, adds the CE of each candidate's grade, read at its last token and
    restricted to the grade tokens.
    """
    b, t = len(chunk), max(len(e.input_ids) for e in chunk)
    a_max = max(len(acc) for e in chunk for acc in e.accept)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention = torch.zeros((b, t), dtype=torch.long)
    rows, cols, accept = [], [], []
    for r, e in enumerate(chunk):
        input_ids[r, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention[r, : len(e.input_ids)] = 1
        for j, acc in enumerate(e.accept):
            rows.append(r)
            cols.append(e.answer_start + j - 1)  # the position that predicts answer token j
            accept.append(acc + [-1] * (a_max - len(acc)))
    accept_t = torch.tensor(accept, device=device)  # (P, A) accepted token ids, -1 padded
    out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False,
                logits_to_keep=0)
    log_p = torch.log_softmax(out.logits[torch.tensor(rows), torch.tensor(cols)].float(), dim=-1)  # (P, V)
    picked = log_p.gather(1, accept_t.clamp_min(0)).masked_fill(accept_t < 0, NEG)  # (P, A)
    answer_nll = -torch.logsumexp(picked, dim=1).mean()
    parts = {"answer_nll": float(answer_nll.detach())}
    total = answer_nll
    if listwise_weight and id_tokens is not None:
        lw = _listwise_term(out.logits, chunk, id_tokens, device)
        parts["listwise_kl"] = float(lw.detach())
        total = total + listwise_weight * lw
    if not (grade_weight or id_weight):
        return total, parts
    rows = torch.tensor([r for r, e in enumerate(chunk) for _ in e.item_positions])
    cols = torch.tensor([p for e in chunk for p in e.item_positions])
    item_logits = out.logits[rows, cols].float()  # (I, V) at each candidate's last token
    if grade_weight:
        target = torch.tensor([g for e in chunk for g in e.grades], device=device)  # (I,)
        grade_ce = torch.nn.functional.cross_entropy(item_logits[:, grade_tokens], target)
        parts["grade_ce"] = float(grade_ce.detach())
        total = total + grade_weight * grade_ce
    if id_weight:
        target = torch.tensor([i for e in chunk for i in range(len(e.item_positions))], device=device)  # (I,)
        id_ce = torch.nn.functional.cross_entropy(item_logits[:, id_tokens[: max(len(e.item_positions) for e in chunk)]], target)
        parts["id_ce"] = float(id_ce.detach())
        total = total + id_weight * id_ce
    return total, parts


def _listwise_term(logits: torch.Tensor, chunk: list[BootstrapExample], id_tokens: list[int], device) -> torch.Tensor:
    """Mean over identifier positions of KL(softmax(grades of unwritten items) || softmax(their id logits))."""
    n = max(len(e.grades) for e in chunk)
    rows, cols, grades = [], [], []
    for r, e in enumerate(chunk):
        remaining = torch.full((n,), float("nan"))
        remaining[: len(e.grades)] = torch.tensor(e.grades, dtype=torch.float)
        for rank, item in enumerate(e.answer_perm):
            rows.append(r)
            cols.append(e.answer_start + 2 * rank - 1)  # predicts the id at this rank
            grades.append(remaining.clone())
            remaining[item] = float("nan")  # written: no longer a choice
    g = torch.stack(grades).to(device)  # (P, N) grade of each still-unwritten item, NaN otherwise
    valid = ~torch.isnan(g)
    pred = logits[torch.tensor(rows), torch.tensor(cols)][:, id_tokens[:n]].float()  # (P, N)
    return listnet_kl(pred[:, :, None], torch.nan_to_num(g, nan=-1.0), valid)


def bootstrap_teacher(model, builder: PromptBuilder, requests: list[RerankRequest], cfg: BootstrapConfig,
                      log: Callable[[int, dict], None] | None = None, val: list[RerankRequest] | None = None):
    """Fine-tunes `model` to write the gold rankings of `requests`. -> (the model, merged when
    LoRA-adapted, history rows; with `val`, rows carry `val_answer_nll` and, with `keep_best`,
    the weights are those of the best validation)."""
    device = next(model.parameters()).device
    pad = builder.tokenizer.pad_token_id
    grades = grade_token_ids(builder.tokenizer) if cfg.grade_weight else None
    n_max = max(len(r.candidates) for r in requests)
    ids = id_token_ids(builder.tokenizer, n_max) if (cfg.id_weight or cfg.listwise_weight) else None
    step_fn = lambda chunk: bootstrap_loss(model, chunk, pad, device, grades, cfg.grade_weight, ids,
                                           cfg.id_weight, cfg.listwise_weight)
    torch.manual_seed(cfg.train.seed)
    model = adapt_backbone(model, cfg.adapt)
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    examples = bootstrap_examples(builder, requests, cfg.loss, cfg.train.seed, cfg.shuffle_candidates, cfg.unjudged_grade,
                                  cfg.ties)
    held_out = bootstrap_examples(builder, val, cfg.loss, cfg.train.seed, unjudged_grade=cfg.unjudged_grade,
                                  ties=cfg.ties) if val else []
    best: dict = {"val_answer_nll": math.inf, "weights": None}

    @torch.no_grad()
    def validate() -> dict[str, float]:
        model.eval()
        nll = sum(float(bootstrap_loss(model, held_out[i: i + 8], pad, device)[0]) * len(held_out[i: i + 8])
                  for i in range(0, len(held_out), 8)) / len(held_out)
        model.train()
        if nll < best["val_answer_nll"]:
            best.update(val_answer_nll=nll, weights={n: p.detach().clone() for n, p in trainable.items()})
        return {"val_answer_nll": nll}

    history = train_loop(step_fn, batches(examples, cfg.train.batch_size, cfg.train.seed),
                         TorchOptimizer([(list(trainable.values()), cfg.train.lr)], cfg.train), cfg.train, device.type,
                         validate=validate if held_out else None, log=log)
    if held_out and cfg.keep_best:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(best["weights"][n])
        best_row = min((r for r in history if "val_answer_nll" in r), key=lambda r: r["val_answer_nll"])
        history[-1].update(kept_step=best_row["step"], kept_val_answer_nll=best_row["val_answer_nll"])
    if cfg.adapt.mode == "lora":
        model = model.merge_and_unload()
    model.eval()
    return model, history
