"""Slate readers, one per format, selected by name from `READERS`.

- `beir`: a BEIR folder (`corpus.jsonl`, `queries.jsonl`, `qrels/<split>.tsv`) plus a TREC-style
  run file of first-stage candidates (`query-id corpus-id rank score`, with or without header;
  the 6-column `qid Q0 docid rank score tag` form is accepted too) -> the top N per query.
- `rank_llm`: rank_llm's request JSONL, `{"query": {"text", "qid"}, "candidates": [{"docid", "score", "doc"}]}`.
- `hllm`: this project's own JSONL, one `RerankRequest` as a dict per line (see `write_jsonl`).
- `tsv`: `qid<TAB>docid<TAB>text` rows with the query texts in `queries` (a `qid<TAB>text` TSV or
  BEIR's queries.jsonl), or `qid<TAB>query<TAB>docid<TAB>text` rows; candidates in file order.

A query with no candidates is an error too: it could not be reranked, and must not vanish.

Every malformed line is a `DataFormatError` naming the file and the line number.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hllm.data.plane import (DataFormatError, parse_doc_lines, parse_qrels_lines, parse_query_lines, parse_run_lines,
                              slates_in_memory)
from hllm.records import Candidate, Query, RerankRequest, record_to_dict, request_from_dict


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _field(obj: dict[str, Any], key: str, path: Path, lineno: int, where: str = "") -> Any:
    if key not in obj or obj[key] is None:
        raise DataFormatError(f"{path}:{lineno}: missing field {where}{key!r}")
    return obj[key]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def read_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """BEIR `query-id corpus-id score` or TREC `qid 0 docid grade` -> {qid: {docid: grade}}."""
    rows, bad = parse_qrels_lines(_lines(Path(path)), str(path), first_line=1)
    bad.check(len(rows), 0.0, str(path))
    qrels: dict[str, dict[str, int]] = defaultdict(dict)
    for r in rows:
        qrels[r["qid"]][r["docid"]] = r["grade"]
    return dict(qrels)


def read_run(path: str | Path) -> dict[str, list[tuple[str, float]]]:
    """TREC-style run -> {qid: [(docid, score), ...]} in rank order."""
    rows, bad = parse_run_lines(_lines(Path(path)), str(path), first_line=1)
    bad.check(len(rows), 0.0, str(path))
    hits: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        hits[r["qid"]].append(r)
    return {qid: [(h["docid"], h["score"]) for h in sorted(hs, key=lambda h: h["rank"])] for qid, hs in hits.items()}


def read_beir(root: str | Path, run_file: str | Path | None = None, top_n: int = 20, split: str = "test",
              max_bad_share: float = 0.0) -> list[RerankRequest]:
    """BEIR folder + first-stage run -> one slate of the top `top_n` per query of the run, by the data
    plane's per-batch functions (`hllm.data.plane`) over whole files: the slates the Ray data stage
    (`pipelines/data.py`) makes, in one process. Bad input is counted per reason; past
    `max_bad_share` of the run's rows a reason stops the read, naming it, its count and an example.
    Judged documents that the run did not retrieve into the slate stay in `extra_qrels`, so
    nDCG's ideal DCG counts them, as trec_eval does.
    """
    root = Path(root)
    run_path = Path(run_file) if run_file else root / "runs" / "bm25_top100.tsv"
    run, bad = parse_run_lines(_lines(run_path), str(run_path), first_line=1)
    parts = [parse_qrels_lines(_lines(root / "qrels" / f"{split}.tsv"), str(root / "qrels" / f"{split}.tsv"), 1),
             parse_doc_lines(_lines(root / "corpus.jsonl"), str(root / "corpus.jsonl")),
             parse_query_lines(_lines(root / "queries.jsonl"), str(root / "queries.jsonl"))]
    for _, b in parts:
        bad.merge(b)
    (qrels, _), (docs, _), (queries, _) = parts
    slates, b = slates_in_memory(run, qrels, docs, queries, top_n)
    bad.merge(b).check(len(run), max_bad_share, str(run_path))
    return slates


def read_rank_llm(path: str | Path, top_n: int | None = None) -> list[RerankRequest]:
    path = Path(path)
    slates = []
    for lineno, obj in _jsonl(path):
        q = _field(obj, "query", path, lineno)
        if not isinstance(q, dict):
            raise DataFormatError(f"{path}:{lineno}: 'query' must be an object with 'text' and 'qid'")
        query = Query(qid=str(_field(q, "qid", path, lineno, "query.")), text=str(_field(q, "text", path, lineno, "query.")))
        cands = []
        for i, c in enumerate(_field(obj, "candidates", path, lineno)):
            where = f"candidates[{i}]."
            doc = _field(c, "doc", path, lineno, where)
            if isinstance(doc, dict):  # rank_llm stores {"title", "text"/"segment"/"contents"}
                text = next((doc[k] for k in ("text", "segment", "contents", "body") if k in doc), None)
                if text is None:
                    raise DataFormatError(f"{path}:{lineno}: {where}doc has none of text/segment/contents")
                title = str(doc.get("title") or "")
            else:
                text, title = doc, ""
            cands.append(Candidate(docid=str(_field(c, "docid", path, lineno, where)), text=str(text),
                                   score=float(c["score"]) if c.get("score") is not None else None, title=title))
        if not cands:
            raise DataFormatError(f"{path}:{lineno}: query {query.qid!r} has no candidates")
        slates.append(RerankRequest(query, cands[:top_n] if top_n else cands))
    return slates


def read_hllm(path: str | Path, top_n: int | None = None) -> list[RerankRequest]:
    path = Path(path)
    slates = []
    for lineno, obj in _jsonl(path):
        try:
            req = request_from_dict(obj)
        except (KeyError, TypeError) as err:
            raise DataFormatError(f"{path}:{lineno}: not an hllm slate ({err})") from None
        if not req.candidates:
            raise DataFormatError(f"{path}:{lineno}: query {req.slate_id!r} has no candidates")
        if top_n:
            req.candidates = req.candidates[:top_n]
            req.grades = req.grades[:top_n] if req.grades else req.grades
        slates.append(req)
    return slates


def _text_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Tab-separated rows whose fields are free text (no quoting, no splitting on spaces); blank lines skipped."""
    with open(path, encoding="utf-8", newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
            if row and "".join(row).strip():
                yield lineno, row


def _query_texts(path: Path) -> dict[str, str]:
    if path.suffix == ".jsonl":
        return {str(_field(o, "_id", path, n)): str(_field(o, "text", path, n)) for n, o in _jsonl(path)}
    texts = {}
    for lineno, row in _text_rows(path):
        if len(row) != 2:
            raise DataFormatError(f"{path}:{lineno}: expected qid<TAB>text, got {len(row)} columns")
        texts[row[0]] = row[1]
    return texts


def read_tsv(path: str | Path, top_n: int | None = None, queries: str | Path | None = None) -> list[RerankRequest]:
    """(qid, docid, text) rows + a queries file, or (qid, query, docid, text) rows -> slates."""
    path = Path(path)
    texts = _query_texts(Path(queries)) if queries else {}
    slates: dict[str, RerankRequest] = {}
    for lineno, row in _text_rows(path):
        if len(row) == 4:
            qid, qtext, docid, text = row
        elif len(row) == 3 and queries:
            qid, docid, text = row
            if qid not in texts:
                raise DataFormatError(f"{path}:{lineno}: query {qid!r} is not in {queries}")
            qtext = texts[qid]
        else:
            need = "3 (qid, docid, text; queries from --queries)" if queries else \
                "4 (qid, query, docid, text), or 3 with a queries file"
            raise DataFormatError(f"{path}:{lineno}: expected {need} tab-separated columns, got {len(row)}")
        slate = slates.setdefault(qid, RerankRequest(Query(qid, qtext), []))
        if top_n is None or len(slate.candidates) < top_n:
            slate.candidates.append(Candidate(docid=docid, text=text))
    if not slates:
        raise DataFormatError(f"{path}: no rows")
    return list(slates.values())


def write_jsonl(slates: list[RerankRequest], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for s in slates:
            fh.write(json.dumps(record_to_dict(s)) + "\n")


READERS: dict[str, Callable[..., list[RerankRequest]]] = {
    "beir": read_beir,
    "rank_llm": read_rank_llm,
    "hllm": read_hllm,
    "tsv": read_tsv,
}


def read_slates(fmt: str, path: str | Path, **kwargs: Any) -> list[RerankRequest]:
    if fmt not in READERS:
        raise DataFormatError(f"unknown slate format {fmt!r} for {path}; known: {sorted(READERS)}")
    return READERS[fmt](path, **kwargs)


def collection_name(path: str | Path) -> str:
    """A collection folder's name, as reports, caches and model cards name it (`trec-dl19-passage-bm25top100`)."""
    return Path(path).name
