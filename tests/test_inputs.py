"""Every kind of image and prompt a user can send: converted, or refused with a message that names
the problem and what is allowed. Driven through `hap.runs.inputs` and through `hap.run`."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

import hap
from hap.runs.inputs import InputLimits, clean_prompt, load_image
from tiny_models import noise_image, tiny_llava


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


RGB = noise_image(0, (40, 30))


@pytest.mark.parametrize(
    "make, mode_in",
    [
        (lambda: RGB.convert("L"), "L"),
        (lambda: RGB.convert("P"), "P"),
        (lambda: RGB.convert("RGBA"), "RGBA"),
        (lambda: RGB.convert("CMYK"), "CMYK"),
        (lambda: RGB.convert("1"), "1"),
        (lambda: Image.fromarray((np.arange(1200, dtype=np.uint16).reshape(30, 40) * 50)), "I;16"),
        (lambda: Image.open(io.BytesIO(encoded(RGB, "JPEG"))), "JPEG"),
        (lambda: Image.open(io.BytesIO(encoded(RGB, "WEBP"))), "WEBP"),
        (lambda: Image.open(io.BytesIO(encoded(RGB, "TIFF"))), "TIFF"),
        (lambda: Image.new("RGB", (1, 1), "red"), "1x1"),
    ],
)
def test_every_image_mode_becomes_rgb(make, mode_in):
    out = load_image(make())
    assert out.mode == "RGB" and out.size[0] >= 1


def pixels(img: Image.Image) -> list[tuple[int, int, int]]:
    """The RGB pixels of the first row of `load_image(img)`."""
    out = load_image(img)
    assert out.mode == "RGB"
    return [out.getpixel((x, 0)) for x in range(out.width)]


def test_16_bit_grey_keeps_its_high_byte():
    values = np.array([[0, 10 * 256 + 255, 128 * 256, 65535]], dtype=np.uint16)
    img = Image.fromarray(values)
    assert img.mode == "I;16"
    assert pixels(img) == [(0, 0, 0), (10, 10, 10), (128, 128, 128), (255, 255, 255)]


def test_cmyk_converts_by_its_inks():
    img = Image.new("CMYK", (5, 1))
    img.putdata([(0, 0, 0, 0), (255, 0, 0, 0), (0, 255, 255, 0), (0, 0, 0, 255), (0, 0, 0, 55)])
    assert pixels(img) == [(255, 255, 255), (0, 255, 255), (255, 0, 0), (0, 0, 0), (200, 200, 200)]


def test_palette_colours_and_a_transparent_index():
    img = Image.new("P", (3, 1))
    img.putpalette([255, 0, 0, 0, 128, 0, 0, 0, 255] + [0] * (3 * 253))
    img.putdata([0, 1, 2])
    assert pixels(img) == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    img.info["transparency"] = 1
    assert pixels(img) == [(255, 0, 0), (255, 255, 255), (0, 0, 255)]  # transparent on white


def test_transparent_pixels_become_white():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    assert load_image(img).getpixel((0, 0)) == (255, 255, 255)


def test_animated_gif_gives_its_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    assert load_image(path).getpixel((0, 0))[0] > 200


def test_exif_rotation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), "white")
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    path = tmp_path / "rot.jpg"
    img.save(path, exif=exif)
    assert load_image(path).size == (20, 40)


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    path = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(path, optimize=True)  # small file, 400 megapixels
    assert path.stat().st_size < 2**20
    with pytest.raises(ValueError, match=r"over \d+ megapixels \(refused from its header\); the limit is 40 megapixels"):
        load_image(path)
    path = tmp_path / "big.png"
    Image.new("1", (8000, 6000)).save(path, optimize=True)  # 48 megapixels: under PIL's guard, over ours
    with pytest.raises(ValueError, match=r"8000 x 6000 = 48.0 megapixels; the limit is 40 megapixels"):
        load_image(path)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", r"empty \(0 bytes\)"),
        (b"this is not an image at all", r"not a readable image.*PNG, JPEG"),
        (encoded(RGB, "PNG")[:60], r"truncated or corrupt|not a readable image"),
        (encoded(RGB, "JPEG")[:200], r"truncated or corrupt"),
        (b"%PDF-1.4 fake", r"not a readable image"),
    ],
    ids=["zero-bytes", "text", "truncated-png", "truncated-jpeg", "pdf"],
)
def test_unreadable_bytes_are_refused(data, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_image(data)
    path = tmp_path / "upload.png"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_image(path)


@pytest.mark.parametrize("fmt, keep", [("PNG", 60), ("JPEG", 200)])
def test_a_truncated_file_is_refused_when_a_library_lets_pil_pad_it(fmt, keep, monkeypatch):
    """lmms-eval's task module sets PIL's process-wide LOAD_TRUNCATED_IMAGES = True (PIL then pads a cut file with
    grey): the check refuses the file all the same and leaves the flag as it found it."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ValueError, match="truncated or corrupt|not a readable image"):
        load_image(encoded(RGB, fmt)[:keep])
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True


def test_byte_limit_is_checked_before_reading(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(b"\0" * 2048)
    with pytest.raises(ValueError, match=r"the limit is 0 MB"):
        load_image(path, InputLimits(max_bytes=1024))


@pytest.mark.parametrize(
    "value, match",
    [
        (np.zeros((8, 8, 3), dtype=np.float32), r"uint8"),
        (np.zeros((8, 8, 5), dtype=np.uint8), r"shape"),
        (12345, r"not int"),
        ("/no/such/file.png", r"not found"),
    ],
)
def test_wrong_image_types_are_named(value, match):
    with pytest.raises(ValueError, match=match):
        load_image(value)


SPECIALS = {"<image>", "<s>", "</s>"}


@pytest.mark.parametrize(
    "prompt, match",
    [("", "empty"), ("   \n\t ", "empty"), ("<image><image>", "empty"), ("\x00\x07", "empty"), (None, "must be text"),
     ("x" * 2001, r"2001 characters; the limit is 2000")],
    ids=["empty", "whitespace", "only-special-tokens", "only-control", "none", "too-long"],
)
def test_bad_prompts_are_refused(prompt, match):
    with pytest.raises(ValueError, match=match):
        clean_prompt(prompt, SPECIALS)


def test_prompts_are_cleaned_and_rtl_text_kept():
    text, notes = clean_prompt("what\x00 color <image> is \u200fthe circle ?</s>", SPECIALS)
    assert text == "what color   is the circle ?" and len(notes) == 3
    assert clean_prompt("ما لون الدائرة ؟ מה הצבע", SPECIALS)[0] == "ما لون الدائرة ؟ מה הצבע"


@pytest.fixture(scope="module")
def tiny():
    return tiny_llava(layers=6)


def test_typed_image_tokens_add_no_image_slot(tiny):
    model, processor = tiny
    cfg = hap.HAPConfig(method="none")
    plain = hap.run(model, processor, noise_image(1), "what color is the circle ?", cfg, max_new_tokens=2)
    injected = hap.run(model, processor, noise_image(1), "what color <image> is the <image> circle ?", cfg,
                       max_new_tokens=2)
    assert injected.num_visual == plain.num_visual == 144
    assert any("<image>" in n for n in injected.notes)


def test_a_prompt_beyond_the_context_is_refused(tiny):
    model, processor = tiny
    with pytest.raises(ValueError, match=r"prompt too long: \d+ tokens \+ max_new_tokens=2 exceed the model's 512"):
        hap.run(model, processor, noise_image(1), "what " * 400, hap.HAPConfig(), max_new_tokens=2)


@pytest.mark.parametrize("value", [0, -1, 10_000, 2.5, "8", True])
def test_bad_max_new_tokens(tiny, value):
    model, processor = tiny
    with pytest.raises(ValueError, match=r"max_new_tokens=.* must be an integer in \[1, 1024\]"):
        hap.run(model, processor, noise_image(1), "what color ?", hap.HAPConfig(), max_new_tokens=value)


def test_out_of_memory_is_reported_freed_and_the_next_run_succeeds(tiny, monkeypatch):
    model, processor = tiny
    cfg = hap.HAPConfig(retain=0.2, first_layers=0)
    original = type(model).generate

    def exhausted(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(type(model), "generate", exhausted)
    with pytest.raises(MemoryError, match=r"out of memory on cpu.*memory was freed"):
        hap.run(model, processor, noise_image(1), "what color is the circle ?", cfg, max_new_tokens=2)
    assert not hasattr(model, "_hap")  # the patch is gone
    monkeypatch.setattr(type(model), "generate", original)
    ok = hap.run(model, processor, noise_image(1), "what color is the circle ?", cfg, max_new_tokens=2)
    assert math.isclose(ok.retain, 0.2, abs_tol=0.01)


def test_same_inputs_give_the_same_selection_run_after_run(tiny):
    model, processor = tiny
    cfg = hap.HAPConfig(retain=0.15, first_layers=0)
    runs = [hap.run(model, processor, noise_image(2), "is there a red square ?", cfg, max_new_tokens=2) for _ in range(3)]
    assert all(r.groups == runs[0].groups and r.head_class == runs[0].head_class for r in runs)
