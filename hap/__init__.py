"""HAP: Head-Adaptive visual token Pruning for vision-language models.

    model, processor = hap.load_model("llava-hf/llava-1.5-7b-hf")
    result = hap.run(model, processor, image, "What is in the image?", hap.HAPConfig(retain=0.056, first_layers=1))

(`hap.HAPConfig()` alone uses per-model defaults, see `hap.knobs`), or patch once and use the stock API: `with hap.patched(model, cfg): model.generate(**inputs)`
(`method="cdpruner"` also reads the raw question: `hap.patched(model, cfg, question=q)`). The methods: `hap.METHODS`,
one module each in `hap.pruners`.
Images of different sizes (their own visual-token counts, their own budgets) go together through
`hap.run_batch(model, processor, images, prompts, cfg)`; several configs on one input through `hap.run_together`.
Each takes `options=hap.ProcessorOptions(max_tiles=6, ...)`: the processor settings that change the visual-token
count (`hap.options`), unset = the checkpoint's own.
"""

from .flops import DecoderShape, Schedule, solve_schedule
from .budget import plan
from .causal import head_importance, token_importance
from .config import HAPConfig
from .inputs import DEFAULT_LIMITS, InputLimits
from .knobs import KNOBS, METHODS, Knob, knob
from .hub import ModelLoadError
from .load import load_model
from .options import ProcessorOptions
from .patch import apply as patch
from .patch import patched
from .patch import remove as unpatch
from .lab.planted import plant
from .run import run, run_batch, run_together
from .trace import Group, Maps, Result
from .utility import HeadUtility, head_utility

__all__ = [
    "DEFAULT_LIMITS",
    "METHODS",
    "DecoderShape",
    "Group",
    "HAPConfig",
    "HeadUtility",
    "InputLimits",
    "KNOBS",
    "Knob",
    "Maps",
    "ModelLoadError",
    "ProcessorOptions",
    "Result",
    "Schedule",
    "head_importance",
    "head_utility",
    "knob",
    "load_model",
    "patch",
    "patched",
    "plant",
    "plan",
    "run",
    "run_batch",
    "run_together",
    "solve_schedule",
    "token_importance",
    "unpatch",
]
