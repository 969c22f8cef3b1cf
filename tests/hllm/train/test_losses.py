import itertools

import pytest
import torch

from hllm.train.loop import TorchOptimizer, TrainConfig, train_loop, use_bf16
from hllm.train.losses import LOSSES, log_sinkhorn, mixed_loss

B, N, K = 3, 6, 6


def perfect(perm: torch.Tensor, k: int, margin: float = 30.0) -> torch.Tensor:
    """(B, N, K) logits that put perm[b, j] at rank j, and items ranked below K nowhere in the top K."""
    logits = torch.zeros((perm.shape[0], perm.shape[1], k))
    for b in range(perm.shape[0]):
        for item in perm[b, k:].tolist():
            if item >= 0:
                logits[b, item, :] = -margin
        for j in range(k):
            if perm[b, j] >= 0:
                logits[b, perm[b, j], j] = margin
    return logits


def make_batch(k: int = K):
    perm = torch.stack([torch.randperm(N) for _ in range(B)])
    mask = torch.ones((B, N), dtype=torch.bool)
    mask[1, 4:] = False  # slate 1 has 4 real items
    perm[1] = torch.tensor([2, 0, 3, 1, -1, -1])
    grades = torch.zeros((B, N), dtype=torch.long)
    for b in range(B):
        for rank, item in enumerate(perm[b].tolist()):
            if item >= 0:
                grades[b, item] = N - rank  # distinct grades: the ideal order is perm
    grades[~mask] = -1
    return perm, mask, grades


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("k", [K, 3])
def test_near_zero_on_a_perfect_matrix(name, k):
    perm, mask, grades = make_batch()
    spec = LOSSES[name]
    if spec.scalar:
        # a perfect scalar score: descending along the permutation, wide gaps
        logits = torch.zeros((B, N, 1))
        for b in range(B):
            for rank, item in enumerate(perm[b].tolist()):
                if item >= 0:
                    logits[b, item, 0] = 40.0 * (N - rank)
        target = perm if spec.target == "perm" else grades
        if name == "listnet":
            logits = grades.float()[:, :, None].clone()  # KL is zero when scores equal grades / T
    else:
        logits = perfect(perm, k)
        target = perm if spec.target == "perm" else grades
    value = spec.fn(logits, target, mask)
    assert float(value) < 1e-3, (name, float(value))
    # and clearly positive on random logits
    assert float(spec.fn(torch.randn_like(logits), target, mask)) > 0.05


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_reach_only_unmasked_items(name):
    perm, mask, grades = make_batch()
    spec = LOSSES[name]
    k = 1 if spec.scalar else K
    logits = torch.randn((B, N, k), requires_grad=True)
    target = perm if spec.target == "perm" else grades
    spec.fn(logits, target, mask).backward()
    assert logits.grad[~mask].abs().max() == 0
    assert logits.grad[mask].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_empty_mask_gives_zero(name):
    spec = LOSSES[name]
    logits = torch.randn((2, 4, 1 if spec.scalar else 4))
    target = torch.full((2, 4), -1)
    assert float(spec.fn(logits, target, torch.zeros((2, 4), dtype=torch.bool))) == 0.0


def test_sinkhorn_is_doubly_stochastic_on_real_items():
    _, mask, _ = make_batch()
    p = log_sinkhorn(torch.randn(B, N, 3), mask, iters=200).exp()
    for b in range(B):
        n = int(mask[b].sum())
        block = p[b, :n, :n]
        assert torch.allclose(block.sum(0), torch.ones(n), atol=1e-4)
        assert torch.allclose(block.sum(1), torch.ones(n), atol=1e-4)
        assert float(p[b, n:].sum()) < 1e-6


def test_graded_ce_accepts_any_item_of_the_wanted_grade():
    logits = torch.full((1, 3, 3), -30.0)
    mask = torch.ones((1, 3), dtype=torch.bool)
    grades = torch.tensor([[2, 2, 0]])
    logits[0, 1, 0], logits[0, 0, 1], logits[0, 2, 2] = 30.0, 30.0, 30.0  # tie swapped: still perfect
    assert float(LOSSES["graded_ce"].fn(logits, grades, mask)) < 1e-3


def test_mixed_loss_weights_and_missing_targets():
    perm, mask, grades = make_batch()
    logits = torch.randn((B, N, K))
    total, parts = mixed_loss(logits, mask, {"position_ce": 1.0, "graded_ce": 0.5}, perm=perm, grades=grades)
    assert float(total) == pytest.approx(parts["position_ce"] + 0.5 * parts["graded_ce"], rel=1e-5)
    with pytest.raises(ValueError, match="needs 'grades'"):
        mixed_loss(logits, mask, {"graded_ce": 1.0}, perm=perm)


# ---- the one training loop ------------------------------------------------------------------------
def _quadratic(steps: int, **kw):
    """A one-parameter problem for the loop: (w, its optimiser, the config, a loss function, endless chunks)."""
    w = torch.nn.Parameter(torch.tensor([3.0]))
    cfg = TrainConfig(steps=steps, batch_size=1, warmup_steps=1, **kw)
    return TorchOptimizer([([w], 0.1)], cfg), cfg, (lambda chunk: ((w ** 2).sum(), {})), itertools.repeat([None])


def test_train_loop_honours_log_every_validate_and_on_step():
    opt, cfg, loss, chunks = _quadratic(5, log_every=2)
    logged, stepped = [], []
    history = train_loop(loss, chunks, opt, cfg, "cpu", validate=lambda: {"val_loss": 1.0},
                         log=lambda s, row: logged.append(s), on_step=lambda row, last: stepped.append((row["step"], last)))
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5] and logged == [2, 4, 5]
    assert [h.get("val_loss") for h in history] == [None, 1.0, None, 1.0, 1.0]
    assert stepped[-1] == (5, True) and not any(last for _, last in stepped[:-1])
    assert history[-1]["loss"] < history[0]["loss"]


def test_train_loop_stops_at_the_time_budget_and_says_so():
    opt, cfg, loss, chunks = _quadratic(100, time_budget_s=1e-9)
    history = train_loop(loss, chunks, opt, cfg, "cpu")
    assert len(history) == 1 and history[-1]["stopped_early"]
    # the decision can be made collectively (an all-reduce under DeepSpeed): none wants to stop, none does
    opt, cfg, loss, chunks = _quadratic(3, time_budget_s=1e-9)
    history = train_loop(loss, chunks, opt, cfg, "cpu", agree=lambda stop: False)
    assert len(history) == 3 and "stopped_early" not in history[-1]


def test_train_loop_resumes_the_step_count():
    opt, cfg, loss, chunks = _quadratic(5)
    assert [h["step"] for h in train_loop(loss, chunks, opt, cfg, "cpu", start_step=3)] == [4, 5]


def test_bf16_autocast_is_on_only_where_it_is_native():
    assert use_bf16(None, "cuda") and use_bf16(True, "cpu") and not use_bf16(False, "cuda")
    assert use_bf16(None, "cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # emulated bf16 is ~70x slower
