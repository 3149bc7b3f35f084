"""lmms-eval plugin: model `llava_hf_hap`, lmms-eval's `llava_hf` wrapper with HAP's pruning patched in.

Run from a repo checkout (lmms-eval installed, e.g. by `bash .ci/install-eval`; `hap` need not be installed):

    python -m hap.lmms_eval --model llava_hf_hap \\
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,method=hap,retain=0.056,first_layers=1 \\
        --tasks pope,gqa,mme --batch_size 1 --output_path logs/

    # data parallel, one patched replica per process:
    accelerate launch --num_processes=8 -m hap.lmms_eval --model llava_hf_hap \\
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,method=hap,retain=0.056,first_layers=1 \\
        --tasks pope,gqa,mme --batch_size 1 --output_path logs/

`python -m hap.lmms_eval ARGS` is exactly `python -m lmms_eval ARGS` with `llava_hf_hap` registered in
lmms-eval's model registry first. lmms-eval 0.7.3 finds external models only through (a) the entry-point
group `lmms_eval.models` of an *installed* distribution (`importlib.metadata`), or (b) the deprecated
`LMMS_EVAL_PLUGINS=<pkg>` variable, which needs the packages `<pkg>.models` (with `AVAILABLE_MODELS`
and one submodule per model) and `<pkg>.tasks`. Neither works from a bare checkout, hence this runner.
Once a distribution declares the entry point, plain `python -m lmms_eval --model llava_hf_hap ...` works
too; in a pyproject.toml:

    [project.entry-points."lmms_eval.models"]
    llava_hf_hap = "hap.lmms_eval:manifest"

`--model_args` takes every `LlavaHf` argument (pretrained, device, dtype, device_map, attn_implementation,
...) plus every `HAPConfig` knob of `hap.knobs.KNOBS` and seed (method, retain, flops_ratio, first_layers, groups,
decay, temperature, ..., rows, score_layers, merge, ...). The default merge=proportional needs SDPA or eager
attention: with attn_implementation=flash_attention_2 pass merge=none (refused by name otherwise). Invalid knobs raise HAPConfig's ValueError before the model loads;
an unreachable budget (e.g. retain=0.056 with first_layers=2 on a 32-layer decoder: the floor is 0.0625)
raises right after it loads. `method=none` runs the stock model. One process loads on `device` (default
cuda) unless `device_map` is given (`device_map=auto`: one process, the model split over the visible GPUs);
under `accelerate launch` each process patches its own replica (`LlavaHf.model` unwraps accelerate's wrapper).
In Python: `import hap.lmms_eval` registers the model, then `lmms_eval.evaluator.simple_evaluate(
model="llava_hf_hap", model_args="pretrained=...,retain=0.056,first_layers=1", tasks=["pope"])`.

As in `llava_hf`, `--model llava_hf_hap` resolves to the chat implementation (`LlavaHfHapChat`, tasks'
`doc_to_messages`); add `--force_simple` for the simple one (`LlavaHfHap`, `doc_to_text`/`doc_to_visual`).
Stock `llava_hf` logs a failed `generate` and scores an empty answer; here a failure (a pruning error,
out of memory) fails the run instead of silently scoring "", so a pruning bug cannot pass for low accuracy.
`method=sparsevlm` and `method=autoprune` run their official rules (docs/method.md §7) with the budget read as every
method's, the visual tokens processed per layer (their papers' "64 tokens" of LLaVA-1.5 is their own post-drop
accounting: retain=0.1428 for SparseVLM's, 0.1423 for AutoPrune's); autoprune needs --batch_size 1.
`method=cdpruner` loads its CLIP from `clip_model` and reads each request's prompt text as the question (lmms-eval
hands no raw question, so the task's pre- and post-prompts are included; the official evaluation reads the bare
question): requests run one at a time, with `--force_simple`.
`timings=PATH` (not a knob) appends one JSON line per request to PATH (`.rank<R>` added under data parallel): its
prefill time, peak GPU memory and the FLOPs ratio its schedule achieved (`PrefillMeter`; `analysis.paper_table`
reads them). `--include_path` takes several folders joined by ':' (`main`).
Loglikelihood tasks are refused while pruning (the pruned forward returns fewer logits than its labels).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

from accelerate import PartialState

with warnings.catch_warnings():  # lmms-eval's llava_hf modules run a process-wide warnings.filterwarnings("ignore")
    from lmms_eval.api.registry import register_model
    from lmms_eval.models.chat.llava_hf import LlavaHf as _LlavaHfChat
    from lmms_eval.models.simple.llava_hf import LlavaHf as _LlavaHfSimple

from .config import HAPConfig
from .knobs import KNOBS, SEED, knob
from .methods import load_plugins, pruner_class
from .patch import apply as _apply_patch
from .pruners import pruner_for
from .runs.run import template_tail
from .patch.decoder import decoder_shape, has_pixels, image_tokens
from .planning.budget import plan

load_plugins()  # the pruners named in HAP_PRUNERS join the method list before lmms-eval reads any model_args
MODEL_NAME = "llava_hf_hap"
HAP_KNOBS = tuple(k.name for k in (*KNOBS, SEED))  # the `--model_args` HAPConfig takes: every field


def config_from_args(args: dict) -> HAPConfig:
    """HAPConfig from the HAP knobs of `--model_args` (lmms-eval already turned numerals into int/float;
    other text is parsed by the knob). Raises the knob's ValueError on a bad value."""
    unknown = set(args) - set(HAP_KNOBS)
    if unknown:
        raise ValueError(f"unknown HAP knob(s) {sorted(unknown)}; known: {', '.join(HAP_KNOBS)}")
    return HAPConfig(**{name: knob(name).parse(v) if isinstance(v, str) else v for name, v in args.items()})


def check_budget(model, config: HAPConfig) -> None:
    """Raise now (not per sample, inside lmms-eval's `generate` try/except) when the budget is unreachable
    on this decoder (`hap.planning.budget.plan`; a retain target depends only on depth and groups). A flops_ratio
    target is checked with no text tokens (its least demanding case)."""
    plan(config, decoder_shape(model), image_tokens(model))


class GenerationFailed(RuntimeError):
    """A `generate` call failed inside lmms-eval's wrapper (which would have scored an empty answer)."""


class _HAPMixin:
    """Pops the HAP knobs, builds the stock wrapper, then patches the unwrapped HF model in place."""

    def __init__(self, **kwargs) -> None:
        knobs = {name: kwargs.pop(name) for name in HAP_KNOBS if name in kwargs}
        timings = kwargs.pop("timings", None)
        self.hap_config = config_from_args(knobs)  # before the slow model load
        pruner = pruner_class(self.hap_config.method)
        if pruner.max_batch is not None and int(kwargs.get("batch_size") or 1) > pruner.max_batch:
            raise ValueError(f"method={self.hap_config.method} prunes {pruner.batch_limit()} at a time "
                             f"({pruner.batch_rule}); run --batch_size {pruner.max_batch}, not {kwargs['batch_size']}")
        device = str(kwargs.get("device", "cuda"))
        if kwargs.get("device_map", "") == "" and (PartialState().num_processes == 1 or not device.startswith("cuda")):
            # LlavaHf passes its default device_map="" to from_pretrained, which transformers 5 rejects;
            # one process means one device: load there (data parallel on GPUs keeps "", LlavaHf's DDP switch; on
            # CPU processes, `torchrun`'s gloo group, each loads its replica on the CPU and the evaluator gives it
            # its rank and share of the requests from RANK / WORLD_SIZE).
            kwargs["device_map"] = device
        super().__init__(**kwargs)
        model = self.model  # LlavaHf.model unwraps accelerate's DDP/FSDP wrapper: this process's replica
        check_budget(model, self.hap_config)
        question_rows = pruner_for(self.hap_config).rows == "question"  # the chat template's tail left out
        self.hap_patch = _apply_patch(model, self.hap_config,
                                      tail=template_tail(self._image_processor) if question_rows else None)
        self._hap_errors: list[BaseException] = []
        meter = None if timings is None else PrefillMeter(model, _rank_file(str(timings), PartialState()))
        _guard_generate(model, self._hap_errors, meter)

    def generate_until(self, requests):
        self._hap_errors.clear()
        if self.hap_patch.clip is None:
            out = super().generate_until(requests)
        else:  # cdpruner reads each request's question: one request at a time, each asked first
            out = []
            for request in requests:
                self.hap_patch.ask(_question(request))
                out += super().generate_until([request])
        if self._hap_errors:
            first = self._hap_errors[0]
            raise GenerationFailed(
                f"{MODEL_NAME}: generate failed ({type(first).__name__}: {first}); lmms-eval would have "
                f"scored an empty answer for the remaining requests"
            ) from first
        return out

    def loglikelihood(self, requests):
        if self.hap_config.method != "none":
            raise NotImplementedError(
                f"{MODEL_NAME}: loglikelihood tasks are not supported with pruning (the pruned forward returns "
                f"fewer logits than the labels lmms-eval builds); use generate_until tasks or method=none"
            )
        return super().loglikelihood(requests)


def _question(request) -> str:
    """The question `cdpruner` reads from an lmms-eval request: its prompt text (`doc_to_text`, the task's pre- and
    post-prompts included: lmms-eval hands no raw question); ValueError where the request holds no text prompt."""
    context = request.args[0]
    if not isinstance(context, str):
        raise ValueError(f"{MODEL_NAME}: method=cdpruner reads the request's prompt text; this task gives "
                         f"{type(context).__name__}: run with --force_simple")
    return context


def _guard_generate(model, errors: list, meter: PrefillMeter | None = None) -> None:
    """Record the first exception of `model.generate` (instance attribute, class untouched) and make every
    later call fail fast, so a broken run stops after one request's work instead of one per request; with a
    `meter`, write the prefill of each call that succeeded."""
    generate = model.generate

    def guarded(*args, **kwargs):
        if errors:
            raise GenerationFailed("an earlier generate failed") from errors[0]
        try:
            out = generate(*args, **kwargs)
        except Exception as err:
            errors.append(err)
            raise
        if meter is not None:
            meter.write(int(kwargs["input_ids"].shape[1]) if "input_ids" in kwargs else None)
        return out

    model.generate = guarded


def _rank_file(path: str, state: PartialState) -> Path:
    """`path` itself in one process; `path` with `.rank<R>` before its suffix in process R of several (accelerate's
    processes, or torchrun's CPU processes, which accelerate's state may not count: RANK / WORLD_SIZE)."""
    p = Path(path)
    world, rank = max(state.num_processes, int(os.environ.get("WORLD_SIZE", 1))), int(os.environ.get("RANK", 0))
    return p if world == 1 else p.with_name(f"{p.stem}.rank{state.process_index or rank}{p.suffix}")


class PrefillMeter:
    """Times each prefill of `model` (the forward that carries the image: vision tower, projector, decoder, the
    logits) and appends one JSON line per `generate` call to `path` (model_arg `timings=PATH`, one file per process):
    `prefill_s` (CUDA events on a GPU, read after the call; wall time on the CPU), `peak_bytes` (the GPU's peak
    allocated memory during the prefill; null on the CPU), `prompt_tokens`, and from HAP's patch the layer-averaged
    `retained_tokens`, the visual tokens `num_visual` and the prefill `flops_ratio` its schedule achieved (1.0 unpruned)."""

    def __init__(self, model, path: Path) -> None:
        self.model, self.path = model, Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.started: float | tuple | None = None
        self.seconds: float | None = None
        model.register_forward_pre_hook(self.start, with_kwargs=True)
        model.register_forward_hook(self.stop)

    def start(self, module, args, kwargs) -> None:
        if not has_pixels(kwargs):  # a decode step
            return
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.started = (begin, end)
        else:
            self.started = time.perf_counter()

    def stop(self, module, args, output) -> None:
        if self.started is None:
            return
        if self.cuda:
            self.started[1].record()
        else:
            self.seconds = time.perf_counter() - self.started

    def write(self, prompt_tokens: int | None) -> None:
        """The record of the prefill just run (nothing when the call ran none)."""
        if self.started is None:
            return
        peak = None
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.seconds = self.started[0].elapsed_time(self.started[1]) / 1000
            peak = torch.cuda.max_memory_allocated()
        state = self.model._hap.state
        record = {"prefill_s": self.seconds, "peak_bytes": peak, "prompt_tokens": prompt_tokens,
                  "retained_tokens": None, "num_visual": None, "flops_ratio": 1.0}
        if state is not None and state.schedule is not None:
            schedule = state.schedule
            record.update(retained_tokens=schedule.retained_tokens, num_visual=schedule.num_visual,
                          flops_ratio=schedule.flops_ratio(state.prompt_len - schedule.num_visual,
                                                           decoder_shape(self.model)))
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.started = self.seconds = None


@register_model(MODEL_NAME)
class LlavaHfHap(_HAPMixin, _LlavaHfSimple):
    """lmms-eval's simple `llava_hf` (prompt from `doc_to_text` + `doc_to_visual`), pruned by HAP."""


@register_model(MODEL_NAME + "_chat")
class LlavaHfHapChat(_HAPMixin, _LlavaHfChat):
    """lmms-eval's chat `llava_hf` (messages from `doc_to_messages`), pruned by HAP."""


def manifest():
    """The `lmms_eval.models` entry-point payload (also what `register()` adds)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(
        model_id=MODEL_NAME,
        simple_class_path=f"{__name__}.LlavaHfHap",
        chat_class_path=f"{__name__}.LlavaHfHapChat",
    )


def register() -> None:
    """Add `llava_hf_hap` to lmms-eval's model registry (idempotent)."""
    from lmms_eval import models

    models.MODEL_REGISTRY_V2.register_manifest(manifest(), overwrite=True)
    models.AVAILABLE_MODELS[MODEL_NAME] = "LlavaHfHapChat"


def main(argv: list[str] | None = None) -> None:
    """`python -m lmms_eval` with `llava_hf_hap` registered; `--include_path` also takes several folders joined by
    the path separator (`tasks_a:tasks_b`), which lmms-eval's own task manager accepts as a list."""
    register()
    from lmms_eval.__main__ import cli_evaluate, parse_eval_args

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = parse_eval_args()[1]
    if args.include_path and os.pathsep in args.include_path:
        args.include_path = [p for p in args.include_path.split(os.pathsep) if p]
    cli_evaluate(args)


_models = sys.modules.get("lmms_eval.models")
if getattr(_models, "MODEL_REGISTRY_V2", None) is not None:  # not while lmms-eval loads this as an entry point
    register()  # `import hap.lmms_eval` is enough for `simple_evaluate(model="llava_hf_hap", ...)`

if __name__ == "__main__":
    # Register the importable module `hap.lmms_eval` (not this `__main__` copy), so that the class paths in
    # the manifest name the same classes lmms-eval imports.
    from hap.lmms_eval import main as _main

    _main()
