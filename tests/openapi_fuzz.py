"""The served OpenAPI fuzzed with schemathesis (its pytest plugin does not load under pytest 9, so its strategies are
driven here): one helper for both Serve apps, only ever sent to loopback."""

import collections

import hypothesis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable


def fuzz(base_url: str, mode: str, seed: int, examples: int) -> collections.Counter:
    """Cases generated from `base_url`/openapi.json (valid, or deliberately invalid), each response run through all of
    schemathesis' checks — no 5xx, valid bodies accepted, invalid ones rejected, every status and body as documented —
    `examples` per operation. -> the statuses seen, with the number of operations under the key "operations"."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    seen: list[int] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @hypothesis.seed(seed)
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(max_examples=examples, deadline=None, derandomize=False, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(base_url=base_url, timeout=60)
            seen.append(response.status_code)
            assert response.status_code < 500, \
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
            case.validate_response(response)  # all checks: raises with every failure it found

        try:
            check()
        except Unsatisfiable:  # nothing invalid to send to a GET without parameters
            assert mode == "negative" and operation.method.upper() == "GET", operation.label
    statuses = collections.Counter(seen)
    statuses["operations"] = operations
    return statuses
