"""One prepared GPU check: what a GPU user depends on, on random-weight models at the real shapes, in minutes.

    python -m app.gpu_check              # on a GPU: LLaVA-1.5-7B and Qwen2.5-VL-7B shapes, bf16, SDPA
    python -m app.gpu_check --shapes llava-7b   # one shape (half the time)
    python -m app.gpu_check --smoke      # the same code on small shapes, float32 on the CPU (< 3 min; tested)

No download: each model is built from its config with random weights directly on the device in bfloat16 (the
decoder at its real shape, a one-layer stand-in vision tower: `analysis.speed.random_vlm`) and paired with a processor
built here (the small model's word-level tokenizer; CLIP's 336-px image processing for LLaVA, Qwen2-VL's at 672 x 672
for Qwen2.5-VL: 576 visual tokens each). Per shape, in this order, the JSON rewritten as each stage ends (a run cut
short keeps what it measured):

1. prefill speed (`analysis.speed.bench`): METHODS at RETAINS against the unpruned prefill, with the FLOPs-ideal
   speed-up and the peak memory;
2. the causal analysis's cost (`analysis.causal_speed.measure`): one unpruned prefill against one gradient pass
   (attribution head importance and token importance);
3. `/analyze` end to end through the app's handler on a shipped scene (causal="attribution", head utility included);
4. `/sweep` through the handler: every method over the budgets;
5. (LLaVA shapes) the field's table in small (`analysis.paper_table`): the model saved to a folder, then two methods
   at one budget on a few `hap_scenes` questions through the lmms-eval plugin, one process per cell; skipped, saying
   so, where lmms-eval is not installed (`bash .ci/install-eval --cli`).

Writes `gpu_check.json` and `gpu_check.md` (`--smoke`: `gpu_check_smoke.*`) under `--out`. Random weights answer
nonsense, so every generation runs to the token limit (the app's 32; `--smoke`: 4): the app's timings are upper bounds.
Sized for under 8 minutes on one GPU (the two sweeps, 43 generations of 32 tokens each, are the longest stages); not
yet run on one. Nothing is downloaded (the hub is set offline unless HF_HUB_OFFLINE says otherwise).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it: nothing to download
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import argparse  # noqa: E402
import csv  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from analysis import causal_speed, paper_table, speed  # noqa: E402
from analysis.training.tiny_vlm import build_processor, build_qwen_processor  # noqa: E402
from app import handler, pipeline  # noqa: E402
from app.models import LOADED  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.uploads import file_data  # noqa: E402
from hap.knobs import KNOBS  # noqa: E402
from hap.patch.decoder import decoder_shape  # noqa: E402

SHAPES = ("llava-7b", "qwen2.5-vl-7b")
SMOKE_SHAPES = ("llava-small", "qwen2.5-vl-small")  # the same families, 4 layers of width 64
METHODS = ("hap", "hap_paper", "random", "fastv", "pdrop", "pdrop_ours")  # pdrop: refused on M-RoPE (Qwen)
RETAINS = (0.222, 0.111, 0.056)
ROOT = Path(__file__).resolve().parent.parent
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
PROMPT = "what color is the square ?"
TABLE_METHODS, TABLE_TOKENS, TABLE_SCENES = ("hap", "uniform"), (64,), "500000:500004"  # the table stage's cells


def processor_for(family: str):
    """(processor with speed.GRID^2 visual tokens per image, the special-token ids its model needs)."""
    if family == "llava":
        processor = build_processor(image_size=speed.GRID * 14)
        processor.tokenizer.model_max_length = 4096
        return processor, {"image_token_id": processor.tokenizer.image_token_id}
    return build_qwen_processor(speed.GRID * 28)  # 14-px patches merged 2 x 2


def speed_stage(model, name: str, device: str, repeats: int) -> dict:
    """{method: {retain: row}} of `analysis.speed.bench`: speedup, ideal, peak_memory_bytes, seconds, kept, scoring."""
    args = speed.parser().parse_args(["--methods", *METHODS, "--retain", *map(str, RETAINS), "--repeats", str(repeats)])
    rows = speed.bench(model, name, args, device)
    out: dict = {m: {f"{r:g}": {"skipped": "refused or out of reach: see the log"} for r in RETAINS} for m in METHODS}
    for r in rows:
        peak = None if r["peak_gib"] != r["peak_gib"] else int(r["peak_gib"] * 2**30)  # nan off CUDA
        out[r["method"]][f"{r['retain']:g}"] = {
            "speedup": r["speedup"], "ideal": r["ideal"], "peak_memory_bytes": peak, "seconds": r["seconds"],
            "kept": r["kept"], "scoring": r["scoring"]}
    return out


def causal_stage(model, device: str, repeats: int) -> dict:
    """One unpruned prefill against one gradient pass (`analysis.causal_speed.measure`), with the peak memory."""
    inputs = speed.make_inputs(model, 40, device)
    del inputs["logits_to_keep"]
    found, _, peak = speed.measured(lambda: causal_speed.measure(model, inputs, repeats), device)
    return {**found, "peak_memory_bytes": peak}


def app_stage(model, processor, name: str, device: str, new_tokens: int) -> tuple[dict, dict]:
    """(`/analyze`, `/sweep`) through the app's handler with `model` as the loaded one: seconds, peak memory and
    what they reported."""
    layers = decoder_shape(model).layers
    knobs = {k.name: k.resolve(layers) for k in KNOBS}
    image = file_data(SCENE)
    server = handler.Handler(Settings(models=[name]))
    LOADED.model, LOADED.processor, LOADED.name = model, processor, name
    try:
        with mock.patch.object(pipeline, "MAX_NEW_TOKENS", new_tokens):
            out, seconds, peak = speed.measured(
                lambda: server.analyze(image, PROMPT, name, causal="attribution", **knobs), device)
            swept, sweep_seconds, sweep_peak = speed.measured(lambda: server.sweep(
                image, PROMPT, name, **{k: v for k, v in knobs.items() if k not in handler.SWEPT}), device)
    finally:
        LOADED.model = LOADED.processor = LOADED.name = None
    s = out["summary"]
    analyze = {"seconds": seconds, "peak_memory_bytes": peak, "answer": s["answer"],
               "retained_tokens": s["retained_tokens"], "flops_ratio": s["flops_ratio"],
               "latency_s": {label: r["latency_s"] for label, r in s["runs"].items()},
               "causal_mode": s["causal"]["mode"], "causal_seconds": s["causal"]["seconds"],
               "head_utility_seconds": s.get("head_utility", {}).get("seconds")}
    result = swept["sweep"]
    sweep = {"seconds": sweep_seconds, "peak_memory_bytes": sweep_peak, "budgets": len(result["retain"]),
             "methods": len(result["methods"])}
    return analyze, sweep


def table_stage(model, processor, device: str, dtype: torch.dtype, folder: Path) -> dict:
    """`analysis.paper_table` on `model` saved to `folder/model`: TABLE_METHODS at TABLE_TOKENS on TABLE_SCENES; the
    rows of its table.csv and its seconds, or why it was skipped."""
    if (missing := paper_table.eval_missing()) is not None:
        return {"skipped": missing}
    saved = folder / "model"
    model.save_pretrained(saved)
    processor.save_pretrained(saved)
    t0 = time.perf_counter()
    code = paper_table.main(["--model", str(saved), "--methods", ",".join(TABLE_METHODS), "--tokens",
                             *map(str, TABLE_TOKENS), "--scenes", TABLE_SCENES, "--out", str(folder / "table"),
                             "--device", device, "--dtype", str(dtype).removeprefix("torch.")])
    seconds = time.perf_counter() - t0
    if code != 0:
        return {"skipped": f"analysis.paper_table exited with {code}", "seconds": seconds}
    with (folder / "table" / "table.csv").open() as f:
        return {"seconds": seconds, "rows": list(csv.DictReader(f))}


def check_shape(name: str, device: str, dtype: torch.dtype, repeats: int, new_tokens: int, save, out: Path) -> dict:
    """Every stage on one shape; `save()` after each."""
    family = speed.SHAPES[name]["family"]
    processor, ids = processor_for(family)
    model, build_seconds, _ = speed.measured(lambda: speed.random_vlm(name, None, dtype, device, ids), device)
    shape = decoder_shape(model)
    report = {"family": family, "layers": shape.layers, "hidden": shape.hidden, "kv_dim": shape.kv_dim,
              "heads": model.config.text_config.num_attention_heads, "visual": speed.GRID**2,
              "parameters": sum(p.numel() for p in model.parameters()), "build_seconds": build_seconds}
    save(name, report)
    report["methods"] = speed_stage(model, name, device, repeats)
    save(name, report)
    report["causal"] = causal_stage(model, device, max(1, repeats // 2))
    save(name, report)
    report["analyze"], report["sweep"] = app_stage(model, processor, f"random/{name}", device, new_tokens)
    save(name, report)
    if family == "llava":
        report["paper_table"] = table_stage(model, processor, device, dtype, out / f"paper_table_{name}")
        save(name, report)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return report


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def markdown(r: dict) -> str:
    """The report's tables: prefill speed per shape, method and budget; the app's and the causal analysis's timings."""
    lines = [f"# GPU check ({'smoke, ' if r['smoke'] else ''}{r['device']}: {r['gpu'] or 'no GPU'}, {r['dtype']})", "",
             f"`{r['command']}`; torch {r['torch']}, transformers {r['transformers']}; {r.get('seconds', 0):.0f} s "
             "in all. Random weights; peak memory is CUDA's max allocated (- off CUDA).", "",
             "| shape | method | retain | kept | speed-up | FLOPs-ideal | measured / ideal | prefill ms | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["shapes"].items():
        for method, budgets in s.get("methods", {}).items():
            for retain, m in budgets.items():
                if "skipped" in m:
                    lines.append(f"| {name} | {method} | {retain} | skipped: {m['skipped']} | | | | | |")
                    continue
                lines.append(f"| {name} | {method} | {retain} | {m['kept']:.1f} | {m['speedup']:.2f}x | "
                             f"{m['ideal']:.2f}x | {m['speedup'] / m['ideal']:.2f} | {1000 * m['seconds']:.1f} | "
                             f"{_gib(m['peak_memory_bytes'])} |")
    lines += ["", "| shape | parameters | build s | /analyze s (peak GiB) | causal in /analyze s | head utility s "
                  "| gradient pass / prefill | /sweep s (peak GiB) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in r["shapes"].items():
        a, c, w = s.get("analyze"), s.get("causal"), s.get("sweep")
        utility = a and a["head_utility_seconds"]
        lines.append(
            f"| {name} | {s['parameters'] / 1e9:.2f} B | {s['build_seconds']:.1f} | "
            + (f"{a['seconds']:.1f} ({_gib(a['peak_memory_bytes'])}) | {a['causal_seconds']:.2f} | "
               f"{'-' if utility is None else f'{utility:.2f}'} | " if a else "- | - | - | ")
            + (f"{c['gradients_per_prefill']:.2f} ({1000 * c['prefill_s']:.0f} ms) | " if c else "- | ")
            + (f"{w['seconds']:.1f} ({_gib(w['peak_memory_bytes'])}) |" if w else "- |"))
    tables = {name: s["paper_table"] for name, s in r["shapes"].items() if "paper_table" in s}
    if tables:
        lines += ["", "| shape | paper_table cell | value | FLOPs ratio | prefill ms | peak MB |", "|---|---|---|---|---|---|"]
    for name, t in tables.items():
        if "skipped" in t:
            lines.append(f"| {name} | skipped: {t['skipped']} | | | | |")
        for row in t.get("rows", []):
            if row["refused"]:
                lines.append(f"| {name} | {row['method']} at {row['tokens']} tokens | refused: {row['refused']} | | | |")
                continue
            peak = f"{float(row['peak_mb']):.0f}" if row["peak_mb"] else "-"
            lines.append(f"| {name} | {row['method']} at {row['tokens']} tokens | {float(row['value']):.3f} | "
                         f"{float(row['flops_ratio']):.3f} | {float(row['prefill_ms']):.1f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="small shapes on the CPU: the same code in under 3 minutes")
    p.add_argument("--shapes", nargs="+", choices=[*SHAPES, *SMOKE_SHAPES], default=None,
                   help=f"default: {' '.join(SHAPES)} ({' '.join(SMOKE_SHAPES)} with --smoke)")
    p.add_argument("--repeats", type=int, default=None, help="timing rounds (default 5; --smoke: 1)")
    p.add_argument("--new-tokens", type=int, default=None, help="the app's generation limit (default 32; --smoke: 4)")
    p.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("no GPU here: the 7B shapes need one (about 16 GB each in bf16); run with --smoke on a CPU")
    if args.smoke:
        torch.set_num_threads(1)
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the CPU runs float32 kernels several times faster
    repeats = args.repeats or (1 if args.smoke else 5)
    new_tokens = args.new_tokens or (4 if args.smoke else 32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("gpu_check_smoke" if args.smoke else "gpu_check")
    report = {"command": "python -m app.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "smoke": args.smoke, "device": device, "dtype": str(dtype).removeprefix("torch."),
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
              "transformers": transformers.__version__, "repeats": repeats, "new_tokens": new_tokens, "shapes": {}}
    t0 = time.perf_counter()

    def save(name: str, shape: dict) -> None:
        report["shapes"][name] = shape
        report["seconds"] = time.perf_counter() - t0
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        stem.with_suffix(".md").write_text(markdown(report))

    for name in args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES):
        check_shape(name, device, dtype, repeats, new_tokens, save, out)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
