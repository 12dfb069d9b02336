"""Weights made straight into a model built on the meta device, a tensor-parallel rank's slices only: nothing whole
is made first, so no rank ever holds (or reads) the whole model.

`fill` gives each parameter its tensor from a source: `Random` draws it, `Checkpoint` reads it from safetensors
files. A parameter that a rank keeps a slice of comes with (dim, start, end, full size) from parallel.shard_model.

Random weights: each weight is cut into tiles of ROWS x COLUMNS, and each tile is drawn from its own generator,
seeded by the model's seed, the weight's name and the tile's place. A rank draws the tiles its slice (rows or
columns) touches and keeps the slice: the numbers at a place of a weight do not depend on who draws them, so N ranks
hold exactly the slices of the one model that N = 1 draws. As transformers initializes a Llama: linear and embedding
weights normal with standard deviation `initializer_range`, RMSNorm weights one. The same numbers on every device of
a type (the CUDA generator is counter-based); a CPU draws other numbers than a GPU.

A checkpoint: each slice is read with safetensors' `get_slice` and copied out of the mapped file, one weight at a
time, so a rank's memory peaks near its own shard (the file's pages are mapped only while a weight is read).
"""

import functools
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

ROWS, COLUMNS = 128, 8192  # a tile of a weight drawn from one seed (a 70B model's weights: about 68,000 tiles)


Piece = tuple[int, int, int, int] | None  # (dim, start, end, full size) of the slice a rank keeps, or None: whole


def fill(model: nn.Module, source, device: torch.device, slices: dict[int, tuple[int, int, int, int]],
         after_layer=None) -> None:
    """Give every parameter of `model` (built on the meta device) its tensor on `device`, in place:
    `source(name, meta parameter, piece)`. `slices` maps a parameter's id to its piece. `after_layer(layer)` runs on
    each decoder layer once it is filled (to quantize it before the next one exists). Tied parameters stay tied; the
    rotary embedding is made again on `device`."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)

    def materialize(root: nn.Module) -> None:
        made: dict[int, nn.Parameter] = {}  # tied parameters (the embedding and the head), made once; dropped after
        for module in root.modules():  # each layer, so that a quantized layer's float weights are freed at once
            for key, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    tensor = source(names[id(p)], p, slices.get(id(p)))
                    made[id(p)] = nn.Parameter(tensor.to(device, p.dtype), requires_grad=False)
                module._parameters[key] = made[id(p)]

    rotary = _rotary(model)
    if rotary is not None and any(b.is_meta for b in rotary.buffers()):
        with torch.device(device):  # its frequencies are made at construction
            model.model.rotary_emb = type(rotary)(config=model.config)
    for layer in getattr(model.model, "layers", []):
        materialize(layer)
        if after_layer is not None:
            after_layer(layer)
    materialize(model)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"nothing fills {', '.join(left[:3])}")


def _rotary(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding, whose frequencies are buffers made at construction."""
    return getattr(model.model, "rotary_emb", None)


class Random:
    """Random weights (the module's docstring says how they are drawn)."""

    def __init__(self, seed: int, device: torch.device, std: float):
        self.seed, self.device, self.std = seed, device, std

    def __call__(self, name: str, p: torch.Tensor, piece: Piece) -> torch.Tensor:
        return _drawn(name, p, piece, self.seed, self.device, self.std)


class Checkpoint:
    """Tensors read from a folder's safetensors files, a slice at a time. `covers(model)` says whether the files hold
    every parameter under the model's own names (a tied output projection may be left out)."""

    def __init__(self, folder: Path):
        self.files = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))

    def covers(self, model: nn.Module) -> bool:
        """Whether `fill` can make `model` (on meta) from these files: they name every parameter, and its only buffers
        left to make are the rotary frequencies, which `fill` makes itself."""
        rotary = _rotary(model)
        made = {id(b) for b in rotary.buffers()} if rotary is not None else set()
        return (bool(self.files) and all(name in self.files for name, _ in model.named_parameters())
                and all(not b.is_meta or id(b) in made for b in model.buffers()))

    def __call__(self, name: str, p: torch.Tensor, piece: Piece) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            whole = f.get_slice(name)
            dim, start, end, _ = piece or (0, 0, None, None)
            # a copy: the slice would otherwise stay a view of the mapped file, whose pages (a column slice's
            # neighbours too) count in the rank's memory once read and for as long as the view lives
            return (whole[start:end] if dim == 0 else whole[:, start:end]).clone()


def _drawn(name: str, p: torch.Tensor, piece: tuple[int, int, int, int] | None, seed: int, device: torch.device,
           std: float) -> torch.Tensor:
    if p.dim() == 1:  # RMSNorm weights (a Llama has no biases)
        return torch.ones(p.shape, dtype=p.dtype, device=device)
    full, kept = list(p.shape), [(0, n) for n in p.shape]  # the whole weight's shape; the part of it this rank holds
    if piece is not None:
        dim, start, end, full[dim] = piece
        kept[dim] = (start, end)
    out = torch.empty(p.shape, dtype=p.dtype, device=device)
    key = zlib.crc32(f"{seed}:{name}".encode())
    (r0, r1), (c0, c1) = kept
    for i in range(r0 // ROWS, (r1 - 1) // ROWS + 1):
        for j in range(c0 // COLUMNS, (c1 - 1) // COLUMNS + 1):
            top, left = i * ROWS, j * COLUMNS
            shape = (min(ROWS, full[0] - top), min(COLUMNS, full[1] - left))
            _generator(device).manual_seed((key << 30 | i << 15 | j) & (2**63 - 1))  # as a new generator would be
            tile = torch.randn(shape, generator=_generator(device), device=device, dtype=torch.float32).mul_(std)
            a, b = max(top, r0), min(top + shape[0], r1)  # the part of the tile inside the slice
            c, d = max(left, c0), min(left + shape[1], c1)
            out[a - r0:b - r0, c - c0:d - c0] = tile[a - top:b - top, c - left:d - left]
    return out


@functools.cache
def _generator(device: torch.device) -> torch.Generator:
    """One generator per device, seeded again for each tile (not one per tile: about 68,000 for a 70B model)."""
    return torch.Generator(device)

