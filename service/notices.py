"""Third-party notices known to say nothing to a user of this service, filtered in every process of ours (the
package's __init__ attaches them, before anything imports torch or transformers).

Each filter matches one logger and one exact message: no whole logger, category or level is silenced, and the
project's own warnings always pass. Attaching a filter imports nothing: torch and transformers find it when
they log.
"""

import logging


def _not_torchao_enum(record: logging.LogRecord) -> bool:
    return not (str(record.msg).startswith("%s is an Enum subclass and is now natively supported by torch.compile")
                and bool(record.args) and getattr(record.args[0], "__module__", "").startswith("torchao."))


def _not_bpe_cleanup(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Ignoring clean_up_tokenization_spaces=True for BPE tokenizer")


# logger -> a filter (a function: False drops the record, as logging.Logger.addFilter takes it)
_FILTERS = {
    # torchao 0.18 (imported by transformers' modeling code, so by every process that loads a model) registers
    # its own Enums (KernelPreference, ScaleCalculationMode) as pytree constants; torch 2.13 deprecates that and
    # warns once per Enum at each import: a matter between those two libraries, with nothing for a user to do
    "torch.utils._pytree": _not_torchao_enum,
    # SmolLM2's tokenizer config asks for clean_up_tokenization_spaces; transformers ignores it for BPE
    # tokenizers (the cleanup would strip real spaces) and says so at a front end's first decode: the text is right
    "transformers.tokenization_utils_tokenizers": _not_bpe_cleanup,
}


def quiet_known_notices() -> None:
    """Attach each filter to its logger (once, however often this is called)."""
    for name, keep in _FILTERS.items():
        logging.getLogger(name).addFilter(keep)  # a filter already there is not added again
