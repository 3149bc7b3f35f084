"""Planning a run (docs/method.md §4, §8): the FLOPs arithmetic, layer groups and budget solve, which know no method
(`flops`), and a method's schedule planned with its pruner (`budget`)."""
