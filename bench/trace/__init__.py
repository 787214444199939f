"""Traced memory: a real training step of a stack on fake tensors, counted by torch's MemTracker."""
