"""Teacher text -> permutation, with counts of what went wrong. Never a silent fallback.

`parse_ranking("[2] > [3] > [1]", n=3)` -> permutation [1, 2, 0] (0-based), counts.ok == 1.
Flags (an output may raise several): `wrong_format` (no `[i]` identifiers: prose, "Passage 3",
an unterminated reasoning block), `repeated`, `missing`, `out_of_range`. Reasoning blocks
(`<think>...</think>`) are removed first. Digits may be any Unicode decimal digits ("[３]").

Only when the caller passes `repair=True` is a flawed answer turned into a permutation: the
first occurrence of each in-range id is kept, and the missing ids are appended in input order.
Without it the permutation is None unless the answer was ok.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hllm.records import ParseCounts

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_BRACKET_ID = re.compile(r"\[\s*(\d+)\s*\]")  # \d matches any Unicode decimal digit
_LOOSE_ID = re.compile(r"(?:passage|document|doc|item|candidate)\s*#?\s*(\d+)", re.IGNORECASE)


@dataclass
class ParsedRanking:
    permutation: list[int] | None  # 0-based, best first
    counts: ParseCounts  # this one output's flags (total == 1)


def extract_ids(text: str) -> tuple[list[int], bool]:
    """-> (1-based ids in order of appearance, whether they were in the `[i]` format)."""
    text = _THINK.sub(" ", text)
    if re.search(r"<think>", text, re.IGNORECASE):  # unterminated: the answer never came
        return [], False
    ids = [int(m) for m in _BRACKET_ID.findall(text)]
    if ids:
        return ids, True
    return [int(m) for m in _LOOSE_ID.findall(text)], False


def parse_ranking(text: str, n: int, repair: bool = False) -> ParsedRanking:
    ids, bracketed = extract_ids(text)
    in_range = [i for i in ids if 1 <= i <= n]
    unique = list(dict.fromkeys(in_range))
    counts = ParseCounts(total=1)
    counts.wrong_format = int(not bracketed)
    counts.out_of_range = int(len(in_range) < len(ids))
    counts.repeated = int(len(unique) < len(in_range))
    counts.missing = int(len(unique) < n)
    counts.ok = int(not (counts.wrong_format or counts.out_of_range or counts.repeated or counts.missing))
    if counts.ok:
        perm = [i - 1 for i in unique]
    elif repair:
        seen = set(unique)
        perm = [i - 1 for i in unique] + [i for i in range(n) if i + 1 not in seen]
    else:
        perm = None
    return ParsedRanking(perm, counts)


def format_ranking(permutation: list[int]) -> str:
    """0-based permutation -> the teacher's answer format `[3] > [1] > [2]`."""
    return " > ".join(f"[{i + 1}]" for i in permutation)
