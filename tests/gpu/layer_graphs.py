"""The graphs torch.compile makes of one decoder layer (issue 26): runs on the CPU or the GPU, with a backend that
only records what dynamo traced. The paged attention function is outside compiled code (torch.compiler.disable),
and it is called from inside the attention module's forward, so dynamo splits the layer at both frames' edges:
each graph's operators are printed, one line a graph, for the prefill and then the decode shapes.

Usage: python3 tests/gpu/layer_graphs.py [--quantization int8-w8a8] [--device cpu]
"""

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--quantization", default="int8-w8a8")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from service.engine.config import EngineConfig
    from service.engine.llm_engine import LLMEngine
    from service.engine.sampling import SamplingParams

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, quantization=args.quantization,
                                    dtype="float32", compile=False, cuda_graphs=False, max_num_seqs=4))
    layers = max((m for m in engine.runner.model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    layers[0].compile(backend=record, dynamic=True)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    print(f"{len(graphs)} graphs of the first decoder layer ({args.model}, {args.quantization}, {args.device})")
    for gm in graphs:
        ops = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
               if n.op in ("call_function", "call_method", "call_module")]
        print(" -", ", ".join(ops))


if __name__ == "__main__":
    main()
