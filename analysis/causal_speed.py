"""Cost of the causal analysis (hap.causal) and of head utility (hap.utility) as multiples of one unpruned prefill,
on a random-weight VLM.

    python -m analysis.causal_speed                   # the 32-layer width-1024 shape ("mid" at 32 layers), CPU
    python -m analysis.causal_speed --layers 8 --repeats 5
    python -m analysis.causal_speed --utility-layers 1 11 21   # head utility at three cut layers only

Timed, interleaved over `--repeats` rounds (median): one unpruned prefill (inference mode), and one gradient pass
(`hap.causal.gradients`: one forward and one backward that give both the attribution head importance and the token
importance). Exact ablation costs one forward per head (`layers x heads` of them, batched) and is not timed here.
The target: attribution + token importance under 3 prefills. Then head utility (`hap.utility.measure`, rows="last",
keep ceil(N / 9), every layer or `--utility-layers`) timed once, beside its FLOPs prediction (`hap.utility.cost`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from analysis.speed import make_inputs, random_vlm
from hap import causal, utility
from hap.patch.decoder import decoder_shape


def prefill(model, inputs: dict) -> None:
    with torch.inference_mode():
        model(**inputs, logits_to_keep=1)


def measure(model, inputs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of one prefill and of one gradient pass, interleaved; and their ratio."""
    runs = {"prefill_s": lambda: prefill(model, inputs), "gradients_s": lambda: causal.gradients(model, inputs)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(v) for name, v in times.items()}
    return {**median, "gradients_per_prefill": median["gradients_s"] / median["prefill_s"]}


def measure_utility(model, inputs: dict, prefill_s: float, layers: list[int] | None) -> dict[str, float]:
    """Seconds of one head-utility pass (`layers`: None = all), in prefills, and the FLOPs prediction."""
    t0 = time.perf_counter()
    found = utility.measure(model, inputs, layers=layers)
    seconds = time.perf_counter() - t0
    ids = inputs["input_ids"][0]
    visual = int((ids == model.config.image_token_id).sum())
    predicted = utility.cost(decoder_shape(model), visual, len(ids) - visual, causal.head_layout(model)[1],
                             found.keep, layers)
    return {"utility_s": seconds, "utility_per_prefill": seconds / prefill_s, "utility_flops_prefills": predicted,
            "utility_layers": len(found.scored)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="mid")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--text-tokens", type=int, default=26)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--utility-layers", type=int, nargs="*", default=None,
                   help="layers whose heads head utility scores (default: all; none given: skip head utility)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = random_vlm(args.shape, args.layers, torch.float32, "cpu")
    inputs = make_inputs(model, args.text_tokens, "cpu")
    del inputs["logits_to_keep"]
    report = {"shape": args.shape, "layers": args.layers, **measure(model, inputs, args.repeats)}
    print(f"{args.shape} x {args.layers} layers: prefill {report['prefill_s']:.2f} s, attribution + token "
          f"importance (one gradient pass) {report['gradients_s']:.2f} s = "
          f"{report['gradients_per_prefill']:.2f} x one prefill (target < 3)")
    if args.utility_layers is None or args.utility_layers:
        report.update(measure_utility(model, inputs, report["prefill_s"], args.utility_layers))
        print(f"head utility ({report['utility_layers']} cut layers x {causal.head_layout(model)[1]} heads + 2 "
              f"references, one pass) {report['utility_s']:.1f} s = {report['utility_per_prefill']:.1f} x one "
              f"prefill (FLOPs predict {report['utility_flops_prefills']:.1f})")
    return report


if __name__ == "__main__":
    main()
