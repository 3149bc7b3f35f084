"""Prefill speed of the pruned decoder against the FLOPs-ideal speed-up, measured side by side.

    python -m analysis.speed                      # mid-size random LLaVA on the CPU (about 3 minutes)
    python -m analysis.speed --shape llava-7b     # the LLaVA-1.5-7B shape, bf16, on a GPU

Random weights (no download): speed does not depend on them. Every configuration is timed in
one process, interleaved round-robin over `--repeats` rounds, and the median is reported, so the
ratios compare like with like on a noisy machine. The vision tower runs once outside the timing
(its features are passed in), so the timed part is the decoder prefill the FLOPs model counts.

Printed per method and budget: prefill time, measured speed-up over `none`, the FLOPs-ideal
speed-up (unpruned / pruned prefill FLOPs), their ratio (1.0 = pruning pays exactly what the
FLOPs promise), and the scoring overhead: HAP's extra time over the `random` policy, which runs
the same schedule without capturing or scoring anything, as a percent of HAP's prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

import hap
from hap.patch.decoder import decoder_shape

SHAPES = {
    # hidden, layers, heads, kv_heads, mlp, vision (hidden, layers, heads, image)
    "mid": dict(hidden=1024, layers=8, heads=16, kv=16, mlp=2816, vision=(256, 4, 4, 336)),
    "llava-7b": dict(hidden=4096, layers=32, heads=32, kv=32, mlp=11008, vision=(1024, 24, 16, 336)),
}
IMAGE_TOKEN = 32000


def random_llava(shape: str, dtype: torch.dtype, device: str) -> LlavaForConditionalGeneration:
    s = SHAPES[shape]
    vh, vl, vheads, size = s["vision"]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=vh, intermediate_size=4 * vh, num_hidden_layers=vl, num_attention_heads=vheads,
            image_size=size, patch_size=14,
        ),
        text_config=LlamaConfig(
            vocab_size=32064, hidden_size=s["hidden"], intermediate_size=s["mlp"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv"], max_position_embeddings=4096,
        ),
        image_token_index=IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlavaForConditionalGeneration(config)
    model.set_attn_implementation("sdpa")
    return model.to(dtype).eval()


def make_inputs(model, text_tokens: int, device: str) -> dict:
    """`[prefix 5][576 image tokens][prompt]` and the image features, computed once."""
    n = (model.config.vision_config.image_size // 14) ** 2
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 30000, (1, 5), generator=g)
    prompt = torch.randint(100, 30000, (1, text_tokens - 5), generator=g)
    ids = torch.cat([prefix, torch.full((1, n), IMAGE_TOKEN), prompt], 1).to(device)
    pixels = torch.randn(1, 3, model.config.vision_config.image_size, model.config.vision_config.image_size)
    with torch.inference_mode():
        features = model.model.get_image_features(pixel_values=pixels.to(device, model.dtype), return_dict=True)
    return {"input_ids": ids, "mm_encoder_outputs": {"image": features}, "logits_to_keep": 1}


def timed(model, inputs: dict, config: hap.HAPConfig | None, device: str) -> float:
    if config is not None:
        hap.patch(model, config)
    try:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(**inputs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        if config is not None:
            hap.unpatch(model)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=SHAPES, default="mid")
    p.add_argument("--retain", type=float, nargs="+", default=[0.222, 0.111, 0.056])
    p.add_argument("--methods", nargs="+", default=["fastv", "pdrop", "uniform", "hap", "random"])
    p.add_argument("--first-layers", type=int, default=None,
                   help="K; default 0 on the 8-layer mid shape (K >= 1 cannot reach 0.056 there), 1 on 7B")
    p.add_argument("--text-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    first = args.first_layers if args.first_layers is not None else (0 if args.shape == "mid" else 1)
    model = random_llava(args.shape, dtype, device)
    inputs = make_inputs(model, args.text_tokens, device)
    shape = decoder_shape(model)
    n = int((inputs["input_ids"] == IMAGE_TOKEN).sum())
    configs: dict[tuple[str, float], hap.HAPConfig | None] = {("none", 1.0): None}
    schedules: dict[tuple[str, float], hap.Schedule] = {}
    skipped = []
    for retain in args.retain:
        for method in args.methods:
            config = hap.HAPConfig(method=method, retain=retain, first_layers=first if method != "fastv" else max(first, 1))
            try:
                schedules[(method, retain)] = hap.solve_schedule(
                    n, shape, first_layers=config.first_layers, groups=1 if method == "fastv" else config.groups,
                    decay=config.decay, retain=retain,
                )
            except ValueError as err:
                skipped.append(f"{method} at {retain}: {err}")
                continue
            configs[(method, retain)] = config
    for _ in range(2):  # warm-up
        for config in configs.values():
            timed(model, inputs, config, device)
    times: dict[tuple[str, float], list[float]] = {key: [] for key in configs}
    for _ in range(args.repeats):
        for key, config in configs.items():
            times[key].append(timed(model, inputs, config, device))
    median = {key: statistics.median(v) for key, v in times.items()}
    base = median[("none", 1.0)]
    print(f"shape={args.shape} device={device} dtype={dtype} threads={args.threads} visual={n} "
          f"text={args.text_tokens} first_layers={first} repeats={args.repeats}")
    print(f"none: prefill {base * 1000:.1f} ms")
    print(f"{'method':8} {'retain':>7} {'kept':>7} {'ms':>8} {'speedup':>8} {'ideal':>7} {'meas/ideal':>10} {'overhead':>9}")
    for (method, retain), schedule in schedules.items():
        ideal = 1 / schedule.flops_ratio(args.text_tokens, shape)
        speedup = base / median[(method, retain)]
        overhead = ""
        if method == "hap" and ("random", retain) in median:
            extra = median[(method, retain)] - median[("random", retain)]
            overhead = f"{100 * extra / median[(method, retain)]:8.1f}%"
        print(f"{method:8} {retain:7.3f} {schedule.retained_tokens:7.1f} {median[(method, retain)] * 1000:8.1f} "
              f"{speedup:8.2f} {ideal:7.2f} {speedup / ideal:10.2f} {overhead:>9}")
    for line in skipped:
        print(f"skipped {line}")


if __name__ == "__main__":
    main()
