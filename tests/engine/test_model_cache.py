"""The GGUF conversion cache: a model converted once is read from its folder, also when two processes (two
servers, or two pytest-xdist workers) convert the same file at the same time."""

import types
from pathlib import Path

from service.engine import models


def test_a_conversion_finished_first_by_another_process_is_used_and_ours_dropped(tmp_path, monkeypatch):
    gguf, cache = tmp_path / "model.gguf", tmp_path / "cache"
    gguf.write_bytes(b"GGUF")

    class Converted:
        """What transformers loads from the GGUF file (the tokenizer and the model): only saving matters here."""
        config = types.SimpleNamespace()

        def save_pretrained(self, folder):
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text('{"ours": true}')
            winner = Path(str(folder).rsplit(".tmp", 1)[0])  # meanwhile, the other process renamed its copy
            winner.mkdir(exist_ok=True)
            (winner / "config.json").write_text('{"theirs": true}')

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: Converted())
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Converted())
    folder = models._convert_gguf(gguf, str(cache))
    assert (folder / "config.json").read_text() == '{"theirs": true}'
    assert [p.name for p in cache.iterdir()] == [folder.name]  # our copy is gone
