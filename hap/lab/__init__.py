"""The head lab (docs/method.md §14): planted sink and dispersed heads, shown as planted. An experiment on top of the
method, not part of it: it registers into the execution path's extension points (`hap.patch.hooks`) while a plan is planted,
and no module outside this package imports it.

- `hap.lab.plan`: the plan and its arithmetic on plain tensors (which heads, which sink tokens, the massive activation,
  what the head classifier found of it);
- `hap.lab.planted`: applying a plan to a model for a block (`hap.plant`), forward hooks and the capture hook.
"""

from .plan import Plan
from .planted import plant

__all__ = ["Plan", "plant"]
