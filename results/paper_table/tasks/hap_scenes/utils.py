"""lmms-eval's hooks of the hap_scenes task (written by analysis.paper_table): those of analysis.scene_task."""
from analysis.scene_task import doc_to_text, doc_to_visual, process_results  # noqa: F401
