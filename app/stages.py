"""One `/analyze` through the real server, timed stage by stage, in the process that serves it.

    python app/stages.py --model FOLDER [--repeats 3] [--threads 2] [--json OUT]

Run by `analysis.app_speed --stages` (never alone needed), once for this checkout and once for another one given as
`--base` (its code first on PYTHONPATH, this file run by its path): it imports nothing of `analysis` and only names of
`app` and `hap` that every checkout since the app's handler split (`hap.run` before the core redesign, `hap.runs.run`
after) has, so one file times both sides of a change.

The checkout's demo (`app.layout.build_demo`) serves the model folder in this process; every stage's function is
wrapped before the demo is built (`TIMED`: each name tried in turn, a missing one skipped), then a warm-up `/analyze`
on another scene, then `--repeats` `/analyze` requests with causal off, each from a new client (`gradio_client`, the
real queue and payload), each with the stages' own times (exclusive: a stage nested in another is taken out of it).
One plain unpruned prefill (`model(**inputs)`, vision tower included) is timed in the same process before each request
and after the last: each request's unit is the mean of the two around it (the machine's speed drifts). Prints JSON:
per request its scene, its unit, the client's seconds, the handler's and each stage's (the rows:
`analysis.app_speed.STAGES`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import threading
import time
from pathlib import Path

SCENES = ("scene_600000.png", "scene_600002.png", "scene_600003.png", "scene_600004.png")  # one per request: none
#   finds its image's features kept from before (each its own vision pass)
WARMUP = "scene_600001.png"  # the warm-up's (the load)
PROMPT = "what color is the square ?"
TIMED = {  # stage -> the functions timed as it ("module:attribute[.attribute]"), the first found of each group
    "vision": [("transformers.models.llava.modeling_llava:LlavaModel.get_image_features",)],
    "tracing": [("hap.runs.trace:Tracer.layer", "hap.trace:Tracer.layer"),
                ("hap.runs.trace:Tracer.cut", "hap.trace:Tracer.cut"),
                ("hap.runs.trace:Tracer.regrid", "hap.trace:Tracer.regrid")],
    "decode": [("hap.patch.batch:decode",)],
    "figures": [("hap.views:figures",), ("hap.views:ViewData.from_result",)],
    "present": [("app.present:analysis_outputs",)],
    "handler": [("app.handler:Handler.analyze",)],
}
FINISH = ("hap.runs.run:finish", "hap.run:finish")  # a run's Result: its prefill and scoring seconds


class Clock:
    """Exclusive seconds per stage of the calls of the wrapped functions, in the thread that makes them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.runs: list[dict] = []  # per run of the request: its label and timings (`finish`)
        self.local = threading.local()

    def reset(self) -> None:
        self.seconds, self.runs = {}, []

    def wrap(self, stage: str, fn):
        """`fn` timed as `stage`, its nested timed calls taken out of its own time."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack = self.local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # the nested timed calls' seconds
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                nested = stack.pop()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + elapsed - nested
                if stack:
                    stack[-1] += elapsed
        return timed


def resolve_module(name: str):
    """The module `name`, or None where the checkout lacks it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def resolve(path: str) -> tuple[object, str, object] | None:
    """(owner, attribute, its raw value) of "module:attr[.attr]", None where the checkout lacks it."""
    module, _, attrs = path.partition(":")
    owner = resolve_module(module)
    *outer, name = attrs.split(".")
    for attr in outer:
        owner = getattr(owner, attr, None)
    if owner is None or name not in vars(owner):
        return None
    return owner, name, vars(owner)[name]


def install(clock: Clock) -> dict[str, list[str]]:
    """Wrap every function of `TIMED` (the first path found of each group) and the runs' `finish`; returns what was
    wrapped by stage."""
    found: dict[str, list[str]] = {}
    for stage, groups in TIMED.items():
        for group in groups:
            hit = next((r for r in map(resolve, group) if r is not None), None)
            if hit is None:
                continue
            owner, name, raw = hit
            if isinstance(raw, classmethod):
                setattr(owner, name, classmethod(clock.wrap(stage, raw.__func__)))
            else:
                setattr(owner, name, clock.wrap(stage, raw))
            found.setdefault(stage, []).append(f"{getattr(owner, '__name__', owner)}.{name}")
    owner, name, finish = next(r for r in map(resolve, FINISH) if r is not None)

    @functools.wraps(finish)
    def finished(model, processor, p, config, patch, answer, timings):
        result = finish(model, processor, p, config, patch, answer, timings)
        traced = patch.state is not None and patch.state.tracer is not None
        replay = traced and timings.get("decode_batch") == 0  # a traced replay of the run before it, not decoded
        clock.runs.append({"label": config.method + (" traced replay" if replay else " traced" if traced else ""),
                           **result.timings})
        return result

    setattr(owner, name, finished)
    return found


def plain_prefill(model, processor, root: Path, repeats: int = 1) -> float:
    """Median seconds of one plain unpruned prefill of the first scene and prompt (`model(**inputs)`, vision included),
    after one untimed."""
    import torch
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=Image.open(root / "assets" / "examples" / SCENES[0]).convert("RGB"), text=text,
                       return_tensors="pt")
    times = []
    with torch.inference_mode():
        model(**inputs)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(**inputs)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def request(port: int, folder: str, root: Path, scene: str) -> float:  # noqa: D103
    """Seconds of one `/analyze` (causal off) from a new client, as `gradio_client` waits for it."""
    from gradio_client import Client, handle_file

    client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False)  # the JSON; images: URLs
    t0 = time.perf_counter()
    client.predict(image=handle_file(str(root / "assets" / "examples" / scene)), prompt=PROMPT, model_name=folder,
                   causal="off", api_name="/analyze")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model folder (analysis.app_speed builds one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    os.environ.update(HAP_APP_MODELS=args.model, HAP_APP_ALLOW_LOCAL="1", GRADIO_ANALYTICS_ENABLED="False",
                      HF_HUB_OFFLINE="1")
    import torch

    torch.set_num_threads(args.threads)
    root = Path(importlib.import_module("app").__file__).resolve().parent.parent  # the checkout being timed
    clock = Clock()
    wrapped = install(clock)
    from app.layout import build_demo
    from app.settings import launch_options

    loaded = next(vars(m)["LOADED"] for m in map(resolve_module, ("app.models", "app.handler")) if m is not None)

    demo = build_demo()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **launch_options())
    port = demo.server_port
    try:
        warm = request(port, args.model, root, WARMUP)  # loads the model
        prefills, requests = [plain_prefill(loaded.model, loaded.processor, root)], []
        for i in range(args.repeats):
            clock.reset()
            scene = SCENES[i % len(SCENES)]
            total = request(port, args.model, root, scene)
            requests.append({"scene": scene, "client": total, "stages": dict(clock.seconds), "runs": list(clock.runs)})
            prefills.append(plain_prefill(loaded.model, loaded.processor, root))
    finally:
        demo.close()
    for i, one in enumerate(requests):
        one["prefill_s"] = (prefills[i] + prefills[i + 1]) / 2
    report = {"root": str(root), "wrapped": wrapped, "warm_up_s": warm, "prefills_s": prefills,
              "prefill_s": statistics.mean(prefills), "threads": args.threads, "requests": requests}
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
