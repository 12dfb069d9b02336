"""Candidate cuts of a batch-1 decode step on the GPU, each timed inside a CUDA graph of 100 repeats
(launch costs out, as in the engine's captured decode steps):

- the greedy read of the logits: argmax + isnan().any() (before), max (values and indices, NaN from the values),
  and a two-stage max over vocabulary chunks;
- the projections of one llama-1b / llama-8b layer at M rows: q, k, v apart vs one fused qkv, gate and up apart
  vs one fused gate_up, with the bandwidth each reaches.

Usage (on a CUDA machine): python3 tests/gpu/kernels/decode_kernels.py
"""

import torch
import torch.nn.functional as F

REPEATS = 100


def graph_time_us(fn) -> float:
    """Microseconds per call of fn(), replayed from a CUDA graph of REPEATS calls (median of 5 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEATS)
    return sorted(times)[2]


def two_stage_max(logits: torch.Tensor, chunks: int = 64):
    rows, vocab = logits.shape
    part_v, part_i = logits.view(rows, chunks, vocab // chunks).max(-1)
    top, which = part_v.max(-1)
    return top, which * (vocab // chunks) + part_i.gather(1, which.unsqueeze(1)).squeeze(1)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    for rows in (1, 256):
        logits = torch.randn(rows, 128256, device=dev, dtype=torch.bfloat16)
        ref = logits.argmax(-1)
        assert torch.equal(two_stage_max(logits)[1], ref) and torch.equal(logits.max(-1)[1], ref)
        before = graph_time_us(lambda: (logits.argmax(-1), torch.isnan(logits).any()))
        fused = graph_time_us(lambda: logits.max(-1)[0].isnan().any())
        staged = graph_time_us(lambda: two_stage_max(logits)[0].isnan().any())
        print(f"logits [{rows}, 128256] bf16: argmax + isnan.any {before:.1f} us, max + isnan(values) {fused:.1f} us, "
              f"two-stage max {staged:.1f} us")

    shapes = {"llama-1b": (2048, 2048, 512, 8192), "llama-8b": (4096, 4096, 1024, 14336)}
    for name, (hidden, q_out, kv_out, inter) in shapes.items():
        wq, wk, wv = (torch.randn(n, hidden, device=dev, dtype=torch.bfloat16) for n in (q_out, kv_out, kv_out))
        wqkv = torch.cat([wq, wk, wv])
        wg, wu = (torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16) for _ in range(2))
        wgu = torch.cat([wg, wu])
        for m in (1, 256):
            x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
            apart = graph_time_us(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)))
            one = graph_time_us(lambda: F.linear(x, wqkv).split([q_out, kv_out, kv_out], -1))
            gu_apart = graph_time_us(lambda: (F.linear(x, wg), F.linear(x, wu)))
            gu_one = graph_time_us(lambda: F.linear(x, wgu).chunk(2, -1))
            qkv_bytes, gu_bytes = wqkv.numel() * 2, wgu.numel() * 2
            print(f"{name} M={m}: qkv apart {apart:.1f} us ({qkv_bytes / apart / 1e6:.2f} TB/s), fused {one:.1f} us "
                  f"({qkv_bytes / one / 1e6:.2f} TB/s); gate+up apart {gu_apart:.1f} us "
                  f"({gu_bytes / gu_apart / 1e6:.2f} TB/s), fused {gu_one:.1f} us ({gu_bytes / gu_one / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
