"""One training run: the loop and its guards (checkpoints, resume, NaN, OOM ladder, preemption, the
run-dir lock), the trainer arguments, memory tracking, the LR schedule, multi-rank strategies."""
