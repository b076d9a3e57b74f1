"""Element sizes, said once: bytes per element of each precision, and of the activations and
16-bit model copies a precision trains with (mixed precision keeps activations, weights and
gradients in 16 bits; fp8 training (Transformer Engine) casts to fp8 inside its GEMMs only, so its
activations and weight copies outside them stay bf16; fp32 keeps everything in 32 bits). A serving
deployment's weight precision counts the same way: weight-only int8 / int4 and W8A8 fp8 keep
16-bit activations, an fp32 deployment (the CPU lab) 32-bit ones."""
from __future__ import annotations

ELEMENT_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}


def activation_bytes(precision: str) -> float:
    """Bytes per activation element (and per 16-bit weight / gradient element) under `precision`."""
    return ELEMENT_BYTES["fp32"] if precision == "fp32" else ELEMENT_BYTES["bf16"]


__all__ = ["ELEMENT_BYTES", "activation_bytes"]
