"""Command line: `python -m hap run --model M --image IMG --prompt "..." --method hap --retain 0.056 --json out.json`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import causal, utility
from .config import HAPConfig
from .hub import ModelLoadError
from .knobs import KNOBS, SEED
from .lab.plan import Plan, plant_line
from .lab.planted import plant
from .load import load_model
from .methods import UNIFORM, load_plugins
from .options import OPTIONS, ProcessorOptions
from .patch.processors import option_defaults, processor_options
from .runs.features import FeatureCache, reusing_features
from .runs.inputs import check_history
from .runs.keeps import keeps, keeps_png, panel_title
from .runs.run import run
from .views import ViewData, export_png

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-llava")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hap", description="Head-adaptive visual token pruning")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="answer one image + prompt with pruning and print the statistics")
    r.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local folder (default: the shipped small model)")
    r.add_argument("--image", required=True, help="image file")
    r.add_argument("--prompt", required=True)
    r.add_argument("--history", type=Path, help="JSON file: earlier [question, answer] turns about the image; "
                   "--prompt is then the follow-up question")
    budget = r.add_mutually_exclusive_group()
    for k in (*KNOBS, SEED):
        k.add_to(budget if k.name in ("retain", "flops_ratio") else r)
    r.add_argument("--plant", type=Path, help="JSON file: a head lab plan (hap.plant), planted for every run of this "
                   'command: {"sink": [[layer, head], ...], "dispersed": [...], "sink_tokens": [...], a count or '
                   'null, "strength": 0.9, "massive": true}; the --json result gains "plant" (the plan, the sink '
                   "tokens used, the classifier's precision / recall on it)")
    images = r.add_argument_group("processor options", "how the image becomes visual tokens; unset: the "
                                  "checkpoint's own; a model whose processor has no such setting refuses it by name")
    for option in OPTIONS:
        option.add_to(images)
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    r.add_argument("--json", type=Path, help="write the whole result as JSON here")
    r.add_argument("--figures", type=Path, help="write every view as a PNG into this folder")
    r.add_argument("--causal", nargs="?", const="auto", default="off", choices=causal.SETTINGS,
                   help="also measure which heads and visual tokens the unpruned answer depends on (hap.causal) "
                        "and each head's utility as a token scorer (hap.utility; every layer on small models, the "
                        "layers before the run's cuts on large ones); --causal alone: exact ablation on small "
                        "models, attribution on large ones; the --json result gains 'causal' and 'head_utility'")
    r.add_argument("--keeps", action="store_true",
                   help="also run every pruning method at this budget (one prefill each, the answers decoded as one "
                        "batch) and show what each keeps (hap.runs.keeps): a line per method, the --json result gains "
                        "'keeps', --figures gains keeps.png")
    return p


def read_history(path: Path | None) -> list[tuple[str, str]]:
    """The turns of a `--history` file (`hap.runs.inputs.check_history`); ValueError naming the file."""
    if path is None:
        return []
    try:
        return check_history(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--history {path}: {err}") from err


def read_plan(path: Path | None) -> Plan:
    """The plan of a `--plant` file (`hap.lab.plan.Plan.from_json`); ValueError naming the file."""
    if path is None:
        return Plan()
    try:
        return Plan.from_json(path.read_text(encoding="utf-8") or "{}")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--plant {path}: {err}") from err


def main(argv: list[str] | None = None) -> int:
    try:
        load_plugins()  # the pruners named in HAP_PRUNERS join the method list before the flags are read
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    try:
        given = {k.name: getattr(args, k.name) for k in (*KNOBS, SEED)}
        config = HAPConfig(**{name: value for name, value in given.items() if value is not None})
        history = read_history(args.history)
        plan = read_plan(args.plant)
        options = ProcessorOptions.of({o.name: getattr(args, o.name) for o in OPTIONS
                                      if getattr(args, o.name) is not None})
        model, processor = load_model(args.model, device=args.device, dtype=args.dtype)
        images = {**option_defaults(model, processor), **options.given()}
        with plant(model, plan.sink, plan.dispersed, plan.sink_tokens, plan.strength, plan.massive), \
                processor_options(model, processor, options):
            result = run(model, processor, args.image, args.prompt, config, max_new_tokens=args.max_new_tokens,
                         history=history)
            mode = causal.resolve_setting(model, args.causal)
            found = None if mode is None else causal.analyze(model, processor, args.image, args.prompt, mode,
                                                             history=history)
            useful = None if mode is None else utility.utility(
                model, processor, args.image, args.prompt, rows=config.rows, history=history,
                layers=utility.auto_layers(model, [g.layers[0] for g in result.groups]), config=config)
            every = None
            if args.keeps:  # the image encoded once for every method
                with reusing_features(model, FeatureCache(1)):
                    every = keeps(model, processor, args.image, args.prompt, config, args.max_new_tokens,
                                  history=history, done={result.method: result})
    except (ValueError, ModelLoadError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for i, (question, answer) in enumerate(result.history):
        print(f"turn {i + 1}: {question} -> {answer}")
    print(f"answer: {result.answer}")
    print(f"method: {result.method}   visual tokens: {result.num_visual}   layers: {result.num_layers}")
    print(
        f"retained visual tokens (layer average): {result.retained_tokens:.2f} = {result.retain:.4f} "
        f"(target {result.target_retain})   prefill FLOPs ratio: {result.flops_ratio:.4f}"
    )
    if result.official_tokens is not None:
        print(f"{result.method}'s own accounting (tokens after each layer's drop): {result.official_tokens:.2f}; "
              f"processed per layer: {result.visual_per_layer}")
    if result.curve is not None:
        c = result.curve
        print(f"autoprune curve: budget {c['budget']}, S {c['first_keep']}, MI_0 {c['mi0']:.4f}, MI_1 {c['mi1']:.4f}, "
              f"slope {c['slope']:.3f}, scale {c['scale']:.3f}")
    for g in result.groups:
        recycled = f" + {len(g.recycled)} recycled" if g.recycled else ""
        print(f"  group {g.index}: layers [{g.layers[0]}, {g.layers[1]}) keep {len(g.kept)}{recycled} "
              f"(scored by {g.scored_by})")
    for note in result.notes:
        print(f"note: {note}")
    if result.plant is not None:
        print(plant_line(result.plant))
    print("timings: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in result.timings.items()))
    report = result.to_json()
    if images:  # the family's processor options, as they ran
        print("processor options: " + ", ".join(f"{k} {v}" for k, v in images.items()))
        report["processor_options"] = images
    if found is not None:
        report["causal"] = causal.to_json(found, result.paq, [g.kept for g in result.groups])
        print(f"causal ({found.mode}, {found.seconds:.2f} s): answer token {found.answer_text!r}, "
              f"Spearman(PAQ, head importance) {report['causal']['paq_spearman']}")
        report["head_utility"] = entry = utility.to_json(useful)
        kept = entry["answer_kept"]
        print(f"head utility ({useful.seconds:.2f} s, keep {useful.keep}, layers {useful.scored}): cuts keeping the "
              f"answer, best head {kept['best_head']} / uniform {kept[UNIFORM]} / PAQ weighting "
              f"{kept['paq_weighted']} of {kept['cuts']}; Spearman(PAQ, utility) {entry['spearman']}")
    if every is not None:
        report["keeps"] = every.to_json()
        for kept in every.methods.values():
            print(f"keeps {panel_title(kept).replace(chr(10), ', ')}, FLOPs ratio {kept.flops_ratio:.4f}")
        for method, why in every.refused.items():
            print(f"keeps {method}: refused: {why}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.figures:
        paths = export_png(result, args.figures, image=args.image)
        if every is not None:
            paths.append(keeps_png(ViewData.from_result(result, args.image), every, args.figures))
        print(f"wrote {len(paths)} figures to {args.figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
