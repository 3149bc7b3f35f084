"""The HAP demo: `demo` (app/layout.py) with the environment's settings (app/settings.py).

The Space's `app_file`; `python -m app` (or `python app/app.py`) serves it on 127.0.0.1:7860 unless
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT say otherwise. Scripts call it as `/analyze` (app/handler.py).
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if sys.path[:1] != [ROOT]:  # run as a file (a Space's app_file): the repo first, so `app` is this package
    sys.path.insert(0, ROOT)

from app.layout import build_demo  # noqa: E402
from app.settings import launch_options  # noqa: E402
from hap.methods import load_plugins  # noqa: E402

load_plugins()  # the pruners named in HAP_PRUNERS join the page's method list, /analyze, /sweep and the keeps view
demo = build_demo()


def main() -> None:
    """Serve the demo with the upload limit it enforces."""
    demo.launch(**launch_options(demo.hap_handler.settings.limits))


if __name__ == "__main__":
    main()
