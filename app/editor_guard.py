"""A file given to the image editor while it starts is held until the editor can take it, then handed over.

Gradio 6.31's ImageEditor handles a file (an upload through its file input, a drop) at once, whether or not it is set
up: before both its canvases are (the toolbar is drawn once they are), its image tool has no context, and the upload
fails with "Uncaught TypeError: Cannot read properties of undefined (reading 'dimensions')" (and '... reading
reset_layers'), the file lost; after that but before the image the page opens with (`app.arrival`) has loaded, the
upload is shown and then replaced by that image. Both were reproduced here by uploading as soon as the editor's file
input exists. `HEAD`, a script in the page's head (`app.settings.launch_options`), catches such a file in the capture
phase while the editor is starting and hands it over (through the editor's file input, as an upload) once the toolbar is drawn and
the opening image is in (its background and composite, each added once: two AddImage commands). After that it never
steps in again.
"""

SCRIPT = """
(() => {
  const ROOT = "image-editor";
  let done = false, held = [];
  const opening = () => {  /* the editor's value when the page was built: an image to load first */
    const found = (window.gradio_config?.components || []).find(c => c.props?.elem_id === ROOT);
    const value = found?.props?.value;
    return !!(value && (value.background || value.composite));
  };
  const adds = editor => {
    let node = editor.command_manager.history, count = 0;
    for (; node; node = node.previous) count += node.command?.name === "AddImage" ? 1 : 0;
    return count;
  };
  const ready = () => {
    const root = document.getElementById(ROOT), editor = window.editor;
    if (!root || !editor || !root.querySelector(".toolbar-wrap")) return false;
    return !opening() || adds(editor) >= 2;
  };
  const hand = files => {  /* as an upload through the editor's file input (the one there now) */
    const input = document.querySelector("#" + ROOT + " input[type=file]"), data = new DataTransfer();
    files.forEach(file => data.items.add(file));
    input.files = data.files;
    input.dispatchEvent(new Event("change", {bubbles: true}));
  };
  const release = () => {
    if (!ready()) { setTimeout(release, 50); return; }
    done = true;
    held.forEach(hand);
    held = [];
  };
  const hold = event => {
    if (done || !event.target?.closest?.("#" + ROOT)) return;
    if (ready()) { done = true; return; }
    const files = Array.from((event.type === "change" ? event.target.files : event.dataTransfer?.files) || []);
    if (!files.length) return;
    event.stopImmediatePropagation();
    event.preventDefault();
    held = [files];  /* the last one given wins, as in the editor */
    release();
  };
  document.addEventListener("change", hold, true);
  document.addEventListener("drop", hold, true);
})();
"""
HEAD = f"<script>{SCRIPT}</script>"
