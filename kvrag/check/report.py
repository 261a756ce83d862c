"""The gate's verdict: one row per check, the report table, and its JSON form for the verdict cache."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvrag.errors import UnsupportedModelError


@dataclass
class CheckRow:
    """One check: `passed` is None when it was skipped (an earlier check already failed)."""

    name: str
    passed: bool | None
    error: float | None = None  # the measured relative error (numeric checks)
    tolerance: float | None = None  # max(multiple * noise, the dtype's floor)
    message: str = ""
    noise: float | None = None  # the model's own error on the same computation: its dtype vs fp32
    multiple: float | None = None  # how many times the noise reuse may differ by

    @property
    def status(self) -> str:
        return "skip" if self.passed is None else "ok" if self.passed else "FAIL"


@dataclass
class CheckReport:
    source: str
    fingerprint: str
    device: str
    dtype: str
    rows: list[CheckRow] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False  # read back from $KVRAG_HOME/checks rather than run now
    reference: str = ""  # what the numeric checks' noise was measured against

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows) and any(r.passed for r in self.rows)

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.passed is False]

    def row(self, name: str) -> CheckRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def table(self) -> str:
        """A short text table: one line per check, then the verdict."""
        head = ("check", "result", "rel. error", "noise", "x", "tolerance", "note")
        lines = [head] + [
            (r.name, r.status, _num(r.error), _num(r.noise), "" if r.multiple is None else f"{r.multiple:g}", _num(r.tolerance), r.message)
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(6)]
        out = [f"model {self.source} on {self.device} / {self.dtype} (fingerprint {self.fingerprint[:12] or '-'})"]
        for i, line in enumerate(lines):
            out.append("  ".join(c.ljust(w) for c, w in zip(line[:6], widths)) + "  " + line[6])
            if i == 0:
                out.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
        if self.reference:
            out.append(f"tolerance = max(x * noise, floor); noise: {self.reference}")
        verdict = "PASSED" if self.passed else "FAILED: " + ", ".join(r.name for r in self.failed)
        out.append(f"{verdict} ({'cached verdict' if self.cached else f'{self.seconds:.2f} s'})")
        return "\n".join(out)

    def error_message(self) -> str:
        failed = self.failed
        parts = [f"{r.name}: {r.message}" + (f" (error {_num(r.error)} > tolerance {_num(r.tolerance)})" if r.error is not None and r.tolerance is not None and not math.isnan(r.error) else "") for r in failed]
        return (
            f"kvrag cannot serve {self.source} exactly on {self.device}/{self.dtype}: "
            f"failed check{'s' if len(failed) > 1 else ''} " + "; ".join(parts)
            + ". Run `kvrag check-model` for the full table; KVRag(..., check=False) skips this gate at your own risk."
        )

    def raise_if_failed(self) -> "CheckReport":
        if not self.passed:
            raise UnsupportedModelError(self.error_message())
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("cached")
        for r in d["rows"]:  # JSON has no NaN/inf
            for k in ("error", "tolerance", "noise", "multiple"):
                if r[k] is not None and not math.isfinite(r[k]):
                    r[k] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], cached: bool = False) -> "CheckReport":
        rows = [CheckRow(**r) for r in d["rows"]]
        return cls(d["source"], d["fingerprint"], d["device"], d["dtype"], rows, float(d.get("seconds", 0.0)), cached, d.get("reference", ""))


def _num(x: float | None) -> str:
    return "" if x is None else "nan" if math.isnan(x) else f"{x:.1e}"
