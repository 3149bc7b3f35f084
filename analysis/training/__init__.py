"""The small default model's training research (`assets/tiny-llava` and its model card): the model, tokenizer and
processor built offline (`tiny_vlm`), the two-stage VLM training (`train_model`), the decoder's text pretraining
(`pretrain_text`) and the per-checkpoint head diagnostics (`diagnostics`). The app and `hap` never import it; the
tests and the GPU check borrow `tiny_vlm`'s offline tokenizer for their random-weight models."""
