"""Where a kernel's timings sit on the roofline: statistics of repeated timings, attention FLOPs and bytes from
formulas, and the device's peaks (the share of peak each achieves).

FLOPs count the two matrix products over the (query, key) pairs a query actually attends to: 2 * D
multiply-adds each, so 4 * D FLOPs per pair and head; softmax and scaling are left out (as FlashAttention's
benchmarks do). Bytes are the least any kernel must move: read Q, K, V once and write O.
"""

import numpy as np

from service.bench.kernel.ops import DTYPES, Shape

# Dense peaks from the vendors' data sheets: (TFLOP/s by dtype, memory GB/s); matched on the device name. fp32 is
# the CUDA cores' (no TF32); int8 is TOPS; fp8 is the tensor cores' in e4m3 or e5m2.
PEAKS = {
    "H100 SXM": ({"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0}, 3350.0),
    "H100 PCIe": ({"fp32": 51.0, "fp16": 756.0, "bf16": 756.0, "fp8": 1513.0, "int8": 1513.0}, 2000.0),
    "H100 NVL": ({"fp32": 60.0, "fp16": 835.0, "bf16": 835.0, "fp8": 1671.0, "int8": 1671.0}, 3900.0),
    # "NVIDIA H100 80GB HBM3" is the SXM part
    "H100": ({"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0}, 3350.0),
    "H200": ({"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0}, 4800.0),
    "A100": ({"fp32": 19.5, "fp16": 312.0, "bf16": 312.0, "int8": 624.0}, 2039.0),
}


def device_peak(name: str, dtype: str) -> tuple[float | None, float | None]:
    """(peak TFLOP/s, peak GB/s) for a device name such as torch.cuda.get_device_name(); Nones when unknown."""
    for key, (flops, bandwidth) in PEAKS.items():
        if key.lower() in name.lower():
            return flops.get(dtype), bandwidth
    return None, None


def attended_pairs(shape: Shape) -> int:
    """(query, key) pairs per sequence and head: causal prefill sum_{i=1..K} i; decode K."""
    k = shape.context
    return k * (k + 1) // 2 if shape.phase == "prefill" else k


def attention_flops(shape: Shape) -> int:
    return 4 * shape.head_dim * shape.batch * shape.heads * attended_pairs(shape)


def attention_bytes(shape: Shape) -> int:
    size = DTYPES[shape.dtype].itemsize
    q_and_o = 2 * shape.batch * shape.heads * shape.queries * shape.head_dim
    k_and_v = 2 * shape.batch * shape.kv_heads * shape.context * shape.head_dim
    return size * (q_and_o + k_and_v)


def statistics(seconds) -> dict[str, float]:
    """mean, median, sample std (n - 1), min, max, p5, p95 (numpy's linear interpolation)."""
    x = np.asarray(seconds, dtype=float)
    if x.size == 0:
        raise ValueError("no timings")
    return {"mean": float(x.mean()), "median": float(np.median(x)),
            "std": float(x.std(ddof=1)) if x.size > 1 else 0.0, "min": float(x.min()), "max": float(x.max()),
            "p5": float(np.percentile(x, 5)), "p95": float(np.percentile(x, 95))}


def throughput(shape: Shape, median_seconds: float, device_name: str) -> dict[str, float | None]:
    """TFLOP/s and GB/s at the median time, and their share of the device's peak (None where unknown)."""
    tflops = attention_flops(shape) / median_seconds / 1e12
    gbps = attention_bytes(shape) / median_seconds / 1e9
    peak_flops, peak_bw = device_peak(device_name, shape.dtype)
    return {"tflops": tflops, "gbps": gbps,
            "flops_share": tflops / peak_flops if peak_flops else None,
            "bandwidth_share": gbps / peak_bw if peak_bw else None}
