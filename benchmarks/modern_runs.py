"""shared reference/modern-runs.md (S1, S5, S6, S7, S8: 194 published runs) as data.

`encode` reads the markdown tables once and writes benchmarks/modern_runs_rows.json (checked in,
so the validation runs without the shared folder); every value is copied as published, and the
row's measured step time is derived the way the table says (tokens/s: GBS x seq / (tok/s/GPU x
GPUs); TFLOP/s: the source's FLOPs per step / (GPUs x TFLOP/s), computed in benchmarks/fidelity.py
from the model's shapes). `unsupported` names what the cost model cannot represent yet (fp8,
context parallelism, a GPU without a profile): such rows are listed, never scored.

    .venv/bin/python benchmarks/modern_runs.py [path/to/modern-runs.md]   # rewrites the JSON
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT.parent.parent / "shared" / "reference" / "modern-runs.md"
OUT = Path(__file__).with_name("modern_runs_rows.json")

MPT = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
       "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
       "70b": (8192, 64, 80)}
"""MPT sizes (d_model, heads, layers): modern-runs.md S8 model table (llm-foundry yamls)."""

LLAMA = {"LLAMA2-7B": (32, 4096, 32, 32, 11008, 32000), "LLAMA2-13B": (40, 5120, 40, 40, 13824, 32000),
         "LLAMA2-70B": (80, 8192, 64, 8, 28672, 32000), "LLAMA3-8B": (32, 4096, 32, 8, 14336, 128256),
         "LLAMA3_8B": (32, 4096, 32, 8, 14336, 128256), "LLAMA3-70B": (80, 8192, 64, 8, 28672, 128256),
         "LLAMA3_70B": (80, 8192, 64, 8, 28672, 128256), "LLAMA3.1_405B": (126, 16384, 128, 8, 53248, 128256)}
"""Llama shapes (layers, hidden, heads, KV heads, FFN, vocab): modern-runs.md S5 / S6 Arch columns."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _num(x: str) -> float:
    return float(x.split()[0].replace(",", ""))


def encode(src: Path = SRC) -> dict:
    rows = []
    section = header = None
    for line in src.read_text().splitlines():
        m = re.match(r"## (S\d+)\.", line)
        if m:
            section = m.group(1)
        if line.startswith("| ID"):
            header = _cells(line)
            continue
        if not (line.startswith("| S") and header):
            continue
        c = dict(zip(header, _cells(line)))
        r = {"id": c["ID"], "source": section}
        if section == "S1":
            r.update(runtime="megatron-core", gpu="H100-SXM", precision="bf16", seq=4096, vocab=131072,
                     layers=int(c["Layers"]), hidden=int(c["Hidden"]), heads=int(c["Heads"]),
                     gbs=int(c["GBS (seq)"]), tp=int(c["TP"]), pp=int(c["PP"]), dp=int(c["DP"]),
                     gpus=int(c["H100s"]), tflops=_num(c["TFLOP/s/GPU (pub)"]),
                     derived_step=_num(c["Step s (derived)"]), metric="tflops")
        elif section == "S5":
            r.update(runtime="megatron-core", gpu="H100-SXM", precision="fp8", model=c["Model"], arch=c["Arch"],
                     seq=int(c["Seq"]), gbs=int(c["GBS"]), mbs=int(c["MBS"]), tp=int(c["TP"]), pp=int(c["PP"]),
                     vp=int(c["VP"]), cp=int(c["CP"]), dp=int(c["DP"]), gpus=int(c["H100s"]),
                     tok_s_gpu=_num(c["Tok/s/GPU (pub)"]), metric="tokens")
        elif section == "S6":
            r.update(runtime="megatron-core", gpu="B200" if "B200" in c["System"] else "H100-SXM", precision="fp8",
                     model=c["Model"], seq=8192, gbs=int(c["GBS"]), mbs=int(c["MBS"]), tp=int(c["TP"]),
                     pp=int(c["PP"]), cp=int(c["CP"]), vp=1 if c["VP"] == "-" else int(c["VP"]), dp=int(c["DP"]),
                     gpus=int(c["GPUs"]), tok_s_gpu=_num(c["Tok/s/GPU (pub)"]), sharding=c["FSDP/DDP"],
                     metric="tokens")
        elif section == "S7":
            r.update(runtime="megatron-core", gpu="B200" if c["GPU"] == "B200" else "H100-SXM", precision="fp8",
                     model=c["Model"], seq=int(c["Seq"]), gbs=int(c["GBS"]), tp=int(c["TP"]), pp=int(c["PP"]),
                     cp=int(c["CP"]), dp=int(c["DP"]), gpus=int(c["GPUs"]),
                     tflops=_num(c["TFLOP/s/GPU with CP (pub)"]), derived_step=_num(c["Step s (derived, CP run)"]),
                     metric="tflops")
        elif section == "S8":
            gpu = {"a100_80gb": "A100-80GB", "a100_40gb": "A100-40GB"}.get(c["GPU"], c["GPU"])
            r.update(runtime="fsdp", gpu=gpu, model=c["Model"], seq=int(c["Seq"]), gpus=int(c["GPUs"]),
                     gbs=int(c["GBS (seq)"]), mbs=int(c["MBS"]), ga=int(c["GA"]), divides=c["GBS chk"] == "✓",
                     precision="bf16", mp_mode=c["MP mode"], sharding=c["FSDP sharding"],
                     checkpointing=c["AC"] == "True", tok_s_gpu=_num(c["Tok/s/GPU (pub)"]),
                     derived_step=_num(c["Step s (derived)"]), metric="tokens")
        else:
            continue
        rows.append(r)
    return {"about": f"Encoded from shared reference/modern-runs.md by benchmarks/modern_runs.py ({len(rows)} rows); "
                     "values as published; see that file for each table's source and commit.",
            "rows": rows}


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else SRC
    if not src.is_file():
        print(f"{src} not found: {OUT.name} kept as checked in")
        sys.exit(0)
    data = encode(src)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(OUT)
    counts: dict[str, int] = {}
    for r in data["rows"]:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    print(f"wrote {OUT}: {len(data['rows'])} rows {counts}")
