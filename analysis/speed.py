"""Prefill speed of the pruned decoder against the FLOPs-ideal speed-up, measured side by side.

    python -m analysis.speed                                   # mid-size random LLaVA, CPU (~3 min)
    python -m analysis.speed --shape llava-7b                  # LLaVA-1.5-7B shape, bf16 on a GPU
    python -m analysis.speed --shape qwen2.5-vl-7b             # Qwen2.5-VL-7B shape (M-RoPE, GQA)
    python -m analysis.speed --shape llava-7b --layers 4       # the 7B width at reduced depth, on a CPU
    python -m analysis.speed --shape llava-7b qwen2.5-vl-7b    # both 7B shapes (python -m app.gpu_check: all of it)
    python -m analysis.speed --shape llava-small qwen2.5-vl-small --repeats 1   # the smoke shapes, seconds on a CPU

Random weights (no download): speed does not depend on them. The visual tokens are random
features handed to the model in place of the vision tower's output (576 of them, a 24 x 24
grid), so the timed part is exactly the decoder prefill that the FLOPs model counts. Every
configuration is timed in one process, interleaved round-robin over `--repeats` rounds, and the
median is reported, so the ratios compare like with like on a noisy machine.

Printed per method and budget: prefill time, measured speed-up over `none`, the FLOPs-ideal
speed-up (unpruned / pruned prefill FLOPs), their ratio (1.0 = pruning pays what the FLOPs
promise), peak GPU memory, and HAP's scoring overhead (`hap`: the library defaults; `hap_paper`: the paper's
HAP): its extra time over the `random` policy,
which runs the same schedule without capturing or scoring anything, as a percent of HAP's
prefill, and the time spent inside the pruner's capture and cut code as timed in the same prefill
(`scoring`, percent of the prefill: less noisy than a difference of two medians on a busy machine). A `text only` row (the prompt without any visual token) shows the fixed cost no
pruning can remove (embedding, weights streamed once per layer, the output head).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.modeling_outputs import BaseModelOutputWithPooling

import hap
from hap.knobs import knob
from hap.patch import refusal
from hap.patch.decoder import decoder_shape

T = TypeVar("T")
IMAGE_TOKEN = 151655
GRID = 24  # visual tokens per side
SHAPES = {
    "mid": dict(family="llava", hidden=1024, layers=8, heads=16, kv=16, mlp=2816, vocab=32064),
    "llava-7b": dict(family="llava", hidden=4096, layers=32, heads=32, kv=32, mlp=11008, vocab=32064),
    "qwen2.5-vl-7b": dict(family="qwen", hidden=3584, layers=28, heads=28, kv=4, mlp=18944, vocab=152064),
    "llava-small": dict(family="llava", hidden=64, layers=4, heads=4, kv=4, mlp=128, vocab=32064),
    "qwen2.5-vl-small": dict(family="qwen", hidden=64, layers=4, heads=4, kv=2, mlp=128, vocab=152064),
}
QWEN_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1, vision_start_token_id=IMAGE_TOKEN - 3,
                vision_end_token_id=IMAGE_TOKEN - 2)


def random_vlm(shape: str, layers: int | None, dtype: torch.dtype, device: str, ids: dict[str, int] | None = None):
    """A random-weight VLM of the named decoder shape with a small stand-in vision tower, built on `device` in
    `dtype` (a 7B one never exists in float32 or on the CPU). `ids`: the special tokens of the processor it is used
    with (`image_token_id`, and Qwen's video and vision start / end ids; default QWEN_IDS)."""
    s = SHAPES[shape]
    ids = {**QWEN_IDS, **(ids or {})}
    text = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                num_hidden_layers=layers or s["layers"], num_attention_heads=s["heads"],
                num_key_value_heads=s["kv"], max_position_embeddings=4096)
    if s["family"] == "llava":
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=GRID * 14, patch_size=14),
            text_config=LlamaConfig(**text), image_token_index=ids["image_token_id"] % s["vocab"],
        )
        cls = LlavaForConditionalGeneration
    else:
        head_dim = s["hidden"] // s["heads"]
        section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen2.5-VL's [16, 24, 24] at 128
        config = Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "default", "mrope_section": section,
                                                       "rope_theta": 1e6}},
            vision_config=dict(depth=1, hidden_size=64, out_hidden_size=s["hidden"], intermediate_size=128,
                               num_heads=2, fullatt_block_indexes=[0]),
            **ids,
        )
        cls = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


def make_inputs(model, text_tokens: int, device: str, with_image: bool = True) -> dict:
    """`[prefix 5][GRID^2 image tokens][prompt]` with random visual features in place of the tower's."""
    image = model.config.image_token_id
    g = torch.Generator().manual_seed(0)
    n = GRID * GRID if with_image else 0
    prefix = torch.randint(100, 30000, (1, 5), generator=g)
    prompt = torch.randint(100, 30000, (1, text_tokens - 5), generator=g)
    ids = torch.cat([prefix, torch.full((1, n), image), prompt], 1).to(device)
    inputs = {"input_ids": ids, "logits_to_keep": 1}
    if with_image:
        hidden = model.config.text_config.hidden_size
        features = torch.randn(n, hidden, generator=g).to(device, model.dtype)
        inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=[features])}
        if "qwen" in type(model).__name__.lower():
            inputs["image_grid_thw"] = torch.tensor([[1, 2 * GRID, 2 * GRID]], device=device)
            inputs["mm_token_type_ids"] = (ids == image).int()
    return inputs


def measured(fn: Callable[[], T], device: str) -> tuple[T, float, int | None]:
    """(fn(), its wall seconds, the peak GPU memory allocated during it in bytes; None off CUDA)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() if cuda else None


def timed(model, inputs: dict, config: hap.HAPConfig | None, device: str) -> tuple[float, float, float]:
    """(seconds, peak GPU GiB or nan, seconds inside the pruner's scoring) of one prefill."""
    patch = hap.patch(model, config) if config is not None else None
    try:
        with torch.inference_mode():
            _, seconds, peak = measured(lambda: model(**inputs), device)
        scoring = patch.state.scoring_seconds if patch is not None and patch.state is not None else 0.0
        return seconds, float("nan") if peak is None else peak / 2**30, scoring
    finally:
        if config is not None:
            hap.unpatch(model)


def parser() -> argparse.ArgumentParser:
    """The command line of `main` (also the settings `bench` takes)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=SHAPES, nargs="+", default=["mid"], help="one or more shapes, run in turn")
    p.add_argument("--layers", type=int, default=None, help="override the decoder depth (reduced depth on a CPU)")
    p.add_argument("--retain", type=float, nargs="+", default=[0.222, 0.111, 0.056])
    p.add_argument("--methods", nargs="+", default=["fastv", "pdrop", "uniform", "hap", "random"],
                   choices=[*hap.METHODS, "hap_paper"], help="hap: the library defaults; hap_paper: HAPConfig.paper()")
    p.add_argument("--first-layers", type=int, default=None,
                   help="K for every method (FastV cuts once, at K); default: the largest K that reaches the "
                        "smallest budget (0 on the 8-layer mid shape: the cut before layer 0 is scored by "
                        "layer 0's own attention)")
    knob("groups").add_to(p, default=knob("groups").default)
    p.add_argument("--text-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Run the benchmark; returns {shape: rows} as printed (one dict per method and budget, see `table`)."""
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    report = {}
    for name in args.shape:
        report[name] = bench_shape(name, args, device, dtype)
        if device == "cuda":
            torch.cuda.empty_cache()
    return report


def bench_shape(name: str, args: argparse.Namespace, device: str, dtype: torch.dtype) -> list[dict]:
    """Time every method and budget on one random-weight model of shape `name` (`bench`)."""
    return bench(random_vlm(name, args.layers, dtype, device), name, args, device)


def bench(model, name: str, args: argparse.Namespace, device: str) -> list[dict]:
    """Time every method and budget of `args` (`parser`) on `model`, print the table and return its rows."""
    dtype = model.dtype
    inputs = make_inputs(model, args.text_tokens, device)
    shape = decoder_shape(model)
    first = args.first_layers
    if first is None:  # the largest K whose full layers still leave room for the smallest budget
        first = max(k for k in range(shape.layers) if k / shape.layers < min(args.retain))
    schedules, skipped = {}, []
    runs: dict[tuple[str, float], tuple[dict, hap.HAPConfig | None]] = {("none", 1.0): (inputs, None)}
    for retain in args.retain:
        for method in args.methods:
            budget = dict(retain=retain, groups=args.groups, first_layers=first)
            config = hap.HAPConfig.paper(**budget) if method == "hap_paper" else hap.HAPConfig(method=method, **budget)
            try:
                schedule = hap.plan(config, shape, GRID * GRID, args.text_tokens)
                why = refusal(model, config)  # the architecture refuses it by name: pdrop on M-RoPE
            except ValueError as err:
                why = str(err)
            if why is not None:
                skipped.append(f"{method} at {retain}: {why}")
                continue
            schedules[(method, retain)] = schedule
            runs[(method, retain)] = (inputs, config)
    runs[("text only", 0.0)] = (make_inputs(model, args.text_tokens, device, with_image=False), None)
    median, peak, scoring = measure(model, runs, args.repeats, device)
    print(f"shape={name} layers={shape.layers} device={device} dtype={dtype} threads={args.threads} "
          f"visual={GRID * GRID} text={args.text_tokens} first_layers={first} repeats={args.repeats}")
    print(f"none: prefill {median[('none', 1.0)] * 1000:.1f} ms, peak {peak[('none', 1.0)]:.2f} GiB; text only "
          f"(no visual token): {median[('text only', 0.0)] * 1000:.1f} ms")
    rows = table(schedules, median, peak, args.text_tokens, shape, scoring)
    print(f"{'method':9} {'retain':>7} {'kept':>7} {'ms':>8} {'speedup':>8} {'ideal':>7} {'meas/ideal':>10} "
          f"{'peak GiB':>9} {'scoring':>8} {'overhead':>9}")
    for r in rows:
        overhead = "" if r["overhead"] is None else f"{100 * r['overhead']:8.1f}%"
        print(f"{r['method']:9} {r['retain']:7.3f} {r['kept']:7.1f} {r['seconds'] * 1000:8.1f} {r['speedup']:8.2f} "
              f"{r['ideal']:7.2f} {r['speedup'] / r['ideal']:10.2f} {r['peak_gib']:9.2f} "
              f"{100 * r['scoring']:7.1f}% {overhead:>9}")
    for line in skipped:
        print(f"skipped {line}")
    return rows


def measure(model, runs: dict, repeats: int, device: str) -> tuple[dict, dict, dict]:
    """Median seconds, peak GiB and median scoring seconds of each run `{key: (inputs, config)}`, interleaved
    round-robin over `repeats` rounds after two warm-up rounds."""
    for _ in range(2):
        for batch, config in runs.values():
            timed(model, batch, config, device)
    times: dict[tuple[str, float], list[tuple[float, float, float]]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, (batch, config) in runs.items():
            times[key].append(timed(model, batch, config, device))
    median = {key: statistics.median(t for t, _, _ in v) for key, v in times.items()}
    peak = {key: max(m for _, m, _ in v) for key, v in times.items()}
    scoring = {key: statistics.median(s for _, _, s in v) for key, v in times.items()}
    return median, peak, scoring


def table(schedules: dict, median: dict, peak: dict, text_tokens: int, shape: hap.DecoderShape,
          scoring: dict | None = None) -> list[dict]:
    """One row per (method, retain): kept tokens, seconds, measured speed-up over `none`, FLOPs-ideal
    speed-up, peak GiB, the pruner's scoring time as a fraction of the prefill (`scoring`: median seconds per
    run, 0 where not given) and, for HAP, its extra time over `random` as a fraction of HAP's prefill."""
    rows = []
    for (method, retain), schedule in schedules.items():
        seconds = median[(method, retain)]
        random = median.get(("random", retain))
        rows.append(dict(
            method=method, retain=retain, kept=schedule.retained_tokens, seconds=seconds,
            speedup=median[("none", 1.0)] / seconds, ideal=1 / schedule.flops_ratio(text_tokens, shape),
            peak_gib=peak[(method, retain)], scoring=(scoring or {}).get((method, retain), 0.0) / seconds,
            overhead=(seconds - random) / seconds if method.startswith("hap") and random is not None else None,
        ))
    return rows


if __name__ == "__main__":
    main()
