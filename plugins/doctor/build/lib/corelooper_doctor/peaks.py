"""Peak dense bf16/fp16 tensor-core FLOP/s of common accelerators, for MFU when
``train.peak_flops`` is not set (vendor data sheets, dense, no sparsity: the numbers PaLM and
torchtitan compute MFU against)."""

from __future__ import annotations

# Matched in order against torch.cuda.get_device_name() (case-insensitive): specific names first.
PEAK_BF16 = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: V100 has no bf16
    ("T4", 65e12),  # fp16
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def known_peak(device_name: str) -> float | None:
    name = device_name.lower()
    for key, peak in PEAK_BF16:
        if key.lower() in name:
            return peak
    return None


def device_peak_flops() -> tuple[float | None, str]:
    """(peak FLOP/s of this process's device, its name); (None, name) when unknown or CPU."""
    import torch

    if not torch.cuda.is_available():
        return None, "cpu"
    name = torch.cuda.get_device_name()
    return known_peak(name), name
