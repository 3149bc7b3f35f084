"""The editor and the conversation in headless Chromium: run an example, ask a follow-up, pick the first turn again,
paint over the image and re-run, and see the before/after comparison; screenshots test-artifacts/conversation.png
and test-artifacts/edit.png (committed as the README's docs/conversation.png and docs/edit.png)."""

from __future__ import annotations

import pytest
from test_browser import (ARTIFACTS, WAIT_S, console_errors, driver, fresh_log, open_page,  # noqa: F401 (fixtures)
                          page_url, pick_example, press_run, show_tab, until_shown)

pytestmark = pytest.mark.browser

FOLLOW_UP = "what color is the dot ?"  # a kind the shipped model answers as a second turn


def show(driver, elem_id: str) -> None:
    driver.execute_script(f"document.getElementById('{elem_id}').scrollIntoView({{block: 'start'}})")


def paint(driver) -> None:
    """Two brush strokes across the editor's canvas (the brush is the editor's tool after an upload)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = driver.find_elements(By.CSS_SELECTOR, "#image-editor canvas")[-1]
    for dy in (-30, 10):
        ActionChains(driver).move_to_element_with_offset(canvas, -80, dy).click_and_hold().move_by_offset(
            60, 0).move_by_offset(60, 0).move_by_offset(40, 0).release().perform()


def test_follow_up_then_edit_and_rerun(page_url, driver):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(1400, 1150)
    open_page(driver, page_url)
    pick_example(driver, wait)
    press_run(driver, wait)
    until_shown(driver, wait, "conversation", "turn 1")
    prompt = driver.find_element(By.CSS_SELECTOR, "textarea")
    prompt.clear()
    prompt.send_keys(FOLLOW_UP)
    driver.find_element(By.ID, "follow-up").click()
    until_shown(driver, wait, "conversation", f"turn 2: {FOLLOW_UP}")
    wait.until(EC.text_to_be_present_in_element((By.ID, "explanation"), "Follow-up after 1 earlier turn"))
    assert "since turn 1: group 0" in driver.find_element(By.ID, "conversation").text
    ARTIFACTS.mkdir(exist_ok=True)
    show(driver, "answer-pruned")
    driver.save_screenshot(str(ARTIFACTS / "conversation.png"))
    driver.find_element(By.CSS_SELECTOR, "#turn input[value='turn 1']").click()  # every view shows turn 1 again
    wait.until(lambda d: "Follow-up" not in d.find_element(By.ID, "explanation").text)
    assert "turn 2" in driver.find_element(By.ID, "conversation").text  # the conversation stays
    show(driver, "image-editor")
    paint(driver)
    driver.find_element(By.ID, "run").click()  # a new conversation on the edited image
    until_shown(driver, wait, "edit-diff", "Answer on the original")
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#plot-edit_diff .js-plotly-plot .main-svg")))
    show_tab(driver, wait, "check")
    assert "edited in the editor" in driver.find_element(By.ID, "ground-truth").text
    show_tab(driver, wait, "image")
    assert "turn 2" not in driver.find_element(By.ID, "conversation").text
    show(driver, "edit-diff")
    driver.execute_script("window.scrollBy(0, -120)")
    driver.save_screenshot(str(ARTIFACTS / "edit.png"))
    errors = console_errors(driver)
    assert not errors, errors
