"""The RAIL / JOINT rows of an anchors file's calibration requests (scripts/selector_lab_rows.py)
as the arrays the selector scripts score them with."""
import gzip
import json

import numpy as np

from megatron_railwave.lab import calibration
def load_rows(*paths: str) -> list[dict]:
    """The rows of gzipped JSON-lines files, one per request name (a later file's row wins)."""
    rows = {}
    for path in paths:
        with gzip.open(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                rows[row["name"]] = row
    return list(rows.values())


def row_arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    """[R] arrays: windows, rail_s, joint_s, payload (B_mean), units (the seed, the leave-out unit),
    target log(t_RAIL / t_JOINT) and limit (1.03 x the better of RAIL and JOINT: NATIVE / PERM are
    not in the rows)."""
    rail, joint = np.array([r["rail_s"] for r in rows]), np.array([r["joint_s"] for r in rows])
    return {"windows": np.array([r["windows"] for r in rows]), "rail_s": rail, "joint_s": joint,
            "payload": np.array([r["B_mean"] for r in rows]),
            "units": np.array([str(r["seed"]) for r in rows], dtype=object),
            "target": np.log(rail / joint),
            "limit": calibration.MAX_RATIO_TO_BEST * np.minimum(rail, joint) * (1.0 + 1e-12)}
