"""Running the model on a device: a scheduled batch packed into tensors (input_packing), attention over the paged
KV cache (attention; the Triton kernel in triton_attention), the cache's size (kv_cache), CUDA graphs (cuda_graphs,
over pinned_upload's uploads), torch.compile (compilation), sampling (sampler), and the runner that ties them
(model_runner)."""
