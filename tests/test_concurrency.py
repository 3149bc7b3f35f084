"""20 clients submit to `/analyze` at once on loopback, each with its own gradio_client.Client.

Every response must be the correct result (equal to the same request run alone: kept indices, head
classes, the three answers) or gradio's clean busy message; with a queue smaller than the burst some
are turned away, with a larger one all are served, one at a time through the single model lane. The
test stops by itself: each thread has a deadline and is a daemon.
"""

from __future__ import annotations

import threading
import time

import pytest
from app_model import ROOT, default_model, free_port
from gradio_client import Client, handle_file
from gradio_client.utils import QueueError

from app.present import OUTPUTS

pytestmark = pytest.mark.slow

CLIENTS = 20
DEADLINE_S = 240  # the whole burst; a thread still waiting then is reported as hung
BUSY = "Queue is full! Please try again."  # what gradio_client raises (QueueError) when the queue is full
SETTINGS = dict(method="hap", retain=0.2, groups=3, first_layers=0, decay=0.5, temperature=0.1, tau_sink=0.5,
                tau_disp=0.9, sink_rho=10.0, rows="prompt")
VARIANTS = [  # different images, prompts and settings, so a leak from one request into the next would show
    dict(image="scene_600000.png", prompt="what color is the triangle ?"),
    dict(image="scene_600001.png", prompt="is there a red circle ?", method="fastv", retain=0.3),
    dict(image="scene_600002.png", prompt="what shape is blue ?", method="random"),
    dict(image="scene_600003.png", prompt="what color is the square ?", rows="last", temperature=0.5),
    dict(image="scene_600004.png", prompt="how many shapes are there ?", method="pdrop", retain=0.15),
]
COUNTS = {"served": 0, "busy": 0, "failed": 0}  # over both queue sizes, for the report
SUMMARY, EXPLANATION = (OUTPUTS.index(name) for name in ("summary", "explanation"))  # positions in a reply


def request(client: Client, model: str, variant: dict, timeout: float):
    v = {**SETTINGS, **variant}
    image = handle_file(str(ROOT / "assets" / "examples" / v.pop("image")))
    prompt = v.pop("prompt")
    job = client.submit(image=image, prompt=prompt, model_name=model, **v, api_name="/analyze")
    return job.result(timeout=timeout)


def fingerprint(out) -> tuple:
    data = out[SUMMARY]
    return ([g["kept"] for g in data["groups"]], data["head_class"],
            *(data["runs"][k]["answer"] for k in ("unpruned", "pruned", "uniform")))


@pytest.fixture(scope="module")
def model_name(tmp_path_factory):
    return default_model(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module", params=[4, 32], ids=["queue-4", "queue-32"])
def server(request, model_name):
    from app.app import build_demo, launch_options

    demo = build_demo([model_name], queue_size=request.param)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **launch_options())
    yield url, request.param
    demo.close()


def test_twenty_clients_at_once_get_their_own_result_or_a_clean_busy_message(server, model_name):
    url, queue_size = server
    alone = Client(url, verbose=False)
    expected = [fingerprint(request(alone, model_name, v, timeout=60)) for v in VARIANTS]  # sequential, one by one
    assert len(set(map(repr, expected))) == len(VARIANTS)

    results: list[tuple[str, object] | None] = [None] * CLIENTS
    ready = threading.Barrier(CLIENTS, timeout=120)
    deadline = time.monotonic() + DEADLINE_S

    def one(i: int) -> None:
        client = None
        try:
            client = Client(url, verbose=False)
            ready.wait()  # all clients connected: submit together
            out = request(client, model_name, VARIANTS[i % len(VARIANTS)], timeout=max(1, deadline - time.monotonic()))
            results[i] = ("ok", fingerprint(out))
        except QueueError as err:
            results[i] = ("busy", str(err))
        except Exception as err:  # noqa: BLE001 - recorded and asserted below
            results[i] = ("error", f"{type(err).__name__}: {err}")
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0, deadline - time.monotonic()))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"clients {hung} had no answer within {DEADLINE_S} s"

    served = [i for i, r in enumerate(results) if r[0] == "ok"]
    busy = [i for i, r in enumerate(results) if r[0] == "busy"]
    errors = {i: r for i, r in enumerate(results) if r[0] == "error"}
    COUNTS["served"] += len(served)
    COUNTS["busy"] += len(busy)
    COUNTS["failed"] += len(errors)
    print(f"queue {queue_size}: {len(served)} served, {len(busy)} busy, {len(errors)} errors")
    assert not errors, errors
    for i in served:
        assert results[i][1] == expected[i % len(VARIANTS)], f"client {i}: result differs from the request run alone"
    assert all(results[i][1] == BUSY for i in busy)
    if queue_size >= CLIENTS:
        assert len(served) == CLIENTS
    else:
        assert busy and len(served) >= queue_size  # the queue was full, and what it held was served

    for v, e in zip(VARIANTS, expected):  # afterwards: the server answers, still the same results
        assert fingerprint(request(alone, model_name, v, timeout=60)) == e
    alone.close()
