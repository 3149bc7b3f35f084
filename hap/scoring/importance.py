"""Static head importance (docs/method.md §16): one weight per decoder head, measured once per model by head ablation
(`hap.static_head_importance`) and kept in a JSON file, which the methods that weight heads statically read (HAWK;
HAP's `head_weight="static"`) in place of a per-image score.

The file: `{"weights": [[w per head] per decoder layer], ...provenance}`, each layer's row summing to 1 (or all zeros:
no head of that layer mattered on the calibration items). The `head_importance` knob names it; unset, a model folder's
`head_importance.json` is used where there is one.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import torch

FILE = "head_importance.json"  # the file a model folder may carry
COMMAND = "python -m analysis.head_importance --model {model} --scenes 400000:400050 --per-scene 2 --out {out}"


def model_file(folder: str | None) -> str | None:
    """The `head_importance.json` of a local model folder `folder` (a model's `name_or_path`), or None."""
    if not folder:
        return None
    path = Path(folder).expanduser() / FILE
    return str(path) if path.is_file() else None


def missing(user: str, model: str) -> str:
    """The refusal of `user` (e.g. "method='hawk'") on `model` (its name or folder) without a weights file, naming
    the command that makes one."""
    folder = Path(model).expanduser()
    out = folder / FILE if folder.is_dir() else Path(FILE)
    return (f"{user} weights heads by static head importance, and no file of it was given (head_importance=PATH) or "
            f"found in the model's folder ({FILE}); measure it once with `{COMMAND.format(model=model, out=out)}` "
            "(or on your own images and prompts with --items items.json)")


def row_normalised(drops: torch.Tensor) -> torch.Tensor:
    """`drops [layers, heads]` (>= 0) with each layer's row divided by its sum; a row of zeros stays zeros."""
    sums = drops.sum(-1, keepdim=True)
    return torch.where(sums > 0, drops / sums.clamp_min(torch.finfo(drops.dtype).tiny), torch.zeros_like(drops))


def read(path: str | None) -> torch.Tensor:
    """The weights `[layers, heads]` float32 of the file at `path`, read once per version of the file; ValueError
    naming the file and the problem (none given, missing, not JSON, no "weights", ragged, negative or not finite)."""
    if path is None:
        raise ValueError("no static head importance file: give head_importance=PATH (hap.patch.apply finds a model "
                         f"folder's {FILE})")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"head_importance={path!r}: no such file")
    return _read(str(file.resolve()), file.stat().st_mtime_ns).clone()


@lru_cache(maxsize=8)
def _read(path: str, version: int) -> torch.Tensor:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"head_importance={path!r}: not a JSON file ({err})") from err
    rows = data.get("weights") if isinstance(data, dict) else None
    if not (isinstance(rows, list) and rows and all(isinstance(r, list) and r for r in rows)
            and len({len(r) for r in rows}) == 1):
        raise ValueError(f'head_importance={path!r}: needs {{"weights": [[one number per head] per decoder layer]}}, '
                         "every layer the same number of heads")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for r in rows for v in r):
        raise ValueError(f"head_importance={path!r}: every weight must be a finite number >= 0")
    return torch.tensor(rows, dtype=torch.float32)


def check_shape(weights: torch.Tensor, path: str, layers: int, heads: int) -> None:
    """ValueError where the file's `weights` are not `[layers, heads]` of the model it is used on."""
    if tuple(weights.shape) != (layers, heads):
        raise ValueError(f"head_importance={path!r} holds {weights.shape[0]} layers x {weights.shape[1]} heads; this "
                         f"model's decoder has {layers} x {heads}: measure it on this model")


def layer_weights(weights: torch.Tensor, layers: list[int], batch: int) -> torch.Tensor:
    """The fusion weights `[batch, len(layers), heads]` of the heads of decoder layers `layers` under static
    importance `weights [all layers, heads]`: those rows, divided by their sum (uniform where they sum to 0)."""
    w = weights[layers]
    total = w.sum()
    w = w / total if total > 0 else torch.full_like(w, 1.0 / w.numel())
    return w.expand(batch, *w.shape)


def static_weights(path: str | None, layers: list[int], paq: torch.Tensor) -> torch.Tensor:
    """The static fusion weights of decoder layers `layers` from the file at `path`, shaped and placed as the cut's
    `paq [batch, len(layers), heads]` (`layer_weights`): what a statically weighted pruner's `head_weights` returns."""
    return layer_weights(read(path), layers, paq.shape[0]).to(paq.device)


def write(path: str | Path, weights: torch.Tensor, **provenance) -> None:
    """Write `weights [layers, heads]` (row-normalised) and `provenance` (JSON values) to `path` as the file
    `read` takes."""
    data = {"weights": [[round(float(v), 8) for v in row] for row in weights.tolist()], **provenance}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
