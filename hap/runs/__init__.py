"""Runs and their results: checked inputs (`inputs`), one image and prompt through the patched model (`run`: `hap.run`,
`hap.run_batch`, `hap.run_together`), what a prefill did (`trace`: `Result`), one vision pass per image (`features`), and
the multi-run tools the app and the CLI share: the three-run comparison (`compare`), what each method keeps (`keeps`)
and the budget sweep (`sweep`)."""
