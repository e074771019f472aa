"""Which device a worker's engine runs on."""

from __future__ import annotations

import os


def has_nvidia_gpu() -> bool:
    if os.environ.get("TOKENMILL_FORCE_CPU"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False

