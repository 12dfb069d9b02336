"""bench offline's roofline: the least time a workload needs on a device, from the model's shape and the device's
peaks, against hand counts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from service.bench.offline import roofline
from service.engine.models import PRESETS
from tests.conftest import load_cpu


def test_a_workloads_roofline_against_hand_counts():
    shape = roofline.ModelShape(layer_weights=1000, head_weights=100, weight_bytes=4000, layers=2, query_heads=2,
                                head_dim=4, kv_bytes_per_token=64)
    # two requests: prompts of 3 and 5 tokens, 2 and 1 output tokens; prompts in steps of 4 tokens
    # prefill: 8 tokens, 2 sampled rows, 3*4/2 + 5*6/2 = 21 attended pairs at 4*4*2*2 = 64 FLOPs each
    #   FLOPs 2*1000*8 + 2*100*2 + 64*21 = 17,744; bytes: 2 steps of weights, 8 tokens written: 8,000 + 512 = 8,512
    # decode: one token (the first request's second), attending to 3 + 1 keys
    #   FLOPs 2*1100 + 64*4 = 2,456; bytes: 1 step of weights, 4 keys read and 1 written: 4,000 + 5*64 = 4,320
    # at 1,000 FLOP/s and 1,000 B/s: prefill bound by FLOPs (17.744 s), decode by bytes (4.32 s)
    seconds = roofline.roofline_seconds(shape, [3, 5], [2, 1], max_num_seqs=8, max_num_batched_tokens=4,
                                        peak_tflops=1e-9, bandwidth_gbs=1e-6)
    assert seconds == pytest.approx(17.744 + 4.32)


def test_the_model_shape_counts_the_decoder_matrices_and_the_weights_a_step_reads():
    tiny = PRESETS["tiny"]
    h, inter, layers, heads, kv = (tiny[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads"))
    head_dim = h // heads
    per_layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * inter  # q and o, k and v, gate, up and down
    model = load_cpu("random:tiny").model  # float32
    shape = roofline.shape_of(model, torch.bfloat16)
    assert shape.layer_weights == layers * per_layer
    assert shape.head_weights == h * tiny["vocab_size"]
    assert shape.kv_bytes_per_token == 2 * layers * kv * head_dim * 2
    embedding = model.get_input_embeddings().weight
    untied = embedding is not model.get_output_embeddings().weight
    everything = sum(p.numel() for p in model.parameters()) * 4
    assert shape.weight_bytes == everything - (embedding.numel() * 4 if untied else 0)


def test_w8a8_layers_count_their_codes_as_weights_and_their_bytes_as_one_each():
    from service.engine.models import load_model
    model = load_model("random:tiny", torch.float32, torch.device("cpu"), quantization="int8-w8a8").model
    plain = roofline.shape_of(load_cpu("random:tiny").model, torch.float32)
    shape = roofline.shape_of(model, torch.float32)
    assert shape.layer_weights == plain.layer_weights  # the scales ([1, out]) are not matrices a token goes through
    assert shape.weight_bytes < plain.weight_bytes


def test_the_1b_shapes_roofline_on_an_h200_is_near_the_figure_the_engine_is_measured_against():
    """1,024 requests of 128 in / 128 out at 256 sequences, bf16: about 170,000 output tok/s was the estimate (weights
    and KV read once a step, FLOPs at peak); the model's weights are built on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS["llama-1b"]), dtype=torch.bfloat16)
    flops, bandwidth = roofline.peaks("NVIDIA H200", "none", torch.bfloat16)
    assert (flops, bandwidth) == (989.0, 4800.0)
    assert roofline.peaks("NVIDIA H200", "fp8-w8a8", torch.bfloat16)[0] == 1979.0
    assert roofline.peaks("cpu", "none", torch.float32) == (None, None)
    seconds = roofline.roofline_seconds(roofline.shape_of(model, torch.bfloat16), [128] * 1024, [128] * 1024,
                                        256, 8192, flops, bandwidth)
    assert 150_000 < 1024 * 128 / seconds < 200_000
