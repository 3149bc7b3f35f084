"""The cost of HAP+'s relevance-diversity selection (`hap.diversity`) beside the decoder prefill it prunes.

    python -m analysis.diversity_cost                       # LLaVA-1.5 (576) and LLaVA-NeXT (2,880), 7B width, CPU
    python -m analysis.diversity_cost --device cuda --dtype bfloat16 --layers 32

For each visual-token count and budget, HAP's schedule on LLaVA-1.5-7B's decoder (32 layers,
`hap.planning.budget.plan`, first_layers 2 at 11.1% and 1 at 5.6%, which 32 layers need; the library's groups) gives
the tokens present and kept at each cut; the selection (`hap.diversity.select` on [1, N, 4096] hidden states) is
timed at every cut and summed, beside the unpruned prefill of the same decoder width (`analysis.speed.random_vlm`'s
`llava-7b` shape, random weights) on `--text-tokens` text tokens plus the visual ones. On a CPU the decoder runs at reduced depth (`--layers`) and the
prefill is scaled to 32 layers (every unpruned layer does the same work); the pruned prefill is the unpruned one times
the schedule's FLOPs ratio. Medians over `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

import hap
from hap.diversity import select
from hap.planning.budget import plan
from hap.planning.flops import DecoderShape
from analysis.speed import SHAPES, random_vlm

COUNTS = {"LLaVA-1.5 (576)": 576, "LLaVA-NeXT (2,880)": 2880}
BUDGETS = {0.111: 2, 0.056: 1}  # retain -> first_layers (5.6% of 32 layers needs one full layer)


def median_seconds(fn, repeats: int, device: str) -> float:
    """Median wall seconds of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_seconds(model, n: int, text_tokens: int, repeats: int, device: str) -> float:
    """Median seconds of one unpruned prefill of `n` visual tokens (random features) and `text_tokens` text ones."""
    image = model.config.image_token_id
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(100, 30000, (1, 5), generator=g), torch.full((1, n), image),
                     torch.randint(100, 30000, (1, text_tokens - 5), generator=g)], 1).to(device)
    features = torch.randn(n, model.config.text_config.hidden_size, generator=g).to(device, model.dtype)
    inputs = {"input_ids": ids, "logits_to_keep": 1,
              "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=[features])}}
    with torch.inference_mode():
        return median_seconds(lambda: model(**inputs), repeats, device)


def selection_seconds(present: list[int], kept: list[int], hidden: int, repeats: int, device: str,
                      dtype: torch.dtype) -> float:
    """Median seconds of the selection at every cut (`present[g]` tokens, `kept[g]` kept), summed over the cuts (the
    weight, 1 here, does not change the work)."""
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(1, n, hidden, generator=g).to(device, dtype), torch.rand(1, n, generator=g).to(device), k)
             for n, k in zip(present, kept)]
    run = lambda: [select(r, e, k, 1.0) for e, r, k in cases]
    return median_seconds(run, repeats, device)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=2, help="decoder layers built (the prefill is scaled to 32)")
    p.add_argument("--text-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    s = SHAPES["llava-7b"]
    shape = DecoderShape.mha(s["layers"], s["hidden"], s["mlp"])
    model = random_vlm("llava-7b", args.layers, dtype, args.device)
    rows = []
    print(f"device {args.device}, {args.dtype}, {args.threads} thread(s); prefill of {args.layers} layers scaled to "
          f"{shape.layers}")
    print("| visual tokens | retain | cuts: present -> kept | selection ms | unpruned prefill ms | pruned prefill ms "
          "| share of the pruned prefill |\n|---|---|---|---|---|---|---|")
    for label, n in COUNTS.items():
        unpruned = prefill_seconds(model, n, args.text_tokens, args.repeats, args.device) * shape.layers / args.layers
        for retain, first in BUDGETS.items():
            schedule = plan(hap.HAPConfig(retain=retain, first_layers=first), shape, n, args.text_tokens)
            present = [n, *schedule.kept[:-1]]
            chosen = selection_seconds(present, schedule.kept, s["hidden"], args.repeats, args.device, dtype)
            pruned = unpruned * schedule.flops_ratio(args.text_tokens, shape)
            rows.append(dict(tokens=n, retain=retain, present=present, kept=schedule.kept, selection_s=chosen,
                             unpruned_s=unpruned, pruned_s=pruned))
            cuts = ", ".join(f"{a} -> {b}" for a, b in zip(present, schedule.kept))
            print(f"| {label} | {retain} | {cuts} | {chosen * 1e3:.1f} | {unpruned * 1e3:.0f} | {pruned * 1e3:.0f} "
                  f"| {chosen / pruned:.2%} |")
    return rows


if __name__ == "__main__":
    main()
