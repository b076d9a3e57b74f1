"""The report's ladder section: RUN_DIR/ladder.json (written by `planner ladder`) as table rows
and the two waterfalls (planner.ladder.plots) as PNG data URIs. No ladder.json: no section."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from planner.ladder.claims import ours_text


def load(run_dir: Path) -> dict[str, Any] | None:
    """ladder.json as the template reads it, or None (absent or unreadable: the section says so)."""
    path = Path(run_dir) / "ladder.json"
    if not path.exists():
        return None
    try:
        lad = json.loads(path.read_text())
        rows = []
        for r in lad["rungs"]:
            c, m = r.get("claim") or {}, r.get("measured") or {}
            ours = ours_text(c) if c else ""
            rows.append({"index": r["index"], "name": " + ".join(r.get("adds") or [r["technique"]]),
                         "illegal": r.get("illegal", ""), "description": r.get("description", ""),
                         "tokens_per_s": r.get("tokens_per_s"), "gain": r.get("gain"),
                         "comm_share": r.get("comm_share"), "padding_share": r.get("padding_share"),
                         "peak_memory_gb": r.get("peak_memory_gb"), "feasible": r.get("feasible", True),
                         "memory_ratio": r.get("memory_ratio"), "article": c.get("article", ""), "ours": ours,
                         "note": c.get("note") or r.get("inert", ""),
                         "measured_tps": m.get("tokens_per_s"), "measured_gain": m.get("gain"),
                         "measured_gb": m.get("peak_memory_gb"), "measured_claim": m.get("claim", ""),
                         "not_run": m.get("not_run", "")})
        return {"rows": rows, "order": lad["order"], "ratio": lad["ratio"], "measured_ratio": lad.get("measured_ratio"),
                "measured": any("measured" in r for r in lad["rungs"]), "unchanged": lad.get("unchanged", []),
                "claims_source": lad.get("claims_source", ""), "raw": lad}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"ladder.json could not be read ({type(exc).__name__}: {exc}); rerun `planner ladder`"}


def figures(lad: dict[str, Any]) -> dict[str, str]:
    from planner.ladder.plots import draw
    return {f"ladder_{w}": "data:image/png;base64," + base64.b64encode(draw(lad["raw"], w)).decode("ascii")
            for w in ("throughput", "memory")}
