"""The graphs torch.compile makes of the decoder layers: runs on the CPU or the GPU, with a backend that
only records what dynamo traced, compiled as the engine compiles them (runner/compilation.py). Paged attention is
one custom op, so a layer is one graph, and the layers share their graphs: one for prefill shapes and one for a
single token (dynamo specializes a size of 1). Each graph's operators are printed, one line a graph.

Usage: python3 tests/gpu/kernels/layer_graphs.py [--quantization int8-w8a8] [--device cpu]
"""

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--quantization", default="int8-w8a8")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from service.engine.config import EngineConfig
    from service.engine.llm_engine import LLMEngine
    from service.engine.runner.compilation import compile_layers, decoder_layers
    from service.engine.sampling import SamplingParams

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, quantization=args.quantization,
                                    dtype="float32", compile=False, cuda_graphs=False, max_num_seqs=4))
    assert compile_layers(engine.runner, backend=record)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    print(f"{len(graphs)} graphs of {len(decoder_layers(engine.runner.model))} decoder layers "
          f"({args.model}, {args.quantization}, {args.device})")
    for gm in graphs:
        ops = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
               if n.op in ("call_function", "call_method", "call_module")]
        print(" -", ", ".join(ops))


if __name__ == "__main__":
    main()
