"""Processor options: the image settings of a model's processor that change how many visual tokens an image gives.

`ProcessorOptions` holds one request's choices; None leaves an option at the checkpoint's own value (its processor's
configuration), so `ProcessorOptions()` is the processor exactly as loaded. Each option is a `Knob` of `OPTIONS` (its
type, range, meaning, CLI flag `--max-tiles`, `/analyze` parameter `max_tiles`); which families take it and what it
becomes in the processor call is `hap.patch.processors.option_kwargs`, the one place that maps options to processor
kwargs. A model whose processor has no such setting refuses the option by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .knobs import Knob

SWITCH = ("on", "off")  # the values of an on / off option as text (CLI, page); True / False in Python


def switch(name: str, help: str) -> Knob:
    """An on / off option (None: the checkpoint's own)."""
    return Knob(name, str, None, help, choices=SWITCH, optional=True)


def number(name: str, help: str, high: float, kind: type = int, low: float = 1) -> Knob:
    """A numeric option in [low, high] (None: the checkpoint's own)."""
    return Knob(name, kind, None, help, low=low, high=high, optional=True)


OPTIONS: tuple[Knob, ...] = (
    switch("pan_and_scan", "Gemma 3: also cut an image far from square into crops along its longer side, each crop "
           "its own block of image tokens (do_pan_and_scan; off in transformers' Gemma3Processor)"),
    number("pan_and_scan_max_crops", "Gemma 3 pan-and-scan: the most crops of an image (pan_and_scan_max_num_crops; "
           "Gemma3Processor's default 4)", 32),
    number("pan_and_scan_min_crop", "Gemma 3 pan-and-scan: the shortest side of a crop in pixels "
           "(pan_and_scan_min_crop_size; Gemma3Processor's default 256)", 4096),
    number("pan_and_scan_min_ratio", "Gemma 3 pan-and-scan: the aspect ratio from which an image is cut "
           "(pan_and_scan_min_ratio_to_activate; Gemma3Processor's default 1.2)", 100.0, float),
    number("max_tiles", "the most tiles an image is cut into: InternVL's max_patches; LLaVA-NeXT / OneVision: only "
           "the checkpoint's grid pinpoints of at most this many tiles", 64),
    number("anyres_max", "LLaVA-OneVision: a tile grid of more than about this many tiles' worth of tokens is shrunk "
           "to it (vision_aspect_ratio anyres_max_N)", 64),
    switch("image_splitting", "SmolVLM / Idefics3: cut the image into crops plus a global view (on) or give the "
           "global view alone (off) (do_image_splitting)"),
    number("longest_edge", "SmolVLM / Idefics3: the image is resized to this longest edge in pixels before it is "
           "cut into crops (size.longest_edge)", 8192),
    number("min_pixels", "Qwen2-VL / 2.5-VL / 3-VL: an image under this many pixels is enlarged to it "
           "(size.shortest_edge)", 100_000_000),
    number("max_pixels", "Qwen2-VL / 2.5-VL / 3-VL: an image over this many pixels is shrunk to it "
           "(size.longest_edge)", 100_000_000),
)
_BY_NAME = {k.name: k for k in OPTIONS}


def check_option(name: str, value: object) -> object:
    """`value` of option `name` as the dataclass holds it (an on / off option as a bool, also from "on" / "off";
    numbers as `Knob.check` coerces them; None, and "" or "default" from a form, as None), else ValueError naming
    the option and what it allows."""
    k = _BY_NAME[name]
    if isinstance(value, str) and value.strip().lower() in ("", "default", "none", "null"):
        return None
    if k.choices != SWITCH:
        return k.check(value)
    if value is None or isinstance(value, bool):
        return value
    return k.check(value.strip().lower() if isinstance(value, str) else value) == "on"


@dataclass(frozen=True)
class ProcessorOptions:
    """One request's processor options (`OPTIONS`); None: the checkpoint's own value."""

    pan_and_scan: bool | None = None
    pan_and_scan_max_crops: int | None = None
    pan_and_scan_min_crop: int | None = None
    pan_and_scan_min_ratio: float | None = None
    max_tiles: int | None = None
    anyres_max: int | None = None
    image_splitting: bool | None = None
    longest_edge: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_option(f.name, getattr(self, f.name)))

    @classmethod
    def of(cls, values: dict | None) -> ProcessorOptions:
        """The options of a mapping by name (a request's fields); None or {}: none set. ValueError names an
        unknown option or a bad value."""
        values = values or {}
        unknown = set(values) - set(_BY_NAME)
        if unknown:
            raise ValueError(f"unknown processor options {', '.join(sorted(unknown))}; known: {', '.join(_BY_NAME)}")
        return cls(**values)

    def given(self) -> dict[str, object]:
        """The options set (not None), by name."""
        return {name: value for name, value in asdict(self).items() if value is not None}


NO_OPTIONS = ProcessorOptions()
