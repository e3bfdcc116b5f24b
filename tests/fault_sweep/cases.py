"""The fault sweep's case table: every case of every command (case.py says what a row holds)."""

from __future__ import annotations

import cases_bench
import cases_data
import cases_exports
import cases_serving
import cases_training

CASES = [
    *cases_serving.CASES,
    *cases_bench.CASES,
    *cases_data.CASES,
    *cases_exports.CASES,
    *cases_training.CASES,
]
_ids = [case.id for case in CASES]
assert len(_ids) == len(set(_ids)), sorted({i for i in _ids if _ids.count(i) > 1})
