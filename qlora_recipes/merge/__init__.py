"""After training: merge a run's adapter into its base and save a standalone model, then measure the merge.

The rooms, in the order a merge runs (`pipeline.merge` drives them; scripts/merge.py calls it):

- `dequantize`: the fp32 weight of a bitsandbytes 4-bit / int8 layer, or of a 4-bit MoE expert weight
  (`model/moe_experts.py`), by bitsandbytes' own functional dequantize.
- `tensors`: the LoRA update (peft's `get_delta_weight`; DoRA's row rescaling as peft merges it) added
  into each targeted weight, streamed module by module. Default: into the DEQUANTIZED base the adapter
  was trained against, loaded exactly as the run loaded it, everything else (embeddings, norms,
  lm_head, modules_to_save) taken from the loaded stack, so the merged model is the trained model
  without the 4-bit packing. `from_original=True`: into the original 16-bit weights of
  `model.name_or_path`, read tensor by tensor from its safetensors files; the result then differs
  from what was trained by the base's quantization error.
- `export`: the tensors put back in the base checkpoint's layout (experts transformers fused while
  loading are written per expert again), shards written as they fill (CPU memory stays near one shard
  plus the 4-bit stack, which the run itself needed), config.json without quantization, the tokenizer;
  all into `<out>.partial`, renamed at the end, so a failed merge leaves no half model.
- `progress`: decoder layers merged and shards written, on stderr (a tqdm bar; plain lines in a log).
- `quality`: the merged model's logits (plain transformers) against the base + adapter forward on a
  few prompts of the run's eval data; `quality_line` for the terminal.
- `pipeline`: `merge(run_dir, ...) -> report`, the whole step, and `merge_report.json`.

The run dir itself is read by `qlora_recipes.outputs.rundir`; prompts are formatted by `qlora_recipes.outputs.prompts`.
"""
