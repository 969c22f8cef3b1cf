import pytest

from hllm.teacher.parsing import format_ranking, parse_ranking

# (text, n, expected flags, permutation without repair, permutation with repair)
CASES = [
    ("[2] > [3] > [1]", 3, {"ok"}, [1, 2, 0], [1, 2, 0]),
    ("  [2]>[3]  >[1]\n", 3, {"ok"}, [1, 2, 0], [1, 2, 0]),
    ("<think>Passage [1] talks about X, [3] is off-topic.</think>\n[2] > [1] > [3]", 3, {"ok"}, [1, 0, 2], [1, 0, 2]),
    ("<think>Let me compare [1] and [2] carefully", 3, {"wrong_format", "missing"}, None, [0, 1, 2]),
    ("Passage 3 > Passage 1 > Passage 2", 3, {"wrong_format"}, None, [2, 0, 1]),
    ("[３] > [１] > [２]", 3, {"ok"}, [2, 0, 1], [2, 0, 1]),  # full-width digits
    ("[٢] > [١]", 2, {"ok"}, [1, 0], [1, 0]),  # Arabic-Indic digits
    ("[4] > [2] > [1", 4, {"missing"}, None, [3, 1, 0, 2]),  # truncated output
    ("[2] > [2] > [1] > [3]", 3, {"repeated"}, None, [1, 0, 2]),
    ("[5] > [1] > [2] > [3]", 3, {"out_of_range"}, None, [0, 1, 2]),
    ("The most relevant passage is the second one, then the first.", 2, {"wrong_format", "missing"}, None, [0, 1]),
    ("", 2, {"wrong_format", "missing"}, None, [0, 1]),
    ("Ranking: [1] > [3] > [1] > [9]", 3, {"repeated", "out_of_range", "missing"}, None, [0, 2, 1]),
]
FLAGS = ["ok", "wrong_format", "repeated", "missing", "out_of_range"]


@pytest.mark.parametrize("text,n,flags,plain,repaired", CASES)
def test_realistic_teacher_outputs(text, n, flags, plain, repaired):
    out = parse_ranking(text, n)
    assert {f for f in FLAGS if getattr(out.counts, f)} == flags
    assert out.counts.total == 1
    assert out.permutation == plain
    fixed = parse_ranking(text, n, repair=True)
    assert fixed.permutation == repaired
    assert fixed.counts == out.counts  # repairing never hides what was wrong


def test_format_round_trip():
    perm = [4, 0, 3, 1, 2]
    assert format_ranking(perm) == "[5] > [1] > [4] > [2] > [3]"
    assert parse_ranking(format_ranking(perm), 5).permutation == perm
