"""The calibration's rule applied to kvlink with trained link adapters, and no other setting: does each keep Full
Attention's right answers on the calibration set? Usage: python scripts/calibrate_adapter.py ADAPTER [ADAPTER ...]
(the bundled model; results as JSON in calibrate-adapter.json, the table on stdout)."""

import json
import sys
import time

from kvrag.check.calibrate import run_calibration
from kvrag.check.calibration_report import calibration_table
from kvrag.kv.layout import make_layout
from kvrag.link_adapter import load_adapter
from kvrag.model.loading import load_model


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    lm = load_model(None)
    out = {}
    for path in paths:
        adapter = load_adapter(path, lm, make_layout(lm.tokenizer, None).adapter_identities)
        t0 = time.perf_counter()
        result = run_calibration(lm, settings=[("kvlink", 0.0, None)], adapter=adapter, progress=print, bar=False)
        print(f"{path}: {time.perf_counter() - t0:.0f} s")
        print(calibration_table(result))
        out[path] = result
    with open("calibrate-adapter.json", "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
