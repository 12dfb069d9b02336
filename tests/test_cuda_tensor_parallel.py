"""Tensor parallelism over NCCL: two GPUs give the greedy tokens of one. Runs only where two CUDA GPUs are."""

import pytest
import torch

from service.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a two-GPU machine)")


@pytest.mark.parametrize("preset", ["tiny", "llama-1b"])
def test_two_gpus_equal_one_gpu_greedy_with_preemption_and_chunked_prefill(preset):
    prompts = [list(range(1, 300)), list(range(400, 420)), list(range(200, 333)), [7, 8, 9]]  # ids < tiny's 512
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # float32 so that summing two partial products differs from one product by rounding far below a logit gap
    settings = dict(model=f"random:{preset}", device="cuda", dtype="float32", num_blocks=24,
                    max_num_batched_tokens=128)
    outputs = {}
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(tensor_parallel_size=size, **settings))
        try:
            outputs[size] = [o["token_ids"] for o in engine.generate(prompts, params)]
        finally:
            engine.close()
            del engine
            torch.cuda.empty_cache()
    assert outputs[2] == outputs[1]
