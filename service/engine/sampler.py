"""Turns the last-position logits of a step into next tokens, per request parameters.

Greedy rows take the argmax. Other rows apply temperature, top-k and top-p, then draw with the
exponential race (argmax of p / Exp(1)), using the request's own generator when it has a seed so
that its output does not depend on what else is in the batch.
"""

from dataclasses import dataclass

import torch

from service.engine.sequence import Sequence


class NonFiniteLogitsError(RuntimeError):
    """The forward pass produced NaN logits (an overflow, corrupt weights or cache); the step fails."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen logprob, top-k) per row


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = logits.float()
        has_nan = torch.isnan(logits).any()  # read after the tokens, so that it costs no extra GPU sync
        self._apply_min_tokens(logits, seqs)
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits, seqs, greedy)
        token_list = tokens.tolist()
        if has_nan.item():  # a NaN makes the argmax meaningless: fail the step rather than emit garbage
            raise NonFiniteLogitsError(f"the model produced NaN logits for {len(seqs)} sequences")
        logprobs = [None] * len(seqs)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(logits[wanted], -1)
            k = max(seqs[i].params.logprobs for i in wanted)
            top_v, top_i = lp.topk(max(k, 1), -1)
            chosen = lp.gather(1, tokens[wanted].unsqueeze(1)).squeeze(1).tolist()
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for row, i in enumerate(wanted):
                n = seqs[i].params.logprobs
                logprobs[i] = (chosen[row], list(zip(top_i[row][:n], top_v[row][:n])))
        return SampleResult(token_list, logprobs)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                banned = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else s.eos_token_ids)
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        temps = torch.tensor([1.0 if g else s.params.temperature for s, g in zip(seqs, greedy)],
                             device=logits.device)
        logits = logits / temps.unsqueeze(1)
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = self._top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            noise[shared] = torch.empty((len(shared), probs.shape[1]), device=probs.device).exponential_(
                generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(-1)
        if any(greedy):
            mask = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(mask, logits.argmax(-1), sampled)
        return sampled

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        sorted_logits, order = logits.sort(-1, descending=True)
        vocab = logits.shape[1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        cut = ranks.unsqueeze(0) >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each token
        cut |= before >= torch.tensor(top_p, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
