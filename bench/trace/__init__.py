"""Traced memory: a real training step of a stack on fake tensors, counted by torch's MemTracker.

`python -m bench trace` (cli). A traced process is a child of its own (child): it registers a fake
CUDA device in a CPU-only torch (fakecuda), builds the stack's model on fake tensors the way the
loader does and prepares it with the run's own code (model), restates the GPU's kernel choices a CPU
build lacks (kernels), runs two optimizer steps of the trainer's loop (step) and counts live tensor
bytes by plan component, phase and module (tracker). run: children, layer slices scaled to the whole
model, the plan beside; suite: every single-GPU recipe and lean option -> bench/results/planner-traced;
cpu_check: the tracer against a real CPU step. This file imports nothing: the child must register the
fake device before torch is imported.
"""
