"""Device settings shared by training, evaluation and the benchmarks: mixed precision and
reproducibility switches.

* :func:`amp_dtype`: with the protocol's ``[numerics] precision = "bf16"`` (its default),
  bfloat16 autocast on CUDA devices that support it (no loss scaler: bfloat16 has
  float32's exponent range), float16 with a ``GradScaler`` on older ones; none on CPU or
  with ``"fp32"`` (float32).
* :func:`configure_determinism`: the settings PyTorch's reproducibility notes name
  (https://pytorch.org/docs/stable/notes/randomness.html): deterministic algorithms
  (an error on an op that has none), ``cudnn.deterministic``, no cuDNN autotuning, and
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when its first handle is made,
  so it is set before any CUDA work (the CLI calls this before it builds anything); or,
  with ``fast``, cuDNN autotuning and non-deterministic kernels.
"""

from __future__ import annotations

import os

import torch

from harness.base.errors import HarnessError

__all__ = ["amp_dtype", "amp_name", "configure_determinism", "CUBLAS_WORKSPACE"]

CUBLAS_WORKSPACE = ":4096:8"


def amp_dtype(device: torch.device, precision: str = "bf16") -> torch.dtype | None:
    """The autocast dtype for ``device`` under the protocol's ``[numerics] precision``, or
    None (no autocast): ``"fp32"`` and CPU devices run in float32."""
    if precision not in ("bf16", "fp32"):
        raise HarnessError(f"numerics.precision must be bf16 or fp32, got {precision!r}")
    if device.type != "cuda" or precision == "fp32":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def amp_name(device: torch.device, precision: str = "bf16") -> str:
    """``bf16``, ``fp16`` or ``off``: recorded with each run."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "off"}[
        amp_dtype(device, precision)
    ]


def configure_determinism(deterministic: bool, *, fast: bool = False) -> None:
    """Reproducibility switches for this process: three levels, each recorded with a run.

    * ``deterministic`` (``--deterministic``): every op must have a deterministic
      implementation (else an error names it), cuDNN picks deterministic kernels and does
      not autotune, cuBLAS gets a fixed workspace;
    * the default: deterministic kernels wherever they exist (a warning where an op has
      none), cuDNN deterministic and not autotuned: the harness's reruns repeat on the CPU
      and, up to ops without a deterministic kernel, on a GPU;
    * ``fast`` (``--fast``): cuDNN autotunes convolutions for the fixed input size and
      any kernel may be used (the fastest, not bit-repeatable).
    """
    if deterministic and fast:
        raise HarnessError("--deterministic and --fast exclude each other")
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        torch.use_deterministic_algorithms(True)
    elif fast:
        torch.use_deterministic_algorithms(False)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = not fast
    torch.backends.cudnn.benchmark = fast
    # Deterministic mode also fills every new tensor with NaN, a debugging aid that changes
    # no result (kernels overwrite the memory) and cost 15% of CPU training time.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a property of torch's module subclass, unseen by the stubs
