"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the k most likely tokens
at its place, for the requests that ask (`echo` with `logprobs`, lm-evaluation-harness's loglikelihood).

A step that computes such positions runs outside the CUDA graphs (steps without them are untouched): the decoder's
last hidden states are caught as it returns them (a forward hook, for that step only), and the output projection
runs over the wanted rows in chunks of at most CHUNK_LOGITS logits, so that a long prompt never holds
[prompt length, vocabulary] floats at once. The results go to the host at once and onto each sequence
(`Sequence.prompt_logprobs`), in prompt order across the chunks of a chunked prefill.
"""

import contextlib

import torch

from service.engine.runner.sampler import LOGPROB_FLOOR
from service.engine.sequence import Sequence

CHUNK_LOGITS = 1 << 24  # logits computed at once: 64 MiB of float32


class Wanted:
    """The packed rows of one step whose logits give prompt logprobs: per sequence, (sequence, first row, first
    position, count); the position p's logits score prompt token p + 1."""

    def __init__(self, batch_rows: list[tuple[Sequence, int, int]]):
        self.parts = []
        for seq, row, n in batch_rows:  # row: the packed row of the chunk's first token; n: the chunk's tokens
            start = seq.num_computed_tokens
            first = len(seq.prompt_logprobs)  # positions before it are done
            end = min(start + n, seq.num_prompt_tokens - 1)
            if end > first:
                assert first >= start, "a chunk skipped positions whose prompt logprobs were still to come"
                self.parts.append((seq, row + first - start, first, end - first))

    def __bool__(self) -> bool:
        return bool(self.parts)


@contextlib.contextmanager
def catch_hidden(model: torch.nn.Module):
    """Within: the decoder's last hidden states of the forward pass, in the yielded list ([1, tokens, hidden])."""
    caught: list[torch.Tensor] = []
    handle = model.get_decoder().register_forward_hook(lambda module, args, out: caught.append(out[0]))
    try:
        yield caught
    finally:
        handle.remove()


def finish_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What the model's own forward does to the output projection's result (a scale, a soft cap), in float32."""
    logits = logits.float()
    config = model.config.get_text_config()
    if (scale := getattr(model, "logit_scale", None)) is not None:  # Cohere
        logits = logits * scale
    if scaling := getattr(config, "logits_scaling", None):  # Granite
        logits = logits / scaling
    if cap := getattr(config, "final_logit_softcapping", None):  # Gemma 2 and 3
        logits = torch.tanh(logits / cap) * cap
    return logits


def compute(model: torch.nn.Module, hidden: torch.Tensor, wanted: Wanted) -> None:
    """Score the wanted positions from the decoder's `hidden` states [tokens, hidden] and append each sequence's
    (logprob, [(token id, logprob), ...]) entries to its `prompt_logprobs` (waits for the device)."""
    dev = hidden.device
    rows, targets, ks = [], [], []
    for seq, row, first, count in wanted.parts:
        rows.extend(range(row, row + count))
        targets.extend(seq.prompt_token_ids[first + 1:first + 1 + count])
        ks.append(seq.params.prompt_logprobs)
    k = max(ks)
    rows_t = torch.tensor(rows, dtype=torch.long).to(dev)
    targets_t = torch.tensor(targets, dtype=torch.long).to(dev)
    head = model.get_output_embeddings()
    chunk = max(1, CHUNK_LOGITS // head.weight.shape[0])
    chosen, top_v, top_i = [], [], []
    for s in range(0, len(rows), chunk):
        logits = finish_logits(model, head(hidden.index_select(0, rows_t[s:s + chunk])))
        lp = logits.log_softmax(-1).clamp_(min=LOGPROB_FLOOR)
        chosen.append(lp.gather(1, targets_t[s:s + chunk, None]).squeeze(1))
        if k:
            v, i = lp.topk(k, -1)
            top_v.append(v)
            top_i.append(i)
    chosen_l = torch.cat(chosen).tolist()
    top_v_l = torch.cat(top_v).tolist() if k else [[]] * len(rows)
    top_i_l = torch.cat(top_i).tolist() if k else [[]] * len(rows)
    at = 0
    for (seq, _, _, count), kk in zip(wanted.parts, ks):
        seq.prompt_logprobs.extend((chosen_l[j], list(zip(top_i_l[j][:kk], top_v_l[j][:kk])))
                                   for j in range(at, at + count))
        at += count
