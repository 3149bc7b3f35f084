"""Every kind of bad input the app can receive, driven through `/analyze` with gradio_client (and raw
HTTP where gradio_client cannot send it: NaN, infinity, server-side paths, oversized uploads).

Each case asserts the exact message (what was wrong and what is allowed) or the correct conversion,
and that the server then still answers the good request with the same result as before (kept
indices, head classes, answers): nothing leaks from a failed request into the next. The library side
of the same inputs is tests/test_inputs.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import gradio as gr

import httpx
import numpy as np
import pytest
import torch
import app_model
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file
from PIL import Image

from test_edit import IN_UPLOADS, outside_paths

from app.present import OUTPUTS
from app.layout import SWEEP_KNOBS
from app.settings import knob_defaults
from app.uploads import REFUSED
from hap.runs.inputs import InputLimits
from hap.knobs import KNOBS, METHODS
from hap.options import OPTIONS

SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
SCENE2 = ROOT / "assets" / "examples" / "scene_600001.png"
PROMPT = "what color is the triangle ?"
SETTINGS = dict(method="hap", retain=0.2, groups=3, first_layers=0, decay=0.5, temperature=0.1, tau_sink=0.5,
                tau_disp=0.9, sink_rho=10.0, rows="prompt")
LIMITS = InputLimits(max_bytes=256 * 2**10, max_pixels=4_000_000, max_prompt_chars=2000)  # small, to reach them
UNREACHABLE = "hap-test/no-such-model"  # allow-listed hub id that cannot be loaded offline
OFF_LIST = "llava-hf/bakLlava-v1-hf"
SUMMARY, EXPLANATION = (OUTPUTS.index(name) for name in ("summary", "explanation"))  # positions in a reply
FILE_INPUTS = (gr.Image, gr.ImageEditor, gr.File)  # the components through which a request names a file


def fingerprint(out) -> tuple:
    """What must not change between identical requests: kept indices, head classes, the three answers."""
    data = out[SUMMARY]
    return ([g["kept"] for g in data["groups"]], data["head_class"],
            *(data["runs"][k]["answer"] for k in ("unpruned", "pruned", "uniform")))


# --------------------------------------------------------------------------------------------- server


class Server:
    def __init__(self, url: str, demo, model: str, local: str, bin_only: str, remote_code: str):
        self.url, self.demo, self.model = url, demo, model
        self.local, self.bin_only, self.remote_code = local, bin_only, remote_code
        self.client = Client(url, verbose=False)
        self.handler = demo.hap_handler
        self.baseline = fingerprint(self.analyze())

    def analyze(self, image=SCENE, prompt=PROMPT, model=None, **changes):
        settings = {**SETTINGS, **changes}
        if isinstance(image, (str, Path)):
            image = handle_file(str(image))
        return self.client.predict(image=image, prompt=prompt, model_name=model or self.model, **settings,
                                   api_name="/analyze")

    def sweep(self, image=SCENE, prompt=PROMPT, model=None, **changes):
        """`/sweep` with the knobs of SETTINGS it takes (not the swept method, retain, flops_ratio)."""
        settings = {k: v for k, v in {**SETTINGS, **changes}.items() if k not in ("method", "retain", "flops_ratio")}
        if isinstance(image, (str, Path)):
            image = handle_file(str(image))
        return self.client.predict(image=image, prompt=prompt, model_name=model or self.model, **settings,
                                   api_name="/sweep")

    def refused(self, match: str, endpoint: str = "analyze", **request) -> str:
        """The request to `endpoint` fails with a message matching `match` (no traceback), and the server still
        answers."""
        with pytest.raises(Exception, match=match) as err:
            getattr(self, endpoint)(**request)
        message = str(err.value)
        assert "Traceback" not in message and "File \"" not in message, message
        self.still_serving()
        return message

    def rebaseline(self) -> None:
        """Back to the default model, reloaded from disk: its answer is the baseline again."""
        self.baseline = fingerprint(self.analyze())
        assert fingerprint(self.analyze()) == self.baseline

    def still_serving(self) -> None:
        assert fingerprint(self.analyze()) == self.baseline

    def payload(self, image, **changes) -> list:
        """The positional `data` of a raw /analyze call: image, prompt, model, every knob in registry order (SETTINGS,
        else the model's defaults), then the history, the stored turns and the causal setting (None: a first
        question, none stored, auto), the plant and the keeps opt-in (None: nothing planted, no comparison), then
        the processor options (None: the checkpoint's own)."""
        settings = {**knob_defaults(self.model), **SETTINGS, **changes}
        return [image, PROMPT, self.model, *(settings[k.name] for k in KNOBS), None, None, None, None, None,
                *(None for _ in OPTIONS)]

    def sweep_payload(self, image) -> list:
        """The positional `data` of a raw /sweep call: image, prompt, model, then the knobs it takes (SWEEP_KNOBS),
        then the processor options (None: the checkpoint's own)."""
        settings = {**knob_defaults(self.model), **SETTINGS}
        return [image, PROMPT, self.model, *(settings[name] for name in SWEEP_KNOBS), *(None for _ in OPTIONS)]

    def raw(self, data: list, endpoint: str = "analyze") -> tuple[str, object]:
        """POST /call/<endpoint> with a JSON body gradio_client would not send; (event, payload) of the answer."""
        body = json.dumps({"data": data}, allow_nan=True)  # NaN / Infinity literals as a careless client sends
        r = httpx.post(f"{self.url}gradio_api/call/{endpoint}", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        r.raise_for_status()
        stream = httpx.get(f"{self.url}gradio_api/call/{endpoint}/{r.json()['event_id']}", timeout=60).text
        event = next(line.split(": ", 1)[1] for line in stream.splitlines() if line.startswith("event: "))
        payload = next(line.split(": ", 1)[1] for line in stream.splitlines() if line.startswith("data: "))
        return event, json.loads(payload)

    def queued(self, fn_index: int, data: list) -> tuple[bool, dict]:
        """POST /queue/join as the page's own script does (any event by its index, the private ones too); (success,
        output) of the event's completion."""
        session = uuid.uuid4().hex
        r = httpx.post(f"{self.url}gradio_api/queue/join", json={"data": data, "fn_index": fn_index,
                                                                  "session_hash": session}, timeout=30)
        r.raise_for_status()
        with httpx.stream("GET", f"{self.url}gradio_api/queue/data", params={"session_hash": session},
                          timeout=120) as stream:
            for line in stream.iter_lines():
                message = json.loads(line[len("data: "):]) if line.startswith("data: ") else {}
                if message.get("msg") == "process_completed":
                    return message["success"], message["output"]
        raise AssertionError(f"event {fn_index} did not complete")

    def event_payload(self, fn, image) -> list:
        """The positional `data` of a raw call of the event `fn`: `image` for its file input, the prompt and this
        server's model, every other input at its default (the page's knob values, text knobs such as clip_model
        included; None for a state)."""
        def value(c):
            if isinstance(c, FILE_INPUTS):
                return image
            if isinstance(c, gr.Textbox) and not (c.elem_id or "").startswith("knob-"):
                return PROMPT
            return self.model if isinstance(c, gr.Dropdown) else c.value

        return [value(c) for c in fn.inputs]

    def uploaded(self, path: Path) -> dict:
        r = httpx.post(f"{self.url}gradio_api/upload", files=[("files", (path.name, path.read_bytes()))], timeout=30)
        r.raise_for_status()
        return {"path": r.json()[0], "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


def copy_model(source: Path, target: Path, bin_only: bool = False) -> Path:
    """A copy of a model folder; `bin_only` keeps the weights as a pickled pytorch_model.bin only."""
    shutil.copytree(source, target)
    if bin_only:
        from safetensors.torch import load_file

        torch.save(load_file(target / "model.safetensors"), target / "pytorch_model.bin")
        (target / "model.safetensors").unlink()
    return target


def remote_code_model(target: Path, marker: Path) -> Path:
    """A folder whose config asks for its own modelling code (which would leave `marker` if it ever ran)."""
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["EvilForConditionalGeneration"], "model_type": "evil",
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForImageTextToText": "evil.EvilModel"},
    }))
    (target / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from app.app import build_demo, launch_options
    from app.settings import resolve

    tmp = tmp_path_factory.mktemp("reliability")
    model = default_model(tmp / "tiny")
    source = Path(resolve(model))
    local = str(copy_model(source, tmp / "local-copy"))
    bin_only = str(copy_model(source, tmp / "bin-only", bin_only=True))
    remote = str(remote_code_model(tmp / "remote-code", tmp / "remote-code-ran"))
    # local folders stay off unless the stand-in model (itself a local folder) has to be served
    demo = build_demo([model, UNREACHABLE, local, bin_only, remote], allow_local=model != app_model.SHIPPED,
                      limits=LIMITS)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options(LIMITS))
    yield Server(url, demo, model, local, bin_only, remote)
    demo.close()


@pytest.fixture
def local_models_on(server, monkeypatch):
    """The operator has set HAP_APP_ALLOW_LOCAL=1 (for this test only)."""
    monkeypatch.setattr(server.handler, "settings", replace(server.handler.settings, allow_local=True))


# --------------------------------------------------------------------------------------------- images


def _png_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _write(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _bomb(tmp: Path) -> Path:
    path = tmp / "bomb.png"
    Image.new("1", (20000, 20000)).save(path, optimize=True)  # 400 megapixels in a few kB
    assert path.stat().st_size < LIMITS.max_bytes
    return path


def _over_pixels(tmp: Path) -> Path:
    path = tmp / "wide.png"
    Image.new("1", (2500, 2000)).save(path, optimize=True)  # 5 megapixels, under PIL's guard, over the limit
    return path


BAD_IMAGES = [
    ("zero-bytes", lambda t: _write(t, "empty.png", b""), r"image 'empty.png': the image file empty.png is empty "
     r"\(0 bytes\); upload a PNG, JPEG"),
    ("text-as-png", lambda t: _write(t, "notes.png", b"this is not an image\n" * 20),
     r"image 'notes.png': not a readable image \(UnidentifiedImageError\); allowed formats: PNG, JPEG, GIF, WebP"),
    ("pdf-as-jpg", lambda t: _write(t, "doc.jpg", b"%PDF-1.4\n%fake\n" * 10), r"not a readable image"),
    ("svg", lambda t: _write(t, "logo.svg", b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'),
     r"image 'logo.svg': not a readable image"),
    ("truncated-png", lambda t: _write(t, "cut.png", SCENE.read_bytes()[: SCENE.stat().st_size // 2]),
     r"image 'cut.png': the image file is truncated or corrupt \(.*\); allowed formats"),
    ("truncated-jpeg", lambda t: _write(t, "cut.jpg", _png_bytes(Image.open(SCENE), "JPEG")[:600]),
     r"image 'cut.jpg': the image file is truncated or corrupt"),
    ("decompression-bomb", _bomb, r"image 'bomb.png': the image has over \d+ megapixels \(refused from its header\); "
     r"the limit is 4 megapixels"),
    ("over-pixel-limit", _over_pixels, r"2500 x 2000 = 5.0 megapixels; the limit is 4 megapixels"),
]


@pytest.mark.parametrize(("make", "match"), [c[1:] for c in BAD_IMAGES], ids=[c[0] for c in BAD_IMAGES])
def test_bad_image_is_refused_with_what_is_allowed(server, tmp_path, make, match):
    server.refused(match, image=make(tmp_path))


def test_no_image(server):
    server.refused(r"no image: upload one or click an example", image=None)


def test_an_upload_over_the_byte_limit_is_refused_before_it_is_stored(server, tmp_path):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8))
    path = tmp_path / "noise.png"
    noise.save(path)
    assert path.stat().st_size > LIMITS.max_bytes
    with pytest.raises(ValueError, match=rf"exceeds the maximum file size of {LIMITS.max_bytes} bytes"):
        server.analyze(image=path)  # gradio_client reads the limit from the server and does not send it
    r = httpx.post(f"{server.url}gradio_api/upload", files=[("files", ("noise.png", path.read_bytes()))], timeout=30)
    assert r.status_code == 413 and f"maximum allowed size of {LIMITS.max_bytes} bytes" in r.text
    server.still_serving()


def test_a_server_path_that_was_not_uploaded_is_refused(server):
    image = {"path": str(SCENE), "meta": {"_type": "gradio.FileData"}}
    event, payload = server.raw(server.payload(image))
    assert event == "error" and "it was not uploaded by a user" in payload["error"]
    server.still_serving()


def test_an_image_that_is_not_a_file_is_refused(server):
    event, payload = server.raw(server.payload("/etc/hostname"))
    assert event == "error" and "validation error for ImageData" in payload["error"], payload  # gradio's own check
    server.still_serving()


def file_events(demo) -> dict[int, object]:
    """Every event that takes a file, by index: the API's /analyze and /sweep and the page's private twins."""
    return {i: fn for i, fn in demo.fns.items() if any(isinstance(c, FILE_INPUTS) for c in fn.inputs)}


def _shapes(fn, good: dict) -> list:
    """How an event's file input carries a FileData dict `v`: as itself (an Image), or as the editor's background or
    its composite over the upload `good` (an ImageEditor)."""
    if not any(isinstance(c, gr.ImageEditor) for c in fn.inputs):
        return [lambda v: v]
    return [lambda v: {"background": v, "layers": [], "composite": None},
            lambda v: {"background": good, "layers": [], "composite": v}]


GRADIO_REFUSALS = ("it was not uploaded by a user",  # a FileData dict with meta outside gradio's upload cache
                   "The 'meta' field must be explicitly provided")  # an editor value's file without meta


def _said(message: str, path: str) -> str:
    """A refusal's message with the path written <path> (gradio's own messages repeat it, as sent or absolute, or
    pydantic's shortened repr of the value sent)."""
    message = re.sub(r"input_value=\{.*\}, input_type", "input_value=<value>, input_type", message)
    return message.replace(os.path.abspath(path), "<path>").replace(path, "<path>")


def _one_refusal(said: dict[str, str]) -> str:
    """The one message of the refusals `said` (kind -> message), which must be the handler's or gradio's own check."""
    assert len(set(said.values())) == 1, said
    message = said["image"]
    assert message == REFUSED or any(m in message for m in GRADIO_REFUSALS), message
    return message


@pytest.mark.parametrize("meta", [False, True], ids=["without-meta", "with-meta"])
def test_a_server_path_is_refused_with_one_message_on_every_event_that_takes_a_file(server, tmp_path, meta):
    """A raw request naming a file that is not an upload or an example: outside, `..`, a symlink out of the upload
    cache, a folder, a missing file, in a FileData dict with gradio's meta or without, on /analyze, /sweep (raw POST)
    and every page event that takes a file (queue/join). One message whatever the path names, so nothing tells
    whether it exists: without meta the handler's REFUSED, with meta gradio's own check first (the paths it passes,
    inside its cache but no file, are the handler's). An upload and an example without meta are answered."""
    from gradio.utils import get_upload_folder

    uploads = Path(tempfile.mkdtemp(dir=get_upload_folder()))
    tag = {"meta": {"_type": "gradio.FileData"}} if meta else {}
    good = {**server.uploaded(SCENE), "meta": {"_type": "gradio.FileData"}} if meta else {"path": server.uploaded(
        SCENE)["path"], "orig_name": SCENE.name}
    try:
        paths = {k: p for k, p in outside_paths(tmp_path, uploads).items() if not (meta and k in IN_UPLOADS)}
        events = file_events(server.demo)
        assert len(events) >= 6  # analyze, sweep and their page twins (Run, Enter, follow-up, the sweep button)
        for index, fn in events.items():
            for shape in _shapes(fn, good):
                said = {}
                for kind, p in paths.items():
                    success, output = server.queued(index, server.event_payload(fn, shape({"path": p, **tag})))
                    assert not success, (fn.api_name, kind, output)
                    said[kind] = _said(output["error"], p)
                message = _one_refusal(said)
                if isinstance(fn.inputs[0], gr.Image) and not meta:  # what gradio lets through, the handler refuses
                    assert message == REFUSED
        for endpoint, payload in (("analyze", server.payload), ("sweep", server.sweep_payload)):  # a script's POST
            said = {}
            for kind, p in paths.items():
                event, answer = server.raw(payload({"path": p, **tag}), endpoint)
                assert event == "error", (endpoint, kind, answer)
                said[kind] = _said(answer["error"], p)
            assert _one_refusal(said) == REFUSED or meta
    finally:
        shutil.rmtree(uploads)
    if not meta:  # an upload, and a shipped example, named without meta: the same answer as through gradio_client
        for image in (good, {"path": str(SCENE)}):
            event, payload = server.raw(server.payload(image))
            assert event == "complete" and fingerprint(payload) == server.baseline, payload
    server.still_serving()


def _alpha(img: Image.Image) -> Image.Image:
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(img.size))
    return rgba


def _sixteen_bit(img: Image.Image) -> Image.Image:
    return Image.fromarray(np.asarray(img.convert("L"), dtype=np.uint16) * 257)


CONVERTED = [  # (id, make the file, expected input format and mode)
    ("1x1", lambda t: _save(Image.new("RGB", (1, 1), "red"), t / "dot.png"), ("PNG", "RGB")),
    ("grayscale", lambda t: _save(Image.open(SCENE).convert("L"), t / "gray.png"), ("PNG", "L")),
    ("palette", lambda t: _save(Image.open(SCENE).convert("P"), t / "palette.png"), ("PNG", "P")),
    ("rgba", lambda t: _save(_alpha(Image.open(SCENE)), t / "alpha.png"), ("PNG", "RGBA")),
    ("cmyk", lambda t: _save(Image.open(SCENE).convert("CMYK"), t / "print.jpg"), ("JPEG", "CMYK")),
    ("16-bit", lambda t: _save(_sixteen_bit(Image.open(SCENE)), t / "deep.png"), ("PNG", "I;16")),
    ("webp", lambda t: _save(Image.open(SCENE), t / "scene.webp", lossless=True), ("WEBP", "RGB")),
]


def _save(img: Image.Image, path: Path, **kw) -> Path:
    img.save(path, **kw)
    return path


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in CONVERTED], ids=[c[0] for c in CONVERTED])
def test_every_image_mode_is_converted_and_answered(server, tmp_path, make, expected):
    out = server.analyze(image=make(tmp_path))
    info = out[SUMMARY]["input"]
    assert (info["format"], info["mode"]) == expected
    assert out[SUMMARY]["num_visual"] == 144 and out[1].startswith("#### Pruned (hap)")
    line = out[EXPLANATION].splitlines()[-1]
    assert line.startswith(f"- Input: {expected[0]} {expected[1]}")
    assert ("converted to RGB" in line) == (expected[1] != "RGB")
    if expected[1] == "RGBA":
        assert "transparent pixels on white" in line
    server.still_serving()


def test_an_animated_gif_gives_its_first_frame(server, tmp_path):
    gif = tmp_path / "anim.gif"
    Image.open(SCENE).save(gif, save_all=True, append_images=[Image.open(SCENE2)], duration=100, loop=0)
    first = tmp_path / "first.png"
    with Image.open(gif) as img:
        img.convert("RGB").save(first)  # frame 0 exactly as GIF stores it (quantised)
    out = server.analyze(image=gif)
    assert out[SUMMARY]["input"]["animated"] and "first frame of the animation" in out[EXPLANATION]
    assert fingerprint(out) == fingerprint(server.analyze(image=first))
    server.still_serving()


def test_exif_rotation_is_applied(server, tmp_path):
    upright = Image.open(SCENE).resize((168, 84))
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # the pixels as a camera held sideways writes them
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    jpeg, png, plain = tmp_path / "camera.jpg", tmp_path / "camera.png", tmp_path / "upright.png"
    stored.save(jpeg, exif=exif, quality=95)
    stored.save(png, exif=exif)
    upright.save(plain)
    info = server.analyze(image=jpeg)[SUMMARY]["input"]
    assert (info["width"], info["height"], info["exif_orientation"]) == (168, 84, 6)
    out = server.analyze(image=png)  # lossless: exactly the upright image once rotated
    assert "EXIF orientation 6 applied" in out[EXPLANATION]
    assert fingerprint(out) == fingerprint(server.analyze(image=plain))
    server.still_serving()


# --------------------------------------------------------------------------------------------- prompts

BAD_PROMPTS = [
    ("empty", "", r"the prompt is empty: type a question about the image"),
    ("whitespace", " \n\t  ", r"the prompt is empty"),
    ("only-control", "\x00\x07\x1b\u200b", r"the prompt is empty"),
    ("only-image-tokens", "<image><image>", r"the prompt is empty"),
    ("over-the-context", "what " * 399, r"prompt too long: \d+ tokens \+ max_new_tokens=32 exceed the model's 512 "
     r"positions; shorten the prompt"),
    ("over-the-char-limit", "x" * 2001, r"the prompt has 2001 characters; the limit is 2000"),
    ("number", 123, r"prompt must be text, not int"),
    ("null", None, r"prompt must be text, not NoneType"),
]


@pytest.mark.parametrize(("prompt", "match"), [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompt_is_refused(server, prompt, match):
    server.refused(match, prompt=prompt)


def test_control_characters_are_removed_and_said(server):
    out = server.analyze(prompt="what\x00 color is\u200f the triangle ?\x07")
    assert "removed control or invisible formatting characters" in out[EXPLANATION]
    assert fingerprint(out) == server.baseline  # the same question once cleaned
    server.still_serving()


def test_typed_image_tokens_add_no_image_slot(server):
    plain = server.analyze()[SUMMARY]
    out = server.analyze(prompt="what color <image> is the <image><image> triangle ?")
    data = out[SUMMARY]
    assert data["num_visual"] == plain["num_visual"] == 144
    assert data["prompt_text"].count("<image>") == plain["prompt_text"].count("<image>") == 1
    assert "removed the special token '<image>' from the prompt" in out[EXPLANATION]
    server.still_serving()


def test_right_to_left_and_non_ascii_text_is_kept(server):
    prompt = "ما لون المثلث ؟ מה הצבע ? 三角形は何色 ?"
    out = server.analyze(prompt=prompt)
    assert prompt in out[SUMMARY]["prompt_text"] and out[1].startswith("#### Pruned (hap)")
    server.still_serving()


# --------------------------------------------------------------------------------------------- settings

ALLOWED = {  # what each numeric knob allows, as its message says (hap/knobs.py)
    "retain": "a number in (0, 1]", "flops_ratio": "a number in (0, 1]", "decay": "a number in (0, 1]",
    "groups": "an integer >= 1", "first_layers": "an integer >= 0", "temperature": "a number > 0",
    "tau_sink": "a number in [0, 1]", "tau_disp": "a number in [0, 1]", "sink_rho": "a number >= 1",
}
OUT_OF_RANGE = [  # (field, value): every numeric knob below, above, negative, of the wrong type
    *(("retain", v) for v in (0, 1.5, -0.2, "0.5")), ("flops_ratio", 0), *(("groups", v) for v in (0, 2.5, True)),
    ("first_layers", -1), ("first_layers", [1]), ("decay", 0), ("decay", 2),
    *(("temperature", v) for v in (-1, "hot", 0)), ("tau_sink", 1.5), ("tau_disp", -0.1),
    ("sink_rho", 0.5), ("sink_rho", {"x": 1}),
]
BAD_SETTINGS = [  # (field, value, message): the range of each knob, then the choices and what this model allows
    *((n, v, re.escape(f"{n}={v!r} must be {ALLOWED[n]}")) for n, v in OUT_OF_RANGE),
    ("method", "evil", r"method='evil' is not allowed; choose one of " + ", ".join(METHODS)),
    ("rows", "middle", r"rows='middle' is not allowed; choose one of prompt, last"),
    ("groups", 9, r"groups=9 must be <= 6: layers \[0, 6\) cannot be split into more groups"),  # not for this model
    ("first_layers", 9, r"first_layers=9 must be < the decoder's 6 layers"),
    ("first_layers", 6, r"first_layers=6 must be < the decoder's 6 layers"),
    ("first_layers", 2, r"retain=0.2 is unreachable: with first_layers=2 of 6 decoder layers"),
]


@pytest.mark.parametrize(("name", "value", "match"), BAD_SETTINGS,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_SETTINGS])
def test_bad_setting_names_the_field_and_the_range(server, name, value, match):
    server.refused(match, **{name: value})


NON_FINITE = [("retain", math.nan, r"retain=nan must be a number in \(0, 1\]"),
              ("temperature", math.nan, r"temperature=nan must be a number > 0"),
              ("decay", math.inf, r"decay=inf must be a number in \(0, 1\]"),
              ("groups", -math.inf, r"groups=-inf must be an integer >= 1")]


@pytest.mark.parametrize(("name", "value", "match"), NON_FINITE, ids=[f"{n}={v}" for n, v, _ in NON_FINITE])
def test_nan_and_infinity_sent_as_raw_json(server, tmp_path, name, value, match):
    """gradio_client refuses to encode NaN; a hand-written client sends the literal, and gets the field named."""
    image = server.uploaded(SCENE)
    event, payload = server.raw(server.payload(image, **{name: value}))
    assert event == "error"
    assert re.search(match, payload["error"]), payload
    server.still_serving()


def test_a_budget_near_the_floor_keeps_one_token_per_group_within_the_request(server):
    out = server.analyze(retain=0.01, decay=0.05)
    kept = [len(g["kept"]) for g in out[SUMMARY]["groups"]]
    assert min(kept) == 1 and len(kept) == 3
    server.refused(r"retain=0.005 is unreachable.*at least one token per group", retain=0.005)


# --------------------------------------------------------------------------------------------- models


def test_a_model_off_the_allow_list_is_refused(server):
    message = server.refused(rf"model '{OFF_LIST}' is not on this server's allow-list \(HAP_APP_MODELS\); "
                             rf"choose one of {re.escape(server.model)}", model=OFF_LIST)
    assert UNREACHABLE in message


@pytest.mark.parametrize("name", ["/etc", "../../../etc", "~/.cache/huggingface", f"{ROOT / app_model.SHIPPED}/"])
def test_a_path_off_the_allow_list_is_refused(server, name):
    server.refused(rf"model '{re.escape(name)}' is not on this server's allow-list", model=name)


def test_a_local_folder_is_refused_unless_the_operator_enables_local_folders(server, monkeypatch):
    # off already unless the shipped model is absent (then the stand-in, a local folder, needs it on)
    monkeypatch.setattr(server.handler, "settings", replace(server.handler.settings, allow_local=False))
    with pytest.raises(Exception, match=r"model '.*local-copy' is a local folder, and loading local folders is off "
                                        r"on this server \(the operator enables it with HAP_APP_ALLOW_LOCAL=1\)"):
        server.analyze(model=server.local)
    monkeypatch.undo()
    server.still_serving()


def test_an_unreachable_model_fails_cleanly(server):
    server.refused(r"cannot load hub id 'hap-test/no-such-model'", model=UNREACHABLE)


def test_pickled_weights_are_refused_and_the_loaded_model_keeps_working(server, local_models_on):
    from app.models import LOADED

    before = fingerprint(server.analyze(model=server.local))  # another allowed model, now the loaded one
    loaded = LOADED.model
    with pytest.raises(Exception, match=r"cannot load local folder .*bin-only: .*no file named model.safetensors"):
        server.analyze(model=server.bin_only)
    assert LOADED.name == server.local and LOADED.model is loaded  # still the previous one, not reloaded
    assert fingerprint(server.analyze(model=server.local)) == before
    server.rebaseline()  # the default model is loaded again, from disk (a training run may have replaced it)


def test_remote_code_is_never_run(server, local_models_on):
    server.refused(r"is a EvilForConditionalGeneration|cannot load local folder .*remote-code",
                   model=server.remote_code)
    assert not (Path(server.remote_code).parent / "remote-code-ran").exists()


# --------------------------------------------------------------------------------------------- memory, errors


def test_out_of_memory_is_reported_freed_and_the_next_request_succeeds(server, monkeypatch):
    import app.pipeline as app_module
    from app.models import LOADED

    freed = []
    monkeypatch.setattr(app_module, "free_memory", lambda: freed.append(1))

    def exhausted(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(type(LOADED.model), "generate", exhausted)
    with pytest.raises(Exception, match=r"out of memory on cpu while answering \(OutOfMemoryError\); memory was "
                                        r"freed\. Try a smaller image"):
        server.analyze()
    assert freed and not hasattr(LOADED.model, "_hap")  # freed, and the patch is gone
    monkeypatch.undo()
    server.still_serving()


def test_out_of_memory_outside_generation_is_reported_too(server, monkeypatch):
    from hap import views

    def exhausted(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(views, "figures", exhausted)
    with pytest.raises(Exception, match=r"out of memory \(MemoryError\); memory was freed"):
        server.analyze()
    monkeypatch.undo()
    server.still_serving()


def test_an_unexpected_error_is_a_message_not_a_traceback(server, monkeypatch):
    from hap import views

    def broken(*args, **kwargs):
        raise RuntimeError("figure backend exploded")

    monkeypatch.setattr(views, "figures", broken)
    with pytest.raises(Exception, match=r"internal error \(RuntimeError: figure backend exploded\); the server is "
                                        r"still running") as err:
        server.analyze()
    assert "Traceback" not in str(err.value)
    monkeypatch.undo()
    server.still_serving()


# --------------------------------------------------------------------------------------------- the sweep

SWEEP_CASES = [  # (id, the request's changes): /sweep checks them as /analyze does, with the same message
    ("no-image", lambda t: dict(image=None)),
    ("text-as-png", lambda t: dict(image=_write(t, "notes.png", b"this is not an image\n" * 20))),
    ("truncated-png", lambda t: dict(image=_write(t, "cut.png", SCENE.read_bytes()[: SCENE.stat().st_size // 2]))),
    ("over-pixel-limit", lambda t: dict(image=_over_pixels(t))),
    ("empty-prompt", lambda t: dict(prompt=" \n ")),
    ("number-prompt", lambda t: dict(prompt=123)),
    ("over-the-context", lambda t: dict(prompt="what " * 399)),
    ("off-list", lambda t: dict(model=OFF_LIST)),
    ("unreachable", lambda t: dict(model=UNREACHABLE)),
    ("groups=2.5", lambda t: dict(groups=2.5)),
    ("groups=9", lambda t: dict(groups=9)),
    ("first_layers=9", lambda t: dict(first_layers=9)),
    ("temperature=hot", lambda t: dict(temperature="hot")),
    ("tau_disp=1.5", lambda t: dict(tau_disp=1.5)),
    ("sink_rho={}", lambda t: dict(sink_rho={"x": 1})),
    ("rows=middle", lambda t: dict(rows="middle")),
]


@pytest.mark.parametrize("make", [c[1] for c in SWEEP_CASES], ids=[c[0] for c in SWEEP_CASES])
def test_bad_sweep_input_gets_the_same_message_as_analyze(server, tmp_path, make):
    changes = make(tmp_path)
    expected = server.refused(r".", **changes)
    assert server.refused(r".", endpoint="sweep", **changes) == expected


# --------------------------------------------------------------------------------------------- determinism


def test_same_inputs_give_the_same_selection_request_after_request(server):
    a = fingerprint(server.analyze())
    other = fingerprint(server.analyze(image=SCENE2, method="fastv", retain=0.1, rows="last"))
    assert fingerprint(server.analyze()) == a == server.baseline != other
    randoms = [fingerprint(server.analyze(method="random")) for _ in range(2)]
    assert randoms[0] == randoms[1]  # the random baseline is seeded


# --------------------------------------------------------------------------------------------- settings


def test_settings_come_from_the_environment():
    from app.settings import HUB_MODELS, TINY_MODEL, Settings, launch_options

    default = Settings.from_env({})
    assert default.models == [TINY_MODEL, *HUB_MODELS] and not default.allow_local and default.queue_size == 16
    assert default.limits == InputLimits(max_bytes=10 * 2**20, max_pixels=40_000_000, max_prompt_chars=2000)
    env = {"HAP_APP_MODELS": " a/b , c/d ", "HAP_APP_ALLOW_LOCAL": "1", "HAP_APP_MAX_MB": "2",
           "HAP_APP_MAX_MEGAPIXELS": "12.5", "HAP_APP_MAX_PROMPT": "300", "HAP_APP_QUEUE_SIZE": "4"}
    s = Settings.from_env(env)
    assert (s.models, s.allow_local, s.queue_size) == (["a/b", "c/d"], True, 4)
    assert s.limits == InputLimits(max_bytes=2 * 2**20, max_pixels=12_500_000, max_prompt_chars=300)
    assert launch_options(s.limits)["max_file_size"] == 2 * 2**20
    for name, value in [("HAP_APP_MAX_MB", "ten"), ("HAP_APP_MAX_MB", "-1"), ("HAP_APP_QUEUE_SIZE", "2.5"),
                        ("HAP_APP_QUEUE_SIZE", "0"), ("HAP_APP_ALLOW_LOCAL", "maybe"), ("HAP_APP_MAX_PROMPT", "nan")]:
        with pytest.raises(ValueError, match=name):
            Settings.from_env({name: value})
