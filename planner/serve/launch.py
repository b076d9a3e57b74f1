"""The launch script of a serving plan: vLLM's or SGLang's OpenAI server, one line per replica.

Flag names: vLLM's Engine Arguments (docs.vllm.ai, `vllm serve --help`), SGLang's Server
Arguments (python/sglang/srt/server_args.py). What makes the script start as written:
- the weights: `--weights DIR|HF_ID`, else the preset's Hugging Face id, else the directory of
  the config.json given as --model (never the config file itself); MODEL= overrides it;
- int4/int8 weights need a checkpoint quantized that way (AWQ 4-bit, GPTQ 8-bit): the engines
  read the method from its quantization_config and pick their fastest kernel for it (vLLM:
  awq_marlin / gptq_marlin on Ampere and newer), so no --quantization flag is passed, and the
  script stops with one line when no quantized checkpoint was named; fp8 weights (W8A8, on GPUs
  with FP8) are quantized by the engine at load from a bf16 checkpoint: --quantization fp8;
- --max-model-len / --context-length: the workload's longest request with 10% headroom,
  rounded up to a multiple of 256 and capped at the model's context (a request at exactly the
  limit is refused by the engine once the chat template adds tokens);
- --trust-remote-code only for families the engines do not implement themselves (ChatGLM's
  THUDM checkpoints, model_type chatglm: custom modelling code).
"""
from __future__ import annotations

import math
import shlex
from pathlib import Path

from planner.serve.memory import GPU_MEMORY_UTILIZATION, memory_fraction
from planner.serve.spec import Deployment, ServeEstimate, Workload
from planner.specs.model import ModelSpec

HF_IDS = {"chatglm-6b": "THUDM/chatglm-6b", "chatglm2-6b": "THUDM/chatglm2-6b", "chatglm3-6b": "THUDM/chatglm3-6b",
          "glm-4-9b": "THUDM/glm-4-9b-chat-hf", "glm-10b": "THUDM/glm-10b", "glm-130b": "THUDM/glm-130b"}
REMOTE_CODE = ("chatglm",)
"""model_types whose checkpoints ship their own modelling code (THUDM's ChatGLM 1-3 and
glm-4-9b-chat); glm / glm4 (transformers' GlmForCausalLM, Glm4ForCausalLM: glm-4-9b-chat-hf),
llama, mistral and qwen run on the engines' own code. GLM-10B/130B (model_type glm in the
presets) have no engine implementation and their checkpoints' code: remote too."""
REMOTE_NAMES = ("glm-10b", "glm-130b")
QUANTIZED = {"int8": "a GPTQ 8-bit", "int4": "an AWQ 4-bit"}
SGLANG_KV = {"fp8": ["--kv-cache-dtype", "fp8_e5m2"]}


def model_path(model_arg: str, weights: str | None) -> str:
    """The checkpoint the engine loads: --weights, a preset's Hugging Face id, or the directory
    of a config.json."""
    if weights:
        return weights
    key = model_arg.strip().lower()
    if key in HF_IDS:
        return HF_IDS[key]
    p = Path(model_arg)
    return str(p.parent if p.name.endswith(".json") else p)


def max_model_len(model: ModelSpec, workload: Workload) -> int:
    """The longest request plus 10% headroom, to a multiple of 256, at most the model's context."""
    return min(model.max_seq, int(math.ceil(workload.max_total() * 1.1 / 256) * 256))


def needs_remote_code(model: ModelSpec) -> bool:
    return model.model_type in REMOTE_CODE or model.base().name in REMOTE_NAMES


def engine_command(model: ModelSpec, dep: Deployment, workload: Workload, budget: float, port: int = 8000) -> list[str]:
    """One replica's server command with MODEL_PLACEHOLDER for the checkpoint."""
    length = str(max_model_len(model, workload))
    remote = ["--trust-remote-code"] if needs_remote_code(model) else []
    fp8 = ["--quantization", "fp8"] if dep.weight_precision == "fp8" else []
    tokens = [] if math.isinf(budget) else [str(int(budget))]
    if dep.engine == "sglang":
        cmd = ["python", "-m", "sglang.launch_server", "--model-path", "MODEL_PLACEHOLDER", *remote,
               "--tp-size", str(dep.tp), "--max-running-requests", str(dep.max_batch), "--context-length", length,
               "--page-size", str(dep.block_size), "--mem-fraction-static", f"{memory_fraction(dep):g}",
               *SGLANG_KV.get(dep.kv_precision, []), *fp8]
        cmd += ["--chunked-prefill-size", *tokens] if tokens else []
        cmd += [] if dep.prefix_caching else ["--disable-radix-cache"]
        return cmd + ["--port", str(port)]
    cmd = ["vllm", "serve", "MODEL_PLACEHOLDER", *remote, "--tensor-parallel-size", str(dep.tp),
           "--max-num-seqs", str(dep.max_batch), "--max-model-len", length, "--block-size", str(dep.block_size),
           "--gpu-memory-utilization", f"{GPU_MEMORY_UTILIZATION:g}",
           *(["--kv-cache-dtype", "fp8"] if dep.kv_precision == "fp8" else []), *fp8]
    cmd += ["--max-num-batched-tokens", *tokens] if tokens else []
    cmd += ["--enable-prefix-caching" if dep.prefix_caching else "--no-enable-prefix-caching"]
    return cmd + ["--port", str(port)]


def launch_script(model: ModelSpec, model_arg: str, dep: Deployment, workload: Workload, est: ServeEstimate, *,
                  budget: float, weights: str | None = None) -> str:
    path = model_path(model_arg, weights)
    quant = QUANTIZED.get(dep.weight_precision)
    lines = ["#!/usr/bin/env bash",
             f"# planner serve: {dep.describe()} for {model.name}",
             f"# predicted: TTFT {est.ttft_s * 1e3:.0f} ms, TPOT {est.tpot_s * 1e3:.1f} ms, e2e p50 "
             f"{est.e2e_p50_s * 1e3:.0f} ms / p99 {est.e2e_p99_s * 1e3:.0f} ms at {est.rate_qps:.2f} QPS; "
             f"saturates at {est.max_qps:.2f} QPS",
             "# MODEL overrides the checkpoint (a Hugging Face id or a local directory)."]
    if model.variant_label:
        lines.append(f"# variant {model.describe()}: a what-if. MODEL must be a checkpoint of that architecture "
                     "(trained or converted); the default id below is the base model's.")
    if quant:
        lines.append(f"# weights {dep.weight_precision}: MODEL must be {quant} checkpoint of {model.name} (the engine "
                     "reads the method from its quantization_config).")
    if dep.kv_precision == "int8":
        lines.append("# KV int8: neither engine has an int8 KV cache; this runs it in bf16.")
    if dep.replicas > 1:
        lines.append(f"# {dep.replicas} replicas on ports 8000-{8000 + dep.replicas - 1}: put a load balancer in front.")
    lines.append("set -euo pipefail")
    if quant and not weights:
        lines.append(f': "${{MODEL:?weights {dep.weight_precision} need {quant} checkpoint: '
                     f'set MODEL=<its directory or Hugging Face id> (planner serve --weights)}}"')
    else:
        lines.append(f"MODEL=${{MODEL:-{shlex.quote(path)}}}")
    for r in range(dep.replicas):
        gpus = ",".join(str(r * dep.tp + i) for i in range(dep.tp))
        cmd = engine_command(model, dep, workload, budget, 8000 + r)
        text = shlex.join(cmd).replace("MODEL_PLACEHOLDER", '"$MODEL"')
        lines.append(f"CUDA_VISIBLE_DEVICES={gpus} {text} &")
    lines.append("wait")
    return "\n".join(lines) + "\n"
