"""HAP: Head-Adaptive visual token Pruning for vision-language models.

    model, processor = hap.load_model("llava-hf/llava-1.5-7b-hf")
    result = hap.run(model, processor, image, "What is in the image?", hap.HAPConfig(retain=0.056, first_layers=1))

(`hap.HAPConfig()` alone uses per-model defaults, see `hap.knobs`), or patch once and use the stock API:
`with hap.patched(model, cfg): model.generate(**inputs)` (a method that reads the raw question, `method="cdpruner"`,
takes it as `hap.patched(model, cfg, question=q)`). The methods: `hap.METHODS`, one module each in `hap.pruners`; one
of your own joins with `@hap.pruners.register` (README, "A pruner of your own").
Images of different sizes (their own visual-token counts, their own budgets) go together through
`hap.run_batch(model, processor, images, prompts, cfg)`; several configs on one input through `hap.run_together`.
Each takes `options=hap.ProcessorOptions(max_tiles=6, ...)`: the processor settings that change the visual-token
count (`hap.options`), unset = the checkpoint's own.

The pipeline, stage by stage (imports flow down this list and never back: `tests/test_architecture.py`):

    settings     methods (the method registry, a leaf), knobs, config (HAPConfig), options (processor settings)
    planning/    flops (FLOPs arithmetic, groups, solve_schedule), budget (a method's schedule, asking its pruner)
    scoring/     capture (prompt-row attention recomputed from q, k), heads (sink / dispersed / optimal, PAQ),
                 fusion (PAQ-weighted fusion, token scores, top-k), importance (the static head importance file);
                 diversity (HAP+'s relevance x diversity)
    pruners/     base (the Pruner interface and the State it reads), one module per method, and what cuts share:
                 merge, recycle, cues (the vision tower's cues)
    patch/       execution inside the decoder: decoder (the hooks), state (the executor's state of one prefill),
                 hooks (extension points), batch and prefix (shared decoding and layers), one adapter per family,
                 processors; hub + load (loading, safetensors only) beside it
    runs/        inputs (checked uploads), run (hap.run and friends), trace (Result), features (one vision pass per
                 image), compare, keeps (what each method keeps), sweep (every method over the budgets)
    views/       a run's figures, the sweep's and the causal ones, report (a comparison's texts), ground_truth (a
                 synthetic scene's truth against a run); layout (where each token lies on the image) beside it
    beside       causal (which heads and tokens the answer depends on; a model's static head importance), utility,
                 lab/ (planted heads: a plug-in through patch.hooks, imported by nothing of the method), lmms_eval
                 (the plugin), __main__ (the CLI)
"""

from .causal import head_importance, static_head_importance, token_importance
from .config import HAPConfig
from .hub import ModelLoadError
from .knobs import KNOBS, METHODS, Knob, knob
from .lab.planted import plant
from .load import load_model
from .options import ProcessorOptions
from .patch import apply as patch
from .patch import patched
from .patch import remove as unpatch
from .planning.budget import plan
from .planning.flops import DecoderShape, Schedule, solve_schedule
from .runs.inputs import DEFAULT_LIMITS, InputLimits
from .runs.run import run, run_batch, run_together
from .runs.trace import Group, Maps, Result
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
    "static_head_importance",
    "token_importance",
    "unpatch",
]
