"""The page in headless Debian Chromium (Selenium, system browser and driver): the result on arrival (no click), run
an example, see every panel (ground truth, head inspector, budget sweep included), and save screenshots: the top of
the page (test-artifacts/app.png, committed as the README's docs/app.png) and the whole page (app-full.png); each
tab's first screen at 1280 x 900 (tab-<name>.png, committed as docs/); the "Is PAQ right?" section on a scene and on
a photograph (causal.png, causal_photo.png, head utility included), checked against `/analyze`; the keeps grid with
the refused methods beside it; the guided lesson step by step; the head lab by clicking.

Every wait is on the state it checks, never a fixed sleep: the page is used once its image editor is set up (its
toolbar is drawn once both its canvases are) and holds the image the page opened with, and the answers of the result
on arrival are shown (`open_page`); a tab once it is shown (`show_tab`), Run once the editor holds the new image
(`pick_example`, `upload`), and a run's result is awaited with its error toast watched (`until_shown`; `press_run`
waits until the arrival note gives way to the run: a failed run fails the test at once, with the message). An upload
into Gradio 6.31's ImageEditor before it is set up was lost with "Cannot read properties of undefined (reading
'dimensions')", and one before its opening image had loaded was replaced by it: the page now holds such a file until
the editor can take it (`app.editor_guard`, `test_a_file_given_while_the_editor_starts_is_kept`), and the tests
wait anyway (docs/app.md)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from app_model import ROOT, SHIPPED, default_model, free_port

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1150"]
ARTIFACTS = ROOT / "test-artifacts"
NARROW = 1280  # the window width the lab and the lesson are checked at
# elem_id plot-<name> of the gr.Plot outputs by tab: one per view of hap.views.VIEWS, then the head inspector
PLOTS = {"image": ["kept_masks", "token_counts", "head_classes", "paq", "layer_maps", "group_maps", "uniform_vs_paq"],
         "check": ["grounding", "head_maps", "inspector"]}


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"no system browser: {CHROMIUM} and {CHROMEDRIVER} come with "
                    "`apt-get install chromium chromium-driver` (.ci/install-browser)")
    from app.app import build_demo, launch_options

    demo = build_demo([default_model(tmp_path_factory.mktemp("tiny-llava"))])
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    yield url
    demo.close()


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield browser
    browser.quit()


WAIT_S = 240  # the longest a run may take on a loaded CI machine
ARRIVAL_S = 60  # the answers of the result on arrival show within this of the page's load, without a click
OPENING_ADDS = 2  # the editor's opening image: its background and its composite, each added once it is set up
EDITOR_SET = ("const e = window.editor, root = document.getElementById('image-editor'); if (!e || !root || "
              "!root.querySelector('.toolbar-wrap')) return false; let n = e.command_manager.history, adds = 0; "
              "for (; n; n = n.previous) adds += n.command && n.command.name === 'AddImage' ? 1 : 0; "
              f"return adds >= {OPENING_ADDS}")  # set up (its toolbar drawn) and holding the opening image
MARK_IMAGE = "window.hapShown = window.editor.background_image"  # the image the editor holds now
HOLDS_NEW_IMAGE = ("const e = window.editor; return !!e && e.command_manager.contains('AddImage') && "
                   "!!e.background_image && e.background_image !== window.hapShown")  # another one since MARK_IMAGE
NOTE_GONE = "const e = document.getElementById('arrival'); return !e || e.offsetParent === null"  # hidden: a run
TEXT = "const e = document.getElementById(arguments[0]); return e ? e.innerText : ''"  # read at once: never stale


@pytest.fixture(autouse=True)
def fresh_log(request):
    """Read (and drop) the browser log before each test that drives the page: its errors are its own."""
    if "driver" in request.fixturenames:
        request.getfixturevalue("driver").get_log("browser")


def console_errors(driver) -> list[dict]:
    """The SEVERE lines the page logged since the last read."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def error_toasts(driver) -> list[str]:
    """The texts of the error toasts shown."""
    return driver.execute_script("return [...document.querySelectorAll('.toast-body.error')].map(e => e.innerText)")


def open_page(driver, url: str) -> float:
    """Load the page and wait until its image editor is set up and holds the image the page opened with (a file
    given before is held until then: `app.editor_guard`) and the answers of the result on arrival are shown (no
    click; an error toast fails at once). Returns the seconds from the load to the answers."""
    from selenium.webdriver.support.ui import WebDriverWait

    from app.present import CARDS

    start = time.monotonic()
    driver.get(url)
    driver.set_script_timeout(WAIT_S)

    def arrived(d):
        shown = all("visual tokens" in d.execute_script(TEXT, f"answer-{k}") for k in CARDS)
        return error_toasts(d) or (shown and d.execute_script(EDITOR_SET))

    found = WebDriverWait(driver, WAIT_S).until(arrived)
    assert found is True, f"the page showed an error on arrival: {found}"
    return time.monotonic() - start


def show_tab(driver, wait, name: str) -> None:
    """Click the tab `name` (`app.layout.TABS`); wait until it is shown."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    driver.find_element(By.ID, f"tab-{name}-button").click()
    wait.until(EC.visibility_of_element_located((By.ID, f"tab-{name}")))


def pick_example(driver, wait, index: int = 0) -> str:
    """Click the scene example `index`; wait until the editor holds it (a new image) and the prompt is its. Returns
    the prompt."""
    from selenium.webdriver.common.by import By

    from app.settings import examples

    prompt = examples([SHIPPED])[0][index][1]
    driver.execute_script(MARK_IMAGE)
    driver.find_elements(By.CSS_SELECTOR, "button.gallery-item")[index].click()
    wait.until(lambda d: d.execute_script(HOLDS_NEW_IMAGE))
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "textarea").get_attribute("value") == prompt)
    return prompt


def upload(driver, wait, path: Path) -> None:
    """Upload `path` into the image editor; wait until the editor holds it (a new image)."""
    from selenium.webdriver.common.by import By

    driver.execute_script(MARK_IMAGE)
    driver.find_element(By.CSS_SELECTOR, "#image-editor input[type=file]").send_keys(str(path))
    wait.until(lambda d: d.execute_script(HOLDS_NEW_IMAGE))


def until_shown(driver, wait, elem_id: str, text: str) -> None:
    """Wait until element `elem_id` shows `text`; an error toast (a refused or failed run) fails at once, with it."""
    found = wait.until(lambda d: error_toasts(d) or text in d.execute_script(TEXT, elem_id))
    assert found is True, f"waiting for {text!r} in #{elem_id}, the page showed an error: {found}"


def press_run(driver, wait) -> None:
    """Press Run on the page as it opened (its first tab shown) and wait until the run's result replaced the result on
    arrival (its note hidden once the run succeeded); an error toast fails at once, with it."""
    from selenium.webdriver.common.by import By

    assert not driver.execute_script(NOTE_GONE), "press_run expects the page as it opened, with its arrival note"
    driver.find_element(By.ID, "run").click()
    found = wait.until(lambda d: error_toasts(d) or d.execute_script(NOTE_GONE))
    assert found is True, f"waiting for the run, the page showed an error: {found}"


def set_slider(driver, elem_id: str, value: int) -> None:
    """Type `value` into the number box of the slider `elem_id` (an input event, as a user's)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    box.clear()
    box.send_keys(str(value), Keys.TAB)


VIEWPORT = (1280, 900)  # the tab tour's window content, in CSS pixels
LOAD_HEIGHT = 6000  # the page at load is at most this tall at VIEWPORT's width
MAIN = {"image": "plot-kept_masks", "check": "plot-grounding", "lab": "lesson-text", "compare": "plot-keeps"}
SHOWN = 200  # px of each tab's main element visible without scrolling, at least


def set_viewport(driver, width: int, height: int) -> None:
    """Size the window so that its content is `width` x `height`."""
    extra = driver.execute_script("return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]")
    driver.set_window_size(width + extra[0], height + extra[1])


def test_the_tabs_at_1280_by_900(page_url, driver):
    """The page a visitor meets, at 1280 x 900 (the first test of the module, so the first visit of its server: the
    result on arrival is run then). With no click the answer cards show the result on arrival within ARRIVAL_S of the
    load, the editor holds its image and the prompt its question, and the page is at most LOAD_HEIGHT tall. Each tab
    (`app.layout.TABS`) then opens on its main element (MAIN) with SHOWN px of it in view and its first screen is saved
    (test-artifacts/tab-<name>.png, committed as docs/tab-<name>.png): this image, check PAQ and the head lab on the
    result on arrival, compare methods after its "Compare every method" (`keeps_grid`); then the guided lesson's five
    steps from the head lab's tab (`lesson_steps`). The measures go to test-artifacts/arrival.json."""
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from app.layout import TABS
    from app.settings import examples

    wait = WebDriverWait(driver, WAIT_S)
    set_viewport(driver, *VIEWPORT)
    seconds = open_page(driver, page_url)
    for name in PLOTS["image"]:  # the first tab drawn in full: its height is the page's at load
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#plot-{name} .js-plotly-plot .main-svg")))
    height = driver.execute_script("return document.documentElement.scrollHeight")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "arrival.json").write_text(json.dumps({"answers_s": round(seconds, 2), "height_px": height}))
    assert seconds <= ARRIVAL_S and height <= LOAD_HEIGHT, (seconds, height)
    image, question = examples([SHIPPED])[0][0][:2]
    assert driver.find_element(By.CSS_SELECTOR, "#prompt textarea").get_attribute("value") == question
    assert Path(image).stem.replace("_", " ") in driver.find_element(By.ID, "arrival").text
    assert f"turn 1: {question}" in driver.find_element(By.ID, "conversation").text
    assert set(MAIN) == set(TABS)
    for name, main in MAIN.items():
        show_tab(driver, wait, name)
        if name == "compare":
            keeps_grid(driver, wait)
        driver.execute_script("window.scrollTo(0, 0)")
        top, inner = driver.execute_script("return [document.getElementById(arguments[0]).getBoundingClientRect().top, "
                                           "window.innerHeight]", main)
        assert top + SHOWN <= inner == VIEWPORT[1], (name, main, top, inner)
        if name == "check":
            truth = driver.find_element(By.ID, "ground-truth").text  # the result on arrival: a scene asked its own
            assert "Ground truth for" in truth, truth  #                 question
        driver.save_screenshot(str(ARTIFACTS / f"tab-{name}.png"))
    show_tab(driver, wait, "lab")
    lesson_steps(driver, wait)
    errors = console_errors(driver)
    assert not errors, errors


def keeps_grid(driver, wait) -> None:
    """"Compare every method" (its tab shown) on the image and question in the request: a map per method that ran, the
    figure's own text without any refusal, the refused methods (CDPruner on the shipped model) beside it with their
    reasons."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    driver.find_element(By.ID, "keeps-run").click()
    until_shown(driver, wait, "keeps-refused", "Not in the figure")  # "not run" before
    wait.until(EC.text_to_be_present_in_element((By.ID, "plot-keeps"), "What each method keeps at"))
    figure = driver.find_element(By.ID, "plot-keeps").text
    assert "refused" not in figure and "hap: " in figure and "fastv: " in figure, figure
    side = driver.find_element(By.ID, "keeps-refused").text
    assert "cdpruner refused:" in side and "cdpruner" not in figure, side


def lesson_steps(driver, wait) -> None:
    """Click each of the guided lesson's five steps (the head lab's tab shown): its text (with the scene's answer and
    the held-out figure) and only the views it uses appear; saves test-artifacts/lesson-<step>.png (step 3 is the
    README's docs/lesson.png)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    from app import lesson

    for index, step in enumerate(lesson.STEPS, 1):
        button = wait.until(EC.element_to_be_clickable((By.ID, f"lesson-{index}")))
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
        button.click()
        until_shown(driver, wait, "lesson-text", f"Step {index} ·")
        text = driver.find_element(By.ID, "lesson-text").text
        assert f"the scene's answer: {lesson.scene()['answer']}" in text
        assert "Held-out: over 120 held-out questions" in text and step.held_out.source in text
        for name in ("head_classes", "uniform_vs_paq", "kept_masks"):
            plot = f"#plot-lesson_{name} .js-plotly-plot .main-svg"
            if name in step.views:
                wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, plot)))
                if not step.plan.empty:
                    wait.until(EC.text_to_be_present_in_element((By.ID, f"plot-lesson_{name}"), "PLANTED"))
            else:
                assert not any(e.is_displayed() for e in driver.find_elements(By.CSS_SELECTOR, plot)), (index, name)
        shoot(driver, f"lesson-{index}", f"plot-lesson_{step.views[-1]}", f"lesson-{index}.png")


EARLY_UPLOAD = """
const bytes = Uint8Array.from(atob("%s"), c => c.charCodeAt(0));
window.hapEarly = null;
const upload = () => {
  const input = document.querySelector("#image-editor input[type=file]");
  if (!input || window.hapEarly) return !!window.hapEarly;
  const data = new DataTransfer();
  data.items.add(new File([bytes], "coffee.jpg", {type: "image/jpeg"}));
  input.files = data.files;
  window.hapEarly = {set_up: !!document.querySelector("#image-editor .toolbar-wrap")};
  input.dispatchEvent(new Event("change", {bubbles: true}));
  return true;
};
const watch = new MutationObserver(() => { if (upload()) watch.disconnect(); });
document.addEventListener("DOMContentLoaded", () => watch.observe(document.body, {childList: true, subtree: true}));
"""  # an upload as soon as the editor's file input exists, before the editor is set up


def test_a_file_given_while_the_editor_starts_is_kept(page_url, driver):
    """A photograph uploaded into the editor as soon as its file input exists (before the editor is set up, and before
    the image the page opens with has loaded) ends up in the editor, with no console error: `app.editor_guard` holds it
    until the editor can take it (without it, Gradio 6.31's editor logged "Cannot read properties of undefined
    (reading 'dimensions')" and lost the file, or replaced it by the opening image)."""
    import base64

    from PIL import Image
    from selenium.webdriver.support.ui import WebDriverWait

    photo = ROOT / "assets" / "examples" / "photos" / "coffee.jpg"
    width = Image.open(photo).width
    holds = ("const e = window.editor; return !!e && !!e.background_image && "
             f"e.background_image.texture.width === {width}")  # the photograph (the opening scene is 168 px wide)
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {
        "source": EARLY_UPLOAD % base64.b64encode(photo.read_bytes()).decode()})
    try:
        driver.get(page_url)
        WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script("return window.hapEarly"))
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})
    assert driver.execute_script("return window.hapEarly") == {"set_up": False}  # the editor was not set up yet
    WebDriverWait(driver, WAIT_S).until(lambda d: error_toasts(d) or d.execute_script(holds))
    assert not error_toasts(driver)
    errors = console_errors(driver)
    assert not errors, errors


def test_example_run_shows_every_panel(page_url, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    open_page(driver, page_url)
    prompt = pick_example(driver, wait, 1)  # the second scene example (the first is the one on arrival)
    press_run(driver, wait)
    until_shown(driver, wait, "conversation", prompt)
    for key in ("unpruned", "pruned", "uniform"):
        until_shown(driver, wait, f"answer-{key}", "visual tokens")
    for tab, names in PLOTS.items():
        show_tab(driver, wait, tab)
        for name in names:
            wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#plot-{name} .js-plotly-plot .main-svg")))
        if tab == "image":
            assert "Group 0" in driver.find_element(By.ID, "explanation").text
    heads = "#plot-head_maps .js-plotly-plot"
    layers = driver.find_elements(By.CSS_SELECTOR, f"{heads} image, {heads} .hm")
    assert layers, "the per-head maps drew no image or heatmap layer"
    truth = driver.find_element(By.ID, "ground-truth").text  # the first example is a scene asked its own question
    assert "Ground truth for" in truth and "Spearman rank correlation of PAQ and grounding" in truth, truth
    outlines = driver.find_elements(By.CSS_SELECTOR, "#plot-head_maps .scatterlayer .trace")
    assert outlines, "the answering patches are not outlined on the per-head maps"
    set_slider(driver, "layer-slider", 3)  # re-draw another layer's heads, and the inspector
    wait.until(EC.text_to_be_present_in_element((By.ID, "plot-head_maps"), "Per-head maps of layer 3"))
    wait.until(EC.text_to_be_present_in_element((By.ID, "inspector-stats"), "Layer 3, head 0"))
    set_slider(driver, "head-slider", 2)  # the head inspector: one head of the stored run
    wait.until(EC.text_to_be_present_in_element((By.ID, "inspector-stats"), "Layer 3, head 2"))
    wait.until(EC.text_to_be_present_in_element((By.ID, "plot-inspector"), "Head inspector: layer 3, head 2"))
    assert "grounding" in driver.find_element(By.ID, "inspector-stats").text
    show_tab(driver, wait, "compare")
    driver.find_element(By.ID, "sweep").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#plot-sweep .js-plotly-plot .main-svg")))
    legend = driver.find_element(By.CSS_SELECTOR, "#plot-sweep .legend").text
    assert all(method in legend for method in ("hap", "uniform", "fastv", "pdrop", "random")), legend
    show_tab(driver, wait, "image")
    ARTIFACTS.mkdir(exist_ok=True)
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(ARTIFACTS / "app.png"))  # what a visitor sees after a Run (the README's docs/app.png)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, height)
    driver.save_screenshot(str(ARTIFACTS / "app-full.png"))  # the first tab's every panel
    errors = console_errors(driver)
    assert not errors, errors


def test_sweep_reads_at_a_glance(page_url, driver):
    """The budget sweep of the issue's example ("how many red objects ?" on a shipped scene): a line per method in the
    legend and the methods x budgets grid of short answers; saves the plot (test-artifacts/sweep.png, committed as
    the README's docs/sweep.png)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from hap.runs.keeps import pruning
    from hap.runs.sweep import ANSWER_WORDS

    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(1400, 1150)
    open_page(driver, page_url)
    pick_example(driver, wait)
    show_tab(driver, wait, "compare")
    prompt = driver.find_element(By.CSS_SELECTOR, "textarea")
    prompt.clear()
    prompt.send_keys("how many red objects ?")
    driver.find_element(By.ID, "sweep").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#plot-sweep .js-plotly-plot .main-svg")))
    plot = driver.find_element(By.ID, "plot-sweep")
    legend = plot.find_element(By.CSS_SELECTOR, ".legend").text
    title = plot.find_element(By.CSS_SELECTOR, ".gtitle").text
    refused = {"cdpruner"}  # the shipped model's tower has no paired CLIP text tower: named in the title, not run
    assert all(method in legend for method in pruning() if method not in refused), legend
    assert all(method not in legend and method in title for method in refused), (legend, title)
    cells = [t.text for t in plot.find_elements(By.CSS_SELECTOR, ".hm text, .heatmaplayer text")]
    assert cells and all(0 < len(c.split()) <= ANSWER_WORDS for c in cells), cells
    ARTIFACTS.mkdir(exist_ok=True)
    driver.execute_script("arguments[0].scrollIntoView()", plot)
    plot.screenshot(str(ARTIFACTS / "sweep.png"))
    errors = console_errors(driver)
    assert not errors, errors


# The "Is PAQ right?" section's screenshots (test-artifacts/causal*.png, committed as the README's docs/causal*.png):
# the first shipped scene asked its own question, and a photograph uploaded into the editor
CAUSAL_SHOTS = [("causal.png", None, "what color is the square ?"),
                ("causal_photo.png", ROOT / "assets" / "examples" / "photos" / "coffee.jpg", "what color is the cup ?")]


def causal_numbers(text: str) -> dict:
    """The section's text: the answer token, its log p, the Spearman with PAQ, each group's kept share and the
    three most important heads."""
    import re

    found = {"answer": re.search(r"first answer token is '([^']*)'", text).group(1),
             "log_prob": float(re.search(r"\(log p (-?\d+\.\d+)\)", text).group(1)),
             "shares": re.search(r"each group keeps: (.*)\.", text).group(1)}
    rho = re.search(r"over the scored heads: (-?\d+\.\d+|undefined)", text).group(1)
    found["rho"] = None if rho == "undefined" else float(rho)
    found["heads"] = re.findall(r"(L\d+h\d+) \(", re.search(r"Most important heads: (.*)", text).group(1))
    return found


def test_causal_section_matches_the_json(page_url, driver):
    """The "Is PAQ right?" section after Run shows the numbers of `/analyze`'s `causal` entry for the same input."""
    import base64

    import numpy as np
    from gradio_client import Client, handle_file
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from app.present import OUTPUTS

    wait = WebDriverWait(driver, WAIT_S)
    client = Client(page_url, verbose=False)
    driver.set_window_size(1400, 1150)
    for name, image, question in CAUSAL_SHOTS:
        open_page(driver, page_url)
        if image is None:
            assert pick_example(driver, wait) == question  # the first scene example
            image = ROOT / "assets" / "examples" / "scene_600000.png"
        else:
            upload(driver, wait, image)
            prompt = driver.find_element(By.CSS_SELECTOR, "textarea")
            prompt.clear()
            prompt.send_keys(question)
        press_run(driver, wait)
        until_shown(driver, wait, "conversation", question)
        width, height = Image.open(image).size  # the editor sends an upload re-encoded as PNG (RGBA)
        assert f"{width} x {height} pixels" in driver.find_element(By.ID, "explanation").text
        show_tab(driver, wait, "check")
        until_shown(driver, wait, "causal-text", "Causal truth")
        until_shown(driver, wait, "utility-text", "Head utility")
        until_shown(driver, wait, "heads-text", "Static or per-image head weights?")
        for plot in ("causal_heads", "causal_scatter", "causal_tokens", "utility_heads", "utility_scatter",
                     "utility_layers", "heads_weights"):
            wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#plot-{plot} .js-plotly-plot .main-svg")))
        shown = causal_numbers(driver.find_element(By.ID, "causal-text").text)
        model = driver.find_element(By.CSS_SELECTOR, "input[aria-label^='Model (loaded']").get_attribute("value")
        out = dict(zip(OUTPUTS, client.predict(image=handle_file(str(image)), prompt=question, model_name=model,
                                               api_name="/analyze")))  # the page's defaults: the API's
        entry = out["summary"]["causal"]
        assert shown["answer"] == entry["answer_text"].strip(), (shown, entry["answer_text"])
        assert shown["log_prob"] == pytest.approx(entry["log_prob"], abs=0.006), (shown, entry["log_prob"])
        rho = entry["paq_spearman"]
        assert shown["rho"] == (None if rho is None else pytest.approx(rho, abs=0.006)), (shown, rho)
        shares = ", ".join(f"group {i} {'-' if s is None else f'{s:.0%}'}"
                           for i, s in enumerate(entry["kept_importance"]))
        assert shown["shares"] == shares, (shown, shares)
        heads = np.asarray(entry["head_importance"])
        top = [f"L{i // heads.shape[1]}h{i % heads.shape[1]}" for i in np.argsort(-heads.ravel())[:3]]
        assert shown["heads"] == top, (shown, top)
        heading = driver.find_element(By.XPATH, "//h2[contains(., 'Is PAQ right?')]")
        useful = out["summary"]["head_utility"]["spearman"]  # the head-utility part: its Spearman as /analyze's
        assert ("undefined" if useful is None else f"{useful:.2f}") in driver.find_element(By.ID, "utility-text").text
        bottom = driver.find_element(By.ID, "plot-heads_weights")  # the section's end: static vs per-image weights
        top, end = (driver.execute_script("const r = arguments[0].getBoundingClientRect(); "
                                          "return [r.top + window.scrollY, r.bottom + window.scrollY]", e)
                    for e in (heading, bottom))
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "clip": {
            "x": 0, "y": top[0] - 16, "width": 1400, "height": end[1] - top[0] + 32, "scale": 1}})
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / name).write_bytes(base64.b64decode(shot["data"]))
    errors = console_errors(driver)
    assert not errors, errors


def click_picture(driver, elem_id: str, x: int, y: int) -> None:
    """Click the picture of the gr.Image `elem_id` at its own pixel (x, y), wherever the page scaled it."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script(f"document.getElementById('{elem_id}').scrollIntoView({{block: 'center'}})")  # lazy img
    img = WebDriverWait(driver, 60).until(lambda d: next(
        (i for i in d.find_elements(By.CSS_SELECTOR, f"#{elem_id} img") if i.get_property("naturalWidth")), None))
    box = driver.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.width, r.height, "
                                "arguments[0].naturalWidth, arguments[0].naturalHeight]", img)
    scale = min(box[0] / box[2], box[1] / box[3], 1)
    dx = (box[0] - box[2] * scale) / 2 + x * scale - box[0] / 2  # from the element's centre (Selenium 4)
    dy = (box[1] - box[3] * scale) / 2 + y * scale - box[1] / 2
    ActionChains(driver).move_to_element_with_offset(img, round(dx), round(dy)).click().perform()


def shoot(driver, first: str, last: str, name: str) -> None:
    """Save test-artifacts/`name`: the page from element `first`'s top to element `last`'s bottom (ids), at the
    window's width."""
    import base64

    top, bottom = (driver.execute_script("const r = document.getElementById(arguments[0]).getBoundingClientRect(); "
                                         "return [r.top + window.scrollY, r.bottom + window.scrollY]", e)
                   for e in (first, last))
    width = driver.execute_script("return document.documentElement.clientWidth")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "clip": {
        "x": 0, "y": top[0] - 16, "width": width, "height": bottom[1] - top[0] + 32, "scale": 1}})
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / name).write_bytes(base64.b64decode(shot["data"]))


def test_the_head_lab_by_clicking(page_url, driver):
    """Click a head on the head picker and a patch on the sink-token picker: the plan box changes; run the plan:
    the lab's results side by side, marked planted; saves test-artifacts/lab.png."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from app.lab_pick import MARGIN, cell_px

    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(NARROW, 1000)  # every figure legible at a 1280-px-wide window
    open_page(driver, page_url)
    show_tab(driver, wait, "lab")
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#lab-heads img")))
    cell = cell_px((6, 8))
    for layer, head in ((0, 1), (1, 5)):
        click_picture(driver, "lab-heads", MARGIN + head * cell + cell // 2, MARGIN + layer * cell + cell // 2)
        wait.until(EC.text_to_be_present_in_element((By.ID, "plant"), f"[{layer}, {head}]"))
    assert '"sink": [[0, 1], [1, 5]]' in driver.find_element(By.ID, "plant").text
    pick_example(driver, wait)
    driver.find_element(By.ID, "lab-run").click()
    until_shown(driver, wait, "lab-answers", "HAP+")
    wait.until(EC.text_to_be_present_in_element((By.ID, "lab"), "recall"))
    for name in ("lab_head_classes", "lab_uniform_vs_paq", "lab_kept_masks"):
        wait.until(EC.text_to_be_present_in_element((By.ID, f"plot-{name}"), "PLANTED"))
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#lab-tokens img")))
    click_picture(driver, "lab-tokens", 5, 5)  # the top-left patch: visual token 0
    wait.until(EC.text_to_be_present_in_element((By.ID, "plant"), '"sink_tokens": [0]'))
    box = driver.find_element(By.CSS_SELECTOR, "#lab-sink-tokens textarea, #lab-sink-tokens input")
    wait.until(lambda d: box.get_attribute("value") == "0")
    shoot(driver, "lab-heads", "plot-lab_kept_masks", "lab.png")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(NARROW, height)
    driver.save_screenshot(str(ARTIFACTS / "lab-full.png"))  # every view of the planted run, at 1280 px
    errors = console_errors(driver)
    assert not errors, errors
