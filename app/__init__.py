"""The Gradio demo of HAP (`app.app.demo`); run it with `python -m app`."""
