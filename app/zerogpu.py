"""ZeroGPU: `spaces.GPU` around the app's model calls, each asking for a duration that fits its work.

On a Space with ZeroGPU hardware the environment provides the `spaces` package; `gpu(work, loaded)` then wraps a
function in `spaces.GPU(duration=...)` with a callable duration, which ZeroGPU calls with the function's own arguments
before it lends a GPU for at most that many seconds (a shorter request queues first; a call still running at the end
is stopped). Without `spaces` (a CPU Space, a workstation, the tests) the function runs as it is.

The duration is an upper estimate of the call's GPU time on the loaded model, from its size and the call's work:
START_S (the worker and the weights moved onto the GPU) plus SAFETY x the work's time, at least MIN_S. The work
(`Work`) counts full forward passes over the prompt (a backward counts two; a traced run one more for the captured
rows) and decode steps. A pass over T tokens costs 2 x layers x `hap.planning.flops.layer_flops(T)` FLOPs at FLOPS per
second; a decode step streams the weights once at BANDWIDTH bytes per second, plus STEP_S and LAYER_STEP_S per layer
of Python and kernel launches (generate, the pruner's hooks). T comes from the processor on the call's own input.
So a 7B sweep (43 generations of up to 32 tokens, 86 passes) asks for about 200 s, the tiny model's about 50 s.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from hap import causal, utility
from hap.planning.flops import layer_flops
from hap.runs.keeps import pruning
from hap.patch.decoder import decoder_shape
from hap.runs.run import build_inputs
from hap.runs.sweep import POINTS

F = TypeVar("F", bound=Callable)
FLOPS = 1e14  # bf16 FLOP/s sustained on a ZeroGPU slice (H200 / RTX Pro 6000 class: well below their peak)
BANDWIDTH = 1e12  # bytes/s of weights streamed per decode step
STEP_S = 5e-3  # Python per decode step (generate's loop)
LAYER_STEP_S = 1e-3  # per decoder layer and decode step (kernel launches, the pruner's hooks)
START_S = 10.0  # the GPU worker starting and the weights moved onto the GPU
SAFETY = 2.0
MIN_S = 15
FORCED_TOKENS = 8  # tokens of a sweep's teacher-forced answer (cut to three words)


@dataclass(frozen=True)
class Work:
    """What one GPU call does: full forward passes over the prompt and decode steps (one token each)."""

    passes: float
    steps: int


@dataclass(frozen=True)
class Call:
    """One GPU call as its duration sees it: the loaded model, the call's arguments by name, its prompt's tokens."""

    model: object
    arguments: dict
    visual: int
    text: int


def answers(runs: int, traced: int, new_tokens: int, together: bool = False) -> Work:
    """`runs` generations of up to `new_tokens` tokens, `traced` of them traced (every layer's rows captured);
    `together`: their answers decoded as one batch (`hap.runs.run.run_together`), each step streaming the weights once."""
    return Work(runs + traced, (1 if together else runs) * new_tokens)


def sweep_work(new_tokens: int, shared: bool = False, together: bool = False) -> Work:
    """`/sweep` (`hap.runs.sweep`): the unpruned answer and every method at POINTS budgets, each generated then its
    unpruned answer's probability teacher-forced (an upper estimate where the sweep is `shared`: every generation
    then stops at its answer's end, FORCED_TOKENS tokens at most here, and a forced pass runs only where needed;
    `together`: a method's budgets are decoded, and forced on their own prefills, as one batch)."""
    methods = len(pruning())
    runs = 1 + methods * POINTS
    if together:
        return Work(runs + 1, (1 + methods) * 2 * FORCED_TOKENS)
    return Work(2 * runs, runs * ((FORCED_TOKENS if shared else new_tokens) + FORCED_TOKENS))


def causal_work(call: Call) -> Work:
    """The "Is PAQ right?" section: the gradient pass (a forward and a backward), exact ablation's forward per head
    where the setting resolves to it, and head utility (`hap.utility.cost`) on its layers; nothing when off."""
    model, arguments = call.model, call.arguments
    mode = causal.resolve_setting(model, arguments.get("setting") or "auto")
    if mode is None:
        return Work(0, 0)
    L, H = causal.head_layout(model)
    heads = 1 + L * H if mode == "ablation" else 0
    layers = utility.auto_layers(model, arguments.get("cuts", ()))
    return Work(3 + heads + utility.cost(decoder_shape(model), call.visual, call.text, H, layers=layers), 0)


def seconds(model, visual: int, text: int, work: Work) -> int:
    """The duration to ask for: START_S + SAFETY x (passes x a pass over visual + text tokens + steps x a decode
    step) on `model`, whole seconds, at least MIN_S."""
    shape = decoder_shape(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    one_pass = 2 * shape.layers * layer_flops(visual + text, shape) / FLOPS
    step = STEP_S + LAYER_STEP_S * shape.layers + weights / BANDWIDTH
    return max(MIN_S, math.ceil(START_S + SAFETY * (work.passes * one_pass + work.steps * step)))


def prompt_tokens(model, processor, arguments: dict) -> tuple[int, int]:
    """(visual, text) tokens of a call's prompt: its `image`, `prompt`, `history` and `limits` through the processor."""
    inputs, _, _ = build_inputs(processor, arguments["image"], arguments["prompt"], arguments["limits"],
                                arguments.get("history") or ())
    ids = inputs["input_ids"][0]
    visual = int((ids == model.config.image_token_id).sum())
    return visual, len(ids) - visual


def duration(fn: Callable, work: Callable[[Call], Work], loaded: Callable[[], tuple]) -> Callable[..., int]:
    """The duration callable of `fn` (called with `fn`'s arguments): `seconds` of `work` on the model `loaded()`
    returns with its processor."""
    signature = inspect.signature(fn)

    def ask(*args, **kwargs) -> int:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        model, processor = loaded()
        visual, text = prompt_tokens(model, processor, bound.arguments)
        return seconds(model, visual, text, work(Call(model, bound.arguments, visual, text)))

    return ask


def gpu(work: Callable[[Call], Work], loaded: Callable[[], tuple]) -> Callable[[F], F]:
    """Decorator: on ZeroGPU (`spaces` importable when the function is decorated) `spaces.GPU` with the duration of
    `work` on the loaded model (`duration`); elsewhere the function itself."""
    try:
        import spaces
    except ImportError:
        return lambda fn: fn
    return lambda fn: spaces.GPU(duration=duration(fn, work, loaded))(fn)
