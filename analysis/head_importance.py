"""A model's static head importance, measured once by head ablation and written as the file that `hawk` and HAP's
`head_weight="static"` read (`hap.static_head_importance`, `hap.scoring.importance`; docs/method.md §16).

    python -m analysis.head_importance --model assets/tiny-llava --scenes 400000:400050 --per-scene 2 \
        --out assets/tiny-llava/head_importance.json
    python -m analysis.head_importance --model llava-hf/llava-1.5-7b-hf --items items.json --out head_importance.json

Calibration items are synthetic scenes with their questions (`--scenes A:B`, validation seeds: never the held-out
ones a table reports on), or your own images and prompts (`--items`: a JSON list of {"image": path, "prompt": text},
paths relative to the file). The file holds the weights ([layers][heads], each layer's row summing to 1 or all zeros)
and how they were measured: the model, the items, the seconds, the torch version. `--versus-plain N` first times the
fast path against the plain loop (every head zeroed in the whole model, `hap.causal.ablation`) on the first N items,
side by side, and prints their ratio and largest difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hap
from hap import causal
from hap.causal import ABLATION_BATCH
from hap.scoring import importance
from analysis.scenes import heldout_items


def scene_items(spec: str, per_scene: int) -> tuple[list, list[str]]:
    """(images, prompts) of the scenes of seeds `spec` = "A:B", `per_scene` questions each."""
    a, b = (int(v) for v in spec.split(":"))
    items = list(heldout_items(range(a, b), per_scene))
    return [scene.image for scene, _ in items], [q.text for _, q in items]


def file_items(path: Path) -> tuple[list[str], list[str]]:
    """(images, prompts) of an items file: [{"image": path, "prompt": text}, ...]; ValueError naming the problem."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--items {path}: not a readable JSON file ({err})") from err
    if not (isinstance(data, list) and data and all(isinstance(d, dict) and isinstance(d.get("image"), str)
                                                    and isinstance(d.get("prompt"), str) for d in data)):
        raise ValueError(f'--items {path}: needs a non-empty list of {{"image": path, "prompt": text}}')
    return [str(path.parent / d["image"]) for d in data], [d["prompt"] for d in data]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/tiny-llava", help="hub id or local folder")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenes", metavar="A:B", help="synthetic scenes of seeds A..B-1 (validation: 400000+)")
    source.add_argument("--items", type=Path, help='JSON list of {"image": path, "prompt": text}')
    p.add_argument("--per-scene", type=int, default=2, help="questions per scene (--scenes)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--batch-size", type=int, default=ABLATION_BATCH, help="ablated copies per forward")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--versus-plain", type=int, default=0, metavar="N",
                   help="first time the fast path against the plain loop over heads on N items, side by side")
    return p


def versus_plain(model, processor, images: list, prompts: list[str], batch_size: int) -> dict:
    """Seconds of the fast path (`hap.causal.item_drops`) and of the plain loop (`hap.causal.ablation`) on the same
    items, alternated item by item, and the largest difference of their drops."""
    fast = plain = diff = 0.0
    for image, prompt in zip(images, prompts):
        inputs = causal.prepare(model, processor, image, prompt)
        t0 = time.perf_counter()
        a = causal.item_drops(model, inputs, batch_size)
        t1 = time.perf_counter()
        b = causal.ablation(model, inputs, batch_size)[2]
        t2 = time.perf_counter()
        fast, plain = fast + t1 - t0, plain + t2 - t1
        diff = max(diff, float((a.float() - b).abs().max()))
    return {"items": len(images), "fast_s": fast, "plain_s": plain, "ratio": fast / plain, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        images, prompts = scene_items(args.scenes, args.per_scene) if args.scenes else file_items(args.items)
        model, processor = hap.load_model(args.model, device=args.device, dtype=args.dtype)
    except (ValueError, hap.ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.versus_plain:
        n = min(args.versus_plain, len(images))
        found = versus_plain(model, processor, images[:n], prompts[:n], args.batch_size)
        print(f"fast path {found['fast_s']:.2f} s, plain loop {found['plain_s']:.2f} s on {n} items: ratio "
              f"{found['ratio']:.2f}; largest difference {found['max_abs_diff']:.2g}")
    bar = tqdm(total=len(images), desc="calibration items", unit="item")
    t0 = time.perf_counter()
    weights = hap.static_head_importance(model, processor, images, prompts, args.batch_size,
                                         progress=lambda done, total: bar.update(1))
    seconds = time.perf_counter() - t0
    bar.close()
    layers, heads = weights.shape
    source = {"scenes": args.scenes, "per_scene": args.per_scene} if args.scenes else {"items": str(args.items)}
    importance.write(args.out, torch.from_numpy(weights), model=args.model, layers=layers, heads=heads,
                     items=len(images), **source, seconds=round(seconds, 2), device=str(model.device),
                     dtype=str(model.dtype), torch=torch.__version__,
                     rule="mean over items of max(0, log p(a) - log p(a | head zeroed)), a = the greedy next token; "
                          "each layer's row divided by its sum")
    print(f"{len(images)} items, {layers} x {heads} heads, {seconds:.1f} s ({seconds / len(images):.2f} s per item)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
