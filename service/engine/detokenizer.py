"""Incremental detokenization and stop-string handling for one sequence at a time.

Text is decoded from a sliding window of tokens so that multi-token characters appear only when
complete. Stop strings are searched across token boundaries; the output never includes them, and
a streamed delta holds back any tail that could still turn into a stop string.
"""

from service.engine.sequence import Sequence

# tokens of left context re-decoded with each new token, so that merges with spaces stay right
_CONTEXT = 5


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(0, seq.num_prompt_tokens - _CONTEXT)

    def append(self, seq: Sequence) -> str | None:
        """Decode the newest token; return a stop reason ('stop') if a stop string now ends the text."""
        if self.tokenizer is None:
            return None
        ids, skip = seq.token_ids, seq.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for more tokens
        before = len(seq.text)
        seq.text += full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        for stop in seq.params.stop:
            at = seq.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                seq.text = seq.text[:at]
                return "stop"
        return None

    @staticmethod
    def take_delta(seq: Sequence) -> str:
        """Text not yet handed out; while running, keep back what may be the start of a stop string."""
        end = len(seq.text)
        if seq.params.stop and not seq.is_finished:
            hold = max(len(s) for s in seq.params.stop) - 1
            end = max(seq.emitted_text_len, end - hold)
        delta = seq.text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        return delta
