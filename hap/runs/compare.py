"""The three runs the demo and the CLI compare on one input: the stock model, the chosen method
(traced, for the views) and uniform head averaging at the same budget (docs/method.md §7)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..config import HAPConfig
from ..methods import NONE, UNIFORM
from .inputs import DEFAULT_LIMITS, InputLimits
from .run import run, run_together
from .trace import Result


@dataclass
class Comparison:
    """The three runs of one input: stock model, chosen method, uniform averaging at the same budget."""

    unpruned: Result
    pruned: Result
    uniform: Result
    untraced: Result | None = None  # the chosen method untraced, timed as it runs alone (`together`); None: not run

    @property
    def timed(self) -> Result:
        """The chosen method's run whose latency is reported: the untraced one where it ran, else the traced one."""
        return self.pruned if self.untraced is None else self.untraced

    def items(self) -> list[tuple[str, Result]]:
        return [("unpruned", self.unpruned), ("pruned", self.pruned), (UNIFORM, self.uniform)]


def compare(
    model,
    processor,
    image,
    prompt: str,
    config: HAPConfig,
    max_new_tokens: int = 32,
    on_stage: Callable[[float, str], None] | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
    history: Sequence[tuple[str, str]] = (),
    together: bool = False,
) -> Comparison:
    """Run the stock model, `config` (traced) and uniform averaging with `config`'s budget, each on the
    conversation `history` then `prompt` (`hap.runs.run.run`); `together`: prepared once, each prefilled alone and the
    answers decoded as one batch where the model allows (`hap.runs.run.run_together`: the same answers), `config` run
    untraced (`untraced`, its latency as it runs alone) and replayed traced right after its prefill for the views
    (`hap.runs.run.traced_replay`: the same numbers, most of the prefill read from the untraced one).

    `on_stage(fraction, description)` is called before each run (a progress bar). A run the
    chosen method already is (method "none" or "uniform") is not repeated.
    """
    stage = on_stage or (lambda fraction, description: None)
    if together:
        runs = {"untraced": (config, False)}
        for method in (NONE, UNIFORM):
            if config.method != method:
                runs[method] = (replace(config, method=method), False)
        stage(0.15, f"{config.method} (then replayed traced), unpruned and uniform: one prefill each, the answers as "
                    "one batch")
        done = dict(zip([*runs, "pruned"], run_together(model, processor, image, prompt, list(runs.values()),
                                                        max_new_tokens, limits, history, replay=0)))
        untraced = done["untraced"]
        return Comparison(done.get(NONE, untraced), done["pruned"], done.get(UNIFORM, untraced), untraced)

    def one(cfg: HAPConfig, trace: bool) -> Result:
        return run(model, processor, image, prompt, cfg, max_new_tokens=max_new_tokens, trace=trace, limits=limits,
                   history=history)

    stage(0.15, f"{config.method}: prefill + attention capture, head scoring, pruned generation")
    pruned = one(config, trace=True)
    stage(0.45, "unpruned reference generation")
    unpruned = pruned if config.method == NONE else one(replace(config, method=NONE), trace=False)
    stage(0.65, "uniform head averaging at the same budget")
    uniform = pruned if config.method == UNIFORM else one(replace(config, method=UNIFORM), trace=False)
    return Comparison(unpruned, pruned, uniform)
